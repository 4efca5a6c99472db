//! The tcp provider's link: a TCP connection under a software queue pair's engine.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use socket2::SockRef;

use crate::nic::{now_nanos, Link};

/// The tcp provider's link: the connection, and when bytes last came on it.
pub(crate) struct TcpLink {
    stream: TcpStream,
    heard: AtomicU64,
}

impl TcpLink {
    pub(crate) fn new(stream: TcpStream) -> Self {
        TcpLink {
            stream,
            heard: AtomicU64::new(now_nanos()),
        }
    }
}

impl Link for TcpLink {
    fn socket(&self) -> Option<BorrowedFd<'_>> {
        Some(self.stream.as_fd())
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
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
                    self.heard.store(now_nanos(), Ordering::Relaxed);
                }
                Ok(n)
            }
            Err(Errno::AGAIN | Errno::INTR) => Ok(0),
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
        Some(Duration::from_nanos(now_nanos().saturating_sub(heard)))
    }
}
