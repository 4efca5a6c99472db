//! Registered memory of the shm provider: one sealed memfd per protection domain (the arena),
//! mapped by this process and by every peer connected to a QP of the PD. Its first MiB is the
//! region table the owner publishes; peers check rkeys, bounds and access flags against it
//! before they touch the rest, as a NIC checks its own table.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::sys::{self, Mapping};
use crate::{AccessFlags, Error, Result, WcStatus};

/// Virtual size of an arena (sparse: only touched pages cost memory).
pub(crate) const ARENA: u64 = 16 << 30;
/// Largest registration.
pub(crate) const MAX_MR: u64 = 4 << 30;
const SLOTS: usize = 16384;
const PROBES: usize = 64;
const TABLE: u64 = (SLOTS * 64) as u64;
const PAGE: u64 = 4096;
/// An rkey slot never used / used and removed.
const EMPTY: u32 = 0;
const REMOVED: u32 = u32::MAX;

/// One published registration. `seq` is a seqlock: odd while the owner writes the entry.
#[repr(C, align(64))]
struct Entry {
    seq: AtomicU32,
    rkey: AtomicU32,
    access: AtomicU32,
    _pad: AtomicU32,
    /// The owner's virtual address of the first byte (what `RemoteRegion::addr` names).
    addr: AtomicU64,
    /// Offset of the first byte in the arena.
    off: AtomicU64,
    len: AtomicU64,
}

/// A snapshot of an entry, read consistently.
#[derive(Clone, Copy)]
struct Snapshot {
    rkey: u32,
    access: u32,
    addr: u64,
    off: u64,
    len: u64,
}

fn slot_of(rkey: u32) -> usize {
    (rkey.wrapping_mul(0x9e37_79b1) >> 18) as usize % SLOTS
}

fn entry(map: &Mapping, i: usize) -> &Entry {
    debug_assert!(i < SLOTS);
    // SAFETY: the table is the first TABLE bytes of a mapping at least ARENA long, page
    // aligned; Entry is all atomics (valid for any bits) and only accessed atomically.
    unsafe { &*map.ptr().cast::<Entry>().add(i % SLOTS) }
}

fn read(e: &Entry) -> Option<Snapshot> {
    for _ in 0..64 {
        let s1 = e.seq.load(Ordering::Acquire);
        if s1 % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let snap = Snapshot {
            rkey: e.rkey.load(Ordering::Relaxed),
            access: e.access.load(Ordering::Relaxed),
            addr: e.addr.load(Ordering::Relaxed),
            off: e.off.load(Ordering::Relaxed),
            len: e.len.load(Ordering::Relaxed),
        };
        std::sync::atomic::fence(Ordering::Acquire);
        if e.seq.load(Ordering::Relaxed) == s1 {
            return Some(snap);
        }
    }
    None
}

/// This process's arena: memory and the published table.
pub(crate) struct Arena {
    pub(crate) fd: OwnedFd,
    pub(crate) map: Mapping,
    /// Free ranges, offset -> length, page aligned.
    free: Mutex<BTreeMap<u64, u64>>,
    table: Mutex<()>,
}

impl Arena {
    pub(crate) fn new() -> Result<Arc<Arena>> {
        let io = |what| move |e| Error::io(what, e);
        let fd = sys::sealed_memfd("rdma-rpc-shm-pd", ARENA).map_err(io("creating the shm arena"))?;
        let map = Mapping::map(&fd, ARENA as usize).map_err(io("mapping the shm arena"))?;
        let mut free = BTreeMap::new();
        free.insert(TABLE, ARENA - TABLE);
        Ok(Arc::new(Arena {
            fd,
            map,
            free: Mutex::new(free),
            table: Mutex::new(()),
        }))
    }

    /// `len` bytes (rounded up to pages), zeroed; returns the arena offset.
    pub(crate) fn alloc(&self, len: u64) -> Result<u64> {
        let want = len.max(1).div_ceil(PAGE) * PAGE;
        let mut free = self.free.lock();
        let Some((&off, &have)) = free.iter().find(|(_, &l)| l >= want) else {
            return Err(Error::InvalidArgument(format!(
                "the shm arena has no {want} contiguous bytes left (it holds {ARENA} per PD)"
            )));
        };
        free.remove(&off);
        if have > want {
            free.insert(off + want, have - want);
        }
        Ok(off)
    }

    /// Gives a range back (its pages to the system, so a later user sees zeros).
    pub(crate) fn free(&self, off: u64, len: u64) {
        let len = len.max(1).div_ceil(PAGE) * PAGE;
        sys::punch_hole(&self.fd, off, len);
        let mut free = self.free.lock();
        let (mut start, mut end) = (off, off + len);
        if let Some((&p, &pl)) = free.range(..off).next_back() {
            if p + pl == off {
                free.remove(&p);
                start = p;
            }
        }
        if let Some(&nl) = free.get(&end) {
            free.remove(&end);
            end += nl;
        }
        free.insert(start, end - start);
    }

    /// A pointer to offset `off` of this process's mapping (computing it is safe; callers
    /// dereference only offsets the allocator gave out, inside the mapping).
    pub(crate) fn at(&self, off: u64) -> *mut u8 {
        debug_assert!(off < ARENA);
        self.map.ptr().wrapping_add(off as usize)
    }

    /// Publishes a registration for peers.
    pub(crate) fn publish(&self, rkey: u32, access: AccessFlags, addr: u64, off: u64, len: u64) -> Result<()> {
        let _t = self.table.lock();
        let first = slot_of(rkey);
        for p in 0..PROBES {
            let e = entry(&self.map, (first + p) % SLOTS);
            let k = e.rkey.load(Ordering::Relaxed);
            if k == EMPTY || k == REMOVED {
                let s = e.seq.load(Ordering::Relaxed);
                e.seq.store(s.wrapping_add(1), Ordering::Release);
                std::sync::atomic::fence(Ordering::Release);
                e.access.store(access.bits(), Ordering::Relaxed);
                e.addr.store(addr, Ordering::Relaxed);
                e.off.store(off, Ordering::Relaxed);
                e.len.store(len, Ordering::Relaxed);
                e.rkey.store(rkey, Ordering::Relaxed);
                e.seq.store(s.wrapping_add(2), Ordering::Release);
                return Ok(());
            }
        }
        Err(Error::InvalidArgument(
            "the shm region table is full around this key: deregister something".into(),
        ))
    }

    /// Takes a registration out of the published table: peers' next checks fail.
    pub(crate) fn withdraw(&self, rkey: u32) {
        let _t = self.table.lock();
        let first = slot_of(rkey);
        for p in 0..PROBES {
            let e = entry(&self.map, (first + p) % SLOTS);
            match e.rkey.load(Ordering::Relaxed) {
                EMPTY => return,
                k if k == rkey => {
                    let s = e.seq.load(Ordering::Relaxed);
                    e.seq.store(s.wrapping_add(1), Ordering::Release);
                    e.rkey.store(REMOVED, Ordering::Relaxed);
                    e.len.store(0, Ordering::Relaxed);
                    e.seq.store(s.wrapping_add(2), Ordering::Release);
                    return;
                }
                _ => {}
            }
        }
    }

    /// True if `key` is in the published table.
    pub(crate) fn contains(&self, key: u32) -> bool {
        let first = slot_of(key);
        for p in 0..PROBES {
            match entry(&self.map, (first + p) % SLOTS).rkey.load(Ordering::Relaxed) {
                EMPTY => return false,
                k if k == key => return true,
                _ => {}
            }
        }
        false
    }

    /// True if `rkey` may be handed out: not 0, not the tombstone.
    pub(crate) fn usable_key(rkey: u32) -> bool {
        rkey != EMPTY && rkey != REMOVED
    }
}

/// A peer's arena, mapped here: the target of one-sided operations.
pub(crate) struct PeerArena {
    map: Mapping,
}

impl PeerArena {
    /// Maps a peer's arena; refuses one that is not sealed or not of the arena's size.
    pub(crate) fn map(fd: &OwnedFd) -> Result<PeerArena> {
        let size = sys::peer_memfd(fd).map_err(|e| Error::io("checking the peer's arena", e))?;
        if size != ARENA {
            return Err(Error::Protocol(format!(
                "the peer's arena is {size} bytes, not {ARENA}"
            )));
        }
        let map = Mapping::map(fd, ARENA as usize).map_err(|e| Error::io("mapping the peer's arena", e))?;
        Ok(PeerArena { map })
    }

    /// RDMA Read: `dst.len()` bytes at `addr` into `dst`.
    pub(crate) fn read(&self, addr: u64, rkey: u32, dst: &mut [u8]) -> std::result::Result<(), WcStatus> {
        let src = self.check(addr, rkey, dst.len(), AccessFlags::REMOTE_READ)?;
        // SAFETY: `check` proved `[src, src + len)` inside our mapping of the peer's arena;
        // `dst` is our own memory; the peer may write the source concurrently (as with DMA):
        // the bytes copied are then some mix, never an out-of-bounds access.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Delivers a Send's payload into a receive the peer posted: `addr`/`lkey` are the
    /// receive's, checked against the peer's table for LOCAL_WRITE.
    pub(crate) fn write_local(&self, addr: u64, lkey: u32, src: &[u8]) -> std::result::Result<(), WcStatus> {
        let dst = self.check(addr, lkey, src.len(), AccessFlags::LOCAL_WRITE)?;
        // SAFETY: as in `read`, the other way.
        unsafe { super::copy::for_peer(src.as_ptr(), dst, src.len()) };
        // The receiver reads the head of the message first (a header, most often).
        // SAFETY: `check` proved `[dst, dst + len)` inside our mapping of the peer's arena.
        unsafe { super::sys::demote(dst, src.len()) };
        Ok(())
    }

    /// Starts fetching for writing the first cache lines of `len` bytes at `addr` of a receive
    /// buffer, after the same checks as `write_local`: a hint, nothing is written.
    pub(crate) fn prefetch_local(&self, addr: u64, lkey: u32, len: usize) {
        if let Ok(p) = self.check(addr, lkey, len, AccessFlags::LOCAL_WRITE) {
            super::sys::prefetch(p, len, true);
        }
    }

    /// RDMA Write: `src` to `addr`.
    pub(crate) fn write(&self, addr: u64, rkey: u32, src: &[u8]) -> std::result::Result<(), WcStatus> {
        let dst = self.check(addr, rkey, src.len(), AccessFlags::REMOTE_WRITE)?;
        // SAFETY: as in `read`, the other way.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// CAS or FAA on the 8-byte word at `addr`, with a real atomic instruction on the shared
    /// memory; returns the old value.
    pub(crate) fn atomic(&self, addr: u64, rkey: u32, op: crate::mr::Rmw) -> std::result::Result<u64, WcStatus> {
        let p = self.check(addr, rkey, 8, AccessFlags::REMOTE_ATOMIC)?;
        if p as usize % 8 != 0 {
            return Err(WcStatus::RemInvReqErr);
        }
        // SAFETY: `p` is 8-byte aligned and 8 bytes inside the mapping (checked above); every
        // atomic on this word, from any process, goes through an AtomicU64.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast::<u64>()) };
        Ok(op.apply(word))
    }

    /// The NIC's checks for a one-sided operation: a published registration with this rkey,
    /// the access flag, the range inside it. Returns where the bytes are in our mapping.
    fn check(&self, addr: u64, rkey: u32, len: usize, need: AccessFlags) -> std::result::Result<*mut u8, WcStatus> {
        if !Arena::usable_key(rkey) {
            return Err(WcStatus::RemAccessErr);
        }
        let first = slot_of(rkey);
        for p in 0..PROBES {
            let Some(s) = read(entry(&self.map, (first + p) % SLOTS)) else {
                return Err(WcStatus::RemAccessErr); // an entry that never settles: a broken peer
            };
            if s.rkey == EMPTY {
                break;
            }
            if s.rkey != rkey {
                continue;
            }
            if s.access & need.bits() != need.bits() {
                return Err(WcStatus::RemAccessErr);
            }
            let end = addr.checked_add(len as u64).ok_or(WcStatus::RemAccessErr)?;
            let reg_end = s.addr.checked_add(s.len).ok_or(WcStatus::RemAccessErr)?;
            if addr < s.addr || end > reg_end {
                return Err(WcStatus::RemAccessErr);
            }
            // The entry comes from the peer: keep the bytes inside the mapping whatever it says.
            let off = s.off.checked_add(addr - s.addr).ok_or(WcStatus::RemAccessErr)?;
            if off < TABLE || off.checked_add(len as u64).is_none_or(|e| e > ARENA) {
                return Err(WcStatus::RemAccessErr);
            }
            // SAFETY: `off + len <= ARENA`, the mapping's length.
            return Ok(unsafe { self.map.ptr().add(off as usize) });
        }
        Err(WcStatus::RemAccessErr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_follow_the_published_table_and_survive_garbage() {
        let arena = Arena::new().expect("arena");
        let off = arena.alloc(4096).expect("alloc");
        let addr = arena.at(off) as u64;
        let rw = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        arena.publish(0x1234_5678, rw, addr, off, 4096).expect("publish");
        let peer = PeerArena::map(&arena.fd).expect("map as a peer");
        let mut b = [0u8; 16];
        peer.read(addr + 8, 0x1234_5678, &mut b).expect("a good read");
        assert_eq!(
            peer.read(addr + 4090, 0x1234_5678, &mut b),
            Err(WcStatus::RemAccessErr),
            "bounds"
        );
        assert_eq!(
            peer.read(addr, 0x1234_5679, &mut b),
            Err(WcStatus::RemAccessErr),
            "rkey"
        );
        let op = crate::mr::Rmw::FetchAdd { add: 1 };
        assert_eq!(
            peer.atomic(addr, 0x1234_5678, op),
            Err(WcStatus::RemAccessErr),
            "access"
        );
        // The owner (or garbage) claims a registration that points outside the arena.
        arena
            .publish(0x0bad_0001, rw, 0x1000, ARENA - 8, 1 << 20)
            .expect("publish");
        assert_eq!(peer.read(0x1000, 0x0bad_0001, &mut b), Err(WcStatus::RemAccessErr));
        arena
            .publish(0x0bad_0002, rw, u64::MAX - 4, TABLE, 100)
            .expect("publish");
        assert_eq!(
            peer.read(u64::MAX - 4, 0x0bad_0002, &mut b),
            Err(WcStatus::RemAccessErr)
        );
        arena.publish(0x0bad_0003, rw, 0x2000, 8, 4096).expect("publish"); // inside the table
        assert_eq!(peer.read(0x2000, 0x0bad_0003, &mut b), Err(WcStatus::RemAccessErr));
        // Withdrawn: refused.
        arena.withdraw(0x1234_5678);
        assert_eq!(peer.read(addr + 8, 0x1234_5678, &mut b), Err(WcStatus::RemAccessErr));
    }

    #[test]
    fn freed_ranges_coalesce_and_come_back_zeroed() {
        let arena = Arena::new().expect("arena");
        let a = arena.alloc(8192).expect("a");
        let b = arena.alloc(4096).expect("b");
        // SAFETY: `a` is ours, 8192 bytes inside the mapping.
        unsafe { std::ptr::write_bytes(arena.at(a), 0xaa, 8192) };
        arena.free(a, 8192);
        arena.free(b, 4096);
        let c = arena.alloc(12288).expect("c");
        assert_eq!(c, a, "the two freed ranges merged");
        // SAFETY: `c` is ours, 12288 bytes inside the mapping.
        let first = unsafe { *arena.at(c) };
        assert_eq!(first, 0, "punched pages read as zeros");
    }
}
