//! Clients that share completion queues: for a process of many connections.

use std::net::SocketAddr;
use std::sync::Arc;

use rdma_rpc_transport::Device;

use super::Client;
use crate::config::Config;
use crate::driver::Groups;
use crate::RpcError;

/// Makes [`Client`]s whose connections share completion queues, 64 connections to one: for a
/// process of many connections, to one server or many (a load generator, a proxy, a shard
/// router). Cheap to clone; clones share the queues.
///
/// Each client still has its own protection domain, queue pair, receive ring and driver task,
/// and behaves as one made by [`Client::connect`]. What changes is how its completions reach
/// it: a connection's own CQ wakes its task through a doorbell of its own, a system call per
/// message on each side; connections on a shared CQ take turns polling it in batches, each
/// handing the others what it found, and one task sleeps on the CQ when they all sleep. Under
/// load over many connections that costs less CPU per call; a single connection gains
/// nothing from it and, when it sleeps, is woken through one more task.
///
/// # Examples
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use rdma_rpc_core::{transport::Device, Config, Connector, RpcError, Server};
/// let dev = Device::open("tcp")?;
/// let server = Server::builder(Config::default())
///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
///     .bind(&dev, "127.0.0.1:0".parse()?)?;
/// let addr = server.local_addr()?;
/// tokio::spawn(server.serve());
/// let connector = Connector::new(&dev, Config::default().ring(8))?;
/// let mut clients = Vec::new();
/// for _ in 0..100 {
///     clients.push(connector.connect(addr).await?);
/// }
/// for (i, c) in clients.iter().enumerate() {
///     assert_eq!(c.call(1, vec![i as u8]).await?, [i as u8]);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Connector {
    device: Device,
    config: Config,
    groups: Arc<Groups>,
}

impl Connector {
    /// A connector of clients on `device`, each configured by `config`.
    ///
    /// # Errors
    /// [`RpcError::Config`] for a configuration outside what the protocol allows.
    pub fn new(device: &Device, config: Config) -> Result<Connector, RpcError> {
        config.validate()?;
        let depth = crate::handshake::cq_depth(&config);
        Ok(Connector {
            device: device.clone(),
            config,
            groups: Arc::new(Groups::new(device, depth)),
        })
    }

    /// Connects to a server at `addr`, as [`Client::connect`] does with this connector's
    /// device and configuration.
    ///
    /// # Errors
    /// As [`Client::connect`]'s.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Client, RpcError> {
        Client::connect_in(&self.device, addr, self.config.clone(), Some(&self.groups)).await
    }
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}
