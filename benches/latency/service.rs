//! `service` modes: the echo through a `#[service]` trait (the generated client stub and server
//! dispatch), its payload a `Bulk` in memory registered with the connection (filled once, a
//! clone sent each call, as `rpc-body` sends one registered buffer), as the tarpc baseline's is
//! a `serde_bytes` buffer: the typed path a user writes, against tarpc's typed path (full
//! round trip). `service-upload` sends such a `Bulk` one way (an 8-byte answer), beside
//! `rpc-upload` (`call_buf`); `service-upload-vec` a `Bulk` made from a `Vec` (shared by its
//! clones, so copied into registered memory by the client on every call).

use std::net::{IpAddr, SocketAddr};

use rdma_rpc::transport::Device;
use rdma_rpc::Config;
use rdma_rpc::{service, Bulk};

use crate::sampler::{self, Plan, Samples};

/// Echoes its bytes back.
#[service]
pub trait Bench {
    /// `data` back, as it came.
    async fn echo(&self, data: Bulk) -> Bulk;
    /// How many bytes `data` has.
    async fn sink(&self, data: Bulk) -> u64;
}

struct Echoer;

impl Bench for Echoer {
    async fn echo(&self, data: Bulk) -> Bulk {
        data
    }
    async fn sink(&self, data: Bulk) -> u64 {
        data.len() as u64
    }
}

/// What a `service` mode sends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The echo, from registered memory.
    Echo,
    /// One way, from registered memory.
    Upload,
    /// One way, from a `Vec`.
    UploadVec,
}

pub async fn measure(
    srv: &tokio::runtime::Handle,
    dev: &Device,
    ip: IpAddr,
    cfg: Config,
    size: usize,
    shape: Shape,
    plan: Plan,
) -> Samples {
    let server = BenchServer::new(Echoer)
        .bind(dev, SocketAddr::new(ip, 0), cfg.clone())
        .expect("bind the benchmark service");
    let addr = server.local_addr().expect("service address");
    let serving = srv.spawn(async move {
        let _ = server.serve().await;
    });
    let client = BenchClient::connect(dev, addr, cfg)
        .await
        .expect("connect the benchmark service client");
    let payload = match shape {
        Shape::UploadVec => Bulk::from(vec![0xa5u8; size]),
        Shape::Echo | Shape::Upload => {
            let conn = client.inner().expect("a client made with connect has a connection");
            let mut buf = conn.buffer(size).expect("a registered buffer");
            buf.bytes_mut().fill(0xa5);
            Bulk::from(buf)
        }
    };
    let s = sampler::run(plan, async || {
        match shape {
            Shape::Echo => {
                let r = client.echo(payload.clone()).await.expect("service echo");
                assert_eq!(r.len(), size);
            }
            Shape::Upload | Shape::UploadVec => {
                let n = client.sink(payload.clone()).await.expect("service upload");
                assert_eq!(n, size as u64);
            }
        }
        None
    })
    .await;
    serving.abort();
    s
}
