//! A shared receive queue of the software NIC: receives that any attached QP's responder takes,
//! oldest first, as a NIC's SRQ hands them out.
//!
//! A QP attached to one keeps no receives of its own: a Send (or Write with immediate) takes
//! the oldest receive here when it executes, and its completion names that QP. A responder that
//! finds the queue empty holds the request (RNR) and waits here as a waiter; a post wakes every
//! waiter, outside the queue's lock (lock order: an engine's state, then the queue's). A QP
//! that goes to error flushes its own work, never these receives. The limit event fires once
//! when a take leaves fewer receives than the armed limit, then disarms, as
//! `IBV_EVENT_SRQ_LIMIT_REACHED` does.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::{Engine, PostedRecv, View};
use crate::qp::RecvDesc;
use crate::srq::LimitEvent;
use crate::Error;

struct State {
    recvs: VecDeque<PostedRecv>,
    /// The armed limit (0: not armed).
    limit: u32,
    /// Responders holding a request for want of a receive.
    waiters: Vec<Weak<Engine>>,
}

pub(crate) struct Srq {
    max_wr: u32,
    state: Mutex<State>,
    event: Arc<LimitEvent>,
}

impl Srq {
    pub(crate) fn new(max_wr: u32, event: Arc<LimitEvent>) -> Self {
        Self {
            max_wr,
            state: Mutex::new(State {
                recvs: VecDeque::new(),
                limit: 0,
                waiters: Vec::new(),
            }),
            event,
        }
    }

    /// Posts receives (all or, past the queue's depth, those that fit); the count posted.
    pub(crate) fn post(&self, descs: &[RecvDesc<'_>]) -> Result<(), (usize, Error)> {
        let waiters = {
            let mut st = self.state.lock();
            for (i, d) in descs.iter().enumerate() {
                if st.recvs.len() >= self.max_wr as usize {
                    let full = Error::QueueFull {
                        queue: "shared receive",
                        depth: self.max_wr,
                    };
                    drop(st);
                    return Err((i, full));
                }
                st.recvs.push_back(PostedRecv {
                    seq: d.seq,
                    local: d.local.as_ref().map(|l| View {
                        region: l.region.clone(),
                        off: l.off,
                        len: l.len,
                    }),
                });
            }
            std::mem::take(&mut st.waiters)
        };
        for e in waiters.iter().filter_map(Weak::upgrade) {
            e.srq_posted();
        }
        Ok(())
    }

    /// Arms the limit event: it fires when a take leaves fewer than `limit` receives posted
    /// (checked at each take, as rxe checks it when a receive is consumed).
    pub(crate) fn arm(&self, limit: u32) {
        self.state.lock().limit = limit;
    }

    /// The oldest receive, for `engine`'s responder; none, and `engine` waits for a post.
    pub(super) fn take(&self, engine: &Arc<Engine>) -> Option<PostedRecv> {
        let mut st = self.state.lock();
        let Some(r) = st.recvs.pop_front() else {
            if !st.waiters.iter().any(|w| w.as_ptr() == Arc::as_ptr(engine)) {
                st.waiters.retain(|w| w.strong_count() > 0);
                st.waiters.push(Arc::downgrade(engine));
            }
            return None;
        };
        let fire = st.limit > 0 && (st.recvs.len() as u64) < u64::from(st.limit);
        if fire {
            st.limit = 0;
        }
        drop(st);
        if fire {
            self.event.fire();
        }
        Some(r)
    }

    /// `f` of the receive the next take gets.
    pub(super) fn front_is(&self, f: impl FnOnce(Option<&PostedRecv>) -> bool) -> bool {
        f(self.state.lock().recvs.front())
    }

    /// Whether a receive is there; when none is, `engine` waits for the next post.
    pub(super) fn has_recv_or_wait(&self, engine: &Arc<Engine>) -> bool {
        let mut st = self.state.lock();
        if !st.recvs.is_empty() {
            return true;
        }
        if !st.waiters.iter().any(|w| w.as_ptr() == Arc::as_ptr(engine)) {
            st.waiters.retain(|w| w.strong_count() > 0);
            st.waiters.push(Arc::downgrade(engine));
        }
        false
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // The receives' views go before the buffers they name (held by the common layer).
        self.state.get_mut().recvs.clear();
    }
}
