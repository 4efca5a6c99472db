//! Time, shutdown and loss: deadlines, GoAway and Close, a lost connection.

use super::outgoing::encode;
use super::*;

impl Session {
    /// Deadlines up to `now` pass: the caller's calls fail, the server's handlers are aborted.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<u32> = self
            .calls
            .iter()
            .filter(|(_, c)| c.live && c.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| id)
            .collect();
        for call in expired {
            if let Some(c) = self.calls.get_mut(call) {
                c.live = false;
            }
            // A call still waiting its turn here never left: it was not run.
            let unsent = self.withdraw(call);
            if !unsent {
                self.queue_small(Kind::Cancel, call, 0, Vec::new());
            }
            let e = if unsent {
                CallError::Expired
            } else {
                CallError::DeadlineExceeded
            };
            self.events.push_back(Event::CallDone { call, result: Err(e) });
        }
        let late: Vec<(u32, bool)> = self
            .served
            .iter()
            .filter(|(_, s)| matches!(s.state, Serving::Running | Serving::Queued(..)))
            .filter(|(_, s)| s.deadline.is_some_and(|d| d <= now))
            .map(|(id, s)| (id, matches!(s.state, Serving::Running)))
            .collect();
        for (call, running) in late {
            if running {
                self.events.push_back(Event::Abort { call });
            }
            self.reply_error(call, ErrorReply::deadline());
        }
        if let Some(t) = self.lent_timeout {
            let lent: Vec<(u32, Option<Instant>)> = self
                .served
                .iter()
                .filter(|(_, s)| matches!(s.state, Serving::Lent(_)))
                .map(|(id, s)| (id, s.lent_at))
                .collect();
            for (call, at) in lent {
                match at {
                    None => {
                        if let Some(s) = self.served.get_mut(call) {
                            s.lent_at = Some(now);
                        }
                    }
                    Some(at) if at + t <= now => {
                        self.handle_connection_lost(Lost::new(
                            LostKind::Timeout,
                            format!(
                                "the peer did not read its answer to call {call} within {t:?} (Config::lent_answer_timeout)"
                            ),
                        ));
                        return;
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// Starts a graceful shutdown of this side (a server's): the peer is told to start no new
    /// calls (GoAway); requests it sent before it learnt that are still served; once nothing is
    /// left to serve, [`Session::poll_transmit`] gives the last message, Close, which tells the
    /// peer that its calls still pending were not run. After Close the session serves and sends
    /// nothing more: the driver closes the connection once Close's Send is complete
    /// ([`Session::is_closed`]). Calls of this side's own fail with
    /// [`CallError::ShuttingDown`] from now on.
    pub fn go_away(&mut self) {
        if self.ours != Shutdown::None || self.lost.is_some() {
            return;
        }
        self.ours = Shutdown::GoingAway;
        self.queue_small(Kind::GoAway, 0, 0, Vec::new());
    }

    /// True once this side sent Close ([`Session::go_away`]): the connection may close as soon
    /// as that Send is complete.
    pub fn is_closed(&self) -> bool {
        self.ours == Shutdown::Closed
    }

    /// True once this side started its shutdown, or the peer told it of its own: no new calls.
    pub fn is_going_away(&self) -> bool {
        self.ours != Shutdown::None || self.theirs != Shutdown::None
    }

    /// Close is due: GoAway went out, and nothing is left to serve or to send.
    pub(super) fn close_due(&self) -> bool {
        self.ours == Shutdown::GoingAway
            && self.lost.is_none()
            && self.served.is_empty()
            && self.queue.is_empty()
            && self.ready.is_none()
            && self.credits.available() >= 1
    }

    /// The last message, Close: it may take the credit held back for Credit messages, as
    /// nothing follows it.
    #[cold]
    pub(super) fn close(&mut self) -> Option<Transmit> {
        let credits = self.credits.spend()?;
        self.ours = Shutdown::Closed;
        Some(Transmit::Send(encode(
            Header::control(Kind::Close),
            credits,
            Vec::new(),
        )))
    }

    /// The peer's Close: the calls still pending were never run there. They fail with
    /// [`CallError::ShuttingDown`]; then the connection is over.
    #[cold]
    pub(super) fn handle_close(&mut self) {
        self.theirs = Shutdown::Closed;
        let calls: Vec<u32> = self.calls.iter().map(|(id, _)| id).collect();
        for call in calls {
            self.finish_call(call, Err(CallError::ShuttingDown));
        }
        self.handle_connection_lost(Lost::new(LostKind::Closed, "the peer shut the connection down (Close)"));
    }

    /// Why the connection was declared lost, once it was (the peer's Close included).
    pub fn lost_reason(&self) -> Option<&Lost> {
        self.lost.as_ref()
    }

    /// The connection is gone (QP error, peer dead): every pending call fails now, every
    /// handler is aborted, every lent buffer is released (no peer can reach it any more).
    pub fn handle_connection_lost(&mut self, why: Lost) {
        if self.lost.is_some() {
            return;
        }
        self.lost = Some(why.clone());
        // Requests still queued here never left in full (a request in pieces runs only once
        // all its pieces are in): those calls did not run.
        let mut unsent = Vec::new();
        for out in self.queue.drain(..) {
            if out.is_request() {
                unsent.extend(out.call());
            }
            // Never sent: the driver has it back now.
            if let Out::Placed { buf, .. } = out {
                self.actions.push_back(Transmit::Release(buf));
            }
        }
        if let Some(Transmit::SendPlaced { buf, .. }) = self.ready.take() {
            self.actions.push_back(Transmit::Release(buf));
        }
        if !self.held_back.is_empty() {
            // Known not to have run: said so, for callers that retry only such calls.
            self.fail_held_back(&CallError::Unsent(why.clone()));
        }
        for call in unsent {
            self.finish_call(call, Err(CallError::Unsent(why.clone())));
        }
        self.joining = None;
        let calls: Vec<u32> = self.calls.iter().map(|(id, _)| id).collect();
        for call in calls {
            self.finish_call(call, Err(CallError::ConnectionLost(why.clone())));
        }
        for (call, s) in self.served.drain() {
            match s.state {
                Serving::Running => self.events.push_back(Event::Abort { call }),
                Serving::Lent(b) | Serving::Writing(b) => self.actions.push_back(Transmit::Release(b)),
                Serving::Reading | Serving::Queued(..) | Serving::Answered => {}
            }
        }
        self.deferred.clear();
        self.active = 0;
        self.held_bytes = 0;
        self.reading_bytes = 0;
    }

    /// True once the connection was declared lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_some()
    }
}
