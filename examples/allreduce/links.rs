//! The ring's connections: `LANES` queue pairs to the right neighbour (this rank writes into
//! its staging slots) and `LANES` from the left one (it writes into ours). Each side tells the
//! other, in the connection's private data, the region the other reaches: the left neighbour
//! sends the word it counts our consumed steps in (we add to it by FAA), we answer with our
//! staging region (it writes its chunks there with immediate data).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdma_rpc::transport::{
    self, AccessFlags, CompletionQueue, Device, Error, Listener, MemoryRegion, ProtectionDomain, QpCaps, QpOptions,
    QueuePair, RecvWr, RemoteRegion,
};

use crate::common;

/// Receives each queue pair from the left keeps posted (one per Write-with-immediate in
/// flight: two steps of a chunk's pieces at most).
pub const RECVS: u64 = 16;
/// Receive work request ids carry this bit.
pub const RECV: u64 = 1 << 40;

/// A rank's half of the ring.
pub struct Links {
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    /// To the right neighbour, and its staging region.
    pub right: Vec<QueuePair>,
    pub right_staging: RemoteRegion,
    /// From the left neighbour, and the word it counts our consumed steps in.
    pub left: Vec<QueuePair>,
    pub left_credit: RemoteRegion,
    /// Where the left neighbour writes (two slots of the largest chunk).
    pub staging: MemoryRegion,
    /// The word the right neighbour counts our steps in (it adds by FAA).
    pub credit: MemoryRegion,
}

fn caps(device: &Device) -> QpCaps {
    QpCaps {
        max_send_wr: 256.min(device.caps().max_qp_wr),
        max_recv_wr: 64.min(device.caps().max_qp_wr),
        max_inline_data: 0,
    }
}

/// Connects rank `rank` of `peers` into the ring with `lanes` queue pairs each way; its
/// staging region holds two slots of `slot` bytes.
pub fn connect(device: &Device, peers: &[SocketAddr], rank: usize, lanes: usize, slot: usize) -> common::Result<Links> {
    let n = peers.len();
    let pd = device.alloc_pd()?;
    let cq = device.create_cq(4096)?;
    let staging = pd.register(2 * slot, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let credit = pd.register(8, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)?;
    let listener = Listener::bind(device, peers[rank])?;
    let private = common::region_bytes(&staging.remote())?;
    let opts = QpOptions::new(&pd, &cq).caps(caps(device));
    let right_addr = peers[(rank + 1) % n];
    let credit_bytes = common::region_bytes(&credit.remote())?;
    let (left, right) = std::thread::scope(|s| {
        let accepting = s.spawn(|| -> common::Result<(Vec<QueuePair>, RemoteRegion)> {
            let mut qps = Vec::new();
            let mut credit = None;
            for _ in 0..lanes {
                let req = listener.accept(Some(Duration::from_secs(60)))?;
                credit = Some(common::region_from(req.private_data())?);
                let recvs = (0..RECVS)
                    .map(|i| Ok(RecvWr::new(RECV | i, pd.register(8, AccessFlags::LOCAL_WRITE)?)))
                    .collect::<common::Result<Vec<_>>>()?;
                qps.push(req.accept_with_recvs(&opts, &private, recvs)?);
            }
            Ok((qps, credit.ok_or("no lane from the left")?))
        });
        let mut right = Vec::new();
        let mut staging = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        while right.len() < lanes {
            match transport::connect(right_addr, &opts, &credit_bytes, Duration::from_secs(10)) {
                Ok((qp, data)) => {
                    staging = Some(common::region_from(&data));
                    right.push(qp);
                }
                // The neighbour is not listening yet: it is still starting.
                Err(Error::Refused { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(e.into()),
            }
        }
        let left = accepting.join().map_err(|_| "the accepting thread panicked")??;
        let staging = staging.ok_or("no lane to the right")??;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((left, (right, staging)))
    })?;
    let (left, left_credit) = left;
    let (right, right_staging) = right;
    Ok(Links {
        pd,
        cq,
        right,
        right_staging,
        left,
        left_credit,
        staging,
        credit,
    })
}
