//! Registered buffers for rendezvous, per connection: size classes, reused, never registered on
//! the hot path once warm, and never reused while lent to the peer.

use std::sync::Arc;

use parking_lot::Mutex;

use rdma_rpc_transport::{AccessFlags, MemoryRegion, ProtectionDomain};

use crate::proto::RemoteRegion;

use crate::buf::{Body, RegisteredBuf};
pub(crate) use crate::free::Role;
use crate::free::{class, Free};
use crate::proto::{BufId, CallMap, Route, LANDING_PREFIX};
use crate::{Isolation, RpcError, TransportError};

/// The buffers of one connection: free ones by size class (shared with the application's
/// [`RegisteredBuf`]s, which come back to them when dropped), and those the session holds (lent
/// to the peer, or being read into) by id.
pub(crate) struct Stash {
    free: Arc<Mutex<Free>>,
    /// Every buffer the session knows by id, in one map: a call's buffer goes through several
    /// of the states below per round trip, each a lookup of the same entry. Ids go in
    /// sequence: an array indexed by their low bits finds them (see [`CallMap`]).
    entries: CallMap<BufId, Entry>,
    next: BufId,
    isolation: Isolation,
    /// Registering is only bookkeeping on this device
    /// ([`DeviceCaps::cheap_registration`](rdma_rpc_transport::DeviceCaps)): a large `Vec`
    /// payload is lent as it is, and a large body read into a `Vec` of its own, where
    /// elsewhere each is copied through a buffer of the free lists.
    vectors: bool,
    /// The connection's domain, to register vectors in without taking the free lists' lock.
    pd: ProtectionDomain,
    /// Buffers the application shares (a registered [`Bulk`](crate::Bulk)), lent as they
    /// are: held here until released, so that none goes back to the free lists while a peer
    /// may still read it, even when the application drops every handle to it.
    pinned: foldhash::HashMap<BufId, Arc<RegisteredBuf>>,
    /// Nothing is registered for peers to reach ([`Stash::private_only`]).
    private: bool,
}

/// A buffer the session knows by id.
struct Entry {
    /// `None` while it is out in a work request ([`Stash::take_out`]).
    mr: Option<MemoryRegion>,
    /// It belongs to the application: once released it waits for [`Stash::reclaim`].
    keep: bool,
    /// Released by the session; only a kept buffer stays in this state.
    released: bool,
    /// Registered from a `Vec` ([`Stash::lend_vec`], [`Stash::take_target`]): deregistered
    /// when released, never kept for reuse.
    vector: bool,
}

impl Entry {
    /// Held by the session (lent to the peer, or being read into), with its registration here.
    fn held(&self) -> bool {
        self.mr.is_some() && !self.released
    }
}

impl Stash {
    /// The buffers of a connection in `pd` whose free lists keep at most `cap` bytes.
    pub(crate) fn new(pd: &ProtectionDomain, isolation: Isolation, cap: usize) -> Self {
        Self {
            free: Arc::new(Mutex::new(Free::new(pd, isolation, cap))),
            entries: CallMap::default(),
            next: 1,
            isolation,
            vectors: pd.device().caps().cheap_registration,
            pd: pd.clone(),
            pinned: foldhash::HashMap::default(),
            private: false,
        }
    }

    /// Registers nothing a peer can reach, for a connection whose domain other connections
    /// share (a server on a receive pool): every buffer, the application's included, is
    /// registered for local access only, and nothing the application shares is lent as it is.
    pub(crate) fn private_only(&mut self) {
        self.private = true;
        self.free.lock().private = true;
    }

    /// Whether a payload longer than one message but below the eager threshold is better lent
    /// than sent in pieces: where registering costs (shm, verbs) pieces are copied three times
    /// and a lent payload once (by the peer's Read); where it is cheap (tcp) the pieces are
    /// quicker than a Read's round trip.
    pub(crate) fn lends_past_a_piece(&self) -> bool {
        !self.vectors
    }

    /// Lends a [`Bulk`](crate::Bulk): as it is when registered with this connection
    /// ([`Stash::lend_shared`]), the vector itself where registering is cheap and no clone
    /// shares it, else a copy in a buffer of the free lists. The flag says whether it was
    /// copied.
    pub(crate) fn lend_bulk(&mut self, bulk: crate::Bulk) -> Result<(RemoteRegion, BufId, bool), RpcError> {
        if let Some((desc, id)) = bulk.registered().and_then(|(buf, range)| self.lend_shared(buf, range)) {
            return Ok((desc, id, false));
        }
        let copied = !self.vectors;
        match bulk.try_into_whole_vec() {
            Ok(v) => self.lend_vec(v).map(|(desc, id)| (desc, id, copied)),
            Err(bulk) => self.lend(&bulk.bytes()).map(|(desc, id)| (desc, id, true)),
        }
    }

    /// Lends bytes `range` of a buffer the application shares, as it is: `None` when it must
    /// be copied instead (another connection's buffer, one peers may not read, or
    /// [`Isolation::Transfer`], whose keys die with each transfer).
    pub(crate) fn lend_shared(
        &mut self,
        buf: &Arc<RegisteredBuf>,
        range: std::ops::Range<usize>,
    ) -> Option<(RemoteRegion, BufId)> {
        if self.isolation == Isolation::Transfer || !buf.readable_on(&self.free) {
            return None;
        }
        let id = self.next;
        self.next += 1;
        self.pinned.insert(id, buf.clone());
        Some((buf.remote_range(range), id))
    }

    /// A free buffer of `len` bytes' class for `role`, or a new registration.
    fn fresh(&mut self, len: usize, role: Role) -> Result<MemoryRegion, RpcError> {
        fresh(&self.free, len, role)
    }

    /// A buffer for the application to fill: `len` bytes after room for the length prefix.
    pub(crate) fn user_buffer(&mut self, len: usize) -> Result<RegisteredBuf, RpcError> {
        self.buffers().buffer(len)
    }

    /// Hands out buffers of this connection, for a handler to answer from.
    pub(crate) fn buffers(&self) -> Buffers {
        Buffers {
            free: self.free.clone(),
        }
    }

    /// Lends the application's buffer (see [`RegisteredBuf::lendable_on`]) without copying it:
    /// writes its length prefix and holds it under a fresh id. With `keep`, [`Stash::reclaim`]
    /// gives it back to the application; otherwise it goes to the free lists when released.
    /// The same layout serves a Send straight from the buffer
    /// ([`Payload::Placed`](crate::proto::Payload::Placed)): the header goes over the prefix.
    fn lend_user(&mut self, buf: RegisteredBuf, keep: bool) -> Result<(RemoteRegion, BufId), RegisteredBuf> {
        if !buf.lendable_on(&self.free, LANDING_PREFIX) {
            return Err(buf);
        }
        let len = buf.len();
        let mut mr = buf.into_region();
        write_prefix(&mut mr.bytes_mut(), len);
        let whole = crate::region::desc(mr.remote());
        let desc = RemoteRegion {
            addr: whole.addr + LANDING_PREFIX as u64,
            len: len as u64,
            rkey: whole.rkey,
        };
        Ok((desc, self.hold(mr, keep)))
    }

    /// As [`Stash::lend_user`] for a buffer a Send goes out from
    /// ([`Payload::Placed`](crate::proto::Payload::Placed)): the message's header goes where
    /// the prefix would, so none is written.
    fn place_user(&mut self, buf: RegisteredBuf, keep: bool) -> Result<BufId, RegisteredBuf> {
        if !buf.lendable_on(&self.free, LANDING_PREFIX) {
            return Err(buf);
        }
        Ok(self.hold(buf.into_region(), keep))
    }

    /// Stages the application's buffer as `route` says, without a copy: lent (with the
    /// descriptor the peer reads it by) or held to be sent from as it is. `Err` gives the
    /// buffer back when it must be copied instead: the route says so, or it is another
    /// connection's (see [`RegisteredBuf::lendable_on`]).
    pub(crate) fn stage_user(
        &mut self,
        buf: RegisteredBuf,
        route: Route,
        keep: bool,
    ) -> Result<(Option<RemoteRegion>, BufId), RegisteredBuf> {
        match route {
            Route::Lend => self.lend_user(buf, keep).map(|(desc, id)| (Some(desc), id)),
            Route::Place => self.place_user(buf, keep).map(|id| (None, id)),
            Route::Copy => Err(buf),
        }
    }

    /// Holds `mr` under a fresh id.
    fn hold(&mut self, mr: MemoryRegion, keep: bool) -> BufId {
        self.hold_as(mr, keep, false)
    }

    fn hold_as(&mut self, mr: MemoryRegion, keep: bool, vector: bool) -> BufId {
        let id = self.next;
        self.next += 1;
        let entry = Entry {
            mr: Some(mr),
            keep,
            released: false,
            vector,
        };
        self.entries.insert(id, entry);
        id
    }

    /// Whether the application's buffer `id` is out in a work request (neither held nor
    /// released yet): a Send from it whose completion has not come back.
    pub(crate) fn in_flight(&self, id: BufId) -> bool {
        self.entries.get(id).is_some_and(|e| e.keep && e.mr.is_none())
    }

    /// The application's lent buffer `id` of `len` bytes back, once no peer reaches it any more
    /// (released, or about to be: its call finished). With [`Isolation::Transfer`] its bytes
    /// move to a fresh registration, so that the old rkey dies.
    pub(crate) fn reclaim(&mut self, id: BufId, len: usize) -> Option<RegisteredBuf> {
        let e = self.entries.get_mut(id)?;
        if e.mr.is_none() {
            // Still out in a work request: when it comes back it is the connection's.
            e.keep = false;
            return None;
        }
        let mr = self.entries.remove(id)?.mr?;
        if self.isolation == Isolation::Transfer {
            let mut fresh = self.fresh(mr.len(), Role::Lend).ok()?;
            fresh.bytes_mut().copy_from_slice(&mr.bytes());
            return Some(RegisteredBuf::new(fresh, LANDING_PREFIX, len, &self.free));
        }
        Some(RegisteredBuf::new(mr, LANDING_PREFIX, len, &self.free))
    }

    /// As [`Stash::reclaim`] once no peer can reach the application's buffer `id` any more (the
    /// Send from it completed, or its lending ended), while its call may still wait for a
    /// response; `None`, with nothing changed, while it is still out.
    pub(crate) fn reclaim_released(&mut self, id: BufId, len: usize) -> Option<RegisteredBuf> {
        let e = self.entries.get(id)?;
        if !(e.keep && e.released && e.mr.is_some()) {
            return None;
        }
        self.reclaim(id, len)
    }

    /// The application gave up on its lent buffer `id` (the call was cancelled): it goes back
    /// to the free lists once released.
    pub(crate) fn unkeep(&mut self, id: BufId) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        if !e.keep {
            return;
        }
        if !e.released {
            e.keep = false;
        } else if let Some(mr) = self.entries.remove(id).and_then(|e| e.mr) {
            self.recycle(mr);
        }
    }

    /// Removes held buffer `id` and gives its registration.
    fn remove_held(&mut self, id: BufId) -> Option<MemoryRegion> {
        if !self.entries.get(id).is_some_and(Entry::held) {
            return None;
        }
        self.entries.remove(id).and_then(|e| e.mr)
    }

    /// Held buffer `id`, holding `len` bytes from its start, handed to the application.
    pub(crate) fn hand_out(&mut self, id: BufId, len: usize) -> Option<RegisteredBuf> {
        let mr = self.remove_held(id)?;
        (len <= mr.len()).then(|| RegisteredBuf::new(mr, 0, len, &self.free))
    }

    /// Held buffer `id`, holding `len` bytes from its start, as a body for the application: a
    /// vector read into ([`Stash::take_target`]) as that vector, any other buffer as it is.
    pub(crate) fn hand_out_body(&mut self, id: BufId, len: usize) -> Option<Body> {
        match self.entries.get(id)?.vector {
            true => self.take_vec(id, len).map(Body::Bytes),
            false => self.hand_out(id, len).map(Body::Registered),
        }
    }

    /// The first `len` bytes of held buffer `id` as a vector, and the buffer freed: a vector
    /// read into is given back as it is, others copied out (and back to the free lists).
    pub(crate) fn take_vec(&mut self, id: BufId, len: usize) -> Option<Vec<u8>> {
        let vector = self.entries.get(id).is_some_and(|e| e.vector);
        let mr = self.remove_held(id)?;
        if len > mr.len() {
            return None;
        }
        if vector {
            // Whole and ours alone (a completed Read's target): never a copy in practice.
            let mut v = mr.into_vec().unwrap_or_else(|mr| mr.bytes().to_vec());
            v.truncate(len);
            return Some(v);
        }
        let v = mr.bytes()[..len].to_vec();
        self.recycle(mr);
        Some(v)
    }

    /// A buffer for an RDMA Read of `len` bytes, held under a fresh id: a new vector of its
    /// own where registering is cheap (handed on with no copy, [`Stash::take_vec`]), else one
    /// of the free lists for `role`.
    pub(crate) fn take_target(&mut self, len: usize, role: Role) -> Result<BufId, RpcError> {
        if !self.vectors || len == 0 {
            return self.take(len, role).map(|(id, _)| id);
        }
        // A refusal of the allocator is an error of this call, not an abort of the process.
        let mr = self.pd.register_zeroed_vec(len, AccessFlags::LOCAL_WRITE);
        let mr = mr.map_err(|e| {
            RpcError::Transport(TransportError::with(
                format!(
                    "registering a {len}-byte vector to read a rendezvous body into (or lower Config::max_payload)"
                ),
                e,
            ))
        })?;
        Ok(self.hold_as(mr, false, true))
    }

    /// Lends `data` for the peer to read: the vector itself where registering is cheap, else
    /// a copy in a buffer of the free lists ([`Stash::lend`]).
    pub(crate) fn lend_vec(&mut self, data: Vec<u8>) -> Result<(RemoteRegion, BufId), RpcError> {
        if !self.vectors || data.is_empty() || self.private {
            return self.lend(&data);
        }
        let len = data.len();
        let mr = self.pd.register_vec(data, AccessFlags::REMOTE_READ);
        let mr =
            mr.map_err(|e| RpcError::Transport(TransportError::with(format!("registering a {len}-byte vector"), e)))?;
        let desc = crate::region::desc(mr.remote());
        Ok((desc, self.hold_as(mr, false, true)))
    }

    /// A buffer of at least `len` bytes for `role`, held under a fresh id.
    pub(crate) fn take(&mut self, len: usize, role: Role) -> Result<(BufId, &mut MemoryRegion), RpcError> {
        let mr = self.fresh(len, role)?;
        let id = self.hold(mr, false);
        match self.entries.get_mut(id).and_then(|e| e.mr.as_mut()) {
            Some(mr) => Ok((id, mr)),
            None => Err(RpcError::Internal("a buffer just held went missing".into())),
        }
    }

    /// Stages `data` in a held buffer as [length][bytes] (the layout a landed response has, so
    /// the same buffer can be read by the peer or written into its landing buffer) and
    /// describes the bytes for the peer.
    pub(crate) fn lend(&mut self, data: &[u8]) -> Result<(RemoteRegion, BufId), RpcError> {
        let (id, mr) = self.take(LANDING_PREFIX + data.len(), Role::Lend)?;
        {
            let mut b = mr.bytes_mut();
            write_prefix(&mut b, data.len());
            b[LANDING_PREFIX..LANDING_PREFIX + data.len()].copy_from_slice(data);
        }
        let whole = crate::region::desc(mr.remote());
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
        self.entries.get(id).filter(|e| e.held()).and_then(|e| e.mr.as_ref())
    }

    /// Takes a held buffer out (to post it); give it back with [`Stash::put_back`].
    pub(crate) fn take_out(&mut self, id: BufId) -> Option<MemoryRegion> {
        self.entries
            .get_mut(id)
            .filter(|e| !e.released)
            .and_then(|e| e.mr.take())
    }

    pub(crate) fn put_back(&mut self, id: BufId, mr: MemoryRegion) {
        match self.entries.get_mut(id) {
            Some(e) => e.mr = Some(mr),
            None => {
                let entry = Entry {
                    mr: Some(mr),
                    keep: false,
                    released: false,
                    vector: false,
                };
                self.entries.insert(id, entry);
            }
        }
    }

    /// The session says no peer can reach `id` any more: back to the free list (or, for the
    /// application's, waiting for [`Stash::reclaim`]). A buffer out in a work request is
    /// released after it is put back.
    pub(crate) fn release(&mut self, id: BufId) {
        if !self.pinned.is_empty() && self.pinned.remove(&id).is_some() {
            return;
        }
        let Some(e) = self.entries.get_mut(id).filter(|e| e.held()) else {
            return;
        };
        if e.keep {
            e.released = true;
        } else if let Some(e) = self.entries.remove(id) {
            // A vector's registration dies with it (and its rkey with that).
            if let (Some(mr), false) = (e.mr, e.vector) {
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

/// A free buffer of `len` bytes' class for `role` from `free`, or a new registration with its
/// domain.
fn fresh(free: &Mutex<Free>, len: usize, role: Role) -> Result<MemoryRegion, RpcError> {
    let c = class(len).ok_or_else(|| {
        RpcError::Transport(TransportError::new(format!(
            "a buffer of {len} bytes cannot be registered"
        )))
    })?;
    let (pd, role) = {
        let mut f = free.lock();
        let role = f.role(role);
        if let Some(mr) = f.pop(c, role) {
            return Ok(mr);
        }
        (f.pd.clone(), role)
    };
    let n = registered_len(c, len, pd.device().caps().max_mr_size);
    pd.register(n, role.access())
        .map_err(|e| RpcError::Transport(TransportError::with(format!("registering a {n}-byte buffer"), e)))
}

/// The bytes to register for a buffer of `len` bytes whose class is `class`, on a device whose
/// largest registration is `max_mr`: the class, or `len` alone where only the class is beyond
/// it (a class holds [`SLACK`] past its power of two). Such a buffer is of no class's size,
/// so it is deregistered when done with, not kept.
fn registered_len(class: usize, len: usize, max_mr: u64) -> usize {
    if class as u64 > max_mr {
        len
    } else {
        class
    }
}

/// Registered buffers of the connection a request came on, for a handler that answers from
/// one ([`context::buffers`](crate::context::buffers)): the response then
/// goes to the caller straight from it, with no copy on the server. Cheap to clone.
#[derive(Clone)]
pub struct Buffers {
    free: Arc<Mutex<Free>>,
}

impl Buffers {
    /// A buffer of `len` bytes to fill (its bytes are not cleared: a reused buffer holds what
    /// it held). Dropping it gives it back to the connection.
    ///
    /// # Errors
    /// [`RpcError::Transport`] when the memory cannot be registered.
    pub fn buffer(&self, len: usize) -> Result<RegisteredBuf, RpcError> {
        let mr = fresh(&self.free, LANDING_PREFIX.saturating_add(len), Role::Lend)?;
        Ok(RegisteredBuf::new(mr, LANDING_PREFIX, len, &self.free))
    }
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::free::{class_index, KEEP, MIN_CLASS, SLACK};

    fn stash() -> Stash {
        let dev = rdma_rpc_transport::Device::open("tcp").expect("the tcp provider");
        let pd = dev.alloc_pd().expect("a protection domain");
        Stash::new(&pd, Isolation::Connection, usize::MAX)
    }

    fn free_count(s: &Stash) -> usize {
        s.free.lock().lists.iter().flatten().map(Vec::len).sum()
    }

    /// Whether a peer could reach `mr` by any one-sided operation.
    fn reachable(mr: &MemoryRegion) -> bool {
        [
            AccessFlags::REMOTE_READ,
            AccessFlags::REMOTE_WRITE,
            AccessFlags::REMOTE_ATOMIC,
        ]
        .into_iter()
        .any(|f| mr.access().contains(f))
    }

    /// A stash whose domain other connections share (a server on a receive pool) registers
    /// nothing a peer can reach, whatever role a buffer is asked for, and lends no buffer of the
    /// application's as it is.
    #[test]
    fn a_private_stash_registers_nothing_a_peer_can_reach() {
        let mut s = stash();
        s.private_only();
        let held = |s: &Stash, id: BufId| s.entries.get(id).and_then(|e| e.mr.as_ref()).map(reachable);
        let (_, lent) = s.lend(&[1; 5000]).expect("lend");
        let (_, vector) = s.lend_vec(vec![2; 70_000]).expect("lend a vector");
        let (landing, _) = s.take(100, Role::Land).expect("a landing buffer");
        let target = s.take_target(3000, Role::Lend).expect("a read target");
        for (what, id) in [
            ("lent", lent),
            ("lent vector", vector),
            ("landing", landing),
            ("read target", target),
        ] {
            assert_eq!(held(&s, id), Some(false), "{what}: registered for peers to reach");
        }
        let user = s.user_buffer(100).expect("a buffer");
        assert!(
            !user.readable_on(&s.free),
            "the application's buffer: readable by peers"
        );
        let shared = Arc::new(user);
        assert!(s.lend_shared(&shared, 0..100).is_none(), "lent as it is");
    }

    #[test]
    fn an_application_buffer_goes_out_comes_back_and_is_reclaimed() {
        let mut s = stash();
        let buf = s.user_buffer(100).expect("a buffer");
        let (desc, id) = s.lend_user(buf, true).expect("lendable");
        assert_eq!(desc.len, 100);
        assert!(s.get(id).is_some() && !s.in_flight(id));
        let mr = s.take_out(id).expect("held");
        assert!(s.in_flight(id) && s.get(id).is_none());
        s.release(id); // out in a work request: nothing to release yet
        assert!(s.in_flight(id));
        s.put_back(id, mr);
        assert!(!s.in_flight(id));
        s.release(id);
        // Kept for the application, not the session's any more.
        assert!(s.get(id).is_none() && s.take_out(id).is_none() && !s.in_flight(id));
        assert_eq!(free_count(&s), 0);
        let back = s.reclaim(id, 100).expect("the application's buffer");
        assert_eq!(back.len(), 100);
        assert!(s.entries.is_empty());
        drop(back);
        assert_eq!(free_count(&s), 1, "a dropped buffer goes back to the free lists");
    }

    #[test]
    fn a_buffer_reclaimed_while_out_returns_to_the_free_lists() {
        let mut s = stash();
        let buf = s.user_buffer(10).expect("a buffer");
        let (_, id) = s.lend_user(buf, true).expect("lendable");
        let mr = s.take_out(id).expect("held");
        assert!(s.reclaim(id, 10).is_none());
        assert!(!s.in_flight(id), "no longer the application's to wait for");
        s.put_back(id, mr);
        s.release(id);
        assert!(s.entries.is_empty());
        assert_eq!(free_count(&s), 1);
    }

    #[test]
    fn a_buffer_comes_back_early_only_once_no_peer_reaches_it() {
        let mut s = stash();
        let buf = s.user_buffer(100).expect("a buffer");
        let (_, id) = s.lend_user(buf, true).expect("lendable");
        // Lent, not released: the peer may still read it.
        assert!(s.reclaim_released(id, 100).is_none());
        // Out in a work request: neither released nor here.
        let mr = s.take_out(id).expect("held");
        assert!(s.reclaim_released(id, 100).is_none());
        s.put_back(id, mr);
        assert!(s.reclaim_released(id, 100).is_none(), "back, but not released yet");
        // Asking early changed nothing: still the application's.
        assert!(s.in_flight(id) || s.get(id).is_some());
        s.release(id);
        let back = s.reclaim_released(id, 100).expect("released: the application's again");
        assert_eq!(back.len(), 100);
        assert!(s.entries.is_empty() && s.reclaim_released(id, 100).is_none());
        // A buffer the application gave up on (a cancelled call) never comes back early.
        let (_, id) = s.lend_user(back, true).expect("lendable");
        s.unkeep(id);
        s.release(id);
        assert!(s.reclaim_released(id, 100).is_none());
        assert_eq!(free_count(&s), 1);
    }

    #[test]
    fn unkeep_hands_a_released_buffer_to_the_free_lists() {
        let mut s = stash();
        let buf = s.user_buffer(10).expect("a buffer");
        let (_, id) = s.lend_user(buf, true).expect("lendable");
        s.release(id);
        assert_eq!(free_count(&s), 0);
        s.unkeep(id);
        assert_eq!(free_count(&s), 1);
        assert!(s.entries.is_empty() && s.reclaim(id, 10).is_none());
        // Unkept before release: released straight to the free lists.
        let buf = s.user_buffer(10).expect("a buffer");
        let (_, id) = s.lend_user(buf, true).expect("lendable");
        s.unkeep(id);
        s.release(id);
        assert_eq!(
            free_count(&s),
            1,
            "the same class's buffer was reused, then freed again"
        );
        assert!(s.entries.is_empty());
    }

    /// The sizes of the classes of 4 KiB and 16 KiB.
    const C4: usize = 4096 + SLACK;
    const C16: usize = 16384 + SLACK;

    #[test]
    fn session_buffers_are_released_and_reused_by_class() {
        let mut s = stash();
        let (id, _) = s.take(5000, Role::Lend).expect("a buffer");
        assert!(s.get(id).is_some_and(|m| m.len() == 8192 + SLACK));
        let mr = s.take_out(id).expect("held");
        s.put_back(id, mr);
        s.release(id);
        assert!(s.entries.is_empty() && s.get(id).is_none());
        assert_eq!(free_count(&s), 1);
        let (id2, _) = s.take(6000, Role::Lend).expect("the same class");
        assert_ne!(id, id2);
        assert_eq!(free_count(&s), 0, "taken from the free list");
        let out = s.hand_out(id2, 6000).expect("held");
        assert_eq!(out.len(), 6000);
        assert!(s.hand_out(id2, 1).is_none());
    }

    #[test]
    fn free_lists_keep_only_class_sized_buffers_and_at_most_keep_each() {
        let dev = rdma_rpc_transport::Device::open("tcp").expect("the tcp provider");
        let pd = dev.alloc_pd().expect("a protection domain");
        let mut f = Free::new(&pd, Isolation::Connection, usize::MAX);
        f.put(pd.register(5000, Role::Lend.access()).expect("reg"));
        assert!(f.lists.iter().flatten().all(Vec::is_empty), "5000 bytes is no class");
        f.put(pd.register(C4 - SLACK, Role::Lend.access()).expect("reg"));
        assert!(
            f.lists.iter().flatten().all(Vec::is_empty),
            "a power of two alone is no class"
        );
        f.put(
            pd.register(C16, AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_ATOMIC))
                .expect("reg"),
        );
        f.put(pd.register_vec(vec![0; C16], AccessFlags::REMOTE_READ).expect("reg"));
        assert!(
            f.lists.iter().flatten().all(Vec::is_empty),
            "other access flags than the stash's"
        );
        for _ in 0..KEEP + 2 {
            f.put(pd.register(C16, Role::Lend.access()).expect("reg"));
        }
        assert_eq!(f.lists[0].get(2).map(Vec::len), Some(KEEP));
        assert!(
            f.pop(C16, Role::Lend).is_some()
                && f.pop(C16, Role::Land).is_none()
                && f.pop(C4, Role::Lend).is_none()
                && f.pop((1 << 40) + SLACK, Role::Lend).is_none()
        );
    }

    #[test]
    fn free_lists_keep_at_most_their_cap_in_bytes() {
        let dev = rdma_rpc_transport::Device::open("tcp").expect("the tcp provider");
        let pd = dev.alloc_pd().expect("a protection domain");
        let mut f = Free::new(&pd, Isolation::Connection, 3 * C16 + C4);
        for _ in 0..5 {
            f.put(pd.register(C16, Role::Lend.access()).expect("reg"));
        }
        assert_eq!((f.lists[0].get(2).map(Vec::len), f.kept), (Some(3), 3 * C16));
        f.put(pd.register(C4, Role::Lend.access()).expect("reg"));
        f.put(pd.register(C4, Role::Lend.access()).expect("reg"));
        assert_eq!(f.kept, 3 * C16 + C4, "a smaller class fills what is left");
        assert!(f.pop(C16, Role::Lend).is_some());
        assert_eq!(f.kept, 2 * C16 + C4, "a buffer taken out no longer counts");
        f.put(pd.register(C16, Role::Lend.access()).expect("reg"));
        assert_eq!(f.kept, 3 * C16 + C4, "its room is there again");
        // What the lists let go of is deregistered: only what they keep stays counted.
        assert_eq!(dev.registered_bytes(), f.kept as u64);
        let mut none = Free::new(&pd, Isolation::Connection, 0);
        none.put(pd.register(C4, Role::Lend.access()).expect("reg"));
        assert_eq!(
            (none.kept, none.lists.iter().flatten().map(Vec::len).sum::<usize>()),
            (0, 0)
        );
    }

    #[test]
    fn a_power_of_two_payload_and_its_prefix_take_the_class_of_its_own_length() {
        for p in [4096usize, 1 << 20, 1 << 30] {
            assert_eq!(class(p + LANDING_PREFIX), Some(p + SLACK), "lent or landed");
            assert_eq!(class(p), Some(p + SLACK), "read into");
            assert_eq!(class(p + LANDING_PREFIX + 1), Some(2 * p + SLACK));
            assert_eq!(class_index(p + SLACK).map(|i| MIN_CLASS << i), Some(p));
            assert_eq!(class_index(p), None);
        }
        assert_eq!(class(1), Some(C4));
        // On a device whose largest registration is 4 GiB (shm's), a 3 GiB payload's class
        // (4 GiB and the slack) is beyond it: the payload's own length is registered instead.
        let (len, max) = (3usize << 30, 4u64 << 30);
        assert_eq!(class(len), Some((4 << 30) + SLACK));
        assert_eq!(class(len).map(|c| registered_len(c, len, max)), Some(len));
        assert_eq!(class_index(len), None, "kept by no free list");
        assert_eq!(registered_len(C4, 100, max), C4);
        assert_eq!(class(usize::MAX - 10), None);
        assert_eq!(class_index(0), None);
    }
}
