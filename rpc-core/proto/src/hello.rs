//! The handshake's bytes: what each side tells the other when the connection is made.

use super::header::VERSION;

/// The handshake: what each side tells the other in the connection's private data
/// (`"RRPC" | version | ring: u32 | eager threshold: u32 | max payload: u64 | max concurrent
/// requests: u32 | flags: u32 | max request bytes: u64 | credits: u8 | log2 of the piece: u8`,
/// little endian; the last five came later, and a peer that leaves them out says 0 for each).
/// It stays within 40 bytes: rdma_cm carries 56 of private data with a connect request, and
/// a client in the server's process adds 16 of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Receive ring depth of the sender (2..=4096).
    pub ring: u32,
    /// Largest eager message of the sender.
    pub eager_threshold: u32,
    /// Largest payload the sender accepts.
    pub max_payload: u64,
    /// Requests of the connection the sender serves at once
    /// (rdma-rpc-core's `Config::max_concurrent_requests`); 0 when it did not say (no limit).
    pub max_requests: u32,
    /// What the sender's protocol takes beyond version 3's first form
    /// ([`Hello::TAKES_INTERLEAVED`], [`Hello::TAKES_BATCHES`]); 0 from a peer built before
    /// the field.
    pub flags: u32,
    /// Bytes of request bodies the sender serves at once
    /// (rdma-rpc-core's `Config::max_request_bytes_in_flight`); 0 when it did not say (no limit).
    pub max_request_bytes: u64,
    /// Credits the sender grants its peer to start with, within `2..=ring` (at most 255 on
    /// the wire); 0 when it did not say: the whole ring. A server whose receives come from one pool for all its
    /// connections grants few and more as its pool allows
    /// ([`Session::grant_credits`](super::Session::grant_credits)).
    pub credits: u32,
    /// Largest piece of a message body the sender's receive slots take
    /// ([`SessionConfig::fragment`](super::SessionConfig::fragment)): a power of two within
    /// [`Hello::PIECES`]; both sides send pieces of the smaller. 0 when it did not say:
    /// [`FRAGMENT`](super::FRAGMENT).
    pub piece: u32,
}

const MAGIC: &[u8; 4] = b"RRPC";

impl Hello {
    /// In [`Hello::flags`]: the sender takes whole requests and responses between the pieces
    /// of a longer message and wants them so
    /// ([`Session::interleave`](super::Session::interleave)); without it (an earlier
    /// peer, or rdma-rpc-core's `Config::interleave` off) its peer sends pieces back to back.
    pub const TAKES_INTERLEAVED: u32 = 1;

    /// [`Hello::flags`] bit: the sender takes several short messages in one Send
    /// ([`FLAG_MORE`](super::FLAG_MORE)), and its peer sends short messages queued at
    /// the same time so ([`Session::batch`](super::Session::batch)). Every build that
    /// knows the bit sets it.
    pub const TAKES_BATCHES: u32 = 2;

    /// [`Hello::flags`] bit: the sender lends no memory (its connections share one protection
    /// domain, where a lent buffer would be within reach of every other connection): its
    /// responses above the eager threshold come in pieces, up to the largest payload, or by
    /// Write into a landing buffer the caller offered. A peer that sees it accepts such pieces
    /// ([`Session::peer_lends_nothing`](super::Session::peer_lends_nothing)).
    pub const LENDS_NOTHING: u32 = 4;

    /// Bytes of an encoded hello ([`Hello::encode`]); a peer's private data may go on after
    /// them.
    pub const LEN: usize = 39;

    /// The pieces a hello can name: 1 KiB to 32 KiB.
    pub const PIECES: std::ops::RangeInclusive<u32> = 1024..=32 * 1024;

    /// The private-data bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.push(VERSION);
        v.extend_from_slice(&self.ring.to_le_bytes());
        v.extend_from_slice(&self.eager_threshold.to_le_bytes());
        v.extend_from_slice(&self.max_payload.to_le_bytes());
        v.extend_from_slice(&self.max_requests.to_le_bytes());
        v.extend_from_slice(&self.flags.to_le_bytes());
        v.extend_from_slice(&self.max_request_bytes.to_le_bytes());
        v.push(self.credits.min(255) as u8);
        v.push(if Self::PIECES.contains(&self.piece) {
            self.piece.ilog2() as u8
        } else {
            0
        });
        v
    }

    /// Parses a peer's private data: `None` for anything that is not a handshake of this
    /// version with a ring of 2..=4096. The fields after the largest payload may be missing,
    /// each as a whole (a peer built before them): 0 then, which says no limit, no flags and
    /// the whole ring. A piece that is not a power of two within [`Hello::PIECES`] is refused.
    /// Extra bytes after the 39 are ignored.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_proto::Hello;
    /// let hello = Hello {
    ///     ring: 64,
    ///     eager_threshold: 16 << 10,
    ///     max_payload: 256 << 20,
    ///     max_requests: 8,
    ///     flags: Hello::TAKES_INTERLEAVED | Hello::TAKES_BATCHES,
    ///     max_request_bytes: 1 << 30,
    ///     credits: 2,
    ///     piece: 4096,
    /// };
    /// let bytes = hello.encode();
    /// assert_eq!(Hello::decode(&bytes), Some(hello));
    /// assert_eq!(bytes.len(), Hello::LEN);
    /// // A peer of an earlier build: a request limit, then nothing.
    /// let old = Hello::decode(&bytes[..25]).expect("an earlier hello");
    /// assert_eq!((old.max_requests, old.flags, old.max_request_bytes), (8, 0, 0));
    /// assert_eq!(Hello::decode(&bytes[..21]).map(|h| h.max_requests), Some(0));
    /// assert_eq!(Hello::decode(&bytes[..20]), None);
    /// // A piece outside 1 KiB..=32 KiB, or a shift past 31, is refused.
    /// for log2 in [9, 16, 42] {
    ///     let mut odd = bytes.clone();
    ///     odd[38] = log2;
    ///     assert_eq!(Hello::decode(&odd), None);
    /// }
    /// ```
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < 21 || &b[..4] != MAGIC || b[4] != VERSION {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut mp = [0u8; 8];
        mp.copy_from_slice(&b[13..21]);
        let h = Self {
            ring: u32_at(5),
            eager_threshold: u32_at(9),
            max_payload: u64::from_le_bytes(mp),
            max_requests: if b.len() >= 25 { u32_at(21) } else { 0 },
            flags: if b.len() >= 29 { u32_at(25) } else { 0 },
            max_request_bytes: b
                .get(29..37)
                .and_then(|w| <[u8; 8]>::try_from(w).ok())
                .map_or(0, u64::from_le_bytes),
            credits: b.get(37).map_or(0, |&c| u32::from(c)),
            piece: match b.get(38) {
                None | Some(0) => 0,
                // A shift past 31 is no piece at all: refused below, as one out of range is.
                Some(&n) => 1u32.checked_shl(u32::from(n)).unwrap_or(u32::MAX),
            },
        };
        let piece_ok = h.piece == 0 || Self::PIECES.contains(&h.piece);
        (h.ring >= 2 && h.ring <= 4096 && piece_ok).then_some(h)
    }
}
