//! Provider `tcp`: a software RC NIC over TCP, for any two hosts without an RDMA card.
//!
//! Each queue pair is one TCP connection with a progress engine (a reader thread acting as the
//! responder and completer, a writer thread for responses) in each process, in the spirit of
//! libfabric's tcp provider. The engine is a model of the NIC, not a shortcut: the target checks
//! rkey (random, per protection domain), bounds and access flags against its own region table; a
//! Send finding no receive is held (RNR) and fails with RNR_RETRY_EXC_ERR when none is posted in
//! time; any error moves the QP to the error state, flushes it and tells the peer; a dead peer
//! (EOF, reset, keepalive or TCP user timeout) fails the head request with RETRY_EXC_ERR.

mod cm;
mod engine;
mod link;
mod sender;
mod wire;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};

use crate::cq::RawWc;
use crate::mr::Region;
use crate::DeviceCaps;

pub(crate) use cm::{connect, Listener, Pending, Request};
pub(crate) use engine::Qp;
pub(crate) use link::Link;

/// Largest message: 1 GiB.
const MAX_MSG: u64 = 1 << 30;

pub(crate) fn caps() -> DeviceCaps {
    DeviceCaps {
        max_inline_data: 256,
        max_msg_size: MAX_MSG,
        atomics: true,
        max_qp_wr: 16384,
        max_cqe: 1 << 20,
        max_mr_size: 1 << 40,
    }
}

/// A software protection domain: the region table its QPs' responders check remote keys against.
pub(crate) struct Pd {
    regions: RwLock<HashMap<u32, Weak<Region>>>,
}

impl Pd {
    pub(crate) fn new() -> Self {
        Self {
            regions: RwLock::new(HashMap::new()),
        }
    }

    /// A random rkey not in use here (and a random lkey). Sequential keys would let a peer guess.
    pub(crate) fn fresh_keys(&self) -> (u32, u32) {
        let table = self.regions.read();
        loop {
            let rkey = random_u32();
            if rkey != 0 && !table.contains_key(&rkey) {
                return (random_u32(), rkey);
            }
        }
    }

    pub(crate) fn register(&self, region: &Arc<Region>) {
        self.regions.write().insert(region.rkey, Arc::downgrade(region));
    }

    pub(crate) fn deregister(&self, rkey: u32, _lkey: u32) {
        self.regions.write().remove(&rkey);
    }

    pub(crate) fn lookup(&self, rkey: u32) -> Option<Arc<Region>> {
        self.regions.read().get(&rkey).and_then(Weak::upgrade)
    }
}

pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // getrandom fails only without any OS entropy source; fall back to a hash of the time.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x9e37_79b9);
        return t.wrapping_mul(0x9e37_79b9);
    }
    u32::from_ne_bytes(b)
}

/// Something that produces completions only when asked: shm QPs whose peers complete receives
/// in shared memory. A CQ asks every source before each poll.
pub(crate) trait CqSource: Send + Sync {
    fn drain(&self);
    /// The CQ waits: have the next completion rung for.
    fn arm(&self);
}

/// A software completion queue.
pub(crate) struct Cq {
    sources: Mutex<Vec<Weak<dyn CqSource>>>,
    queue: Mutex<VecDeque<RawWc>>,
    armed: AtomicBool,
    bell: crate::shm::bell::Bell,
}

impl Cq {
    pub(crate) fn new(depth: u32) -> crate::Result<Self> {
        Ok(Self {
            sources: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::with_capacity(depth.min(4096) as usize)),
            armed: AtomicBool::new(false),
            bell: crate::shm::bell::Bell::new()?,
        })
    }

    pub(crate) fn push(&self, wc: RawWc) {
        self.queue.lock().push_back(wc);
        if self.armed.swap(false, Ordering::AcqRel) {
            self.bell.ring();
        }
    }

    pub(crate) fn add_source(&self, source: Weak<dyn CqSource>) {
        let mut s = self.sources.lock();
        s.retain(|w| w.strong_count() > 0);
        s.push(source);
    }

    pub(crate) fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> usize {
        // Lock order: sources, then a source's engine state, then the queue (as push takes it).
        for s in self.sources.lock().iter().filter_map(Weak::upgrade) {
            s.drain();
        }
        let mut q = self.queue.lock();
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        n
    }

    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
        for s in self.sources.lock().iter().filter_map(Weak::upgrade) {
            s.arm();
        }
    }

    /// Sleeps until the doorbell rings (arm first, then poll once more, then wait).
    pub(crate) async fn wait_bell(&self) -> crate::Result<()> {
        self.bell.wait().await
    }

    /// A duplicate of the doorbell for a peer process that delivers into our receives (shm).
    pub(crate) fn share_bell(&self) -> crate::Result<std::os::fd::OwnedFd> {
        self.bell.share()
    }
}
