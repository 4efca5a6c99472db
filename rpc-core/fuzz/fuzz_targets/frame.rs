//! The frame decoder. The body is `rdma_rpc_fuzz::frame` (src/lib.rs), also replayed on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::frame(data));
