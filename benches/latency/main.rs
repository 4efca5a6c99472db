//! Latency by message size, the way perftest prints it: RPCs (automatic threshold, forced
//! eager, forced rendezvous, spin and event completion, request-only uploads), raw provider
//! operations, and memcpy, TCP and tarpc baselines, measured in one run on one machine.
//!
//!     cargo bench --bench latency -- [--provider tcp] [--sizes 64,4096] [--modes rpc,tcp] \
//!         [--iters N] [--seconds 60] [--json out.json] [--plot out.svg]
//!
//! `--sweep rate` measures the raw provider's message rate instead (perftest's `ib_send_bw` /
//! `ib_write_bw`, by depth and post list), `--sweep scale` what idle connections cost by how many
//! there are, `--sweep throughput` calls per second under load (by calls in flight and by
//! connections, beside a tokio TCP echo and tarpc).

mod baseline;
mod host;
mod perftest;
mod plot;
mod rate;
mod raw;
mod report;
mod rpc;
mod sampler;
mod scale;
mod service;
mod stats;
mod throughput;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rdma_rpc::transport::Device;
use rdma_rpc::CompletionMode;

use sampler::Plan;
use stats::{Convention, Row};

const ALL_MODES: &[&str] = &[
    "rpc",
    "rpc-body",
    "rpc-eager",
    "rpc-rendezvous",
    "rpc-spin",
    "rpc-event",
    "rpc-upload",
    "rpc-upload-vec",
    "rpc-behind",
    "rpc-behind-fifo",
    "rpc-one-thread",
    "service",
    "service-upload",
    "service-upload-vec",
    "memcpy",
    "send",
    "send-copy",
    "send-head",
    "send-event",
    "write",
    "read",
    "atomic",
    "tcp",
    "tarpc",
    "wake",
    "spin-word",
];

/// The sizes a mode is measured at: one for `atomic` and `spin-word` (8 B, the word),
/// `send-event` (64 B, beside the event-mode RPC) and `wake` (no payload), the sweep's
/// for the others.
fn mode_sizes(mode: &str, sizes: &[usize]) -> Vec<usize> {
    match mode {
        "atomic" => vec![8],
        "send-event" => vec![64],
        "wake" => vec![0],
        "spin-word" => vec![8],
        _ => sizes.to_vec(),
    }
}

/// The order of a round's rows.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    /// Every mode of a size back to back, sizes ascending: the rows a ratio compares are
    /// measured within a second of each other, so a slow phase of a shared machine falls on
    /// both.
    Size,
    /// Every size of a mode back to back, modes as listed: the rows a ratio compares are a
    /// round's share of the sweep apart.
    Mode,
}

/// The rows of one round, in `order`.
fn row_order<'a>(modes: &'a [String], sizes: &[usize], order: Order) -> Vec<(&'a str, usize)> {
    let rows = modes
        .iter()
        .flat_map(|m| mode_sizes(m, sizes).into_iter().map(move |s| (m.as_str(), s)));
    match order {
        Order::Mode => rows.collect(),
        Order::Size => {
            let mut rows: Vec<(&str, usize)> = rows.collect();
            // Stable: the modes of one size keep their listed order.
            rows.sort_by_key(|&(_, size)| size);
            rows
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Latency by message size: rdma-rpc RPCs, raw verbs and baselines, perftest's columns")]
struct Args {
    /// Provider spec: shm, tcp, verbs, verbs:<device> (default: RDMA_RPC_PROVIDER, else shm:
    /// both ends of the benchmark run on this host).
    #[arg(long)]
    provider: Option<String>,
    /// Comma-separated sizes in bytes (default: powers of two from 2 B to 8 MiB).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Comma-separated modes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "rpc,rpc-body,rpc-eager,rpc-rendezvous,rpc-spin,rpc-event,rpc-upload,rpc-upload-vec,service,service-upload,service-upload-vec,send,send-head,send-copy,send-event,write,read,atomic,memcpy,tcp,tarpc,wake,spin-word"
    )]
    modes: Vec<String>,
    /// Fixed iterations per size (default: as many as fit the time budget).
    #[arg(long)]
    iters: Option<usize>,
    /// Time budget for the whole sweep, in seconds, spread over its rows.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Run the sweep in this many rounds, each row getting its share of the iterations (and of
    /// the time) in every round, and merge each row's samples: on a noisy machine every mode
    /// then sees the same slow and fast phases, which keeps the ratios between modes honest.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// The order of each round's rows: `size` measures every mode of a size back to back (the
    /// rows a ratio compares then lie within a second of each other), `mode` every size of a
    /// mode. The tables and the JSON list the rows mode by mode either way.
    #[arg(long, value_enum, default_value_t = Order::Size)]
    order: Order,
    /// IP to listen on (loopback for tcp; the rxe netdev's address for verbs).
    #[arg(long, default_value = "127.0.0.1")]
    ip: IpAddr,
    /// Serve the RPC modes' server at this address (another host runs `--connect` to it) until
    /// a client stops it (`--stop-server`); measures nothing.
    #[arg(long, conflicts_with = "connect")]
    serve: Option<SocketAddr>,
    /// Measure the RPC modes against the server at this address (`--serve` on another host or
    /// process) instead of one started here: only rpc, rpc-body, rpc-spin, rpc-event,
    /// rpc-upload and rpc-upload-vec.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// With `--connect`: stop the server once the sweep is done.
    #[arg(long, requires = "connect")]
    stop_server: bool,
    /// Completion mode of the RPC driver: spin, event, adaptive (`throughput`: a list).
    #[arg(long, default_value = "adaptive")]
    completion: String,
    /// Raw modes: microseconds to poll the CQ before waiting on its completion channel
    /// (perftest always polls; on the tcp provider polling steals the engine's CPU).
    #[arg(long, default_value_t = 20)]
    raw_spin_us: u64,
    /// Raw Send and Write ping-pongs: one request in this many asks for a completion, as
    /// perftest's `cq_mod` (1: every one).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=256))]
    raw_cq_mod: u32,
    /// Receives each side of the raw Send ping-pongs keeps posted; `rpc-body` posts as many
    /// (`Config::ring`), the other RPC modes the library's default (64).
    #[arg(long, default_value_t = raw::RING, value_parser = clap::value_parser!(u32).range(2..=256))]
    raw_ring: u32,
    /// Write the rows as JSON here.
    #[arg(long)]
    json: Option<String>,
    /// Draw latency against size (SVG) here.
    #[arg(long)]
    plot: Option<String>,
    /// Pin the client thread and the server thread to these CPUs, e.g. `0,1` (as perftest is
    /// run under taskset); `0,0` puts both on one core. Threads they start inherit the pinning.
    #[arg(long, value_delimiter = ',')]
    cpus: Option<Vec<usize>>,
    /// perftest reports to compare with, e.g. send=send.txt,write=write.txt,read=read.txt. A
    /// file may hold several reports (runs before and after the sweep): each size's median of
    /// them is compared.
    #[arg(long, value_delimiter = ',')]
    perftest: Vec<String>,
    /// Measure nothing: read the rows of an earlier run (its `--json` file) and print only the
    /// eager/rendezvous crossover they give, the hypervisor's steal while they were timed and
    /// the comparison with `--perftest`, so that perftest can run both before and after that
    /// sweep (as `scripts/vm-bench.sh` does).
    #[arg(long)]
    rows: Option<String>,
    /// With `--rows`: print the saved run's whole summary of ratios again (its provider named
    /// by `--provider`, else shm), round-by-round lines included.
    #[arg(long, requires = "rows")]
    summary: bool,
    /// What to measure: `latency` (the sweep by size), `rate` (message rate and bandwidth of the
    /// raw provider by depth and post list, `--sizes` default 64,4096,65536) or `scale` (what
    /// idle connections cost, by `--conns`).
    #[arg(long, value_enum, default_value_t = Sweep::Latency)]
    sweep: Sweep,
    /// `rate`: the operations, of send and write.
    #[arg(long, value_delimiter = ',', default_value = "send,write")]
    ops: Vec<String>,
    /// `rate`: requests kept in flight.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    depths: Vec<u32>,
    /// `rate`: requests posted per call (at most the depth).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    post_lists: Vec<u32>,
    /// `scale`: connection counts (default 1,100,1000,10000); `throughput`: the connection
    /// counts of the rows by connections (default 1,16,256,4096).
    #[arg(long, value_delimiter = ',')]
    conns: Option<Vec<usize>>,
    /// `throughput`: calls in flight on one connection.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    in_flight: Vec<usize>,
    /// `throughput`: calls in flight on each connection of the rows by connections.
    #[arg(long, default_value_t = 2)]
    conn_in_flight: usize,
    /// `throughput`: the servers, of rpc (rdma-rpc on the provider), rpc-pool (the same on a
    /// receive pool: `Config::receive_pool`, 4 KiB pieces, its clients made by one
    /// `Connector`), tcp (a tokio TCP echo), tarpc.
    #[arg(long, value_delimiter = ',', default_value = "rpc,rpc-pool,tcp,tarpc")]
    systems: Vec<String>,
    /// `throughput`: run every row without (0) and with (1) a busy process beside it.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    busy: Vec<u8>,
    /// `throughput`: skip the raw provider's Send rate rows.
    #[arg(long)]
    no_raw: bool,
    /// `throughput`: worker threads of the client's runtime and of the server's.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    #[arg(long, default_value_t = 1)]
    server_threads: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What a run measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Sweep {
    Latency,
    Rate,
    Scale,
    Throughput,
}

/// On an error, its message (`Display`: what failed and what to do, e.g. an unknown provider
/// or no RDMA device) on stderr and exit status 1; `main` returning the `Result` would print
/// its `Debug` form instead.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(path) = &args.rows {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading the rows in {path}: {e}"))?;
        let rows: Vec<Row> =
            serde_json::from_str(&text).map_err(|e| format!("{path} is not the JSON of a --json run: {e}"))?;
        if args.summary {
            let provider = args.provider.as_deref().unwrap_or("shm");
            report::summary(&rows, provider, args.raw_ring);
        } else {
            report::print_crossover(&rows);
            report::steal(&rows);
            report::cross_core(&rows);
        }
        if !args.perftest.is_empty() {
            perftest::compare(&rows, &perftest_files(&args.perftest));
        }
        return Ok(());
    }
    if let Ok(addr) = std::env::var(scale::CONNECT_ENV) {
        // The connecting end of a `--sweep scale` row (a child of the run).
        let n = std::env::var(scale::COUNT_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        return Ok(scale::connecting_end(&Device::open_default()?, &addr, n)?);
    }
    if let Ok(what) = std::env::var(throughput::server::SERVE_ENV) {
        // The server of a `--sweep throughput` row (a child of the run).
        return throughput::server::serve_child(&what);
    }
    if std::env::var_os(throughput::server::BUSY_ENV).is_some() {
        throughput::server::busy_child();
        return Ok(());
    }
    let from_env = std::env::var(rdma_rpc::transport::PROVIDER_ENV)
        .ok()
        .filter(|p| !p.trim().is_empty());
    let provider = args.provider.clone().or(from_env).unwrap_or_else(|| "shm".to_owned());
    std::env::set_var(rdma_rpc::transport::PROVIDER_ENV, &provider);
    let dev = Device::open_default()?;
    if let Some(addr) = args.serve {
        let completion = match args.completion.as_str() {
            "spin" => CompletionMode::Spin,
            "event" => CompletionMode::Event,
            "adaptive" => CompletionMode::default(),
            other => return Err(format!("unknown completion mode {other}").into()),
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        return rt.block_on(rpc::serve(&dev, addr, rdma_rpc::Config::default().mode(completion)));
    }
    match args.sweep {
        Sweep::Latency => {}
        Sweep::Rate => return rate_sweep(&args, &dev),
        Sweep::Scale => return scale_sweep(&args, &dev),
        Sweep::Throughput => return throughput_sweep(&args, &dev),
    }
    raw::SPIN_US.store(args.raw_spin_us, std::sync::atomic::Ordering::Relaxed);
    raw::CQ_MOD.store(args.raw_cq_mod as usize, std::sync::atomic::Ordering::Relaxed);
    let sizes = args
        .sizes
        .clone()
        .unwrap_or_else(|| (1..=23).map(|i| 1usize << i).collect());
    for m in &args.modes {
        if !ALL_MODES.contains(&m.as_str()) {
            return Err(format!("unknown mode {m}: use {}", ALL_MODES.join(",")).into());
        }
        if args.connect.is_some() && !rpc::REMOTE_MODES.contains(&m.as_str()) {
            return Err(format!(
                "mode {m} needs its server in this process: with --connect, use {}",
                rpc::REMOTE_MODES.join(",")
            )
            .into());
        }
    }
    let completion = match args.completion.as_str() {
        "spin" => CompletionMode::Spin,
        "event" => CompletionMode::Event,
        "adaptive" => CompletionMode::default(),
        other => return Err(format!("unknown completion mode {other}").into()),
    };
    let peer = match args.connect {
        Some(addr) => rpc::Peer::There(addr),
        None => rpc::Peer::Here(args.ip),
    };
    let knobs = Knobs {
        completion,
        raw_ring: args.raw_ring,
    };
    let order = row_order(&args.modes, &sizes, args.order);
    let rows_planned = order.len().max(1);
    let rounds = args.rounds as usize;
    let plan = Plan {
        iters: args.iters.map(|n| n.div_ceil(rounds)),
        per_row: Duration::from_secs_f64(args.seconds / (rows_planned * rounds) as f64),
        min_iters: 20usize.div_ceil(rounds),
        max_iters: 100_000usize.div_ceil(rounds),
    };
    // Client and server each get one thread (the machines have two cores): the client side runs
    // on this thread, every server of every mode (RPC, raw echo, TCP, tarpc) on the other.
    // Both CPUs are looked up before this thread is pinned: a thread's view of the machine's
    // CPUs is its own affinity mask, which its children inherit.
    let host = host::describe();
    let (client_cpu, server_cpu) = match args.cpus.as_deref() {
        Some(&[c, s]) => (Some(core(c)?), Some(core(s)?)),
        None => (None, None),
        Some(_) => return Err("--cpus takes two CPUs: client,server".into()),
    };
    if let Some(c) = client_cpu {
        pin(c)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-server")
        .on_thread_start(move || {
            if let Some(s) = server_cpu {
                if let Err(e) = pin(s) {
                    eprintln!("warning: {e}: the server thread runs unpinned");
                }
            }
        })
        .enable_all()
        .build()?;
    let srv = server_rt.handle().clone();
    let bar = ProgressBar::new((rows_planned * rounds) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} rows  {msg}  [{elapsed_precise}]",
    )?);
    println!(
        "rdma-rpc latency sweep: provider {} (device {}), {} sizes, modes {}, {}{}",
        dev.provider(),
        dev.name(),
        sizes.len(),
        args.modes.join(","),
        chrono_free_date(),
        if rounds > 1 {
            format!(", in {rounds} rounds")
        } else {
            String::new()
        }
    );
    println!("host: {host}");
    // Every row's samples, merged over the rounds, in the order of the first round.
    let mut merged: Vec<(&str, usize, Convention, usize, sampler::Samples)> = Vec::new();
    for round in 0..rounds {
        for (k, &(mode, size)) in order.iter().enumerate() {
            bar.set_message(format!("{mode} {size} B (round {}/{rounds})", round + 1));
            let (conv, moved, mut s) = rt.block_on(measure(&srv, &dev, peer, mode, size, plan, knobs));
            s.xcore_ns.extend(rt.block_on(baseline::cross_core(&srv)));
            match merged.get_mut(k) {
                Some(m) => m.4.absorb(s),
                None => merged.push((mode, size, conv, moved, s)),
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    // Mode by mode (sizes ascending within each), whatever order they were measured in.
    merged.sort_by_key(|m| args.modes.iter().position(|x| x == m.0));
    let rows: Vec<Row> = merged
        .iter()
        .map(|(mode, size, conv, moved, s)| stats::row(mode, *conv, *size, *moved, s))
        .collect();
    for mode in &args.modes {
        let r: Vec<&Row> = rows.iter().filter(|r| &r.mode == mode).collect();
        report::table(mode, &r);
    }
    report::summary(&rows, dev.provider(), args.raw_ring);
    if !args.perftest.is_empty() {
        perftest::compare(&rows, &perftest_files(&args.perftest));
    }
    if let (Some(addr), true) = (args.connect, args.stop_server) {
        rt.block_on(async {
            let client = rdma_rpc::Client::connect(&dev, addr, rdma_rpc::Config::default()).await?;
            client.call(rpc::STOP, Vec::new()).await.map(drop)
        })
        .map_err(|e| format!("stopping the server at {addr}: {}", e.report()))?;
        println!("the server at {addr} is stopped");
    }
    for p in [&args.json, &args.plot].into_iter().flatten() {
        if let Some(dir) = std::path::Path::new(p).parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
        println!("rows written to {path}");
    }
    if let Some(path) = &args.plot {
        plot::draw(
            path,
            &rows,
            &format!("rdma-rpc latency by size, provider {}", dev.provider()),
        )?;
        println!("plot written to {path}");
    }
    Ok(())
}

/// `--sweep rate`: every op, size, post list and depth, in that nesting.
fn rate_sweep(args: &Args, dev: &Device) -> Result<(), Box<dyn std::error::Error>> {
    let ops: Vec<rate::Op> = args
        .ops
        .iter()
        .map(|o| rate::Op::parse(o).ok_or_else(|| format!("unknown op {o}: use send,write")))
        .collect::<Result<_, _>>()?;
    if let Some(d) = args.depths.iter().find(|&&d| d == 0 || d > 4096) {
        return Err(format!("depth {d} must be within 1..=4096").into());
    }
    let sizes = args.sizes.clone().unwrap_or_else(|| vec![64, 4096, 65536]);
    let mut plan = Vec::new();
    for &op in &ops {
        for &size in &sizes {
            for &list in &args.post_lists {
                for &depth in args.depths.iter().filter(|&&d| list <= d) {
                    plan.push((op, size, list.max(1), depth));
                }
            }
        }
    }
    let per_row = Duration::from_secs_f64(args.seconds / plan.len().max(1) as f64);
    println!(
        "rdma-rpc message rate: provider {} (device {}), {:.2} s a row, {}",
        dev.provider(),
        dev.name(),
        per_row.as_secs_f64(),
        chrono_free_date()
    );
    println!("host: {}", host::describe());
    let bar = ProgressBar::new(plan.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} rows  {msg}  [{elapsed_precise}]",
    )?);
    let mut rows = Vec::new();
    for (op, size, list, depth) in plan {
        bar.set_message(format!("{size} B, depth {depth}, post list {list}"));
        rows.push(rate::measure(dev, args.ip, op, size, depth, list, per_row)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    rate::table(&rows);
    let at = |depth: u32, list: u32| {
        rows.iter()
            .find(|r| r.op == "send" && r.bytes == 64 && r.depth == depth && r.post_list == list)
            .map(|r| r.msg_rate)
    };
    if let (Some(one), Some(deep)) = (at(1, 1), at(64, 16)) {
        println!();
        println!(
            "64 B Sends: depth 64 with post lists of 16 moves {:.1}x the messages of depth 1",
            deep / one.max(1e-12)
        );
    }
    write_json(args, &rows)
}

/// `--sweep scale`: a row per connection count.
fn scale_sweep(args: &Args, dev: &Device) -> Result<(), Box<dyn std::error::Error>> {
    scale::raise_fd_limit();
    println!(
        "rdma-rpc connection scale: provider {} (device {}), clients in a child process, {}",
        dev.provider(),
        dev.name(),
        chrono_free_date()
    );
    println!("host: {}", host::describe());
    let mut rows = Vec::new();
    for &n in args.conns.as_deref().unwrap_or(&[1, 100, 1000, 10000]) {
        eprintln!("{n} connections ...");
        rows.push(scale::measure(dev, args.ip, n)?);
    }
    scale::table(&rows);
    write_json(args, &rows)
}

/// `--sweep throughput`: calls/s under load, by calls in flight and by connections.
fn throughput_sweep(args: &Args, dev: &Device) -> Result<(), Box<dyn std::error::Error>> {
    // The clients of thousands of connections hold a few descriptors each (on shm, one per
    // registration).
    scale::raise_fd_limit();
    let systems = args
        .systems
        .iter()
        .map(|s| {
            throughput::server::System::parse(s)
                .ok_or_else(|| format!("unknown system {s}: use rpc,rpc-pool,tcp,tarpc"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let completions: Vec<String> = args.completion.split(',').map(|c| c.trim().to_owned()).collect();
    if let Some(c) = completions.iter().find(|c| throughput::server::completion(c).is_none()) {
        return Err(format!("unknown completion mode {c}: use spin,event,adaptive").into());
    }
    if let Some(d) = args
        .in_flight
        .iter()
        .chain([&args.conn_in_flight])
        .find(|&&d| d == 0 || d > 4096)
    {
        return Err(format!("calls in flight {d} must be within 1..=4096").into());
    }
    let plan = throughput::Plan {
        systems,
        completions,
        sizes: args.sizes.clone().unwrap_or_else(|| vec![32, 4096, 1 << 20]),
        in_flight: args.in_flight.clone(),
        conns: args.conns.clone().unwrap_or_else(|| vec![1, 16, 256, 4096]),
        conn_in_flight: args.conn_in_flight,
        busy: args.busy.iter().map(|&b| b != 0).collect(),
        raw: !args.no_raw,
        client_threads: args.client_threads,
        server_threads: args.server_threads,
        seconds: args.seconds,
        ip: args.ip,
    };
    let rows = throughput::sweep(&plan, dev)?;
    throughput::tables(&rows);
    throughput::report::summary(&rows);
    if let Some(path) = &args.plot {
        if let Some(dir) = std::path::Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir)?;
        }
        let title = format!("rdma-rpc calls/s by calls in flight, provider {}", dev.provider());
        throughput::report::draw(path, &rows, &title)?;
        println!("plot written to {path}");
    }
    write_json(args, &rows)
}

fn write_json<T: serde::Serialize>(args: &Args, rows: &[T]) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(path) = &args.json {
        if let Some(dir) = std::path::Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(rows)?)?;
        println!("rows written to {path}");
    }
    Ok(())
}

/// What every row of a mode is measured with, besides its size.
#[derive(Clone, Copy)]
struct Knobs {
    completion: CompletionMode,
    raw_ring: u32,
}

async fn measure(
    srv: &tokio::runtime::Handle,
    dev: &Device,
    peer: rpc::Peer,
    mode: &str,
    size: usize,
    plan: Plan,
    knobs: Knobs,
) -> (Convention, usize, sampler::Samples) {
    let Knobs { completion, raw_ring } = knobs;
    let ip = peer.ip();
    match mode {
        "rpc" | "rpc-eager" | "rpc-rendezvous" | "rpc-spin" | "rpc-event" => {
            let (client, serving) = rpc::connect(srv, dev, peer, rpc::config(mode, size, completion, raw_ring)).await;
            let s = rpc::measure(&client, size, plan).await;
            serving.abort();
            (Convention::Rtt, 2 * size, s)
        }
        "rpc-body" => {
            let (client, serving) = rpc::connect(srv, dev, peer, rpc::config(mode, size, completion, raw_ring)).await;
            let s = rpc::in_place(&client, size, plan).await;
            serving.abort();
            (Convention::Rtt, 2 * size, s)
        }
        "rpc-one-thread" => {
            // The server on the client's own runtime, so on its thread: a test's or a small
            // tool's layout.
            let here = tokio::runtime::Handle::current();
            let (client, serving) = rpc::connect(&here, dev, peer, rpc::config(mode, size, completion, raw_ring)).await;
            let s = rpc::measure(&client, size, plan).await;
            serving.abort();
            (Convention::Rtt, 2 * size, s)
        }
        "rpc-behind" | "rpc-behind-fifo" => {
            let (client, serving) = rpc::connect(srv, dev, peer, rpc::config(mode, size, completion, raw_ring)).await;
            let s = rpc::behind(&client, size, plan).await;
            serving.abort();
            (Convention::Rtt, 2 * rpc::SHORT, s)
        }
        "rpc-upload" | "rpc-upload-vec" => {
            let (client, serving) = rpc::connect(srv, dev, peer, rpc::config(mode, size, completion, raw_ring)).await;
            let s = if mode == "rpc-upload" {
                rpc::upload(&client, size, plan).await
            } else {
                rpc::upload_vec(&client, size, plan).await
            };
            serving.abort();
            (Convention::Rtt, size, s)
        }
        "service" | "service-upload" | "service-upload-vec" => {
            let cfg = rpc::config(mode, size, completion, raw_ring);
            let (shape, bytes) = match mode {
                "service" => (service::Shape::Echo, 2 * size),
                "service-upload" => (service::Shape::Upload, size),
                _ => (service::Shape::UploadVec, size),
            };
            (
                Convention::Rtt,
                bytes,
                service::measure(srv, dev, ip, cfg, size, shape, plan).await,
            )
        }
        "memcpy" => (Convention::Rtt, size, baseline::memcpy(size, plan).await),
        "send" | "send-head" | "send-copy" | "send-event" => {
            let (c, s) = raw::pair(dev, ip);
            let how = raw::PingPong {
                touch: match mode {
                    "send-head" => raw::Touch::Head,
                    "send-copy" => raw::Touch::Copy,
                    _ => raw::Touch::Nothing,
                },
                ring: raw_ring,
                spin: if mode == "send-event" {
                    Duration::ZERO
                } else {
                    raw::spin_budget()
                },
            };
            (Convention::HalfRtt, size, raw::send(srv, c, s, size, how, plan).await)
        }
        "write" => {
            let (c, s) = raw::pair(dev, ip);
            (Convention::HalfRtt, size, raw::write(srv, c, s, size, plan).await)
        }
        "read" => {
            let (c, s) = raw::pair(dev, ip);
            (Convention::Rtt, size, raw::read(c, s, size, plan).await)
        }
        "atomic" => {
            let (c, s) = raw::pair(dev, ip);
            (Convention::Rtt, 8, raw::atomic(c, s, plan).await)
        }
        "tcp" => (Convention::Rtt, 2 * size, baseline::tcp_echo(srv, size, plan).await),
        "wake" => (Convention::Rtt, 0, baseline::wake(srv, plan).await),
        "spin-word" => (Convention::Rtt, 0, baseline::spin_word(srv, plan).await),
        _ => (Convention::Rtt, 2 * size, baseline::tarpc_echo(srv, size, plan).await),
    }
}

/// `op=path` pairs of `--perftest`.
fn perftest_files(specs: &[String]) -> Vec<(String, String)> {
    specs
        .iter()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

/// The CPU `cpu` among those this process may run on.
fn core(cpu: usize) -> Result<core_affinity::CoreId, String> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.id == cpu)
        .ok_or_else(|| format!("no CPU {cpu} to pin to"))
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: core_affinity::CoreId) -> Result<(), String> {
    if core_affinity::set_for_current(cpu) {
        Ok(())
    } else {
        Err(format!("pinning to CPU {} failed", cpu.id))
    }
}

/// Today's date (UTC) from the system clock, without a date crate.
fn chrono_free_date() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    // civil-from-days (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
