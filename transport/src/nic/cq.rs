//! The software NIC's completion queue, shared by the `tcp` and `shm` providers.

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use rustix::event::epoll;

use super::watch;
use crate::cq::RawWc;

/// Something that produces completions when asked: shm QPs whose peers complete receives in
/// shared memory, tcp QPs whose socket the polling thread reads itself. A CQ asks every source
/// before each poll.
pub(crate) trait CqSource: Send + Sync {
    fn drain(self: Arc<Self>);
    /// The CQ waits: have the next completion rung for. `watched`: the CQ's waiter watches
    /// the sockets of many QPs itself ([`Cq::watches_many`]).
    fn arm(&self, watched: bool);
}

/// QPs on one CQ beyond which many share it (a pooled server's, a `Connector`'s): its waiter
/// watches their tcp sockets in their readers' stead ([`Cq::watches_many`]), and its polls
/// leave their shm rings of frames to the progress thread ([`Cq::reads_frames`]). On such a
/// CQ every poll looking at every ring (a cache line or two each, of memory the peers write)
/// cost more than it saved: a pooled server's 2,048 connections gave 14% of its samples to
/// the look and fewer calls/s.
const MANY: usize = 8;

/// Nanoseconds on the clock of poll stamps (never 0: 0 stands for "never").
pub(crate) fn now_nanos() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// A software completion queue.
pub(crate) struct Cq {
    /// Sources asked at every poll: those no socket announces (shm).
    sources: Mutex<Vec<Source>>,
    /// At most [`MANY`] sources: polls read their links.
    reads_frames: AtomicBool,
    /// Sources with a socket in `sockets` (tcp), by their key there: a poll drains only those
    /// its sockets or a nudge name ([`Cq::nudge`]), so that a CQ many QPs share costs a poll
    /// what has arrived, not a look at every QP.
    watched: Mutex<HashMap<u64, Watched>>,
    /// Keys of watched sources to drain at the next poll; `due_any` says there are some.
    due: Mutex<Vec<u64>>,
    due_any: AtomicBool,
    queue: Mutex<VecDeque<RawWc>>,
    /// Completions in `queue`, so that an empty poll takes no lock.
    queued: AtomicUsize,
    armed: AtomicBool,
    bell: crate::nic::bell::Bell,
    bell_id: u64,
    /// When the CQ was last polled ([`now_nanos`]; 0: never): whether an application thread
    /// spins on it, for the engines of its QPs.
    last_poll: AtomicU64,
    /// Polls so far, to stamp `last_poll` on some (shm).
    polls: AtomicU32,
    /// tcp: the sockets of the QPs attached, so that a poll reads only those with data (one
    /// system call for all of them).
    sockets: Sockets,
}

/// An epoll set of QP sockets, keyed as their sources in `Cq::watched`.
struct Sockets {
    /// Shared with its registration in a waiter's runtime (`watch.rs`).
    epoll: Arc<OwnedFd>,
    next: AtomicU64,
    /// Sockets were added: polls ask the set, and a waiter watches it too.
    any: AtomicBool,
    watch: watch::Watch,
}

/// A source and a cheap look at whether it has anything (before waking the source up).
struct Source {
    source: Weak<dyn CqSource>,
    has_some: Box<dyn Fn() -> bool + Send + Sync>,
    /// A look at its link (shm's ring of frames), taken while the CQ has at most [`MANY`]
    /// sources.
    framed: Option<Box<dyn Fn() -> bool + Send + Sync>>,
}

/// Whether a watched source still has something once drained.
type Left = Arc<dyn Fn() -> bool + Send + Sync>;

/// A source with a socket, and whether it still has something once drained (frames read
/// ahead, an acknowledgement owed): it is drained again at the next poll then.
struct Watched {
    source: Weak<dyn CqSource>,
    left: Left,
}

impl Cq {
    pub(crate) fn new(depth: u32) -> crate::Result<Self> {
        Ok(Self {
            sources: Mutex::new(Vec::new()),
            reads_frames: AtomicBool::new(true),
            polls: AtomicU32::new(0),
            watched: Mutex::new(HashMap::new()),
            due: Mutex::new(Vec::new()),
            due_any: AtomicBool::new(false),
            queue: Mutex::new(VecDeque::with_capacity(depth.min(4096) as usize)),
            queued: AtomicUsize::new(0),
            armed: AtomicBool::new(false),
            bell: crate::nic::bell::Bell::new()?,
            bell_id: u64::from(super::random_u32()) << 32 | u64::from(super::random_u32()),
            last_poll: AtomicU64::new(0),
            sockets: Sockets {
                epoll: Arc::new(
                    epoll::create(epoll::CreateFlags::CLOEXEC)
                        .map_err(|e| crate::Error::io("creating a CQ's socket set (epoll)", e.into()))?,
                ),
                next: AtomicU64::new(0),
                any: AtomicBool::new(false),
                watch: watch::Watch::new(),
            },
        })
    }

    /// Adds a source whose `socket` says when it has something (level-triggered): polls drain
    /// it when the socket has something to read, when it is nudged ([`Cq::nudge`]), and again
    /// after a drain that left something (`left`). Returns its key, to nudge it by.
    pub(crate) fn add_watched(
        &self,
        socket: BorrowedFd<'_>,
        source: Weak<dyn CqSource>,
        left: Left,
    ) -> crate::Result<u64> {
        let s = &self.sockets;
        let key = s.next.fetch_add(1, Ordering::Relaxed);
        let mut watched = self.watched.lock();
        watched.retain(|_, w| w.source.strong_count() > 0);
        epoll::add(&s.epoll, socket, epoll::EventData::new_u64(key), epoll::EventFlags::IN)
            .map_err(|e| crate::Error::io("adding a QP's socket to its CQ's set (epoll)", e.into()))?;
        // A waiter armed the CQ before this source came: it must be woken by this source's
        // completions too, as a NIC's armed CQ is by any QP's (see `add_source`).
        if self.armed.load(Ordering::SeqCst) {
            if let Some(src) = source.upgrade() {
                src.arm(self.watches_many(watched.len() + 1));
            }
        }
        watched.insert(key, Watched { source, left });
        drop(watched);
        s.any.store(true, Ordering::Release);
        // Its first poll looks, whatever the socket says.
        self.nudge(key);
        Ok(key)
    }

    /// The watched source `key` has something no socket announces: the next poll drains it.
    pub(crate) fn nudge(&self, key: u64) {
        self.due.lock().push(key);
        self.due_any.store(true, Ordering::SeqCst);
    }

    /// Whether its polls read the links of its sources that have one (shm's rings): while it
    /// has at most [`MANY`] sources.
    pub(crate) fn reads_frames(&self) -> bool {
        self.reads_frames.load(Ordering::Acquire)
    }

    /// When the CQ was last polled ([`now_nanos`]; 0: never).
    pub(crate) fn last_poll(&self) -> u64 {
        self.last_poll.load(Ordering::Relaxed)
    }

    /// Marks due the watched sources whose sockets have something to read.
    fn mark_readable(&self) {
        let s = &self.sockets;
        // On the stack: this runs on every poll.
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 64];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        let Ok((events, _)) = epoll::wait(&s.epoll, &mut buf[..], Some(&zero)) else {
            // Cannot tell: every source looks.
            let keys: Vec<u64> = self.watched.lock().keys().copied().collect();
            self.due.lock().extend(keys);
            self.due_any.store(true, Ordering::SeqCst);
            return;
        };
        if events.is_empty() {
            return;
        }
        self.due.lock().extend(events.iter().map(|e| e.data.u64()));
        self.due_any.store(true, Ordering::SeqCst);
    }

    /// Drains the watched sources due; those that still have something stay due.
    fn drain_due(&self) {
        if !self.due_any.swap(false, Ordering::SeqCst) {
            return;
        }
        let mut keys = std::mem::take(&mut *self.due.lock());
        keys.sort_unstable();
        keys.dedup();
        let due: Vec<(u64, Arc<dyn CqSource>, Left)> = {
            let watched = self.watched.lock();
            keys.iter()
                .filter_map(|k| {
                    let w = watched.get(k)?;
                    Some((*k, w.source.upgrade()?, w.left.clone()))
                })
                .collect()
        };
        // No lock of the CQ's held: a drain takes the engine's and pushes completions.
        for (key, src, left) in due {
            src.drain();
            if left() {
                self.nudge(key);
            }
        }
    }

    pub(crate) fn push(&self, wc: RawWc) {
        {
            let mut q = self.queue.lock();
            q.push_back(wc);
            self.queued.store(q.len(), Ordering::SeqCst);
        }
        // A load first: the read-modify-write only when a waiter armed the CQ.
        if self.armed.load(Ordering::SeqCst) && self.armed.swap(false, Ordering::SeqCst) {
            self.bell.ring();
        }
    }

    pub(crate) fn add_source(&self, source: Weak<dyn CqSource>, has_some: Box<dyn Fn() -> bool + Send + Sync>) {
        self.add_framed_source(source, has_some, None);
    }

    /// [`add_source`](Self::add_source), with a look at the source's link that polls take in
    /// turns with the other sources' ([`FRAMED_PER_POLL`] a poll).
    pub(crate) fn add_framed_source(
        &self,
        source: Weak<dyn CqSource>,
        has_some: Box<dyn Fn() -> bool + Send + Sync>,
        framed: Option<Box<dyn Fn() -> bool + Send + Sync>>,
    ) {
        let mut s = self.sources.lock();
        s.retain(|w| w.source.strong_count() > 0);
        // A waiter armed the CQ before this source came: it must be woken by this source's
        // completions too, as a NIC's armed CQ is by any QP's (`ibv_req_notify_cq`). Under the
        // sources' lock, against `arm`: it stores the flag, then arms what is listed.
        if self.armed.load(Ordering::SeqCst) {
            if let Some(src) = source.upgrade() {
                src.arm(false);
            }
        }
        s.push(Source {
            source,
            has_some,
            framed,
        });
        self.reads_frames.store(s.len() <= MANY, Ordering::Release);
    }

    pub(crate) fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> usize {
        // Its QPs learn that this CQ is polled (their pollers read their links).
        if self.sockets.any.load(Ordering::Acquire) {
            self.last_poll.store(now_nanos(), Ordering::Relaxed);
            // tcp QPs attached: which of them to read.
            self.mark_readable();
        } else {
            // shm: every 16th poll reads the clock (a read a poll added 0.1 µs to a 1.5 µs
            // round trip); the stamp is then late by 16 polls at most, a few µs of spinning.
            // A racy count: a lost increment only moves the next stamp.
            let n = self.polls.load(Ordering::Relaxed);
            self.polls.store(n.wrapping_add(1), Ordering::Relaxed);
            if n % 16 == 0 {
                self.last_poll.store(now_nanos(), Ordering::Relaxed);
            }
        }
        // Lock order: sources, then a source's engine state, then the queue (as push takes it);
        // watched sources are drained with no lock of the CQ's held.
        let mut sources = self.sources.lock();
        let mut gone = false;
        let framed = sources.len() <= MANY;
        for s in sources.iter() {
            if (s.has_some)() || (framed && s.framed.as_ref().is_some_and(|f| f())) {
                match s.source.upgrade() {
                    Some(src) => src.drain(),
                    None => gone = true,
                }
            }
        }
        if gone {
            // The QP was destroyed: drop its queue (and the mapping the look holds).
            sources.retain(|s| s.source.strong_count() > 0);
            self.reads_frames.store(sources.len() <= MANY, Ordering::Release);
        }
        drop(sources);
        self.drain_due();
        if self.queued.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        let mut q = self.queue.lock();
        let n = q.len().min(max);
        // One by one: `extend(q.drain(..n))` takes the general path of `Vec::extend` (a
        // `VecDeque` drain is not a trusted-length iterator), about 120 instructions a poll on
        // the message's path.
        out.reserve(n);
        for _ in 0..n {
            if let Some(wc) = q.pop_front() {
                out.push(wc);
            }
        }
        self.queued.store(q.len(), Ordering::SeqCst);
        if n > 0 {
            self.sockets.watch.polled_some();
        }
        n
    }

    /// Whether a waiter armed the CQ and no completion has come since.
    pub(crate) fn is_armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst)
    }

    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
        for s in self.sources.lock().iter().filter_map(|s| s.source.upgrade()) {
            s.arm(false);
        }
        // Under the lock `add_watched` looks at the flag under.
        let watched = self.watched.lock();
        if self.watches_many(watched.len()) {
            // The waiter watches their sockets: only the sources with something no socket
            // announces (due) need their readers.
            let due = self.due.lock().clone();
            for src in due.iter().filter_map(|k| watched.get(k)?.source.upgrade()) {
                src.arm(true);
            }
        } else {
            for src in watched.values().filter_map(|w| w.source.upgrade()) {
                src.arm(false);
            }
        }
    }

    /// Whether a waiter on this CQ, with `sources` tcp QPs on it, watches their sockets in
    /// their readers' stead: more than [`MANY`] (a CQ a server or a `Connector`
    /// shares), and its next wait watches them (not the doorbell alone, `watch.rs`). Its
    /// waiter then wakes on their arrivals and its poll reads them; a QP's reader takes its
    /// socket back by what a poll hands it, or at its grace timer. Waking every reader at
    /// every arm, as for a CQ of one connection, would cost a turn of the progress thread
    /// per QP each time the waiter slept.
    fn watches_many(&self, sources: usize) -> bool {
        sources > MANY && self.sockets.watch.will_watch()
    }

    /// Sleeps until the doorbell rings, or (tcp QPs attached) until one of their sockets has
    /// something to read, which the next poll may take itself (`watch.rs`). Arm first, then
    /// poll once more, then wait; a wake-up may find nothing.
    pub(crate) async fn wait_bell(&self) -> crate::Result<()> {
        let s = &self.sockets;
        if s.any.load(Ordering::Acquire) {
            s.watch.wait(&s.epoll, &self.bell).await
        } else {
            self.bell.wait().await
        }
    }

    /// A duplicate of the doorbell for a peer process that delivers into our receives (shm).
    pub(crate) fn share_bell(&self) -> crate::Result<std::os::fd::OwnedFd> {
        self.bell.share()
    }

    /// The doorbell's id, random: a peer process keeps one descriptor per id (shm's `bells`).
    pub(crate) fn bell_id(&self) -> u64 {
        self.bell_id
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::time::Duration;

    use super::*;

    /// A source that counts its drains.
    #[derive(Default)]
    struct Counted(AtomicUsize);

    impl CqSource for Counted {
        fn drain(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn arm(&self, _watched: bool) {}
    }

    #[tokio::test]
    async fn a_waiter_on_a_cq_with_sockets_wakes_when_one_has_something_to_read() {
        let cq = Cq::new(16).expect("cq");
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let source = Arc::new(Counted::default());
        let weak = Arc::downgrade(&source) as Weak<dyn CqSource>;
        cq.add_watched(ours.as_fd(), weak, Arc::new(|| false)).expect("add");
        cq.poll(&mut Vec::new(), 1);
        assert_eq!(source.0.load(Ordering::SeqCst), 1, "its first poll drains it");
        cq.poll(&mut Vec::new(), 1);
        assert_eq!(source.0.load(Ordering::SeqCst), 1, "nothing to read, nothing drained");
        cq.arm();
        let waiting = tokio::time::timeout(Duration::from_millis(100), cq.wait_bell()).await;
        assert!(waiting.is_err(), "nothing came, nothing rang");
        theirs.write_all(b"x").expect("write");
        // No completion and no ring: the socket alone wakes it, for the next poll to read.
        tokio::time::timeout(Duration::from_secs(10), cq.wait_bell())
            .await
            .expect("woken by the socket")
            .expect("no error");
        cq.poll(&mut Vec::new(), 1);
        assert_eq!(source.0.load(Ordering::SeqCst), 2, "the poll drains the readable one");
    }

    /// Of many watched sources, a poll drains those whose sockets have something, those
    /// nudged, and again those a drain left something in.
    #[test]
    fn a_poll_drains_only_the_sources_readable_nudged_or_left_with_something() {
        let cq = Cq::new(16).expect("cq");
        let left = Arc::new(AtomicBool::new(false));
        let mut ends = Vec::new();
        let mut sources = Vec::new();
        let mut keys = Vec::new();
        for i in 0..20 {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
            let source = Arc::new(Counted::default());
            let weak = Arc::downgrade(&source) as Weak<dyn CqSource>;
            let l = left.clone();
            let sticky: Arc<dyn Fn() -> bool + Send + Sync> = if i == 7 {
                Arc::new(move || l.load(Ordering::SeqCst))
            } else {
                Arc::new(|| false)
            };
            keys.push(cq.add_watched(ours.as_fd(), weak, sticky).expect("add"));
            sources.push(source);
            ends.push((ours, theirs));
        }
        let counts = |sources: &[Arc<Counted>]| sources.iter().map(|s| s.0.load(Ordering::SeqCst)).collect::<Vec<_>>();
        cq.poll(&mut Vec::new(), 1);
        assert_eq!(counts(&sources), vec![1; 20], "each is drained at its first poll");
        ends[3].1.write_all(b"x").expect("write");
        cq.nudge(keys[11]);
        left.store(true, Ordering::SeqCst);
        cq.nudge(keys[7]);
        cq.poll(&mut Vec::new(), 1);
        cq.poll(&mut Vec::new(), 1);
        let mut want = vec![1; 20];
        // 3 is readable at both polls (nobody reads it); 11 was nudged once; 7 still has
        // something after each drain.
        (want[3], want[11], want[7]) = (3, 2, 3);
        assert_eq!(counts(&sources), want);
        left.store(false, Ordering::SeqCst);
        cq.poll(&mut Vec::new(), 1);
        want[3] += 1;
        want[7] += 1;
        assert_eq!(counts(&sources), want, "7 had nothing left after its last drain");
        cq.poll(&mut Vec::new(), 1);
        want[3] += 1;
        assert_eq!(counts(&sources), want);
    }
}
