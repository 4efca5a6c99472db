//! The engine of one software queue pair: requester, responder and completer. It turns on its
//! device's progress engine (`nic/progress.rs`), which serves every QP of the device with a
//! fixed number of threads: each turn reads what it can ([`reader`]), writes what it can
//! ([`Sender`]), fires the RNR timer, and says what to wait for next.
//!
//! Lock order: `post` before `reader` before `state` before a region's memory before the
//! sender's lock. Nothing blocks on the link at all, so the reader always drains and two engines
//! can never wait on each other; the engine never waits for a region's lock either (an
//! application may hold one as long as it likes): what needs held memory waits for a later turn.

mod reader;
pub(crate) mod srq;
mod stall;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::inbox::Inbox;
use super::link::Link;
use super::sender::Sender;
use super::wire::{AtomicOp, DataHead, Encoder, Frame, WireError};
use super::Cq;
use crate::cq::RawWc;
use crate::mr::{Region, Rmw};
use crate::nic::direct::{Direct, Local, OwnQueue};
use crate::nic::progress::{Handle, Next, Progress, Task, Waker, Why};
use crate::pd::PdShared;
use crate::qp::{RecvDesc, SendDesc, FLUSH};
use crate::{AccessFlags, Error, Head, SendOp, WcOpcode, WcStatus};

/// How long a Send waits at the target for a receive before the initiator gets
/// RNR_RETRY_EXC_ERR: seven retries of a 10 ms RNR timer.
const RNR_BUDGET: Duration = Duration::from_millis(70);

/// When the acknowledgement a handled frame made due goes out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AckWhen {
    /// Another frame is already here: after it (acks are cumulative).
    Later,
    /// Now (the reader thread).
    Now,
    /// A polling thread handled it: see [`Engine::defer_ack`].
    Deferred,
}

/// Why the reader thread stops.
enum Stop {
    /// The link ended or failed.
    Link,
    TooLong(usize),
    Malformed(WireError),
}

impl From<std::io::Error> for Stop {
    fn from(_: std::io::Error) -> Self {
        Stop::Link
    }
}

impl From<WireError> for Stop {
    fn from(e: WireError) -> Self {
        Stop::Malformed(e)
    }
}

/// A piece of registered memory that a request in flight names.
struct View {
    region: Arc<Region>,
    off: usize,
    len: usize,
}

struct Pending {
    seq: u64,
    opcode: WcOpcode,
    signaled: bool,
    local: Option<View>,
    /// Executed already by this side (shm one-sided): its result, reported in order.
    done: Option<Result<u32, WcStatus>>,
    /// A Read's bytes placed so far, from the parts of its response that came.
    got: usize,
}

struct PostedRecv {
    seq: u64,
    local: Option<View>,
}

#[derive(Default)]
struct State {
    error: bool,
    /// After an RNR NAK, requests are discarded until the initiator's Fatal arrives.
    discarding: bool,
    outstanding: VecDeque<Pending>,
    recvs: VecDeque<PostedRecv>,
    /// Responder frames waiting for a receive; the head one is the RNR-stalled request.
    stalled: stall::Stalled,
    stall_gen: u64,
    /// When the held head request's RNR budget runs out, and its stall's generation.
    rnr: Option<(Instant, u64)>,
    /// The last Send or Write executed that asked for an acknowledgement and has not had it
    /// yet (acks are cumulative, as RC's): it goes out before any other response, when the
    /// reader thread finds no further frame waiting, and after requests a post_recv let run.
    /// One that a polling thread made due waits a little for company (see [`Engine::defer_ack`]).
    ack_due: Option<u64>,
    /// The last Send or Write executed, and the last one acknowledged: before a Fatal the peer
    /// learns how far we got, asked or not.
    executed: Option<u64>,
    acked: Option<u64>,
}

struct Engine {
    qp_num: u32,
    pd: Arc<PdShared>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    link: Arc<dyn Link>,
    /// Serialises posts, so frames leave in the order requests enter `outstanding`.
    post: Mutex<()>,
    out: Sender,
    state: Mutex<State>,
    error: AtomicBool,
    destroyed: AtomicBool,
    /// shm: the peer's memory and receive queue, for operations run here without the peer's
    /// CPU (one-sided ones, and Sends that find a posted receive).
    direct: Option<Arc<dyn Direct>>,
    /// shm: our receive queue in shared memory, where the peer completes receives.
    own_rq: Option<Arc<dyn OwnQueue>>,
    /// The shared receive queue the responder takes receives from, if the QP has one (then it
    /// has none of its own, and on shm the peer delivers nothing directly).
    srq: Option<Arc<srq::Srq>>,
    /// tcp: this QP's key in each of its CQs' socket sets, to nudge them by (`Cq::nudge`).
    watch_keys: OnceLock<Vec<(Arc<Cq>, u64)>>,
    /// The read side of the link, held by whoever reads: the reader thread or a poller.
    reader: Mutex<reader::Reader>,
    /// Frames that polls of the QP's CQs handled so far (tcp).
    taken: AtomicU64,
    /// A poll left whole frames read ahead: the next poll handles them even if the socket has
    /// nothing new (tcp; the CQ sources look at it).
    buffered: Arc<AtomicBool>,
    /// A polling thread left an acknowledgement due, to go out in one write with this side's
    /// next request (see [`Engine::defer_ack`]); the next poll of the QP's CQs sends it if no
    /// request took it along (tcp; the CQ sources look at it).
    ack_owed: Arc<AtomicBool>,
    /// The reader thread is about to wait, or waits, with no timeout: it will not come back to
    /// send a deferred acknowledgement by itself.
    reader_untimed: AtomicBool,
    /// The held frames reached [`stall::STALL_CAP`]: nobody reads the link until the stall
    /// ends, which wakes the engine.
    throttle: AtomicBool,
    /// Turns the QP on its device's progress engine (a poller hands it a frame, a CQ was
    /// armed, an RNR stall began or ended).
    waker: OnceLock<Waker>,
    /// The engine's own state between turns.
    turns: Mutex<reader::ReadLoop>,
}

/// A software RC queue pair over one link.
pub(crate) struct Qp {
    engine: Arc<Engine>,
    handle: Handle,
}

impl Qp {
    /// Starts the engine of a QP made with `opts` over `link` (with the peer's memory and our
    /// shared receive queue on shm), on its device's progress engine.
    pub(crate) fn start(
        link: Arc<dyn Link>,
        qp_num: u32,
        opts: &crate::QpOptions,
        shm: Option<(Arc<dyn Direct>, Arc<dyn OwnQueue>)>,
    ) -> Result<Self, Error> {
        let cq = |c: &crate::CompletionQueue| -> Result<Arc<Cq>, Error> {
            Ok(crate::provider::cq_of::<super::SoftCq>(c, "a software QP")?.0.clone())
        };
        let (pd, send_cq, recv_cq) = (opts.pd.inner.clone(), cq(&opts.send_cq)?, cq(&opts.recv_cq)?);
        let srq = match &opts.srq {
            Some(s) => Some(
                s.inner
                    .imp
                    .as_any()
                    .downcast_ref::<super::SoftSrq>()
                    .ok_or_else(|| Error::InvalidArgument("a software QP needs a software SRQ".into()))?
                    .0
                    .clone(),
            ),
            None => None,
        };
        let progress: &Progress = opts.pd.inner.device.inner.imp.progress()?;
        let (direct, own_rq) = match shm {
            Some((p, rq)) => (Some(p), Some(rq)),
            None => (None, None),
        };
        let engine = Arc::new(Engine {
            qp_num,
            pd,
            send_cq,
            recv_cq,
            post: Mutex::new(()),
            out: Sender::new(link.clone()),
            reader: Mutex::new(reader::Reader::new(Inbox::new(link.clone()))),
            buffered: Arc::new(AtomicBool::new(false)),
            ack_owed: Arc::new(AtomicBool::new(false)),
            reader_untimed: AtomicBool::new(false),
            taken: AtomicU64::new(0),
            waker: OnceLock::new(),
            turns: Mutex::new(reader::ReadLoop::default()),
            link,
            state: Mutex::new(State::default()),
            error: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            throttle: AtomicBool::new(false),
            direct,
            own_rq,
            srq,
            watch_keys: OnceLock::new(),
        });
        let source = || -> Weak<dyn super::CqSource> { Arc::downgrade(&engine) as Weak<Engine> };
        if let Some(rq) = &engine.own_rq {
            // shm: a poll of either CQ drains what the peer completed in our receive queue, and
            // reads the ring when bytes wait there or the last poll left frames read ahead (on
            // a CQ of a few QPs: `Cq::reads_frames`).
            let (link, buffered, owed) = (engine.link.clone(), engine.buffered.clone(), engine.ack_owed.clone());
            let framed = move || link.has_bytes() || buffered.load(Ordering::Acquire) || owed.load(Ordering::Acquire);
            let rq = rq.clone();
            if Arc::ptr_eq(&engine.send_cq, &engine.recv_cq) {
                engine
                    .recv_cq
                    .add_framed_source(source(), Box::new(move || rq.has_taken()), Some(Box::new(framed)));
            } else {
                engine.recv_cq.add_framed_source(
                    source(),
                    Box::new(move || rq.has_taken()),
                    Some(Box::new(framed.clone())),
                );
                engine
                    .send_cq
                    .add_framed_source(source(), Box::new(|| false), Some(Box::new(framed)));
            }
        } else {
            // A poll of either CQ reads the socket when its epoll set says it has something,
            // or when the last poll left whole frames read ahead.
            let mut cqs = vec![&engine.send_cq];
            if !Arc::ptr_eq(&engine.send_cq, &engine.recv_cq) {
                cqs.push(&engine.recv_cq);
            }
            let mut keys = Vec::new();
            for cq in cqs {
                match engine.link.socket() {
                    Some(fd) => {
                        let (buffered, owed) = (engine.buffered.clone(), engine.ack_owed.clone());
                        let left = Arc::new(move || buffered.load(Ordering::Acquire) || owed.load(Ordering::Acquire));
                        keys.push((cq.clone(), cq.add_watched(fd, source(), left)?));
                    }
                    None => cq.add_source(source(), Box::new(|| true)),
                }
            }
            let _ = engine.watch_keys.set(keys);
        }
        let task: Arc<dyn Task> = Arc::new(Turns(engine.clone()));
        let handle = progress.register(task, Some(engine.link.event_fd()))?;
        let _ = engine.waker.set(handle.waker());
        engine.out.set_waker(handle.waker());
        // Anything that came before the waker was set is looked at in a turn now.
        handle.wake();
        Ok(Self { engine, handle })
    }

    pub(crate) fn is_error(&self) -> bool {
        self.engine.error.load(Ordering::Acquire)
    }

    /// shm: tells the peer which CPU this thread runs on, and whether the peer's poller said
    /// it runs on the same one. tcp: false (the peer may be anywhere).
    pub(crate) fn peer_shares_cpu(&self) -> bool {
        let (Some(peer), Some(own)) = (&self.engine.direct, &self.engine.own_rq) else {
            return false;
        };
        let Some(me) = crate::nic::cpu::current_cpu() else {
            return false;
        };
        own.publish_cpu(me);
        peer.peer_on(me)
    }

    /// shm: when the peer's poller said it runs on this thread's CPU, moves this thread to
    /// another CPU it may run on (see `nic::cpu::leave_cpu`) and tells the peer where it went; true
    /// when it moved. tcp: false.
    pub(crate) fn leave_peer_cpu(&self) -> bool {
        let (Some(peer), Some(own)) = (&self.engine.direct, &self.engine.own_rq) else {
            return false;
        };
        let Some(me) = crate::nic::cpu::current_cpu() else {
            return false;
        };
        if !peer.peer_on(me) || !crate::nic::cpu::leave_cpu(me) {
            return false;
        }
        if let Some(now) = crate::nic::cpu::current_cpu() {
            own.publish_cpu(now);
        }
        true
    }

    pub(crate) fn post_send(&self, descs: &[SendDesc<'_>]) -> Result<(), (usize, Error)> {
        let e = &self.engine;
        let _serial = e.post.lock();
        for d in descs {
            let local = d.local.as_ref().map(|l| View {
                region: l.region.clone(),
                off: l.off,
                len: l.len,
            });
            {
                let mut st = e.state.lock();
                let pending = Pending {
                    seq: d.seq,
                    opcode: d.op.wc_opcode(),
                    signaled: d.signaled,
                    local,
                    done: None,
                    got: 0,
                };
                if st.error {
                    e.push_send(pending, FLUSH, 0);
                    continue;
                }
                if let Some(v) = &pending.local {
                    let wrong_pd = !Arc::ptr_eq(&v.region.pd, &e.pd);
                    let no_write = d.op.writes_local() && !v.region.access.contains(AccessFlags::LOCAL_WRITE);
                    if wrong_pd || no_write {
                        e.error.store(true, Ordering::Release);
                        e.push_send(pending, WcStatus::LocProtErr, 0);
                        e.enter_error(&mut st, None);
                        continue;
                    }
                }
                // shm: a one-sided operation with nothing before it in flight runs here and
                // now, on the peer's memory (with nothing before it, RC order holds).
                if let Some(peer) = e.direct.as_ref().filter(|_| st.outstanding.is_empty()) {
                    let local = pending.local.as_ref().map(|v| Local {
                        region: &v.region,
                        off: v.off,
                        len: v.len,
                    });
                    if let Some(result) = peer.run(d, local) {
                        let mut pending = pending;
                        pending.done = Some(result);
                        st.outstanding.push_back(pending);
                        e.retire(&mut st);
                        continue;
                    }
                }
                st.outstanding.push_back(pending);
                // An acknowledgement a poll left due goes out in the request's write, ahead of
                // it; handed to the sender under `state`, so that no response can overtake it.
                if let Some(ssn) = e.take_ack(&mut st) {
                    e.out.ahead(&Encoder::ack(ssn).finish());
                }
            }
            if send_request(&e.out, d).is_err() {
                // The reader sees the broken connection too and fails what is outstanding.
                e.link.shutdown();
            }
        }
        Ok(())
    }

    pub(crate) fn post_recv(&self, descs: &[RecvDesc<'_>]) -> Result<(), (usize, Error)> {
        let e = &self.engine;
        let mut st = e.state.lock();
        for d in descs {
            let posted = PostedRecv {
                seq: d.seq,
                local: d.local.as_ref().map(|l| View {
                    region: l.region.clone(),
                    off: l.off,
                    len: l.len,
                }),
            };
            if st.error {
                e.push_recv(posted, FLUSH, WcOpcode::Recv, 0, None);
            } else {
                if let Some(rq) = &e.own_rq {
                    // Published for the peer to fill by itself (shm).
                    match &posted.local {
                        Some(v) => {
                            let writable =
                                Arc::ptr_eq(&v.region.pd, &e.pd) && v.region.access.contains(AccessFlags::LOCAL_WRITE);
                            rq.post(posted.seq, v.len as u64, writable)
                        }
                        None => rq.post(posted.seq, 0, true),
                    }
                }
                st.recvs.push_back(posted);
            }
        }
        // An acknowledgement due for requests this post let run goes now; one a poll left due
        // may still wait for this side's next request.
        let before = st.ack_due;
        e.drain_stalled(&mut st);
        if st.ack_due != before {
            e.flush_ack(&mut st);
        }
        Ok(())
    }

    /// Stops the engine and waits for its threads, so that nothing touches the QP's buffers
    /// once this returns. No completions are generated for what was in flight.
    pub(crate) fn destroy(&mut self) {
        // A NIC acknowledged what landed when it landed; one a poll left owed goes now, or the
        // peer would fail a Send this side took (a process that exits after its last message).
        if self.engine.ack_owed.load(Ordering::Acquire) {
            self.engine.flush_ack(&mut self.engine.state.lock());
        }
        self.engine.destroyed.store(true, Ordering::Release);
        self.engine.link.shutdown();
        self.engine.out.close();
        // No turn after this, and none under way.
        self.handle.deregister();
        // A poller may still be reading: wait for it (the next one sees `destroyed`).
        drop(self.engine.reader.lock());
    }
}

/// Sends the wire frame of a request, its payload straight from registered memory.
fn send_request(out: &Sender, d: &SendDesc<'_>) -> Result<(), ()> {
    let with_data = |enc: Encoder| match &d.local {
        Some(l) if d.len > 0 => out.request(&enc.head(d.len), &l.region.read_range(l.off, d.len)),
        _ => out.request(&enc.finish(), &[]),
    };
    match d.op {
        // Only a request whose completion someone waits for asks to be acknowledged.
        SendOp::Send { imm } => with_data(Encoder::send(d.seq, imm, d.signaled)),
        SendOp::Write { remote, imm } => with_data(Encoder::write(d.seq, remote.addr, remote.rkey, imm, d.signaled)),
        SendOp::Read { remote } => out.request(
            &Encoder::read_req(d.seq, remote.addr, remote.rkey, d.len as u32).finish(),
            &[],
        ),
        SendOp::CompareSwap { remote, compare, swap } => out.request(
            &Encoder::atomic(d.seq, remote.addr, remote.rkey, AtomicOp::CompareSwap { compare, swap }).finish(),
            &[],
        ),
        SendOp::FetchAdd { remote, add } => out.request(
            &Encoder::atomic(d.seq, remote.addr, remote.rkey, AtomicOp::FetchAdd { add }).finish(),
            &[],
        ),
    }
}

/// A Send or Write of ours the peer ran, acknowledged by any later response (not executed here).
fn acked_by_later(p: &Pending) -> bool {
    p.done.is_none() && matches!(p.opcode, WcOpcode::Send | WcOpcode::RdmaWrite)
}

/// A part of `len` bytes of Read `p`'s response fits its buffer `v` where the parts before it
/// ended; the last part (`more` false) must end where the buffer does.
fn read_fits(p: &Pending, v: &View, len: usize, more: bool) -> bool {
    let end = p.got.saturating_add(len);
    if more {
        end <= v.len
    } else {
        end == v.len
    }
}

/// The responder ran Send or Write `ssn`; `ack`: its initiator asked to hear so.
fn executed(st: &mut State, ssn: u64, ack: bool) {
    st.executed = Some(ssn);
    if ack {
        st.ack_due = Some(ssn);
    }
}

fn needs_recv(f: &Frame) -> bool {
    matches!(
        f,
        Frame::Data {
            head: DataHead::Send { .. } | DataHead::Write { imm: Some(_), .. },
            ..
        }
    )
}

impl Engine {
    /// Where the `len`-byte payload of a frame with these fields lands, if the frame will
    /// succeed as it stands; `None` sends it down the general path (errors, stalls, shm).
    fn landing(&self, head: DataHead, len: usize) -> Option<(Arc<Region>, usize)> {
        let st = self.state.lock();
        if st.error || st.discarding {
            return None;
        }
        match head {
            DataHead::ReadResp { ssn, more } => {
                let p = st
                    .outstanding
                    .iter()
                    .find(|p| !(p.seq < ssn && acked_by_later(p)))
                    .filter(|p| p.seq == ssn && p.done.is_none() && p.opcode == WcOpcode::RdmaRead)?;
                let v = p.local.as_ref().filter(|v| read_fits(p, v, len, more))?;
                Some((v.region.clone(), v.off + p.got))
            }
            DataHead::Write { addr, rkey, imm, .. } => {
                // Behind a stalled request, or needing a receive there is not: general path.
                let wants_recv = imm.is_some() && (st.recvs.is_empty() || self.own_rq.is_some() || self.srq.is_some());
                if !st.stalled.is_empty() || wants_recv {
                    return None;
                }
                let region = self.check_remote(addr, rkey, len, AccessFlags::REMOTE_WRITE).ok()?;
                let off = (addr - region.addr) as usize;
                Some((region, off))
            }
            DataHead::Send { .. } => {
                if !st.stalled.is_empty() || self.own_rq.is_some() || self.srq.is_some() {
                    return None;
                }
                let v = st.recvs.front()?.local.as_ref()?;
                let fits = Arc::ptr_eq(&v.region.pd, &self.pd)
                    && v.region.access.contains(AccessFlags::LOCAL_WRITE)
                    && len <= v.len;
                fits.then(|| (v.region.clone(), v.off))
            }
        }
    }

    /// Completes a frame whose payload [`landing`](Self::landing) placed, as `handle` would;
    /// `when`: the acknowledgement it makes due goes out.
    fn landed(&self, head: DataHead, len: usize, when: AckWhen) {
        let mut st = self.state.lock();
        self.drain_rq(&mut st);
        match head {
            DataHead::ReadResp { ssn, more: true } => self.read_part(&mut st, ssn, |_| Ok(len)),
            DataHead::ReadResp { ssn, more: false } => {
                self.complete_head(&mut st, ssn, WcStatus::Success, |p| Ok((p.got + len) as u32))
            }
            DataHead::Write { .. } | DataHead::Send { .. } if st.error || st.discarding => {}
            DataHead::Write { ssn, imm, ack, .. } => {
                if let Some(imm) = imm {
                    let Some(r) = st.recvs.pop_front() else { return };
                    self.push_recv(r, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len as u32, Some(imm));
                }
                executed(&mut st, ssn, ack);
            }
            DataHead::Send { ssn, imm, ack } => {
                let Some(r) = st.recvs.pop_front() else { return };
                self.push_recv(r, WcStatus::Success, WcOpcode::Recv, len as u32, imm);
                executed(&mut st, ssn, ack);
            }
        }
        self.ack_after(&mut st, when);
    }

    /// Sends a response frame, after the ack it must not overtake.
    fn respond(&self, st: &mut State, frame: Encoder) {
        self.flush_ack(st);
        let _ = self.out.send(&frame.finish());
    }

    /// Acknowledges every Send and Write executed so far (the peer completes them all).
    fn flush_ack(&self, st: &mut State) {
        if let Some(ssn) = self.take_ack(st) {
            let _ = self.out.send(&Encoder::ack(ssn).finish());
        }
    }

    /// The acknowledgement due, if any, for the caller to send at once (nothing owed after).
    fn take_ack(&self, st: &mut State) -> Option<u64> {
        let ssn = st.ack_due.take()?;
        st.acked = Some(ssn);
        self.ack_owed.store(false, Ordering::Release);
        Some(ssn)
    }

    /// Sends the acknowledgement a handled frame made due, when `when` says.
    fn ack_after(&self, st: &mut State, when: AckWhen) {
        match when {
            AckWhen::Later => {}
            AckWhen::Now => self.flush_ack(st),
            AckWhen::Deferred => self.defer_ack(st),
        }
    }

    /// A polling thread's acknowledgement waits for this side's next request, to go out in the
    /// same write (on tcp an acknowledgement of its own costs a send here and a receive at the
    /// peer, on the path of the answer that typically follows; a NIC's costs neither CPU), or
    /// for the next poll of the QP's CQs, or for the reader thread's next turn (at most
    /// `POLLER_GRACE` while pollers spin, at once when a CQ is armed): whichever comes first.
    /// With the reader thread in a wait without a timeout, which would not come back for it,
    /// it goes now.
    fn defer_ack(&self, st: &mut State) {
        if st.ack_due.is_none() {
            return;
        }
        // Either this thread sees the reader's flag or the reader sees this one (both SeqCst);
        // likewise a waiter's arm (which wakes the reader for an acknowledgement owed) and
        // this thread: a poll after the arm (drain, arm, drain) sends it itself, as no turn of
        // the reader thread may come before its timer (`CqSource::arm` on shm arms the ring).
        self.ack_owed.store(true, Ordering::SeqCst);
        if self.reader_untimed.load(Ordering::SeqCst) || self.waiter_sleeps() {
            self.flush_ack(st);
        } else {
            self.nudge();
        }
    }

    /// Something no socket announces waits for a poll (frames read ahead, an acknowledgement
    /// owed): the next poll of each of the QP's CQs drains it.
    pub(super) fn nudge(&self) {
        for (cq, key) in self.watch_keys.get().into_iter().flatten() {
            cq.nudge(*key);
        }
    }

    /// Completes `p`. Its view of the local buffer goes first: whoever takes the completion
    /// (and the buffer with it) must find the registration held by that buffer alone, so that
    /// dropping it deregisters at once (`Device::registered_bytes` counts it back then).
    fn push_send(&self, p: Pending, status: WcStatus, byte_len: u32) {
        let Pending {
            seq,
            opcode,
            signaled,
            local,
            ..
        } = p;
        drop(local);
        if self.destroyed.load(Ordering::Acquire) || (status.is_success() && !signaled) {
            return;
        }
        self.send_cq.push(RawWc {
            qp_num: self.qp_num,
            seq,
            recv: false,
            status,
            opcode,
            byte_len,
            imm: None,
            vendor_err: 0,
            head: Head::default(),
        });
    }

    /// Completes receive `r`, its view of the buffer dropped first (as in `push_send`).
    fn push_recv(&self, r: PostedRecv, status: WcStatus, opcode: WcOpcode, byte_len: u32, imm: Option<u32>) {
        self.push_recv_head(r, status, opcode, byte_len, imm, Head::default());
    }

    /// As `push_recv`, with a copy of the message's first bytes (shm's completed entries).
    fn push_recv_head(
        &self,
        r: PostedRecv,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        head: Head,
    ) {
        let PostedRecv { seq, local } = r;
        drop(local);
        if self.destroyed.load(Ordering::Acquire) {
            return;
        }
        self.recv_cq.push(RawWc {
            qp_num: self.qp_num,
            seq,
            recv: true,
            status,
            opcode,
            byte_len,
            imm,
            vendor_err: 0,
            head,
        });
    }

    /// Moves the QP to the error state: the head request gets `head` (if given), everything
    /// else outstanding and every posted receive is flushed, and the peer is told.
    fn enter_error(&self, st: &mut State, head: Option<WcStatus>) {
        if st.error {
            return;
        }
        // What the peer completed directly is reported before the flush.
        self.drain_rq(st);
        if st.error {
            return;
        }
        st.error = true;
        self.error.store(true, Ordering::Release);
        let mut status = head.unwrap_or(FLUSH);
        for p in st.outstanding.drain(..) {
            self.push_send(p, status, 0);
            status = FLUSH;
        }
        for r in st.recvs.drain(..) {
            self.push_recv(r, FLUSH, WcOpcode::Recv, 0, None);
        }
        st.stalled.clear();
        self.settle_throttle(st);
        // Everything executed is acknowledged before the Fatal, asked for or not.
        if st.executed > st.acked {
            st.ack_due = st.executed;
        }
        self.flush_ack(st);
        let _ = self.out.send(&Encoder::fatal().finish());
        self.out.close_after_flush();
    }

    /// Handles one frame; `when`: the acknowledgement it makes due goes out.
    fn handle(self: &Arc<Self>, frame: Frame, when: AckWhen) {
        let mut st = self.state.lock();
        // Receives the peer completed directly come first: they were before this frame.
        self.drain_rq(&mut st);
        self.dispatch(&mut st, frame);
        self.ack_after(&mut st, when);
    }

    fn dispatch(self: &Arc<Self>, st: &mut State, frame: Frame) {
        match frame {
            Frame::Ack { ssn } => self.complete_acked(st, ssn),
            Frame::Data {
                head: DataHead::ReadResp { ssn, more: true },
                data,
            } => self.read_part(st, ssn, |p| match &p.local {
                Some(v) if read_fits(p, v, data.len(), true) => {
                    v.region.lock_range(v.off + p.got, data.len()).copy_from_slice(&data);
                    Ok(data.len())
                }
                _ => Err(WcStatus::BadRespErr),
            }),
            Frame::Data {
                head: DataHead::ReadResp { ssn, more: false },
                data,
            } => self.complete_head(st, ssn, WcStatus::Success, |p| match &p.local {
                _ if p.opcode != WcOpcode::RdmaRead => Err(WcStatus::BadRespErr),
                Some(v) if read_fits(p, v, data.len(), false) => {
                    v.region.lock_range(v.off + p.got, data.len()).copy_from_slice(&data);
                    Ok(v.len as u32)
                }
                None if data.is_empty() => Ok(0),
                _ => Err(WcStatus::BadRespErr),
            }),
            Frame::AtomicResp { ssn, old } => self.complete_head(st, ssn, WcStatus::Success, |p| match &p.local {
                Some(v) if v.len >= 8 => {
                    v.region.lock_range(v.off, 8).copy_from_slice(&old.to_ne_bytes());
                    Ok(8)
                }
                _ => Err(WcStatus::BadRespErr),
            }),
            Frame::Nak { ssn, status } => self.complete_head(st, ssn, status, |_| Ok(0)),
            Frame::Fatal => self.enter_error(st, None),
            // Only that the peer lives: the link noted when it came.
            Frame::Beat => {}
            request => {
                if st.error || st.discarding {
                    return;
                }
                if !st.stalled.is_empty() {
                    st.stalled.push_back(request);
                    self.settle_throttle(st);
                } else if needs_recv(&request) && !self.recv_ready(st) {
                    self.start_stall(st, request);
                } else {
                    self.execute(st, request);
                }
            }
        }
    }

    /// shm: reports the receives the peer completed in our shared receive queue, in order,
    /// copying each Send's payload from the staging area into the receive's own buffer. Never
    /// waits for that buffer's lock: one the application holds leaves the entry (and those
    /// after it) for a later drain, so a poll made while holding it returns. True when every
    /// completed entry was drained.
    fn drain_rq(&self, st: &mut State) -> bool {
        let Some(rq) = &self.own_rq else { return true };
        while let Some((at, d)) = rq.peek_done() {
            let opcode = if d.write_imm {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let local = st.recvs.front().and_then(|r| r.local.as_ref());
            let posted = local.map_or(0, |v| v.len);
            // The peer writes the entry: a Send's length past what was posted (or staged) is a
            // lie a NIC could never tell, and would send the application past its buffer. (A
            // Write-with-immediate's length is the Write's, into memory of its own.)
            let staged_max = rq.staged_max().min(posted);
            let mut status = d.status;
            if status.is_success() && opcode == WcOpcode::Recv && d.byte_len as usize > staged_max {
                tracing::warn!(
                    qp = self.qp_num,
                    d.byte_len,
                    posted,
                    "the peer completed a receive past its length"
                );
                status = WcStatus::LocLenErr;
            } else if status.is_success() && opcode == WcOpcode::Recv && d.byte_len > 0 {
                // A Send's payload waits in the staging area: into the receive's own buffer,
                // with the NIC's local checks, as the frame path's `deliver` makes them.
                let len = d.byte_len as usize;
                match local {
                    Some(v)
                        if Arc::ptr_eq(&v.region.pd, &self.pd)
                            && v.region.access.contains(AccessFlags::LOCAL_WRITE) =>
                    {
                        let Some(mut dst) = v.region.try_lock_range(v.off, len) else {
                            return false; // the application holds the buffer: a later drain
                        };
                        rq.take_staged(&mut dst);
                    }
                    _ => {
                        rq.skip_staged(len);
                        status = WcStatus::LocProtErr;
                    }
                }
            }
            rq.pass(at);
            let Some(r) = st.recvs.pop_front() else {
                tracing::warn!(qp = self.qp_num, "the peer completed a receive we never posted");
                continue;
            };
            if r.seq as u32 != d.seq {
                tracing::warn!(qp = self.qp_num, "the peer completed receives out of order");
            }
            let imm = d.imm;
            if status.is_success() {
                self.push_recv_head(r, WcStatus::Success, opcode, d.byte_len, imm, d.head);
            } else {
                self.error.store(true, Ordering::Release);
                self.push_recv(r, status, opcode, 0, None);
                if !st.error {
                    // As after a failed delivery: the QP goes to error (the peer sends Fatal too).
                    self.enter_error(st, None);
                }
            }
        }
        true
    }

    /// shm: a request that came as a frame takes the oldest shared receive entry too, once the
    /// entries the peer completed before it are drained. `None` while one of them waits for a
    /// buffer the application holds (the frame waits as for a receive, RNR); `Some(false)`
    /// when the peer broke the queue.
    fn take_for_frame(&self, st: &mut State) -> Option<bool> {
        match &self.own_rq {
            None => Some(true),
            // Its receives come from the shared queue: the peer was given none to complete.
            Some(_) if self.srq.is_some() => Some(true),
            Some(rq) => {
                if !self.drain_rq(st) {
                    return None;
                }
                Some(rq.take_for_frame())
            }
        }
    }

    /// Reports requests this side executed itself (shm one-sided) once they reach the head:
    /// completions stay in posting order.
    fn retire(&self, st: &mut State) {
        while let Some(result) = st.outstanding.front().and_then(|p| p.done) {
            let Some(p) = st.outstanding.pop_front() else { return };
            match result {
                Ok(byte_len) => self.push_send(p, WcStatus::Success, byte_len),
                Err(status) => {
                    self.error.store(true, Ordering::Release);
                    self.push_send(p, status, 0);
                    self.enter_error(st, None);
                    return;
                }
            }
        }
    }

    /// An Ack for `ssn` completes every outstanding Send and Write up to it (acks coalesce);
    /// anything else before it, or nothing outstanding with that number, breaks RC.
    fn complete_acked(&self, st: &mut State, ssn: u64) {
        loop {
            self.retire(st);
            if st.error {
                return;
            }
            let acked = st
                .outstanding
                .front()
                .is_some_and(|p| p.seq <= ssn && matches!(p.opcode, WcOpcode::Send | WcOpcode::RdmaWrite));
            let Some(p) = st.outstanding.pop_front().filter(|_| acked) else {
                tracing::warn!(qp = self.qp_num, ssn, "ack for no outstanding Send or Write");
                self.enter_error(st, Some(WcStatus::BadRespErr));
                return;
            };
            let last = p.seq == ssn;
            self.push_send(p, WcStatus::Success, 0);
            if last {
                return self.retire(st);
            }
        }
    }

    /// Completes the oldest outstanding request, which must be `ssn` (RC is in order).
    fn complete_head(
        &self,
        st: &mut State,
        ssn: u64,
        status: WcStatus,
        land: impl FnOnce(&Pending) -> Result<u32, WcStatus>,
    ) {
        let Some(p) = self.head_for(st, ssn) else { return };
        match if status.is_success() { land(&p) } else { Err(status) } {
            Ok(byte_len) => {
                self.push_send(p, WcStatus::Success, byte_len);
                self.retire(st);
            }
            Err(status) => self.fail_head(st, p, status),
        }
    }

    /// A part of the response to Read `ssn`, the oldest outstanding request, with more to come:
    /// `land` places its bytes after those placed so far and says how many; the Read stays
    /// outstanding. Anything else breaks RC, as in [`complete_head`](Self::complete_head).
    fn read_part(&self, st: &mut State, ssn: u64, land: impl FnOnce(&Pending) -> Result<usize, WcStatus>) {
        let Some(mut p) = self.head_for(st, ssn) else { return };
        if p.opcode != WcOpcode::RdmaRead || p.done.is_some() {
            st.outstanding.push_front(p);
            return self.enter_error(st, Some(WcStatus::BadRespErr));
        }
        match land(&p) {
            Ok(n) => {
                p.got += n;
                st.outstanding.push_front(p);
            }
            Err(status) => self.fail_head(st, p, status),
        }
    }

    /// The oldest outstanding request, taken out for a response to `ssn`, once the Sends and
    /// Writes before it are completed (a response acknowledges them: RC executes in order).
    /// `None`, the QP in error, if the response is for anything else.
    fn head_for(&self, st: &mut State, ssn: u64) -> Option<Pending> {
        if st.error {
            return None;
        }
        while st.outstanding.front().is_some_and(|p| p.seq < ssn && acked_by_later(p)) {
            if let Some(p) = st.outstanding.pop_front() {
                self.push_send(p, WcStatus::Success, 0);
            }
        }
        let Some(p) = st.outstanding.pop_front() else {
            tracing::warn!(qp = self.qp_num, ssn, "response with nothing outstanding");
            self.enter_error(st, None);
            return None;
        };
        if p.seq != ssn {
            st.outstanding.push_front(p);
            self.enter_error(st, Some(WcStatus::BadRespErr));
            return None;
        }
        Some(p)
    }

    /// Request `p`, taken out by [`head_for`](Self::head_for), fails with `status`; the QP is in
    /// error before anyone can see that completion.
    fn fail_head(&self, st: &mut State, p: Pending, status: WcStatus) {
        self.error.store(true, Ordering::Release);
        self.push_send(p, status, 0);
        self.enter_error(st, None);
    }

    fn start_stall(self: &Arc<Self>, st: &mut State, frame: Frame) {
        st.stalled.push_front(frame);
        self.settle_throttle(st);
        st.stall_gen += 1;
        // The RNR budget runs on the progress engine's timers: a turn fires it.
        st.rnr = Some((Instant::now() + RNR_BUDGET, st.stall_gen));
        self.wake_reader();
    }

    fn rnr_expired(&self, gen: u64) {
        let mut st = self.state.lock();
        if st.stall_gen != gen || st.error {
            return;
        }
        if let Some(head) = st.stalled.pop_front() {
            if let Frame::Data {
                head: DataHead::Send { ssn, .. } | DataHead::Write { ssn, .. },
                ..
            } = head
            {
                self.respond(&mut st, Encoder::nak(ssn, WcStatus::RnrRetryExcErr));
            }
            st.stalled.clear();
            st.discarding = true;
            self.settle_throttle(&st);
        }
    }

    /// Runs stalled requests now that receives may be there.
    fn drain_stalled(self: &Arc<Self>, st: &mut State) {
        if st.stalled.is_empty() || !self.recv_ready(st) {
            return;
        }
        self.run_stalled(st);
        self.settle_throttle(st);
    }

    fn run_stalled(self: &Arc<Self>, st: &mut State) {
        st.stall_gen += 1; // the head moves on: its timer is void
        while let Some(frame) = st.stalled.pop_front() {
            if needs_recv(&frame) && !self.recv_ready(st) {
                self.start_stall(st, frame);
                return;
            }
            let gen = st.stall_gen;
            self.execute(st, frame);
            // In error, or held again (another QP took the shared receive it was to have).
            if st.error || st.stall_gen != gen {
                return;
            }
        }
    }

    /// Whether a receive is there for the next request that needs one; on a shared queue,
    /// when none is, the next post there runs the requests held here.
    fn recv_ready(self: &Arc<Self>, st: &State) -> bool {
        match &self.srq {
            Some(srq) => srq.has_recv_or_wait(self),
            None => !st.recvs.is_empty(),
        }
    }

    /// The receive the next request takes: the QP's oldest, or the shared queue's.
    fn take_recv(self: &Arc<Self>, st: &mut State) -> Option<PostedRecv> {
        match &self.srq {
            Some(srq) => srq.take(self),
            None => st.recvs.pop_front(),
        }
    }

    /// Receives were posted on the shared queue this QP waited on: held requests run.
    fn srq_posted(self: &Arc<Self>) {
        let mut st = self.state.lock();
        if st.error || self.destroyed.load(Ordering::Acquire) {
            return;
        }
        let before = st.ack_due;
        self.drain_stalled(&mut st);
        if st.ack_due != before {
            self.flush_ack(&mut st);
        }
    }

    /// Matches the throttle to what the held frames take, and wakes the reader thread when the
    /// link may be read again. Called under `state` after every change to the held frames.
    fn settle_throttle(&self, st: &State) {
        let full = st.stalled.full();
        if self.throttle.swap(full, Ordering::AcqRel) && !full {
            self.wake_reader();
        }
    }

    /// The target's checks, as a NIC makes them: a registration with this rkey in this QP's PD,
    /// the access flag, and the range inside the registration.
    fn check_remote(&self, addr: u64, rkey: u32, len: usize, need: AccessFlags) -> Result<Arc<Region>, WcStatus> {
        let region = self.pd.imp.lookup(rkey).ok_or(WcStatus::RemAccessErr)?;
        if !region.access.contains(need) {
            return Err(WcStatus::RemAccessErr);
        }
        let end = addr.checked_add(len as u64).ok_or(WcStatus::RemAccessErr)?;
        if addr < region.addr || end > region.addr + region.len as u64 {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(region)
    }

    /// The responder: executes one request whose receive (if it needs one) is available.
    fn execute(self: &Arc<Self>, st: &mut State, frame: Frame) {
        let fail = |st: &mut State, ssn: u64, status: WcStatus| {
            self.respond(st, Encoder::nak(ssn, status));
            self.enter_error(st, None);
        };
        match frame {
            Frame::Data {
                head: DataHead::Send { ssn, imm, ack },
                data,
            } => {
                match self.take_for_frame(st) {
                    Some(true) => {}
                    Some(false) => return fail(st, ssn, WcStatus::RemOpErr),
                    None => {
                        let head = DataHead::Send { ssn, imm, ack };
                        return self.start_stall(st, Frame::Data { head, data });
                    }
                }
                let Some(r) = self.take_recv(st) else {
                    // Another QP took the shared receive: held until one is posted (RNR).
                    let head = DataHead::Send { ssn, imm, ack };
                    return self.start_stall(st, Frame::Data { head, data });
                };
                match deliver(&r, &data, &self.pd) {
                    Ok(()) => {
                        self.push_recv(r, WcStatus::Success, WcOpcode::Recv, data.len() as u32, imm);
                        executed(st, ssn, ack);
                    }
                    Err(status) => {
                        self.push_recv(r, status, WcOpcode::Recv, 0, None);
                        let remote = if status == WcStatus::LocLenErr {
                            WcStatus::RemInvReqErr
                        } else {
                            WcStatus::RemOpErr
                        };
                        fail(st, ssn, remote);
                    }
                }
            }
            Frame::Data {
                head:
                    DataHead::Write {
                        ssn,
                        addr,
                        rkey,
                        imm,
                        ack,
                    },
                data,
            } => {
                if !data.is_empty() {
                    match self.check_remote(addr, rkey, data.len(), AccessFlags::REMOTE_WRITE) {
                        Ok(region) => {
                            let off = (addr - region.addr) as usize;
                            region.lock_range(off, data.len()).copy_from_slice(&data);
                        }
                        Err(status) => return fail(st, ssn, status),
                    }
                }
                if let Some(imm) = imm {
                    // Without a receive (one held by the application's buffer on shm, or taken
                    // by another QP of the shared queue), held: written already, written again
                    // when it runs (the same bytes).
                    let receive = match self.take_for_frame(st) {
                        Some(true) => self.take_recv(st),
                        Some(false) => return fail(st, ssn, WcStatus::RemOpErr),
                        None => None,
                    };
                    let Some(r) = receive else {
                        let head = DataHead::Write {
                            ssn,
                            addr,
                            rkey,
                            imm: Some(imm),
                            ack,
                        };
                        return self.start_stall(st, Frame::Data { head, data });
                    };
                    self.push_recv(
                        r,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        data.len() as u32,
                        Some(imm),
                    );
                }
                executed(st, ssn, ack);
            }
            Frame::ReadReq { ssn, addr, rkey, len } => {
                let len = len as usize;
                if len == 0 {
                    return self.respond(st, Encoder::read_resp(ssn));
                }
                match self.check_remote(addr, rkey, len, AccessFlags::REMOTE_READ) {
                    Ok(region) => {
                        let off = (addr - region.addr) as usize;
                        self.flush_ack(st);
                        // What the link does not take at once is read from the region as it
                        // goes out, as a NIC reads while it transmits: a Write or Send behind
                        // this Read may land before the answer has left whole, which RC allows
                        // (an initiator that must order them fences: IBV_SEND_FENCE).
                        let _ = self.out.send_from(ssn, &region, off, len);
                    }
                    Err(status) => fail(st, ssn, status),
                }
            }
            Frame::Atomic { ssn, addr, rkey, op } => {
                if addr % 8 != 0 {
                    return fail(st, ssn, WcStatus::RemInvReqErr);
                }
                match self.check_remote(addr, rkey, 8, AccessFlags::REMOTE_ATOMIC) {
                    Ok(region) => {
                        let off = (addr - region.addr) as usize;
                        let rmw = match op {
                            AtomicOp::CompareSwap { compare, swap } => Rmw::CompareSwap { compare, swap },
                            AtomicOp::FetchAdd { add } => Rmw::FetchAdd { add },
                        };
                        // Not `respond`: if the application holds the region, the atomic
                        // waits in the sending backlog rather than this thread under our lock.
                        self.flush_ack(st);
                        let _ = self.out.send_atomic(ssn, &region, off, rmw);
                    }
                    Err(status) => fail(st, ssn, status),
                }
            }
            Frame::Ack { .. }
            | Frame::Nak { .. }
            | Frame::Data {
                head: DataHead::ReadResp { .. },
                ..
            }
            | Frame::AtomicResp { .. }
            | Frame::Fatal
            | Frame::Beat => {}
        }
    }
}

/// Copies a Send's payload into a posted receive, with the NIC's local checks.
fn deliver(r: &PostedRecv, data: &[u8], pd: &Arc<PdShared>) -> Result<(), WcStatus> {
    match &r.local {
        None if data.is_empty() => Ok(()),
        None => Err(WcStatus::LocLenErr),
        Some(v) => {
            if !Arc::ptr_eq(&v.region.pd, pd) || !v.region.access.contains(AccessFlags::LOCAL_WRITE) {
                return Err(WcStatus::LocProtErr);
            }
            if data.len() > v.len {
                return Err(WcStatus::LocLenErr);
            }
            v.region.lock_range(v.off, data.len()).copy_from_slice(data);
            Ok(())
        }
    }
}

/// A QP's engine as the progress engine's task.
struct Turns(Arc<Engine>);

impl Task for Turns {
    fn turn(&self, why: Why) -> Next {
        self.0.turn_once(why)
    }
}

impl Engine {
    /// One turn on the progress engine: the RNR timer, the reader, the writer.
    fn turn_once(self: &Arc<Self>, why: Why) -> Next {
        let mut rl = self.turns.lock();
        let mut why = why;
        loop {
            self.link.disarm();
            let now = Instant::now();
            let rnr_due = {
                let mut st = self.state.lock();
                match st.rnr {
                    Some((at, gen)) if at <= now => {
                        st.rnr = None;
                        Some(gen)
                    }
                    _ => None,
                }
            };
            if let Some(gen) = rnr_due {
                self.rnr_expired(gen);
            }
            let link_at = self.link.service(now, why.readable);
            let read = self.read_turn(&mut rl, why, now);
            let (full, write_at) = self.out.write_turn(now);
            let rnr_at = self.state.lock().rnr.map(|(at, _)| at);
            let at = [link_at, read.at, write_at, rnr_at].into_iter().flatten().min();
            // A link whose readiness no descriptor tells (shm) rings its descriptor when what
            // was armed comes; armed with it there already, the turn goes on.
            let again = (read.watch && self.link.arm_read()) || (full && self.link.arm_write());
            if again {
                why = Why {
                    readable: true,
                    writable: true,
                    ..Why::default()
                };
                continue;
            }
            return match self.link.socket().is_some() {
                // A socket: readable and writable as itself.
                true => Next {
                    read: read.watch,
                    write: full,
                    at,
                },
                // One descriptor rung for both (and for the link's own traffic).
                false => Next {
                    read: read.watch || full || self.link.always_watched(),
                    write: false,
                    at,
                },
            };
        }
    }
}

impl super::CqSource for Engine {
    fn arm(&self, watched: bool) {
        if let Some(rq) = &self.own_rq {
            rq.arm();
        }
        // The waiter sleeps from now: the reader thread watches the socket again, unless its
        // wait has no timeout, which watches the socket already (or waits out a stall), and no
        // poll left frames read ahead, which no socket readiness announces. Missing a wait it
        // is just entering with a timeout costs at most that timeout (`POLLER_GRACE`), and the
        // waiter watches the socket itself meanwhile (`watch.rs`). A waiter that watches the
        // sockets of many QPs (`watched`) reads what arrives itself: their readers come back
        // by what its polls hand them, or at their timeout.
        //
        // On a link whose descriptor the engine always watches (shm), arming the ring for
        // reading is all a turn would do: its producer rings that descriptor when the next
        // frame comes, and the engine turns then. A wake-up here cost a progress-thread turn
        // per sleep of an event-mode waiter, on the path of every call (a pooled shm server).
        // A turn under way disarms first and then sees the CQ armed, so it arms again.
        if self.buffered.load(Ordering::Acquire) {
            return self.wake_reader();
        }
        let timed = !self.reader_untimed.load(Ordering::SeqCst);
        if !timed || watched {
            return;
        }
        let armed_ring = self.link.always_watched() && !self.ack_owed.load(Ordering::SeqCst);
        if armed_ring && !self.link.arm_read() {
            return;
        }
        self.wake_reader();
    }

    fn drain(self: Arc<Self>) {
        if self.own_rq.is_some() {
            let mut st = self.state.lock();
            // A frame that waited for entries held up by a busy buffer runs once they drained.
            if self.drain_rq(&mut st) && !st.stalled.is_empty() {
                self.drain_stalled(&mut st);
            }
            drop(st);
            // Most polls find only the queue's completions: the ring of frames is not touched,
            // nor ever on a CQ of many QPs (their progress thread reads it).
            let framed =
                self.link.has_bytes() || self.buffered.load(Ordering::Acquire) || self.ack_owed.load(Ordering::Acquire);
            if !framed || !self.pollers_read() {
                return;
            }
        }
        self.poll_link();
    }
}
