//! The typed request path of `#[service]`. The body is `rdma_rpc_fuzz::request` (src/lib.rs), also replayed on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::request(data));
