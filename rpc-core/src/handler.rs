//! Handlers by method id, type-erased: async handlers (a future per request, polled once in the
//! connection's driver and moved to a task of its own if it waits) and synchronous ones
//! (answered in the driver as they return). `register.rs` has the
//! [`ServerBuilder`](crate::ServerBuilder) methods that register them.

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use crate::buf::{Body, RegisteredBuf};

use crate::stash::Buffers;
use crate::RpcError;

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = Result<Response, RpcError>> + Send>>;

/// Makes an async handler's future.
type MakeFuture = dyn Fn(Body, &Buffers, Option<Instant>) -> BoxFuture + Send + Sync;
/// Runs a synchronous handler.
type Answer = dyn Fn(&Body, &Buffers) -> Result<Response, RpcError> + Send + Sync;

/// A handler, type-erased: the request's body and the connection's buffers in.
pub(crate) enum Handler {
    /// With the request's deadline (put in force for [`context::deadline`](crate::context::deadline)): its future out.
    Async(Box<MakeFuture>),
    /// Borrowing the body: its answer out (the driver puts the deadline in force around the
    /// call, and drops the body after the answer is sent).
    Sync(Box<Answer>),
}

/// A handler's answer: bytes to copy into the message, a registered buffer to send from, or
/// a shared value lent as it is where it is registered with the connection. (`pub` for the
/// sealed [`HandlerOutput`](crate::HandlerOutput); its module is private.)
pub enum Response {
    Bytes(Vec<u8>),
    Buf(RegisteredBuf),
    Bulk(crate::Bulk),
}

/// Polls a future, turning a panic inside it into an `Err` with the panic's payload.
pub(crate) struct CatchUnwind(pub(crate) BoxFuture);

impl Future for CatchUnwind {
    type Output = Result<Result<Response, RpcError>, Box<dyn std::any::Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let fut = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(std::task::Poll::Ready(r)) => std::task::Poll::Ready(Ok(r)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(p) => std::task::Poll::Ready(Err(p)),
        }
    }
}

/// A handler's result, or [`RpcError::HandlerPanic`] with the text of its panic.
pub(crate) fn or_panic(r: std::thread::Result<Result<Response, RpcError>>) -> Result<Response, RpcError> {
    r.unwrap_or_else(|p| Err(RpcError::HandlerPanic(panic_message(p))))
}

/// The text of a handler's panic.
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}
