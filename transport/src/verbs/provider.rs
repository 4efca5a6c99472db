//! The verbs provider's objects as the provider traits see them (`provider.rs`).

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::cm::{Listener, Pending, Request};
use super::{Context, Cq, Mr, Pd, Qp, Srq};
use crate::cq::RawWc;
use crate::mr::Region;
use crate::pd::PdShared;
use crate::provider::{
    Connected, CqOps, DeviceOps, ListenerOps, PdOps, PendingOps, QpOps, RegistrationOps, RequestOps, SrqOps, Wait,
};
use crate::qp::{RecvDesc, SendDesc};
use crate::srq::LimitEvent;
use crate::{AccessFlags, Device, DeviceCaps, Error, ProtectionDomain, QpOptions, Result};

fn connected((qp, qp_num, pending): (Qp, u32, Pending)) -> Connected {
    Connected {
        qp: Box::new(qp),
        qp_num,
        pending: Box::new(pending),
    }
}

impl DeviceOps for Context {
    fn name(&self) -> &str {
        Context::name(self)
    }

    fn caps(&self) -> &DeviceCaps {
        Context::caps(self)
    }

    fn alloc_pd(&self) -> Result<Box<dyn PdOps>> {
        Ok(Box::new(Pd::new(self)?))
    }

    fn create_cq(&self, depth: u32) -> Result<Box<dyn CqOps>> {
        Ok(Box::new(Cq::new(self, depth)?))
    }

    fn create_srq(&self, pd: &ProtectionDomain, max_wr: u32, event: Arc<LimitEvent>) -> Result<Box<dyn SrqOps>> {
        let vpd = crate::provider::pd_of::<Pd>(&pd.inner, "a verbs SRQ")?;
        Ok(Box::new(Srq::new(pd.device(), vpd, max_wr, event)?))
    }

    fn bind(&self, _device: &Device, addr: SocketAddr) -> Result<Box<dyn ListenerOps>> {
        Ok(Box::new(Listener::bind(self, addr)?))
    }

    fn connect(
        &self,
        addr: SocketAddr,
        opts: &QpOptions,
        _private_data: &[u8],
        timeout: Duration,
    ) -> Result<Connected> {
        // The private data goes with rdma_connect, in the pending step's `finish`.
        super::cm::connect(self, addr, opts, timeout).map(connected)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl RegistrationOps for Mr {
    fn deregister(&mut self) -> bool {
        Mr::deregister(self)
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
        let (mem, addr) = crate::mr::heap(len, vec)?;
        // The memory moves into the region below with the registration; a vector's or a box's
        // heap buffer stays where it is when its owner moves.
        let mr = Pd::register(self, addr as *mut u8, len, access)?;
        Ok(Arc::new(Region {
            pd: pd.clone(),
            addr,
            len,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            access,
            from_vec,
            exposed: crate::mr::peers_write(access),
            mem: RwLock::new(mem),
            imp: Some(Box::new(mr)),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CqOps for Cq {
    fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> Result<usize> {
        Cq::poll(self, out, max)
    }

    fn arm(&self) -> Result<()> {
        Cq::arm(self)
    }

    fn wait(&self) -> Wait<'_> {
        Box::pin(self.wait_event())
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

    fn path_attrs(&self) -> Option<crate::PathAttrs> {
        Qp::path_attrs(self)
    }

    fn destroy(&mut self) {
        Qp::destroy(self);
    }
}

impl SrqOps for Srq {
    fn post(&self, descs: &[RecvDesc<'_>]) -> std::result::Result<(), (usize, Error)> {
        Srq::post(self, descs)
    }

    fn arm(&self, limit: u32) -> Result<()> {
        Srq::arm(self, limit)
    }

    fn read_events(&self) {
        Srq::read_events(self);
    }

    fn events_ready(&self) -> Wait<'_> {
        Box::pin(Srq::events_ready(self))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ListenerOps for Listener {
    fn local_addr(&self) -> Result<SocketAddr> {
        Listener::local_addr(self)
    }

    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn RequestOps>> {
        Ok(Box::new(Listener::accept(self, timeout)?))
    }
}

impl RequestOps for Request {
    fn private_data(&self) -> &[u8] {
        Request::private_data(self)
    }

    fn peer(&self) -> Option<SocketAddr> {
        Request::peer(self)
    }

    fn accept(self: Box<Self>, opts: &QpOptions) -> Result<Connected> {
        Request::accept(*self, opts).map(connected)
    }

    fn reject(self: Box<Self>, reason: &[u8]) {
        Request::reject(*self, reason);
    }
}

impl PendingOps for Pending {
    fn refuse(self: Box<Self>, reason: &[u8]) {
        Pending::refuse(*self, reason);
    }

    fn finish(self: Box<Self>, private_data: &[u8]) -> Result<Vec<u8>> {
        Pending::finish(*self, private_data)
    }
}
