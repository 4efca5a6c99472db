//! The protocol core, sans-IO: no sockets, no clock, no provider inside.
//!
//! A [`Session`] is one side of a connection. Inputs come in as calls — a received message
//! ([`Session::handle_message`]), a Write-with-immediate ([`Session::handle_write_imm`]), the end
//! of an RDMA Read or Write the driver ran for it, the time ([`Session::handle_timeout`]), the
//! loss of the connection — and outputs are taken by polling: [`Session::poll_transmit`] for
//! work to post (Sends, Reads, Writes-with-imm; it never exceeds the peer's credits, so the peer
//! never sees RNR) and [`Session::poll_event`] for what the application must learn (a call
//! finished, a request arrived, a handler must stop). After any input, drain both.
//!
//! A message whose body is longer than [`SessionConfig::fragment`] bytes travels in pieces
//! ([`FLAG_FRAGMENT`]): back-to-back Sends, one receive slot and one credit each, which the
//! receiving session joins before reading the message; receive slots are never longer than one
//! piece ([`SessionConfig::slot_size`]).
//!
//! Short messages queued together may share one Send ([`FLAG_MORE`], `batch.rs`): one slot and
//! one credit for all, each handled as if it had come alone.
//!
//! Buffers are named by [`BufId`]s the driver gives: the session never frees memory, it tells the
//! driver when a buffer a peer could reach may be released ([`Transmit::Release`]).

mod batch;
mod calls;
mod credits;
mod error;
mod header;
mod hello;
mod inline;
mod region;
mod session;
mod status;

pub use batch::FLAG_MORE;
pub use calls::{CallMap, Key};
pub use credits::Credits;
pub use error::{CallError, ErrorReply, LocalError, Lost, LostKind};
pub use header::{
    decode_desc, encode_desc, Header, Kind, DESC_LEN, FLAG_FRAGMENT, FLAG_LANDING, FLAG_RENDEZVOUS, FRAG_PREFIX,
    HEADER_LEN, VERSION,
};
pub use hello::Hello;
pub use inline::Inline;
pub use region::RemoteRegion;
pub use session::{
    BufId, Event, Message, Payload, Reply, RequestBody, Route, Session, SessionConfig, Token, Transmit, FRAGMENT,
    LANDING_PREFIX,
};
pub use status::Status;

/// Bytes that are not a valid message, or a message that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// Fewer bytes than a header or a descriptor.
    #[error("message truncated")]
    Truncated,
    /// A version this build does not speak.
    #[error("protocol version {0} (this build speaks {v})", v = header::VERSION)]
    BadVersion(u8),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    BadKind(u8),
    /// The header's body length and the message disagree.
    #[error("body length {announced} announced, {actual} present")]
    BodyLength {
        /// From the header.
        announced: u32,
        /// In the message.
        actual: usize,
    },
    /// A request reused the id of a call still in progress.
    #[error("duplicate call id {0}")]
    DuplicateCall(u32),
    /// A response or immediate for no call of ours.
    #[error("unknown call id {0}")]
    UnknownCall(u32),
    /// The peer returned more credits than our ring has: it is not following the protocol.
    #[error("peer returned credits beyond the ring")]
    Overrun,
    /// The peer sent a message with no credit left for it: it is not following the protocol.
    #[error("peer sent beyond the credits it was granted")]
    NoCredit,
    /// A lent buffer longer than the configured maximum payload.
    #[error("payload of {0} bytes above the maximum")]
    TooLarge(u64),
    /// A fragment out of place: out of order, too long, of another message, or a message
    /// between the pieces of one.
    #[error("bad fragment: {0}")]
    BadFragment(&'static str),
    /// The allocator refused the memory for a message being joined from its pieces (its
    /// length is within the configured maximum): the connection ends, the process goes on.
    #[error("no memory for a {0}-byte message: lower eager_threshold, or give the process more memory")]
    NoMemory(usize),
    /// A batch of messages in one Send that does not parse: a message longer than the rest,
    /// bytes after the last, a piece of a longer message inside, or too many messages.
    #[error("bad batch: {0}")]
    BadBatch(&'static str),
}
