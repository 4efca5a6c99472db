//! The server's side of a session: requests, their limits, and the answers.

use super::*;

impl Session {
    pub(super) fn handle_request(&mut self, h: &Header, body: Cow<'_, [u8]>, now: Instant) -> Result<(), ProtoError> {
        let call = h.call_id;
        if self.ours == Shutdown::Closed {
            // Sent before the caller saw our Close, which tells it this call was not run.
            return Ok(());
        }
        if self.served.contains_key(call) {
            return Err(ProtoError::DuplicateCall(call));
        }
        if self.active >= self.serve_limit {
            // Refused before anything of it is kept: the caller learns that it was not run.
            self.queue_small(
                Kind::Response,
                call,
                Status::Overloaded as u16,
                self.serve_limit.to_string().into_bytes(),
            );
            return Ok(());
        }
        let (landing, skip) = if h.flags & FLAG_LANDING != 0 {
            (Some(decode_desc(&body)?.0), DESC_LEN)
        } else {
            (None, 0)
        };
        let rest = &body[skip..];
        let budget = (h.budget_us > 0).then(|| Duration::from_micros(u64::from(h.budget_us)));
        let deadline = budget.map(|b| now + b);
        if deadline.is_some() {
            self.deadlines.store(true, Ordering::Relaxed);
        }
        let mut sc = ServerCall {
            method: h.method,
            deadline,
            landing,
            state: Serving::Running,
            cancelled: false,
            bytes: 0,
            counts: true,
            lent_at: None,
            arrived: now,
        };
        if h.flags & FLAG_RENDEZVOUS != 0 {
            let (desc, tail) = decode_desc(rest)?;
            // The payload: the lent bytes, then the tail the message carries (the tail is
            // within one message already; the sum is what the handler will hold).
            let total = desc.len.saturating_add(tail.len() as u64);
            if total > self.cfg.max_payload {
                self.reply_error(call, ErrorReply::too_large(total, self.cfg.max_payload));
                return Ok(());
            }
            let tail = tail.to_vec();
            self.active += 1;
            if self.deferred.is_empty() && self.bytes_fit(total) {
                self.held_bytes += total;
                self.reading_bytes += total;
                sc.bytes = total;
                sc.state = Serving::Reading;
                self.served.insert(call, sc);
                self.actions.push_back(Transmit::Read {
                    token: Token::Request(call),
                    remote: desc,
                    tail,
                });
            } else {
                sc.state = Serving::Queued(desc, tail);
                self.served.insert(call, sc);
                self.deferred.push_back(call);
            }
            return Ok(());
        }
        self.active += 1;
        self.served.insert(call, sc);
        let payload = match body {
            Cow::Borrowed(b) if self.offer.is_some() && self.in_slot_methods.contains(&h.method) => {
                RequestBody::InSlot {
                    slot: self.offer.take().unwrap_or_default(),
                    range: HEADER_LEN + skip..HEADER_LEN + b.len(),
                }
            }
            Cow::Borrowed(b) => {
                let body = &b[skip..];
                match Inline::new(body) {
                    Some(small) => RequestBody::Inline(small),
                    None => RequestBody::Bytes(body.to_vec()),
                }
            }
            Cow::Owned(mut v) => {
                v.drain(..skip);
                RequestBody::Bytes(v)
            }
        };
        self.events.push_back(Event::Request {
            call,
            method: h.method,
            payload,
            budget,
        });
        Ok(())
    }

    /// Whether a rendezvous body of `len` bytes may be read now: within the bytes held and the
    /// bytes being read, or alone in each.
    pub(super) fn bytes_fit(&self, len: u64) -> bool {
        let held = self.held_bytes == 0 || self.held_bytes.saturating_add(len) <= self.byte_limit;
        let read = self.reading_bytes == 0 || self.reading_bytes.saturating_add(len) <= self.read_limit;
        held && read
    }

    /// A request's body is no longer being read (`bytes` of it): those waiting may be.
    pub(super) fn read_ended(&mut self, bytes: u64) {
        self.reading_bytes = self.reading_bytes.saturating_sub(bytes);
        self.read_deferred();
    }

    /// Served request `call` is done with (its answer left, or it was dropped): it no longer
    /// counts against the limits, and requests waiting for bytes may be read.
    #[inline]
    pub(super) fn unserve(&mut self, call: u32) {
        let Some(sc) = self.served.remove(call) else { return };
        if sc.counts {
            self.active = self.active.saturating_sub(1);
        }
        self.release(call, sc.state, sc.bytes);
    }

    /// Served request `call` is answered: its request bytes are free now, but it counts against
    /// the request limit until `next` is done (the answer left the queue, was read or was
    /// written).
    pub(super) fn answered(&mut self, call: u32, next: Serving) {
        let Some(sc) = self.served.get_mut(call) else { return };
        let state = std::mem::replace(&mut sc.state, next);
        let bytes = std::mem::take(&mut sc.bytes);
        self.release(call, state, bytes);
    }

    /// What a served request in `state` held (`bytes` of request body) goes back.
    pub(super) fn release(&mut self, call: u32, state: Serving, bytes: u64) {
        if matches!(state, Serving::Reading) {
            self.reading_bytes = self.reading_bytes.saturating_sub(bytes);
        }
        if state.holds_request() && bytes > 0 {
            self.held_bytes = self.held_bytes.saturating_sub(bytes);
            self.read_deferred();
        }
        if matches!(state, Serving::Queued(..)) {
            // It may have been the one that did not fit, holding back those behind it.
            self.deferred.retain(|&c| c != call);
            self.read_deferred();
        }
    }

    /// A message left (handed to the driver, or ready to be): an answer that waited in the
    /// queue no longer counts.
    pub(super) fn left(&mut self, header: &Header) {
        if header.kind == Kind::Response
            && matches!(
                self.served.get(header.call_id).map(|s| &s.state),
                Some(Serving::Answered)
            )
        {
            self.unserve(header.call_id);
        }
    }

    /// Queues the answer to served request `call` (with its message `out`): done with at once
    /// when it can go at once (the common case: one lookup), else counted until it leaves.
    pub(super) fn answer(&mut self, call: u32, out: Out) {
        if self.push_out(out) {
            self.unserve(call);
        } else {
            self.answered(call, Serving::Answered);
        }
    }

    /// Starts the Reads of requests that waited for bytes, in arrival order, as far as they fit.
    pub(super) fn read_deferred(&mut self) {
        while let Some(&call) = self.deferred.front() {
            let Some(Serving::Queued(desc, tail)) = self.served.get(call).map(|s| &s.state) else {
                self.deferred.pop_front();
                continue;
            };
            let (desc, total) = (*desc, desc.len.saturating_add(tail.len() as u64));
            if !self.bytes_fit(total) {
                break;
            }
            self.deferred.pop_front();
            self.held_bytes += total;
            self.reading_bytes += total;
            let mut tail = Vec::new();
            if let Some(sc) = self.served.get_mut(call) {
                sc.bytes = total;
                if let Serving::Queued(_, t) = std::mem::replace(&mut sc.state, Serving::Reading) {
                    tail = t;
                }
            }
            self.actions.push_back(Transmit::Read {
                token: Token::Request(call),
                remote: desc,
                tail,
            });
        }
    }

    /// Whether served request `call` still waits for its handler's answer: false once it was
    /// cancelled, timed out or answered, so that a driver starts no handler for it.
    pub fn awaits_answer(&self, call: u32) -> bool {
        self.served
            .get(call)
            .is_some_and(|c| matches!(c.state, Serving::Running) && !c.cancelled)
    }

    /// The deadline of served request `call` on this side's clock (placed from its budget when
    /// it arrived), if its caller set one.
    pub fn served_deadline(&self, call: u32) -> Option<Instant> {
        self.served.get(call).and_then(|c| c.deadline)
    }

    /// Whether the body an RDMA Read fetches for `token` is for a consumer that takes it in
    /// the buffer it was read into: a handler of a method served in place
    /// ([`Session::serve_in_slot`]: it may keep that buffer, or answer from it), or a call that
    /// keeps its response where it lands ([`Session::keep_in_slot`], then
    /// [`Session::handle_response_read`]). A driver may read any other into memory of the
    /// consumer's own.
    pub fn reads_in_place(&self, token: Token) -> bool {
        match token {
            Token::Request(call) => self
                .served
                .get(call)
                .is_some_and(|s| self.in_slot_methods.contains(&s.method) || self.in_place_methods.contains(&s.method)),
            Token::Response(call) => self.calls.get(call).is_some_and(|c| c.in_slot && c.live),
        }
    }

    /// Whether a lent response of `len` bytes to `call` goes into the landing buffer the call
    /// advertised (by an RDMA Write of the lent buffer with its [`LANDING_PREFIX`]), rather
    /// than being read by the caller.
    pub fn lands(&self, call: u32, len: usize) -> bool {
        self.served
            .get(call)
            .and_then(|s| s.landing)
            .is_some_and(|l| l.len >= len as u64 + LANDING_PREFIX as u64)
    }

    /// Answers a request. Pass large responses as [`Payload::Lent`]: they are written into the
    /// caller's landing buffer when it advertised one big enough, and lent for the caller to
    /// read otherwise. A response to a call that was cancelled or timed out is dropped (a lent
    /// buffer is released at once).
    pub fn respond(&mut self, call: u32, result: Result<Payload, ErrorReply>) {
        let running = matches!(self.served.get(call).map(|s| &s.state), Some(Serving::Running));
        if !running {
            if let Ok(Payload::Lent { buf, .. } | Payload::LentWith { buf, .. } | Payload::Placed { buf, .. }) = result
            {
                self.actions.push_back(Transmit::Release(buf));
            }
            return;
        }
        match result {
            Ok(Payload::Placed { buf, len }) => match self.check_placed(len) {
                Ok(()) => {
                    let header = Header {
                        kind: Kind::Response,
                        flags: 0,
                        call_id: call,
                        method: 0,
                        status: Status::Ok as u16,
                        credits: 0,
                        body_len: 0,
                        budget_us: 0,
                    };
                    self.answer(call, Out::Placed { header, buf, len });
                }
                Err(e) => {
                    self.actions.push_back(Transmit::Release(buf));
                    self.reply_error(call, ErrorReply::internal(e.to_string()));
                }
            },
            Ok(Payload::Eager(bytes)) if bytes.len() <= self.eager_response_max() => {
                self.answer_msg(call, 0, Status::Ok as u16, bytes);
            }
            Ok(Payload::Eager(bytes)) => {
                self.reply_error(
                    call,
                    ErrorReply::internal(format!(
                        "eager response of {} bytes above {}",
                        bytes.len(),
                        self.eager_response_max()
                    )),
                );
            }
            Ok(Payload::LentWith { buf, .. }) => {
                self.actions.push_back(Transmit::Release(buf));
                self.reply_error(
                    call,
                    ErrorReply::internal("a response cannot carry a tail after its lent bytes"),
                );
            }
            Ok(Payload::Lent { desc, buf }) => {
                if desc.len > self.cfg.max_payload {
                    self.actions.push_back(Transmit::Release(buf));
                    self.reply_error(call, ErrorReply::too_large(desc.len, self.cfg.max_payload));
                    return;
                }
                let landing = self.served.get(call).and_then(|s| s.landing);
                if self.served.contains_key(call) {
                    // Answered: its request bytes are free; it counts until the answer is
                    // written, or read (ReadDone).
                    match landing.filter(|l| l.len >= desc.len + LANDING_PREFIX as u64) {
                        Some(remote) => {
                            self.answered(call, Serving::Writing(buf));
                            self.queue.push_back(Out::WriteImm {
                                buf,
                                len: desc.len as usize,
                                remote: RemoteRegion {
                                    len: desc.len,
                                    ..remote
                                },
                                imm: call,
                            });
                        }
                        None if self.lends_nothing => {
                            self.actions.push_back(Transmit::Release(buf));
                            self.reply_error(
                                call,
                                ErrorReply::internal(
                                    "this side lends nothing (Session::lend_nothing): answer in pieces, as an eager payload",
                                ),
                            );
                        }
                        None => {
                            self.answered(call, Serving::Lent(buf));
                            if self.lent_timeout.is_some() {
                                self.deadlines.store(true, Ordering::Relaxed);
                            }
                            let mut body = Vec::with_capacity(DESC_LEN);
                            encode_desc(&desc, &mut body);
                            self.queue_msg(Kind::Response, FLAG_RENDEZVOUS, call, Status::Ok as u16, body);
                        }
                    }
                }
            }
            Err(e) => self.reply_error(call, e),
        }
    }

    pub(super) fn reply_error(&mut self, call: u32, e: ErrorReply) {
        let ErrorReply { status, message: msg } = e;
        // A message longer than an eager payload is cut, at a character's boundary.
        let mut end = msg.len().min(self.cfg.eager_max.max(64));
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        let mut body = msg.into_bytes();
        body.truncate(end);
        self.answer_msg(call, 0, status as u16, body);
    }

    /// Queues a response message to `call`; a served request counts until it leaves.
    pub(super) fn answer_msg(&mut self, call: u32, flags: u16, status: u16, body: Vec<u8>) {
        if self.queue_msg(Kind::Response, flags, call, status, body) {
            self.unserve(call);
        } else {
            self.answered(call, Serving::Answered);
        }
    }

    pub(super) fn handle_cancel(&mut self, call: u32) {
        match self.served.get_mut(call).map(|s| &mut s.state) {
            Some(Serving::Running) => {
                self.events.push_back(Event::Abort { call });
                self.reply_error(call, ErrorReply::cancelled());
            }
            Some(Serving::Queued(..)) => self.reply_error(call, ErrorReply::cancelled()),
            Some(Serving::Reading) => {
                if let Some(s) = self.served.get_mut(call) {
                    s.cancelled = true;
                }
            }
            // Lent / Writing: the caller still sends ReadDone or gets the Write; unknown: the
            // response crossed the Cancel.
            _ => {}
        }
    }

    pub(super) fn handle_read_done_msg(&mut self, call: u32) -> Result<(), ProtoError> {
        match self.served.get(call).map(|s| &s.state) {
            Some(Serving::Lent(buf)) => {
                let buf = *buf;
                self.unserve(call);
                self.actions.push_back(Transmit::Release(buf));
                Ok(())
            }
            _ => Err(ProtoError::UnknownCall(call)),
        }
    }
}
