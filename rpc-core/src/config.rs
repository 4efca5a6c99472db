//! Configuration of clients and servers.

use std::time::Duration;

/// How a connection's driver waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionMode {
    /// Poll the CQ in a loop (yielding to tokio between polls): lowest latency, one busy core.
    Spin,
    /// Arm the CQ and sleep until the completion channel fires: no CPU while idle.
    Event,
    /// Spin for a bounded budget after the last activity, then sleep as `Event`.
    ///
    /// Keep the budget above what waking a sleeping thread costs on the host. With less, a
    /// client and a server can fall into a rhythm in which each goes to sleep just before the
    /// other's message arrives, and every call then pays two wake-ups. On KVM guests whose idle
    /// vCPUs halt at once (`guest_halt_poll_ns` 0) a wake-up takes tens of microseconds, so a
    /// budget much below the default risks that rhythm there (`docs/guide.md`, "Completion modes").
    ///
    /// On the shm provider a poller stops spinning at once when the peer's poller runs on its
    /// own core ([`peer_shares_cpu`](crate::transport::QueuePair::peer_shares_cpu)):
    /// spinning there only keeps the peer from answering, and a call would take two whole
    /// budgets. A server's connection first moves its thread to another CPU the thread
    /// may run on ([`leave_peer_cpu`](crate::transport::QueuePair::leave_peer_cpu); the
    /// thread's affinity mask is the same afterwards, and a thread pinned to one CPU stays),
    /// at most once per 10 ms, and both ends then spin apart, instead of taking turns on one
    /// core while another idles. `Spin` always spins.
    ///
    /// On every provider a call or a server connection whose peer was last driven by the very
    /// thread it runs on (a client and its server on one current-thread runtime, as in a
    /// `#[tokio::test]`) does not spin either: the peer cannot answer until it gives the thread
    /// up. The two sides of a connection made within one process find each other in the
    /// handshake; each notes which thread drove it last.
    Adaptive {
        /// How long to keep spinning after the last completion or command. The clock starts
        /// at the end of the first round of polls that found nothing (256 by a waiting call,
        /// 64 by the connection's driver), so that a connection busy enough to find something
        /// every round reads no clock: a waiter spins at most one round longer than this.
        /// Zero never spins (as `Event`).
        spin: Duration,
    },
}

impl CompletionMode {
    /// The default budget of [`CompletionMode::Adaptive`]: 200 microseconds, the window Linux itself
    /// polls an idle vCPU for before halting it (`guest_halt_poll_ns`), for the same trade
    /// between the CPU spent waiting and a wake-up's cost.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
}

impl Default for CompletionMode {
    fn default() -> Self {
        CompletionMode::Adaptive {
            spin: Self::DEFAULT_SPIN,
        }
    }
}

/// How long a peer can reach the buffers this side lends it for rendezvous.
///
/// Every connection has its own protection domain, so in both modes an rkey of one connection
/// is worthless on every other. The modes differ within a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Isolation {
    /// Rendezvous buffers are pooled per connection and reused: a peer that kept an old
    /// descriptor can still reach that buffer (its own connection's, possibly holding a later
    /// transfer of the same connection). No registration on the hot path once warm.
    #[default]
    Connection,
    /// Each rendezvous transfer gets its own registration, deregistered when the transfer ends:
    /// a descriptor is worthless once its transfer is over (the peer gets a remote access error).
    /// Costs a registration per large transfer, on both providers; memory windows would do it
    /// without re-registering and are not used yet.
    Transfer,
}

/// Settings of a [`Client`](crate::Client) or [`Server`](crate::Server). Both ends exchange
/// theirs when connecting and use the smaller threshold and payload limit.
///
/// Made by [`Config::default`] and the builder methods named after the fields (the fields are
/// public to read; new ones may come, so it is not built as a struct literal outside this
/// crate).
///
/// # Examples
/// ```
/// let cfg = rdma_rpc_core::Config::default().eager_threshold(4096).ring(32);
/// assert_eq!((cfg.ring, cfg.eager_threshold), (32, Some(4096)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Receive slots each side keeps posted (the credit window): how many messages the peer
    /// may send before it waits for credits. A deep ring absorbs bursts of calls; each slot it
    /// cycles through is memory the CPUs' caches must hold, so on `shm` a shallower ring can
    /// be quicker for bodies left in their slots (measure with the latency benchmark's
    /// `--raw-ring`). Each slot is one piece of 32 KiB and its header, on each side. Within
    /// [`Config::RING_RANGE`] (2..=4096); the two sides of a connection use the smaller of
    /// their rings.
    pub ring: u32,
    /// Payloads up to this size travel inside Sends (one per
    /// [`FRAGMENT`](crate::proto::FRAGMENT) bytes: receive slots stay that small whatever the
    /// threshold); larger ones by rendezvous (RDMA Read of a lent buffer, or
    /// Write-with-immediate into a landing buffer). `None`, the default, takes the provider's
    /// measured switch point, [`DeviceCaps::eager_hint`](rdma_rpc_transport::DeviceCaps):
    /// 16 KiB on verbs, 128 MiB on shm, 128 KiB on tcp. Registered buffers
    /// ([`Client::call_buf`](crate::Client::call_buf)) longer than one piece are lent whatever
    /// the threshold: lending them costs no copy.
    pub eager_threshold: Option<usize>,
    /// Largest request or response accepted.
    pub max_payload: u64,
    /// How completions are waited for.
    pub mode: CompletionMode,
    /// Limit for connection set-up (more than zero).
    pub connect_timeout: Duration,
    /// How long a peer can reach lent buffers.
    pub isolation: Isolation,
    /// Server side: requests of one connection served at once (received and not answered
    /// yet), at least 1. The server tells its clients when they connect, and a
    /// [`Client`](crate::Client) keeps further calls waiting, unsent, until earlier ones are
    /// answered; a peer that sends more anyway gets [`RpcError::Overloaded`](crate::RpcError)
    /// for them, unrun. With the handlers' tasks and request bodies, this bounds what one
    /// connection can make the server hold: at most this many eager requests (each within the
    /// eager threshold).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Client, Config, Server};
    /// let dev = Device::open("tcp")?;
    /// // A server that runs one request of a connection at a time...
    /// let one_at_a_time = Config::default().max_concurrent_requests(1);
    /// let server = Server::builder(one_at_a_time)
    ///     .handler(1, |req: Vec<u8>| async move { Ok(req) })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// // ...still answers every call of a client that makes four at once: three wait their
    /// // turn in the client, none is refused.
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// let (a, b, c, d) = tokio::join!(
    ///     client.call(1, vec![0]),
    ///     client.call(1, vec![1]),
    ///     client.call(1, vec![2]),
    ///     client.call(1, vec![3]),
    /// );
    /// assert_eq!((a?, b?, c?, d?), (vec![0], vec![1], vec![2], vec![3]));
    /// # Ok(())
    /// # }
    /// ```
    pub max_concurrent_requests: u32,
    /// Server side: bytes of request bodies one connection may have the server read and hold
    /// at once, at least 1. A rendezvous request whose body would go beyond waits, unread (its
    /// bytes stay in the caller's memory, and its deadline runs), until earlier ones are
    /// answered. The server tells its clients when they connect, and a
    /// [`Client`](crate::Client) holds an eager request that would go beyond back, unsent,
    /// likewise (the server cannot leave a Send's bytes unread). One alone always goes, so a
    /// request up to [`max_payload`](Config::max_payload) is served whatever this limit. Of
    /// these bytes, [`max_request_bytes_reading`](Config::max_request_bytes_reading) bounds
    /// those being read at once.
    pub max_request_bytes_in_flight: u64,
    /// Server side: bytes of rendezvous request bodies one connection has the server read
    /// at once (RDMA Reads posted and not done), at least 1; 8 MiB by default. A Read cannot
    /// be called back once posted, so a call its caller cancels (drops, or lets time out)
    /// while its body is being read is answered only when the Read ends, and Reads posted for
    /// many requests go over the link before anything queued behind them. A request beyond
    /// this waits its turn unread, and a cancel answers it at once. One alone always goes, so
    /// a single large call moves at full speed whatever this is; 8 MiB is what a 100 Gb/s link
    /// moves in under a millisecond. Raise it if many concurrent large calls leave your link
    /// idle between Reads; lower it if cancelled calls should let go of the link sooner.
    pub max_request_bytes_reading: u64,
    /// Server side: connections served at once, at least 1. Each holds its receive ring, send
    /// buffers and free rendezvous buffers (a few MiB with the default ring, plus up to
    /// [`max_cached_buffer_bytes`](Config::max_cached_buffer_bytes)); a connection request
    /// beyond is refused, and the client gets [`RpcError::ConnectionRefused`](crate::RpcError).
    pub max_connections: u32,
    /// Whether a message that goes out in pieces (an eager payload longer than one
    /// [`FRAGMENT`](crate::proto::FRAGMENT)) lets the short requests and responses queued
    /// behind it go between its pieces, one after each piece (on by default). Off, this side
    /// sends in strict order and tells its peer to do the same towards it: a short call made
    /// while a long eager one is on its way then waits for all of the long one's pieces (on
    /// `shm`, whose threshold is 128 MiB, milliseconds; the latency benchmark's `rpc-behind`
    /// and `rpc-behind-fifo` modes measure the difference). Peers built before this existed
    /// never interleave towards anyone.
    pub interleave: bool,
    /// Bytes of free rendezvous buffers each side of a connection keeps registered for its
    /// next calls; 64 MiB by default, 0 keeps none. Where registering memory is more than
    /// bookkeeping (`verbs`, `shm`), a large `Vec` payload goes through a buffer registered
    /// for the connection, and one kept spares the next call of that size a registration.
    /// Beyond this, a buffer a call is done with is deregistered: on `verbs` its memory is
    /// unpinned and goes back to the allocator. Buffers are kept by role, each registered for
    /// exactly its use (lent to be read, landed into, read into), so a peer's old key reaches
    /// nothing it was not given. Keeping fewer costs throughput where
    /// registering is slow; `cargo bench --bench buffer_cache` prints what each bound keeps
    /// registered and the throughput it gives. It counts per connection and side, so a server holds up to
    /// [`max_connections`](Config::max_connections) times this; buffers the application
    /// holds ([`Client::buffer`](crate::Client::buffer)) count only once dropped. A buffer
    /// for an n-byte payload takes the least power of two that holds n, and 24 bytes more (its
    /// length prefix): 1 MiB and 24 bytes for a 1 MiB payload. So a bound of exactly 2^k keeps
    /// no buffer for a 2^k-byte payload: to keep eight for 64 MiB calls, give 8 x (64 MiB + 24).
    pub max_cached_buffer_bytes: u64,
    /// Server side: how long a lent answer (a response above the threshold that the caller
    /// reads by RDMA Read) waits for the caller to say it has read it; 60 s by default, more
    /// than zero. Until then the answer's buffer stays registered and the request counts
    /// against [`max_concurrent_requests`](Config::max_concurrent_requests); past it the caller
    /// is taken to be broken or hostile and its connection is closed, which releases it all.
    /// Give it more than the largest answer takes to read on the slowest link you serve.
    pub lent_answer_timeout: Duration,
    /// Server side: a connection on which no request came for this long, and that serves
    /// none, is told to go (GoAway, then Close: its client's next call fails with
    /// [`RpcError::ShuttingDown`](crate::RpcError), not run, and a pool reconnects), and is
    /// dropped if it is still there as long again. `None` (the default) keeps idle connections
    /// for ever: set it on a server that untrusted peers can reach, or they can hold its
    /// [`max_connections`](Config::max_connections) slots by connecting and saying nothing.
    pub idle_timeout: Option<Duration>,
    /// How long a connection may see no completion before it proves its peer with a keepalive
    /// probe: a zero-length RDMA Write, which the peer's NIC acknowledges without its CPU. A
    /// peer whose host is gone (or whose link dropped) acknowledges nothing, so once the QP's
    /// retries run out the connection ends, and every call on it fails with
    /// [`RpcError::ConnectionLost`](crate::RpcError) ("the peer is unreachable"), with or
    /// without a deadline, within about 2 x this plus the transport's retry time
    /// (the repository's `docs/guarantees.md`, "A dead peer").
    /// 5 s by default; `None` never probes (a call whose request the peer acknowledged then
    /// waits for its deadline, or for ever without one).
    pub keepalive: Option<Duration>,
    /// Largest piece of a message body one Send carries, and so the size of a receive slot:
    /// [`FRAGMENT`](crate::proto::FRAGMENT) (32 KiB) by default, a power of two within
    /// [`Config::PIECE_RANGE`]. The two sides of a connection send pieces of the smaller of
    /// theirs. Smaller slots cost less memory per credit (a server on a
    /// [`receive_pool`](Config::receive_pool) of many connections) and more Sends per eager
    /// message.
    pub piece: usize,
    /// Server side: the receive slots of all its connections, in one pool on one shared
    /// receive queue (`None`, the default, gives each connection a ring of its own). The pool
    /// is registered once, when the server binds, with a server-wide pool of send buffers
    /// beside it, so a connection costs no registered memory of its own. Each connection is
    /// granted 2 credits when it comes and more as the pool allows (up to
    /// [`ring`](Config::ring)), so a client never sends into an empty queue; the pool must
    /// hold at least 2 x [`max_connections`](Config::max_connections) slots. Its connections
    /// share one protection domain, so the server lends them nothing: responses above the
    /// eager threshold travel in pieces (or into a landing buffer the caller offers), requests
    /// are read into memory no peer can reach, and bodies are copied out of their slots.
    /// Pair it with a small [`piece`](Config::piece) (4 KiB, say): 2 x 4,096 connections of
    /// 4 KiB slots are 33 MiB.
    pub receive_pool: Option<u32>,
}

/// The switch point verbs suggests, and the one a configuration falls back to where no device
/// resolved it (shm and tcp suggest higher ones: see [`Config::eager_threshold`]). The
/// latency benchmark's `rpc-eager` and `rpc-rendezvous` modes measure your own.
pub const DEFAULT_EAGER_THRESHOLD: usize = 16 * 1024;

impl Default for Config {
    fn default() -> Self {
        Self {
            ring: 64,
            eager_threshold: None,
            max_payload: 256 << 20,
            mode: CompletionMode::default(),
            connect_timeout: Duration::from_secs(10),
            isolation: Isolation::Connection,
            max_concurrent_requests: 1024,
            max_request_bytes_in_flight: 1 << 30,
            max_request_bytes_reading: 8 << 20,
            max_connections: 1024,
            interleave: true,
            max_cached_buffer_bytes: 64 << 20,
            lent_answer_timeout: Duration::from_secs(60),
            idle_timeout: None,
            keepalive: Some(Duration::from_secs(5)),
            piece: crate::proto::FRAGMENT,
            receive_pool: None,
        }
    }
}

impl Config {
    /// The eager threshold this configuration gives on `device`: its own, or the provider's.
    ///
    /// # Examples
    /// ```
    /// let tcp = rdma_rpc_core::transport::Device::open("tcp")?;
    /// let cfg = rdma_rpc_core::Config::default();
    /// assert_eq!(cfg.eager_threshold_on(&tcp), tcp.caps().eager_hint);
    /// # Ok::<(), rdma_rpc_core::transport::Error>(())
    /// ```
    pub fn eager_threshold_on(&self, device: &rdma_rpc_transport::Device) -> usize {
        self.eager_threshold.unwrap_or(device.caps().eager_hint)
    }

    /// Fewest and most receive slots a side may keep posted ([`Config::ring`]).
    pub const RING_RANGE: std::ops::RangeInclusive<u32> = 2..=4096;

    /// Smallest and largest piece of a message body one Send carries ([`Config::piece`]).
    pub const PIECE_RANGE: std::ops::RangeInclusive<usize> = 1024..=crate::proto::FRAGMENT;

    /// Checks what the protocol bounds: the ring's depth, the eager threshold (which the
    /// handshake carries in 32 bits) and a connect timeout that leaves set-up some time.
    pub(crate) fn validate(&self) -> Result<(), crate::RpcError> {
        if !Self::RING_RANGE.contains(&self.ring) {
            return Err(crate::RpcError::Config(format!(
                "Config::ring is {}, must be within {}..={} (receive slots each side keeps posted; 64 by default)",
                self.ring,
                Self::RING_RANGE.start(),
                Self::RING_RANGE.end()
            )));
        }
        if !Self::PIECE_RANGE.contains(&self.piece) || !self.piece.is_power_of_two() {
            return Err(crate::RpcError::Config(format!(
                "Config::piece is {}, must be a power of two within {}..={} (bytes of a message one Send carries; 32 KiB by default)",
                self.piece,
                Self::PIECE_RANGE.start(),
                Self::PIECE_RANGE.end()
            )));
        }
        if let Some(pool) = self.receive_pool {
            let least = u64::from(self.max_connections) * 2;
            if u64::from(pool) < least {
                return Err(crate::RpcError::Config(format!(
                    "Config::receive_pool is {pool} slots, below 2 per connection of Config::max_connections \
                     ({}): give it at least {least}, or take fewer connections",
                    self.max_connections
                )));
            }
        }
        if self.idle_timeout.is_some_and(|t| t.is_zero()) {
            return Err(crate::RpcError::Config(
                "Config::idle_timeout is zero: give clients some time between calls, or None to keep idle connections"
                    .into(),
            ));
        }
        if self.keepalive.is_some_and(|t| t.is_zero()) {
            return Err(crate::RpcError::Config(
                "Config::keepalive is zero: give it some seconds (5 s by default), or None to never probe".into(),
            ));
        }
        if self.lent_answer_timeout.is_zero() {
            return Err(crate::RpcError::Config(
                "Config::lent_answer_timeout is zero: give a caller time to read a large answer (60 s by default)"
                    .into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(crate::RpcError::Config(
                "Config::connect_timeout is zero: give connection set-up some time (10 s by default)".into(),
            ));
        }
        if self.max_concurrent_requests == 0 {
            return Err(crate::RpcError::Config(
                "Config::max_concurrent_requests is zero: a server must serve at least one request at a time (1024 by default)".into(),
            ));
        }
        if self.max_connections == 0 {
            return Err(crate::RpcError::Config(
                "Config::max_connections is zero: a server must take at least one connection (1024 by default)".into(),
            ));
        }
        if self.max_request_bytes_in_flight == 0 {
            return Err(crate::RpcError::Config(
                "Config::max_request_bytes_in_flight is zero: give rendezvous requests some room (1 GiB by default)"
                    .into(),
            ));
        }
        if self.max_request_bytes_reading == 0 {
            return Err(crate::RpcError::Config(
                "Config::max_request_bytes_reading is zero: let the server read at least one rendezvous request at a time (8 MiB by default)"
                    .into(),
            ));
        }
        if let Some(t) = self.eager_threshold.filter(|&t| u32::try_from(t).is_err()) {
            return Err(crate::RpcError::Config(format!(
                "Config::eager_threshold is {t}, must be at most {} (larger payloads go by rendezvous)",
                u32::MAX
            )));
        }
        Ok(())
    }

    /// This configuration with the threshold fixed for `device`.
    pub(crate) fn on(mut self, device: &rdma_rpc_transport::Device) -> Config {
        self.eager_threshold = Some(self.eager_threshold_on(device));
        self
    }

    /// [`Config::max_cached_buffer_bytes`] as a size in memory.
    pub(crate) fn cached_buffer_bytes(&self) -> usize {
        usize::try_from(self.max_cached_buffer_bytes).unwrap_or(usize::MAX)
    }

    /// The threshold (of a configuration fixed with [`Config::on`]).
    pub(crate) fn eager(&self) -> usize {
        self.eager_threshold.unwrap_or(DEFAULT_EAGER_THRESHOLD)
    }
}

/// Per-call options: [`CallOptions::default`] (none) and the builder methods named after the
/// fields.
///
/// ```
/// use std::time::Duration;
/// let opts = rdma_rpc_core::CallOptions::default().deadline(Duration::from_millis(5));
/// assert_eq!(opts.deadline, Some(Duration::from_millis(5)));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallOptions {
    /// Fail with `DeadlineExceeded` after this long; the server gets the remaining budget (and
    /// aborts the handler when it runs out). The wire carries budgets up to about 71 minutes
    /// (`u32` microseconds): a longer deadline is the caller's alone, the server places none.
    /// `Duration::MAX` is never.
    pub deadline: Option<Duration>,
    /// Expected response size. Above the threshold, the call advertises a landing buffer of this
    /// size (at most the connection's largest payload) so that the server can RDMA-Write the
    /// response straight into it. Only a hint: a response that does not fit comes another way.
    pub response_hint: Option<usize>,
}

/// Builder methods, one per field: `fn field(self, value) -> Self`, each documented as "Sets
/// `Type::field`".
macro_rules! setters {
    ($ty:ident { $($field:ident: $arg:ty => $val:expr),* $(,)? }) => {
        impl $ty {
            $(
                #[doc = concat!("Sets [`", stringify!($ty), "::", stringify!($field), "`].")]
                #[must_use]
                pub fn $field(mut self, $field: $arg) -> Self {
                    self.$field = $val;
                    self
                }
            )*
        }
    };
}

setters!(Config {
    ring: u32 => ring,
    eager_threshold: impl Into<Option<usize>> => eager_threshold.into(),
    max_payload: u64 => max_payload,
    mode: CompletionMode => mode,
    connect_timeout: Duration => connect_timeout,
    isolation: Isolation => isolation,
    max_concurrent_requests: u32 => max_concurrent_requests,
    max_request_bytes_in_flight: u64 => max_request_bytes_in_flight,
    max_request_bytes_reading: u64 => max_request_bytes_reading,
    max_connections: u32 => max_connections,
    interleave: bool => interleave,
    max_cached_buffer_bytes: u64 => max_cached_buffer_bytes,
    lent_answer_timeout: Duration => lent_answer_timeout,
    idle_timeout: impl Into<Option<Duration>> => idle_timeout.into(),
    keepalive: impl Into<Option<Duration>> => keepalive.into(),
    piece: usize => piece,
    receive_pool: impl Into<Option<u32>> => receive_pool.into(),
});

setters!(CallOptions {
    deadline: impl Into<Option<Duration>> => deadline.into(),
    response_hint: impl Into<Option<usize>> => response_hint.into(),
});

use crate::proto::Hello;

/// What a side with this configuration says when it connects.
///
/// ```
/// use rdma_rpc_core::{proto::Hello, Config};
/// let hello = Hello::from(&Config::default().max_concurrent_requests(8));
/// assert_eq!(hello.max_requests, 8);
/// assert_eq!(hello.flags & Hello::TAKES_INTERLEAVED, Hello::TAKES_INTERLEAVED);
/// let in_order = Hello::from(&Config::default().interleave(false));
/// assert_eq!(in_order.flags & Hello::TAKES_INTERLEAVED, 0);
/// ```
impl From<&Config> for Hello {
    fn from(c: &Config) -> Self {
        Self {
            ring: c.ring,
            eager_threshold: c.eager().min(u32::MAX as usize) as u32,
            max_payload: c.max_payload,
            max_requests: c.max_concurrent_requests,
            max_request_bytes: c.max_request_bytes_in_flight,
            credits: 0,
            piece: c.piece.min(u32::MAX as usize) as u32,
            flags: Self::TAKES_BATCHES | if c.interleave { Self::TAKES_INTERLEAVED } else { 0 },
        }
    }
}
