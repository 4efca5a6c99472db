//! The provider traits: what the verbs-shaped objects ([`Device`], [`ProtectionDomain`],
//! [`MemoryRegion`](crate::MemoryRegion), [`CompletionQueue`](crate::CompletionQueue),
//! [`QueuePair`](crate::QueuePair), [`SharedReceiveQueue`](crate::SharedReceiveQueue),
//! [`Listener`](crate::Listener)) ask of the provider behind them, and the one table that maps
//! a spec to its provider ([`open`]).
//!
//! A provider is one folder that implements these traits (`tcp/`, `shm/`, `verbs/`; the
//! software NIC the first two share is `nic/`) and one line in [`open`]. The common layer owns
//! the objects, their buffers and bookkeeping; a provider only moves bytes and reports
//! completions. A provider reaches its own objects behind another's handle (its CQ behind a
//! `CompletionQueue` given to its QP, say) through `as_any`, and refuses another provider's.

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::cq::RawWc;
use crate::mr::Region;
use crate::pd::PdShared;
use crate::qp::{RecvDesc, SendDesc};
use crate::srq::LimitEvent;
use crate::{AccessFlags, Device, DeviceCaps, Error, ProtectionDomain, ProviderSpec, QpOptions, Result};

/// A future a provider's object returns from a trait method.
pub(crate) type Wait<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

/// Opens the device a spec names: the registration of every provider.
pub(crate) fn open(spec: &ProviderSpec) -> Result<Box<dyn DeviceOps>> {
    Ok(match spec {
        ProviderSpec::Tcp => Box::new(crate::tcp::TcpDevice::new()),
        ProviderSpec::Shm => Box::new(crate::shm::ShmDevice::new(false)),
        ProviderSpec::ShmAnyUser => Box::new(crate::shm::ShmDevice::new(true)),
        #[cfg(feature = "verbs")]
        ProviderSpec::Verbs(name) => Box::new(crate::verbs::Context::open(name.as_deref())?),
        #[cfg(not(feature = "verbs"))]
        ProviderSpec::Verbs(_) => return Err(Error::ProviderNotBuilt("verbs")),
    })
}

/// A device: makes the other objects.
pub(crate) trait DeviceOps: Send + Sync + 'static {
    /// The device's name (`tcp`, `shm`, `rxe0`, `mlx5_0`).
    fn name(&self) -> &str;
    fn caps(&self) -> &DeviceCaps;
    fn alloc_pd(&self) -> Result<Box<dyn PdOps>>;
    fn create_cq(&self, depth: u32) -> Result<Box<dyn CqOps>>;
    fn create_srq(&self, pd: &ProtectionDomain, max_wr: u32, event: Arc<LimitEvent>) -> Result<Box<dyn SrqOps>>;
    fn bind(&self, device: &Device, addr: SocketAddr) -> Result<Box<dyn ListenerOps>>;
    /// Connects a QP made from `opts` to a listener at `addr`, sending `private_data`.
    fn connect(&self, addr: SocketAddr, opts: &QpOptions, private_data: &[u8], timeout: Duration) -> Result<Connected>;
    /// The software NIC's progress engine, for providers built on it (`nic`).
    fn progress(&self) -> Result<&crate::nic::progress::Progress> {
        Err(Error::InvalidArgument(format!(
            "device {} has no software progress engine",
            self.name()
        )))
    }
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
}

/// A QP set up, and the last step of its set-up, taken once its first receives are posted.
pub(crate) struct Connected {
    pub(crate) qp: Box<dyn QpOps>,
    pub(crate) qp_num: u32,
    pub(crate) pending: Box<dyn PendingOps>,
}

/// A protection domain: registers memory.
pub(crate) trait PdOps: Send + Sync + 'static {
    /// Registers `len` bytes with `access`, from `vec` if given (`from_vec`: the caller may
    /// want the vector back), as a region of `pd`.
    fn register(
        &self,
        pd: &Arc<PdShared>,
        len: usize,
        access: AccessFlags,
        vec: Option<Vec<u8>>,
        from_vec: bool,
    ) -> Result<Arc<Region>>;
    /// The registration an rkey names, for a software responder's checks.
    fn lookup(&self, _rkey: u32) -> Option<Arc<Region>> {
        None
    }
    /// A region of this PD is going (its last piece was dropped).
    fn deregister(&self, _rkey: u32, _lkey: u32) {}
    fn as_any(&self) -> &dyn Any;
}

/// A registration's provider part, undone when its region goes.
pub(crate) trait RegistrationOps: Send + Sync + 'static {
    /// Undoes the registration; false when the device may still reach the memory, which must
    /// then never be freed or reused.
    fn deregister(&mut self) -> bool;
}

/// Memory a provider gives a registration where it must live (shm: a segment peers may map),
/// in 8-byte words.
pub(crate) trait SharedMemory: Send + Sync + 'static {
    fn words(&self) -> &[u64];
    fn words_mut(&mut self) -> &mut [u64];
    /// Its first `len` bytes, copied (peers may still write it).
    fn copy_out(&self, len: usize) -> Vec<u8>;
    /// Word `i`, for atomics that peers may run on it too.
    fn atomic_word(&self, i: usize) -> &std::sync::atomic::AtomicU64;
}

/// A completion queue.
pub(crate) trait CqOps: Send + Sync + 'static {
    /// Takes up to `max` completions without waiting.
    fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> Result<usize>;
    /// Has the next completion wake [`wait`](Self::wait).
    fn arm(&self) -> Result<()>;
    /// Waits for what [`arm`](Self::arm) asked for (or spuriously).
    fn wait(&self) -> Wait<'_>;
    fn as_any(&self) -> &dyn Any;
}

/// A connected queue pair.
pub(crate) trait QpOps: Send + Sync + 'static {
    fn post_send(&self, descs: &[SendDesc<'_>]) -> std::result::Result<(), (usize, Error)>;
    fn post_recv(&self, descs: &[RecvDesc<'_>]) -> std::result::Result<(), (usize, Error)>;
    fn is_error(&self) -> bool;
    /// See [`QueuePair::path_attrs`](crate::QueuePair::path_attrs).
    fn path_attrs(&self) -> Option<crate::PathAttrs> {
        None
    }
    /// See [`QueuePair::peer_shares_cpu`](crate::QueuePair::peer_shares_cpu).
    fn peer_shares_cpu(&self) -> bool {
        false
    }
    /// See [`QueuePair::leave_peer_cpu`](crate::QueuePair::leave_peer_cpu).
    fn leave_peer_cpu(&self) -> bool {
        false
    }
    /// Stops the QP: nothing touches its buffers once this returns.
    fn destroy(&mut self);
}

/// A shared receive queue.
pub(crate) trait SrqOps: Send + Sync + 'static {
    fn post(&self, descs: &[RecvDesc<'_>]) -> std::result::Result<(), (usize, Error)>;
    /// Arms the limit event.
    fn arm(&self, limit: u32) -> Result<()>;
    /// Reads the device's events that may have fired the limit event, without waiting.
    fn read_events(&self) {}
    /// Waits for the device's events, where they come from outside the process's own code.
    fn events_ready(&self) -> Wait<'_> {
        Box::pin(std::future::pending())
    }
    fn as_any(&self) -> &dyn Any;
}

/// A listening endpoint.
pub(crate) trait ListenerOps: Send + Sync + 'static {
    fn local_addr(&self) -> Result<SocketAddr>;
    /// The next connection request, waiting up to `timeout` (forever with `None`).
    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn RequestOps>>;
}

/// A connection request.
pub(crate) trait RequestOps: Send + 'static {
    fn private_data(&self) -> &[u8];
    fn peer(&self) -> Option<SocketAddr>;
    /// Sets the QP up from `opts`; on failure the provider refuses the peer itself, saying why.
    fn accept(self: Box<Self>, opts: &QpOptions) -> Result<Connected>;
    fn reject(self: Box<Self>, reason: &[u8]);
}

/// The last step of a connection's set-up.
pub(crate) trait PendingOps: 'static {
    /// Refuses the peer instead of finishing (this side's set-up failed after all).
    fn refuse(self: Box<Self>, reason: &[u8]);
    /// Finishes (the accepting side replies with `private_data`); the peer's private data on
    /// the connecting side.
    fn finish(self: Box<Self>, private_data: &[u8]) -> Result<Vec<u8>>;
}

/// A finished set-up on the connecting side: the peer's private data.
pub(crate) struct Done(pub(crate) Vec<u8>);

impl PendingOps for Done {
    fn refuse(self: Box<Self>, _reason: &[u8]) {}

    fn finish(self: Box<Self>, _private_data: &[u8]) -> Result<Vec<u8>> {
        Ok(self.0)
    }
}

/// `cq`'s provider object as a `T`, or an error naming what the provider needs.
pub(crate) fn cq_of<'a, T: 'static>(cq: &'a crate::CompletionQueue, what: &'static str) -> Result<&'a T> {
    cq.inner
        .imp
        .as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| Error::InvalidArgument(format!("{what} needs a CQ of its own provider")))
}

/// `pd`'s provider object as a `T`, or an error naming what the provider needs.
pub(crate) fn pd_of<'a, T: 'static>(pd: &'a PdShared, what: &'static str) -> Result<&'a T> {
    pd.imp
        .as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| Error::InvalidArgument(format!("{what} needs a PD of its own provider")))
}
