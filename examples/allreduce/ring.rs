//! The all-reduce over RDMA: ring reduce-scatter then all-gather. Each step, a rank writes one
//! chunk to its right neighbour by RDMA Write with immediate (the step's number), split over
//! the lanes (queue pairs in parallel), into one of two staging slots there; it takes the
//! chunk its left neighbour wrote into its own staging, adds it in (reduce-scatter) or copies it
//! (all-gather), and tells the left neighbour that slot is free again by FAA on a word of the
//! neighbour's. A slot is written again only once its last step was consumed, so no chunk is
//! overwritten unread.

use std::collections::HashMap;

use rdma_rpc::transport::{AccessFlags, Completion, MemoryRegion, SendOp, SendWr, WcOpcode};

use crate::common;
use crate::links::{Links, RECV};

const WRITE: u64 = 1 << 41;
const FAA: u64 = 1 << 42;

/// One vector, in `chunks x lanes` registered parts (each `part` bytes), which the Writes send
/// from directly: no copy on the way out.
pub struct Vector {
    parts: Vec<Vec<Option<MemoryRegion>>>,
    pub part: usize,
}

impl Vector {
    /// A vector of `chunks * lanes * part / 4` floats, zeroed, registered in `links`' domain.
    pub fn new(links: &Links, chunks: usize, lanes: usize, part: usize) -> common::Result<Self> {
        let mut whole = links.pd.register(chunks * lanes * part, AccessFlags::LOCAL_WRITE)?;
        let mut parts = Vec::with_capacity(chunks);
        for _ in 0..chunks {
            let mut lane_parts = Vec::with_capacity(lanes);
            for _ in 0..lanes {
                let rest = whole.split_off(part.min(whole.len()))?;
                lane_parts.push(Some(std::mem::replace(&mut whole, rest)));
            }
            parts.push(lane_parts);
        }
        Ok(Self { parts, part })
    }

    /// Fills every float from `f(index)`.
    pub fn fill(&mut self, f: impl Fn(usize) -> f32) -> common::Result<()> {
        let per = self.part / 4;
        let lanes = self.parts[0].len();
        for (c, lane_parts) in self.parts.iter_mut().enumerate() {
            for (l, p) in lane_parts.iter_mut().enumerate() {
                let p = p.as_mut().ok_or("a part still in flight")?;
                let mut b = p.bytes_mut();
                for (i, w) in b.chunks_exact_mut(4).enumerate() {
                    w.copy_from_slice(&f((c * lanes + l) * per + i).to_ne_bytes());
                }
            }
        }
        Ok(())
    }

    /// Checks every float against `want(index)`; the first that differs, if any.
    pub fn check(&self, want: impl Fn(usize) -> f32) -> common::Result<Option<(usize, f32, f32)>> {
        let per = self.part / 4;
        let lanes = self.parts[0].len();
        for (c, lane_parts) in self.parts.iter().enumerate() {
            for (l, p) in lane_parts.iter().enumerate() {
                let p = p.as_ref().ok_or("a part still in flight")?;
                let b = p.bytes();
                for (i, w) in b.chunks_exact(4).enumerate() {
                    let got = f32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
                    let at = (c * lanes + l) * per + i;
                    if got != want(at) {
                        return Ok(Some((at, got, want(at))));
                    }
                }
            }
        }
        Ok(None)
    }
}

/// The ring's progress: the next step's number (steps count on across all-reduces, since the
/// neighbours' flags do), the receives that came per step, the FAA result buffers.
pub struct Ring {
    step: u64,
    arrived: HashMap<u32, usize>,
    faa_bufs: Vec<MemoryRegion>,
    seen: Vec<Completion>,
}

impl Ring {
    pub fn new(links: &Links) -> common::Result<Self> {
        let faa_bufs = (0..16)
            .map(|_| links.pd.register(8, AccessFlags::LOCAL_WRITE))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            step: 0,
            arrived: HashMap::new(),
            faa_bufs,
            seen: Vec::new(),
        })
    }

    /// Takes what completed, waiting for at least one completion.
    async fn progress(&mut self, links: &Links, v: &mut Vector) -> common::Result<()> {
        self.seen.clear();
        links.cq.poll(&mut self.seen, 64)?;
        if self.seen.is_empty() {
            links.cq.wait(&mut self.seen, 64).await?;
        }
        for c in std::mem::take(&mut self.seen) {
            let c = c.ok().map_err(|e| {
                format!(
                    "work request {:#x} failed: {:?}",
                    e.completion.wr_id, e.completion.status
                )
            })?;
            let buf = c.buf;
            if c.wr_id & WRITE != 0 {
                let (chunk, lane) = (((c.wr_id >> 16) & 0xffff) as usize, (c.wr_id & 0xffff) as usize);
                v.parts[chunk][lane] = buf;
            } else if c.wr_id & FAA != 0 {
                self.faa_bufs.extend(buf);
            } else if c.wr_id & RECV != 0 && c.opcode == WcOpcode::RecvRdmaWithImm {
                *self.arrived.entry(c.imm.unwrap_or(u32::MAX)).or_default() += 1;
                let qp = links
                    .left
                    .iter()
                    .find(|q| q.qp_num() == c.qp_num)
                    .ok_or("a receive on no lane from the left")?;
                let buf = buf.ok_or("a receive without its buffer")?;
                qp.post_recv(rdma_rpc::transport::RecvWr::new(c.wr_id, buf))
                    .map_err(|e| e.error)?;
            }
        }
        Ok(())
    }

    /// The steps the right neighbour has consumed (it adds to our credit word by FAA).
    fn consumed(links: &Links) -> u64 {
        let b = links.credit.bytes();
        u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }

    /// All-reduces `v` (sum) with the ring of `n` ranks in which this is `rank`.
    pub async fn allreduce(&mut self, links: &Links, v: &mut Vector, n: usize, rank: usize) -> common::Result<()> {
        // Parts per chunk: each queue pair carries every `qps`-th one (more parts than queue
        // pairs where a part would exceed the device's largest message).
        let lanes = v.parts[0].len();
        let qps = links.right.len();
        let slot = links.staging.len() / 2;
        for k in 0..2 * (n - 1) {
            let g = self.step;
            let (send, recv, add) = if k < n - 1 {
                ((rank + n - k) % n, (rank + 2 * n - k - 1) % n, true)
            } else {
                let s = k - (n - 1);
                ((rank + 1 + n - s) % n, (rank + n - s) % n, false)
            };
            // The slot this step writes held step g - 2: wait until the neighbour took it.
            while g >= 2 && Self::consumed(links) + 1 < g {
                self.progress(links, v).await?;
            }
            let base = (g % 2) as usize * slot;
            for lane in 0..lanes {
                let qp = &links.right[lane % qps];
                while v.parts[send][lane].is_none() {
                    self.progress(links, v).await?;
                }
                let part = v.parts[send][lane].take().ok_or("a part in flight")?;
                let remote = links.right_staging.at((base + lane * v.part) as u64);
                let wr = SendWr::new(
                    WRITE | (send as u64) << 16 | lane as u64,
                    SendOp::Write {
                        remote,
                        imm: Some(g as u32),
                    },
                )
                .buf(part);
                qp.post_send(wr).map_err(|e| e.error)?;
            }
            // The left neighbour's chunk of this step, on every lane.
            while self.arrived.get(&(g as u32)).copied().unwrap_or(0) < lanes {
                self.progress(links, v).await?;
            }
            self.arrived.remove(&(g as u32));
            for lane in 0..lanes {
                while v.parts[recv][lane].is_none() {
                    self.progress(links, v).await?;
                }
                let part = v.parts[recv][lane].as_mut().ok_or("a part in flight")?;
                // This piece alone: a copy of the whole staging region (as `bytes()` gives for
                // memory peers write) would cost the largest vector's size every step.
                let at = base + lane * v.part;
                let from = links.staging.bytes_at(at..at + v.part)?;
                let mut to = part.bytes_mut();
                if add {
                    for (d, s) in to.chunks_exact_mut(4).zip(from.chunks_exact(4)) {
                        let sum =
                            f32::from_ne_bytes([d[0], d[1], d[2], d[3]]) + f32::from_ne_bytes([s[0], s[1], s[2], s[3]]);
                        d.copy_from_slice(&sum.to_ne_bytes());
                    }
                } else {
                    to.copy_from_slice(&from);
                }
            }
            // The slot is free again: one more step consumed, on the left neighbour's word.
            while self.faa_bufs.is_empty() {
                self.progress(links, v).await?;
            }
            let buf = self.faa_bufs.pop().ok_or("no FAA buffer")?;
            let faa = SendOp::FetchAdd {
                remote: links.left_credit.at(0),
                add: 1,
            };
            links.left[0]
                .post_send(SendWr::new(FAA | g, faa).buf(buf))
                .map_err(|e| e.error)?;
            self.step += 1;
        }
        // Every part back before the caller reads the vector.
        loop {
            let out = v.parts.iter().flatten().any(Option::is_none);
            if !out {
                return Ok(());
            }
            self.progress(links, v).await?;
        }
    }
}
