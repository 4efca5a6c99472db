//! The per-call tracing spans (`rpc.call` on the client, `rpc.serve` on the server), and the
//! `rpc.payload` event that says how a payload from a registered buffer left.
//!
//! A span is made only once a tracing subscriber exists (global or scoped). Without one,
//! `tracing` with its `log` feature on (which any crate in the build can turn on: tarpc does)
//! makes disabled spans that still go through its log fallback on every enter, exit, field
//! record and drop: several hundred instructions per round trip (callgrind, in the benchmark,
//! where tarpc is linked: `Span::log` alone ran 9 times per round trip). No span at all costs
//! nothing, and no span is made then: [`call`] and [`serve`] give `None`, so that nothing is
//! cloned, entered or dropped per call (four drops of an empty span cost about 90 instructions
//! per round trip with that log fallback linked). The price: with no tracing subscriber, these spans do not reach a `log` logger
//! either (a tracing subscriber gets them, see `tests/spans.rs`).

use tracing::Span;

/// `rpc.call` for a call of `method` with `len` request bytes, once a subscriber exists.
pub(crate) fn call(method: u32, len: usize) -> Option<Span> {
    tracing::dispatcher::has_been_set().then(|| tracing::debug_span!("rpc.call", method, len))
}

/// `rpc.serve` for request `call` of `method`, `len` bytes, within `budget`, once a subscriber
/// exists.
pub(crate) fn serve(method: u32, call: u32, len: usize, budget: Option<std::time::Duration>) -> Option<Span> {
    tracing::dispatcher::has_been_set().then(|| tracing::debug_span!("rpc.serve", method, call, len, ?budget))
}

/// How a payload from a registered buffer ([`Client::call_buf`](crate::Client::call_buf),
/// a handler's [`RegisteredBuf`](crate::RegisteredBuf) answer) leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum How {
    /// In one Send straight from the buffer, the header in the room in front of its bytes.
    SentFromBuffer,
    /// The buffer itself lent to the peer (rendezvous).
    Lent,
    /// Copied into the message, as a `Vec` is (another connection's buffer, or a small request
    /// behind a landing descriptor).
    Copied,
    /// Copied into a buffer of this connection, which is lent (another connection's buffer,
    /// above the threshold).
    CopiedAndLent,
}

impl How {
    fn as_str(self) -> &'static str {
        match self {
            How::SentFromBuffer => "sent from its buffer",
            How::Lent => "lent",
            How::Copied => "copied",
            How::CopiedAndLent => "copied into a lent buffer",
        }
    }
}

/// The `rpc.payload` event (level DEBUG, fields `side`, `len`, `how`) for the `side`
/// (`request` or `response`) of `len` bytes, once a tracing subscriber exists: where an
/// application sees whether its registered buffers were sent as they are.
pub(crate) fn payload(side: &'static str, len: usize, how: How) {
    if tracing::dispatcher::has_been_set() {
        tracing::debug!(side, len, how = how.as_str(), "rpc.payload");
    }
}
