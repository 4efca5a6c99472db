//! rdma-rpc: typed RPC over RDMA.
//!
//! Today this facade re-exports the transport layer: a safe, verbs-shaped API with the real
//! ibverbs provider and a software provider over TCP that keeps the same semantics. The RPC core
//! and the `#[service]` macro build on it.
//!
//! ```
//! let dev = rdma_rpc::transport::Device::open("tcp")?;
//! assert_eq!(dev.provider(), "tcp");
//! # Ok::<(), rdma_rpc::transport::Error>(())
//! ```

pub use rdma_rpc_core as core;
pub use rdma_rpc_transport as transport;
