//! The software NIC's objects as the provider traits see them (`provider.rs`): its PD, CQ,
//! SRQ and QPs, which the `tcp` and `shm` providers share.

use std::any::Any;
use std::sync::Arc;

use parking_lot::RwLock;

use super::{Cq, Pd, Qp, Srq};
use crate::cq::RawWc;
use crate::mr::Region;
use crate::pd::PdShared;
use crate::provider::{CqOps, PdOps, QpOps, SrqOps, Wait};
use crate::qp::{RecvDesc, SendDesc};
use crate::{AccessFlags, Error, Result};

/// The software CQ behind a `CompletionQueue` (its engines hold it too).
pub(crate) struct SoftCq(pub(crate) Arc<Cq>);

impl SoftCq {
    pub(crate) fn new(depth: u32) -> Result<Self> {
        Ok(SoftCq(Arc::new(Cq::new(depth)?)))
    }
}

impl CqOps for SoftCq {
    fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> Result<usize> {
        Ok(self.0.poll(out, max))
    }

    fn arm(&self) -> Result<()> {
        self.0.arm();
        Ok(())
    }

    fn wait(&self) -> Wait<'_> {
        Box::pin(self.0.wait_bell())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The software SRQ behind a `SharedReceiveQueue` (its QPs' engines hold it too).
pub(crate) struct SoftSrq(pub(crate) Arc<Srq>);

impl SrqOps for SoftSrq {
    fn post(&self, descs: &[RecvDesc<'_>]) -> std::result::Result<(), (usize, Error)> {
        self.0.post(descs)
    }

    fn arm(&self, limit: u32) -> Result<()> {
        self.0.arm(limit);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The tcp provider's PD: registrations in the process's heap, in a table the responders
/// check keys against.
impl PdOps for Pd {
    fn register(
        &self,
        pd: &Arc<PdShared>,
        len: usize,
        access: AccessFlags,
        vec: Option<Vec<u8>>,
        from_vec: bool,
    ) -> Result<Arc<Region>> {
        let (mem, addr) = crate::mr::heap(len, vec)?;
        let (lkey, rkey) = self.fresh_keys();
        let region = Arc::new(Region {
            pd: pd.clone(),
            addr,
            len,
            lkey,
            rkey,
            access,
            from_vec,
            // The engine writes under the lock, as local users do.
            exposed: false,
            mem: RwLock::new(mem),
            imp: None,
        });
        Pd::register(self, &region);
        Ok(region)
    }

    fn lookup(&self, rkey: u32) -> Option<Arc<Region>> {
        Pd::lookup(self, rkey)
    }

    fn deregister(&self, rkey: u32, lkey: u32) {
        Pd::deregister(self, rkey, lkey);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl QpOps for Qp {
    fn post_send(&self, descs: &[SendDesc<'_>]) -> std::result::Result<(), (usize, Error)> {
        Qp::post_send(self, descs)
    }

    fn post_recv(&self, descs: &[RecvDesc<'_>]) -> std::result::Result<(), (usize, Error)> {
        Qp::post_recv(self, descs)
    }

    fn is_error(&self) -> bool {
        Qp::is_error(self)
    }

    fn peer_shares_cpu(&self) -> bool {
        Qp::peer_shares_cpu(self)
    }

    fn leave_peer_cpu(&self) -> bool {
        Qp::leave_peer_cpu(self)
    }

    fn destroy(&mut self) {
        Qp::destroy(self);
    }
}
