//! Reliable-connected queue pairs, and the bookkeeping that ties buffers to work requests.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cq::RawWc;
use crate::mr::Region;
use crate::{
    Completion, CompletionQueue, Error, MemoryRegion, ProtectionDomain, RecvWr, Result, SendOp, SendWr, WcOpcode,
    WcStatus,
};

/// Queue sizes asked for when a QP is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send-queue work requests (signaled or not) at most.
    pub max_send_wr: u32,
    /// Posted receives at most.
    pub max_recv_wr: u32,
    /// Largest inline send; at most the device's `max_inline_data`.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_inline_data: 64,
        }
    }
}

/// What a new queue pair is made of: its PD, its completion queues and its sizes.
#[derive(Debug, Clone)]
pub struct QpOptions {
    pub(crate) pd: ProtectionDomain,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) caps: QpCaps,
    pub(crate) srq: Option<crate::SharedReceiveQueue>,
}

impl QpOptions {
    /// A QP in `pd` whose send and receive completions both go to `cq`, with default sizes.
    pub fn new(pd: &ProtectionDomain, cq: &CompletionQueue) -> Self {
        Self {
            pd: pd.clone(),
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            caps: QpCaps::default(),
            srq: None,
        }
    }

    /// Takes receives from `srq` (of the same PD) instead of a receive queue of its own, as
    /// `ibv_qp_init_attr.srq` does: [`QueuePair::post_recv`] then refuses, and `max_recv_wr`
    /// is ignored.
    pub fn srq(mut self, srq: &crate::SharedReceiveQueue) -> Self {
        self.srq = Some(srq.clone());
        self
    }

    /// A separate CQ for receive completions.
    pub fn recv_cq(mut self, cq: &CompletionQueue) -> Self {
        self.recv_cq = cq.clone();
        self
    }

    /// Queue sizes.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let dev = self.pd.device();
        let c = dev.caps();
        let same = |cq: &CompletionQueue| Arc::ptr_eq(&cq.inner.device.inner, &dev.inner);
        if !same(&self.send_cq) || !same(&self.recv_cq) {
            return Err(Error::InvalidArgument(
                "PD and CQs must belong to the same device".into(),
            ));
        }
        if let Some(srq) = &self.srq {
            if !Arc::ptr_eq(&srq.pd().inner, &self.pd.inner) {
                return Err(Error::InvalidArgument(
                    "a QP and its shared receive queue must belong to the same PD".into(),
                ));
            }
        }
        if self.caps.max_inline_data > c.max_inline_data {
            return Err(Error::InvalidArgument(format!(
                "max_inline_data {} exceeds the device's {}",
                self.caps.max_inline_data, c.max_inline_data
            )));
        }
        for (what, n) in [
            ("max_send_wr", self.caps.max_send_wr),
            ("max_recv_wr", self.caps.max_recv_wr),
        ] {
            if n == 0 || n > c.max_qp_wr {
                return Err(Error::InvalidArgument(format!(
                    "{what} {n} must be within 1..={}",
                    c.max_qp_wr
                )));
            }
        }
        Ok(())
    }
}

/// A local buffer as a provider sees it while the request is in flight.
pub(crate) struct LocalDesc<'a> {
    pub(crate) region: &'a Arc<Region>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// A send-queue request as handed to a provider.
pub(crate) struct SendDesc<'a> {
    pub(crate) seq: u64,
    pub(crate) op: SendOp,
    pub(crate) local: Option<LocalDesc<'a>>,
    pub(crate) len: usize,
    pub(crate) signaled: bool,
    /// The tcp provider copies every payload at post time, so only verbs reads this.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) inline: bool,
}

/// A receive as handed to a provider.
pub(crate) struct RecvDesc<'a> {
    pub(crate) seq: u64,
    pub(crate) local: Option<LocalDesc<'a>>,
}

/// A post that was refused at once (as `ibv_post_send` returning an errno): the work requests
/// that were not posted come back, with their buffers.
#[derive(Debug, thiserror::Error)]
#[error("post refused ({} work request(s) not posted)", .unposted.len())]
pub struct PostError<W> {
    /// Why.
    #[source]
    pub error: Error,
    /// The requests not posted, in order; those before them were posted.
    pub unposted: Vec<W>,
}

struct SendSlot {
    seq: u64,
    wr_id: u64,
    opcode: WcOpcode,
    buf: Option<MemoryRegion>,
}

struct RecvSlot {
    seq: u64,
    wr_id: u64,
    buf: Option<MemoryRegion>,
}

/// The in-flight table of one QP: requests in posting order, each owning its buffer.
#[derive(Default)]
struct Tracker {
    sends: VecDeque<SendSlot>,
    recvs: VecDeque<RecvSlot>,
    next_send: u64,
    next_recv: u64,
}

/// State shared by a QP and the CQs that report its completions.
pub(crate) struct QpShared {
    pub(crate) qp_num: u32,
    tracker: Mutex<Tracker>,
    /// Where its receives (and their buffers) come from, if not its own queue.
    srq: Option<crate::SharedReceiveQueue>,
}

impl QpShared {
    /// Attaches the buffer to a provider completion. Send completions arrive in posting order, so
    /// older unsignaled requests are done too: their buffers are released here.
    pub(crate) fn complete(&self, raw: RawWc) -> Completion {
        if let (true, Some(srq)) = (raw.recv, &self.srq) {
            let (wr_id, buf) = srq.complete(raw.seq).unwrap_or_else(|| {
                tracing::error!(
                    qp = self.qp_num,
                    seq = raw.seq,
                    "completion of a receive the SRQ does not hold"
                );
                (raw.seq, None)
            });
            return raw.into_completion(wr_id, raw.opcode, buf);
        }
        let mut t = self.tracker.lock();
        let (wr_id, opcode, buf) = if raw.recv {
            match t.recvs.front() {
                Some(s) if s.seq == raw.seq => match t.recvs.pop_front() {
                    Some(s) => (s.wr_id, raw.opcode, s.buf),
                    None => (raw.seq, raw.opcode, None),
                },
                _ => {
                    tracing::error!(qp = self.qp_num, seq = raw.seq, "receive completion out of order");
                    (raw.seq, raw.opcode, None)
                }
            }
        } else {
            while t.sends.front().is_some_and(|s| s.seq < raw.seq) {
                t.sends.pop_front();
            }
            match t.sends.front() {
                Some(s) if s.seq == raw.seq => match t.sends.pop_front() {
                    Some(s) => {
                        let op = if raw.status.is_success() { raw.opcode } else { s.opcode };
                        (s.wr_id, op, s.buf)
                    }
                    None => (raw.seq, raw.opcode, None),
                },
                _ => {
                    tracing::error!(qp = self.qp_num, seq = raw.seq, "send completion with no request");
                    (raw.seq, raw.opcode, None)
                }
            }
        };
        raw.into_completion(wr_id, opcode, buf)
    }
}

impl RawWc {
    fn into_completion(self, wr_id: u64, opcode: WcOpcode, buf: Option<MemoryRegion>) -> Completion {
        Completion {
            wr_id,
            status: self.status,
            opcode,
            byte_len: self.byte_len,
            imm: self.imm,
            qp_num: self.qp_num,
            vendor_err: self.vendor_err,
            buf,
            head: self.head,
        }
    }
}

/// A connected reliable (RC) queue pair, ready to post. Made by
/// [`connect`](crate::connect) or [`ConnectRequest::accept`](crate::ConnectRequest::accept).
///
/// Dropping it destroys the QP first (the NIC stops touching memory), then releases the buffers
/// of requests still in flight. Its completions not yet polled are cleaned from its CQs, as
/// ConnectX's provider does when a QP is destroyed: a CQ that other QPs share never hands out
/// a completion of a dropped QP (whose work request ids mean nothing any more). To see every
/// completion of a QP, poll until its last one came before dropping it.
pub struct QueuePair {
    // Field order is drop order: the provider QP goes before the buffers it may touch.
    imp: Box<dyn crate::provider::QpOps>,
    shared: Arc<QpShared>,
    opts: QpOptions,
}

impl QueuePair {
    pub(crate) fn new(imp: Box<dyn crate::provider::QpOps>, qp_num: u32, opts: QpOptions) -> Self {
        let shared = Arc::new(QpShared {
            qp_num,
            tracker: Mutex::new(Tracker::default()),
            srq: opts.srq.clone(),
        });
        opts.send_cq.attach(&shared);
        opts.recv_cq.attach(&shared);
        Self { imp, shared, opts }
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    /// The sizes it was created with.
    pub fn caps(&self) -> QpCaps {
        self.opts.caps
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.opts.pd
    }

    /// True once the QP is in the error state: every request now completes with a flush error.
    pub fn is_error(&self) -> bool {
        self.imp.is_error()
    }

    /// What the connection's set-up agreed on a device that has these attributes (`verbs`):
    /// the path MTU rdma_cm found, the RDMA Read depths both sides agreed, the ACK timeout and
    /// the retry counts. `None` on the software providers, whose links have none of them.
    pub fn path_attrs(&self) -> Option<PathAttrs> {
        self.imp.path_attrs()
    }

    /// Whether the peer's poller last ran on the CPU this thread runs on now, as far as the
    /// provider can tell: a hint for a thread about to spin for a completion only the peer can
    /// cause. While the two share a core, spinning only keeps the peer from running; sleep on
    /// the completion channel instead. Each call also tells the peer where this thread runs.
    ///
    /// Only the shm provider can tell (both ends on one host); tcp and verbs always say false.
    ///
    /// ```
    /// use std::time::Duration;
    /// use rdma_rpc_transport::{connect, Device, Listener, QpOptions};
    /// let dev = Device::open("shm")?;
    /// let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(64)?);
    /// let listener = Listener::bind(&dev, "127.0.0.1:0".parse().unwrap())?;
    /// let addr = listener.local_addr()?;
    /// let opts = QpOptions::new(&pd, &cq);
    /// let server = std::thread::spawn({
    ///     let opts = opts.clone();
    ///     move || listener.accept(Some(Duration::from_secs(5)))?.accept(&opts, b"")
    /// });
    /// let (qp, _) = connect(addr, &opts, b"", Duration::from_secs(5))?;
    /// let server_qp = server.join().unwrap()?;
    /// // Nobody told the client where the server's poller runs yet.
    /// assert!(!qp.peer_shares_cpu());
    /// // The server's poller says where it runs; a client poller about to wait decides.
    /// server_qp.peer_shares_cpu();
    /// if qp.peer_shares_cpu() {
    ///     // Same core: sleep on the CQ's completion channel (`CompletionQueue::wait`).
    /// } else {
    ///     // Another core (or it moved since): spinning on `poll` may pay off.
    /// }
    /// # Ok::<(), rdma_rpc_transport::Error>(())
    /// ```
    pub fn peer_shares_cpu(&self) -> bool {
        self.imp.peer_shares_cpu()
    }

    /// When the peer's poller runs on this thread's CPU ([`QueuePair::peer_shares_cpu`]), moves
    /// this thread to another CPU it may run on, so that both can poll at once; true when it
    /// moved. The thread's affinity mask is the same afterwards: the kernel moves a thread whose
    /// mask leaves out its CPU for a moment and does not move it back when the mask returns.
    /// Nothing happens to a thread that may run on one CPU only (pinned by its owner), on a
    /// provider that does not know where the peer runs (`tcp`, `verbs`), or when the peer is
    /// elsewhere.
    ///
    /// Why: two threads that wake each other up in turn are put on one CPU by Linux and left
    /// there while the other CPU idles, since only one of them is ever runnable; each message
    /// then costs two context switches instead of none.
    pub fn leave_peer_cpu(&self) -> bool {
        self.imp.leave_peer_cpu()
    }

    /// Number of send-queue requests posted and not yet reaped (signaled or not).
    pub fn outstanding_sends(&self) -> usize {
        self.shared.tracker.lock().sends.len()
    }

    /// Posts one send-queue work request.
    ///
    /// # Errors
    /// [`PostError`] with the request when it is invalid for this QP (inline too long, message
    /// too long, atomic buffer not 8 bytes, no atomics, queue full).
    pub fn post_send(&self, wr: SendWr) -> Result<(), PostError<SendWr>> {
        // The batch path without its vectors: one request is the hot path of every RPC.
        let mut t = self.shared.tracker.lock();
        let refuse = |error, wr| {
            Err(PostError {
                error,
                unposted: vec![wr],
            })
        };
        if t.sends.len() >= self.opts.caps.max_send_wr as usize {
            let depth = self.opts.caps.max_send_wr;
            return refuse(Error::QueueFull { queue: "send", depth }, wr);
        }
        if let Err(e) = self.check_send(&wr) {
            return refuse(e, wr);
        }
        let seq = t.next_send;
        let desc = SendDesc {
            seq,
            op: wr.op,
            local: wr.buf.as_ref().map(|b| LocalDesc {
                region: &b.region,
                off: b.off,
                len: wr.data_len(),
            }),
            len: wr.data_len(),
            signaled: wr.signaled,
            inline: wr.inline,
        };
        if let Err((_, e)) = self.imp.post_send(std::slice::from_ref(&desc)) {
            return refuse(e, wr);
        }
        t.sends.push_back(SendSlot {
            seq,
            wr_id: wr.wr_id,
            opcode: wr.op.wc_opcode(),
            buf: wr.buf,
        });
        t.next_send = seq + 1;
        Ok(())
    }

    /// Posts several send-queue requests with one doorbell (one `ibv_post_send` on verbs).
    ///
    /// # Errors
    /// As [`QueuePair::post_send`]; the requests before the refused one are posted.
    pub fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<(), PostError<SendWr>> {
        let mut wrs: Vec<SendWr> = wrs.into_iter().collect();
        let mut t = self.shared.tracker.lock();
        let room = (self.opts.caps.max_send_wr as usize).saturating_sub(t.sends.len());
        let mut n_ok = wrs.len().min(room);
        let mut first_err = (n_ok < wrs.len()).then_some(Error::QueueFull {
            queue: "send",
            depth: self.opts.caps.max_send_wr,
        });
        if let Some(i) = wrs[..n_ok].iter().position(|w| self.check_send(w).is_err()) {
            first_err = self.check_send(&wrs[i]).err();
            n_ok = i;
        }
        let base = t.next_send;
        let descs: Vec<SendDesc<'_>> = wrs[..n_ok]
            .iter()
            .enumerate()
            .map(|(i, w)| SendDesc {
                seq: base + i as u64,
                op: w.op,
                local: w.buf.as_ref().map(|b| LocalDesc {
                    region: &b.region,
                    off: b.off,
                    len: w.data_len(),
                }),
                len: w.data_len(),
                signaled: w.signaled,
                inline: w.inline,
            })
            .collect();
        let posted = match self.imp.post_send(&descs) {
            Ok(()) => n_ok,
            Err((i, e)) => {
                first_err = Some(e);
                i
            }
        };
        drop(descs);
        let rest = wrs.split_off(posted);
        for (i, w) in wrs.into_iter().enumerate() {
            t.sends.push_back(SendSlot {
                seq: base + i as u64,
                wr_id: w.wr_id,
                opcode: w.op.wc_opcode(),
                buf: w.buf,
            });
        }
        t.next_send = base + posted as u64;
        match first_err {
            Some(error) if !rest.is_empty() => Err(PostError { error, unposted: rest }),
            _ => Ok(()),
        }
    }

    fn check_send(&self, w: &SendWr) -> Result<()> {
        let caps = self.opts.pd.device().caps();
        let len = w.data_len();
        if let Some(b) = &w.buf {
            if len > b.len() {
                return Err(Error::InvalidArgument(format!(
                    "length {len} beyond buffer of {}",
                    b.len()
                )));
            }
        } else if len > 0 {
            return Err(Error::InvalidArgument(format!("length {len} with no buffer")));
        }
        if len as u64 > caps.max_msg_size {
            return Err(Error::MessageTooLarge {
                len,
                max: caps.max_msg_size,
            });
        }
        if w.op.is_atomic() {
            if !caps.atomics {
                return Err(Error::AtomicsUnsupported(self.opts.pd.device().name().to_owned()));
            }
            if let SendOp::CompareSwap { remote, .. } | SendOp::FetchAdd { remote, .. } = w.op {
                if remote.addr % 8 != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        remote.addr
                    )));
                }
            }
            if w.buf.as_ref().map(MemoryRegion::len).unwrap_or(0) < 8 || w.len.is_some_and(|l| l != 8) {
                return Err(Error::InvalidArgument(
                    "an atomic needs an 8-byte local buffer for the old value".into(),
                ));
            }
        }
        if w.inline {
            if !matches!(w.op, SendOp::Send { .. } | SendOp::Write { .. }) {
                return Err(Error::InvalidArgument("only Send and Write can be inline".into()));
            }
            if len > self.opts.caps.max_inline_data as usize {
                return Err(Error::InlineTooLarge {
                    len,
                    max: self.opts.caps.max_inline_data,
                });
            }
        }
        Ok(())
    }

    /// Posts one receive.
    ///
    /// # Errors
    /// [`PostError`] with the request when the receive queue is full.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), PostError<RecvWr>> {
        if self.opts.srq.is_some() {
            return Err(PostError {
                error: srq_attached(),
                unposted: vec![wr],
            });
        }
        // The batch path without its vectors (every message reposts one receive).
        let mut t = self.shared.tracker.lock();
        if t.recvs.len() >= self.opts.caps.max_recv_wr as usize {
            let depth = self.opts.caps.max_recv_wr;
            return Err(PostError {
                error: Error::QueueFull {
                    queue: "receive",
                    depth,
                },
                unposted: vec![wr],
            });
        }
        let seq = t.next_recv;
        let desc = RecvDesc {
            seq,
            local: wr.buf.as_ref().map(|b| LocalDesc {
                region: &b.region,
                off: b.off,
                len: b.len,
            }),
        };
        if let Err((_, error)) = self.imp.post_recv(std::slice::from_ref(&desc)) {
            return Err(PostError {
                error,
                unposted: vec![wr],
            });
        }
        t.recvs.push_back(RecvSlot {
            seq,
            wr_id: wr.wr_id,
            buf: wr.buf,
        });
        t.next_recv = seq + 1;
        Ok(())
    }

    /// Posts several receives at once.
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`].
    pub fn post_recv_batch(&self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError<RecvWr>> {
        let mut wrs: Vec<RecvWr> = wrs.into_iter().collect();
        if self.opts.srq.is_some() && !wrs.is_empty() {
            return Err(PostError {
                error: srq_attached(),
                unposted: wrs,
            });
        }
        let mut t = self.shared.tracker.lock();
        let room = (self.opts.caps.max_recv_wr as usize).saturating_sub(t.recvs.len());
        let n_ok = wrs.len().min(room);
        let mut first_err = (n_ok < wrs.len()).then_some(Error::QueueFull {
            queue: "receive",
            depth: self.opts.caps.max_recv_wr,
        });
        let base = t.next_recv;
        let descs = recv_descs(&wrs[..n_ok], base);
        let posted = match self.imp.post_recv(&descs) {
            Ok(()) => n_ok,
            Err((i, e)) => {
                first_err = Some(e);
                i
            }
        };
        drop(descs);
        let rest = wrs.split_off(posted);
        for (i, w) in wrs.into_iter().enumerate() {
            t.recvs.push_back(RecvSlot {
                seq: base + i as u64,
                wr_id: w.wr_id,
                buf: w.buf,
            });
        }
        t.next_recv = base + posted as u64;
        match first_err {
            Some(error) if !rest.is_empty() => Err(PostError { error, unposted: rest }),
            _ => Ok(()),
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.imp.destroy();
        self.opts.send_cq.detach(self.shared.qp_num);
        self.opts.recv_cq.detach(self.shared.qp_num);
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.shared.qp_num)
            .field("caps", &self.opts.caps)
            .finish()
    }
}

/// The receives `wrs` as a provider sees them, numbered from `base`.
pub(crate) fn recv_descs(wrs: &[RecvWr], base: u64) -> Vec<RecvDesc<'_>> {
    wrs.iter()
        .enumerate()
        .map(|(i, w)| RecvDesc {
            seq: base + i as u64,
            local: w.buf.as_ref().map(|b| LocalDesc {
                region: &b.region,
                off: b.off,
                len: b.len,
            }),
        })
        .collect()
}

fn srq_attached() -> Error {
    Error::InvalidArgument(
        "this QP takes its receives from a shared receive queue: post them there (SharedReceiveQueue::post_recv)"
            .into(),
    )
}

/// The completion status a flushed request gets.
pub(crate) const FLUSH: WcStatus = WcStatus::WrFlushErr;

/// A connected QP's path and retry attributes ([`QueuePair::path_attrs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PathAttrs {
    /// Path MTU in bytes (256 to 4096), from rdma_cm's route.
    pub path_mtu: u32,
    /// RDMA Reads and atomics this side may have outstanding at the peer (`max_rd_atomic`):
    /// at most the peer's responder resources.
    pub read_depth: u8,
    /// The peer's RDMA Reads and atomics this side serves at once (`max_dest_rd_atomic`): at
    /// most the peer's initiator depth.
    pub read_responder: u8,
    /// Local ACK timeout exponent: 4.096 µs x 2^this per try.
    pub ack_timeout: u8,
    /// Transport retries before a request fails with `RETRY_EXC_ERR` (7 means for ever on
    /// some devices, so it is never 7 here).
    pub retry_count: u8,
    /// RNR retries (7 means for ever).
    pub rnr_retry: u8,
}
