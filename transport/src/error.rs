//! The transport layer's one error type.

use std::io;

/// Everything that can go wrong in the transport layer, outside completions.
///
/// Failures of posted work requests are not errors of this type: they arrive as completions
/// with a [`WcStatus`](crate::WcStatus), exactly as on a NIC.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The provider spec is not one of `tcp`, `shm`, `shm:any-user`, `verbs` or `verbs:<device>`.
    #[error("unknown provider {0:?}: use `tcp`, `shm`, `shm:any-user`, `verbs` or `verbs:<device>` (e.g. in RDMA_RPC_PROVIDER)")]
    UnknownProvider(String),
    /// The provider exists but was left out of this build.
    #[error("provider {0} is not compiled in: enable the cargo feature `{0}`")]
    ProviderNotBuilt(&'static str),
    /// No RDMA device was found, or not the one that was named.
    #[error("no RDMA device {wanted}: {detail}. Without an RDMA card use provider `tcp` (any hosts) or `shm` (processes on one host), or soft-RoCE (`rdma link add rxe0 type rxe netdev <if>`)")]
    NoDevice {
        /// The device asked for ("any" when none was named).
        wanted: String,
        /// What the system said.
        detail: String,
    },
    /// A verbs call failed.
    #[error("{call} failed")]
    Verbs {
        /// The libibverbs / librdmacm function.
        call: &'static str,
        /// errno as an I/O error.
        #[source]
        source: io::Error,
    },
    /// A socket operation of a software provider or of connection setup failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The argument is outside what the device or the API allows.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The memory for a region could not be had (the allocator refused it), as `ibv_reg_mr`
    /// fails with ENOMEM.
    #[error("cannot allocate {len} bytes for a memory region: register less, or free memory first")]
    OutOfMemory {
        /// The region's length.
        len: usize,
    },
    /// More work requests are outstanding than the queue was created for.
    #[error("{queue} queue full ({depth} work requests outstanding): reap completions before posting more, or create the QP with a deeper queue")]
    QueueFull {
        /// "send" or "receive".
        queue: &'static str,
        /// The queue depth.
        depth: u32,
    },
    /// Inline data longer than the QP's `max_inline_data`.
    #[error("inline send of {len} bytes exceeds max_inline_data {max}: send it from a registered buffer without the inline flag")]
    InlineTooLarge {
        /// Requested length.
        len: usize,
        /// The QP's limit.
        max: u32,
    },
    /// A message longer than the device's maximum message size.
    #[error("message of {len} bytes exceeds the device's max_msg_size {max}")]
    MessageTooLarge {
        /// Requested length.
        len: usize,
        /// Device limit.
        max: u64,
    },
    /// The device cannot do atomics.
    #[error("device {0} has no atomic capability")]
    AtomicsUnsupported(String),
    /// Private data larger than connection management can carry.
    #[error("private data of {len} bytes exceeds the limit of {max} bytes")]
    PrivateDataTooLong {
        /// Given length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Nothing of this provider listens at the address: the connection was refused. The hint
    /// names the likely cause (a server of another provider there, one not started); the
    /// operating system's error is the [`source`](std::error::Error::source)
    /// ([`Error::io_error`]: `ConnectionRefused`).
    #[error("nothing listens at {addr} on provider {provider}: {hint}")]
    Refused {
        /// The address connected to.
        addr: std::net::SocketAddr,
        /// This side's provider.
        provider: &'static str,
        /// What to check.
        hint: String,
        /// The refusal.
        #[source]
        source: io::Error,
    },
    /// The peer refused the connection.
    #[error("connection rejected by the peer")]
    Rejected,
    /// The peer refused the connection and said why: typically its own set-up of the
    /// connection failed (out of file descriptors or memory), which its operator can fix.
    /// Nothing was connected.
    #[error("connection rejected by the peer: {0}")]
    RejectedWith(String),
    /// The `shm` peer is a process of another user, and the device was opened as `shm`, which
    /// connects processes of one user only. Nothing was connected.
    #[error("the shm peer runs as uid {peer}, this process as uid {own}: `shm` connects processes of one user; open the device as `shm:any-user` to allow others")]
    PeerUser {
        /// The peer's user id.
        peer: u32,
        /// This process's effective user id.
        own: u32,
    },
    /// The peer did not answer in time.
    #[error("timed out while {0}")]
    Timeout(&'static str),
    /// The peer spoke something other than this protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Completion waiting needs a tokio runtime with IO enabled.
    #[error("no tokio runtime with IO enabled: call from within a tokio runtime built with enable_io()")]
    NoRuntime,
}

/// An error and its sources on one line, `a: b: c`, for people: each error of this crate (and
/// of `rdma-rpc-core`) says only its own part and gives its cause as its
/// [`source`](std::error::Error::source), so `{}` alone shows the outermost part.
///
/// ```
/// use rdma_rpc_transport::{connect, Device, QpOptions, Report};
/// let dev = Device::open("tcp")?;
/// let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(4)?);
/// let err = connect("127.0.0.1:1", &QpOptions::new(&pd, &cq), b"", std::time::Duration::from_secs(5))
///     .err()
///     .expect("nothing listens on port 1");
/// let line = Report(&err).to_string();
/// assert!(line.starts_with("nothing listens at 127.0.0.1:1 on provider tcp: "), "{line}");
/// assert!(line.ends_with("(os error 111)"), "the operating system's words last: {line}");
/// # Ok::<(), rdma_rpc_transport::Error>(())
/// ```
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut at = self.0.source();
        while let Some(e) = at {
            write!(f, ": {e}")?;
            at = e.source();
        }
        Ok(())
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(context: &'static str, source: io::Error) -> Self {
        Error::Io { context, source }
    }

    /// A connection to `addr` on `provider` that failed with `source`: [`Error::Refused`], with
    /// its likely cause, when nothing listened; [`Error::Io`] otherwise.
    pub(crate) fn connecting(addr: std::net::SocketAddr, provider: &'static str, source: io::Error) -> Self {
        if source.kind() == io::ErrorKind::ConnectionRefused {
            let hint = crate::listening::refused_hint(addr, provider);
            return Error::Refused {
                addr,
                provider,
                hint,
                source,
            };
        }
        Error::io("connecting", source)
    }

    /// The operating system's error under this one (a socket's, or a verbs call's errno), if
    /// any: its [`kind`](io::Error::kind) tells e.g. a refused connection
    /// (`ConnectionRefused`) from a taken port (`AddrInUse`).
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            Error::Io { source, .. } | Error::Verbs { source, .. } | Error::Refused { source, .. } => Some(source),
            _ => None,
        }
    }
}
