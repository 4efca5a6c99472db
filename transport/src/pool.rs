//! A pool of pre-registered, equally sized buffers for hot paths (no registration per message).

use std::sync::Arc;

use parking_lot::Mutex;

use crate::mr::Region;
use crate::{AccessFlags, Error, MemoryRegion, ProtectionDomain, Result};

/// Pre-registered buffers of one size, carved from a single registration.
///
/// [`BufferPool::take`] hands out a [`MemoryRegion`]; dropping it (after its completion gave it
/// back, or directly) returns it to the pool. Buffers held by work requests in flight stay out of
/// the pool until their completion is reaped or their QP is flushed.
///
/// One registration means one lock for the bytes of all its buffers on the software providers:
/// a guard from [`MemoryRegion::bytes`] on one buffer makes access to any other buffer of the
/// pool wait (the provider's delivery into a posted one included). Keep such guards short, or
/// register buffers one by one where the application may hold their bytes for long (as
/// rdma-rpc does for the receive slots it hands to applications).
///
/// # Examples
/// ```
/// use rdma_rpc_transport::{AccessFlags, BufferPool, Device};
/// let pd = Device::open("tcp")?.alloc_pd()?;
/// let pool = BufferPool::new(&pd, 4096, 8, AccessFlags::LOCAL_WRITE)?;
/// let buf = pool.take().expect("a free buffer");
/// assert_eq!((buf.len(), pool.available()), (4096, 7));
/// drop(buf);
/// assert_eq!(pool.available(), 8);
/// # Ok::<(), rdma_rpc_transport::Error>(())
/// ```
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<PoolShared>,
}

struct PoolShared {
    region: Arc<Region>,
    buf_size: usize,
    count: usize,
    free: Mutex<Vec<usize>>,
}

/// The way back to a pool, carried by pooled buffers.
pub(crate) struct PoolHome(Arc<PoolShared>);

impl PoolHome {
    pub(crate) fn give_back(self, region: Arc<Region>, off: usize) {
        debug_assert!(Arc::ptr_eq(&region, &self.0.region));
        self.0.free.lock().push(off);
    }
}

impl BufferPool {
    /// Registers `count` buffers of `buf_size` bytes with `access`, as one memory region.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero size or count; registration errors.
    pub fn new(pd: &ProtectionDomain, buf_size: usize, count: usize, access: AccessFlags) -> Result<Self> {
        let total = buf_size
            .checked_mul(count)
            .filter(|&t| t > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("pool of {count} x {buf_size} bytes")))?;
        let whole = pd.register(total, access)?;
        let region = whole.region.clone();
        let free = (0..count).rev().map(|i| i * buf_size).collect();
        Ok(Self {
            shared: Arc::new(PoolShared {
                region,
                buf_size,
                count,
                free: Mutex::new(free),
            }),
        })
    }

    /// A free buffer, or `None` when all are taken.
    pub fn take(&self) -> Option<MemoryRegion> {
        let off = self.shared.free.lock().pop()?;
        Some(MemoryRegion {
            region: self.shared.region.clone(),
            off,
            len: self.shared.buf_size,
            home: Some(PoolHome(self.shared.clone())),
        })
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.shared.buf_size
    }

    /// Number of buffers in all.
    pub fn capacity(&self) -> usize {
        self.shared.count
    }

    /// Number of buffers free now.
    pub fn available(&self) -> usize {
        self.shared.free.lock().len()
    }

    /// Bytes registered for this pool.
    pub fn registered_bytes(&self) -> usize {
        self.shared.region.len
    }
}
