//! The software RC NIC that the `tcp` and `shm` providers share: each queue pair's engine
//! (requester, responder, completer) over a byte link (`link.rs`: a TCP connection, or
//! shared-memory rings), the software CQ and PD, and the device's progress engine
//! (`progress.rs`) that turns every queue pair of a device with a fixed number of threads.
//!
//! The engine is a model of the NIC, not a shortcut: the target checks rkey (random, per
//! protection domain), bounds and access flags against its own region table; a Send finding no
//! receive is held (RNR) and fails with RNR_RETRY_EXC_ERR when none is posted in time; any
//! error moves the QP to the error state, flushes it and tells the peer; a dead peer (EOF,
//! reset, silence past the keepalive) fails the head request with RETRY_EXC_ERR. Over tcp the
//! application's polls read the socket too while it spins, in the spirit of libfabric's tcp
//! provider, so that a payload lands on the core that consumes it (`engine/reader.rs`; a task
//! sleeping on a CQ is woken by the sockets too: `watch.rs`). Over shm, one-sided operations and
//! Sends that find a posted receive run on the peer's memory from the initiator's thread, and
//! only the rest goes through the link.
//!
//! What a peer can make the engine hold in memory: the frame it is reading (at most the largest
//! message), up to 4 MiB of frames behind a Send that waits for a receive (past that the engine
//! reads nothing until the stall ends), and a few dozen bytes per answer the peer has not taken
//! from its link: a Read's answer stays in the registration until it leaves, as a NIC reads
//! host memory while it transmits. A long answer goes in parts of 256 KiB, as a NIC's goes in
//! packets, and this side's own requests go between two parts (see `sender.rs`).
//!
//! Registrations are behind locks here (a NIC needs none), and the engine never waits for one:
//! a frame whose memory the application holds (`bytes_mut()`) waits in the reader, a Read or
//! atomic answer waits in the sender, and the engine looks again 200 µs later; the answers and
//! acknowledgements this side owes after it wait behind it (RC orders responses), while this
//! side's own requests pass it.
//!
//! Acknowledgements cost CPU here (a NIC's cost none): one that a poll made due (a signaled
//! Send or Write the application's polling thread handled) goes out in the write of this side's
//! next request, or at the next poll of the QP's CQs, or from the engine's next turn within
//! `POLLER_GRACE` (1 ms), whichever comes first, rather than as a frame of its own on the path
//! of the answer that typically follows. The engine acknowledges at once what it read itself.

/// Largest message: 1 GiB.
pub(crate) const MAX_MSG: u64 = 1 << 30;

pub(crate) mod backlog;
pub(crate) mod bell;
mod cpu;
mod cq;
pub(crate) mod direct;
mod engine;
mod inbox;
pub(crate) mod link;
mod pd;
pub(crate) mod progress;
mod provider;
mod sender;
mod watch;
mod wire;

pub(crate) use cq::{now_nanos, Cq, CqSource};
pub(crate) use engine::srq::Srq;
pub(crate) use engine::Qp;
pub(crate) use link::{Link, BEAT, KEEPALIVE};
pub(crate) use pd::{random_u32, Pd};
pub(crate) use provider::{SoftCq, SoftSrq};
