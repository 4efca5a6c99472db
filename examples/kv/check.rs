//! Writers and readers at once. Writer `w` owns the keys `k` with `k % writers == w` and puts
//! `(k, n)` for n = 1, 2, ... (with a body derived from both), by RPC or by RDMA Write with
//! immediate (`--put-by`; by default the odd writers write); after each put returns it
//! publishes `n` as key k's floor. A reader notes the floor, then GETs (one-sided, or by RPC
//! every eighth time) and fails on: a body that does not match its `(k, n)` (torn), `n` below
//! the floor or a missing key whose floor is set (stale), `n` below what this reader saw
//! before for k (out of order). That is the protocol's promise: a GET returns a value that was
//! current at some instant during the GET.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc::transport::Device;
use rdma_rpc::Config;

use crate::client::{OneSided, Writer};
use crate::common;
use crate::service::KvClient;

#[derive(clap::Args)]
pub struct Opts {
    /// Writer connections.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Reader connections (each with a one-sided queue pair and an RPC client).
    #[arg(long, default_value_t = 2)]
    readers: usize,
    /// Keys in play.
    #[arg(long, default_value_t = 16)]
    keys: usize,
    /// How long to run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Also delete and re-create keys (writers delete every 16th put's key, then put it again).
    #[arg(long)]
    deletes: bool,
    /// Keep going past `--seconds` until this many torn copies were caught (so that the
    /// detection is known to have been exercised), for at most `--max-seconds`.
    #[arg(long, default_value_t = 0)]
    min_torn: u64,
    /// The limit for `--min-torn`.
    #[arg(long, default_value_t = 60.0)]
    max_seconds: f64,
    /// How writers PUT: `rpc`, `write-imm` (RDMA Write with immediate), or `mixed` (the odd
    /// writers by Write-with-immediate).
    #[arg(long, default_value = "mixed")]
    put_by: PutBy,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PutBy {
    Rpc,
    WriteImm,
    Mixed,
}

/// A writer's way of putting.
enum Putter {
    Rpc(KvClient),
    Write(Writer),
}

impl Putter {
    async fn put(&mut self, key: Vec<u8>, value: Vec<u8>) -> common::Result<()> {
        match self {
            Putter::Rpc(kv) => Ok(kv.put(key, value).await??),
            Putter::Write(w) => w.put(&key, &value).await,
        }
    }
}

/// When writers and readers stop: after `until`, once enough torn copies were caught (or at
/// `cap`).
#[derive(Clone)]
struct Stop {
    until: Instant,
    cap: Instant,
    min_torn: u64,
    torn: Arc<AtomicU64>,
}

impl Stop {
    fn going(&self) -> bool {
        let now = Instant::now();
        now < self.until || (self.torn.load(Ordering::Relaxed) < self.min_torn && now < self.cap)
    }
}

fn key(k: usize) -> Vec<u8> {
    format!("check-{k}").into_bytes()
}

fn value(k: usize, n: u64) -> Vec<u8> {
    let mut v = (k as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&n.to_le_bytes());
    v.extend(common::pattern(k as u64 * 1_000_003 + n, 8 + (n as usize * 37) % 600));
    v
}

/// `(k, n)` if the value is whole.
fn parse(v: &[u8]) -> Option<(usize, u64)> {
    let k = u64::from_le_bytes(v.get(..8)?.try_into().ok()?) as usize;
    let n = u64::from_le_bytes(v.get(8..16)?.try_into().ok()?);
    (value(k, n) == v).then_some((k, n))
}

pub async fn run(device: &Device, rpc: SocketAddr, one_sided: SocketAddr, o: Opts) -> common::Result<()> {
    let floors: Arc<Vec<AtomicU64>> = Arc::new((0..o.keys).map(|_| AtomicU64::new(0)).collect());
    // A delete makes a key absent for a moment, which a reader may see: its floor says so.
    let deleting: Arc<Vec<AtomicU64>> = Arc::new((0..o.keys).map(|_| AtomicU64::new(0)).collect());
    let started = Instant::now();
    let stop = Stop {
        until: started + Duration::from_secs_f64(o.seconds),
        cap: started + Duration::from_secs_f64(o.max_seconds.max(o.seconds)),
        min_torn: o.min_torn,
        torn: Arc::new(AtomicU64::new(0)),
    };

    // Delete, both GETs, re-create: the basics first.
    let kv = KvClient::connect(device, rpc, Config::default()).await?;
    let mut reader = OneSided::connect(device, one_sided).await?;
    kv.put(b"basics".to_vec(), b"v1".to_vec()).await??;
    let seen = (kv.get(b"basics".to_vec()).await?, reader.get(b"basics").await?);
    if seen != (Some(b"v1".to_vec()), Some(b"v1".to_vec())) || !kv.delete(b"basics".to_vec()).await? {
        return Err(format!("put/get/delete basics failed: {seen:?}").into());
    }
    if kv.get(b"basics".to_vec()).await?.is_some() || reader.get(b"basics").await?.is_some() {
        return Err("a deleted key is still visible".into());
    }

    let mut tasks = Vec::new();
    let mut by_write = 0;
    for w in 0..o.writers {
        let kv = KvClient::connect(device, rpc, Config::default()).await?;
        let writes = o.put_by == PutBy::WriteImm || (o.put_by == PutBy::Mixed && w % 2 == 1);
        let mut putter = if writes {
            by_write += 1;
            Putter::Write(Writer::connect(device, one_sided).await?)
        } else {
            Putter::Rpc(kv.clone())
        };
        let (floors, deleting, deletes, keys, stop) =
            (floors.clone(), deleting.clone(), o.deletes, o.keys, stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut puts = 0u64;
            let mut n = vec![0u64; keys];
            while stop.going() {
                for k in (w..keys).step_by(o.writers) {
                    n[k] += 1;
                    if deletes && n[k] % 16 == 0 {
                        deleting[k].fetch_add(1, Ordering::SeqCst);
                        kv.delete(key(k)).await?;
                    }
                    putter.put(key(k), value(k, n[k])).await?;
                    if deletes && n[k] % 16 == 0 {
                        deleting[k].fetch_add(1, Ordering::SeqCst);
                    }
                    floors[k].store(n[k], Ordering::SeqCst);
                    puts += 1;
                }
            }
            common::Result::Ok((puts, 0u64, 0u64, 0u64))
        }));
    }
    for r in 0..o.readers {
        let kv = KvClient::connect(device, rpc, Config::default()).await?;
        let mut reader = OneSided::connect(device, one_sided).await?;
        let (floors, deleting, keys, stop) = (floors.clone(), deleting.clone(), o.keys, stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut last = vec![0u64; keys];
            let (mut reads, mut by_rpc, mut torn_seen) = (0u64, 0u64, 0u64);
            let mut i = r;
            while stop.going() {
                i = i.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                let k = (i >> 8) % keys;
                let floor = floors[k].load(Ordering::SeqCst);
                let del_before = deleting[k].load(Ordering::SeqCst);
                let got = if reads % 8 == 7 {
                    by_rpc += 1;
                    kv.get(key(k)).await?
                } else {
                    reader.get(&key(k)).await?
                };
                reads += 1;
                stop.torn.fetch_add(reader.torn - torn_seen, Ordering::Relaxed);
                torn_seen = reader.torn;
                let Some(v) = got else {
                    // Absent is fine only before the first put, or during a delete.
                    let deleting_now = del_before % 2 == 1 || deleting[k].load(Ordering::SeqCst) != del_before;
                    if floor > 0 && !deleting_now {
                        return Err(format!("stale: key {k} missing after put {floor} returned").into());
                    }
                    continue;
                };
                let (kk, n) = parse(&v).ok_or_else(|| format!("torn value returned for key {k}"))?;
                if kk != k {
                    return Err(format!("key {k} returned the value of key {kk}").into());
                }
                if n < floor {
                    return Err(format!("stale: key {k} gave put {n} after put {floor} returned").into());
                }
                if n < last[k] {
                    return Err(format!("out of order: key {k} gave put {n} after put {}", last[k]).into());
                }
                last[k] = n;
            }
            common::Result::Ok((0, reads, by_rpc, reader.torn))
        }));
    }
    let (mut puts, mut reads, mut by_rpc, mut torn) = (0, 0, 0, 0);
    for t in tasks {
        let (p, r, b, tr) = t.await??;
        (puts, reads, by_rpc, torn) = (puts + p, reads + r, by_rpc + b, torn + tr);
    }
    println!(
        "check passed: {puts} puts by {} writers ({by_write} by RDMA Write with immediate), {reads} GETs by {} \
         readers ({by_rpc} by RPC, {} one-sided), {torn} torn copies caught and read again, 0 torn, stale or \
         out-of-order values returned",
        o.writers,
        o.readers,
        reads - by_rpc
    );
    Ok(())
}
