//! Registered buffers for rendezvous, per connection: size classes, reused, never registered on
//! the hot path once warm, and never reused while lent to the peer.

use foldhash::HashMap;

use rdma_rpc_transport::{AccessFlags, MemoryRegion, ProtectionDomain, RemoteRegion};

use crate::proto::{BufId, LANDING_PREFIX};
use crate::{Isolation, RpcError};

/// The buffers of one connection: free ones by size class, and those the session holds (lent to
/// the peer, or being read into) by id.
pub(crate) struct Stash {
    pd: ProtectionDomain,
    free: HashMap<usize, Vec<MemoryRegion>>,
    held: HashMap<BufId, MemoryRegion>,
    next: BufId,
    registered: usize,
    isolation: Isolation,
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
            free: HashMap::default(),
            held: HashMap::default(),
            next: 1,
            registered: 0,
            isolation,
        }
    }

    /// A buffer of at least `len` bytes, held under a fresh id.
    pub(crate) fn take(&mut self, len: usize) -> Result<(BufId, &mut MemoryRegion), RpcError> {
        let c = class(len);
        let mr = match self.free.get_mut(&c).and_then(Vec::pop) {
            Some(mr) => mr,
            None => {
                let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
                let mr = self
                    .pd
                    .register(c, access)
                    .map_err(|e| RpcError::Transport(format!("registering a {c}-byte rendezvous buffer: {e}")))?;
                self.registered += c;
                mr
            }
        };
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
            b[..LANDING_PREFIX].copy_from_slice(&(data.len() as u64).to_le_bytes());
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
            let mut n = [0u8; LANDING_PREFIX];
            n.copy_from_slice(&b[..LANDING_PREFIX]);
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
            self.recycle(mr);
        }
    }

    /// A buffer no peer can reach through the session any more: kept for reuse, or (with
    /// [`Isolation::Transfer`], or beyond [`KEEP`]) deregistered, so that its rkey dies.
    pub(crate) fn recycle(&mut self, mr: MemoryRegion) {
        let list = self.free.entry(mr.len()).or_default();
        if self.isolation == Isolation::Connection && list.len() < KEEP {
            list.push(mr);
        } else {
            self.registered -= mr.len();
        }
    }
}
