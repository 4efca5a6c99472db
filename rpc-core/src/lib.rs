//! The rdma-rpc protocol core and its tokio runtime.
//!
//! - [`proto`]: the sans-IO session — framing, receive ring and credits, eager path, rendezvous
//!   by RDMA Read and Write-with-immediate, call table, deadlines, cancellation, errors.
//! - [`Client`] and [`Server`]: thin tokio drivers that run a session over a transport QP.

mod buf;
mod bulk;
mod channel;
mod client;
mod colocate;
mod config;
pub mod context;
mod driver;
mod error;
mod free;
mod handler;
mod handshake;
mod region;
mod register;
mod server;
mod spans;
mod stash;
mod tasks;

pub use buf::{Body, BodyRef, RegisteredBuf};
pub use bulk::Bulk;
pub use channel::{Channel, Reconnect};
pub use client::{Client, Connector, Request};
pub use config::{CallOptions, CompletionMode, Config, Isolation, DEFAULT_EAGER_THRESHOLD};
pub use driver::IN_SLOT_MIN;
pub use error::{RpcError, TransportError};
/// The protocol core: the sans-IO session, framing and credits ([`rdma_rpc_proto`]).
pub use rdma_rpc_proto as proto;
pub use rdma_rpc_proto::{Lost, LostKind, Status};
pub use rdma_rpc_transport as transport;
#[doc(hidden)]
pub use register::TypedAnswer;
pub use register::{AsyncHandler, HandlerInput, HandlerOutput, SyncHandler};
pub use server::{Server, ServerBuilder};
pub use stash::Buffers;
