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

/// Ends a `--serve` server (`--stop-server`): answered, then the server shuts down.
pub const STOP: u32 = 9;

/// The modes `--connect` measures against a server of another process or host (`--serve`):
/// those whose server is the RPC server below with a default configuration.
pub const REMOTE_MODES: &[&str] = &[
    "rpc",
    "rpc-body",
    "rpc-spin",
    "rpc-event",
    "rpc-upload",
    "rpc-upload-vec",
];

/// Where the RPC modes' server is: started here for each row on this IP, or running at an
/// address (`--connect`).
#[derive(Clone, Copy, Debug)]
pub enum Peer {
    Here(std::net::IpAddr),
    There(SocketAddr),
}

impl Peer {
    /// The IP this host's own servers (the modes `--connect` does not take) listen on.
    pub fn ip(self) -> std::net::IpAddr {
        match self {
            Peer::Here(ip) => ip,
            Peer::There(a) => a.ip(),
        }
    }
}

/// The RPC modes' server: every handler they call.
pub fn server(cfg: Config) -> rdma_rpc::ServerBuilder {
    Server::builder(cfg)
        .handler(ECHO, |req: Vec<u8>| async move { Ok(req) })
        .handler(SINK, |req: Vec<u8>| async move {
            Ok(Vec::from((req.len() as u64).to_le_bytes()))
        })
        .handler(SINK_BODY, |req: Body| async move {
            Ok(Vec::from((req.len() as u64).to_le_bytes()))
        })
        .handler_sync(SIZED_BODY, |req: &Body, bufs: &Buffers| bufs.buffer(req.len()))
}

/// The server of a row, when this process started one: aborting it stops its accept loop.
pub struct Serving(Option<tokio::task::JoinHandle<()>>);

impl Serving {
    pub fn abort(self) {
        if let Some(h) = self.0 {
            h.abort();
        }
    }
}

/// A client of the RPC modes' server at `peer`: one started for it here, or the one there.
pub async fn connect(srv: &tokio::runtime::Handle, dev: &Device, peer: Peer, cfg: Config) -> (Client, Serving) {
    let (addr, serving) = match peer {
        Peer::Here(ip) => {
            let server = server(cfg.clone())
                .bind(dev, SocketAddr::new(ip, 0))
                .expect("bind the benchmark server");
            let addr = server.local_addr().expect("server address");
            let serving = srv.spawn(async move {
                let _ = server.serve().await;
            });
            (addr, Serving(Some(serving)))
        }
        Peer::There(addr) => {
            // The server of another host may still be starting: retried for 30 s.
            let start = std::time::Instant::now();
            loop {
                match Client::connect(dev, addr, cfg.clone()).await {
                    Ok(c) => return (c, Serving(None)),
                    Err(e) if start.elapsed() < std::time::Duration::from_secs(30) => {
                        eprintln!("connecting to {addr}: {} (retrying)", e.report());
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    }
                    Err(e) => panic!("connecting to the server at {addr}: {}", e.report()),
                }
            }
        }
    };
    let client = Client::connect(dev, addr, cfg)
        .await
        .expect("connect the benchmark client");
    (client, serving)
}

/// `--serve ADDR`: the RPC modes' server at `addr` (with `cfg`), until a client sends [`STOP`].
pub async fn serve(dev: &Device, addr: SocketAddr, cfg: Config) -> Result<(), Box<dyn std::error::Error>> {
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let stopper = stop.clone();
    let server = server(cfg)
        .handler(STOP, move |_: Vec<u8>| {
            let stop = stopper.clone();
            async move {
                stop.notify_one();
                Ok(Vec::new())
            }
        })
        .bind(dev, addr)
        .map_err(|e| format!("binding {addr}: {}", e.report()))?;
    println!(
        "serving the RPC modes ({}) at {} on provider {}: stop with --connect {} --stop-server",
        REMOTE_MODES.join(","),
        server.local_addr()?,
        dev.provider(),
        server.local_addr()?
    );
    server
        .serve_with_shutdown(async move { stop.notified().await })
        .await
        .map_err(|e| format!("serving: {}", e.report()).into())
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
