//! Registered buffers for rendezvous, per connection: size classes, reused, never registered on
//! the hot path once warm, and never reused while lent to the peer.

use std::sync::Arc;

use foldhash::{HashMap, HashSet};
use parking_lot::Mutex;

use rdma_rpc_transport::{AccessFlags, MemoryRegion, ProtectionDomain, RemoteRegion};

use crate::buf::RegisteredBuf;
use crate::proto::{BufId, LANDING_PREFIX};
use crate::{Isolation, RpcError};

/// The buffers of one connection: free ones by size class (shared with the application's
/// [`RegisteredBuf`]s, which come back to them when dropped), and those the session holds (lent
/// to the peer, or being read into) by id.
pub(crate) struct Stash {
    pd: ProtectionDomain,
    free: Arc<Mutex<Free>>,
    held: HashMap<BufId, MemoryRegion>,
    /// Held buffers that belong to the application: on release they wait in `kept` for it.
    keep: HashSet<BufId>,
    kept: HashMap<BufId, MemoryRegion>,
    next: BufId,
    isolation: Isolation,
}

/// Free buffers by size class.
pub(crate) struct Free {
    lists: HashMap<usize, Vec<MemoryRegion>>,
    isolation: Isolation,
}

impl Free {
    fn pop(&mut self, class: usize) -> Option<MemoryRegion> {
        self.lists.get_mut(&class).and_then(Vec::pop)
    }

    /// A buffer no peer can reach through the session any more: kept for reuse, or (with
    /// [`Isolation::Transfer`], or beyond [`KEEP`]) deregistered, so that its rkey dies.
    pub(crate) fn put(&mut self, mr: MemoryRegion) {
        let list = self.lists.entry(mr.len()).or_default();
        if self.isolation == Isolation::Connection && list.len() < KEEP {
            list.push(mr);
        }
    }
}

const MIN_CLASS: usize = 4096;
/// Free buffers kept per size class; more are deregistered.
const KEEP: usize = 8;

fn class(len: usize) -> usize {
    len.max(MIN_CLASS).next_power_of_two()
}

impl Stash {
    pub(crate) fn new(pd: &ProtectionDomain, isolation: Isolation) -> Self {
        Self {
            pd: pd.clone(),
            free: Arc::new(Mutex::new(Free {
                lists: HashMap::default(),
                isolation,
            })),
            held: HashMap::default(),
            keep: HashSet::default(),
            kept: HashMap::default(),
            next: 1,
            isolation,
        }
    }

    /// A free buffer of `len` bytes' class, or a new registration.
    fn fresh(&mut self, len: usize) -> Result<MemoryRegion, RpcError> {
        fresh(&self.pd, &self.free, len)
    }

    /// A buffer for the application to fill: `len` bytes after room for the length prefix.
    pub(crate) fn user_buffer(&mut self, len: usize) -> Result<RegisteredBuf, RpcError> {
        self.buffers().buffer(len)
    }

    /// Hands out buffers of this connection, for a handler to answer from.
    pub(crate) fn buffers(&self) -> Buffers {
        Buffers {
            pd: self.pd.clone(),
            free: self.free.clone(),
        }
    }

    /// Lends the application's buffer (see [`RegisteredBuf::lendable_on`]) without copying it:
    /// writes its length prefix and holds it under a fresh id. With `keep`, [`Stash::reclaim`]
    /// gives it back to the application; otherwise it goes to the free lists when released.
    /// The same layout serves a Send straight from the buffer
    /// ([`Payload::Placed`](crate::proto::Payload::Placed)): the header goes over the prefix.
    pub(crate) fn lend_user(&mut self, buf: RegisteredBuf, keep: bool) -> Result<(RemoteRegion, BufId), RegisteredBuf> {
        if !buf.lendable_on(&self.free, LANDING_PREFIX) {
            return Err(buf);
        }
        let len = buf.len();
        let mut mr = buf.into_region();
        write_prefix(&mut mr.bytes_mut(), len);
        let whole = mr.remote();
        let desc = RemoteRegion {
            addr: whole.addr + LANDING_PREFIX as u64,
            len: len as u64,
            rkey: whole.rkey,
        };
        let id = self.next;
        self.next += 1;
        self.held.insert(id, mr);
        if keep {
            self.keep.insert(id);
        }
        Ok((desc, id))
    }

    /// Whether the application's buffer `id` is out in a work request (neither held nor
    /// released yet): a Send from it whose completion has not come back.
    pub(crate) fn in_flight(&self, id: BufId) -> bool {
        self.keep.contains(&id) && !self.held.contains_key(&id) && !self.kept.contains_key(&id)
    }

    /// The application's lent buffer `id` of `len` bytes back, once no peer reaches it any more
    /// (released, or about to be: its call finished). With [`Isolation::Transfer`] its bytes
    /// move to a fresh registration, so that the old rkey dies.
    pub(crate) fn reclaim(&mut self, id: BufId, len: usize) -> Option<RegisteredBuf> {
        self.keep.remove(&id);
        let mr = self.kept.remove(&id).or_else(|| self.held.remove(&id))?;
        if self.isolation == Isolation::Transfer {
            let mut fresh = self.fresh(mr.len()).ok()?;
            fresh.bytes_mut().copy_from_slice(&mr.bytes());
            return Some(RegisteredBuf::new(fresh, LANDING_PREFIX, len, &self.free));
        }
        Some(RegisteredBuf::new(mr, LANDING_PREFIX, len, &self.free))
    }

    /// The application gave up on its lent buffer `id` (the call was cancelled): it goes back
    /// to the free lists once released.
    pub(crate) fn unkeep(&mut self, id: BufId) {
        if self.keep.remove(&id) {
            if let Some(mr) = self.kept.remove(&id) {
                self.recycle(mr);
            }
        }
    }

    /// Held buffer `id`, holding `len` bytes from its start, handed to the application.
    pub(crate) fn hand_out(&mut self, id: BufId, len: usize) -> Option<RegisteredBuf> {
        let mr = self.held.remove(&id)?;
        (len <= mr.len()).then(|| RegisteredBuf::new(mr, 0, len, &self.free))
    }

    /// A buffer of at least `len` bytes, held under a fresh id.
    pub(crate) fn take(&mut self, len: usize) -> Result<(BufId, &mut MemoryRegion), RpcError> {
        let mr = self.fresh(len)?;
        let id = self.next;
        self.next += 1;
        let slot = self.held.entry(id).or_insert(mr);
        Ok((id, slot))
    }

    /// Stages `data` in a held buffer as [length][bytes] (the layout a landed response has, so
    /// the same buffer can be read by the peer or written into its landing buffer) and
    /// describes the bytes for the peer.
    pub(crate) fn lend(&mut self, data: &[u8]) -> Result<(RemoteRegion, BufId), RpcError> {
        let (id, mr) = self.take(LANDING_PREFIX + data.len())?;
        {
            let mut b = mr.bytes_mut();
            write_prefix(&mut b, data.len());
            b[LANDING_PREFIX..LANDING_PREFIX + data.len()].copy_from_slice(data);
        }
        let whole = mr.remote();
        let desc = RemoteRegion {
            addr: whole.addr + LANDING_PREFIX as u64,
            len: data.len() as u64,
            rkey: whole.rkey,
        };
        Ok((desc, id))
    }

    /// The bytes of a landed response in held buffer `id`, which is then freed.
    pub(crate) fn landed(&mut self, id: BufId) -> Result<Vec<u8>, RpcError> {
        let out = self.get(id).map(|mr| {
            let b = mr.bytes();
            let mut n = [0u8; 8];
            n.copy_from_slice(&b[..8]);
            let n = u64::from_le_bytes(n);
            usize::try_from(n)
                .ok()
                .filter(|&n| n <= b.len() - LANDING_PREFIX)
                .map(|n| b[LANDING_PREFIX..LANDING_PREFIX + n].to_vec())
                .ok_or_else(|| RpcError::Protocol(format!("landed response claims {n} bytes")))
        });
        self.release(id);
        out.unwrap_or_else(|| Err(RpcError::Protocol("landing buffer unknown".into())))
    }

    /// A held buffer, for reading its bytes.
    pub(crate) fn get(&self, id: BufId) -> Option<&MemoryRegion> {
        self.held.get(&id)
    }

    /// Takes a held buffer out (to post it); give it back with [`Stash::put_back`].
    pub(crate) fn take_out(&mut self, id: BufId) -> Option<MemoryRegion> {
        self.held.remove(&id)
    }

    pub(crate) fn put_back(&mut self, id: BufId, mr: MemoryRegion) {
        self.held.insert(id, mr);
    }

    /// The session says no peer can reach `id` any more: back to the free list.
    pub(crate) fn release(&mut self, id: BufId) {
        if let Some(mr) = self.held.remove(&id) {
            if self.keep.contains(&id) {
                self.kept.insert(id, mr);
            } else {
                self.recycle(mr);
            }
        }
    }

    /// A buffer no peer can reach through the session any more (see [`Free::put`]).
    pub(crate) fn recycle(&mut self, mr: MemoryRegion) {
        self.free.lock().put(mr);
    }
}

/// Writes the [`LANDING_PREFIX`] of a payload of `len` bytes to the start of `b`: the length,
/// then zeros.
fn write_prefix(b: &mut [u8], len: usize) {
    let (n, rest) = b[..LANDING_PREFIX].split_at_mut(8);
    n.copy_from_slice(&(len as u64).to_le_bytes());
    rest.fill(0);
}

/// A free buffer of `len` bytes' class from `free`, or a new registration with `pd`.
fn fresh(pd: &ProtectionDomain, free: &Mutex<Free>, len: usize) -> Result<MemoryRegion, RpcError> {
    let c = class(len);
    if let Some(mr) = free.lock().pop(c) {
        return Ok(mr);
    }
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    pd.register(c, access)
        .map_err(|e| RpcError::Transport(format!("registering a {c}-byte buffer: {e}")))
}

/// Registered buffers of the connection a request came on, for a handler that answers from
/// one ([`ServerBuilder::handler_buf`](crate::ServerBuilder::handler_buf)): the response then
/// goes to the caller straight from it, with no copy on the server. Cheap to clone.
#[derive(Clone)]
pub struct Buffers {
    pd: ProtectionDomain,
    free: Arc<Mutex<Free>>,
}

impl Buffers {
    /// A buffer of `len` bytes to fill (its bytes are not cleared: a reused buffer holds what
    /// it held). Dropping it gives it back to the connection.
    ///
    /// # Errors
    /// [`RpcError::Transport`] when the memory cannot be registered.
    pub fn buffer(&self, len: usize) -> Result<RegisteredBuf, RpcError> {
        let mr = fresh(&self.pd, &self.free, LANDING_PREFIX.saturating_add(len))?;
        Ok(RegisteredBuf::new(mr, LANDING_PREFIX, len, &self.free))
    }
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers").finish_non_exhaustive()
    }
}
