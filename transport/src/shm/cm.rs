//! Connection set-up for the shm provider, shaped like the tcp provider's: a listener on an
//! abstract Unix socket named after the `SocketAddr` it is given (`rdma-rpc-shm:<ip>:<port>`,
//! so the same addresses work on every provider; port 0 picks a free one), a handshake carrying
//! the private data and, as descriptors, each side's arena and inbox ring.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::arena::{Arena, PeerArena};
use super::link::ShmLink;
use super::ring::{self, Ring};
use super::rq::{self, OwnRq, PeerRq};
use super::sys::{self, Mapping};
use super::Peer;
use crate::backlog::Backlog;
use crate::cm::MAX_PRIVATE_DATA;
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"RDRPCSHM";
/// 2: a fourth descriptor, the receive CQ's doorbell; the receive queue's `armed` word.
/// 3: receive entries carry the head of each message (`Completion::head`), fields narrowed.
/// 4: read responses sent as frames go in parts (the tcp wire's `READ_PART`).
const VERSION: u16 = 4;
const HANDSHAKE: Duration = Duration::from_secs(10);

fn name(addr: SocketAddr) -> Result<UnixAddr> {
    UnixAddr::from_abstract_name(format!("rdma-rpc-shm:{addr}")).map_err(|e| Error::io("naming the shm endpoint", e))
}

/// What one side brings to a connection.
pub(crate) struct Side {
    pub(crate) arena: Arc<Arena>,
    pub(crate) inbox_fd: OwnedFd,
    pub(crate) inbox: Arc<Mapping>,
    rq_fd: OwnedFd,
    rq: Option<OwnRq>,
    /// The receive CQ's doorbell, for the peer to ring after delivering into our receives.
    bell_fd: OwnedFd,
}

/// A connection's pieces, once both sides' descriptors are in.
pub(crate) struct Joined {
    pub(crate) link: Arc<ShmLink>,
    pub(crate) peer: Arc<Peer>,
    pub(crate) own_rq: OwnRq,
}

impl Side {
    pub(crate) fn new(arena: Arc<Arena>, max_recv_wr: u32, bell_fd: OwnedFd) -> Result<Side> {
        let fd =
            sys::sealed_memfd("rdma-rpc-shm-ring", ring::BYTES as u64).map_err(|e| Error::io("creating a ring", e))?;
        let inbox = Arc::new(Mapping::map(&fd, ring::BYTES).map_err(|e| Error::io("mapping a ring", e))?);
        let (rq_fd, rq) = OwnRq::create(rq::capacity(max_recv_wr))?;
        Ok(Side {
            arena,
            inbox_fd: fd,
            inbox,
            rq_fd,
            rq: Some(rq),
            bell_fd,
        })
    }

    fn fds(&self) -> [std::os::fd::RawFd; 4] {
        [
            self.arena.fd.as_raw_fd(),
            self.inbox_fd.as_raw_fd(),
            self.rq_fd.as_raw_fd(),
            self.bell_fd.as_raw_fd(),
        ]
    }

    /// The link, the peer's memory and receive queue, from the peer's descriptors. Our
    /// descriptors stay with `self` until they were sent.
    fn join(&mut self, sock: UnixStream, peer_fds: Vec<OwnedFd>) -> Result<Joined> {
        let [arena_fd, inbox_fd, rq_fd, bell]: [OwnedFd; 4] = peer_fds
            .try_into()
            .map_err(|_| Error::Protocol("the peer sent the wrong descriptors".into()))?;
        let arena = PeerArena::map(&arena_fd)?;
        let peer_rq = PeerRq::map(&rq_fd)?;
        let size = sys::sealed_size(&inbox_fd).map_err(|e| Error::io("checking the peer's ring", e))?;
        if size < ring::BYTES as u64 {
            return Err(Error::Protocol("the peer's ring is too small".into()));
        }
        let tx_map =
            Arc::new(Mapping::map(&inbox_fd, ring::BYTES).map_err(|e| Error::io("mapping the peer's ring", e))?);
        let dead = Arc::new(AtomicBool::new(false));
        let rx = Ring::new(self.inbox.clone(), dead.clone()).ok_or_else(|| Error::Protocol("ring".into()))?;
        let tx = Ring::new(tx_map, dead.clone()).ok_or_else(|| Error::Protocol("ring".into()))?;
        let link = ShmLink::new(rx, tx, sock, dead).map_err(|e| Error::io("starting the shm watcher", e))?;
        let own_rq = self
            .rq
            .take()
            .ok_or_else(|| Error::Protocol("side joined twice".into()))?;
        Ok(Joined {
            link,
            peer: Arc::new(Peer {
                arena,
                rq: peer_rq,
                bell,
            }),
            own_rq,
        })
    }
}

fn hello(private_data: &[u8]) -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    m.extend_from_slice(&VERSION.to_le_bytes());
    m.extend_from_slice(private_data);
    m
}

fn parse_hello(m: &[u8]) -> Result<Vec<u8>> {
    if m.len() < 10 || &m[..8] != MAGIC {
        return Err(Error::Protocol("not an rdma-rpc shm peer (bad magic)".into()));
    }
    let v = u16::from_le_bytes([m[8], m[9]]);
    if v != VERSION {
        return Err(Error::Protocol(format!(
            "peer speaks shm version {v}, we speak {VERSION}"
        )));
    }
    Ok(m[10..].to_vec())
}

/// A listening endpoint; handshakes are read on threads of their own ([`Backlog`]).
pub(crate) struct Listener {
    addr: SocketAddr,
    socket: Arc<UnixListener>,
    backlog: Arc<Backlog<Request>>,
}

/// A connection request whose handshake arrived.
pub(crate) struct Request {
    pub(crate) stream: UnixStream,
    pub(crate) private_data: Vec<u8>,
    pub(crate) fds: Vec<OwnedFd>,
}

impl Listener {
    pub(crate) fn bind(addr: SocketAddr) -> Result<Listener> {
        let mut try_addr = addr;
        let mut attempts = 0;
        let socket = loop {
            if addr.port() == 0 {
                try_addr.set_port(20_000 + (crate::tcp::random_u32() % 40_000) as u16);
            }
            match UnixListener::bind_addr(&name(try_addr)?) {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && addr.port() == 0 && attempts < 64 => {
                    attempts += 1;
                }
                Err(e) => return Err(Error::io("binding the shm endpoint", e)),
            }
        };
        let socket = Arc::new(socket);
        let s = socket.clone();
        let backlog = Backlog::start(
            "rdma-rpc-shm",
            move || Some(s.accept()),
            |(stream, _)| handshake(stream),
            |(stream, _)| refuse(&stream, crate::backlog::OUT_OF_FDS.as_bytes()),
        )?;
        Ok(Listener {
            addr: try_addr,
            socket,
            backlog,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn accept(&self, timeout: Option<Duration>) -> Result<Request> {
        self.backlog.accept(timeout)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.backlog.close();
        // SAFETY: shutting down a descriptor we own wakes the acceptor's blocking accept.
        unsafe { libc::shutdown(self.socket.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

fn handshake(stream: UnixStream) -> Result<Request> {
    stream
        .set_read_timeout(Some(HANDSHAKE))
        .map_err(|e| Error::io("handshake timeout", e))?;
    let (m, fds) = sys::recv_with_fds(&stream, 10 + MAX_PRIVATE_DATA).map_err(|e| {
        let e = Error::io("reading the handshake", e);
        // Out of descriptors for the peer's (this process at its limit of open files): the
        // peer is told so, not left to see the socket close.
        if matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::InvalidData) {
            refuse(&stream, &crate::cm::set_up_reason(&e));
        }
        e
    })?;
    let private_data = parse_hello(&m)?;
    let _ = stream.set_read_timeout(None);
    Ok(Request {
        stream,
        private_data,
        fds,
    })
}

/// The last step of set-up, once the new QP has its first receives.
pub(crate) enum Pending {
    /// Accepting: the reply (with our descriptors) to send.
    Reply { stream: UnixStream, side: Side },
    /// Connecting: done, with the peer's private data.
    Done(Vec<u8>),
}

impl Pending {
    /// Refuses the peer instead of finishing (the accepting side's set-up failed).
    pub(crate) fn refuse(self, reason: &[u8]) {
        if let Pending::Reply { stream, .. } = self {
            refuse(&stream, reason);
        }
    }

    pub(crate) fn finish(self, private_data: &[u8]) -> Result<Vec<u8>> {
        match self {
            Pending::Reply { stream, side } => {
                let mut reply = vec![1u8];
                reply.extend_from_slice(private_data);
                sys::send_with_fds(&stream, &reply, &side.fds()).map_err(|e| Error::io("answering", e))?;
                Ok(Vec::new())
            }
            Pending::Done(data) => Ok(data),
        }
    }
}

impl Request {
    /// Joins the link from the peer's descriptors; the reply goes out with [`Pending::finish`].
    /// When this fails the peer is refused, with the error as the reason.
    pub(crate) fn accept(self, mut side: Side) -> Result<(Joined, Pending)> {
        let reply = match self.stream.try_clone() {
            Ok(r) => r,
            Err(e) => {
                let e = Error::io("cloning the socket", e);
                refuse(&self.stream, &crate::cm::set_up_reason(&e));
                return Err(e);
            }
        };
        match side.join(self.stream, self.fds) {
            Ok(joined) => Ok((joined, Pending::Reply { stream: reply, side })),
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
fn refuse(stream: &UnixStream, reason: &[u8]) {
    let mut m = vec![0u8];
    m.extend_from_slice(reason);
    let _ = sys::send_with_fds(stream, &m, &[]);
}

/// Connects to the endpoint named after `addr`; returns the link, the peer's arena and the
/// peer's private data.
pub(crate) fn connect(
    addr: SocketAddr,
    mut side: Side,
    private_data: &[u8],
    timeout: Duration,
) -> Result<(Joined, Vec<u8>)> {
    let stream = UnixStream::connect_addr(&name(addr)?).map_err(|e| Error::io("connecting (shm)", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| Error::io("setting a handshake timeout", e))?;
    sys::send_with_fds(&stream, &hello(private_data), &side.fds())
        .map_err(|e| Error::io("sending the handshake", e))?;
    let longest = 1 + MAX_PRIVATE_DATA.max(crate::cm::MAX_REJECT_REASON);
    let (reply, fds) = sys::recv_with_fds(&stream, longest).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(crate::cm::NO_HANDSHAKE),
        _ => Error::io("reading the handshake", e),
    })?;
    match reply.split_first() {
        Some((1, data)) => {
            let data = data.to_vec();
            let _ = stream.set_read_timeout(None);
            let joined = side.join(stream, fds)?;
            drop(side);
            Ok((joined, data))
        }
        Some((0, reason)) => Err(crate::cm::rejected(reason)),
        _ => Err(Error::Protocol("malformed connection reply".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_of_another_layout_version_is_refused_by_name() {
        assert_eq!(parse_hello(&hello(b"data")).expect("our own hello"), b"data");
        let mut old = hello(b"");
        old[8..10].copy_from_slice(&(VERSION - 1).to_le_bytes());
        let e = parse_hello(&old).expect_err("another version");
        assert!(
            e.to_string()
                .contains(&format!("peer speaks shm version {}, we speak {VERSION}", VERSION - 1)),
            "{e}"
        );
        assert!(parse_hello(b"RDRPC").is_err(), "too short");
    }
}
