//! The client: a handle to one connection's driver task.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rdma_rpc_transport::{Device, QpCaps, QpOptions};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::config::{CallOptions, Config, Hello};
use crate::driver::{self, Conn, Role, RoleInput};
use crate::proto::{Event, Payload, Reply, Session, SessionConfig, LANDING_PREFIX};
use crate::RpcError;

type ReplyTx = oneshot::Sender<Result<Vec<u8>, RpcError>>;

enum Cmd {
    Call {
        ticket: u64,
        method: u32,
        payload: Vec<u8>,
        opts: CallOptions,
        reply: ReplyTx,
    },
    Cancel {
        ticket: u64,
    },
}

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
    tx: mpsc::UnboundedSender<Cmd>,
    tickets: Arc<AtomicU64>,
    lost: Arc<parking_lot::Mutex<Option<String>>>,
}

impl Client {
    /// Connects to a server at `addr` on `device` and starts the connection's driver task.
    /// Must be called within a tokio runtime (with IO and time enabled).
    ///
    /// # Errors
    /// [`RpcError::Transport`] when the connection cannot be made; [`RpcError::Protocol`]
    /// when the peer is not an rdma-rpc server of this version.
    pub async fn connect(device: &Device, addr: SocketAddr, config: Config) -> Result<Client, RpcError> {
        let tr = |e: rdma_rpc_transport::Error| RpcError::Transport(e.to_string());
        let pd = device.alloc_pd().map_err(tr)?;
        let cq = device.create_cq(config.ring * 4 + 64).map_err(tr)?;
        let mine = Hello::from_config(&config);
        let slot = slot_size(&config);
        let recvs = Conn::ring(&pd, config.ring, slot)?;
        let opts = QpOptions::new(&pd, &cq).caps(qp_caps(device, &config));
        let timeout = config.connect_timeout;
        let (qp, reply) = tokio::task::spawn_blocking(move || {
            rdma_rpc_transport::connect_with_recvs(addr, &opts, &mine.encode(), timeout, recvs)
        })
        .await
        .map_err(|e| RpcError::Transport(format!("connect task: {e}")))?
        .map_err(tr)?;
        let theirs = Hello::decode(&reply).ok_or_else(|| RpcError::Protocol("not an rdma-rpc server".into()))?;
        let session = Session::new(agree(&mine, &theirs));
        let conn = Conn::new(session, &pd, qp, cq, slot, config.isolation)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let lost = Arc::new(parking_lot::Mutex::new(None));
        let role = ClientRole {
            rx,
            open: true,
            by_ticket: HashMap::new(),
            by_call: HashMap::new(),
            lost: lost.clone(),
        };
        tokio::spawn(driver::run(conn, role, config.mode));
        Ok(Client {
            tx,
            tickets: Arc::new(AtomicU64::new(1)),
            lost,
        })
    }

    /// Calls `method` with `payload`; returns the response bytes.
    ///
    /// # Errors
    /// Any [`RpcError`]: the server's (unknown method, handler panic, application error, ...),
    /// the deadline, or the connection's loss.
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told and aborts the handler. Buffers
    /// the server may still read stay registered and untouched until it is done with them.
    pub async fn call(&self, method: u32, payload: Vec<u8>) -> Result<Vec<u8>, RpcError> {
        self.call_with(method, payload, CallOptions::default()).await
    }

    /// As [`Client::call`], with a deadline and a response-size hint.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub async fn call_with(&self, method: u32, payload: Vec<u8>, opts: CallOptions) -> Result<Vec<u8>, RpcError> {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let span = tracing::debug_span!("rpc.call", method, ticket, len = payload.len());
        let (reply, rx) = oneshot::channel();
        let cmd = Cmd::Call {
            ticket,
            method,
            payload,
            opts,
            reply,
        };
        if self.tx.send(cmd).is_err() {
            return Err(self.lost_error());
        }
        let mut guard = CancelOnDrop {
            tx: &self.tx,
            ticket,
            armed: true,
        };
        let r = rx.instrument(span).await;
        guard.armed = false;
        r.unwrap_or_else(|_| Err(self.lost_error()))
    }

    fn lost_error(&self) -> RpcError {
        RpcError::ConnectionLost(self.lost.lock().clone().unwrap_or_else(|| "connection closed".into()))
    }
}

struct CancelOnDrop<'a> {
    tx: &'a mpsc::UnboundedSender<Cmd>,
    ticket: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Cmd::Cancel { ticket: self.ticket });
        }
    }
}

pub(crate) fn slot_size(c: &Config) -> usize {
    SessionConfig {
        ring: c.ring,
        eager_max: c.eager_threshold,
        max_payload: c.max_payload,
    }
    .slot_size()
}

pub(crate) fn qp_caps(device: &Device, c: &Config) -> QpCaps {
    QpCaps {
        max_send_wr: (c.ring * 2 + 64).min(device.caps().max_qp_wr),
        max_recv_wr: c.ring.min(device.caps().max_qp_wr),
        max_inline_data: device.caps().max_inline_data.min(256),
    }
}

/// Both sides use the smaller threshold and limit, and send into the peer's ring.
pub(crate) fn agree(mine: &Hello, theirs: &Hello) -> SessionConfig {
    SessionConfig {
        ring: theirs.ring,
        eager_max: mine.eager_threshold.min(theirs.eager_threshold) as usize,
        max_payload: mine.max_payload.min(theirs.max_payload),
    }
}

struct ClientRole {
    rx: mpsc::UnboundedReceiver<Cmd>,
    open: bool,
    by_ticket: HashMap<u64, u32>,
    by_call: HashMap<u32, (u64, ReplyTx)>,
    lost: Arc<parking_lot::Mutex<Option<String>>>,
}

impl ClientRole {
    fn on_cmd(&mut self, conn: &mut Conn, cmd: Cmd) {
        match cmd {
            Cmd::Call {
                ticket,
                method,
                payload,
                opts,
                reply,
            } => {
                let mut staged = Vec::new();
                let result = (|| {
                    let p = if conn.session.is_rendezvous(payload.len()) {
                        let (desc, buf) = conn.stash.lend(&payload)?;
                        staged.push(buf);
                        Payload::Lent { desc, buf }
                    } else {
                        Payload::Eager(payload)
                    };
                    let landing = match opts.response_hint {
                        Some(h) if conn.session.is_rendezvous(h) => {
                            let want = h.saturating_add(LANDING_PREFIX);
                            let (buf, mr) = conn.stash.take(want)?;
                            let mut desc = mr.remote();
                            desc.len = want as u64;
                            staged.push(buf);
                            Some((desc, buf))
                        }
                        _ => None,
                    };
                    conn.session
                        .start_call(method, p, landing, opts.deadline, Instant::now())
                })();
                match result {
                    Ok(call) => {
                        self.by_ticket.insert(ticket, call);
                        self.by_call.insert(call, (ticket, reply));
                    }
                    Err(e) => {
                        for b in staged {
                            conn.stash.release(b);
                        }
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Cmd::Cancel { ticket } => {
                if let Some(call) = self.by_ticket.remove(&ticket) {
                    self.by_call.remove(&call);
                    conn.session.cancel(call);
                }
            }
        }
    }
}

impl Role for ClientRole {
    fn drain_inputs(&mut self, conn: &mut Conn) -> bool {
        let mut any = false;
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    self.on_cmd(conn, cmd);
                    any = true;
                }
                Err(mpsc::error::TryRecvError::Empty) => return any,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.open = false;
                    return any;
                }
            }
        }
    }

    fn on_event(&mut self, conn: &mut Conn, ev: Event) {
        if let Event::CallDone { call, result } = ev {
            let result = result.and_then(|r| match r {
                Reply::Bytes(b) => Ok(b),
                Reply::Landed { buf } => conn.stash.landed(buf),
            });
            if let Some((ticket, reply)) = self.by_call.remove(&call) {
                self.by_ticket.remove(&ticket);
                let _ = reply.send(result);
            }
        }
    }

    async fn wait_input(&mut self) -> Option<RoleInput> {
        if !self.open {
            return std::future::pending().await;
        }
        match self.rx.recv().await {
            Some(cmd) => Some(Box::new(cmd)),
            None => {
                self.open = false;
                None
            }
        }
    }

    fn on_input(&mut self, conn: &mut Conn, input: RoleInput) {
        if let Ok(cmd) = input.downcast::<Cmd>() {
            self.on_cmd(conn, *cmd);
        }
    }

    fn finished(&self, conn: &Conn) -> bool {
        !self.open && self.by_call.is_empty() && conn.session.pending_calls() == 0
    }

    fn on_lost(&mut self, why: &str) {
        *self.lost.lock() = Some(why.to_owned());
        for (_, (_, reply)) in self.by_call.drain() {
            let _ = reply.send(Err(RpcError::ConnectionLost(why.to_owned())));
        }
        self.by_ticket.clear();
        self.rx.close();
        while let Ok(cmd) = self.rx.try_recv() {
            if let Cmd::Call { reply, .. } = cmd {
                let _ = reply.send(Err(RpcError::ConnectionLost(why.to_owned())));
            }
        }
    }
}
