//! A distributed lock on a remote 8-byte word, guarding a remote counter, and a sequencer, all
//! in one registered region of the server that only clients touch — by CAS, FAA, RDMA Read and
//! RDMA Write; the server's CPU only accepts connections.
//!
//! ```text
//! cargo run --release --example lock -- server --listen 127.0.0.1:7474
//! cargo run --release --example lock -- client --connect 127.0.0.1:7474 --id 1 --increments 1000
//! cargo run --release --example lock -- report --connect 127.0.0.1:7474
//! ```
//! A client repeats: acquire (CAS 0 -> id, with exponential backoff), read the counter, write
//! it plus one, release (CAS id -> 0), and take a ticket from the sequencer (FAA 1). It prints
//! the latencies; `--tickets-out FILE` writes its tickets. `--unlocked` skips the lock, to show
//! the lost updates it prevents.

#[path = "../common/mod.rs"]
mod common;

mod words;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdma_rpc::transport::{AccessFlags, Device, Listener};

use words::{Words, COUNTER, LOCK, SEQUENCER};

#[derive(Parser)]
#[command(about = "a lock by CAS guarding a counter, and a sequencer by FAA, on remote words")]
struct Args {
    /// Transport provider: tcp, shm (processes on one host), verbs or verbs:<device> (default: RDMA_RPC_PROVIDER, else tcp).
    #[arg(long, global = true)]
    provider: Option<String>,
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Holds the words; accepts clients.
    Server {
        /// Address to listen on (port 0 picks one; printed).
        #[arg(long)]
        listen: SocketAddr,
    },
    /// Increments the counter under the lock and takes tickets.
    Client {
        #[arg(long)]
        connect: SocketAddr,
        /// This client's id (1..), the lock word's value while it holds the lock.
        #[arg(long)]
        id: u64,
        #[arg(long, default_value_t = 1000)]
        increments: u64,
        /// Write the tickets taken, one per line.
        #[arg(long)]
        tickets_out: Option<PathBuf>,
        /// Skip the lock (shows lost updates).
        #[arg(long)]
        unlocked: bool,
    },
    /// Prints the three words.
    Report {
        #[arg(long)]
        connect: SocketAddr,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::exit_code(run().await)
}

async fn run() -> common::Result<()> {
    let args = Args::parse();
    let device = common::device(args.provider.as_deref())?;
    match args.role {
        Role::Server { listen } => server(&device, listen),
        Role::Client {
            connect,
            id,
            increments,
            tickets_out,
            unlocked,
        } => client(&device, connect, id, increments, tickets_out, unlocked).await,
        Role::Report { connect } => {
            let mut w = Words::connect(&device, connect).await?;
            let (lock, counter, seq) = (w.read(LOCK).await?, w.read(COUNTER).await?, w.read(SEQUENCER).await?);
            println!("lock {lock} counter {counter} sequencer {seq}");
            Ok(())
        }
    }
}

/// Registers the words and keeps every client's queue pair open; nothing else.
fn server(device: &Device, listen: SocketAddr) -> common::Result<()> {
    let pd = device.alloc_pd()?;
    let cq = device.create_cq(64)?;
    let access =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let words = pd.register(words::BYTES, access)?;
    let private = common::region_bytes(&words.remote())?;
    let listener = Listener::bind(device, listen)?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    common::keep_accepting(listener, pd, cq, private)
}

async fn client(
    device: &Device,
    addr: SocketAddr,
    id: u64,
    increments: u64,
    tickets_out: Option<PathBuf>,
    unlocked: bool,
) -> common::Result<()> {
    if id == 0 {
        return Err("--id 0 is the free lock's value: give 1 or more".into());
    }
    let mut w = Words::connect(device, addr).await?;
    let (mut acquire, mut faa, mut tries) = (common::Latencies::new()?, common::Latencies::new()?, 0u64);
    let mut tickets = Vec::with_capacity(increments as usize);
    for _ in 0..increments {
        if !unlocked {
            let t = Instant::now();
            let mut backoff = Duration::from_micros(1);
            loop {
                tries += 1;
                if w.compare_swap(LOCK, 0, id).await? == 0 {
                    break;
                }
                std::thread::sleep(backoff.mul_f64(0.5 + fastrand_half(tries)));
                backoff = (backoff * 2).min(Duration::from_millis(1));
            }
            acquire.record(t.elapsed());
        }
        let n = w.read(COUNTER).await?;
        w.write(COUNTER, n + 1).await?;
        if !unlocked {
            let held = w.compare_swap(LOCK, id, 0).await?;
            if held != id {
                return Err(format!("client {id} lost the lock to {held} while holding it").into());
            }
        }
        let t = Instant::now();
        tickets.push(w.fetch_add(SEQUENCER, 1).await?);
        faa.record(t.elapsed());
    }
    if let Some(path) = tickets_out {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for t in &tickets {
            writeln!(f, "{t}")?;
        }
        f.flush()?;
    }
    let (a50, a99) = acquire.p50_p99();
    let (f50, f99) = faa.p50_p99();
    println!(
        "client {id}: {increments} increments, {tries} CAS attempts for {} acquisitions",
        acquire.len()
    );
    println!("{:<24} {:>10} {:>10}", "operation", "p50[usec]", "p99[usec]");
    println!("{:<24} {a50:>10.2} {a99:>10.2}", "acquire (CAS+backoff)");
    println!("{:<24} {f50:>10.2} {f99:>10.2}", "ticket (FAA)");
    Ok(())
}

/// A jitter in [0, 0.5) from a counter (xorshift), so that clients do not retry in step.
fn fastrand_half(n: u64) -> f64 {
    let mut x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id());
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    (x % 1000) as f64 / 2000.0
}
