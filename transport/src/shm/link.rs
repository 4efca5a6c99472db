//! A queue pair's byte link over shared memory: our inbox ring (we consume), the peer's inbox
//! ring (we produce), and the Unix socket the connection was set up on. The socket is the one
//! descriptor a connection holds on each side: it carries the grants of memory (`grant`), the
//! doorbell (a `WAKE` message, sent when we wrote to the peer's sleeping reader or freed room
//! for its waiting writer), and tells that the peer process died (the kernel closes it then).
//! The QP's turns on the progress engine watch it and serve it ([`Link::service`]). A process
//! that stops or hangs keeps its socket open: each side beats in its own inbox's header, and
//! takes a peer whose beat stands still for [`KEEPALIVE`] to be dead, as a NIC's retries give
//! up on a host that stopped answering.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::grant::{Grants, Inbound, Server, MSG};
use super::ring::{Ring, RingError};
use super::sys;
use crate::nic::{Link, BEAT, KEEPALIVE};

pub(crate) struct ShmLink {
    rx: Ring,
    tx: Ring,
    sock: Arc<UnixStream>,
    peer_dead: Arc<AtomicBool>,
    server: Arc<Server>,
    grants: Arc<Grants>,
    watch: Mutex<Watch>,
}

fn io_err(e: RingError) -> io::Error {
    match e {
        RingError::Closed => io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the queue pair"),
        RingError::Corrupt => io::Error::new(io::ErrorKind::InvalidData, "the peer corrupted the ring"),
    }
}

/// What the socket's reader keeps between turns.
struct Watch {
    inbound: Inbound,
    /// The peer's beat as last seen, and since when.
    seen: Option<u64>,
    since: Instant,
    next_beat: Instant,
    done: bool,
}

impl ShmLink {
    pub(crate) fn new(
        rx: Ring,
        tx: Ring,
        sock: Arc<UnixStream>,
        peer_dead: Arc<AtomicBool>,
        server: Arc<Server>,
        grants: Arc<Grants>,
    ) -> Arc<ShmLink> {
        rx.beat();
        let now = Instant::now();
        Arc::new(ShmLink {
            rx,
            tx,
            sock,
            peer_dead,
            server,
            grants,
            watch: Mutex::new(Watch {
                inbound: Inbound::new(),
                seen: None,
                since: now,
                next_beat: now + BEAT,
                done: false,
            }),
        })
    }

    /// The peer is gone: every wait of ours ends.
    fn peer_died(&self) {
        self.peer_dead.store(true, Ordering::Release);
        self.rx.wake_all();
        self.tx.wake_all();
    }
}

impl Link for ShmLink {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.rx.try_read(buf).map_err(io_err)
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// Reads what came on the socket (grants, requests for them, doorbells; its end), beats,
    /// and looks at the peer's beat.
    fn service(&self, now: Instant, readable: bool) -> Option<Instant> {
        let mut w = self.watch.lock();
        if w.done {
            return None;
        }
        let mut dead = false;
        // After set-up the socket carries grants and doorbells only (`grant`): the end, an
        // error, or a broken message ends the connection. Read only when the engine saw it
        // readable (its one-shot interest reports what comes meanwhile): no system call for
        // a turn something else caused.
        // A read that came back short took what was there: the engine's interest, armed again
        // after this turn, fires at once for what came since (a read to `EAGAIN` cost a
        // second system call on every doorbell).
        const MAX: usize = 64 * MSG;
        let mut more = readable;
        while more {
            more = match sys::recv_with_fds_now(&self.sock, MAX) {
                Ok(Some((bytes, fds))) => {
                    let full = bytes.len() == MAX;
                    let taken = w.inbound.take(&bytes, fds, &self.sock, &self.server, &self.grants);
                    if let Err(e) = &taken {
                        tracing::warn!("shm peer dropped: {}", crate::Report(e));
                    }
                    dead = taken.is_err();
                    !dead && full
                }
                Ok(None) => false,
                Err(_) => {
                    dead = true;
                    false
                }
            };
        }
        self.grants.sweep();
        if !dead && now >= w.next_beat {
            self.rx.beat();
            let beat = self.tx.peer_beat();
            if w.seen != Some(beat) {
                (w.seen, w.since) = (Some(beat), now);
            } else if now - w.since >= KEEPALIVE {
                tracing::warn!("the shm peer's heartbeat stood still for {KEEPALIVE:?}: taken to be dead");
                dead = true;
            }
            w.next_beat = now + BEAT;
        }
        if dead {
            w.done = true;
            self.grants.close();
            self.peer_died();
            return None;
        }
        Some(w.next_beat)
    }

    fn always_watched(&self) -> bool {
        true
    }

    fn has_bytes(&self) -> bool {
        self.rx.has_bytes()
    }

    fn arm_read(&self) -> bool {
        self.rx.arm_read()
    }

    fn arm_write(&self) -> bool {
        self.tx.arm_write()
    }

    fn disarm(&self) {
        self.rx.disarm_read();
        self.tx.disarm_write();
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.tx.try_write(buf).map_err(io_err)
    }

    fn try_write2(&self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        self.tx.try_write2(a, b).map_err(io_err)
    }

    fn shutdown_write(&self) {
        self.tx.close();
    }

    fn shutdown(&self) {
        self.tx.close();
        self.rx.abandon();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.grants.close();
        self.peer_died();
    }
}
