//! What the RPC layer tells a tracing subscriber: the per-call spans (`rpc.call` on the client,
//! `rpc.serve` on the server) with their fields, and the `rpc.payload` event that says how a
//! payload from a registered buffer left (sent from the buffer, lent, copied). One process of its
//! own (the subscriber is global), shared by this file's tests: each looks only at its own calls.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

#[allow(dead_code)] // this file uses only `bounded` and `test_ip`
mod common;

use common::test_ip;

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{Body, Buffers, CallOptions, Client, Config, RpcError, Server};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// A span or an event as recorded: the span's name (`event` for events) and the fields as text.
type Seen = (String, Vec<(String, String)>);

/// Records every span made and every event.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<Seen>>,
    next: AtomicU64,
}

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
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut f = Fields(Vec::new());
        span.record(&mut f);
        self.seen
            .lock()
            .expect("lock")
            .push((span.metadata().name().to_owned(), f.0));
        Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut f = Fields(Vec::new());
        event.record(&mut f);
        self.seen.lock().expect("lock").push(("event".to_owned(), f.0));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The process's subscriber, installed by whichever test comes first.
fn recorder() -> Arc<Recorder> {
    static R: OnceLock<Arc<Recorder>> = OnceLock::new();
    R.get_or_init(|| {
        let r = Arc::new(Recorder::default());
        tracing::subscriber::set_global_default(r.clone()).expect("the only subscriber of this process");
        r
    })
    .clone()
}

fn field(fields: &[(String, String)], k: &str) -> Option<String> {
    fields.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_and_every_served_request_has_its_span_once_a_subscriber_is_installed() {
    let spans = recorder();
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let ip = test_ip();
    let server = Server::builder(Config::default())
        .handler(7, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&dev, SocketAddr::new(ip, 0))
        .expect("bind");
    let addr = server.local_addr().expect("address");
    let serving = tokio::spawn(server.serve());
    let client = common::bounded(Client::connect(&dev, addr, Config::default()))
        .await
        .expect("connect");
    for len in [3usize, 5] {
        let r = common::bounded(client.call(7, vec![1; len])).await.expect("call");
        assert_eq!(r.len(), len);
    }
    serving.abort();
    let seen = spans.seen.lock().expect("lock").clone();
    // Method 7 is this test's; the other test of this process calls other methods.
    let of = |name: &str| -> Vec<Vec<(String, String)>> {
        seen.iter()
            .filter(|(n, f)| n == name && field(f, "method").as_deref() == Some("7"))
            .map(|(_, f)| f.clone())
            .collect()
    };
    let calls = of("rpc.call");
    assert_eq!(calls.len(), 2, "one rpc.call span per call: {seen:?}");
    assert_eq!(field(&calls[1], "len").as_deref(), Some("5"));
    let served = of("rpc.serve");
    assert_eq!(served.len(), 2, "one rpc.serve span per request: {seen:?}");
    assert_eq!(field(&served[0], "len").as_deref(), Some("3"));
    assert!(field(&served[0], "call").is_some() && field(&served[0], "budget").is_some());
}

/// Answers as many bytes as the request has, from a buffer of the first
/// connection that called it (so a copy on any other).
const SIZED_BUF: u32 = 9;
const THRESHOLD: usize = 16 * 1024;

/// How the `side` payload of `len` bytes left, per the `rpc.payload` events seen.
fn how(seen: &[Seen], side: &str, len: usize) -> Vec<String> {
    seen.iter()
        .filter(|(n, f)| {
            n == "event"
                && field(f, "message").as_deref() == Some("rpc.payload")
                && field(f, "side").as_deref() == Some(side)
                && field(f, "len") == Some(len.to_string())
        })
        .filter_map(|(_, f)| field(f, "how"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_registered_payload_says_whether_it_was_sent_from_its_buffer_lent_or_copied() {
    let rec = recorder();
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let cfg = Config::default().eager_threshold(THRESHOLD);
    let first: Arc<Mutex<Option<Buffers>>> = Arc::default();
    let server = Server::builder(cfg.clone())
        .handler(SIZED_BUF, move |body: Body, bufs: Buffers| {
            let first = first.lock().expect("lock").get_or_insert(bufs).clone();
            async move { first.buffer(body.len()) }
        })
        .bind(&dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("address");
    let serving = tokio::spawn(server.serve());
    let connect = || common::bounded(Client::connect(&dev, addr, cfg.clone()));
    let (client, other) = (connect().await.expect("connect"), connect().await.expect("connect"));
    // Sizes of this test's own (no other test sends registered payloads of these lengths).
    let (small, large) = (1001usize, 3 * THRESHOLD + 1);
    let (small_elsewhere, large_elsewhere, small_landing) = (1002usize, 3 * THRESHOLD + 2, 1003usize);
    let call = |c: &Client, b, opts| {
        let c = c.clone();
        async move {
            let (r, back) = common::bounded(c.with_options(opts).call_buf_body(SIZED_BUF, b))
                .await
                .expect("call");
            assert_eq!(r.len(), back.len());
        }
    };
    // The first caller: its buffers are the handler's too.
    for len in [small, large] {
        call(&client, client.buffer(len).expect("buffer"), CallOptions::default()).await;
    }
    // A small request behind a landing descriptor (the response hint is above the threshold).
    let hint = CallOptions::default().response_hint(2 * THRESHOLD);
    call(&client, client.buffer(small_landing).expect("buffer"), hint).await;
    // Another connection, calling with the first one's buffers; answered from them too.
    for len in [small_elsewhere, large_elsewhere] {
        call(&other, client.buffer(len).expect("buffer"), CallOptions::default()).await;
    }
    serving.abort();
    let seen = rec.seen.lock().expect("lock").clone();
    let one = |side: &str, len: usize, want: &str| {
        assert_eq!(how(&seen, side, len), [want], "the {side} of {len} bytes: {seen:?}");
    };
    one("request", small, "sent from its buffer");
    one("response", small, "sent from its buffer");
    one("request", large, "lent");
    one("response", large, "lent");
    one("request", small_landing, "copied");
    one("request", small_elsewhere, "copied");
    one("response", small_elsewhere, "copied");
    one("request", large_elsewhere, "copied into a lent buffer");
    one("response", large_elsewhere, "copied into a lent buffer");
}
