//! Provider `shm`: software RDMA between processes on one host, through shared memory.
//!
//! - **Memory.** A protection domain's registrations live in one sealed memfd (its arena),
//!   mapped by the owner and by every peer connected to a QP of the PD. The arena's first MiB is
//!   the region table the owner publishes (rkey, access, address, length, under a seqlock).
//! - **One-sided operations without the target's CPU.** RDMA Read, Write (without immediate)
//!   and the atomics are executed by the initiator itself, on its mapping of the target's arena,
//!   after the checks a NIC makes against the published table (rkey, bounds, access flags);
//!   atomics are real atomic instructions on the shared word.
//! - **Two-sided operations.** The receiver publishes its receive queue in shared memory
//!   (`rq`); a Send or Write-with-immediate that finds a posted receive is delivered by the
//!   sender, which writes the payload and the completion into the entry; the receiver's CQ
//!   drains completed entries in order. Only when the receiver waits (its CQ armed, a one-shot
//!   flag in the queue's header) does the sender ring its doorbell, an eventfd the waiting task
//!   sleeps on in tokio's IO driver: one wake-up per message, none while it polls. One that
//!   finds no receive goes as
//!   a frame to the receiver's progress engine (the tcp provider's engine: the same responder,
//!   RNR, error and flush semantics), over a pair of shared-memory byte rings with futex
//!   wake-ups; frames and direct deliveries never overlap, so RC order holds.
//! - **Set-up and death.** An abstract Unix socket named after the address carries the
//!   handshake and the memfds (SCM_RIGHTS); it stays open, and its end (the kernel closes it
//!   when a process dies) turns into errors with the QP flushed.
//!
//! Trust model: peers are processes of the same user on the same host, which could already
//! read each other's memory (ptrace, /proc). The checks keep a buggy peer from reaching memory
//! it was not given, and every word read from shared memory is validated so that garbage in the
//! rings or the table gives errors, never out-of-bounds accesses; memfds are sealed so a peer
//! cannot shrink them under us (no SIGBUS). They are not a defence against a hostile process
//! of the same user.

mod arena;
pub(crate) mod bell;
pub(crate) mod cm;
mod copy;
pub(crate) mod link;
mod ring;
pub(crate) mod rq;
mod sys;

use std::sync::Arc;

pub(crate) use arena::{Arena, PeerArena};
pub(crate) use rq::OwnRq;
pub(crate) use sys::{current_cpu, leave_cpu};

use crate::cq::CqImpl;
use crate::{AccessFlags, DeviceCaps, Error, QpOptions, Result};

/// What a QP reaches of its peer: its memory and its receive queue.
pub(crate) struct Peer {
    pub(crate) arena: PeerArena,
    pub(crate) rq: rq::PeerRq,
    /// The doorbell of the peer's receive CQ (an eventfd), rung when it waits.
    bell: std::os::fd::OwnedFd,
}

impl Peer {
    /// Wakes the peer's CQ waiter (after a delivery it armed for).
    pub(crate) fn ring(&self) {
        bell::ring(&self.bell);
    }
}

/// Starts a QP's engine over an established shm link.
pub(crate) fn start(
    link: Arc<link::ShmLink>,
    peer: Arc<Peer>,
    own_rq: OwnRq,
    opts: &QpOptions,
) -> Result<(crate::tcp::Qp, u32)> {
    let cq = |c: &crate::CompletionQueue| match &c.inner.imp {
        CqImpl::Tcp(cq) => Ok(Arc::clone(cq)),
        #[allow(unreachable_patterns)]
        _ => Err(Error::InvalidArgument("an shm QP needs shm CQs".into())),
    };
    let qp_num = crate::tcp::random_u32();
    let qp = crate::tcp::Qp::start(
        link,
        qp_num,
        opts.pd.inner.clone(),
        cq(&opts.send_cq)?,
        cq(&opts.recv_cq)?,
        Some((peer, own_rq)),
    )?;
    Ok((qp, qp_num))
}

/// What this side brings to a connection, from the PD in `opts`.
pub(crate) fn side(opts: &QpOptions) -> Result<cm::Side> {
    match &opts.pd.inner.imp {
        crate::pd::PdImpl::Shm(pd) => {
            let bell = match &opts.recv_cq.inner.imp {
                CqImpl::Tcp(cq) => cq.share_bell()?,
                #[allow(unreachable_patterns)]
                _ => return Err(Error::InvalidArgument("an shm QP needs shm CQs".into())),
            };
            cm::Side::new(pd.arena.clone(), opts.caps.max_recv_wr, bell)
        }
        _ => Err(Error::InvalidArgument("an shm QP needs an shm PD".into())),
    }
}

pub(crate) fn caps() -> DeviceCaps {
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
/// Writes-with-immediate) and the arena that holds the memory and publishes the same keys.
pub(crate) struct Pd {
    pub(crate) keys: crate::tcp::Pd,
    pub(crate) arena: Arc<Arena>,
}

impl Pd {
    pub(crate) fn new() -> Result<Self> {
        Ok(Self {
            keys: crate::tcp::Pd::new(),
            arena: Arena::new()?,
        })
    }

    /// Fresh keys, both absent from the published table (the lkey is published too, for
    /// receives a peer delivers into).
    pub(crate) fn fresh_keys(&self) -> (u32, u32) {
        loop {
            let (lkey, rkey) = self.keys.fresh_keys();
            let usable = |k| Arena::usable_key(k) && !self.arena.contains(k);
            if lkey != rkey && usable(lkey) && usable(rkey) {
                return (lkey, rkey);
            }
        }
    }

    /// Publishes a registration: under its rkey with its access flags, and under its lkey with
    /// LOCAL_WRITE only (receives), which no one-sided operation accepts.
    pub(crate) fn publish(&self, keys: (u32, u32), access: AccessFlags, addr: u64, off: u64, len: u64) -> Result<()> {
        let (lkey, rkey) = keys;
        self.arena.publish(rkey, access, addr, off, len)?;
        let local = if access.contains(AccessFlags::LOCAL_WRITE) {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::NONE
        };
        if let Err(e) = self.arena.publish(lkey, local, addr, off, len) {
            self.arena.withdraw(rkey);
            return Err(e);
        }
        Ok(())
    }
}

/// Starts fetching the first cache lines of `len` bytes at `p` into this core's cache: a peer's
/// core just wrote them, and the application is about to read them. A hint (never faults).
pub(crate) fn prefetch(p: *const u8, len: usize) {
    sys::prefetch(p, len, false);
}

/// Registered memory in an arena: freed (its pages given back) when dropped.
pub(crate) struct Slice {
    arena: Arc<Arena>,
    off: u64,
    words: usize,
}

impl Slice {
    pub(crate) fn alloc(arena: &Arc<Arena>, len: usize) -> Result<Slice> {
        let off = arena.alloc(len as u64)?;
        Ok(Slice {
            arena: arena.clone(),
            off,
            words: len.div_ceil(8),
        })
    }

    pub(crate) fn off(&self) -> u64 {
        self.off
    }

    pub(crate) fn words(&self) -> &[u64] {
        // SAFETY: the range is this slice's own allocation inside the arena mapping (page
        // aligned, so aligned for u64), which lives as long as `self.arena`; peers may write
        // it concurrently through their mappings, as a NIC writes registered memory by DMA.
        unsafe { std::slice::from_raw_parts(self.arena.at(self.off).cast::<u64>(), self.words) }
    }

    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        // SAFETY: as in `words`; `&mut self` makes this the only local reference.
        unsafe { std::slice::from_raw_parts_mut(self.arena.at(self.off).cast::<u64>(), self.words) }
    }
}

impl Slice {
    /// Word `i` as an atomic (for the atomics peers also run on it).
    pub(crate) fn atomic_word(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        let i = i.min(self.words.saturating_sub(1));
        // SAFETY: word `i` is inside this slice's allocation (clamped above; regions are at
        // least one word), 8-byte aligned (pages), alive as long as `self`; every atomic on it
        // goes through AtomicU64.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.arena.at(self.off).cast::<u64>().add(i)) }
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.arena.free(self.off, self.words as u64 * 8);
    }
}
