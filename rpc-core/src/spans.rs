//! The per-call tracing spans (`rpc.call` on the client, `rpc.serve` on the server).
//!
//! A span is made only once a tracing subscriber exists (global or scoped). Without one,
//! `tracing` with its `log` feature on (which any crate in the build can turn on: tarpc does)
//! makes disabled spans that still go through its log fallback on every enter, exit, field
//! record and drop: several hundred instructions per round trip (callgrind, in the benchmark,
//! where tarpc is linked: `Span::log` alone ran 9 times per round trip). No span at all costs
//! nothing. The price: with no tracing subscriber, these spans do not reach a `log` logger
//! either (a tracing subscriber gets them, see `tests/spans.rs`).

use tracing::Span;

/// `rpc.call` for a call of `method` with `len` request bytes.
pub(crate) fn call(method: u32, len: usize) -> Span {
    if tracing::dispatcher::has_been_set() {
        tracing::debug_span!("rpc.call", method, len)
    } else {
        Span::none()
    }
}

/// `rpc.serve` for request `call` of `method`, `len` bytes, within `budget`.
pub(crate) fn serve(method: u32, call: u32, len: usize, budget: Option<std::time::Duration>) -> Span {
    if tracing::dispatcher::has_been_set() {
        tracing::debug_span!("rpc.serve", method, call, len, ?budget)
    } else {
        Span::none()
    }
}
