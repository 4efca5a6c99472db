//! RPC modes: the byte-level client and server of rdma-rpc on a provider (echo, full round trip).

use std::net::SocketAddr;

use rdma_rpc::transport::Device;
use rdma_rpc::{Body, Buffers, Client, CompletionMode, Config, Server};

use crate::sampler::{self, Plan, Samples};

pub const ECHO: u32 = 1;
/// Takes the request (as a `Vec`), answers its length: request goodput.
pub const SINK: u32 = 2;
/// Takes the request as it arrived (a large one in the registered buffer it was read into),
/// answers its length.
pub const SINK_BODY: u32 = 3;
/// Takes the request as it arrived (a small one in its receive slot) and answers as many bytes
/// from a registered buffer of its own, reading and writing neither, at once (a synchronous
/// handler): the work of the raw Send ping-pong's echo side.
pub const SIZED_BODY: u32 = 4;

/// Eager threshold and ring for each RPC mode at a given size; `raw_ring` is the depth of the
/// raw Send ping-pong's receive ring, which `rpc-body` (the RPC doing what that ping-pong does)
/// posts as well: the two then differ by the RPC layer alone. The other modes keep the
/// library's default ring.
pub fn config(mode: &str, size: usize, completion: CompletionMode, raw_ring: u32) -> Config {
    let base = Config::default().mode(completion);
    match mode {
        // Everything inside Sends (in pieces of at most 32 KiB: the ring keeps its size).
        "rpc-eager" => base.eager_threshold(size.max(1)),
        // Everything above 0 bytes by rendezvous.
        "rpc-rendezvous" => base.eager_threshold(0),
        "rpc-spin" => base.mode(CompletionMode::Spin),
        "rpc-event" => base.mode(CompletionMode::Event),
        "rpc-body" => base.ring(raw_ring),
        // The long calls eager (the short ones too, whatever the size).
        "rpc-behind" => base.eager_threshold(size.max(SHORT)),
        "rpc-behind-fifo" => base.eager_threshold(size.max(SHORT)).interleave(false),
        _ => base,
    }
}

/// A server and a client connected to it; abort the handle to stop the server's accept loop.
pub async fn connect(
    srv: &tokio::runtime::Handle,
    dev: &Device,
    ip: std::net::IpAddr,
    cfg: Config,
) -> (Client, tokio::task::JoinHandle<()>) {
    let server = Server::builder(cfg.clone())
        .handler(ECHO, |req: Vec<u8>| async move { Ok(req) })
        .handler(SINK, |req: Vec<u8>| async move {
            Ok(Vec::from((req.len() as u64).to_le_bytes()))
        })
        .handler(SINK_BODY, |req: Body| async move {
            Ok(Vec::from((req.len() as u64).to_le_bytes()))
        })
        .handler_sync(SIZED_BODY, |req: &Body, bufs: &Buffers| bufs.buffer(req.len()))
        .bind(dev, SocketAddr::new(ip, 0))
        .expect("bind the benchmark server");
    let addr = server.local_addr().expect("server address");
    let serving = srv.spawn(async move {
        let _ = server.serve().await;
    });
    let client = Client::connect(dev, addr, cfg)
        .await
        .expect("connect the benchmark client");
    (client, serving)
}

pub async fn measure(client: &Client, size: usize, plan: Plan) -> Samples {
    let payload = vec![0xa5u8; size];
    sampler::run(plan, async || {
        let r = client.call(ECHO, payload.clone()).await.expect("echo call");
        assert_eq!(r.len(), size);
        None
    })
    .await
}

/// The short call of `rpc-behind`: its payload each way.
pub const SHORT: usize = 64;

/// A `SHORT`-byte echo call timed while echo calls of `size` bytes run back to back on the same
/// connection, one always in flight (eager, as `config` makes them; each long call's answer is
/// the next one's payload, so the harness copies nothing between them). Both loops run in this
/// task and start their next call as soon as the last one is done: a short call starts at any
/// point of a long one's way there and back, and waits behind whatever of it the connection
/// sends first.
pub async fn behind(client: &Client, size: usize, plan: Plan) -> Samples {
    let stop = std::cell::Cell::new(false);
    let streaming = async {
        let mut long = vec![0x5au8; size];
        while !stop.get() {
            long = client.call(ECHO, long).await.expect("long echo call");
        }
    };
    let short = vec![0xa5u8; SHORT];
    let timed = async {
        let s = sampler::run(plan, async || {
            let r = client.call(ECHO, short.clone()).await.expect("short echo call");
            assert_eq!(r.len(), SHORT);
            None
        })
        .await;
        stop.set(true);
        s
    };
    let ((), samples) = tokio::join!(streaming, timed);
    samples
}

/// `size` bytes each way which neither the handler nor the caller reads, as in the raw Send
/// ping-pong: the request goes from a registered buffer (`Client::call_buf_body`) to a
/// synchronous handler (`handler_sync` answering a `RegisteredBuf`, as the ping-pong's echo answers at once), which
/// answers as many bytes from a registered buffer of its own. From
/// `IN_SLOT_MIN` (512 B with the header) each body stays in the receive slot it landed in;
/// shorter ones the RPC copies out, which costs less than holding the slot.
pub async fn in_place(client: &Client, size: usize, plan: Plan) -> Samples {
    let mut buf = Some(client.buffer(size).expect("a registered buffer"));
    if let Some(b) = buf.as_mut() {
        b.bytes_mut().fill(0xa5);
    }
    sampler::run(plan, async || {
        let b = buf.take().expect("the buffer is back");
        let (r, back) = client.call_buf_body(SIZED_BODY, b).await.expect("in-place call");
        assert_eq!(r.len(), size);
        buf = Some(back);
        None
    })
    .await
}

/// A request of `size` bytes from a `Vec` (copied into a registered buffer on the client, and
/// out of one on the server), an 8-byte answer.
pub async fn upload_vec(client: &Client, size: usize, plan: Plan) -> Samples {
    let payload = vec![0x5au8; size];
    sampler::run(plan, async || {
        let r = client.call(SINK, payload.clone()).await.expect("upload call");
        assert_eq!(r, (size as u64).to_le_bytes());
        None
    })
    .await
}

/// A request of `size` bytes from a registered buffer of the connection (`Client::buffer`,
/// `Client::call_buf`), taken by a handler of a `Body` in the buffer the server read it into, an
/// 8-byte answer: no copy but the transfer itself.
pub async fn upload(client: &Client, size: usize, plan: Plan) -> Samples {
    let mut buf = Some(client.buffer(size).expect("a registered buffer"));
    if let Some(b) = buf.as_mut() {
        b.bytes_mut().fill(0x5a);
    }
    sampler::run(plan, async || {
        let b = buf.take().expect("the buffer is back");
        let (r, back) = client.call_buf(SINK_BODY, b).await.expect("upload call");
        assert_eq!(r, (size as u64).to_le_bytes());
        buf = Some(back);
        None
    })
    .await
}
