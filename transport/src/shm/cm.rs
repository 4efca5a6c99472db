//! Connection set-up for the shm provider, shaped like the tcp provider's: a listener on an
//! abstract Unix socket named after the `SocketAddr` it is given (`rdma-rpc-shm:<ip>:<port>`,
//! so the same addresses work on every provider, with TCP's rules: a wildcard takes connections
//! to every local address of its port; port 0 picks a free one), a handshake carrying
//! the private data and, as descriptors, each side's key table (read-only), inbox ring, receive
//! queue and doorbell. Memory is granted later, key by key, on the same socket (`grant`).

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::arena::{Arena, PeerArena};
use super::grant::{self, Grants, Server};
use super::link::ShmLink;
use super::ring::{self, Ring};
use super::rq::{self, OwnRq, PeerRq};
use super::sys::{self, Mapping};
use super::Peer;
use crate::cm::MAX_PRIVATE_DATA;
use crate::listening;
use crate::nic::backlog::{Acceptor, Backlog, Handshake};
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"RDRPCSHM";
/// 2: a fourth descriptor, the receive CQ's doorbell; the receive queue's `armed` word.
/// 3: receive entries carry the head of each message (`Completion::head`), fields narrowed.
/// 4: read responses sent as frames go in parts (the tcp wire's `READ_PART`).
/// 5: each ring's header carries its consumer's heartbeat (`link::KEEPALIVE`).
/// 6: a key table (read-only) instead of the whole arena; memory granted key by key (`grant`).
/// 7: the rings' doorbell is a message on the socket (`grant::wake`), not a futex; the hello
/// and the reply carry the id of the CQ doorbell they send (`bells`).
const VERSION: u16 = 7;

fn name(addr: SocketAddr) -> Result<UnixAddr> {
    UnixAddr::from_abstract_name(listening::shm_name(addr)).map_err(|e| Error::io("naming the shm endpoint", e))
}

/// Connects to the endpoint that takes connections to `addr`: its own, else a wildcard's
/// (`0.0.0.0:P` or `[::]:P`) when `addr` is an address of this host, as TCP does.
fn reach(addr: SocketAddr) -> Result<UnixStream> {
    let first = match UnixStream::connect_addr(&name(addr)?) {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    if first.kind() != std::io::ErrorKind::ConnectionRefused {
        return Err(Error::io("connecting (shm)", first));
    }
    for wild in listening::wildcards(addr) {
        if let Ok(s) = UnixStream::connect_addr(&name(wild)?) {
            return Ok(s);
        }
    }
    Err(Error::connecting(addr, "shm", first))
}

/// Whether binding `addr` would take connections another endpoint takes already, as TCP
/// refuses (`EADDRINUSE`): a wildcard and a specific address of one port exclude each other.
fn clashes(addr: SocketAddr) -> bool {
    let bound = listening::shm_endpoints();
    bound
        .iter()
        .any(|b| b.port() == addr.port() && b != &addr && (b.ip().is_unspecified() || addr.ip().is_unspecified()))
}

/// What one side brings to a connection.
pub(crate) struct Side {
    pub(crate) arena: Arc<Arena>,
    /// The arena's key table, read-only: what the peer gets of our memory at set-up.
    table_fd: OwnedFd,
    pub(crate) inbox_fd: OwnedFd,
    pub(crate) inbox: Arc<Mapping>,
    rq_fd: OwnedFd,
    rq: Option<OwnRq>,
    /// The receive CQ's doorbell, for the peer to ring after delivering into our receives, and
    /// its id (one descriptor per CQ in the peer process, however many QPs share the CQ).
    bell_fd: OwnedFd,
    bell_id: u64,
    /// Once joined: the grants' server, to start pushing when the handshake is over.
    server: Option<Arc<Server>>,
}

/// A connection's pieces, once both sides' descriptors are in.
pub(crate) struct Joined {
    pub(crate) link: Arc<ShmLink>,
    pub(crate) peer: Arc<Peer>,
    pub(crate) own_rq: OwnRq,
}

impl Side {
    pub(crate) fn new(arena: Arc<Arena>, max_recv_wr: u32, bell_fd: OwnedFd, bell_id: u64) -> Result<Side> {
        let fd =
            sys::sealed_memfd("rdma-rpc-shm-ring", ring::BYTES as u64).map_err(|e| Error::io("creating a ring", e))?;
        let inbox = Arc::new(Mapping::map(&fd, ring::BYTES).map_err(|e| Error::io("mapping a ring", e))?);
        #[cfg(rdma_loom)]
        ring::init(&inbox);
        let (rq_fd, rq) = OwnRq::create(rq::capacity(max_recv_wr))?;
        let table_fd = sys::reopen_read_only(&arena.table_fd).map_err(|e| Error::io("opening the key table", e))?;
        Ok(Side {
            arena,
            table_fd,
            inbox_fd: fd,
            inbox,
            rq_fd,
            rq: Some(rq),
            bell_fd,
            bell_id,
            server: None,
        })
    }

    fn fds(&self) -> [std::os::fd::RawFd; 4] {
        [
            self.table_fd.as_raw_fd(),
            self.inbox_fd.as_raw_fd(),
            self.rq_fd.as_raw_fd(),
            self.bell_fd.as_raw_fd(),
        ]
    }

    /// The link, the peer's memory and receive queue, from the peer's descriptors. Our
    /// descriptors stay with `self` until they were sent.
    fn join(&mut self, sock: UnixStream, peer_fds: Vec<OwnedFd>, peer_bell_id: u64) -> Result<Joined> {
        let [table_fd, inbox_fd, rq_fd, bell]: [OwnedFd; 4] = peer_fds
            .try_into()
            .map_err(|_| Error::Protocol("the peer sent the wrong descriptors".into()))?;
        // One descriptor for the connection's socket, whoever uses it.
        let sock = Arc::new(sock);
        let grants = Arc::new(Grants::new(&table_fd, sock.clone())?);
        let peer_rq = PeerRq::map(&rq_fd)?;
        let size = sys::peer_memfd(&inbox_fd).map_err(|e| Error::io("checking the peer's ring", e))?;
        if size != ring::BYTES as u64 {
            return Err(Error::Protocol(format!(
                "the peer's ring is {size} bytes, not {}",
                ring::BYTES
            )));
        }
        sys::peer_eventfd(&bell).map_err(|e| Error::io("checking the peer's doorbell", e))?;
        let peer_pid = sys::peer_pid(&sock).map_err(|e| Error::io("reading the peer's credentials", e))?;
        let bell = super::bells::shared(peer_pid, peer_bell_id, bell);
        let tx_map =
            Arc::new(Mapping::map(&inbox_fd, ring::BYTES).map_err(|e| Error::io("mapping the peer's ring", e))?);
        let dead = Arc::new(AtomicBool::new(false));
        let rx = Ring::new(self.inbox.clone(), dead.clone())
            .ok_or_else(|| Error::Protocol("ring".into()))?
            .with_peer_wake(doorbell(&sock));
        let tx = Ring::new(tx_map, dead.clone())
            .ok_or_else(|| Error::Protocol("ring".into()))?
            .with_peer_wake(doorbell(&sock));
        let own_rq = self
            .rq
            .take()
            .ok_or_else(|| Error::Protocol("side joined twice".into()))?;
        let server = Server::start(self.arena.clone(), sock.clone());
        self.server = Some(server.clone());
        let link = ShmLink::new(rx, tx, sock, dead, server, grants.clone());
        Ok(Joined {
            link,
            peer: Arc::new(Peer {
                arena: PeerArena::new(grants),
                rq: peer_rq,
                bell,
            }),
            own_rq,
        })
    }
}

/// Rings the peer's doorbell: a message on the connection's socket (`grant::wake`). The ring
/// holds the socket weakly: the link owns it.
fn doorbell(sock: &Arc<UnixStream>) -> Arc<dyn Fn() + Send + Sync> {
    let sock = Arc::downgrade(sock);
    Arc::new(move || {
        if let Some(s) = sock.upgrade() {
            grant::wake(&s);
        }
    })
}

/// The hello: magic, version, the id of the CQ doorbell it carries, the private data.
fn hello(private_data: &[u8], bell_id: u64) -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    m.extend_from_slice(&VERSION.to_le_bytes());
    m.extend_from_slice(&bell_id.to_le_bytes());
    m.extend_from_slice(private_data);
    m
}

/// The hello's doorbell id and private data.
fn parse_hello(m: &[u8]) -> Result<(u64, Vec<u8>)> {
    if m.len() < 10 || &m[..8] != MAGIC {
        return Err(Error::Protocol("not an rdma-rpc shm peer (bad magic)".into()));
    }
    let v = u16::from_le_bytes([m[8], m[9]]);
    if v != VERSION {
        return Err(Error::Protocol(format!(
            "peer speaks shm version {v}, we speak {VERSION}"
        )));
    }
    let (id, data) = take_id(&m[10..])?;
    Ok((id, data.to_vec()))
}

/// The doorbell id at the front of a hello's or a reply's rest, and what follows it.
fn take_id(m: &[u8]) -> Result<(u64, &[u8])> {
    let (id, rest) = m
        .split_first_chunk::<8>()
        .ok_or_else(|| Error::Protocol("shm handshake truncated".into()))?;
    Ok((u64::from_le_bytes(*id), rest))
}

/// A listening endpoint; it and the handshakes in progress are tasks on the device's progress
/// engine ([`Backlog`]).
pub(crate) struct Listener {
    addr: SocketAddr,
    backlog: Arc<Backlog<Request>>,
}

/// A connection request whose handshake arrived.
pub(crate) struct Request {
    pub(crate) stream: UnixStream,
    pub(crate) private_data: Vec<u8>,
    pub(crate) fds: Vec<OwnedFd>,
    bell_id: u64,
}

impl Listener {
    /// Binds the endpoint named after `addr`; `any_user` accepts processes of other users.
    pub(crate) fn bind(device: &crate::Device, addr: SocketAddr, any_user: bool) -> Result<Listener> {
        let mut try_addr = addr;
        let mut attempts = 0;
        let socket = loop {
            if addr.port() == 0 {
                try_addr.set_port(20_000 + (crate::nic::random_u32() % 40_000) as u16);
            }
            let bound = if clashes(try_addr) {
                Err(std::io::Error::from(std::io::ErrorKind::AddrInUse))
            } else {
                UnixListener::bind_addr(&name(try_addr)?)
            };
            match bound {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && addr.port() == 0 && attempts < 64 => {
                    attempts += 1;
                }
                Err(e) => return Err(Error::io("binding the shm endpoint", e)),
            }
        };
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the shm endpoint", e))?;
        let socket = Arc::new(socket);
        let s = socket.clone();
        let how = Acceptor {
            accept: Box::new(move || match s.accept() {
                Ok((stream, _)) => Some(Ok(stream)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                Err(e) => Some(Err(e)),
            }),
            begin: Box::new(move |stream| {
                Box::new(Hello {
                    stream: Some(stream),
                    any_user,
                    checked: false,
                }) as Box<dyn Handshake<Request>>
            }),
            refuse: Box::new(|stream| {
                refuse(&stream, crate::nic::backlog::OUT_OF_FDS.as_bytes());
                None
            }),
        };
        let backlog = Backlog::start(device, std::os::fd::AsFd::as_fd(&*socket), how)?;
        Ok(Listener {
            addr: try_addr,
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
        // Off the progress engine before the socket closes.
        self.backlog.close();
    }
}

/// Whether the process at the other end of `stream` may connect: one of this process's user,
/// or any with `any_user`.
fn check_user(stream: &UnixStream, any_user: bool) -> Result<()> {
    let peer = sys::peer_uid(stream).map_err(|e| Error::io("reading the peer's credentials", e))?;
    let own = sys::own_uid();
    if any_user || peer == own {
        Ok(())
    } else {
        Err(Error::PeerUser { peer, own })
    }
}

/// A client's hello as it comes, read without waiting (the backlog bounds it by
/// `backlog::HANDSHAKE`).
struct Hello {
    stream: Option<UnixStream>,
    any_user: bool,
    /// The client's user was checked.
    checked: bool,
}

impl Handshake<Request> for Hello {
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.stream.as_ref().map(std::os::fd::AsFd::as_fd)
    }

    fn step(&mut self) -> Result<Option<Request>> {
        let Some(stream) = &self.stream else {
            return Err(Error::Protocol("handshake already taken".into()));
        };
        if !self.checked {
            if let Err(e) = check_user(stream, self.any_user) {
                if let Error::PeerUser { peer, own } = e {
                    let reason =
                        format!("uid {peer} is not this server's uid {own}; shm:any-user on the server allows it");
                    refuse(stream, reason.as_bytes());
                }
                return Err(e);
            }
            self.checked = true;
        }
        let (m, fds) = match sys::recv_with_fds_now(stream, 18 + MAX_PRIVATE_DATA) {
            Ok(Some(got)) => got,
            Ok(None) => return Ok(None),
            Err(e) => {
                let e = Error::io("reading the handshake", e);
                // Out of descriptors for the peer's (this process at its limit of open files):
                // the peer is told so, not left to see the socket close.
                if matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::InvalidData) {
                    refuse(stream, &crate::cm::set_up_reason(&e));
                }
                return Err(e);
            }
        };
        let (bell_id, private_data) = parse_hello(&m)?;
        let stream = self
            .stream
            .take()
            .ok_or_else(|| Error::Protocol("handshake already taken".into()))?;
        Ok(Some(Request {
            stream,
            private_data,
            fds,
            bell_id,
        }))
    }
}

/// The last step of accepting, once the new QP has its first receives: the reply (with our
/// descriptors) to send. (Connecting has no step left: `provider::Done`.)
pub(crate) struct Pending {
    stream: UnixStream,
    side: Side,
}

impl Pending {
    /// Refuses the peer instead of finishing (the accepting side's set-up failed).
    pub(crate) fn refuse(self, reason: &[u8]) {
        refuse(&self.stream, reason);
    }

    pub(crate) fn finish(self, private_data: &[u8]) -> Result<Vec<u8>> {
        let Pending { stream, side } = self;
        let mut reply = vec![1u8];
        reply.extend_from_slice(&side.bell_id.to_le_bytes());
        reply.extend_from_slice(private_data);
        // The grants of what the peer may use at once go first (`connect` keeps them), so that
        // it holds them even if this process stops right after the reply.
        if let Some(server) = &side.server {
            server.ready();
        }
        sys::send_with_fds(&stream, &reply, &side.fds()).map_err(|e| Error::io("answering", e))?;
        Ok(Vec::new())
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
        match side.join(self.stream, self.fds, self.bell_id) {
            Ok(joined) => Ok((joined, Pending { stream: reply, side })),
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
    any_user: bool,
) -> Result<(Joined, Vec<u8>)> {
    let stream = reach(addr)?;
    // Any user can bind an abstract name: a server of another user gets none of our memory.
    check_user(&stream, any_user)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| Error::io("setting a handshake timeout", e))?;
    sys::send_with_fds(&stream, &hello(private_data, side.bell_id), &side.fds())
        .map_err(|e| Error::io("sending the handshake", e))?;
    let longest = 9 + MAX_PRIVATE_DATA.max(crate::cm::MAX_REJECT_REASON);
    // The grants the server pushes come just before its reply, each read on its own (a read
    // ends with the message whose descriptors it took): kept for the link.
    let deadline = std::time::Instant::now() + timeout;
    let mut pushed = Vec::new();
    let (reply, fds) = loop {
        let (m, fds) = sys::recv_with_fds(&stream, longest).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(crate::cm::NO_HANDSHAKE),
            _ => Error::io("reading the handshake", e),
        })?;
        if !grant::is_grant(&m) {
            break (m, fds);
        }
        if pushed.len() >= grant::MAX_PUSHED || std::time::Instant::now() > deadline {
            return Err(Error::Protocol("the server sent grants and no reply".into()));
        }
        pushed.push((m, fds));
    };
    match reply.split_first() {
        Some((1, rest)) => {
            let (bell_id, data) = take_id(rest)?;
            let data = data.to_vec();
            let _ = stream.set_read_timeout(None);
            let joined = side.join(stream, fds, bell_id)?;
            for (m, fds) in pushed {
                joined.peer.arena.grants().take_pushed(&m, fds);
            }
            if let Some(server) = &side.server {
                server.ready();
            }
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
        assert_eq!(
            parse_hello(&hello(b"data", 7)).expect("our own hello"),
            (7, b"data".to_vec())
        );
        let mut old = hello(b"", 0);
        old[8..10].copy_from_slice(&(VERSION - 1).to_le_bytes());
        let e = parse_hello(&old).expect_err("another version");
        assert!(
            e.to_string()
                .contains(&format!("peer speaks shm version {}, we speak {VERSION}", VERSION - 1)),
            "{e}"
        );
        assert!(parse_hello(b"RDRPC").is_err(), "too short");
    }

    /// The four descriptors a side sends, taken from a real side (a protection domain's key
    /// table, a ring, a receive queue, a CQ's doorbell), as raw descriptors of our own.
    struct Fds {
        table: OwnedFd,
        inbox: OwnedFd,
        rq: OwnedFd,
        bell: OwnedFd,
        _side: Side,
    }

    fn device_side() -> Side {
        let dev = crate::Device::open("shm").expect("shm");
        let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
        crate::shm::side(&crate::QpOptions::new(&pd, &cq)).expect("a side")
    }

    fn good_fds() -> Fds {
        let side = device_side();
        let dup = |fd: std::os::fd::RawFd| {
            // SAFETY: `fd` is a live descriptor of `side`; dup gives a new one we own.
            let d = unsafe { libc::dup(fd) };
            assert!(d >= 0, "dup");
            // SAFETY: dup returned a fresh descriptor nothing else owns.
            unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(d) }
        };
        let [a, i, r, b] = side.fds();
        Fds {
            table: dup(a),
            inbox: dup(i),
            rq: dup(r),
            bell: dup(b),
            _side: side,
        }
    }

    /// A memfd of `len` bytes made with `flags`, carrying `seals`.
    fn memfd(flags: libc::c_uint, len: u64, seals: libc::c_int) -> OwnedFd {
        let name = std::ffi::CString::new("hostile").expect("name");
        // SAFETY: `name` is NUL-terminated and outlives the call.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // SAFETY: plain syscalls on a descriptor we own.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0, "ftruncate");
            if seals != 0 {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0, "seals");
            }
        }
        fd
    }

    /// Sends a handshake with `fds` to the listener at `addr` as a raw process would, and
    /// returns the reply: `Ok(())` for an acceptance, `Err(reason)` for a refusal.
    fn try_join(addr: SocketAddr, fds: [&OwnedFd; 4]) -> std::result::Result<(), String> {
        let stream = UnixStream::connect_addr(&name(addr).expect("name")).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let raw = fds.map(|f| f.as_raw_fd());
        sys::send_with_fds(&stream, &hello(b"", 1), &raw).expect("send the handshake");
        let (reply, _fds) = sys::recv_with_fds(&stream, 512).expect("a reply, not a hang");
        match reply.split_first() {
            Some((1, _)) => Ok(()),
            Some((0, reason)) => Err(String::from_utf8_lossy(reason).into_owned()),
            _ => panic!("malformed reply {reply:?}"),
        }
    }

    /// A server that takes `n` connection requests and accepts those that pass its checks.
    fn serve(listener: Listener, n: usize) -> std::thread::JoinHandle<usize> {
        std::thread::spawn(move || {
            let mut joined = 0;
            for _ in 0..n {
                let req = listener.accept(Some(Duration::from_secs(20))).expect("a request");
                if let Ok((j, pending)) = req.accept(device_side()) {
                    pending.finish(b"").expect("reply");
                    joined += 1;
                    drop(j);
                }
            }
            joined
        })
    }

    #[test]
    fn descriptors_that_are_not_plain_sealed_memfds_of_the_right_size_are_refused() {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let listener = Listener::bind(&crate::Device::open("shm").expect("shm"), addr, false).expect("bind");
        let addr = listener.local_addr();
        let server = serve(listener, 8);
        let g = good_fds();
        let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        let huge_table = memfd(libc::MFD_HUGETLB, 2 << 20, sealed);
        let huge_rq = memfd(libc::MFD_HUGETLB, 2 << 20, sealed);
        let unsealed_ring = memfd(0, ring::BYTES as u64, 0);
        let small_table = memfd(0, super::super::arena::TABLE as u64 / 2, sealed);
        let odd_rq = memfd(0, rq::bytes(4) as u64 + 64, sealed);
        let [pipe_r, _pipe_w] = {
            let mut p = [0; 2];
            // SAFETY: `p` is a valid 2-element out-array.
            assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
            // SAFETY: fresh descriptors nothing else owns.
            p.map(|fd| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
        };
        let file = tempfile_of(super::super::arena::TABLE as u64);
        let cases: [(&str, [&OwnedFd; 4], &str); 7] = [
            (
                "a hugetlbfs key table",
                [&huge_table, &g.inbox, &g.rq, &g.bell],
                "hugetlbfs",
            ),
            (
                "a hugetlbfs receive queue",
                [&g.table, &g.inbox, &huge_rq, &g.bell],
                "hugetlbfs",
            ),
            (
                "an unsealed ring",
                [&g.table, &unsealed_ring, &g.rq, &g.bell],
                "not sealed",
            ),
            (
                "a key table of the wrong size",
                [&small_table, &g.inbox, &g.rq, &g.bell],
                "key table is",
            ),
            (
                "a receive queue of no valid size",
                [&g.table, &g.inbox, &odd_rq, &g.bell],
                "receive queue is",
            ),
            (
                "a pipe as the doorbell",
                [&g.table, &g.inbox, &g.rq, &pipe_r],
                "not an eventfd",
            ),
            // On a tmpfs /tmp a plain file passes as memory, but cannot be sealed.
            (
                "a plain file",
                [&file, &g.inbox, &g.rq, &g.bell],
                "not a memfd|not sealed",
            ),
        ];
        for (what, fds, says) in cases {
            match try_join(addr, fds) {
                Ok(()) => panic!("{what} was accepted"),
                Err(reason) => assert!(
                    says.split('|').any(|s| reason.contains(s)),
                    "{what}: refused, but with {reason:?}"
                ),
            }
        }
        // The same server, still alive, takes a side whose descriptors are all in order.
        try_join(addr, [&g.table, &g.inbox, &g.rq, &g.bell]).expect("a good side is accepted");
        assert_eq!(
            server.join().expect("the server thread"),
            1,
            "only the good side joined"
        );
    }

    /// A regular file of `len` bytes (sparse) on the file system of the temporary directory,
    /// unlinked: not a memfd.
    fn tempfile_of(len: u64) -> OwnedFd {
        let path = std::env::temp_dir().join(format!("rdma-rpc-hostile-{}", crate::nic::random_u32()));
        let f = std::fs::File::create(&path).expect("a temporary file");
        f.set_len(len).expect("set_len");
        let _ = std::fs::remove_file(&path);
        f.into()
    }

    /// A protection domain, a CQ and a listener of the shm provider.
    fn listening() -> (crate::ProtectionDomain, crate::CompletionQueue, crate::Listener) {
        let dev = crate::Device::open("shm").expect("shm");
        let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
        let listener = crate::Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
        (pd, cq, listener)
    }

    /// A peer that joins properly, then writes a completion into one of our receives with a
    /// length past the receive's buffer: the receive completes with an error, never with that
    /// length (which would send the application past its buffer).
    #[test]
    fn a_receive_completed_past_its_length_is_an_error() {
        use crate::{AccessFlags, RecvWr, WcStatus};
        let (pd, cq, listener) = listening();
        let addr = listener.local_addr().expect("addr");
        let opts = crate::QpOptions::new(&pd, &cq);
        let server = std::thread::spawn(move || {
            let qp = listener
                .accept(Some(Duration::from_secs(20)))
                .expect("a request")
                .accept(&opts, b"")
                .expect("accepted");
            let buf = pd.register(64, AccessFlags::LOCAL_WRITE).expect("buffer");
            qp.post_recv(RecvWr::new(7, buf))
                .map_err(|e| e.error)
                .expect("post a receive");
            (qp, pd)
        });
        // The attacker: a side of its own, then the server's receive queue, mapped.
        let g = good_fds();
        let stream = UnixStream::connect_addr(&name(addr).expect("name")).expect("connect");
        let raw = [&g.table, &g.inbox, &g.rq, &g.bell].map(|f| f.as_raw_fd());
        sys::send_with_fds(&stream, &hello(b"", 1), &raw).expect("send the handshake");
        let (reply, fds) = sys::recv_with_fds(&stream, 512).expect("the reply");
        assert_eq!(reply.first(), Some(&1), "accepted");
        let their_rq = PeerRq::map(&fds[2]).expect("the server's receive queue");
        let (_qp, _pd) = server.join().expect("the server thread");
        let taken = loop {
            if let Some(t) = their_rq.take().expect("a sane queue") {
                break t;
            }
            std::thread::yield_now();
        };
        assert_eq!(taken.len, 64);
        let _ = taken.complete(WcStatus::Success, 0, 1 << 20, 0);
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while done.is_empty() && std::time::Instant::now() < deadline {
            cq.poll(&mut done, 4).expect("poll");
        }
        let c = done.first().expect("the receive completed");
        assert_eq!((c.wr_id, c.status), (7, WcStatus::LocLenErr), "{c:?}");
        drop(stream);
    }

    /// A raw peer's side of a grant: the verdict, the length, the descriptor.
    struct Granted {
        verdict: u8,
        len: u64,
        fd: Option<OwnedFd>,
    }

    /// The grant messages a raw peer reads, parsed as the protocol says (`grant`'s module
    /// doc), by hand.
    struct RawGrants {
        stream: UnixStream,
        bytes: Vec<u8>,
        fds: std::collections::VecDeque<OwnedFd>,
    }

    impl RawGrants {
        /// The next message: `(want, key, grant)`, or `None` when none comes within the
        /// socket's read timeout.
        fn next(&mut self) -> Option<(u8, u32, Granted)> {
            while self.bytes.len() < 48 {
                let (b, fds) = sys::recv_with_fds(&self.stream, 4096).ok()?;
                self.bytes.extend_from_slice(&b);
                self.fds.extend(fds);
            }
            let a: Vec<u8> = self.bytes.drain(..48).collect();
            assert_eq!(a[0], 2, "a grant or a refusal");
            let fd = if a[2] == 0 { None } else { self.fds.pop_front() };
            assert!(a[2] == 0 || fd.is_some(), "a grant carries a descriptor");
            let key = u32::from_le_bytes([a[4], a[5], a[6], a[7]]);
            let len = u64::from_le_bytes(std::array::from_fn(|j| a[32 + j]));
            Some((a[1], key, Granted { verdict: a[2], len, fd }))
        }

        /// Asks for `key` and reads the answer (nothing else may be in flight).
        fn ask(&mut self, want: u8, key: u32) -> Granted {
            let mut m = [0u8; 48];
            m[0] = 1;
            m[1] = want;
            m[4..8].copy_from_slice(&key.to_le_bytes());
            sys::send_with_fds(&self.stream, &m, &[]).expect("send a request");
            let (w, k, got) = self.next().expect("an answer");
            assert_eq!((w, k), (want, key), "the answer to this request");
            got
        }
    }

    /// `mmap` of `len` bytes of `fd` with `prot`, shared: the mapping, or the errno.
    fn raw_map(fd: &OwnedFd, len: usize, prot: libc::c_int) -> std::result::Result<*mut u8, i32> {
        // SAFETY: a fresh mapping the kernel places; nothing in this process refers to it.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(p.cast())
        }
    }

    /// A process that joins properly and then uses no check of ours: what it gets of the
    /// server's memory is what a NIC would let it reach, and the kernel holds it to that. The
    /// key table cannot be mapped writable; a REMOTE_READ registration comes read-only (no
    /// writable mapping, no mprotect to writable); a REMOTE_WRITE one read-write; a private
    /// registration, a posted receive's buffer, an lkey, a made-up key or a kind of grant that
    /// does not exist, not at all; and the receive queue names no buffer of ours.
    #[test]
    fn a_raw_peer_reaches_only_what_it_was_granted_and_the_kernel_holds_it_to_that() {
        use crate::{AccessFlags, RecvWr};
        let (pd, cq, listener) = listening();
        let addr = listener.local_addr().expect("addr");
        let opts = crate::QpOptions::new(&pd, &cq);
        let mut ro = pd
            .register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .expect("read-only");
        ro.write_at(0, b"read me").expect("write");
        let rw = pd
            .register(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .expect("writable");
        let private = pd.register(4096, AccessFlags::LOCAL_WRITE).expect("private");
        let recv = pd.register(4096, AccessFlags::LOCAL_WRITE).expect("receive buffer");
        let (recv_lkey, private_keys) = (recv.lkey(), (private.lkey(), private.rkey()));
        let server = std::thread::spawn(move || {
            let qp = listener
                .accept(Some(Duration::from_secs(20)))
                .expect("a request")
                .accept(&opts, b"")
                .expect("accepted");
            qp.post_recv(RecvWr::new(7, recv)).map_err(|e| e.error).expect("post");
            qp
        });
        let g = good_fds();
        let stream = UnixStream::connect_addr(&name(addr).expect("name")).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let raw = [&g.table, &g.inbox, &g.rq, &g.bell].map(|f| f.as_raw_fd());
        sys::send_with_fds(&stream, &hello(b"", 1), &raw).expect("send the handshake");
        // Before the reply, the grants of what it may use at once, each read on its own.
        let mut early = Vec::new();
        let (reply, fds) = loop {
            let (m, fds) = sys::recv_with_fds(&stream, 512).expect("the reply");
            if m.len() == 48 && m[0] == 2 {
                early.push((m, fds));
            } else {
                break (m, fds);
            }
        };
        assert_eq!(reply.first(), Some(&1), "accepted");
        let qp = server.join().expect("the server thread");
        let mut peer = RawGrants {
            stream,
            bytes: early.iter().flat_map(|(m, _)| m.clone()).collect(),
            fds: early.into_iter().flat_map(|(_, f)| f).collect(),
        };
        // Pushed unasked: the registrations with remote access, nothing else.
        let mut pushed = std::collections::BTreeMap::new();
        while let Some((want, key, got)) = peer.next() {
            assert!(got.verdict != 0, "nothing refused unasked");
            pushed.insert((want, key), (got.verdict, got.len));
        }
        let expected: std::collections::BTreeMap<_, _> =
            [((1, ro.rkey()), (1, 4096)), ((1, rw.rkey()), (2, 8192))].into();
        assert_eq!(pushed, expected, "what was pushed");
        // The table: read-only, whatever the peer tries.
        let table = &fds[0];
        let table_len = super::super::arena::TABLE;
        assert_eq!(
            raw_map(table, table_len, libc::PROT_READ | libc::PROT_WRITE),
            Err(libc::EACCES)
        );
        assert!(raw_map(table, table_len, libc::PROT_READ).is_ok(), "readable");
        // A REMOTE_READ registration: read-only.
        let got = peer.ask(1, ro.rkey());
        assert_eq!((got.verdict, got.len), (1, 4096), "granted read-only");
        let fd = got.fd.expect("a descriptor");
        assert_eq!(
            raw_map(&fd, 4096, libc::PROT_READ | libc::PROT_WRITE),
            Err(libc::EACCES)
        );
        let p = raw_map(&fd, 4096, libc::PROT_READ).expect("readable");
        // SAFETY: `p` maps 4096 readable bytes.
        let head = unsafe { std::slice::from_raw_parts(p, 7) }.to_vec();
        assert_eq!(head, b"read me");
        // SAFETY: `p` is our own mapping of 4096 bytes.
        let r = unsafe { libc::mprotect(p.cast(), 4096, libc::PROT_READ | libc::PROT_WRITE) };
        assert_eq!(r, -1, "mprotect to writable is refused");
        // A REMOTE_WRITE registration: written through the grant, seen by its owner.
        let got = peer.ask(1, rw.rkey());
        assert_eq!((got.verdict, got.len), (2, 8192), "granted read-write");
        let p = raw_map(&got.fd.expect("a descriptor"), 8192, libc::PROT_READ | libc::PROT_WRITE).expect("writable");
        // SAFETY: `p` maps 8192 writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(b"written".as_ptr(), p.add(100), 7) };
        assert_eq!(&rw.bytes()[100..107], b"written");
        // Nothing else.
        for (what, want, key) in [
            ("a private registration's rkey", 1, private_keys.1),
            ("a private registration's lkey as an rkey", 1, private_keys.0),
            ("a private registration's lkey for a receive", 2, private_keys.0),
            ("a posted receive's lkey", 1, recv_lkey),
            ("a posted receive's lkey for a receive", 2, recv_lkey),
            ("a made-up key", 1, 0x5eed_0001),
        ] {
            let got = peer.ask(want, key);
            assert!(got.verdict == 0 && got.fd.is_none(), "{what} was granted");
        }
        // The receive queue: the posted receive's length, and no address or key of its buffer.
        let rq = PeerRq::map(&fds[2]).expect("the server's receive queue");
        let t = rq.take().expect("sane counters").expect("the posted receive");
        assert_eq!(t.len, 4096);
        // SAFETY: the queue's memfd is at least a page: its header, then the first entry,
        // whose first 16 bytes are where a buffer's address and key could go.
        let entry =
            unsafe { std::slice::from_raw_parts(raw_map(&fds[2], 8192, libc::PROT_READ).expect("map").add(4096), 16) };
        assert_eq!(&entry[..8], &[0; 8], "no address");
        assert_eq!(&entry[8..12], &4096u32.to_le_bytes(), "the length");
        assert_eq!(&entry[12..16], &[1, 0, 0, 0], "whether it may be written, and no key");
        // A withdrawn registration: no longer granted.
        let rw_rkey = rw.rkey();
        drop(rw);
        assert_eq!(peer.ask(1, rw_rkey).verdict, 0, "deregistered");
        drop((qp, ro, private, peer));
    }
}
