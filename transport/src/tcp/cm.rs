//! Connection management for the tcp provider: a listener and `connect()` with private data,
//! shaped like rdma_cm's listen / connect / accept / reject.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};

use crate::cm::MAX_PRIVATE_DATA;
use crate::nic::backlog::{Acceptor, Backlog, Handshake};
use crate::nic::{random_u32, Qp};
use crate::{Error, QpOptions, Result};

const MAGIC: &[u8; 8] = b"RDRPCTCP";
/// The wire format's version: 2 since read responses go in parts (`READ_PART`), 3 since idle
/// links beat (`BEAT`).
const VERSION: u16 = 3;

/// A listening socket for incoming queue-pair connections. It and the handshakes in progress
/// are tasks on the device's progress engine ([`Backlog`]), so a slow or silent client never
/// holds up the others, and `accept`'s timeout only bounds the wait for a request.
pub(crate) struct Listener {
    addr: SocketAddr,
    backlog: Arc<Backlog<Request>>,
}

/// A connection request waiting to be accepted or rejected.
pub(crate) struct Request {
    stream: TcpStream,
    pub(crate) private_data: Vec<u8>,
    pub(crate) peer: SocketAddr,
}

impl Listener {
    pub(crate) fn bind(device: &crate::Device, addr: SocketAddr) -> Result<Self> {
        let socket = Arc::new(TcpListener::bind(addr).map_err(|e| Error::io("binding the listener", e))?);
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the listener", e))?;
        let addr = socket
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))?;
        let s = socket.clone();
        let how = Acceptor {
            accept: Box::new(move || match s.accept() {
                Ok(c) => Some(Ok(c)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                Err(e) => Some(Err(e)),
            }),
            begin: Box::new(|(stream, peer)| Box::new(Hello::new(stream, peer, false)) as Box<dyn Handshake<Request>>),
            // Its hello first: closing a TCP socket with unread bytes resets the connection,
            // which could discard the refusal before the peer reads it.
            refuse: Box::new(|(stream, peer)| {
                Some(Box::new(Hello::new(stream, peer, true)) as Box<dyn Handshake<Request>>)
            }),
        };
        let backlog = Backlog::start(device, socket.as_fd(), how)?;
        Ok(Self { addr, backlog })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Off the progress engine before the socket closes.
        self.backlog.close();
    }
}

/// A client's hello as it comes, read without waiting (the backlog bounds it by
/// `backlog::HANDSHAKE`, however slowly its bytes come).
struct Hello {
    stream: Option<TcpStream>,
    peer: SocketAddr,
    buf: Vec<u8>,
    /// Out of descriptors: the hello is read only to refuse it.
    refusing: bool,
}

impl Hello {
    fn new(stream: TcpStream, peer: SocketAddr, refusing: bool) -> Hello {
        Hello {
            stream: Some(stream),
            peer,
            buf: Vec::with_capacity(64),
            refusing,
        }
    }
}

impl Handshake<Request> for Hello {
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.stream.as_ref().map(|s| s.as_fd())
    }

    fn step(&mut self) -> Result<Option<Request>> {
        let Some(stream) = &self.stream else {
            return Err(Error::Protocol("handshake already taken".into()));
        };
        // Exactly the hello's bytes: what follows it belongs to the queue pair's engine.
        loop {
            let want = match self.buf.len() {
                n if n < 9 => 9 - n,
                n => 9 + usize::from(self.buf[8]) - n,
            };
            if want == 0 {
                break;
            }
            let mut chunk = vec![0u8; want];
            match rustix::net::recv(stream, &mut chunk, rustix::net::RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(Error::Protocol("the client closed during its handshake".into())),
                Ok((n, _)) => self.buf.extend_from_slice(&chunk[..n]),
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return Ok(None),
                Err(e) => return Err(Error::io("reading the handshake", e.into())),
            }
            if self.buf.len() >= 8 && &self.buf[..8] != MAGIC {
                return Err(Error::Protocol("not an rdma-rpc tcp peer (bad magic)".into()));
            }
        }
        if self.refusing {
            refuse(stream, crate::nic::backlog::OUT_OF_FDS.as_bytes());
            return Err(Error::Protocol("refused: out of file descriptors".into()));
        }
        let hello = self.buf.split_off(9);
        let mut r = hello.as_slice();
        let (stream, peer) = match self.stream.take() {
            Some(s) => (s, self.peer),
            None => return Err(Error::Protocol("handshake already taken".into())),
        };
        handshake(stream, peer, &mut r).map(Some)
    }
}

fn handshake(stream: TcpStream, peer: SocketAddr, r: &mut &[u8]) -> Result<Request> {
    let version = take::<2>(r).map(u16::from_le_bytes)?;
    if version != VERSION {
        // Refused by name: the peer learns which version this side speaks (a reply of kind
        // `REFUSED_VERSION`; builds from before it only see a malformed reply).
        let mut reply = vec![REFUSED_VERSION];
        reply.extend_from_slice(&VERSION.to_le_bytes());
        let _ = write_msg(&mut &stream, &reply);
        let e = version_mismatch(version);
        tracing::warn!(%peer, %e, "refused a connection");
        return Err(e);
    }
    Ok(Request {
        stream,
        private_data: r.to_vec(),
        peer,
    })
}

/// A connection reply: the listener speaks another wire version, which follows (2 bytes).
const REFUSED_VERSION: u8 = 2;

fn version_mismatch(theirs: u16) -> Error {
    Error::Protocol(format!(
        "the peer speaks tcp wire version {theirs}, this build speaks {VERSION}: \
         run the same rdma-rpc-transport release on both ends"
    ))
}

/// Reads from a socket that must deliver by a deadline: each read waits at most what is left,
/// so a peer that trickles a byte at a time cannot stretch the wait.
struct Before<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for Before<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// The last step of connection set-up, taken once the new QP has its receives posted.
pub(crate) enum Pending {
    /// Accepting: the reply to send.
    Reply(TcpStream),
    /// Connecting: already done, with the peer's private data.
    Done(Vec<u8>),
}

impl Pending {
    /// Refuses the peer instead of finishing (the accepting side's set-up failed).
    pub(crate) fn refuse(self, reason: &[u8]) {
        if let Pending::Reply(stream) = self {
            refuse(&stream, reason);
        }
    }

    pub(crate) fn finish(self, private_data: &[u8]) -> Result<Vec<u8>> {
        match self {
            Pending::Reply(stream) => {
                let mut reply = vec![1u8];
                reply.extend_from_slice(private_data);
                write_msg(&mut &stream, &reply)?;
                Ok(Vec::new())
            }
            Pending::Done(data) => Ok(data),
        }
    }
}

impl Request {
    /// Starts the QP's engine; the reply goes out with [`Pending::finish`], after the caller
    /// posted its first receives, so the peer's first Send always finds one.
    /// When this fails the peer is refused, with the error as the reason.
    pub(crate) fn accept(self, opts: &QpOptions) -> Result<(Qp, u32, Pending)> {
        let qp_num = random_u32();
        let reply = match self.stream.try_clone() {
            Ok(r) => r,
            Err(e) => {
                let e = Error::io("cloning the socket", e);
                refuse(&self.stream, &crate::cm::set_up_reason(&e));
                return Err(e);
            }
        };
        match start(self.stream, opts, qp_num) {
            Ok((qp, n)) => Ok((qp, n, Pending::Reply(reply))),
            Err(e) => {
                refuse(&reply, &crate::cm::set_up_reason(&e));
                Err(e)
            }
        }
    }

    pub(crate) fn reject(self, reason: &[u8]) {
        refuse(&self.stream, reason);
    }
}

/// The refusal, with its reason (an empty one for none): `[0][reason]`.
fn refuse(stream: &TcpStream, reason: &[u8]) {
    let mut m = vec![0u8];
    m.extend_from_slice(reason);
    let _ = write_msg(&mut &*stream, &m);
}

pub(crate) fn connect(
    addr: impl ToSocketAddrs,
    opts: &QpOptions,
    private_data: &[u8],
    timeout: Duration,
) -> Result<(Qp, u32, Pending)> {
    let addr = addr
        .to_socket_addrs()
        .map_err(|e| Error::io("resolving the address", e))?
        .next()
        .ok_or_else(|| Error::InvalidArgument("address resolves to nothing".into()))?;
    // The connect and the whole reply within `timeout`.
    let deadline = Instant::now() + timeout;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| Error::connecting(addr, "tcp", e))?;
    let mut hello = VERSION.to_le_bytes().to_vec();
    hello.extend_from_slice(private_data);
    write_msg(&mut &stream, &hello)?;
    let reply = read_msg(&mut Before {
        stream: &stream,
        deadline,
    })?;
    match reply.split_first() {
        Some((1, data)) => {
            let data = data.to_vec();
            let qp_num = random_u32();
            let (qp, n) = start(stream, opts, qp_num)?;
            Ok((qp, n, Pending::Done(data)))
        }
        Some((0, reason)) => Err(crate::cm::rejected(reason)),
        Some((&REFUSED_VERSION, v)) => match v.try_into() {
            Ok(v) => Err(version_mismatch(u16::from_le_bytes(v))),
            Err(_) => Err(Error::Protocol("malformed connection reply".into())),
        },
        _ => Err(Error::Protocol("malformed connection reply".into())),
    }
}

fn start(stream: TcpStream, opts: &QpOptions, qp_num: u32) -> Result<(Qp, u32)> {
    let cfg = |e| Error::io("configuring the QP socket", e);
    stream.set_read_timeout(None).map_err(cfg)?;
    stream.set_nodelay(true).map_err(cfg)?;
    let sock = SockRef::from(&stream);
    // A silent peer (host gone, link cut) must become an error, not a hang: keepalive probes
    // when idle, and a bound on unacknowledged data when not.
    let ka = TcpKeepalive::new()
        .with_time(Duration::from_secs(2))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    sock.set_tcp_keepalive(&ka).map_err(cfg)?;
    sock.set_tcp_user_timeout(Some(Duration::from_secs(5))).map_err(cfg)?;
    let qp = Qp::start(Arc::new(super::link::TcpLink::new(stream)), qp_num, opts, None)?;
    Ok((qp, qp_num))
}

fn write_msg(w: &mut impl Write, payload: &[u8]) -> Result<()> {
    // A hello or an accept (a version or a kind byte, then private data), or a refusal and its
    // reason; the length goes in one byte.
    if payload.len() > (MAX_PRIVATE_DATA + 2).max(1 + crate::cm::MAX_REJECT_REASON) {
        return Err(Error::PrivateDataTooLong {
            len: payload.len(),
            max: MAX_PRIVATE_DATA,
        });
    }
    let mut m = MAGIC.to_vec();
    m.push(payload.len() as u8);
    m.extend_from_slice(payload);
    w.write_all(&m).map_err(|e| Error::io("sending the handshake", e))
}

fn read_msg(r: &mut impl Read) -> Result<Vec<u8>> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(crate::cm::NO_HANDSHAKE),
        _ => Error::io("reading the handshake", e),
    })?;
    if &head[..8] != MAGIC {
        return Err(Error::Protocol("not an rdma-rpc tcp peer (bad magic)".into()));
    }
    let mut payload = vec![0u8; usize::from(head[8])];
    r.read_exact(&mut payload).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(crate::cm::NO_HANDSHAKE),
        _ => Error::io("reading the handshake", e),
    })?;
    Ok(payload)
}

fn take<const N: usize>(r: &mut &[u8]) -> Result<[u8; N]> {
    let (h, rest) = r
        .split_first_chunk::<N>()
        .ok_or_else(|| Error::Protocol("handshake truncated".into()))?;
    *r = rest;
    Ok(*h)
}

impl crate::provider::ListenerOps for Listener {
    fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.addr)
    }

    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn crate::provider::RequestOps>> {
        Ok(Box::new(self.backlog.accept(timeout)?))
    }
}

impl crate::provider::RequestOps for Request {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    fn peer(&self) -> Option<SocketAddr> {
        Some(self.peer)
    }

    fn accept(self: Box<Self>, opts: &QpOptions) -> Result<crate::provider::Connected> {
        let (qp, qp_num, pending) = Request::accept(*self, opts)?;
        Ok(crate::provider::Connected {
            qp: Box::new(qp),
            qp_num,
            pending: Box::new(pending),
        })
    }

    fn reject(self: Box<Self>, reason: &[u8]) {
        Request::reject(*self, reason);
    }
}

impl crate::provider::PendingOps for Pending {
    fn refuse(self: Box<Self>, reason: &[u8]) {
        Pending::refuse(*self, reason);
    }

    fn finish(self: Box<Self>, private_data: &[u8]) -> Result<Vec<u8>> {
        Pending::finish(*self, private_data)
    }
}
