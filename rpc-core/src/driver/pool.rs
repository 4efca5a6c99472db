//! A server's receive pool ([`Config::receive_pool`](crate::Config::receive_pool)): one shared
//! receive queue for all its connections, the slots posted on it, the credits it may grant
//! beyond each connection's two, and the send buffers its connections share.
//!
//! The credit rule that keeps every Send of every client on a posted receive: the pool holds
//! `slots` receives, each connection is granted 2 when it comes (the configuration keeps
//! `2 x max_connections` within the pool) and at most `slots - 2 x max_connections` more are
//! out at once, across all connections ([`ReceivePool::take_spare`]). A connection's window
//! (credits its peer holds, messages on their way or being handled, credits owed to it) is
//! thus always backed by slots the queue holds or the connection is done with and reposts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rdma_rpc_transport::{AccessFlags, BufferPool, Device, ProtectionDomain, RecvWr, SharedReceiveQueue};

use super::RECV;
use crate::{RpcError, TransportError};

/// Credits every connection of a pool is granted at least: one for a message, one held back
/// for a Credit message ([`Credits`](crate::proto::Credits)).
pub(crate) const FLOOR: u32 = 2;

/// One server's receive slots and send buffers, shared by its connections.
pub(crate) struct ReceivePool {
    pub(crate) pd: ProtectionDomain,
    pub(crate) srq: SharedReceiveQueue,
    /// Each slot is a pool of one buffer: a slot dropped anywhere (in the CQ of a connection
    /// that ended before it reaped it) goes back to its pool, and [`ReceivePool::refill`]
    /// posts it again. Each is also a registration of its own, so that reading one never
    /// waits on another being received into.
    slots: Vec<BufferPool>,
    /// Credits beyond the connections' floors not granted to any now.
    spare: AtomicU32,
    /// Send buffers for every connection of the server.
    pub(crate) send: BufferPool,
    /// The completion queues the connections share.
    pub(crate) groups: super::Groups,
    refilling: Mutex<()>,
}

impl ReceivePool {
    /// Registers and posts `slots` receive slots of `slot` bytes for up to `max_connections`
    /// connections, and a quarter as many send buffers (at least 64).
    /// Each connection's completions go to a CQ shared with others, holding `per_connection`
    /// entries for each of them.
    pub(crate) fn new(
        device: &Device,
        slots: u32,
        slot: usize,
        (max_connections, per_connection): (u32, u32),
    ) -> Result<Arc<Self>, RpcError> {
        let tr = |what: String| move |e| RpcError::Transport(TransportError::with(what, e));
        let pd = device
            .alloc_pd()
            .map_err(tr("allocating the receive pool's protection domain".into()))?;
        let srq = pd
            .create_srq(slots)
            .map_err(tr(format!("creating a shared receive queue of {slots} receives")))?;
        let pools = (0..slots)
            .map(|_| BufferPool::new(&pd, slot, 1, AccessFlags::LOCAL_WRITE))
            .collect::<Result<Vec<_>, _>>()
            .map_err(tr(format!("registering {slots} receive slots of {slot} bytes")))?;
        let sends = (slots / 4).max(64) as usize;
        let send = BufferPool::new(&pd, slot, sends, AccessFlags::LOCAL_WRITE)
            .map_err(tr(format!("registering {sends} send buffers of {slot} bytes")))?;
        let pool = Arc::new(Self {
            pd,
            srq,
            slots: pools,
            spare: AtomicU32::new(slots.saturating_sub(max_connections.saturating_mul(FLOOR))),
            send,
            groups: super::Groups::new(device, per_connection),
            refilling: Mutex::new(()),
        });
        pool.refill()?;
        Ok(pool)
    }

    /// Takes up to `want` spare credits; returns how many.
    pub(crate) fn take_spare(&self, want: u32) -> u32 {
        let mut got = 0;
        let _ = self.spare.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
            got = s.min(want);
            Some(s - got)
        });
        got
    }

    /// Gives back `n` credits a connection no longer holds.
    pub(crate) fn give_spare(&self, n: u32) {
        self.spare.fetch_add(n, Ordering::AcqRel);
    }

    /// Whether no spare credit is left: connections above their floor then give back the
    /// credits of the slots their peers use.
    pub(crate) fn short(&self) -> bool {
        self.spare.load(Ordering::Acquire) == 0
    }

    /// Posts a consumed slot again.
    pub(crate) fn repost(&self, wr: RecvWr) -> Result<(), rdma_rpc_transport::Error> {
        self.srq.post_recv(wr).map_err(|e| e.error)
    }

    /// Posts every slot that is in no work request and held by no connection (one dropped
    /// with a connection's CQ comes back here); at set-up, all of them.
    pub(crate) fn refill(&self) -> Result<(), RpcError> {
        let _one = self.refilling.lock();
        for (i, p) in self.slots.iter().enumerate() {
            if let Some(mr) = p.take() {
                self.repost(RecvWr::new(RECV | i as u64, mr))
                    .map_err(|e| RpcError::Transport(TransportError::with("posting a receive slot of the pool", e)))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use rdma_rpc_transport::{connect, Listener, QpOptions, SendWr};

    use super::*;

    /// Sends `n` 8-byte messages from `client`.
    fn send(client: &rdma_rpc_transport::QueuePair, pd: &ProtectionDomain, n: u64) {
        for i in 0..n {
            let mut b = pd.register(8, AccessFlags::NONE).expect("register");
            b.write_at(0, &i.to_le_bytes()).expect("write");
            client.post_send(SendWr::send(i, b)).map_err(|e| e.error).expect("send");
        }
    }

    /// Receives on `cq` until `n` completions came or 5 s passed; returns how many.
    fn receive(cq: &rdma_rpc_transport::CompletionQueue, n: usize) -> usize {
        let (mut got, start) = (Vec::new(), Instant::now());
        while got.len() < n && start.elapsed() < Duration::from_secs(5) {
            cq.poll(&mut got, 16).expect("poll");
            std::thread::sleep(Duration::from_millis(1));
        }
        got.len()
    }

    /// A connection that ends with messages it took but did not post again (reaped, or still
    /// in its CQ) drops their slots: they come back to the pool's buffer pools, and `refill`
    /// posts them again, so the next connection's messages are received; without the refill
    /// they would wait for a receive for ever.
    #[test]
    fn slots_a_connection_dropped_are_posted_again() {
        let dev = Device::open("tcp").expect("tcp");
        let pool = ReceivePool::new(&dev, 2, 64, (1, 16)).expect("pool");
        let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
        for round in 0..2 {
            let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
            let addr = listener.local_addr().expect("addr");
            let scq = dev.create_cq(16).expect("cq");
            let opts = QpOptions::new(&pool.pd, &scq).srq(&pool.srq);
            let server = std::thread::spawn(move || listener.accept(None).expect("accept").accept(&opts, b""));
            let (client, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", Duration::from_secs(5)).expect("connect");
            let server_qp = server.join().expect("accept thread").expect("accept");
            send(&client, &cpd, 2);
            assert_eq!(receive(&scq, 2), 2, "round {round}: both messages found a slot");
            // The connection ends with both slots dropped, none posted again.
            drop((server_qp, scq, client));
            pool.refill().expect("refill");
        }
    }
}
