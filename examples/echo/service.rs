//! The echo service shared by both processes, and the server's implementation.

use rdma_rpc::{service, Bulk};

/// Echoes bytes back.
#[service]
pub trait Echo {
    /// Returns `data` unchanged (raw both ways; by rendezvous above the threshold).
    async fn echo(&self, data: Bulk) -> Bulk;
    /// A greeting that names the caller.
    async fn hello(&self, name: String) -> String;
}

/// The server's side.
pub struct Echoer;

impl Echo for Echoer {
    async fn echo(&self, data: Bulk) -> Bulk {
        data
    }
    async fn hello(&self, name: String) -> String {
        format!("hello, {name}")
    }
}
