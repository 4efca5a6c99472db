//! The caller-facing error type, and the transport failures under it.

use rdma_rpc_proto::{CallError, ErrorReply, Status};

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The server has no handler for this method id.
    #[error("unknown method {0}: is the server running the same service version?")]
    UnknownMethod(u32),
    /// The server could not decode the request.
    #[error("the server could not decode the request: {0}")]
    BadRequest(String),
    /// The handler panicked (the server is still up).
    #[error("the handler panicked: {0}")]
    HandlerPanic(String),
    /// Request or response above the maximum payload.
    #[error("payload of {len} bytes above the maximum of {max}: raise Config::max_payload on both sides")]
    PayloadTooLarge {
        /// Bytes asked for (0 when the server did not say).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The deadline passed before the response arrived. The server may have run the call
    /// (or be running it still): see [`RpcError::Expired`] for calls known not to have run.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The call's deadline passed before it was run: before its request left this side (a
    /// deadline under a microsecond, the unit the wire carries, or a call that waited for the
    /// server's limit of requests past its deadline), or before the server started its
    /// handler. It was not run: retry it with a longer deadline.
    #[error("the deadline passed before the call was run, so it was not run: give it a longer deadline")]
    Expired,
    /// The call was cancelled.
    #[error("call cancelled")]
    Cancelled,
    /// The handler returned an error of the application.
    #[error("application error: {0}")]
    Application(String),
    /// The server failed for a reason of its own.
    #[error("server error: {0}")]
    Internal(String),
    /// The connection is gone: every pending call fails with this at once. Its request had
    /// left, so the server may have run it (see [`RpcError::Unsent`] for those that had not).
    /// [`Lost::kind`](crate::proto::Lost::kind) says what ended it (the peer's Close, a
    /// transport failure, a protocol breach, a timeout of this side, a local failure).
    #[error("connection lost: {0}")]
    ConnectionLost(crate::proto::Lost),
    /// The connection was lost before this call's request had left in full (it waited for the
    /// server's limit of requests, or for credits): it did not run. Retry it on a new
    /// connection.
    #[error("connection lost before the call was sent, so it did not run: {0}")]
    Unsent(crate::proto::Lost),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The call's arguments could not be encoded (a `Serialize` impl failed, or a sequence of
    /// unknown length); nothing was sent.
    #[error("could not encode the call: {0}")]
    Encode(String),
    /// The server is shutting down ([`Server::serve_with_shutdown`](crate::Server::serve_with_shutdown)):
    /// this call was not run there, so it is safe to retry, on a new connection (to the same
    /// address once the server is back) or to another server.
    #[error("the server is shutting down: the call was not run; retry it on a new connection or another server")]
    ShuttingDown,
    /// The server was already serving as many requests of this connection as it allows at
    /// once, so it refused this one unrun: safe to retry. A [`Client`](crate::Client) never
    /// sends more than the server's limit (it learns it when connecting, and further calls
    /// wait their turn), so this comes from a peer that does not keep the limit.
    #[error("the server was already serving as many requests of this connection as it allows ({limit}) and did not run the call: retry it later, or raise Config::max_concurrent_requests on the server")]
    Overloaded {
        /// The server's limit (0 when it did not say).
        limit: u64,
    },
    /// The server refused the connection: it was at its limit of connections
    /// ([`Config::max_connections`](crate::Config::max_connections)), or shutting down, or did
    /// not understand the hello. Nothing was connected; try again later, or another server.
    #[error("the server refused the connection (at its Config::max_connections, shutting down, or not speaking this version): try again later or another server")]
    ConnectionRefused,
    /// The transport failed: connecting, binding, registering memory. What was being done,
    /// and the transport's own error under it when there is one
    /// ([`TransportError::transport`], [`TransportError::io_kind`]: e.g.
    /// `ConnectionRefused` when nothing listens at the address).
    #[error(transparent)]
    Transport(TransportError),
    /// A [`Config`](crate::Config) value is outside what the protocol allows: nothing was
    /// connected or bound. The message names the field and its range.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// A transport failure under [`RpcError::Transport`]: what was being done (naming the
/// address, size or task), and the transport's own error when one caused it, which is also
/// this error's [`source`](std::error::Error::source) (and its source the operating system's
/// error, where there is one).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use rdma_rpc_core::{transport::Device, Client, Config, RpcError};
/// let dev = Device::open("tcp").expect("the tcp provider");
/// // Nothing listens on port 1.
/// match Client::connect(&dev, "127.0.0.1:1".parse().expect("an address"), Config::default()).await {
///     Err(RpcError::Transport(e)) => {
///         assert_eq!(e.io_kind(), Some(std::io::ErrorKind::ConnectionRefused));
///         assert_eq!(e.to_string(), "connecting to 127.0.0.1:1");
///     }
///     other => panic!("{:?}", other.map(|_| ())),
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TransportError {
    what: String,
    cause: Option<std::sync::Arc<rdma_rpc_transport::Error>>,
}

impl TransportError {
    /// A failure with no transport error under it.
    pub(crate) fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            cause: None,
        }
    }

    /// `cause` while doing `what`.
    pub(crate) fn with(what: impl Into<String>, cause: rdma_rpc_transport::Error) -> Self {
        Self {
            what: what.into(),
            cause: Some(std::sync::Arc::new(cause)),
        }
    }

    /// What was being done.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The transport's error, when one caused this.
    pub fn transport(&self) -> Option<&rdma_rpc_transport::Error> {
        self.cause.as_deref()
    }

    /// The kind of the operating system's error under the transport's, when there is one:
    /// `ConnectionRefused` (nothing listens at the address: start the server, or retry),
    /// `AddrInUse` (binding a taken port), `TimedOut`, ...
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        self.transport()
            .and_then(rdma_rpc_transport::Error::io_error)
            .map(std::io::Error::kind)
    }
}

/// What was being done; the transport's error is the [`source`](std::error::Error::source)
/// ([`RpcError::report`] prints them all).
impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_deref().map(|c| c as &(dyn std::error::Error + 'static))
    }
}

/// Equal when they say the same: what was being done, and the same messages under it.
impl PartialEq for TransportError {
    fn eq(&self, other: &Self) -> bool {
        rdma_rpc_transport::Report(self).to_string() == rdma_rpc_transport::Report(other).to_string()
    }
}

impl Eq for TransportError {}

impl RpcError {
    /// The error and its causes on one line (`a: b: c`): `{}` on an `RpcError` shows only its
    /// own part, and its [`source`](std::error::Error::source) the cause, as the Rust API
    /// guidelines have it, so that error reporters print each part once.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use rdma_rpc_core::{transport::Device, Client, Config};
    /// let dev = Device::open("tcp").expect("the tcp provider");
    /// let err = Client::connect(&dev, "127.0.0.1:1".parse().expect("an address"), Config::default())
    ///     .await
    ///     .err()
    ///     .expect("nothing listens on port 1");
    /// assert_eq!(err.to_string(), "connecting to 127.0.0.1:1");
    /// let all = err.report().to_string();
    /// assert!(all.starts_with("connecting to 127.0.0.1:1: nothing listens at 127.0.0.1:1 on provider tcp: "), "{all}");
    /// # }
    /// ```
    pub fn report(&self) -> rdma_rpc_transport::Report<'_> {
        rdma_rpc_transport::Report(self)
    }

    /// True when the call certainly did not run on the server, so that retrying it (on this
    /// connection later, or elsewhere) cannot run it twice: [`RpcError::ShuttingDown`],
    /// [`RpcError::Expired`], [`RpcError::Unsent`], [`RpcError::Overloaded`], [`RpcError::ConnectionRefused`], and errors raised before
    /// anything was sent ([`RpcError::Encode`], [`RpcError::Config`]). False for every other
    /// error, including those after which the call may or may not have run
    /// ([`RpcError::ConnectionLost`], [`RpcError::DeadlineExceeded`], [`RpcError::Cancelled`]),
    /// and those a handler can pass on from a call of its own.
    ///
    /// ```
    /// use rdma_rpc_core::{Lost, LostKind, RpcError};
    /// assert!(RpcError::ShuttingDown.did_not_run());
    /// assert!(RpcError::Overloaded { limit: 8 }.did_not_run());
    /// assert!(RpcError::Expired.did_not_run());
    /// assert!(!RpcError::DeadlineExceeded.did_not_run());
    /// let reset = Lost::new(LostKind::Transport, "reset");
    /// assert!(!RpcError::ConnectionLost(reset.clone()).did_not_run());
    /// assert!(RpcError::Unsent(reset).did_not_run());
    /// ```
    pub fn did_not_run(&self) -> bool {
        matches!(
            self,
            RpcError::ShuttingDown
                | RpcError::Unsent(_)
                | RpcError::Expired
                | RpcError::Overloaded { .. }
                | RpcError::ConnectionRefused
                | RpcError::Encode(_)
                | RpcError::Config(_)
        )
    }

    /// The status and message a server sends for this error returned by a handler. Errors that
    /// promise the call did not run ([`RpcError::Overloaded`], [`RpcError::ShuttingDown`]) go
    /// as [`Status::Internal`]: the handler ran. The session sends those statuses itself.
    pub fn to_wire(&self) -> ErrorReply {
        let status = match self {
            RpcError::UnknownMethod(_) => Status::UnknownMethod,
            RpcError::BadRequest(_) => Status::BadRequest,
            RpcError::HandlerPanic(_) => Status::HandlerPanic,
            RpcError::PayloadTooLarge { .. } => Status::PayloadTooLarge,
            RpcError::DeadlineExceeded => Status::DeadlineExceeded,
            RpcError::Cancelled => Status::Cancelled,
            RpcError::Application(_) => Status::Application,
            // Not `Overloaded` or `ShuttingDown`, whose callers take them for "not run": a
            // handler that passes one on (from a call of its own) did run.
            _ => Status::Internal,
        };
        let msg = match self {
            RpcError::BadRequest(m) | RpcError::HandlerPanic(m) | RpcError::Application(m) | RpcError::Internal(m) => {
                m.clone()
            }
            RpcError::PayloadTooLarge { len, max } => format!("{len}/{max}"),
            other => other.report().to_string(),
        };
        ErrorReply::new(status, msg)
    }

    /// The error a caller sees for a response with `status` and body `msg`.
    pub fn from_wire(status: Status, method: u32, msg: &[u8]) -> Self {
        let text = String::from_utf8_lossy(msg).into_owned();
        match status {
            Status::Ok => RpcError::Protocol("error constructed from an Ok status".into()),
            Status::UnknownMethod => RpcError::UnknownMethod(method),
            Status::BadRequest => RpcError::BadRequest(text),
            Status::HandlerPanic => RpcError::HandlerPanic(text),
            Status::PayloadTooLarge => {
                let mut it = text.split('/').map(|p| p.parse::<u64>().unwrap_or(0));
                RpcError::PayloadTooLarge {
                    len: it.next().unwrap_or(0),
                    max: it.next().unwrap_or(0),
                }
            }
            Status::DeadlineExceeded => RpcError::DeadlineExceeded,
            Status::Cancelled => RpcError::Cancelled,
            Status::Expired => RpcError::Expired,
            Status::Application => RpcError::Application(text),
            Status::Internal => RpcError::Internal(text),
            Status::Overloaded => RpcError::Overloaded {
                limit: text.parse().unwrap_or(0),
            },
            _ => RpcError::Internal(text),
        }
    }
}

/// The session's reasons, as a caller sees them.
impl From<CallError> for RpcError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Remote {
                status,
                method,
                message,
            } => RpcError::from_wire(status, method, message.as_bytes()),
            CallError::PayloadTooLarge { len, max } => RpcError::PayloadTooLarge { len, max },
            CallError::DeadlineExceeded => RpcError::DeadlineExceeded,
            CallError::Expired => RpcError::Expired,
            CallError::Cancelled => RpcError::Cancelled,
            CallError::ConnectionLost(why) => RpcError::ConnectionLost(why),
            CallError::Unsent(why) => RpcError::Unsent(why),
            CallError::Protocol(why) => RpcError::Protocol(why),
            CallError::ShuttingDown => RpcError::ShuttingDown,
            // The driver's own error, passed through the session.
            CallError::Local(e) => e
                .downcast_ref::<RpcError>()
                .cloned()
                .unwrap_or_else(|| RpcError::Internal(rdma_rpc_transport::Report(&e).to_string())),
            other => RpcError::Protocol(other.to_string()),
        }
    }
}
