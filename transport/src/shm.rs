//! Provider `shm`: software RDMA between processes on one host, through shared memory.
//!
//! - **Memory.** Each registration is a sealed memfd of its own. A peer is given one (pushed
//!   by the owner, or asked for under a key: `grant`) only as a NIC would let it reach the
//!   memory: read-only under an rkey with REMOTE_READ alone, read-write under one with
//!   REMOTE_WRITE or REMOTE_ATOMIC, and otherwise not at all. The protection domain's key
//!   table, which peers map read-only, holds one word per registration that says whether it
//!   lives, so a deregistered key fails at once.
//! - **One-sided operations without the target's CPU.** RDMA Read, Write (without immediate)
//!   and the atomics are executed by the initiator itself, on its mapping of the granted
//!   registration, after the checks a NIC makes (bounds, access flags); atomics are real
//!   atomic instructions on the shared word.
//! - **Two-sided operations.** The receiver publishes its receive queue in shared memory
//!   (`rq`); a Send or Write-with-immediate that finds a posted receive is delivered by the
//!   sender, which writes the payload into the queue's staging area and the completion into
//!   the entry; the receiver's CQ drains completed entries in order, copying each payload into
//!   the receive's own buffer, which no peer ever maps. Only when the receiver waits (its CQ armed, a one-shot
//!   flag in the queue's header) does the sender ring its doorbell, an eventfd the waiting task
//!   sleeps on in tokio's IO driver: one wake-up per message, none while it polls. One that
//!   finds no receive goes as
//!   a frame to the receiver's progress engine (the tcp provider's engine: the same responder,
//!   RNR, error and flush semantics), over a pair of shared-memory byte rings with futex
//!   wake-ups; frames and direct deliveries never overlap, so RC order holds.
//! - **Set-up and death.** An abstract Unix socket named after the address carries the
//!   handshake and the memfds (SCM_RIGHTS); it stays open for grants, and its end (the kernel
//!   closes it when a process dies) turns into errors with the QP flushed.
//!
//! Trust model: peers are processes of the same user by default (`shm:any-user` admits any).
//! The kernel holds a peer to what it was granted: it holds no descriptor of any other memory
//! of ours (receive buffers included), and one opened read-only cannot be mapped writable.
//! Every word read from shared memory is validated, so garbage in the rings, the receive queue
//! or a grant gives errors, never out-of-bounds accesses; memfds are sealed so a peer cannot
//! shrink them under us (no SIGBUS). What the kernel cannot narrow: a peer granted a
//! registration reaches all of it until it is deregistered (REMOTE_ATOMIC allows plain writes
//! too); after that it reaches only pages this process no longer uses. Each registration with
//! remote access holds one descriptor here.

mod arena;
mod bells;
pub(crate) mod cm;
mod copy;
mod device;
mod direct;
pub(crate) mod grant;
pub(crate) mod link;
mod ring;
pub(crate) mod rq;
mod sys;

use std::sync::Arc;

pub(crate) use arena::{Arena, PeerArena};
pub(crate) use device::ShmDevice;
pub(crate) use rq::OwnRq;

use crate::{AccessFlags, DeviceCaps, QpOptions, Result};

/// What a QP reaches of its peer: its memory and its receive queue.
pub(crate) struct Peer {
    pub(crate) arena: PeerArena,
    pub(crate) rq: rq::PeerRq,
    /// The doorbell of the peer's receive CQ (an eventfd), rung when it waits; shared by the
    /// connections to the same CQ of the same process (`bells`).
    bell: Arc<std::os::fd::OwnedFd>,
}

impl Peer {
    /// Wakes the peer's CQ waiter (after a delivery it armed for).
    pub(crate) fn ring(&self) {
        crate::nic::bell::ring(&self.bell);
    }
}

/// Starts a QP's engine over an established shm link.
pub(crate) fn start(
    link: Arc<link::ShmLink>,
    peer: Arc<Peer>,
    own_rq: OwnRq,
    opts: &QpOptions,
) -> Result<(crate::nic::Qp, u32)> {
    let qp_num = crate::nic::random_u32();
    let qp = crate::nic::Qp::start(link, qp_num, opts, Some((peer, Arc::new(own_rq))))?;
    Ok((qp, qp_num))
}

/// What this side brings to a connection, from the PD in `opts`.
pub(crate) fn side(opts: &QpOptions) -> Result<cm::Side> {
    let pd = crate::provider::pd_of::<Pd>(&opts.pd.inner, "an shm QP")?;
    let cq = &crate::provider::cq_of::<crate::nic::SoftCq>(&opts.recv_cq, "an shm QP")?.0;
    cm::Side::new(pd.arena.clone(), opts.caps.max_recv_wr, cq.share_bell()?, cq.bell_id())
}

fn caps() -> DeviceCaps {
    DeviceCaps {
        max_inline_data: 256,
        max_msg_size: 1 << 30,
        atomics: true,
        max_qp_wr: 16384,
        max_cqe: 1 << 20,
        max_mr_size: arena::MAX_MR,
        // Eager (in pieces, through warm receive slots) beats rendezvous of a copied Vec at
        // every size measured, up to 128 MiB (docs/decisions.md). Short calls go between the
        // pieces of a long message, so one waits a piece or two behind it, not for all of it.
        eager_hint: 128 << 20,
        progress_threads: false,
        cheap_registration: false,
    }
}

/// A shm protection domain: the tcp provider's key table (for the engine's two-sided path and
/// Writes-with-immediate) and the arena that holds the registrations peers may be granted.
pub(crate) struct Pd {
    pub(crate) keys: crate::nic::Pd,
    pub(crate) arena: Arc<Arena>,
}

impl Pd {
    pub(crate) fn new() -> Result<Self> {
        Ok(Self {
            keys: crate::nic::Pd::new(),
            arena: Arena::new()?,
        })
    }

    /// Fresh keys, neither published (the lkey is published too, for receives a peer delivers
    /// into).
    pub(crate) fn fresh_keys(&self) -> (u32, u32) {
        loop {
            let (lkey, rkey) = self.keys.fresh_keys();
            let usable = |k| Arena::usable_key(k) && !self.arena.contains(k);
            if lkey != rkey && usable(lkey) && usable(rkey) {
                return (lkey, rkey);
            }
        }
    }

    /// Publishes a registration of `slice`, `len` bytes at `addr`, under `keys`.
    pub(crate) fn publish(&self, keys: (u32, u32), access: AccessFlags, slice: &Slice, len: u64) -> Result<()> {
        self.arena.publish(keys, access, &slice.seg, slice.addr(), len)
    }
}

/// Whether `access` lets peers reach a registration (and so be granted its memory).
fn remote(access: AccessFlags) -> bool {
    let any = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    access.bits() & any.bits() != 0
}

/// Registered memory: a segment of its own, which peers reach only as granted.
pub(crate) struct Slice {
    seg: Arc<arena::Segment>,
    words: usize,
}

impl Slice {
    /// `len` zeroed bytes for a registration with `access`.
    pub(crate) fn alloc(len: usize, access: AccessFlags) -> Result<Slice> {
        Ok(Slice {
            seg: arena::Segment::new(len, remote(access))?,
            words: len.div_ceil(8),
        })
    }

    /// The address of the first byte in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.seg.ptr() as u64
    }

    /// The words, for a registration no peer may write (without REMOTE_WRITE or
    /// REMOTE_ATOMIC, whose memory is never granted writable): exposed ones are copied in and
    /// out instead (`mr::Region::exposed`).
    pub(crate) fn words(&self) -> &[u64] {
        // SAFETY: the range is inside this slice's own segment mapping (page aligned, so
        // aligned for u64), which lives as long as `self.seg`; no peer holds a writable
        // mapping of it (see above), and local writers hold the region's lock.
        unsafe { std::slice::from_raw_parts(self.seg.ptr().cast::<u64>(), self.words) }
    }

    /// As [`Slice::words`], for writing (and for filling a registration before it is published).
    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        // SAFETY: as in `words`; `&mut self` makes this the only local reference.
        unsafe { std::slice::from_raw_parts_mut(self.seg.ptr().cast::<u64>(), self.words) }
    }

    /// A copy of the first `len` bytes, through a raw pointer (peers may write them).
    pub(crate) fn copy_out(&self, len: usize) -> Vec<u8> {
        let len = len.min(self.words * 8);
        let mut v = vec![0u8; len];
        // SAFETY: `len` bytes from the start of this slice's own segment, which lives as long
        // as `self`; `v` is ours; no reference to the shared bytes is made.
        unsafe { std::ptr::copy_nonoverlapping(self.seg.ptr(), v.as_mut_ptr(), len) };
        v
    }

    /// Word `i` as an atomic (for the atomics peers also run on it).
    pub(crate) fn atomic_word(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        let i = i.min(self.words.saturating_sub(1));
        // SAFETY: word `i` is inside this slice's segment (clamped above; regions are at least
        // one word), 8-byte aligned (pages), alive as long as `self`; every atomic on it goes
        // through AtomicU64.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.seg.ptr().cast::<u64>().add(i)) }
    }
}
