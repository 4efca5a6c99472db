//! What a client's calls and its driver task share under the connection's lock: the call
//! table, the one spinner, and starting, settling and posting.

use super::*;

pub(super) struct State {
    pub(super) conn: Conn,
    pub(super) calls: CallMap<u32, Slot>,
    /// Calls whose futures wait for the driver to wake them.
    pub(super) sleeping: usize,
    /// The driver task waits on the CQ (it wakes sleeping calls without being kicked).
    pub(super) driver_on_cq: bool,
    /// The deadline the driver sleeps until (it fires deadlines of sleeping calls).
    pub(super) driver_until: Option<Instant>,
    pub(super) closed: bool,
    /// Results handed to calls so far: a spinning call looks its own up only when this moved.
    pub(super) settled: u64,
    /// The connection's adaptive spinning, off for a while after a spinner was held up.
    pub(super) backoff: driver::Backoff,
    /// The one call that polls the connection by spinning; the others sleep until it (or the
    /// driver) hands them their results. One poller finds every completion in one batch and
    /// wakes their calls together, where a spinner per call polled (and locked) once per
    /// call per turn of the runtime, and a busy peer then waited for all of them.
    pub(super) spinner: Option<u32>,
    /// The spinner's leave to spin, of the process's few ([`SpinToken`](crate::driver::SpinToken)):
    /// held while the connection has a spinner.
    pub(super) spin_token: Option<crate::driver::SpinToken>,
    /// Calls woken with their results whose futures have not run since: each may start its
    /// next call when it does, so a spinner posts after them ([`State::may_post`]).
    pub(super) woken: usize,
    /// Polls the spinner held back posting for since it last posted.
    pub(super) held_back: u32,
    /// The driver task woke calls with their results and gave way to them: it posts the
    /// requests they start when it runs again, together ([`State::part_due`] aside).
    pub(super) driver_posts: bool,
    /// Passed as `now` to calls without a deadline (the session reads the clock's value only
    /// to place a deadline), which saves a clock read per call.
    pub(super) epoch: Instant,
}

/// A started call: its result once known, and who to wake then.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) result: Option<Result<Body, RpcError>>,
    pub(super) waker: Option<Waker>,
    /// Woken with its result, and not polled since ([`State::woken`]).
    pub(super) woken: bool,
}

/// Polls a spinner holds back posting for at most, waiting for the calls it woke
/// ([`State::may_post`]).
pub(super) const HOLD_BACK_POLLS: u32 = 4;

/// The parts the requests of calls in flight on a connection go out in, behind a spinner
/// ([`State::part_due`]); at least [`PART_MIN`] requests a part.
pub(super) const PARTS: usize = 4;
pub(super) const PART_MIN: usize = 8;

/// A request's bytes as the caller hands them over.
pub(super) enum Outgoing {
    Vec(Vec<u8>),
    Buf(crate::RegisteredBuf),
    /// A shared value's bytes, then `tail` (a typed call's other arguments).
    Bulk {
        bulk: crate::Bulk,
        tail: Vec<u8>,
    },
}

impl Outgoing {
    pub(super) fn len(&self) -> usize {
        match self {
            Outgoing::Vec(v) => v.len(),
            Outgoing::Buf(b) => b.len(),
            Outgoing::Bulk { bulk, tail } => bulk.len() + tail.len(),
        }
    }
}

/// What a call gives back to its caller besides the response.
pub(super) enum Back {
    Nothing,
    /// The caller's buffer, which was copied (or sent inside the message).
    Own(crate::RegisteredBuf),
    /// The caller's buffer, lent as it is under this id.
    Kept {
        id: crate::proto::BufId,
        len: usize,
    },
}

impl State {
    /// Stages the payload (lent above the threshold), starts the call and posts its request.
    pub(super) fn start(&mut self, method: u32, payload: Outgoing, opts: CallOptions) -> Result<(u32, Back), RpcError> {
        let now = match opts.deadline {
            Some(_) => Instant::now(),
            None => self.epoch,
        };
        let conn = &mut self.conn;
        // What to give back if the call cannot start: the payload's buffer and the landing
        // buffer, at most one each (an array: no allocation per call).
        let mut staged: [Option<crate::proto::BufId>; 2] = [None, None];
        let mut back = Back::Nothing;
        // A large response is written into a landing buffer the request advertises, of at most
        // the largest payload the connection carries (a hint beyond it is only a hint).
        let max = usize::try_from(conn.session.config().max_payload).unwrap_or(usize::MAX);
        let landing_len = opts
            .response_hint
            .map(|h| h.min(max))
            .filter(|&h| conn.session.is_rendezvous(h));
        let result = (|| -> Result<u32, RpcError> {
            let p = match payload {
                Outgoing::Vec(v) if conn.session.is_rendezvous(v.len()) => {
                    // The vector itself where registering is cheap, else a copy.
                    let (desc, buf) = conn.stash.lend_vec(v)?;
                    staged[0] = Some(buf);
                    Payload::Lent { desc, buf }
                }
                Outgoing::Vec(v) => Payload::Eager(v),
                // A registered one as it is (a shared buffer has no room for a header in
                // front), else the vector itself or a copy.
                Outgoing::Bulk { bulk, tail } if conn.lends_bulk(bulk.len() + tail.len()) => {
                    let len = bulk.len();
                    let (desc, buf, copied) = conn.stash.lend_bulk(bulk)?;
                    spans::payload("request", len, if copied { How::CopiedAndLent } else { How::Lent });
                    staged[0] = Some(buf);
                    Payload::LentWith { desc, buf, tail }
                }
                // Small: into the message; a vector the value alone holds is moved, not copied.
                Outgoing::Bulk { bulk, tail } => match bulk.try_into_whole_vec() {
                    Ok(mut v) => {
                        v.extend_from_slice(&tail);
                        Payload::Eager(v)
                    }
                    Err(bulk) => {
                        let mut v = Vec::with_capacity(bulk.len() + tail.len());
                        v.extend_from_slice(&bulk.bytes());
                        v.extend_from_slice(&tail);
                        Payload::Eager(v)
                    }
                },
                Outgoing::Buf(b) => {
                    let len = b.len();
                    let route = conn.session.registered_route(len, landing_len.is_some());
                    let lend = route == Route::Lend;
                    match conn.stash.stage_user(b, route, true) {
                        Ok((desc, buf)) => {
                            staged[0] = Some(buf);
                            back = Back::Kept { id: buf, len };
                            match desc {
                                Some(desc) => {
                                    spans::payload("request", len, How::Lent);
                                    Payload::Lent { desc, buf }
                                }
                                None => {
                                    spans::payload("request", len, How::SentFromBuffer);
                                    Payload::Placed { buf, len }
                                }
                            }
                        }
                        // Another connection's buffer, or a small one behind a landing
                        // descriptor: copied, as a Vec would be.
                        Err(b) => {
                            let p = if lend {
                                let (desc, buf) = conn.stash.lend(&b.bytes())?;
                                staged[0] = Some(buf);
                                spans::payload("request", len, How::CopiedAndLent);
                                Payload::Lent { desc, buf }
                            } else {
                                spans::payload("request", len, How::Copied);
                                Payload::Eager(b.to_vec())
                            };
                            back = Back::Own(b);
                            p
                        }
                    }
                }
            };
            let landing = match landing_len {
                Some(h) => {
                    let want = h.saturating_add(LANDING_PREFIX);
                    let (buf, mr) = conn.stash.take(want, crate::stash::Role::Land)?;
                    let mut desc = crate::region::desc(mr.remote());
                    desc.len = want as u64;
                    staged[1] = Some(buf);
                    Some((desc, buf))
                }
                None => None,
            };
            Ok(conn.session.start_call(method, p, landing, opts.deadline, now)?)
        })();
        match result {
            Ok(call) => {
                // The request goes out first: nothing polls in between, so its slot in the
                // call table can come after, off the round trip's path. With another call
                // spinning, its next poll posts it instead, in one Send with the other short
                // messages queued by then (the calls its last results let start), unless
                // enough wait for a part of its own ([`State::part_due`]). Likewise behind
                // the driver, when it woke this call among others ([`State::driver_posts`]).
                if !self.poster_after() || self.part_due() {
                    self.conn.flush();
                }
                self.calls.insert(call, Slot::default());
                Ok((call, back))
            }
            Err(e) => {
                for b in staged.into_iter().flatten() {
                    conn.stash.release(b);
                }
                if let Back::Kept { id, .. } = back {
                    conn.stash.unkeep(id);
                }
                Err(e)
            }
        }
    }

    /// Whether a poller runs after the calls woken with their results and posts what they
    /// start: the spinner, or the driver task given way to them ([`State::driver_posts`]).
    pub(super) fn poster_after(&self) -> bool {
        self.spinner.is_some() || self.driver_posts
    }

    /// After a poll that woke calls with no spinner, where the provider moves each Send on
    /// threads of its own (`tcp`): the driver task posts, after them, what they start (true:
    /// kick it), where each call posted its own request, a system call and the kernel's
    /// loopback TCP round each (12-14 µs of CPU a call at 64 in flight in the event mode).
    /// Where a Send is cheap (`shm`) each goes at once: a sleeping server then wakes for the
    /// first, not for a batch (at 16 in flight in the event mode, batches halved calls/s).
    pub(super) fn commit_driver(&mut self) -> bool {
        if !self.conn.yield_cpu || self.spinner.is_some() || self.driver_posts || self.woken < 2 {
            return false;
        }
        self.driver_posts = true;
        true
    }

    /// Whether the requests queued behind a spinner make a part of their own: a quarter of the
    /// calls in flight, at least [`PART_MIN`]. One Send for all the calls a batch of results
    /// let start has the server wait until the client has run every one of them, then the
    /// client wait while the server answers them all: each side's core idles half the time.
    /// In parts the server answers the first while the client starts the rest (on `shm` at 64
    /// in flight, 1.3 M calls/s against 1.0 M in one Send). Not where the provider moves each
    /// Send on threads of its own (`tcp`): there a Send costs the host's CPU more than the
    /// overlap saves (at 64 in flight, 0.1-0.35 M calls/s in parts against 0.4-0.6 M).
    pub(super) fn part_due(&self) -> bool {
        !self.conn.yield_cpu && self.conn.session.unsent() >= (self.calls.len() / PARTS).max(PART_MIN)
    }

    /// Polls the connection once and hands finished calls their results; posts what is
    /// queued unless calls it woke are still to run ([`State::woken`]).
    pub(super) fn progress(&mut self) {
        self.conn.take_inputs();
        self.settle();
        if self.may_post() {
            self.conn.flush();
        }
    }

    /// Whether to post now: unless calls this side woke with their results have not run yet
    /// and a spinner will post after them. Each such call starts its next one as it runs,
    /// and its request then goes out with the others in one batch (`proto/batch.rs`) where
    /// posting at once sent each alone. A spinner holds back a few polls at most, whatever the
    /// woken calls do.
    pub(super) fn may_post(&mut self) -> bool {
        if self.woken == 0 || !self.poster_after() || self.held_back >= HOLD_BACK_POLLS {
            self.held_back = 0;
            return true;
        }
        self.held_back += 1;
        false
    }

    /// `call` runs again after its result woke it: one woken call fewer to wait for.
    pub(super) fn ran(&mut self, call: u32) {
        if let Some(slot) = self.calls.get_mut(call) {
            if std::mem::take(&mut slot.woken) {
                self.woken -= 1;
            }
        }
    }

    /// Hands out what the session decided since (results, transmits), without polling.
    pub(super) fn settle(&mut self) {
        while let Some(ev) = self.conn.session.poll_event() {
            if let Event::CallDone { call, result } = ev {
                let result = result.map_err(RpcError::from).and_then(|r| match r {
                    Reply::Bytes(b) => Ok(Body::Bytes(b)),
                    Reply::Inline(b) => Ok(Body::Inline(b)),
                    Reply::Landed { buf } => self.conn.stash.landed(buf).map(Body::Bytes),
                    Reply::Held { buf, len } => self
                        .conn
                        .stash
                        .hand_out_body(buf, len)
                        .ok_or_else(|| RpcError::Internal("the response's read buffer went missing".into())),
                    Reply::InSlot { slot, range } => self
                        .conn
                        .slot_body(slot, range)
                        .map(Body::Registered)
                        .ok_or_else(|| RpcError::Internal("the response's receive slot went missing".into())),
                });
                if let Some(slot) = self.calls.get_mut(call) {
                    self.settled += 1;
                    slot.result = Some(result);
                    if let Some(w) = slot.waker.take() {
                        w.wake();
                        if !std::mem::replace(&mut slot.woken, true) {
                            self.woken += 1;
                        }
                    }
                }
            }
        }
        // Consumed receive slots are posted again by the next `flush` (the next call's, or the
        // driver's): after the request it sends, off the path of this result.
        if self.woken == 0 || !self.poster_after() {
            self.conn.send_pending();
        }
        if self.conn.lost().is_some() {
            self.conn.drain_flushed();
        }
    }

    /// When `call` (leaving) was the spinner: hands the turn to a call still waiting, and wakes
    /// it to spin. True when a call took it.
    pub(super) fn pass_turn(&mut self, call: u32) -> bool {
        if self.spinner != Some(call) {
            return false;
        }
        self.spinner = None;
        let next = self
            .calls
            .iter()
            .find(|&(id, slot)| id != call && slot.result.is_none() && slot.waker.is_some())
            .map(|(id, _)| id);
        let Some(next) = next else {
            return false;
        };
        match self.calls.get_mut(next).and_then(|s| s.waker.take()) {
            Some(w) => {
                self.spinner = Some(next);
                w.wake();
                true
            }
            None => false,
        }
    }

    /// True when no call polls by itself, so the driver must watch the CQ for them.
    pub(super) fn needs_watch(&self) -> bool {
        self.conn.lost().is_none() && (self.conn.has_work() || self.conn.probing()) && self.calls.len() <= self.sleeping
    }

    /// True when what a flush left ([`Conn::more_to_post`]) is the driver's to post: no call
    /// spins, which would post it itself.
    pub(super) fn driver_must_post(&self) -> bool {
        self.calls.len() <= self.sleeping && self.conn.more_to_post()
    }
}

/// Waits until the application's buffer `id` is back from the Send it went out in (its
/// completion may come after the response), or the connection is lost.
pub(super) fn wait_sent(st: &mut parking_lot::MutexGuard<'_, State>, id: crate::proto::BufId) {
    while st.conn.stash.in_flight(id) {
        if st.conn.lost().is_some() {
            // Flushed work requests give their buffers back.
            st.conn.drain_flushed();
            return;
        }
        st.progress();
        if st.conn.stash.in_flight(id) {
            parking_lot::MutexGuard::unlocked(st, std::thread::yield_now);
        }
    }
}
