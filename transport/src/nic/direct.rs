//! The hooks of a link whose peer's memory this side reaches itself (shm): the engine runs
//! operations on the peer's memory through [`Direct`] when it can, and drains the receives the
//! peer completed in our queue through [`OwnQueue`]. A provider without them (tcp) sends
//! everything as frames.

use std::sync::Arc;

use crate::mr::Region;
use crate::qp::SendDesc;
use crate::{Head, WcStatus};

/// A local buffer a request in flight names.
pub(crate) struct Local<'a> {
    pub(crate) region: &'a Arc<Region>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// The peer's side, reached directly.
pub(crate) trait Direct: Send + Sync + 'static {
    /// Runs `d` on the peer's memory now, as the peer's NIC would: one-sided operations always,
    /// Sends and Writes-with-immediate when the peer has a receive posted. `None`: it goes as a
    /// frame (the peer's engine runs it). The result as the completion will say it.
    fn run(&self, d: &SendDesc<'_>, local: Option<Local<'_>>) -> Option<Result<u32, WcStatus>>;
    /// Whether the peer's poller last said it runs on `cpu`.
    fn peer_on(&self, cpu: u32) -> bool;
}

/// One receive the peer completed in our queue.
pub(crate) struct Done {
    /// The low 32 bits of the receive's sequence number.
    pub(crate) seq: u32,
    pub(crate) status: WcStatus,
    pub(crate) byte_len: u32,
    pub(crate) imm: Option<u32>,
    /// A Write-with-immediate's (its bytes are in the target memory, none staged).
    pub(crate) write_imm: bool,
    pub(crate) head: Head,
}

/// Our receive queue, which the peer completes (shm).
pub(crate) trait OwnQueue: Send + Sync + 'static {
    /// Publishes a posted receive of `len` bytes (`writable`: the buffer takes a Send).
    fn post(&self, seq: u64, len: u64, writable: bool);
    /// The CQ waits: have the peer ring for the next completion.
    fn arm(&self);
    /// Whether the peer completed a receive not drained yet.
    fn has_taken(&self) -> bool;
    /// The next completed receive and where it is, if any.
    fn peek_done(&self) -> Option<(u64, Done)>;
    /// The most a Send's payload can be staged with.
    fn staged_max(&self) -> usize;
    /// Copies the next staged payload into `dst` (its length).
    fn take_staged(&self, dst: &mut [u8]);
    /// Skips the next staged payload of `len` bytes.
    fn skip_staged(&self, len: usize);
    /// Moves past the entry `at`.
    fn pass(&self, at: u64);
    /// A request that came as a frame takes the oldest entry; false when the peer broke the
    /// queue.
    fn take_for_frame(&self) -> bool;
    /// Tells the peer which CPU this side's poller runs on.
    fn publish_cpu(&self, cpu: u32);
}
