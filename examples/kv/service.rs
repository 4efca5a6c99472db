//! The KV service (RPC side).

use rdma_rpc::service;

/// A key-value cache. GET also works one-sided: see `client.rs`.
#[service]
pub trait Kv {
    /// The value of `key`.
    async fn get(&self, key: Vec<u8>) -> Option<Vec<u8>>;
    /// Sets `key` to `value`; errors when the table is full or the pair too large.
    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), String>;
    /// Removes `key`; says whether it was there.
    async fn delete(&self, key: Vec<u8>) -> bool;
    /// The port of the server's one-sided endpoint (same IP): connect a queue pair there and
    /// the private data of the answer names the index and value regions.
    async fn one_sided_port(&self) -> u16;
    /// The server process's CPU time (user and system) so far, in microseconds.
    async fn cpu_time_us(&self) -> u64;
}
