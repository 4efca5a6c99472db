//! What the end-to-end test files share.

use std::net::IpAddr;
use std::time::Duration;

use rdma_rpc_core::transport::Device;

// Each test binary uses the part it needs.
#[allow(dead_code)]
pub mod split;

impl split::Serve for rdma_rpc_core::Server {
    fn addr(&self) -> std::net::SocketAddr {
        self.local_addr().expect("the server's address")
    }
    fn start(self) {
        tokio::spawn(self.serve());
    }
}

/// The provider named by `RDMA_RPC_PROVIDER` (default `tcp`).
pub fn device() -> Device {
    Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER")
}

/// The address servers bind to: `RDMA_RPC_TEST_IP` (rxe0's in the VM lane), else loopback.
pub fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

/// Awaits `f`, failing the test after 300 s instead of hanging.
pub async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(300), f)
        .await
        .expect("bounded: no hang")
}

/// The span (µs) a drop test draws its callers' waits from: twice the median of the times the
/// timed calls in `calls` took, made at once as the callers make theirs, and at least
/// `floor_us`. On any machine (the VM lane's emulated NIC, where transfers queue, included)
/// about half the calls then finish within their wait and the others are dropped mid-call, as
/// [`tally`] checks; fixed spans once let none finish there.
pub async fn drop_span(calls: Vec<tokio::task::JoinHandle<Duration>>, floor_us: u64) -> u64 {
    let mut times = Vec::new();
    for c in calls {
        times.push(bounded(c).await.expect("a timed caller"));
    }
    times.sort();
    let median = times.get(times.len() / 2).copied().unwrap_or_default();
    (median.as_micros() as u64 * 2).max(floor_us)
}

/// How long a drop test's caller waits for its call number `i` (`r` from its [`Rng`]): a random
/// part of `span`, but the whole of it for its first call. Once calls are dropped, the emulated
/// NIC of the VM lane still carries their queued transfers (the server's RDMA Reads of bodies
/// nobody waits for any more), and a later call can wait behind all of them; a run once had
/// every one of 2,400 calls time out that way. First calls start before any backlog, so some
/// complete on any machine and [`tally`] sees both outcomes.
pub fn drop_wait(i: u64, r: u64, span: u64) -> Duration {
    Duration::from_micros(if i == 0 { span } else { r % span.max(1) })
}

/// Waits for callers that each report (calls completed, calls dropped mid-flight), checks that
/// both happened (else the waits need tuning), prints and returns the totals.
pub async fn tally(tasks: Vec<tokio::task::JoinHandle<(usize, usize)>>) -> (usize, usize) {
    let (mut done, mut dropped) = (0, 0);
    for t in tasks {
        let (d, x) = bounded(t).await.expect("caller");
        done += d;
        dropped += x;
    }
    println!("{done} calls completed, {dropped} dropped mid-flight");
    assert!(dropped > 0, "no call was dropped: make the waits shorter");
    assert!(done > 0, "no call completed: make the waits longer");
    (done, dropped)
}

/// A caller's reproducible xorshift stream, seeded by the caller's number.
pub struct Rng(u64);

impl Rng {
    pub fn new(caller: u64) -> Self {
        Rng(caller.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}
