//! Keepalive: a connection that has seen no completion for a while proves its peer with a
//! zero-length RDMA Write. A Write of no bytes touches no memory, so the peer checks no key
//! (IBA C9-88), costs its CPU nothing and needs no receive; its acknowledgement comes from the
//! peer's NIC. A peer whose host is gone never acknowledges it, so the QP's retries run out
//! and the probe fails with `RETRY_EXC_ERR`, which ends the connection: without a probe, a
//! connection whose last request the peer had acknowledged waited for ever.

use std::time::{Duration, Instant};

use rdma_rpc_transport::{RemoteAddr, SendOp, SendWr};

use super::{local_loss, Conn, PROBE};

/// Idle rounds of a spinning connection between two looks at the clock for its keepalive.
const SPIN_ROUNDS_PER_LOOK: u32 = 4096;

/// A connection's keepalive state.
#[derive(Debug)]
pub(crate) struct Keepalive {
    every: Duration,
    /// When the next look is due.
    next: Instant,
    /// The connection's completions counted at the last look.
    seen: u64,
    /// A probe is posted and not completed.
    probing: bool,
    /// Idle spinning rounds since the last look.
    rounds: u32,
}

impl Keepalive {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            next: Instant::now() + every,
            seen: 0,
            probing: false,
            rounds: 0,
        }
    }
}

impl Conn {
    /// When the keepalive wants to look next: a sleeping connection wakes by then.
    pub(crate) fn keepalive_due(&self) -> Option<Instant> {
        self.keepalive.as_ref().map(|k| k.next)
    }

    /// One idle round of a spinning connection: every [`SPIN_ROUNDS_PER_LOOK`] rounds, a look
    /// ([`Conn::keepalive_look`]); a connection that spins for ever (`CompletionMode::Spin`)
    /// never sleeps to wake at [`Conn::keepalive_due`].
    pub(crate) fn keepalive_spun(&mut self) {
        let Some(k) = &mut self.keepalive else { return };
        k.rounds += 1;
        if k.rounds >= SPIN_ROUNDS_PER_LOOK {
            k.rounds = 0;
            self.keepalive_look(Instant::now());
        }
    }

    /// At or after the keepalive's time: a connection that saw no completion since the last
    /// look, and has no probe out, posts one. Its completion is a completion like any other
    /// (the next look sees the peer answered); its failure ends the connection.
    pub(crate) fn keepalive_look(&mut self, now: Instant) {
        let completions = self.completions;
        let room = self.rdma_posted < self.rdma_room;
        let Some(k) = &mut self.keepalive else { return };
        if now < k.next || self.lost.is_some() {
            return;
        }
        k.next = now + k.every;
        let quiet = completions == k.seen;
        k.seen = completions;
        // Without room in the send queue the connection has work in flight, whose completions
        // will tell.
        if !quiet || k.probing || !room {
            return;
        }
        let probe = SendWr::new(
            PROBE,
            SendOp::Write {
                remote: RemoteAddr { addr: 0, rkey: 0 },
                imm: None,
            },
        );
        k.probing = true;
        match self.qp.post_send(probe) {
            Ok(()) => {
                self.rdma_posted += 1;
                tracing::trace!("keepalive: probing a quiet peer");
            }
            Err(e) => self.lose(local_loss(format!(
                "posting a keepalive probe: {}",
                rdma_rpc_transport::Report(&e.error)
            ))),
        }
    }

    /// Whether a probe is out: its completion (a failure above all) is worth waiting for.
    pub(crate) fn probing(&self) -> bool {
        self.keepalive.as_ref().is_some_and(|k| k.probing)
    }

    /// The probe completed (either way: a failure ends the connection as any failed work
    /// request does).
    pub(crate) fn keepalive_answered(&mut self) {
        if let Some(k) = &mut self.keepalive {
            k.probing = false;
        }
    }
}
