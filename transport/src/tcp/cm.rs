//! Connection management for the tcp provider: a listener and `connect()` with private data,
//! shaped like rdma_cm's listen / connect / accept / reject.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};

use super::{random_u32, Qp};
use crate::cm::MAX_PRIVATE_DATA;
use crate::cq::CqImpl;
use crate::{Error, QpOptions, Result};

const MAGIC: &[u8; 8] = b"RDRPCTCP";
const VERSION: u16 = 1;

/// A listening socket for incoming queue-pair connections.
pub(crate) struct Listener {
    inner: TcpListener,
}

/// A connection request waiting to be accepted or rejected.
pub(crate) struct Request {
    stream: TcpStream,
    pub(crate) private_data: Vec<u8>,
    pub(crate) peer: SocketAddr,
}

impl Listener {
    pub(crate) fn bind(addr: SocketAddr) -> Result<Self> {
        let inner = TcpListener::bind(addr).map_err(|e| Error::io("binding the listener", e))?;
        Ok(Self { inner })
    }

    pub(crate) fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("reading the listener address", e))
    }

    pub(crate) fn accept(&self, timeout: Option<Duration>) -> Result<Request> {
        let (stream, peer) = match timeout {
            None => self
                .inner
                .accept()
                .map_err(|e| Error::io("accepting a connection", e))?,
            Some(t) => accept_within(&self.inner, t)?,
        };
        stream
            .set_read_timeout(Some(timeout.unwrap_or(HANDSHAKE)))
            .map_err(|e| Error::io("setting a handshake timeout", e))?;
        let hello = read_msg(&mut &stream)?;
        let mut r = hello.as_slice();
        let version = take::<2>(&mut r).map(u16::from_le_bytes)?;
        if version != VERSION {
            return Err(Error::Protocol(format!(
                "peer speaks version {version}, we speak {VERSION}"
            )));
        }
        Ok(Request {
            stream,
            private_data: r.to_vec(),
            peer,
        })
    }
}

/// Longest wait for the other side's half of a handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Waits up to `t` for a connection: SO_RCVTIMEO bounds a blocking accept on Linux, so no
/// polling loop burns CPU while the listener is idle.
fn accept_within(l: &TcpListener, t: Duration) -> Result<(TcpStream, SocketAddr)> {
    let sock = SockRef::from(l);
    sock.set_read_timeout(Some(t.max(Duration::from_millis(1))))
        .map_err(|e| Error::io("setting the accept timeout", e))?;
    let res = l.accept();
    let _ = sock.set_read_timeout(None);
    match res {
        Ok(x) => Ok(x),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            Err(Error::Timeout("waiting for a connection"))
        }
        Err(e) => Err(Error::io("accepting a connection", e)),
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
    pub(crate) fn accept(self, opts: &QpOptions) -> Result<(Qp, u32, Pending)> {
        let qp_num = random_u32();
        let reply = self
            .stream
            .try_clone()
            .map_err(|e| Error::io("cloning the socket", e))?;
        let (qp, n) = start(self.stream, opts, qp_num)?;
        Ok((qp, n, Pending::Reply(reply)))
    }

    pub(crate) fn reject(self) {
        let _ = write_msg(&mut &self.stream, &[0u8]);
    }
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
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| Error::io("connecting", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| Error::io("setting a handshake timeout", e))?;
    let mut hello = VERSION.to_le_bytes().to_vec();
    hello.extend_from_slice(private_data);
    write_msg(&mut &stream, &hello)?;
    let reply = read_msg(&mut &stream)?;
    match reply.split_first() {
        Some((1, data)) => {
            let data = data.to_vec();
            let qp_num = random_u32();
            let (qp, n) = start(stream, opts, qp_num)?;
            Ok((qp, n, Pending::Done(data)))
        }
        Some((0, _)) => Err(Error::Rejected),
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
    let cq = |c: &crate::CompletionQueue| match &c.inner.imp {
        CqImpl::Tcp(cq) => Ok(Arc::clone(cq)),
        #[allow(unreachable_patterns)]
        _ => Err(Error::InvalidArgument("a tcp QP needs tcp CQs".into())),
    };
    let qp = Qp::start(
        stream,
        qp_num,
        opts.pd.inner.clone(),
        cq(&opts.send_cq)?,
        cq(&opts.recv_cq)?,
    )?;
    Ok((qp, qp_num))
}

fn write_msg(w: &mut impl Write, payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_PRIVATE_DATA + 2 {
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
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout("waiting for the handshake"),
        _ => Error::io("reading the handshake", e),
    })?;
    if &head[..8] != MAGIC {
        return Err(Error::Protocol("not an rdma-rpc tcp peer (bad magic)".into()));
    }
    let mut payload = vec![0u8; usize::from(head[8])];
    r.read_exact(&mut payload)
        .map_err(|e| Error::io("reading the handshake", e))?;
    Ok(payload)
}

fn take<const N: usize>(r: &mut &[u8]) -> Result<[u8; N]> {
    let (h, rest) = r
        .split_first_chunk::<N>()
        .ok_or_else(|| Error::Protocol("handshake truncated".into()))?;
    *r = rest;
    Ok(*h)
}
