//! Registered memory of the shm provider, and what a peer may reach of it.
//!
//! Each registration is a sealed memfd of its own (a segment), mapped by this process. A peer
//! gets a segment only under a key (`grant`), and only as a NIC would let it reach the memory:
//! read-only where only REMOTE_READ was granted, read-write where REMOTE_WRITE or REMOTE_ATOMIC
//! was, nothing otherwise (receives are delivered through the receive queue, `rq`). The kernel enforces what it was given: a descriptor opened
//! read-only cannot be mapped writable, and no descriptor of the rest ever leaves the process.
//!
//! The protection domain's table (one memfd, which peers map read-only) holds a word per
//! registration: the tag it was published with, zero once it is withdrawn. A peer checks the
//! word before each access, so a deregistered key stops working at once, as on a NIC; the
//! table names no key, so reading it reveals none.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

// The model-checking build (`--cfg rdma_loom`): the table's words are loom's atomics, built in
// place (`Arena::new`).
#[cfg(rdma_loom)]
use loom::sync::atomic::AtomicU64 as TableWord;
#[cfg(not(rdma_loom))]
use std::sync::atomic::AtomicU64 as TableWord;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::grant::{Grants, Server, Want};
use super::sys::{self, Mapping};
use crate::{AccessFlags, Error, Result, WcStatus};

/// Largest registration.
pub(crate) const MAX_MR: u64 = 4 << 30;
/// Registrations a protection domain holds at once (a table word each; a few in the models).
pub(crate) const SLOTS: usize = if cfg!(rdma_loom) { 4 } else { 1 << 17 };
/// Bytes of the table.
pub(crate) const TABLE: usize = SLOTS * std::mem::size_of::<TableWord>();
const PAGE: usize = 4096;
/// Keys never handed out: 0 (never published) and the all-ones word.
const RESERVED: [u32; 2] = [0, u32::MAX];

/// One registration's memory: a sealed memfd, mapped here; peers map it only once granted.
pub(crate) struct Segment {
    /// Kept while a peer may be granted it (one descriptor per registration with remote
    /// access).
    pub(crate) fd: Option<OwnedFd>,
    map: Mapping,
}

impl Segment {
    /// `len` zeroed bytes (rounded up to pages); `grantable` keeps the descriptor, for
    /// registrations a peer may reach (remote access).
    pub(crate) fn new(len: usize, grantable: bool) -> Result<Arc<Segment>> {
        let size = len.max(1).div_ceil(PAGE) * PAGE;
        let fd = sys::sealed_memfd("rdma-rpc-shm-mr", size as u64).map_err(|e| Error::io("creating shm memory", e))?;
        let map = Mapping::map(&fd, size).map_err(|e| Error::io("mapping shm memory", e))?;
        Ok(Arc::new(Segment {
            fd: grantable.then_some(fd),
            map,
        }))
    }

    /// The first byte (page aligned).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.map.ptr()
    }
}

/// A published registration, under one of its keys.
#[derive(Clone)]
pub(crate) struct Published {
    pub(crate) seg: Arc<Segment>,
    pub(crate) slot: u32,
    pub(crate) tag: u64,
    /// The owner's virtual address of the first byte (what `RemoteRegion::addr` names).
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// What this key allows: the registration's flags under its rkey, LOCAL_WRITE at most
    /// under its lkey (receives), which no one-sided operation accepts.
    pub(crate) access: AccessFlags,
}

struct Registry {
    keys: HashMap<u32, Published>,
    free: Vec<u32>,
    next_slot: u32,
    next_tag: u64,
    /// The connections of this protection domain: pushed the grants of new registrations.
    servers: Vec<Weak<Server>>,
}

/// This process's registrations of one protection domain, and the table peers check.
pub(crate) struct Arena {
    /// The table's memfd: peers get it read-only.
    pub(crate) table_fd: OwnedFd,
    table: Mapping,
    reg: Mutex<Registry>,
}

/// Whether `access` lets peers reach a registration one-sidedly.
fn remote(access: AccessFlags) -> bool {
    let any = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    access.bits() & any.bits() != 0
}

/// The table word of `slot` (`slot < SLOTS`).
fn word(table: &Mapping, slot: u32) -> &TableWord {
    debug_assert!((slot as usize) < SLOTS);
    // SAFETY: the table mapping is TABLE bytes, page aligned, so word `slot % SLOTS` is inside
    // it and aligned; a word is valid for any bits (zero when fresh; under loom, built in place
    // by `Arena::new`), and every access to it, here and in peers, is atomic.
    unsafe { &*table.ptr().cast::<TableWord>().add(slot as usize % SLOTS) }
}

/// Whether the registration a grant of `slot`/`tag` names is still published.
pub(crate) fn live(table: &Mapping, slot: u32, tag: u64) -> bool {
    (slot as usize) < SLOTS && word(table, slot).load(Ordering::Acquire) == tag
}

impl Arena {
    pub(crate) fn new() -> Result<Arc<Arena>> {
        let io = |what| move |e| Error::io(what, e);
        let table_fd = sys::sealed_memfd("rdma-rpc-shm-pd", TABLE as u64).map_err(io("creating the shm key table"))?;
        let table = Mapping::map(&table_fd, TABLE).map_err(io("mapping the shm key table"))?;
        #[cfg(rdma_loom)]
        for i in 0..SLOTS {
            // SAFETY: a fresh mapping of TABLE bytes that nothing refers to yet.
            unsafe { table.ptr().cast::<TableWord>().add(i).write(TableWord::new(0)) };
        }
        Ok(Arc::new(Arena {
            table_fd,
            table,
            reg: Mutex::new(Registry {
                keys: HashMap::new(),
                free: Vec::new(),
                next_slot: 0,
                next_tag: 1,
                servers: Vec::new(),
            }),
        }))
    }

    /// Publishes a registration under its two keys: `access` under the rkey, LOCAL_WRITE (if
    /// granted) under the lkey.
    pub(crate) fn publish(
        &self,
        (lkey, rkey): (u32, u32),
        access: AccessFlags,
        seg: &Arc<Segment>,
        addr: u64,
        len: u64,
    ) -> Result<()> {
        let mut reg = self.reg.lock();
        let slot = match reg.free.pop() {
            Some(s) => s,
            None if (reg.next_slot as usize) < SLOTS => {
                reg.next_slot += 1;
                reg.next_slot - 1
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "an shm protection domain holds at most {SLOTS} registrations: deregister some"
                )))
            }
        };
        let tag = reg.next_tag;
        reg.next_tag += 1;
        let entry = |access| Published {
            seg: seg.clone(),
            slot,
            tag,
            addr,
            len,
            access,
        };
        let local = if access.contains(AccessFlags::LOCAL_WRITE) {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::NONE
        };
        reg.keys.insert(rkey, entry(access));
        reg.keys.insert(lkey, entry(local));
        word(&self.table, slot).store(tag, Ordering::Release);
        let servers: Vec<_> = reg.servers.iter().filter_map(Weak::upgrade).collect();
        drop(reg);
        if remote(access) {
            for s in servers {
                s.push(Want::Remote, rkey);
            }
        }
        Ok(())
    }

    /// Takes a registration out: a peer's next access under either key fails.
    pub(crate) fn withdraw(&self, (lkey, rkey): (u32, u32)) {
        let mut reg = self.reg.lock();
        let Some(p) = reg.keys.remove(&rkey) else { return };
        reg.keys.remove(&lkey);
        word(&self.table, p.slot).store(0, Ordering::Release);
        reg.free.push(p.slot);
    }

    /// The registration `key` names, if published.
    pub(crate) fn lookup(&self, key: u32) -> Option<Published> {
        self.reg.lock().keys.get(&key).cloned()
    }

    /// True if `key` names a published registration.
    pub(crate) fn contains(&self, key: u32) -> bool {
        self.reg.lock().keys.contains_key(&key)
    }

    /// True if `key` may be handed out.
    pub(crate) fn usable_key(key: u32) -> bool {
        !RESERVED.contains(&key)
    }

    /// Tracks a connection's server (see `Registry::servers`).
    pub(crate) fn track(&self, server: &Arc<Server>) {
        let mut reg = self.reg.lock();
        reg.servers.retain(|w| w.strong_count() > 0);
        reg.servers.push(Arc::downgrade(server));
    }

    /// The rkeys published with remote access.
    pub(crate) fn remote_keys(&self) -> Vec<u32> {
        let reg = self.reg.lock();
        reg.keys
            .iter()
            .filter(|(_, p)| remote(p.access))
            .map(|(&k, _)| k)
            .collect()
    }
}

/// A grant just written through, still held. Letting it go is a locked instruction, which
/// waits until the copy's stores have left this core: dropped after the completion the peer
/// polls for is written, it delays nothing the peer waits for (dropped before, it delayed
/// each delivery by the time the copied lines take to reach the peer's core).
pub(crate) struct Held<'a>(#[allow(dead_code)] parking_lot::MappedRwLockReadGuard<'a, super::grant::Grant>);

/// A peer's memory as granted to us: the target of one-sided operations and deliveries.
pub(crate) struct PeerArena {
    grants: Arc<Grants>,
}

impl PeerArena {
    pub(crate) fn new(grants: Arc<Grants>) -> PeerArena {
        PeerArena { grants }
    }

    pub(crate) fn grants(&self) -> &Grants {
        &self.grants
    }

    /// RDMA Read: `dst.len()` bytes at `addr` into `dst`; `None` when this side holds no grant
    /// of `rkey` (the Read goes as a frame: see `grant`).
    pub(crate) fn read(&self, addr: u64, rkey: u32, dst: &mut [u8]) -> Option<std::result::Result<(), WcStatus>> {
        self.grants.with(rkey, Want::Remote, |g| {
            let src = g.at(addr, dst.len(), AccessFlags::REMOTE_READ)?;
            if let Some(within) = g.atomic_bounds() {
                // SAFETY: `at` proved the range inside the granted mapping; its words are
                // reached only by atomics or these copies.
                unsafe { crate::words::copy_out(src, dst, within) };
                return Ok(());
            }
            // SAFETY: `at` proved `[src, src + len)` inside our mapping of the granted segment;
            // `dst` is our own memory; the peer may write the source concurrently (as with
            // DMA): the bytes copied are then some mix, never an out-of-bounds access.
            unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
            Ok(())
        })
    }

    /// RDMA Write: `src` to `addr`; `None` as for [`PeerArena::read`]. Hold the result until
    /// the completion is written.
    pub(crate) fn write(&self, addr: u64, rkey: u32, src: &[u8]) -> Option<std::result::Result<Held<'_>, WcStatus>> {
        let g = self.grants.get(rkey, Want::Remote)?;
        let dst = match g.at(addr, src.len(), AccessFlags::REMOTE_WRITE) {
            Ok(dst) => dst,
            Err(status) => return Some(Err(status)),
        };
        match g.atomic_bounds() {
            // SAFETY: as in `read`, the other way.
            Some(within) => unsafe { crate::words::copy_in(dst, src, within) },
            // SAFETY: as in `read`, the other way; REMOTE_WRITE grants are mapped writable.
            None => unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) },
        }
        Some(Ok(Held(g)))
    }

    /// CAS or FAA on the 8-byte word at `addr`, with a real atomic instruction on the shared
    /// memory; returns the old value. `None` as for [`PeerArena::read`].
    pub(crate) fn atomic(
        &self,
        addr: u64,
        rkey: u32,
        op: crate::mr::Rmw,
    ) -> Option<std::result::Result<u64, WcStatus>> {
        self.grants.with(rkey, Want::Remote, |g| {
            let p = g.at(addr, 8, AccessFlags::REMOTE_ATOMIC)?;
            if p as usize % 8 != 0 {
                return Err(WcStatus::RemInvReqErr);
            }
            // SAFETY: `p` is 8-byte aligned and 8 bytes inside a writable mapping (REMOTE_ATOMIC
            // grants are); every atomic on this word, from any process, goes through an
            // AtomicU64.
            let word = unsafe { AtomicU64::from_ptr(p.cast::<u64>()) };
            Ok(op.apply(word))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(not(rdma_loom))]
    fn the_table_names_no_key_and_follows_publish_and_withdraw() {
        let arena = Arena::new().expect("arena");
        let seg = Segment::new(4096, true).expect("segment");
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        arena
            .publish((0x1111, 0x2222), rw, &seg, seg.ptr() as u64, 4096)
            .expect("publish");
        let p = arena.lookup(0x2222).expect("the rkey");
        assert_eq!(p.access, rw);
        assert_eq!(arena.lookup(0x1111).expect("the lkey").access, AccessFlags::LOCAL_WRITE);
        assert!(live(&arena.table, p.slot, p.tag));
        // SAFETY: the table is TABLE bytes of our own mapping.
        let words = unsafe { std::slice::from_raw_parts(arena.table.ptr().cast::<u64>(), SLOTS) };
        assert!(
            words.iter().all(|&w| w != 0x1111 && w != 0x2222),
            "no key appears in the table"
        );
        arena.withdraw((0x1111, 0x2222));
        assert!(!live(&arena.table, p.slot, p.tag), "withdrawn: the tag is gone");
        assert!(arena.lookup(0x2222).is_none() && arena.lookup(0x1111).is_none());
        // The slot comes back with a new tag: an old grant of it stays dead.
        arena
            .publish((0x3333, 0x4444), rw, &seg, seg.ptr() as u64, 4096)
            .expect("publish again");
        let q = arena.lookup(0x4444).expect("the new rkey");
        assert_eq!(q.slot, p.slot);
        assert!(!live(&arena.table, p.slot, p.tag) && live(&arena.table, q.slot, q.tag));
    }
}

/// A model of the key table under loom (see `rq`'s): `RUSTFLAGS="--cfg rdma_loom" cargo test
/// -p rdma-rpc-transport --release --lib shm::arena::models`.
#[cfg(all(test, rdma_loom))]
mod models {
    use super::*;
    use loom::sync::atomic::AtomicU64 as Canary;

    /// A peer that finds a registration live sees what the owner wrote into it before it
    /// published it; once the owner has withdrawn it (and said so), the peer finds it dead.
    #[test]
    fn a_live_registration_is_seen_as_published_and_a_withdrawn_one_is_dead() {
        loom::model(|| {
            let arena = Arena::new().expect("arena");
            // The peer's view: the table's memfd mapped again, read-only.
            let peer = Mapping::map_read_only(&arena.table_fd, TABLE).expect("map");
            let bytes = Arc::new(Canary::new(0));
            let gone = Arc::new(Canary::new(0));
            let (a, b, g) = (arena.clone(), bytes.clone(), gone.clone());
            let owner = loom::thread::spawn(move || {
                let seg = Segment::new(4096, true).expect("segment");
                b.store(7, Ordering::Relaxed); // the registration's bytes, before publishing
                let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
                a.publish((1, 2), rw, &seg, seg.ptr() as u64, 4096).expect("publish");
                a.withdraw((1, 2));
                g.store(1, Ordering::Release);
            });
            // The first registration of a table takes slot 0 with tag 1.
            if live(&peer, 0, 1) {
                assert_eq!(bytes.load(Ordering::Relaxed), 7, "live, but its bytes not seen");
            }
            if gone.load(Ordering::Acquire) == 1 {
                assert!(!live(&peer, 0, 1), "withdrawn, but still live");
            }
            owner.join().expect("the owner");
        });
    }
}
