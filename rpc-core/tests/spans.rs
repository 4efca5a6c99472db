//! The per-call tracing spans: `rpc.call` on the client and `rpc.serve` on the server, with
//! their fields, once a subscriber is installed (a process of its own: the subscriber is global).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[allow(dead_code)] // this file uses only `bounded`
mod common;

use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{Client, Config, RpcError, Server};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// A span as recorded: its name and its fields as text.
type Seen = (String, Vec<(String, String)>);

/// Records every span made.
#[derive(Default)]
struct Spans {
    seen: Mutex<Vec<Seen>>,
    next: AtomicU64,
}

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl Subscriber for Spans {
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
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_and_every_served_request_has_its_span_once_a_subscriber_is_installed() {
    let spans = Arc::new(Spans::default());
    tracing::subscriber::set_global_default(spans.clone()).expect("the only subscriber of this process");
    let dev = Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER");
    let ip = std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
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
    let of = |name: &str| -> Vec<Vec<(String, String)>> {
        seen.iter().filter(|(n, _)| n == name).map(|(_, f)| f.clone()).collect()
    };
    let field = |fields: &[(String, String)], k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let calls = of("rpc.call");
    assert_eq!(calls.len(), 2, "one rpc.call span per call: {seen:?}");
    assert_eq!(field(&calls[0], "method").as_deref(), Some("7"));
    assert_eq!(field(&calls[1], "len").as_deref(), Some("5"));
    let served = of("rpc.serve");
    assert_eq!(served.len(), 2, "one rpc.serve span per request: {seen:?}");
    assert_eq!(field(&served[0], "method").as_deref(), Some("7"));
    assert_eq!(field(&served[0], "len").as_deref(), Some("3"));
    assert!(field(&served[0], "call").is_some() && field(&served[0], "budget").is_some());
}
