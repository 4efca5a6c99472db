//! `service` mode: the echo through a `#[service]` trait (the generated client stub and server
//! dispatch), its payload a `Bulk`, as the tarpc baseline's is a `serde_bytes` buffer: the
//! typed path a user writes, against tarpc's typed path (full round trip).

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
}

struct Echoer;

impl Bench for Echoer {
    async fn echo(&self, data: Bulk) -> Bulk {
        data
    }
}

pub async fn measure(
    srv: &tokio::runtime::Handle,
    dev: &Device,
    ip: IpAddr,
    cfg: Config,
    size: usize,
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
    let payload = vec![0xa5u8; size];
    let s = sampler::run(plan, async || {
        let r = client.echo(Bulk::from(payload.clone())).await.expect("service echo");
        assert_eq!(r.len(), size);
        None
    })
    .await;
    serving.abort();
    s
}
