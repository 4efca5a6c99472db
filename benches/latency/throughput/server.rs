//! The server of a throughput row, in a child process of its own (as a user's server is): an
//! rdma-rpc echo, a tokio TCP echo or a tarpc echo, on a runtime of `--server-threads` workers.
//!
//! The child prints `ADDR <addr>` once it listens, then answers each `STATS` line on its stdin
//! with `STATS <cpu µs> <RSS KiB> <threads> <registered bytes> <bytes registered at bind>` (its
//! whole process; the last is a receive pool's, which its connections share), and exits when its
//! stdin ends.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use futures::prelude::*;
use rdma_rpc::transport::Device;
use rdma_rpc::{CompletionMode, Config, Server};
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader as TokioBufReader};
use tokio::net::TcpListener;

use crate::baseline::{Echo, EchoServer};

/// The environment variable that makes this binary a throughput row's server: what it serves.
pub const SERVE_ENV: &str = "RDMA_RPC_TPUT_SERVE";
/// Its completion mode (`spin`, `event`, `adaptive`), connection cap and worker threads.
pub const MODE_ENV: &str = "RDMA_RPC_TPUT_MODE";
pub const CONNS_ENV: &str = "RDMA_RPC_TPUT_CONNS";
pub const THREADS_ENV: &str = "RDMA_RPC_TPUT_THREADS";
pub const IP_ENV: &str = "RDMA_RPC_TPUT_IP";

/// The echo method of the rdma-rpc server.
pub const ECHO: u32 = 1;

/// What a row's server runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    /// rdma-rpc on the run's provider.
    Rpc,
    /// The same with the server on a receive pool ([`pool_config`]).
    RpcPool,
    /// A length-prefixed echo over tokio's TCP (TCP_NODELAY).
    Tcp,
    /// tarpc over TCP (bincode).
    Tarpc,
}

impl System {
    pub fn parse(s: &str) -> Option<System> {
        match s {
            "rpc" => Some(System::Rpc),
            "rpc-pool" => Some(System::RpcPool),
            "tcp" => Some(System::Tcp),
            "tarpc" => Some(System::Tarpc),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            System::Rpc => "rpc",
            System::RpcPool => "rpc-pool",
            System::Tcp => "tcp",
            System::Tarpc => "tarpc",
        }
    }
}

/// The completion mode named on the command line.
pub fn completion(name: &str) -> Option<CompletionMode> {
    match name {
        "spin" => Some(CompletionMode::Spin),
        "event" => Some(CompletionMode::Event),
        "adaptive" => Some(CompletionMode::default()),
        _ => None,
    }
}

/// The rdma-rpc configuration of both ends of a row.
pub fn config(mode: CompletionMode, conns: usize) -> Config {
    Config::default()
        .mode(mode)
        .max_connections(u32::try_from(conns + 16).unwrap_or(u32::MAX))
        .max_payload(1 << 30)
}

/// The server's configuration of an `rpc-pool` row: receives of 4 KiB pieces from one pool of
/// 3 slots per connection it takes (2 each, and as many spare), at most the 16,384 receives a
/// software device's queue holds.
pub fn pool_config(mode: CompletionMode, conns: usize) -> Config {
    let c = config(mode, conns);
    let slots = (c.max_connections.saturating_mul(3)).clamp(64, 16_384);
    c.piece(4096).receive_pool(slots)
}

/// The clients' configuration of an `rpc-pool` row: 4 KiB pieces, as the server's, and a ring
/// of 16, as a client of many connections keeps (its receive slots and send buffers then cost
/// 16 x 4 KiB and 24 x 4 KiB a connection, where the default's are 64 x 32 KiB and 72 x 32 KiB);
/// of 4 beyond 1,024 connections: on `shm` each receive slot is a mapping of its own, and 4,096
/// connections of 16 passed Linux's 65,530 mappings a process (`vm.max_map_count`).
pub fn pool_client_config(mode: CompletionMode, conns: usize) -> Config {
    config(mode, conns).piece(4096).ring(if conns > 1024 { 4 } else { 16 })
}

impl System {
    /// Whether the row's server is rdma-rpc's.
    pub fn is_rpc(self) -> bool {
        matches!(self, System::Rpc | System::RpcPool)
    }
}

/// The whole process's CPU time (user + system), resident memory and threads.
pub fn process_figures() -> (u64, u64, usize) {
    let cpu = cpu_time::ProcessTime::now().as_duration().as_micros() as u64;
    let rss_pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .unwrap_or(0);
    let threads = std::fs::read_dir("/proc/self/task").map(Iterator::count).unwrap_or(0);
    (cpu, rss_pages * 4, threads)
}

/// The child: serves until its stdin ends.
pub fn serve_child(what: &str) -> Result<(), Box<dyn std::error::Error>> {
    let system = System::parse(what).ok_or_else(|| format!("unknown server {what}"))?;
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let mode = completion(&env(MODE_ENV)).unwrap_or_default();
    let conns: usize = env(CONNS_ENV).parse().unwrap_or(1);
    let threads: usize = env(THREADS_ENV).parse().unwrap_or(1);
    let ip: IpAddr = env(IP_ENV).parse().unwrap_or(IpAddr::from([127, 0, 0, 1]));
    crate::scale::raise_fd_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("tput-server")
        .enable_all()
        .build()?;
    let dev = if system.is_rpc() {
        Some(Device::open_default()?)
    } else {
        None
    };
    let unbound = dev.as_ref().map_or(0, Device::registered_bytes);
    let addr = rt.block_on(async {
        match system {
            System::Rpc | System::RpcPool => {
                let dev = dev.as_ref().ok_or("no device")?;
                let cfg = if system == System::RpcPool {
                    pool_config(mode, conns)
                } else {
                    config(mode, conns)
                };
                let server = Server::builder(cfg)
                    .handler(ECHO, |req: Vec<u8>| async move { Ok(req) })
                    .bind(dev, SocketAddr::new(ip, 0))?;
                let addr = server.local_addr()?;
                tokio::spawn(async move {
                    let _ = server.serve().await;
                });
                Ok::<SocketAddr, Box<dyn std::error::Error>>(addr)
            }
            System::Tcp => {
                let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
                let addr = listener.local_addr()?;
                tokio::spawn(tcp_echo(listener));
                Ok(addr)
            }
            System::Tarpc => {
                let mut incoming =
                    tarpc::serde_transport::tcp::listen(SocketAddr::new(ip, 0), Bincode::default).await?;
                incoming.config_mut().max_frame_length(usize::MAX);
                let addr = incoming.local_addr();
                tokio::spawn(async move {
                    incoming
                        .filter_map(|t| async move { t.ok() })
                        .for_each(|t| async move {
                            tokio::spawn(BaseChannel::with_defaults(t).execute(EchoServer.serve()).for_each(
                                |f| async move {
                                    tokio::spawn(f);
                                },
                            ));
                        })
                        .await;
                });
                Ok(addr)
            }
        }
    })?;
    let at_bind = dev.as_ref().map_or(0, Device::registered_bytes).saturating_sub(unbound);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ADDR {addr}")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        if line?.trim() == "STATS" {
            let (cpu, rss, threads) = process_figures();
            let registered = dev.as_ref().map_or(0, Device::registered_bytes);
            writeln!(out, "STATS {cpu} {rss} {threads} {registered} {at_bind}")?;
            out.flush()?;
        }
    }
    drop(rt);
    Ok(())
}

/// A length-prefixed echo: each connection reads frames and writes each back as it comes.
async fn tcp_echo(listener: TcpListener) {
    while let Ok((s, _)) = listener.accept().await {
        tokio::spawn(async move {
            let _ = s.set_nodelay(true);
            let (r, mut w) = s.into_split();
            let mut r = TokioBufReader::with_capacity(64 * 1024, r);
            let mut buf = Vec::new();
            loop {
                let mut len = [0u8; 4];
                if r.read_exact(&mut len).await.is_err() {
                    return;
                }
                let n = u32::from_le_bytes(len) as usize;
                buf.resize(4 + n, 0);
                buf[..4].copy_from_slice(&len);
                if r.read_exact(&mut buf[4..]).await.is_err() || w.write_all(&buf).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// A server child as the parent sees it.
pub struct Remote {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    pub addr: SocketAddr,
}

/// The server's figures at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub cpu_us: u64,
    pub rss_kib: u64,
    pub threads: usize,
    pub registered: u64,
    /// Registered by the server as it bound (a receive pool), before any connection.
    pub at_bind: u64,
}

impl Remote {
    /// Starts a server child for `system`.
    pub fn start(system: System, mode: &str, conns: usize, threads: usize, ip: IpAddr) -> Result<Remote, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .env(SERVE_ENV, system.name())
            .env(MODE_ENV, mode)
            .env(CONNS_ENV, conns.to_string())
            .env(THREADS_ENV, threads.to_string())
            .env(IP_ENV, ip.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the {} server: {e}", system.name()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("the server's output")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .and_then(Result::ok)
            .ok_or_else(|| format!("the {} server ended before it listened", system.name()))?;
        let addr = first
            .strip_prefix("ADDR ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("the {} server said {first:?}", system.name()))?;
        Ok(Remote {
            child,
            stdin,
            lines,
            addr,
        })
    }

    /// The server's figures now.
    pub fn stats(&mut self) -> Result<Stats, String> {
        let stdin = self.stdin.as_mut().ok_or("the server's input is closed")?;
        writeln!(stdin, "STATS").map_err(|e| format!("asking the server: {e}"))?;
        stdin.flush().map_err(|e| e.to_string())?;
        let line = self.lines.next().and_then(Result::ok).ok_or("the server ended")?;
        let f: Vec<u64> = line
            .strip_prefix("STATS ")
            .ok_or_else(|| format!("the server said {line:?}"))?
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        match f[..] {
            [cpu_us, rss_kib, threads, registered, at_bind] => Ok(Stats {
                cpu_us,
                rss_kib,
                threads: threads as usize,
                registered,
                at_bind,
            }),
            _ => Err(format!("the server said {line:?}")),
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// The environment variable that makes this binary a busy process: one thread spinning until
/// its stdin ends, the "other tenant" of a shared machine.
pub const BUSY_ENV: &str = "RDMA_RPC_TPUT_BUSY";

/// The busy child: spins on a thread while the main thread waits for stdin to end.
pub fn busy_child() {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let spinner = std::thread::spawn(move || {
        let mut x = 0u64;
        while !s.load(std::sync::atomic::Ordering::Relaxed) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    });
    let _ = std::io::stdin().lines().count();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = spinner.join();
}

/// A busy process beside the run while it lives.
pub struct Busy(Child);

impl Busy {
    pub fn start() -> Result<Busy, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        Command::new(exe)
            .env(BUSY_ENV, "1")
            .stdin(Stdio::piped())
            .spawn()
            .map(Busy)
            .map_err(|e| format!("starting the busy process: {e}"))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}
