//! Soak: many connections with calls in flight across sizes on both sides of the rendezvous
//! threshold, every response checked; at the end sent = answered = handled, registered bytes
//! back at their starting level on both sides, memory flat. Prints calls/s, p50/p99, max RSS.
//!
//! Short by default (CI); the long form is the same test with a bigger budget:
//! `RDMA_RPC_SOAK_SECS=600 RDMA_RPC_SOAK_CONNS=32 cargo test --release --test soak -- --nocapture`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc::transport::Device;
use rdma_rpc::{Client, Config, RpcError, Server};

const METHOD: u32 = 1;
/// Request and response sizes: below, at and above the 16 KiB threshold, up to 1 MiB.
const SIZES: [usize; 8] = [16, 200, 4096, 16 * 1024 - 64, 16 * 1024 + 1, 60_000, 300_000, 1 << 20];

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `seed | response length | pattern(seed)`, `len` bytes in all (at least 12).
fn request(seed: u64, len: usize, response_len: usize) -> Vec<u8> {
    let mut v = seed.to_le_bytes().to_vec();
    v.extend_from_slice(&(response_len as u32).to_le_bytes());
    v.extend(pattern(seed, len.saturating_sub(12)));
    v
}

fn handle(req: &[u8]) -> Result<Vec<u8>, RpcError> {
    let bad = || RpcError::Application("corrupt request".into());
    let seed = u64::from_le_bytes(req.get(..8).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
    let rlen = u32::from_le_bytes(req.get(8..12).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    if req[12..] != pattern(seed, req.len() - 12)[..] {
        return Err(bad());
    }
    Ok(pattern(!seed, rlen))
}

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

async fn settle(dev: &Device, want: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while dev.registered_bytes() != want {
        assert!(
            Instant::now() < deadline,
            "{what}: {} registered bytes, expected {want}",
            dev.registered_bytes()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sizes up to 32 KiB go in one Send, 32-256 KiB in pieces, larger ones by rendezvous: all three
/// paths under load, whatever the provider's own threshold.
fn soak_config() -> Config {
    Config::default().eager_threshold(256 << 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_many_connections_across_the_threshold_nothing_lost_nothing_leaked() {
    let secs = env("RDMA_RPC_SOAK_SECS", 6);
    let conns = env("RDMA_RPC_SOAK_CONNS", 8) as usize;
    let per_conn = env("RDMA_RPC_SOAK_INFLIGHT", 8) as usize;
    let (sdev, cdev) = (
        Device::open_default().expect("device"),
        Device::open_default().expect("device"),
    );
    let handled = Arc::new(AtomicU64::new(0));
    let h = handled.clone();
    let server = Server::builder(soak_config())
        .handler(METHOD, move |req: Vec<u8>| {
            h.fetch_add(1, Ordering::Relaxed);
            async move { handle(&req) }
        })
        .bind(&sdev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let server_base = sdev.registered_bytes();
    tokio::spawn(server.serve());

    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let half = started + Duration::from_secs(secs) / 2;
    let until = started + Duration::from_secs(secs);
    let mut rss_half = None;
    let mut tasks = Vec::new();
    let mut clients = Vec::new();
    for c in 0..conns {
        let client = Client::connect(&cdev, addr, soak_config()).await.expect("connect");
        clients.push(client.clone());
        for t in 0..per_conn {
            let (client, sent, answered) = (client.clone(), sent.clone(), answered.clone());
            tasks.push(tokio::spawn(async move {
                let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
                let mut i = (c * 1000 + t) as u64;
                while Instant::now() < until {
                    i += 1;
                    let (qlen, rlen) = (SIZES[i as usize % 8].max(12), SIZES[(i as usize / 8 + t) % 8]);
                    let seed = i.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    sent.fetch_add(1, Ordering::Relaxed);
                    let t0 = Instant::now();
                    let resp = client.call(METHOD, request(seed, qlen, rlen)).await.expect("call");
                    hist.record(t0.elapsed().as_micros() as u64).expect("record");
                    assert_eq!(resp.len(), rlen, "response length");
                    assert!(resp == pattern(!seed, rlen), "response content");
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                hist
            }));
        }
    }
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if rss_half.is_none() && Instant::now() >= half {
            rss_half = Some(rss_kib("VmRSS:"));
        }
    }
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    for t in tasks {
        hist.add(t.await.expect("caller")).expect("merge");
    }
    let elapsed = started.elapsed();
    let rss_end = rss_kib("VmRSS:");
    let (sent, answered, handled) = (
        sent.load(Ordering::Relaxed),
        answered.load(Ordering::Relaxed),
        handled.load(Ordering::Relaxed),
    );
    drop(clients);
    settle(&cdev, 0, "clients").await;
    settle(&sdev, server_base, "server").await;
    println!(
        "soak: {conns} connections x {per_conn} in flight, {:.1} s, sizes {}..{} B: {sent} calls, {:.0} calls/s, \
         p50 {} us, p99 {} us, max {} us; RSS {} MiB at half time, {} MiB at the end, max {} MiB; \
         registered bytes back to {server_base} (server) and 0 (clients)",
        elapsed.as_secs_f64(),
        SIZES[0],
        SIZES[7],
        sent as f64 / elapsed.as_secs_f64(),
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        hist.max(),
        rss_half.unwrap_or(0) >> 10,
        rss_end >> 10,
        rss_kib("VmHWM:") >> 10,
    );
    assert!(sent > 0);
    assert_eq!((sent, handled), (answered, answered), "sent = handled = answered");
    // Flat: the second half may not grow memory by more than a quarter plus allocator slack.
    let half = rss_half.unwrap_or(rss_end);
    assert!(
        rss_end <= half + half / 4 + 64 * 1024,
        "RSS grew from {half} KiB at half time to {rss_end} KiB"
    );
}
