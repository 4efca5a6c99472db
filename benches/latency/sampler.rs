//! How many iterations a row gets, and the timed loop itself.

use std::time::{Duration, Instant};

use cpu_time::ProcessTime;

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
}

impl Samples {
    /// Adds another round's samples of the same row.
    pub fn absorb(&mut self, other: Samples) {
        self.times.extend(other.times);
        self.cpu += other.cpu;
    }
}

/// Runs `op` for warm-up, sizes the row from the warm-up's mean, then times each operation.
/// `op` returns the duration it measured itself (e.g. RTT/2), or `None` to use the wall time.
pub async fn run(plan: Plan, mut op: impl AsyncFnMut() -> Option<Duration>) -> Samples {
    let warm = plan.iters.map_or(20, |n| (n / 10).clamp(2, 100));
    let t0 = Instant::now();
    for _ in 0..warm {
        op().await;
    }
    let mean = t0.elapsed() / warm as u32;
    let iters = plan.iters.unwrap_or_else(|| {
        let fit = (plan.per_row.as_secs_f64() / mean.as_secs_f64().max(1e-9)) as usize;
        fit.clamp(plan.min_iters, plan.max_iters)
    });
    let mut times = Vec::with_capacity(iters);
    let cpu0 = ProcessTime::now();
    for _ in 0..iters {
        let t = Instant::now();
        let own = op().await;
        times.push(own.unwrap_or_else(|| t.elapsed()));
    }
    Samples {
        times,
        cpu: cpu0.elapsed(),
    }
}
