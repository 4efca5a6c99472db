//! Posting what the session sends: Sends from the send pool or from a placed buffer, Reads and
//! Writes-with-immediate started, buffers released.

use super::*;

impl Conn {
    /// A buffer a Send went out from ([`Transmit::SendPlaced`]) is no longer in a work request:
    /// back to the stash, released (to its owner, or the free lists).
    pub(super) fn placed_back(&mut self, id: BufId, mr: MemoryRegion) {
        self.stash.put_back(id, mr);
        self.stash.release(id);
    }

    /// Posts what the session wants sent, then reposts the receive slots consumed since: a
    /// response goes out before its request's slot is posted again (the slot's credit goes with
    /// a later message, so the peer never sends into a slot that is not posted).
    pub(crate) fn flush(&mut self) -> bool {
        let mut any = self.send_pending();
        if self.repost() {
            any |= self.send_pending();
        }
        any
    }

    /// Whether the session has something to post now that a later `flush` would post: what a
    /// `flush` left at [`FLUSH_BYTES`]. A driver looks before it sleeps. (Work waiting for
    /// credits or for a free send buffer waits for a completion, which wakes the driver.)
    pub(crate) fn more_to_post(&self) -> bool {
        self.cut_short && self.lost.is_none() && self.backlog.is_empty() && self.session.has_transmit()
    }

    /// Posts what the session wants sent, up to about [`FLUSH_BYTES`] (and leaves consumed
    /// slots for a later `flush`).
    pub(crate) fn send_pending(&mut self) -> bool {
        if self.session.budgets_stale() {
            // Calls let go after waiting for the server's limit: what their deadlines leave.
            self.session.refresh_budgets(Instant::now());
        }
        let mut any = false;
        let mut bytes = 0;
        self.cut_short = false;
        if !self.rdma_waiting.is_empty() {
            any = self.post_waiting();
        }
        loop {
            if bytes >= FLUSH_BYTES {
                self.cut_short = true;
                return any;
            }
            let t = match self.backlog.pop_front() {
                Some(t) => t,
                // Most calls find nothing: the cheap look first.
                None if !self.session.has_transmit() => return any,
                None => match self.session.poll_transmit() {
                    Some(t) => t,
                    None => return any,
                },
            };
            let len = match &t {
                Transmit::Send(m) => m.len(),
                Transmit::SendPlaced { len, .. } => *len,
                _ => 0,
            };
            // A transmit that waits for a send buffer is no progress: the driver must not
            // take it for activity and spin, when the buffers it waits for come back through
            // other connections' completions (a server's shared send pool).
            if let Err(t) = self.post(t) {
                self.backlog.push_front(t);
                return any;
            }
            any = true;
            bytes += len;
        }
    }

    /// Posts one transmit; gives it back when no send buffer is free yet.
    pub(super) fn post(&mut self, t: Transmit) -> Result<(), Transmit> {
        if self.lost.is_some() {
            if let Transmit::Release(buf) | Transmit::SendPlaced { buf, .. } = t {
                self.stash.release(buf);
            }
            return Ok(());
        }
        // A message's own bytes (a `Vec` body) are freed after the post, off its path.
        let mut sent = None;
        let wr = match t {
            Transmit::Send(bytes) => {
                let Some(mut buf) = self.send_pool.take() else {
                    self.starved = self.lease.is_some();
                    return Err(Transmit::Send(bytes));
                };
                self.starved = false;
                if !bytes.write_to(&mut buf.bytes_mut()) {
                    self.lose(local_loss(format!(
                        "a {}-byte message does not fit a send buffer",
                        bytes.len()
                    )));
                    return Ok(());
                }
                let mut wr = SendWr::send(SEND, buf).len(bytes.len());
                // Only every SIGNAL_EVERY-th Send asks for a completion (as perftest and eRPC
                // do): its completion also gives back the buffers of the unsignaled ones before
                // it, and the poll loops see one completion where they saw SIGNAL_EVERY.
                // Every Send of a connection shutting down asks for one: its last (Close) must
                // complete before the connection closes.
                self.unsignaled += 1;
                // A shared send pool's buffers come back at once: an unsignaled Send would
                // keep its buffer from every other connection until this one sends again.
                if self.unsignaled < SIGNAL_EVERY && !self.session.is_going_away() && self.lease.is_none() {
                    wr = wr.unsignaled();
                } else {
                    self.unsignaled = 0;
                }
                let wr = if bytes.len() <= self.max_inline {
                    wr.inline()
                } else {
                    wr
                };
                sent = Some(bytes);
                wr
            }
            Transmit::SendPlaced { head, buf, len } => {
                let Some(mut mr) = self.stash.take_out(buf) else {
                    self.lose(local_loss(format!("buffer {buf} to send from is not the connection's")));
                    return Ok(());
                };
                let n = HEADER_LEN + len;
                if n > mr.len() {
                    self.placed_back(buf, mr);
                    self.lose(local_loss(format!(
                        "a {n}-byte message does not fit the buffer it is in"
                    )));
                    return Ok(());
                }
                mr.bytes_mut()[..HEADER_LEN].copy_from_slice(&head);
                // Signaled: its completion gives the buffer back (and the pool's buffers of the
                // unsignaled Sends before it).
                self.unsignaled = 0;
                let wr = SendWr::send(PLACED | buf, mr).len(n);
                if n <= self.max_inline {
                    wr.inline()
                } else {
                    wr
                }
            }
            Transmit::Read { token, remote, tail } => {
                let read = remote.len as usize;
                // The bytes read, then the tail the request message carried: the body whole.
                let len = read.saturating_add(tail.len());
                if !self.rdma_fits() {
                    return Err(Transmit::Read { token, remote, tail });
                }
                // Into a vector of its own where that is cheap, unless the handler takes the
                // request in registered memory. A body taken where it lands may be sent on as
                // it is (a typed handler's `Bulk` answered back, a caller's sent again): peers
                // may read the buffer once it is lent.
                let target = match token {
                    Token::Request(_) if self.session.reads_in_place(token) => {
                        self.stash.take(len, crate::stash::Role::Lend).map(|(id, _)| id)
                    }
                    Token::Response(_) if self.session.reads_in_place(token) => {
                        self.stash.take_target(len, crate::stash::Role::Lend)
                    }
                    _ => self.stash.take_target(len, crate::stash::Role::Private),
                };
                let local = match target {
                    Ok(x) => x,
                    Err(e) => {
                        self.session
                            .handle_read_done(token, Err(CallError::Local(LocalError::new(e))), Instant::now());
                        return Ok(());
                    }
                };
                let Some(mut buf) = self.stash.take_out(local) else {
                    return Ok(());
                };
                if !tail.is_empty() {
                    // Before the Read is posted: the tail's bytes are this side's alone, and
                    // the Read lands before them.
                    if let Err(e) = buf.write_at(read, &tail) {
                        self.stash.put_back(local, buf);
                        self.stash.release(local);
                        let e = RpcError::Internal(format!("placing a request's tail: {e}"));
                        self.session
                            .handle_read_done(token, Err(CallError::Local(LocalError::new(e))), Instant::now());
                        return Ok(());
                    }
                }
                let k = self.next_read;
                self.next_read = (self.next_read + 1) & ID_MASK;
                let (wrs, mut job) = self.pieces(buf, read, local, Some(token), |off, _| {
                    (
                        READ | k,
                        SendOp::Read {
                            remote: crate::region::at(&remote, off as u64),
                        },
                    )
                });
                job.len = len;
                self.reads.insert(k, job);
                return self.post_all(wrs);
            }
            Transmit::WriteImm { buf, len, remote, imm } => {
                if !self.rdma_fits() {
                    return Err(Transmit::WriteImm { buf, len, remote, imm });
                }
                let Some(mr) = self.stash.take_out(buf) else {
                    return Ok(());
                };
                let (wrs, job) = self.pieces(mr, LANDING_PREFIX + len, buf, None, |off, last| {
                    let op = SendOp::Write {
                        remote: crate::region::at(&remote, off as u64),
                        imm: last.then_some(imm),
                    };
                    (WRITE | buf, op)
                });
                self.writes.insert(buf, job);
                return self.post_all(wrs);
            }
            Transmit::Release(b) => {
                self.stash.release(b);
                return Ok(());
            }
        };
        if let Err(e) = self.qp.post_send(wr) {
            for wr in e.unposted {
                let id = wr.wr_id();
                if let (PLACED, Some(mr)) = (id & !ID_MASK, wr.into_buf()) {
                    self.placed_back(id & ID_MASK, mr);
                }
            }
            self.lose(local_loss(format!("posting: {}", rdma_rpc_transport::Report(&e.error))));
        }
        drop(sent);
        Ok(())
    }
}
