//! A queue pair's receive queue in shared memory, so that a peer can deliver a Send (or a
//! Write-with-immediate) by itself, as a NIC does, without a thread of the receiving process.
//! The owner posts entries; the peer takes the oldest, writes a Send's payload into the queue's
//! staging area (after the entries, used in order as a ring), writes the completion into the
//! entry and moves `head`; the owner drains completed entries into its CQ in order, copying each
//! payload from the staging area into the receive's own buffer. So no receive buffer is ever
//! shared: a peer reaches the staging area and the entries, nothing else of ours.
//!
//! Both sides read words the other writes: everything read is checked, so a peer writing
//! garbage gets errors, never an access outside the segment.

use std::sync::Arc;

// The model-checking build (`--cfg rdma_loom`) runs this protocol on loom's atomics: the
// queue's memory is still a mapped memfd, with loom's atomics built in place (`Segment::init`).
#[cfg(rdma_loom)]
use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(rdma_loom))]
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::sys::{self, Mapping};
use crate::{Error, Head, Result, WcStatus, HEAD_MAX};

/// Bytes of the header: a page (more under loom, whose atomics are larger).
const HEADER: usize = if std::mem::size_of::<Header>() > 4096 {
    std::mem::size_of::<Header>().next_multiple_of(4096)
} else {
    4096
};
/// Bytes of an entry: a cache line (more under loom).
const ENTRY: usize = std::mem::size_of::<Entry>();
/// Bytes of the staging area: what direct deliveries not yet drained may hold; a Send that
/// finds no room goes as a frame (the receiver's engine copies it).
pub(crate) const STAGE: usize = 1 << 20;
/// Words of a message's head an entry carries ([`HEAD_MAX`] bytes).
const HEAD_WORDS: usize = HEAD_MAX / 4;

/// Entry states.
const POSTED: u32 = 0;
const DONE: u32 = 1;

/// Completion flags.
pub(crate) const HAS_IMM: u32 = 1;
pub(crate) const WRITE_IMM: u32 = 2;

#[repr(C, align(64))]
struct Header {
    /// Entries posted (owner).
    tail: AtomicU64,
    _p0: [u8; 56],
    /// Entries taken (the peer, or the owner's engine for a request that came as a frame).
    head: AtomicU64,
    _p1: [u8; 56],
    /// 1 while the owner waits for a completion (its CQ is armed): the peer that completes an
    /// entry then clears it and rings the owner's doorbell. Without it nobody rings: a polling
    /// owner costs its peer no wake-up.
    armed: AtomicU32,
    _p2: [u8; 60],
    /// The CPU the owner's poller last ran on, plus one (0: not told yet), for the peer to
    /// see whether the two share a core (`peer_shares_cpu`). Written only when it changes, so
    /// its line stays shared while neither side moves. A hint: a peer writing garbage only
    /// misleads our spinning.
    cpu: AtomicU32,
    _p3: [u8; 60],
    /// Staging bytes the owner has copied out (the peer may write up to `STAGE` past it).
    stage_head: AtomicU64,
    _p4: [u8; 56],
}

/// A posted receive, in one cache line: what the owner wrote when posting it, then what the
/// peer writes when completing it, beside the message's first bytes. The owner polls `state`;
/// a protocol that reads its header from the head fetches one line from the peer's core for a
/// message, not two in a row (this one, then the buffer's first).
#[repr(C, align(64))]
struct Entry {
    /// Unused (zero): the receive's buffer is none of the peer's business.
    _r0: AtomicU64,
    /// The buffer's length (at most `u32::MAX`: far above the largest message).
    len: AtomicU32,
    /// 1 when the receive may be written into (its buffer has LOCAL_WRITE), as a NIC checks
    /// before it delivers; the owner checks again as it copies the payload in.
    writable: AtomicU32,
    /// The low bits of the common layer's sequence number, a check of the order.
    seq: AtomicU32,
    state: AtomicU32,
    /// The receive's status (0 for success, else a `WcStatus` code), its flags and the bytes
    /// of `head` in use, a byte each.
    info: AtomicU32,
    imm: AtomicU32,
    byte_len: AtomicU32,
    head: [AtomicU32; HEAD_WORDS],
}

#[cfg(not(rdma_loom))]
const _: () = assert!(ENTRY == 64 && HEADER == 4096);

/// Bytes of a segment for `cap` entries (a power of two), staging area included.
pub(crate) fn bytes(cap: usize) -> usize {
    HEADER + cap * ENTRY + STAGE
}

/// The capacity for a queue of `max_recv_wr`.
pub(crate) fn capacity(max_recv_wr: u32) -> usize {
    (max_recv_wr as usize).next_power_of_two().max(2)
}

struct Segment {
    map: Arc<Mapping>,
    cap: usize,
}

impl Segment {
    fn new(map: Arc<Mapping>) -> Option<Segment> {
        let n = map.len().checked_sub(HEADER + STAGE)? / ENTRY;
        // The largest power of two that fits: both sides derive the same from the same size.
        let cap = if n == 0 {
            return None;
        } else {
            1usize << (usize::BITS - 1 - n.leading_zeros())
        };
        Some(Segment { map, cap })
    }

    /// Builds loom's atomics in the fresh (zeroed) segment; the standard ones need nothing, as
    /// zero bytes are a valid atomic.
    #[cfg(rdma_loom)]
    fn init(&self) {
        let zero = || AtomicU32::new(0);
        // SAFETY: the segment is HEADER + cap * ENTRY bytes of our own fresh mapping, page
        // aligned, and nothing refers to it yet; each value is written once, at its own place.
        unsafe {
            self.map.ptr().cast::<Header>().write(Header {
                tail: AtomicU64::new(0),
                _p0: [0; 56],
                head: AtomicU64::new(0),
                _p1: [0; 56],
                armed: zero(),
                _p2: [0; 60],
                cpu: zero(),
                _p3: [0; 60],
                stage_head: AtomicU64::new(0),
                _p4: [0; 56],
            });
            for i in 0..self.cap {
                self.map.ptr().add(HEADER + i * ENTRY).cast::<Entry>().write(Entry {
                    _r0: AtomicU64::new(0),
                    len: zero(),
                    writable: zero(),
                    seq: zero(),
                    state: zero(),
                    info: zero(),
                    imm: zero(),
                    byte_len: zero(),
                    head: std::array::from_fn(|_| zero()),
                });
            }
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER bytes, page aligned; Header is all atomics,
        // valid for any bits, only accessed atomically.
        unsafe { &*self.map.ptr().cast::<Header>() }
    }

    /// The staging area's first byte (after the entries).
    fn stage(&self) -> *mut u8 {
        self.map.ptr().wrapping_add(HEADER + self.cap * ENTRY)
    }

    fn entry(&self, i: u64) -> &Entry {
        // `cap` is a power of two (see `new`): a mask, not a division, on every message.
        let i = (i & (self.cap as u64 - 1)) as usize;
        // SAFETY: `i < cap` and HEADER + cap * ENTRY <= the mapping's length; Entry is all
        // atomics, 64-byte aligned (HEADER and ENTRY are multiples of 64).
        unsafe { &*self.map.ptr().add(HEADER + i * ENTRY).cast::<Entry>() }
    }
}

/// The owner's side: post and drain.
pub(crate) struct OwnRq {
    seg: Segment,
    /// Entries whose completion was drained (or taken by the owner itself).
    drained: AtomicU64,
    /// Entries posted: the owner's own count, which the shared `tail` only publishes (the peer
    /// can write that word, and must not make the owner drain receives it never posted).
    posted: AtomicU64,
    /// Staging bytes copied out: the owner's own count (`stage_head` publishes it).
    staged: AtomicU64,
}

/// One completed receive, as drained.
pub(crate) struct Done {
    /// The low 32 bits of the receive's sequence number.
    pub(crate) seq: u32,
    pub(crate) status: WcStatus,
    pub(crate) flags: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm: u32,
    /// A copy of the message's first bytes.
    pub(crate) head: Head,
}

impl OwnRq {
    /// A new segment for `cap` entries: its memfd (to send to the peer) and the owner's side.
    pub(crate) fn create(cap: usize) -> Result<(std::os::fd::OwnedFd, OwnRq)> {
        let len = bytes(cap);
        let fd =
            sys::sealed_memfd("rdma-rpc-shm-rq", len as u64).map_err(|e| Error::io("creating a receive queue", e))?;
        let map = Arc::new(Mapping::map(&fd, len).map_err(|e| Error::io("mapping a receive queue", e))?);
        let seg = Segment::new(map).ok_or_else(|| Error::InvalidArgument("receive queue too small".into()))?;
        #[cfg(rdma_loom)]
        seg.init();
        Ok((
            fd,
            OwnRq {
                seg,
                drained: AtomicU64::new(0),
                posted: AtomicU64::new(0),
                staged: AtomicU64::new(0),
            },
        ))
    }

    /// Publishes a posted receive (the owner's engine holds its state lock).
    pub(crate) fn post(&self, seq: u64, len: u64, writable: bool) {
        let h = self.seg.header();
        let tail = self.posted.load(Ordering::Relaxed);
        let e = self.seg.entry(tail);
        e.seq.store(seq as u32, Ordering::Relaxed);
        e.len.store(len.min(u64::from(u32::MAX)) as u32, Ordering::Relaxed);
        e.writable.store(u32::from(writable), Ordering::Relaxed);
        e.info.store(0, Ordering::Relaxed);
        e.byte_len.store(0, Ordering::Relaxed);
        e.state.store(POSTED, Ordering::Relaxed);
        self.posted.store(tail.wrapping_add(1), Ordering::Relaxed);
        h.tail.store(tail.wrapping_add(1), Ordering::Release);
    }

    /// Copies the next `dst.len()` staged bytes (a drained Send's payload, `len <= STAGE`)
    /// into `dst`, the receive's own buffer, and gives their room back to the peer.
    pub(crate) fn take_staged(&self, dst: &mut [u8]) {
        let n = dst.len().min(STAGE);
        let pos = self.staged.load(Ordering::Relaxed);
        let at = (pos % STAGE as u64) as usize;
        let first = n.min(STAGE - at);
        // SAFETY: `at + first <= STAGE` and `n - first <= STAGE`: both copies stay inside the
        // staging area of our mapping; `dst` is our own memory, `n` bytes long. The peer
        // wrote these bytes before the entry's DONE (read with Acquire); one that writes them
        // again now only garbles its own message.
        unsafe {
            std::ptr::copy_nonoverlapping(self.seg.stage().add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.seg.stage(), dst.as_mut_ptr().add(first), n - first);
        }
        self.skip_staged(n);
    }

    /// Gives the room of `len` staged bytes back without reading them (a delivery that failed
    /// on this side).
    pub(crate) fn skip_staged(&self, len: usize) {
        let pos = self.staged.load(Ordering::Relaxed).wrapping_add(len as u64);
        self.staged.store(pos, Ordering::Relaxed);
        self.seg.header().stage_head.store(pos, Ordering::Release);
    }

    /// Tells the peer which CPU our poller runs on (a store only when that changed).
    pub(crate) fn publish_cpu(&self, cpu: u32) {
        let word = &self.seg.header().cpu;
        let v = cpu.wrapping_add(1);
        if word.load(Ordering::Relaxed) != v {
            word.store(v, Ordering::Relaxed);
        }
    }

    /// Asks the peer to ring the doorbell after its next completion (one-shot, as
    /// `ibv_req_notify_cq`). Poll once more after arming: a completion written just before
    /// was not rung for.
    pub(crate) fn arm(&self) {
        self.seg.header().armed.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Whether the peer took an entry not drained yet (a cheap look before locking anything).
    /// It looks at the oldest posted entry's state, not at `head`: the entry's line is the one
    /// the drain reads anyway, so a message costs the owner one line fetched from the peer's
    /// core instead of two in a row (`head`, then the entry).
    pub(crate) fn has_taken(&self) -> bool {
        self.oldest_done().is_some()
    }

    /// The oldest posted entry that nobody drained yet, with its index, if the peer completed it.
    fn oldest_done(&self) -> Option<(u64, &Entry)> {
        let d = self.drained.load(Ordering::Relaxed);
        if d == self.posted.load(Ordering::Relaxed) {
            return None;
        }
        let e = self.seg.entry(d);
        (e.state.load(Ordering::Acquire) == DONE).then_some((d, e))
    }

    /// The oldest completion the peer wrote and nobody drained yet, if any. `None` also at the
    /// first entry that is not done (the peer marks entries in order, each before it moves
    /// `head` past it; a peer that lies stalls itself). Each call moves past what it returns,
    /// so a caller may drain again while handling an entry.
    #[cfg(test)]
    pub(crate) fn next_done(&self) -> Option<Done> {
        let (at, done) = self.peek_done()?;
        self.pass(at);
        Some(done)
    }

    /// As [`OwnRq::next_done`], leaving the entry where it is, with its index: [`OwnRq::pass`]
    /// moves past it.
    pub(crate) fn peek_done(&self) -> Option<(u64, Done)> {
        let (at, e) = self.oldest_done()?;
        let info = e.info.load(Ordering::Relaxed);
        let status = match info & 0xff {
            0 => WcStatus::Success,
            code => WcStatus::from_raw(code),
        };
        let done = Done {
            seq: e.seq.load(Ordering::Relaxed),
            status,
            flags: (info >> 8) & 0xff,
            byte_len: e.byte_len.load(Ordering::Relaxed),
            imm: e.imm.load(Ordering::Relaxed),
            head: e.head((info >> 16) as usize & 0xff),
        };
        Some((at, done))
    }

    /// Moves past entry `at`, which [`OwnRq::peek_done`] showed: whatever the peer wrote into
    /// its state since, this side drains each entry once.
    pub(crate) fn pass(&self, at: u64) {
        self.seg.entry(at).state.store(POSTED, Ordering::Relaxed);
        self.drained.store(at.wrapping_add(1), Ordering::Relaxed);
    }

    /// The owner's engine takes the oldest receive for a request that came as a frame. Fails
    /// when the peer also took receives directly that are not drained yet (it must not, while
    /// a frame of its is in flight).
    pub(crate) fn take_for_frame(&self) -> bool {
        let h = self.seg.header();
        let d = self.drained.load(Ordering::Relaxed);
        if h.head
            .compare_exchange(d, d.wrapping_add(1), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.drained.store(d.wrapping_add(1), Ordering::Relaxed);
        true
    }
}

/// The peer's receive queue, as the initiator of Sends sees it.
pub(crate) struct PeerRq {
    seg: Segment,
    /// The peer's `tail` as this side last read it. Entries before it are posted, so a Send
    /// reads the shared `tail` (a line the owner writes at every post, which a read then
    /// fetches from the owner's core before the Send's stores may commit) only once it has
    /// caught up with what it saw: once per ring's worth of messages in a steady ping-pong.
    /// Sends (its only users) are serialised by the QP's engine.
    tail_seen: AtomicU64,
    /// Staging bytes written (this side's own count), and the owner's `stage_head` as last
    /// read (read again only when the room it shows is short).
    staged: AtomicU64,
    stage_head_seen: AtomicU64,
}

/// A receive the peer posted, taken.
pub(crate) struct Taken<'a> {
    entry: &'a Entry,
    /// The message's first bytes, for the completion (`with_head`).
    msg_head: &'a [u8],
    head: u64,
    rq: &'a PeerRq,
    pub(crate) len: u64,
    /// Whether the receive's buffer may be written (as its owner said).
    pub(crate) writable: bool,
}

impl PeerRq {
    pub(crate) fn map(fd: &std::os::fd::OwnedFd) -> Result<PeerRq> {
        let size = sys::peer_memfd(fd).map_err(|e| Error::io("checking the peer's receive queue", e))?;
        // Exactly a queue of a power of two entries, as `capacity` makes them.
        let size = usize::try_from(size).unwrap_or(0);
        if !(1..=16).any(|k| bytes(1 << k) == size) {
            return Err(Error::Protocol(format!(
                "the peer's receive queue is {size} bytes, not a queue of 2 to 65536 entries"
            )));
        }
        let map = Arc::new(Mapping::map(fd, size).map_err(|e| Error::io("mapping the peer's receive queue", e))?);
        let seg = Segment::new(map).ok_or_else(|| Error::Protocol("the peer's receive queue is too small".into()))?;
        Ok(PeerRq {
            seg,
            tail_seen: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            stage_head_seen: AtomicU64::new(0),
        })
    }

    /// Receives posted from `head` on, by the `tail` last seen; the shared `tail` is read only
    /// when that shows none, or makes no sense (the owner moves `head` too, when a frame takes
    /// an entry). `Err` when the shared counters make no sense.
    fn posted(&self, head: u64) -> std::result::Result<u64, ()> {
        let cap = self.seg.cap as u64;
        let posted = self.tail_seen.load(Ordering::Relaxed).wrapping_sub(head);
        if posted != 0 && posted <= cap {
            return Ok(posted);
        }
        let tail = self.seg.header().tail.load(Ordering::Acquire);
        let posted = tail.wrapping_sub(head);
        if posted > cap {
            return Err(());
        }
        self.tail_seen.store(tail, Ordering::Relaxed);
        Ok(posted)
    }

    /// The oldest receive the peer posted and nobody took; `Ok(None)` when there is none (RNR);
    /// `Err` when the counters make no sense.
    pub(crate) fn take(&self) -> std::result::Result<Option<Taken<'_>>, ()> {
        let head = self.seg.header().head.load(Ordering::Acquire);
        if self.posted(head)? == 0 {
            return Ok(None);
        }
        let entry = self.seg.entry(head);
        Ok(Some(Taken {
            entry,
            msg_head: &[],
            head,
            rq: self,
            len: u64::from(entry.len.load(Ordering::Relaxed)),
            writable: entry.writable.load(Ordering::Relaxed) == 1,
        }))
    }
}

impl PeerRq {
    /// The CPU the peer's poller last told us it runs on, if it told us.
    pub(crate) fn cpu(&self) -> Option<u32> {
        self.seg.header().cpu.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Where the next Send will land, when the peer has a receive posted beyond the one taken
    /// last: the entry's cache line and the first lines of the next `len` staging bytes are
    /// fetched for writing. A hint only.
    pub(crate) fn prefetch_next(&self, len: usize) {
        let head = self.seg.header().head.load(Ordering::Relaxed);
        // Only what was seen posted: reading the shared `tail` here would fetch its line from
        // the owner's core after every post.
        let posted = self.tail_seen.load(Ordering::Relaxed).wrapping_sub(head);
        if posted == 0 || posted > self.seg.cap as u64 {
            return;
        }
        let entry = self.seg.entry(head);
        sys::prefetch(std::ptr::from_ref(entry).cast(), ENTRY, true);
        let at = (self.staged.load(Ordering::Relaxed) % STAGE as u64) as usize;
        sys::prefetch(self.seg.stage().wrapping_add(at), len.min(STAGE - at), true);
    }

    /// Room for `len` more staged bytes, reading the owner's `stage_head` again only when the
    /// room last seen is short. `false` also when the owner's count makes no sense.
    fn stage_room(&self, len: usize) -> bool {
        let staged = self.staged.load(Ordering::Relaxed);
        let fits = |head: u64| staged.wrapping_sub(head) <= (STAGE - len) as u64;
        if len > STAGE {
            return false;
        }
        if fits(self.stage_head_seen.load(Ordering::Relaxed)) {
            return true;
        }
        let head = self.seg.header().stage_head.load(Ordering::Acquire);
        self.stage_head_seen.store(head, Ordering::Relaxed);
        fits(head)
    }
}

impl Entry {
    /// The head the peer wrote, `n` bytes (checked: a peer writing garbage gets at most
    /// `HEAD_MAX` bytes of garbage).
    fn head(&self, n: usize) -> Head {
        let mut bytes = [0u8; HEAD_MAX];
        for (i, w) in self.head.iter().enumerate().take(n.div_ceil(4)) {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        Head::from_array(bytes, n)
    }

    /// Stores the first bytes of `msg`; returns how many.
    fn set_head(&self, msg: &[u8]) -> u32 {
        let n = msg.len().min(HEAD_MAX);
        for (w, chunk) in self.head.iter().zip(msg[..n].chunks(4)) {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            w.store(u32::from_le_bytes(word), Ordering::Relaxed);
        }
        n as u32
    }
}

impl<'a> Taken<'a> {
    /// Writes a Send's payload into the staging area, where the owner's drain takes it; `false`
    /// (nothing written, the entry still untaken) when there is no room: the Send goes another
    /// way. A successful completion of `msg.len()` bytes must follow.
    pub(crate) fn stage(&self, msg: &[u8]) -> bool {
        let rq = self.rq;
        if !rq.stage_room(msg.len()) {
            return false;
        }
        let pos = rq.staged.load(Ordering::Relaxed);
        let at = (pos % STAGE as u64) as usize;
        let first = msg.len().min(STAGE - at);
        let dst = rq.seg.stage();
        // SAFETY: both copies stay inside the staging area (`at + first <= STAGE`, the rest
        // from its start, `msg.len() <= STAGE`), in room the owner gave back (`stage_room`);
        // it reads them only after the entry's DONE.
        unsafe {
            super::copy::for_peer(msg.as_ptr(), dst.add(at), first);
            std::ptr::copy_nonoverlapping(msg.as_ptr().add(first), dst, msg.len() - first);
            // The owner's drain reads them next: from the shared cache, not this core's.
            sys::demote(dst.add(at), first);
        }
        rq.staged.store(pos.wrapping_add(msg.len() as u64), Ordering::Relaxed);
        true
    }

    /// A copy of the message's first bytes goes with the completion (see [`Head`]).
    pub(crate) fn with_head(self, msg: &'a [u8]) -> Self {
        Taken { msg_head: msg, ..self }
    }

    /// Writes the receive's completion and hands the entry to the owner; true when the owner
    /// waits for it (armed), so the caller must ring its doorbell.
    #[must_use]
    pub(crate) fn complete(self, status: WcStatus, flags: u32, byte_len: u64, imm: u32) -> bool {
        let e = self.entry;
        let code = if status.is_success() { 0 } else { status as u32 & 0xff };
        let n = e.set_head(if status.is_success() { self.msg_head } else { &[] });
        e.info.store(code | (flags & 0xff) << 8 | n << 16, Ordering::Relaxed);
        e.byte_len
            .store(byte_len.min(u64::from(u32::MAX)) as u32, Ordering::Relaxed);
        e.imm.store(imm, Ordering::Relaxed);
        e.state.store(DONE, Ordering::Release);
        // The owner's CQ drain reads this entry next: from the shared cache, not this core's.
        // SAFETY: `e` is a reference into the mapped queue segment, ENTRY bytes long.
        unsafe { sys::demote(std::ptr::from_ref(e).cast(), ENTRY) };
        let h = self.rq.seg.header();
        h.head.store(self.head.wrapping_add(1), Ordering::Release);
        // Pairs with the fence in `OwnRq::arm`: either the owner's poll after arming sees this
        // entry, or this sees the owner armed.
        fence(Ordering::SeqCst);
        h.armed.load(Ordering::Relaxed) != 0 && h.armed.swap(0, Ordering::AcqRel) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_sees_completions_in_order_and_frames_take_the_next_entry() {
        let (fd, own) = OwnRq::create(4).expect("rq");
        let peer = PeerRq::map(&fd).expect("map");
        assert!(!own.has_taken() && own.next_done().is_none(), "nothing posted");
        own.post(7, 64, true);
        own.post(8, 128, true);
        assert!(!own.has_taken(), "posted, not completed");
        let t = peer.take().expect("counters").expect("a posted receive");
        assert_eq!(t.len, 64);
        assert!(!t.complete(WcStatus::Success, HAS_IMM, 5, 9), "not armed: no doorbell");
        assert!(own.has_taken());
        let d = own.next_done().expect("done");
        assert_eq!((d.seq, d.byte_len, d.flags, d.imm), (7, 5, HAS_IMM, 9));
        assert!(d.status.is_success());
        assert!(
            !own.has_taken() && own.next_done().is_none(),
            "drained; the second is not done"
        );
        // A request that came as a frame takes the second entry; the peer's next take finds none.
        assert!(own.take_for_frame());
        assert!(peer.take().expect("counters").is_none());
        assert!(!own.has_taken() && own.next_done().is_none());
        // Reposted after a wrap-around: a drained entry's old completion is not seen again.
        for seq in 9..12 {
            own.post(seq, 64 * seq, true);
        }
        assert!(!own.has_taken(), "fresh entries over drained ones");
        own.arm();
        let t = peer.take().expect("counters").expect("posted");
        assert!(t.complete(WcStatus::Success, 0, 1, 0), "armed: ring the doorbell once");
        assert_eq!(own.next_done().map(|d| d.seq), Some(9));
        // Posted after the peer last looked: it finds them once it has taken what it saw.
        own.post(12, 64 * 12, true);
        own.post(13, 64 * 13, true);
        for seq in 10..14 {
            let t = peer.take().expect("counters").expect("posted");
            assert_eq!(t.len, 64 * seq, "taken in posting order");
            assert!(!t.complete(WcStatus::Success, 0, 1, 0));
        }
        assert!(peer.take().expect("counters").is_none(), "all taken");
        assert_eq!(
            std::iter::from_fn(|| own.next_done())
                .map(|d| d.seq)
                .collect::<Vec<_>>(),
            [10, 11, 12, 13]
        );
        // A copy of the message's first bytes goes with its completion; a peer's head length
        // past the entry's room reads as the room.
        own.post(16, 64 * 16, true);
        own.post(17, 64 * 17, true);
        let msg: Vec<u8> = (0..40).collect();
        let t = peer.take().expect("counters").expect("posted");
        assert!(!t.with_head(&msg).complete(WcStatus::Success, 0, 40, 0));
        let t = peer.take().expect("counters").expect("posted");
        let e = t.entry;
        assert!(!t.with_head(&msg).complete(WcStatus::Success, 0, 40, 0));
        e.info.store(255 << 16, Ordering::Relaxed);
        assert_eq!(own.next_done().map(|d| d.head), Some(Head::copy_of(&msg[..HEAD_MAX])));
        assert_eq!(own.next_done().map(|d| d.head.bytes().len()), Some(HEAD_MAX));
        // A frame takes an entry the peer never saw posted: `head` passes what the peer saw,
        // and the peer must not take the entry after it, which nobody posted.
        own.post(14, 64 * 14, true);
        assert!(own.take_for_frame());
        assert!(
            peer.take().expect("counters").is_none(),
            "nothing posted past the frame's"
        );
        own.post(15, 64 * 15, true);
        assert_eq!(peer.take().expect("counters").map(|t| t.len), Some(64 * 15));
    }

    /// A peer that writes the shared `tail` and every entry's state word, as a hostile one
    /// could: the owner drains no more completions than it posted receives, so it never loops
    /// on entries it never gave out.
    #[test]
    fn a_peer_that_floods_tail_and_states_completes_no_more_than_was_posted() {
        let (fd, own) = OwnRq::create(4).expect("rq");
        let peer = PeerRq::map(&fd).expect("map");
        own.post(7, 64, true);
        for _ in 0..3 {
            peer.seg.header().tail.store(1000, Ordering::Release);
            for i in 0..4 {
                peer.seg.entry(i).state.store(DONE, Ordering::Release);
            }
            let drained = std::iter::from_fn(|| own.next_done()).take(100).count();
            assert!(drained <= 1, "{drained} completions drained for 1 receive posted");
        }
        // The owner's next post goes where its own count says, whatever the peer wrote.
        own.post(8, 128, true);
        assert_eq!(peer.seg.header().tail.load(Ordering::Acquire), 2);
    }
}

/// Models of the queue's synchronisation under loom, which runs each body in every
/// interleaving of its threads that the C++ memory model allows (within loom's bounds):
/// `RUSTFLAGS="--cfg rdma_loom" cargo test -p rdma-rpc-transport --release --lib shm::rq::models`.
#[cfg(all(test, rdma_loom))]
mod models {
    use super::*;

    /// The owner arms its CQ and polls once more while the peer completes a receive: the
    /// owner sees the completion, or the peer rings its doorbell, never neither (a lost
    /// wake-up would leave the owner asleep with a completion waiting).
    #[test]
    fn a_completion_is_seen_after_arming_or_rung_for() {
        loom::model(|| {
            let (fd, own) = OwnRq::create(2).expect("rq");
            let peer = PeerRq::map(&fd).expect("map");
            own.post(1, 64, true);
            let sender = loom::thread::spawn(move || {
                let t = peer.take().expect("sane counters").expect("the posted receive");
                t.complete(WcStatus::Success, 0, 5, 0)
            });
            let before = own.next_done().is_some();
            own.arm();
            let after = before || own.next_done().is_some();
            let rung = sender.join().expect("the sender");
            assert!(after || rung, "a completion neither seen after arming nor rung for");
        });
    }

    /// Receives posted while the peer completes earlier ones, around the ring (two entries):
    /// the owner drains every completion once, in order, with the fields the peer wrote for
    /// that receive (no entry's old completion read again, none torn), and the peer takes
    /// each receive once, with the fields the owner posted.
    #[test]
    fn completions_around_the_ring_are_drained_once_in_order_and_whole() {
        loom::model(|| {
            const N: u32 = 3;
            let (fd, own) = OwnRq::create(2).expect("rq");
            let peer = PeerRq::map(&fd).expect("map");
            own.post(1, 64, true);
            let sender = loom::thread::spawn(move || {
                let mut next = 1;
                while next <= N {
                    match peer.take().expect("sane counters") {
                        Some(t) => {
                            assert_eq!(t.len, 64 * u64::from(next), "the receive posted");
                            let _ = t.complete(WcStatus::Success, 0, u64::from(next) * 10, next);
                            next += 1;
                        }
                        None => loom::thread::yield_now(),
                    }
                }
            });
            let (mut posted, mut drained) = (1, 0);
            while drained < N {
                if posted < N && posted - drained < 2 {
                    posted += 1;
                    own.post(u64::from(posted), 64 * u64::from(posted), true);
                }
                match own.next_done() {
                    Some(d) => {
                        drained += 1;
                        assert_eq!((d.seq, d.byte_len, d.imm), (drained, drained * 10, drained));
                    }
                    None => loom::thread::yield_now(),
                }
            }
            sender.join().expect("the sender");
            assert!(own.next_done().is_none(), "nothing drained twice");
        });
    }
}
