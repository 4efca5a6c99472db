//! The server: handlers by method id, a listener, one driver task per connection.

use foldhash::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use rdma_rpc_transport::{Device, Listener, QpOptions};
use tracing::Instrument;

use crate::buf::Body;
use crate::colocate::Link;
use crate::config::Config;
use crate::context;
use crate::driver::{self, Conn, ReceivePool, Role, RoleInput};
use crate::handler::{or_panic, CatchUnwind, Handler, Response};
use crate::handshake::{self, qp_caps, slot_size};
use crate::proto::Hello;
use crate::proto::{ErrorReply, Event, Payload, RequestBody, Status};
use crate::spans::{self, How};
use crate::stash::Buffers;
use crate::tasks::Tasks;
use crate::{RpcError, TransportError};

/// Collects handlers, then binds.
pub struct ServerBuilder {
    config: Config,
    pub(crate) handlers: HashMap<u32, Handler>,
    /// Where each method's handler takes its request.
    pub(crate) placement: Placement,
}

/// Which methods' handlers take the request where it arrived.
#[derive(Default)]
pub struct Placement {
    /// A [`Body`], or borrowed by a synchronous handler: eager requests may stay in their
    /// receive slot, large ones in the buffer they were read into.
    in_slot: HashSet<u32>,
    /// Large requests only, in the buffer they were read into; eager ones copied out (a typed
    /// handler, which may wait long, holds no receive slot).
    read_in_place: HashSet<u32>,
}

impl Placement {
    /// `method`'s requests where they arrive, eager or read.
    pub(crate) fn keep(&mut self, method: u32) {
        self.in_slot.insert(method);
        self.read_in_place.remove(&method);
    }

    /// `method`'s large requests where they were read; eager ones copied.
    pub(crate) fn read_only(&mut self, method: u32) {
        self.in_slot.remove(&method);
        self.read_in_place.insert(method);
    }

    /// `method`'s requests copied out.
    pub(crate) fn copy(&mut self, method: u32) {
        self.in_slot.remove(&method);
        self.read_in_place.remove(&method);
    }
}

impl ServerBuilder {
    /// Listens on `addr` (port 0 picks one).
    ///
    /// # Errors
    /// [`RpcError::Config`] for a configuration outside what the protocol allows;
    /// [`RpcError::Transport`] when the address cannot be bound.
    pub fn bind(self, device: &Device, addr: SocketAddr) -> Result<Server, RpcError> {
        self.config.validate()?;
        let pool = match self.config.receive_pool {
            Some(slots) => Some(ReceivePool::new(
                device,
                slots,
                slot_size(&self.config.clone().on(device)),
                (self.config.max_connections, handshake::cq_depth(&self.config)),
            )?),
            None => None,
        };
        let listener = Listener::bind(device, addr)
            .map_err(|e| RpcError::Transport(TransportError::with(format!("binding {addr}"), e)))?;
        Ok(Server {
            device: device.clone(),
            listener: Arc::new(listener),
            config: self.config,
            handlers: Arc::new(self.handlers),
            placement: Arc::new(self.placement),
            connections: Arc::new(AtomicUsize::new(0)),
            pool,
        })
    }
}

/// A bound server. Run it with [`Server::serve`] (usually in a spawned task).
pub struct Server {
    device: Device,
    listener: Arc<Listener>,
    config: Config,
    handlers: Arc<HashMap<u32, Handler>>,
    placement: Arc<Placement>,
    /// Connections set up or being set up ([`Config::max_connections`]).
    connections: Arc<AtomicUsize>,
    /// The receive slots and send buffers all connections share ([`Config::receive_pool`]).
    pool: Option<Arc<ReceivePool>>,
}

impl Server {
    /// Starts describing a server.
    pub fn builder(config: Config) -> ServerBuilder {
        ServerBuilder {
            config,
            handlers: HashMap::default(),
            placement: Placement::default(),
        }
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// [`RpcError::Transport`] when the listener cannot say.
    pub fn local_addr(&self) -> Result<SocketAddr, RpcError> {
        self.listener
            .local_addr()
            .map_err(|e| RpcError::Transport(TransportError::with("reading the listener's address", e)))
    }

    /// Accepts connections forever, each with its own protection domain, CQ, ring and driver.
    /// A connection that fails to set up is logged and skipped. Each connection runs in a task
    /// of its own until its client goes: dropping this future stops accepting, not them. For
    /// a server that stops, see [`Server::serve_with_shutdown`].
    ///
    /// # Errors
    /// Only when the listener itself fails.
    pub async fn serve(self) -> Result<(), RpcError> {
        loop {
            let req = accept(self.listener.clone(), None).await?;
            let Some(conn) = req.and_then(|req| self.connection(req, None)) else {
                continue;
            };
            tokio::spawn(conn);
        }
    }

    /// As [`Server::serve`] until `signal` completes, then shuts down gracefully and returns
    /// once every connection is closed:
    ///
    /// - no new connection is accepted;
    /// - each client is told to start no new calls (they fail at once with
    ///   [`RpcError::ShuttingDown`], unsent);
    /// - every request that reached the server before it closed the connection is run and
    ///   answered, handlers that take a while included;
    /// - then each connection closes with a last message that tells its client that the calls
    ///   it still has pending were not run: they fail with [`RpcError::ShuttingDown`] too, never
    ///   with an ambiguous [`RpcError::ConnectionLost`]. So a call either ran once and got its
    ///   answer, or did not run and may be retried elsewhere.
    ///
    /// Idle clients do not hold the shutdown up. A handler that never finishes does: to bound
    /// the wait, run this future under `tokio::time::timeout`; dropping it closes the
    /// connections still open at once (their pending calls then fail with
    /// [`RpcError::ConnectionLost`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use rdma_rpc_core::{Client, Config, RpcError, Server};
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
    ///
    /// let client = Client::connect(&dev, addr, Config::default()).await?;
    /// assert_eq!(client.call(1, b"ping".to_vec()).await?, b"ping");
    ///
    /// stop.send(()).ok();
    /// serving.await??; // every connection drained and closed
    /// assert_eq!(client.call(1, b"ping".to_vec()).await, Err(RpcError::ShuttingDown));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// Only when the listener itself fails (the connections are closed first).
    pub async fn serve_with_shutdown(self, signal: impl Future<Output = ()>) -> Result<(), RpcError> {
        let shutdown = Arc::new(Shutdown::default());
        // Dropped with this future (a grace period's end): an accept still in progress then
        // refuses what it takes.
        let _started_when_dropped = StartOnDrop(shutdown.clone());
        // Owned here: dropping this future aborts them (closing their connections).
        let mut conns = tokio::task::JoinSet::new();
        let mut pending_accept = None;
        tokio::pin!(signal);
        let result = loop {
            let next = pending_accept
                .get_or_insert_with(|| tokio::spawn(accept(self.listener.clone(), Some(shutdown.clone()))));
            tokio::select! {
                () = &mut signal => break Ok(()),
                r = next => {
                    pending_accept = None;
                    match r {
                        Ok(Ok(Some(req))) => {
                            if let Some(conn) = self.connection(req, Some(shutdown.clone())) {
                                conns.spawn(conn);
                            }
                        }
                        Ok(Ok(None)) => {}
                        Ok(Err(e)) => break Err(e),
                        Err(e) => break Err(RpcError::Transport(TransportError::new(format!("the accept task failed: {e}")))),
                    }
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        };
        tracing::info!(connections = conns.len(), "shutting down: accepting no more, draining");
        shutdown.start();
        // A connection request the accept in progress takes now is refused (by `accept`).
        if let Some(next) = pending_accept {
            let _ = next.await;
        }
        while conns.join_next().await.is_some() {}
        tracing::info!("shut down: every connection closed");
        result
    }

    /// The task that sets up and serves one connection, or `None` when the server already has
    /// [`Config::max_connections`] (the request is refused).
    fn connection(
        &self,
        req: rdma_rpc_transport::ConnectRequest,
        shutdown: Option<Arc<Shutdown>>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let max = self.config.max_connections as usize;
        let Some(counted) = Counted::new(&self.connections, max) else {
            tracing::warn!(max, peer = ?req.peer(), "refusing a connection: at Config::max_connections");
            req.reject();
            return None;
        };
        let (device, config) = (self.device.clone(), self.config.clone());
        let (handlers, placement) = (self.handlers.clone(), self.placement.clone());
        let pool = self.pool.clone();
        Some(async move {
            // Counted until the connection's task ends, however it ends (aborted included).
            let _counted = counted;
            let served = match pool {
                Some(pool) => serve_pooled(device, config, handlers, &pool, req, shutdown).await,
                None => serve_connection(device, config, handlers, &placement, req, shutdown).await,
            };
            if let Err(e) = served {
                tracing::warn!(%e, "setting up a connection");
            }
        })
    }
}

/// One connection counted against [`Config::max_connections`] while it lives.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    /// Counts one more, unless `max` are counted already.
    fn new(count: &Arc<AtomicUsize>, max: usize) -> Option<Counted> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| Counted(count.clone()))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The next connection request, or `None` when none came within [`ACCEPT_POLL`] (or one failed,
/// which is logged, or came after `shutdown` started, which is refused).
async fn accept(
    listener: Arc<Listener>,
    shutdown: Option<Arc<Shutdown>>,
) -> Result<Option<rdma_rpc_transport::ConnectRequest>, RpcError> {
    // A bounded wait, so that a runtime shutting down never waits long on this thread.
    let req = tokio::task::spawn_blocking(move || listener.accept(Some(ACCEPT_POLL)))
        .await
        .map_err(|e| RpcError::Transport(TransportError::new(format!("the accept task failed: {e}"))))?;
    match req {
        Ok(r) if shutdown.is_some_and(|s| s.started()) => {
            r.reject();
            Ok(None)
        }
        Ok(r) => Ok(Some(r)),
        Err(rdma_rpc_transport::Error::Timeout(_)) => Ok(None),
        Err(e) => {
            tracing::warn!(%e, "accepting a connection");
            Ok(None)
        }
    }
}

/// A server's shutdown, as its connections see it: a flag each driver looks at once per round
/// (one load), and a wake-up for those asleep.
#[derive(Default)]
struct Shutdown {
    started: AtomicBool,
    wake: tokio::sync::Notify,
}

impl Shutdown {
    fn start(&self) {
        self.started.store(true, Ordering::Release);
        self.wake.notify_waiters();
    }

    fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Completes once [`Shutdown::start`] was called.
    async fn wait(&self) {
        loop {
            let woken = self.wake.notified();
            tokio::pin!(woken);
            // Registered before the look at the flag: a start between the two still wakes it.
            woken.as_mut().enable();
            if self.started() {
                return;
            }
            woken.await;
        }
    }
}

/// Starts the shutdown when dropped.
struct StartOnDrop(Arc<Shutdown>);

impl Drop for StartOnDrop {
    fn drop(&mut self) {
        self.0.start();
    }
}

/// What a connection's driver hears of its server's shutdown.
struct GoAway;

async fn serve_connection(
    device: Device,
    config: Config,
    handlers: Arc<HashMap<u32, Handler>>,
    placement: &Placement,
    req: rdma_rpc_transport::ConnectRequest,
    shutdown: Option<Arc<Shutdown>>,
) -> Result<(), RpcError> {
    let config = config.on(&device);
    let mine = Hello::from(&config);
    let Some(theirs) = Hello::decode(req.private_data()) else {
        req.reject();
        return Err(RpcError::Protocol("connect request without an rdma-rpc hello".into()));
    };
    let tr =
        |what: &'static str| move |e: rdma_rpc_transport::Error| RpcError::Transport(TransportError::with(what, e));
    // Isolation: a protection domain per connection, so an rkey of one connection's buffers is
    // worthless on any other connection's QP.
    let resources = (|| {
        let pd = device.alloc_pd().map_err(tr("allocating a protection domain"))?;
        let cq = device
            .create_cq(handshake::cq_depth(&config))
            .map_err(tr("creating a completion queue"))?;
        let recvs = Conn::ring(&pd, config.ring, slot_size(&config))?;
        Ok::<_, RpcError>((pd, cq, recvs))
    })();
    let (pd, cq, recvs) = match resources {
        Ok(r) => r,
        Err(e) => {
            // Out of descriptors or memory, say: the client is told, not left to see the
            // connection close (the accept below refuses it so on the transport's failures).
            let why = e.report();
            req.reject_with(&format!("its set-up failed: {why}"));
            return Err(e);
        }
    };
    let slot = slot_size(&config);
    let opts = QpOptions::new(&pd, &cq).caps(qp_caps(&device, &config));
    // A client in this process: pair with it, and offer this side back (see `colocate`).
    let mut link = Link::default();
    let mut hello = mine.encode();
    if link.pair(req.private_data().get(Hello::LEN..)) {
        hello.extend_from_slice(&link.offer());
    }
    let qp = tokio::task::spawn_blocking(move || req.accept_with_recvs(&opts, &hello, recvs))
        .await
        .map_err(|e| RpcError::Transport(TransportError::new(format!("the accept task failed: {e}"))))?
        .map_err(tr("accepting a connection"))?;
    let mut session = handshake::session(&config, &mine, &theirs);
    session.serve_in_slot(placement.in_slot.iter().copied());
    session.read_in_place(placement.read_in_place.iter().copied());
    limit(&mut session, &config);
    let mut conn = Conn::configured(session, &pd, qp, cq, slot, &config)?;
    conn.link = link;
    run(conn, handlers, shutdown, &config).await;
    Ok(())
}

/// A connection of a server on a receive pool ([`Config::receive_pool`]): its QP takes its
/// receives from the pool's shared queue and lives in the pool's protection domain; it is
/// granted the pool's floor of credits and lends nothing.
async fn serve_pooled(
    device: Device,
    config: Config,
    handlers: Arc<HashMap<u32, Handler>>,
    pool: &Arc<ReceivePool>,
    req: rdma_rpc_transport::ConnectRequest,
    shutdown: Option<Arc<Shutdown>>,
) -> Result<(), RpcError> {
    let config = config.on(&device);
    let mut mine = Hello::from(&config);
    mine.credits = driver::POOL_FLOOR;
    mine.flags |= Hello::LENDS_NOTHING;
    let Some(theirs) = Hello::decode(req.private_data()) else {
        req.reject();
        return Err(RpcError::Protocol("connect request without an rdma-rpc hello".into()));
    };
    // The connection's completions go to a CQ it shares with others of the pool's.
    let seat = match pool.groups.place() {
        Ok(seat) => seat,
        Err(e) => {
            req.reject_with(&format!("its set-up failed: {}", e.report()));
            return Err(e);
        }
    };
    let opts = QpOptions::new(&pool.pd, seat.cq())
        .srq(&pool.srq)
        .caps(qp_caps(&device, &config));
    let mut link = Link::default();
    let mut hello = mine.encode();
    if link.pair(req.private_data().get(Hello::LEN..)) {
        hello.extend_from_slice(&link.offer());
    }
    let qp = tokio::task::spawn_blocking(move || req.accept(&opts, &hello))
        .await
        .map_err(|e| RpcError::Transport(TransportError::new(format!("the accept task failed: {e}"))))?
        .map_err(|e| RpcError::Transport(TransportError::with("accepting a connection", e)))?;
    let mut session = handshake::session(&config, &mine, &theirs);
    limit(&mut session, &config);
    let mut conn = Conn::pooled(session, qp, seat, pool, &config)?;
    conn.link = link;
    run(conn, handlers, shutdown, &config).await;
    Ok(())
}

/// What a server's configuration bounds in each of its sessions.
fn limit(session: &mut crate::proto::Session, config: &Config) {
    session.limit_serving(
        config.max_concurrent_requests as usize,
        config.max_request_bytes_in_flight,
    );
    session.limit_reading(config.max_request_bytes_reading);
    session.limit_lent(config.lent_answer_timeout);
}

/// Serves a set-up connection until it ends.
async fn run(conn: Conn, handlers: Arc<HashMap<u32, Handler>>, shutdown: Option<Arc<Shutdown>>, config: &Config) {
    let role = ServerRole {
        buffers: conn.stash.buffers(),
        handlers,
        tasks: Tasks::new(),
        shutdown,
        going_away: false,
        idle_timeout: config.idle_timeout,
        last_request: tokio::time::Instant::now(),
    };
    driver::run(conn, role, config.mode).await;
}

type Done = (u32, Result<Response, RpcError>);

const ACCEPT_POLL: std::time::Duration = std::time::Duration::from_millis(100);

struct ServerRole {
    handlers: Arc<HashMap<u32, Handler>>,
    /// The connection's registered buffers, for handlers that answer from one.
    buffers: Buffers,
    /// Handlers that did not finish on their first poll.
    tasks: Tasks<Result<Response, RpcError>>,
    /// The server's shutdown, when it has one ([`Server::serve_with_shutdown`]).
    shutdown: Option<Arc<Shutdown>>,
    /// This connection's GoAway is queued.
    going_away: bool,
    /// [`Config::idle_timeout`](crate::Config::idle_timeout).
    idle_timeout: Option<std::time::Duration>,
    /// The last request's arrival (or the connection's start).
    last_request: tokio::time::Instant,
}

impl ServerRole {
    #[cold]
    fn go_away(&mut self, conn: &mut Conn) {
        if !self.going_away {
            self.going_away = true;
            conn.session.go_away();
        }
    }

    /// No request came for the idle timeout: a connection serving nothing is told to go
    /// (GoAway, then Close: its client's next call fails as not run); one that is still
    /// there a whole timeout after that (its peer took no Close) is dropped.
    #[cold]
    fn idle(&mut self, conn: &mut Conn) {
        let now = tokio::time::Instant::now();
        if conn.session.serving() > 0 {
            self.last_request = now; // busy, not idle: look again a timeout from now
        } else if !self.going_away {
            self.go_away(conn);
            self.last_request = now;
        } else {
            conn.lose(crate::proto::Lost::new(
                crate::proto::LostKind::Timeout,
                "idle: the peer neither called nor took the server's Close (Config::idle_timeout)",
            ));
        }
    }
}

/// The wait's word that the idle timeout passed.
struct Idle;

/// Hands a handler's result to the session: large responses are staged in a registered buffer
/// (or lent as they are, from a buffer of this connection), small ones from a buffer of this
/// connection are sent from it.
fn answer(conn: &mut Conn, call: u32, result: Result<Response, RpcError>) {
    if conn.session.lends_nothing() {
        return answer_unlent(conn, call, result);
    }
    let bytes = match result {
        Ok(Response::Buf(b)) => {
            let len = b.len();
            // Without a landing descriptor the route is never a copy.
            match conn
                .stash
                .stage_user(b, conn.session.registered_route(len, false), false)
            {
                Ok((Some(desc), buf)) => {
                    spans::payload("response", len, How::Lent);
                    return conn.session.respond(call, Ok(Payload::Lent { desc, buf }));
                }
                Ok((None, buf)) => {
                    spans::payload("response", len, How::SentFromBuffer);
                    return conn.session.respond(call, Ok(Payload::Placed { buf, len }));
                }
                // Another connection's buffer: copied, as a Vec is (and lent as one is).
                Err(b) => {
                    let how = if conn.session.is_rendezvous(len) {
                        How::CopiedAndLent
                    } else {
                        How::Copied
                    };
                    spans::payload("response", len, how);
                    Ok(b.to_vec())
                }
            }
        }
        Ok(Response::Bytes(v)) => Ok(v),
        Ok(Response::Bulk(b)) => {
            let len = b.len();
            // Lent when long, unless it goes into the caller's landing buffer (a Write from the
            // buffer carries a length prefix that a shared value has no room for).
            if !conn.lends_bulk(len) || conn.session.lands(call, len) {
                Ok(b.try_into_whole_vec().unwrap_or_else(|b| b.to_vec()))
            } else {
                let staged = conn.stash.lend_bulk(b).map(|(desc, buf, copied)| {
                    spans::payload("response", len, if copied { How::CopiedAndLent } else { How::Lent });
                    Payload::Lent { desc, buf }
                });
                return conn.session.respond(call, staged.map_err(|e| e.to_wire()));
            }
        }
        Err(e) => Err(e),
    };
    let result = match bytes {
        // Lent as it is where registering is cheap, unless it goes into the caller's landing
        // buffer: a Write from the buffer carries the length prefix a copy has room for.
        Ok(bytes) if conn.session.is_rendezvous(bytes.len()) => {
            let staged = if conn.session.lands(call, bytes.len()) {
                conn.stash.lend(&bytes)
            } else {
                conn.stash.lend_vec(bytes)
            };
            staged.map(|(desc, buf)| Payload::Lent { desc, buf })
        }
        Ok(bytes) => Ok(Payload::Eager(bytes)),
        Err(e) => Err(e),
    };
    conn.session.respond(call, result.map_err(|e| e.to_wire()));
}

/// [`answer`] on a connection that lends nothing (a server on a receive pool): every answer
/// is copied into the message, and one above the threshold goes in pieces, or is written into
/// the caller's landing buffer from a buffer no peer can reach.
fn answer_unlent(conn: &mut Conn, call: u32, result: Result<Response, RpcError>) {
    let bytes = match result {
        Ok(Response::Buf(b)) => {
            spans::payload("response", b.len(), How::Copied);
            Ok(b.to_vec())
        }
        Ok(Response::Bytes(v)) => Ok(v),
        Ok(Response::Bulk(b)) => {
            if b.is_registered() {
                spans::payload("response", b.len(), How::Copied);
            }
            Ok(b.try_into_whole_vec().unwrap_or_else(|b| b.to_vec()))
        }
        Err(e) => Err(e),
    };
    let result = match bytes {
        Ok(bytes) if conn.session.is_rendezvous(bytes.len()) && conn.session.lands(call, bytes.len()) => {
            conn.stash.lend(&bytes).map(|(desc, buf)| Payload::Lent { desc, buf })
        }
        Ok(bytes) => Ok(Payload::Eager(bytes)),
        Err(e) => Err(e),
    };
    conn.session.respond(call, result.map_err(|e| e.to_wire()));
}

impl Role for ServerRole {
    #[inline]
    fn drain_inputs(&mut self, conn: &mut Conn) -> bool {
        let mut busy = false;
        if !self.going_away && self.shutdown.as_ref().is_some_and(|s| s.started()) {
            self.go_away(conn);
            busy = true;
        }
        // Results of aborted calls are dropped: the session answered those already.
        busy | self.tasks.drain(|call, result| answer(conn, call, result))
    }

    fn on_event(&mut self, conn: &mut Conn, ev: Event) {
        match ev {
            Event::Request {
                call,
                method,
                payload,
                budget,
            } => {
                if self.idle_timeout.is_some() {
                    self.last_request = tokio::time::Instant::now();
                }
                // First the body, so that a held buffer goes back even when no handler runs.
                let body = match payload {
                    RequestBody::Bytes(b) => Body::Bytes(b),
                    RequestBody::Inline(b) => Body::Inline(b),
                    RequestBody::InSlot { slot, range } => match conn.slot_body(slot, range) {
                        Some(r) => Body::Registered(r),
                        None => {
                            let e = RpcError::Internal("the request's receive slot went missing".into());
                            conn.session.respond(call, Err(e.to_wire()));
                            return;
                        }
                    },
                    RequestBody::Held { buf, len } => match conn.stash.hand_out_body(buf, len) {
                        Some(b) => b,
                        None => {
                            let e = RpcError::Internal("the request's buffer went missing".into());
                            conn.session.respond(call, Err(e.to_wire()));
                            return;
                        }
                    },
                };
                // Cancelled (or answered) in the messages that came with it: nobody waits for
                // its answer, so its handler does not start.
                if !conn.session.awaits_answer(call) {
                    return;
                }
                let span = crate::spans::serve(method, call, body.len(), budget);
                // Called through the shared table: no reference count touched per request.
                let Some(h) = self.handlers.get(&method) else {
                    conn.session
                        .respond(call, Err(RpcError::UnknownMethod(method).to_wire()));
                    return;
                };
                // The deadline the session placed, only for a request that carries a budget.
                let deadline = budget.and_then(|_| conn.session.served_deadline(call));
                // Past it before the handler starts (the request waited behind others, or
                // its budget was shorter than getting here): not run, and the caller is told so.
                if deadline.is_some_and(|d| d <= std::time::Instant::now()) {
                    let why = "the deadline passed before the handler started: the call was not run";
                    conn.session.respond(call, Err(ErrorReply::new(Status::Expired, why)));
                    return;
                }
                let h = match h {
                    Handler::Async(h) => h,
                    Handler::Sync(h) => {
                        let answered = {
                            let _enter = span.as_ref().map(tracing::Span::enter);
                            let run = || context::scoped(deadline, || h(&body, &self.buffers));
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                        };
                        answer(conn, call, or_panic(answered));
                        // Now, unless more requests wait to be run: then after the last of
                        // them, all in one batch (the driver flushes after the events).
                        if !conn.session.has_event() {
                            conn.send_pending();
                        }
                        // After the response is out: a request kept in its receive slot goes
                        // back to the ring off the round trip's path.
                        drop(body);
                        return;
                    }
                };
                // A handler may panic while it makes its future, before any of it runs as a
                // future: that fails this call alone, as a panic inside the future does.
                let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(body, &self.buffers, deadline)));
                let mut fut = match made {
                    Ok(fut) => CatchUnwind(fut),
                    Err(p) => {
                        answer(conn, call, or_panic(Err(p)));
                        return;
                    }
                };
                // A handler that finishes on its first poll (most do) is answered right here, with
                // no task and no thread hop; the others continue in a task of their own.
                let first = {
                    let _enter = span.as_ref().map(tracing::Span::enter);
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    Pin::new(&mut fut).poll(&mut cx)
                };
                if let std::task::Poll::Ready(r) = first {
                    answer(conn, call, or_panic(r));
                    // The response goes out now (or with the answers to the requests that
                    // came with it, after the last); the handler's future and the request are
                    // dropped after it, off the round trip's path.
                    if !conn.session.has_event() {
                        conn.send_pending();
                    }
                    return;
                }
                // Aborting the task (cancel, deadline) drops the handler and sends nothing.
                self.tasks.spawn(
                    call,
                    async move { or_panic(fut.await) }.instrument(span.unwrap_or_else(tracing::Span::none)),
                );
            }
            Event::Abort { call } => {
                self.tasks.abort(call);
            }
            Event::CallDone { .. } => {}
        }
    }

    async fn wait_input(&mut self) -> Option<RoleInput> {
        let shutdown = self.shutdown.clone().filter(|_| !self.going_away);
        let stop = async move {
            match shutdown {
                Some(s) => s.wait().await,
                None => std::future::pending().await,
            }
        };
        let idle_at = self.idle_timeout.map(|t| self.last_request + t);
        let idle = async move {
            match idle_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            d = self.tasks.recv() => d.map(|d| Box::new(d) as RoleInput),
            () = stop => Some(Box::new(GoAway)),
            () = idle => Some(Box::new(Idle)),
        }
    }

    fn on_input(&mut self, conn: &mut Conn, input: RoleInput) {
        match input.downcast::<Done>() {
            Ok(d) => {
                let (call, result) = *d;
                answer(conn, call, result);
            }
            Err(other) => {
                if other.is::<GoAway>() {
                    self.go_away(conn);
                } else if other.is::<Idle>() {
                    self.idle(conn);
                }
            }
        }
    }

    #[inline]
    fn finished(&self, conn: &Conn) -> bool {
        self.going_away && conn.closed()
    }

    fn on_lost(&mut self, _why: &crate::proto::Lost) {
        self.tasks.abort_all();
    }
}
