//! The fixed little-endian message header, and rendezvous descriptors.

use crate::RemoteRegion;

use super::ProtoError;

/// Protocol version carried in every header.
pub const VERSION: u8 = 5;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 24;
/// Bytes of an encoded [`RemoteRegion`] (addr, len, rkey).
pub const DESC_LEN: usize = 20;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A call.
    Request = 1,
    /// The answer to a call.
    Response = 2,
    /// The caller gave up on a call.
    Cancel = 3,
    /// The caller finished reading a lent response buffer.
    ReadDone = 4,
    /// Nothing but returned credits.
    Credit = 5,
    /// The server is shutting down: start no new calls on this connection. Requests sent
    /// before it arrived are still served.
    GoAway = 6,
    /// The server's last message: it answered every request it will ever serve and runs none
    /// that arrives after this one. The caller's calls still pending were not run.
    Close = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Cancel,
            4 => Kind::ReadDone,
            5 => Kind::Credit,
            6 => Kind::GoAway,
            7 => Kind::Close,
            k => return Err(ProtoError::BadKind(k)),
        })
    }
}

/// Header flag: the body starts with a descriptor of a lent buffer (rendezvous), not the payload.
/// In a request, bytes after the descriptor(s) are the payload's tail: the payload is the lent
/// bytes followed by them ([`Payload::LentWith`](crate::Payload::LentWith)).
pub const FLAG_RENDEZVOUS: u16 = 1;
/// Header flag (requests): a landing-buffer descriptor follows, for a large response.
pub const FLAG_LANDING: u16 = 2;
/// Header flag: one piece of an eager message longer than one receive slot. The body starts
/// with [`FRAG_PREFIX`] bytes (the whole body's length, then this piece's offset in it, both
/// little-endian u32); the pieces of a message travel back to back, in order, each in its own
/// Send (and slot, and credit), and the receiver joins them before reading the message.
pub const FLAG_FRAGMENT: u16 = 4;
/// Bytes in front of a fragment's piece of the body.
pub const FRAG_PREFIX: usize = 8;

/// The fixed header of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// FLAG_* bits.
    pub flags: u16,
    /// The call this message belongs to (0 for Credit).
    pub call_id: u32,
    /// Method id (requests).
    pub method: u32,
    /// Status (responses): see [`Status`](crate::Status).
    pub status: u16,
    /// Receive slots the sender reposted since its last message: credits returned.
    pub credits: u16,
    /// Bytes following the header.
    pub body_len: u32,
    /// Deadline as a relative budget in microseconds (requests; 0 = none). Never a clock.
    pub budget_us: u32,
}

impl Header {
    /// The header of a message that only returns `credits`.
    pub fn credit(credits: u16) -> Header {
        Header {
            kind: Kind::Credit,
            flags: 0,
            call_id: 0,
            method: 0,
            status: 0,
            credits,
            body_len: 0,
            budget_us: 0,
        }
    }

    /// The header of a message of `kind` that belongs to no call (Credit, GoAway, Close),
    /// its credits to be filled in when it is sent.
    pub fn control(kind: Kind) -> Header {
        Header {
            kind,
            ..Header::credit(0)
        }
    }

    /// Encodes into the first [`HEADER_LEN`] bytes of `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bytes());
    }

    /// The encoded header.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = VERSION;
        h[1] = self.kind as u8;
        h[2..4].copy_from_slice(&self.flags.to_le_bytes());
        h[4..8].copy_from_slice(&self.call_id.to_le_bytes());
        h[8..12].copy_from_slice(&self.method.to_le_bytes());
        h[12..14].copy_from_slice(&self.status.to_le_bytes());
        h[14..16].copy_from_slice(&self.credits.to_le_bytes());
        h[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        h[20..24].copy_from_slice(&self.budget_us.to_le_bytes());
        h
    }

    /// Whether `msg` is a request with a time budget, read from the two header fields alone
    /// (the rest is decoded where the message is handled); `None` when it is too short for a
    /// header or of another version.
    pub(crate) fn is_budgeted_request(msg: &[u8]) -> Option<bool> {
        let h = msg.first_chunk::<HEADER_LEN>().filter(|h| h[0] == VERSION)?;
        Some(h[1] == Kind::Request as u8 && h[20..24] != [0; 4])
    }

    /// Decodes a whole message: the header, and the body it announces.
    ///
    /// # Errors
    /// [`ProtoError`] for a short message, wrong version, unknown kind, or a body length that
    /// does not match. Never panics, whatever the bytes.
    pub fn decode(msg: &[u8]) -> Result<(Header, &[u8]), ProtoError> {
        let (h, body) = msg.split_first_chunk::<HEADER_LEN>().ok_or(ProtoError::Truncated)?;
        Self::from_parts(h, body)
    }

    /// As [`Header::decode`], the header read from `head`, a copy of the message's first
    /// bytes that came with its completion (a transport `Head`), when it holds a whole header;
    /// from `msg` itself otherwise. The body is `msg`'s.
    ///
    /// # Errors
    /// As [`Header::decode`].
    pub fn decode_with_head<'m>(head: &[u8], msg: &'m [u8]) -> Result<(Header, &'m [u8]), ProtoError> {
        match head.first_chunk::<HEADER_LEN>() {
            Some(h) => Self::from_parts(h, msg.get(HEADER_LEN..).ok_or(ProtoError::Truncated)?),
            None => Self::decode(msg),
        }
    }

    fn from_parts<'m>(h: &[u8; HEADER_LEN], body: &'m [u8]) -> Result<(Header, &'m [u8]), ProtoError> {
        if h[0] != VERSION {
            return Err(ProtoError::BadVersion(h[0]));
        }
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let header = Header {
            kind: Kind::from_u8(h[1])?,
            flags: u16_at(2),
            call_id: u32_at(4),
            method: u32_at(8),
            status: u16_at(12),
            credits: u16_at(14),
            body_len: u32_at(16),
            budget_us: u32_at(20),
        };
        if header.body_len as usize != body.len() {
            return Err(ProtoError::BodyLength {
                announced: header.body_len,
                actual: body.len(),
            });
        }
        Ok((header, body))
    }
}

/// Appends a descriptor.
pub fn encode_desc(d: &RemoteRegion, out: &mut Vec<u8>) {
    out.extend_from_slice(&d.addr.to_le_bytes());
    out.extend_from_slice(&d.len.to_le_bytes());
    out.extend_from_slice(&d.rkey.to_le_bytes());
}

/// Splits a descriptor off the front of `body`.
///
/// # Errors
/// [`ProtoError::Truncated`] when fewer than [`DESC_LEN`] bytes are left.
pub fn decode_desc(body: &[u8]) -> Result<(RemoteRegion, &[u8]), ProtoError> {
    let (d, rest) = body.split_first_chunk::<DESC_LEN>().ok_or(ProtoError::Truncated)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(&d[..8]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&d[8..16]);
    let mut k = [0u8; 4];
    k.copy_from_slice(&d[16..20]);
    Ok((
        RemoteRegion {
            addr: u64::from_le_bytes(a),
            len: u64::from_le_bytes(l),
            rkey: u32::from_le_bytes(k),
        },
        rest,
    ))
}
