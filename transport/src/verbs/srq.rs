//! Shared receive queues (`ibv_create_srq`), and the device's async events that carry their
//! limit event.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;
use rdma_sys::*;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::{check, last_os_error, Context, Pd};
use crate::qp::RecvDesc;
use crate::srq::LimitEvent;
use crate::{Device, Error, Result};

/// The device's async event descriptor, non-blocking, and who waits for which SRQ's event.
#[derive(Default)]
pub(crate) struct AsyncEvents {
    srqs: Mutex<HashMap<usize, Weak<LimitEvent>>>,
    fd: OnceLock<AsyncFd<EventFd>>,
    registering: Mutex<()>,
}

struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl AsyncEvents {
    /// Reads every pending async event of `ctx` without waiting: an SRQ's limit event fires
    /// its [`LimitEvent`]; others are logged (QP errors also reach their CQs as completions).
    fn read(&self, ctx: &Context) {
        set_nonblocking(ctx);
        loop {
            // SAFETY: ibv_async_event is plain old data.
            let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: the context is live and its async fd non-blocking; `ev` is a valid
            // out-pointer.
            if unsafe { ibv_get_async_event(ctx.raw(), &mut ev) } != 0 {
                return;
            }
            if ev.event_type == ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED {
                // SAFETY: for an SRQ event the union holds the SRQ.
                let srq = unsafe { ev.element.srq } as usize;
                if let Some(e) = self.srqs.lock().get(&srq).and_then(Weak::upgrade) {
                    e.fire();
                }
            } else {
                tracing::debug!(event = ?ev.event_type, "verbs async event");
            }
            // SAFETY: every event taken is acknowledged once (destroying an SRQ waits for it).
            unsafe { ibv_ack_async_event(&mut ev) };
        }
    }

    async fn ready(&self, ctx: &Context) -> Result<()> {
        let afd = match self.fd.get() {
            Some(a) => a,
            None => {
                if tokio::runtime::Handle::try_current().is_err() {
                    return Err(Error::NoRuntime);
                }
                let _one = self.registering.lock();
                match self.fd.get() {
                    Some(a) => a,
                    None => {
                        set_nonblocking(ctx);
                        // SAFETY: the context is live.
                        let fd = unsafe { (*ctx.raw()).async_fd };
                        // SAFETY: the context's async fd stays open until the context is closed,
                        // after the `AsyncFd` (a field of the context) is dropped; EventFd always
                        // returns that same fd.
                        let afd = unsafe { AsyncFd::register_with_interest(EventFd(fd), Interest::READABLE) }
                            .map_err(|e| Error::io("registering the device's async events with tokio", e.into()))?;
                        self.fd.get_or_init(|| afd)
                    }
                }
            }
        };
        let mut guard = afd
            .readable()
            .await
            .map_err(|e| Error::io("waiting for the device's async events", e))?;
        guard.clear_ready();
        self.read(ctx);
        Ok(())
    }
}

fn set_nonblocking(ctx: &Context) {
    // SAFETY: the context is live; F_GETFL/F_SETFL change only the descriptor's flags.
    unsafe {
        let fd = (*ctx.raw()).async_fd;
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 && fl & libc::O_NONBLOCK == 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

/// A shared receive queue on a verbs device.
pub(crate) struct Srq {
    srq: NonNull<ibv_srq>,
    device: Device,
}

// SAFETY: SRQs are thread-safe verbs objects; the pointer is valid until Drop.
unsafe impl Send for Srq {}
// SAFETY: as above; shared use is limited to posting and modifying, which verbs allow from any
// thread.
unsafe impl Sync for Srq {}

fn ctx(device: &Device) -> Option<&Context> {
    device.inner.imp.as_any().downcast_ref::<Context>()
}

impl Srq {
    pub(crate) fn new(device: &Device, pd: &Pd, max_wr: u32, event: Arc<LimitEvent>) -> Result<Self> {
        let Some(c) = ctx(device) else {
            return Err(Error::InvalidArgument("a verbs SRQ needs a verbs device".into()));
        };
        let mut init = ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is live (the SRQ's owner holds it); init is a valid in/out pointer.
        let srq = NonNull::new(unsafe { ibv_create_srq(pd.raw(), &mut init) })
            .ok_or_else(|| last_os_error("ibv_create_srq"))?;
        c.events
            .srqs
            .lock()
            .insert(srq.as_ptr() as usize, Arc::downgrade(&event));
        Ok(Self {
            srq,
            device: device.clone(),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_srq {
        self.srq.as_ptr()
    }

    pub(crate) fn post(&self, descs: &[RecvDesc<'_>]) -> Result<(), (usize, Error)> {
        let srq = self.raw();
        super::qp::post_recvs(descs, "ibv_post_srq_recv", |wr, bad| {
            // SAFETY: the SRQ is live; the list and its SGEs live until the call returns, and the
            // memory they name stays registered until completion (the SRQ's slots own it).
            unsafe { ibv_post_srq_recv(srq, wr, bad) }
        })
    }

    pub(crate) fn arm(&self, limit: u32) -> Result<()> {
        let mut attr = ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: the SRQ is live; attr is valid for the call.
        check("ibv_modify_srq", unsafe {
            ibv_modify_srq(self.raw(), &mut attr, ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32)
        })
    }

    pub(crate) fn read_events(&self) {
        if let Some(c) = ctx(&self.device) {
            c.events.read(c);
        }
    }

    pub(crate) async fn events_ready(&self) -> Result<()> {
        match ctx(&self.device) {
            Some(c) => c.events.ready(c).await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        if let Some(c) = ctx(&self.device) {
            c.events.srqs.lock().remove(&(self.srq.as_ptr() as usize));
        }
        // SAFETY: no QP uses the SRQ any more (each holds it through its options until
        // destroyed); destroyed once.
        let rc = unsafe { ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            tracing::warn!("ibv_destroy_srq: {}", io::Error::from_raw_os_error(rc.abs()));
        }
    }
}
