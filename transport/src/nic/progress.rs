//! The progress engine of a software device: a fixed number of threads (one by default) that
//! serve every queue pair of the device, as a NIC's processing units serve all of its queues.
//!
//! A queue pair's engine is a [`Task`]: it turns when its descriptor is ready (epoll, one-shot:
//! re-armed after each turn with the interest the turn asks for), when somebody wakes it (a
//! poster queued bytes, a poller handed a frame over, a receive was posted), or when its timer
//! is due (the RNR budget, a retry of memory the application holds, a heartbeat). A turn never
//! waits: what it cannot finish now, it asks to be turned again for. So nothing in the device
//! grows a thread per queue pair, per connection or per timer.
//!
//! Timers are a heap of deadlines, one live entry per task (a newer deadline voids the older by
//! its generation): at 10,000 tasks a push or pop costs some 14 comparisons, and the timers a
//! NIC model needs are as short as 200 µs, below a wheel's usual tick.
//!
//! A task turns on one thread at a time: a thread that finds it turning leaves its reasons for
//! the turning thread, which turns it again before it lets go.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::epoll;

use crate::{Error, Result};

/// The environment variable that sets a software device's progress threads (default 1).
pub(crate) const THREADS_ENV: &str = "RDMA_RPC_PROGRESS_THREADS";

/// The most progress threads a device may have.
const MAX_THREADS: usize = 64;

/// Why a task turns (several reasons may come together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Why {
    /// Its descriptor has something to read (or an end).
    pub(crate) readable: bool,
    /// Its descriptor takes bytes.
    pub(crate) writable: bool,
    /// Its timer is due.
    pub(crate) timer: bool,
    /// Somebody woke it.
    pub(crate) woken: bool,
}

const READABLE: u8 = 1;
const WRITABLE: u8 = 2;
const TIMER: u8 = 4;
const WOKEN: u8 = 8;

impl Why {
    fn bits(self) -> u8 {
        let bit = |on: bool, b: u8| if on { b } else { 0 };
        bit(self.readable, READABLE) | bit(self.writable, WRITABLE) | bit(self.timer, TIMER) | bit(self.woken, WOKEN)
    }

    fn from_bits(b: u8) -> Why {
        Why {
            readable: b & READABLE != 0,
            writable: b & WRITABLE != 0,
            timer: b & TIMER != 0,
            woken: b & WOKEN != 0,
        }
    }
}

/// What a task waits for after a turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Next {
    /// Turn when its descriptor has something to read.
    pub(crate) read: bool,
    /// Turn when its descriptor takes bytes.
    pub(crate) write: bool,
    /// Turn at this time at the latest.
    pub(crate) at: Option<Instant>,
}

/// Something the engine turns.
pub(crate) trait Task: Send + Sync + 'static {
    /// One turn: does what can be done now, never waiting, and says what to wait for next.
    fn turn(&self, why: Why) -> Next;
}

/// A task's bookkeeping.
struct Cell {
    task: Arc<dyn Task>,
    fd: Option<RawFd>,
    /// Held while the task turns.
    turning: Mutex<()>,
    /// Reasons that came while it turned (or before its turn began).
    pending: AtomicU8,
    /// Queued to turn for a wake-up.
    queued: AtomicBool,
    /// The interest its descriptor is armed with (`None`: disarmed, its one shot fired).
    armed: Mutex<Option<(bool, bool)>>,
    /// The live timer entry's generation and deadline.
    timer: Mutex<(u64, Option<Instant>)>,
    gone: AtomicBool,
}

struct Shared {
    epoll: OwnedFd,
    /// Rung to have a thread look at the ready queue and the timers.
    wake: OwnedFd,
    cells: Mutex<HashMap<u64, Arc<Cell>>>,
    next_token: AtomicU64,
    ready: Mutex<VecDeque<u64>>,
    timers: Mutex<BinaryHeap<Reverse<(Instant, u64, u64)>>>,
    stop: AtomicBool,
    /// Turns run so far, of every task (what the engine costs, for tests).
    turns: AtomicU64,
}

const WAKE_TOKEN: u64 = u64::MAX;

thread_local! {
    /// The task this thread turns now (0: none).
    static TURNING: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A device's progress engine. Threads start with the first task and stop when the engine is
/// dropped (the device with it).
pub(crate) struct Progress {
    shared: Arc<Shared>,
    threads: usize,
    started: OnceLock<std::result::Result<(), String>>,
}

/// A task's place in the engine: wakes it, and takes it out (see [`Handle::deregister`];
/// dropping it does too). The task itself holds a [`Waker`], not this: the engine holds the
/// task until it is taken out.
pub(crate) struct Handle {
    token: u64,
    cell: Arc<Cell>,
    shared: Arc<Shared>,
}

/// Wakes a task (cheap to clone; does nothing once the task is taken out).
#[derive(Clone)]
pub(crate) struct Waker {
    token: u64,
    cell: std::sync::Weak<Cell>,
    shared: std::sync::Weak<Shared>,
}

impl Waker {
    /// Has the task turn soon (on an engine thread).
    pub(crate) fn wake(&self) {
        let (Some(cell), Some(shared)) = (self.cell.upgrade(), self.shared.upgrade()) else {
            return;
        };
        wake(&shared, self.token, &cell);
    }
}

fn wake(shared: &Shared, token: u64, cell: &Cell) {
    if !cell.gone.load(Ordering::Acquire) && !cell.queued.swap(true, Ordering::AcqRel) {
        shared.ready.lock().push_back(token);
        crate::nic::bell::ring(&shared.wake);
    }
}

impl Progress {
    /// An engine with `threads` threads (started with the first task).
    pub(crate) fn new(threads: usize) -> Result<Progress> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| Error::io("creating a progress engine (epoll)", e.into()))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| Error::io("creating a progress engine's wake-up (eventfd)", e.into()))?;
        epoll::add(
            &epoll,
            &wake,
            epoll::EventData::new_u64(WAKE_TOKEN),
            epoll::EventFlags::IN | epoll::EventFlags::ONESHOT,
        )
        .map_err(|e| Error::io("adding a progress engine's wake-up to its set (epoll)", e.into()))?;
        Ok(Progress {
            shared: Arc::new(Shared {
                epoll,
                wake,
                cells: Mutex::new(HashMap::new()),
                next_token: AtomicU64::new(1),
                ready: Mutex::new(VecDeque::new()),
                timers: Mutex::new(BinaryHeap::new()),
                stop: AtomicBool::new(false),
                turns: AtomicU64::new(0),
            }),
            threads: threads.clamp(1, MAX_THREADS),
            started: OnceLock::new(),
        })
    }

    /// Turns run so far, of every task.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn turns(&self) -> u64 {
        self.shared.turns.load(Ordering::Relaxed)
    }

    /// The thread count asked for by [`THREADS_ENV`] (1 when unset or not a number).
    pub(crate) fn threads_from_env() -> usize {
        std::env::var(THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1)
    }

    fn start(&self) -> Result<()> {
        let started = self.started.get_or_init(|| {
            for i in 0..self.threads {
                let shared = self.shared.clone();
                std::thread::Builder::new()
                    .name(format!("rdma-progress-{i}"))
                    .spawn(move || shared.run())
                    .map_err(|e| format!("spawning a progress thread: {e}"))?;
            }
            Ok(())
        });
        started
            .clone()
            .map_err(|e| Error::io("starting a progress engine", std::io::Error::other(e)))
    }

    /// Adds `task`, watching `fd` (which must stay open until the task is deregistered) with
    /// the interest of its first turn, which runs at once.
    pub(crate) fn register(&self, task: Arc<dyn Task>, fd: Option<BorrowedFd<'_>>) -> Result<Handle> {
        self.start()?;
        let s = &self.shared;
        let token = s.next_token.fetch_add(1, Ordering::Relaxed);
        let cell = Arc::new(Cell {
            task,
            fd: fd.map(|f| std::os::fd::AsRawFd::as_raw_fd(&f)),
            turning: Mutex::new(()),
            pending: AtomicU8::new(0),
            queued: AtomicBool::new(false),
            armed: Mutex::new(Some((false, false))),
            timer: Mutex::new((0, None)),
            gone: AtomicBool::new(false),
        });
        if let Some(fd) = fd {
            epoll::add(
                &s.epoll,
                fd,
                epoll::EventData::new_u64(token),
                epoll::EventFlags::ONESHOT,
            )
            .map_err(|e| Error::io("adding a queue pair to its device's progress engine (epoll)", e.into()))?;
        }
        s.cells.lock().insert(token, cell.clone());
        let h = Handle {
            token,
            cell,
            shared: s.clone(),
        };
        h.wake();
        Ok(h)
    }
}

/// A device's progress engine, made when first asked for.
#[derive(Default)]
pub(crate) struct Lazy {
    engine: OnceLock<Progress>,
    making: Mutex<()>,
}

impl Lazy {
    /// The engine, made with [`THREADS_ENV`]'s thread count the first time.
    pub(crate) fn get(&self) -> Result<&Progress> {
        if let Some(p) = self.engine.get() {
            return Ok(p);
        }
        let _one = self.making.lock();
        if let Some(p) = self.engine.get() {
            return Ok(p);
        }
        let p = Progress::new(Progress::threads_from_env())?;
        Ok(self.engine.get_or_init(|| p))
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for _ in 0..self.threads {
            crate::nic::bell::ring(&self.shared.wake);
        }
    }
}

impl Handle {
    /// Has the task turn soon (on an engine thread).
    pub(crate) fn wake(&self) {
        wake(&self.shared, self.token, &self.cell);
    }

    /// A waker for the task to keep.
    pub(crate) fn waker(&self) -> Waker {
        Waker {
            token: self.token,
            cell: Arc::downgrade(&self.cell),
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// Takes the task out: it does not turn again once this returns (a turn under way on
    /// another thread is waited for; called from the task's own turn, that turn is its last).
    pub(crate) fn deregister(&self) {
        if self.cell.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.cells.lock().remove(&self.token);
        if let Some(fd) = self.cell.fd {
            // SAFETY: the task's owner keeps the descriptor open until after this returns.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let _ = epoll::delete(&self.shared.epoll, fd);
        }
        // A turn under way ends before this returns; none starts after (`gone`).
        if TURNING.with(std::cell::Cell::get) != self.token {
            drop(self.cell.turning.lock());
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.deregister();
    }
}

impl Shared {
    fn run(self: Arc<Self>) {
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 256];
        loop {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let timeout = self.until_next_timer().map(|d| rustix::event::Timespec {
                tv_sec: d.as_secs().try_into().unwrap_or(i64::MAX),
                tv_nsec: d.subsec_nanos().into(),
            });
            let events = match epoll::wait(&self.epoll, &mut buf[..], timeout.as_ref()) {
                Ok((events, _)) => events,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!(%e, "a progress engine's epoll_wait failed");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            for (token, flags) in events.iter().map(|e| (e.data.u64(), e.flags)) {
                if token == WAKE_TOKEN {
                    let _ = rustix::io::read(&self.wake, &mut [0u8; 8]);
                    let _ = epoll::modify(
                        &self.epoll,
                        &self.wake,
                        epoll::EventData::new_u64(WAKE_TOKEN),
                        epoll::EventFlags::IN | epoll::EventFlags::ONESHOT,
                    );
                    continue;
                }
                let end = epoll::EventFlags::HUP | epoll::EventFlags::ERR | epoll::EventFlags::RDHUP;
                let why = Why {
                    readable: flags.intersects(epoll::EventFlags::IN | end),
                    writable: flags.intersects(epoll::EventFlags::OUT | end),
                    ..Why::default()
                };
                if let Some(cell) = self.cell(token) {
                    // Its one shot fired: disarmed until its turn arms it again.
                    *cell.armed.lock() = None;
                    self.turn(token, &cell, why);
                }
            }
            loop {
                let Some(token) = self.ready.lock().pop_front() else {
                    break;
                };
                if let Some(cell) = self.cell(token) {
                    cell.queued.store(false, Ordering::Release);
                    self.turn(
                        token,
                        &cell,
                        Why {
                            woken: true,
                            ..Why::default()
                        },
                    );
                }
            }
            self.fire_timers();
        }
    }

    fn cell(&self, token: u64) -> Option<Arc<Cell>> {
        self.cells.lock().get(&token).cloned()
    }

    /// How long until the earliest live timer. Entries a later deadline voided are dropped from
    /// the top first: a task that pushes its deadline back at every turn (the heartbeat, the
    /// pollers' grace) would otherwise wake a thread for nothing once per turn.
    fn until_next_timer(&self) -> Option<Duration> {
        let mut t = self.timers.lock();
        loop {
            let &Reverse((at, token, gen)) = t.peek()?;
            let live = self.cell(token).is_some_and(|c| c.timer.lock().0 == gen);
            if live {
                return Some(at.saturating_duration_since(Instant::now()));
            }
            t.pop();
        }
    }

    fn fire_timers(&self) {
        loop {
            let due = {
                let mut t = self.timers.lock();
                match t.peek() {
                    Some(Reverse((at, _, _))) if *at <= Instant::now() => t.pop(),
                    _ => None,
                }
            };
            let Some(Reverse((_, token, gen))) = due else { return };
            let Some(cell) = self.cell(token) else { continue };
            if cell.timer.lock().0 != gen {
                continue; // voided by a later deadline
            }
            self.turn(
                token,
                &cell,
                Why {
                    timer: true,
                    ..Why::default()
                },
            );
        }
    }

    /// Turns `cell`'s task for `why`, and again for what came meanwhile; or leaves `why` to the
    /// thread that turns it now.
    fn turn(&self, token: u64, cell: &Arc<Cell>, why: Why) {
        cell.pending.fetch_or(why.bits(), Ordering::SeqCst);
        loop {
            let Some(guard) = cell.turning.try_lock() else { return };
            if cell.gone.load(Ordering::Acquire) {
                return;
            }
            let bits = cell.pending.swap(0, Ordering::SeqCst);
            if bits != 0 {
                self.turns.fetch_add(1, Ordering::Relaxed);
                let outer = TURNING.with(|t| t.replace(token));
                // A task that panics is a bug of its own: it is taken off the engine, and every
                // other task of the device goes on.
                let turned =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cell.task.turn(Why::from_bits(bits))));
                TURNING.with(|t| t.set(outer));
                let Ok(next) = turned else {
                    tracing::error!(
                        token,
                        "a task of the progress engine panicked: it is taken off the engine"
                    );
                    cell.gone.store(true, Ordering::Release);
                    self.cells.lock().remove(&token);
                    if let Some(fd) = cell.fd {
                        // SAFETY: the task's owner keeps the descriptor open while it is
                        // registered, and it is until its handle goes.
                        let _ = epoll::delete(&self.epoll, unsafe { BorrowedFd::borrow_raw(fd) });
                    }
                    return;
                };
                if cell.gone.load(Ordering::Acquire) {
                    return;
                }
                self.apply(token, cell, next);
            }
            drop(guard);
            if cell.pending.load(Ordering::SeqCst) == 0 {
                return;
            }
        }
    }

    /// Arms the descriptor and the timer as a turn asked.
    fn apply(&self, token: u64, cell: &Cell, next: Next) {
        if let Some(fd) = cell.fd {
            let want = (next.read, next.write);
            let mut armed = cell.armed.lock();
            if *armed != Some(want) {
                let mut flags = epoll::EventFlags::ONESHOT | epoll::EventFlags::RDHUP;
                if next.read {
                    flags |= epoll::EventFlags::IN;
                }
                if next.write {
                    flags |= epoll::EventFlags::OUT;
                }
                // SAFETY: the task's owner keeps the descriptor open while it is registered
                // (deregistration waits for this turn).
                let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                match epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(token), flags) {
                    Ok(()) => *armed = Some(want),
                    Err(e) => tracing::warn!(%e, "re-arming a queue pair's descriptor failed"),
                }
            }
        }
        // The cell's timer, then the heap, never both at once (`until_next_timer` takes them
        // the other way round).
        let gen = {
            let mut timer = cell.timer.lock();
            if timer.1 == next.at {
                return;
            }
            timer.0 += 1;
            timer.1 = next.at;
            timer.0
        };
        // No thread is rung for a deadline earlier than the ones they sleep until: turns run
        // on an engine thread only, and this one reckons its next wait from the heap after
        // its turns (a ring cost a write, and a read and a re-arm on the next round, on most
        // turns: a QP's grace timer moves at each).
        if let Some(at) = next.at {
            self.timers.lock().push(Reverse((at, token, gen)));
        }
    }
}

impl AsFd for Progress {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Counter {
        turns: AtomicUsize,
        timers: AtomicUsize,
        again_at: Mutex<Option<Instant>>,
    }

    impl Task for Counter {
        fn turn(&self, why: Why) -> Next {
            self.turns.fetch_add(1, Ordering::SeqCst);
            if why.timer {
                self.timers.fetch_add(1, Ordering::SeqCst);
            }
            Next {
                at: self.again_at.lock().take(),
                ..Next::default()
            }
        }
    }

    fn wait_for(what: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_task_turns_when_woken_and_when_its_timer_is_due_and_never_after_deregistering() {
        let p = Progress::new(1).expect("engine");
        let c = Arc::new(Counter {
            turns: AtomicUsize::new(0),
            timers: AtomicUsize::new(0),
            again_at: Mutex::new(Some(Instant::now() + Duration::from_millis(20))),
        });
        let h = p.register(c.clone(), None).expect("register");
        wait_for(|| c.timers.load(Ordering::SeqCst) == 1);
        let before = c.turns.load(Ordering::SeqCst);
        h.wake();
        wait_for(|| c.turns.load(Ordering::SeqCst) > before);
        *c.again_at.lock() = Some(Instant::now() + Duration::from_millis(30));
        h.wake();
        wait_for(|| c.turns.load(Ordering::SeqCst) > before + 1);
        h.deregister();
        let after = c.turns.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(c.turns.load(Ordering::SeqCst), after, "no turn after deregistering");
        assert_eq!(c.timers.load(Ordering::SeqCst), 1, "the voided timer never fired");
    }

    #[test]
    fn a_task_that_panics_is_taken_off_and_the_others_go_on() {
        struct Bad;
        impl Task for Bad {
            fn turn(&self, _why: Why) -> Next {
                panic!("a bug in a task");
            }
        }
        let p = Progress::new(1).expect("engine");
        let bad = p.register(Arc::new(Bad), None).expect("register");
        let c = Arc::new(Counter {
            turns: AtomicUsize::new(0),
            timers: AtomicUsize::new(0),
            again_at: Mutex::new(None),
        });
        let good = p.register(c.clone(), None).expect("register");
        wait_for(|| c.turns.load(Ordering::SeqCst) >= 1);
        bad.wake();
        good.wake();
        wait_for(|| c.turns.load(Ordering::SeqCst) >= 2);
        drop(bad); // taken off already: dropping it waits for nothing
    }

    #[test]
    fn a_descriptor_turns_its_task_once_per_arming() {
        struct Reader {
            fd: OwnedFd,
            reads: AtomicUsize,
        }
        impl Task for Reader {
            fn turn(&self, why: Why) -> Next {
                if why.readable {
                    self.reads.fetch_add(1, Ordering::SeqCst);
                    let _ = rustix::io::read(&self.fd, &mut [0u8; 8]);
                }
                Next {
                    read: true,
                    ..Next::default()
                }
            }
        }
        let p = Progress::new(2).expect("engine");
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).expect("eventfd");
        let r = Arc::new(Reader {
            fd,
            reads: AtomicUsize::new(0),
        });
        let h = p.register(r.clone(), Some(r.fd.as_fd())).expect("register");
        for i in 1..=5 {
            crate::nic::bell::ring(&r.fd);
            wait_for(|| r.reads.load(Ordering::SeqCst) >= i);
        }
        drop(h);
        assert_eq!(r.reads.load(Ordering::SeqCst), 5);
    }
}
