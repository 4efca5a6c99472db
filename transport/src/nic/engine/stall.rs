//! The requests held behind a Send that found no receive (RNR), and the cap on what they may
//! take in memory.
//!
//! A NIC holds nothing while a Send waits for a receive: it answers RNR, and the initiator sends
//! again after its timer, with everything behind it. The engine reads its link in order, so it
//! keeps what arrives behind the stalled Send until a receive is posted or the RNR budget runs
//! out. Without a cap that was as much as the link delivered in those 70 ms (40 MiB in a test
//! of 1 MiB Sends): past [`STALL_CAP`] the engine stops reading the link (the peer's socket
//! fills, and its sends wait there) until the stall ends one way or the other, so that a QP's
//! memory is bounded by a count, not by the link's speed. What that costs: this side's own
//! requests' answers behind them wait too, at most until the budget runs out.

use std::collections::VecDeque;

use crate::nic::wire::Frame;

/// Bytes of held frames past which the engine stops reading its link.
pub(super) const STALL_CAP: usize = 4 << 20;

/// What a held frame counts for: its payload, and a little for the rest.
fn cost(frame: &Frame) -> usize {
    64 + match frame {
        Frame::Data { data, .. } => data.len(),
        _ => 0,
    }
}

/// The held frames, in order; the head one is the RNR-stalled request.
#[derive(Default)]
pub(super) struct Stalled {
    frames: VecDeque<Frame>,
    bytes: usize,
}

impl Stalled {
    pub(super) fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// At or past the cap: read no more until the stall ends.
    pub(super) fn full(&self) -> bool {
        self.bytes >= STALL_CAP
    }

    pub(super) fn push_front(&mut self, frame: Frame) {
        self.bytes += cost(&frame);
        self.frames.push_front(frame);
    }

    pub(super) fn push_back(&mut self, frame: Frame) {
        self.bytes += cost(&frame);
        self.frames.push_back(frame);
    }

    pub(super) fn pop_front(&mut self) -> Option<Frame> {
        let frame = self.frames.pop_front()?;
        self.bytes -= cost(&frame);
        Some(frame)
    }

    pub(super) fn clear(&mut self) {
        self.frames.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::wire::DataHead;

    fn send(len: usize) -> Frame {
        Frame::Data {
            head: DataHead::Send {
                ssn: 1,
                imm: None,
                ack: false,
            },
            data: vec![0; len],
        }
    }

    #[test]
    fn the_count_follows_the_frames_and_the_cap_holds_at_its_size() {
        // Each frame counts its payload and 64 bytes more.
        let mut s = Stalled::default();
        s.push_back(send(STALL_CAP - 300));
        s.push_front(send(100));
        assert!(!s.full(), "two frames 72 bytes under the cap");
        s.push_back(Frame::Fatal);
        assert!(!s.full(), "8 bytes under it");
        s.push_back(Frame::Fatal);
        assert!(s.full(), "56 bytes over it");
        assert!(matches!(s.pop_front(), Some(Frame::Data { data, .. }) if data.len() == 100));
        assert!(!s.full());
        s.clear();
        assert!(s.is_empty() && !s.full());
        s.push_back(send(STALL_CAP));
        assert!(s.full(), "one frame alone can reach it");
        assert!(s.pop_front().is_some() && s.pop_front().is_none() && !s.full());
    }
}
