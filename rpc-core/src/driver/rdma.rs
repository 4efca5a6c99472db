//! RDMA Reads and Writes of a connection: cut into pieces of the device's largest message, posted
//! as the send queue has room, joined when every piece is done.

use super::*;

impl Conn {
    /// Splits a transfer of `len` bytes of `mr` into work requests of at most the device's
    /// message size; `op(offset, last)` names each piece (the last may carry the immediate).
    pub(super) fn pieces(
        &self,
        mut mr: MemoryRegion,
        len: usize,
        buf: BufId,
        token: Option<Token>,
        op: impl Fn(usize, bool) -> (u64, SendOp),
    ) -> (Vec<SendWr>, Job) {
        let mut wrs = Vec::with_capacity(len / self.chunk + 1);
        let mut parts = Vec::new();
        let mut off = 0;
        loop {
            let n = (len - off).min(self.chunk);
            let last = off + n >= len;
            // `split_off` only fails beyond the end, which `n <= len - off <= mr.len()` rules out.
            let tail = mr.split_off(n).ok();
            let (wr_id, o) = op(off, last);
            wrs.push(SendWr::new(wr_id, o).buf(mr).len(n));
            off += n;
            match tail {
                Some(t) if !last => mr = t,
                Some(t) => {
                    parts.push(t);
                    break;
                }
                None => break,
            }
        }
        let job = Job {
            token,
            buf,
            len,
            remaining: wrs.len(),
            parts,
        };
        (wrs, job)
    }

    /// Whether a Read or Write may start now: the send queue has room beside its Sends and
    /// no earlier transfer still waits for some. Its pieces beyond the room go in turns
    /// ([`Conn::post_waiting`]), so at most one transfer waits part-posted.
    pub(super) fn rdma_fits(&self) -> bool {
        self.rdma_waiting.is_empty() && self.rdma_posted < self.rdma_room
    }

    /// Posts the pieces of a transfer, as many as the room takes now; the rest go as earlier
    /// pieces complete ([`Conn::post_waiting`]).
    pub(super) fn post_all(&mut self, wrs: Vec<SendWr>) -> Result<(), Transmit> {
        if self.rdma_posted + wrs.len() <= self.rdma_room {
            // Nearly always (a transfer is one piece below the device's largest message).
            self.post_pieces(wrs);
        } else {
            self.rdma_waiting.extend(wrs);
            self.post_waiting();
        }
        Ok(())
    }

    /// Posts waiting pieces of a transfer within the room; true when it posted any.
    pub(super) fn post_waiting(&mut self) -> bool {
        if self.lost.is_some() {
            // Never posted: their buffers go with the connection, as flushed pieces' do.
            self.rdma_waiting.clear();
            return false;
        }
        let n = self
            .rdma_room
            .saturating_sub(self.rdma_posted)
            .min(self.rdma_waiting.len());
        if n == 0 {
            return false;
        }
        let batch = self.rdma_waiting.drain(..n).collect();
        self.post_pieces(batch);
        true
    }

    /// Posts pieces of Reads or Writes, counted until their completions.
    pub(super) fn post_pieces(&mut self, wrs: Vec<SendWr>) {
        self.rdma_posted += wrs.len();
        if let Err(e) = self.qp.post_send_batch(wrs) {
            self.lose(local_loss(format!("posting: {}", rdma_rpc_transport::Report(&e.error))));
        }
    }
}

/// Pieces of Reads and Writes a send queue of `depth` takes at once beside its Sends: a Send
/// holds a send buffer (`ring + 8` of them) or a credit (`ring`), so at most about `2 * ring`
/// are outstanding, and [`qp_caps`](crate::handshake::qp_caps) makes the queue 64 deeper than
/// that. Transfers beyond wait, in order, for earlier ones to complete: posted, they would
/// overflow the queue and lose the connection.
pub(super) fn rdma_room(depth: u32, ring: usize) -> usize {
    (depth as usize).saturating_sub(2 * ring).max(1)
}

/// An RDMA Read or Write in flight, possibly in several pieces.
pub(super) struct Job {
    pub(super) token: Option<Token>,
    pub(super) buf: BufId,
    pub(super) len: usize,
    remaining: usize,
    parts: Vec<MemoryRegion>,
}

impl Job {
    /// Records one finished piece of job `id`; returns the job once all its pieces are back.
    pub(super) fn piece_done<K: std::hash::Hash + Eq + Copy>(
        jobs: &mut HashMap<K, Job>,
        id: K,
        buf: Option<MemoryRegion>,
    ) -> Option<Job> {
        let job = jobs.get_mut(&id)?;
        job.parts.extend(buf);
        job.remaining -= 1;
        if job.remaining > 0 {
            return None;
        }
        jobs.remove(&id)
    }

    /// Joins the pieces back into the one buffer they were split from.
    pub(super) fn join(mut self) -> Option<MemoryRegion> {
        self.parts.sort_by_key(MemoryRegion::addr);
        let mut it = self.parts.into_iter();
        let mut whole = it.next()?;
        for p in it {
            whole.unsplit(p).ok()?;
        }
        Some(whole)
    }
}
