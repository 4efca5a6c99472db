//! What a storm of cancelled rendezvous calls costs the calls after it, and what concurrent
//! large calls move, for two settings of `Config::max_request_bytes_reading`.
//!
//! ```text
//! cargo bench --bench cancel_storm -- --provider tcp
//! cargo bench --bench cancel_storm -- --provider shm --windows 1073741824,8388608
//! ```
//!
//! Per window: sixteen tasks each start `--calls` calls of `--body` bytes (by rendezvous) and
//! drop each after `--wait-us` µs, then one 64-byte call and one `--body` call are timed; three
//! rounds. Then eight tasks move 400 MiB in `--body` calls, not dropped; three rounds, MB/s. The
//! windows alternate, so compare them within one run.

use std::time::{Duration, Instant};

use clap::Parser;
use rdma_rpc_core::{transport::Device, Client, Config, RpcError, Server};

#[derive(Parser)]
struct Args {
    /// Provider: tcp, shm or verbs.
    #[arg(long, default_value = "tcp")]
    provider: String,
    /// Values of `Config::max_request_bytes_reading` to compare, in bytes.
    #[arg(long, value_delimiter = ',', default_value = "1073741824,8388608")]
    windows: Vec<u64>,
    /// Bytes of each call's request body (sent by rendezvous).
    #[arg(long, default_value_t = 4 << 20)]
    body: usize,
    /// Calls each of the sixteen storm tasks makes per round.
    #[arg(long, default_value_t = 20)]
    calls: usize,
    /// How long a storm call may take before it is dropped, µs.
    #[arg(long, default_value_t = 100)]
    wait_us: u64,
    /// Rounds of each part per window.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Ignored: cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

const ECHO_HEAD: u32 = 1;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let dev = Device::open(&args.provider)?;
    println!(
        "cancel_storm: provider {}, {} B bodies by rendezvous, storms of 16 x {} calls dropped after {} µs",
        args.provider, args.body, args.calls, args.wait_us
    );
    for &window in &args.windows {
        let client = connect(&dev, window).await?;
        for round in 0..args.rounds {
            let (storm, dropped) = storm(&client, &args).await?;
            let small = timed(&client, 64).await?;
            let large = timed(&client, args.body).await?;
            println!(
                "window {window:>10} B  storm round {round}: {:>8.1} ms, {dropped:>3} of {} dropped; then a 64 B call {:>9.3} ms, a {} B call {:>8.3} ms",
                ms(storm),
                16 * args.calls,
                ms(small),
                args.body,
                ms(large)
            );
        }
        for round in 0..args.rounds {
            let t = Instant::now();
            let per_task = ((400 << 20) / args.body / 8).max(1);
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (c, len) = (client.clone(), args.body);
                    tokio::spawn(async move {
                        for _ in 0..per_task {
                            c.call(ECHO_HEAD, vec![2u8; len]).await?;
                        }
                        Ok::<(), RpcError>(())
                    })
                })
                .collect();
            for task in tasks {
                task.await??;
            }
            let mb = (8 * per_task * args.body) as f64 / 1e6;
            println!(
                "window {window:>10} B  8 tasks, {mb:.0} MB in {:.1} ms: {:.0} MB/s (round {round})",
                ms(t.elapsed()),
                mb / t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// A server that answers each request with its first 8 bytes, and a client of it, both with
/// `window` bytes of requests read at once and a 16 KiB eager threshold.
async fn connect(dev: &Device, window: u64) -> Result<Client, Box<dyn std::error::Error>> {
    let cfg = Config::default()
        .max_request_bytes_reading(window)
        .eager_threshold(16 << 10);
    let server = Server::builder(cfg.clone())
        .handler(
            ECHO_HEAD,
            |req: Vec<u8>| async move { Ok(req[..req.len().min(8)].to_vec()) },
        )
        .bind(dev, "127.0.0.1:0".parse()?)?;
    let addr = server.local_addr()?;
    tokio::spawn(server.serve());
    let client = Client::connect(dev, addr, cfg).await?;
    for _ in 0..10 {
        client.call(ECHO_HEAD, vec![1u8; 1 << 20]).await?;
    }
    Ok(client)
}

/// Sixteen tasks whose calls are dropped after the wait: how long they took, and how many
/// were dropped.
async fn storm(client: &Client, args: &Args) -> Result<(Duration, usize), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (c, len, calls, wait) = (
                client.clone(),
                args.body,
                args.calls,
                Duration::from_micros(args.wait_us),
            );
            tokio::spawn(async move {
                let mut dropped = 0;
                for _ in 0..calls {
                    match tokio::time::timeout(wait, c.call(ECHO_HEAD, vec![3u8; len])).await {
                        Ok(r) => drop(r?),
                        Err(_) => dropped += 1,
                    }
                }
                Ok::<usize, RpcError>(dropped)
            })
        })
        .collect();
    let mut dropped = 0;
    for task in tasks {
        dropped += task.await??;
    }
    Ok((t.elapsed(), dropped))
}

async fn timed(client: &Client, len: usize) -> Result<Duration, RpcError> {
    let t = Instant::now();
    client.call(ECHO_HEAD, vec![4u8; len]).await?;
    Ok(t.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
