//! Why the session ended a call: its own errors, apart from the runtime's.

use std::sync::Arc;

use crate::Status;

/// Why the session ended a call of this side, or refused to start one. The runtime on top
/// turns it into its own error type (`rdma_rpc_core::RpcError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The server answered with an error status, and the message it sent with it.
    #[error("the server answered {status:?}: {message}")]
    Remote {
        /// The response's status (never [`Status::Ok`]).
        status: Status,
        /// The call's method id.
        method: u32,
        /// The response body as text (invalid UTF-8 replaced).
        message: String,
    },
    /// A request above the agreed maximum payload; nothing was sent.
    #[error("payload of {len} bytes above the maximum of {max}")]
    PayloadTooLarge {
        /// Bytes asked for.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The call's deadline passed before its response arrived; the server may have run it.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The call's deadline passed before the request left this side (a budget under the
    /// wire's microsecond, or a call that waited its turn too long), or before the server
    /// started its handler: it was not run.
    #[error("the deadline passed before the call was run: it was not run")]
    Expired,
    /// The caller cancelled the call.
    #[error("call cancelled")]
    Cancelled,
    /// The connection is gone, for the reason given; the call's request had left, so the
    /// peer may have run it.
    #[error("connection lost: {0}")]
    ConnectionLost(Lost),
    /// The connection is gone, for the reason given, before the call's request had left in
    /// full: it did not run.
    #[error("connection lost before the call was sent, so it did not run: {0}")]
    Unsent(Lost),
    /// The peer broke the protocol, or the call asked for something it forbids.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer is shutting down: the call was not run.
    #[error("the peer is shutting down: the call was not run")]
    ShuttingDown,
    /// The driver failed the call's transfer ([`Session::handle_read_done`](crate::Session::handle_read_done)):
    /// its own error, passed through unchanged.
    #[error(transparent)]
    Local(LocalError),
}

/// Why a connection was lost: a kind to branch on, and the words for a person.
///
/// ```
/// use rdma_rpc_proto::{Lost, LostKind};
/// let lost = Lost::new(LostKind::Closed, "the peer shut the connection down (Close)");
/// assert_eq!(lost.kind(), LostKind::Closed);
/// assert_eq!(lost.to_string(), "the peer shut the connection down (Close)");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{why}")]
pub struct Lost {
    kind: LostKind,
    why: String,
}

/// What ended a connection ([`Lost::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostKind {
    /// The peer closed it or went away: its Close, its disconnect, its process ending (the
    /// work requests in flight were flushed).
    Closed,
    /// The transport failed a work request (the peer is gone or unreachable, a retry count
    /// ran out, a remote access was refused): the words name the completion status.
    Transport,
    /// The peer broke the protocol: a message this side could not accept.
    Protocol,
    /// A limit of this side's configuration ran out (an idle connection, an answer the peer
    /// did not read in time).
    Timeout,
    /// This side failed on its own (posting or polling its queues, its own buffers).
    Local,
}

impl Lost {
    /// A loss of `kind`, in `why`'s words.
    pub fn new(kind: LostKind, why: impl Into<String>) -> Self {
        Self { kind, why: why.into() }
    }

    /// What ended the connection.
    pub fn kind(&self) -> LostKind {
        self.kind
    }

    /// The words.
    pub fn reason(&self) -> &str {
        &self.why
    }
}

/// An error of the driver's that the session carries to a call's result unchanged (a buffer it
/// could not register for a Read, say), for the driver to take back with
/// [`LocalError::downcast_ref`].
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct LocalError(Arc<dyn std::error::Error + Send + Sync>);

impl LocalError {
    /// Wraps `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }

    /// The error, when it is a `T`.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

/// Equal when they say the same.
impl PartialEq for LocalError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for LocalError {}

/// `e` and its sources on one line, `a: b: c`.
pub(crate) fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(x) = at {
        s.push_str(": ");
        s.push_str(&x.to_string());
        at = x.source();
    }
    s
}

impl CallError {
    /// The error a caller sees for a response with `status` (not [`Status::Ok`]) and body
    /// `msg`: a deadline, a cancel or a payload limit as if this side had met it, the rest as
    /// [`CallError::Remote`].
    pub fn from_wire(status: Status, method: u32, msg: &[u8]) -> Self {
        let message = String::from_utf8_lossy(msg).into_owned();
        match status {
            Status::DeadlineExceeded => CallError::DeadlineExceeded,
            Status::Cancelled => CallError::Cancelled,
            Status::Expired => CallError::Expired,
            Status::PayloadTooLarge => {
                let mut it = message.split('/').map(|p| p.parse::<u64>().unwrap_or(0));
                CallError::PayloadTooLarge {
                    len: it.next().unwrap_or(0),
                    max: it.next().unwrap_or(0),
                }
            }
            _ => CallError::Remote {
                status,
                method,
                message,
            },
        }
    }
}

/// What a server answers a failed call with: a status and a message, which its caller's
/// session turns into [`CallError::Remote`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// The status (not [`Status::Ok`]: an `Ok` here goes as [`Status::Internal`]).
    pub status: Status,
    /// The message; cut to what one eager message holds.
    pub message: String,
}

impl ErrorReply {
    /// `status` with `message`.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status: if status == Status::Ok { Status::Internal } else { status },
            message: message.into(),
        }
    }

    pub(crate) fn cancelled() -> Self {
        Self::new(Status::Cancelled, CallError::Cancelled.to_string())
    }

    pub(crate) fn deadline() -> Self {
        Self::new(Status::DeadlineExceeded, CallError::DeadlineExceeded.to_string())
    }

    /// The body of a [`Status::PayloadTooLarge`] answer: `len/max`.
    pub(crate) fn too_large(len: u64, max: u64) -> Self {
        Self::new(Status::PayloadTooLarge, format!("{len}/{max}"))
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(Status::Internal, message)
    }
}
