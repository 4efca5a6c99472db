//! The session: one side of a connection, as a state machine.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use foldhash::HashSet;

use super::calls::CallMap;
use std::time::{Duration, Instant};

use rdma_rpc_transport::RemoteRegion;

use super::batch;
use super::credits::Credits;
use super::header::{
    decode_desc, encode_desc, Header, Kind, DESC_LEN, FLAG_FRAGMENT, FLAG_LANDING, FLAG_RENDEZVOUS, FRAG_PREFIX,
    HEADER_LEN,
};
use super::inline::Inline;
use super::ProtoError;
use crate::{RpcError, Status};

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
    fn body_max(&self) -> usize {
        DESC_LEN + self.eager_max.max(DESC_LEN * 2)
    }

    /// The piece size (at least 16 bytes).
    fn piece(&self) -> usize {
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
    /// RDMA Read `remote` into a buffer of the driver's, then call [`Session::handle_read_done`].
    Read {
        /// What for.
        token: Token,
        /// Where from (its `len` is the payload length).
        remote: RemoteRegion,
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
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Piece(v, r) => &v[r.clone()],
        }
    }
}

impl Message {
    fn prefix(&self) -> &[u8] {
        self.frag.as_ref().map_or(&[], |f| &f[..])
    }

    /// Bytes on the wire.
    pub fn len(&self) -> usize {
        HEADER_LEN + self.prefix().len() + self.body.as_slice().len() + self.more_len()
    }

    /// Bytes of the messages batched after this one.
    fn more_len(&self) -> usize {
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
        result: Result<Reply, RpcError>,
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
    Queued(RemoteRegion),
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
    fn overtakes(&self, piece: usize) -> bool {
        match self {
            Out::Msg { header, body } => body.len() <= piece && matches!(header.kind, Kind::Request | Kind::Response),
            Out::Placed { header, .. } => matches!(header.kind, Kind::Request | Kind::Response),
            Out::Pieces { .. } | Out::WriteImm { .. } => false,
        }
    }

    fn is_read_done(&self) -> bool {
        matches!(self, Out::Msg { header, .. } if header.kind == Kind::ReadDone)
    }

    /// The call a request waiting to be sent belongs to ([`Session::limit_calls`]).
    fn call(&self) -> Option<u32> {
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
    lost: Option<String>,
    /// Methods whose eager requests stay in their receive slot.
    in_slot_methods: HashSet<u32>,
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
    /// Calls of ours the peer serves at once ([`Session::limit_calls`]); calls beyond wait
    /// here, unsent, in the order they were made.
    call_limit: usize,
    held_back: VecDeque<Out>,
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
    fn holds_request(&self) -> bool {
        matches!(self, Serving::Queued(_) | Serving::Reading | Serving::Running)
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
            call_limit: usize::MAX,
            held_back: VecDeque::new(),
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
    fn call_bytes_fit(&self, n: u64) -> bool {
        n == 0 || self.call_bytes == 0 || self.call_bytes.saturating_add(n) <= self.call_bytes_limit
    }

    /// Whether short messages queued at the same time go out together, in one Send ([`batch`]):
    /// only towards a peer that takes batches (it says so in its
    /// [`Hello`](crate::proto::Hello); every session takes them). Off by default.
    pub fn batch(&mut self, yes: bool) {
        self.batch = yes;
    }

    /// Whether the peer takes whole requests and responses between the pieces of a longer
    /// message (it says so in its [`Hello`](crate::proto::Hello); every session takes them).
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
            consider(s.deadline, matches!(s.state, Serving::Running | Serving::Queued(_)));
            if let (Some(t), Serving::Lent(_)) = (self.lent_timeout, &s.state) {
                // Not seen by `handle_timeout` yet: due at once, to be stamped.
                consider(Some(s.lent_at.map_or_else(Instant::now, |at| at + t)), true);
            }
        }
        if !any {
            self.deadlines.store(false, Ordering::Relaxed);
        }
        earliest
    }

    // ------------------------------------------------------------------ client side

    /// Starts a call. `landing` is a registered buffer for a large response, if the caller
    /// expects one; `budget` a deadline relative to `now` (which is read only to place that
    /// deadline: without a budget any instant will do).
    ///
    /// # Errors
    /// [`RpcError::PayloadTooLarge`]; [`RpcError::ConnectionLost`] after the connection died.
    /// On error the caller still owns the buffers it passed.
    pub fn start_call(
        &mut self,
        method: u32,
        payload: Payload,
        landing: Option<(RemoteRegion, BufId)>,
        budget: Option<Duration>,
        now: Instant,
    ) -> Result<u32, RpcError> {
        // Before the loss: after the peer's Close the connection is lost too, and the caller
        // must learn that this call was not run (and may be retried elsewhere).
        if self.is_going_away() {
            return Err(RpcError::ShuttingDown);
        }
        if let Some(why) = &self.lost {
            return Err(RpcError::ConnectionLost(why.clone()));
        }
        let (len, eager) = match &payload {
            Payload::Eager(b) => (b.len() as u64, b.len() as u64),
            Payload::Lent { desc, .. } => (desc.len, 0),
            Payload::Placed { len, .. } => (*len as u64, *len as u64),
        };
        if len > self.cfg.max_payload {
            return Err(RpcError::PayloadTooLarge {
                len,
                max: self.cfg.max_payload,
            });
        }
        if let Payload::Eager(b) = &payload {
            if b.len() > self.cfg.eager_max {
                return Err(RpcError::Protocol(format!(
                    "eager payload of {} bytes above eager_max {}",
                    b.len(),
                    self.cfg.eager_max
                )));
            }
        }
        if let Payload::Placed { len, .. } = payload {
            self.check_placed(len)?;
            if landing.is_some() {
                return Err(RpcError::Protocol(
                    "a payload sent from its buffer cannot carry a landing descriptor".into(),
                ));
            }
        }
        let call = self.fresh_call_id();
        let mut flags = 0;
        let mut body = Vec::new();
        if let Some((d, _)) = &landing {
            flags |= FLAG_LANDING;
            body.reserve(DESC_LEN * 2);
            encode_desc(d, &mut body);
        }
        let lent = match &payload {
            Payload::Lent { desc, buf } => {
                flags |= FLAG_RENDEZVOUS;
                encode_desc(desc, &mut body);
                Some(*buf)
            }
            _ => None,
        };
        // A budget the wire cannot carry (u32 microseconds: about 71 minutes) stays the caller's
        // alone: the server gets none, rather than a shorter one that would cut the call short.
        let budget_us = budget
            .and_then(|b| u32::try_from(b.as_micros()).ok())
            .map_or(0, |us| us.max(1));
        let header = Header {
            kind: Kind::Request,
            flags,
            call_id: call,
            method,
            status: 0,
            credits: 0,
            body_len: 0,
            budget_us,
        };
        let out = match payload {
            Payload::Placed { buf, len } => Out::Placed { header, buf, len },
            // The payload is the body as it stands: moved, not copied.
            Payload::Eager(b) if body.is_empty() => Out::Msg { header, body: b },
            Payload::Eager(b) => {
                body.extend_from_slice(&b);
                Out::Msg { header, body }
            }
            Payload::Lent { .. } => Out::Msg { header, body },
        };
        // Beyond what the peer serves at once, or behind calls that wait: the call waits too.
        let sent = self.held_back.is_empty() && self.calls.len() < self.call_limit && self.call_bytes_fit(eager);
        if sent {
            self.call_bytes += eager;
            self.push_out(out);
        } else {
            self.held_back.push_back(out);
        }
        // Past what an `Instant` can hold (`Duration::MAX`, say): never.
        let deadline = budget.and_then(|b| now.checked_add(b));
        if deadline.is_some() {
            self.deadlines.store(true, Ordering::Relaxed);
        }
        self.calls.insert(
            call,
            ClientCall {
                method,
                deadline,
                lent,
                landing: landing.map(|(_, b)| b),
                in_slot: false,
                live: true,
                bytes: eager,
                counted: sent,
            },
        );
        Ok(call)
    }

    /// Whether a payload of `len` bytes may go as [`Payload::Placed`]: within the eager threshold
    /// and one piece.
    pub fn fits_placed(&self, len: usize) -> bool {
        len <= self.cfg.eager_max && len <= self.cfg.piece()
    }

    /// How a payload of `len` bytes already in a registered buffer of the connection goes
    /// without a copy: lent when above the threshold or longer than one piece (lending costs no
    /// copy, whatever the threshold), sent from the buffer otherwise, unless a landing
    /// descriptor must go in front of it (`with_landing`), which leaves only a copy.
    pub fn registered_route(&self, len: usize, with_landing: bool) -> Route {
        if self.is_rendezvous(len) || !self.fits_placed(len) {
            Route::Lend
        } else if with_landing {
            Route::Copy
        } else {
            Route::Place
        }
    }

    fn check_placed(&self, len: usize) -> Result<(), RpcError> {
        if self.fits_placed(len) {
            return Ok(());
        }
        Err(RpcError::Protocol(format!(
            "a payload of {len} bytes cannot be sent from its buffer in one message (eager_max {}, piece {})",
            self.cfg.eager_max,
            self.cfg.piece()
        )))
    }

    fn fresh_call_id(&mut self) -> u32 {
        loop {
            let id = self.next_call;
            self.next_call = self.next_call.wrapping_add(1).max(1);
            if !self.calls.contains_key(id) {
                return id;
            }
        }
    }

    /// The caller gave up on `call` (its future was dropped). The server is told; the call's
    /// buffers stay lent until the server's last word on it.
    pub fn cancel(&mut self, call: u32) {
        if let Some(c) = self.calls.get_mut(call) {
            if c.live {
                c.live = false;
                if !self.withdraw(call) {
                    self.queue_small(Kind::Cancel, call, 0, Vec::new());
                }
            }
        }
    }

    /// Takes `call` (no longer live) out of the calls waiting to be sent, if it is one, and
    /// finishes it there: nothing of it reached the peer.
    fn withdraw(&mut self, call: u32) -> bool {
        if self.held_back.is_empty() {
            return false;
        }
        let Some(i) = self.held_back.iter().position(|o| o.call() == Some(call)) else {
            return false;
        };
        if let Some(Out::Placed { buf, .. }) = self.held_back.remove(i) {
            self.actions.push_back(Transmit::Release(buf));
        }
        self.finish_call(call, Err(RpcError::Cancelled));
        true
    }

    /// The calls waiting to be sent fail with `e` (the peer's GoAway: they were never sent).
    #[cold]
    fn fail_held_back(&mut self, e: &RpcError) {
        while let Some(out) = self.held_back.pop_front() {
            if let Out::Placed { buf, .. } = out {
                self.actions.push_back(Transmit::Release(buf));
            }
            if let Some(call) = out.call() {
                self.finish_call(call, Err(e.clone()));
            }
        }
    }

    fn finish_call(&mut self, call: u32, result: Result<Reply, RpcError>) {
        let Some(c) = self.calls.remove(call) else { return };
        if c.counted {
            self.call_bytes -= c.bytes;
        }
        if !self.held_back.is_empty() {
            self.send_held_back();
        }
        if let Some(b) = c.lent {
            self.actions.push_back(Transmit::Release(b));
        }
        let landed = matches!(result, Ok(Reply::Landed { .. }));
        if let Some(b) = c.landing {
            if !(landed && c.live) {
                self.actions.push_back(Transmit::Release(b));
            }
        }
        if c.live {
            self.events.push_back(Event::CallDone { call, result });
        }
    }

    /// Sends the calls waiting for the peer, as far as its limit allows.
    fn send_held_back(&mut self) {
        if self.lost.is_some() || self.theirs != Shutdown::None {
            return;
        }
        while self.calls.len() - self.held_back.len() < self.call_limit {
            let Some(front) = self.held_back.front() else {
                break;
            };
            let n = front.call().and_then(|id| self.calls.get(id)).map_or(0, |c| c.bytes);
            if !self.call_bytes_fit(n) {
                break;
            }
            let Some(out) = self.held_back.pop_front() else {
                break;
            };
            if let Some(c) = out.call().and_then(|id| self.calls.get_mut(id)) {
                c.counted = true;
                self.call_bytes += n;
            }
            self.queue.push_back(out);
        }
    }

    fn handle_response(&mut self, h: &Header, body: Cow<'_, [u8]>) -> Result<(), ProtoError> {
        let call = h.call_id;
        let Some(c) = self.calls.get(call) else {
            return Err(ProtoError::UnknownCall(call));
        };
        if h.flags & FLAG_RENDEZVOUS != 0 {
            let (desc, _) = decode_desc(&body)?;
            if desc.len > self.cfg.max_payload {
                return Err(ProtoError::TooLarge(desc.len));
            }
            if c.live {
                // A server answers only once it has the request (it reads a lent one before
                // anything else happens to the call): the request's buffer is free already,
                // before the response's is taken (a large vector goes back to the allocator
                // in time to be reused for the response).
                if let Some(b) = self.calls.get_mut(call).and_then(|c| c.lent.take()) {
                    self.actions.push_back(Transmit::Release(b));
                }
                self.actions.push_back(Transmit::Read {
                    token: Token::Response(call),
                    remote: desc,
                });
            } else {
                self.queue_small(Kind::ReadDone, call, 0, Vec::new());
                self.finish_call(call, Err(RpcError::Cancelled));
            }
            return Ok(());
        }
        let result = match Status::from_u16(h.status) {
            Status::Ok => Ok(match (body, c.in_slot && c.live) {
                (Cow::Borrowed(b), true) if self.offer.is_some() => Reply::InSlot {
                    slot: self.offer.take().unwrap_or_default(),
                    range: HEADER_LEN..HEADER_LEN + b.len(),
                },
                // A short one by value for a caller that takes a `Body`; a `Vec` for the others.
                (body, in_slot) => match in_slot.then(|| Inline::new(&body)).flatten() {
                    Some(small) => Reply::Inline(small),
                    None => Reply::Bytes(body.into_owned()),
                },
            }),
            s => Err(RpcError::from_wire(s, c.method, &body)),
        };
        self.finish_call(call, result);
        Ok(())
    }

    // ------------------------------------------------------------------ server side

    fn handle_request(&mut self, h: &Header, body: Cow<'_, [u8]>, now: Instant) -> Result<(), ProtoError> {
        let call = h.call_id;
        if self.ours == Shutdown::Closed {
            // Sent before the caller saw our Close, which tells it this call was not run.
            return Ok(());
        }
        if self.served.contains_key(call) {
            return Err(ProtoError::DuplicateCall(call));
        }
        if self.active >= self.serve_limit {
            // Refused before anything of it is kept: the caller learns that it was not run.
            self.queue_small(
                Kind::Response,
                call,
                Status::Overloaded as u16,
                self.serve_limit.to_string().into_bytes(),
            );
            return Ok(());
        }
        let (landing, skip) = if h.flags & FLAG_LANDING != 0 {
            (Some(decode_desc(&body)?.0), DESC_LEN)
        } else {
            (None, 0)
        };
        let rest = &body[skip..];
        let budget = (h.budget_us > 0).then(|| Duration::from_micros(u64::from(h.budget_us)));
        let deadline = budget.map(|b| now + b);
        if deadline.is_some() {
            self.deadlines.store(true, Ordering::Relaxed);
        }
        let mut sc = ServerCall {
            method: h.method,
            deadline,
            landing,
            state: Serving::Running,
            cancelled: false,
            bytes: 0,
            counts: true,
            lent_at: None,
        };
        if h.flags & FLAG_RENDEZVOUS != 0 {
            let (desc, _) = decode_desc(rest)?;
            if desc.len > self.cfg.max_payload {
                self.reply_error(
                    call,
                    &RpcError::PayloadTooLarge {
                        len: desc.len,
                        max: self.cfg.max_payload,
                    },
                );
                return Ok(());
            }
            self.active += 1;
            if self.deferred.is_empty() && self.bytes_fit(desc.len) {
                self.held_bytes += desc.len;
                self.reading_bytes += desc.len;
                sc.bytes = desc.len;
                sc.state = Serving::Reading;
                self.served.insert(call, sc);
                self.actions.push_back(Transmit::Read {
                    token: Token::Request(call),
                    remote: desc,
                });
            } else {
                sc.state = Serving::Queued(desc);
                self.served.insert(call, sc);
                self.deferred.push_back(call);
            }
            return Ok(());
        }
        self.active += 1;
        self.served.insert(call, sc);
        let payload = match body {
            Cow::Borrowed(b) if self.offer.is_some() && self.in_slot_methods.contains(&h.method) => {
                RequestBody::InSlot {
                    slot: self.offer.take().unwrap_or_default(),
                    range: HEADER_LEN + skip..HEADER_LEN + b.len(),
                }
            }
            Cow::Borrowed(b) => {
                let body = &b[skip..];
                match Inline::new(body) {
                    Some(small) => RequestBody::Inline(small),
                    None => RequestBody::Bytes(body.to_vec()),
                }
            }
            Cow::Owned(mut v) => {
                v.drain(..skip);
                RequestBody::Bytes(v)
            }
        };
        self.events.push_back(Event::Request {
            call,
            method: h.method,
            payload,
            budget,
        });
        Ok(())
    }

    /// Whether a rendezvous body of `len` bytes may be read now: within the bytes held and the
    /// bytes being read, or alone in each.
    fn bytes_fit(&self, len: u64) -> bool {
        let held = self.held_bytes == 0 || self.held_bytes.saturating_add(len) <= self.byte_limit;
        let read = self.reading_bytes == 0 || self.reading_bytes.saturating_add(len) <= self.read_limit;
        held && read
    }

    /// A request's body is no longer being read (`bytes` of it): those waiting may be.
    fn read_ended(&mut self, bytes: u64) {
        self.reading_bytes = self.reading_bytes.saturating_sub(bytes);
        self.read_deferred();
    }

    /// Served request `call` is done with (its answer left, or it was dropped): it no longer
    /// counts against the limits, and requests waiting for bytes may be read.
    #[inline]
    fn unserve(&mut self, call: u32) {
        let Some(sc) = self.served.remove(call) else { return };
        if sc.counts {
            self.active = self.active.saturating_sub(1);
        }
        self.release(call, sc.state, sc.bytes);
    }

    /// Served request `call` is answered: its request bytes are free now, but it counts against
    /// the request limit until `next` is done (the answer left the queue, was read or was
    /// written).
    fn answered(&mut self, call: u32, next: Serving) {
        let Some(sc) = self.served.get_mut(call) else { return };
        let state = std::mem::replace(&mut sc.state, next);
        let bytes = std::mem::take(&mut sc.bytes);
        self.release(call, state, bytes);
    }

    /// What a served request in `state` held (`bytes` of request body) goes back.
    fn release(&mut self, call: u32, state: Serving, bytes: u64) {
        if matches!(state, Serving::Reading) {
            self.reading_bytes = self.reading_bytes.saturating_sub(bytes);
        }
        if state.holds_request() && bytes > 0 {
            self.held_bytes = self.held_bytes.saturating_sub(bytes);
            self.read_deferred();
        }
        if matches!(state, Serving::Queued(_)) {
            // It may have been the one that did not fit, holding back those behind it.
            self.deferred.retain(|&c| c != call);
            self.read_deferred();
        }
    }

    /// A message left (handed to the driver, or ready to be): an answer that waited in the
    /// queue no longer counts.
    fn left(&mut self, header: &Header) {
        if header.kind == Kind::Response
            && matches!(
                self.served.get(header.call_id).map(|s| &s.state),
                Some(Serving::Answered)
            )
        {
            self.unserve(header.call_id);
        }
    }

    /// Queues the answer to served request `call` (with its message `out`): done with at once
    /// when it can go at once (the common case: one lookup), else counted until it leaves.
    fn answer(&mut self, call: u32, out: Out) {
        if self.push_out(out) {
            self.unserve(call);
        } else {
            self.answered(call, Serving::Answered);
        }
    }

    /// Starts the Reads of requests that waited for bytes, in arrival order, as far as they fit.
    fn read_deferred(&mut self) {
        while let Some(&call) = self.deferred.front() {
            let Some(Serving::Queued(desc)) = self.served.get(call).map(|s| &s.state) else {
                self.deferred.pop_front();
                continue;
            };
            let desc = *desc;
            if !self.bytes_fit(desc.len) {
                break;
            }
            self.deferred.pop_front();
            self.held_bytes += desc.len;
            self.reading_bytes += desc.len;
            if let Some(sc) = self.served.get_mut(call) {
                sc.bytes = desc.len;
                sc.state = Serving::Reading;
            }
            self.actions.push_back(Transmit::Read {
                token: Token::Request(call),
                remote: desc,
            });
        }
    }

    /// The deadline of served request `call` on this side's clock (placed from its budget when
    /// it arrived), if its caller set one.
    pub fn served_deadline(&self, call: u32) -> Option<Instant> {
        self.served.get(call).and_then(|c| c.deadline)
    }

    /// Whether the body an RDMA Read fetches for `token` is for a handler that takes it in
    /// registered memory as it arrived ([`Session::serve_in_slot`]: it may keep that buffer,
    /// or answer from it); a driver may read any other into memory of the consumer's own.
    pub fn reads_in_place(&self, token: Token) -> bool {
        match token {
            Token::Request(call) => self
                .served
                .get(call)
                .is_some_and(|s| self.in_slot_methods.contains(&s.method)),
            Token::Response(_) => false,
        }
    }

    /// Whether a lent response of `len` bytes to `call` goes into the landing buffer the call
    /// advertised (by an RDMA Write of the lent buffer with its [`LANDING_PREFIX`]), rather
    /// than being read by the caller.
    pub fn lands(&self, call: u32, len: usize) -> bool {
        self.served
            .get(call)
            .and_then(|s| s.landing)
            .is_some_and(|l| l.len >= len as u64 + LANDING_PREFIX as u64)
    }

    /// Answers a request. Pass large responses as [`Payload::Lent`]: they are written into the
    /// caller's landing buffer when it advertised one big enough, and lent for the caller to
    /// read otherwise. A response to a call that was cancelled or timed out is dropped (a lent
    /// buffer is released at once).
    pub fn respond(&mut self, call: u32, result: Result<Payload, RpcError>) {
        let running = matches!(self.served.get(call).map(|s| &s.state), Some(Serving::Running));
        if !running {
            if let Ok(Payload::Lent { buf, .. } | Payload::Placed { buf, .. }) = result {
                self.actions.push_back(Transmit::Release(buf));
            }
            return;
        }
        match result {
            Ok(Payload::Placed { buf, len }) => match self.check_placed(len) {
                Ok(()) => {
                    let header = Header {
                        kind: Kind::Response,
                        flags: 0,
                        call_id: call,
                        method: 0,
                        status: Status::Ok as u16,
                        credits: 0,
                        body_len: 0,
                        budget_us: 0,
                    };
                    self.answer(call, Out::Placed { header, buf, len });
                }
                Err(e) => {
                    self.actions.push_back(Transmit::Release(buf));
                    self.reply_error(call, &RpcError::Internal(e.to_string()));
                }
            },
            Ok(Payload::Eager(bytes)) if bytes.len() <= self.cfg.eager_max => {
                self.answer_msg(call, 0, Status::Ok as u16, bytes);
            }
            Ok(Payload::Eager(bytes)) => {
                self.reply_error(
                    call,
                    &RpcError::Internal(format!("eager response of {} bytes above eager_max", bytes.len())),
                );
            }
            Ok(Payload::Lent { desc, buf }) => {
                if desc.len > self.cfg.max_payload {
                    self.actions.push_back(Transmit::Release(buf));
                    self.reply_error(
                        call,
                        &RpcError::PayloadTooLarge {
                            len: desc.len,
                            max: self.cfg.max_payload,
                        },
                    );
                    return;
                }
                let landing = self.served.get(call).and_then(|s| s.landing);
                if self.served.contains_key(call) {
                    // Answered: its request bytes are free; it counts until the answer is
                    // written, or read (ReadDone).
                    match landing.filter(|l| l.len >= desc.len + LANDING_PREFIX as u64) {
                        Some(remote) => {
                            self.answered(call, Serving::Writing(buf));
                            self.queue.push_back(Out::WriteImm {
                                buf,
                                len: desc.len as usize,
                                remote: RemoteRegion {
                                    len: desc.len,
                                    ..remote
                                },
                                imm: call,
                            });
                        }
                        None => {
                            self.answered(call, Serving::Lent(buf));
                            if self.lent_timeout.is_some() {
                                self.deadlines.store(true, Ordering::Relaxed);
                            }
                            let mut body = Vec::with_capacity(DESC_LEN);
                            encode_desc(&desc, &mut body);
                            self.queue_msg(Kind::Response, FLAG_RENDEZVOUS, call, Status::Ok as u16, body);
                        }
                    }
                }
            }
            Err(e) => self.reply_error(call, &e),
        }
    }

    fn reply_error(&mut self, call: u32, e: &RpcError) {
        let (status, msg) = e.to_wire();
        // A message longer than an eager payload is cut, at a character's boundary.
        let mut end = msg.len().min(self.cfg.eager_max.max(64));
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        let mut body = msg.into_bytes();
        body.truncate(end);
        self.answer_msg(call, 0, status as u16, body);
    }

    /// Queues a response message to `call`; a served request counts until it leaves.
    fn answer_msg(&mut self, call: u32, flags: u16, status: u16, body: Vec<u8>) {
        if self.queue_msg(Kind::Response, flags, call, status, body) {
            self.unserve(call);
        } else {
            self.answered(call, Serving::Answered);
        }
    }

    fn handle_cancel(&mut self, call: u32) {
        match self.served.get_mut(call).map(|s| &mut s.state) {
            Some(Serving::Running) => {
                self.events.push_back(Event::Abort { call });
                self.reply_error(call, &RpcError::Cancelled);
            }
            Some(Serving::Queued(_)) => self.reply_error(call, &RpcError::Cancelled),
            Some(Serving::Reading) => {
                if let Some(s) = self.served.get_mut(call) {
                    s.cancelled = true;
                }
            }
            // Lent / Writing: the caller still sends ReadDone or gets the Write; unknown: the
            // response crossed the Cancel.
            _ => {}
        }
    }

    fn handle_read_done_msg(&mut self, call: u32) -> Result<(), ProtoError> {
        match self.served.get(call).map(|s| &s.state) {
            Some(Serving::Lent(buf)) => {
                let buf = *buf;
                self.unserve(call);
                self.actions.push_back(Transmit::Release(buf));
                Ok(())
            }
            _ => Err(ProtoError::UnknownCall(call)),
        }
    }

    // ------------------------------------------------------------------ inputs from the driver

    /// Whether handling `msg` reads the `now` passed with it: only a request (or a piece of
    /// one) with a time budget does, to place its deadline. For any other message a driver
    /// whose clock is costly to read may pass any instant.
    pub fn needs_now(msg: &[u8]) -> bool {
        // A peek at two fields, not a second decode: this runs on every message. A batch may
        // hold a request with a budget after its first message.
        batch::has_more(msg) || Header::is_budgeted_request(msg).unwrap_or(true)
    }

    /// A message arrived in a receive slot. The driver reposts the slot when it likes (after
    /// sending what this message causes, say) and then calls [`Session::reposted`]: only then is
    /// the slot's credit returned to the peer, so the peer never sends into a slot not posted.
    ///
    /// # Errors
    /// [`ProtoError`] for bytes that are not a valid message or that break the protocol; the
    /// driver should then close the connection. Never panics.
    pub fn handle_message(&mut self, msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.handle_message_in(msg, None, now).map(|_| ())
    }

    /// As [`Session::handle_message`], offering the receive slot the message is in, named
    /// `slot`, to the application: a request for a method served in place
    /// ([`Session::serve_in_slot`]) or a response to a call that keeps its response in place
    /// ([`Session::keep_in_slot`]) then stays there ([`RequestBody::InSlot`], [`Reply::InSlot`]).
    /// Returns whether it did: the driver then keeps the slot out of the ring until the
    /// application lets go of it, and reposts it then (calling [`Session::reposted`]).
    /// Messages in pieces are always copied out.
    ///
    /// # Errors
    /// As [`Session::handle_message`] (the slot is not kept then).
    pub fn handle_message_in(&mut self, msg: &[u8], slot: Option<u64>, now: Instant) -> Result<bool, ProtoError> {
        self.handle_message_with_head(&[], msg, slot, now)
    }

    /// As [`Session::handle_message_in`], the header read from `head` when it holds one: a
    /// copy of the message's first bytes that came with its completion (the transport's
    /// `Completion::head`), which spares a read of the receive slot's first line.
    ///
    /// # Errors
    /// As [`Session::handle_message`].
    pub fn handle_message_with_head(
        &mut self,
        head: &[u8],
        msg: &[u8],
        slot: Option<u64>,
        now: Instant,
    ) -> Result<bool, ProtoError> {
        let first = if head.len() >= HEADER_LEN { head } else { msg };
        if batch::has_more(first) {
            // Copied out of its slot, part by part: the slot goes back at once.
            return self.handle_batch(head, msg, now).map(|()| false);
        }
        self.offer = slot;
        let r = self.handle_decoded(head, msg, now);
        let offered = std::mem::take(&mut self.offer).is_some();
        r.map(|()| slot.is_some() && !offered)
    }

    fn handle_decoded(&mut self, head: &[u8], msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        let (h, body) = Header::decode_with_head(head, msg)?;
        self.handle_part(&h, body, now)
    }

    /// A batch ([`batch`]): its messages one after another, for one slot's credit.
    fn handle_batch(&mut self, head: &[u8], msg: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        for part in batch::Parts::new(head, msg) {
            let (head, bytes) = part?;
            let (h, body) = Header::decode_with_head(head, bytes)?;
            self.handle_part(&h, body, now)?;
        }
        Ok(())
    }

    /// One message, decoded, its slot's credit counted.
    fn handle_part(&mut self, h: &Header, body: &[u8], now: Instant) -> Result<(), ProtoError> {
        self.credits.returned(h.credits).map_err(|()| ProtoError::Overrun)?;
        if h.flags & FLAG_FRAGMENT != 0 {
            // Joined into a vector of its own (`Cow::Owned`): never kept in a slot.
            return match self.join(h, body)? {
                Some((h, whole)) => self.dispatch(&h, Cow::Owned(whole), now),
                None => Ok(()),
            };
        }
        if let Some(j) = &self.joining {
            // Between the pieces of a message: credits, and whole requests and responses of
            // other calls ([`Session::interleave`]).
            let other = matches!(h.kind, Kind::Request | Kind::Response)
                && (h.kind, h.call_id) != (j.header.kind, j.header.call_id);
            if h.kind != Kind::Credit && !other {
                return Err(ProtoError::BadFragment("a message between the pieces of another"));
            }
        }
        self.dispatch(h, Cow::Borrowed(body), now)
    }

    /// Adds a piece to the message being joined; the header and whole body once complete.
    fn join(&mut self, h: &Header, body: &[u8]) -> Result<Option<(Header, Vec<u8>)>, ProtoError> {
        let (pre, piece) = body
            .split_first_chunk::<FRAG_PREFIX>()
            .ok_or(ProtoError::BadFragment("no prefix"))?;
        let total = u32::from_le_bytes([pre[0], pre[1], pre[2], pre[3]]) as usize;
        let off = u32::from_le_bytes([pre[4], pre[5], pre[6], pre[7]]) as usize;
        if piece.is_empty() || piece.len() > self.cfg.piece() {
            return Err(ProtoError::BadFragment("piece length"));
        }
        let j = match &mut self.joining {
            Some(j) => {
                if (j.header.kind, j.header.call_id, j.total) != (h.kind, h.call_id, total) || off != j.body.len() {
                    return Err(ProtoError::BadFragment(
                        "not the next piece of the message being joined",
                    ));
                }
                j
            }
            None => {
                if off != 0 || !matches!(h.kind, Kind::Request | Kind::Response) {
                    return Err(ProtoError::BadFragment("not the first piece of a request or response"));
                }
                if total <= self.cfg.piece() || total > self.cfg.body_max() {
                    return Err(ProtoError::BadFragment("message length"));
                }
                let header = Header {
                    flags: h.flags & !FLAG_FRAGMENT,
                    body_len: total as u32,
                    ..*h
                };
                // The length is within the configuration's maximum; the allocator may still
                // refuse it, which ends this connection rather than the process.
                let mut body = Vec::new();
                body.try_reserve_exact(total).map_err(|_| ProtoError::NoMemory(total))?;
                self.joining.insert(Joining { header, total, body })
            }
        };
        if j.body.len() + piece.len() > j.total {
            return Err(ProtoError::BadFragment("pieces longer than the message"));
        }
        j.body.extend_from_slice(piece);
        if j.body.len() < j.total {
            return Ok(None);
        }
        Ok(self.joining.take().map(|j| (j.header, j.body)))
    }

    fn dispatch(&mut self, h: &Header, body: Cow<'_, [u8]>, now: Instant) -> Result<(), ProtoError> {
        match h.kind {
            Kind::Request => self.handle_request(h, body, now),
            Kind::Response => self.handle_response(h, body),
            Kind::Cancel => {
                self.handle_cancel(h.call_id);
                Ok(())
            }
            Kind::ReadDone => self.handle_read_done_msg(h.call_id),
            Kind::Credit => Ok(()),
            Kind::GoAway => {
                self.theirs = self.theirs.max(Shutdown::GoingAway);
                // Never sent, so never run: safe to retry elsewhere.
                self.fail_held_back(&RpcError::ShuttingDown);
                Ok(())
            }
            Kind::Close => {
                self.handle_close();
                Ok(())
            }
        }
    }

    /// A receive slot consumed by a message (or a Write-with-immediate) is posted again: its
    /// credit goes back to the peer with our next message.
    pub fn reposted(&mut self) {
        self.credits.reposted();
    }

    /// An RDMA Write-with-immediate landed `len` bytes for call `imm` (consuming a receive slot,
    /// which the driver reposts and reports with [`Session::reposted`]).
    ///
    /// # Errors
    /// [`ProtoError::UnknownCall`] when no call of ours advertised a landing buffer under `imm`.
    pub fn handle_write_imm(&mut self, imm: u32, len: usize) -> Result<(), ProtoError> {
        let _ = len; // the length travels in the landing buffer's prefix
        self.credits.received().map_err(|()| ProtoError::NoCredit)?;
        match self.calls.get(imm) {
            Some(c) if c.landing.is_some() => {
                let buf = c.landing.unwrap_or_default();
                self.finish_call(imm, Ok(Reply::Landed { buf }));
                Ok(())
            }
            _ => Err(ProtoError::UnknownCall(imm)),
        }
    }

    /// A [`Transmit::Read`] finished with these bytes (or failed).
    pub fn handle_read_done(&mut self, token: Token, result: Result<Vec<u8>, RpcError>, now: Instant) {
        match token {
            Token::Response(call) => {
                if !self.calls.contains_key(call) {
                    return;
                }
                self.queue_small(Kind::ReadDone, call, 0, Vec::new());
                self.finish_call(call, result.map(Reply::Bytes));
            }
            Token::Request(call) => self.request_fetched(call, result.map(RequestBody::Bytes), now),
        }
    }

    /// As [`Session::handle_read_done`] for a [`Token::Request`] read, when the driver keeps the
    /// request in held buffer `buf` (read into from its start, `len` bytes) to hand it to the
    /// application without a copy. When no handler will run (cancelled, or the call is gone),
    /// the buffer comes back as a [`Transmit::Release`].
    pub fn handle_request_read(&mut self, call: u32, result: Result<(BufId, usize), RpcError>, now: Instant) {
        let buf = result.as_ref().ok().map(|&(b, _)| b);
        let runs = self.served.get(call).is_some_and(|s| !s.cancelled);
        if !runs || result.is_err() {
            if let Some(b) = buf {
                self.actions.push_back(Transmit::Release(b));
            }
        }
        self.request_fetched(call, result.map(|(buf, len)| RequestBody::Held { buf, len }), now);
    }

    fn request_fetched(&mut self, call: u32, result: Result<RequestBody, RpcError>, now: Instant) {
        let Some(sc) = self.served.get_mut(call) else { return };
        let (cancelled, method) = (sc.cancelled, sc.method);
        let was_read = std::mem::replace(&mut sc.state, Serving::Running);
        if matches!(was_read, Serving::Reading) {
            let bytes = sc.bytes;
            self.read_ended(bytes);
        }
        match result {
            _ if cancelled => self.reply_error(call, &RpcError::Cancelled),
            Err(e) => self.reply_error(call, &RpcError::Internal(format!("fetching the request: {e}"))),
            Ok(payload) => {
                let budget = self
                    .served
                    .get(call)
                    .and_then(|s| s.deadline)
                    .map(|d| d.saturating_duration_since(now));
                self.events.push_back(Event::Request {
                    call,
                    method,
                    payload,
                    budget,
                });
            }
        }
    }

    /// A [`Transmit::WriteImm`] finished.
    pub fn handle_write_done(&mut self, buf: BufId) {
        let call = self
            .served
            .iter()
            .find(|(_, s)| matches!(s.state, Serving::Writing(b) if b == buf))
            .map(|(c, _)| c);
        if let Some(call) = call {
            self.unserve(call);
        }
        self.actions.push_back(Transmit::Release(buf));
    }

    /// Deadlines up to `now` pass: the caller's calls fail, the server's handlers are aborted.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<u32> = self
            .calls
            .iter()
            .filter(|(_, c)| c.live && c.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| id)
            .collect();
        for call in expired {
            if let Some(c) = self.calls.get_mut(call) {
                c.live = false;
            }
            self.events.push_back(Event::CallDone {
                call,
                result: Err(RpcError::DeadlineExceeded),
            });
            if !self.withdraw(call) {
                self.queue_small(Kind::Cancel, call, 0, Vec::new());
            }
        }
        let late: Vec<(u32, bool)> = self
            .served
            .iter()
            .filter(|(_, s)| matches!(s.state, Serving::Running | Serving::Queued(_)))
            .filter(|(_, s)| s.deadline.is_some_and(|d| d <= now))
            .map(|(id, s)| (id, matches!(s.state, Serving::Running)))
            .collect();
        for (call, running) in late {
            if running {
                self.events.push_back(Event::Abort { call });
            }
            self.reply_error(call, &RpcError::DeadlineExceeded);
        }
        if let Some(t) = self.lent_timeout {
            let lent: Vec<(u32, Option<Instant>)> = self
                .served
                .iter()
                .filter(|(_, s)| matches!(s.state, Serving::Lent(_)))
                .map(|(id, s)| (id, s.lent_at))
                .collect();
            for (call, at) in lent {
                match at {
                    None => {
                        if let Some(s) = self.served.get_mut(call) {
                            s.lent_at = Some(now);
                        }
                    }
                    Some(at) if at + t <= now => {
                        self.handle_connection_lost(&format!(
                            "the peer did not read its answer to call {call} within {t:?} (Config::lent_answer_timeout)"
                        ));
                        return;
                    }
                    Some(_) => {}
                }
            }
        }
    }

    /// Starts a graceful shutdown of this side (a server's): the peer is told to start no new
    /// calls (GoAway); requests it sent before it learnt that are still served; once nothing is
    /// left to serve, [`Session::poll_transmit`] gives the last message, Close, which tells the
    /// peer that its calls still pending were not run. After Close the session serves and sends
    /// nothing more: the driver closes the connection once Close's Send is complete
    /// ([`Session::is_closed`]). Calls of this side's own fail with
    /// [`RpcError::ShuttingDown`] from now on.
    pub fn go_away(&mut self) {
        if self.ours != Shutdown::None || self.lost.is_some() {
            return;
        }
        self.ours = Shutdown::GoingAway;
        self.queue_small(Kind::GoAway, 0, 0, Vec::new());
    }

    /// True once this side sent Close ([`Session::go_away`]): the connection may close as soon
    /// as that Send is complete.
    pub fn is_closed(&self) -> bool {
        self.ours == Shutdown::Closed
    }

    /// True once this side started its shutdown, or the peer told it of its own: no new calls.
    pub fn is_going_away(&self) -> bool {
        self.ours != Shutdown::None || self.theirs != Shutdown::None
    }

    /// Close is due: GoAway went out, and nothing is left to serve or to send.
    fn close_due(&self) -> bool {
        self.ours == Shutdown::GoingAway
            && self.lost.is_none()
            && self.served.len() == 0
            && self.queue.is_empty()
            && self.ready.is_none()
            && self.credits.available() >= 1
    }

    /// The last message, Close: it may take the credit held back for Credit messages, as
    /// nothing follows it.
    #[cold]
    fn close(&mut self) -> Option<Transmit> {
        let credits = self.credits.spend()?;
        self.ours = Shutdown::Closed;
        Some(Transmit::Send(encode(
            Header::control(Kind::Close),
            credits,
            Vec::new(),
        )))
    }

    /// The peer's Close: the calls still pending were never run there. They fail with
    /// [`RpcError::ShuttingDown`]; then the connection is over.
    #[cold]
    fn handle_close(&mut self) {
        self.theirs = Shutdown::Closed;
        let calls: Vec<u32> = self.calls.iter().map(|(id, _)| id).collect();
        for call in calls {
            self.finish_call(call, Err(RpcError::ShuttingDown));
        }
        self.handle_connection_lost("the peer shut the connection down (Close)");
    }

    /// Why the connection was declared lost, once it was (the peer's Close included).
    pub fn lost_reason(&self) -> Option<&str> {
        self.lost.as_deref()
    }

    /// The connection is gone (QP error, peer dead): every pending call fails now, every
    /// handler is aborted, every lent buffer is released (no peer can reach it any more).
    pub fn handle_connection_lost(&mut self, why: &str) {
        if self.lost.is_some() {
            return;
        }
        self.lost = Some(why.to_owned());
        for out in self.queue.drain(..) {
            // Never sent: the driver has it back now.
            if let Out::Placed { buf, .. } = out {
                self.actions.push_back(Transmit::Release(buf));
            }
        }
        if let Some(Transmit::SendPlaced { buf, .. }) = self.ready.take() {
            self.actions.push_back(Transmit::Release(buf));
        }
        if !self.held_back.is_empty() {
            // Known not to have run: said so, for callers that retry only such calls.
            let e = RpcError::ConnectionLost(format!("{why} (this call was never sent, so it did not run)"));
            self.fail_held_back(&e);
        }
        self.joining = None;
        let calls: Vec<u32> = self.calls.iter().map(|(id, _)| id).collect();
        for call in calls {
            self.finish_call(call, Err(RpcError::ConnectionLost(why.to_owned())));
        }
        for (call, s) in self.served.drain() {
            match s.state {
                Serving::Running => self.events.push_back(Event::Abort { call }),
                Serving::Lent(b) | Serving::Writing(b) => self.actions.push_back(Transmit::Release(b)),
                Serving::Reading | Serving::Queued(_) | Serving::Answered => {}
            }
        }
        self.deferred.clear();
        self.active = 0;
        self.held_bytes = 0;
        self.reading_bytes = 0;
    }

    /// True once the connection was declared lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    // ------------------------------------------------------------------ outputs

    /// Queues `out`, or makes it `ready` when it may go at once: nothing queued, ready or
    /// pending before it, the connection open, a data credit free, and one piece long. What
    /// `poll_transmit` would do for it then is done here. True when it went `ready` (it has
    /// left, as far as the limits go: the caller settles what it answered).
    fn push_out(&mut self, out: Out) -> bool {
        let now = self.ready.is_none()
            && self.queue.is_empty()
            && self.actions.is_empty()
            && self.lost.is_none()
            && self.ours != Shutdown::Closed
            && self.credits.can_send_data();
        let one_piece = match &out {
            Out::Msg { body, .. } => body.len() <= self.cfg.piece(),
            Out::Placed { .. } => true,
            Out::Pieces { .. } | Out::WriteImm { .. } => false,
        };
        if !(now && one_piece) {
            self.queue.push_back(out);
            return false;
        }
        match (out, self.credits.spend()) {
            (Out::Msg { header, body }, Some(c)) => {
                self.ready = Some(Transmit::Send(encode(header, c, body)));
            }
            (Out::Placed { mut header, buf, len }, Some(c)) => {
                header.credits = c;
                header.body_len = len as u32;
                self.ready = Some(Transmit::SendPlaced {
                    head: header.to_bytes(),
                    buf,
                    len,
                });
            }
            // Not reached (`now` saw two credits, `one_piece` the kind): queued as before.
            (out, _) => {
                self.queue.push_back(out);
                return false;
            }
        }
        true
    }

    fn queue_small(&mut self, kind: Kind, call: u32, status: u16, body: Vec<u8>) {
        self.queue_msg(kind, 0, call, status, body);
    }

    /// Queues a message (see [`Session::push_out`]); true when it went at once.
    fn queue_msg(&mut self, kind: Kind, flags: u16, call: u32, status: u16, body: Vec<u8>) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.push_out(Out::Msg {
            header: Header {
                kind,
                flags,
                call_id: call,
                method: 0,
                status,
                credits: 0,
                body_len: 0,
                budget_us: 0,
            },
            body,
        })
    }

    /// False when [`Session::poll_transmit`] would give nothing now: a cheap look for drivers
    /// that poll often (true does not promise work: credits may still be short).
    pub fn has_transmit(&self) -> bool {
        self.ready.is_some()
            || !self.actions.is_empty()
            || (self.lost.is_none()
                && self.ours != Shutdown::Closed
                && ((!self.queue.is_empty() && self.credits.can_send_data())
                    || self.credits.credit_message_due()
                    || self.close_due()))
    }

    /// The next piece of work to post, if credits allow.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        // Made before anything now in `actions` or the queue (see `push_out`); with the short
        // messages queued behind it since, as one batch.
        if let Some(t) = self.ready.take() {
            return Some(match t {
                Transmit::Send(mut m) if self.batch && !self.queue.is_empty() => {
                    self.batch_behind(&mut m);
                    Transmit::Send(m)
                }
                t => t,
            });
        }
        if let Some(a) = self.actions.pop_front() {
            return Some(a);
        }
        if self.lost.is_some() || self.ours == Shutdown::Closed {
            return None;
        }
        if self.close_due() {
            return self.close();
        }
        if !self.queue.is_empty() && self.credits.can_send_data() {
            let piece = self.cfg.piece();
            if let Some(Out::Msg { header, body }) = self.queue.front_mut() {
                if body.len() > piece {
                    // Too long for one slot: from now on it leaves in pieces, one per poll.
                    let (header, body) = (*header, Arc::new(std::mem::take(body)));
                    self.queue[0] = Out::Pieces { header, body, sent: 0 };
                }
            }
            // Between two pieces, the first whole request or response queued behind them
            // (`interleave`), then a piece again.
            if self.interleave
                && matches!(self.queue.front(), Some(Out::Pieces { .. }))
                && !std::mem::take(&mut self.overtook)
            {
                // Never past a ReadDone: a caller sends it before the calls it makes after
                // the answer it read, and until it arrives that answer counts here.
                let behind = self
                    .queue
                    .iter()
                    .skip(1)
                    .take_while(|o| !o.is_read_done())
                    .position(|o| o.overtakes(piece));
                if let Some(out) = behind.and_then(|i| self.queue.remove(i + 1)) {
                    self.overtook = true;
                    return self.whole(out);
                }
            }
            if let Some(Out::Pieces { header, body, sent }) = self.queue.front_mut() {
                let credits = self.credits.spend()?;
                let (off, n) = (*sent, (body.len() - *sent).min(piece));
                let m = encode_piece(*header, credits, body, off, n);
                *sent += n;
                if *sent == body.len() {
                    let header = *header;
                    self.queue.pop_front();
                    self.left(&header);
                }
                return Some(Transmit::Send(m));
            }
            let out = self.queue.pop_front()?;
            return self.whole(out);
        }
        if self.credits.credit_message_due() {
            let credits = self.credits.spend()?;
            return Some(Transmit::Send(encode(
                Header::control(Kind::Credit),
                credits,
                Vec::new(),
            )));
        }
        None
    }

    /// `out`, taken from the queue, as what the driver posts (one piece: `poll_transmit` cut
    /// longer messages into pieces first), with its credit spent.
    fn whole(&mut self, out: Out) -> Option<Transmit> {
        match out {
            Out::Msg { header, body } => {
                let credits = self.credits.spend()?;
                self.left(&header);
                let mut m = encode(header, credits, body);
                if self.batch {
                    self.batch_behind(&mut m);
                }
                Some(Transmit::Send(m))
            }
            Out::Pieces { .. } => None,
            Out::WriteImm { buf, len, remote, imm } => {
                self.credits.spend_silent()?;
                // Its caller has the answer as soon as it lands, and may call again before
                // this side sees the Write complete: it counts no longer.
                if let Some(sc) = self.served.get_mut(imm).filter(|s| s.counts) {
                    sc.counts = false;
                    self.active = self.active.saturating_sub(1);
                }
                Some(Transmit::WriteImm { buf, len, remote, imm })
            }
            Out::Placed { mut header, buf, len } => {
                header.credits = self.credits.spend()?;
                self.left(&header);
                header.body_len = len as u32;
                Some(Transmit::SendPlaced {
                    head: header.to_bytes(),
                    buf,
                    len,
                })
            }
        }
    }

    /// Adds to `m` (short, just taken from the queue with its credit spent) the short whole
    /// messages queued right behind it, as one batch ([`batch`]) that fits a receive slot.
    fn batch_behind(&mut self, m: &mut Message) {
        if m.len() > batch::PART_MAX {
            return;
        }
        let room = self.cfg.slot_size();
        let mut len = m.len();
        while m.parts() < batch::PARTS_MAX {
            let Some(Out::Msg { body, .. }) = self.queue.front() else {
                break;
            };
            let part = HEADER_LEN + body.len();
            if part > batch::PART_MAX || len + part > room {
                break;
            }
            let Some(Out::Msg { mut header, body }) = self.queue.pop_front() else {
                break;
            };
            self.left(&header);
            // The first message returns the credits of the whole Send.
            header.credits = 0;
            header.body_len = body.len() as u32;
            match m.more.last_mut() {
                Some((h, _)) => batch::mark_more(h),
                None => batch::mark_more(&mut m.head),
            }
            m.more.push((header.to_bytes(), body));
            len += part;
        }
    }

    /// Whether [`Session::poll_event`] has an event to give: a driver that answers requests
    /// as it takes them may hold the answers back until the last one, and send them together.
    pub fn has_event(&self) -> bool {
        !self.events.is_empty()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}

fn encode(mut h: Header, credits: u16, body: Vec<u8>) -> Message {
    h.credits = credits;
    h.body_len = body.len() as u32;
    Message {
        head: h.to_bytes(),
        frag: None,
        body: Bytes::Own(body),
        more: Vec::new(),
    }
}

/// The piece `[off, off + n)` of a long message's body, as a fragment.
fn encode_piece(mut h: Header, credits: u16, body: &Arc<Vec<u8>>, off: usize, n: usize) -> Message {
    h.credits = credits;
    h.flags |= FLAG_FRAGMENT;
    h.body_len = (FRAG_PREFIX + n) as u32;
    let mut frag = [0u8; FRAG_PREFIX];
    frag[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    frag[4..].copy_from_slice(&(off as u32).to_le_bytes());
    Message {
        head: h.to_bytes(),
        frag: Some(frag),
        body: Bytes::Piece(body.clone(), off..off + n),
        more: Vec::new(),
    }
}
