//! A `#[service]`'s `Bulk` without copies: a `Bulk` in memory registered with the connection
//! is lent as it is (request and response), shared by its clones, received where it landed,
//! and a handler answers from the connection's buffers (`context::buffers`). Those that cannot
//! be lent (a `Vec`, another connection's buffer, a small one) are copied, and arrive whole.
//! Over the provider named by `RDMA_RPC_PROVIDER` (default `tcp`; `verbs` on rxe0 in the VM
//! lane). One process of its own: it installs a global tracing subscriber to see the
//! `rpc.payload` events that say how each payload left.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};

use rdma_rpc::transport::Device;
use rdma_rpc::{context, service, Bulk, Client, Config};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Stores and returns raw bytes.
#[service]
trait Blobs {
    /// A digest of `data` (salted), whether it arrived in registered memory, and its length.
    async fn put(&self, salt: u64, data: Bulk) -> (u64, bool, usize);
    /// `len` bytes of `byte`, answered from the connection's registered buffers.
    async fn make(&self, len: u32, byte: u8) -> Bulk;
    /// `data` back as it came.
    async fn echo(&self, data: Bulk) -> Bulk;
}

struct Store;

fn digest(salt: u64, b: &[u8]) -> u64 {
    b.iter().fold(salt ^ 0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Blobs for Store {
    async fn put(&self, salt: u64, data: Bulk) -> (u64, bool, usize) {
        (digest(salt, &data.bytes()), data.is_registered(), data.len())
    }
    async fn make(&self, len: u32, byte: u8) -> Bulk {
        let bufs = context::buffers().expect("a #[service] method has its connection's buffers");
        let mut b = bufs.buffer(len as usize).expect("a registered buffer");
        b.bytes_mut().fill(byte);
        Bulk::from(b)
    }
    async fn echo(&self, data: Bulk) -> Bulk {
        data
    }
}

/// Records the `rpc.payload` events: (side, len, how).
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, String, String)>>);

#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let get = |k: &str| f.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        if get("message").as_deref() == Some("rpc.payload") {
            let (side, len, how) = (get("side"), get("len"), get("how"));
            if let (Some(s), Some(l), Some(h)) = (side, len, how) {
                self.0.lock().expect("lock").push((s, l, h));
            }
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn recorder() -> Arc<Recorder> {
    static R: OnceLock<Arc<Recorder>> = OnceLock::new();
    R.get_or_init(|| {
        let r = Arc::new(Recorder::default());
        tracing::subscriber::set_global_default(r.clone()).expect("the only subscriber of this process");
        r
    })
    .clone()
}

/// How payloads of `side` and `len` bytes left, in order.
fn how(rec: &Recorder, side: &str, len: usize) -> Vec<String> {
    rec.0
        .lock()
        .expect("lock")
        .iter()
        .filter(|(s, l, _)| s == side && *l == len.to_string())
        .map(|(_, _, h)| h.clone())
        .collect()
}

fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

const THRESHOLD: usize = 16 << 10;

fn config() -> Config {
    Config::default().eager_threshold(THRESHOLD)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

/// A server of `Store` and a client (and its connection).
async fn setup(dev: &Device) -> (BlobsClient, Client) {
    let server = BlobsServer::new(Store)
        .bind(dev, SocketAddr::new(test_ip(), 0), config())
        .expect("bind");
    let addr = server.local_addr().expect("address");
    tokio::spawn(server.serve());
    let conn = Client::connect(dev, addr, config()).await.expect("connect");
    (BlobsClient::new(conn.clone()), conn)
}

/// A registered `Bulk` of `len` bytes of `data`'s pattern, on `conn`.
fn registered(conn: &Client, data: &[u8]) -> Bulk {
    let mut b = conn.buffer(data.len()).expect("a registered buffer");
    b.bytes_mut().copy_from_slice(data);
    Bulk::from(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_bulk_is_lent_as_it_is_both_ways_and_its_clones_share_it() {
    let rec = recorder();
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let (blobs, conn) = setup(&dev).await;
    // Lengths of this test's own: the events are told apart by them.
    let (len, made, echoed) = (5 * THRESHOLD + 11, 4 * THRESHOLD + 13, 3 * THRESHOLD + 17);
    let data = pattern(len, 3);
    let bulk = registered(&conn, &data);
    // Three calls at once, each with a clone: one registration, lent three times.
    let calls = (0..3u64).map(|salt| {
        let (blobs, bulk) = (blobs.clone(), bulk.clone());
        async move { blobs.put(salt, bulk).await }
    });
    for (salt, got) in futures::future::join_all(calls).await.into_iter().enumerate() {
        let (d, in_registered, n) = got.expect("put");
        assert_eq!((d, n), (digest(salt as u64, &data), len), "the bytes arrived whole");
        // A typed method takes its request where it was read into: registered memory.
        assert!(in_registered, "the handler's Bulk is where the request was read into");
    }
    assert_eq!(how(&rec, "request", len), ["lent"; 3], "each call lent the same buffer");
    assert_eq!(bulk.to_vec(), data, "lending leaves the bytes as they were");

    // A handler's Bulk from the connection's buffers is lent to the caller as it is, and read
    // where it landed (registered memory, or a vector of its own where registering is cheap).
    let got = blobs.make(made as u32, 0x5a).await.expect("make");
    assert_eq!(got.len(), made);
    assert!(got.bytes().iter().all(|&b| b == 0x5a));
    assert_eq!(how(&rec, "response", made), ["lent"]);
    assert_eq!(got.is_registered(), !dev.caps().cheap_registration);

    // The request's own Bulk, answered back: lent from where it was read into, no copy.
    let data = pattern(echoed, 9);
    let back = blobs.echo(registered(&conn, &data)).await.expect("echo");
    assert_eq!(back.to_vec(), data);
    assert_eq!(how(&rec, "request", echoed), ["lent"]);
    assert_eq!(how(&rec, "response", echoed), ["lent"]);
    // What came back is registered with the connection too (not on tcp: a vector there), so
    // it goes out again without a copy.
    if back.is_registered() {
        let (d, _, n) = blobs.put(1, back).await.expect("put again");
        assert_eq!((d, n), (digest(1, &data), echoed));
        assert_eq!(how(&rec, "request", echoed), ["lent", "lent"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulks_that_cannot_be_lent_are_copied_and_arrive_whole() {
    let rec = recorder();
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let (blobs, _conn) = setup(&dev).await;
    let (_, other) = setup(&dev).await;
    // Another connection's registered buffer: copied into one of this connection's, lent.
    let len = 6 * THRESHOLD + 19;
    let data = pattern(len, 5);
    let (d, _, n) = blobs.put(7, registered(&other, &data)).await.expect("put");
    assert_eq!((d, n), (digest(7, &data), len));
    assert_eq!(how(&rec, "request", len), ["copied into a lent buffer"]);
    // A shared Vec, a whole one, a slice of one, an empty one, and small ones either way.
    let v = Bulk::from(pattern(len + 1, 6));
    let keep = v.clone();
    for b in [
        v,
        Bulk::from(pattern(len + 2, 7)),
        keep.slice(100..len).expect("within"),
        Bulk::new(),
        Bulk::from(pattern(100, 8)),
        registered(&other, &pattern(200, 9)),
    ] {
        let want = b.to_vec();
        let (d, _, n) = blobs.put(3, b).await.expect("put");
        assert_eq!((d, n), (digest(3, &want), want.len()), "a {}-byte Bulk", want.len());
        let back = blobs.echo(Bulk::from(want.clone())).await.expect("echo");
        assert_eq!(back.to_vec(), want, "a {}-byte Bulk echoed", want.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_bulk_results_hold_no_receive_slot() {
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let (blobs, _conn) = setup(&dev).await;
    // Twice the ring's worth of 4 KiB results, all kept at once: each arrived in a receive
    // slot and was copied out of it, so none holds a slot (and calls never wait for credits).
    let ring = Config::default().ring as usize;
    let mut kept = Vec::new();
    for i in 0..2 * ring {
        let b = blobs.make(4096, i as u8).await.expect("make");
        assert!(!b.is_registered(), "a small result is not kept in its receive slot");
        kept.push(b);
    }
    assert!(kept
        .iter()
        .enumerate()
        .all(|(i, b)| b.bytes().iter().all(|&x| x == i as u8)));
}
