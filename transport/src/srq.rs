//! Shared receive queues: one pool of posted receives that many QPs consume from.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::qp::PostError;
use crate::{Error, MemoryRegion, ProtectionDomain, RecvWr, Result};

/// A shared receive queue (SRQ), as `ibv_create_srq` makes: receives posted here are taken,
/// oldest first, by whichever attached QP receives a Send (or a Write with immediate) next.
/// Cheap to clone.
///
/// Attach QPs with [`QpOptions::srq`](crate::QpOptions::srq); they then have no receive queue
/// of their own ([`QueuePair::post_recv`](crate::QueuePair::post_recv) refuses). A receive
/// completion names the QP that took the receive ([`Completion::qp_num`](crate::Completion)),
/// and gives its buffer back as any receive's does. A QP that goes to the error state flushes
/// its own work, never this queue's receives. An empty queue holds an arriving Send as a QP
/// without receives does (RNR): the sender gets `RNR_RETRY_EXC_ERR` when none is posted within
/// its retry budget.
///
/// One queue serves many connections with the memory of one: `n` QPs that each keep `r`
/// receives posted hold `n * r` buffers, the same QPs on one SRQ as many as the traffic needs.
/// Refill it when the limit event says it runs low ([`arm_limit`](Self::arm_limit)).
///
/// # Examples
/// Two clients Send to two server QPs that share one SRQ:
/// ```
/// use std::time::Duration;
/// use rdma_rpc_transport::*;
/// let dev = Device::open("tcp")?;
/// let (pd, cq) = (dev.alloc_pd()?, dev.create_cq(64)?);
/// let srq = pd.create_srq(16)?;
/// let listener = Listener::bind(&dev, "127.0.0.1:0".parse().unwrap())?;
/// let addr = listener.local_addr()?;
/// let server_opts = QpOptions::new(&pd, &cq).srq(&srq);
/// let server = std::thread::spawn(move || -> Result<Vec<QueuePair>> {
///     (0..2).map(|_| listener.accept(None)?.accept(&server_opts, b"")).collect()
/// });
/// let (cpd, ccq) = (dev.alloc_pd()?, dev.create_cq(64)?);
/// let clients: Vec<QueuePair> = (0..2)
///     .map(|_| Ok(connect(addr, &QpOptions::new(&cpd, &ccq), b"", Duration::from_secs(5))?.0))
///     .collect::<Result<_>>()?;
/// let servers = server.join().unwrap()?;
/// for i in 0..2 {
///     srq.post_recv(RecvWr::new(i, pd.register(8, AccessFlags::LOCAL_WRITE)?))
///         .map_err(|e| e.error)?;
/// }
/// for (i, c) in clients.iter().enumerate() {
///     let mut b = cpd.register(8, AccessFlags::NONE)?;
///     b.write_at(0, &[i as u8; 8])?;
///     c.post_send(SendWr::send(i as u64, b)).map_err(|e| e.error)?;
/// }
/// let mut got = Vec::new();
/// while got.len() < 2 {
///     cq.poll(&mut got, 2)?;
/// }
/// let mut by = got.iter().map(|c| c.qp_num).collect::<Vec<_>>();
/// by.sort();
/// let mut want = servers.iter().map(|q| q.qp_num()).collect::<Vec<_>>();
/// want.sort();
/// assert_eq!(by, want); // each completion names the QP that took the receive
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqShared>,
}

pub(crate) struct SrqShared {
    // Field order is drop order: the provider's queue goes before the buffers it names.
    pub(crate) imp: Box<dyn crate::provider::SrqOps>,
    pd: ProtectionDomain,
    max_wr: u32,
    slots: Mutex<Slots>,
    pub(crate) event: Arc<LimitEvent>,
}

#[derive(Default)]
struct Slots {
    /// Posted receives by sequence number, each owning its buffer until its completion.
    posted: HashMap<u64, (u64, Option<MemoryRegion>)>,
    next: u64,
}

/// The SRQ limit event: fired once per arming.
pub(crate) struct LimitEvent {
    fired: AtomicBool,
    notify: tokio::sync::Notify,
}

impl LimitEvent {
    pub(crate) fn new() -> Self {
        Self {
            fired: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    fn take(&self) -> bool {
        self.fired.swap(false, Ordering::AcqRel)
    }
}

impl SharedReceiveQueue {
    pub(crate) fn new(pd: &ProtectionDomain, max_wr: u32) -> Result<Self> {
        let dev = pd.device();
        let max = dev.caps().max_qp_wr;
        if max_wr == 0 || max_wr > max {
            return Err(Error::InvalidArgument(format!(
                "SRQ depth {max_wr} must be within 1..={max}"
            )));
        }
        let event = Arc::new(LimitEvent::new());
        let imp = dev.inner.imp.create_srq(pd, max_wr, event.clone())?;
        Ok(Self {
            inner: Arc::new(SrqShared {
                imp,
                pd: pd.clone(),
                max_wr,
                slots: Mutex::new(Slots::default()),
                event,
            }),
        })
    }

    /// The protection domain its receives' buffers must belong to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The most receives it holds posted at once.
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }

    /// Posts one receive.
    ///
    /// # Errors
    /// [`PostError`] with the request when the queue holds `max_wr` receives already.
    pub fn post_recv(&self, wr: RecvWr) -> std::result::Result<(), PostError<RecvWr>> {
        self.post_recv_batch(std::iter::once(wr))
    }

    /// Posts several receives at once (one `ibv_post_srq_recv` on verbs).
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv); the receives before the refused one are posted.
    pub fn post_recv_batch(&self, wrs: impl IntoIterator<Item = RecvWr>) -> std::result::Result<(), PostError<RecvWr>> {
        let mut wrs: Vec<RecvWr> = wrs.into_iter().collect();
        let mut slots = self.inner.slots.lock();
        let base = slots.next;
        let descs = crate::qp::recv_descs(&wrs, base);
        let (posted, err) = self
            .inner
            .imp
            .post(&descs)
            .map_or_else(|(i, e)| (i, Some(e)), |()| (descs.len(), None));
        drop(descs);
        let rest = wrs.split_off(posted);
        for (i, w) in wrs.into_iter().enumerate() {
            slots.posted.insert(base + i as u64, (w.wr_id, w.buf));
        }
        slots.next = base + posted as u64;
        match err {
            Some(error) if !rest.is_empty() => Err(PostError { error, unposted: rest }),
            _ => Ok(()),
        }
    }

    /// Arms the limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): it fires once when a QP
    /// takes a receive and leaves fewer than `limit` posted, and
    /// [`limit_reached`](Self::limit_reached) returns; arm it again after refilling. 0 disarms
    /// it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a limit above `max_wr`; verbs errors.
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        if limit > self.inner.max_wr {
            return Err(Error::InvalidArgument(format!(
                "SRQ limit {limit} above its depth {}",
                self.inner.max_wr
            )));
        }
        self.inner.imp.arm(limit)
    }

    /// Whether the armed limit event fired since the last call (and takes it).
    pub fn limit_fired(&self) -> bool {
        self.inner.imp.read_events();
        self.inner.event.take()
    }

    /// Waits until the armed limit event fires (at once if it fired since the last look).
    ///
    /// # Errors
    /// Verbs: reading the device's async events failed, or no tokio runtime.
    ///
    /// # Cancel safety
    /// Cancel safe: an event that fires meanwhile is kept for the next call.
    pub async fn limit_reached(&self) -> Result<()> {
        loop {
            let notified = self.inner.event.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.limit_fired() {
                return Ok(());
            }
            tokio::select! {
                () = &mut notified => {}
                r = self.inner.imp.events_ready() => r?,
            }
        }
    }

    /// The buffer and id of the receive a completion names (`seq`), given back.
    pub(crate) fn complete(&self, seq: u64) -> Option<(u64, Option<MemoryRegion>)> {
        self.inner.slots.lock().posted.remove(&seq)
    }
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("max_wr", &self.inner.max_wr)
            .finish()
    }
}
