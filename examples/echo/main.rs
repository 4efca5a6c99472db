//! An echo service as two processes.
//!
//! ```text
//! cargo run --example echo -- --listen 127.0.0.1:7471                      # server
//! cargo run --example echo -- --connect 127.0.0.1:7471 --sizes 64,1048576 # client
//! ```
//! `--provider tcp|shm|verbs|verbs:<dev>` picks the transport (default: `RDMA_RPC_PROVIDER`, else
//! `tcp`). The server prints `listening on <addr>` and serves until Ctrl-C or SIGTERM, then shuts
//! down gracefully; the client checks every echo byte for byte and prints the median round trip
//! per size.

#[path = "../common/mod.rs"]
mod common;
mod service;

use std::net::SocketAddr;
use std::time::Instant;

use clap::Parser;
use rdma_rpc::transport::Device;
use rdma_rpc::{Bulk, Config};
use service::{EchoClient, EchoServer, Echoer};

#[derive(Parser)]
#[command(about = "rdma-rpc echo: run one process with --listen, another with --connect")]
struct Args {
    /// Serve on this address (port 0 picks one).
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<SocketAddr>,
    /// Call a server at this address.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Transport provider: tcp, shm (processes on one host), verbs or verbs:<device>.
    #[arg(long)]
    provider: Option<String>,
    /// Message sizes in bytes (client).
    #[arg(long, value_delimiter = ',', default_value = "1,64,4096,65536,1048576")]
    sizes: Vec<usize>,
    /// Echoes per size (client).
    #[arg(long, default_value_t = 200)]
    iters: usize,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::exit_code(run().await)
}

async fn run() -> common::Result<()> {
    let args = Args::parse();
    let device = common::device(args.provider.as_deref())?;
    match (args.listen, args.connect) {
        (Some(addr), _) => serve(&device, addr).await,
        (None, Some(addr)) => call(&device, addr, &args.sizes, args.iters).await,
        (None, None) => Err("give --listen or --connect".into()),
    }
}

/// Serves until Ctrl-C or SIGTERM, then shuts down gracefully: every echo that reached the
/// server is answered, and clients' later calls fail with `RpcError::ShuttingDown` (not run).
async fn serve(device: &Device, addr: SocketAddr) -> common::Result<()> {
    let server = EchoServer::new(Echoer).bind(device, addr, Config::default())?;
    println!("listening on {} ({})", server.local_addr()?, device.provider());
    server.serve_with_shutdown(stop_signal()).await?;
    println!("shut down: every echo that reached the server was answered");
    Ok(())
}

/// Completes on Ctrl-C (SIGINT) or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            eprintln!("no SIGTERM handler ({e}): stop with Ctrl-C");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Echoes `iters` messages of each size, checks them, prints the median round trip.
async fn call(device: &Device, addr: SocketAddr, sizes: &[usize], iters: usize) -> common::Result<()> {
    let echo = EchoClient::connect(device, addr, Config::default()).await?;
    println!("{:>10} {:>8} {:>14}", "#bytes", "#echoes", "median[usec]");
    let mut total = 0;
    // The connection underneath, for registered memory to send from.
    let conn = echo.inner().ok_or("a client made with connect has a connection")?;
    for &size in sizes {
        let data: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        // Filled once in memory registered with the connection: every echo below lends these
        // bytes to the server as they are (a clone of a `Bulk` shares them; no copy).
        let mut buf = conn.buffer(size)?;
        buf.bytes_mut().copy_from_slice(&data);
        let payload = Bulk::from(buf);
        let mut times = common::Latencies::new()?;
        for _ in 0..iters {
            let t = Instant::now();
            let back = echo.echo(payload.clone()).await?;
            times.record(t.elapsed());
            if back.bytes()[..] != data[..] {
                return Err(format!("echo of {size} bytes came back different").into());
            }
        }
        println!("{size:>10} {iters:>8} {:>14.2}", times.quantile_us(0.5));
        total += iters;
    }
    let greeting = echo.hello("echo client".into()).await?;
    println!("{greeting}; {total} echoes verified byte for byte");
    Ok(())
}
