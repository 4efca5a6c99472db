//! The same append done as an RPC, for comparison: the backup checks and applies it.

use std::sync::atomic::{AtomicU64, Ordering};

use rdma_rpc::{service, Bulk};

use crate::record;

/// Appends by RPC.
#[service]
pub trait LogSink {
    /// Checks and applies one encoded record; returns how many RPC appends were applied.
    async fn append(&self, record: Bulk) -> Result<u64, String>;
}

/// The backup's RPC side: counts and checks, in its own sequence.
#[derive(Default)]
pub struct Sink {
    pub applied: AtomicU64,
}

impl LogSink for Sink {
    async fn append(&self, rec: Bulk) -> Result<u64, String> {
        let (seq, _, _) = record::decode(&rec.bytes())?;
        let want = self.applied.load(Ordering::SeqCst);
        if seq != want {
            return Err(format!("RPC append {seq} out of order: expected {want}"));
        }
        Ok(self.applied.fetch_add(1, Ordering::SeqCst) + 1)
    }
}
