//! The reader thread's side of a link: one read takes whatever has arrived (often several
//! frames) into a small buffer; a large payload is read straight into its destination.

use std::io;
use std::sync::Arc;

use super::link::Link;
use crate::mr::Region;

/// Bytes read ahead at most: room for every frame without a payload, and for small payloads.
const CAP: usize = 64 << 10;

pub(crate) struct Inbox {
    link: Arc<dyn Link>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Inbox {
    pub(crate) fn new(link: Arc<dyn Link>) -> Self {
        Self {
            link,
            buf: vec![0; CAP].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The largest `k` that [`fill`](Self::fill) accepts.
    pub(crate) const fn capacity() -> usize {
        CAP
    }

    /// The next `k` bytes (`k <= CAP`), reading until they are here; they stay unread.
    pub(crate) fn fill(&mut self, k: usize) -> io::Result<&[u8]> {
        debug_assert!(k <= CAP);
        if self.end - self.start < k {
            if self.start + k > CAP {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            while self.end - self.start < k {
                self.end += self.link.read_some(&mut self.buf[self.end..])?;
            }
        }
        Ok(&self.buf[self.start..self.start + k])
    }

    /// Whether a whole frame (length prefix and body) is already here.
    pub(crate) fn has_frame(&self) -> bool {
        let have = &self.buf[self.start..self.end];
        have.first_chunk::<4>()
            .is_some_and(|n| have.len() - 4 >= u32::from_le_bytes(*n) as usize)
    }

    /// Marks `k` filled bytes read.
    pub(crate) fn consume(&mut self, k: usize) {
        self.start = (self.start + k).min(self.end);
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Fills `len` bytes of `region` from `off` with the next bytes: what was read ahead, then
    /// straight from the link. The region's lock is held only while bytes are copied (never
    /// while waiting for the peer), so a stalled peer cannot block the application's access
    /// to its memory.
    pub(crate) fn read_into_region(&mut self, region: &Region, off: usize, len: usize) -> io::Result<()> {
        let have = (self.end - self.start).min(len);
        region
            .lock_range(off, have)
            .copy_from_slice(&self.buf[self.start..self.start + have]);
        self.consume(have);
        let mut got = have;
        while got < len {
            let n = self.link.try_read(&mut region.lock_range(off + got, len - got))?;
            if n == 0 {
                self.link.wait_readable()?;
            }
            got += n;
        }
        Ok(())
    }

    /// Fills `dst` with the next bytes: what was read ahead, then straight from the link.
    pub(crate) fn read_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let have = (self.end - self.start).min(dst.len());
        dst[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.consume(have);
        if have < dst.len() {
            self.link.read_exact(&mut dst[have..])?;
        }
        Ok(())
    }
}
