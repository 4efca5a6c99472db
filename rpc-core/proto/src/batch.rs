//! Batches: several short messages in one Send, one receive slot and one credit for all.
//!
//! A message whose header carries [`FLAG_MORE`] is followed, in the same Send, by another
//! message (its header and body), right after its body; the last one has the flag clear. Each
//! is handled as if it had come alone, in order; only the first may return credits. A side
//! sends batches only to a peer whose [`Hello`](super::Hello) says it takes them
//! ([`Hello::TAKES_BATCHES`](super::Hello::TAKES_BATCHES)), and only of messages
//! queued at the same time: a batch never waits for a message to come. With many calls in
//! flight, the Sends, receive completions and credits per call fall with the batch's size:
//! what a NIC spends per message (and on `shm` the cache lines each Send moves between cores)
//! is paid once per batch.
//!
//! Only short messages are batched ([`PART_MAX`]): a batch is always copied out of its slot,
//! which for a message this short costs less than keeping the slot, and so a message that a
//! caller or handler would take in place ([`Reply::InSlot`](super::Reply::InSlot)) still
//! comes in a slot of its own. Pieces of a longer message are never batched.

use super::header::{FLAG_FRAGMENT, HEADER_LEN, VERSION};
use super::ProtoError;

/// Header flag: another message follows this one in the same Send.
pub const FLAG_MORE: u16 = 8;

/// The longest message (header included) that goes into a batch: as long as the shortest
/// message the driver keeps in its receive slot for the application (`IN_SLOT_MIN`); shorter
/// ones it copies out anyway.
pub const PART_MAX: usize = 512;

/// Most messages in one batch: the first one's receiver sees the others within the same
/// completion, so a batch stays short enough not to hold up the first.
pub const PARTS_MAX: usize = 64;

/// Whether the message whose first bytes are `head` says another follows it (a header of
/// another version says nothing: it is refused as it is).
pub(crate) fn has_more(head: &[u8]) -> bool {
    head.first() == Some(&VERSION)
        && head
            .get(2..4)
            .is_some_and(|f| u16::from_le_bytes([f[0], f[1]]) & FLAG_MORE != 0)
}

/// Marks the encoded header `head` as followed by another message.
pub(crate) fn mark_more(head: &mut [u8; HEADER_LEN]) {
    let f = u16::from_le_bytes([head[2], head[3]]) | FLAG_MORE;
    head[2..4].copy_from_slice(&f.to_le_bytes());
}

/// The parts of a batch: the bytes of each message (header and body), in order, and whether
/// it is the first. `head` is a copy of the first message's first bytes that came with the
/// completion (or empty).
pub(crate) struct Parts<'m> {
    rest: &'m [u8],
    head: &'m [u8],
    done: bool,
    n: usize,
}

impl<'m> Parts<'m> {
    pub(crate) fn new(head: &'m [u8], msg: &'m [u8]) -> Self {
        Parts {
            rest: msg,
            head,
            done: false,
            n: 0,
        }
    }
}

/// One part: the copied head (empty but for the first part), and the message's bytes.
pub(crate) type Part<'m> = (&'m [u8], &'m [u8]);

impl<'m> Iterator for Parts<'m> {
    type Item = Result<Part<'m>, ProtoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let head = std::mem::take(&mut self.head);
        let first = if head.len() >= HEADER_LEN { head } else { self.rest };
        let Some(h) = first.first_chunk::<HEADER_LEN>() else {
            self.done = true;
            return Some(Err(ProtoError::Truncated));
        };
        let flags = u16::from_le_bytes([h[2], h[3]]);
        let body_len = u32::from_le_bytes([h[16], h[17], h[18], h[19]]) as usize;
        let end = HEADER_LEN.saturating_add(body_len);
        let more = flags & FLAG_MORE != 0;
        self.n += 1;
        let bad = if end > self.rest.len() {
            Some("a message longer than the rest of its batch")
        } else if flags & FLAG_FRAGMENT != 0 {
            Some("a piece of a longer message in a batch")
        } else if more && self.n >= PARTS_MAX {
            Some("more messages than a batch holds")
        } else if !more && end != self.rest.len() {
            Some("bytes after the last message of a batch")
        } else {
            None
        };
        if let Some(why) = bad {
            self.done = true;
            return Some(Err(ProtoError::BadBatch(why)));
        }
        let (part, rest) = self.rest.split_at(end);
        self.rest = rest;
        self.done = !more;
        Some(Ok((head, part)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Header, Kind};

    fn msg(kind: Kind, body: &[u8], more: bool) -> Vec<u8> {
        let mut h = Header::control(kind);
        h.body_len = body.len() as u32;
        let mut head = h.to_bytes();
        if more {
            mark_more(&mut head);
        }
        let mut v = head.to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_batch_splits_into_its_messages_in_order() {
        let mut b = msg(Kind::Credit, b"", true);
        b.extend(msg(Kind::Cancel, b"ab", true));
        b.extend(msg(Kind::Credit, b"xyz", false));
        assert!(has_more(&b));
        let parts: Vec<Vec<u8>> = Parts::new(&[], &b)
            .map(|p| p.map(|(_, m)| m.to_vec()))
            .collect::<Result<_, _>>()
            .expect("a good batch");
        assert_eq!(parts.len(), 3);
        assert_eq!(&parts[1][HEADER_LEN..], b"ab");
        assert_eq!(&parts[2][HEADER_LEN..], b"xyz");
        assert!(!has_more(&parts[2]));
    }

    #[test]
    fn hostile_batches_are_errors_not_panics() {
        // Truncated: a flag says more, nothing follows.
        let b = msg(Kind::Credit, b"", true);
        let r: Vec<_> = Parts::new(&[], &b).collect();
        assert!(matches!(r.last(), Some(Err(ProtoError::Truncated))), "{r:?}");
        // A body length past the end.
        let mut b = msg(Kind::Credit, b"abc", true);
        b.truncate(HEADER_LEN + 1);
        assert!(Parts::new(&[], &b).any(|p| p.is_err()));
        // A body length of u32::MAX does not overflow.
        let mut h = Header::control(Kind::Credit);
        h.body_len = u32::MAX;
        let mut head = h.to_bytes();
        mark_more(&mut head);
        assert!(Parts::new(&[], &head).any(|p| p.is_err()));
        // Trailing bytes after the last part.
        let mut b = msg(Kind::Credit, b"", false);
        b.push(0);
        assert!(Parts::new(&[], &b).any(|p| p.is_err()));
        // A fragment inside.
        let mut h = Header::control(Kind::Credit);
        h.flags = FLAG_FRAGMENT | FLAG_MORE;
        let mut b = h.to_bytes().to_vec();
        b.extend(msg(Kind::Credit, b"", false));
        assert!(Parts::new(&[], &b).any(|p| p.is_err()));
        // Too many parts.
        let mut b = Vec::new();
        for _ in 0..PARTS_MAX {
            b.extend(msg(Kind::Credit, b"", true));
        }
        b.extend(msg(Kind::Credit, b"", false));
        assert!(Parts::new(&[], &b).any(|p| p.is_err()));
        // Random bytes end, whatever they are.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let n = (x % 200) as usize;
            let bytes: Vec<u8> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            assert!(Parts::new(&[], &bytes).take(PARTS_MAX + 2).count() <= PARTS_MAX);
        }
    }
}
