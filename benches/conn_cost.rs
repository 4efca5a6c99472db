//! What one connection costs a process: threads, file descriptors and registered memory.
//!
//! ```text
//! cargo bench --bench conn_cost -- --provider tcp --conns 10
//! cargo bench --bench conn_cost -- --provider shm --conns 10
//! ```
//!
//! A server and `--conns` clients run in this one process on one device, each client having
//! made one call; the threads (`/proc/self/task`), descriptors (`/proc/self/fd`) and
//! registered bytes (`Device::registered_bytes`) are counted before the connections and after,
//! and divided by the connections: both sides of each, and then each side (half of that: the
//! two sides of a connection hold alike).

use std::net::{IpAddr, SocketAddr};

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
    /// Connections to make.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    conns: u32,
    /// Ignored: cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

const ECHO: u32 = 1;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Err(e) = run(Args::parse()).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// This process's threads and descriptors (`/proc/self`), and what `dev` has registered.
fn snapshot(dev: &Device) -> Result<(usize, usize, u64), std::io::Error> {
    let count = |dir: &str| std::fs::read_dir(dir).map(Iterator::count);
    Ok((
        count("/proc/self/task")?,
        count("/proc/self/fd")?,
        dev.registered_bytes(),
    ))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::open(&args.provider)?;
    let server = Server::builder(Config::default())
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&dev, SocketAddr::new(args.ip, 0))?;
    let addr = server.local_addr()?;
    tokio::spawn(server.serve());
    // One connection first, so that what every process has once (the listener's threads, the
    // runtime's) is counted before, not spread over the connections.
    let first = Client::connect(&dev, addr, Config::default()).await?;
    first.call(ECHO, vec![1]).await?;
    let before = snapshot(&dev)?;
    let mut clients = Vec::new();
    for _ in 0..args.conns {
        let c = Client::connect(&dev, addr, Config::default()).await?;
        c.call(ECHO, vec![1]).await?;
        clients.push(c);
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let after = snapshot(&dev)?;
    let n = f64::from(args.conns);
    let per = |a: usize, b: usize| (a.saturating_sub(b)) as f64 / n;
    let (threads, fds) = (per(after.0, before.0), per(after.1, before.1));
    let mib = after.2.saturating_sub(before.2) as f64 / n / f64::from(1 << 20);
    println!(
        "conn_cost: provider {}, {} connections, default Config",
        dev.provider(),
        args.conns
    );
    println!("per connection, both sides: {threads:.1} threads, {fds:.1} fds, {mib:.2} MiB registered");
    println!(
        "per connection, each side: {:.1} threads, {:.1} fds, {:.2} MiB registered",
        threads / 2.0,
        fds / 2.0,
        mib / 2.0
    );
    drop((clients, first));
    Ok(())
}
