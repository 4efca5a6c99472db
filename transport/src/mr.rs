//! Memory regions that own their buffers, and descriptors of remote ones.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use parking_lot::{MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use serde::{Deserialize, Serialize};

use crate::pd::PdShared;
use crate::pool::PoolHome;
use crate::{AccessFlags, Error, ProtectionDomain, Result};

/// A registered allocation. The memory is a boxed `[u64]` (8-byte aligned for atomics) that never
/// moves while registered; it is freed only after deregistration, when the last
/// [`MemoryRegion`] naming it — including those held by work requests in flight — is gone.
pub(crate) struct Region {
    // Field order is drop order: deregister (`imp`) before freeing (`mem`) before the PD goes.
    /// The provider's part of the registration (none where the provider keeps nothing).
    pub(crate) imp: Option<Box<dyn crate::provider::RegistrationOps>>,
    /// The bytes. Local users and the software providers' progress engines go through this lock
    /// (any number of readers, or one writer); a real NIC reaches the same memory by DMA, as it
    /// does in every verbs program.
    pub(crate) mem: RwLock<Mem>,
    pub(crate) pd: Arc<PdShared>,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) access: AccessFlags,
    /// Registered from an application's vector ([`MemoryRegion::into_vec`] gives it back).
    pub(crate) from_vec: bool,
    /// A peer may write it at any time, without this process's lock: registered with
    /// REMOTE_WRITE or REMOTE_ATOMIC on `shm` (the peer's process writes its mapping) or
    /// `verbs` (the NIC). No Rust reference to its bytes is ever made while it is registered:
    /// they are copied in and out through raw pointers ([`BufRef`], [`BufMut`]).
    pub(crate) exposed: bool,
}

/// The bytes of a registration: on the heap (tcp, verbs), in a shm arena that peers map, or an
/// application's vector registered where it is ([`ProtectionDomain::register_vec`]).
pub(crate) enum Mem {
    Heap(Box<[u64]>),
    Shared(Box<dyn crate::provider::SharedMemory>),
    Vec(Vec<u8>),
}

impl Mem {
    fn bytes(&self) -> &[u8] {
        match self {
            Mem::Heap(b) => bytemuck::cast_slice(b),
            Mem::Shared(s) => bytemuck::cast_slice(s.words()),
            Mem::Vec(v) => v,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Heap(b) => bytemuck::cast_slice_mut(b),
            Mem::Shared(s) => bytemuck::cast_slice_mut(s.words_mut()),
            Mem::Vec(v) => v,
        }
    }
}

/// An atomic read-modify-write on an 8-byte word (CAS or FAA).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rmw {
    CompareSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

impl Rmw {
    /// Applies it to `word` atomically; returns the old value.
    pub(crate) fn apply(self, word: &std::sync::atomic::AtomicU64) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        match self {
            Rmw::CompareSwap { compare, swap } => word
                .compare_exchange(compare, swap, SeqCst, SeqCst)
                .unwrap_or_else(|v| v),
            Rmw::FetchAdd { add } => word.fetch_add(add, SeqCst),
        }
    }

    fn apply_plain(self, old: u64) -> u64 {
        match self {
            Rmw::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            Rmw::FetchAdd { add } => old.wrapping_add(add),
        }
    }
}

/// The provider's registration; kept only to be dropped (deregistered) at the right moment.
#[allow(dead_code)]
/// The heap memory a registration of `len` bytes is made in (`vec` itself, or zeroed words),
/// and its address: for providers whose registrations live in the process's own heap.
pub(crate) fn heap(len: usize, vec: Option<Vec<u8>>) -> Result<(Mem, u64)> {
    Ok(match vec {
        Some(mut v) => {
            let addr = v.as_mut_ptr() as u64;
            (Mem::Vec(v), addr)
        }
        None => {
            let mut mem = zeroed_words(len)?;
            let addr = mem.as_mut_ptr() as u64;
            (Mem::Heap(mem), addr)
        }
    })
}

/// Whether a registration with `access` lets peers write it (REMOTE_WRITE or REMOTE_ATOMIC):
/// its memory is then never borrowed in place (see `Region::exposed`), on providers where a
/// peer writes it without this process's locks.
pub(crate) fn peers_write(access: AccessFlags) -> bool {
    remote_writes(access)
}

/// `len` bytes of zeroed words, or [`Error::OutOfMemory`] where the allocator refuses them (a
/// `vec!` would abort the process instead). The allocator is asked first, then the memory
/// comes zeroed and untouched from `vec!` (its pages are faulted in only when used, as
/// before), so a refusal is an error in all but a race with another allocation between the two.
fn zeroed_words(len: usize) -> Result<Box<[u64]>> {
    let words = len.div_ceil(8);
    ask_allocator::<u64>(words, len)?;
    Ok(vec![0u64; words].into_boxed_slice())
}

/// As [`zeroed_words`], as a vector of `len` bytes ([`ProtectionDomain::register_zeroed_vec`]).
pub(crate) fn zeroed_bytes(len: usize) -> Result<Vec<u8>> {
    ask_allocator::<u8>(len, len)?;
    Ok(vec![0u8; len])
}

/// Whether the allocator gives `n` values of `T` (for a region of `len` bytes): asked, and
/// given back at once.
fn ask_allocator<T>(n: usize, len: usize) -> Result<()> {
    Vec::<T>::new()
        .try_reserve_exact(n)
        .map_err(|_| Error::OutOfMemory { len })
}

impl Region {
    /// The first byte of `[off, off + len)`, checked to be inside the region.
    fn at(&self, off: usize, len: usize) -> *mut u8 {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "a range outside the region"
        );
        (self.addr as *mut u8).wrapping_add(off)
    }

    /// A copy of the bytes `[off, off + len)`, taken under the region's lock the caller holds
    /// (`_lock`: local writers wait) through a raw pointer: for an exposed region, whose bytes
    /// a peer may write while they are copied (the copy then holds some mix, as a NIC's DMA
    /// read would).
    fn snapshot_locked(&self, _lock: &Mem, off: usize, len: usize) -> Box<[u8]> {
        let mut copy = vec![0u8; len].into_boxed_slice();
        let from = self.at(off, len);
        if self.access.contains(AccessFlags::REMOTE_ATOMIC) {
            // SAFETY: `at` checked the range inside the registration, which lives (and does not
            // move) as long as `self`; peers reach its words only by atomics or these copies.
            unsafe { crate::words::copy_out(from, &mut copy, self.bounds()) };
        } else {
            // SAFETY: `at` checked the range inside the registration, whose memory lives (and
            // does not move) as long as `self`; `copy` is our own, `len` bytes; no reference
            // to the registration's bytes is made.
            unsafe { std::ptr::copy_nonoverlapping(from, copy.as_mut_ptr(), len) };
        }
        copy
    }

    /// Writes `src` at `off` through a raw pointer, under the region's lock held by the caller
    /// (`_lock`): for an exposed region.
    fn write_raw(&self, _lock: &Mem, off: usize, src: &[u8]) {
        let to = self.at(off, src.len());
        if self.access.contains(AccessFlags::REMOTE_ATOMIC) {
            // SAFETY: as in `snapshot_locked`, the other way.
            unsafe { crate::words::copy_in(to, src, self.bounds()) };
        } else {
            // SAFETY: `at` checked the range; the memory lives as long as `self`; `src` is the
            // caller's own memory, never the registration's.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), to, src.len()) };
        }
    }

    /// The registration's bytes, as addresses (for copies that meet peers' atomics).
    fn bounds(&self) -> crate::words::Bounds {
        crate::words::Bounds {
            lo: self.addr as usize,
            hi: self.addr as usize + self.len,
        }
    }

    /// Locks the bytes `[off, off + len)` of the region for writing (a copy written back when
    /// dropped, for an exposed region: see [`BufMut`]).
    pub(crate) fn lock_range(&self, off: usize, len: usize) -> BufMut<'_> {
        self.writable(self.mem.write(), off, len)
    }

    /// Locks the bytes `[off, off + len)` of the region for reading, beside other readers (a
    /// copy, for an exposed region: see [`BufRef`]). A thread that already reads the region may
    /// read it again even while a writer waits (the second borrow of a buffer in one expression
    /// must not deadlock).
    pub(crate) fn read_range(&self, off: usize, len: usize) -> BufRef<'_> {
        self.readable(self.mem.read_recursive(), off, len)
    }

    /// As [`read_range`](Self::read_range) if nobody holds the lock for writing; `None` if
    /// somebody does.
    pub(crate) fn try_read_range(&self, off: usize, len: usize) -> Option<BufRef<'_>> {
        Some(self.readable(self.mem.try_read_recursive()?, off, len))
    }

    /// As [`lock_range`](Self::lock_range) if nobody holds the lock; `None` if somebody does.
    pub(crate) fn try_lock_range(&self, off: usize, len: usize) -> Option<BufMut<'_>> {
        Some(self.writable(self.mem.try_write()?, off, len))
    }

    /// The bytes `[off, off + len)` under a read lock: the memory itself, or for an exposed
    /// region a copy (no reference to memory a peer may write).
    fn readable<'a>(&'a self, lock: RwLockReadGuard<'a, Mem>, off: usize, len: usize) -> BufRef<'a> {
        if self.exposed {
            return BufRef(Bytes::Copy(self.snapshot_locked(&lock, off, len)));
        }
        BufRef(Bytes::Locked(RwLockReadGuard::map(lock, |m| {
            &m.bytes()[off..off + len]
        })))
    }

    /// The bytes `[off, off + len)` under the write lock: the memory itself, or for an exposed
    /// region a copy whose changed bytes are written back when it is dropped.
    fn writable<'a>(&'a self, lock: RwLockWriteGuard<'a, Mem>, off: usize, len: usize) -> BufMut<'a> {
        if self.exposed {
            let copy = self.snapshot_locked(&lock, off, len);
            let view = 0..copy.len();
            let back = WriteBack {
                lock,
                region: self,
                off,
                orig: copy.clone(),
                copy,
            };
            return BufMut(BytesMut::Copy(back, view));
        }
        BufMut(BytesMut::Locked(RwLockWriteGuard::map(lock, |m| {
            &mut m.bytes_mut()[off..off + len]
        })))
    }
}

impl Region {
    /// A target's atomic on the 8-byte word at byte offset `off` (8-aligned), if nobody holds
    /// the region's lock: the old value; `None` if somebody does. Shared memory (shm) uses an
    /// atomic instruction, since peers run atomics on it directly; heap memory is only reached
    /// through this lock.
    pub(crate) fn try_atomic(&self, off: usize, op: Rmw) -> Option<u64> {
        Some(rmw(&mut *self.mem.try_write()?, off, op))
    }

    /// The application's vector back, deregistered (a copy out of the arena on shm).
    fn into_vec(mut self) -> Vec<u8> {
        let len = self.len;
        let mem = std::mem::replace(self.mem.get_mut(), Mem::Vec(Vec::new()));
        // Deregistered (keys withdrawn, the NIC's registration gone) before the memory is
        // anyone's, or freed: no peer reaches it from here on.
        drop(self);
        match mem {
            Mem::Vec(v) => v,
            // A peer may still hold a mapping of shm memory: copied out, not borrowed.
            Mem::Shared(slice) => slice.copy_out(len),
            other => other.bytes()[..len].to_vec(),
        }
    }
}

/// Whether peers may write a registration with `access` (Writes or atomics).
fn remote_writes(access: AccessFlags) -> bool {
    let writes = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    access.bits() & writes.bits() != 0
}

/// An atomic on the 8-byte word of `mem` at byte offset `off`, under the region's lock.
fn rmw(mem: &mut Mem, off: usize, op: Rmw) -> u64 {
    match mem {
        Mem::Shared(s) => op.apply(s.atomic_word(off / 8)),
        Mem::Heap(words) => {
            let old = words[off / 8];
            // Stored in native byte order, as the NIC does.
            words[off / 8] = op.apply_plain(old);
            old
        }
        // A vector's bytes may sit at any address: read and written as bytes, under the lock.
        Mem::Vec(v) => {
            let Some(w) = v.get_mut(off..off + 8) else { return 0 };
            let mut old = [0u8; 8];
            old.copy_from_slice(w);
            let old = u64::from_ne_bytes(old);
            w.copy_from_slice(&op.apply_plain(old).to_ne_bytes());
            old
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let registered = &self.pd.device.inner.registered;
        registered.fetch_sub(self.len as u64, std::sync::atomic::Ordering::Relaxed);
        self.pd.imp.deregister(self.rkey, self.lkey);
        if let Some(imp) = &mut self.imp {
            if !imp.deregister() {
                // The device may still reach the memory: it must never be freed or reused.
                std::mem::forget(std::mem::replace(self.mem.get_mut(), Mem::Vec(Vec::new())));
            }
        }
    }
}

/// A registered buffer, owned: the unit that work requests take and completions give back.
///
/// A `MemoryRegion` names an exclusive byte range of one registration. Posting a work request
/// moves it into the queue pair; its [`Completion`](crate::Completion) (or the flush of the QP)
/// hands it back. So a buffer a NIC may still read or write can never be touched, freed or reused
/// by the program: the type system, not a comment, enforces it.
///
/// Remote access is per registration, as on a NIC: a peer holding the rkey may reach any byte of
/// the registration that the access flags allow, whichever `MemoryRegion` piece currently owns it.
pub struct MemoryRegion {
    pub(crate) region: Arc<Region>,
    pub(crate) off: usize,
    pub(crate) len: usize,
    pub(crate) home: Option<PoolHome>,
}

impl MemoryRegion {
    pub(crate) fn register(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<Self> {
        Self::register_from(pd, len, access, None)
    }

    /// Registers `v` where it is (tcp, verbs), or a copy of it in the shared arena (shm).
    pub(crate) fn register_vec(pd: &ProtectionDomain, v: Vec<u8>, access: AccessFlags) -> Result<Self> {
        Self::register_from(pd, v.len(), access, Some(v))
    }

    /// `len` zeroed bytes, or the bytes of `vec` (of length `len`), registered with `access`.
    fn register_from(pd: &ProtectionDomain, len: usize, access: AccessFlags, vec: Option<Vec<u8>>) -> Result<Self> {
        let caps = pd.device().caps();
        if len == 0 || len as u64 > caps.max_mr_size {
            return Err(Error::InvalidArgument(format!(
                "memory region length {len} must be within 1..={}",
                caps.max_mr_size
            )));
        }
        let needs_local_write = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if access.bits() & needs_local_write.bits() != 0 && !access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too (as in ibv_reg_mr)".into(),
            ));
        }
        let from_vec = vec.is_some();
        let region = pd.inner.imp.register(&pd.inner, len, access, vec, from_vec)?;
        pd.device()
            .inner
            .registered
            .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(MemoryRegion {
            region,
            off: 0,
            len,
            home: None,
        })
    }

    /// The vector this region was registered from ([`ProtectionDomain::register_vec`]), with
    /// what was written into it since, deregistered: on tcp and verbs the very allocation, no
    /// copy; on shm a copy out of the shared arena.
    ///
    /// # Errors
    /// Gives the region back when it was not registered from a vector, is a piece of one
    /// ([`MemoryRegion::split_off`]), or another piece or a work request in flight holds the
    /// registration still.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::{AccessFlags, Device};
    /// let pd = Device::open("tcp")?.alloc_pd()?;
    /// let mut mr = pd.register_vec(b"hello".to_vec(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
    /// mr.bytes_mut()[0] = b'j';
    /// assert_eq!(mr.into_vec().ok(), Some(b"jello".to_vec()));
    /// let other = pd.register(8, AccessFlags::LOCAL_WRITE)?;
    /// assert!(other.into_vec().is_err(), "not registered from a vector");
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn into_vec(self) -> std::result::Result<Vec<u8>, MemoryRegion> {
        if !self.region.from_vec || self.off != 0 || self.len != self.region.len || self.home.is_some() {
            return Err(self);
        }
        let region = self.region.clone();
        drop(self);
        // The only strong reference left: no other piece, no work request, no engine thread
        // between a lookup and its access (weak table entries cannot be upgraded any more).
        match Arc::try_unwrap(region) {
            Ok(r) => Ok(r.into_vec()),
            Err(region) => {
                let len = region.len;
                Err(MemoryRegion {
                    region,
                    off: 0,
                    len,
                    home: None,
                })
            }
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Virtual address of the first byte, as the NIC and peers see it.
    pub fn addr(&self) -> u64 {
        self.region.addr + self.off as u64
    }

    /// The local key of the registration.
    pub fn lkey(&self) -> u32 {
        self.region.lkey
    }

    /// The remote key of the registration: a capability, give it only to peers that may use it.
    pub fn rkey(&self) -> u32 {
        self.region.rkey
    }

    /// The access flags of the registration.
    pub fn access(&self) -> AccessFlags {
        self.region.access
    }

    /// `{addr, len, rkey}` of this buffer, for a peer's one-sided operations.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.region.rkey,
        }
    }

    /// The bytes, for reading. Read borrows of one registration share it (on any threads, and
    /// again on a thread that already holds one); while any is held, writes into the
    /// registration wait: [`MemoryRegion::bytes_mut`], and a software provider's delivery of a
    /// peer's Send or Write into it.
    ///
    /// A registration peers may write (REMOTE_WRITE or REMOTE_ATOMIC) on `shm` and `verbs`,
    /// where their writes do not wait (another process, or the NIC, writes the memory itself),
    /// gives a copy of its bytes as they are now instead: a Rust reference to memory written
    /// behind it would be unsound. Either way the bytes a borrow shows do not change under it.
    pub fn bytes(&self) -> BufRef<'_> {
        self.region.read_range(self.off, self.len)
    }

    /// As [`MemoryRegion::bytes`], for the bytes `range` of the buffer only: a registration
    /// peers may write gives a copy of those bytes alone, so reading a small piece of a large
    /// one (a landing slot, a staging chunk) costs that piece, not the whole registration.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `range` is not within the buffer.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::{AccessFlags, Device};
    /// let pd = Device::open("tcp")?.alloc_pd()?;
    /// let mut mr = pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    /// mr.write_at(1024, b"piece")?;
    /// assert_eq!(&mr.bytes_at(1024..1029)?[..], b"piece");
    /// assert!(mr.bytes_at(4090..4100).is_err());
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn bytes_at(&self, range: std::ops::Range<usize>) -> Result<BufRef<'_>> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument(format!(
                "bytes {}..{} of a {}-byte buffer",
                range.start, range.end, self.len
            )));
        }
        Ok(self.region.read_range(self.off + range.start, range.end - range.start))
    }

    /// The bytes, for writing: the registration's lock, exclusively (other pieces of it
    /// included). Any other borrow of the same registration taken on this thread while this one
    /// is held waits forever: drop it first.
    ///
    /// On the software providers a peer's Read or atomic that reaches the registration is
    /// answered when this borrow ends (a NIC reads host memory whatever the application does),
    /// and what the QP owes the peer after that answer waits with it; this side's own requests,
    /// its posts and dropping the QP do not. Keep borrows of memory that peers read short.
    ///
    /// A registration peers may write (see [`MemoryRegion::bytes`]) gives a copy, and the bytes
    /// changed in it are written into the registration when the borrow ends: a peer's writes
    /// meanwhile to bytes the borrow did not change stay.
    pub fn bytes_mut(&mut self) -> BufMut<'_> {
        self.region.lock_range(self.off, self.len)
    }

    /// Copies `src` to the start of the buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is longer than the buffer.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(src.len())
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{} bytes at {offset} do not fit in {}", src.len(), self.len))
            })?;
        self.bytes_mut()[offset..end].copy_from_slice(src);
        Ok(())
    }

    /// Splits the buffer in two at `at`: `self` keeps `[0, at)`, the result owns `[at, len)`.
    /// Both keep the registration (lkey, rkey) alive.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `at > len`, or for a buffer that belongs to a pool.
    pub fn split_off(&mut self, at: usize) -> Result<MemoryRegion> {
        if at > self.len {
            return Err(Error::InvalidArgument(format!(
                "split at {at} beyond length {}",
                self.len
            )));
        }
        if self.home.is_some() {
            return Err(Error::InvalidArgument("a pooled buffer cannot be split".into()));
        }
        let tail = MemoryRegion {
            region: self.region.clone(),
            off: self.off + at,
            len: self.len - at,
            home: None,
        };
        self.len = at;
        Ok(tail)
    }
}

impl MemoryRegion {
    /// Joins `other` back onto the end of `self`, undoing [`MemoryRegion::split_off`].
    ///
    /// # Errors
    /// Gives `other` back when it is not the piece right after `self` in the same registration.
    pub fn unsplit(&mut self, other: MemoryRegion) -> Result<(), MemoryRegion> {
        let adjacent = Arc::ptr_eq(&self.region, &other.region) && self.off + self.len == other.off;
        if !adjacent || self.home.is_some() || other.home.is_some() {
            return Err(other);
        }
        self.len += other.len;
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            home.give_back(self.region.clone(), self.off);
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.region.access)
            .finish()
    }
}

/// Read access to a [`MemoryRegion`]'s bytes: the registration's memory under its lock, or a
/// copy (see [`MemoryRegion::bytes`]).
pub struct BufRef<'a>(Bytes<'a>);

enum Bytes<'a> {
    Locked(MappedRwLockReadGuard<'a, [u8]>),
    Copy(Box<[u8]>),
}

impl Deref for BufRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Bytes::Locked(g) => g,
            Bytes::Copy(c) => c,
        }
    }
}

impl<'a> BufRef<'a> {
    /// Narrows to `range`; `None` when it is not inside.
    pub fn slice(self, range: std::ops::Range<usize>) -> Option<BufRef<'a>> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        Some(BufRef(match self.0 {
            Bytes::Locked(g) => Bytes::Locked(MappedRwLockReadGuard::map(g, |b| &b[range])),
            Bytes::Copy(c) => Bytes::Copy(c[range].into()),
        }))
    }
}

/// Write access to a [`MemoryRegion`]'s bytes: the registration's memory under its lock, or a
/// copy written back when dropped (see [`MemoryRegion::bytes_mut`]).
pub struct BufMut<'a>(BytesMut<'a>);

enum BytesMut<'a> {
    Locked(MappedRwLockWriteGuard<'a, [u8]>),
    /// `view`: the part of the copy this borrow shows.
    Copy(WriteBack<'a>, std::ops::Range<usize>),
}

/// A copy of an exposed registration's bytes, whose changed bytes go back when it is dropped.
struct WriteBack<'a> {
    /// Held for the borrow: local readers and writers wait, as for a locked borrow.
    lock: RwLockWriteGuard<'a, Mem>,
    region: &'a Region,
    /// Where `copy` starts in the registration.
    off: usize,
    copy: Box<[u8]>,
    /// The bytes as they were copied, to write back only those changed.
    orig: Box<[u8]>,
}

impl Drop for WriteBack<'_> {
    fn drop(&mut self) {
        // The runs of bytes the borrow changed, each written back whole.
        let (copy, orig) = (&self.copy, &self.orig);
        let mut i = 0;
        while i < copy.len() {
            if copy[i] == orig[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < copy.len() && copy[i] != orig[i] {
                i += 1;
            }
            self.region.write_raw(&self.lock, self.off + start, &copy[start..i]);
        }
    }
}

impl<'a> BufMut<'a> {
    /// Narrows to `range`; `None` when it is not inside.
    pub fn slice(self, range: std::ops::Range<usize>) -> Option<BufMut<'a>> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        Some(BufMut(match self.0 {
            BytesMut::Locked(g) => BytesMut::Locked(MappedRwLockWriteGuard::map(g, |b| &mut b[range])),
            BytesMut::Copy(back, view) => BytesMut::Copy(back, view.start + range.start..view.start + range.end),
        }))
    }
}

impl Deref for BufMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            BytesMut::Locked(g) => g,
            BytesMut::Copy(back, view) => &back.copy[view.clone()],
        }
    }
}

impl DerefMut for BufMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            BytesMut::Locked(g) => g,
            BytesMut::Copy(back, view) => &mut back.copy[view.clone()],
        }
    }
}

/// A peer's registered buffer: what a peer sends so that we can Read, Write or run atomics on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The address `offset` bytes in (no bounds check here: the target checks, as a NIC does).
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr.wrapping_add(offset),
            rkey: self.rkey,
        }
    }

    /// The sub-region `[offset, offset + len)`, or `None` when it does not fit (or would run
    /// past the top of the address space: a region a peer sent may say anything).
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::RemoteRegion;
    /// let r = RemoteRegion { addr: 0x1000, len: 64, rkey: 7 };
    /// assert_eq!(r.slice(16, 8), Some(RemoteRegion { addr: 0x1010, len: 8, rkey: 7 }));
    /// assert_eq!(r.slice(60, 8), None);
    /// let forged = RemoteRegion { addr: u64::MAX - 4, len: 64, rkey: 7 };
    /// assert_eq!(forged.slice(8, 8), None);
    /// ```
    pub fn slice(&self, offset: u64, len: u64) -> Option<RemoteRegion> {
        let end = offset.checked_add(len)?;
        let addr = self.addr.checked_add(offset)?;
        (end <= self.len).then_some(RemoteRegion {
            addr,
            len,
            rkey: self.rkey,
        })
    }
}

/// A remote address and the key to reach it: the target of a one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteAddr {
    /// Virtual address at the target.
    pub addr: u64,
    /// The target's remote key.
    pub rkey: u32,
}
