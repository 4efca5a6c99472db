//! What a session sends: its queue, credits, pieces and batches.

use super::*;

impl Session {
    /// Queues `out`, or makes it `ready` when it may go at once: nothing queued, ready or
    /// pending before it, the connection open, a data credit free, and one piece long. What
    /// `poll_transmit` would do for it then is done here. True when it went `ready` (it has
    /// left, as far as the limits go: the caller settles what it answered).
    pub(super) fn push_out(&mut self, out: Out) -> bool {
        let now = self.ready.is_none()
            && self.queue.is_empty()
            && self.actions.is_empty()
            && self.lost.is_none()
            && self.ours != Shutdown::Closed
            && self.credits.can_send_data();
        let one_piece = match &out {
            Out::Msg { body, .. } => body.len() <= self.cfg.piece(),
            Out::Placed { .. } => true,
            Out::Pieces { .. } | Out::WriteImm { .. } => false,
        };
        if !(now && one_piece) {
            self.queue.push_back(out);
            return false;
        }
        match (out, self.credits.spend()) {
            (Out::Msg { header, body }, Some(c)) => {
                self.ready = Some(Transmit::Send(encode(header, c, body)));
            }
            (Out::Placed { mut header, buf, len }, Some(c)) => {
                header.credits = c;
                header.body_len = len as u32;
                self.ready = Some(Transmit::SendPlaced {
                    head: header.to_bytes(),
                    buf,
                    len,
                });
            }
            // Not reached (`now` saw two credits, `one_piece` the kind): queued as before.
            (out, _) => {
                self.queue.push_back(out);
                return false;
            }
        }
        true
    }

    pub(super) fn queue_small(&mut self, kind: Kind, call: u32, status: u16, body: Vec<u8>) {
        self.queue_msg(kind, 0, call, status, body);
    }

    /// Queues a message (see [`Session::push_out`]); true when it went at once.
    pub(super) fn queue_msg(&mut self, kind: Kind, flags: u16, call: u32, status: u16, body: Vec<u8>) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.push_out(Out::Msg {
            header: Header {
                kind,
                flags,
                call_id: call,
                method: 0,
                status,
                credits: 0,
                body_len: 0,
                budget_us: 0,
            },
            body,
        })
    }

    /// Messages made and not handed to the driver yet: the one ready to go and those queued
    /// behind it (short ones go together, in one Send, when the driver next asks).
    pub fn unsent(&self) -> usize {
        self.queue.len() + usize::from(self.ready.is_some())
    }

    /// False when [`Session::poll_transmit`] would give nothing now: a cheap look for drivers
    /// that poll often (true does not promise work: credits may still be short).
    pub fn has_transmit(&self) -> bool {
        self.ready.is_some()
            || !self.actions.is_empty()
            || (self.lost.is_none()
                && self.ours != Shutdown::Closed
                && ((!self.queue.is_empty() && self.credits.can_send_data())
                    || self.credits.credit_message_due()
                    || self.close_due()))
    }

    /// The next piece of work to post, if credits allow.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        // Made before anything now in `actions` or the queue (see `push_out`); with the short
        // messages queued behind it since, as one batch.
        if let Some(t) = self.ready.take() {
            return Some(match t {
                Transmit::Send(mut m) if self.batch && !self.queue.is_empty() => {
                    self.batch_behind(&mut m);
                    Transmit::Send(m)
                }
                t => t,
            });
        }
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if self.lost.is_some() || self.ours == Shutdown::Closed {
            return None;
        }
        if self.close_due() {
            return self.close();
        }
        if !self.queue.is_empty() && self.credits.can_send_data() {
            let piece = self.cfg.piece();
            if let Some(Out::Msg { header, body }) = self.queue.front_mut() {
                if body.len() > piece {
                    // Too long for one slot: from now on it leaves in pieces, one per poll.
                    let (header, body) = (*header, Arc::new(std::mem::take(body)));
                    self.queue[0] = Out::Pieces { header, body, sent: 0 };
                }
            }
            // Between two pieces, the first whole request or response queued behind them
            // (`interleave`), then a piece again.
            if self.interleave
                && matches!(self.queue.front(), Some(Out::Pieces { .. }))
                && !std::mem::take(&mut self.overtook)
            {
                // Never past a ReadDone: a caller sends it before the calls it makes after
                // the answer it read, and until it arrives that answer counts here.
                let behind = self
                    .queue
                    .iter()
                    .skip(1)
                    .take_while(|o| !o.is_read_done())
                    .position(|o| o.overtakes(piece));
                if let Some(out) = behind.and_then(|i| self.queue.remove(i + 1)) {
                    self.overtook = true;
                    return self.whole(out);
                }
            }
            if let Some(Out::Pieces { header, body, sent }) = self.queue.front_mut() {
                let credits = self.credits.spend()?;
                let (off, n) = (*sent, (body.len() - *sent).min(piece));
                let m = encode_piece(*header, credits, body, off, n);
                *sent += n;
                if *sent == body.len() {
                    let header = *header;
                    self.queue.pop_front();
                    self.left(&header);
                }
                return Some(Transmit::Send(m));
            }
            let out = self.queue.pop_front()?;
            return self.whole(out);
        }
        if self.credits.credit_message_due() {
            let credits = self.credits.spend()?;
            return Some(Transmit::Send(encode(
                Header::control(Kind::Credit),
                credits,
                Vec::new(),
            )));
        }
        None
    }

    /// `out`, taken from the queue, as what the driver posts (one piece: `poll_transmit` cut
    /// longer messages into pieces first), with its credit spent.
    pub(super) fn whole(&mut self, out: Out) -> Option<Transmit> {
        match out {
            Out::Msg { header, body } => {
                let credits = self.credits.spend()?;
                self.left(&header);
                let mut m = encode(header, credits, body);
                if self.batch {
                    self.batch_behind(&mut m);
                }
                Some(Transmit::Send(m))
            }
            Out::Pieces { .. } => None,
            Out::WriteImm { buf, len, remote, imm } => {
                self.credits.spend_silent()?;
                // Its caller has the answer as soon as it lands, and may call again before
                // this side sees the Write complete: it counts no longer.
                if let Some(sc) = self.served.get_mut(imm).filter(|s| s.counts) {
                    sc.counts = false;
                    self.active = self.active.saturating_sub(1);
                }
                Some(Transmit::WriteImm { buf, len, remote, imm })
            }
            Out::Placed { mut header, buf, len } => {
                header.credits = self.credits.spend()?;
                self.left(&header);
                header.body_len = len as u32;
                Some(Transmit::SendPlaced {
                    head: header.to_bytes(),
                    buf,
                    len,
                })
            }
        }
    }

    /// Adds to `m` (short, just taken from the queue with its credit spent) the short whole
    /// messages queued right behind it, as one batch ([`batch`]) that fits a receive slot.
    pub(super) fn batch_behind(&mut self, m: &mut Message) {
        if m.len() > batch::PART_MAX {
            return;
        }
        let room = self.cfg.slot_size();
        let mut len = m.len();
        while m.parts() < batch::PARTS_MAX {
            let Some(Out::Msg { body, .. }) = self.queue.front() else {
                break;
            };
            let part = HEADER_LEN + body.len();
            if part > batch::PART_MAX || len + part > room {
                break;
            }
            let Some(Out::Msg { mut header, body }) = self.queue.pop_front() else {
                break;
            };
            self.left(&header);
            // The first message returns the credits of the whole Send.
            header.credits = 0;
            header.body_len = body.len() as u32;
            match m.more.last_mut() {
                Some((h, _)) => batch::mark_more(h),
                None => batch::mark_more(&mut m.head),
            }
            m.more.push((header.to_bytes(), body));
            len += part;
        }
    }

    /// Whether [`Session::poll_event`] has an event to give: a driver that answers requests
    /// as it takes them may hold the answers back until the last one, and send them together.
    pub fn has_event(&self) -> bool {
        !self.events.is_empty()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}

pub(super) fn encode(mut h: Header, credits: u16, body: Vec<u8>) -> Message {
    h.credits = credits;
    h.body_len = body.len() as u32;
    Message {
        head: h.to_bytes(),
        frag: None,
        body: Bytes::Own(body),
        more: Vec::new(),
    }
}

/// The piece `[off, off + n)` of a long message's body, as a fragment.
fn encode_piece(mut h: Header, credits: u16, body: &Arc<Vec<u8>>, off: usize, n: usize) -> Message {
    h.credits = credits;
    h.flags |= FLAG_FRAGMENT;
    h.body_len = (FRAG_PREFIX + n) as u32;
    let mut frag = [0u8; FRAG_PREFIX];
    frag[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    frag[4..].copy_from_slice(&(off as u32).to_le_bytes());
    Message {
        head: h.to_bytes(),
        frag: Some(frag),
        body: Bytes::Piece(body.clone(), off..off + n),
        more: Vec::new(),
    }
}
