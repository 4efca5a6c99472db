//! Opening a device by provider spec, and what it can do.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::{Error, Result};

/// The environment variable that names the default provider.
pub const PROVIDER_ENV: &str = "RDMA_RPC_PROVIDER";

/// Which provider implements the verbs: parsed from `tcp`, `shm`, `shm:any-user`, `verbs` or
/// `verbs:<device>`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProviderSpec {
    /// Software reliable connections over TCP: any two hosts, no RDMA card.
    Tcp,
    /// Software RDMA through shared memory: processes of one user on one host. Connections
    /// from or to a process of another user are refused.
    Shm,
    /// As [`ProviderSpec::Shm`], accepting processes of any user on the host (`shm:any-user`).
    /// Peers then reach the memory of this process's protection domains as any `shm` peer does:
    /// see the provider's trust model (`docs/guarantees.md`).
    ShmAnyUser,
    /// Real ibverbs + rdma_cm; `None` picks the first device.
    Verbs(Option<String>),
}

impl FromStr for ProviderSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "tcp" => Ok(ProviderSpec::Tcp),
            "shm" => Ok(ProviderSpec::Shm),
            "shm:any-user" => Ok(ProviderSpec::ShmAnyUser),
            "verbs" => Ok(ProviderSpec::Verbs(None)),
            other => match other.strip_prefix("verbs:") {
                Some(dev) if !dev.is_empty() => Ok(ProviderSpec::Verbs(Some(dev.to_owned()))),
                _ => Err(Error::UnknownProvider(other.to_owned())),
            },
        }
    }
}

impl fmt::Display for ProviderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProviderSpec::Tcp => f.write_str("tcp"),
            ProviderSpec::Shm => f.write_str("shm"),
            ProviderSpec::ShmAnyUser => f.write_str("shm:any-user"),
            ProviderSpec::Verbs(None) => f.write_str("verbs"),
            ProviderSpec::Verbs(Some(d)) => write!(f, "verbs:{d}"),
        }
    }
}

impl ProviderSpec {
    /// The spec in `RDMA_RPC_PROVIDER`, or `tcp` when it is unset or empty.
    ///
    /// # Errors
    /// [`Error::UnknownProvider`] when the variable holds something else.
    pub fn from_env() -> Result<Self> {
        match std::env::var(PROVIDER_ENV) {
            Ok(s) if !s.trim().is_empty() => s.parse(),
            _ => Ok(ProviderSpec::Tcp),
        }
    }
}

/// Limits and capabilities read from the device when it is opened, and honoured by posts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceCaps {
    /// Largest inline send a QP may ask for.
    pub max_inline_data: u32,
    /// Largest message (Send, Write or Read) in bytes.
    pub max_msg_size: u64,
    /// Whether CAS and FAA are available.
    pub atomics: bool,
    /// Deepest send or receive queue.
    pub max_qp_wr: u32,
    /// Deepest completion queue.
    pub max_cqe: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Payloads up to this size are cheaper to copy through Sends than to copy into a buffer
    /// the peer moves one-sided (an RDMA Read) on this provider, as the benchmark harness
    /// measures it (`recommended eager_threshold`); RPC layers take it as their default switch
    /// point. 16 KiB on verbs, where a NIC's Read spares the CPUs the copies; 128 MiB on shm,
    /// where both are CPU copies and the Read adds round trips and a copy of the whole payload;
    /// 128 KiB
    /// on tcp, where a rendezvous lends and reads into the application's vectors as they are
    /// ([`DeviceCaps::cheap_registration`]) and so copies nothing in user space, where eager
    /// copies into and out of its pieces.
    pub eager_hint: usize,
    /// The provider moves data on threads of its own (tcp: a reader per QP whenever nobody
    /// spins on its CQs, and a writer for what the socket does not take at once), as libfabric's
    /// auto progress: a thread that polls the CQ should give up its core between rounds of
    /// polls, or it takes the CPU those threads need. False for verbs (the NIC) and shm (the
    /// poster itself moves the bytes).
    pub progress_threads: bool,
    /// Registering memory costs no more than bookkeeping, and
    /// [`ProtectionDomain::register_vec`](crate::ProtectionDomain::register_vec) registers a
    /// vector where it is: an RPC layer may then lend an application's vector, or read into a
    /// fresh one, instead of copying through buffers registered ahead. True on tcp; false on
    /// verbs (`ibv_reg_mr` pins pages: a system call and page-table work each time) and on
    /// shm (a vector is copied into the shared arena).
    pub cheap_registration: bool,
}

/// An opened RDMA device of some provider. Cheap to clone.
///
/// # Examples
/// ```
/// let dev = rdma_rpc_transport::Device::open("tcp")?;
/// assert_eq!(dev.provider(), "tcp");
/// assert!(dev.caps().atomics);
/// # Ok::<(), rdma_rpc_transport::Error>(())
/// ```
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceShared>,
}

pub(crate) struct DeviceShared {
    pub(crate) spec: ProviderSpec,
    pub(crate) imp: Box<dyn crate::provider::DeviceOps>,
    /// Bytes registered through this device and not yet deregistered.
    pub(crate) registered: std::sync::atomic::AtomicU64,
}

impl Device {
    /// Opens a device by provider spec: `tcp`, `shm`, `shm:any-user`, `verbs` or `verbs:<device>`.
    ///
    /// # Errors
    /// [`Error::UnknownProvider`] for a bad spec, [`Error::NoDevice`] when verbs finds no device,
    /// [`Error::ProviderNotBuilt`] when the `verbs` feature is off.
    pub fn open(spec: &str) -> Result<Device> {
        Self::open_spec(&spec.parse()?)
    }

    /// Opens the device named by `RDMA_RPC_PROVIDER` (default `tcp`).
    ///
    /// # Errors
    /// As [`Device::open`].
    pub fn open_default() -> Result<Device> {
        Self::open_spec(&ProviderSpec::from_env()?)
    }

    /// Opens a device from a parsed spec.
    ///
    /// # Errors
    /// As [`Device::open`].
    pub fn open_spec(spec: &ProviderSpec) -> Result<Device> {
        Ok(Device {
            inner: Arc::new(DeviceShared {
                spec: spec.clone(),
                imp: crate::provider::open(spec)?,
                registered: Default::default(),
            }),
        })
    }

    /// The provider's name: `tcp`, `shm` or `verbs`.
    pub fn provider(&self) -> &'static str {
        match self.inner.spec {
            ProviderSpec::Tcp => "tcp",
            ProviderSpec::Shm | ProviderSpec::ShmAnyUser => "shm",
            ProviderSpec::Verbs(_) => "verbs",
        }
    }

    /// The spec this device was opened with.
    pub fn spec(&self) -> &ProviderSpec {
        &self.inner.spec
    }

    /// The device name (`tcp`, or the verbs device such as `rxe0` or `mlx5_0`).
    pub fn name(&self) -> &str {
        self.inner.imp.name()
    }

    /// Capabilities read at open.
    pub fn caps(&self) -> &DeviceCaps {
        self.inner.imp.caps()
    }

    /// Bytes registered through this device (every PD) and not yet deregistered: a registration
    /// counts from `register` until its last piece is dropped (work requests in flight hold it).
    /// A figure to watch for leaks; it returns to its starting level when everything is freed.
    pub fn registered_bytes(&self) -> u64 {
        self.inner.registered.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// [`Error::Verbs`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<crate::ProtectionDomain> {
        crate::ProtectionDomain::new(self)
    }

    /// Creates a completion queue with room for `depth` completions.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `depth` exceeds [`DeviceCaps::max_cqe`]; verbs errors.
    pub fn create_cq(&self, depth: u32) -> Result<crate::CompletionQueue> {
        crate::CompletionQueue::new(self, depth)
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("spec", &self.inner.spec)
            .field("name", &self.name())
            .field("caps", self.caps())
            .finish()
    }
}
