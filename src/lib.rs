//! rdma-rpc: typed RPC over RDMA.
//!
//! Put [`service`] on a trait of `async fn`s and get a typed client, server dispatch and stable
//! method ids. Calls travel over a verbs-shaped transport ([`transport`]): real ibverbs (`verbs`,
//! feature `verbs`), or the software provider `tcp` that keeps the same semantics on any machine.
//! Small messages go by Send/Recv into pre-posted receive rings; large ones by rendezvous (RDMA
//! Read, or Write-with-immediate into a buffer the caller lends), chosen by size
//! ([`Config::eager_threshold`]).
//!
//! # A whole service
//! ```
//! use rdma_rpc::{service, transport::Device, Bulk, Config, RpcError};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! pub struct Entry { pub key: String, pub value: u64 }
//!
//! #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
//! pub enum StoreError { Missing(String) }
//!
//! /// A tiny store.
//! #[service]
//! pub trait Store {
//!     /// Adds or replaces an entry.
//!     async fn put(&self, entry: Entry);
//!     /// The value of `key`, or the store's own error.
//!     async fn get(&self, key: String) -> Result<u64, StoreError>;
//!     /// Stores a blob; large blobs move by RDMA Read, unserialized.
//!     async fn upload(&self, name: String, data: Bulk) -> usize;
//! }
//!
//! #[derive(Default)]
//! struct Memory(std::sync::Mutex<std::collections::HashMap<String, u64>>);
//!
//! impl Store for Memory {
//!     async fn put(&self, e: Entry) {
//!         self.0.lock().unwrap().insert(e.key, e.value);
//!     }
//!     async fn get(&self, key: String) -> Result<u64, StoreError> {
//!         self.0.lock().unwrap().get(&key).copied().ok_or(StoreError::Missing(key))
//!     }
//!     async fn upload(&self, _name: String, data: Bulk) -> usize {
//!         data.len()
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::open("tcp")?;
//! // Serve: one handler per method, on any address (port 0 picks one).
//! let server = StoreServer::new(Memory::default()).bind(&dev, "127.0.0.1:0".parse()?, Config::default())?;
//! let addr = server.local_addr()?;
//! tokio::spawn(server.serve());
//!
//! // Call: the trait's methods, async, each returning Result<_, RpcError>.
//! let store = StoreClient::connect(&dev, addr, Config::default()).await?;
//! store.put(Entry { key: "a".into(), value: 1 }).await?;
//! assert_eq!(store.get("a".into()).await?, Ok(1));
//! assert_eq!(store.get("b".into()).await?, Err(StoreError::Missing("b".into())));
//! assert_eq!(store.upload("blob".into(), vec![7u8; 1 << 20].into()).await?, 1 << 20);
//!
//! // Per-call options: a deadline for every call of this handle.
//! let hasty = store.with_options(rdma_rpc::CallOptions {
//!     deadline: Some(std::time::Duration::from_secs(1)),
//!     ..Default::default()
//! });
//! assert_eq!(hasty.get("a".into()).await?, Ok(1));
//! # Ok(()) }
//! ```
//!
//! The client returns the trait's own return type inside `Result<_, RpcError>`: a method that
//! returns `Result<T, E>` gives `Result<Result<T, E>, RpcError>`, the outer error being the
//! call's (deadline, connection, ...) and the inner one the service's.
//!
//! # What `#[service]` accepts
//! `async fn name(&self, arg: Type, ...) -> Ret` where every argument and the result are owned
//! types that implement serde's `Serialize` and `DeserializeOwned`. It refuses, each with its
//! own message: a non-async fn, generic methods, `self` by value or `&mut self`, `impl Trait`
//! and borrowed (`&`) types, patterns as argument names, default bodies, method names the
//! client uses itself (`new`, `connect`, `with_options`, `options`, `inner`) and two methods
//! with one id. `#[rpc(id = N)]` on a method pins its id (ids otherwise derive from
//! `Trait.method`, so renaming changes them).

mod bulk;
mod codec;

pub use bulk::Bulk;
pub use rdma_rpc_core as core;
pub use rdma_rpc_core::context;
pub use rdma_rpc_core::{
    CallOptions, Client, CompletionMode, Config, Isolation, RpcError, Server, ServerBuilder, Status, TransportError,
};
pub use rdma_rpc_macros::service;
pub use rdma_rpc_transport as transport;

/// What generated code uses; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::codec::{decode_args, decode_args_bulk, decode_ret, encode_args, encode_args_bulk, encode_ret};
}
