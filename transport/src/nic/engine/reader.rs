//! How the engine reads its link: one resumable step at a time, never waiting, so that whoever
//! holds the reader can stop at any byte and the next holder goes on from there.
//!
//! Two kinds of holder take turns. While the application spins on one of the QP's CQs,
//! the polling thread reads the link itself (a tcp socket; on shm the ring of frames, which
//! carries what the peer could not deliver into our receive queue: Sends into a shared receive
//! queue, acknowledgements): the payload lands on the core that consumes it, with no thread in
//! between, and the device's progress engine (`nic/progress.rs`) leaves the link alone while
//! frames flow, looking again after each grace period ([`POLLER_GRACE`]). The engine watches
//! the link when nobody has polled for [`SPIN_GAP`], when a CQ is armed (its waiter sleeps),
//! when a grace period passes with frames waiting that the pollers did not take, and for a
//! while after that happened twice in a row (an application spinning on memory that RDMA
//! Writes fill): as a NIC keeps answering one-sided requests whatever the host's CPUs do. It
//! watches a quiet link too (a grace period in which nothing came), and leaves what then
//! arrives to the pollers while they spin: a QP with nothing coming costs no turns. Neither
//! holder ever waits for a lock another thread may hold (an application may hold a buffer's
//! lock while it polls, or for as long as it likes): a frame whose memory is held waits in the
//! reader, a poller hands it to the engine, and the engine looks again after
//! [`RECHECK`](crate::nic::sender::RECHECK).
//!
//! A task that sleeps on an armed CQ watches the socket too (`tcp/watch.rs`): an arrival wakes
//! it and the engine at once, and its next poll reads the socket when the reader is free
//! (payloads over [`POLLER_LANDS_MAX`] excepted).
//!
//! A CQ keeps the sockets of its tcp QPs in an epoll set: a poll asks it once (one system call
//! however many QPs share the CQ) and reads only the sockets that have something, plus any QP
//! whose last poll left whole frames read ahead.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AckWhen, Engine, Stop};
use crate::mr::Region;
use crate::nic::inbox::Inbox;
use crate::nic::link::{BEAT, KEEPALIVE};
use crate::nic::now_nanos;
use crate::nic::progress::Why;
use crate::nic::sender::RECHECK;
use crate::nic::wire::{DataHead, Frame, MAX_BODY};

/// Pollers count as spinning while the last poll came at most this long ago; an application
/// that polls less often leaves the socket to the progress engine. The price of the pollers' speed:
/// while an application polls at least this often, what arrives for it waits for its next poll
/// (and so does the acknowledgement its peer's completion waits for), where a NIC would handle it
/// at once. Shorter gaps hand more of a large message's frames to the progress engine
/// mid-transfer, which slows large RPCs (docs/decisions.md).
const SPIN_GAP: Duration = Duration::from_micros(200);

/// How long the progress engine leaves the socket to spinning pollers before it looks again:
/// frames that pollers who stopped without arming a CQ leave wait at most this much.
const POLLER_GRACE: Duration = Duration::from_millis(1);

/// A grace period ran out with the pollers no longer spinning and requests waiting that complete
/// nothing on this side (a Write without immediate, a Read, an atomic: the application cannot
/// learn from a CQ that they came, and may be waiting on the memory a Write fills): a strike.
/// Two strikes this close together, and the progress engine watches the socket itself for
/// [`DISTRUST`], so that such an application pays the grace period only twice that often. (Watching while pollers poll works, but costs a wake-up of
/// the progress engine per arrival and frames landed on the wrong core.)
const STRIKES_WITHIN: Duration = Duration::from_millis(10);
const DISTRUST: Duration = Duration::from_secs(1);

/// The longest payload a poll lands while a waiter sleeps on one of the QP's CQs (it woke
/// because the socket had something: `tcp/watch.rs`); a longer one is the progress engine's,
/// which watches the socket then too: the waiter's thread landing long payloads as well slowed
/// large Reads that wait.
const POLLER_LANDS_MAX: usize = 64 << 10;

/// How far a long frame's buffer grows ahead of the bytes that arrived.
const GROW: usize = 1 << 20;

/// The longest frame that carries no payload (a request for a Read, an atomic, an
/// acknowledgement, a refusal and its reason): anything longer is not this protocol.
const CONTROL_MAX: usize = 4096;

/// Frames one poll takes at most (the rest waits for the next poll, or the progress engine).
const FRAMES_PER_POLL: usize = 64;

/// Where the reader is in the byte stream.
pub(super) enum Partial {
    /// At a frame boundary.
    Idle,
    /// A payload landing in registered memory: `got` of `len` bytes so far.
    Landing {
        head: DataHead,
        region: Arc<Region>,
        off: usize,
        len: usize,
        got: usize,
    },
    /// The body of a frame too long for the inbox, read whole: `len` bytes, `got` so far. The
    /// buffer grows with the bytes that arrive, never ahead of them by more than [`GROW`]: a
    /// length field alone allocates nothing.
    Body { buf: Vec<u8>, got: usize, len: usize },
}

/// The engine's read side; whoever holds it reads.
pub(super) struct Reader {
    inbox: Inbox,
    partial: Partial,
    /// The link ended or broke (its end is handled once, by whoever met it).
    stopped: bool,
    /// Requests handled so far that complete nothing on this side (a Write without immediate,
    /// a Read, an atomic): nothing tells this side's application that they came.
    silent: u64,
}

impl Reader {
    pub(super) fn new(inbox: Inbox) -> Self {
        Self {
            inbox,
            partial: Partial::Idle,
            stopped: false,
            silent: 0,
        }
    }
}

/// Who holds the reader.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Who {
    /// The device's progress engine: reads long frames too.
    Thread,
    /// An application thread polling a CQ: only what lands at once.
    Poller,
}

/// The reader's state between two turns on the progress engine.
#[derive(Default)]
pub(super) struct ReadLoop {
    /// Frames the pollers had taken at the last turn.
    taken: u64,
    distrust_until: Option<Instant>,
    last_strike: Option<Instant>,
    /// The last turn left the socket to the pollers for a grace period.
    left: bool,
    /// The last turn found the held frames at their cap: nothing is read until the stall ends.
    throttled: bool,
    /// The last turn met memory the application holds: look again soon.
    retry: bool,
}

/// What the reader waits for after a turn.
pub(super) struct ReadNext {
    /// The link having something to read.
    pub(super) watch: bool,
    pub(super) at: Option<Instant>,
}

enum Outcome {
    /// A frame was handled.
    Frame,
    /// Nothing more has arrived.
    Blocked,
    /// The next frame is for the progress engine.
    HandOff,
    /// The frames held behind an RNR stall reached their cap: read nothing until it ends.
    Throttled,
}

impl Engine {
    /// The reader's turn on the progress engine: reads whatever the polling threads leave, and
    /// everything while nobody polls; says what to wait for next.
    pub(super) fn read_turn(self: &Arc<Self>, rl: &mut ReadLoop, why: Why, now: Instant) -> ReadNext {
        let idle = ReadNext { watch: false, at: None };
        // Woken: there is work for the engine (a hand-off, an armed CQ, an end).
        let mut rung = why.woken || std::mem::take(&mut rl.retry);
        // The last wait was a grace period that ran out, woken by nothing else.
        let mut graced = rl.left && why.timer && !why.readable && !why.woken;
        if rl.throttled {
            if self.throttle.load(Ordering::Acquire) {
                return idle; // the stall's end wakes this
            }
            (rl.throttled, rung, graced) = (false, true, false);
        }
        if self.reader.lock().stopped {
            return idle;
        }
        if self.link.silent_for().is_some_and(|s| s >= KEEPALIVE) {
            // Not a byte, not even a beat: the peer's process stopped or hangs (its kernel
            // may still acknowledge TCP, so the connection itself never says).
            let mut r = self.reader.lock();
            if !r.stopped {
                tracing::warn!(
                    qp = self.qp_num,
                    "the peer stayed silent for {KEEPALIVE:?}: taken to be dead"
                );
                self.stop(&mut r, Stop::Link);
            }
            return idle;
        }
        // What has arrived is the pollers' (stepping now would take it from under them)
        // after a grace period in which they took frames and still spin (they keep up), or
        // when it arrived while they spin and nobody woke the engine. Pollers not spinning at
        // the end of a grace period were busy, or wait for something else than a CQ (see
        // STRIKES_WITHIN).
        let spinning = self.spinning();
        let keeping_up = graced && spinning && self.taken.load(Ordering::Relaxed) != rl.taken;
        let arrived_to_spinners = !graced && self.leave(now, rl.distrust_until);
        let elsewhere = graced && !spinning;
        let mut found_silent = false;
        let mut frames = 0;
        if rung || !(keeping_up || arrived_to_spinners) {
            let mut r = self.reader.lock();
            if r.stopped {
                return idle;
            }
            let silent_before = r.silent;
            loop {
                match self.step(&mut r, Who::Thread) {
                    Ok(Outcome::Frame) => frames += 1,
                    Ok(Outcome::Blocked) => break,
                    Ok(Outcome::HandOff) => {
                        rl.retry = true;
                        break;
                    }
                    Ok(Outcome::Throttled) => {
                        rl.throttled = true;
                        break;
                    }
                    Err(stop) => {
                        self.stop(&mut r, stop);
                        return idle;
                    }
                }
            }
            found_silent = r.silent != silent_before;
        }
        if rl.throttled {
            // Not the socket's readiness: it has more, and must keep it until the stall ends.
            // Pollers send their acknowledgements themselves meanwhile.
            self.reader_untimed.store(true, Ordering::SeqCst);
            if self.ack_owed.load(Ordering::SeqCst) {
                self.flush_ack(&mut self.state.lock());
            }
            // The stall may have ended while this turn looked.
            if !self.throttle.load(Ordering::Acquire) {
                self.wake_reader();
            }
            return idle;
        }
        if elsewhere && found_silent {
            if rl.last_strike.is_some_and(|t| now - t < STRIKES_WITHIN) {
                rl.distrust_until = Some(now + DISTRUST);
            }
            rl.last_strike = Some(now);
        }
        // A grace period in which nothing came, the pollers still spinning: the link is quiet.
        // The engine watches it from now, as the pollers do, instead of looking again after
        // each grace period: what comes next wakes it, and it leaves that to the pollers if
        // they still spin (a quiet QP costs no turn at all, where a grace timer cost a turn a
        // millisecond for each QP whose CQ is polled, at 4,096 connections more turns than
        // the progress thread could run).
        let taken = self.taken.load(Ordering::Relaxed);
        let quiet = graced && spinning && taken == rl.taken && frames == 0 && !rl.retry;
        rl.taken = taken;
        let leave = !quiet && self.leave(now, rl.distrust_until);
        rl.left = leave && !rl.retry;
        // An acknowledgement a poller left owed goes out at the latest at the next turn; a
        // wait without a timeout first tells the pollers to send theirs themselves (see
        // `defer_ack`).
        self.reader_untimed.store(!leave && !rl.retry, Ordering::SeqCst);
        if self.ack_owed.load(Ordering::SeqCst) {
            self.flush_ack(&mut self.state.lock());
        }
        // On a link that beats, back at least once a beat to see whether the peer still does.
        let at = if rl.retry {
            Some(now + RECHECK)
        } else if leave {
            Some(now + POLLER_GRACE)
        } else {
            self.link.beats().then(|| now + BEAT)
        };
        ReadNext { watch: !leave, at }
    }

    /// Whether the link is the pollers' at `t`: they spin, no waiter sleeps on a CQ, and they
    /// have not been found waiting for something else lately.
    fn leave(&self, t: Instant, distrust_until: Option<Instant>) -> bool {
        self.spinning() && !self.waiter_sleeps() && self.pollers_read() && distrust_until.is_none_or(|d| t >= d)
    }

    /// Whether polls of the QP's CQs read its link: always a socket (its CQ's epoll set says
    /// which to read), shm's ring on CQs of a few QPs ([`Cq::reads_frames`](crate::nic::cq::Cq::reads_frames)).
    pub(super) fn pollers_read(&self) -> bool {
        self.link.socket().is_some() || (self.send_cq.reads_frames() && self.recv_cq.reads_frames())
    }

    /// Whether a waiter sleeps on one of the QP's CQs (armed, and no completion since).
    pub(super) fn waiter_sleeps(&self) -> bool {
        self.send_cq.is_armed() || self.recv_cq.is_armed()
    }

    /// Whether an application thread polled one of the QP's CQs at most [`SPIN_GAP`] ago.
    fn spinning(&self) -> bool {
        let last = self.send_cq.last_poll().max(self.recv_cq.last_poll());
        last != 0 && now_nanos().saturating_sub(last) < nanos(SPIN_GAP)
    }

    /// A polling thread's turn: sends an acknowledgement the last turn left owed (no
    /// request took it along meanwhile), and takes what has arrived, if the reader is free.
    pub(super) fn poll_link(self: &Arc<Self>) {
        if self.ack_owed.load(Ordering::Acquire) {
            self.flush_ack(&mut self.state.lock());
        }
        let Some(mut r) = self.reader.try_lock() else { return };
        if r.stopped || self.destroyed.load(Ordering::Acquire) {
            return;
        }
        for _ in 0..FRAMES_PER_POLL {
            match self.step(&mut r, Who::Poller) {
                Ok(Outcome::Frame) => {
                    self.taken.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Outcome::Blocked | Outcome::Throttled) => break,
                Ok(Outcome::HandOff) => {
                    drop(r);
                    return self.wake_reader();
                }
                Err(stop) => return self.stop(&mut r, stop),
            }
        }
        // Frames read ahead and left (the cap): the next poll takes them, socket or not. With a
        // waiter asleep there may be no next poll, and the socket that would wake the reader
        // thread is empty: that thread takes them.
        let left = r.inbox.has_frame();
        self.buffered.store(left, Ordering::Release);
        if left {
            self.nudge();
        }
        if left && self.waiter_sleeps() {
            drop(r);
            self.wake_reader();
        }
    }

    /// Has the engine turn the QP (a hand-off, an armed CQ, the end).
    pub(super) fn wake_reader(&self) {
        if let Some(w) = self.waker.get() {
            w.wake();
        }
    }

    /// The link ended, or the peer spoke garbage: the head request times out, the rest flush.
    fn stop(&self, r: &mut Reader, why: Stop) {
        r.stopped = true;
        match why {
            Stop::Link => {}
            Stop::TooLong(n) => tracing::warn!(qp = self.qp_num, n, "frame longer than any message: closing"),
            Stop::Malformed(err) => tracing::warn!(qp = self.qp_num, %err, "malformed frame: closing"),
        }
        let mut st = self.state.lock();
        self.enter_error(&mut st, Some(crate::WcStatus::RetryExcErr));
        drop(st);
        self.link.shutdown();
        self.wake_reader();
    }

    /// Reads and handles at most one frame, without waiting for the link. A payload whose
    /// destination is known from the frame's fields (a read response, a write, a send into a
    /// posted receive) is read straight into that registered memory, as a NIC's DMA would;
    /// anything else is read whole and decoded.
    fn step(self: &Arc<Self>, r: &mut Reader, who: Who) -> Result<Outcome, Stop> {
        loop {
            match &mut r.partial {
                Partial::Landing {
                    head,
                    region,
                    off,
                    len,
                    got,
                } => {
                    while *got < *len {
                        let Some(mut dst) = lock(region, *off + *got, *len - *got) else {
                            return Ok(Outcome::HandOff);
                        };
                        let n = r.inbox.read_into(&mut dst)?;
                        drop(dst);
                        if n == 0 {
                            return Ok(Outcome::Blocked);
                        }
                        *got += n;
                    }
                    let (head, len) = (*head, *len);
                    r.partial = Partial::Idle;
                    if matches!(head, DataHead::Write { imm: None, .. }) {
                        r.silent += 1;
                    }
                    self.landed(head, len, ack_when(r, who));
                    return Ok(Outcome::Frame);
                }
                Partial::Body { buf, got, len } => {
                    if who == Who::Poller {
                        return Ok(Outcome::HandOff);
                    }
                    while *got < *len {
                        if *got == buf.len() {
                            buf.resize((*got).saturating_add(GROW).min(*len), 0);
                        }
                        let n = r.inbox.read_into(&mut buf[*got..])?;
                        if n == 0 {
                            return Ok(Outcome::Blocked);
                        }
                        *got += n;
                    }
                    let frame = Frame::decode(buf)?;
                    if !self.may_handle(&frame, who) {
                        return Ok(Outcome::HandOff);
                    }
                    r.partial = Partial::Idle;
                    r.silent += u64::from(silent(&frame));
                    self.handle(frame, ack_when(r, who));
                    return Ok(Outcome::Frame);
                }
                Partial::Idle => {
                    if self.throttle.load(Ordering::Acquire) {
                        return Ok(Outcome::Throttled);
                    }
                    if !r.inbox.try_fill(4)? {
                        return Ok(Outcome::Blocked);
                    }
                    let mut len = [0u8; 4];
                    len.copy_from_slice(&r.inbox.avail()[..4]);
                    let n = u32::from_le_bytes(len) as usize;
                    if n > MAX_BODY {
                        return Err(Stop::TooLong(n));
                    }
                    if n > CONTROL_MAX && r.inbox.try_fill(5)? && DataHead::len(r.inbox.avail()[4]).is_none() {
                        // Only frames that carry a payload are long.
                        return Err(Stop::TooLong(n));
                    }
                    if n > 0 {
                        if !r.inbox.try_fill(5)? {
                            return Ok(Outcome::Blocked);
                        }
                        let kind = r.inbox.avail()[4];
                        if let Some(h) = DataHead::len(kind).filter(|&h| n > h) {
                            if !r.inbox.try_fill(4 + h)? {
                                return Ok(Outcome::Blocked);
                            }
                            let head = DataHead::decode(&r.inbox.avail()[4..4 + h])?;
                            if who == Who::Poller && n - h > POLLER_LANDS_MAX && self.waiter_sleeps() {
                                return Ok(Outcome::HandOff);
                            }
                            if let Some((region, off)) = self.landing(head, n - h) {
                                r.inbox.consume(4 + h);
                                r.partial = Partial::Landing {
                                    head,
                                    region,
                                    off,
                                    len: n - h,
                                    got: 0,
                                };
                                continue;
                            }
                        }
                    }
                    if 4 + n > Inbox::capacity() {
                        if who == Who::Poller {
                            return Ok(Outcome::HandOff);
                        }
                        r.inbox.consume(4);
                        r.partial = Partial::Body {
                            buf: Vec::new(),
                            got: 0,
                            len: n,
                        };
                        continue;
                    }
                    if !r.inbox.try_fill(4 + n)? {
                        return Ok(Outcome::Blocked);
                    }
                    let frame = Frame::decode(&r.inbox.avail()[4..4 + n])?;
                    if !self.may_handle(&frame, who) {
                        return Ok(Outcome::HandOff);
                    }
                    r.inbox.consume(4 + n);
                    r.silent += u64::from(silent(&frame));
                    self.handle(frame, ack_when(r, who));
                    return Ok(Outcome::Frame);
                }
            }
        }
    }

    /// Whether `who` can handle `frame` now without waiting for a lock an application holds.
    fn may_handle(&self, frame: &Frame, who: Who) -> bool {
        match who {
            Who::Poller => self.poller_may_handle(frame),
            Who::Thread => self.engine_may_handle(frame),
        }
    }

    /// Whether the progress engine can handle `frame` without waiting for a lock: it serves
    /// every QP of the device, so memory one application holds must not stop the others. Frames
    /// whose memory is held wait in the reader for a later turn (a NIC never waits for a lock,
    /// there being none: its writes land under the application's feet).
    fn engine_may_handle(&self, frame: &Frame) -> bool {
        use crate::AccessFlags;
        let free = |r: &Region| r.mem.try_write().is_some();
        match frame {
            Frame::Data {
                head: DataHead::Write { addr, rkey, .. },
                data,
            } if !data.is_empty() => self
                .check_remote(*addr, *rkey, data.len(), AccessFlags::REMOTE_WRITE)
                .map_or(true, |r| free(&r)),
            Frame::Data {
                head: DataHead::Send { .. },
                data,
            } if !data.is_empty() => {
                let st = self.state.lock();
                if !st.stalled.is_empty() {
                    return true; // it joins the held frames, touching nothing
                }
                match &self.srq {
                    Some(srq) => srq.front_is(|r| r.and_then(|r| r.local.as_ref()).is_none_or(|v| free(&v.region))),
                    None => st
                        .recvs
                        .front()
                        .and_then(|r| r.local.as_ref())
                        .is_none_or(|v| free(&v.region)),
                }
            }
            Frame::Data {
                head: DataHead::ReadResp { ssn, .. },
                ..
            } => {
                let st = self.state.lock();
                let head = st.outstanding.iter().find(|p| p.seq == *ssn);
                head.and_then(|p| p.local.as_ref()).is_none_or(|v| free(&v.region))
            }
            Frame::AtomicResp { .. } => self.poller_may_handle(frame),
            // Answered from the sending side, which never waits for memory either.
            _ => true,
        }
    }

    /// Whether a polling thread can handle `frame` without waiting for a lock its own
    /// application may hold: frames that touch no registered memory, and those whose memory it
    /// could lock right now (so this thread holds no guard of it, and any other holder lets go
    /// without waiting for this thread). Others go to the progress engine.
    fn poller_may_handle(&self, frame: &Frame) -> bool {
        use crate::AccessFlags;
        let free = |r: &Region| r.mem.try_write().is_some();
        match frame {
            Frame::Ack { .. } | Frame::Nak { .. } | Frame::Fatal | Frame::Beat => true,
            // A target's checks failing means a NAK, memory untouched.
            Frame::ReadReq { addr, rkey, len, .. } => self
                .check_remote(*addr, *rkey, *len as usize, AccessFlags::REMOTE_READ)
                .map_or(true, |r| free(&r)),
            Frame::Atomic { addr, rkey, .. } => self
                .check_remote(*addr, *rkey, 8, AccessFlags::REMOTE_ATOMIC)
                .map_or(true, |r| free(&r)),
            Frame::AtomicResp { ssn, .. } => {
                let st = self.state.lock();
                let head = st.outstanding.iter().find(|p| p.seq == *ssn);
                head.and_then(|p| p.local.as_ref()).is_none_or(|v| free(&v.region))
            }
            // A Send into a shared receive queue's oldest receive, when that receive's memory
            // could be locked now: no landing path takes it (another QP may take that receive
            // between a look and the landing), so it is handled whole, here rather than by a
            // hand-off to the progress engine (a thread switch per message).
            Frame::Data {
                head: DataHead::Send { .. },
                ..
            } if self.srq.is_some() => {
                let st = self.state.lock();
                st.stalled.is_empty()
                    && self.srq.as_ref().is_some_and(|srq| {
                        srq.front_is(|r| r.and_then(|r| r.local.as_ref()).is_none_or(|v| free(&v.region)))
                    })
            }
            _ => false,
        }
    }
}

/// When the acknowledgement a frame just read makes due goes out: after the next frame if one
/// is already here, now from the progress engine, later from a polling thread.
fn ack_when(r: &Reader, who: Who) -> AckWhen {
    match who {
        _ if r.inbox.has_frame() => AckWhen::Later,
        Who::Thread => AckWhen::Now,
        Who::Poller => AckWhen::Deferred,
    }
}

/// A request that completes nothing on this side.
fn silent(frame: &Frame) -> bool {
    matches!(
        frame,
        Frame::ReadReq { .. }
            | Frame::Atomic { .. }
            | Frame::Data {
                head: DataHead::Write { imm: None, .. },
                ..
            }
    )
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().try_into().unwrap_or(u64::MAX)
}

/// `len` bytes of `region` from `off`, if nobody holds them (neither holder of the reader
/// waits for an application).
fn lock(region: &Region, off: usize, len: usize) -> Option<crate::BufMut<'_>> {
    region.try_lock_range(off, len)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use super::SPIN_GAP;
    use crate::{connect, AccessFlags, Device, Listener, QpOptions, RecvWr, SendOp, SendWr};

    /// A QP whose CQ is polled without a pause while nothing comes costs its device's progress
    /// engine no turns once its link is found quiet (a grace timer cost one a millisecond), and
    /// what then comes is still taken by the spinning poller.
    #[test]
    fn a_quiet_link_whose_cq_spins_costs_no_turns() {
        const SENDS: u32 = 30;
        for provider in ["tcp", "shm"] {
            let dev = Device::open(provider).expect("device");
            let listener = Listener::bind(&dev, "127.0.0.1:0".parse::<SocketAddr>().expect("addr")).expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
            let recvs = (0..=SENDS)
                .map(|_| RecvWr::new(7, pd.register(64, AccessFlags::LOCAL_WRITE).expect("register")))
                .collect();
            let opts = QpOptions::new(&pd, &cq);
            let accept = std::thread::spawn(move || {
                listener
                    .accept(None)
                    .expect("accept")
                    .accept_with_recvs(&opts, b"", recvs)
            });
            let cdev = Device::open(provider).expect("device");
            let (cpd, ccq) = (cdev.alloc_pd().expect("pd"), cdev.create_cq(16).expect("cq"));
            let (client, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", Duration::from_secs(5)).expect("connect");
            let _qp = accept.join().expect("accept thread").expect("accept");
            let progress = dev.inner.imp.progress().expect("a software device");
            let mut got = Vec::new();
            let spin = |d: Duration, got: &mut Vec<crate::Completion>| {
                let start = Instant::now();
                while start.elapsed() < d {
                    cq.poll(got, 16).expect("poll");
                }
            };
            let send = |imm: u32| {
                let b = cpd.register(8, AccessFlags::NONE).expect("register");
                client
                    .post_send(SendWr::new(1, SendOp::Send { imm: Some(imm) }).buf(b))
                    .map_err(|e| e.error)
                    .expect("send");
            };
            // Messages that come while the poller pauses for less than `SPIN_GAP` (it still
            // counts as spinning): the engine's turn for each leaves it to the poller, which
            // takes it at its next poll.
            spin(Duration::from_millis(5), &mut got);
            for i in 0..SENDS {
                send(i);
                let pause = Instant::now();
                while pause.elapsed() < SPIN_GAP / 2 {
                    std::hint::spin_loop();
                }
                spin(Duration::from_millis(1), &mut got);
            }
            spin(Duration::from_millis(20), &mut got);
            let imms: Vec<_> = got.iter().map(|c| c.imm.expect("imm")).collect();
            assert_eq!(
                imms,
                (0..SENDS).collect::<Vec<_>>(),
                "{provider}: every Send came, in order"
            );
            got.clear();
            let before = progress.turns();
            spin(Duration::from_millis(200), &mut got);
            let turns = progress.turns() - before;
            assert!(
                turns <= 10,
                "{provider}: {turns} turns in 200 ms of polling a quiet QP (one a grace period is 200)"
            );
            send(SENDS);
            let start = Instant::now();
            while got.is_empty() && start.elapsed() < Duration::from_secs(5) {
                cq.poll(&mut got, 16).expect("poll");
            }
            assert_eq!(
                got.first().and_then(|c| c.imm),
                Some(SENDS),
                "{provider}: the last Send came"
            );
        }
    }

    /// On shm, Sends into a shared receive queue come as frames on the ring: a poller that spins
    /// on a CQ of a few QPs takes them itself, without a turn of the progress thread for each
    /// (which cost a thread switch a message).
    #[test]
    fn a_spinning_poller_takes_shm_frames_itself() {
        const SENDS: u64 = 200;
        let dev = Device::open("shm").expect("device");
        let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
        let srq = pd.create_srq(64).expect("srq");
        let listener = Listener::bind(&dev, "127.0.0.1:0".parse::<SocketAddr>().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let opts = QpOptions::new(&pd, &cq).srq(&srq);
        let accept = std::thread::spawn(move || listener.accept(None).expect("accept").accept(&opts, b""));
        let cdev = Device::open("shm").expect("device");
        let (cpd, ccq) = (cdev.alloc_pd().expect("pd"), cdev.create_cq(64).expect("cq"));
        let (client, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", Duration::from_secs(5)).expect("connect");
        let _qp = accept.join().expect("accept thread").expect("accept");
        let progress = dev.inner.imp.progress().expect("a software device");
        let (mut got, mut sent) = (Vec::new(), Vec::new());
        let mut recvs: Vec<_> = (0..SENDS)
            .rev()
            .map(|i| RecvWr::new(i, pd.register(64, AccessFlags::LOCAL_WRITE).expect("register")))
            .collect();
        let mut bufs: Vec<_> = (0..SENDS)
            .map(|_| cpd.register(8, AccessFlags::NONE).expect("register"))
            .collect();
        let before = progress.turns();
        for i in 0..SENDS {
            srq.post_recv(recvs.pop().expect("a receive"))
                .map_err(|e| e.error)
                .expect("post");
            let b = bufs.pop().expect("a buffer");
            client
                .post_send(SendWr::new(i, SendOp::Send { imm: None }).buf(b))
                .map_err(|e| e.error)
                .expect("send");
            let start = Instant::now();
            while got.len() as u64 <= i && start.elapsed() < Duration::from_secs(5) {
                cq.poll(&mut got, 16).expect("poll");
                ccq.poll(&mut sent, 16).expect("poll");
            }
        }
        let turns = progress.turns() - before;
        assert_eq!(
            got.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
            (0..SENDS).collect::<Vec<_>>()
        );
        assert!(
            turns < SENDS / 3,
            "{turns} turns of the progress thread for {SENDS} Sends taken by a spinning poller"
        );
    }
}
