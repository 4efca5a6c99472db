//! Connection requests whose handshake is complete, for the software providers' listeners: an
//! acceptor thread takes connections, a thread per connection reads its handshake (bounded),
//! and `accept` hands out the complete ones. A slow or silent client never holds up others:
//! when every handshake slot is taken, the oldest handshake in progress is cut off to make
//! room, so clients that trickle their handshake cannot keep a prompt one out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::{Error, Result};

/// Handshakes read at once; a connection beyond cuts the oldest one in progress off.
const MAX_HANDSHAKES: usize = 256;

/// Cuts a handshake in progress off (shuts its connection down, so that its read returns).
pub(crate) type Interrupt = Box<dyn Fn() + Send + Sync>;

/// Why a connection is refused that came while this process had no file descriptor left.
pub(crate) const OUT_OF_FDS: &str = "its process is out of file descriptors (RLIMIT_NOFILE): raise its limit \
                                     (`ulimit -n`) or have it hold fewer connections";

const _: () = assert!(OUT_OF_FDS.len() <= crate::cm::MAX_REJECT_REASON);

/// True for the errors of a process, or a system, out of file descriptors.
fn out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The queue between the acceptor and `accept`.
pub(crate) struct Backlog<R> {
    queue: Mutex<VecDeque<R>>,
    cv: Condvar,
    closed: AtomicBool,
    handshakes: AtomicUsize,
    /// The handshakes in progress, oldest first, each with its number and how to cut it off.
    in_progress: Mutex<VecDeque<(u64, Interrupt)>>,
}

impl<R: Send + 'static> Backlog<R> {
    /// Starts the acceptor thread: `next` blocks for the next connection (`None` once the
    /// listener is shut down), `handshake` turns one into a request (on its own thread), and
    /// `interrupt` gives what cuts that handshake off when a newer one needs its slot.
    ///
    /// A process out of file descriptors cannot take a connection, which would wait in the
    /// kernel's queue until its peer gives up. The acceptor keeps one descriptor in reserve
    /// for that: it lets it go, takes the connection, and hands it to `refuse` (which tells the
    /// peer [`OUT_OF_FDS`]), then takes the reserve back.
    pub(crate) fn start<C: Send + 'static>(
        name: &str,
        mut next: impl FnMut() -> Option<std::io::Result<C>> + Send + 'static,
        handshake: impl Fn(C) -> Result<R> + Send + Sync + 'static,
        interrupt: impl Fn(&C) -> Interrupt + Send + 'static,
        refuse: impl Fn(C) + Send + 'static,
    ) -> Result<Arc<Self>> {
        let open_spare = || std::fs::File::open("/dev/null").ok();
        let mut spare = open_spare();
        let backlog = Arc::new(Backlog {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            closed: AtomicBool::new(false),
            handshakes: AtomicUsize::new(0),
            in_progress: Mutex::new(VecDeque::new()),
        });
        let mut next_id = 0u64;
        let (b, handshake) = (backlog.clone(), Arc::new(handshake));
        std::thread::Builder::new()
            .name(format!("{name}-accept"))
            .spawn(move || loop {
                let accepted = next();
                if b.closed.load(Ordering::Acquire) {
                    return;
                }
                let conn = match accepted {
                    None => return,
                    Some(Ok(c)) => c,
                    Some(Err(e)) if out_of_fds(&e) && spare.is_some() => {
                        tracing::warn!(%e, "out of file descriptors: refusing a connection");
                        drop(spare.take()); // the reserve, for this connection
                        if let Some(Ok(c)) = next() {
                            refuse(c);
                        }
                        spare = open_spare();
                        continue;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(%e, "accepting a connection failed");
                        std::thread::sleep(Duration::from_millis(50)); // e.g. out of descriptors
                        spare = spare.or_else(open_spare);
                        continue;
                    }
                };
                if b.handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                    // Full: the oldest handshake gives way (its thread ends and frees its slot).
                    // A prompt client is done long before 256 newer ones arrive; one that
                    // trickles its hello is not.
                    if let Some((_, cut)) = b.in_progress.lock().pop_front() {
                        cut();
                    } else {
                        b.handshakes.fetch_sub(1, Ordering::AcqRel);
                        continue; // dropped: closed
                    }
                }
                next_id += 1;
                let id = next_id;
                b.in_progress.lock().push_back((id, interrupt(&conn)));
                let (b2, h) = (b.clone(), handshake.clone());
                let spawned = std::thread::Builder::new()
                    .name("rdma-rpc-handshake".into())
                    .spawn(move || {
                        let result = h(conn);
                        b2.in_progress.lock().retain(|(i, _)| *i != id);
                        match result {
                            Ok(req) if !b2.closed.load(Ordering::Acquire) => {
                                b2.queue.lock().push_back(req);
                                b2.cv.notify_one();
                            }
                            Ok(_) => {}
                            Err(e) => tracing::debug!(%e, "a connection's handshake failed"),
                        }
                        b2.handshakes.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    b.in_progress.lock().retain(|(i, _)| *i != id);
                    b.handshakes.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| Error::io("starting the acceptor thread", e))?;
        Ok(backlog)
    }

    /// The next complete request, waiting up to `timeout` (forever with `None`).
    pub(crate) fn accept(&self, timeout: Option<Duration>) -> Result<R> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut queue = self.queue.lock();
        loop {
            if let Some(r) = queue.pop_front() {
                return Ok(r);
            }
            match deadline {
                None => self.cv.wait(&mut queue),
                Some(d) => {
                    if self.cv.wait_until(&mut queue, d).timed_out() && queue.is_empty() {
                        return Err(Error::Timeout("waiting for a connection"));
                    }
                }
            }
        }
    }

    /// The listener is going: the acceptor stops at its next wake-up (shut the socket down to
    /// wake it), late handshakes are dropped.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}
