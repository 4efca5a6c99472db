//! A handle that outlives its connection: it connects again, with bounded back-off, when the
//! connection it has is lost or its server shuts down, as tonic's `Channel` does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc_transport::Device;

use crate::buf::Body;
use crate::client::Request;
use crate::config::{CallOptions, Config};
use crate::{Client, RpcError};

/// How a [`Channel`] connects again.
///
/// ```
/// use std::time::Duration;
/// let patient = rdma_rpc_core::Reconnect { give_up_after: Duration::from_secs(60), ..Default::default() };
/// assert_eq!(patient.first_backoff, Duration::from_millis(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconnect {
    /// The wait after the first failed attempt; it doubles after each one, up to
    /// `max_backoff`. 10 ms by default.
    pub first_backoff: Duration,
    /// The longest wait between attempts; 1 s by default.
    pub max_backoff: Duration,
    /// How long a call waits for a connection before it fails with the last attempt's error;
    /// 10 s by default.
    pub give_up_after: Duration,
}

impl Default for Reconnect {
    fn default() -> Self {
        Self {
            first_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
            give_up_after: Duration::from_secs(10),
        }
    }
}

/// A handle to a server that connects again when its connection is lost or its server shuts
/// down: the next call after that waits for a new connection (with back-off, bounded by
/// [`Reconnect::give_up_after`]) and goes over it. Cheap to clone; clones share the
/// connection.
///
/// It never repeats a call. The calls in flight when a connection is lost fail, each saying
/// whether it may have run: [`RpcError::ConnectionLost`] (its request had left: it may have
/// run), [`RpcError::Unsent`] or [`RpcError::ShuttingDown`] (it did not run;
/// [`RpcError::did_not_run`]). Retrying is the caller's choice.
///
/// # Examples
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use rdma_rpc_core::{transport::Device, Channel, Config, Reconnect, RpcError, Server};
/// let dev = Device::open("tcp")?;
/// let echo = || Server::builder(Config::default()).handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) });
/// let server = echo().bind(&dev, "127.0.0.1:0".parse()?)?;
/// let addr = server.local_addr()?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let serving = tokio::spawn(server.serve_with_shutdown(async move {
///     let _ = stopped.await;
/// }));
/// let channel = Channel::connect(&dev, addr, Config::default(), Reconnect::default()).await?;
/// assert_eq!(channel.call(1, b"one".to_vec()).await?, b"one");
/// // The server shuts down and comes back on the same address.
/// stop.send(()).ok();
/// serving.await??;
/// tokio::spawn(echo().bind(&dev, addr)?.serve());
/// // The next call goes over a new connection.
/// assert_eq!(channel.call(1, b"two".to_vec()).await?, b"two");
/// assert_eq!(channel.reconnects(), 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
    /// What every call of this handle carries ([`Channel::with_options`]).
    opts: CallOptions,
}

struct Inner {
    device: Device,
    addr: SocketAddr,
    config: Config,
    policy: Reconnect,
    /// The connection in use; a call checks it without waiting.
    current: parking_lot::Mutex<Client>,
    /// Held while connecting again, so that the calls that find the connection gone make one
    /// new connection, not one each.
    connecting: tokio::sync::Mutex<()>,
    reconnects: AtomicU64,
}

impl Channel {
    /// Connects to a server at `addr` on `device`; later connections use the same `config`,
    /// as `policy` says.
    ///
    /// # Errors
    /// As [`Client::connect`]: the first connection is made once, not retried.
    pub async fn connect(
        device: &Device,
        addr: SocketAddr,
        config: Config,
        policy: Reconnect,
    ) -> Result<Self, RpcError> {
        let client = Client::connect(device, addr, config.clone()).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                device: device.clone(),
                addr,
                config,
                policy,
                current: parking_lot::Mutex::new(client),
                connecting: tokio::sync::Mutex::new(()),
                reconnects: AtomicU64::new(0),
            }),
            opts: CallOptions::default(),
        })
    }

    /// The connection to call on: the one in use while it takes calls, else a new one.
    ///
    /// # Errors
    /// The last attempt's error when no connection could be made within
    /// [`Reconnect::give_up_after`]; at once for errors another attempt cannot mend
    /// ([`RpcError::Config`], [`RpcError::Protocol`]).
    pub async fn client(&self) -> Result<Client, RpcError> {
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        let _one = self.inner.connecting.lock().await;
        // Another call may have connected while this one waited.
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        let p = &self.inner.policy;
        let give_up = Instant::now() + p.give_up_after;
        let mut wait = p.first_backoff;
        loop {
            match Client::connect(&self.inner.device, self.inner.addr, self.inner.config.clone()).await {
                Ok(c) => {
                    *self.inner.current.lock() = c.clone();
                    self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e @ (RpcError::Config(_) | RpcError::Protocol(_))) => return Err(e),
                Err(e) if Instant::now() + wait > give_up => return Err(e),
                Err(_) => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(p.max_backoff);
                }
            }
        }
    }

    /// The connection in use, when it still takes calls.
    fn usable(&self) -> Option<Client> {
        let c = self.inner.current.lock().clone();
        c.is_connected().then_some(c)
    }

    /// How many times this channel connected again.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::Relaxed)
    }

    /// A handle on the same channel whose calls all carry `opts` (see
    /// [`Client::with_options`]).
    pub fn with_options(&self, opts: CallOptions) -> Channel {
        Channel {
            inner: self.inner.clone(),
            opts,
        }
    }

    /// The options every call of this handle carries.
    pub fn options(&self) -> &CallOptions {
        &self.opts
    }

    /// As [`Client::call`], on the channel's connection.
    ///
    /// # Errors
    /// As [`Client::call`], and as [`Channel::client`] when no connection can be made.
    pub async fn call(&self, method: u32, payload: impl Into<Request>) -> Result<Vec<u8>, RpcError> {
        let payload = payload.into();
        self.client()
            .await?
            .into_with_options(self.opts.clone())
            .call(method, payload)
            .await
    }

    /// As [`Client::call_body`], on the channel's connection.
    ///
    /// # Errors
    /// As [`Channel::call`].
    pub async fn call_body(&self, method: u32, payload: impl Into<Request>) -> Result<Body, RpcError> {
        let payload = payload.into();
        self.client()
            .await?
            .into_with_options(self.opts.clone())
            .call_body(method, payload)
            .await
    }

    /// As [`Client::call_body_opts`], on the channel's connection. Not a public API.
    #[doc(hidden)]
    pub async fn call_body_opts(&self, method: u32, payload: Vec<u8>, opts: CallOptions) -> Result<Body, RpcError> {
        self.client().await?.call_body_opts(method, payload, opts).await
    }

    /// As [`Client::call_bulk_tail`], on the channel's connection. Not a public API.
    #[doc(hidden)]
    pub async fn call_bulk_tail(
        &self,
        method: u32,
        bulk: crate::Bulk,
        tail: Vec<u8>,
        opts: CallOptions,
    ) -> Result<Body, RpcError> {
        self.client().await?.call_bulk_tail(method, bulk, tail, opts).await
    }
}
