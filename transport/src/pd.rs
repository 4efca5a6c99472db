//! Protection domains: the scope in which memory regions and queue pairs meet.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{AccessFlags, Device, MemoryRegion, Result};

/// A protection domain. Memory registered in one PD is reachable only through QPs of the same PD,
/// locally (lkey) and remotely (rkey). Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdShared>,
}

pub(crate) struct PdShared {
    pub(crate) device: Device,
    pub(crate) id: u64,
    pub(crate) imp: Box<dyn crate::provider::PdOps>,
}

static NEXT_PD_ID: AtomicU64 = AtomicU64::new(1);

impl ProtectionDomain {
    pub(crate) fn new(device: &Device) -> Result<Self> {
        let imp = device.inner.imp.alloc_pd()?;
        Ok(Self {
            inner: Arc::new(PdShared {
                device: device.clone(),
                id: NEXT_PD_ID.fetch_add(1, Ordering::Relaxed),
                imp,
            }),
        })
    }

    /// A shared receive queue holding at most `max_wr` posted receives, whose buffers come from
    /// this PD (`ibv_create_srq`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a depth of 0 or above the
    /// device's `max_qp_wr`; verbs errors.
    pub fn create_srq(&self, max_wr: u32) -> Result<crate::SharedReceiveQueue> {
        crate::SharedReceiveQueue::new(self, max_wr)
    }

    /// The device this PD belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Allocates `len` zeroed bytes and registers them with `access`.
    ///
    /// Registration is slow (a system call and page pinning on real NICs): do it at set-up,
    /// and use a [`BufferPool`](crate::BufferPool) on hot paths.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for `len == 0`, a length above
    /// the device's `max_mr_size`, or REMOTE_WRITE / REMOTE_ATOMIC without LOCAL_WRITE (as verbs
    /// demands); verbs errors from `ibv_reg_mr`.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::{AccessFlags, Device};
    /// let pd = Device::open("tcp")?.alloc_pd()?;
    /// let mut mr = pd.register(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
    /// mr.bytes_mut()[..5].copy_from_slice(b"hello");
    /// assert_eq!(&mr.bytes()[..5], b"hello");
    /// let remote = mr.remote(); // {addr, len, rkey}: send it to the peer
    /// assert_eq!(remote.len, 64);
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn register(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::register(self, len, access)
    }

    /// Registers the bytes of `v` with `access`, as `ibv_reg_mr` registers memory a program
    /// already has: on tcp and verbs the vector's own allocation, with no copy; on shm, where
    /// peers reach only the shared arena, a copy of it there. [`MemoryRegion::into_vec`] gives
    /// the vector back. Whether this costs no more than bookkeeping is
    /// [`DeviceCaps::cheap_registration`](crate::DeviceCaps::cheap_registration) (on a NIC it
    /// pins the pages, a system call and page-table work per call).
    ///
    /// # Errors
    /// As [`ProtectionDomain::register`] (an empty vector is `len == 0`); the vector is dropped.
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::{AccessFlags, Device};
    /// let pd = Device::open("tcp")?.alloc_pd()?;
    /// let mr = pd.register_vec(vec![7u8; 4096], AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
    /// let remote = mr.remote(); // a peer may RDMA Read these 4096 bytes now
    /// assert_eq!(remote.len, 4096);
    /// assert_eq!(mr.into_vec().map(|v| v.len()).ok(), Some(4096));
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn register_vec(&self, v: Vec<u8>, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::register_vec(self, v, access)
    }

    /// As [`ProtectionDomain::register_vec`], of a new zeroed vector of `len` bytes (given back
    /// by [`MemoryRegion::into_vec`]).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) where the allocator refuses the
    /// memory, as [`ProtectionDomain::register`]; otherwise as [`ProtectionDomain::register_vec`].
    pub fn register_zeroed_vec(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::register_vec(self, crate::mr::zeroed_bytes(len)?, access)
    }
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain").field("id", &self.inner.id).finish()
    }
}
