//! Completion queues with a completion channel wired into tokio.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{OnceLock, Weak};

use parking_lot::Mutex;
use rdma_sys::*;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::{check, last_os_error, Context};
use crate::cq::RawWc;
use crate::{Error, Result, WcOpcode, WcStatus};

/// wr_id bit that marks receive requests: error completions carry no valid opcode, so the
/// queue a completion belongs to travels in the wr_id.
pub(crate) const RECV_BIT: u64 = 1 << 63;

/// Events are acknowledged in batches (ibv_ack_cq_events takes a mutex).
const ACK_BATCH: u32 = 32;

struct ChannelFd(RawFd);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What a CQ does when it sees an error completion of a QP: move it to the error state and tell
/// the peer (rdma_disconnect), as the tcp provider does.
pub(crate) trait OnQpError: Send + Sync {
    fn qp_failed(&self);
}

pub(crate) struct Cq {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    async_fd: OnceLock<AsyncFd<ChannelFd>>,
    /// One registration at a time: a descriptor registers with a runtime once (a second
    /// registration of the same one fails with EEXIST).
    registering: Mutex<()>,
    unacked: AtomicU32,
    pub(crate) qps: Mutex<HashMap<u32, Weak<dyn OnQpError>>>,
}

// SAFETY: CQs and completion channels are thread-safe verbs objects; pointers live until Drop.
unsafe impl Send for Cq {}
// SAFETY: as above; polling from several threads is allowed by libibverbs.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(ctx: &Context, depth: u32) -> Result<Self> {
        // SAFETY: the context is live.
        let channel = NonNull::new(unsafe { ibv_create_comp_channel(ctx.raw()) })
            .ok_or_else(|| last_os_error("ibv_create_comp_channel"))?;
        // SAFETY: channel is live; a NULL cq_context is allowed.
        let cq = unsafe { ibv_create_cq(ctx.raw(), depth as i32, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let err = last_os_error("ibv_create_cq");
            // SAFETY: the channel has no CQ attached and is destroyed once.
            unsafe { ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(err);
        };
        let this = Self {
            cq,
            channel,
            async_fd: OnceLock::new(),
            registering: Mutex::new(()),
            unacked: AtomicU32::new(0),
            qps: Mutex::new(HashMap::new()),
        };
        let fd = this.fd();
        // SAFETY: fd is the channel's open descriptor; F_GETFL/F_SETFL only change its flags.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if rc < 0 {
            return Err(Error::io(
                "making the completion channel non-blocking",
                io::Error::last_os_error(),
            ));
        }
        Ok(this)
    }

    pub(crate) fn raw(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live until Drop.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    pub(crate) fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> Result<usize> {
        const CHUNK: usize = 32;
        // SAFETY: ibv_wc is plain old data.
        let mut wcs: [ibv_wc; CHUNK] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        while total < max {
            let want = (max - total).min(CHUNK);
            // SAFETY: the CQ is live and wcs has room for `want` entries.
            let n = unsafe { ibv_poll_cq(self.raw(), want as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(Error::Verbs {
                    call: "ibv_poll_cq",
                    source: io::Error::from_raw_os_error(-n),
                });
            }
            for wc in &wcs[..n as usize] {
                out.push(self.convert(wc));
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        Ok(total)
    }

    fn convert(&self, wc: &ibv_wc) -> RawWc {
        let status = WcStatus::from_raw(wc.status);
        let recv = wc.wr_id & RECV_BIT != 0;
        if !status.is_success() {
            if let Some(qp) = self.qps.lock().get(&wc.qp_num).and_then(Weak::upgrade) {
                qp.qp_failed();
            }
        }
        let opcode = match wc.opcode {
            ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
            ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            ibv_wc_opcode::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            ibv_wc_opcode::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            _ if recv => WcOpcode::Recv,
            _ => WcOpcode::Send,
        };
        let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        // SAFETY: imm_data is the active member when IBV_WC_WITH_IMM is set; both members are u32.
        let imm = with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        RawWc {
            qp_num: wc.qp_num,
            seq: wc.wr_id & !RECV_BIT,
            recv,
            status,
            opcode,
            byte_len: wc.byte_len,
            imm: if status.is_success() { imm } else { None },
            vendor_err: wc.vendor_err,
            head: crate::Head::default(),
        }
    }

    /// Requests an event for the next completion.
    pub(crate) fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is live.
        check("ibv_req_notify_cq", unsafe { ibv_req_notify_cq(self.raw(), 0) })
    }

    fn async_fd(&self) -> Result<&AsyncFd<ChannelFd>> {
        if let Some(a) = self.async_fd.get() {
            return Ok(a);
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoRuntime);
        }
        let _registering = self.registering.lock();
        if let Some(a) = self.async_fd.get() {
            return Ok(a);
        }
        // SAFETY: the fd is the completion channel's, open until Drop, where the AsyncFd is
        // dropped first; ChannelFd always returns that same fd.
        let afd = unsafe { AsyncFd::register_with_interest(ChannelFd(self.fd()), Interest::READABLE) }
            .map_err(|e| Error::io("registering the completion channel with tokio", e.into()))?;
        Ok(self.async_fd.get_or_init(|| afd))
    }

    /// Waits for a completion event (after [`Cq::arm`]) and consumes every pending event.
    pub(crate) async fn wait_event(&self) -> Result<()> {
        let afd = self.async_fd()?;
        loop {
            let mut guard = afd
                .readable()
                .await
                .map_err(|e| Error::io("waiting on the completion channel", e))?;
            let got = self.drain_events()?;
            if got > 0 {
                return Ok(());
            }
            guard.clear_ready();
        }
    }

    fn drain_events(&self) -> Result<u32> {
        let mut got = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; both out-pointers are valid.
            let rc = unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(Error::Verbs {
                    call: "ibv_get_cq_event",
                    source: e,
                });
            }
            got += 1;
        }
        let pending = self.unacked.fetch_add(got, Ordering::AcqRel) + got;
        if pending >= ACK_BATCH {
            let n = self.unacked.swap(0, Ordering::AcqRel);
            // SAFETY: n events of this CQ were received and not yet acknowledged.
            unsafe { ibv_ack_cq_events(self.raw(), n) };
        }
        Ok(got)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let n = self.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            // SAFETY: n events were received and not acknowledged; destroy_cq waits for all acks.
            unsafe { ibv_ack_cq_events(self.raw(), n) };
        }
        // Deregister from tokio before the fd is closed.
        drop(self.async_fd.take());
        // SAFETY: every QP using this CQ holds it alive, so none is left; each freed once, CQ first.
        unsafe {
            if ibv_destroy_cq(self.raw()) != 0 {
                tracing::error!("ibv_destroy_cq failed");
            }
            ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}
