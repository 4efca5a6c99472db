//! Connection management: a listener and `connect()` that yield connected queue pairs, carrying
//! a few bytes of private data each way (rdma_cm on verbs, a TCP handshake on `tcp`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{Device, Error, QpOptions, QueuePair, RecvWr, Result};

/// The most private data either side may carry (the rdma_cm limit for an RC connect on IB/RoCE).
pub const MAX_PRIVATE_DATA: usize = 56;

/// The longest reason a rejection carries ([`ConnectRequest::reject_with`]): what IB CM's
/// REJ message has room for, with a length byte. A longer reason keeps its first 40 bytes and
/// its end, where an error chain's root cause is, with `...` between (cut at character
/// boundaries).
pub const MAX_REJECT_REASON: usize = 140;

/// `reason`, within [`MAX_REJECT_REASON`] bytes: its start and its end when longer.
pub(crate) fn reject_reason(reason: &str) -> Vec<u8> {
    const HEAD: usize = 40;
    if reason.len() <= MAX_REJECT_REASON {
        return reason.as_bytes().to_vec();
    }
    let mut head = HEAD;
    while !reason.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = reason.len() - (MAX_REJECT_REASON - 3 - head);
    while !reason.is_char_boundary(tail) {
        tail += 1;
    }
    let mut out = reason.as_bytes()[..head].to_vec();
    out.extend_from_slice(b"...");
    out.extend_from_slice(&reason.as_bytes()[tail..]);
    out
}

/// The error a connecting side gets for a rejection that carried `reason` (none: `Rejected`).
pub(crate) fn rejected(reason: &[u8]) -> Error {
    if reason.is_empty() {
        Error::Rejected
    } else {
        Error::RejectedWith(String::from_utf8_lossy(reason).into_owned())
    }
}

/// What a software provider's connect says when the peer's half of the handshake never came.
pub(crate) const NO_HANDSHAKE: &str = "waiting for the peer's handshake (a peer that is not rdma-rpc on this provider never sends one: check the address and the provider)";

fn check_private(data: &[u8]) -> Result<()> {
    if data.len() > MAX_PRIVATE_DATA {
        return Err(Error::PrivateDataTooLong {
            len: data.len(),
            max: MAX_PRIVATE_DATA,
        });
    }
    Ok(())
}

/// Listens for queue-pair connections on an address.
///
/// # Examples
/// ```
/// use std::time::Duration;
/// use rdma_rpc_transport::{connect, Device, Listener, QpOptions};
/// let dev = Device::open("tcp")?;
/// let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(64)?);
/// let listener = Listener::bind(&dev, "127.0.0.1:0".parse().unwrap())?;
/// let addr = listener.local_addr()?;
/// let opts = QpOptions::new(&pd, &cq);
/// let server = std::thread::spawn({
///     let opts = opts.clone();
///     move || {
///         let req = listener.accept(Some(Duration::from_secs(5)))?;
///         assert_eq!(req.private_data(), b"hello");
///         req.accept(&opts, b"welcome")
///     }
/// });
/// let (qp, reply) = connect(addr, &opts, b"hello", Duration::from_secs(5))?;
/// assert_eq!(reply, b"welcome");
/// let _server_qp = server.join().unwrap()?;
/// # drop(qp);
/// # Ok::<(), rdma_rpc_transport::Error>(())
/// ```
pub struct Listener {
    device: Device,
    imp: Box<dyn crate::provider::ListenerOps>,
}

impl Listener {
    /// Binds to `addr` (port 0 picks a free port). On verbs, the address must be an IP of an RDMA
    /// device's netdev (or unspecified).
    ///
    /// # Errors
    /// Socket or rdma_cm errors.
    pub fn bind(device: &Device, addr: SocketAddr) -> Result<Self> {
        let imp = device.inner.imp.bind(device, addr)?;
        Ok(Self {
            device: device.clone(),
            imp,
        })
    }

    /// The bound address (with the port picked).
    ///
    /// # Errors
    /// Socket errors.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.imp.local_addr()
    }

    /// The device connections arrive on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Waits for the next connection request (up to `timeout`, or forever with `None`).
    ///
    /// # Errors
    /// [`Error::Timeout`]; socket or rdma_cm errors. A peer whose handshake fails (not rdma-rpc,
    /// another version, silent for 10 s) is dropped without holding up other connections, and
    /// `accept` goes on waiting.
    pub fn accept(&self, timeout: Option<Duration>) -> Result<ConnectRequest> {
        let imp = self.imp.accept(timeout)?;
        Ok(ConnectRequest {
            private_data: imp.private_data().to_vec(),
            peer: imp.peer(),
            imp,
        })
    }
}

/// An incoming connection: read its private data, then accept or reject it (either consumes it).
pub struct ConnectRequest {
    private_data: Vec<u8>,
    peer: Option<SocketAddr>,
    imp: Box<dyn crate::provider::RequestOps>,
}

impl ConnectRequest {
    /// The private data the peer sent with its request.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The peer's address, when known.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Creates a QP from `opts`, connects it to the peer, and sends `private_data` back.
    ///
    /// # Errors
    /// [`Error::PrivateDataTooLong`], invalid options, provider errors.
    pub fn accept(self, opts: &QpOptions, private_data: &[u8]) -> Result<QueuePair> {
        self.accept_with_recvs(opts, private_data, Vec::new())
    }

    /// As [`ConnectRequest::accept`], with `recvs` posted before the peer learns the connection
    /// is up: its first Send always finds a receive.
    ///
    /// # Errors
    /// As [`ConnectRequest::accept`]; [`Error::QueueFull`] for more receives than the queue.
    ///
    /// When this side's set-up fails (out of file descriptors or memory, say), the peer is
    /// refused with the error's message as the reason ([`ConnectRequest::reject_with`]), so
    /// that its `connect` says what went wrong here instead of seeing the connection close.
    pub fn accept_with_recvs(self, opts: &QpOptions, private_data: &[u8], recvs: Vec<RecvWr>) -> Result<QueuePair> {
        if let Err(e) = check_private(private_data).and_then(|()| opts.validate()) {
            self.reject_with(&set_up_failed(&e));
            return Err(e);
        }
        // The provider refuses the peer itself when its part fails (it holds the reply's way).
        let c = self.imp.accept(opts)?;
        let (qp, pending) = (QueuePair::new(c.qp, c.qp_num, opts.clone()), c.pending);
        if let Err(e) = qp.post_recv_batch(recvs) {
            pending.refuse(&set_up_reason(&e.error));
            return Err(e.error);
        }
        pending.finish(private_data)?;
        Ok(qp)
    }

    /// Refuses the connection; the peer's `connect` fails with [`Error::Rejected`].
    pub fn reject(self) {
        self.reject_with("");
    }

    /// Refuses the connection and says why; the peer's `connect` fails with
    /// [`Error::RejectedWith`] carrying `reason` (at most [`MAX_REJECT_REASON`] bytes of it;
    /// an empty one gives [`Error::Rejected`]). For a failure of this side's own set-up, which
    /// the peer cannot fix but should not mistake for a network fault.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rdma_rpc_transport::{connect, Device, Error, Listener, QpOptions};
    /// let dev = Device::open("tcp")?;
    /// let listener = Listener::bind(&dev, "127.0.0.1:0".parse().unwrap())?;
    /// let addr = listener.local_addr()?;
    /// let server = std::thread::spawn(move || -> rdma_rpc_transport::Result<()> {
    ///     listener.accept(Some(Duration::from_secs(5)))?.reject_with("out of memory for rings");
    ///     Ok(())
    /// });
    /// let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(16)?);
    /// match connect(addr, &QpOptions::new(&pd, &cq), b"", Duration::from_secs(5)) {
    ///     Err(Error::RejectedWith(why)) => assert_eq!(why, "out of memory for rings"),
    ///     other => panic!("{:?}", other.map(|_| ())),
    /// }
    /// server.join().unwrap()?;
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn reject_with(self, reason: &str) {
        let reason = reject_reason(reason);
        self.imp.reject(&reason);
    }
}

/// The reason a peer is refused with when this side's set-up of its connection failed.
pub(crate) fn set_up_failed(e: &Error) -> String {
    format!("its set-up failed: {}", crate::Report(e))
}

/// [`set_up_failed`]'s reason as the bytes a refusal carries ([`reject_reason`]).
pub(crate) fn set_up_reason(e: &Error) -> Vec<u8> {
    reject_reason(&set_up_failed(e))
}

/// Connects a new QP, made from `opts`, to a listener at `addr`, sending `private_data`.
/// Returns the QP and the private data of the peer's accept.
///
/// # Errors
/// [`Error::Rejected`] when the listener refused without a reason, [`Error::RejectedWith`] when
/// it said why (a server whose own set-up of the connection failed says what failed),
/// [`Error::Timeout`], [`Error::PrivateDataTooLong`], invalid options, provider errors
/// (address or route resolution on verbs).
pub fn connect(
    addr: impl ToSocketAddrs,
    opts: &QpOptions,
    private_data: &[u8],
    timeout: Duration,
) -> Result<(QueuePair, Vec<u8>)> {
    connect_with_recvs(addr, opts, private_data, timeout, Vec::new())
}

/// As [`connect`], with `recvs` posted before the connection is established.
///
/// # Errors
/// As [`connect`]; [`Error::QueueFull`] for more receives than the queue.
pub fn connect_with_recvs(
    addr: impl ToSocketAddrs,
    opts: &QpOptions,
    private_data: &[u8],
    timeout: Duration,
    recvs: Vec<RecvWr>,
) -> Result<(QueuePair, Vec<u8>)> {
    check_private(private_data)?;
    opts.validate()?;
    let addr = addr
        .to_socket_addrs()
        .map_err(|e| Error::io("resolving the address", e))?
        .next()
        .ok_or_else(|| Error::InvalidArgument("address resolves to nothing".into()))?;
    let c = opts.pd.device().inner.imp.connect(addr, opts, private_data, timeout)?;
    let (qp, pending) = (QueuePair::new(c.qp, c.qp_num, opts.clone()), c.pending);
    qp.post_recv_batch(recvs).map_err(|e| e.error)?;
    let data = pending.finish(private_data)?;
    Ok((qp, data))
}
