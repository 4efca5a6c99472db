//! Work requests: what a queue pair is asked to do.

use crate::{MemoryRegion, RemoteAddr, WcOpcode};

/// The operation of a send-queue work request (`enum ibv_wr_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOp {
    /// IBV_WR_SEND (or IBV_WR_SEND_WITH_IMM with `imm`): consumes a receive at the peer.
    Send {
        /// 32 bits of immediate data delivered in the peer's receive completion.
        imm: Option<u32>,
    },
    /// IBV_WR_RDMA_WRITE (or _WITH_IMM): one-sided; with `imm` it also consumes a peer receive.
    Write {
        /// Where to write.
        remote: RemoteAddr,
        /// Immediate data for the peer's receive completion.
        imm: Option<u32>,
    },
    /// IBV_WR_RDMA_READ: one-sided, the bytes land in the local buffer.
    Read {
        /// Where to read from.
        remote: RemoteAddr,
    },
    /// IBV_WR_ATOMIC_CMP_AND_SWP on an 8-byte aligned remote word; the old value lands in the
    /// first 8 bytes of the local buffer (native byte order).
    CompareSwap {
        /// The remote word.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value if it matched.
        swap: u64,
    },
    /// IBV_WR_ATOMIC_FETCH_AND_ADD on an 8-byte aligned remote word; old value as for CAS.
    FetchAdd {
        /// The remote word.
        remote: RemoteAddr,
        /// The addend.
        add: u64,
    },
}

impl SendOp {
    pub(crate) fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send { .. } => WcOpcode::Send,
            SendOp::Write { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    pub(crate) fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// Operations whose local buffer the NIC writes.
    pub(crate) fn writes_local(&self) -> bool {
        matches!(self, SendOp::Read { .. }) || self.is_atomic()
    }
}

/// A send-queue work request. It owns its local buffer until the completion gives it back.
///
/// # Examples
/// ```
/// use rdma_rpc_transport::{RemoteAddr, SendOp, SendWr};
/// let wr = SendWr::new(7, SendOp::Write { remote: RemoteAddr { addr: 0x1000, rkey: 42 }, imm: Some(1) })
///     .unsignaled();
/// assert_eq!(wr.wr_id(), 7);
/// ```
#[derive(Debug)]
#[must_use = "a work request does nothing until it is posted"]
pub struct SendWr {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) buf: Option<MemoryRegion>,
    pub(crate) len: Option<usize>,
    pub(crate) signaled: bool,
    pub(crate) inline: bool,
}

impl SendWr {
    /// A signaled request with no local buffer (zero bytes); add one with [`SendWr::buf`].
    pub fn new(wr_id: u64, op: SendOp) -> Self {
        Self {
            wr_id,
            op,
            buf: None,
            len: None,
            signaled: true,
            inline: false,
        }
    }

    /// A Send of the whole of `buf`.
    pub fn send(wr_id: u64, buf: MemoryRegion) -> Self {
        Self::new(wr_id, SendOp::Send { imm: None }).buf(buf)
    }

    /// The local buffer: data source for Send/Write, destination for Read and atomics.
    pub fn buf(mut self, buf: MemoryRegion) -> Self {
        self.buf = Some(buf);
        self
    }

    /// Use only the first `len` bytes of the buffer.
    pub fn len(mut self, len: usize) -> Self {
        self.len = Some(len);
        self
    }

    /// No completion on success (errors still complete). The buffer is released when a later
    /// signaled request of the same QP completes, or when the QP is flushed. Signal at least
    /// one request per send-queue depth, as in verbs.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Copy the data into the work request at post time (Send/Write up to `max_inline_data`).
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    /// The caller's identifier, returned in the completion.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The operation.
    pub fn op(&self) -> &SendOp {
        &self.op
    }

    /// Takes the buffer back out of an unposted request.
    pub fn into_buf(self) -> Option<MemoryRegion> {
        self.buf
    }

    pub(crate) fn data_len(&self) -> usize {
        match (&self.buf, self.len) {
            (_, Some(l)) => l,
            (Some(b), None) => b.len(),
            (None, None) => 0,
        }
    }
}

/// A receive-queue work request: a buffer for one incoming Send or Write-with-immediate.
#[derive(Debug)]
#[must_use = "a work request does nothing until it is posted"]
pub struct RecvWr {
    pub(crate) wr_id: u64,
    pub(crate) buf: Option<MemoryRegion>,
}

impl RecvWr {
    /// A receive into `buf` (registered with LOCAL_WRITE).
    pub fn new(wr_id: u64, buf: MemoryRegion) -> Self {
        Self { wr_id, buf: Some(buf) }
    }

    /// A receive with no buffer: enough for zero-byte Sends and Write-with-immediate.
    pub fn empty(wr_id: u64) -> Self {
        Self { wr_id, buf: None }
    }

    /// The caller's identifier.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// Takes the buffer back out of an unposted request.
    pub fn into_buf(self) -> Option<MemoryRegion> {
        self.buf
    }
}
