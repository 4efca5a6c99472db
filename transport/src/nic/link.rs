//! The byte link under a software queue pair's engine: a TCP connection (`tcp`), shared-memory
//! rings (`shm`). The engine needs non-blocking reads and writes, a descriptor its
//! device's progress engine watches (`nic/progress.rs`), and shutdown.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Duration;

/// A bidirectional byte stream for one queue pair.
pub(crate) trait Link: Send + Sync + 'static {
    /// Reads what is there now, up to `buf.len()`, without waiting: `Ok(0)` when nothing is
    /// (whoever holds the engine's reader); the end of the link is an error.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// The descriptor the progress engine watches for the link: readable when there is
    /// something to read, writable when there is room (a socket); or, for a link whose
    /// readiness no descriptor tells (shm's rings), one that is rung when what
    /// [`arm_read`](Self::arm_read) or [`arm_write`](Self::arm_write) asked for comes.
    fn event_fd(&self) -> BorrowedFd<'_>;
    /// The descriptor to watch for readability beside others (a CQ's epoll set), if the link
    /// is a socket that application threads may read too.
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Whether bytes wait to be read, for a link whose readiness no socket tells (shm's
    /// rings): asked at each poll of the QP's CQs, so it must cost a load or two, no system
    /// call. A socket says so through its CQ's epoll set instead.
    fn has_bytes(&self) -> bool {
        false
    }
    /// The engine is about to wait for something to read: has [`event_fd`](Self::event_fd)
    /// rung when it comes. True when it is there already (do not wait). Sockets need nothing.
    fn arm_read(&self) -> bool {
        false
    }
    /// As [`arm_read`](Self::arm_read), for room to write.
    fn arm_write(&self) -> bool {
        false
    }
    /// A turn begins: takes back what was armed.
    fn disarm(&self) {}
    /// A turn's upkeep of the link itself (shm: its socket's messages when `readable` says
    /// [`event_fd`](Self::event_fd) has some, its heartbeat); when the next is due.
    fn service(&self, _now: std::time::Instant, _readable: bool) -> Option<std::time::Instant> {
        None
    }
    /// Whether [`event_fd`](Self::event_fd) is watched whatever the engine waits for (it
    /// carries the link's own traffic).
    fn always_watched(&self) -> bool {
        false
    }
    /// Writes what fits without waiting; `Ok(0)` when nothing does.
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
    /// Writes what fits of `a` then `b` without waiting; the count of bytes taken from both.
    fn try_write2(&self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        let n = self.try_write(a)?;
        if n < a.len() || b.is_empty() {
            return Ok(n);
        }
        Ok(n + self.try_write(b)?)
    }
    /// No more bytes from this side (the peer reads to the end, then sees the end).
    fn shutdown_write(&self);
    /// Ends the link both ways at once.
    fn shutdown(&self);
    /// Whether each side's writer beats while idle ([`Frame::Beat`](super::wire::Frame)), so
    /// that the other can tell a stopped or hung peer: a TCP peer's kernel acknowledges for a
    /// process that stopped, so the connection itself never says.
    fn beats(&self) -> bool {
        false
    }
    /// How long nothing has come from the peer, on a link that beats.
    fn silent_for(&self) -> Option<Duration> {
        None
    }
}

/// How often an idle side beats (a tcp writer's Beat frame, an shm watcher's heartbeat word).
pub(crate) const BEAT: Duration = Duration::from_millis(500);
/// How long a peer may stay silent, beats included, before it is taken for stopped or hung,
/// on both software providers.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(10);
