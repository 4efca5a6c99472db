//! Gradient all-reduce for training: N processes sum a vector of f32 each step, by a ring
//! reduce-scatter and all-gather over RDMA Write with immediate into registered chunks, the
//! steps' slots handed back by FAA, each chunk split over several queue pairs per neighbour.
//! Every step's sum is checked against a local computation; step time, algorithm bandwidth
//! (vector bytes / step time) and CPU time per step are reported beside the same all-reduce
//! over plain TCP, in the same run.
//!
//! ```text
//! P=127.0.0.1:7480,127.0.0.1:7482,127.0.0.1:7484
//! cargo run --release --example allreduce -- --rank 1 --peers $P &
//! cargo run --release --example allreduce -- --rank 2 --peers $P &
//! cargo run --release --example allreduce -- --rank 0 --peers $P
//! ```
//! Rank r listens on `peers[r]` (RDMA) and on the next port (TCP). Any provider, any hosts.

#[path = "../common/mod.rs"]
mod common;

mod links;
mod ring;
mod tcp;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser)]
#[command(about = "ring all-reduce of f32 vectors by RDMA Write with immediate, beside TCP")]
struct Args {
    /// Transport provider: tcp, shm (processes on one host), verbs or verbs:<device> (default: RDMA_RPC_PROVIDER, else tcp).
    #[arg(long)]
    provider: Option<String>,
    /// This process's rank.
    #[arg(long)]
    rank: usize,
    /// Every rank's address, in rank order (2 to 8); each also listens on the next port for TCP.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<SocketAddr>,
    /// Vector sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576,16777216,67108864")]
    sizes: Vec<usize>,
    /// Queue pairs per neighbour, each carrying a part of every chunk.
    #[arg(long, default_value_t = 2)]
    lanes: usize,
    /// All-reduces per size and transport; by default from the size (200 of 4 KiB down to
    /// 3 of 64 MiB). Every rank must be given the same.
    #[arg(long)]
    rounds: Option<u64>,
}

/// Rank `r`'s value at float `i` in all-reduce `it`: small integers, so sums are exact.
fn value(r: usize, i: usize, it: u64) -> f32 {
    ((r * 7 + i * 3 + it as usize) % 11) as f32
}

fn sum(n: usize, i: usize, it: u64) -> f32 {
    (0..n).map(|r| value(r, i, it)).sum()
}

/// Step times and this process's CPU time over them.
struct Run {
    steps: Vec<Duration>,
    cpu: Duration,
}

impl Run {
    fn p50(&mut self) -> Duration {
        self.steps.sort();
        self.steps[self.steps.len() / 2]
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    common::exit_code(run().await)
}

async fn run() -> common::Result<()> {
    let a = Args::parse();
    let n = a.peers.len();
    if !(2..=8).contains(&n) || a.rank >= n || a.lanes == 0 {
        return Err(format!(
            "--peers names {n} ranks (2 to 8), --rank {} must be one of them, --lanes at least 1",
            a.rank
        )
        .into());
    }
    let device = common::device(a.provider.as_deref())?;
    // Each chunk goes in `parts` pieces, a multiple of 4 bytes each, spread over the lanes; more
    // pieces than lanes where one would exceed the device's largest message (8 MiB on rxe).
    let largest = a.sizes.iter().copied().max().unwrap_or(4096);
    let part_of = |bytes: usize, parts: usize| bytes.div_ceil(4 * n * parts).max(1) * 4;
    let max_msg = usize::try_from(device.caps().max_msg_size).unwrap_or(usize::MAX);
    let mut parts = a.lanes;
    while part_of(largest, parts) > max_msg {
        parts += a.lanes;
    }
    let links = links::connect(&device, &a.peers, a.rank, a.lanes, parts * part_of(largest, parts))?;
    let mut ring = ring::Ring::new(&links)?;
    let mut tcp = tcp::TcpRing::connect(&a.peers, a.rank)?;
    if a.rank == 0 {
        println!(
            "all-reduce of f32 vectors, {n} ranks, {} lanes per neighbour, provider {}",
            a.lanes,
            device.provider()
        );
        println!(
            "{:>10} {:>6} {:>14} {:>12} {:>14} {:>12} {:>13} {:>13}",
            "bytes", "steps", "rdma p50[us]", "rdma[GB/s]", "tcp p50[us]", "tcp[GB/s]", "rdma cpu[us]", "tcp cpu[us]"
        );
    }
    let mut it = 0u64;
    for &size in &a.sizes {
        let part = part_of(size, parts);
        let floats = n * parts * part / 4;
        let mut v = ring::Vector::new(&links, n, parts, part)?;
        let mut plain = vec![0f32; floats];
        // The same number of all-reduces on every rank: a count measured by time would differ
        // between ranks, so it comes from the size.
        let rounds = a.rounds.unwrap_or((200_000_000 / size.max(1) as u64).clamp(3, 200));
        let mut rdma = Run {
            steps: Vec::new(),
            cpu: Duration::ZERO,
        };
        let c0 = common::process_cpu_time();
        for _ in 0..rounds {
            it += 1;
            v.fill(|i| value(a.rank, i, it))?;
            let t = Instant::now();
            ring.allreduce(&links, &mut v, n, a.rank).await?;
            rdma.steps.push(t.elapsed());
            if let Some((i, got, want)) = v.check(|i| sum(n, i, it))? {
                return Err(format!("RDMA all-reduce {it}, {size} B: float {i} is {got}, the sum is {want}").into());
            }
        }
        rdma.cpu = common::process_cpu_time() - c0;
        let mut plain_run = Run {
            steps: Vec::new(),
            cpu: Duration::ZERO,
        };
        let c0 = common::process_cpu_time();
        for _ in 0..rounds {
            it += 1;
            for (i, x) in plain.iter_mut().enumerate() {
                *x = value(a.rank, i, it);
            }
            let t = Instant::now();
            tcp.allreduce(&mut plain, n, a.rank)?;
            plain_run.steps.push(t.elapsed());
            if let Some(i) = (0..floats).find(|&i| plain[i] != sum(n, i, it)) {
                return Err(format!(
                    "TCP all-reduce {it}, {size} B: float {i} is {}, the sum is {}",
                    plain[i],
                    sum(n, i, it)
                )
                .into());
            }
        }
        plain_run.cpu = common::process_cpu_time() - c0;
        let bytes = floats * 4;
        let (r50, t50) = (rdma.p50(), plain_run.p50());
        let gbs = |d: Duration| bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
        let cpu = |r: &Run| r.cpu.as_secs_f64() * 1e6 / rounds as f64;
        if a.rank == 0 {
            println!(
                "{bytes:>10} {rounds:>6} {:>14.1} {:>12.3} {:>14.1} {:>12.3} {:>13.1} {:>13.1}",
                r50.as_secs_f64() * 1e6,
                gbs(r50),
                t50.as_secs_f64() * 1e6,
                gbs(t50),
                cpu(&rdma),
                cpu(&plain_run)
            );
        } else {
            println!(
                "rank {} {bytes} B: cpu per all-reduce rdma {:.1} us, tcp {:.1} us",
                a.rank,
                cpu(&rdma),
                cpu(&plain_run)
            );
        }
    }
    println!("rank {}: every sum checked, {it} all-reduces", a.rank);
    Ok(())
}
