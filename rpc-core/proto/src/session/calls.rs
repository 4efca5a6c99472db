//! The caller's side of a session: starting, cancelling and finishing calls, and their responses.

use super::*;

impl Session {
    /// Starts a call. `landing` is a registered buffer for a large response, if the caller
    /// expects one; `budget` a deadline relative to `now` (which is read only to place that
    /// deadline: without a budget any instant will do).
    ///
    /// # Errors
    /// [`CallError::PayloadTooLarge`]; [`CallError::ConnectionLost`] after the connection died;
    /// [`CallError::Expired`] for a budget below a microsecond (the wire's unit): the call has
    /// no time left to be sent in, and is not. On error the caller still owns the buffers it
    /// passed.
    pub fn start_call(
        &mut self,
        method: u32,
        payload: Payload,
        landing: Option<(RemoteRegion, BufId)>,
        budget: Option<Duration>,
        now: Instant,
    ) -> Result<u32, CallError> {
        // Before the loss: after the peer's Close the connection is lost too, and the caller
        // must learn that this call was not run (and may be retried elsewhere).
        if self.is_going_away() {
            return Err(CallError::ShuttingDown);
        }
        if let Some(why) = &self.lost {
            return Err(CallError::ConnectionLost(why.clone()));
        }
        let (len, eager) = match &payload {
            Payload::Eager(b) => (b.len() as u64, b.len() as u64),
            Payload::Lent { desc, .. } => (desc.len, 0),
            Payload::LentWith { desc, tail, .. } => (desc.len.saturating_add(tail.len() as u64), 0),
            Payload::Placed { len, .. } => (*len as u64, *len as u64),
        };
        if len > self.cfg.max_payload {
            return Err(CallError::PayloadTooLarge {
                len,
                max: self.cfg.max_payload,
            });
        }
        if budget.is_some_and(|b| b.as_micros() == 0) {
            return Err(CallError::Expired);
        }
        if let Payload::Eager(b) | Payload::LentWith { tail: b, .. } = &payload {
            if b.len() > self.cfg.eager_max {
                return Err(CallError::Protocol(format!(
                    "eager payload of {} bytes above eager_max {}",
                    b.len(),
                    self.cfg.eager_max
                )));
            }
        }
        if let Payload::Placed { len, .. } = payload {
            self.check_placed(len)?;
            if landing.is_some() {
                return Err(CallError::Protocol(
                    "a payload sent from its buffer cannot carry a landing descriptor".into(),
                ));
            }
        }
        let call = self.fresh_call_id();
        let mut flags = 0;
        let mut body = Vec::new();
        if let Some((d, _)) = &landing {
            flags |= FLAG_LANDING;
            body.reserve(DESC_LEN * 2);
            encode_desc(d, &mut body);
        }
        let lent = match &payload {
            Payload::Lent { desc, buf } => {
                flags |= FLAG_RENDEZVOUS;
                encode_desc(desc, &mut body);
                Some(*buf)
            }
            Payload::LentWith { desc, buf, tail } => {
                flags |= FLAG_RENDEZVOUS;
                body.reserve(DESC_LEN + tail.len());
                encode_desc(desc, &mut body);
                body.extend_from_slice(tail);
                Some(*buf)
            }
            _ => None,
        };
        // A budget the wire cannot carry (u32 microseconds: about 71 minutes) stays the caller's
        // alone: the server gets none, rather than a shorter one that would cut the call short.
        let budget_us = budget
            .and_then(|b| u32::try_from(b.as_micros()).ok())
            .map_or(0, |us| us.max(1));
        let header = Header {
            kind: Kind::Request,
            flags,
            call_id: call,
            method,
            status: 0,
            credits: 0,
            body_len: 0,
            budget_us,
        };
        let out = match payload {
            Payload::Placed { buf, len } => Out::Placed { header, buf, len },
            // The payload is the body as it stands: moved, not copied.
            Payload::Eager(b) if body.is_empty() => Out::Msg { header, body: b },
            Payload::Eager(b) => {
                body.extend_from_slice(&b);
                Out::Msg { header, body }
            }
            Payload::Lent { .. } | Payload::LentWith { .. } => Out::Msg { header, body },
        };
        // Beyond what the peer serves at once, or behind calls that wait: the call waits too.
        let sent = self.held_back.is_empty() && self.calls.len() < self.call_limit && self.call_bytes_fit(eager);
        if sent {
            self.call_bytes += eager;
            self.push_out(out);
        } else {
            self.held_back.push_back(out);
        }
        // Past what an `Instant` can hold (`Duration::MAX`, say): never.
        let deadline = budget.and_then(|b| now.checked_add(b));
        if deadline.is_some() {
            self.deadlines.store(true, Ordering::Relaxed);
        }
        self.calls.insert(
            call,
            ClientCall {
                method,
                deadline,
                lent,
                landing: landing.map(|(_, b)| b),
                in_slot: false,
                live: true,
                bytes: eager,
                counted: sent,
            },
        );
        Ok(call)
    }

    /// Whether a payload of `len` bytes may go as [`Payload::Placed`]: within the eager threshold
    /// and one piece.
    pub fn fits_placed(&self, len: usize) -> bool {
        len <= self.cfg.eager_max && len <= self.cfg.piece()
    }

    /// How a payload of `len` bytes already in a registered buffer of the connection goes
    /// without a copy: lent when above the threshold or longer than one piece (lending costs no
    /// copy, whatever the threshold), sent from the buffer otherwise, unless a landing
    /// descriptor must go in front of it (`with_landing`), which leaves only a copy.
    pub fn registered_route(&self, len: usize, with_landing: bool) -> Route {
        if self.is_rendezvous(len) || !self.fits_placed(len) {
            Route::Lend
        } else if with_landing {
            Route::Copy
        } else {
            Route::Place
        }
    }

    pub(super) fn check_placed(&self, len: usize) -> Result<(), CallError> {
        if self.fits_placed(len) {
            return Ok(());
        }
        Err(CallError::Protocol(format!(
            "a payload of {len} bytes cannot be sent from its buffer in one message (eager_max {}, piece {})",
            self.cfg.eager_max,
            self.cfg.piece()
        )))
    }

    pub(super) fn fresh_call_id(&mut self) -> u32 {
        loop {
            let id = self.next_call;
            self.next_call = self.next_call.wrapping_add(1).max(1);
            if !self.calls.contains_key(id) {
                return id;
            }
        }
    }

    /// The caller gave up on `call` (its future was dropped). The server is told; the call's
    /// buffers stay lent until the server's last word on it.
    pub fn cancel(&mut self, call: u32) {
        if let Some(c) = self.calls.get_mut(call) {
            if c.live {
                c.live = false;
                if !self.withdraw(call) {
                    self.queue_small(Kind::Cancel, call, 0, Vec::new());
                }
            }
        }
    }

    /// Takes `call` (no longer live) out of the calls waiting to be sent, if it is one, and
    /// finishes it there: nothing of it reached the peer.
    pub(super) fn withdraw(&mut self, call: u32) -> bool {
        if self.held_back.is_empty() {
            return false;
        }
        let Some(i) = self.held_back.iter().position(|o| o.call() == Some(call)) else {
            return false;
        };
        if let Some(Out::Placed { buf, .. }) = self.held_back.remove(i) {
            self.actions.push_back(Transmit::Release(buf));
        }
        self.finish_call(call, Err(CallError::Cancelled));
        true
    }

    /// The calls waiting to be sent fail with `e` (the peer's GoAway: they were never sent).
    #[cold]
    pub(super) fn fail_held_back(&mut self, e: &CallError) {
        while let Some(out) = self.held_back.pop_front() {
            if let Out::Placed { buf, .. } = out {
                self.actions.push_back(Transmit::Release(buf));
            }
            if let Some(call) = out.call() {
                self.finish_call(call, Err(e.clone()));
            }
        }
    }

    pub(super) fn finish_call(&mut self, call: u32, result: Result<Reply, CallError>) {
        let Some(c) = self.calls.remove(call) else { return };
        if c.counted {
            self.call_bytes -= c.bytes;
        }
        if !self.held_back.is_empty() {
            self.send_held_back();
        }
        if let Some(b) = c.lent {
            self.actions.push_back(Transmit::Release(b));
        }
        let landed = matches!(result, Ok(Reply::Landed { .. }));
        if let Some(b) = c.landing {
            if !(landed && c.live) {
                self.actions.push_back(Transmit::Release(b));
            }
        }
        if c.live {
            self.events.push_back(Event::CallDone { call, result });
        }
    }

    /// Whether calls that waited for the server's limit were let go with the budget they were
    /// started with: the driver then reads the clock and calls [`Session::refresh_budgets`]
    /// before it takes the next transmit.
    pub fn budgets_stale(&self) -> bool {
        self.stale_budgets
    }

    /// Gives the requests queued to be sent the budget their deadlines leave at `now`, so a
    /// server never gets more time than its caller has; one with less than a microsecond left
    /// is taken back unsent, [`CallError::Expired`].
    pub fn refresh_budgets(&mut self, now: Instant) {
        self.stale_budgets = false;
        let mut expired = Vec::new();
        for out in self.queue.iter_mut() {
            let header = match out {
                Out::Msg { header, .. } | Out::Placed { header, .. } | Out::Pieces { header, sent: 0, .. } => header,
                _ => continue,
            };
            if header.kind != Kind::Request {
                continue;
            }
            let Some(d) = self.calls.get(header.call_id).and_then(|c| c.deadline) else {
                continue;
            };
            let left = d.saturating_duration_since(now);
            if left.as_micros() == 0 {
                expired.push(header.call_id);
            } else if let Ok(us) = u32::try_from(left.as_micros()) {
                header.budget_us = us;
            }
        }
        for call in expired {
            let Some(i) = self.queue.iter().position(|o| o.call() == Some(call) && o.is_request()) else {
                continue;
            };
            if let Some(Out::Placed { buf, .. }) = self.queue.remove(i) {
                self.actions.push_back(Transmit::Release(buf));
            }
            self.finish_call(call, Err(CallError::Expired));
        }
    }

    /// Sends the calls waiting for the peer, as far as its limit allows.
    pub(super) fn send_held_back(&mut self) {
        if self.lost.is_some() || self.theirs != Shutdown::None {
            return;
        }
        while self.calls.len() - self.held_back.len() < self.call_limit {
            let Some(front) = self.held_back.front() else {
                break;
            };
            let n = front.call().and_then(|id| self.calls.get(id)).map_or(0, |c| c.bytes);
            if !self.call_bytes_fit(n) {
                break;
            }
            let Some(out) = self.held_back.pop_front() else {
                break;
            };
            if let Some(c) = out.call().and_then(|id| self.calls.get_mut(id)) {
                c.counted = true;
                self.call_bytes += n;
                self.stale_budgets |= c.deadline.is_some();
            }
            self.queue.push_back(out);
        }
    }

    pub(super) fn handle_response(&mut self, h: &Header, body: Cow<'_, [u8]>) -> Result<(), ProtoError> {
        let call = h.call_id;
        let Some(c) = self.calls.get(call) else {
            return Err(ProtoError::UnknownCall(call));
        };
        if h.flags & FLAG_RENDEZVOUS != 0 {
            let (desc, _) = decode_desc(&body)?;
            if desc.len > self.cfg.max_payload {
                return Err(ProtoError::TooLarge(desc.len));
            }
            if c.live {
                // A server answers only once it has the request (it reads a lent one before
                // anything else happens to the call): the request's buffer is free already,
                // before the response's is taken (a large vector goes back to the allocator
                // in time to be reused for the response).
                if let Some(b) = self.calls.get_mut(call).and_then(|c| c.lent.take()) {
                    self.actions.push_back(Transmit::Release(b));
                }
                self.actions.push_back(Transmit::Read {
                    token: Token::Response(call),
                    remote: desc,
                    tail: Vec::new(),
                });
            } else {
                self.queue_small(Kind::ReadDone, call, 0, Vec::new());
                self.finish_call(call, Err(CallError::Cancelled));
            }
            return Ok(());
        }
        let result = match Status::from_u16(h.status) {
            Status::Ok => Ok(match (body, c.in_slot && c.live) {
                (Cow::Borrowed(b), true) if self.offer.is_some() => Reply::InSlot {
                    slot: self.offer.take().unwrap_or_default(),
                    range: HEADER_LEN..HEADER_LEN + b.len(),
                },
                // A short one by value for a caller that takes a `Body`; a `Vec` for the others.
                (body, in_slot) => match in_slot.then(|| Inline::new(&body)).flatten() {
                    Some(small) => Reply::Inline(small),
                    None => Reply::Bytes(body.into_owned()),
                },
            }),
            s => Err(CallError::from_wire(s, c.method, &body)),
        };
        self.finish_call(call, result);
        Ok(())
    }
}
