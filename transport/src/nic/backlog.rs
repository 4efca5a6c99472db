//! Connection requests whose handshake is complete, for the software providers' listeners. The
//! listening socket and every handshake in progress are tasks on the device's progress engine
//! (`nic/progress.rs`): no thread per listener or per connection. A handshake reads what has
//! come without waiting, within [`HANDSHAKE`]; `accept` hands out the complete ones. A slow or
//! silent client never holds up others: when every handshake slot is taken, the oldest
//! handshake in progress is cut off to make room, so clients that trickle their handshake
//! cannot keep a prompt one out.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::nic::progress::{Handle, Next, Progress, Task, Why};
use crate::{Error, Result};

/// Handshakes read at once; a connection beyond cuts the oldest one in progress off.
const MAX_HANDSHAKES: usize = 256;

/// Longest wait for a client's half of a handshake, all of it.
pub(crate) const HANDSHAKE: Duration = Duration::from_secs(10);

/// How long the acceptor waits after an error of `accept` (other than running out of
/// descriptors, which it answers) before it tries again.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Why a connection is refused that came while this process had no file descriptor left.
pub(crate) const OUT_OF_FDS: &str = "its process is out of file descriptors (RLIMIT_NOFILE): raise its limit \
                                     (`ulimit -n`) or have it hold fewer connections";

const _: () = assert!(OUT_OF_FDS.len() <= crate::cm::MAX_REJECT_REASON);

/// True for the errors of a process, or a system, out of file descriptors.
fn out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// A handshake in progress, as a provider reads it.
pub(crate) trait Handshake<R>: Send + 'static {
    /// The connection's descriptor, watched for readability (none once the handshake gave its
    /// connection away).
    fn fd(&self) -> Option<BorrowedFd<'_>>;
    /// Takes what has come, without waiting: `Ok(Some(request))` once the handshake is whole,
    /// `Ok(None)` to wait for more; an error ends it (the provider told the client why, if it
    /// could).
    fn step(&mut self) -> Result<Option<R>>;
}

/// How a listener takes connections: `accept` without waiting (`None` when none is there),
/// `begin` for a connection's handshake, `refuse` for one taken with the descriptor kept in
/// reserve (out of descriptors: it tells the client so, with a handshake that ends in the
/// refusal, if it has one to wait for).
pub(crate) struct Acceptor<C, R> {
    pub(crate) accept: Box<dyn FnMut() -> Option<std::io::Result<C>> + Send>,
    pub(crate) begin: Box<dyn Fn(C) -> Shake<R> + Send + Sync>,
    pub(crate) refuse: Box<dyn Fn(C) -> Option<Shake<R>> + Send + Sync>,
}

/// A handshake, boxed.
pub(crate) type Shake<R> = Box<dyn Handshake<R>>;

/// The queue between the handshakes and `accept`.
pub(crate) struct Backlog<R> {
    queue: Mutex<VecDeque<R>>,
    cv: Condvar,
    closed: AtomicBool,
    /// The handshakes in progress, oldest first, each with its number and its place on the
    /// progress engine (dropping it cuts the handshake off).
    in_progress: Mutex<VecDeque<(u64, Handle)>>,
    next_id: AtomicU64,
    /// The listening socket's place on the progress engine.
    acceptor: Mutex<Option<Handle>>,
}

/// The listening socket as a task.
struct Accepting<C, R> {
    backlog: Weak<Backlog<R>>,
    /// Held while the listener listens (its device's progress engine turns this).
    device: crate::Device,
    state: Mutex<AcceptState<C, R>>,
}

struct AcceptState<C, R> {
    how: Acceptor<C, R>,
    /// A descriptor kept in reserve, for taking a connection to refuse when out of them.
    spare: Option<std::fs::File>,
}

/// A handshake as a task.
struct Shaking<R> {
    id: u64,
    backlog: Weak<Backlog<R>>,
    deadline: Instant,
    hs: Mutex<Option<Box<dyn Handshake<R>>>>,
}

fn open_spare() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

impl<R: Send + 'static> Backlog<R> {
    /// Puts the listening socket `fd` on `device`'s progress engine (`fd` must stay open until
    /// [`close`](Self::close)).
    pub(crate) fn start<C: Send + 'static>(
        device: &crate::Device,
        fd: BorrowedFd<'_>,
        how: Acceptor<C, R>,
    ) -> Result<Arc<Self>> {
        let backlog = Arc::new(Backlog {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            closed: AtomicBool::new(false),
            in_progress: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(1),
            acceptor: Mutex::new(None),
        });
        let task = Arc::new(Accepting {
            backlog: Arc::downgrade(&backlog),
            device: device.clone(),
            state: Mutex::new(AcceptState {
                how,
                spare: open_spare(),
            }),
        });
        let handle = device.inner.imp.progress()?.register(task, Some(fd))?;
        *backlog.acceptor.lock() = Some(handle);
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

    /// The listener is going: it takes no more connections, and the handshakes in progress
    /// are cut off. Returns once the listening socket is off the progress engine.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let acceptor = self.acceptor.lock().take();
        drop(acceptor);
        let cut: Vec<_> = self.in_progress.lock().drain(..).collect();
        drop(cut);
    }

    /// A handshake ended: its place on the engine goes (from its own turn).
    fn ended(&self, id: u64) {
        let mut in_progress = self.in_progress.lock();
        let gone = in_progress
            .iter()
            .position(|(i, _)| *i == id)
            .map(|at| in_progress.remove(at));
        drop(in_progress);
        drop(gone);
    }

    fn push(&self, r: R) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        self.queue.lock().push_back(r);
        self.cv.notify_one();
    }

    /// Starts a handshake on `progress`, cutting the oldest one off when every slot is taken.
    fn begin(self: &Arc<Self>, progress: &Progress, hs: Box<dyn Handshake<R>>) {
        let cut = {
            let mut in_progress = self.in_progress.lock();
            // A prompt client is done long before 256 newer ones arrive; one that trickles its
            // hello is not.
            (in_progress.len() >= MAX_HANDSHAKES)
                .then(|| in_progress.pop_front())
                .flatten()
        };
        drop(cut);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let task = Arc::new(Shaking {
            id,
            backlog: Arc::downgrade(self),
            deadline: Instant::now() + HANDSHAKE,
            hs: Mutex::new(None),
        });
        // Registered while `hs` owns the descriptor; `hs` then moves into the task (a move does
        // not close it), which keeps it until the task is taken out.
        let Some(fd) = hs.fd() else { return };
        let registered = progress.register(task.clone(), Some(fd));
        let handle = match registered {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(%e, "a connection's handshake could not start");
                return;
            }
        };
        let waker = handle.waker();
        // In the list before the handshake can end: its end takes it off the engine at once.
        self.in_progress.lock().push_back((id, handle));
        *task.hs.lock() = Some(hs);
        waker.wake();
    }
}

impl<C: Send + 'static, R: Send + 'static> Task for Accepting<C, R> {
    fn turn(&self, _why: Why) -> Next {
        let Some(backlog) = self.backlog.upgrade() else {
            return Next::default();
        };
        if backlog.closed.load(Ordering::Acquire) {
            return Next::default();
        }
        let Ok(progress) = self.device.inner.imp.progress() else {
            return Next::default();
        };
        let mut st = self.state.lock();
        loop {
            let conn = match (st.how.accept)() {
                None => break,
                Some(Ok(c)) => c,
                Some(Err(e)) if out_of_fds(&e) && st.spare.is_some() => {
                    tracing::warn!(%e, "out of file descriptors: refusing a connection");
                    drop(st.spare.take()); // the reserve, for this connection
                    if let Some(Ok(c)) = (st.how.accept)() {
                        if let Some(hs) = (st.how.refuse)(c) {
                            backlog.begin(progress, hs);
                        }
                    }
                    st.spare = open_spare();
                    continue;
                }
                Some(Err(e)) => {
                    tracing::warn!(%e, "accepting a connection failed");
                    st.spare = st.spare.take().or_else(open_spare);
                    return Next {
                        read: false,
                        write: false,
                        at: Some(Instant::now() + ACCEPT_RETRY),
                    };
                }
            };
            let hs = (st.how.begin)(conn);
            backlog.begin(progress, hs);
        }
        Next {
            read: true,
            write: false,
            at: None,
        }
    }
}

impl<R: Send + 'static> Task for Shaking<R> {
    fn turn(&self, _why: Why) -> Next {
        let Some(backlog) = self.backlog.upgrade() else {
            return Next::default();
        };
        let mut slot = self.hs.lock();
        let Some(hs) = slot.as_mut() else {
            return Next::default(); // not moved in yet: the wake after it turns this again
        };
        let outcome = if Instant::now() >= self.deadline {
            Err(Error::Timeout(crate::cm::NO_HANDSHAKE))
        } else {
            hs.step()
        };
        match outcome {
            Ok(None) => Next {
                read: true,
                write: false,
                at: Some(self.deadline),
            },
            Ok(Some(r)) => {
                slot.take();
                // Off the engine first: the request's connection is then free to be a QP's.
                let next = self.finish(&backlog);
                backlog.push(r);
                next
            }
            Err(e) => {
                tracing::debug!(%e, "a connection's handshake failed");
                slot.take();
                self.finish(&backlog)
            }
        }
    }
}

impl<R: Send + 'static> Shaking<R> {
    fn finish(&self, backlog: &Backlog<R>) -> Next {
        backlog.ended(self.id);
        Next::default()
    }
}
