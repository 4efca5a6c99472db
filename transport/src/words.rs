//! Copies into and out of a registration on whose words peers may run atomics (REMOTE_ATOMIC):
//! every access to a word an atomic can reach is a whole 8-byte atomic, so a copy never meets
//! a peer's atomic with a plain access, or one of another size, on the same word. A word the
//! copy covers only in part is merged by compare-and-swap. Bytes of a word that is not whole
//! inside the registration, which no atomic can reach (its 8 bytes must be inside), are
//! copied plainly.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The registration's bytes, as addresses: `[lo, hi)`.
#[derive(Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) lo: usize,
    pub(crate) hi: usize,
}

impl Bounds {
    /// The word holding address `a`, if the whole word is inside the registration.
    fn word(self, a: usize) -> Option<usize> {
        let w = a & !7;
        (w >= self.lo && w + 8 <= self.hi).then_some(w)
    }
}

/// Copies `src` to `dst` inside the registration `within`.
///
/// # Safety
/// `[dst, dst + src.len())` lies inside `within`, which is writable memory that lives for the
/// call, 8-byte aligned words of it accessed only atomically by everyone else.
pub(crate) unsafe fn copy_in(dst: *mut u8, src: &[u8], within: Bounds) {
    let mut i = 0;
    while i < src.len() {
        let a = dst as usize + i;
        match within.word(a) {
            Some(w) => {
                let (from, to) = (a - w, (a - w + src.len() - i).min(8));
                // SAFETY: the word is whole inside the registration (`word`), 8-aligned, and
                // only accessed atomically (this function's contract).
                let word = unsafe { AtomicU64::from_ptr(w as *mut u64) };
                if from == 0 && to == 8 {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&src[i..i + 8]);
                    word.store(u64::from_ne_bytes(b), Relaxed);
                } else {
                    let merge = |old: u64| {
                        let mut b = old.to_ne_bytes();
                        b[from..to].copy_from_slice(&src[i..i + to - from]);
                        Some(u64::from_ne_bytes(b))
                    };
                    let _ = word.fetch_update(Relaxed, Relaxed, merge);
                }
                i += to - from;
            }
            None => {
                // SAFETY: inside the registration (this function's contract); no atomic can
                // reach this byte's word.
                unsafe { (a as *mut u8).write(src[i]) };
                i += 1;
            }
        }
    }
}

/// Copies from `src` into `dst`, inside the registration `within`.
///
/// # Safety
/// `[src, src + dst.len())` lies inside `within`, which is readable memory that lives for the
/// call, 8-byte aligned words of it accessed only atomically by everyone else.
pub(crate) unsafe fn copy_out(src: *const u8, dst: &mut [u8], within: Bounds) {
    let mut i = 0;
    while i < dst.len() {
        let a = src as usize + i;
        match within.word(a) {
            Some(w) => {
                let (from, to) = (a - w, (a - w + dst.len() - i).min(8));
                // SAFETY: as in `copy_in`.
                let word = unsafe { AtomicU64::from_ptr(w as *mut u64) };
                let b = word.load(Relaxed).to_ne_bytes();
                dst[i..i + to - from].copy_from_slice(&b[from..to]);
                i += to - from;
            }
            None => {
                // SAFETY: inside the registration; no atomic can reach this byte's word.
                dst[i] = unsafe { (a as *const u8).read() };
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_offset_and_length_and_no_more() {
        // A registration of 37 bytes starting 3 bytes into a word-aligned buffer: words whole
        // inside it are reached atomically, the others bytewise.
        let mut buf = vec![0u64; 8];
        let base = buf.as_mut_ptr() as usize;
        let within = Bounds {
            lo: base + 3,
            hi: base + 40,
        };
        for off in 0..37 {
            for len in 0..=37 - off {
                buf.iter_mut().for_each(|w| *w = u64::MAX);
                let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
                // SAFETY: `[base + 3 + off, + len)` is inside `within`, inside `buf`; nothing
                // else runs.
                unsafe { copy_in((within.lo + off) as *mut u8, &src, within) };
                let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
                assert_eq!(&bytes[3 + off..3 + off + len], &src[..], "off {off} len {len}");
                assert!(
                    bytes[..3 + off]
                        .iter()
                        .chain(&bytes[3 + off + len..])
                        .all(|&b| b == 0xff),
                    "off {off} len {len}: bytes outside the copy changed"
                );
                let mut back = vec![0u8; len];
                // SAFETY: as above.
                unsafe { copy_out((within.lo + off) as *const u8, &mut back, within) };
                assert_eq!(back, src, "off {off} len {len}");
            }
        }
    }
}
