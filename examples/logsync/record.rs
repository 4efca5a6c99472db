//! The log record, as it lies in the backup's ring and as it travels by RPC.
//!
//! `len: u32 | flags: u32 | seq: u64 | sum: u64 | payload (len bytes) | zero padding to 8`,
//! where `sum` is FNV-1a 64 over `seq` (little endian) and the payload. The last record of a run
//! has `flags = END` and no payload.

use crate::common::{fnv64, pattern, FNV64};

/// Bytes before the payload.
pub const HEADER: usize = 24;
/// The flag of the last record.
pub const END: u32 = 1;

/// A record's size in the ring.
pub fn padded(len: usize) -> usize {
    (HEADER + len).next_multiple_of(8)
}

/// The payload of record `seq`: 16 to 4111 bytes of a pattern, the length also from `seq`.
pub fn payload(seq: u64) -> Vec<u8> {
    let len = 16 + (seq.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 52) as usize;
    pattern(seq, len)
}

fn sum(seq: u64, payload: &[u8]) -> u64 {
    fnv64(fnv64(FNV64, &seq.to_le_bytes()), payload)
}

/// Encodes a record (padded).
pub fn encode(seq: u64, flags: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(padded(payload.len()));
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&sum(seq, payload).to_le_bytes());
    v.extend_from_slice(payload);
    v.resize(padded(payload.len()), 0);
    v
}

/// A record read back: its seq, flags and payload, if its length fits `bytes` and its sum is right.
pub fn decode(bytes: &[u8]) -> Result<(u64, u32, &[u8]), String> {
    let u32_at = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        u64::from_le_bytes(b)
    };
    if bytes.len() < HEADER {
        return Err(format!("{} bytes: shorter than a header", bytes.len()));
    }
    let len = u32_at(0) as usize;
    let payload = bytes
        .get(HEADER..HEADER + len)
        .ok_or_else(|| format!("length {len} runs past the end"))?;
    let (flags, seq) = (u32_at(4), u64_at(8));
    if sum(seq, payload) != u64_at(16) {
        return Err(format!("record {seq}: checksum mismatch (torn or overwritten)"));
    }
    Ok((seq, flags, payload))
}
