//! The rdma-rpc protocol core.
//!
//! Empty on purpose: the sans-IO session (framing, receive rings and credits, eager path,
//! rendezvous by RDMA Read / Write-with-imm, call table, deadlines, cancellation) and its tokio
//! client and server are the next piece of work ("RPC core" issue). It will be written against
//! [`rdma_rpc_transport`], re-exported here so that dependents already name one path.

pub use rdma_rpc_transport as transport;
