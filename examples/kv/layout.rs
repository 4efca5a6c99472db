//! The table as it lies in the server's registered memory, which clients read with RDMA Read.
//!
//! - Index: `BUCKETS + PROBE` entries of 32 bytes, `key_hash: u64 | slot: u32 | live: u32 |
//!   version: u64 | sum: u64` (sum = FNV-1a 64 of the first 24 bytes). A key lives in one of the
//!   `PROBE` entries from `hash % BUCKETS`, so one read of `PROBE * 32` bytes finds it.
//! - Values: `SLOTS` slots of `SLOT` bytes, `version: u64 | key_len: u32 | val_len: u32 | key |
//!   value | sum: u64` (sum over everything before it).
//!
//! The server rewrites a slot in place, in several steps; a reader that copies it mid-update
//! gets bytes whose sum does not match (torn) and reads again. A slot freed by a delete and
//! reused for another key fails the key check, and the reader starts over from the index.

use crate::common::{fnv64, FNV64};

pub const BUCKETS: usize = 4096;
pub const PROBE: usize = 8;
pub const ENTRY: usize = 32;
pub const INDEX_BYTES: usize = (BUCKETS + PROBE) * ENTRY;
pub const SLOTS: usize = 2048;
pub const SLOT: usize = 1024;
pub const VALUES_BYTES: usize = SLOTS * SLOT;
/// The largest key plus value a slot holds.
pub const MAX_KV: usize = SLOT - 24;

/// A key's hash (never 0: 0 marks an empty entry).
pub fn key_hash(key: &[u8]) -> u64 {
    fnv64(FNV64, key).max(1)
}

/// The first index entry a key may use.
pub fn home(hash: u64) -> usize {
    (hash % BUCKETS as u64) as usize
}

/// One index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub hash: u64,
    pub slot: u32,
    pub live: bool,
    pub version: u64,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

impl Entry {
    pub fn encode(&self) -> [u8; ENTRY] {
        let mut e = [0u8; ENTRY];
        e[..8].copy_from_slice(&self.hash.to_le_bytes());
        e[8..12].copy_from_slice(&self.slot.to_le_bytes());
        e[12..16].copy_from_slice(&u32::from(self.live).to_le_bytes());
        e[16..24].copy_from_slice(&self.version.to_le_bytes());
        let sum = fnv64(FNV64, &e[..24]);
        e[24..].copy_from_slice(&sum.to_le_bytes());
        e
    }

    /// `Err(())` for a torn entry; `Ok(None)` for a never-used one.
    pub fn decode(b: &[u8]) -> Result<Option<Entry>, ()> {
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if fnv64(FNV64, &b[..24]) != u64_at(b, 24) {
            return Err(());
        }
        Ok(Some(Entry {
            hash: u64_at(b, 0),
            slot: u32_at(b, 8),
            live: u32_at(b, 12) != 0,
            version: u64_at(b, 16),
        }))
    }
}

/// A value slot's bytes: header, key, value, sum; written in pieces by [`slot_pieces`].
pub fn encode_slot(version: u64, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(24 + key.len() + value.len());
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&(key.len() as u32).to_le_bytes());
    v.extend_from_slice(&(value.len() as u32).to_le_bytes());
    v.extend_from_slice(key);
    v.extend_from_slice(value);
    let sum = fnv64(FNV64, &v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

/// What a read of a slot found.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotRead<'a> {
    /// A whole, consistent slot.
    Value { key: &'a [u8], value: &'a [u8] },
    /// Copied mid-update: read again.
    Torn,
}

pub fn decode_slot(b: &[u8]) -> SlotRead<'_> {
    if b.len() < 24 {
        return SlotRead::Torn;
    }
    let (klen, vlen) = (u32_at(b, 8) as usize, u32_at(b, 12) as usize);
    let end = 16usize.saturating_add(klen).saturating_add(vlen);
    if klen + vlen > MAX_KV || end + 8 > b.len() || fnv64(FNV64, &b[..end]) != u64_at(b, end) {
        return SlotRead::Torn;
    }
    SlotRead::Value {
        key: &b[16..16 + klen],
        value: &b[16 + klen..end],
    }
}
