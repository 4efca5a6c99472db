//! The client: a handle to one connection, driven by its callers.
//!
//! A call posts its request itself and, while it spins, polls the connection itself: no task
//! hop between the caller and the queue pair. A call that sleeps (event mode, or adaptive
//! after its spin budget) leaves the polling to the connection's driver task, which waits on the
//! completion queue and wakes it. The driver also keeps the connection going when no call
//! polls (cancels waiting for credits, deadlines) and closes it after the last handle.

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
use crate::config::{CallOptions, CompletionMode, Config, Hello};
use crate::driver::{self, Conn};
use crate::handshake;
use crate::proto::{CallMap, Event, Payload, Reply, Route, LANDING_PREFIX};
use crate::spans::{self, How};
use crate::{RpcError, TransportError};

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
///     .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req.into_iter().rev().collect()) })
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

struct State {
    conn: Conn,
    calls: CallMap<u32, Slot>,
    /// Calls whose futures wait for the driver to wake them.
    sleeping: usize,
    /// The driver task waits on the CQ (it wakes sleeping calls without being kicked).
    driver_on_cq: bool,
    /// The deadline the driver sleeps until (it fires deadlines of sleeping calls).
    driver_until: Option<Instant>,
    closed: bool,
    /// Results handed to calls so far: a spinning call looks its own up only when this moved.
    settled: u64,
    /// The connection's adaptive spinning, off for a while after a spinner was held up.
    backoff: driver::Backoff,
    /// The one call that polls the connection by spinning; the others sleep until it (or the
    /// driver) hands them their results. One poller finds every completion in one batch and
    /// wakes their calls together, where a spinner per call polled (and locked) once per
    /// call per turn of the runtime, and a busy peer then waited for all of them.
    spinner: Option<u32>,
    /// Calls woken with their results whose futures have not run since: each may start its
    /// next call when it does, so a spinner posts after them ([`State::may_post`]).
    woken: usize,
    /// Polls the spinner held back posting for since it last posted.
    held_back: u32,
    /// Passed as `now` to calls without a deadline (the session reads the clock's value only
    /// to place a deadline), which saves a clock read per call.
    epoch: Instant,
}

/// A started call: its result once known, and who to wake then.
#[derive(Default)]
struct Slot {
    result: Option<Result<Body, RpcError>>,
    waker: Option<Waker>,
    /// Woken with its result, and not polled since ([`State::woken`]).
    woken: bool,
}

/// Polls a spinner holds back posting for at most, waiting for the calls it woke
/// ([`State::may_post`]).
const HOLD_BACK_POLLS: u32 = 4;

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
        config.validate()?;
        let config = config.on(device);
        let pd = device
            .alloc_pd()
            .map_err(|e| RpcError::Transport(TransportError::with("allocating a protection domain", e)))?;
        let cq = device
            .create_cq(config.ring * 4 + 64)
            .map_err(|e| RpcError::Transport(TransportError::with("creating a completion queue", e)))?;
        let mine = Hello::from_config(&config);
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
                woken: 0,
                held_back: 0,
                epoch: Instant::now(),
                closed: false,
            }),
            mode: config.mode,
            kick: Notify::new(),
        });
        tokio::spawn(drive(OnDriverGone(shared.clone())));
        Ok(Client {
            handle: Arc::new(Handle { shared }),
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

    /// Calls `method` with `payload`; returns the response bytes.
    ///
    /// Up to the eager threshold the payload is copied into the request message; above it, it
    /// is lent for the server to read (rendezvous): as it is where registering memory is cheap
    /// ([`DeviceCaps::cheap_registration`](crate::transport::DeviceCaps), tcp), else copied into
    /// a registered buffer first. A large response comes back the same way. To avoid the copies
    /// on every provider, see [`Client::call_buf`].
    ///
    /// # Errors
    /// Any [`RpcError`]: the server's (unknown method, handler panic, application error, ...),
    /// the deadline, or the connection's loss.
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told and aborts the handler. Buffers
    /// the server may still read stay registered and untouched until it is done with them.
    pub fn call(&self, method: u32, payload: Vec<u8>) -> impl Future<Output = Result<Vec<u8>, RpcError>> + Send + '_ {
        self.call_with(method, payload, CallOptions::default())
    }

    /// As [`Client::call`], with a deadline and a response-size hint.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn call_with(
        &self,
        method: u32,
        payload: Vec<u8>,
        opts: CallOptions,
    ) -> impl Future<Output = Result<Vec<u8>, RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Vec(payload), opts, false, |body, _| {
            Ok(body.into_vec())
        })
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
    pub fn call_body(&self, method: u32, payload: Vec<u8>) -> impl Future<Output = Result<Body, RpcError>> + Send + '_ {
        self.call_body_with(method, payload, CallOptions::default())
    }

    /// As [`Client::call_body`], with a deadline and a response-size hint.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn call_body_with(
        &self,
        method: u32,
        payload: Vec<u8>,
        opts: CallOptions,
    ) -> impl Future<Output = Result<Body, RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Vec(payload), opts, true, |body, _| Ok(body))
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
    ///     .handler_body(1, |b: Body| async move { Ok::<_, RpcError>((b.len() as u64).to_le_bytes().to_vec()) })
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
        self.call_buf_with(method, buf, CallOptions::default())
    }

    /// As [`Client::call_buf`], with a deadline and a response-size hint.
    ///
    /// # Errors
    /// As [`Client::call_buf`].
    pub fn call_buf_with(
        &self,
        method: u32,
        buf: crate::RegisteredBuf,
        opts: CallOptions,
    ) -> impl Future<Output = Result<(Vec<u8>, crate::RegisteredBuf), RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Buf(buf), opts, false, |body, buf| {
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
    ///     .handler_buf(1, |req: Body, bufs: Buffers| async move {
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
        self.call_buf_body_with(method, buf, CallOptions::default())
    }

    /// As [`Client::call_buf_body`], with a deadline and a response-size hint.
    ///
    /// # Errors
    /// As [`Client::call_buf`].
    pub fn call_buf_body_with(
        &self,
        method: u32,
        buf: crate::RegisteredBuf,
        opts: CallOptions,
    ) -> impl Future<Output = Result<(Body, crate::RegisteredBuf), RpcError>> + Send + '_ {
        self.begin(method, Outgoing::Buf(buf), opts, true, with_buffer)
    }
}

/// The response and the caller's buffer, which a call from a registered buffer always has.
fn with_buffer(body: Body, buf: Option<crate::RegisteredBuf>) -> Result<(Body, crate::RegisteredBuf), RpcError> {
    buf.map(|buf| (body, buf))
        .ok_or_else(|| RpcError::Internal("the call's buffer went missing".into()))
}

/// A request's bytes as the caller hands them over.
enum Outgoing {
    Vec(Vec<u8>),
    Buf(crate::RegisteredBuf),
}

impl Outgoing {
    fn len(&self) -> usize {
        match self {
            Outgoing::Vec(v) => v.len(),
            Outgoing::Buf(b) => b.len(),
        }
    }
}

/// What a call gives back to its caller besides the response.
enum Back {
    Nothing,
    /// The caller's buffer, which was copied (or sent inside the message).
    Own(crate::RegisteredBuf),
    /// The caller's buffer, lent as it is under this id.
    Kept {
        id: crate::proto::BufId,
        len: usize,
    },
}

impl State {
    /// Stages the payload (lent above the threshold), starts the call and posts its request.
    fn start(&mut self, method: u32, payload: Outgoing, opts: CallOptions) -> Result<(u32, Back), RpcError> {
        let now = match opts.deadline {
            Some(_) => Instant::now(),
            None => self.epoch,
        };
        let conn = &mut self.conn;
        // What to give back if the call cannot start: the payload's buffer and the landing
        // buffer, at most one each (an array: no allocation per call).
        let mut staged: [Option<crate::proto::BufId>; 2] = [None, None];
        let mut back = Back::Nothing;
        // A large response is written into a landing buffer the request advertises, of at most
        // the largest payload the connection carries (a hint beyond it is only a hint).
        let max = usize::try_from(conn.session.config().max_payload).unwrap_or(usize::MAX);
        let landing_len = opts
            .response_hint
            .map(|h| h.min(max))
            .filter(|&h| conn.session.is_rendezvous(h));
        let result = (|| {
            let p = match payload {
                Outgoing::Vec(v) if conn.session.is_rendezvous(v.len()) => {
                    // The vector itself where registering is cheap, else a copy.
                    let (desc, buf) = conn.stash.lend_vec(v)?;
                    staged[0] = Some(buf);
                    Payload::Lent { desc, buf }
                }
                Outgoing::Vec(v) => Payload::Eager(v),
                Outgoing::Buf(b) => {
                    let len = b.len();
                    let route = conn.session.registered_route(len, landing_len.is_some());
                    let lend = route == Route::Lend;
                    match conn.stash.stage_user(b, route, true) {
                        Ok((desc, buf)) => {
                            staged[0] = Some(buf);
                            back = Back::Kept { id: buf, len };
                            match desc {
                                Some(desc) => {
                                    spans::payload("request", len, How::Lent);
                                    Payload::Lent { desc, buf }
                                }
                                None => {
                                    spans::payload("request", len, How::SentFromBuffer);
                                    Payload::Placed { buf, len }
                                }
                            }
                        }
                        // Another connection's buffer, or a small one behind a landing
                        // descriptor: copied, as a Vec would be.
                        Err(b) => {
                            let p = if lend {
                                let (desc, buf) = conn.stash.lend(&b.bytes())?;
                                staged[0] = Some(buf);
                                spans::payload("request", len, How::CopiedAndLent);
                                Payload::Lent { desc, buf }
                            } else {
                                spans::payload("request", len, How::Copied);
                                Payload::Eager(b.to_vec())
                            };
                            back = Back::Own(b);
                            p
                        }
                    }
                }
            };
            let landing = match landing_len {
                Some(h) => {
                    let want = h.saturating_add(LANDING_PREFIX);
                    let (buf, mr) = conn.stash.take(want, crate::stash::Role::Land)?;
                    let mut desc = mr.remote();
                    desc.len = want as u64;
                    staged[1] = Some(buf);
                    Some((desc, buf))
                }
                None => None,
            };
            conn.session.start_call(method, p, landing, opts.deadline, now)
        })();
        match result {
            Ok(call) => {
                // The request goes out first: nothing polls in between, so its slot in the
                // call table can come after, off the round trip's path. With another call
                // spinning, its next poll posts it instead, in one Send with the other short
                // messages queued by then (the calls its last results let start).
                if self.spinner.is_none() {
                    self.conn.flush();
                }
                self.calls.insert(call, Slot::default());
                Ok((call, back))
            }
            Err(e) => {
                for b in staged.into_iter().flatten() {
                    conn.stash.release(b);
                }
                if let Back::Kept { id, .. } = back {
                    conn.stash.unkeep(id);
                }
                Err(e)
            }
        }
    }

    /// Polls the connection once and hands finished calls their results; posts what is
    /// queued unless calls it woke are still to run ([`State::woken`]).
    fn progress(&mut self) {
        self.conn.take_inputs();
        self.settle();
        if self.may_post() {
            self.conn.flush();
        }
    }

    /// Whether to post now: unless calls this side woke with their results have not run yet
    /// and a spinner will post after them. Each such call starts its next one as it runs,
    /// and its request then goes out with the others in one batch (`proto/batch.rs`) where
    /// posting at once sent each alone. A spinner holds back a few polls at most, whatever the
    /// woken calls do.
    fn may_post(&mut self) -> bool {
        if self.woken == 0 || self.spinner.is_none() || self.held_back >= HOLD_BACK_POLLS {
            self.held_back = 0;
            return true;
        }
        self.held_back += 1;
        false
    }

    /// `call` runs again after its result woke it: one woken call fewer to wait for.
    fn ran(&mut self, call: u32) {
        if let Some(slot) = self.calls.get_mut(call) {
            if std::mem::take(&mut slot.woken) {
                self.woken -= 1;
            }
        }
    }

    /// Hands out what the session decided since (results, transmits), without polling.
    fn settle(&mut self) {
        while let Some(ev) = self.conn.session.poll_event() {
            if let Event::CallDone { call, result } = ev {
                let result = result.and_then(|r| match r {
                    Reply::Bytes(b) => Ok(Body::Bytes(b)),
                    Reply::Inline(b) => Ok(Body::Inline(b)),
                    Reply::Landed { buf } => self.conn.stash.landed(buf).map(Body::Bytes),
                    Reply::InSlot { slot, range } => self
                        .conn
                        .slot_body(slot, range)
                        .map(Body::Registered)
                        .ok_or_else(|| RpcError::Internal("the response's receive slot went missing".into())),
                });
                if let Some(slot) = self.calls.get_mut(call) {
                    self.settled += 1;
                    slot.result = Some(result);
                    if let Some(w) = slot.waker.take() {
                        w.wake();
                        if !std::mem::replace(&mut slot.woken, true) {
                            self.woken += 1;
                        }
                    }
                }
            }
        }
        // Consumed receive slots are posted again by the next `flush` (the next call's, or the
        // driver's): after the request it sends, off the path of this result.
        if self.woken == 0 || self.spinner.is_none() {
            self.conn.send_pending();
        }
        if self.conn.lost().is_some() {
            self.conn.drain_flushed();
        }
    }

    /// When `call` (leaving) was the spinner: hands the turn to a call still waiting, and wakes
    /// it to spin. True when a call took it.
    fn pass_turn(&mut self, call: u32) -> bool {
        if self.spinner != Some(call) {
            return false;
        }
        self.spinner = None;
        let next = self
            .calls
            .iter()
            .find(|&(id, slot)| id != call && slot.result.is_none() && slot.waker.is_some())
            .map(|(id, _)| id);
        let Some(next) = next else {
            return false;
        };
        match self.calls.get_mut(next).and_then(|s| s.waker.take()) {
            Some(w) => {
                self.spinner = Some(next);
                w.wake();
                true
            }
            None => false,
        }
    }

    /// True when no call polls by itself, so the driver must watch the CQ for them.
    fn needs_watch(&self) -> bool {
        self.conn.lost().is_none() && self.conn.has_work() && self.calls.len() <= self.sleeping
    }

    /// True when what a flush left ([`Conn::more_to_post`]) is the driver's to post: no call
    /// spins, which would post it itself.
    fn driver_must_post(&self) -> bool {
        self.calls.len() <= self.sleeping && self.conn.more_to_post()
    }
}

/// Waits until the application's buffer `id` is back from the Send it went out in (its
/// completion may come after the response), or the connection is lost.
fn wait_sent(st: &mut parking_lot::MutexGuard<'_, State>, id: crate::proto::BufId) {
    while st.conn.stash.in_flight(id) {
        if st.conn.lost().is_some() {
            // Flushed work requests give their buffers back.
            st.conn.drain_flushed();
            return;
        }
        st.progress();
        if st.conn.stash.in_flight(id) {
            parking_lot::MutexGuard::unlocked(st, std::thread::yield_now);
        }
    }
}

/// How many polls the only call in flight makes before giving way to the runtime (a few
/// microseconds on shm).
const INNER_SPINS: u32 = 256;

/// What a call starts with.
struct Start {
    method: u32,
    payload: Outgoing,
    opts: CallOptions,
    /// An eager response may stay in its receive slot ([`Client::call_body`]).
    in_slot: bool,
}

/// A call: started on its first poll, then in flight until its result; cancels it when dropped
/// before the result. Starting, waiting and giving the caller's buffer back happen under one
/// lock when the result comes within the first poll's spin, as it nearly always does on a
/// fast provider (each lock taken and released is two atomic read-modify-writes).
struct Call<'a, T> {
    shared: &'a Shared,
    /// Until the first poll.
    start: Option<Start>,
    /// The call's `rpc.call` span (made at the first poll; entered at each), or none without
    /// a subscriber.
    span: Option<tracing::Span>,
    finish: Finish<T>,
    call: u32,
    /// What to give back to the caller besides the response; `None` once given.
    back: Option<Back>,
    /// The adaptive spin budget (its clock read only once a round of polls found nothing).
    budget: driver::Budget,
    sleeping: bool,
    done: bool,
    /// A spinner giving way to the calls it woke ([`tokio::task::yield_now`]), until it resumes.
    yielding: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

/// Turns a finished call's response and the caller's buffer back into what the public method
/// gives.
type Finish<T> = fn(Body, Option<crate::RegisteredBuf>) -> Result<T, RpcError>;

impl<'a, T> Call<'a, T> {
    fn new(shared: &'a Shared, start: Start, finish: Finish<T>) -> Self {
        Self {
            shared,
            start: Some(start),
            span: None,
            finish,
            call: 0,
            back: None,
            budget: driver::Budget::default(),
            sleeping: false,
            done: false,
            yielding: None,
        }
    }
}

/// A call that ends without its response (an error, a cancel): the caller's lent buffer goes
/// back to the connection, not to the caller, once the server is done with it.
fn unkeep(st: &mut State, back: Option<Back>) {
    if let Some(Back::Kept { id, .. }) = back {
        st.conn.stash.unkeep(id);
    }
}

/// The caller's buffer back with the response (after the Send it went out in is done).
fn give_back(
    st: &mut parking_lot::MutexGuard<'_, State>,
    result: Body,
    back: Back,
) -> Result<(Body, Option<crate::RegisteredBuf>), RpcError> {
    match back {
        Back::Nothing => Ok((result, None)),
        Back::Own(b) => Ok((result, Some(b))),
        Back::Kept { id, len } => {
            wait_sent(st, id);
            match st.conn.stash.reclaim(id, len) {
                Some(b) => Ok((result, Some(b))),
                None => Err(match st.conn.lost() {
                    Some(why) => RpcError::ConnectionLost(why.to_owned()),
                    None => RpcError::Transport(TransportError::new("re-registering the lent buffer failed")),
                }),
            }
        }
    }
}

impl<T> Future for Call<'_, T> {
    type Output = Result<T, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(y) = this.yielding.as_mut() {
            if y.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.yielding = None;
        }
        if let Some(start) = &this.start {
            this.span = spans::call(start.method, start.payload.len());
        }
        // Without a subscriber there is no span: nothing to clone, enter or drop.
        let span = this.span.clone();
        let _entered = span.as_ref().map(tracing::Span::enter);
        this.poll_call(cx)
            .map(|r| r.and_then(|(body, buf)| (this.finish)(body, buf)))
    }
}

impl<T> Call<'_, T> {
    /// The call's progress, under the connection's lock: starts it on the first poll.
    fn poll_call(&mut self, cx: &mut Context<'_>) -> Poll<Result<(Body, Option<crate::RegisteredBuf>), RpcError>> {
        let shared = self.shared;
        let mut st = shared.state.lock();
        if let Some(start) = self.start.take() {
            match st.start(start.method, start.payload, start.opts) {
                Ok((call, back)) => {
                    if start.in_slot {
                        // Before anyone polls: the response cannot have arrived yet.
                        st.conn.session.keep_in_slot(call);
                    }
                    self.call = call;
                    self.back = Some(back);
                }
                Err(e) => {
                    self.done = true;
                    return Poll::Ready(Err(e));
                }
            }
        } else {
            st.ran(self.call);
            // Another call spinning polls for all: this one only looks at its own slot.
            if st.spinner.is_none_or(|c| c == self.call) {
                st.progress();
            }
        }
        st.conn.link.driven_here();
        // A server driven by this very thread cannot answer while this call spins.
        // One spinner per connection: this call, unless another has the turn (a sleeping call
        // spins only when a spinner that left handed the turn to it).
        let turn = match st.spinner {
            Some(c) => c == self.call,
            None => !self.sleeping,
        };
        let mut spin =
            turn && {
                let st = &mut *st;
                self.budget.spins(shared.mode, &mut st.backoff)
            } && !st.conn.peer_on_this_thread(shared.mode);
        if spin {
            st.spinner = Some(self.call);
            if self.sleeping {
                self.sleeping = false;
                st.sleeping -= 1;
            }
        } else if turn {
            st.spinner = None;
        }
        // The only call in flight spins right here for a while: giving way to the runtime
        // between polls costs more than a round trip on shm (a syscall per turn when the caller
        // is the runtime's `block_on`). With other calls in flight it gives way at once, so
        // that they are posted without waiting for this one.
        if spin && st.calls.len() == 1 {
            let mut seen = None;
            let mut ran_out = true;
            for _ in 0..INNER_SPINS {
                // Its own result only when some result came (here, or on another thread).
                if seen != Some(st.settled) {
                    if st.calls.get(self.call).is_none_or(|s| s.result.is_some()) {
                        ran_out = false;
                        break;
                    }
                    seen = Some(st.settled);
                }
                if st.conn.lost().is_some() {
                    ran_out = false;
                    break;
                }
                std::hint::spin_loop();
                // Only the CQ until it has something; then everything that follows from it.
                if st.conn.poll_cq() {
                    st.settle();
                    self.reclaim_early(&mut st);
                } else if st.conn.more_to_post() {
                    // The next piece of a long message (a flush posts one at a time).
                    st.conn.send_pending();
                }
                // A caller on another thread waiting to start a call gets the lock now (one
                // atomic load when nobody waits).
                parking_lot::MutexGuard::bump(&mut st);
            }
            // The polls found nothing and the server's poller is on this core: spinning on
            // keeps it from answering. Sleep. (A result that came in the last poll is taken
            // below whatever `spin` says.)
            if ran_out && matches!(shared.mode, CompletionMode::Adaptive { .. }) && st.conn.peer_shares_cpu() {
                spin = false;
            }
        }
        if !spin && st.spinner == Some(self.call) {
            // Out of budget (or the peer needs the core): the turn goes with it.
            st.spinner = None;
        }
        let Some(slot) = st.calls.get_mut(self.call) else {
            // Only a finished call leaves the table, and only here.
            self.done = true;
            unkeep(&mut st, self.back.take());
            return Poll::Ready(Err(RpcError::ConnectionLost("the call was lost".into())));
        };
        if let Some(result) = slot.result.take() {
            st.calls.remove(self.call);
            if self.sleeping {
                st.sleeping -= 1;
            }
            self.done = true;
            let back = self.back.take().unwrap_or(Back::Nothing);
            let out = match result {
                Ok(body) => give_back(&mut st, body, back),
                Err(e) => {
                    unkeep(&mut st, Some(back));
                    Err(e)
                }
            };
            // The spinner leaving hands its turn on; without a call to take it, whoever sleeps
            // now needs the driver on the CQ.
            let handed = st.pass_turn(self.call);
            let kick = (!handed && !st.driver_on_cq && st.needs_watch()) || st.driver_must_post();
            drop(st);
            if kick {
                shared.kick.notify_one();
            }
            return Poll::Ready(out);
        }
        if spin {
            // Spinning on: through the runtime, and off the core for a moment when the
            // provider's own threads need it. This poll found nothing of its own: the budget
            // runs from here.
            self.budget.idle_round(shared.mode);
            let yield_cpu = st.conn.yield_cpu;
            let others = st.woken > 0;
            drop(st);
            if yield_cpu {
                std::thread::yield_now();
            }
            if others {
                // The calls this poll woke go first, and the rest of the runtime's queues:
                // tokio's `yield_now` runs this task again only after the worker has run
                // them (and polled its IO driver). Waking itself kept the worker's local queue
                // from ever emptying, and with more runnable tasks than it holds (256) the
                // others waited in the global queue, which a worker looks at once in 61 turns.
                let mut y: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(tokio::task::yield_now());
                if y.as_mut().poll(cx).is_pending() {
                    self.yielding = Some(y);
                    return Poll::Pending;
                }
            }
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        slot.waker = Some(cx.waker().clone());
        if !self.sleeping {
            self.sleeping = true;
            st.sleeping += 1;
        }
        // The driver must look again when it is not watching the CQ, or when a deadline
        // earlier than the one it sleeps until has come (this call's). Not while another call
        // spins: that one polls, posts and fires deadlines for all, and kicks the driver
        // when it stops.
        let earlier = st
            .conn
            .session
            .poll_timeout()
            .is_some_and(|d| st.driver_until.is_none_or(|u| d < u));
        let kick = st.spinner.is_none() && (!st.driver_on_cq || earlier || st.conn.more_to_post());
        drop(st);
        if kick {
            shared.kick.notify_one();
        }
        Poll::Pending
    }

    /// The caller's buffer back from the connection as soon as no peer reaches it (on a fast
    /// provider the Send from it completes long before the response comes): taken while the
    /// call waits, off the response's path.
    fn reclaim_early(&mut self, st: &mut State) {
        if let Some(Back::Kept { id, len }) = self.back {
            if let Some(b) = st.conn.stash.reclaim_released(id, len) {
                self.back = Some(Back::Own(b));
            }
        }
    }
}

impl<T> Drop for Call<'_, T> {
    fn drop(&mut self) {
        // Never polled (nothing started), or finished.
        if self.done || self.start.is_some() {
            return;
        }
        let mut st = self.shared.state.lock();
        if self.sleeping {
            st.sleeping -= 1;
        }
        st.ran(self.call);
        st.pass_turn(self.call);
        if let Some(slot) = st.calls.remove(self.call) {
            if slot.result.is_none() {
                st.conn.session.cancel(self.call);
                st.conn.flush();
            }
        }
        unkeep(&mut st, self.back.take());
        // The driver finishes what the cancel started (the server's last word, credits).
        drop(st);
        self.shared.kick.notify_one();
    }
}

/// The connection's driver task: polls for sleeping calls, keeps the connection going when no
/// call does, and closes it (dropping the QP and buffers) after the last handle.
async fn drive(gone: OnDriverGone) {
    // The guard is the future's from its making: dropped with it even if it never ran.
    let shared = &gone.0;
    let cq = shared.state.lock().conn.cq().clone();
    loop {
        let next = {
            let mut st = shared.state.lock();
            st.conn.link.driven_here();
            st.progress();
            let lost = st.conn.lost().is_some();
            if st.closed && (lost || !st.conn.has_work()) {
                return;
            }
            // What the flush left (a long message's further pieces) goes before any sleep,
            // unless a spinning call posts it.
            if st.driver_must_post() {
                None
            } else {
                let watch = st.needs_watch();
                let deadline = if lost { None } else { st.conn.session.poll_timeout() };
                st.driver_on_cq = watch;
                st.driver_until = deadline;
                Some((watch, deadline))
            }
        };
        let Some((watch, deadline)) = next else {
            crate::driver::reschedule().await;
            continue;
        };
        let sleep = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = cq.ready(), if watch => {
                if let Err(e) = r {
                    tracing::debug!(%e, "waiting on the CQ");
                    // The next progress polls the CQ and sees the error as the connection's loss.
                    tokio::task::yield_now().await;
                }
            }
            () = shared.kick.notified() => {}
            () = sleep => {}
        }
    }
}

/// Dropped with the driver task. Unless the client was closed, that is its runtime shutting
/// down (a client connected on one runtime, such as a test's, and used on another): then
/// nothing would ever wake a call that sleeps, so the connection fails at once, and its
/// calls, pending and later, with it.
struct OnDriverGone(Arc<Shared>);

impl Drop for OnDriverGone {
    fn drop(&mut self) {
        let mut st = self.0.state.lock();
        if st.closed || st.conn.lost().is_some() {
            return;
        }
        st.conn.lose(
            "the connection's driver task ended with the tokio runtime the client was connected on: \
             use a Client on that runtime while it runs, or connect again on this one"
                .into(),
        );
        st.settle();
    }
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
            let other = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime");
            let server = other.block_on(async { echo(&dev) });
            let addr = server.local_addr().expect("an address");
            other.spawn(server.serve());
            assert!(
                !one.block_on(server_seen_here(&dev, addr)),
                "{provider}: the server's connection runs on another thread"
            );
        }
    }
}
