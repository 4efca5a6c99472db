//! A KV cache whose GETs need not wake the server: `get`/`put`/`delete` by RPC (`#[service]`),
//! a one-sided GET that reads the server's index and value slots with RDMA Read and catches
//! torn copies (checksums) during concurrent PUTs, and a PUT by RDMA Write with immediate into
//! a slot the server lent, the immediate naming the slot (`writes.rs`): the server updates its
//! index with no request to parse.
//!
//! ```text
//! cargo run --release --example kv -- server --listen 127.0.0.1:7473
//! cargo run --release --example kv -- client --connect 127.0.0.1:7473 bench
//! cargo run --release --example kv -- client --connect 127.0.0.1:7473 check --seconds 5
//! ```
//! `bench` prints GET latency by RPC and one-sided, and PUT latency and the server's CPU per PUT
//! by RPC and by Write-with-immediate; `check` runs writers (by both kinds of PUT) and readers at
//! once and fails on any torn, stale or out-of-order value (`server --torn-window-us N` widens the window
//! in which a reader can copy a half-written slot, to show that such copies are caught).

#[path = "../common/mod.rs"]
mod common;

mod check;
mod client;
mod layout;
mod server;
mod service;
mod writes;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdma_rpc::Config;

use service::{KvClient, KvServer};

#[derive(Parser)]
#[command(about = "a KV cache: RPC get/put/delete, a one-sided GET by RDMA Read, a PUT by RDMA Write with immediate")]
struct Args {
    /// Transport provider: tcp, shm (processes on one host), verbs or verbs:<device> (default: RDMA_RPC_PROVIDER, else tcp).
    #[arg(long, global = true)]
    provider: Option<String>,
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Serves the table.
    Server {
        /// Address of the RPC service (port 0 picks one; printed).
        #[arg(long)]
        listen: SocketAddr,
        /// Pause between the steps of a slot update, in microseconds.
        #[arg(long, default_value_t = 0)]
        torn_window_us: u64,
    },
    /// Calls it.
    Client {
        /// The server's RPC address.
        #[arg(long)]
        connect: SocketAddr,
        #[command(subcommand)]
        mode: Mode,
    },
}

#[derive(Subcommand)]
enum Mode {
    /// GET latency, RPC against one-sided; PUT latency and server CPU, RPC against
    /// Write-with-immediate.
    Bench {
        /// Keys to load.
        #[arg(long, default_value_t = 1000)]
        keys: usize,
        /// Value size in bytes.
        #[arg(long, default_value_t = 64)]
        value_size: usize,
        /// GETs per method.
        #[arg(long, default_value_t = 5000)]
        gets: usize,
        /// PUTs per method.
        #[arg(long, default_value_t = 5000)]
        puts: usize,
    },
    /// Concurrent writers and readers; exits non-zero on a torn, stale or out-of-order value.
    Check(check::Opts),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::exit_code(run().await)
}

async fn run() -> common::Result<()> {
    let args = Args::parse();
    let device = common::device(args.provider.as_deref())?;
    match args.role {
        Role::Server { listen, torn_window_us } => {
            let pd = device.alloc_pd()?;
            let table = server::Table::new(&device, &pd, listen.ip(), Duration::from_micros(torn_window_us))?;
            let server = KvServer::from_arc(table).bind(&device, listen, Config::default())?;
            println!("listening on {}", server.local_addr()?);
            server.serve().await?;
            Ok(())
        }
        Role::Client { connect, mode } => {
            let kv = KvClient::connect(&device, connect, Config::default()).await?;
            let port = kv.one_sided_port().await?;
            let one_sided = SocketAddr::new(connect.ip(), port);
            match mode {
                Mode::Bench {
                    keys,
                    value_size,
                    gets,
                    puts,
                } => bench(&device, &kv, one_sided, keys, value_size, (gets, puts)).await,
                Mode::Check(opts) => check::run(&device, connect, one_sided, opts).await,
            }
        }
    }
}

async fn bench(
    device: &rdma_rpc::transport::Device,
    kv: &KvClient,
    one_sided: SocketAddr,
    keys: usize,
    value_size: usize,
    (gets, puts): (usize, usize),
) -> common::Result<()> {
    let key = |i: usize| format!("key-{i}").into_bytes();
    let value = |i: usize| common::pattern(i as u64, value_size);
    for i in 0..keys {
        kv.put(key(i), value(i)).await??;
    }
    let mut reader = client::OneSided::connect(device, one_sided).await?;
    let (mut rpc, mut direct) = (common::Latencies::new()?, common::Latencies::new()?);
    for n in 0..gets {
        let i = n * 7919 % keys;
        let t = Instant::now();
        let v = kv.get(key(i)).await?;
        rpc.record(t.elapsed());
        let t = Instant::now();
        let w = reader.get(&key(i)).await?;
        direct.record(t.elapsed());
        if v.as_deref() != Some(&value(i)[..]) || w != v {
            return Err(format!("key {i}: RPC and one-sided GETs disagree with what was put").into());
        }
    }
    let (r50, r99) = rpc.p50_p99();
    let (d50, d99) = direct.p50_p99();
    println!(
        "{keys} keys, {value_size} B values, {gets} GETs and {puts} PUTs each, provider {}",
        device.provider()
    );
    println!("{:<32} {:>10} {:>10}", "GET", "p50[usec]", "p99[usec]");
    println!("{:<32} {r50:>10.2} {r99:>10.2}", "RPC (Kv::get)");
    println!("{:<32} {d50:>10.2} {d99:>10.2}", "one-sided (2 RDMA Reads)");
    // PUTs: the same keys, new values, each way; the server's CPU over each run.
    let mut writer = client::Writer::connect(device, one_sided).await?;
    let (mut by_rpc, mut by_write) = (common::Latencies::new()?, common::Latencies::new()?);
    let fresh = |n: usize| common::pattern((n + keys) as u64, value_size);
    let cpu0 = kv.cpu_time_us().await?;
    for n in 0..puts {
        let t = Instant::now();
        kv.put(key(n % keys), fresh(n)).await??;
        by_rpc.record(t.elapsed());
    }
    let cpu1 = kv.cpu_time_us().await?;
    for n in 0..puts {
        let t = Instant::now();
        writer.put(&key(n % keys), &fresh(n + puts)).await?;
        by_write.record(t.elapsed());
    }
    let cpu2 = kv.cpu_time_us().await?;
    for i in 0..keys.min(puts) {
        let last = (puts - 1 - (puts - 1 - i) % keys) + puts;
        if kv.get(key(i)).await? != Some(fresh(last)) {
            return Err(format!("key {i}: a GET after the PUTs does not see the last one").into());
        }
    }
    let per_put = |cpu: u64| cpu as f64 / puts.max(1) as f64;
    let (p50, p99) = by_rpc.p50_p99();
    let (w50, w99) = by_write.p50_p99();
    println!(
        "{:<32} {:>10} {:>10} {:>22}",
        "PUT", "p50[usec]", "p99[usec]", "server CPU/PUT[usec]"
    );
    println!(
        "{:<32} {p50:>10.2} {p99:>10.2} {:>22.2}",
        "RPC (Kv::put)",
        per_put(cpu1 - cpu0)
    );
    println!(
        "{:<32} {w50:>10.2} {w99:>10.2} {:>22.2}",
        "RDMA Write with immediate",
        per_put(cpu2 - cpu1)
    );
    if device.provider() != "verbs" {
        println!(
            "(on {}, the server's CPU includes its software NIC's)",
            device.provider()
        );
    }
    Ok(())
}
