//! The session: one side of a connection, as a state machine.
//!
//! This file holds its types, its state and its limits; what it does is split by concern:
//! `calls` (the caller's side: starting, cancelling, finishing calls), `serving` (requests,
//! their limits and answers), `inputs` (messages alone or in batches, the ends of Reads and
//! Writes), `fragments` (joining a long message), `shutdown` (deadlines, GoAway and Close, a
//! lost connection) and `outgoing` (the queue, credits, pieces and batches).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use foldhash::HashSet;

use super::calls::CallMap;
use std::time::{Duration, Instant};

use crate::RemoteRegion;

use super::batch;
use super::credits::Credits;
use super::header::{
    decode_desc, encode_desc, Header, Kind, DESC_LEN, FLAG_FRAGMENT, FLAG_LANDING, FLAG_RENDEZVOUS, FRAG_PREFIX,
    HEADER_LEN,
};
use super::inline::Inline;
use super::ProtoError;
use crate::{CallError, ErrorReply, Lost, LostKind, Status};

mod calls;
mod fragments;
mod inputs;
mod outgoing;
mod serving;
mod shutdown;

/// A registered buffer, named by the driver that owns it.
pub type BufId = u64;

/// Bytes in front of a landed response (and of a lent buffer's payload): its length as a
/// little-endian `u64`, then zeros. As long as a message header, so that a buffer laid out for
/// lending can also be sent eagerly as it is ([`Payload::Placed`]), its header written over the
/// prefix.
pub const LANDING_PREFIX: usize = HEADER_LEN;

/// Sizes both sides agree on (exchanged at connection set-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Receive slots each side keeps posted.
    pub ring: u32,
    /// Largest payload sent eagerly (inside a Send); larger ones go by rendezvous.
    pub eager_max: usize,
    /// Largest piece of a message body one Send carries; a longer eager message goes in
    /// pieces ([`FLAG_FRAGMENT`]). Both sides must use the same value: drivers use [`FRAGMENT`].
    pub fragment: usize,
    /// Largest payload accepted at all.
    pub max_payload: u64,
}

/// The piece size drivers use ([`SessionConfig::fragment`]): receive slots hold at most this
/// much of a body, so an eager threshold above it costs no more memory per slot.
pub const FRAGMENT: usize = 32 * 1024;

impl SessionConfig {
    /// Longest body of a message: an eager payload after a landing descriptor, or descriptors.
    pub(super) fn body_max(&self) -> usize {
        DESC_LEN + self.eager_max.max(DESC_LEN * 2)
    }

    /// The piece size (at least 16 bytes).
    pub(super) fn piece(&self) -> usize {
        self.fragment.max(16)
    }

    /// Bytes a receive slot needs: the longest message, or the longest fragment of one.
    pub fn slot_size(&self) -> usize {
        let body = self.body_max();
        HEADER_LEN
            + if body <= self.piece() {
                body
            } else {
                FRAG_PREFIX + self.piece()
            }
    }
}

/// A request or response payload as the driver hands it over.
#[derive(Debug, PartialEq, Eq)]
pub enum Payload {
    /// Small: copied into the message.
    Eager(Vec<u8>),
    /// Large: staged in a registered buffer the peer may reach through `desc` until released.
    Lent {
        /// addr, len (the payload length), rkey.
        desc: RemoteRegion,
        /// The driver's name for the buffer.
        buf: BufId,
    },
    /// A request only: as [`Payload::Lent`], with `tail` after the lent bytes. The payload is
    /// the lent bytes followed by `tail`, which travels in the request message (at most the
    /// eager threshold long), so a buffer the application shares can be lent as it is while a
    /// few bytes of its own follow it (a typed call's other arguments). The server reads the
    /// lent bytes into a buffer with room for the tail after them.
    LentWith {
        /// addr, len (the lent bytes only), rkey.
        desc: RemoteRegion,
        /// The driver's name for the buffer.
        buf: BufId,
        /// The bytes after the lent ones.
        tail: Vec<u8>,
    },
    /// Small, and already in a registered buffer after [`HEADER_LEN`] bytes of room: sent from
    /// there in one message ([`Transmit::SendPlaced`]), no copy. At most one piece
    /// ([`SessionConfig::fragment`]) and the eager threshold long; no landing descriptor goes
    /// with it. The driver owns the buffer again once the Send completes, or when the session
    /// releases it unsent ([`Transmit::Release`]).
    Placed {
        /// The driver's name for the buffer.
        buf: BufId,
        /// The payload length.
        len: usize,
    },
}

/// How a payload in a registered buffer goes ([`Session::registered_route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// As [`Payload::Lent`], the buffer itself.
    Lend,
    /// As [`Payload::Placed`], sent from the buffer.
    Place,
    /// Copied into the message ([`Payload::Eager`]).
    Copy,
}

/// The result of a call.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The response bytes.
    Bytes(Vec<u8>),
    /// A short response (at most [`Inline::MAX`] bytes) for a call that takes its response
    /// where it lands ([`Session::keep_in_slot`]), copied out of its message without an
    /// allocation.
    Inline(Inline),
    /// The response is `range` of the message in receive slot `slot`, which the driver offered
    /// ([`Session::handle_message_in`]) for a call that asked for it ([`Session::keep_in_slot`]):
    /// the driver hands the slot to the caller and reposts it when the caller lets go.
    InSlot {
        /// The slot, as the driver named it.
        slot: u64,
        /// Where the response's bytes are in the slot.
        range: std::ops::Range<usize>,
    },
    /// The response landed by RDMA Write in the landing buffer the call advertised, laid out
    /// as [`LANDING_PREFIX`] bytes of little-endian length, then the bytes. The driver takes
    /// them out (checking the length against the buffer) and owns the buffer again.
    Landed {
        /// The landing buffer.
        buf: BufId,
    },
    /// A lent response read into the driver's held buffer `buf` (its first `len` bytes), for
    /// a call that takes its response where it lands ([`Session::keep_in_slot`],
    /// [`Session::handle_response_read`]): the driver hands the buffer to the caller.
    Held {
        /// The buffer read into.
        buf: BufId,
        /// The response's length.
        len: usize,
    },
}

/// What an RDMA Read the driver runs is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Token {
    /// Server side: fetching the request of this call.
    Request(u32),
    /// Client side: fetching the response of this call.
    Response(u32),
}

/// Work for the driver.
#[derive(Debug, PartialEq, Eq)]
pub enum Transmit {
    /// Send this message (header and body) with a two-sided Send.
    Send(Message),
    /// Write `head` over the first [`HEADER_LEN`] bytes of `buf` and Send the buffer's first
    /// `HEADER_LEN + len` bytes (a [`Payload::Placed`]); `buf` is the driver's again when the
    /// Send completes (no [`Transmit::Release`] follows).
    SendPlaced {
        /// The encoded header.
        head: [u8; HEADER_LEN],
        /// The buffer, its payload after `HEADER_LEN` bytes.
        buf: BufId,
        /// Payload bytes.
        len: usize,
    },
    /// RDMA Read `remote` into a buffer of the driver's with `tail` after the bytes read, then
    /// call [`Session::handle_read_done`] (or [`Session::handle_request_read`]) with all
    /// `remote.len + tail.len()` bytes.
    Read {
        /// What for.
        token: Token,
        /// Where from (its `len` is the number of bytes to read).
        remote: RemoteRegion,
        /// Bytes of the payload after the ones read (a [`Payload::LentWith`] request's);
        /// empty for most.
        tail: Vec<u8>,
    },
    /// RDMA Write-with-immediate a response of `len` bytes to `remote`, then call
    /// [`Session::handle_write_done`]. What is written is `buf`'s [`LANDING_PREFIX`]-byte length
    /// header followed by the bytes (the layout a lent buffer has), `LANDING_PREFIX + len` bytes
    /// from the start of `buf`; the immediate goes with the last piece.
    WriteImm {
        /// Source.
        buf: BufId,
        /// Payload bytes (without the prefix).
        len: usize,
        /// Destination.
        remote: RemoteRegion,
        /// Immediate data (the call id).
        imm: u32,
    },
    /// No peer can reach this buffer through this session any more: it may be reused.
    Release(BufId),
}

/// Where a request's bytes are.
#[derive(Debug, PartialEq, Eq)]
pub enum RequestBody {
    /// Copied out of the message (or read and copied, see [`Session::handle_read_done`]).
    Bytes(Vec<u8>),
    /// A short request (at most [`Inline::MAX`] bytes) not kept in its slot: copied out of the
    /// message without an allocation.
    Inline(Inline),
    /// In held buffer `buf`, from its start, after [`Session::handle_request_read`]: the
    /// driver hands the buffer itself to the application.
    Held {
        /// The buffer the request was read into.
        buf: BufId,
        /// The request's length.
        len: usize,
    },
    /// `range` of the message in receive slot `slot`, which the driver offered
    /// ([`Session::handle_message_in`]) for a method served in place
    /// ([`Session::serve_in_slot`]): the driver hands the slot to the handler and reposts it
    /// when the handler lets go.
    InSlot {
        /// The slot, as the driver named it.
        slot: u64,
        /// Where the request's bytes are in the slot.
        range: std::ops::Range<usize>,
    },
}

/// A message to send: its encoded header and its body (for a fragment: the prefix and its
/// piece of the shared body), kept apart so that the driver copies them once, straight into a
/// registered send buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    head: [u8; HEADER_LEN],
    frag: Option<[u8; FRAG_PREFIX]>,
    body: Bytes,
    /// The messages batched after this one in the same Send ([`batch`]), each header and body.
    more: Vec<([u8; HEADER_LEN], Vec<u8>)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Bytes {
    Own(Vec<u8>),
    Piece(Arc<Vec<u8>>, std::ops::Range<usize>),
}

impl Bytes {
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Piece(v, r) => &v[r.clone()],
        }
    }
}

impl Message {
    pub(super) fn prefix(&self) -> &[u8] {
        self.frag.as_ref().map_or(&[], |f| &f[..])
    }

    /// Bytes on the wire.
    pub fn len(&self) -> usize {
        HEADER_LEN + self.prefix().len() + self.body.as_slice().len() + self.more_len()
    }

    /// Bytes of the messages batched after this one.
    pub(super) fn more_len(&self) -> usize {
        self.more.iter().map(|(_, b)| HEADER_LEN + b.len()).sum()
    }

    /// Messages in this Send: this one and those batched after it.
    pub fn parts(&self) -> usize {
        1 + self.more.len()
    }

    /// Never empty (a header at least); for clippy's sake.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes the message to the start of `out`; `false` (nothing written) when it does not fit.
    pub fn write_to(&self, out: &mut [u8]) -> bool {
        let Some(out) = out.get_mut(..self.len()) else {
            return false;
        };
        let (head, rest) = out.split_at_mut(HEADER_LEN);
        head.copy_from_slice(&self.head);
        let (pre, rest) = rest.split_at_mut(self.prefix().len());
        pre.copy_from_slice(self.prefix());
        let (body, mut rest) = rest.split_at_mut(self.body.as_slice().len());
        body.copy_from_slice(self.body.as_slice());
        for (h, b) in &self.more {
            let (head, tail) = rest.split_at_mut(HEADER_LEN);
            head.copy_from_slice(h);
            let (body, tail) = tail.split_at_mut(b.len());
            body.copy_from_slice(b);
            rest = tail;
        }
        true
    }

    /// The message as one vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(&self.head);
        v.extend_from_slice(self.prefix());
        v.extend_from_slice(self.body.as_slice());
        for (h, b) in &self.more {
            v.extend_from_slice(h);
            v.extend_from_slice(b);
        }
        v
    }
}

/// What the application must learn.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A call of ours finished.
    CallDone {
        /// The call.
        call: u32,
        /// Its result.
        result: Result<Reply, CallError>,
    },
    /// A request arrived: run the handler for `method`, then [`Session::respond`].
    Request {
        /// The call id to respond to.
        call: u32,
        /// The method id.
        method: u32,
        /// The request bytes.
        payload: RequestBody,
        /// The caller's remaining budget, if it set a deadline.
        budget: Option<Duration>,
    },
    /// Stop the handler of this call (cancelled or past its deadline); its response is sent.
    Abort {
        /// The call.
        call: u32,
    },
}

struct ClientCall {
    method: u32,
    deadline: Option<Instant>,
    lent: Option<BufId>,
    landing: Option<BufId>,
    /// The caller takes an eager response in the receive slot it arrives in.
    in_slot: bool,
    /// False once the caller has its result (deadline) or gave up (cancel): the entry only
    /// waits for the server's last word so the buffers can be released.
    live: bool,
    /// Bytes of the request's body that travel inside Sends (0 for a rendezvous request), and
    /// whether they count against [`Session::limit_call_bytes`] (the request is sent).
    bytes: u64,
    counted: bool,
}

enum Serving {
    /// Waiting for request bytes to free up before its body is read ([`Session::limit_serving`]).
    Queued(RemoteRegion, Vec<u8>),
    Reading,
    Running,
    /// Response lent; waiting for ReadDone.
    Lent(BufId),
    /// Response being written to the landing buffer.
    Writing(BufId),
    /// Response queued, not handed to the driver yet (the peer's credits hold it back).
    Answered,
}

struct ServerCall {
    method: u32,
    deadline: Option<Instant>,
    landing: Option<RemoteRegion>,
    state: Serving,
    cancelled: bool,
    /// Request bytes this call holds against [`Session::limit_serving`]'s bytes (a
    /// rendezvous request's, from the start of its Read until it is answered).
    bytes: u64,
    /// Counts against [`Session::limit_serving`]'s requests: until its answer left, or was read
    /// (a lent one).
    counts: bool,
    /// When its answer was lent, as [`Session::handle_timeout`] first saw it
    /// ([`Session::limit_lent`]).
    lent_at: Option<Instant>,
    /// The `now` its request came with: no later than any time the driver reads afterwards,
    /// so an answer lent and not stamped yet is due at it ([`Session::poll_timeout`]).
    arrived: Instant,
}

enum Out {
    Msg {
        header: Header,
        body: Vec<u8>,
    },
    /// A message longer than one piece, `sent` bytes of its body on the way.
    Pieces {
        header: Header,
        body: Arc<Vec<u8>>,
        sent: usize,
    },
    WriteImm {
        buf: BufId,
        len: usize,
        remote: RemoteRegion,
        imm: u32,
    },
    /// A message whose body is in a registered buffer ([`Payload::Placed`]).
    Placed {
        header: Header,
        buf: BufId,
        len: usize,
    },
}

impl Out {
    /// Whether this may go between the pieces of a longer message ([`Session::interleave`]): a
    /// whole request or response (of another call, since a call has one of each). Cancels,
    /// shutdown messages and Writes-with-immediate keep their place.
    pub(super) fn overtakes(&self, piece: usize) -> bool {
        match self {
            Out::Msg { header, body } => body.len() <= piece && matches!(header.kind, Kind::Request | Kind::Response),
            Out::Placed { header, .. } => matches!(header.kind, Kind::Request | Kind::Response),
            Out::Pieces { .. } | Out::WriteImm { .. } => false,
        }
    }

    pub(super) fn is_read_done(&self) -> bool {
        matches!(self, Out::Msg { header, .. } if header.kind == Kind::ReadDone)
    }

    /// The call a request waiting to be sent belongs to ([`Session::limit_calls`]).
    /// Whether this is (a piece of) a request.
    pub(super) fn is_request(&self) -> bool {
        match self {
            Out::Msg { header, .. } | Out::Placed { header, .. } | Out::Pieces { header, .. } => {
                header.kind == Kind::Request
            }
            Out::WriteImm { .. } => false,
        }
    }

    pub(super) fn call(&self) -> Option<u32> {
        match self {
            Out::Msg { header, .. } | Out::Placed { header, .. } | Out::Pieces { header, .. } => Some(header.call_id),
            Out::WriteImm { .. } => None,
        }
    }
}

/// One side of an rdma-rpc connection. See the [module docs](super) for the order of calls.
pub struct Session {
    cfg: SessionConfig,
    credits: Credits,
    next_call: u32,
    calls: CallMap<u32, ClientCall>,
    served: CallMap<u32, ServerCall>,
    queue: VecDeque<Out>,
    /// A message that could go the moment it was made (nothing queued or pending before it, a
    /// credit for it, in one piece), encoded with its credit spent: [`Session::poll_transmit`]
    /// hands it out first, without a walk through the queue. Most messages of a connection
    /// with one call at a time go this way.
    ready: Option<Transmit>,
    actions: VecDeque<Transmit>,
    events: VecDeque<Event>,
    /// The message whose pieces are arriving (at most one: the pieces of two messages never
    /// interleave, though whole requests and responses may come between them).
    joining: Option<Joining>,
    /// The peer takes whole requests and responses between the pieces of a longer message
    /// ([`Session::interleave`]).
    interleave: bool,
    /// Short messages queued together go out in one Send ([`Session::batch`]).
    batch: bool,
    /// The last message sent went between the pieces of the message at the queue's front: the
    /// next turn is that message's.
    overtook: bool,
    lost: Option<Lost>,
    /// Methods whose eager requests stay in their receive slot.
    in_slot_methods: HashSet<u32>,
    /// Methods whose large requests stay in the buffer they are read into (eager ones copied).
    in_place_methods: HashSet<u32>,
    /// The slot the message being handled arrived in, while the driver lets it go to the
    /// application; taken (set to `None`) by whatever keeps the message there.
    offer: Option<u64>,
    /// Set when a call or a served request with a deadline was added; cleared by
    /// [`Session::poll_timeout`] once it finds none. (Atomic only to keep `Session` `Sync`.)
    deadlines: AtomicBool,
    /// Our own shutdown ([`Session::go_away`]): GoAway queued, then Close sent.
    ours: Shutdown,
    /// The peer's: its GoAway, then its Close, as they came.
    theirs: Shutdown,
    /// Requests this side serves at once, and request bytes it reads and holds at once
    /// ([`Session::limit_serving`]).
    serve_limit: usize,
    byte_limit: u64,
    /// Served requests not answered yet ([`Serving::is_active`]), and the bytes they hold.
    active: usize,
    held_bytes: u64,
    /// Bytes of rendezvous request bodies whose Reads are posted and not done, and how many
    /// may be at once ([`Session::limit_reading`]).
    reading_bytes: u64,
    read_limit: u64,
    /// Rendezvous requests waiting for bytes, in arrival order.
    deferred: VecDeque<u32>,
    /// How long a lent answer may wait for its caller's ReadDone ([`Session::limit_lent`]).
    lent_timeout: Option<Duration>,
    /// This side answers in pieces above the threshold, lending nothing
    /// ([`Session::lend_nothing`]); the peer does ([`Session::peer_lends_nothing`]).
    lends_nothing: bool,
    peer_lends_nothing: bool,
    /// Calls of ours the peer serves at once ([`Session::limit_calls`]); calls beyond wait
    /// here, unsent, in the order they were made.
    call_limit: usize,
    held_back: VecDeque<Out>,
    /// Calls with a deadline left `held_back` for the queue carrying the budget they were
    /// started with: [`Session::refresh_budgets`] gives them what is left.
    stale_budgets: bool,
    /// Bytes of eager request bodies the peer holds at once ([`Session::limit_call_bytes`]),
    /// and those of our calls sent and not finished.
    call_bytes_limit: u64,
    call_bytes: u64,
}

/// How far one side's shutdown went ([`Session::go_away`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Shutdown {
    /// Not started.
    None,
    /// GoAway: no new calls; requests already sent are served.
    GoingAway,
    /// Close: every request that will ever be served is answered.
    Closed,
}

struct Joining {
    header: Header,
    total: usize,
    body: Vec<u8>,
}

impl Serving {
    /// Holds request bytes against [`Session::limit_serving`]'s bytes (until its answer is
    /// made). Every served request, in any state, counts against its requests until its answer
    /// has left: queued answers, lent ones not read yet and ones being written included, so
    /// that a peer which takes no answers cannot make this side hold more than the limit.
    pub(super) fn holds_request(&self) -> bool {
        matches!(self, Serving::Queued(..) | Serving::Reading | Serving::Running)
    }
}

impl Session {
    /// A new session whose peer has `cfg.ring` receives posted.
    pub fn new(cfg: SessionConfig) -> Self {
        Self {
            credits: Credits::new(cfg.ring.max(2)),
            cfg,
            next_call: 1,
            calls: CallMap::default(),
            served: CallMap::default(),
            queue: VecDeque::new(),
            ready: None,
            actions: VecDeque::new(),
            events: VecDeque::new(),
            joining: None,
            interleave: false,
            batch: false,
            overtook: false,
            lost: None,
            in_slot_methods: HashSet::default(),
            in_place_methods: HashSet::default(),
            offer: None,
            deadlines: AtomicBool::new(false),
            ours: Shutdown::None,
            theirs: Shutdown::None,
            serve_limit: usize::MAX,
            byte_limit: u64::MAX,
            active: 0,
            held_bytes: 0,
            reading_bytes: 0,
            read_limit: u64::MAX,
            deferred: VecDeque::new(),
            lent_timeout: None,
            lends_nothing: false,
            peer_lends_nothing: false,
            call_limit: usize::MAX,
            held_back: VecDeque::new(),
            stale_budgets: false,
            call_bytes_limit: u64::MAX,
            call_bytes: 0,
        }
    }

    /// Bounds what this side serves at once (no bound by default):
    /// - `requests`: requests received and not done with yet: being read, waiting, run, or
    ///   answered with an answer that has not left yet (queued for want of the peer's
    ///   credits, lent and not read, or not yet handed to the driver to write). A request
    ///   beyond is answered at once with [`Status::Overloaded`], unrun.
    /// - `bytes`: bodies of rendezvous requests being read or run. A request whose body would
    ///   go beyond waits, unread (its bytes stay in the caller's memory), until enough of the
    ///   earlier ones are answered; one alone is always read (up to the largest payload).
    ///   Eager bodies arrive whether or not there is room: a caller that learned the limit
    ///   holds them back instead ([`Session::limit_call_bytes`]).
    pub fn limit_serving(&mut self, requests: usize, bytes: u64) {
        self.serve_limit = requests;
        self.byte_limit = bytes;
    }

    /// Bounds the bytes of rendezvous request bodies this side reads at once (no bound by
    /// default), within those [`Session::limit_serving`] lets it hold. A Read cannot be called
    /// back once posted: a request cancelled while its body is being read is answered only when
    /// the Read ends, and Reads posted for many requests keep the link busy for all of them
    /// before anything behind. A request beyond waits its turn, unread, where a Cancel answers
    /// it at once. One alone is always read.
    pub fn limit_reading(&mut self, bytes: u64) {
        self.read_limit = bytes;
    }

    /// Bounds how long a lent answer (a rendezvous response the caller reads) waits for its
    /// caller's ReadDone: past `timeout` the caller is taken to be broken or hostile, and the
    /// connection is lost (every buffer it held goes back), so an answer nobody reads is not
    /// held for ever. No bound by default.
    pub fn limit_lent(&mut self, timeout: Duration) {
        self.lent_timeout = Some(timeout);
    }

    /// This side lends no memory to its peer (it says so in its hello,
    /// [`Hello::LENDS_NOTHING`](crate::Hello::LENDS_NOTHING)): [`Session::respond`] takes eager
    /// responses up to the largest payload and sends those above the threshold in pieces.
    pub fn lend_nothing(&mut self, on: bool) {
        self.lends_nothing = on;
    }

    /// The peer lends no memory: a response of it above the threshold comes in pieces, and is
    /// joined up to the largest payload (requests stay within the threshold).
    pub fn peer_lends_nothing(&mut self, on: bool) {
        self.peer_lends_nothing = on;
    }

    /// Whether this side lends nothing ([`Session::lend_nothing`]).
    pub fn lends_nothing(&self) -> bool {
        self.lends_nothing
    }

    /// Longest body a message of `kind` may be joined to from pieces: a response of a peer
    /// that lends nothing may carry a whole payload.
    pub(super) fn joined_max(&self, kind: Kind) -> usize {
        if self.peer_lends_nothing && kind == Kind::Response {
            let payload = usize::try_from(self.cfg.max_payload).unwrap_or(usize::MAX);
            self.cfg.body_max().max(payload.min(u32::MAX as usize))
        } else {
            self.cfg.body_max()
        }
    }

    /// Longest eager response this side sends: a whole payload (in pieces) when it lends
    /// nothing, the threshold otherwise.
    pub(super) fn eager_response_max(&self) -> usize {
        if self.lends_nothing {
            let payload = usize::try_from(self.cfg.max_payload).unwrap_or(usize::MAX);
            self.cfg.eager_max.max(payload.min(u32::MAX as usize - DESC_LEN))
        } else {
            self.cfg.eager_max
        }
    }

    /// Bounds how many calls of ours are sent and not answered at once: the peer's
    /// `requests` of [`Session::limit_serving`], so that no call of a well-behaved caller is
    /// refused for it. Calls beyond wait in the session, unsent, and go out in the order they
    /// were made as earlier ones finish; a waiting call can still be cancelled or time out.
    pub fn limit_calls(&mut self, n: usize) {
        self.call_limit = n.max(1);
    }

    /// Bounds the bytes of request bodies that travel inside Sends (eager requests) of our
    /// calls sent and not answered at once: the peer's `bytes` of [`Session::limit_serving`],
    /// which it cannot hold back itself once they are sent (it reads a rendezvous body only
    /// when it has room). A call beyond waits, unsent, as for [`Session::limit_calls`]; one
    /// alone always goes.
    pub fn limit_call_bytes(&mut self, bytes: u64) {
        self.call_bytes_limit = bytes.max(1);
    }

    /// Whether a call whose eager body is `n` bytes may be sent now
    /// ([`Session::limit_call_bytes`]).
    pub(super) fn call_bytes_fit(&self, n: u64) -> bool {
        n == 0 || self.call_bytes == 0 || self.call_bytes.saturating_add(n) <= self.call_bytes_limit
    }

    /// Whether short messages queued at the same time go out together, in one Send
    /// ([`FLAG_MORE`](crate::FLAG_MORE)): only towards a peer that takes batches (it
    /// says so in its [`Hello`](crate::Hello); every session takes them). Off by
    /// default.
    pub fn batch(&mut self, yes: bool) {
        self.batch = yes;
    }

    /// Whether the peer takes whole requests and responses between the pieces of a longer
    /// message (it says so in its [`Hello`](crate::Hello); every session takes them).
    /// When it does, a message that goes out in pieces no longer holds up the calls queued
    /// behind it: each piece may be followed by one such message, so short calls get through
    /// while a long one is on its way, and the long one still gets every other turn.
    pub fn interleave(&mut self, yes: bool) {
        self.interleave = yes;
    }

    /// Served requests not answered yet: being read, waiting for bytes, or run
    /// ([`Session::limit_serving`]).
    pub fn unanswered(&self) -> usize {
        self.active
    }

    /// Bytes of rendezvous request bodies being read or run ([`Session::limit_serving`]).
    pub fn held_request_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Bytes of rendezvous request bodies being read ([`Session::limit_reading`]).
    pub fn reading_request_bytes(&self) -> u64 {
        self.reading_bytes
    }

    /// How many calls of ours are sent at once ([`Session::limit_calls`]); `None` without a limit.
    pub fn call_limit(&self) -> Option<usize> {
        (self.call_limit != usize::MAX).then_some(self.call_limit)
    }

    /// Messages waiting to be sent (for want of the peer's credits), and calls held back by
    /// its limits: what this side holds for a peer that does not take them.
    pub fn queued(&self) -> usize {
        self.queue.len() + self.held_back.len()
    }

    /// Calls of ours waiting for one of the peer's requests to free up ([`Session::limit_calls`]).
    pub fn held_back_calls(&self) -> usize {
        self.held_back.len()
    }

    /// Eager requests for these methods are handed over in the receive slot they arrived in
    /// ([`RequestBody::InSlot`]) when the driver offers the slot, instead of copied out.
    pub fn serve_in_slot(&mut self, methods: impl IntoIterator<Item = u32>) {
        self.in_slot_methods.extend(methods);
    }

    /// Rendezvous requests for these methods stay in the buffer the driver reads them into
    /// ([`Session::reads_in_place`]), as [`Session::serve_in_slot`]'s do; their eager requests
    /// are copied out of their receive slots.
    pub fn read_in_place(&mut self, methods: impl IntoIterator<Item = u32>) {
        self.in_place_methods.extend(methods);
    }

    /// The caller of `call` takes an eager response in the receive slot it arrives in
    /// ([`Reply::InSlot`]) when the driver offers the slot, instead of copied out.
    pub fn keep_in_slot(&mut self, call: u32) {
        if let Some(c) = self.calls.get_mut(call) {
            c.in_slot = true;
        }
    }

    /// The agreed sizes.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// Credits (for tests and metrics).
    pub fn credits(&self) -> &Credits {
        &self.credits
    }

    /// Sets the first grants of a new connection, before any message: this side grants the
    /// peer `mine` credits and the peer granted it `theirs` (each within `2..=ring`; the
    /// handshake's [`Hello::credits`](crate::Hello::credits)). Without it both are the ring.
    pub fn start_grants(&mut self, mine: u32, theirs: u32) {
        self.credits = Credits::with_grants(self.cfg.ring, mine, theirs);
    }

    /// Grants the peer up to `n` more credits (a receive pool's spare slots); returns how many
    /// ([`Credits::grant`]). They go out with the next message, or in a Credit message once
    /// half the peer's window is owed.
    pub fn grant_credits(&mut self, n: u32) -> u32 {
        self.credits.grant(n)
    }

    /// A consumed slot went back to a receive pool rather than to this peer: call instead of
    /// [`Session::reposted`]. `false` (and nothing changed) at the smallest window, where the
    /// caller reports the slot reposted as usual ([`Credits::withhold`]).
    pub fn withhold_credit(&mut self) -> bool {
        self.credits.withhold()
    }

    /// Calls of ours not yet finished, including abandoned ones waiting for the server's word.
    pub fn pending_calls(&self) -> usize {
        self.calls.len()
    }

    /// Requests being served.
    pub fn serving(&self) -> usize {
        self.served.len()
    }

    /// Whether a payload of `len` bytes goes by rendezvous.
    pub fn is_rendezvous(&self, len: usize) -> bool {
        len > self.cfg.eager_max
    }

    /// The earliest deadline to pass to [`Session::handle_timeout`].
    ///
    /// Called on every round of progress: without calls or requests that carry a deadline it
    /// looks at one flag, not at every call in flight.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if !self.deadlines.load(Ordering::Relaxed) {
            return None;
        }
        let mut any = false;
        let mut earliest: Option<Instant> = None;
        let mut consider = |d: Option<Instant>, counts: bool| {
            if let Some(d) = d {
                any = true;
                if counts && earliest.is_none_or(|e| d < e) {
                    earliest = Some(d);
                }
            }
        };
        for c in self.calls.values() {
            consider(c.deadline, c.live);
        }
        for s in self.served.values() {
            // A request still being read keeps its deadline for when its handler runs.
            consider(s.deadline, matches!(s.state, Serving::Running | Serving::Queued(..)));
            if let (Some(t), Serving::Lent(_)) = (self.lent_timeout, &s.state) {
                // Not seen by `handle_timeout` yet: due at once, to be stamped.
                consider(Some(s.lent_at.map_or(s.arrived, |at| at + t)), true);
            }
        }
        if !any {
            self.deadlines.store(false, Ordering::Relaxed);
        }
        earliest
    }
}
