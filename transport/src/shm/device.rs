//! The shm provider's objects as the provider traits see them (`provider.rs`): its device, its
//! PD (registrations in segments peers may be granted), and connection set-up.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::{cm, Arena, Pd, Slice};
use crate::mr::{Mem, Region};
use crate::nic::{SoftCq, SoftSrq};
use crate::pd::PdShared;
use crate::provider::{
    Connected, CqOps, DeviceOps, Done, ListenerOps, PdOps, PendingOps, RegistrationOps, RequestOps, SharedMemory,
    SrqOps,
};
use crate::srq::LimitEvent;
use crate::{AccessFlags, Device, DeviceCaps, ProtectionDomain, QpOptions, Result};

/// An shm device: the software NIC, its QPs over shared-memory rings between processes of one
/// host.
pub(crate) struct ShmDevice {
    /// Connections from and to processes of other users are accepted.
    any_user: bool,
    caps: DeviceCaps,
    progress: crate::nic::progress::Lazy,
}

impl ShmDevice {
    pub(crate) fn new(any_user: bool) -> Self {
        ShmDevice {
            any_user,
            caps: super::caps(),
            progress: Default::default(),
        }
    }
}

impl DeviceOps for ShmDevice {
    fn name(&self) -> &str {
        "shm"
    }

    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn alloc_pd(&self) -> Result<Box<dyn PdOps>> {
        Ok(Box::new(Pd::new()?))
    }

    fn create_cq(&self, depth: u32) -> Result<Box<dyn CqOps>> {
        Ok(Box::new(SoftCq::new(depth)?))
    }

    fn create_srq(&self, _pd: &ProtectionDomain, max_wr: u32, event: Arc<LimitEvent>) -> Result<Box<dyn SrqOps>> {
        Ok(Box::new(SoftSrq(Arc::new(crate::nic::Srq::new(max_wr, event)))))
    }

    fn bind(&self, device: &Device, addr: SocketAddr) -> Result<Box<dyn ListenerOps>> {
        Ok(Box::new(cm::Listener::bind(device, addr, self.any_user)?))
    }

    fn connect(&self, addr: SocketAddr, opts: &QpOptions, private_data: &[u8], timeout: Duration) -> Result<Connected> {
        let side = super::side(opts)?;
        let (j, data) = cm::connect(addr, side, private_data, timeout, self.any_user)?;
        let (qp, qp_num) = super::start(j.link, j.peer, j.own_rq, opts)?;
        Ok(Connected {
            qp: Box::new(qp),
            qp_num,
            pending: Box::new(Done(data)),
        })
    }

    fn progress(&self) -> Result<&crate::nic::progress::Progress> {
        self.progress.get()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A registration published in the PD's key table: withdrawn when its region goes.
struct Published {
    arena: Arc<Arena>,
    keys: (u32, u32),
}

impl RegistrationOps for Published {
    fn deregister(&mut self) -> bool {
        self.arena.withdraw(self.keys);
        true
    }
}

impl PdOps for Pd {
    fn register(
        &self,
        pd: &Arc<PdShared>,
        len: usize,
        access: AccessFlags,
        vec: Option<Vec<u8>>,
        from_vec: bool,
    ) -> Result<Arc<Region>> {
        let mut slice = Slice::alloc(len, access)?;
        if let Some(v) = &vec {
            bytemuck::cast_slice_mut::<u64, u8>(slice.words_mut())[..len].copy_from_slice(v);
        }
        let addr = slice.addr();
        let (lkey, rkey) = self.fresh_keys();
        self.publish((lkey, rkey), access, &slice, len as u64)?;
        let region = Arc::new(Region {
            pd: pd.clone(),
            addr,
            len,
            lkey,
            rkey,
            access,
            from_vec,
            exposed: crate::mr::peers_write(access),
            mem: RwLock::new(Mem::Shared(Box::new(slice))),
            imp: Some(Box::new(Published {
                arena: self.arena.clone(),
                keys: (lkey, rkey),
            })),
        });
        self.keys.register(&region);
        Ok(region)
    }

    fn lookup(&self, rkey: u32) -> Option<Arc<Region>> {
        self.keys.lookup(rkey)
    }

    fn deregister(&self, rkey: u32, lkey: u32) {
        self.keys.deregister(rkey, lkey);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl SharedMemory for Slice {
    fn words(&self) -> &[u64] {
        Slice::words(self)
    }

    fn words_mut(&mut self) -> &mut [u64] {
        Slice::words_mut(self)
    }

    fn copy_out(&self, len: usize) -> Vec<u8> {
        Slice::copy_out(self, len)
    }

    fn atomic_word(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        Slice::atomic_word(self, i)
    }
}

impl ListenerOps for cm::Listener {
    fn local_addr(&self) -> Result<SocketAddr> {
        Ok(cm::Listener::local_addr(self))
    }

    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn RequestOps>> {
        Ok(Box::new(cm::Listener::accept(self, timeout)?))
    }
}

impl RequestOps for cm::Request {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    fn peer(&self) -> Option<SocketAddr> {
        None
    }

    fn accept(self: Box<Self>, opts: &QpOptions) -> Result<Connected> {
        let side = match super::side(opts) {
            Ok(s) => s,
            Err(e) => {
                self.reject(&crate::cm::set_up_reason(&e));
                return Err(e);
            }
        };
        let (j, p) = cm::Request::accept(*self, side)?;
        match super::start(j.link, j.peer, j.own_rq, opts) {
            Ok((qp, qp_num)) => Ok(Connected {
                qp: Box::new(qp),
                qp_num,
                pending: Box::new(p),
            }),
            Err(e) => {
                p.refuse(&crate::cm::set_up_reason(&e));
                Err(e)
            }
        }
    }

    fn reject(self: Box<Self>, reason: &[u8]) {
        cm::Request::reject(*self, reason);
    }
}

impl PendingOps for cm::Pending {
    fn refuse(self: Box<Self>, reason: &[u8]) {
        cm::Pending::refuse(*self, reason);
    }

    fn finish(self: Box<Self>, private_data: &[u8]) -> Result<Vec<u8>> {
        cm::Pending::finish(*self, private_data)
    }
}
