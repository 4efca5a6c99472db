//! Log replication by RDMA Write: a primary appends records straight into the backup's
//! registered log ring with RDMA Write-with-immediate (the immediate says where the record
//! starts); the backup applies each record and returns credits with a Send, so the primary never
//! overwrites what the backup has not applied. The same append as an RPC is timed beside it.
//!
//! ```text
//! cargo run --release --example logsync -- backup --listen 127.0.0.1:7472
//! cargo run --release --example logsync -- primary --connect 127.0.0.1:7472 --mib 8
//! ```
//! Both print the records and bytes they handled and a digest of the log; `--out FILE` writes
//! the log itself (payloads in order). `backup --apply-delay-us N` makes the backup slow: the
//! primary then waits for credits (its "stalls") and nothing is overwritten.

#[path = "../common/mod.rs"]
mod common;

mod backup;
mod primary;
mod record;
mod sink;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "log replication by RDMA Write-with-immediate, with credits")]
struct Args {
    /// Transport provider: tcp, shm (processes on one host), verbs or verbs:<device> (default: RDMA_RPC_PROVIDER, else tcp).
    #[arg(long, global = true)]
    provider: Option<String>,
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Holds the log ring; applies records; returns credits.
    Backup {
        /// Address to listen on (port 0 picks one; printed).
        #[arg(long)]
        listen: SocketAddr,
        /// Size of the log ring in bytes (a multiple of 8, at least 8 KiB).
        #[arg(long, default_value_t = 1 << 20)]
        ring: usize,
        /// Work per applied record, in microseconds (a slow backup).
        #[arg(long, default_value_t = 0)]
        apply_delay_us: u64,
        /// Write the applied log (payloads in order) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Appends records and replicates them to the backup.
    Primary {
        /// The backup's address.
        #[arg(long)]
        connect: SocketAddr,
        /// How much payload to append, in MiB.
        #[arg(long, default_value_t = 8)]
        mib: usize,
        /// How many appends to time as RPCs for comparison.
        #[arg(long, default_value_t = 1000)]
        rpc_appends: u64,
        /// Write the appended log (payloads in order) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
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
        Role::Backup {
            listen,
            ring,
            apply_delay_us,
            out,
        } => backup::run(&device, listen, ring, apply_delay_us, out).await,
        Role::Primary {
            connect,
            mib,
            rpc_appends,
            out,
        } => primary::run(&device, connect, mib << 20, rpc_appends, out).await,
    }
}

/// What the backup tells the primary in its private data.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Offer {
    /// The log ring.
    pub ring: rdma_rpc::transport::RemoteRegion,
    /// Receives posted for notifications: the most records in flight.
    pub depth: u32,
    /// Port of the backup's RPC service, on the same IP.
    pub rpc_port: u16,
}
