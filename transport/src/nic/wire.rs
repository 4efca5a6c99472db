//! The tcp provider's frames: a 4-byte little-endian length, then a kind byte and fields.
//! Decoded once, at the edge, into [`Frame`]; malformed input is an error, never a panic.

use crate::WcStatus;

/// Longest frame body accepted: the largest message plus headers. A peer cannot make us
/// allocate more than this from a length field.
pub(crate) const MAX_BODY: usize = super::MAX_MSG as usize + 64;

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// A Send, a Write or a read response (or a part of one): its fields, then its payload.
    Data {
        head: DataHead,
        data: Vec<u8>,
    },
    ReadReq {
        ssn: u64,
        addr: u64,
        rkey: u32,
        len: u32,
    },
    Atomic {
        ssn: u64,
        addr: u64,
        rkey: u32,
        op: AtomicOp,
    },
    Ack {
        ssn: u64,
    },
    Nak {
        ssn: u64,
        status: WcStatus,
    },
    AtomicResp {
        ssn: u64,
        old: u64,
    },
    /// The sender's QP entered the error state.
    Fatal,
    /// The sender's process is alive (sent when its link is otherwise idle): a peer that
    /// hears nothing for [`KEEPALIVE`](super::link::KEEPALIVE) takes it for stopped or hung.
    Beat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    CompareSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

const SEND: u8 = 1;
const WRITE: u8 = 2;
const READ_REQ: u8 = 3;
const ATOMIC: u8 = 4;
const ACK: u8 = 10;
const NAK: u8 = 11;
const READ_RESP: u8 = 12;
const ATOMIC_RESP: u8 = 13;
/// A part of a read response, more to follow; the last part is a `READ_RESP`. Parts arrive in
/// order and each lands where the one before ended (as IB's read response first, middle and
/// last packets): the responder reads memory a part at a time, and its own requests may go
/// between two parts.
const READ_PART: u8 = 14;
const FATAL: u8 = 20;
const BEAT: u8 = 21;

/// Send and Write flag: the initiator asks for an acknowledgement (as IB's AckReq bit). Acks
/// are cumulative, and any later response acknowledges too, so only requests whose completion
/// someone waits for ask.
const ACK_REQ: u8 = 2;

/// Encodes a frame whose payload, if any, is appended by `data` (copied straight from the
/// registered buffer, once).
pub(crate) struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    fn new(kind: u8, cap: usize) -> Self {
        let mut buf = Vec::with_capacity(cap + 32);
        buf.extend_from_slice(&[0; 4]);
        buf.push(kind);
        Self { buf }
    }
    fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Flags (bit 0: an immediate follows, bit 1: acknowledge this), then the immediate.
    fn imm(self, imm: Option<u32>, ack: bool) -> Self {
        let a = if ack { ACK_REQ } else { 0 };
        match imm {
            Some(v) => self.u8(1 | a).u32(v),
            None => self.u8(a).u32(0),
        }
    }
    #[cfg(test)]
    pub(crate) fn data(mut self, d: &[u8]) -> Self {
        self.buf.extend_from_slice(d);
        self
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.head(0)
    }
    /// The frame up to its payload of `data_len` bytes, which the caller sends right after.
    pub(crate) fn head(mut self, data_len: usize) -> Vec<u8> {
        let body = (self.buf.len() - 4 + data_len) as u32;
        self.buf[..4].copy_from_slice(&body.to_le_bytes());
        self.buf
    }

    pub(crate) fn send(ssn: u64, imm: Option<u32>, ack: bool) -> Self {
        Self::new(SEND, 0).u64(ssn).imm(imm, ack)
    }
    pub(crate) fn write(ssn: u64, addr: u64, rkey: u32, imm: Option<u32>, ack: bool) -> Self {
        Self::new(WRITE, 0).u64(ssn).u64(addr).u32(rkey).imm(imm, ack)
    }
    pub(crate) fn read_req(ssn: u64, addr: u64, rkey: u32, len: u32) -> Self {
        Self::new(READ_REQ, 0).u64(ssn).u64(addr).u32(rkey).u32(len)
    }
    pub(crate) fn atomic(ssn: u64, addr: u64, rkey: u32, op: AtomicOp) -> Self {
        let e = Self::new(ATOMIC, 0).u64(ssn).u64(addr).u32(rkey);
        match op {
            AtomicOp::CompareSwap { compare, swap } => e.u8(0).u64(compare).u64(swap),
            AtomicOp::FetchAdd { add } => e.u8(1).u64(add).u64(0),
        }
    }
    pub(crate) fn ack(ssn: u64) -> Self {
        Self::new(ACK, 0).u64(ssn)
    }
    pub(crate) fn nak(ssn: u64, status: WcStatus) -> Self {
        Self::new(NAK, 0).u64(ssn).u8(status as u8)
    }
    pub(crate) fn read_resp(ssn: u64) -> Self {
        Self::new(READ_RESP, 0).u64(ssn)
    }
    /// A read response's part with more to follow (the last one is [`read_resp`](Self::read_resp)).
    pub(crate) fn read_part(ssn: u64) -> Self {
        Self::new(READ_PART, 0).u64(ssn)
    }
    pub(crate) fn atomic_resp(ssn: u64, old: u64) -> Self {
        Self::new(ATOMIC_RESP, 0).u64(ssn).u64(old)
    }
    pub(crate) fn fatal() -> Self {
        Self::new(FATAL, 0)
    }
    pub(crate) fn beat() -> Self {
        Self::new(BEAT, 0)
    }
}

/// The fields of a frame that carries a payload, decoded before the payload is read so that
/// the payload can be read straight into the memory it is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataHead {
    Send {
        ssn: u64,
        imm: Option<u32>,
        /// The initiator wants this acknowledged (it asked for a completion).
        ack: bool,
    },
    Write {
        ssn: u64,
        addr: u64,
        rkey: u32,
        imm: Option<u32>,
        ack: bool,
    },
    /// A read response, or with `more` a part of one that more parts follow.
    ReadResp { ssn: u64, more: bool },
}

impl DataHead {
    /// Bytes of the kind and fields of a payload-carrying frame of `kind`; `None` for others.
    pub(crate) fn len(kind: u8) -> Option<usize> {
        match kind {
            SEND => Some(1 + 8 + 5),
            WRITE => Some(1 + 8 + 8 + 4 + 5),
            READ_RESP | READ_PART => Some(1 + 8),
            _ => None,
        }
    }

    /// Decodes exactly [`len`](Self::len) bytes, kind first.
    pub(crate) fn decode(head: &[u8]) -> Result<DataHead, WireError> {
        let (&kind, rest) = head.split_first().ok_or(WireError::Truncated)?;
        let mut r = Reader(rest);
        let h = match kind {
            SEND => {
                let ssn = r.u64()?;
                let (imm, ack) = r.imm()?;
                DataHead::Send { ssn, imm, ack }
            }
            WRITE => {
                let (ssn, addr, rkey) = (r.u64()?, r.u64()?, r.u32()?);
                let (imm, ack) = r.imm()?;
                DataHead::Write {
                    ssn,
                    addr,
                    rkey,
                    imm,
                    ack,
                }
            }
            READ_RESP => DataHead::ReadResp {
                ssn: r.u64()?,
                more: false,
            },
            READ_PART => DataHead::ReadResp {
                ssn: r.u64()?,
                more: true,
            },
            k => return Err(WireError::UnknownKind(k)),
        };
        r.end()?;
        Ok(h)
    }
}

/// Why a frame could not be decoded.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    #[error("frame truncated")]
    Truncated,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("trailing bytes in a fixed-size frame")]
    Trailing,
    #[error("bad field value")]
    BadValue,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or(WireError::Truncated)?;
        self.0 = rest;
        Ok(*head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn imm(&mut self) -> Result<(Option<u32>, bool), WireError> {
        let flag = self.u8()?;
        let v = self.u32()?;
        if flag & !(1 | ACK_REQ) != 0 {
            return Err(WireError::BadValue);
        }
        Ok(((flag & 1 != 0).then_some(v), flag & ACK_REQ != 0))
    }
    fn end(self) -> Result<(), WireError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing)
        }
    }
}

impl Frame {
    /// Decodes one frame body (without the length prefix).
    pub(crate) fn decode(body: &[u8]) -> Result<Frame, WireError> {
        let (&kind, rest) = body.split_first().ok_or(WireError::Truncated)?;
        let mut r = Reader(rest);
        let f = match kind {
            // A payload-carrying frame: its fields as the reader decodes them ahead, then the rest.
            SEND | WRITE | READ_RESP | READ_PART => {
                let h = DataHead::len(kind).unwrap_or(0);
                let (head, data) = body.split_at_checked(h).ok_or(WireError::Truncated)?;
                return Ok(Frame::Data {
                    head: DataHead::decode(head)?,
                    data: data.to_vec(),
                });
            }
            READ_REQ => Frame::ReadReq {
                ssn: r.u64()?,
                addr: r.u64()?,
                rkey: r.u32()?,
                len: r.u32()?,
            },
            ATOMIC => {
                let (ssn, addr, rkey, op, a, b) = (r.u64()?, r.u64()?, r.u32()?, r.u8()?, r.u64()?, r.u64()?);
                let op = match op {
                    0 => AtomicOp::CompareSwap { compare: a, swap: b },
                    1 => AtomicOp::FetchAdd { add: a },
                    _ => return Err(WireError::BadValue),
                };
                Frame::Atomic { ssn, addr, rkey, op }
            }
            ACK => Frame::Ack { ssn: r.u64()? },
            NAK => {
                let ssn = r.u64()?;
                let raw = r.u8()?;
                let status = WcStatus::from_raw(u32::from(raw));
                if status.is_success() {
                    return Err(WireError::BadValue);
                }
                Frame::Nak { ssn, status }
            }
            ATOMIC_RESP => Frame::AtomicResp {
                ssn: r.u64()?,
                old: r.u64()?,
            },
            FATAL => Frame::Fatal,
            BEAT => Frame::Beat,
            k => return Err(WireError::UnknownKind(k)),
        };
        r.end()?;
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(bytes: Vec<u8>) -> Frame {
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
        assert_eq!(len, bytes.len() - 4);
        Frame::decode(&bytes[4..]).expect("decodes")
    }

    #[test]
    fn frames_roundtrip() {
        assert_eq!(
            roundtrip(Encoder::write(3, 0x1000, 77, Some(9), true).data(b"abc").finish()),
            Frame::Data {
                head: DataHead::Write {
                    ssn: 3,
                    addr: 0x1000,
                    rkey: 77,
                    imm: Some(9),
                    ack: true
                },
                data: b"abc".to_vec()
            }
        );
        assert_eq!(
            roundtrip(Encoder::atomic(1, 8, 2, AtomicOp::FetchAdd { add: 5 }).finish()),
            Frame::Atomic {
                ssn: 1,
                addr: 8,
                rkey: 2,
                op: AtomicOp::FetchAdd { add: 5 }
            }
        );
        assert_eq!(
            roundtrip(Encoder::nak(4, WcStatus::RemAccessErr).finish()),
            Frame::Nak {
                ssn: 4,
                status: WcStatus::RemAccessErr
            }
        );
    }

    #[test]
    fn a_payload_head_decodes_as_the_whole_frame_does() {
        let frame = Encoder::write(3, 0x1000, 77, None, false).head(5);
        let len = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
        let body = &frame[4..];
        assert_eq!(DataHead::len(body[0]), Some(body.len()));
        assert_eq!(len, body.len() + 5);
        assert_eq!(
            DataHead::decode(body),
            Ok(DataHead::Write {
                ssn: 3,
                addr: 0x1000,
                rkey: 77,
                imm: None,
                ack: false
            })
        );
        let send = Encoder::send(9, Some(4), true).finish();
        assert_eq!(DataHead::len(send[4]), Some(send.len() - 4));
        assert_eq!(
            DataHead::decode(&send[4..]),
            Ok(DataHead::Send {
                ssn: 9,
                imm: Some(4),
                ack: true
            })
        );
        let resp = Encoder::read_resp(2).finish();
        assert_eq!(
            DataHead::decode(&resp[4..]),
            Ok(DataHead::ReadResp { ssn: 2, more: false })
        );
        let part = Encoder::read_part(5).head(3);
        assert_eq!(DataHead::len(part[4]), Some(part.len() - 4));
        assert_eq!(
            DataHead::decode(&part[4..]),
            Ok(DataHead::ReadResp { ssn: 5, more: true })
        );
        assert_eq!(DataHead::len(ACK), None);
        assert_eq!(DataHead::decode(&[SEND, 1, 2]), Err(WireError::Truncated));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut seed = 0x1234_5678_u64;
        for len in 0..200 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = Frame::decode(&bytes);
        }
        assert_eq!(Frame::decode(&[]), Err(WireError::Truncated));
        assert_eq!(Frame::decode(&[99]), Err(WireError::UnknownKind(99)));
        assert_eq!(
            Frame::decode(&[ACK, 1, 0, 0, 0, 0, 0, 0, 0, 5]),
            Err(WireError::Trailing)
        );
    }
}
