//! The byte link under a software queue pair's engine: a TCP connection here, shared-memory
//! rings in the shm provider. The engine needs non-blocking reads (whoever holds its reader) and a
//! wait for data (its reader thread), non-blocking and blocking writes (posters, then the writer
//! thread), and shutdown.

use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use socket2::SockRef;

/// A bidirectional byte stream for one queue pair.
pub(crate) trait Link: Send + Sync + 'static {
    /// Reads what is there now, up to `buf.len()`, without waiting: `Ok(0)` when nothing is
    /// (whoever holds the engine's reader); the end of the link is an error.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Waits (the reader thread) until there is something to read or the link ended, `wake`
    /// is readable, or `timeout` passed; with `watch` false, for `wake` or `timeout` only.
    /// `Ok(false)` when the time ran out. Links whose reads cannot be waited for beside a
    /// descriptor (shm) wait for data only and must be called with `watch`.
    fn wait(&self, wake: Option<BorrowedFd<'_>>, watch: bool, timeout: Option<Duration>) -> io::Result<bool>;
    /// The descriptor to watch for readability beside others (a CQ's epoll set), if the link
    /// has one.
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        None
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
    /// Writes everything, waiting for room (writer thread only).
    fn write_all(&self, buf: &[u8]) -> io::Result<()>;
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

/// The tcp provider's link: the connection, and when bytes last came on it.
pub(crate) struct TcpLink {
    stream: TcpStream,
    heard: AtomicU64,
}

impl TcpLink {
    pub(crate) fn new(stream: TcpStream) -> Self {
        TcpLink {
            stream,
            heard: AtomicU64::new(super::now_nanos()),
        }
    }
}

impl Link for TcpLink {
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        Some(self.stream.as_fd())
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        match SockRef::from(&self.stream).send_with_flags(buf, flags) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        use rustix::io::Errno;
        let want = buf.len();
        match rustix::net::recv(&self.stream, buf, rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) if want > 0 => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok((n, _)) => {
                if n > 0 {
                    self.heard.store(super::now_nanos(), Ordering::Relaxed);
                }
                Ok(n)
            }
            Err(Errno::AGAIN | Errno::INTR) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    fn wait(&self, wake: Option<BorrowedFd<'_>>, watch: bool, timeout: Option<Duration>) -> io::Result<bool> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let limit = timeout.map(|t| Timespec {
            tv_sec: t.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: t.subsec_nanos().into(),
        });
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(2);
        if watch {
            fds.push(PollFd::new(&self.stream, PollFlags::IN));
        }
        if let Some(w) = &wake {
            fds.push(PollFd::new(w, PollFlags::IN));
        }
        match poll(&mut fds, limit.as_ref()) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::INTR) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    fn try_write2(&self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        // One sendmsg for a frame's header and its payload, straight from registered memory.
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        let parts = [io::IoSlice::new(a), io::IoSlice::new(b)];
        match SockRef::from(&self.stream).send_vectored_with_flags(&parts, flags) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        (&self.stream).write_all(buf)
    }

    fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn beats(&self) -> bool {
        true
    }

    fn silent_for(&self) -> Option<Duration> {
        let heard = self.heard.load(Ordering::Relaxed);
        Some(Duration::from_nanos(super::now_nanos().saturating_sub(heard)))
    }
}
