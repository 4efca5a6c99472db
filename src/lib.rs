//! rdma-rpc: typed RPC over RDMA.
//!
//! Put [`service`] on a trait of `async fn`s and get a typed client, server dispatch and stable
//! method ids. Calls travel over a verbs-shaped transport ([`transport`]): real ibverbs (`verbs`,
//! feature `verbs`), or a software provider with the same semantics: `tcp` between any two
//! hosts, `shm` between processes of one host.
//! Small messages go by Send/Recv into pre-posted receive rings; large ones by rendezvous (RDMA
//! Read, or Write-with-immediate into a buffer the caller lends), chosen by size
//! ([`Config::eager_threshold`]).
//!
//! # A whole service
//! The same example as the README's, and `cargo run --example store`:
#![doc = concat!("```\n", include_str!("../examples/store.rs"), "```\n")]
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

mod codec;

/// The README's Rust blocks, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The user guide's Rust blocks, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
pub struct GuideDoctests;

pub use rdma_rpc_core as core;
pub use rdma_rpc_core::context;
pub use rdma_rpc_core::{
    AsyncHandler, Body, BodyRef, Buffers, Bulk, CallOptions, Channel, Client, CompletionMode, Config, Connector,
    HandlerInput, HandlerOutput, Isolation, Lost, LostKind, Reconnect, RegisteredBuf, RpcError, Server, ServerBuilder,
    Status, SyncHandler, TransportError, DEFAULT_EAGER_THRESHOLD, IN_SLOT_MIN,
};
pub use rdma_rpc_macros::service;
pub use rdma_rpc_transport as transport;

/// What generated code uses; not a public API.
#[doc(hidden)]
pub mod __private {
    /// What a generated client calls through: one connection, or a [`Channel`](crate::Channel)
    /// that connects again.
    #[derive(Clone)]
    pub enum Caller {
        /// One connection.
        Client(crate::Client),
        /// A connection made again when lost.
        Channel(crate::Channel),
    }

    impl Caller {
        /// Calls `method` with `payload` on whichever it is; the response where it landed.
        pub async fn call(
            &self,
            method: u32,
            payload: Vec<u8>,
            opts: crate::CallOptions,
        ) -> Result<crate::Body, crate::RpcError> {
            match self {
                Caller::Client(c) => c.call_body_opts(method, payload, opts).await,
                Caller::Channel(c) => c.call_body_opts(method, payload, opts).await,
            }
        }

        /// Calls `method` with `bulk` then `tail` as the request (see `Client::call_bulk_tail`).
        pub async fn call_bulk(
            &self,
            method: u32,
            bulk: crate::Bulk,
            tail: Vec<u8>,
            opts: crate::CallOptions,
        ) -> Result<crate::Body, crate::RpcError> {
            match self {
                Caller::Client(c) => c.call_bulk_tail(method, bulk, tail, opts).await,
                Caller::Channel(c) => c.call_bulk_tail(method, bulk, tail, opts).await,
            }
        }
    }

    pub use crate::codec::{
        bulk_layout, decode_args, decode_args_bulk, decode_ret, encode_answer, encode_args, encode_args_bulk,
        encode_ret, end_args, end_bulk, into_bulk, push_arg, take_arg,
    };
}
