//! The read side of a link, never waiting: one read takes whatever has arrived (often several
//! frames) into a small buffer; a large payload is then read straight into its destination.
//! Whoever holds the engine's reader (its thread, or an application thread polling a CQ)
//! reads through here.

use std::io;
use std::sync::Arc;

use super::link::Link;

/// Room for the largest frame decoded here (a frame without a landing place for its payload).
const CAP: usize = 64 << 10;

/// Room a link starts with: what one read asks for, twice. It grows to [`CAP`] only for a
/// frame that needs it, so an idle connection holds 8 KiB here, not 64 (a server of
/// thousands of connections holds one of these per connection).
const START: usize = 2 * AHEAD;

/// Bytes one read asks for beyond what is needed: several small frames per system call, while
/// a large payload that follows a header is mostly left in the socket, to be read straight into
/// its destination rather than through this buffer (one copy fewer).
const AHEAD: usize = 4 << 10;

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
            buf: vec![0; START].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The largest `k` that [`try_fill`](Self::try_fill) accepts.
    pub(crate) const fn capacity() -> usize {
        CAP
    }

    /// Whether the next `k` bytes (`k <= CAP`) are here, reading what has arrived until they
    /// are; never waits. The end of the link is an error.
    pub(crate) fn try_fill(&mut self, k: usize) -> io::Result<bool> {
        debug_assert!(k <= CAP);
        if self.end - self.start >= k {
            return Ok(true);
        }
        if self.start + k > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if k > self.buf.len() {
                let mut grown = vec![0; k.next_power_of_two().clamp(START, CAP)].into_boxed_slice();
                grown[..self.end].copy_from_slice(&self.buf[..self.end]);
                self.buf = grown;
            }
        }
        let upto = (self.start + k.max(AHEAD)).min(self.buf.len());
        while self.end - self.start < k {
            match self.link.try_read(&mut self.buf[self.end..upto])? {
                0 => return Ok(false),
                n => self.end += n,
            }
        }
        Ok(true)
    }

    /// The bytes read and not consumed yet.
    pub(crate) fn avail(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Whether a whole frame (length prefix and body) is already here.
    pub(crate) fn has_frame(&self) -> bool {
        let have = self.avail();
        have.first_chunk::<4>()
            .is_some_and(|n| have.len() - 4 >= u32::from_le_bytes(*n) as usize)
    }

    /// Marks `k` bytes read.
    pub(crate) fn consume(&mut self, k: usize) {
        self.start = (self.start + k).min(self.end);
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Fills the start of `dst` with the next bytes, without waiting: what was read ahead if
    /// anything was, else what the link has. How many; 0 when nothing has arrived.
    pub(crate) fn read_into(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let have = (self.end - self.start).min(dst.len());
        if have == 0 {
            return self.link.try_read(dst);
        }
        dst[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.consume(have);
        Ok(have)
    }
}
