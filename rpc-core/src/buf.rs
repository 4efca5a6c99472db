//! Registered memory an application holds: buffers it fills in place for a large request
//! ([`Client::buffer`](crate::Client::buffer), [`Client::call_buf`](crate::Client::call_buf))
//! and the registered buffer a large request was read into, handed to a handler as is
//! (a handler that takes a [`Body`]), or the receive slot
//! a small request or response arrived in ([`Client::call_body`](crate::Client::call_body)).
//! No copies: the peer reads from, or the transport reads into, exactly these bytes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rdma_rpc_transport::{BufMut, BufRef, MemoryRegion};

use crate::free::Free;
use crate::proto::Inline;

/// A buffer registered with one connection's protection domain, owned by the application.
/// Dropping it gives it back to its connection for reuse (or deregisters it once the
/// connection is gone).
pub struct RegisteredBuf {
    mr: Option<MemoryRegion>,
    off: usize,
    len: usize,
    home: Home,
}

/// Where a buffer goes when the application lets go of it.
enum Home {
    /// The connection's free lists (rendezvous buffers).
    Stash(Weak<Mutex<Free>>),
    /// The connection's receive ring, as the slot the driver named `wr_id`. Held strongly (one
    /// atomic increment, where a weak reference costs two compare-and-swaps per message): a
    /// slot given back after its connection is gone is dropped with the list.
    Ring { wr_id: u64, slots: Arc<SlotsBack> },
}

/// Receive slots the application let go of, for the driver to post again.
#[derive(Default)]
pub(crate) struct SlotsBack {
    slots: Mutex<Vec<(u64, MemoryRegion)>>,
    /// Set when `slots` may hold something: the driver's check costs one load.
    any: AtomicBool,
}

impl SlotsBack {
    /// The slots given back since the last call.
    pub(crate) fn take(&self, into: &mut Vec<(u64, MemoryRegion)>) {
        // A plain load first: no atomic write (and no cache line taken from the other core)
        // on the polls that find nothing, which is nearly all of them.
        if self.any.load(Ordering::Relaxed) && self.any.swap(false, Ordering::Acquire) {
            into.append(&mut self.slots.lock());
        }
    }

    fn put(&self, wr_id: u64, mr: MemoryRegion) {
        self.slots.lock().push((wr_id, mr));
        self.any.store(true, Ordering::Release);
    }
}

impl RegisteredBuf {
    pub(crate) fn new(mr: MemoryRegion, off: usize, len: usize, home: &Arc<Mutex<Free>>) -> Self {
        Self {
            mr: Some(mr),
            off,
            len,
            home: Home::Stash(Arc::downgrade(home)),
        }
    }

    /// Bytes `range` of receive slot `mr` (posted as `wr_id`), which goes back to `slots` when
    /// dropped; the slot itself back when the range is not inside it.
    pub(crate) fn in_slot(
        mr: MemoryRegion,
        range: std::ops::Range<usize>,
        wr_id: u64,
        slots: &Arc<SlotsBack>,
    ) -> Result<Self, MemoryRegion> {
        if range.start > range.end || range.end > mr.len() {
            return Err(mr);
        }
        Ok(Self {
            mr: Some(mr),
            off: range.start,
            len: range.len(),
            home: Home::Ring {
                wr_id,
                slots: slots.clone(),
            },
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for reading. Read borrows share the buffer; while one is held, writes into
    /// it wait (see [`MemoryRegion::bytes`](rdma_rpc_transport::MemoryRegion::bytes)).
    pub fn bytes(&self) -> BufRef<'_> {
        let (off, len) = (self.off, self.len);
        self.region()
            .bytes()
            .slice(off..off + len)
            .unwrap_or_else(|| unreachable_range(off, len))
    }

    /// The bytes, for writing. The borrow holds the buffer's lock exclusively: drop it before
    /// borrowing the same buffer again on this thread, or the second borrow waits forever.
    pub fn bytes_mut(&mut self) -> BufMut<'_> {
        let (off, len) = (self.off, self.len);
        self.region_mut()
            .bytes_mut()
            .slice(off..off + len)
            .unwrap_or_else(|| unreachable_range(off, len))
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }

    /// Whether it is a receive slot of its connection's ring (which the peer's credits wait
    /// for while it is held).
    pub(crate) fn in_ring(&self) -> bool {
        matches!(self.home, Home::Ring { .. })
    }

    /// Bytes `range` of it, for reading (a [`Bulk`](crate::Bulk)'s range, always within).
    pub(crate) fn bytes_in(&self, range: std::ops::Range<usize>) -> BufRef<'_> {
        let (off, len) = (self.off + range.start, range.len());
        self.region()
            .bytes()
            .slice(off..off + len)
            .unwrap_or_else(|| unreachable_range(off, len))
    }

    /// Whether it is registered with the connection whose free lists are `home`, and peers may
    /// read it: it can be lent as it is, at any offset.
    pub(crate) fn readable_on(&self, home: &Arc<Mutex<Free>>) -> bool {
        let ours = match &self.home {
            Home::Stash(h) => std::ptr::eq(h.as_ptr(), Arc::as_ptr(home)),
            Home::Ring { .. } => false,
        };
        ours && self
            .region()
            .access()
            .contains(rdma_rpc_transport::AccessFlags::REMOTE_READ)
    }

    /// The descriptor through which a peer reads bytes `range` of it.
    pub(crate) fn remote_range(&self, range: std::ops::Range<usize>) -> crate::proto::RemoteRegion {
        let whole = crate::region::desc(self.region().remote());
        crate::proto::RemoteRegion {
            addr: whole.addr + (self.off + range.start) as u64,
            len: range.len() as u64,
            rkey: whole.rkey,
        }
    }

    /// Whether it belongs to the connection whose free lists are `home`, with room for the
    /// length prefix a lent buffer carries before its bytes.
    pub(crate) fn lendable_on(&self, home: &Arc<Mutex<Free>>, prefix: usize) -> bool {
        match &self.home {
            Home::Stash(h) => self.off == prefix && std::ptr::eq(h.as_ptr(), Arc::as_ptr(home)),
            Home::Ring { .. } => false,
        }
    }

    /// The registration, for lending it (its bytes start at the prefix).
    pub(crate) fn into_region(mut self) -> MemoryRegion {
        self.mr.take().unwrap_or_else(|| unreachable_taken())
    }

    fn region(&self) -> &MemoryRegion {
        // Only `into_region` and `drop` take the region out, and both consume `self`.
        self.mr.as_ref().unwrap_or_else(|| unreachable_taken())
    }

    fn region_mut(&mut self) -> &mut MemoryRegion {
        self.mr.as_mut().unwrap_or_else(|| unreachable_taken())
    }
}

#[cold]
fn unreachable_range(off: usize, len: usize) -> ! {
    unreachable!("a registered buffer always covers its bytes ({off}+{len})")
}

#[cold]
fn unreachable_taken() -> ! {
    unreachable!("a registered buffer's region is only taken when it is consumed")
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        let Some(mr) = self.mr.take() else { return };
        match &self.home {
            Home::Stash(h) => {
                if let Some(free) = h.upgrade() {
                    free.lock().put(mr);
                }
            }
            Home::Ring { wr_id, slots } => slots.put(*wr_id, mr),
        }
    }
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf").field("len", &self.len).finish()
    }
}

/// A request's bytes as a [`handler`](crate::ServerBuilder::handler) that takes a `Body` gets them, or a
/// response's as [`Client::call_body`](crate::Client::call_body) returns them: without a copy,
/// in the receive slot an eager one arrived in, or in the registered buffer a large request was
/// read into; copied out where it was joined from pieces, where its message is shorter than
/// [`IN_SLOT_MIN`](crate::IN_SLOT_MIN) bytes (such a copy costs less than lending the slot), or
/// where the application already holds half of the connection's receive slots. A copied body
/// of at most [`Inline::MAX`] bytes is held by value ([`Body::Inline`]: no allocation), a
/// longer one in a vector ([`Body::Bytes`]).
///
/// A body held in a receive slot keeps that slot out of the connection's receive ring, so the
/// peer has one credit less until the body is dropped: drop it when done with it (or turn it into
/// a `Vec` with [`Body::into_vec`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Body {
    /// Copied out of its message; or a large one read straight into this vector, where
    /// registering memory is cheap ([`DeviceCaps::cheap_registration`](crate::transport::DeviceCaps)).
    Bytes(Vec<u8>),
    /// In registered memory of the connection: the receive slot it arrived in, or the buffer
    /// a large request was read into.
    Registered(RegisteredBuf),
    /// Copied out of its message, and short enough to be held by value.
    Inline(Inline),
}

impl Body {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Body::Bytes(b) => b.len(),
            Body::Registered(r) => r.len(),
            Body::Inline(b) => b.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, for reading (read borrows share a registered body's buffer).
    pub fn bytes(&self) -> BodyRef<'_> {
        BodyRef(match self {
            Body::Bytes(b) => Inner::Slice(b),
            Body::Registered(r) => Inner::Buf(r.bytes()),
            Body::Inline(b) => Inner::Slice(b),
        })
    }

    /// The bytes as a vector (a copy for a registered body).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Body::Bytes(b) => b,
            Body::Registered(r) => r.to_vec(),
            Body::Inline(b) => b.to_vec(),
        }
    }
}

/// Read access to a [`Body`]'s or a [`Bulk`](crate::Bulk)'s bytes.
pub struct BodyRef<'a>(Inner<'a>);

impl<'a> BodyRef<'a> {
    pub(crate) fn slice(s: &'a [u8]) -> Self {
        Self(Inner::Slice(s))
    }

    pub(crate) fn buf(b: BufRef<'a>) -> Self {
        Self(Inner::Buf(b))
    }
}

enum Inner<'a> {
    Slice(&'a [u8]),
    Buf(BufRef<'a>),
}

impl std::ops::Deref for BodyRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::Slice(s) => s,
            Inner::Buf(b) => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(n: usize) -> Vec<MemoryRegion> {
        let dev = rdma_rpc_transport::Device::open("tcp").expect("the tcp provider");
        let pd = dev.alloc_pd().expect("a protection domain");
        (0..n)
            .map(|_| {
                pd.register(64, rdma_rpc_transport::AccessFlags::LOCAL_WRITE)
                    .expect("a slot")
            })
            .collect()
    }

    #[test]
    fn slots_dropped_on_other_threads_all_come_back_once_each() {
        const RING: usize = 16;
        let back = Arc::new(SlotsBack::default());
        let mut got = Vec::new();
        back.take(&mut got);
        assert!(got.is_empty(), "nothing given back yet");
        // The whole ring held by the application at once, dropped from four threads.
        let bufs: Vec<RegisteredBuf> = slots(RING)
            .into_iter()
            .enumerate()
            .map(|(i, mr)| RegisteredBuf::in_slot(mr, 8..40, i as u64, &back).expect("in range"))
            .collect();
        assert!(bufs.iter().all(|b| b.len() == 32));
        let mut rest = bufs;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let mine: Vec<RegisteredBuf> = rest.drain(..RING / 4).collect();
                std::thread::spawn(move || drop(mine))
            })
            .collect();
        for t in threads {
            t.join().expect("a dropping thread");
        }
        back.take(&mut got);
        let mut ids: Vec<u64> = got.iter().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..RING as u64).collect::<Vec<_>>());
        assert!(got.iter().all(|(_, mr)| mr.len() == 64), "each slot whole");
        let before = got.len();
        back.take(&mut got);
        assert_eq!(got.len(), before, "taken once");
    }

    #[test]
    fn a_range_outside_its_slot_gives_the_slot_back() {
        let back = Arc::new(SlotsBack::default());
        let mut it = slots(1).into_iter();
        let mr = it.next().expect("one slot");
        let mr = RegisteredBuf::in_slot(mr, 60..70, 0, &back).expect_err("past the end");
        assert_eq!(mr.len(), 64);
    }
}
