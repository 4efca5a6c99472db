//! A call's future: started on its first poll, spinning or sleeping by the completion mode until
//! its result, cancelled when dropped before it.

use super::state::wait_sent;
use super::*;

/// How many polls the only call in flight makes before giving way to the runtime (a few
/// microseconds on shm).
pub(super) const INNER_SPINS: u32 = 256;

/// What a call starts with.
pub(super) struct Start {
    pub(super) method: u32,
    pub(super) payload: Outgoing,
    pub(super) opts: CallOptions,
    /// An eager response may stay in its receive slot ([`Client::call_body`]).
    pub(super) in_slot: bool,
}

/// A call: started on its first poll, then in flight until its result; cancels it when dropped
/// before the result. Starting, waiting and giving the caller's buffer back happen under one
/// lock when the result comes within the first poll's spin, as it nearly always does on a
/// fast provider (each lock taken and released is two atomic read-modify-writes).
pub(super) struct Call<'a, T> {
    pub(super) shared: &'a Shared,
    /// Until the first poll.
    pub(super) start: Option<Start>,
    /// The call's `rpc.call` span (made at the first poll; entered at each), or none without
    /// a subscriber.
    pub(super) span: Option<tracing::Span>,
    pub(super) finish: Finish<T>,
    pub(super) call: u32,
    /// What to give back to the caller besides the response; `None` once given.
    pub(super) back: Option<Back>,
    /// The adaptive spin budget (its clock read only once a round of polls found nothing).
    pub(super) budget: driver::Budget,
    pub(super) sleeping: bool,
    pub(super) done: bool,
    /// A spinner giving way to the calls it woke ([`tokio::task::yield_now`]), until it resumes.
    pub(super) yielding: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

/// Turns a finished call's response and the caller's buffer back into what the public method
/// gives.
pub(super) type Finish<T> = fn(Body, Option<crate::RegisteredBuf>) -> Result<T, RpcError>;

impl<'a, T> Call<'a, T> {
    pub(super) fn new(shared: &'a Shared, start: Start, finish: Finish<T>) -> Self {
        Self {
            shared,
            start: Some(start),
            span: None,
            finish,
            call: 0,
            back: None,
            budget: driver::Budget::default(),
            sleeping: false,
            done: false,
            yielding: None,
        }
    }
}

/// A call that ends without its response (an error, a cancel): the caller's lent buffer goes
/// back to the connection, not to the caller, once the server is done with it.
pub(super) fn unkeep(st: &mut State, back: Option<Back>) {
    if let Some(Back::Kept { id, .. }) = back {
        st.conn.stash.unkeep(id);
    }
}

/// The caller's buffer back with the response (after the Send it went out in is done).
pub(super) fn give_back(
    st: &mut parking_lot::MutexGuard<'_, State>,
    result: Body,
    back: Back,
) -> Result<(Body, Option<crate::RegisteredBuf>), RpcError> {
    match back {
        Back::Nothing => Ok((result, None)),
        Back::Own(b) => Ok((result, Some(b))),
        Back::Kept { id, len } => {
            wait_sent(st, id);
            match st.conn.stash.reclaim(id, len) {
                Some(b) => Ok((result, Some(b))),
                None => Err(match st.conn.lost() {
                    Some(why) => RpcError::ConnectionLost(why.clone()),
                    None => RpcError::Transport(TransportError::new("re-registering the lent buffer failed")),
                }),
            }
        }
    }
}

impl<T> Future for Call<'_, T> {
    type Output = Result<T, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // tokio's cooperative budget: a call that finishes within its first poll (one call
        // alone on a fast connection spins inside it) does not return to the runtime, so a
        // task making calls in a loop gives way once its budget is spent, not never: other
        // tasks of its worker, other callers of this connection among them, get their turn.
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let this = self.get_mut();
        if let Some(y) = this.yielding.as_mut() {
            if y.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.yielding = None;
        }
        if let Some(start) = &this.start {
            this.span = spans::call(start.method, start.payload.len());
        }
        // Without a subscriber there is no span: nothing to clone, enter or drop.
        let span = this.span.clone();
        let _entered = span.as_ref().map(tracing::Span::enter);
        let out = this
            .poll_call(cx)
            .map(|r| r.and_then(|(body, buf)| (this.finish)(body, buf)));
        if out.is_ready() {
            coop.made_progress();
        }
        out
    }
}

impl<T> Call<'_, T> {
    /// The call's progress, under the connection's lock: starts it on the first poll.
    pub(super) fn poll_call(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(Body, Option<crate::RegisteredBuf>), RpcError>> {
        let shared = self.shared;
        let mut st = shared.state.lock();
        if let Some(start) = self.start.take() {
            match st.start(start.method, start.payload, start.opts) {
                Ok((call, back)) => {
                    if start.in_slot {
                        // Before anyone polls: the response cannot have arrived yet.
                        st.conn.session.keep_in_slot(call);
                    }
                    self.call = call;
                    self.back = Some(back);
                }
                Err(e) => {
                    self.done = true;
                    return Poll::Ready(Err(e));
                }
            }
        } else {
            st.ran(self.call);
            // Another call spinning polls for all: this one only looks at its own slot.
            if st.spinner.is_none_or(|c| c == self.call) {
                st.progress();
            }
            if st.commit_driver() {
                shared.kick.notify_one();
            }
        }
        st.conn.link.driven_here();
        // A server driven by this very thread cannot answer while this call spins.
        // One spinner per connection: this call, unless another has the turn (a sleeping call
        // spins only when a spinner that left handed the turn to it).
        let turn = match st.spinner {
            Some(c) => c == self.call,
            None => !self.sleeping,
        };
        let mut spin =
            turn && {
                let st = &mut *st;
                self.budget.spins(shared.mode, &mut st.backoff)
            } && !st.conn.peer_on_this_thread(shared.mode)
                && crate::driver::Conn::may_spin(shared.mode, &mut st.spin_token);
        if spin {
            st.conn.spin_round();
            st.spinner = Some(self.call);
            if self.sleeping {
                self.sleeping = false;
                st.sleeping -= 1;
            }
        } else if turn {
            st.spinner = None;
        }
        // The only call in flight spins right here for a while: giving way to the runtime
        // between polls costs more than a round trip on shm (a syscall per turn when the caller
        // is the runtime's `block_on`). With other calls in flight it gives way at once, so
        // that they are posted without waiting for this one.
        if spin && st.calls.len() == 1 {
            let mut seen = None;
            let mut ran_out = true;
            for _ in 0..INNER_SPINS {
                // Its own result only when some result came (here, or on another thread).
                if seen != Some(st.settled) {
                    if st.calls.get(self.call).is_none_or(|s| s.result.is_some()) {
                        ran_out = false;
                        break;
                    }
                    seen = Some(st.settled);
                }
                if st.conn.lost().is_some() {
                    ran_out = false;
                    break;
                }
                std::hint::spin_loop();
                // Only the CQ until it has something; then everything that follows from it.
                if st.conn.poll_cq() {
                    st.settle();
                    self.reclaim_early(&mut st);
                } else if st.conn.more_to_post() {
                    // The next piece of a long message (a flush posts one at a time).
                    st.conn.send_pending();
                }
                // A caller on another thread waiting to start a call gets the lock now (one
                // atomic load when nobody waits).
                parking_lot::MutexGuard::bump(&mut st);
            }
            // The polls found nothing and the server's poller is on this core: spinning on
            // keeps it from answering. Sleep. (A result that came in the last poll is taken
            // below whatever `spin` says.)
            if ran_out && matches!(shared.mode, CompletionMode::Adaptive { .. }) && st.conn.peer_shares_cpu() {
                spin = false;
            }
        }
        if !spin && st.spinner == Some(self.call) {
            // Out of budget (or the peer needs the core): the turn goes with it.
            st.spinner = None;
        }
        if st.spinner.is_none() {
            st.spin_token = None;
            st.conn.spin_end();
        }
        let Some(slot) = st.calls.get_mut(self.call) else {
            // Only a finished call leaves the table, and only here.
            self.done = true;
            unkeep(&mut st, self.back.take());
            return Poll::Ready(Err(RpcError::ConnectionLost(crate::driver::local_loss(
                "the call was lost",
            ))));
        };
        if let Some(result) = slot.result.take() {
            st.calls.remove(self.call);
            if self.sleeping {
                st.sleeping -= 1;
            }
            self.done = true;
            let back = self.back.take().unwrap_or(Back::Nothing);
            let out = match result {
                Ok(body) => give_back(&mut st, body, back),
                Err(e) => {
                    unkeep(&mut st, Some(back));
                    Err(e)
                }
            };
            // The spinner leaving hands its turn on; without a call to take it, whoever sleeps
            // now needs the driver on the CQ.
            let handed = st.pass_turn(self.call);
            if st.spinner.is_none() {
                st.spin_token = None;
                st.conn.spin_end();
            }
            let kick = (!handed && !st.driver_on_cq && st.needs_watch()) || st.driver_must_post();
            drop(st);
            if kick {
                shared.kick.notify_one();
            }
            return Poll::Ready(out);
        }
        if spin {
            // Spinning on: through the runtime, and off the core for a moment when the
            // provider's own threads need it. This poll found nothing of its own: the budget
            // runs from here.
            self.budget.idle_round(shared.mode);
            let yield_cpu = st.conn.yield_cpu;
            let others = st.woken > 0;
            drop(st);
            if yield_cpu {
                std::thread::yield_now();
            }
            if others {
                // The calls this poll woke go first, and the rest of the runtime's queues:
                // tokio's `yield_now` runs this task again only after the worker has run
                // them (and polled its IO driver). Waking itself kept the worker's local queue
                // from ever emptying, and with more runnable tasks than it holds (256) the
                // others waited in the global queue, which a worker looks at once in 61 turns.
                let mut y: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(tokio::task::yield_now());
                if y.as_mut().poll(cx).is_pending() {
                    self.yielding = Some(y);
                    return Poll::Pending;
                }
            }
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        slot.waker = Some(cx.waker().clone());
        if !self.sleeping {
            self.sleeping = true;
            st.sleeping += 1;
        }
        // The driver must look again when it is not watching the CQ, or when a deadline
        // earlier than the one it sleeps until has come (this call's). Not while another call
        // spins: that one polls, posts and fires deadlines for all, and kicks the driver
        // when it stops.
        let earlier = st
            .conn
            .session
            .poll_timeout()
            .is_some_and(|d| st.driver_until.is_none_or(|u| d < u));
        let kick = st.spinner.is_none() && (!st.driver_on_cq || earlier || st.conn.more_to_post());
        drop(st);
        if kick {
            shared.kick.notify_one();
        }
        Poll::Pending
    }

    /// The caller's buffer back from the connection as soon as no peer reaches it (on a fast
    /// provider the Send from it completes long before the response comes): taken while the
    /// call waits, off the response's path.
    pub(super) fn reclaim_early(&mut self, st: &mut State) {
        if let Some(Back::Kept { id, len }) = self.back {
            if let Some(b) = st.conn.stash.reclaim_released(id, len) {
                self.back = Some(Back::Own(b));
            }
        }
    }
}

impl<T> Drop for Call<'_, T> {
    fn drop(&mut self) {
        // Never polled (nothing started), or finished.
        if self.done || self.start.is_some() {
            return;
        }
        let mut st = self.shared.state.lock();
        if self.sleeping {
            st.sleeping -= 1;
        }
        st.ran(self.call);
        st.pass_turn(self.call);
        if st.spinner.is_none() {
            st.spin_token = None;
            st.conn.spin_end();
        }
        if let Some(slot) = st.calls.remove(self.call) {
            if slot.result.is_none() {
                st.conn.session.cancel(self.call);
                st.conn.flush();
            }
        }
        unkeep(&mut st, self.back.take());
        // The driver finishes what the cancel started (the server's last word, credits).
        drop(st);
        self.shared.kick.notify_one();
    }
}
