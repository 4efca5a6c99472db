//! The sending side of a software QP's connection, shared by posters and the responder.
//!
//! `send` never blocks on the socket: a frame goes out at once with a non-blocking send when
//! nothing is queued, and otherwise joins a backlog that the queue pair's turns on its device's
//! progress engine flush ([`Sender::write_turn`]), with non-blocking writes too, asking to turn
//! again when the link has room. So the reader (the responder: the progress engine or a polling
//! application thread) can answer without ever waiting on the peer, and two engines can never
//! wait on each other, while the common case costs one syscall and no thread hop.
//!
//! A read response goes in parts of at most 256 KiB, each a frame (`READ_PART`, the last a
//! `READ_RESP`), as a NIC sends a long read response in packets. Its payload is not copied
//! into the backlog: it waits there as a reference to the registered memory it comes from, and
//! the writer copies it out a part at a time as the link takes it, as a NIC reads host
//! memory while it transmits. A peer that asks for reads and does not take the answers
//! (hostile, or its own reader stuck) then costs this side a few dozen bytes per request, not a
//! copy of each response: 64 reads of a 16 MiB registration grew the process by 1 GiB before
//! (`tcp_hostile`'s test of it). Only the rest of a part the link took some of at once is
//! copied: a frame on the link is never left half-written to wait for memory.
//!
//! The backlog carries two streams, as an RC QP's wire does: this side's requests, and its
//! responses to the peer's (acknowledgements, read responses, atomic answers). Each keeps its
//! own order. A response part that needs registered memory the application holds for writing
//! waits for it, and the requests queued behind it go out meanwhile; they also go between two
//! parts of a long read response. A NIC answers a peer from host memory whatever the
//! application does, so an application that holds memory a peer reads never waits for that
//! peer's answer to get its own Sends out, and a short request never waits for a long answer
//! to go whole.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::link::{Link, BEAT};
use super::wire::Encoder;
use crate::mr::{Region, Rmw};
use crate::nic::progress::Waker;

/// The most bytes a piece of the backlog holds: what is queued beyond it goes into the next
/// piece. The writer moves past what the link took without moving the rest, and an emptied
/// piece is kept for reuse, so that a backlog of many long frames costs a copy in and a copy
/// out per byte, whatever its length (a backlog in one buffer, drained at its front, moves
/// all of its rest at each write). As large as `shm`'s ring, so that one write fills it.
const CHUNK: usize = 1 << 20;

/// The most capacity of emptied pieces kept for reuse.
const SPARE_MAX: usize = 4 << 20;

/// The longest part of a read response: the writer copies one out of registered memory at a
/// time, holding the region's lock only for that copy.
const PART: usize = 256 << 10;

/// How long a response that needs memory the application holds waits before the writer looks
/// at it again (it lets requests pass meanwhile).
pub(crate) const RECHECK: Duration = Duration::from_micros(200);

/// A piece of the backlog.
enum Piece {
    /// Frames as bytes. `request`: all of them are this side's requests, which may pass a
    /// response waiting for memory. (The first piece may be the rest of a frame already begun;
    /// it is at the front, so it goes before anything can pass it.) `at`: how many of them
    /// went out already (only at the front).
    Bytes { bytes: Vec<u8>, at: usize, request: bool },
    /// What is left of the response to Read `ssn`: `len` bytes of `region` from `off`, read
    /// as they go out, a part at a time.
    Memory {
        ssn: u64,
        region: Arc<Region>,
        off: usize,
        len: usize,
    },
    /// An atomic the responder found its region locked for: run, and answered, when its turn
    /// to go out comes (RC lets later requests overtake an atomic; fences order them).
    Atomic {
        ssn: u64,
        region: Arc<Region>,
        off: usize,
        op: Rmw,
    },
}

/// What the writer did with the piece at the front.
enum Step {
    /// It went whole.
    Done,
    /// The link took part of it or nothing: the rest waits at the front for room.
    Full,
    /// It needs memory the application holds: it waits at the front for [`RECHECK`]. `full`:
    /// the requests it let pass filled the link meanwhile.
    Memory { full: bool },
}

#[derive(Default)]
struct State {
    backlog: VecDeque<Piece>,
    /// Pieces of bytes the writer emptied, kept for the next ones (no allocation per piece);
    /// their capacity in all at most [`SPARE_MAX`].
    spares: Vec<Vec<u8>>,
    /// Frames to go out ahead of the next one sent, in its write ([`Sender::ahead`]): responses.
    ahead: Vec<u8>,
    /// Close the sending side once the backlog is out.
    close_after: bool,
    closed: bool,
    /// Writes so far, and their count at the last heartbeat check: an idle link beats.
    writes: u64,
    beat_mark: u64,
    beat_at: Option<Instant>,
}

impl State {
    /// Nothing queued: a frame may go out at once.
    fn idle(&self) -> bool {
        self.backlog.is_empty()
    }

    /// `head` with whatever waits to go ahead of it in front; `joined` holds the two when
    /// something does.
    fn with_ahead<'a>(&mut self, head: &'a [u8], joined: &'a mut Vec<u8>) -> &'a [u8] {
        if self.ahead.is_empty() {
            return head;
        }
        *joined = std::mem::take(&mut self.ahead);
        joined.extend_from_slice(head);
        joined
    }

    fn push_bytes(&mut self, mut bytes: &[u8], request: bool) {
        while !bytes.is_empty() {
            if let Some(Piece::Bytes {
                bytes: last,
                request: r,
                ..
            }) = self.backlog.back_mut()
            {
                if *r == request && last.len() < CHUNK {
                    let n = (CHUNK - last.len()).min(bytes.len());
                    last.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    continue;
                }
            }
            let b = self.spares.pop().unwrap_or_default();
            self.backlog.push_back(Piece::Bytes {
                bytes: b,
                at: 0,
                request,
            });
        }
    }

    /// Keeps an emptied piece's buffer for the next ones, while the kept ones hold little.
    fn recycle(&mut self, mut bytes: Vec<u8>) {
        let kept: usize = self.spares.iter().map(Vec::capacity).sum();
        if bytes.capacity() <= CHUNK && kept + bytes.capacity() <= SPARE_MAX {
            bytes.clear();
            self.spares.push(bytes);
        }
    }

    /// What waits to go ahead of the next frame, queued as the responses it is.
    fn queue_ahead(&mut self) {
        let ahead = std::mem::take(&mut self.ahead);
        self.push_bytes(&ahead, false);
    }

    /// This side's requests out of the backlog, in their order; the responses keep theirs.
    fn take_requests(&mut self) -> Vec<Vec<u8>> {
        let is_request = |p: &Piece| matches!(p, Piece::Bytes { request: true, .. });
        if !self.backlog.iter().any(is_request) {
            return Vec::new();
        }
        let mut requests = Vec::new();
        let mut rest = VecDeque::with_capacity(self.backlog.len());
        for piece in self.backlog.drain(..) {
            match piece {
                Piece::Bytes {
                    bytes, request: true, ..
                } => requests.push(bytes),
                other => rest.push_back(other),
            }
        }
        self.backlog = rest;
        requests
    }
}

pub(crate) struct Sender {
    link: Arc<dyn Link>,
    state: Mutex<State>,
    /// Turns the queue pair when the backlog needs its writer.
    waker: OnceLock<Waker>,
}

impl Sender {
    pub(crate) fn new(link: Arc<dyn Link>) -> Self {
        Self {
            link,
            state: Mutex::new(State::default()),
            waker: OnceLock::new(),
        }
    }

    /// Once the queue pair is on its progress engine: how the writer is woken.
    pub(crate) fn set_waker(&self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w.wake();
        }
    }

    /// Sends or queues one whole response frame (an acknowledgement, a NAK, an answer without
    /// payload, a Fatal). Fails only once the connection is closed.
    pub(crate) fn send(&self, frame: &[u8]) -> Result<(), ()> {
        self.put(frame, &[], false)
    }

    /// Sends or queues one of this side's requests, given as its header and its payload
    /// (borrowed from registered memory: only what the link does not take at once is copied,
    /// into the backlog). Fails only once the connection is closed.
    pub(crate) fn request(&self, head: &[u8], data: &[u8]) -> Result<(), ()> {
        self.put(head, data, true)
    }

    /// Puts whole `frames` ahead of the next frame sent, to go out in its write (the engine's
    /// deferred acknowledgement, ahead of the request that carries it). The caller holds what
    /// orders the frames it sends (the engine's state), so nothing sent later overtakes them.
    pub(crate) fn ahead(&self, frames: &[u8]) {
        self.state.lock().ahead.extend_from_slice(frames);
    }

    fn put(&self, head: &[u8], data: &[u8], request: bool) -> Result<(), ()> {
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        if !st.idle() {
            // The writer is due already (it waits for room or memory).
            st.queue_ahead();
            st.push_bytes(head, request);
            st.push_bytes(data, request);
            return Ok(());
        }
        let mut joined = Vec::new();
        let head = st.with_ahead(head, &mut joined);
        let sent = self.try_now(&mut st, head, data)?;
        if sent < head.len() + data.len() {
            // The frame's rest, at the front: it goes first, whatever it is.
            let (h, d) = (sent.min(head.len()), sent.saturating_sub(head.len()));
            st.push_bytes(&head[h..], false);
            st.push_bytes(&data[d..], false);
            drop(st);
            self.wake();
        }
        Ok(())
    }

    /// Sends or queues the response to Read `ssn`: `len` bytes of `region` from `off`, in parts.
    /// The parts go out at once while the link takes them whole, if nothing is queued and
    /// nobody holds the region for writing; the rest waits as a reference to the region, not as
    /// a copy (so does all of it while somebody holds the region: the application, which may
    /// post on this QP meanwhile, for the responder never waits for a registration's lock
    /// while it holds the QP's).
    pub(crate) fn send_from(&self, ssn: u64, region: &Arc<Region>, off: usize, len: usize) -> Result<(), ()> {
        // The region first, then our lock, in the order a post takes them (`request` with a
        // payload from a registered buffer).
        let bytes = region.try_read_range(off, len);
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        let rest = |at: usize| Piece::Memory {
            ssn,
            region: region.clone(),
            off: off + at,
            len: len - at,
        };
        let Some(bytes) = bytes.filter(|_| st.idle()) else {
            let was_idle = st.idle();
            st.queue_ahead();
            st.backlog.push_back(rest(0));
            drop(st);
            if was_idle {
                self.wake();
            }
            return Ok(());
        };
        let mut at = 0;
        loop {
            let n = PART.min(len - at);
            let head = part_head(ssn, n, len - at);
            let mut joined = Vec::new();
            let full = st.with_ahead(&head, &mut joined);
            let part = &bytes[at..at + n];
            let sent = self.try_now(&mut st, full, part)?;
            at += n;
            if sent < full.len() + n {
                // The part's rest, copied: the frame is on its way and must go whole.
                let (h, d) = (sent.min(full.len()), sent.saturating_sub(full.len()));
                st.push_bytes(&full[h..], false);
                st.push_bytes(&part[d..], false);
                break;
            }
            if at == len {
                return Ok(());
            }
        }
        if at < len {
            st.backlog.push_back(rest(at));
        }
        drop(st);
        self.wake();
        Ok(())
    }

    /// Runs a target's atomic on `region` and sends its answer; if somebody holds the region,
    /// or anything waits in the backlog (an atomic deferred before it may be there), the atomic
    /// waits in the backlog for the writer, which runs them in the order they came when the
    /// region is free.
    pub(crate) fn send_atomic(&self, ssn: u64, region: &Arc<Region>, off: usize, op: Rmw) -> Result<(), ()> {
        let mut st = self.state.lock();
        if st.closed || st.close_after {
            return Err(());
        }
        // What waits to go ahead goes first, from the backlog (the atomic then queues behind it).
        st.queue_ahead();
        // Only a try: no lock taken under ours is waited for.
        let now = st.idle().then(|| region.try_atomic(off, op)).flatten();
        if let Some(old) = now {
            drop(st);
            return self.send(&Encoder::atomic_resp(ssn, old).finish());
        }
        let was_idle = st.idle();
        st.backlog.push_back(Piece::Atomic {
            ssn,
            region: region.clone(),
            off,
            op,
        });
        drop(st);
        if was_idle {
            self.wake();
        }
        Ok(())
    }

    /// One non-blocking write of `head` then `data`: the bytes taken. A broken link closes.
    fn try_now(&self, st: &mut State, head: &[u8], data: &[u8]) -> Result<usize, ()> {
        st.writes += 1;
        self.link.try_write2(head, data).map_err(|_| st.closed = true)
    }

    /// Lets what is queued go out, then closes the sending side.
    pub(crate) fn close_after_flush(&self) {
        self.state.lock().close_after = true;
        self.wake();
    }

    /// Stops at once: nothing more goes out.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
    }

    /// The writer's turn (on the progress engine): writes the backlog, a piece at a time, as far
    /// as the link takes it without waiting; beats on a link idle for [`BEAT`]. Says whether to
    /// turn again when the link has room, and when at the latest (memory the application
    /// holds, the next beat).
    pub(crate) fn write_turn(&self, now: Instant) -> (bool, Option<Instant>) {
        let mut st = self.state.lock();
        loop {
            if st.closed {
                return (false, None);
            }
            if st.backlog.is_empty() {
                if st.close_after {
                    self.link.shutdown_write();
                    st.closed = true;
                    return (false, None);
                }
                return (false, self.beat(&mut st, now));
            }
            match self.write_front(&mut st) {
                Err(()) => {
                    st.closed = true;
                    return (false, None);
                }
                Ok(Step::Done) => {}
                Ok(Step::Full) => return (true, None),
                Ok(Step::Memory { full }) => return (full, Some(now + RECHECK)),
            }
        }
    }

    /// On a link that beats: a Beat frame when nothing went out since the last look a beat ago.
    /// When to look next.
    fn beat(&self, st: &mut State, now: Instant) -> Option<Instant> {
        if !self.link.beats() {
            return None;
        }
        match st.beat_at {
            Some(at) if now < at => return Some(at),
            Some(_) if st.writes == st.beat_mark && st.ahead.is_empty() => {
                // Nothing to send for a beat: the peer learns that this process lives.
                let beat = Encoder::beat().finish();
                if let Ok(sent) = self.try_now(st, &beat, &[]) {
                    st.push_bytes(&beat[sent..], false);
                }
            }
            _ => {}
        }
        st.beat_mark = st.writes;
        let at = now + BEAT;
        st.beat_at = Some(at);
        Some(at)
    }

    /// Writes the piece at the front of the backlog, or what of it the link takes.
    fn write_front(&self, st: &mut State) -> Result<Step, ()> {
        let Some(piece) = st.backlog.pop_front() else {
            return Ok(Step::Done);
        };
        match piece {
            Piece::Bytes { bytes, at, request } => {
                let n = self.try_now(st, &bytes[at..], &[])?;
                if at + n == bytes.len() {
                    st.recycle(bytes);
                    return Ok(Step::Done);
                }
                let at = at + n;
                // Begun, it must go first: nothing passes it any more.
                let request = request && at == 0;
                st.backlog.push_front(Piece::Bytes { bytes, at, request });
                Ok(Step::Full)
            }
            Piece::Memory { ssn, region, off, len } => {
                let n = PART.min(len);
                let Some(bytes) = region.try_read_range(off, n) else {
                    st.backlog.push_front(Piece::Memory { ssn, region, off, len });
                    let full = self.let_requests_pass(st)?;
                    return Ok(Step::Memory { full });
                };
                let head = part_head(ssn, n, len);
                let sent = self.try_now(st, &head, &bytes)?;
                if n < len {
                    st.backlog.push_front(Piece::Memory {
                        ssn,
                        region: region.clone(),
                        off: off + n,
                        len: len - n,
                    });
                }
                if sent < head.len() + n {
                    // The part's rest, copied: the frame is on its way and must go whole.
                    let (h, d) = (sent.min(head.len()), sent.saturating_sub(head.len()));
                    let mut rest = head[h..].to_vec();
                    rest.extend_from_slice(&bytes[d..]);
                    st.backlog.push_front(Piece::Bytes {
                        bytes: rest,
                        at: 0,
                        request: false,
                    });
                    return Ok(Step::Full);
                }
                drop(bytes);
                // A short request need not wait for a long answer to go whole.
                if n < len && self.let_requests_pass(st)? {
                    return Ok(Step::Full);
                }
                Ok(Step::Done)
            }
            Piece::Atomic { ssn, region, off, op } => {
                let Some(old) = region.try_atomic(off, op) else {
                    st.backlog.push_front(Piece::Atomic { ssn, region, off, op });
                    let full = self.let_requests_pass(st)?;
                    return Ok(Step::Memory { full });
                };
                let frame = Encoder::atomic_resp(ssn, old).finish();
                let sent = self.try_now(st, &frame, &[])?;
                if sent < frame.len() {
                    st.backlog.push_front(Piece::Bytes {
                        bytes: frame[sent..].to_vec(),
                        at: 0,
                        request: false,
                    });
                    return Ok(Step::Full);
                }
                Ok(Step::Done)
            }
        }
    }

    /// The requests queued behind the response at the front (which waits for memory, or is a
    /// long answer going in parts), written ahead of it as far as the link takes them; true
    /// when it filled up (what it did not take stays ahead of that response).
    fn let_requests_pass(&self, st: &mut State) -> Result<bool, ()> {
        let mut requests = st.take_requests().into_iter();
        while let Some(r) = requests.next() {
            let n = self.try_now(st, &r, &[])?;
            if n < r.len() {
                let rest: Vec<Vec<u8>> = requests.collect();
                for later in rest.into_iter().rev() {
                    st.backlog.push_front(Piece::Bytes {
                        bytes: later,
                        at: 0,
                        request: true,
                    });
                }
                st.backlog.push_front(Piece::Bytes {
                    bytes: r,
                    at: n,
                    request: n == 0,
                });
                return Ok(true);
            }
            st.recycle(r);
        }
        Ok(false)
    }
}

/// The frame head of the next `n` bytes of the response to Read `ssn`, of which `left` are still
/// to go: a part, or the last one.
fn part_head(ssn: u64, n: usize, left: usize) -> Vec<u8> {
    match n < left {
        true => Encoder::read_part(ssn).head(n),
        false => Encoder::read_resp(ssn).head(n),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A link that takes at most `room` bytes until given more, and keeps what it took.
    struct Narrow {
        room: AtomicUsize,
        took: Mutex<Vec<u8>>,
        fd: OwnedFd,
    }

    impl Narrow {
        fn new() -> Arc<Self> {
            let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd");
            Arc::new(Self {
                room: AtomicUsize::new(0),
                took: Mutex::new(Vec::new()),
                fd,
            })
        }
    }

    impl Link for Narrow {
        fn try_read(&self, _buf: &mut [u8]) -> std::io::Result<usize> {
            Ok(0)
        }
        fn event_fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }
        fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.room.load(Ordering::Relaxed));
            self.room.fetch_sub(n, Ordering::Relaxed);
            self.took.lock().extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn shutdown_write(&self) {}
        fn shutdown(&self) {}
    }

    fn longest_piece(s: &Sender) -> usize {
        let st = s.state.lock();
        st.backlog
            .iter()
            .map(|p| match p {
                Piece::Bytes { bytes, .. } => bytes.len(),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }

    /// Many long requests queued behind a link that takes little at a time: they go out whole
    /// and in order, while the backlog holds them in pieces of at most `CHUNK` bytes, so that
    /// a write moves nothing it did not send (one piece holding the whole backlog, drained at
    /// its front, moved the rest at every write).
    #[test]
    fn a_long_backlog_goes_out_in_order_from_bounded_pieces() {
        let link = Narrow::new();
        let s = Sender::new(link.clone());
        let mut want = Vec::new();
        for i in 0..24u64 {
            let data: Vec<u8> = (0..300_000u32).map(|b| (b as u64 * 7 + i) as u8).collect();
            let head = Encoder::send(i, None, true).head(data.len());
            s.request(&head, &data).expect("queued");
            want.extend_from_slice(&head);
            want.extend_from_slice(&data);
        }
        assert!(longest_piece(&s) <= CHUNK, "a piece of {} bytes", longest_piece(&s));
        let mut turns = 0;
        loop {
            link.room.store(100_000, Ordering::Relaxed);
            let (again, _) = s.write_turn(Instant::now());
            turns += 1;
            assert!(longest_piece(&s) <= CHUNK);
            if !again {
                break;
            }
            assert!(turns < 10_000, "the backlog never emptied");
        }
        assert!(*link.took.lock() == want, "the bytes went out as queued");
        let kept: usize = s.state.lock().spares.iter().map(Vec::capacity).sum();
        assert!(kept <= SPARE_MAX, "{kept} bytes of spare pieces kept");
        assert!(!s.state.lock().spares.is_empty(), "an emptied piece is kept for reuse");
    }
}
