//! `--sweep throughput`: calls per second under load, the way eRPC's small- and large-RPC
//! throughput apps measure them. An echo server runs in a child process (rdma-rpc on the run's
//! provider, a tokio TCP echo, tarpc); this process keeps calls going on its connections and
//! times each. Every row runs on a fresh server.
//!
//! Rows by calls in flight on one connection (`--in-flight`) at each size (`--sizes`), then by
//! connections (`--conns`, each with `--conn-in-flight` calls) at the first size; each in every
//! completion mode of rdma-rpc (`--completion`) and, with `--busy 0,1`, once more beside a busy
//! process. The raw provider's Send message rate at each depth runs beside them.

mod load;
pub mod report;
pub mod server;

use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rdma_rpc::transport::Device;
use serde::Serialize;

use server::{Busy, Remote, System};

/// One row of the throughput table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `rpc`, `tcp`, `tarpc`, or `raw-send` (the provider's Send rate, messages per second).
    pub system: String,
    /// rdma-rpc's completion mode (the baselines: `-`).
    pub completion: String,
    /// A busy process ran beside the row.
    pub busy: bool,
    pub bytes: usize,
    pub conns: usize,
    /// Calls in flight per connection.
    pub in_flight: usize,
    pub calls: u64,
    pub seconds: f64,
    pub calls_per_s: f64,
    /// Latency of a call under this load, µs.
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// Process CPU time per call, µs: the client's (this process) and the server's.
    pub client_cpu_us: f64,
    pub server_cpu_us: f64,
    /// The server with its connections open and idle, per connection.
    pub server_rss_kib_per_conn: f64,
    pub server_registered_per_conn: f64,
    /// The server's threads with the connections open (total), and before they were made.
    pub server_threads: usize,
    pub server_threads_before: usize,
    pub error: Option<String>,
}

/// What the sweep is asked for.
pub struct Plan {
    pub systems: Vec<System>,
    pub completions: Vec<String>,
    pub sizes: Vec<usize>,
    pub in_flight: Vec<usize>,
    pub conns: Vec<usize>,
    pub conn_in_flight: usize,
    pub busy: Vec<bool>,
    pub raw: bool,
    pub client_threads: usize,
    pub server_threads: usize,
    pub seconds: f64,
    pub ip: IpAddr,
}

/// One row to measure.
#[derive(Clone)]
struct Spec {
    system: System,
    completion: String,
    busy: bool,
    size: usize,
    conns: usize,
    in_flight: usize,
}

impl Plan {
    fn specs(&self) -> Vec<Spec> {
        let mut out = Vec::new();
        let mut push = |system, completion: &str, busy, size, conns, in_flight| {
            out.push(Spec {
                system,
                completion: completion.to_owned(),
                busy,
                size,
                conns,
                in_flight,
            });
        };
        for &busy in &self.busy {
            for &system in &self.systems {
                let modes: Vec<&str> = match system {
                    System::Rpc | System::RpcPool => self.completions.iter().map(String::as_str).collect(),
                    _ => vec!["-"],
                };
                for mode in modes {
                    for &size in &self.sizes {
                        for &d in &self.in_flight {
                            push(system, mode, busy, size, 1, d);
                        }
                    }
                    if let Some(&size) = self.sizes.first() {
                        for &n in self.conns.iter().filter(|&&n| n > 1) {
                            push(system, mode, busy, size, n, self.conn_in_flight);
                        }
                    }
                }
            }
        }
        out
    }
}

/// Runs the sweep; the rows in the order measured.
pub fn sweep(plan: &Plan, dev: &Device) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    crate::scale::raise_fd_limit();
    let specs = plan.specs();
    let raw_rows = if plan.raw {
        plan.busy.len() * plan.sizes.len() * plan.in_flight.len()
    } else {
        0
    };
    let per_row = Duration::from_secs_f64((plan.seconds / (specs.len() + raw_rows).max(1) as f64).max(0.3));
    println!(
        "rdma-rpc throughput: provider {} (device {}), server in a child process ({} thread{}), client {} thread{}, {:.2} s a row, {}",
        dev.provider(),
        dev.name(),
        plan.server_threads,
        if plan.server_threads == 1 { "" } else { "s" },
        plan.client_threads,
        if plan.client_threads == 1 { "" } else { "s" },
        per_row.as_secs_f64(),
        crate::chrono_free_date()
    );
    println!("host: {}", crate::host::describe());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(plan.client_threads.max(1))
        .thread_name("tput-client")
        .enable_all()
        .build()?;
    let bar = ProgressBar::new((specs.len() + raw_rows) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} rows  {msg}  [{elapsed_precise}]",
    )?);
    let mut rows = Vec::new();
    for &busy in &plan.busy {
        let _busy = if busy { Some(Busy::start()?) } else { None };
        for s in specs.iter().filter(|s| s.busy == busy) {
            bar.set_message(format!(
                "{} {} {} B, {} conn x {} in flight{}",
                s.system.name(),
                s.completion,
                s.size,
                s.conns,
                s.in_flight,
                if busy { ", busy" } else { "" }
            ));
            rows.push(measure(&rt, dev, plan, s, per_row));
            bar.inc(1);
        }
        if plan.raw {
            for &size in &plan.sizes {
                for &d in &plan.in_flight {
                    bar.set_message(format!("raw Send {size} B, depth {d}"));
                    rows.push(raw_row(dev, plan.ip, size, d, busy, per_row));
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    Ok(rows)
}

/// The provider's Send rate at `depth` (post lists of 1), as a row.
fn raw_row(dev: &Device, ip: IpAddr, size: usize, depth: usize, busy: bool, per_row: Duration) -> Row {
    let depth = u32::try_from(depth).unwrap_or(u32::MAX).min(4096);
    let mut row = empty_row("raw-send", "-", busy, size, 1, depth as usize);
    match crate::rate::measure(dev, ip, crate::rate::Op::Send, size, depth, 1, per_row) {
        Ok(r) => {
            row.calls = r.iterations;
            row.seconds = per_row.as_secs_f64();
            row.calls_per_s = r.msg_rate * 1e6;
        }
        Err(e) => row.error = Some(e),
    }
    row
}

fn empty_row(system: &str, completion: &str, busy: bool, bytes: usize, conns: usize, in_flight: usize) -> Row {
    Row {
        system: system.to_owned(),
        completion: completion.to_owned(),
        busy,
        bytes,
        conns,
        in_flight,
        calls: 0,
        seconds: 0.0,
        calls_per_s: 0.0,
        p50_us: 0.0,
        p99_us: 0.0,
        p999_us: 0.0,
        client_cpu_us: 0.0,
        server_cpu_us: 0.0,
        server_rss_kib_per_conn: 0.0,
        server_registered_per_conn: 0.0,
        server_threads: 0,
        server_threads_before: 0,
        error: None,
    }
}

/// One row on a fresh server; a failure becomes the row's `error`.
fn measure(rt: &tokio::runtime::Runtime, dev: &Device, plan: &Plan, s: &Spec, per_row: Duration) -> Row {
    let mut row = empty_row(s.system.name(), &s.completion, s.busy, s.size, s.conns, s.in_flight);
    if let Err(e) = measure_into(rt, dev, plan, s, per_row, &mut row) {
        row.error = Some(e);
    }
    row
}

fn measure_into(
    rt: &tokio::runtime::Runtime,
    dev: &Device,
    plan: &Plan,
    s: &Spec,
    per_row: Duration,
    row: &mut Row,
) -> Result<(), String> {
    let mut remote = Remote::start(s.system, &s.completion, s.conns, plan.server_threads, plan.ip)?;
    let before = remote.stats()?;
    let mode = server::completion(&s.completion).unwrap_or_default();
    let cfg = if s.system == System::RpcPool {
        server::pool_client_config(mode, s.conns)
    } else {
        server::config(mode, s.conns)
    };
    let conns = rt.block_on(load::connect(s.system, dev, remote.addr, s.conns, &cfg))?;
    // The connections settle (the server's side of the last ones is made after the client's).
    std::thread::sleep(Duration::from_millis(100));
    let idle = remote.stats()?;
    let per_conn = |a: u64, b: u64| a.saturating_sub(b) as f64 / s.conns as f64;
    row.server_rss_kib_per_conn = per_conn(idle.rss_kib, before.rss_kib);
    // A receive pool registered as the server bound counts, shared out over the connections.
    row.server_registered_per_conn = per_conn(idle.registered + before.at_bind, before.registered);
    row.server_threads = idle.threads;
    row.server_threads_before = before.threads;
    let gate = load::Gate::new(plan.client_threads);
    let tasks = {
        let _in = rt.enter();
        load::start(conns, s.in_flight, s.size, &gate)
    };
    // Warm-up: a tenth of the row, at least 100 ms.
    std::thread::sleep((per_row / 10).max(Duration::from_millis(100)));
    let (server0, client0) = (remote.stats()?, cpu_time::ProcessTime::now());
    let started = Instant::now();
    gate.open.store(true, Ordering::Relaxed);
    std::thread::sleep(per_row);
    gate.open.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let (server1, client_cpu) = (remote.stats()?, client0.elapsed());
    gate.stop.store(true, Ordering::Relaxed);
    rt.block_on(async {
        for t in tasks {
            match tokio::time::timeout(Duration::from_secs(30), t).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(format!("a load task failed: {e}")),
                Err(_) => return Err("a call did not end within 30 s of the row's end".to_owned()),
            }
        }
        Ok(())
    })?;
    if let Some(e) = gate.error.lock().ok().and_then(|g| g.clone()) {
        return Err(e);
    }
    let h = gate.latencies();
    let calls = gate.calls.load(Ordering::Relaxed);
    row.calls = calls;
    row.seconds = elapsed.as_secs_f64();
    row.calls_per_s = calls as f64 / elapsed.as_secs_f64().max(1e-9);
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    (row.p50_us, row.p99_us, row.p999_us) = (us(0.5), us(0.99), us(0.999));
    let per_call = |us: f64| us / calls.max(1) as f64;
    row.client_cpu_us = per_call(client_cpu.as_micros() as f64);
    row.server_cpu_us = per_call(server1.cpu_us.saturating_sub(server0.cpu_us) as f64);
    Ok(())
}

fn label(r: &Row) -> String {
    if r.completion == "-" {
        r.system.clone()
    } else {
        format!("{} {}", r.system, r.completion)
    }
}

/// The tables: by calls in flight, then by connections; each for idle and busy runs.
pub fn tables(rows: &[Row]) {
    for busy in [false, true] {
        let by_depth: Vec<&Row> = rows.iter().filter(|r| r.busy == busy && r.conns == 1).collect();
        if !by_depth.is_empty() {
            heading(&format!(
                "calls/s by calls in flight, one connection{}",
                if busy { ", a busy process beside" } else { "" }
            ));
            println!(
                " {:<16} {:>8} {:>9} {:>12} {:>9} {:>9} {:>9} {:>11} {:>11}",
                "system",
                "#bytes",
                "in-flight",
                "calls/s",
                "p50[us]",
                "p99[us]",
                "p99.9[us]",
                "cli CPU/us",
                "srv CPU/us"
            );
            for r in by_depth {
                line(r, r.in_flight);
            }
        }
        let by_conns: Vec<&Row> = rows.iter().filter(|r| r.busy == busy && r.conns > 1).collect();
        if !by_conns.is_empty() {
            heading(&format!(
                "calls/s by connections{}",
                if busy { ", a busy process beside" } else { "" }
            ));
            println!(
                " {:<16} {:>8} {:>9} {:>12} {:>9} {:>9} {:>9} {:>11} {:>11} {:>12} {:>12} {:>8}",
                "system",
                "#bytes",
                "#conns",
                "calls/s",
                "p50[us]",
                "p99[us]",
                "p99.9[us]",
                "cli CPU/us",
                "srv CPU/us",
                "reg/conn[B]",
                "RSS/conn[K]",
                "threads"
            );
            for r in by_conns {
                line(r, r.conns);
            }
        }
    }
}

fn heading(title: &str) {
    println!();
    println!("{}", "-".repeat(110));
    println!(" {title}");
    println!("{}", "-".repeat(110));
}

fn line(r: &Row, key: usize) {
    if let Some(e) = &r.error {
        println!(" {:<16} {:>8} {:>9}   failed: {e}", label(r), r.bytes, key);
        return;
    }
    print!(
        " {:<16} {:>8} {:>9} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>11.2} {:>11.2}",
        label(r),
        r.bytes,
        key,
        r.calls_per_s,
        r.p50_us,
        r.p99_us,
        r.p999_us,
        r.client_cpu_us,
        r.server_cpu_us
    );
    if r.conns > 1 {
        print!(
            " {:>12.0} {:>12.1} {:>8}",
            r.server_registered_per_conn, r.server_rss_kib_per_conn, r.server_threads
        );
    }
    println!();
}
