//! Queue pairs: posting work requests, and the connection's event thread.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use rdma_sys::*;

use super::cq::{OnQpError, RECV_BIT};
use crate::qp::{RecvDesc, SendDesc};
use crate::{CompletionQueue, Error, Result, SendOp};

/// The parts of a connected QP that its CQs and its event thread also reach.
pub(crate) struct QpInner {
    id: NonNull<rdma_cm_id>,
    channel: NonNull<rdma_event_channel>,
    disconnected: AtomicBool,
}

// SAFETY: rdma_cm ids and verbs QPs may be used from any thread; the pointers live until the
// owning `Qp` is destroyed, after the event thread is joined and the CQ hooks are removed.
unsafe impl Send for QpInner {}
// SAFETY: as above; shared use is limited to thread-safe calls (rdma_disconnect, post, query).
unsafe impl Sync for QpInner {}

impl QpInner {
    fn qp(&self) -> *mut ibv_qp {
        // SAFETY: the id is live and has a QP (created before the Qp value exists).
        unsafe { (*self.id.as_ptr()).qp }
    }
}

impl OnQpError for QpInner {
    /// Moves the QP to the error state (flushing it) and sends a DREQ, so the peer learns.
    fn qp_failed(&self) {
        if !self.disconnected.swap(true, Ordering::AcqRel) {
            // SAFETY: the id is live (see the Send/Sync note); rdma_disconnect is idempotent.
            unsafe { rdma_disconnect(self.id.as_ptr()) };
        }
    }
}

/// A connected RC queue pair on a verbs device.
pub(crate) struct Qp {
    inner: Arc<QpInner>,
    cqs: [CompletionQueue; 2],
    events: Option<JoinHandle<()>>,
    wake: [RawFd; 2],
    destroyed: bool,
}

fn verbs_cq(cq: &CompletionQueue) -> Option<&super::Cq> {
    cq.inner.imp.as_any().downcast_ref::<super::Cq>()
}

impl Qp {
    /// Takes ownership of a connected id (with its QP) and its own event channel. `accepting`:
    /// the id is a connect request not answered yet, which a failure here refuses with the
    /// reason (before the id is destroyed).
    pub(super) fn new(
        id: NonNull<rdma_cm_id>,
        channel: NonNull<rdma_event_channel>,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        accepting: bool,
    ) -> Result<(Self, u32, std::sync::mpsc::Receiver<super::cm::Event>)> {
        let refuse = |e: Error| {
            if accepting {
                let reason = crate::cm::set_up_reason(&e);
                // SAFETY: the id is live until `inner` drops, after this, and unanswered.
                unsafe { super::cm::reject(id.as_ptr(), &reason) };
            }
            e
        };
        let inner = Arc::new(QpInner {
            id,
            channel,
            disconnected: AtomicBool::new(false),
        });
        // SAFETY: the QP is live.
        let qp_num = unsafe { (*inner.qp()).qp_num };
        let mut wake = [-1; 2];
        // SAFETY: wake is a valid 2-element out-array.
        if unsafe { libc::pipe2(wake.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(refuse(Error::io(
                "creating the QP's wake pipe",
                io::Error::last_os_error(),
            )));
        }
        for cq in [send_cq, recv_cq] {
            if let Some(c) = verbs_cq(cq) {
                let hook: Weak<dyn OnQpError> = Arc::downgrade(&inner) as Weak<dyn OnQpError>;
                c.qps.lock().insert(qp_num, hook);
            }
        }
        let ev_inner = inner.clone();
        let wake_rd = wake[0];
        let (setup_tx, setup_rx) = std::sync::mpsc::channel();
        let events = std::thread::Builder::new()
            .name(format!("rdma-cm-{qp_num:x}"))
            .spawn(move || event_loop(&ev_inner, wake_rd, &setup_tx))
            .map_err(|e| refuse(Error::io("spawning the connection event thread", e)))?;
        Ok((
            Self {
                inner,
                cqs: [send_cq.clone(), recv_cq.clone()],
                events: Some(events),
                wake,
                destroyed: false,
            },
            qp_num,
            setup_rx,
        ))
    }

    /// The QP's attributes named by `mask` (`ibv_query_qp`); `None` when the query fails.
    fn query(&self, mask: ibv_qp_attr_mask) -> Option<ibv_qp_attr> {
        // SAFETY: ibv_qp_attr and ibv_qp_init_attr are plain old data.
        let (mut attr, mut init): (ibv_qp_attr, ibv_qp_init_attr) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: the QP is live; both out-pointers are valid.
        let rc = unsafe { ibv_query_qp(self.inner.qp(), &mut attr, mask.0 as i32, &mut init) };
        (rc == 0).then_some(attr)
    }

    pub(crate) fn is_error(&self) -> bool {
        self.query(ibv_qp_attr_mask::IBV_QP_STATE)
            .is_none_or(|a| a.qp_state == ibv_qp_state::IBV_QPS_ERR)
    }

    /// What the connection's transitions set: rdma_cm's path MTU, the Read depths the two
    /// sides agreed, the ACK timeout and the retry counts.
    pub(crate) fn path_attrs(&self) -> Option<crate::PathAttrs> {
        let attr = self.query(
            ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY,
        )?;
        Some(crate::PathAttrs {
            // enum ibv_mtu: 1 = 256 bytes ... 5 = 4096.
            path_mtu: 128u32 << attr.path_mtu.min(5),
            read_depth: attr.max_rd_atomic,
            read_responder: attr.max_dest_rd_atomic,
            ack_timeout: attr.timeout,
            retry_count: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
        })
    }

    pub(crate) fn post_send(&self, descs: &[SendDesc<'_>]) -> Result<(), (usize, Error)> {
        if descs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ibv_sge> = descs
            .iter()
            .map(|d| ibv_sge {
                addr: d.local.as_ref().map_or(0, |l| l.region.addr + l.off as u64),
                length: d.len as u32,
                lkey: d.local.as_ref().map_or(0, |l| l.region.lkey),
            })
            .collect();
        // SAFETY: ibv_send_wr is plain old data; all-zero is a valid (empty) request.
        let mut wrs: Vec<ibv_send_wr> = descs.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
        let base = wrs.as_mut_ptr();
        for (i, (d, wr)) in descs.iter().zip(wrs.iter_mut()).enumerate() {
            wr.wr_id = d.seq;
            wr.sg_list = &mut sges[i];
            wr.num_sge = i32::from(d.len > 0 || d.op.is_atomic());
            let mut flags = 0;
            if d.signaled {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if d.inline {
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            }
            wr.send_flags = flags;
            let imm = |wr: &mut ibv_send_wr, v: u32| wr.imm_data_invalidated_rkey_union.imm_data = v.to_be();
            match d.op {
                SendOp::Send { imm: None } => wr.opcode = ibv_wr_opcode::IBV_WR_SEND,
                SendOp::Send { imm: Some(v) } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                    imm(wr, v);
                }
                SendOp::Write { remote, imm: i } => {
                    wr.opcode = match i {
                        None => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                        Some(v) => {
                            imm(wr, v);
                            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                        }
                    };
                    wr.wr.rdma = rdma_t {
                        remote_addr: remote.addr,
                        rkey: remote.rkey,
                    };
                }
                SendOp::Read { remote } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                    wr.wr.rdma = rdma_t {
                        remote_addr: remote.addr,
                        rkey: remote.rkey,
                    };
                }
                SendOp::CompareSwap { remote, compare, swap } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    wr.wr.atomic = atomic_t {
                        remote_addr: remote.addr,
                        compare_add: compare,
                        swap,
                        rkey: remote.rkey,
                    };
                }
                SendOp::FetchAdd { remote, add } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    wr.wr.atomic = atomic_t {
                        remote_addr: remote.addr,
                        compare_add: add,
                        swap: 0,
                        rkey: remote.rkey,
                    };
                }
            }
            if i + 1 < descs.len() {
                // SAFETY: i + 1 is in bounds of `wrs`, which is not reallocated from here on.
                wr.next = unsafe { base.add(i + 1) };
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live; the list and its SGEs live until the call returns, and the
        // memory the SGEs name stays registered until completion (the tracker owns it).
        let rc = unsafe { ibv_post_send(self.inner.qp(), base, &mut bad) };
        post_result("ibv_post_send", rc, bad, base)
    }

    pub(crate) fn post_recv(&self, descs: &[RecvDesc<'_>]) -> Result<(), (usize, Error)> {
        let qp = self.inner.qp();
        post_recvs(descs, "ibv_post_recv", |wr, bad| {
            // SAFETY: the QP is live; the list and its SGEs live until the call returns, and the
            // memory they name stays registered until completion (the tracker owns it).
            unsafe { ibv_post_recv(qp, wr, bad) }
        })
    }

    /// Disconnects, stops the event thread and destroys QP, id and channel, in that order.
    pub(crate) fn destroy(&mut self) {
        if std::mem::replace(&mut self.destroyed, true) {
            return;
        }
        // SAFETY: wake[1] is our pipe's write end.
        unsafe { libc::write(self.wake[1], [1u8].as_ptr().cast(), 1) };
        if let Some(t) = self.events.take() {
            let _ = t.join();
        }
        for cq in &self.cqs {
            if let Some(c) = verbs_cq(cq) {
                // SAFETY: reading the QP number of a live QP.
                let num = unsafe { (*self.inner.qp()).qp_num };
                c.qps.lock().remove(&num);
            }
        }
        self.inner.qp_failed();
        // SAFETY: the event thread is gone and the CQ hooks removed, so nothing else uses these;
        // the QP goes before the id, the id before its channel; each is destroyed once.
        unsafe {
            rdma_destroy_qp(self.inner.id.as_ptr());
            rdma_destroy_id(self.inner.id.as_ptr());
            rdma_destroy_event_channel(self.inner.channel.as_ptr());
            libc::close(self.wake[0]);
            libc::close(self.wake[1]);
        }
    }
}

/// Posts `descs` as one list of receives through `post` (`ibv_post_recv` or
/// `ibv_post_srq_recv`), which is given the list and where to say which one it refused.
pub(super) fn post_recvs(
    descs: &[RecvDesc<'_>],
    call: &'static str,
    post: impl FnOnce(*mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> i32,
) -> Result<(), (usize, Error)> {
    if descs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ibv_sge> = descs
        .iter()
        .map(|d| ibv_sge {
            addr: d.local.as_ref().map_or(0, |l| l.region.addr + l.off as u64),
            length: d.local.as_ref().map_or(0, |l| l.len as u32),
            lkey: d.local.as_ref().map_or(0, |l| l.region.lkey),
        })
        .collect();
    let mut wrs: Vec<ibv_recv_wr> = descs
        .iter()
        .map(|d| ibv_recv_wr {
            wr_id: d.seq | RECV_BIT,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: i32::from(d.local.is_some()),
        })
        .collect();
    let base = wrs.as_mut_ptr();
    for (i, wr) in wrs.iter_mut().enumerate() {
        wr.sg_list = &mut sges[i];
        if i + 1 < descs.len() {
            // SAFETY: i + 1 is in bounds of `wrs`, which is not reallocated from here on.
            wr.next = unsafe { base.add(i + 1) };
        }
    }
    let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
    let rc = post(base, &mut bad);
    post_result(call, rc, bad, base)
}

/// Maps a post's return code to the index of the first request not posted and the error.
pub(super) fn post_result<T>(call: &'static str, rc: i32, bad: *mut T, base: *mut T) -> Result<(), (usize, Error)> {
    if rc == 0 {
        return Ok(());
    }
    let at = if bad.is_null() {
        0
    } else {
        // SAFETY: on failure the provider sets bad to a request of the list that starts at base,
        // which is one allocation (a Vec not reallocated during the post).
        unsafe { bad.offset_from(base) }.max(0) as usize
    };
    let source = io::Error::from_raw_os_error(rc.abs());
    Err((at, Error::Verbs { call, source }))
}

/// Reads the connection's rdma_cm events until woken: a DISCONNECTED (the peer disconnected,
/// failed, or died and its kernel sent a DREQ) moves our QP to the error state.
/// Connection set-up events (ESTABLISHED, REJECTED, errors) go to `setup`, for the accept or
/// connect that waits on them.
fn event_loop(inner: &QpInner, wake: RawFd, setup: &std::sync::mpsc::Sender<super::cm::Event>) {
    // SAFETY: the channel is live until after this thread is joined.
    let fd = unsafe { (*inner.channel.as_ptr()).fd };
    loop {
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of 2 pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live and readable; ev is a valid out-pointer.
        if unsafe { rdma_get_cm_event(inner.channel.as_ptr(), &mut ev) } != 0 {
            return;
        }
        // SAFETY: ev is a valid event until acknowledged below.
        let event = unsafe { super::cm::copy_event(ev) };
        tracing::debug!(kind = event.kind, "rdma_cm event on a QP");
        use rdma_cm_event_type::*;
        match event.kind {
            RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL => inner.qp_failed(),
            RDMA_CM_EVENT_TIMEWAIT_EXIT => {}
            _ => {
                let _ = setup.send(event);
            }
        }
        // SAFETY: ev came from rdma_get_cm_event and is acknowledged once.
        unsafe { rdma_ack_cm_event(ev) };
    }
}
