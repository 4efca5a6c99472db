//! The client: a handle to one connection, driven by its callers.
//!
//! A call posts its request itself and, while it spins, polls the connection itself: no task
//! hop between the caller and the queue pair. A call that sleeps (event mode, or adaptive
//! after its spin budget) leaves the polling to the connection's driver task, which waits on the
//! completion queue and wakes it. The driver also keeps the connection going when no call
//! polls (cancels waiting for credits, deadlines) and closes it after the last handle.
//!
//! This file is the API (connecting, the call methods); `state` is what the calls and the
//! driver share under the connection's lock, `call` a call's future, `drive` the driver task.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use parking_lot::Mutex;
use rdma_rpc_transport::{Device, QpOptions};
use tokio::sync::Notify;

use crate::buf::Body;
use crate::colocate::Link;
use crate::config::{CallOptions, CompletionMode, Config};
use crate::driver::{self, Conn};
use crate::handshake;
use crate::proto::Hello;
use crate::proto::{CallMap, Event, Payload, Reply, Route, LANDING_PREFIX};
use crate::spans::{self, How};
use crate::{RpcError, TransportError};

mod call;
mod connector;
mod drive;
mod state;

pub use connector::Connector;

use call::{Call, Finish, Start};
use drive::{drive, OnDriverGone};
use state::{Back, Outgoing, State};

/// A connection to a server, for byte-level calls (method id and bytes in, bytes out).
/// Cheap to clone; all clones share the connection. The `#[service]` macro builds typed
/// clients on top of it.
///
/// # Examples
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use rdma_rpc_core::{transport::Device, Client, Config, Server, RpcError};
/// let dev = Device::open("tcp")?;
/// let server = Server::builder(Config::default())
///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req.into_iter().rev().collect::<Vec<u8>>()) })
///     .bind(&dev, "127.0.0.1:0".parse()?)?;
/// let addr = server.local_addr()?;
/// tokio::spawn(server.serve());
/// let client = Client::connect(&dev, addr, Config::default()).await?;
/// assert_eq!(client.call(1, b"abc".to_vec()).await?, b"cba");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    handle: Arc<Handle>,
    /// What every call of this handle carries ([`Client::with_options`]).
    opts: CallOptions,
}

/// What a call sends ([`Client::call`]): bytes in a `Vec`, or a [`Bulk`](crate::Bulk) (lent
/// as it is when it is registered with the connection and longer than one message).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Request {
    /// Bytes of the caller's: copied into the message, or lent (the vector itself where
    /// registering is cheap, else a copy).
    Vec(Vec<u8>),
    /// A shared value, sent from where it is.
    Bulk(crate::Bulk),
}

impl From<Vec<u8>> for Request {
    fn from(v: Vec<u8>) -> Self {
        Request::Vec(v)
    }
}

impl From<crate::Bulk> for Request {
    fn from(b: crate::Bulk) -> Self {
        Request::Bulk(b)
    }
}

impl Request {
    fn outgoing(self) -> Outgoing {
        match self {
            Request::Vec(v) => Outgoing::Vec(v),
            Request::Bulk(bulk) => Outgoing::Bulk { bulk, tail: Vec::new() },
        }
    }
}

/// Dropped with the last clone of a [`Client`]: tells the driver to close the connection.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.state.lock().closed = true;
        self.shared.kick.notify_one();
    }
}

/// What the callers and the driver task share.
struct Shared {
    state: Mutex<State>,
    mode: CompletionMode,
    /// Wakes the driver task: a call went to sleep, or the last handle went away.
    kick: Notify,
}

impl Client {
    /// Connects to a server at `addr` on `device` and starts the connection's driver task.
    /// Must be called within a tokio runtime (with IO and time enabled).
    ///
    /// The driver task runs on this runtime. Calls may be made from any runtime while it runs;
    /// once it shuts down (a client kept from one `#[tokio::test]` to the next, each with a
    /// runtime of its own), the connection fails: its calls, pending and later, end at once
    /// with [`RpcError::ConnectionLost`] saying so. Connect again on the runtime in use.
    ///
    /// # Errors
    /// [`RpcError::Config`] for a configuration outside what the protocol allows;
    /// [`RpcError::ConnectionRefused`] when the server refuses it (at its connection limit, or
    /// shutting down); [`RpcError::Transport`] when it cannot be made, including when the server
    /// could not set it up and said why (its transport error is then
    /// [`Error::RejectedWith`](rdma_rpc_transport::Error::RejectedWith), e.g. a server out of
    /// file descriptors); [`RpcError::Protocol`]
    /// when the peer is not an rdma-rpc server of this version.
    pub async fn connect(device: &Device, addr: SocketAddr, config: Config) -> Result<Client, RpcError> {
        Self::connect_in(device, addr, config, None).await
    }

    /// [`Client::connect`], the connection's completions going to a CQ of `groups` when
    /// given ([`Connector`]).
    async fn connect_in(
        device: &Device,
        addr: SocketAddr,
        config: Config,
        groups: Option<&driver::Groups>,
    ) -> Result<Client, RpcError> {
        config.validate()?;
        let config = config.on(device);
        let pd = device
            .alloc_pd()
            .map_err(|e| RpcError::Transport(TransportError::with("allocating a protection domain", e)))?;
        let (cq, seat) = match groups {
            Some(groups) => {
                let seat = groups.place()?;
                (seat.cq().clone(), Some(seat))
            }
            None => (
                device
                    .create_cq(handshake::cq_depth(&config))
                    .map_err(|e| RpcError::Transport(TransportError::with("creating a completion queue", e)))?,
                None,
            ),
        };
        let mine = Hello::from(&config);
        let slot = handshake::slot_size(&config);
        let recvs = Conn::ring(&pd, config.ring, slot)?;
        let opts = QpOptions::new(&pd, &cq).caps(handshake::qp_caps(device, &config));
        let timeout = config.connect_timeout;
        // The hello, then this side offered to a server in this process (see `colocate`).
        let mut link = Link::default();
        let mut hello = mine.encode();
        hello.extend_from_slice(&link.offer());
        let (qp, reply) = tokio::task::spawn_blocking(move || {
            rdma_rpc_transport::connect_with_recvs(addr, &opts, &hello, timeout, recvs)
        })
        .await
        .map_err(|e| {
            RpcError::Transport(TransportError::new(format!(
                "connecting to {addr}: the connect task failed: {e}"
            )))
        })?
        .map_err(|e| match e {
            rdma_rpc_transport::Error::Rejected => RpcError::ConnectionRefused,
            e => RpcError::Transport(TransportError::with(format!("connecting to {addr}"), e)),
        })?;
        let theirs = Hello::decode(&reply).ok_or_else(|| RpcError::Protocol("not an rdma-rpc server".into()))?;
        let mut session = handshake::session(&config, &mine, &theirs);
        if theirs.max_requests > 0 {
            session.limit_calls(theirs.max_requests as usize);
        }
        if theirs.max_request_bytes > 0 {
            session.limit_call_bytes(theirs.max_request_bytes);
        }
        let mut conn = Conn::configured(session, &pd, qp, cq, slot, &config)?;
        if let Some(seat) = seat {
            conn.join(seat);
        }
        link.pair(reply.get(Hello::LEN..));
        link.withdraw();
        conn.link = link;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                conn,
                calls: CallMap::default(),
                settled: 0,
                sleeping: 0,
                driver_on_cq: false,
                driver_until: None,
                backoff: driver::Backoff::default(),
                spinner: None,
                spin_token: None,
                woken: 0,
                held_back: 0,
                driver_posts: false,
                epoch: Instant::now(),
                closed: false,
            }),
            mode: config.mode,
            kick: Notify::new(),
        });
        tokio::spawn(drive(OnDriverGone(shared.clone())));
        Ok(Client {
            handle: Arc::new(Handle { shared }),
            opts: CallOptions::default(),
        })
    }

    /// Whether this connection takes no more calls because its server is shutting down
    /// ([`Server::serve_with_shutdown`](crate::Server::serve_with_shutdown)): it sent GoAway
    /// (calls still pending are answered) or already Close. A call started now would fail
    /// at once with [`RpcError::ShuttingDown`]; a connection pool uses this to route calls
    /// elsewhere first. Looks at what has arrived first (one poll of the connection): an idle
    /// client hears its server's GoAway only when something polls.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{Client, Config, Server};
    /// use rdma_rpc_core::transport::Device;
    ///
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     .handler(1, |req: Vec<u8>| async move { Ok(req) })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    /// let serving = tokio::spawn(server.serve_with_shutdown(async move {
    ///     let _ = stopped.await;
    /// }));
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// assert!(!client.is_shutting_down());
    /// stop.send(()).ok();
    /// serving.await??;
    /// assert!(client.is_shutting_down());
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_shutting_down(&self) -> bool {
        let mut st = self.handle.shared.state.lock();
        st.progress();
        st.conn.session.is_going_away()
    }

    /// Whether this connection still takes calls: false once it is lost (its peer died, the
    /// link broke, its driver's runtime shut down) or its server is shutting down, when a call
    /// would fail at once. Looks at what has arrived first (one poll of the connection).
    /// A [`Channel`](crate::Channel) connects again when this turns false.
    pub fn is_connected(&self) -> bool {
        let mut st = self.handle.shared.state.lock();
        st.progress();
        st.conn.lost().is_none() && !st.conn.session.is_going_away() && !st.conn.session.is_lost()
    }

    /// How many calls this connection has its server run at once: the server's
    /// [`Config::max_concurrent_requests`], stated when connecting (`None` from a server that
    /// stated none). Calls beyond wait in the client, unsent, until earlier ones are answered.
    pub fn call_limit(&self) -> Option<usize> {
        self.handle.shared.state.lock().conn.session.call_limit()
    }

    /// Calls waiting in the client for the server's [`Client::call_limit`]: more than zero
    /// means this connection is saturated, and a pool may open another.
    pub fn waiting_calls(&self) -> usize {
        self.handle.shared.state.lock().conn.session.held_back_calls()
    }

    /// A handle on the same connection whose calls all carry `opts` (a deadline, a
    /// response-size hint). Cheap: clones share the connection.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use rdma_rpc_core::{transport::Device, CallOptions, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// let within = client.with_options(CallOptions::default().deadline(Duration::from_secs(1)));
    /// assert_eq!(within.call(1, b"ab".to_vec()).await?, b"ab");
    /// assert_eq!(within.options().deadline, Some(Duration::from_secs(1)));
    /// # Ok(()) }
    /// ```
    pub fn with_options(&self, opts: CallOptions) -> Client {
        Client {
            handle: self.handle.clone(),
            opts,
        }
    }

    /// This handle, its calls carrying `opts` (no clone of the connection's handle).
    pub(crate) fn into_with_options(mut self, opts: CallOptions) -> Client {
        self.opts = opts;
        self
    }

    /// The options every call of this handle carries.
    pub fn options(&self) -> &CallOptions {
        &self.opts
    }

    /// Calls `method` with `payload` (a `Vec<u8>` or a [`Bulk`](crate::Bulk)); returns the
    /// response bytes.
    ///
    /// Up to the eager threshold the payload is copied into the request message; above it, it
    /// is lent for the server to read (rendezvous): a `Vec` as it is where registering memory
    /// is cheap ([`DeviceCaps::cheap_registration`](crate::transport::DeviceCaps), tcp), else
    /// copied into a registered buffer first; a `Bulk` registered with this connection as it
    /// is whenever it is longer than one message. A large response comes back the same way.
    /// To avoid the copies on every provider, see [`Client::buffer`], [`Client::call_buf`] and
    /// [`Client::call_body`].
    ///
    /// # Errors
    /// Any [`RpcError`]: the server's (unknown method, handler panic, application error, ...),
    /// the deadline, or the connection's loss.
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told and aborts the handler. Buffers
    /// the server may still read stay registered and untouched until it is done with them.
    pub fn call(
        &self,
        method: u32,
        payload: impl Into<Request>,
    ) -> impl Future<Output = Result<Vec<u8>, RpcError>> + Send + '_ {
        self.begin(
            method,
            payload.into().outgoing(),
            self.opts.clone(),
            false,
            |body, _| Ok(body.into_vec()),
        )
    }

    /// As [`Client::call`], with the response as a [`Body`], without the copy into a `Vec`: an
    /// eager response stays in the receive slot it arrived in ([`Body::Registered`]) until the
    /// body is dropped (one shorter than [`IN_SLOT_MIN`](crate::IN_SLOT_MIN) bytes with its
    /// header is copied, which costs less). While held, that slot is out of the connection's
    /// receive ring: at most half the ring is held this way (beyond that, responses come copied,
    /// as [`Body::Bytes`]), so drop bodies when done with them.
    ///
    /// # Errors
    /// As [`Client::call`].
    ///
    /// # Cancel safety
    /// As [`Client::call`].
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Body, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req.repeat(512)) })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// let body = client.call_body(1, b"ab".to_vec()).await?;
    /// // Read where it landed: no copy.
    /// assert_eq!(&body.bytes()[..], &b"ab".repeat(512)[..]);
    /// assert!(matches!(body, Body::Registered(_)));
    /// drop(body); // the receive slot goes back to the ring
    /// # Ok(()) }
    /// ```
    pub fn call_body(
        &self,
        method: u32,
        payload: impl Into<Request>,
    ) -> impl Future<Output = Result<Body, RpcError>> + Send + '_ {
        self.begin(method, payload.into().outgoing(), self.opts.clone(), true, |body, _| {
            Ok(body)
        })
    }

    /// What generated code calls: [`Client::call_body`] with `opts` instead of the handle's.
    /// Not a public API.
    #[doc(hidden)]
    pub fn call_body_opts(
        &self,
        method: u32,
        payload: Vec<u8>,
        opts: CallOptions,
    ) -> impl Future<Output = Result<Body, RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Vec(payload), opts, true, |body, _| Ok(body))
    }

    /// What generated code calls: `bulk`'s bytes then `tail` as the request, the response as
    /// a [`Body`]. A large registered `bulk` of this connection is lent as it is, `tail` in
    /// the request message beside it. Not a public API.
    #[doc(hidden)]
    pub fn call_bulk_tail(
        &self,
        method: u32,
        bulk: crate::Bulk,
        tail: Vec<u8>,
        opts: CallOptions,
    ) -> impl Future<Output = Result<Body, RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Bulk { bulk, tail }, opts, true, |body, _| Ok(body))
    }

    /// A call of `method` with `payload`, started on its first poll; `finish` turns the
    /// response and the caller's buffer into what the public method gives. With `in_slot` an
    /// eager response may stay in its receive slot.
    fn begin<T>(
        &self,
        method: u32,
        payload: Outgoing,
        opts: CallOptions,
        in_slot: bool,
        finish: Finish<T>,
    ) -> Call<'_, T> {
        let start = Start {
            method,
            payload,
            opts,
            in_slot,
        };
        Call::new(&self.handle.shared, start, finish)
    }

    /// A buffer of `len` bytes registered with this connection, to fill in place and send with
    /// [`Client::call_buf`]: a large request then goes to the server straight from it, with no
    /// copy on this side. Dropping it gives it back to the connection.
    ///
    /// # Errors
    /// [`RpcError::Transport`] when the memory cannot be registered.
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Body, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     .handler(1, |b: Body| async move { Ok::<_, RpcError>((b.len() as u64).to_le_bytes().to_vec()) })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// let mut buf = client.buffer(1 << 20)?;
    /// buf.bytes_mut().fill(7);
    /// for _ in 0..3 {
    ///     // The same registered buffer, lent to the server each time, comes back with the answer.
    ///     let (answer, back) = client.call_buf(1, buf).await?;
    ///     assert_eq!(answer, (1u64 << 20).to_le_bytes());
    ///     buf = back;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn buffer(&self, len: usize) -> Result<crate::RegisteredBuf, RpcError> {
        self.handle.shared.state.lock().conn.stash.user_buffer(len)
    }

    /// Calls `method` with the bytes of `buf`, and gives `buf` back with the response. A buffer
    /// of this connection's ([`Client::buffer`]) is not copied: a small one is sent as it is,
    /// in one message (the header goes in the room in front of its bytes); above the eager
    /// threshold, or when longer than one piece, it is lent to the server as it is. Buffers of
    /// other connections are copied, as [`Client::call`] copies its `Vec`. With a tracing
    /// subscriber installed, a DEBUG event `rpc.payload` (`side = "request"`, `len`, `how`) says
    /// which of these happened.
    ///
    /// With [`Isolation::Transfer`](crate::Isolation::Transfer) the buffer comes back in a fresh
    /// registration (its bytes copied), so that the key the server saw dies with the transfer.
    ///
    /// # Errors
    /// As [`Client::call`]; on an error the buffer goes back to the connection (after the
    /// server is done with it).
    ///
    /// # Cancel safety
    /// As [`Client::call`]: dropping the future cancels the call, and the buffer goes back to
    /// the connection once the server is done with it.
    pub fn call_buf(
        &self,
        method: u32,
        buf: crate::RegisteredBuf,
    ) -> impl Future<Output = Result<(Vec<u8>, crate::RegisteredBuf), RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Buf(buf), self.opts.clone(), false, |body, buf| {
            with_buffer(body, buf).map(|(body, buf)| (body.into_vec(), buf))
        })
    }

    /// As [`Client::call_buf`], with the response as a [`Body`] as [`Client::call_body`] gives
    /// it: no copy on this side either way when the request is small and the response eager.
    ///
    /// # Errors
    /// As [`Client::call_buf`].
    ///
    /// # Cancel safety
    /// As [`Client::call_buf`].
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{transport::Device, Body, Buffers, Client, Config, RpcError, Server};
    /// let dev = Device::open("tcp")?;
    /// let server = Server::builder(Config::default())
    ///     // Answers from a registered buffer of its own: no copy on the server either.
    ///     .handler(1, |req: Body, bufs: Buffers| async move {
    ///         let mut out = bufs.buffer(req.len())?;
    ///         out.bytes_mut().copy_from_slice(&req.bytes());
    ///         out.bytes_mut().reverse();
    ///         Ok::<_, RpcError>(out)
    ///     })
    ///     .bind(&dev, "127.0.0.1:0".parse()?)?;
    /// let addr = server.local_addr()?;
    /// tokio::spawn(server.serve());
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// let mut buf = client.buffer(1024)?;
    /// for round in 0..3u8 {
    ///     buf.bytes_mut().fill(round);
    ///     buf.bytes_mut()[0] = 255;
    ///     // Sent from `buf` itself; the answer is read where it landed.
    ///     let (answer, back) = client.call_buf_body(1, buf).await?;
    ///     assert_eq!(answer.len(), 1024);
    ///     assert_eq!((answer.bytes()[0], answer.bytes()[1023]), (round, 255));
    ///     buf = back;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn call_buf_body(
        &self,
        method: u32,
        buf: crate::RegisteredBuf,
    ) -> impl Future<Output = Result<(Body, crate::RegisteredBuf), RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Buf(buf), self.opts.clone(), true, with_buffer)
    }
}

/// The response and the caller's buffer, which a call from a registered buffer always has.
fn with_buffer(body: Body, buf: Option<crate::RegisteredBuf>) -> Result<(Body, crate::RegisteredBuf), RpcError> {
    buf.map(|buf| (body, buf))
        .ok_or_else(|| RpcError::Internal("the call's buffer went missing".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this client's server was last driven by the thread asking (`colocate`), after
    /// one call.
    async fn server_seen_here(dev: &rdma_rpc_transport::Device, addr: std::net::SocketAddr) -> bool {
        let client = Client::connect(dev, addr, Config::default()).await.expect("connect");
        assert_eq!(client.call(1, b"ab".to_vec()).await.expect("call"), b"ab");
        let st = client.handle.shared.state.lock();
        st.conn.peer_on_this_thread(CompletionMode::default()) && !st.conn.peer_on_this_thread(CompletionMode::Spin)
    }

    fn echo(dev: &rdma_rpc_transport::Device) -> crate::Server {
        crate::Server::builder(Config::default())
            .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
            .bind(dev, "127.0.0.1:0".parse().expect("an address"))
            .expect("bind")
    }

    /// A runtime of one worker serving an echo on `provider`: the device, the runtime and the
    /// server's address.
    fn served(provider: &str) -> (rdma_rpc_transport::Device, tokio::runtime::Runtime, SocketAddr) {
        let dev = rdma_rpc_transport::Device::open(provider).expect("a software provider");
        let (rt, addr) = served_on(&dev);
        (dev, rt, addr)
    }

    /// An echo on `dev`, served by a runtime of one worker (on a thread of its own).
    fn served_on(dev: &rdma_rpc_transport::Device) -> (tokio::runtime::Runtime, SocketAddr) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let server = rt.block_on(async { echo(dev) });
        let addr = server.local_addr().expect("an address");
        rt.spawn(server.serve());
        (rt, addr)
    }

    /// The most requests that waited unsent while `n` calls started behind a spinner.
    fn most_unsent_behind_a_spinner(provider: &str, n: usize) -> usize {
        let (dev, rt, addr) = served(provider);
        rt.block_on(async {
            let client = Client::connect(&dev, addr, Config::default()).await.expect("connect");
            let mut st = client.handle.shared.state.lock();
            // A call that spins for the others (none: nothing polls while the lock is held).
            st.spinner = Some(u32::MAX);
            let mut most = 0;
            for _ in 0..n {
                let start = st.start(1, state::Outgoing::Vec(b"ab".to_vec()), CallOptions::default());
                start.expect("the call starts");
                most = most.max(st.conn.session.unsent());
            }
            st.spinner = None;
            most
        })
    }

    #[test]
    fn calls_started_behind_a_spinner_go_out_in_parts_where_sends_are_cheap() {
        let most = most_unsent_behind_a_spinner("shm", 64);
        assert!(
            (state::PART_MIN..=64 / state::PARTS).contains(&most),
            "shm: 64 calls started behind a spinner leave at most a quarter unsent at once, in parts \
             of at least {}; the most unsent was {most}",
            state::PART_MIN
        );
        // Each Send costs the provider's threads CPU on tcp: one Send for all, when the spinner
        // next polls.
        assert_eq!(
            most_unsent_behind_a_spinner("tcp", 64),
            64,
            "tcp: all 64 wait for the spinner"
        );
    }

    #[test]
    fn requests_of_calls_woken_together_wait_for_the_driver_on_tcp_and_go_at_once_on_shm() {
        let (dev, rt, addr) = served("tcp");
        rt.block_on(async {
            let config = Config::default().mode(CompletionMode::Event);
            let client = Client::connect(&dev, addr, config).await.expect("connect");
            let shared = &client.handle.shared;
            let mut calls = Vec::new();
            {
                let mut st = shared.state.lock();
                // Two calls woken with their results, not run yet (their tasks would start
                // calls as they run): the driver is to post after them.
                st.woken = 2;
                assert!(st.commit_driver(), "the driver takes the posting over");
                for _ in 0..8 {
                    let start = st.start(1, state::Outgoing::Vec(b"ab".to_vec()), CallOptions::default());
                    calls.push(start.expect("the call starts").0);
                    // Its future sleeps until the driver wakes it (there is none here).
                    st.sleeping += 1;
                }
                assert_eq!(
                    st.conn.session.unsent(),
                    8,
                    "no request went alone: all wait for the driver"
                );
            }
            shared.kick.notify_one();
            // The driver gives way a few turns, then posts all eight (the woken calls never
            // run here): each gets its answer.
            let answered = tokio::time::timeout(std::time::Duration::from_secs(20), async {
                loop {
                    {
                        let st = shared.state.lock();
                        if calls
                            .iter()
                            .all(|&c| st.calls.get(c).is_some_and(|s| s.result.is_some()))
                        {
                            break;
                        }
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            })
            .await;
            let mut st = shared.state.lock();
            st.woken = 0;
            st.sleeping -= calls.len();
            for c in calls {
                st.calls.remove(c);
            }
            assert!(
                answered.is_ok(),
                "the driver posted the held requests, and the answers came"
            );
        });
        // Where a Send is cheap, each call posts its own at once: the server starts on the
        // first without waiting for the others.
        let (shm, rt, addr) = served("shm");
        rt.block_on(async {
            let config = Config::default().mode(CompletionMode::Event);
            let client = Client::connect(&shm, addr, config).await.expect("connect");
            let mut st = client.handle.shared.state.lock();
            st.woken = 2;
            let committed = st.commit_driver();
            st.woken = 0;
            assert!(!committed, "shm: calls woken together post their own requests");
        });
    }

    #[test]
    fn a_server_on_the_callers_thread_is_seen_there_and_one_elsewhere_is_not() {
        for provider in ["tcp", "shm"] {
            let dev = rdma_rpc_transport::Device::open(provider).expect("a software provider");
            let one = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            let here = one.block_on(async {
                let server = echo(&dev);
                let addr = server.local_addr().expect("an address");
                tokio::spawn(server.serve());
                server_seen_here(&dev, addr).await
            });
            assert!(here, "{provider}: the server's connection runs on this thread");
            // The server on a runtime of its own, on another thread.
            let (_other, addr) = served_on(&dev);
            assert!(
                !one.block_on(server_seen_here(&dev, addr)),
                "{provider}: the server's connection runs on another thread"
            );
        }
    }
}
