//! A queue pair's byte link over shared memory: our inbox ring (we consume), the peer's inbox
//! ring (we produce), and the Unix socket the connection was set up on, which carries the
//! grants of memory (`grant`) and tells that the peer process died (the kernel closes it then). A process that stops or hangs keeps
//! its socket open: each side's watcher thread beats in its own inbox's header, and takes a
//! peer whose beat stands still for [`KEEPALIVE`] to be dead, as a NIC's retries give up on a
//! host that stopped answering.

use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::grant::{Grants, Inbound, Server, MSG};
use super::ring::{Ring, RingError};
use super::sys;
use crate::tcp::{Link, BEAT, KEEPALIVE};

pub(crate) struct ShmLink {
    rx: Ring,
    tx: Ring,
    sock: UnixStream,
    peer_dead: Arc<AtomicBool>,
}

fn io_err(e: RingError) -> io::Error {
    match e {
        RingError::Closed => io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the queue pair"),
        RingError::Corrupt => io::Error::new(io::ErrorKind::InvalidData, "the peer corrupted the ring"),
    }
}

impl ShmLink {
    /// Starts the watcher thread that beats, and turns the socket's end, or a peer whose beat
    /// stood still for [`KEEPALIVE`], into `peer_dead`.
    pub(crate) fn new(
        rx: Ring,
        tx: Ring,
        sock: UnixStream,
        peer_dead: Arc<AtomicBool>,
        server: Arc<Server>,
        grants: Arc<Grants>,
    ) -> io::Result<Arc<ShmLink>> {
        let link = Arc::new(ShmLink {
            rx,
            tx,
            sock,
            peer_dead,
        });
        let watch = link.sock.try_clone()?;
        watch.set_read_timeout(Some(BEAT))?;
        let weak = Arc::downgrade(&link);
        link.rx.beat();
        std::thread::Builder::new()
            .name("rdma-shm-watch".into())
            .spawn(move || {
                let mut inbound = Inbound::new();
                let (mut seen, mut since) = (None, Instant::now());
                loop {
                    // After set-up the socket carries grants only (`grant`): the end, an error
                    // other than the timeout, or a broken message ends the connection.
                    match sys::recv_with_fds(&watch, 64 * MSG) {
                        Ok((bytes, fds)) => {
                            if let Err(e) = inbound.take(&bytes, fds, &watch, &server, &grants) {
                                tracing::warn!("shm peer dropped: {e}");
                                break;
                            }
                        }
                        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                        Err(_) => break,
                    }
                    grants.sweep();
                    let Some(l) = weak.upgrade() else {
                        grants.close();
                        return;
                    };
                    l.rx.beat();
                    let beat = l.tx.peer_beat();
                    if seen != Some(beat) {
                        (seen, since) = (Some(beat), Instant::now());
                    } else if since.elapsed() >= KEEPALIVE {
                        tracing::warn!("the shm peer's heartbeat stood still for {KEEPALIVE:?}: taken to be dead");
                        break;
                    }
                }
                grants.close();
                if let Some(l) = weak.upgrade() {
                    l.peer_dead.store(true, Ordering::Release);
                    l.rx.wake_all();
                    l.tx.wake_all();
                }
            })?;
        Ok(link)
    }
}

impl Link for ShmLink {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.rx.try_read(buf).map_err(io_err)
    }

    fn wait(&self, _wake: Option<BorrowedFd<'_>>, watch: bool, _timeout: Option<Duration>) -> io::Result<bool> {
        debug_assert!(watch, "an shm link is always watched by its reader thread");
        self.rx.wait_data().map_err(io_err)?;
        Ok(true)
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.tx.try_write(buf).map_err(io_err)
    }

    fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        self.tx.write_all(buf).map_err(io_err)
    }

    fn shutdown_write(&self) {
        self.tx.close();
    }

    fn shutdown(&self) {
        self.tx.close();
        self.rx.abandon();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        // Our own reader may sleep on our inbox: wake it to see the end.
        self.peer_dead.store(true, Ordering::Release);
        self.rx.wake_all();
        self.tx.wake_all();
    }
}
