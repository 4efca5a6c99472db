//! A session fed a hostile peer. The body is `rdma_rpc_fuzz::session` (src/lib.rs), also replayed on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_rpc_fuzz::session(data));
