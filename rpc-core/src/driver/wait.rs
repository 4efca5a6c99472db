//! The wait policy of [`CompletionMode`]: how long a poller spins before it sleeps, and when it
//! stops spinning because its CPU is wanted elsewhere.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::config::CompletionMode;

/// Lets the runtime run other tasks once, then continues: how a spinning task gives way.
///
/// Unlike `tokio::task::yield_now`, which defers the task until the runtime has polled its IO
/// driver (a syscall per spin), this only queues the task again behind the others.
pub(crate) async fn reschedule() {
    let mut queued = false;
    std::future::poll_fn(|cx| {
        if queued {
            return std::task::Poll::Ready(());
        }
        queued = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// Connections of this process spinning for completions now ([`SpinToken::take`]).
static SPINNERS: AtomicU32 = AtomicU32::new(0);

/// Leave for one connection to spin for completions, while fewer connections of the process
/// than it has CPUs spin; given back when dropped. A process of thousands of connections whose
/// every idle one spun its budget (a server, or a client of many servers) spent its cores
/// spinning, each connection's turn a trip through the runtime; the others sleep on their CQs
/// meanwhile, and one connection alone spins as before.
pub(crate) struct SpinToken(());

impl SpinToken {
    pub(crate) fn take() -> Option<SpinToken> {
        static MAX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        let max = *MAX.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32));
        SPINNERS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| SpinToken(()))
    }
}

impl Drop for SpinToken {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How often a spinning thread looks at how long it waited for a CPU ([`cpu_contended`]).
const CONTENTION_WINDOW: Duration = Duration::from_millis(20);

thread_local! {
    /// This thread's current window: asks since it started, when, and the runqueue wait then;
    /// and the verdict of the last whole window.
    static WINDOW: std::cell::Cell<Window> = const {
        std::cell::Cell::new(Window { asks: 0, start: None, waited_ns: 0, contended: false })
    };
}

#[derive(Clone, Copy)]
struct Window {
    asks: u32,
    start: Option<Instant>,
    waited_ns: u64,
    contended: bool,
}

/// Whether the calling thread, while it spun, waited for a CPU (runnable but not running) for
/// more than a quarter of the last window of [`CONTENTION_WINDOW`] or more: the machine has
/// more runnable threads than cores (a busy process beside a client and a server on two cores
/// makes each wait a third of the time; on an idle machine a spinner waits about 1%), and a
/// spinner there takes a core its peer or another process needs. Read from the kernel's
/// scheduler statistics (`/proc/thread-self/schedstat`, second field) once per window, with a
/// clock read per 64 asks. A window starts afresh after the thread slept ([`window_restart`]),
/// whose wake-ups wait for a CPU too. Never true where the kernel keeps no such statistics.
fn cpu_contended() -> bool {
    fn runqueue_wait_ns() -> Option<u64> {
        let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        s.split_whitespace().nth(1)?.parse().ok()
    }
    WINDOW.with(|cell| {
        let mut w = cell.get();
        w.asks = w.asks.wrapping_add(1);
        if w.asks % 64 == 1 {
            let now = Instant::now();
            let due = w
                .start
                .is_none_or(|s| now.saturating_duration_since(s) >= CONTENTION_WINDOW);
            if due {
                if let Some(waited) = runqueue_wait_ns() {
                    w.contended = w.start.is_some_and(|s| {
                        u128::from(waited.saturating_sub(w.waited_ns)) * 4 > now.saturating_duration_since(s).as_nanos()
                    });
                    w.waited_ns = waited;
                    w.start = Some(now);
                }
            }
        }
        cell.set(w);
        w.contended
    })
}

/// The calling thread's window starts again at its next ask (it is about to sleep).
fn window_restart() {
    WINDOW.with(|cell| {
        let mut w = cell.get();
        w.start = None;
        w.asks = 0;
        w.contended = false;
        cell.set(w);
    });
}

/// How long a connection sleeps instead of spinning once a spin was held up (see
/// [`Backoff`]); doubled, up to [`BACKOFF_MAX`], each time spinning is held up again right after.
pub(crate) const BACKOFF: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_millis(640);

/// A connection's adaptive spinning, switched off for [`BACKOFF`] when its thread waits for a
/// CPU ([`cpu_contended`]), or when a spinner found a gap longer than the whole spin budget
/// between two of its rounds of polls: its thread was off the CPU (another process took the
/// core) or the runtime had that much other work. Either way the CPU is wanted elsewhere, and a spinner only keeps its peer, or the work it waits
/// for, from running: on a machine with more runnable threads than cores, calls then wait for
/// the scheduler's time slices (milliseconds) instead of for each other. Sleeping until a
/// completion wakes it gives the core away; spinning resumes when the back-off ends.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    until: Option<Instant>,
    /// The last back-off's length, and when it ended: held up again within a window of its
    /// end, the next one is twice as long.
    last: Duration,
    ended: Option<Instant>,
}

impl Backoff {
    /// Whether spinning is off now (a clock read only while it is).
    fn active(&mut self) -> bool {
        match self.until {
            Some(u) if Instant::now() < u => true,
            Some(u) => {
                self.until = None;
                self.ended = Some(u);
                false
            }
            None => false,
        }
    }

    fn start(&mut self, now: Instant) {
        let again = self
            .ended
            .is_some_and(|e| now.saturating_duration_since(e) < 2 * CONTENTION_WINDOW);
        let length = if again {
            (self.last * 2).min(BACKOFF_MAX)
        } else {
            BACKOFF
        };
        tracing::trace!("spinning held up: sleeping instead for {length:?}");
        self.last = length;
        self.until = Some(now + length);
        window_restart();
    }
}

/// The spin budget of [`CompletionMode::Adaptive`], timed from the first round of polls that
/// found nothing after the last activity (a round: 256 polls of a waiting call, 64 of the
/// connection's driver), not from the activity itself: a connection whose messages come
/// within a round (a ping-pong, a busy server) then reads no clock at all, where it read it
/// twice per message (a syscall per read on hosts whose clocksource is the HPET,
/// such as the soft-RoCE VM). A waiter so spins at most one round longer than the budget.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    /// When the first idle round since the last activity ended; `None` before it.
    idle_since: Option<Instant>,
    /// When [`spins`](Self::spins) last said yes after an idle round.
    last: Option<Instant>,
}

impl Budget {
    /// Activity (a completion, a command): the budget starts again at the next idle round.
    pub(crate) fn restart(&mut self) {
        self.idle_since = None;
        self.last = None;
    }

    /// A round of polls found nothing: the budget's clock starts, unless it runs already. Only
    /// an adaptive budget has a clock: `Spin` (the VM lane's mode) reads none.
    pub(crate) fn idle_round(&mut self, mode: CompletionMode) {
        if self.idle_since.is_none() && matches!(mode, CompletionMode::Adaptive { spin } if !spin.is_zero()) {
            let now = Instant::now();
            self.idle_since = Some(now);
            self.last = Some(now);
        }
    }

    /// Whether `mode` spins on. On every provider, tcp included: a wake-up costs more than
    /// the spin budget's CPU (on tcp a spinning poll also reads the socket itself, where a
    /// sleeping caller waits for the engine's reader thread and then for its own wake-up).
    /// An adaptive budget also stops, and `backoff` starts, when the gap since the last round
    /// was longer than the budget ([`Backoff`]).
    pub(crate) fn spins(&mut self, mode: CompletionMode, backoff: &mut Backoff) -> bool {
        match mode {
            CompletionMode::Spin => true,
            // No budget: no spinning at all, not even the first round.
            CompletionMode::Adaptive { spin } if spin.is_zero() => false,
            CompletionMode::Adaptive { spin } => {
                if backoff.active() {
                    return false;
                }
                if cpu_contended() {
                    backoff.start(Instant::now());
                    return false;
                }
                let Some(idle) = self.idle_since else {
                    return true;
                };
                let now = Instant::now();
                if self.last.is_some_and(|t| now.saturating_duration_since(t) > spin) {
                    backoff.start(now);
                    self.last = None;
                    return false;
                }
                self.last = Some(now);
                now.saturating_duration_since(idle) < spin
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adaptive_budget_runs_from_the_first_idle_round_and_restarts_on_activity() {
        let tiny = CompletionMode::Adaptive {
            spin: Duration::from_nanos(1),
        };
        let mut off = Backoff::default();
        let mut b = Budget::default();
        assert!(b.spins(tiny, &mut off), "no idle round yet: the budget has not started");
        b.idle_round(tiny);
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            !b.spins(tiny, &mut off),
            "a 1 ns budget is spent 2 ms after its first idle round"
        );
        b.idle_round(tiny);
        off = Backoff::default();
        assert!(!b.spins(tiny, &mut off), "a later idle round does not start it again");
        b.restart();
        off = Backoff::default();
        assert!(b.spins(tiny, &mut off), "activity: the budget starts again");
        let plenty = CompletionMode::Adaptive {
            spin: Duration::from_secs(3600),
        };
        b.idle_round(plenty);
        assert!(b.spins(plenty, &mut off));
        let none = CompletionMode::Adaptive { spin: Duration::ZERO };
        b.restart();
        assert!(
            !b.spins(none, &mut off),
            "a zero budget never spins, not even a first round"
        );
        assert!(b.spins(CompletionMode::Spin, &mut off) && !b.spins(CompletionMode::Event, &mut off));
        b.idle_round(CompletionMode::Spin);
        b.idle_round(none);
        assert!(b.idle_since.is_none(), "only an adaptive budget reads the clock");
    }

    #[test]
    fn a_gap_longer_than_the_budget_between_rounds_stops_spinning_for_the_backoff() {
        let mode = CompletionMode::Adaptive {
            spin: Duration::from_millis(5),
        };
        let mut off = Backoff::default();
        let mut b = Budget::default();
        b.idle_round(mode);
        assert!(b.spins(mode, &mut off), "rounds back to back spin on");
        // The thread was away longer than the budget (another process had the core).
        std::thread::sleep(Duration::from_millis(12));
        assert!(!b.spins(mode, &mut off), "a held-up spinner stops");
        b.restart();
        assert!(
            !b.spins(mode, &mut off),
            "the back-off outlives the call: no spinning until it ends"
        );
        std::thread::sleep(BACKOFF + Duration::from_millis(2));
        assert!(b.spins(mode, &mut off), "after the back-off, spinning resumes");
        b.idle_round(mode);
        assert!(b.spins(mode, &mut off), "and is not stopped again without a new gap");
        // Spin mode spins whatever happened: it has no budget to measure gaps against.
        std::thread::sleep(Duration::from_millis(12));
        assert!(b.spins(CompletionMode::Spin, &mut off));
    }
}
