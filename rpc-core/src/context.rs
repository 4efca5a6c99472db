//! What a handler knows of the request it serves: the caller's deadline, on this server's
//! clock, so that work on the request's behalf (a call to another service, a query) can stop
//! when the caller stops waiting.
//!
//! The caller's [`CallOptions::deadline`](crate::CallOptions) travels as a relative budget; the
//! server places it from the request's arrival and aborts the handler when it passes (the
//! caller gets [`RpcError::DeadlineExceeded`](crate::RpcError)). Inside the handler, [`deadline`]
//! says when that is and [`remaining`] how long is left, which is what a call made on the
//! request's behalf passes on:
//!
//! ```
//! use std::time::Duration;
//! use rdma_rpc_core::{context, transport::Device, CallOptions, Client, Config, RpcError, Server};
//!
//! /// A call made on a request's behalf, within what is left of its caller's budget (none when
//! /// its caller set none).
//! async fn ask(backend: &Client, key: Vec<u8>) -> Result<Vec<u8>, RpcError> {
//!     let opts = CallOptions::default().deadline(context::remaining());
//!     backend.with_options(opts).call(1, key).await
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::open("tcp")?;
//! // The backend says how long its caller's deadline leaves it, in whole seconds.
//! let backend = Server::builder(Config::default())
//!     .handler(1, |_key: Vec<u8>| async move {
//!         Ok(context::remaining().map_or(b"none".to_vec(), |d| d.as_secs().to_string().into_bytes()))
//!     })
//!     .bind(&dev, "127.0.0.1:0".parse()?)?;
//! let backend_addr = backend.local_addr()?;
//! tokio::spawn(backend.serve());
//! let to_backend = std::sync::Arc::new(Client::connect(&dev, backend_addr, Config::default()).await?);
//!
//! // The front end asks the backend on each request's behalf.
//! let front = Server::builder(Config::default())
//!     .handler(2, move |key: Vec<u8>| {
//!         let backend = to_backend.clone();
//!         async move { ask(&backend, key).await }
//!     })
//!     .bind(&dev, "127.0.0.1:0".parse()?)?;
//! let front_addr = front.local_addr()?;
//! tokio::spawn(front.serve());
//!
//! let client = Client::connect(&dev, front_addr, Config::default()).await?;
//! let hour = CallOptions::default().deadline(Duration::from_secs(3600));
//! let left = client.with_options(hour).call(2, b"k".to_vec()).await?;
//! let secs: u64 = String::from_utf8(left)?.parse()?;
//! assert!((3000..3600).contains(&secs), "the backend got what was left of the hour: {secs} s");
//! assert_eq!(client.call(2, b"k".to_vec()).await?, b"none");
//! # Ok(()) }
//! ```
//!
//! A `#[service]` method reads them the same way, and [`buffers`] besides. Outside a handler, or for a
//! request without a budget, both are `None`. A task a handler spawns (`tokio::spawn`) is a
//! task of its own: it sees them only when spawned through [`inherit`].

use std::future::Future;
use std::time::{Duration, Instant};

use crate::Buffers;

tokio::task_local! {
    /// `None` in force only under [`inherit`] from outside a budget.
    static DEADLINE: Option<Instant>;
    /// The connection's buffers, in a `#[service]` method.
    static BUFFERS: Buffers;
}

/// Registered buffers of the connection the request came on, in a `#[service]` method (`None`
/// elsewhere): a [`Bulk`](crate::Bulk) made from one is answered without a copy on this side
/// (lent to the caller as it is). A handler registered by hand takes them as its second
/// argument instead, which costs nothing per request ([`ServerBuilder::handler`](crate::ServerBuilder::handler)).
///
/// ```
/// use rdma_rpc_core::{context, Bulk};
/// /// What a `#[service]` method returning `Bulk` might do: fill registered memory when
/// /// there is some (inside a handler), a vector otherwise.
/// fn filled(len: usize, byte: u8) -> Result<Bulk, rdma_rpc_core::RpcError> {
///     Ok(match context::buffers() {
///         Some(bufs) => {
///             let mut buf = bufs.buffer(len)?;
///             buf.bytes_mut().fill(byte);
///             Bulk::from(buf)
///         }
///         None => Bulk::from(vec![byte; len]),
///     })
/// }
/// assert_eq!(filled(3, 7)?.to_vec(), [7, 7, 7]);
/// # Ok::<(), rdma_rpc_core::RpcError>(())
/// ```
pub fn buffers() -> Option<Buffers> {
    BUFFERS.try_with(Buffers::clone).ok()
}

/// When the caller of the request this handler serves stops waiting: the server aborts the
/// handler then. `None` when the caller set no deadline, or outside a handler.
pub fn deadline() -> Option<Instant> {
    DEADLINE.try_with(|d| *d).ok().flatten()
}

/// `fut` with the deadline in force here (the handler's) in force while it runs too: for a
/// task a handler spawns on the request's behalf, which is a task of its own and would see no
/// deadline. Where none is in force, `fut` sees none either.
///
/// ```
/// use rdma_rpc_core::{context, Config, Server};
/// let builder = Server::builder(Config::default()).handler(1, |req: Vec<u8>| async move {
///     // Work on the request's behalf in a task of its own, within the caller's deadline.
///     let left = tokio::spawn(context::inherit(async { context::remaining() }));
///     let left = left.await.ok().flatten();
///     Ok(left.map_or(req, |d| d.as_millis().to_string().into_bytes()))
/// });
/// # drop(builder);
/// ```
pub fn inherit<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    DEADLINE.scope(deadline(), fut)
}

/// The time left until [`deadline`] (zero once it has passed), for a call made on the request's
/// behalf (`CallOptions::default().deadline(context::remaining())`). `None` when the caller set no
/// deadline, or outside a handler.
pub fn remaining() -> Option<Duration> {
    deadline().map(|d| d.saturating_duration_since(Instant::now()))
}

/// Makes a handler's future with `deadline` in force, from its creation through every poll;
/// without one, the future as `make` makes it (no scope: nothing per poll).
pub(crate) fn boxed<F>(
    deadline: Option<Instant>,
    make: impl FnOnce() -> F,
) -> std::pin::Pin<Box<dyn Future<Output = F::Output> + Send>>
where
    F: Future + Send + 'static,
{
    match deadline {
        Some(d) => {
            let fut = DEADLINE.sync_scope(Some(d), make);
            Box::pin(DEADLINE.scope(Some(d), fut))
        }
        None => Box::pin(make()),
    }
}

/// As [`boxed`], with the connection's buffers in force too ([`buffers`]) while the future
/// runs (made by `make`, which runs nothing of the handler's: an async block's body waits
/// for the first poll). One allocation, as [`boxed`] makes.
pub(crate) fn boxed_with_buffers<F>(
    deadline: Option<Instant>,
    bufs: &Buffers,
    make: impl FnOnce() -> F,
) -> std::pin::Pin<Box<dyn Future<Output = F::Output> + Send>>
where
    F: Future + Send + 'static,
{
    let bufs = bufs.clone();
    boxed(deadline, move || BUFFERS.scope(bufs, make()))
}

/// Runs `f` with `deadline` in force (a synchronous handler); without one, as it is.
pub(crate) fn scoped<R>(deadline: Option<Instant>, f: impl FnOnce() -> R) -> R {
    match deadline {
        Some(d) => DEADLINE.sync_scope(Some(d), f),
        None => f(),
    }
}
