//! What `Config::max_cached_buffer_bytes` keeps registered and what it costs: concurrent large
//! `Vec` echoes by rendezvous, for several bounds in one run.
//!
//! ```text
//! cargo bench --bench buffer_cache -- --provider shm
//! cargo bench --bench buffer_cache -- --provider shm --sizes 1048576,4194304 --caps 67108864,16777216,0
//! cargo bench --bench buffer_cache -- --provider verbs --ip 10.10.0.1   # soft-RoCE: docs/rdma.md
//! ```
//!
//! Per payload size and bound: eight tasks each echo `256 MiB / size / 8` (at least 4) calls
//! of that size, in `--rounds` rounds on one connection (a device of its own, so its figures
//! are that connection's alone, both sides counted). It prints each round's MB/s (request and
//! response bytes), their median, and what the device keeps registered once the calls are done
//! (the rings, send buffers and the free rendezvous buffers the bound lets both sides keep).
//! The bounds alternate within a size, so compare them within one run. Where registering is
//! bookkeeping (`tcp`), large payloads are registered where they are and nothing is cached.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use rdma_rpc_core::{transport::Device, Client, Config, RpcError, Server};

#[derive(Parser)]
struct Args {
    /// Provider: tcp, shm or verbs.
    #[arg(long, default_value = "shm")]
    provider: String,
    /// The address the server listens on (on `verbs`, one of an RDMA device's).
    #[arg(long, default_value = "127.0.0.1")]
    ip: IpAddr,
    /// Payload sizes, in bytes (each sent by rendezvous: above the 16 KiB threshold used).
    #[arg(long, value_delimiter = ',', default_value = "1048576,4194304")]
    sizes: Vec<usize>,
    /// Values of `Config::max_cached_buffer_bytes` to compare, in bytes.
    #[arg(long, value_delimiter = ',', default_value = "67108864,16777216")]
    caps: Vec<u64>,
    /// Rounds per size and bound.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Ignored: cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

const ECHO: u32 = 1;
const TASKS: usize = 8;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Err(e) = run(Args::parse()).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    drop(Device::open(&args.provider)?);
    println!(
        "buffer_cache: provider {}, {TASKS} tasks of Vec echoes by rendezvous (16 KiB threshold), {} rounds",
        args.provider, args.rounds
    );
    for &size in &args.sizes {
        for &cap in &args.caps {
            // A device per connection: its registered bytes are this connection's alone.
            let dev = Device::open(&args.provider)?;
            let client = connect(&dev, args.ip, cap).await?;
            let mut rounds = Vec::with_capacity(args.rounds);
            for _ in 0..args.rounds {
                rounds.push(echoes(&client, size).await?);
            }
            let at_rest = settled(&dev).await;
            let mut sorted = rounds.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
            let each: Vec<String> = rounds.iter().map(|r| format!("{r:.0}")).collect();
            println!(
                "{size:>10} B  cap {cap:>10} B: median {median:>6.0} MB/s (rounds {}); registered at rest {:.1} MiB",
                each.join(", "),
                at_rest as f64 / f64::from(1 << 20)
            );
        }
    }
    Ok(())
}

/// An echo server on `ip` and a client of it on `dev`, each side keeping at most `cap` bytes of free
/// rendezvous buffers.
async fn connect(dev: &Device, ip: IpAddr, cap: u64) -> Result<Client, Box<dyn std::error::Error>> {
    let cfg = Config::default().eager_threshold(16 << 10).max_cached_buffer_bytes(cap);
    let server = Server::builder(cfg.clone())
        .handler(ECHO, |req: Vec<u8>| async move { Ok(req) })
        .bind(dev, SocketAddr::new(ip, 0))?;
    let addr = server.local_addr()?;
    tokio::spawn(server.serve());
    Ok(Client::connect(dev, addr, cfg).await?)
}

/// Eight tasks' echoes of `size` bytes: MB/s of request and response bytes together.
async fn echoes(client: &Client, size: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let calls = ((256 << 20) / size / TASKS).max(4);
    let t = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move {
                let req = vec![i as u8; size];
                for _ in 0..calls {
                    let got = c.call(ECHO, req.clone()).await?;
                    if got.len() != size {
                        return Err(RpcError::Internal(format!("{size} B sent, {} B came back", got.len())));
                    }
                }
                Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok((2 * TASKS * calls * size) as f64 / t.elapsed().as_secs_f64() / 1e6)
}

/// What `dev` keeps registered once it stops changing (a lent response is let go when the
/// peer says it read it, just after the call returns).
async fn settled(dev: &Device) -> u64 {
    let mut last = dev.registered_bytes();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = dev.registered_bytes();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}
