//! The byte copy that stands in for a NIC's DMA on `shm`: a message into memory that another
//! core reads next, header first.

/// The first bytes of a message, copied ahead of the rest and on their own: the lines a
/// receiver reads first (its header), as many as `sys::demote` moves to the shared cache.
const HEAD: usize = 256;

/// Messages longer than this are copied in two parts, `HEAD` and the rest.
///
/// Why: glibc's `memcpy` copies by `rep movsb` from 2112 bytes on processors with FSRM
/// (`glibc.cpu.x86_rep_movsb_threshold`, 0x840). On some processors the core that reads the
/// head of a message copied that way waits longer for it; copying the head on its own, by
/// vector stores, spares the receiver that wait where it reads the header first, and costs
/// nothing measurable where it copies everything out (docs/decisions.md). Up to 2 KiB glibc
/// copies by vector stores either way.
const SPLIT_ABOVE: usize = 2048;

/// Copies `len` bytes from `src` to `dst`, the first `HEAD` of a long message on their own.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len` bytes,
/// the two not overlapping.
pub(crate) unsafe fn for_peer(src: *const u8, dst: *mut u8, len: usize) {
    if len <= SPLIT_ABOVE {
        // SAFETY: this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: `HEAD < SPLIT_ABOVE < len`: both parts lie inside the ranges of this function's
    // contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, HEAD);
        std::ptr::copy_nonoverlapping(src.add(HEAD), dst.add(HEAD), len - HEAD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_each_length_and_offset_and_no_more() {
        let src: Vec<u8> = (0..3 * SPLIT_ABOVE).map(|i| (i % 251) as u8).collect();
        for len in [
            0,
            1,
            HEAD - 1,
            HEAD,
            HEAD + 1,
            SPLIT_ABOVE,
            SPLIT_ABOVE + 1,
            4096 + 24,
            2 * SPLIT_ABOVE + 7,
        ] {
            for off in [0, 1, 63] {
                let mut dst = vec![0xeeu8; len + 2 * 64];
                // SAFETY: `src` holds at least `off + len` bytes, `dst` `off + len + 64`.
                unsafe { for_peer(src.as_ptr().add(off), dst.as_mut_ptr().add(off), len) };
                assert!(dst[..off].iter().all(|&b| b == 0xee), "before, len {len} off {off}");
                assert_eq!(&dst[off..off + len], &src[off..off + len], "len {len} off {off}");
                assert!(
                    dst[off + len..].iter().all(|&b| b == 0xee),
                    "after, len {len} off {off}"
                );
            }
        }
    }
}
