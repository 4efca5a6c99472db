//! What a driver hands a session: messages (alone or in batches), Writes-with-immediate, the ends
//! of Reads and Writes.

use super::*;

impl Session {
    /// Whether handling `msg` reads the `now` passed with it: only a request (or a piece of
    /// one) with a time budget does, to place its deadline. For any other message a driver
    /// whose clock is costly to read may pass any instant.
    pub fn needs_now(msg: &[u8]) -> bool {
        // A peek at two fields, not a second decode: this runs on every message. A batch may
        // hold a request with a budget after its first message.
        batch::has_more(msg) || Header::is_budgeted_request(msg).unwrap_or(true)
    }

    /// A message arrived in a receive slot. The driver reposts the slot when it likes (after
    /// sending what this message causes, say) and then calls [`Session::reposted`]: only then is
    /// the slot's credit returned to the peer, so the peer never sends into a slot not posted.
    ///
    /// # Errors
    /// [`ProtoError`] for bytes that are not a valid message or that break the protocol; the
    /// driver should then close the connection. Never panics.
    pub fn handle_message(&mut self, msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.handle_message_in(msg, None, now).map(|_| ())
    }

    /// As [`Session::handle_message`], offering the receive slot the message is in, named
    /// `slot`, to the application: a request for a method served in place
    /// ([`Session::serve_in_slot`]) or a response to a call that keeps its response in place
    /// ([`Session::keep_in_slot`]) then stays there ([`RequestBody::InSlot`], [`Reply::InSlot`]).
    /// Returns whether it did: the driver then keeps the slot out of the ring until the
    /// application lets go of it, and reposts it then (calling [`Session::reposted`]).
    /// Messages in pieces are always copied out.
    ///
    /// # Errors
    /// As [`Session::handle_message`] (the slot is not kept then).
    pub fn handle_message_in(&mut self, msg: &[u8], slot: Option<u64>, now: Instant) -> Result<bool, ProtoError> {
        self.handle_message_with_head(&[], msg, slot, now)
    }

    /// As [`Session::handle_message_in`], the header read from `head` when it holds one: a
    /// copy of the message's first bytes that came with its completion (the transport's
    /// `Completion::head`), which spares a read of the receive slot's first line.
    ///
    /// # Errors
    /// As [`Session::handle_message`].
    pub fn handle_message_with_head(
        &mut self,
        head: &[u8],
        msg: &[u8],
        slot: Option<u64>,
        now: Instant,
    ) -> Result<bool, ProtoError> {
        let first = if head.len() >= HEADER_LEN { head } else { msg };
        if batch::has_more(first) {
            // Copied out of its slot, part by part: the slot goes back at once.
            return self.handle_batch(head, msg, now).map(|()| false);
        }
        self.offer = slot;
        let r = self.handle_decoded(head, msg, now);
        let offered = std::mem::take(&mut self.offer).is_some();
        r.map(|()| slot.is_some() && !offered)
    }

    pub(super) fn handle_decoded(&mut self, head: &[u8], msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        let (h, body) = Header::decode_with_head(head, msg)?;
        self.handle_part(&h, body, now)
    }

    /// A batch ([`batch`]): its messages one after another, for one slot's credit.
    pub(super) fn handle_batch(&mut self, head: &[u8], msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        for part in batch::Parts::new(head, msg) {
            let (head, bytes) = part?;
            let (h, body) = Header::decode_with_head(head, bytes)?;
            self.handle_part(&h, body, now)?;
        }
        Ok(())
    }

    /// One message, decoded, its slot's credit counted.
    pub(super) fn handle_part(&mut self, h: &Header, body: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.returned(h.credits).map_err(|()| ProtoError::Overrun)?;
        if h.flags & FLAG_FRAGMENT != 0 {
            // Joined into a vector of its own (`Cow::Owned`): never kept in a slot.
            return match self.join(h, body)? {
                Some((h, whole)) => self.dispatch(&h, Cow::Owned(whole), now),
                None => Ok(()),
            };
        }
        if let Some(j) = &self.joining {
            // Between the pieces of a message: credits, and whole requests and responses of
            // other calls ([`Session::interleave`]).
            let other = matches!(h.kind, Kind::Request | Kind::Response)
                && (h.kind, h.call_id) != (j.header.kind, j.header.call_id);
            if h.kind != Kind::Credit && !other {
                return Err(ProtoError::BadFragment("a message between the pieces of another"));
            }
        }
        self.dispatch(h, Cow::Borrowed(body), now)
    }

    pub(super) fn dispatch(&mut self, h: &Header, body: Cow<'_, [u8]>, now: Instant) -> Result<(), ProtoError> {
        match h.kind {
            Kind::Request => self.handle_request(h, body, now),
            Kind::Response => self.handle_response(h, body),
            Kind::Cancel => {
                self.handle_cancel(h.call_id);
                Ok(())
            }
            Kind::ReadDone => self.handle_read_done_msg(h.call_id),
            Kind::Credit => Ok(()),
            Kind::GoAway => {
                self.theirs = self.theirs.max(Shutdown::GoingAway);
                // Never sent, so never run: safe to retry elsewhere.
                self.fail_held_back(&CallError::ShuttingDown);
                Ok(())
            }
            Kind::Close => {
                self.handle_close();
                Ok(())
            }
        }
    }

    /// A receive slot consumed by a message (or a Write-with-immediate) is posted again: its
    /// credit goes back to the peer with our next message.
    pub fn reposted(&mut self) {
        self.credits.reposted();
    }

    /// An RDMA Write-with-immediate landed `len` bytes for call `imm` (consuming a receive slot,
    /// which the driver reposts and reports with [`Session::reposted`]).
    ///
    /// # Errors
    /// [`ProtoError::UnknownCall`] when no call of ours advertised a landing buffer under `imm`.
    pub fn handle_write_imm(&mut self, imm: u32, len: usize) -> Result<(), ProtoError> {
        let _ = len; // the length travels in the landing buffer's prefix
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        match self.calls.get(imm) {
            Some(c) if c.landing.is_some() => {
                let buf = c.landing.unwrap_or_default();
                self.finish_call(imm, Ok(Reply::Landed { buf }));
                Ok(())
            }
            _ => Err(ProtoError::UnknownCall(imm)),
        }
    }

    /// A [`Transmit::Read`] finished with these bytes (or failed).
    pub fn handle_read_done(&mut self, token: Token, result: Result<Vec<u8>, CallError>, now: Instant) {
        match token {
            Token::Response(call) => {
                if !self.calls.contains_key(call) {
                    return;
                }
                self.queue_small(Kind::ReadDone, call, 0, Vec::new());
                self.finish_call(call, result.map(Reply::Bytes));
            }
            Token::Request(call) => self.request_fetched(call, result.map(RequestBody::Bytes), now),
        }
    }

    /// As [`Session::handle_read_done`] for a [`Token::Response`] read that the driver read into
    /// held buffer `buf` (from its start, `len` bytes) because the call takes its response
    /// where it lands ([`Session::reads_in_place`]): the call finishes with [`Reply::Held`].
    /// When the call was cancelled or is gone, the buffer comes back as a [`Transmit::Release`].
    pub fn handle_response_read(&mut self, call: u32, result: Result<(BufId, usize), CallError>) {
        if !self.calls.get(call).is_some_and(|c| c.live) {
            if let Ok((b, _)) = result {
                self.actions.push_back(Transmit::Release(b));
            }
        }
        if !self.calls.contains_key(call) {
            return;
        }
        self.queue_small(Kind::ReadDone, call, 0, Vec::new());
        self.finish_call(call, result.map(|(buf, len)| Reply::Held { buf, len }));
    }

    /// As [`Session::handle_read_done`] for a [`Token::Request`] read, when the driver keeps the
    /// request in held buffer `buf` (read into from its start, `len` bytes) to hand it to the
    /// application without a copy. When no handler will run (cancelled, or the call is gone),
    /// the buffer comes back as a [`Transmit::Release`].
    pub fn handle_request_read(&mut self, call: u32, result: Result<(BufId, usize), CallError>, now: Instant) {
        let buf = result.as_ref().ok().map(|&(b, _)| b);
        let runs = self.served.get(call).is_some_and(|s| !s.cancelled);
        if !runs || result.is_err() {
            if let Some(b) = buf {
                self.actions.push_back(Transmit::Release(b));
            }
        }
        self.request_fetched(call, result.map(|(buf, len)| RequestBody::Held { buf, len }), now);
    }

    pub(super) fn request_fetched(&mut self, call: u32, result: Result<RequestBody, CallError>, now: Instant) {
        let Some(sc) = self.served.get_mut(call) else { return };
        let (cancelled, method) = (sc.cancelled, sc.method);
        let was_read = std::mem::replace(&mut sc.state, Serving::Running);
        if matches!(was_read, Serving::Reading) {
            let bytes = sc.bytes;
            self.read_ended(bytes);
        }
        match result {
            _ if cancelled => self.reply_error(call, ErrorReply::cancelled()),
            Err(e) => {
                let why = format!("fetching the request: {}", crate::error::report(&e));
                self.reply_error(call, ErrorReply::internal(why));
            }
            Ok(payload) => {
                let budget = self
                    .served
                    .get(call)
                    .and_then(|s| s.deadline)
                    .map(|d| d.saturating_duration_since(now));
                self.events.push_back(Event::Request {
                    call,
                    method,
                    payload,
                    budget,
                });
            }
        }
    }

    /// A [`Transmit::WriteImm`] finished.
    pub fn handle_write_done(&mut self, buf: BufId) {
        let call = self
            .served
            .iter()
            .find(|(_, s)| matches!(s.state, Serving::Writing(b) if b == buf))
            .map(|(c, _)| c);
        if let Some(call) = call {
            self.unserve(call);
        }
        self.actions.push_back(Transmit::Release(buf));
    }
}
