//! A connection's receive slots: those a message stays in for the application, and posting consumed
//! ones again.

use super::*;

impl Conn {
    /// The message bytes `range` of receive slot `slot`, which the session kept in place
    /// ([`RequestBody::InSlot`](crate::proto::RequestBody::InSlot),
    /// [`Reply::InSlot`](crate::proto::Reply::InSlot)), for the application: the slot is posted
    /// again once the buffer is dropped. `None` when the slot is not held (a bug).
    pub(crate) fn slot_body(&mut self, slot: u64, range: std::ops::Range<usize>) -> Option<RegisteredBuf> {
        // Rarely more than one: a slot is handed out right after its message is decoded.
        let i = self.held.iter().position(|(id, _)| *id == slot)?;
        let (_, mr) = self.held.swap_remove(i);
        match RegisteredBuf::in_slot(mr, range, slot, &self.slots_back) {
            Ok(b) => {
                self.out += 1;
                Some(b)
            }
            Err(mr) => {
                self.unposted.push(RecvWr::new(slot, mr));
                None
            }
        }
    }

    /// Takes back the receive slots the application let go of (one atomic load when none),
    /// to be posted again.
    pub(super) fn collect_slots(&mut self) {
        self.slots_back.take(&mut self.back);
        if self.back.is_empty() {
            return; // nearly always: called on every flush
        }
        for (wr_id, mr) in self.back.drain(..) {
            self.out = self.out.saturating_sub(1);
            self.unposted.push(RecvWr::new(wr_id, mr));
        }
    }

    /// Reposts consumed receive slots (with those the application gave back) and tells the
    /// session; true when there were any.
    pub(super) fn repost(&mut self) -> bool {
        self.collect_slots();
        if self.unposted.is_empty() {
            return false;
        }
        let mut wrs = std::mem::take(&mut self.unposted);
        for wr in wrs.drain(..) {
            if self.lost.is_some() {
                break;
            }
            let posted = match &self.lease {
                Some(lease) => lease.pool.repost(wr).map(|()| {
                    // The pool runs short: a slot above this peer's floor goes back to it.
                    if lease.pool.short() && self.session.withhold_credit() {
                        lease.pool.give_spare(1);
                    } else {
                        self.session.reposted();
                    }
                }),
                None => self
                    .qp
                    .post_recv(wr)
                    .map(|()| self.session.reposted())
                    .map_err(|e| e.error),
            };
            match posted {
                Ok(()) => {}
                Err(e) => self.lose(local_loss(format!(
                    "reposting a receive: {}",
                    rdma_rpc_transport::Report(&e)
                ))),
            }
        }
        wrs.clear();
        self.unposted = wrs;
        true
    }
}
