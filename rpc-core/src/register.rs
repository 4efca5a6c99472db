//! The [`ServerBuilder`] methods that register handlers: bytes in and out, bodies in place,
//! answers from registered buffers, and synchronous handlers.

use std::future::Future;

use crate::buf::{Body, RegisteredBuf};
use crate::context;
use crate::handler::{Handler, Response};
use crate::server::ServerBuilder;
use crate::stash::Buffers;
use crate::RpcError;

impl ServerBuilder {
    /// Registers the handler of `method`: request bytes in, response bytes (or an error) out.
    /// A later registration for the same id replaces the earlier one.
    pub fn handler<F, Fut>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<u8>, RpcError>> + Send + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Async(Box::new(move |req: Body, _: &Buffers, deadline| {
                context::boxed(deadline, || {
                    let fut = f(req.into_vec());
                    async move { fut.await.map(Response::Bytes) }
                })
            })),
        );
        self.placement.copy(method);
        self
    }

    /// As [`ServerBuilder::handler`], with the request as a [`Body`], without the copy into a
    /// `Vec` ([`Body::into_vec`] makes one when wanted): an eager request stays in the receive
    /// slot it arrived in (one shorter than [`IN_SLOT_MIN`](crate::IN_SLOT_MIN) bytes with its
    /// header is copied, which costs less), a large one arrives in the registered buffer the
    /// server read it into.
    /// Dropping the body gives the slot or buffer back to the connection: a handler holds at
    /// most half of its connection's receive slots this way (beyond that, requests come
    /// copied), and should let go of the body as soon as it is done with it.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_core::{Body, Config, RpcError, Server};
    /// // Answers with the request's length and first byte, without copying the request.
    /// let builder = Server::builder(Config::default()).handler_body(7, |body: Body| async move {
    ///     let first = body.bytes().first().copied().unwrap_or(0);
    ///     let mut out = (body.len() as u64).to_le_bytes().to_vec();
    ///     out.push(first);
    ///     Ok::<_, RpcError>(out)
    /// });
    /// # drop(builder);
    /// ```
    pub fn handler_body<F, Fut>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(Body) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<u8>, RpcError>> + Send + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Async(Box::new(move |req: Body, _: &Buffers, deadline| {
                context::boxed(deadline, || {
                    let fut = f(req);
                    async move { fut.await.map(Response::Bytes) }
                })
            })),
        );
        self.placement.keep(method);
        self
    }

    /// As [`ServerBuilder::handler_body`], answering from a registered buffer: the handler gets
    /// the connection's [`Buffers`], fills one and returns it, and the response goes to the
    /// caller straight from it (sent as it is when small, lent when large), with no copy. A
    /// buffer of another connection is copied. The buffer goes back to the connection once sent.
    /// With a tracing subscriber installed, a DEBUG event `rpc.payload` (`side = "response"`,
    /// `len`, `how`) says which of these happened.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_core::{Body, Buffers, Config, RpcError, Server};
    /// // Answers with 4 KiB of the request's first byte, written in place.
    /// let builder = Server::builder(Config::default()).handler_buf(9, |req: Body, bufs: Buffers| async move {
    ///     let mut out = bufs.buffer(4096)?;
    ///     out.bytes_mut().fill(req.bytes().first().copied().unwrap_or(0));
    ///     Ok::<_, RpcError>(out)
    /// });
    /// # drop(builder);
    /// ```
    pub fn handler_buf<F, Fut>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(Body, Buffers) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<RegisteredBuf, RpcError>> + Send + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Async(Box::new(move |req: Body, bufs: &Buffers, deadline| {
                context::boxed(deadline, || {
                    let fut = f(req, bufs.clone());
                    async move { fut.await.map(Response::Buf) }
                })
            })),
        );
        self.placement.keep(method);
        self
    }

    /// As [`ServerBuilder::handler`], for a handler that answers at once: a plain function,
    /// run in the connection's driver as the request arrives, with no future to allocate and
    /// poll. It borrows the request's bytes where they arrived (a request of 512 bytes or more
    /// with its header in its receive slot, copied by no one; see
    /// [`IN_SLOT_MIN`](crate::IN_SLOT_MIN)), and the slot goes back to the ring after the
    /// response is sent. While it runs, the other requests of its connection wait, so it is for
    /// work that does not wait (in-memory lookups, arithmetic); anything that waits (IO, other
    /// RPCs) belongs in an async handler. A panic fails its call alone, with
    /// [`RpcError::HandlerPanic`]; [`context::deadline`] says what it says in an async handler.
    /// A later registration for the same id replaces the earlier one.
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     .handler_sync(1, |req: &[u8]| Ok::<_, RpcError>(req.iter().rev().copied().collect()))
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// assert_eq!(client.call(1, b"abc".to_vec()).await?, b"cba");
    /// # Ok(()) }
    /// ```
    pub fn handler_sync<F>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(&[u8]) -> Result<Vec<u8>, RpcError> + Send + Sync + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Sync(Box::new(move |req: &Body, _: &Buffers| {
                f(&req.bytes()).map(Response::Bytes)
            })),
        );
        self.placement.keep(method);
        self
    }

    /// As [`ServerBuilder::handler_buf`], for a handler that answers at once, as
    /// [`ServerBuilder::handler_sync`] does: it borrows the request's [`Body`] and the
    /// connection's [`Buffers`], and returns a registered buffer of them, sent as it is. No
    /// future, no `Buffers` clone per request, the request's slot back to the ring after the
    /// response is sent: the cheapest path through the server, for handlers that do not wait.
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Body, Buffers, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     // The request's bytes, reversed, in a registered buffer of the connection.
    ///     .handler_buf_sync(1, |req: &Body, bufs: &Buffers| {
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
    /// # Ok(()) }
    /// ```
    pub fn handler_buf_sync<F>(mut self, method: u32, f: F) -> Self
    where
        F: Fn(&Body, &Buffers) -> Result<RegisteredBuf, RpcError> + Send + Sync + 'static,
    {
        self.handlers.insert(
            method,
            Handler::Sync(Box::new(move |req: &Body, bufs: &Buffers| {
                f(req, bufs).map(Response::Buf)
            })),
        );
        self.placement.keep(method);
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
