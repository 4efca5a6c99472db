//! `#[service]` end to end: a service with methods of every supported shape, served and called
//! over the provider named by `RDMA_RPC_PROVIDER` (default `tcp`; in the VM lane `verbs` on
//! rxe0, with `RDMA_RPC_TEST_IP`). Servers go through `split` (rpc-core's test helper), so the
//! two-host lane runs every test that has one with its server on the other host.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdma_rpc::transport::Device;
use rdma_rpc::{service, Bulk, CallOptions, Client, Config, RpcError, Server};
use serde::{Deserialize, Serialize};

#[path = "../rpc-core/tests/common/split.rs"]
#[allow(dead_code)] // this file uses `serve` only
mod split;

impl split::Serve for Server {
    fn addr(&self) -> SocketAddr {
        self.local_addr().expect("the server's address")
    }
    fn start(self) {
        tokio::spawn(self.serve());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Point {
    x: f64,
    y: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum MathError {
    DivideByZero,
    Overflow { a: i64, b: i64 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Item {
    name: String,
    blob: Bulk,
}

/// A service with one method of each shape.
#[service]
trait Lab {
    /// Unit in, unit out.
    async fn ping(&self);
    /// Several arguments, a tuple back.
    async fn add(&self, a: u64, b: u32, label: String) -> (u64, String);
    /// A user struct both ways.
    async fn scale(&self, p: Point, by: f64) -> Point;
    /// A user error carried to the client.
    async fn divide(&self, a: i64, b: i64) -> Result<i64, MathError>;
    /// A bulk argument (raw, rendezvous above the threshold) between two others.
    async fn digest(&self, tag: u32, data: Bulk, salt: u64) -> (u32, u64, usize);
    /// A bulk result.
    async fn fill(&self, len: u32, byte: u8) -> Bulk;
    /// Bulk inside other types: serialized as byte strings.
    async fn index(&self, items: Vec<Item>) -> Option<BTreeMap<String, Bulk>>;
    /// A pinned id.
    #[rpc(id = 77)]
    async fn calls(&self) -> u64;
    /// Sleeps, for deadlines.
    async fn nap(&self, ms: u64);
    /// The milliseconds left of the caller's deadline, as the handler sees it.
    async fn budget_left(&self) -> Option<u64>;
}

#[derive(Default)]
struct LabImpl {
    calls: AtomicU64,
}

impl LabImpl {
    fn count(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

fn digest_of(salt: u64, data: &[u8]) -> u64 {
    data.iter().fold(salt ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Lab for LabImpl {
    async fn ping(&self) {
        self.count();
    }
    async fn add(&self, a: u64, b: u32, label: String) -> (u64, String) {
        self.count();
        (a + u64::from(b), format!("{label}!"))
    }
    async fn scale(&self, p: Point, by: f64) -> Point {
        self.count();
        Point {
            x: p.x * by,
            y: p.y * by,
        }
    }
    async fn divide(&self, a: i64, b: i64) -> Result<i64, MathError> {
        self.count();
        if b == 0 {
            return Err(MathError::DivideByZero);
        }
        a.checked_div(b).ok_or(MathError::Overflow { a, b })
    }
    async fn digest(&self, tag: u32, data: Bulk, salt: u64) -> (u32, u64, usize) {
        self.count();
        (tag, digest_of(salt, &data.bytes()), data.len())
    }
    async fn fill(&self, len: u32, byte: u8) -> Bulk {
        self.count();
        let mut v = vec![byte; len as usize];
        if let Some(last) = v.last_mut() {
            *last = byte.wrapping_add(1);
        }
        v.into()
    }
    async fn index(&self, items: Vec<Item>) -> Option<BTreeMap<String, Bulk>> {
        self.count();
        (!items.is_empty()).then(|| items.into_iter().map(|i| (i.name, i.blob)).collect())
    }
    async fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
    async fn nap(&self, ms: u64) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    async fn budget_left(&self) -> Option<u64> {
        rdma_rpc::context::remaining().map(|d| d.as_millis() as u64)
    }
}

fn device() -> Device {
    Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER")
}

fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

async fn lab() -> (LabClient, Device) {
    let dev = device();
    let server = LabServer::new(LabImpl::default())
        .bind(&dev, SocketAddr::new(test_ip(), 0), Config::default())
        .expect("bind");
    let addr = split::serve(server).await;
    let client = LabClient::connect(&dev, addr, Config::default())
        .await
        .expect("connect");
    (client, dev)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_shape_works_end_to_end() {
    let (lab, _dev) = lab().await;
    lab.ping().await.expect("ping");
    assert_eq!(
        lab.add(40, 2, "sum".into()).await.expect("add"),
        (42, "sum!".to_string())
    );
    assert_eq!(
        lab.scale(Point { x: 1.5, y: -2.0 }, 2.0).await.expect("scale"),
        Point { x: 3.0, y: -4.0 }
    );
    assert_eq!(lab.divide(7, 2).await.expect("divide"), Ok(3));
    assert_eq!(lab.divide(7, 0).await.expect("divide"), Err(MathError::DivideByZero));
    assert_eq!(
        lab.divide(i64::MIN, -1).await.expect("divide"),
        Err(MathError::Overflow { a: i64::MIN, b: -1 })
    );
    let items = vec![
        Item {
            name: "a".into(),
            blob: pattern(10, 1).into(),
        },
        Item {
            name: "b".into(),
            blob: pattern(40_000, 2).into(),
        },
    ];
    let map = lab.index(items).await.expect("index").expect("some");
    assert_eq!(map["b"].bytes()[..], pattern(40_000, 2)[..]);
    assert_eq!(lab.index(vec![]).await.expect("index"), None);
    assert_eq!(lab.calls().await.expect("calls"), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_arguments_and_results_cross_the_rendezvous_threshold_intact() {
    let (lab, dev) = lab().await;
    let t = rdma_rpc::Config::default().eager_threshold_on(&dev);
    // Past the threshold, within the largest payload (shm's threshold is half of it).
    let max = rdma_rpc::Config::default().max_payload as usize;
    let sizes = [0, 1, t - 64, t, t + 1, 3 * t + 5, 4 << 20];
    for len in sizes.into_iter().filter(|&n| n <= max) {
        let data = pattern(len, len as u8);
        let want = digest_of(9, &data);
        let (tag, digest, n) = lab.digest(len as u32, data.into(), 9).await.expect("digest");
        assert_eq!((tag, digest, n), (len as u32, want, len), "request of {len} bytes");
        let got = lab.fill(len as u32, 0xab).await.expect("fill");
        assert_eq!(got.len(), len, "response of {len} bytes");
        assert!(
            got.bytes().iter().rev().skip(1).all(|&b| b == 0xab),
            "response of {len} bytes"
        );
        if len > 0 {
            assert_eq!(got.bytes()[len - 1], 0xac);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_typed_calls_each_get_their_own_answer() {
    let (lab, _dev) = lab().await;
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let lab = lab.clone();
        tasks.push(tokio::spawn(async move {
            let size = if i % 4 == 0 { 64 << 10 } else { 100 };
            let data = pattern(size, i as u8);
            let want = digest_of(i, &data);
            let (tag, d, _) = lab.digest(i as u32, data.into(), i).await.expect("digest");
            assert_eq!((tag, d), (i as u32, want));
            let (sum, label) = lab.add(i, 1, format!("{i}")).await.expect("add");
            assert_eq!((sum, label), (i + 1, format!("{i}!")));
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(lab.calls().await.expect("calls"), 128);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_options_applies_a_deadline_to_every_call() {
    let (lab, _dev) = lab().await;
    // A deadline far above a round trip even under the VM lane's emulation (where a 1 ms nap
    // once took more than 50 ms), far below the long nap: only whether it applies is tested.
    let hasty = lab.with_options(CallOptions::default().deadline(Duration::from_millis(1000)));
    assert_eq!(hasty.options().deadline, Some(Duration::from_millis(1000)));
    assert_eq!(hasty.nap(10_000).await, Err(RpcError::DeadlineExceeded));
    hasty.nap(1).await.expect("a short nap fits the deadline");
    lab.nap(100).await.expect("the original handle has no deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_sees_its_callers_deadline() {
    let (lab, _dev) = lab().await;
    assert_eq!(lab.budget_left().await.expect("call"), None, "no deadline, none seen");
    let timed = lab.with_options(CallOptions::default().deadline(Duration::from_secs(600)));
    let left = timed
        .budget_left()
        .await
        .expect("call")
        .expect("the method sees the deadline");
    assert!(left > 0 && left <= 600_000, "{left} ms left of 600 s");
    assert_eq!(rdma_rpc::context::deadline(), None, "outside a handler");
}

#[test]
fn method_ids_are_stable_and_pinnable() {
    let ids: BTreeMap<_, _> = LabClient::METHOD_IDS.iter().copied().collect();
    assert_eq!(ids.len(), 10);
    assert_eq!(ids["calls"], 77);
    // FNV-1a 32 of "Lab.ping": a wire-compatibility promise, so it is written down here.
    let fnv = |s: &str| {
        s.bytes()
            .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
    };
    assert_eq!(ids["ping"], fnv("Lab.ping"));
    assert_eq!(ids["digest"], fnv("Lab.digest"));
}

/// Another service on the same server: ids derive from the trait's name too.
#[service]
trait Clock {
    async fn ping(&self) -> String;
}

struct ClockImpl;

impl Clock for ClockImpl {
    async fn ping(&self) -> String {
        "tick".into()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_share_one_server_and_one_connection() {
    let dev = device();
    let builder = Server::builder(Config::default());
    let builder = LabServer::new(LabImpl::default()).register(builder);
    let server = ClockServer::new(ClockImpl)
        .register(builder)
        .bind(&dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = split::serve(server).await;
    let raw = Client::connect(&dev, addr, Config::default()).await.expect("connect");
    let (lab, clock) = (LabClient::new(raw.clone()), ClockClient::new(raw));
    lab.ping().await.expect("Lab.ping");
    assert_eq!(clock.ping().await.expect("Clock.ping"), "tick");
    assert_ne!(LabClient::METHOD_IDS[0].1, ClockClient::METHOD_IDS[0].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_mismatched_calls_are_typed_errors() {
    let (lab, _dev) = lab().await;
    let ids: BTreeMap<_, _> = LabClient::METHOD_IDS.iter().copied().collect();
    let raw = lab.inner().expect("a client over one connection");
    // Bytes that are not the arguments of `add`, and a bulk request whose trailer lies.
    for (method, bytes) in [
        ("add", vec![0xff; 3]),
        ("add", vec![]),
        ("digest", u64::MAX.to_le_bytes().to_vec()),
    ] {
        match raw.call(ids[method], bytes).await {
            Err(RpcError::BadRequest(msg)) => assert!(msg.contains(&format!("Lab.{method}")), "{msg}"),
            other => panic!("{method}: expected BadRequest, got {other:?}"),
        }
    }
    assert_eq!(raw.call(12345, vec![]).await, Err(RpcError::UnknownMethod(12345)));
    // A client of another service version: same name and id, another result type.
    #[service(crate = ::rdma_rpc)]
    trait LabV2 {
        #[rpc(id = 77)]
        async fn calls(&self) -> (u64, u64, u64);
    }
    let v2 = LabV2Client::new(raw.clone());
    match v2.calls().await {
        Err(RpcError::Protocol(msg)) => assert!(msg.contains("LabV2.calls"), "{msg}"),
        other => panic!("expected a Protocol error, got {other:?}"),
    }
    // The server is unharmed.
    lab.ping().await.expect("ping after bad requests");
}

/// A typed client over a `Channel` outlives its server: after a graceful restart on the same
/// address, its calls reach the new server. Both ends stay in this process in every lane: the
/// restart needs the first server's address and its shutdown here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_client_over_a_channel_reaches_a_restarted_server() {
    let dev = device();
    let bind = |addr| {
        LabServer::new(LabImpl::default())
            .bind(&dev, addr, Config::default())
            .expect("bind")
    };
    let server = bind(SocketAddr::new(test_ip(), 0));
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let channel = rdma_rpc::Channel::connect(&dev, addr, Config::default(), rdma_rpc::Reconnect::default())
        .await
        .expect("connect");
    let client = LabClient::from_channel(channel);
    assert!(client.inner().is_none() && client.channel().is_some());
    assert_eq!(client.add(1, 2, "x".into()).await.expect("add"), (3, "x!".to_string()));
    stop.send(()).expect("the server runs");
    serving.await.expect("task").expect("a clean shutdown");
    let server = bind(addr);
    tokio::spawn(server.serve());
    // The new server has run nothing before (the old one ran `add`): the call went to it.
    assert_eq!(client.calls().await.expect("calls"), 0);
    assert_eq!(client.channel().map(|c| c.reconnects()), Some(1));
}
