//! The software NIC's completion queue, shared by the `tcp` and `shm` providers.

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    /// The CQ waits: have the next completion rung for.
    fn arm(&self);
}

/// Nanoseconds on the clock of poll stamps (never 0: 0 stands for "never").
pub(crate) fn now_nanos() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// A software completion queue.
pub(crate) struct Cq {
    sources: Mutex<Vec<Source>>,
    queue: Mutex<VecDeque<RawWc>>,
    /// Completions in `queue`, so that an empty poll takes no lock.
    queued: AtomicUsize,
    armed: AtomicBool,
    bell: crate::nic::bell::Bell,
    bell_id: u64,
    /// When the CQ was last polled ([`now_nanos`]; 0: never): whether an application thread
    /// spins on it, for the engines of its QPs.
    last_poll: AtomicU64,
    /// tcp: the sockets of the QPs attached, so that a poll reads only those with data (one
    /// system call for all of them).
    sockets: Sockets,
}

/// An epoll set of QP sockets, each with the flag its CQ source looks at.
struct Sockets {
    /// Shared with its registration in a waiter's runtime (`watch.rs`).
    epoll: Arc<OwnedFd>,
    flags: Mutex<HashMap<u64, Weak<AtomicBool>>>,
    next: AtomicU64,
    /// Sockets were added: polls ask the set, and a waiter watches it too.
    any: AtomicBool,
    watch: watch::Watch,
}

/// A source and a cheap look at whether it has anything (before waking the source up).
struct Source {
    source: Weak<dyn CqSource>,
    has_some: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Cq {
    pub(crate) fn new(depth: u32) -> crate::Result<Self> {
        Ok(Self {
            sources: Mutex::new(Vec::new()),
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
                flags: Mutex::new(HashMap::new()),
                next: AtomicU64::new(0),
                any: AtomicBool::new(false),
                watch: watch::Watch::new(),
            },
        })
    }

    /// Has polls raise `flag` whenever `socket` has something to read (level-triggered).
    pub(crate) fn add_socket(&self, socket: BorrowedFd<'_>, flag: &Arc<AtomicBool>) -> crate::Result<()> {
        let s = &self.sockets;
        let key = s.next.fetch_add(1, Ordering::Relaxed);
        let mut flags = s.flags.lock();
        flags.retain(|_, f| f.strong_count() > 0);
        epoll::add(&s.epoll, socket, epoll::EventData::new_u64(key), epoll::EventFlags::IN)
            .map_err(|e| crate::Error::io("adding a QP's socket to its CQ's set (epoll)", e.into()))?;
        flags.insert(key, Arc::downgrade(flag));
        s.any.store(true, Ordering::Release);
        Ok(())
    }

    /// When the CQ was last polled ([`now_nanos`]; 0: never).
    pub(crate) fn last_poll(&self) -> u64 {
        self.last_poll.load(Ordering::Relaxed)
    }

    /// Raises the flags of the sockets that have something to read.
    fn mark_readable(&self) {
        let s = &self.sockets;
        // On the stack: this runs on every poll.
        let mut buf = [MaybeUninit::<epoll::Event>::uninit(); 64];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        let Ok((events, _)) = epoll::wait(&s.epoll, &mut buf[..], Some(&zero)) else {
            // Cannot tell: every source looks.
            for f in s.flags.lock().values().filter_map(Weak::upgrade) {
                f.store(true, Ordering::Release);
            }
            return;
        };
        if events.is_empty() {
            return;
        }
        let flags = s.flags.lock();
        for e in events.iter() {
            if let Some(f) = flags.get(&e.data.u64()).and_then(Weak::upgrade) {
                f.store(true, Ordering::Release);
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
        let mut s = self.sources.lock();
        s.retain(|w| w.source.strong_count() > 0);
        // A waiter armed the CQ before this source came: it must be woken by this source's
        // completions too, as a NIC's armed CQ is by any QP's (`ibv_req_notify_cq`). Under the
        // sources' lock, against `arm`: it stores the flag, then arms what is listed.
        if self.armed.load(Ordering::SeqCst) {
            if let Some(src) = source.upgrade() {
                src.arm();
            }
        }
        s.push(Source { source, has_some });
    }

    pub(crate) fn poll(&self, out: &mut Vec<RawWc>, max: usize) -> usize {
        if self.sockets.any.load(Ordering::Acquire) {
            // tcp QPs attached: they learn that this CQ is polled, and which of them to read.
            self.last_poll.store(now_nanos(), Ordering::Relaxed);
            self.mark_readable();
        }
        // Lock order: sources, then a source's engine state, then the queue (as push takes it).
        let mut sources = self.sources.lock();
        let mut gone = false;
        for s in sources.iter() {
            if (s.has_some)() {
                match s.source.upgrade() {
                    Some(src) => src.drain(),
                    None => gone = true,
                }
            }
        }
        if gone {
            // The QP was destroyed: drop its queue (and the mapping the look holds).
            sources.retain(|s| s.source.strong_count() > 0);
        }
        drop(sources);
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
            s.arm();
        }
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

    #[tokio::test]
    async fn a_waiter_on_a_cq_with_sockets_wakes_when_one_has_something_to_read() {
        let cq = Cq::new(16).expect("cq");
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let flag = Arc::new(AtomicBool::new(false));
        cq.add_socket(ours.as_fd(), &flag).expect("add");
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
        assert!(flag.load(Ordering::Acquire), "the poll marks the socket readable");
    }
}
