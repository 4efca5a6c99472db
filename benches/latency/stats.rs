//! One row of the report: perftest's columns plus throughput and CPU per operation.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::host::Ticks;
use crate::sampler::Samples;

/// How a row's latency is counted, as perftest does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Convention {
    /// Full round trip (RPCs, Read, atomics, baselines).
    Rtt,
    /// Half a ping-pong round trip (Send and Write latency, as ib_send_lat / ib_write_lat).
    HalfRtt,
}

impl Convention {
    pub fn label(self) -> &'static str {
        match self {
            Convention::Rtt => "RTT",
            Convention::HalfRtt => "RTT/2",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub mode: String,
    pub convention: Convention,
    pub bytes: usize,
    pub iterations: usize,
    pub t_min: f64,
    pub t_max: f64,
    pub t_typical: f64,
    pub t_avg: f64,
    pub t_stdev: f64,
    pub p99: f64,
    pub p999: f64,
    /// Payload bytes moved per operation (both directions) over the mean time.
    pub mb_per_s: f64,
    /// Process CPU time (user + sys) per operation.
    pub cpu_us_per_op: f64,
    /// The median of each round alone (`--rounds`), in the order they ran: each round measures
    /// the row on connections of its own.
    pub round_p50: Vec<f64>,
    /// The hypervisor's steal while the row was timed, in % of the guest's CPU time (absent
    /// without `/proc/stat`, or for a row too short for its 10 ms ticks to say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal_pct: Option<f64>,
    /// The two threads' cross-core round trip measured right after each round of the row, in
    /// ns, in the order of `round_p50`: the host's placement of the two vCPUs at that moment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub round_xcore_ns: Vec<f64>,
    /// The hypervisor's steal while each round of the row was timed, in % and in the order of
    /// `round_p50`; `None` for a round too short for the ticks to say.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub round_steal_pct: Vec<Option<f64>>,
}

/// Builds a row from per-operation samples (already halved for RTT/2 rows).
pub fn row(mode: &str, convention: Convention, bytes: usize, moved: usize, s: &Samples) -> Row {
    let (samples, cpu) = (&s.times[..], s.cpu);
    let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds");
    let ns: Vec<u64> = samples.iter().map(|d| (d.as_nanos() as u64).max(1)).collect();
    for &v in &ns {
        let _ = h.record(v);
    }
    let n = ns.len().max(1) as f64;
    let avg = ns.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = ns.iter().map(|&v| (v as f64 - avg).powi(2)).sum::<f64>() / n;
    let us = |v: f64| v / 1000.0;
    Row {
        mode: mode.to_owned(),
        convention,
        bytes,
        iterations: ns.len(),
        t_min: us(ns.iter().copied().min().unwrap_or(0) as f64),
        t_max: us(ns.iter().copied().max().unwrap_or(0) as f64),
        t_typical: us(h.value_at_quantile(0.5) as f64),
        t_avg: us(avg),
        t_stdev: us(var.sqrt()),
        p99: us(h.value_at_quantile(0.99) as f64),
        p999: us(h.value_at_quantile(0.999) as f64),
        mb_per_s: if avg > 0.0 {
            moved as f64 / (avg / 1e9) / 1e6
        } else {
            0.0
        },
        cpu_us_per_op: cpu.as_secs_f64() * 1e6 / n,
        round_p50: round_medians(samples, &s.rounds),
        steal_pct: s
            .ticks
            .iter()
            .try_fold(Ticks::default(), |all, t| t.map(|t| all.plus(t)))
            .and_then(Ticks::steal_pct),
        round_xcore_ns: s.xcore_ns.clone(),
        round_steal_pct: s.ticks.iter().map(|t| t.and_then(Ticks::steal_pct)).collect(),
    }
}

/// The median of each round's stretch of `samples` (`rounds` holds their lengths), in µs.
fn round_medians(samples: &[Duration], rounds: &[usize]) -> Vec<f64> {
    let mut out = Vec::with_capacity(rounds.len());
    let mut at = 0;
    for &n in rounds {
        let Some(round) = samples.get(at..at + n) else { break };
        at += n;
        let mut v: Vec<Duration> = round.to_vec();
        v.sort_unstable();
        if let Some(m) = v.get(v.len() / 2) {
            out.push(m.as_secs_f64() * 1e6);
        }
    }
    out
}
