//! The client side of a throughput row: `conns` connections, each with `in_flight` calls kept
//! going (closed loop: a call that ends starts the next), every call's latency recorded.
//!
//! rdma-rpc and tarpc clients run `in_flight` tasks per connection, each making one call after
//! another; the TCP echo (one byte stream per connection, no call identifiers) keeps
//! `in_flight` frames written ahead of the answers it reads, in order.
//!
//! Latencies go to one histogram per client thread, not one per task: a histogram of 1 ns to
//! 100 s at 3 significant digits is about 230 KiB, and one per task (8,192 at 4,096
//! connections x 2 in flight) made the client zero 2 GiB of pages while the row ran.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc::transport::Device;
use rdma_rpc::{Client, Config, Connector};
use tarpc::tokio_serde::formats::Bincode;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::server::{System, ECHO};
use crate::baseline::EchoClient;

/// What the loops share: whether the window is open, when to stop, calls made in the window
/// and their latencies.
pub struct Gate {
    /// Calls ending while this is set are counted and timed.
    pub open: AtomicBool,
    pub stop: AtomicBool,
    pub calls: AtomicU64,
    /// The first error a loop met (it stops then).
    pub error: std::sync::Mutex<Option<String>>,
    /// Latencies, one histogram per client thread (a thread takes the next on its first call).
    shards: Vec<Mutex<Histogram<u64>>>,
}

/// Which of the gate's histograms the calling thread records into.
fn shard(n: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    MINE.with(|m| *m % n.max(1))
}

impl Gate {
    /// A gate for a client of `threads` threads.
    pub fn new(threads: usize) -> Arc<Gate> {
        Arc::new(Gate {
            open: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            calls: AtomicU64::new(0),
            error: std::sync::Mutex::new(None),
            shards: (0..threads.max(1)).map(|_| Mutex::new(histogram())).collect(),
        })
    }

    /// Every latency recorded, in one histogram.
    pub fn latencies(&self) -> Histogram<u64> {
        let mut all = histogram();
        for s in &self.shards {
            let _ = all.add(&*s.lock().unwrap_or_else(|p| p.into_inner()));
        }
        all
    }

    fn fail(&self, e: String) {
        if let Ok(mut slot) = self.error.lock() {
            slot.get_or_insert(e);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    /// One call ended after `since`: counted and timed when the window is open.
    fn record(&self, since: Instant) {
        if self.open.load(Ordering::Relaxed) {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let ns = since.elapsed().as_nanos().max(1) as u64;
            let mut h = self.shards[shard(self.shards.len())]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let _ = h.record(ns);
        }
    }
}

fn histogram() -> Histogram<u64> {
    // 1 ns to 100 s, 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("histogram bounds")
}

/// The connections of a row, made before it is timed.
pub enum Conns {
    Rpc(Vec<Client>),
    Tcp(Vec<TcpStream>),
    Tarpc(Vec<EchoClient>),
}

/// Makes `n` connections to `addr` (one after another, as a pool of clients starts).
pub async fn connect(system: System, dev: &Device, addr: SocketAddr, n: usize, cfg: &Config) -> Result<Conns, String> {
    let err = |i: usize, e: String| format!("connection {} of {n}: {e}", i + 1);
    Ok(match system {
        System::Rpc => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(
                    Client::connect(dev, addr, cfg.clone())
                        .await
                        .map_err(|e| err(i, e.report().to_string()))?,
                );
            }
            Conns::Rpc(v)
        }
        System::RpcPool => {
            // Clients of many connections share completion queues, as the server's do.
            let connector = Connector::new(dev, cfg.clone()).map_err(|e| e.report().to_string())?;
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(
                    connector
                        .connect(addr)
                        .await
                        .map_err(|e| err(i, e.report().to_string()))?,
                );
            }
            Conns::Rpc(v)
        }
        System::Tcp => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                let s = TcpStream::connect(addr).await.map_err(|e| err(i, e.to_string()))?;
                s.set_nodelay(true).map_err(|e| err(i, e.to_string()))?;
                v.push(s);
            }
            Conns::Tcp(v)
        }
        System::Tarpc => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                let mut c = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
                c.config_mut().max_frame_length(usize::MAX);
                let t = c.await.map_err(|e| err(i, e.to_string()))?;
                v.push(EchoClient::new(tarpc::client::Config::default(), t).spawn());
            }
            Conns::Tarpc(v)
        }
    })
}

/// Starts the loops of a row on the current runtime; each ends when `gate.stop` is set.
pub fn start(conns: Conns, in_flight: usize, size: usize, gate: &Arc<Gate>) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    match conns {
        Conns::Rpc(clients) => {
            for c in clients {
                for _ in 0..in_flight {
                    let (c, gate) = (c.clone(), gate.clone());
                    tasks.push(tokio::spawn(async move {
                        let payload = vec![0xa5u8; size];
                        while !gate.stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            match c.call(ECHO, payload.clone()).await {
                                Ok(r) if r.len() == size => gate.record(t),
                                Ok(r) => gate.fail(format!("an echo of {size} B came back with {} B", r.len())),
                                Err(e) => gate.fail(format!("call: {e}")),
                            }
                        }
                    }));
                }
            }
        }
        Conns::Tarpc(clients) => {
            for c in clients {
                for _ in 0..in_flight {
                    let (c, gate) = (c.clone(), gate.clone());
                    tasks.push(tokio::spawn(async move {
                        let payload = serde_bytes::ByteBuf::from(vec![0xa5u8; size]);
                        while !gate.stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            let mut ctx = tarpc::context::current();
                            ctx.deadline = Instant::now() + Duration::from_secs(600);
                            match c.echo(ctx, payload.clone()).await {
                                Ok(r) if r.len() == size => gate.record(t),
                                Ok(r) => gate.fail(format!("an echo of {size} B came back with {} B", r.len())),
                                Err(e) => gate.fail(format!("tarpc call: {e}")),
                            }
                        }
                    }));
                }
            }
        }
        Conns::Tcp(streams) => {
            for s in streams {
                let gate = gate.clone();
                tasks.push(tokio::spawn(async move {
                    if let Err(e) = tcp_loop(s, in_flight, size, &gate).await {
                        gate.fail(format!("tcp echo: {e}"));
                    }
                }));
            }
        }
    }
    tasks
}

/// One TCP connection: `in_flight` frames written ahead, each answer read in order. The
/// writer and the reader run apart (both halves in this task), so a writer held up by a full
/// socket never keeps the answers from being read.
async fn tcp_loop(s: TcpStream, in_flight: usize, size: usize, gate: &Gate) -> std::io::Result<()> {
    let (r, mut w) = s.into_split();
    let mut r = BufReader::with_capacity(64 * 1024, r);
    let mut frame = (size as u32).to_le_bytes().to_vec();
    frame.extend(std::iter::repeat_n(0xa5u8, size));
    let slots = tokio::sync::Semaphore::new(in_flight);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let writer = async {
        while !gate.stop.load(Ordering::Relaxed) {
            let Ok(permit) = slots.acquire().await else { break };
            permit.forget();
            let _ = tx.send(Instant::now());
            w.write_all(&frame).await?;
        }
        drop(tx);
        std::io::Result::Ok(())
    };
    let reader = async {
        let mut back = vec![0u8; 4 + size];
        while let Some(t) = rx.recv().await {
            r.read_exact(&mut back).await?;
            gate.record(t);
            slots.add_permits(1);
        }
        std::io::Result::Ok(())
    };
    let (a, b) = tokio::join!(writer, reader);
    a.and(b)
}
