//! A queue pair's byte link over shared memory: our inbox ring (we consume), the peer's inbox
//! ring (we produce), two doorbells (ours, which our progress engine watches and the peer rings
//! when it wrote to a sleeping reader or freed room for a sleeping writer; and the peer's), and
//! the Unix socket the connection was set up on, which carries the grants of memory (`grant`)
//! and tells that the peer process died (the kernel closes it then). A process that stops or
//! hangs keeps its socket open: each side's watcher (a task on the progress engine, as the
//! queue pair is) beats in its own inbox's header, and takes a peer whose beat stands still for
//! [`KEEPALIVE`] to be dead, as a NIC's retries give up on a host that stopped answering.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;

use super::grant::{Grants, Inbound, Server, MSG};
use super::ring::{Ring, RingError};
use super::sys;
use crate::nic::progress::{Handle, Next, Progress, Task, Why};
use crate::nic::{Link, BEAT, KEEPALIVE};

pub(crate) struct ShmLink {
    rx: Ring,
    tx: Ring,
    /// Our doorbell: the peer rings it, our progress engine watches it.
    bell: Arc<OwnedFd>,
    /// The watcher's place on the progress engine; it goes before the socket it watches.
    watcher: Mutex<Option<Handle>>,
    sock: UnixStream,
    peer_dead: Arc<AtomicBool>,
}

fn io_err(e: RingError) -> io::Error {
    match e {
        RingError::Closed => io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the queue pair"),
        RingError::Corrupt => io::Error::new(io::ErrorKind::InvalidData, "the peer corrupted the ring"),
    }
}

/// The watcher: grants coming on the socket, our heartbeat, and the peer's.
struct Watcher {
    link: Weak<ShmLink>,
    server: Arc<Server>,
    grants: Arc<Grants>,
    state: Mutex<WatchState>,
}

struct WatchState {
    inbound: Inbound,
    /// The peer's beat as last seen, and since when.
    seen: Option<u64>,
    since: Instant,
    next_beat: Instant,
    done: bool,
}

impl ShmLink {
    /// Puts the watcher on `progress`: it beats, and turns the socket's end, or a peer whose
    /// beat stood still for [`KEEPALIVE`], into `peer_dead`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rx: Ring,
        tx: Ring,
        bell: OwnedFd,
        sock: UnixStream,
        peer_dead: Arc<AtomicBool>,
        server: Arc<Server>,
        grants: Arc<Grants>,
        progress: &Progress,
    ) -> crate::Result<Arc<ShmLink>> {
        let link = Arc::new(ShmLink {
            rx,
            tx,
            bell: Arc::new(bell),
            watcher: Mutex::new(None),
            sock,
            peer_dead,
        });
        link.rx.beat();
        let now = Instant::now();
        let watcher = Arc::new(Watcher {
            link: Arc::downgrade(&link),
            server,
            grants,
            state: Mutex::new(WatchState {
                inbound: Inbound::new(),
                seen: None,
                since: now,
                next_beat: now + BEAT,
                done: false,
            }),
        });
        let handle = progress.register(watcher, Some(link.sock.as_fd()))?;
        *link.watcher.lock() = Some(handle);
        Ok(link)
    }

    /// The peer is gone: every wait of ours ends.
    fn peer_died(&self) {
        self.peer_dead.store(true, Ordering::Release);
        self.rx.wake_all();
        self.tx.wake_all();
        // Our own engine, which may wait for the peer, looks again.
        crate::nic::bell::ring(&self.bell);
    }
}

impl Task for Watcher {
    fn turn(&self, _why: Why) -> Next {
        let mut st = self.state.lock();
        if st.done {
            return Next::default();
        }
        let Some(l) = self.link.upgrade() else {
            st.done = true;
            self.grants.close();
            return Next::default();
        };
        let mut dead = false;
        // After set-up the socket carries grants only (`grant`): the end, an error, or a broken
        // message ends the connection.
        loop {
            match sys::recv_with_fds_now(&l.sock, 64 * MSG) {
                Ok(Some((bytes, fds))) => {
                    if let Err(e) = st.inbound.take(&bytes, fds, &l.sock, &self.server, &self.grants) {
                        tracing::warn!("shm peer dropped: {e}");
                        dead = true;
                        break;
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    dead = true;
                    break;
                }
            }
        }
        self.grants.sweep();
        let now = Instant::now();
        if !dead && now >= st.next_beat {
            l.rx.beat();
            let beat = l.tx.peer_beat();
            if st.seen != Some(beat) {
                (st.seen, st.since) = (Some(beat), now);
            } else if now - st.since >= KEEPALIVE {
                tracing::warn!("the shm peer's heartbeat stood still for {KEEPALIVE:?}: taken to be dead");
                dead = true;
            }
            st.next_beat = now + BEAT;
        }
        if dead {
            st.done = true;
            self.grants.close();
            l.peer_died();
            return Next::default();
        }
        Next {
            read: true,
            write: false,
            at: Some(st.next_beat),
        }
    }
}

impl Link for ShmLink {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.rx.try_read(buf).map_err(io_err)
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        self.bell.as_fd()
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
        let _ = rustix::io::read(&*self.bell, &mut [0u8; 8]);
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        self.tx.try_write(buf).map_err(io_err)
    }

    fn shutdown_write(&self) {
        self.tx.close();
    }

    fn shutdown(&self) {
        self.tx.close();
        self.rx.abandon();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        // Our own engine may wait on our inbox: it sees the end.
        self.peer_died();
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        // The watcher goes before the socket it watches.
        if let Some(h) = self.watcher.get_mut().take() {
            h.deregister();
        }
    }
}
