//! How many iterations a row gets, and the timed loop itself.

use std::time::{Duration, Instant};

use cpu_time::ProcessTime;

use crate::host::{self, Ticks};

/// Iteration policy: a fixed count, or as many as fit in `per_row` (bounded).
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub iters: Option<usize>,
    pub per_row: Duration,
    pub min_iters: usize,
    pub max_iters: usize,
}

/// Samples of one row and the process CPU time they took.
pub struct Samples {
    pub times: Vec<Duration>,
    pub cpu: Duration,
    /// How many of `times` each round took, in order (one entry until rounds are merged).
    pub rounds: Vec<usize>,
    /// The guest's CPU ticks while each round's `times` were taken, in the order of `rounds`
    /// (`None` without `/proc/stat`).
    pub ticks: Vec<Option<Ticks>>,
    /// The two threads' cross-core round trip measured right after each round, in ns (see
    /// `baseline::cross_core`), in the order of `rounds`.
    pub xcore_ns: Vec<f64>,
}

impl Samples {
    /// Adds another round's samples of the same row.
    pub fn absorb(&mut self, other: Samples) {
        self.times.extend(other.times);
        self.cpu += other.cpu;
        self.rounds.extend(other.rounds);
        self.ticks.extend(other.ticks);
        self.xcore_ns.extend(other.xcore_ns);
    }
}

/// Runs `op` for warm-up, sizes the row from the warm-up's median operation, then times each
/// operation. `op` returns the duration it measured itself (e.g. RTT/2), or `None` to use the
/// wall time. The warm-up runs at least 20 operations and, within a tenth of the row's share of
/// the time, up to 200: the first pass of a connection through its receive ring is several
/// times slower than the rest (each slot's pages are touched for the first time: 4-13 us per
/// operation on shm, against 1.3), and a ring of 64 outlasted a warm-up of 20, which then sized
/// its row to a fraction of its share.
pub async fn run(plan: Plan, mut op: impl AsyncFnMut() -> Option<Duration>) -> Samples {
    let (min_warm, max_warm) = match plan.iters {
        Some(n) => {
            let w = (n / 10).clamp(2, 100);
            (w, w)
        }
        None => (20, 200),
    };
    let budget = plan.per_row / 10;
    let mut warm_times = Vec::with_capacity(max_warm);
    let t0 = Instant::now();
    while warm_times.len() < min_warm || (warm_times.len() < max_warm && t0.elapsed() < budget) {
        let t = Instant::now();
        op().await;
        warm_times.push(t.elapsed());
    }
    warm_times.sort_unstable();
    let typical = warm_times.get(warm_times.len() / 2).copied().unwrap_or_default();
    let iters = plan.iters.unwrap_or_else(|| {
        let fit = (plan.per_row.as_secs_f64() / typical.as_secs_f64().max(1e-9)) as usize;
        fit.clamp(plan.min_iters, plan.max_iters)
    });
    let mut times = Vec::with_capacity(iters);
    let cpu0 = ProcessTime::now();
    let ticks0 = host::ticks();
    for _ in 0..iters {
        let t = Instant::now();
        let own = op().await;
        times.push(own.unwrap_or_else(|| t.elapsed()));
    }
    let cpu = cpu0.elapsed();
    let ticks = ticks0.zip(host::ticks()).map(|(t0, t1)| t1.since(t0));
    Samples {
        rounds: vec![times.len()],
        times,
        cpu,
        ticks: vec![ticks],
        xcore_ns: Vec::new(),
    }
}
