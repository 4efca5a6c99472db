//! shm's hooks into the software NIC's engine (`nic::direct`): operations run on the peer's
//! memory and receive queue from the initiator's thread, and our receive queue drained as the
//! peer completed it.

use super::rq::{self, OwnRq};
use super::{Peer, PeerArena};
use crate::mr::Rmw;
use crate::nic::direct::{Direct, Done, Local, OwnQueue};
use crate::qp::SendDesc;
use crate::{SendOp, WcStatus};

impl Direct for Peer {
    fn run(&self, d: &SendDesc<'_>, local: Option<Local<'_>>) -> Option<Result<u32, WcStatus>> {
        run(self, d, local)
    }

    fn peer_on(&self, cpu: u32) -> bool {
        self.rq.cpu() == Some(cpu)
    }
}

impl OwnQueue for OwnRq {
    fn post(&self, seq: u64, len: u64, writable: bool) {
        OwnRq::post(self, seq, len, writable);
    }

    fn arm(&self) {
        OwnRq::arm(self);
    }

    fn has_taken(&self) -> bool {
        OwnRq::has_taken(self)
    }

    fn peek_done(&self) -> Option<(u64, Done)> {
        OwnRq::peek_done(self).map(|(at, d)| {
            (
                at,
                Done {
                    seq: d.seq,
                    status: d.status,
                    byte_len: d.byte_len,
                    imm: (d.flags & rq::HAS_IMM != 0).then_some(d.imm),
                    write_imm: d.flags & rq::WRITE_IMM != 0,
                    head: d.head,
                },
            )
        })
    }

    fn staged_max(&self) -> usize {
        rq::STAGE
    }

    fn take_staged(&self, dst: &mut [u8]) {
        OwnRq::take_staged(self, dst);
    }

    fn skip_staged(&self, len: usize) {
        OwnRq::skip_staged(self, len);
    }

    fn pass(&self, at: u64) {
        OwnRq::pass(self, at);
    }

    fn take_for_frame(&self) -> bool {
        OwnRq::take_for_frame(self)
    }

    fn publish_cpu(&self, cpu: u32) {
        OwnRq::publish_cpu(self, cpu);
    }
}

/// Runs a request on the peer's memory (shm): one-sided ones always, Sends and
/// Writes-with-immediate when the peer has a receive posted (else `None`: the request goes as a
/// frame and the peer's engine holds it, RNR). The result as the completion will say it.
fn run(peer: &Peer, d: &SendDesc<'_>, local: Option<Local<'_>>) -> Option<Result<u32, WcStatus>> {
    let local = local.as_ref();
    let local_bytes = |len: usize| local.map(|v| v.region.lock_range(v.off, len));
    let arena = &peer.arena;
    Some(match d.op {
        SendOp::Read { remote } => {
            if d.len == 0 {
                return Some(Ok(0));
            }
            match local_bytes(d.len) {
                Some(mut dst) => arena.read(remote.addr, remote.rkey, &mut dst)?.map(|()| d.len as u32),
                None => Err(WcStatus::LocLenErr),
            }
        }
        SendOp::Write { remote, imm: None } => {
            if d.len == 0 {
                return Some(Ok(0));
            }
            match local_bytes(d.len) {
                Some(src) => arena.write(remote.addr, remote.rkey, &src)?.map(|_| 0),
                None => Err(WcStatus::LocLenErr),
            }
        }
        SendOp::CompareSwap { remote, compare, swap } => {
            atomic(arena, remote, Rmw::CompareSwap { compare, swap }, local)?
        }
        SendOp::FetchAdd { remote, add } => atomic(arena, remote, Rmw::FetchAdd { add }, local)?,
        SendOp::Send { imm } => {
            let taken = match peer.rq.take() {
                Ok(Some(t)) => t,
                Ok(None) => return None,
                Err(()) => return Some(Err(WcStatus::RemOpErr)),
            };
            let flags = if imm.is_some() { rq::HAS_IMM } else { 0 };
            let data = if d.len > 0 { local_bytes(d.len) } else { None };
            let bytes: &[u8] = data.as_deref().unwrap_or(&[]);
            // The receiving NIC's check of room in the receive (the receiver checks its buffer
            // as it copies the payload in).
            let (ring, result) = if bytes.len() as u64 > taken.len {
                (
                    taken.complete(WcStatus::LocLenErr, 0, 0, 0),
                    Err(WcStatus::RemInvReqErr),
                )
            } else if bytes.is_empty() {
                (taken.complete(WcStatus::Success, flags, 0, imm.unwrap_or(0)), Ok(0))
            } else if !taken.writable {
                (taken.complete(WcStatus::LocProtErr, 0, 0, 0), Err(WcStatus::RemOpErr))
            } else if taken.stage(bytes) {
                let n = bytes.len() as u64;
                // A copy of its first bytes beside the completion, which a protocol reads its
                // header from (see `Head`).
                let taken = taken.with_head(bytes);
                (taken.complete(WcStatus::Success, flags, n, imm.unwrap_or(0)), Ok(0))
            } else {
                // No room in the staging area: the Send goes as a frame.
                return None;
            };
            if ring {
                peer.ring();
            }
            // Off the path of this Send: the next one likely lands in the next posted entry,
            // whose line the peer's core last read; fetching it (and the staging lines) now
            // keeps that Send from waiting for them.
            peer.rq.prefetch_next(bytes.len());
            result
        }
        SendOp::Write { remote, imm: Some(imm) } => {
            let taken = match peer.rq.take() {
                Ok(Some(t)) => t,
                Ok(None) => return None,
                Err(()) => return Some(Err(WcStatus::RemOpErr)),
            };
            let src = match d.len {
                0 => None,
                len => match local_bytes(len) {
                    Some(src) => Some(src),
                    None => return Some(Err(WcStatus::LocLenErr)),
                },
            };
            let held = match &src {
                // Without its grant, the Write-with-immediate goes as a frame (the entry taken
                // is not consumed until completed).
                Some(src) => match arena.write(remote.addr, remote.rkey, src)? {
                    Ok(held) => Some(held),
                    // A failed write consumes no receive; the peer learns of the error (Fatal).
                    Err(status) => return Some(Err(status)),
                },
                None => None,
            };
            let flags = rq::HAS_IMM | rq::WRITE_IMM;
            let ring = taken.complete(WcStatus::Success, flags, d.len as u64, imm);
            // Both locks go after the completion (see `Held`).
            drop((held, src));
            if ring {
                peer.ring();
            }
            Ok(0)
        }
    })
}

fn atomic(
    peer: &PeerArena,
    remote: crate::RemoteAddr,
    op: Rmw,
    local: Option<&Local<'_>>,
) -> Option<Result<u32, WcStatus>> {
    let old = match peer.atomic(remote.addr, remote.rkey, op)? {
        Ok(old) => old,
        Err(status) => return Some(Err(status)),
    };
    Some(match local {
        Some(v) if v.len >= 8 => {
            v.region.lock_range(v.off, 8).copy_from_slice(&old.to_ne_bytes());
            Ok(8)
        }
        _ => Err(WcStatus::LocLenErr),
    })
}
