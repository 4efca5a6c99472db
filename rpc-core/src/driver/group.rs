//! Completion queues shared by connections, a pooled server's ([`Config::receive_pool`]) and a
//! [`Connector`](crate::Connector)'s: each CQ serves up to [`GROUP`] connections, and whoever
//! polls it routes every completion to its connection's inbox by QP number. A group's CQ stays
//! when its connections leave, for the next ones: a server holds at most one per [`GROUP`] of
//! `max_connections`.
//!
//! With a CQ per connection, each message woke its connection's task through that CQ's own
//! doorbell: a system call to ring it, another to wait on it, and a turn of the runtime's IO
//! driver, per message and per connection. A shared CQ is polled in batches: while one of its
//! connections spins on it, its doorbell is not armed and nothing rings it; a connection that
//! polls hands the others what it found and wakes each once per batch, in the process. Only
//! when none spins does one task (the group's waiter) sleep on the doorbell.
//!
//! Order: a connection's completions reach it in the CQ's order, as every completion goes
//! through its connection's inbox, pushed under one lock in the order polls return them.
//!
//! [`Config::receive_pool`]: crate::Config::receive_pool

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use parking_lot::Mutex;
use rdma_rpc_transport::{Completion, CompletionQueue, Device};
use tokio::sync::Notify;

use crate::{RpcError, TransportError};

/// Connections per shared CQ at most. A software CQ asks each of its QPs whether it has
/// anything at every poll, so a group stays small enough for that to cost less than the
/// system calls it saves; 64 connections with 2 calls in flight each still give batches.
pub(crate) const GROUP: usize = 64;

/// How long a completion of a QP no connection has claimed is kept: one that comes between
/// the accept and the connection's joining is handed over when it joins (microseconds later);
/// one of a connection that already left (its QP reaped by a poll just before it was
/// destroyed) is dropped after this, its buffer back to its pool.
const STRAY_TTL: Duration = Duration::from_secs(5);

/// Completions polled per round.
const BATCH: usize = 64;

/// How long the waiter leaves the CQ unarmed to spinning members while none polls it: a
/// spinner busy elsewhere (a long handler), held off its core, or stopped without saying so
/// ([`Member::spin_end`]) delays the connections asleep by about this much at most.
const SPIN_QUIET: Duration = Duration::from_millis(1);

/// A connection's completions, handed over by whoever polled them.
#[derive(Default)]
pub(crate) struct Inbox {
    queue: Mutex<Vec<Completion>>,
    /// Raised once per batch that brought something (a permit is kept if nobody waits).
    ready: Notify,
}

impl Inbox {
    /// Waits until a poll handed this inbox something since the last wait.
    pub(crate) async fn notified(&self) {
        self.ready.notified().await;
    }
}

/// What the CQ's pollers share: who gets what, and what nobody has claimed yet.
#[derive(Default)]
struct Routes {
    inboxes: HashMap<u32, Arc<Inbox>>,
    strays: VecDeque<(Instant, Completion)>,
    /// The group's waiter runs (it ends when the group has no connection, or with its
    /// runtime); which one, so that only the current one's end says none runs.
    waiting: bool,
    waiter: u64,
}

/// What a poller of a group reuses from batch to batch: the completions, and the inboxes to
/// wake.
#[derive(Default)]
struct Batch {
    completions: Vec<Completion>,
    wake: Vec<Arc<Inbox>>,
}

/// One shared CQ and its connections.
pub(crate) struct Group {
    cq: CompletionQueue,
    routes: Mutex<Routes>,
    /// Held while a batch is polled and routed: one poller at a time keeps the order.
    polling: Mutex<Batch>,
    /// Connections placed on the group: joined, or having their QP made on its CQ.
    seats: AtomicUsize,
    /// Rung when a connection leaves: the waiter looks whether it still has any.
    left: Notify,
    /// Why the CQ failed, once it did: every connection of the group is lost.
    failed: OnceLock<String>,
    /// `Routes::waiting`, to look at without the lock.
    waiting: AtomicBool,
    /// Members spinning on the CQ now ([`Member::spin_round`]): their polls route every
    /// member's completions, so the waiter leaves the CQ unarmed. Armed under spinning pollers,
    /// the CQ would ring its doorbell and wake the waiter at each completion, and each arm
    /// would wake the QPs' readers (docs/decisions.md).
    spinners: AtomicUsize,
    /// A member polled since the waiter last looked.
    spun: AtomicBool,
    /// Rung when the last spinner stops.
    idle: Notify,
    /// Rung when the first spinner starts: a waiter on the armed CQ leaves it to the spinners.
    busy: Notify,
    /// The waiter leaves the CQ unarmed to spinners now.
    #[cfg(test)]
    leaving: AtomicBool,
    /// A test's [`SPIN_QUIET`], in nanoseconds (0: the constant).
    #[cfg(test)]
    quiet_ns: std::sync::atomic::AtomicU64,
}

/// A server's shared CQs, filled one after the other.
pub(crate) struct Groups {
    device: Device,
    /// Completions one connection may have outstanding at once (its receives and sends).
    per_connection: u32,
    groups: Mutex<Vec<Arc<Group>>>,
}

impl Groups {
    pub(crate) fn new(device: &Device, per_connection: u32) -> Self {
        Self {
            device: device.clone(),
            per_connection: per_connection.max(1),
            groups: Mutex::new(Vec::new()),
        }
    }

    /// A seat in a group with room for one more connection (a new group when none has any).
    /// The caller makes its QP on the seat's CQ, then [`joins`](Seat::join) with it.
    pub(crate) fn place(&self) -> Result<Seat, RpcError> {
        let size = self.size();
        let mut groups = self.groups.lock();
        let group = match groups.iter().find(|g| g.seats.load(Ordering::Acquire) < size) {
            Some(g) => g.clone(),
            None => {
                let depth = size as u32 * self.per_connection;
                let cq = self.device.create_cq(depth).map_err(|e| {
                    RpcError::Transport(TransportError::with(
                        format!("creating a completion queue of {depth} entries shared by {size} connections"),
                        e,
                    ))
                })?;
                let g = Arc::new(Group {
                    cq,
                    routes: Mutex::new(Routes::default()),
                    polling: Mutex::new(Batch::default()),
                    seats: AtomicUsize::new(0),
                    left: Notify::new(),
                    failed: OnceLock::new(),
                    waiting: AtomicBool::new(false),
                    spinners: AtomicUsize::new(0),
                    spun: AtomicBool::new(false),
                    idle: Notify::new(),
                    busy: Notify::new(),
                    #[cfg(test)]
                    leaving: AtomicBool::new(false),
                    #[cfg(test)]
                    quiet_ns: std::sync::atomic::AtomicU64::new(0),
                });
                groups.push(g.clone());
                g
            }
        };
        group.seats.fetch_add(1, Ordering::AcqRel);
        Ok(Seat { group })
    }

    /// Connections per CQ: [`GROUP`], fewer where the device's CQs hold fewer completions.
    fn size(&self) -> usize {
        let most = self.device.caps().max_cqe / self.per_connection;
        (most as usize).clamp(1, GROUP)
    }
}

/// A connection's place in a group, before its QP is known. Dropped, it frees the place.
pub(crate) struct Seat {
    group: Arc<Group>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.group.seats.fetch_sub(1, Ordering::AcqRel);
        self.group.left.notify_one();
    }
}

impl Seat {
    /// The CQ to make the connection's QP on.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.group.cq
    }

    /// The connection over QP `qp_num` takes its completions from now on, those that came
    /// before it joined first.
    pub(crate) fn join(self, qp_num: u32) -> Member {
        let inbox = Arc::new(Inbox::default());
        let group = self.group.clone();
        {
            let mut r = group.routes.lock();
            let mut q = inbox.queue.lock();
            let mut i = 0;
            while i < r.strays.len() {
                if r.strays[i].1.qp_num == qp_num {
                    if let Some((_, c)) = r.strays.remove(i) {
                        q.push(c);
                    }
                } else {
                    i += 1;
                }
            }
            if !q.is_empty() {
                inbox.ready.notify_one();
            }
            r.inboxes.insert(qp_num, inbox.clone());
        }
        group.start_waiter();
        Member {
            seat: self,
            qp_num,
            inbox,
            spinning: AtomicBool::new(false),
        }
    }
}

/// A connection of a group: its inbox, and its part in polling the CQ.
pub(crate) struct Member {
    seat: Seat,
    qp_num: u32,
    inbox: Arc<Inbox>,
    /// Counted among the group's spinners.
    spinning: AtomicBool,
}

impl Drop for Member {
    fn drop(&mut self) {
        self.spin_end();
        // What is still in the inbox drops with it (its buffers back to their pools); nothing
        // is routed to it once it is out of the table.
        let mut r = self.seat.group.routes.lock();
        r.inboxes.remove(&self.qp_num);
        r.strays.retain(|(_, c)| c.qp_num != self.qp_num);
    }
}

impl Member {
    /// The connection spins on the CQ (a round of polls): until [`spin_end`](Self::spin_end),
    /// its polls route the group's completions and the waiter leaves the CQ unarmed, as long as
    /// some member polls at least once a [`SPIN_QUIET`].
    pub(crate) fn spin_round(&self) {
        let group = &self.seat.group;
        if !self.spinning.load(Ordering::Relaxed)
            && !self.spinning.swap(true, Ordering::AcqRel)
            && group.spinners.fetch_add(1, Ordering::AcqRel) == 0
        {
            group.busy.notify_one();
        }
    }

    /// The connection stops spinning (it is about to sleep, or has nothing in flight): the
    /// last spinner to stop has the waiter arm the CQ.
    pub(crate) fn spin_end(&self) {
        if self.spinning.load(Ordering::Relaxed)
            && self.spinning.swap(false, Ordering::AcqRel)
            && self.seat.group.spinners.fetch_sub(1, Ordering::AcqRel) == 1
        {
            self.seat.group.idle.notify_one();
        }
    }

    /// Routes a batch of the CQ's completions when no other connection is doing so, then
    /// moves this connection's into `out`; returns how many.
    ///
    /// # Errors
    /// Why the CQ failed (every connection of the group ends).
    pub(crate) fn poll(&self, out: &mut Vec<Completion>) -> Result<usize, String> {
        let group = &self.seat.group;
        // A load first: the line stays shared while it says so already.
        if !group.spun.load(Ordering::Relaxed) {
            group.spun.store(true, Ordering::Relaxed);
        }
        if let Some(mut batch) = group.polling.try_lock() {
            group.route(&mut batch);
        }
        if let Some(why) = group.failed.get() {
            return Err(why.clone());
        }
        let mut q = self.inbox.queue.lock();
        let n = q.len();
        out.append(&mut q);
        Ok(n)
    }

    /// The inbox, to wait on without holding the connection. Starts the group's waiter if
    /// none runs (the one that ran went with its runtime: a client kept from one runtime to
    /// the next), so that what comes while the connection sleeps wakes it.
    pub(crate) fn inbox(&self) -> Arc<Inbox> {
        let group = &self.seat.group;
        if !group.waiting.load(Ordering::Acquire) {
            group.start_waiter();
        }
        self.inbox.clone()
    }
}

impl Group {
    /// [`SPIN_QUIET`], or a test's.
    fn quiet(&self) -> Duration {
        #[cfg(test)]
        if let n @ 1.. = self.quiet_ns.load(Ordering::Relaxed) {
            return Duration::from_nanos(n);
        }
        SPIN_QUIET
    }

    /// Starts a waiter unless one runs, on the caller's runtime (none outside one: the next
    /// connection to sleep starts it).
    fn start_waiter(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let guard = {
            let mut r = self.routes.lock();
            if r.waiting {
                return;
            }
            r.waiting = true;
            r.waiter += 1;
            self.waiting.store(true, Ordering::Release);
            WaiterGuard {
                group: self.clone(),
                id: r.waiter,
            }
        };
        // Spawned with the routes unlocked: a runtime that is shutting down drops the task at
        // once, and the guard's drop takes the lock.
        runtime.spawn(wait_for(guard));
    }

    /// Polls a batch and hands each completion to its connection's inbox (the caller holds
    /// `polling`); wakes each connection that had nothing waiting, once. Returns how many.
    fn route(&self, batch: &mut Batch) -> usize {
        let Batch { completions, wake } = batch;
        let n = match self.cq.poll(completions, BATCH) {
            Ok(n) => n,
            Err(e) => {
                self.fail(format!("polling the shared CQ: {}", rdma_rpc_transport::Report(&e)));
                return 0;
            }
        };
        if n == 0 {
            return 0;
        }
        {
            let mut r = self.routes.lock();
            let now = Instant::now();
            while r
                .strays
                .front()
                .is_some_and(|(t, _)| now.saturating_duration_since(*t) > STRAY_TTL)
            {
                r.strays.pop_front();
            }
            for c in completions.drain(..) {
                match r.inboxes.get(&c.qp_num) {
                    Some(inbox) => {
                        let mut q = inbox.queue.lock();
                        if q.is_empty() {
                            wake.push(inbox.clone());
                        }
                        q.push(c);
                    }
                    None => r.strays.push_back((now, c)),
                }
            }
        }
        for inbox in wake.drain(..) {
            inbox.ready.notify_one();
        }
        n
    }

    /// The CQ failed: every connection of the group hears of it.
    fn fail(&self, why: String) {
        let _ = self.failed.set(why);
        for inbox in self.routes.lock().inboxes.values() {
            inbox.ready.notify_one();
        }
        // The waiter ends.
        self.left.notify_one();
    }
}

/// The group's waiter: sleeps on the CQ while no connection spins on it, and routes what wakes
/// it. Ends when the group has no connection (the next to join starts another), or with its
/// runtime (the next connection to sleep starts another, see [`Member::inbox`]).
async fn wait_for(me: WaiterGuard) {
    let group = &me.group;
    loop {
        {
            let mut r = group.routes.lock();
            if r.inboxes.is_empty() || group.failed.get().is_some() {
                // None runs from now: said under the lock a joiner looks under.
                r.waiting = false;
                group.waiting.store(false, Ordering::Release);
                r.waiter += 1;
                return;
            }
        }
        let spinning = group.spinners.load(Ordering::Acquire) > 0;
        if spinning {
            // The spinners route; arm only once they stop, or once none polled for a while.
            group.spun.store(false, Ordering::Relaxed);
            #[cfg(test)]
            group.leaving.store(true, Ordering::Relaxed);
            tokio::select! {
                () = group.idle.notified() => continue,
                () = group.left.notified() => continue,
                () = tokio::time::sleep(group.quiet()) => {
                    if group.spun.load(Ordering::Relaxed) {
                        continue;
                    }
                }
            }
        }
        #[cfg(test)]
        group.leaving.store(false, Ordering::Relaxed);
        tokio::select! {
            ready = group.cq.ready() => match ready {
                Ok(()) => {
                    let mut batch = group.polling.lock();
                    group.route(&mut batch);
                }
                Err(e) => group.fail(format!("waiting on the shared CQ: {}", rdma_rpc_transport::Report(&e))),
            },
            () = group.left.notified() => {}
            () = group.busy.notified() => {}
            // Spinners that went quiet: whether they spin again.
            () = tokio::time::sleep(group.quiet()), if spinning => {}
        }
    }
}

/// The running waiter: when it ends, however (its runtime may drop it), none runs.
struct WaiterGuard {
    group: Arc<Group>,
    id: u64,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let mut r = self.group.routes.lock();
        if r.waiter == self.id {
            r.waiting = false;
            self.group.waiting.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use rdma_rpc_transport::{
        connect, AccessFlags, Listener, ProtectionDomain, QpOptions, QueuePair, RecvWr, SendOp, SendWr,
    };

    use super::*;

    /// A QP on `seat`'s CQ with `recvs` receives of 16 bytes posted, and its peer.
    fn pair(dev: &Device, seat: &Seat, recvs: u64) -> (QueuePair, QueuePair, ProtectionDomain) {
        let listener = Listener::bind(dev, "127.0.0.1:0".parse::<SocketAddr>().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let pd = dev.alloc_pd().expect("pd");
        let recv = (0..recvs)
            .map(|i| RecvWr::new(i, pd.register(16, AccessFlags::LOCAL_WRITE).expect("register")))
            .collect::<Vec<_>>();
        let opts = QpOptions::new(&pd, seat.cq());
        let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
        let server = std::thread::spawn(move || {
            listener
                .accept(None)
                .expect("accept")
                .accept_with_recvs(&opts, b"", recv)
        });
        let (client, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", Duration::from_secs(5)).expect("connect");
        let qp = server.join().expect("accept thread").expect("accept");
        (qp, client, cpd)
    }

    /// Sends `n` messages from `client`, the i-th carrying `i` as its immediate.
    fn send(client: &QueuePair, pd: &ProtectionDomain, n: u32) {
        for i in 0..n {
            let b = pd.register(8, AccessFlags::NONE).expect("register");
            client
                .post_send(SendWr::new(u64::from(i), SendOp::Send { imm: Some(i) }).buf(b))
                .map_err(|e| e.error)
                .expect("send");
        }
    }

    /// Polls as `member` until `n` completions came or `within` passed.
    fn take(member: &Member, n: usize, within: Duration) -> Vec<Completion> {
        let (mut got, start) = (Vec::new(), Instant::now());
        while got.len() < n && start.elapsed() < within {
            member.poll(&mut got).expect("poll");
            std::thread::sleep(Duration::from_millis(1));
        }
        got
    }

    /// Two connections on one CQ: one polls, and each gets its own completions, in order, each
    /// once; a completion that came before its connection joined is handed over at the join.
    #[tokio::test]
    async fn each_connection_gets_its_own_completions_in_order_whoever_polls() {
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        let (a, b) = (groups.place().expect("seat"), groups.place().expect("seat"));
        assert!(Arc::ptr_eq(&a.group, &b.group), "two connections share one CQ");
        let (qa, ca, pa) = pair(&dev, &a, 32);
        let (qb, cb, pb) = pair(&dev, &b, 32);
        let a = a.join(qa.qp_num());
        // b's first messages come before it joins: a's polls keep them for it.
        send(&cb, &pb, 5);
        let early = take(&a, 1, Duration::from_millis(200));
        assert!(early.is_empty(), "a got none of b's completions: {}", early.len());
        let b = b.join(qb.qp_num());
        send(&ca, &pa, 20);
        send(&cb, &pb, 20);
        // Only a polls the CQ; b takes what a routed to it.
        let from_a = take(&a, 20, Duration::from_secs(5));
        let mut from_b = Vec::new();
        b.poll(&mut from_b).expect("poll");
        let start = Instant::now();
        while from_b.len() < 25 && start.elapsed() < Duration::from_secs(5) {
            let more = take(&a, 0, Duration::ZERO);
            assert!(more.is_empty());
            b.poll(&mut from_b).expect("poll");
        }
        let imms = |v: &[Completion], qp: u32| {
            assert!(
                v.iter().all(|c| c.qp_num == qp),
                "only the connection's own completions"
            );
            v.iter().map(|c| c.imm.expect("imm")).collect::<Vec<_>>()
        };
        assert_eq!(imms(&from_a, qa.qp_num()), (0..20).collect::<Vec<_>>());
        let expected = (0..5).chain(0..20).collect::<Vec<_>>();
        assert_eq!(imms(&from_b, qb.qp_num()), expected, "b's, the early ones first");
    }

    /// A group takes `GROUP` connections at most; a place given back (a set-up that failed,
    /// a connection that left) is taken again before a new CQ is made.
    #[tokio::test]
    async fn groups_fill_up_to_their_size_and_reuse_freed_places() {
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        let first: Vec<Seat> = (0..GROUP).map(|_| groups.place().expect("seat")).collect();
        assert!(first.iter().all(|s| Arc::ptr_eq(&s.group, &first[0].group)));
        let next = groups.place().expect("seat");
        assert!(!Arc::ptr_eq(&next.group, &first[0].group), "a full group: a new CQ");
        let freed = Arc::clone(&first[3].group);
        drop(first);
        let again = groups.place().expect("seat");
        assert!(Arc::ptr_eq(&again.group, &freed), "the first group has room again");
        assert_eq!(groups.groups.lock().len(), 2);
        // A device whose CQs are small puts fewer connections on each.
        let small = Groups::new(&dev, dev.caps().max_cqe / 3);
        assert_eq!(small.size(), 3);
    }

    /// The group's waiter wakes a sleeping connection when its completion comes, and ends when
    /// the group's last connection leaves; the next to join starts another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sleeping_connection_is_woken_by_the_waiter_which_ends_with_the_group() {
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        for round in 0..2 {
            let seat = groups.place().expect("seat");
            let (qp, client, pd) = pair(&dev, &seat, 4);
            let member = seat.join(qp.qp_num());
            assert!(member.seat.group.routes.lock().waiting, "round {round}: a waiter runs");
            let inbox = member.inbox();
            let woken = tokio::spawn(async move { inbox.notified().await });
            tokio::time::sleep(Duration::from_millis(20)).await;
            send(&client, &pd, 1);
            tokio::time::timeout(Duration::from_secs(5), woken)
                .await
                .expect("woken within 5 s")
                .expect("task");
            let mut got = Vec::new();
            member.poll(&mut got).expect("poll");
            assert_eq!(got.len(), 1);
            let group = member.seat.group.clone();
            drop((member, qp));
            let start = Instant::now();
            while group.routes.lock().waiting && start.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(
                !group.routes.lock().waiting,
                "round {round}: the waiter ended with the group"
            );
        }
    }

    /// While a connection spins on the CQ, the waiter leaves it unarmed (armed under spinning
    /// pollers, each completion rang the doorbell and woke the waiter, which armed it again),
    /// and the spinner's polls route a sleeping connection's completions. Once the spinner
    /// stops, the waiter watches the CQ again; one that stopped polling without saying so
    /// keeps nobody asleep for long.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_waiter_leaves_the_cq_to_a_spinner_and_watches_it_once_the_spinner_stops() {
        let dev = Device::open("shm").expect("shm");
        let groups = Groups::new(&dev, 64);
        let (sa, sb) = (groups.place().expect("seat"), groups.place().expect("seat"));
        let (qa, _ca, _pa) = pair(&dev, &sa, 4);
        let (qb, cb, pb) = pair(&dev, &sb, 128);
        let a = Arc::new(sa.join(qa.qp_num()));
        let b = sb.join(qb.qp_num());
        let group = a.seat.group.clone();
        // Quiet spells of a spinner held off its core do not count here.
        group.quiet_ns.store(3_600_000_000_000, Ordering::Relaxed);
        let inbox = b.inbox();
        let woken = |what: &'static str| {
            let inbox = inbox.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), inbox.notified())
                    .await
                    .unwrap_or_else(|_| panic!("{what}: b woken within 10 s"));
            }
        };
        let leaving = |yes: bool| {
            let group = group.clone();
            async move {
                let start = Instant::now();
                while group.leaving.load(Ordering::Relaxed) != yes && start.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                group.leaving.load(Ordering::Relaxed) == yes
            }
        };
        assert!(leaving(false).await, "nobody spins: the waiter watches the CQ");
        let stop = Arc::new(AtomicBool::new(false));
        let spinner = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut none = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    a.spin_round();
                    a.poll(&mut none).expect("poll");
                }
                a.spin_end();
                none
            })
        };
        assert!(leaving(true).await, "a spins: the waiter leaves the CQ to it");
        let mut got = Vec::new();
        for i in 0..100 {
            send(&cb, &pb, 1);
            woken("a spinner routes").await;
            b.poll(&mut got).expect("poll");
            assert!(
                group.leaving.load(Ordering::Relaxed),
                "message {i}: the waiter armed the CQ"
            );
        }
        assert_eq!(got.len(), 100);
        stop.store(true, Ordering::Relaxed);
        assert!(spinner.join().expect("spinner").is_empty(), "a had nothing of its own");
        assert!(
            leaving(false).await,
            "the spinner stopped: the waiter watches the CQ again"
        );
        send(&cb, &pb, 1);
        woken("the spinner stopped").await;
        b.poll(&mut got).expect("poll");
        // Counted as spinning, never polling: the waiter watches after a quiet while.
        group.quiet_ns.store(1_000_000, Ordering::Relaxed);
        a.spin_round();
        send(&cb, &pb, 1);
        woken("a silent spinner").await;
        b.poll(&mut got).expect("poll");
        assert_eq!(got.len(), 102);
        a.spin_end();
    }

    /// A waiter that went with its runtime is started again by the next connection to sleep,
    /// on the runtime it sleeps on: what comes then still wakes it.
    #[test]
    fn a_waiter_gone_with_its_runtime_is_started_again_by_the_next_sleeper() {
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        let seat = groups.place().expect("seat");
        let (qp, client, pd) = pair(&dev, &seat, 4);
        let first = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let member = first.block_on(async { seat.join(qp.qp_num()) });
        let group = member.seat.group.clone();
        assert!(group.waiting.load(Ordering::Acquire), "the join started a waiter");
        drop(first);
        assert!(
            !group.waiting.load(Ordering::Acquire) && !group.routes.lock().waiting,
            "the waiter went with its runtime, and says so"
        );
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        second.block_on(async {
            let inbox = member.inbox();
            assert!(group.waiting.load(Ordering::Acquire), "a sleeper started another");
            send(&client, &pd, 1);
            tokio::time::timeout(Duration::from_secs(5), inbox.notified())
                .await
                .expect("woken within 5 s");
        });
    }

    /// A connection that joins while its runtime shuts down (a task dropped at the shutdown
    /// whose drop makes the join): the waiter it starts is dropped at once, and that neither
    /// deadlocks nor leaves the group believing a waiter runs.
    #[test]
    fn a_join_during_its_runtimes_shutdown_leaves_no_waiter_said_to_run() {
        struct JoinOnDrop(Option<(Seat, u32)>, std::sync::mpsc::Sender<Member>);
        impl Drop for JoinOnDrop {
            fn drop(&mut self) {
                if let Some((seat, qp_num)) = self.0.take() {
                    let _ = self.1.send(seat.join(qp_num));
                }
            }
        }
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        let seat = groups.place().expect("seat");
        let (qp, _client, _pd) = pair(&dev, &seat, 4);
        let (tx, members) = std::sync::mpsc::channel();
        let (done_tx, done) = std::sync::mpsc::channel();
        let qp_num = qp.qp_num();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            let on_drop = JoinOnDrop(Some((seat, qp_num)), tx);
            runtime.spawn(async move {
                let _held = on_drop;
                std::future::pending::<()>().await;
            });
            runtime.block_on(tokio::task::yield_now());
            drop(runtime);
            let _ = done_tx.send(());
        });
        done.recv_timeout(Duration::from_secs(10))
            .expect("the runtime shut down within 10 s (no deadlock in the join)");
        let member = members.recv().expect("joined");
        let group = member.seat.group.clone();
        assert!(
            !group.waiting.load(Ordering::Acquire) && !group.routes.lock().waiting,
            "no waiter runs, and the group says so"
        );
    }

    /// A CQ that failed fails every connection of its group, the sleeping ones woken to hear
    /// it, and its waiter ends.
    #[tokio::test]
    async fn a_failed_cq_fails_every_connection_of_its_group() {
        let dev = Device::open("tcp").expect("tcp");
        let groups = Groups::new(&dev, 64);
        let (a, b) = (groups.place().expect("seat"), groups.place().expect("seat"));
        let (qa, _ca, _pa) = pair(&dev, &a, 4);
        let (qb, _cb, _pb) = pair(&dev, &b, 4);
        let (a, b) = (a.join(qa.qp_num()), b.join(qb.qp_num()));
        let sleeping = b.inbox();
        a.seat.group.fail("the CQ overran".into());
        tokio::time::timeout(Duration::from_secs(5), sleeping.notified())
            .await
            .expect("the sleeper is woken");
        for m in [&a, &b] {
            let err = m.poll(&mut Vec::new()).expect_err("a failed group");
            assert!(err.contains("overran"), "{err}");
        }
        let start = Instant::now();
        while a.seat.group.waiting.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(!a.seat.group.waiting.load(Ordering::Acquire), "the waiter ended");
    }
}
