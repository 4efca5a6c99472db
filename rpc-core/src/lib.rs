//! The rdma-rpc protocol core and its tokio runtime.
//!
//! - [`proto`]: the sans-IO session — framing, receive ring and credits, eager path, rendezvous
//!   by RDMA Read and Write-with-immediate, call table, deadlines, cancellation, errors.
//! - [`Client`] and [`Server`]: thin tokio drivers that run a session over a transport QP.

pub mod proto;
mod status;

pub use rdma_rpc_transport as transport;
pub use status::{RpcError, Status};
