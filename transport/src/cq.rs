//! Completion queues: where finished work requests come back, with their buffers.

use std::sync::Arc;

use foldhash::HashMap;

use parking_lot::Mutex;

use crate::qp::QpShared;
use crate::{Device, Error, MemoryRegion, Result, WcOpcode, WcStatus};

/// One finished work request (`struct ibv_wc`), plus the buffer it held.
#[derive(Debug)]
#[non_exhaustive]
pub struct Completion {
    /// The `wr_id` given when the request was posted.
    pub wr_id: u64,
    /// Success or the reason of failure.
    pub status: WcStatus,
    /// What completed (for errors, what was posted).
    pub opcode: WcOpcode,
    /// Bytes received (receives) or read (RDMA Read); 8 for atomics.
    pub byte_len: u32,
    /// Immediate data of a Send-with-imm or Write-with-imm.
    pub imm: Option<u32>,
    /// The queue pair number.
    pub qp_num: u32,
    /// Provider-specific error detail (0 when none).
    pub vendor_err: u32,
    /// The buffer the request named, handed back: the request can no longer touch it.
    pub buf: Option<MemoryRegion>,
    /// Receives: a copy of the message's first bytes, where the provider delivers one with
    /// the completion (see [`Head`](crate::Head)); empty otherwise.
    pub head: crate::Head,
}

impl Completion {
    /// `Ok(self)` on success, else an error naming the status.
    ///
    /// # Errors
    /// [`CompletionError`] with the status, wr_id and the buffer (so it is not lost).
    pub fn ok(self) -> Result<Self, CompletionError> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(CompletionError { completion: self })
        }
    }
}

/// A completion that did not succeed.
#[derive(Debug, thiserror::Error)]
#[error("work request {} on QP {} failed: {}{}", .completion.wr_id, .completion.qp_num, .completion.status,
    .completion.status.hint().map(|h| format!(" ({h})")).unwrap_or_default())]
pub struct CompletionError {
    /// The failed completion, with its buffer.
    pub completion: Completion,
}

/// What a provider reports before the buffer is attached.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawWc {
    pub(crate) qp_num: u32,
    /// The per-QP sequence number the common layer used as the provider's wr_id.
    pub(crate) seq: u64,
    pub(crate) recv: bool,
    pub(crate) status: WcStatus,
    pub(crate) opcode: WcOpcode,
    pub(crate) byte_len: u32,
    pub(crate) imm: Option<u32>,
    pub(crate) vendor_err: u32,
    pub(crate) head: crate::Head,
}

struct Reaping {
    held: std::collections::VecDeque<Completion>,
    scratch: Vec<RawWc>,
    /// Where `ready` reaps before holding (kept, so that no wait allocates).
    spare: Vec<Completion>,
}

/// A completion queue, shareable by many queue pairs. Cheap to clone.
///
/// Poll it ([`CompletionQueue::poll`]) or wait on it under tokio ([`CompletionQueue::wait`]).
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqShared>,
}

pub(crate) struct CqShared {
    pub(crate) device: Device,
    pub(crate) depth: u32,
    /// Looked up once per completion: foldhash, not std's SipHash (which cost about 110
    /// instructions a lookup, some 450 per RPC round trip on shm, counted by callgrind).
    pub(crate) qps: Mutex<HashMap<u32, Arc<QpShared>>>,
    /// Completions reaped by [`CompletionQueue::ready`] (handed out first by the next poll),
    /// and the provider's raw completions of a poll. One lock for both: every reap holds it, so
    /// completions held by `ready` cannot be overtaken by later ones.
    reaping: Mutex<Reaping>,
    pub(crate) imp: Box<dyn crate::provider::CqOps>,
}

impl CompletionQueue {
    pub(crate) fn new(device: &Device, depth: u32) -> Result<Self> {
        if depth == 0 || depth > device.caps().max_cqe {
            return Err(Error::InvalidArgument(format!(
                "CQ depth {depth} must be within 1..={}",
                device.caps().max_cqe
            )));
        }
        let imp = device.inner.imp.create_cq(depth)?;
        Ok(Self {
            inner: Arc::new(CqShared {
                device: device.clone(),
                depth,
                qps: Mutex::new(HashMap::default()),
                reaping: Mutex::new(Reaping {
                    held: std::collections::VecDeque::new(),
                    scratch: Vec::with_capacity(64),
                    spare: Vec::with_capacity(64),
                }),
                imp,
            }),
        })
    }

    /// Capacity in completions.
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// Moves up to `max` finished completions into `out` without blocking; returns how many.
    ///
    /// # Errors
    /// A verbs error from `ibv_poll_cq` (the CQ overran, or the device died).
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut r = self.inner.reaping.lock();
        let mut n = 0;
        while n < max {
            let Some(c) = r.held.pop_front() else { break };
            out.push(c);
            n += 1;
        }
        if !r.held.is_empty() {
            return Ok(n);
        }
        Ok(n + self.reap(&mut r.scratch, out, max - n)?)
    }

    /// Polls the provider, attaching each completion's buffer.
    fn reap(&self, scratch: &mut Vec<RawWc>, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        if max == 0 {
            return Ok(0);
        }
        scratch.clear();
        let n = self.inner.imp.poll(scratch, max)?;
        if n == 0 {
            return Ok(0);
        }
        let qps = self.inner.qps.lock();
        let mut kept = 0;
        for raw in scratch.drain(..) {
            // A destroyed QP's completions are cleaned from its CQs, as ConnectX's provider
            // does at `ibv_destroy_qp`: its work request ids are gone with it (reporting the
            // provider's sequence number instead would hand the caller an id it may have
            // given another QP's request), and so are its buffers.
            if let Some(qp) = qps.get(&raw.qp_num) {
                out.push(qp.complete(raw));
                kept += 1;
            }
        }
        Ok(kept)
    }

    /// Waits until at least one completion is there, then moves up to `max` into `out`.
    ///
    /// Arms the CQ only when it is empty, and polls again after arming, so no completion is
    /// missed (drain → arm → drain). One task at a time should wait on a CQ.
    ///
    /// # Errors
    /// [`Error::NoRuntime`] outside tokio (verbs); provider errors.
    ///
    /// # Cancel safety
    /// Cancel safe: completions are only taken from the queue in the `poll` that returns them.
    pub async fn wait(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        loop {
            self.ready().await?;
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
        }
    }

    /// Waits until a completion is there without taking it: the next [`CompletionQueue::poll`]
    /// returns it. For a task that waits while others poll, so that completions are always
    /// handled in the order polls return them.
    ///
    /// # Errors
    /// [`Error::NoRuntime`] outside tokio (verbs); provider errors.
    ///
    /// # Cancel safety
    /// Cancel safe: what it reaps stays in the CQ for the next poll.
    pub async fn ready(&self) -> Result<()> {
        loop {
            if self.hold()? {
                return Ok(());
            }
            self.inner.imp.arm()?;
            if self.hold()? {
                return Ok(());
            }
            self.inner.imp.wait().await?;
        }
    }

    /// Reaps into the held queue; true when it holds anything.
    fn hold(&self) -> Result<bool> {
        let mut r = self.inner.reaping.lock();
        if !r.held.is_empty() {
            return Ok(true);
        }
        let Reaping { scratch, held, spare } = &mut *r;
        self.reap(scratch, spare, 64)?;
        held.extend(spare.drain(..));
        Ok(!held.is_empty())
    }

    pub(crate) fn attach(&self, qp: &Arc<QpShared>) {
        self.inner.qps.lock().insert(qp.qp_num, qp.clone());
    }

    /// The QP is destroyed: none of its completions is handed out from now on, those a
    /// [`ready`](Self::ready) already took from the provider included.
    pub(crate) fn detach(&self, qp_num: u32) {
        self.inner.qps.lock().remove(&qp_num);
        self.inner.reaping.lock().held.retain(|c| c.qp_num != qp_num);
    }
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("depth", &self.inner.depth)
            .finish()
    }
}
