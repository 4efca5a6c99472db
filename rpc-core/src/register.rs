//! The [`ServerBuilder`] methods that register handlers: [`ServerBuilder::handler`] for async
//! handlers, [`ServerBuilder::handler_sync`] for those that answer at once, each taking the
//! request alone or with the connection's [`Buffers`]. What a handler takes its request as
//! ([`HandlerInput`]) says where the request stays while it runs; what it answers with
//! ([`HandlerOutput`]) says how the answer leaves.

use std::future::Future;

use crate::buf::{Body, RegisteredBuf};
use crate::context;
use crate::handler::{Handler, Response};
use crate::server::{Placement, ServerBuilder};
use crate::stash::Buffers;
use crate::{Bulk, RpcError};

/// What an async handler takes its request as, and so where the request is while it runs:
///
/// | type | a request of one message | a larger request |
/// |---|---|---|
/// | `Vec<u8>` | copied out | copied out |
/// | [`Body`] | in its receive slot, from [`IN_SLOT_MIN`](crate::IN_SLOT_MIN) bytes | in the registered buffer it was read into |
/// | [`Bulk`] | copied out | in the registered buffer it was read into |
///
/// A `Body` in a receive slot holds that slot (a credit its caller waits for) until dropped:
/// a connection's handlers hold at most half of its slots this way (beyond that, requests
/// come copied), so a handler that waits long should take a `Vec<u8>` or a `Bulk`, or let go
/// of the body early. Sealed: these three are all.
pub trait HandlerInput: sealed::Input + Send + Sized + 'static {}

/// What a handler answers with, and so how the answer leaves:
///
/// - `Vec<u8>`: copied into the response message (or lent from a registered copy when
///   longer than one message);
/// - [`RegisteredBuf`] of the request's connection (from the [`Buffers`] a handler takes as
///   its second argument): sent from where it is, with no copy, and given back to the connection once sent (a buffer of another
///   connection is copied);
/// - [`Bulk`]: lent as it is when registered with the connection and longer than one
///   message, copied otherwise.
///
/// With a tracing subscriber installed, a DEBUG event `rpc.payload` (`side = "response"`,
/// `len`, `how`) says which of these happened. Sealed: these three are all.
pub trait HandlerOutput: sealed::Output + Send + 'static {}

mod sealed {
    use super::{Body, Bulk, Placement, RegisteredBuf, Response};

    pub trait Input {
        /// Where the server keeps this method's requests.
        fn place(placement: &mut Placement, method: u32);
        fn from_body(body: Body) -> Self;
    }

    pub trait Output {
        fn into_response(self) -> Response;
    }

    impl Input for Vec<u8> {
        fn place(placement: &mut Placement, method: u32) {
            placement.copy(method);
        }
        fn from_body(body: Body) -> Self {
            body.into_vec()
        }
    }

    impl Input for Body {
        fn place(placement: &mut Placement, method: u32) {
            placement.keep(method);
        }
        fn from_body(body: Body) -> Self {
            body
        }
    }

    impl Input for Bulk {
        fn place(placement: &mut Placement, method: u32) {
            placement.read_only(method);
        }
        fn from_body(body: Body) -> Self {
            Bulk::from(body)
        }
    }

    impl Output for Vec<u8> {
        fn into_response(self) -> Response {
            Response::Bytes(self)
        }
    }

    impl Output for RegisteredBuf {
        fn into_response(self) -> Response {
            Response::Buf(self)
        }
    }

    impl Output for Bulk {
        fn into_response(self) -> Response {
            Response::Bulk(self)
        }
    }
}

impl HandlerInput for Vec<u8> {}
impl HandlerInput for Body {}
impl HandlerInput for Bulk {}
impl HandlerOutput for Vec<u8> {}
impl HandlerOutput for RegisteredBuf {}
impl HandlerOutput for Bulk {}

/// A closure [`ServerBuilder::handler`] takes: `Fn(I) -> Fut` or, to answer from registered
/// memory, `Fn(I, Buffers) -> Fut`, where `I` is a [`HandlerInput`] and `Fut` a future of
/// `Result<O, RpcError>` with `O` a [`HandlerOutput`]. `M` only tells the two shapes apart:
/// the compiler picks it. Sealed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an async handler",
    label = "expected `Fn(I) -> Fut` or `Fn(I, Buffers) -> Fut` with the argument types written out",
    note = "`I` is `Vec<u8>`, `Body` or `Bulk`; `Fut` outputs `Result<O, RpcError>` with `O` one of `Vec<u8>`, `RegisteredBuf`, `Bulk`"
)]
pub trait AsyncHandler<M>: Send + Sync + Sized + 'static {
    #[doc(hidden)]
    fn register(self, builder: &mut ServerBuilder, method: u32);
}

/// A closure [`ServerBuilder::handler_sync`] takes: `Fn(&Body) -> Result<O, RpcError>` or, to
/// answer from registered memory, `Fn(&Body, &Buffers) -> Result<O, RpcError>`, with `O` a
/// [`HandlerOutput`]. `M` only tells the two shapes apart: the compiler picks it. Sealed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a synchronous handler",
    label = "expected `Fn(&Body) -> Result<O, RpcError>` or `Fn(&Body, &Buffers) -> Result<O, RpcError>` with the argument types written out",
    note = "`O` is one of `Vec<u8>`, `RegisteredBuf`, `Bulk`"
)]
pub trait SyncHandler<M>: Send + Sync + Sized + 'static {
    #[doc(hidden)]
    fn register(self, builder: &mut ServerBuilder, method: u32);
}

/// The shapes of handler closures ([`AsyncHandler`], [`SyncHandler`]): the request alone, or
/// with the connection's buffers. Not a public API.
#[doc(hidden)]
pub mod shape {
    /// `Fn(I)`: the request alone.
    pub struct Alone<I, O>(std::marker::PhantomData<fn(I) -> O>);
    /// `Fn(I, Buffers)`: the request and the connection's buffers.
    pub struct WithBuffers<I, O>(std::marker::PhantomData<fn(I) -> O>);
}

/// Registers `call` as `method`'s async handler, its requests placed as `I` asks.
fn register_async<I, O, Fut>(
    builder: &mut ServerBuilder,
    method: u32,
    call: impl Fn(I, &Buffers) -> Fut + Send + Sync + 'static,
) where
    I: HandlerInput,
    O: HandlerOutput,
    Fut: Future<Output = Result<O, RpcError>> + Send + 'static,
{
    builder.handlers.insert(
        method,
        Handler::Async(Box::new(move |req: Body, bufs: &Buffers, deadline| {
            context::boxed(deadline, || {
                let fut = call(I::from_body(req), bufs);
                async move { fut.await.map(sealed::Output::into_response) }
            })
        })),
    );
    I::place(&mut builder.placement, method);
}

/// Registers `call` as `method`'s synchronous handler (its requests kept where they arrive).
fn register_sync<O: HandlerOutput>(
    builder: &mut ServerBuilder,
    method: u32,
    call: impl Fn(&Body, &Buffers) -> Result<O, RpcError> + Send + Sync + 'static,
) {
    builder.handlers.insert(
        method,
        Handler::Sync(Box::new(move |req: &Body, bufs: &Buffers| {
            call(req, bufs).map(sealed::Output::into_response)
        })),
    );
    builder.placement.keep(method);
}

impl<F, Fut, I, O> AsyncHandler<shape::Alone<I, O>> for F
where
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, RpcError>> + Send + 'static,
    I: HandlerInput,
    O: HandlerOutput,
{
    fn register(self, builder: &mut ServerBuilder, method: u32) {
        register_async(builder, method, move |req: I, _: &Buffers| self(req));
    }
}

impl<F, Fut, I, O> AsyncHandler<shape::WithBuffers<I, O>> for F
where
    F: Fn(I, Buffers) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, RpcError>> + Send + 'static,
    I: HandlerInput,
    O: HandlerOutput,
{
    fn register(self, builder: &mut ServerBuilder, method: u32) {
        register_async(builder, method, move |req: I, bufs: &Buffers| self(req, bufs.clone()));
    }
}

impl<F, O> SyncHandler<shape::Alone<Body, O>> for F
where
    F: Fn(&Body) -> Result<O, RpcError> + Send + Sync + 'static,
    O: HandlerOutput,
{
    fn register(self, builder: &mut ServerBuilder, method: u32) {
        register_sync(builder, method, move |req: &Body, _: &Buffers| self(req));
    }
}

impl<F, O> SyncHandler<shape::WithBuffers<Body, O>> for F
where
    F: Fn(&Body, &Buffers) -> Result<O, RpcError> + Send + Sync + 'static,
    O: HandlerOutput,
{
    fn register(self, builder: &mut ServerBuilder, method: u32) {
        register_sync(builder, method, self);
    }
}

impl ServerBuilder {
    /// Registers the async handler of `method`: the request in as a `Vec<u8>`, a [`Body`] or a
    /// [`Bulk`] ([`HandlerInput`] says where each keeps it), the answer out as a `Vec<u8>`, a
    /// [`RegisteredBuf`] or a `Bulk` ([`HandlerOutput`] says how each leaves), or an error. A
    /// handler that answers from registered memory takes the connection's [`Buffers`] as a
    /// second argument. Write the arguments' types out (`|req: Vec<u8>|`): they pick the input.
    ///
    /// The handler's future is polled once in the connection's driver as the request arrives,
    /// and moved to a task of its own if it waits. Inside it, [`context::deadline`] says when
    /// its caller stops waiting. A panic fails its call alone, with
    /// [`RpcError::HandlerPanic`]. A later registration for the same id replaces the earlier one.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_core::{Body, Buffers, Config, RpcError, Server};
    /// let builder = Server::builder(Config::default())
    ///     // Bytes in, bytes out.
    ///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
    ///     // The request where it arrived (no copy): its length and first byte.
    ///     .handler(2, |body: Body| async move {
    ///         let first = body.bytes().first().copied().unwrap_or(0);
    ///         let mut out = (body.len() as u64).to_le_bytes().to_vec();
    ///         out.push(first);
    ///         Ok::<_, RpcError>(out)
    ///     })
    ///     // 4 KiB of the request's first byte, written in registered memory and sent from it.
    ///     .handler(3, |req: Body, bufs: Buffers| async move {
    ///         let mut out = bufs.buffer(4096)?;
    ///         out.bytes_mut().fill(req.bytes().first().copied().unwrap_or(0));
    ///         Ok::<_, RpcError>(out)
    ///     });
    /// # drop(builder);
    /// ```
    pub fn handler<M>(mut self, method: u32, f: impl AsyncHandler<M>) -> Self {
        f.register(&mut self, method);
        self
    }

    /// Registers a handler of `method` that answers at once: a plain function, run in the
    /// connection's driver as the request arrives, with no future to allocate and poll. It
    /// borrows the request's [`Body`] where it arrived (a request of
    /// [`IN_SLOT_MIN`](crate::IN_SLOT_MIN) bytes or more with its header in its receive slot,
    /// copied by no one), and the slot goes back to the ring after the response is sent. It
    /// answers as an async handler does ([`HandlerOutput`]), and takes the connection's
    /// [`Buffers`] as a second argument to answer from registered memory;
    /// [`context::deadline`] says its caller's deadline.
    ///
    /// While it runs, the other requests of its connection wait, so it is for work that does
    /// not wait (in-memory lookups, arithmetic); anything that waits (IO, other RPCs) belongs
    /// in an async handler ([`ServerBuilder::handler`]). A panic fails its call alone, with
    /// [`RpcError::HandlerPanic`]. A later registration for the same id replaces the earlier one.
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Body, Buffers, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     // The request's bytes, reversed.
    ///     .handler_sync(1, |req: &Body| Ok::<_, RpcError>(req.bytes().iter().rev().copied().collect::<Vec<u8>>()))
    ///     // The same, written in a registered buffer of the connection and sent from it.
    ///     .handler_sync(2, |req: &Body, bufs: &Buffers| {
    ///         let mut out = bufs.buffer(req.len())?;
    ///         out.bytes_mut().copy_from_slice(&req.bytes());
    ///         out.bytes_mut().reverse();
    ///         Ok::<_, RpcError>(out)
    ///     })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// assert_eq!(client.call(1, b"abc".to_vec()).await?, b"cba");
    /// assert_eq!(client.call(2, b"abc".to_vec()).await?, b"cba");
    /// # Ok(()) }
    /// ```
    pub fn handler_sync<M>(mut self, method: u32, f: impl SyncHandler<M>) -> Self {
        f.register(&mut self, method);
        self
    }

    /// What generated code registers: the request as a [`Body`], a large one in the buffer it
    /// was read into and a small one copied out of its receive slot (a typed handler may wait
    /// long, and holds no slot); the answer encoded bytes or a [`Bulk`](crate::Bulk), lent
    /// when long ([`Stash::lend_bulk`](crate::stash::Stash)). [`context::buffers`] gives the handler the
    /// connection's buffers. Not a public API.
    #[doc(hidden)]
    pub fn handler_typed<F, Fut>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(Body) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<TypedAnswer, RpcError>> + Send + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Async(Box::new(move |req: Body, bufs: &Buffers, deadline| {
                context::boxed_with_buffers(deadline, bufs, || {
                    let fut = f(req);
                    async move {
                        fut.await.map(|a| match a {
                            TypedAnswer::Bytes(v) => Response::Bytes(v),
                            TypedAnswer::Bulk(b) => Response::Bulk(b),
                        })
                    }
                })
            })),
        );
        self.placement.read_only(method);
        self
    }
}

/// A typed handler's answer ([`ServerBuilder::handler_typed`]). Not a public API.
#[doc(hidden)]
#[derive(Debug)]
pub enum TypedAnswer {
    /// The encoded result.
    Bytes(Vec<u8>),
    /// A `Bulk` result, as it is.
    Bulk(crate::Bulk),
}
