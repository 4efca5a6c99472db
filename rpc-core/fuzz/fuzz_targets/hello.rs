//! The connection handshake (private data). The body is `rdma_rpc_fuzz::hello` (src/lib.rs), also replayed on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::hello(data));
