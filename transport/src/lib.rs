//! A safe, verbs-shaped RDMA API with interchangeable providers.
//!
//! The types follow ibverbs: a [`Device`] (opened by provider spec), a [`ProtectionDomain`],
//! [`MemoryRegion`]s that own their buffers (lkey, rkey, access flags), a [`BufferPool`] of
//! pre-registered buffers, [`CompletionQueue`]s, [`SharedReceiveQueue`]s, and
//! reliable-connected [`QueuePair`]s made by [`connect`] and [`Listener`]. Work requests ([`SendWr`], [`RecvWr`]) own their buffers until
//! the [`Completion`] gives them back, so memory a NIC may touch cannot be freed or reused.
//!
//! Providers, chosen at run time by spec (`RDMA_RPC_PROVIDER`, default `tcp`):
//! - `tcp`: software RC over TCP, a faithful model of the NIC for any two hosts (its connections
//!   and `shm`'s run on one progress thread per device, `RDMA_RPC_PROGRESS_THREADS` for more);
//! - `shm`: software RC through shared memory, for processes on one host (one-sided operations
//!   and Sends run by the initiator on the peer's mapped memory);
//! - `verbs`, `verbs:<device>`: real libibverbs + librdmacm (ConnectX, soft-RoCE rxe, ...),
//!   with the cargo feature `verbs` (on by default).
//!
//! # Examples
//! A one-sided RDMA Write followed by a Send, on the `tcp` provider:
//! ```
//! use std::time::Duration;
//! use rdma_rpc_transport::*;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::open("tcp")?;
//! let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(64)?);
//! let opts = QpOptions::new(&pd, &cq);
//! let listener = Listener::bind(&dev, "127.0.0.1:0".parse()?)?;
//! let addr = listener.local_addr()?;
//! let target = pd.register(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let server = std::thread::spawn({
//!     let opts = opts.clone();
//!     move || listener.accept(None)?.accept(&opts, b"")
//! });
//! let (qp, _) = connect(addr, &opts, b"", Duration::from_secs(5))?;
//! let server_qp = server.join().unwrap()?;
//! server_qp.post_recv(RecvWr::new(1, pd.register(64, AccessFlags::LOCAL_WRITE)?)).map_err(|e| e.error)?;
//!
//! let mut src = pd.register(5, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, b"hello")?;
//! let mut note = pd.register(4, AccessFlags::LOCAL_WRITE)?;
//! note.write_at(0, b"done")?;
//! qp.post_send_batch([
//!     SendWr::new(10, SendOp::Write { remote: target.remote().at(0), imm: None }).buf(src).unsignaled(),
//!     SendWr::send(11, note),
//! ]).map_err(|e| e.error)?;
//!
//! let mut done = Vec::new();
//! while done.len() < 2 {
//!     cq.wait(&mut done, 8).await?;
//! }
//! assert!(done.iter().all(|c| c.status.is_success()));
//! assert_eq!(&target.bytes()[..5], b"hello"); // the Write landed before the Send arrived
//! # Ok(()) }
//! ```

mod access;
mod cm;
mod cq;
mod device;
mod error;
mod head;
mod listening;
mod mr;
mod nic;
mod pd;
mod pool;
mod provider;
mod qp;
mod shm;
mod srq;
mod tcp;
#[cfg(feature = "verbs")]
mod verbs;
mod wc;
mod words;
mod wr;

pub use access::AccessFlags;
pub use cm::{connect, connect_with_recvs, ConnectRequest, Listener, MAX_PRIVATE_DATA, MAX_REJECT_REASON};
pub use cq::{Completion, CompletionError, CompletionQueue};
pub use device::{Device, DeviceCaps, ProviderSpec, PROVIDER_ENV};
pub use error::{Error, Report, Result};
pub use head::{Head, HEAD_MAX};
pub use mr::{BufMut, BufRef, MemoryRegion, RemoteAddr, RemoteRegion};
pub use pd::ProtectionDomain;
pub use pool::BufferPool;
pub use qp::{PathAttrs, PostError, QpCaps, QpOptions, QueuePair};
pub use srq::SharedReceiveQueue;
pub use wc::{WcOpcode, WcStatus};
pub use wr::{RecvWr, SendOp, SendWr};
