//! The connection handshake both sides share: what a connection's queue pair and receive ring
//! need, what two hellos agree, and the session they make.

use rdma_rpc_transport::{Device, QpCaps};

use crate::config::Config;
use crate::proto::Hello;
use crate::proto::{Session, SessionConfig, FRAGMENT};

pub(crate) fn slot_size(c: &Config) -> usize {
    SessionConfig {
        ring: c.ring,
        eager_max: c.eager(),
        fragment: c.piece,
        max_payload: c.max_payload,
    }
    .slot_size()
}

/// Entries of a connection's CQ (or its share of a shared one): its receives and its sends
/// (`qp_caps`), with room to spare.
pub(crate) fn cq_depth(c: &Config) -> u32 {
    c.ring * 4 + 64
}

pub(crate) fn qp_caps(device: &Device, c: &Config) -> QpCaps {
    QpCaps {
        max_send_wr: (c.ring * 2 + 64).min(device.caps().max_qp_wr),
        max_recv_wr: c.ring.min(device.caps().max_qp_wr),
        max_inline_data: device.caps().max_inline_data.min(256),
    }
}

/// Both sides use the smaller threshold, limit and ring. The smaller ring, not the peer's:
/// a side returns credits in a Credit message once half its ring is owed, so with rings of
/// different depths a side whose window is the other's (shallower) ring would wait for a
/// Credit message the other owes only at half of the deeper one (a 2-slot client of a 64-slot
/// server stalled on its second call). A deeper side just keeps some slots posted unused.
/// The eager threshold is at most the largest payload: a message joined from pieces is never
/// longer than what either side accepts.
pub(crate) fn agree(mine: &Hello, theirs: &Hello) -> SessionConfig {
    let max_payload = mine.max_payload.min(theirs.max_payload);
    let eager = u64::from(mine.eager_threshold.min(theirs.eager_threshold)).min(max_payload);
    // A piece of 0 is a peer that did not say: the one every build used before.
    let piece = |h: &Hello| if h.piece == 0 { FRAGMENT } else { h.piece as usize };
    SessionConfig {
        ring: mine.ring.min(theirs.ring),
        eager_max: usize::try_from(eager).unwrap_or(usize::MAX),
        fragment: piece(mine).min(piece(theirs)).max(1024),
        max_payload,
    }
}

/// The session of a connection whose hellos were `mine` and `theirs`, with what both sides set
/// alike: interleaving, and batches towards a peer that takes them. Each side adds its own
/// limits (a caller the server's, a server its configuration's).
pub(crate) fn session(config: &Config, mine: &Hello, theirs: &Hello) -> Session {
    let mut session = Session::new(agree(mine, theirs));
    session.interleave(config.interleave && theirs.flags & Hello::TAKES_INTERLEAVED != 0);
    session.batch(theirs.flags & Hello::TAKES_BATCHES != 0);
    // 0 is the whole ring; `start_grants` keeps each within 2..=ring.
    let grant = |h: &Hello| if h.credits == 0 { h.ring } else { h.credits };
    session.start_grants(grant(mine), grant(theirs));
    session.lend_nothing(mine.flags & Hello::LENDS_NOTHING != 0);
    session.peer_lends_nothing(theirs.flags & Hello::LENDS_NOTHING != 0);
    session
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agreed_threshold_is_within_the_largest_payload() {
        let big = Hello::from(&Config::default().eager_threshold(128 << 20));
        let small = Hello::from(&Config::default().max_payload(4096));
        for (a, b) in [(&big, &small), (&small, &big)] {
            let s = agree(a, b);
            assert_eq!((s.eager_max, s.max_payload), (4096, 4096));
        }
        assert_eq!(agree(&big, &big).eager_max, 128 << 20);
    }
}
