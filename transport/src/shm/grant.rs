//! Grants: how a peer gets the memory one key names, and nothing else.
//!
//! The owner pushes a grant to each connected peer when it registers memory with remote access
//! (and, at set-up, of what it registered before): a descriptor of the registration's memfd,
//! opened read-only unless the key allows writing, on the connection's Unix socket. So
//! one-sided operations need no CPU of the owner's, as on a NIC: a stopped owner is still read
//! and written. (Receive buffers are never granted: Sends go through the receive queue's
//! staging area, `rq`.) An initiator that meets a key it holds no grant for (a grant pushed but not
//! yet taken in, one dropped for the cap, or a key the owner never granted) sends that
//! operation as a frame, which the owner's engine checks and runs, and asks for the grant
//! without waiting; the owner's watcher thread answers from its registrations (`arena`), or
//! refuses. The initiator maps what it is given
//! and keeps it while the owner's table says the registration lives. Messages are [`MSG`]
//! bytes each way:
//!
//! - request: `[1, want, 0, 0, key: u32]`, zero-padded;
//! - grant, asked for or pushed: `[2, want, verdict, 0, key: u32, slot: u32, access: u32,
//!   tag: u64, addr: u64, len: u64]`, zero-padded, with one descriptor unless the verdict is a
//!   refusal.
//!
//! Integers are little-endian. Everything read from the other side is checked: a peer that
//! lies about a grant gets refusals, never an access outside what it sent.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt, HashSet};
use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock, RwLockReadGuard};

use super::arena::{self, Arena};
use super::sys::{self, Mapping};
use crate::{AccessFlags, WcStatus};

/// Bytes of a message, either way.
pub(crate) const MSG: usize = 48;
const REQUEST: u8 = 1;
const ANSWER: u8 = 2;
/// A doorbell: the sender wrote to a ring whose reader sleeps, or freed room for a writer that
/// waits (`link`). Carries nothing else.
const WAKE: u8 = 3;
const REFUSED: u8 = 0;
const READ_ONLY: u8 = 1;
const READ_WRITE: u8 = 2;
/// Descriptors received and not yet matched to an answer, beyond which the peer is broken.
const MAX_LOOSE_FDS: usize = 16;
/// Grants a connection keeps that nobody asked for (pushed), at most: each is a mapping, and
/// a process has a bounded number of them (`vm.max_map_count`). Past it, keys are asked for.
pub(crate) const MAX_PUSHED: usize = 4096;
/// Requests out at once, at most (one per key an initiator met without its grant).
const MAX_ASKED: usize = 1024;

/// What a grant is for: one-sided operations under an rkey (the only kind there is; the byte
/// leaves room for others, and a request for an unknown kind is refused).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Want {
    Remote = 1,
}

impl Want {
    fn from_byte(b: u8) -> Option<Want> {
        match b {
            1 => Some(Want::Remote),
            _ => None,
        }
    }
}

/// The owner's side of one connection: pushes grants to its peer and answers its requests.
pub(crate) struct Server {
    arena: Arc<Arena>,
    sock: Arc<UnixStream>,
    /// Set once the handshake's last message is out: nothing may go before it.
    ready: AtomicBool,
}

impl Server {
    /// Serves the peer at the other end of `sock`; pushes nothing before [`Server::ready`].
    pub(crate) fn start(arena: Arc<Arena>, sock: Arc<UnixStream>) -> Arc<Server> {
        let server = Arc::new(Server {
            arena,
            sock,
            ready: AtomicBool::new(false),
        });
        server.arena.track(&server);
        server
    }

    /// The handshake is over: pushes the grants of what the peer may already use
    /// (registrations with remote access), and from here on each new one.
    pub(crate) fn ready(&self) {
        // Set before the snapshot: a registration either sees it set and pushes its own
        // grant, or is in the snapshot (or both: a grant pushed twice is harmless).
        self.ready.store(true, Ordering::SeqCst);
        for key in self.arena.remote_keys() {
            self.push(Want::Remote, key);
        }
    }

    /// Sends the peer the grant of `key`, if there is one and the handshake is over; a peer
    /// that does not take it in asks later.
    pub(crate) fn push(&self, want: Want, key: u32) {
        if !self.ready.load(Ordering::SeqCst) {
            return;
        }
        if let (m, Some(fd)) = self.answer(want as u8, key) {
            send(&self.sock, &m, Some(&fd));
        }
    }

    /// The answer to a request for `key`, and the descriptor to send with it.
    fn answer(&self, want: u8, key: u32) -> ([u8; MSG], Option<OwnedFd>) {
        let mut m = [0u8; MSG];
        m[0] = ANSWER;
        m[1] = want;
        m[4..8].copy_from_slice(&key.to_le_bytes());
        let Some(p) = self.arena.lookup(key) else {
            return (m, None);
        };
        let writes = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let verdict = match Want::from_byte(want) {
            Some(Want::Remote) if p.access.bits() & writes.bits() != 0 => READ_WRITE,
            Some(Want::Remote) if p.access.contains(AccessFlags::REMOTE_READ) => READ_ONLY,
            _ => return (m, None),
        };
        let Some(own) = &p.seg.fd else { return (m, None) };
        let fd = if verdict == READ_WRITE {
            own.try_clone()
        } else {
            sys::reopen_read_only(own)
        };
        let Ok(fd) = fd else { return (m, None) }; // out of descriptors: refused
        m[2] = verdict;
        m[8..12].copy_from_slice(&p.slot.to_le_bytes());
        m[12..16].copy_from_slice(&p.access.bits().to_le_bytes());
        m[16..24].copy_from_slice(&p.tag.to_le_bytes());
        m[24..32].copy_from_slice(&p.addr.to_le_bytes());
        m[32..40].copy_from_slice(&p.len.to_le_bytes());
        (m, Some(fd))
    }
}

/// A peer's registration as granted to us, mapped.
pub(crate) struct Grant {
    map: Mapping,
    slot: u32,
    tag: u64,
    addr: u64,
    len: u64,
    access: AccessFlags,
}

impl Grant {
    /// Where `len` bytes at the owner's `addr` are in our mapping, after the NIC's checks:
    /// the access flag, the range inside the registration.
    pub(crate) fn at(&self, addr: u64, len: usize, need: AccessFlags) -> Result<*mut u8, WcStatus> {
        if !self.access.contains(need) {
            return Err(WcStatus::RemAccessErr);
        }
        let end = addr.checked_add(len as u64).ok_or(WcStatus::RemAccessErr)?;
        if addr < self.addr || end > self.addr + self.len {
            return Err(WcStatus::RemAccessErr);
        }
        // `addr + len - self.addr <= self.len <= the mapping's length` (checked when mapped).
        Ok(self.map.ptr().wrapping_add((addr - self.addr) as usize))
    }

    /// For a registration peers may run atomics on, its bytes in our mapping: copies into and
    /// out of it go word by word, atomically (`words`).
    pub(crate) fn atomic_bounds(&self) -> Option<crate::words::Bounds> {
        self.access
            .contains(AccessFlags::REMOTE_ATOMIC)
            .then(|| crate::words::Bounds {
                lo: self.map.ptr() as usize,
                hi: self.map.ptr() as usize + self.len as usize,
            })
    }
}

/// The initiator's side of one connection: the owner's table, the grants so far, the requests
/// out.
pub(crate) struct Grants {
    table: Mapping,
    cache: RwLock<HashMap<(u32, Want), Grant>>,
    /// Requests sent and not answered yet (at most [`MAX_ASKED`]).
    pending: Mutex<HashSet<(u32, Want)>>,
    sock: Arc<UnixStream>,
    dead: AtomicBool,
}

impl Grants {
    /// Maps the peer's table (read-only, whatever the descriptor allows); requests go on `sock`.
    pub(crate) fn new(table_fd: &OwnedFd, sock: Arc<UnixStream>) -> crate::Result<Grants> {
        let size = sys::peer_memfd(table_fd).map_err(|e| crate::Error::io("checking the peer's key table", e))?;
        if size != arena::TABLE as u64 {
            return Err(crate::Error::Protocol(format!(
                "the peer's key table is {size} bytes, not {}",
                arena::TABLE
            )));
        }
        let table = Mapping::map_read_only(table_fd, arena::TABLE)
            .map_err(|e| crate::Error::io("mapping the peer's key table", e))?;
        Ok(Grants {
            table,
            cache: RwLock::new(HashMap::new()),
            pending: Mutex::new(HashSet::default()),
            sock,
            dead: AtomicBool::new(false),
        })
    }

    /// The grant of `key` for `want`, held (under a read lock) while it is used, if this side
    /// holds it and its registration lives. Otherwise `None`, and the owner is asked for it
    /// without waiting: the operation goes another way (as a frame, which the owner's engine
    /// checks and runs), so nothing waits on the owner here, under the QP's lock.
    pub(crate) fn get(&self, key: u32, want: Want) -> Option<MappedRwLockReadGuard<'_, Grant>> {
        let k = (key, want);
        let table = &self.table;
        let held = RwLockReadGuard::try_map(self.cache.read(), |c| {
            c.get(&k).filter(|g| arena::live(table, g.slot, g.tag))
        });
        match held {
            Ok(g) => return Some(g),
            Err(unmapped) => drop(unmapped), // before the write lock below
        }
        // None yet, or one of a registration withdrawn since (the key may name a new one).
        self.cache.write().remove(&k);
        self.ask(k);
        None
    }

    /// Runs `f` on the grant of `key` for `want`, if held (see [`Grants::get`]).
    pub(crate) fn with<R>(
        &self,
        key: u32,
        want: Want,
        f: impl FnOnce(&Grant) -> Result<R, WcStatus>,
    ) -> Option<Result<R, WcStatus>> {
        Some(f(&*self.get(key, want)?))
    }

    /// Asks the owner for `k` unless a request for it is out already; does not wait.
    fn ask(&self, k: (u32, Want)) {
        let mut pending = self.pending.lock();
        if self.dead.load(Ordering::Acquire) || pending.contains(&k) || pending.len() >= MAX_ASKED {
            return;
        }
        let mut m = [0u8; MSG];
        m[0] = REQUEST;
        m[1] = k.1 as u8;
        m[4..8].copy_from_slice(&k.0.to_le_bytes());
        if send(&self.sock, &m, None) {
            pending.insert(k);
        }
    }

    /// Takes in a grant or a refusal (on the watcher thread): maps what was granted, after
    /// checking it. One nobody asked for (pushed) is kept up to [`MAX_PUSHED`].
    fn answered(&self, m: &[u8; MSG], fd: Option<OwnedFd>) {
        let Some(want) = Want::from_byte(m[1]) else { return };
        let u32_at = |i: usize| u32::from_le_bytes([m[i], m[i + 1], m[i + 2], m[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|j| m[i + j]));
        let k = (u32_at(4), want);
        let mut pending = self.pending.lock();
        let grant = fd.and_then(|fd| {
            let writable = match m[2] {
                READ_WRITE => true,
                READ_ONLY => false,
                _ => return None,
            };
            let (slot, access, tag, addr, len) = (u32_at(8), u32_at(12), u64_at(16), u64_at(24), u64_at(32));
            let size = sys::peer_memfd(&fd).ok()?;
            if len == 0 || len > size || addr.checked_add(len).is_none() || slot as usize >= arena::SLOTS {
                return None;
            }
            let size = usize::try_from(size).ok()?;
            let map = if writable {
                Mapping::map(&fd, size)
            } else {
                Mapping::map_read_only(&fd, size)
            };
            let mut access = AccessFlags::from_bits_truncate(access);
            if !writable {
                // Whatever the owner claims, a read-only mapping serves reads only.
                access = AccessFlags::from_bits_truncate(access.bits() & AccessFlags::REMOTE_READ.bits());
            }
            Some(Grant {
                map: map.ok()?,
                slot,
                tag,
                addr,
                len,
                access,
            })
        });
        let asked = pending.remove(&k);
        if let Some(g) = grant {
            let mut cache = self.cache.write();
            if asked || cache.len() < MAX_PUSHED || cache.contains_key(&k) {
                cache.insert(k, g);
            }
        }
    }

    /// Takes in a grant read before the link existed (during the handshake).
    pub(crate) fn take_pushed(&self, m: &[u8], mut fds: Vec<OwnedFd>) {
        if let Ok(m) = <&[u8; MSG]>::try_from(m) {
            self.answered(m, if m[2] == REFUSED { None } else { fds.pop() });
        }
    }

    /// Drops the grants of registrations the owner withdrew (their memory goes with them).
    pub(crate) fn sweep(&self) {
        let stale: Vec<_> = self
            .cache
            .read()
            .iter()
            .filter(|(_, g)| !arena::live(&self.table, g.slot, g.tag))
            .map(|(k, _)| *k)
            .collect();
        if !stale.is_empty() {
            let mut cache = self.cache.write();
            for k in stale {
                cache.remove(&k);
            }
        }
    }

    /// The connection ended: no more requests, the grants go.
    pub(crate) fn close(&self) {
        self.dead.store(true, Ordering::Release);
        self.pending.lock().clear();
        self.cache.write().clear();
    }
}

/// Whether `m` is a grant or a refusal (not a handshake message).
pub(crate) fn is_grant(m: &[u8]) -> bool {
    m.len() == MSG && m[0] == ANSWER
}

/// Rings the peer's doorbell: a [`WAKE`] message, without waiting (a full socket means the
/// peer has messages to read, which wake it all the same).
pub(crate) fn wake(sock: &UnixStream) {
    let mut m = [0u8; MSG];
    m[0] = WAKE;
    let _ = sys::send_with_fds_nowait(sock, &m, &[]);
}

/// Sends one message (and a descriptor), without waiting: a peer that leaves its socket full
/// is not reading what we send it.
fn send(sock: &UnixStream, m: &[u8; MSG], fd: Option<&OwnedFd>) -> bool {
    let fds: Vec<_> = fd.iter().map(|f| f.as_raw_fd()).collect();
    sys::send_with_fds_nowait(sock, m, &fds).is_ok()
}

/// What a connection's watcher reads from its socket: requests it answers, answers it hands to
/// the requests waiting.
pub(crate) struct Inbound {
    bytes: Vec<u8>,
    fds: VecDeque<OwnedFd>,
}

impl Inbound {
    pub(crate) fn new() -> Inbound {
        Inbound {
            bytes: Vec::new(),
            fds: VecDeque::new(),
        }
    }

    /// Takes in what one read gave. `Err` when the peer broke the protocol or does not read
    /// our answers: the connection is then over.
    pub(crate) fn take(
        &mut self,
        bytes: &[u8],
        fds: Vec<OwnedFd>,
        sock: &UnixStream,
        server: &Server,
        grants: &Grants,
    ) -> io::Result<()> {
        let broken = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidData, why.to_owned()));
        self.bytes.extend_from_slice(bytes);
        self.fds.extend(fds);
        if self.fds.len() > MAX_LOOSE_FDS {
            return broken("the peer sent descriptors nobody asked for");
        }
        let whole = self.bytes.len() / MSG * MSG;
        for chunk in self.bytes[..whole].chunks_exact(MSG) {
            let m: &[u8; MSG] = chunk.try_into().map_err(|_| io::ErrorKind::InvalidData)?;
            let key = u32::from_le_bytes([m[4], m[5], m[6], m[7]]);
            match (m[0], Want::from_byte(m[1])) {
                (REQUEST, _) => {
                    let (answer, fd) = server.answer(m[1], key);
                    if !send(sock, &answer, fd.as_ref()) {
                        return broken("the peer does not read the answers to its requests");
                    }
                }
                (WAKE, _) => {} // the turn that reads it is what it asked for
                (ANSWER, Some(_)) => {
                    let fd = if m[2] == REFUSED { None } else { self.fds.pop_front() };
                    grants.answered(m, fd);
                }
                _ => return broken("the peer sent a message that is not a request or an answer"),
            }
        }
        self.bytes.drain(..whole);
        Ok(())
    }
}
