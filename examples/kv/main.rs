//! A KV cache whose GETs need not wake the server: `get`/`put`/`delete` by RPC (`#[service]`),
//! and a one-sided GET that reads the server's index and value slots with RDMA Read and catches
//! torn copies (checksums) during concurrent PUTs.
//!
//! ```text
//! cargo run --release --example kv -- server --listen 127.0.0.1:7473
//! cargo run --release --example kv -- client --connect 127.0.0.1:7473 bench
//! cargo run --release --example kv -- client --connect 127.0.0.1:7473 check --seconds 5
//! ```
//! `bench` prints GET latency by RPC and one-sided; `check` runs writers and readers at once and
//! fails on any torn, stale or out-of-order value (`server --torn-window-us N` widens the window
//! in which a reader can copy a half-written slot, to show that such copies are caught).

#[path = "../common/mod.rs"]
mod common;

mod check;
mod client;
mod layout;
mod server;
mod service;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdma_rpc::Config;

use service::{KvClient, KvServer};

#[derive(Parser)]
#[command(about = "a KV cache: RPC get/put/delete and a one-sided GET by RDMA Read")]
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
    /// GET latency, RPC against one-sided.
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
                Mode::Bench { keys, value_size, gets } => bench(&device, &kv, one_sided, keys, value_size, gets).await,
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
    gets: usize,
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
        "{keys} keys, {value_size} B values, {gets} GETs each, provider {}",
        device.provider()
    );
    println!("{:<26} {:>10} {:>10}", "GET", "p50[usec]", "p99[usec]");
    println!("{:<26} {r50:>10.2} {r99:>10.2}", "RPC (Kv::get)");
    println!("{:<26} {d50:>10.2} {d99:>10.2}", "one-sided (2 RDMA Reads)");
    Ok(())
}
