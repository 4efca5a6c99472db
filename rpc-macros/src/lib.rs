//! The `#[service]` attribute of rdma-rpc.
//!
//! Empty on purpose: the macro (typed client stubs and server dispatch generated from a trait)
//! comes with the `#[service]` issue, on top of the RPC core. Nothing here pretends to work yet.
