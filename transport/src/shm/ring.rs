//! A one-way byte ring in shared memory: one producer process, one consumer process. It carries
//! the frames of a queue pair (the tcp provider's wire format) in place of a socket.
//!
//! The consumer owns the memory (a sealed memfd) and sends it to the producer. Both sides read
//! words the other writes, so every word read from the ring is checked: a peer that writes
//! garbage can make the ring report a protocol error, never make us read out of bounds.

use std::sync::Arc;
#[cfg(any(test, rdma_loom))]
use std::time::Duration;

// The model-checking build (`--cfg rdma_loom`): loom's atomics, built in place (`init`).
#[cfg(rdma_loom)]
use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(rdma_loom))]
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::sys::{self, Mapping};

/// Data bytes of a ring (a power of two).
pub(crate) const CAP: usize = 1 << 20;
/// Header bytes before the data.
const HEADER: usize = 4096;
/// The memfd's size.
pub(crate) const BYTES: usize = HEADER + CAP;
/// How long a sleeper waits before it looks at the peer's liveness again.
#[cfg(any(test, rdma_loom))]
const NAP: Duration = Duration::from_millis(50);
/// Busy polls before sleeping (none in the models: loom explores the sleeping path).
#[cfg(any(test, rdma_loom))]
const SPINS: u32 = if cfg!(rdma_loom) { 0 } else { 2000 };

/// The header, at the start of the memfd. Each counter has its own cache line.
#[repr(C, align(64))]
struct Header {
    /// Bytes consumed (written by the consumer).
    head: AtomicU64,
    _p0: [u8; 56],
    /// Bytes produced (written by the producer).
    tail: AtomicU64,
    _p1: [u8; 56],
    /// Bumped by the producer when it publishes and the consumer sleeps (futex word).
    data_seq: AtomicU32,
    consumer_sleeping: AtomicU32,
    _p2: [u8; 56],
    /// Bumped by the consumer when it frees space and the producer sleeps (futex word).
    space_seq: AtomicU32,
    producer_sleeping: AtomicU32,
    _p3: [u8; 56],
    /// Set by the producer: no more bytes will come (EOF once drained).
    closed: AtomicU32,
    /// Set by the consumer: it is gone; producing is pointless.
    gone: AtomicU32,
    _p4: [u8; 56],
    /// The consumer's heartbeat: its process bumps it every [`BEAT`](super::link::BEAT) while
    /// it runs, whatever its application does; a producer that sees it stand still for
    /// [`KEEPALIVE`](super::link::KEEPALIVE) takes the consumer to be dead (stopped, hung).
    beat: AtomicU64,
}

#[cfg(not(rdma_loom))]
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

/// Builds loom's atomics in a fresh (zeroed) ring's header; the standard ones need nothing, as
/// zero bytes are a valid atomic.
#[cfg(rdma_loom)]
pub(crate) fn init(map: &Mapping) {
    let zero = || AtomicU32::new(0);
    // SAFETY: a fresh mapping of at least BYTES, page aligned, that nothing refers to yet.
    unsafe {
        map.ptr().cast::<Header>().write(Header {
            head: AtomicU64::new(0),
            _p0: [0; 56],
            tail: AtomicU64::new(0),
            _p1: [0; 56],
            data_seq: zero(),
            consumer_sleeping: zero(),
            _p2: [0; 56],
            space_seq: zero(),
            producer_sleeping: zero(),
            _p3: [0; 56],
            closed: zero(),
            gone: zero(),
            _p4: [0; 56],
            beat: AtomicU64::new(0),
        })
    };
}

/// Sleeps while `word` is `seen`, for at most `timeout`.
#[cfg(all(test, not(rdma_loom)))]
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    sys::futex_wait(word, seen, timeout);
}

/// Wakes the sleepers on `word`.
#[cfg(not(rdma_loom))]
fn futex_wake(word: &AtomicU32) {
    sys::futex_wake(word);
}

/// In the models a sleep has no timeout: a waiter nobody wakes never returns, and loom reports
/// the model as stuck. (The real sleep ends after [`NAP`], which bounds a lost wake-up to a
/// stall; the models allow none.)
#[cfg(rdma_loom)]
fn futex_wait(word: &AtomicU32, seen: u32, _timeout: Duration) {
    while word.load(Ordering::Acquire) == seen {
        loom::thread::yield_now();
    }
}

#[cfg(rdma_loom)]
fn futex_wake(_word: &AtomicU32) {}

/// One end of a ring.
pub(crate) struct Ring {
    map: Arc<Mapping>,
    /// Set locally when the peer process is known dead (its socket closed): wakes and ends
    /// every wait even though the peer never set `closed`.
    peer_dead: Arc<std::sync::atomic::AtomicBool>,
    /// The peer's doorbell (a message on the connection's socket, which its progress engine
    /// watches), rung instead of the futex when the peer said it sleeps
    /// ([`arm_read`](Ring::arm_read), [`arm_write`](Ring::arm_write)).
    peer_wake: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// Why a ring operation ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RingError {
    /// The other side closed (or died): no more bytes.
    Closed,
    /// The shared counters make no sense: the peer broke the ring.
    Corrupt,
}

impl Ring {
    pub(crate) fn new(map: Arc<Mapping>, peer_dead: Arc<std::sync::atomic::AtomicBool>) -> Option<Ring> {
        (map.len() >= BYTES).then_some(Ring {
            map,
            peer_dead,
            peer_wake: None,
        })
    }

    /// Wakes the peer through its doorbell rather than the futex: its progress engine waits on
    /// the doorbell, never on the futex.
    #[cfg_attr(rdma_loom, allow(dead_code))]
    pub(crate) fn with_peer_wake(mut self, wake: Arc<dyn Fn() + Send + Sync>) -> Ring {
        self.peer_wake = Some(wake);
        self
    }

    /// Wakes the peer's sleeper on `word` (just bumped).
    fn wake_peer(&self, word: &AtomicU32) {
        match &self.peer_wake {
            #[cfg(not(rdma_loom))]
            Some(wake) => wake(),
            _ => futex_wake(word),
        }
    }

    /// Consumer, about to wait for bytes without blocking: has the producer ring the doorbell
    /// when it writes. True when bytes (or the end) are there already.
    pub(crate) fn arm_read(&self) -> bool {
        let h = self.header();
        h.consumer_sleeping.store(1, Ordering::Relaxed);
        // Pairs with the fence in `try_write`, as in `wait`.
        fence(Ordering::SeqCst);
        let ready = !matches!(self.used(), Ok((_, 0))) || h.closed.load(Ordering::Acquire) != 0 || self.dead();
        if ready {
            h.consumer_sleeping.store(0, Ordering::Relaxed);
        }
        ready
    }

    /// Consumer: whether bytes wait (a corrupt ring says yes: the read that follows finds it).
    pub(crate) fn has_bytes(&self) -> bool {
        !matches!(self.used(), Ok((_, 0)))
    }

    /// Producer, about to wait for room without blocking: has the consumer ring the doorbell
    /// when it frees some. True when there is room (or the end) already.
    pub(crate) fn arm_write(&self) -> bool {
        let h = self.header();
        h.producer_sleeping.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let ready =
            !matches!(self.used(), Ok((_, u)) if u >= CAP as u64) || h.gone.load(Ordering::Acquire) != 0 || self.dead();
        if ready {
            h.producer_sleeping.store(0, Ordering::Relaxed);
        }
        ready
    }

    /// Consumer: no longer waiting for bytes.
    pub(crate) fn disarm_read(&self) {
        self.header().consumer_sleeping.store(0, Ordering::Relaxed);
    }

    /// Producer: no longer waiting for room.
    pub(crate) fn disarm_write(&self) {
        self.header().producer_sleeping.store(0, Ordering::Relaxed);
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least BYTES long and page aligned; Header is all atomics,
        // valid for any bit pattern, and only ever accessed atomically.
        unsafe { &*self.map.ptr().cast::<Header>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: HEADER < BYTES <= mapping length.
        unsafe { self.map.ptr().add(HEADER) }
    }

    fn dead(&self) -> bool {
        self.peer_dead.load(Ordering::Acquire)
    }

    /// Wakes our own sleepers (after `peer_dead` was set).
    pub(crate) fn wake_all(&self) {
        let h = self.header();
        h.data_seq.fetch_add(1, Ordering::AcqRel);
        futex_wake(&h.data_seq);
        h.space_seq.fetch_add(1, Ordering::AcqRel);
        futex_wake(&h.space_seq);
    }

    /// Producer: no more bytes.
    pub(crate) fn close(&self) {
        let h = self.header();
        h.closed.store(1, Ordering::Release);
        h.data_seq.fetch_add(1, Ordering::AcqRel);
        self.wake_peer(&h.data_seq);
    }

    /// Consumer: this process is alive (its heartbeat, for the producer).
    pub(crate) fn beat(&self) {
        self.header().beat.fetch_add(1, Ordering::Release);
    }

    /// Producer: the consumer's heartbeat as it stands.
    pub(crate) fn peer_beat(&self) -> u64 {
        self.header().beat.load(Ordering::Acquire)
    }

    /// Consumer: gone.
    pub(crate) fn abandon(&self) {
        let h = self.header();
        h.gone.store(1, Ordering::Release);
        h.space_seq.fetch_add(1, Ordering::AcqRel);
        self.wake_peer(&h.space_seq);
    }

    /// Bytes in the ring, checked.
    fn used(&self) -> Result<(u64, u64), RingError> {
        let h = self.header();
        let head = h.head.load(Ordering::Acquire);
        let tail = h.tail.load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > CAP as u64 {
            return Err(RingError::Corrupt);
        }
        Ok((head, used))
    }

    /// Producer: writes as much of `bytes` as fits now; returns how much.
    pub(crate) fn try_write(&self, bytes: &[u8]) -> Result<usize, RingError> {
        self.try_write2(bytes, &[])
    }

    /// Producer: writes as much of `a`, then of `b`, as fits now, as one write: the consumer
    /// sees both parts at once and is woken once (a frame's head and its payload, written
    /// apart, rang the peer's doorbell twice). Returns how much of both it took.
    pub(crate) fn try_write2(&self, a: &[u8], b: &[u8]) -> Result<usize, RingError> {
        let h = self.header();
        if h.gone.load(Ordering::Acquire) != 0 || self.dead() {
            return Err(RingError::Closed);
        }
        let (head, used) = self.used()?;
        let room = CAP - used as usize;
        let tail = head.wrapping_add(used);
        let n_a = a.len().min(room);
        let n_b = if n_a == a.len() { b.len().min(room - n_a) } else { 0 };
        if n_a + n_b == 0 {
            return Ok(0);
        }
        self.copy_in(tail, &a[..n_a]);
        self.copy_in(tail.wrapping_add(n_a as u64), &b[..n_b]);
        h.tail.store(tail.wrapping_add((n_a + n_b) as u64), Ordering::Release);
        // Pairs with the fence in `wait`: either the consumer, about to sleep, sees these
        // bytes, or this sees it sleeping and wakes it.
        fence(Ordering::SeqCst);
        if h.consumer_sleeping.load(Ordering::Relaxed) != 0 {
            h.data_seq.fetch_add(1, Ordering::AcqRel);
            self.wake_peer(&h.data_seq);
        }
        Ok(n_a + n_b)
    }

    /// Producer: copies `bytes` to the data area from stream position `at`, wrapping around its
    /// end; `tail` is not moved. The caller passes positions at or past `tail` and at most the
    /// room left (so at most `CAP` bytes), which the consumer does not read until `tail` moves
    /// past them. A longer slice copies nothing (no caller passes one).
    fn copy_in(&self, at: u64, bytes: &[u8]) {
        let n = bytes.len();
        if n > CAP {
            return;
        }
        let at = (at % CAP as u64) as usize;
        let first = n.min(CAP - at);
        // SAFETY: `at + first <= CAP` and `n - first <= CAP` (n <= CAP): both copies stay inside the data area.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().add(at), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.data(), n - first);
        }
    }

    /// Producer: writes all of `bytes`, waiting for space (the tests' writer; the engine never
    /// waits inside a write).
    #[cfg(any(test, rdma_loom))]
    pub(crate) fn write_all(&self, mut bytes: &[u8]) -> Result<(), RingError> {
        while !bytes.is_empty() {
            let n = self.try_write(bytes)?;
            bytes = &bytes[n..];
            if n == 0 {
                self.wait(|r| Ok(r.used()?.1 < CAP as u64), true)?;
            }
        }
        Ok(())
    }

    /// Consumer: fills `buf`, waiting for bytes (the tests' reader; the engine never waits
    /// inside a read).
    #[cfg(test)]
    pub(crate) fn read_exact(&self, buf: &mut [u8]) -> Result<(), RingError> {
        let mut got = 0;
        while got < buf.len() {
            got += self.read_some(&mut buf[got..])?;
        }
        Ok(())
    }

    /// Consumer: takes what is in the ring, up to `buf.len()`, waiting until there is something;
    /// returns how much (at least 1 for a non-empty `buf`).
    #[cfg(test)]
    pub(crate) fn read_some(&self, buf: &mut [u8]) -> Result<usize, RingError> {
        loop {
            let n = self.try_read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            self.wait_data()?;
        }
    }

    /// Consumer: waits until there are bytes to read (or the ring ended).
    #[cfg(any(test, rdma_loom))]
    pub(crate) fn wait_data(&self) -> Result<(), RingError> {
        self.wait(|r| Ok(r.used()?.1 > 0), false)
    }

    /// Consumer: takes what is in the ring now, up to `buf.len()`; 0 when it is empty.
    pub(crate) fn try_read(&self, buf: &mut [u8]) -> Result<usize, RingError> {
        let h = self.header();
        let (head, used) = self.used()?;
        if used == 0 {
            if h.closed.load(Ordering::Acquire) != 0 || self.dead() {
                return Err(RingError::Closed);
            }
            return Ok(0);
        }
        let n = (used as usize).min(buf.len());
        let at = (head % CAP as u64) as usize;
        let first = n.min(CAP - at);
        // SAFETY: the bytes `[head, head + n)` were published by the producer (tail moved
        // past them with Release, read with Acquire) and stay until `head` moves; both
        // copies are inside the data area and inside `buf`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(), buf.as_mut_ptr().add(first), n - first);
        }
        h.head.store(head.wrapping_add(n as u64), Ordering::Release);
        // As in `try_write`, for the producer waiting for space.
        fence(Ordering::SeqCst);
        if h.producer_sleeping.load(Ordering::Relaxed) != 0 {
            h.space_seq.fetch_add(1, Ordering::AcqRel);
            self.wake_peer(&h.space_seq);
        }
        Ok(n)
    }

    /// Spins, then sleeps on the futex until `ready` or an end (the tests' and models' waits;
    /// the progress engine arms instead: `arm_read`, `arm_write`).
    #[cfg(any(test, rdma_loom))]
    fn wait(&self, ready: impl Fn(&Ring) -> Result<bool, RingError>, producer: bool) -> Result<(), RingError> {
        let h = self.header();
        for _ in 0..SPINS {
            if ready(self)? {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let (word, flag) = if producer {
            (&h.space_seq, &h.producer_sleeping)
        } else {
            (&h.data_seq, &h.consumer_sleeping)
        };
        loop {
            let seen = word.load(Ordering::Acquire);
            flag.store(1, Ordering::Relaxed);
            // Pairs with the fences after `tail` and `head` move: either the other side sees
            // the flag and bumps `word`, or `ready` sees what it published.
            fence(Ordering::SeqCst);
            if ready(self)? {
                flag.store(0, Ordering::SeqCst);
                return Ok(());
            }
            let ended = if producer {
                h.gone.load(Ordering::Acquire) != 0
            } else {
                h.closed.load(Ordering::Acquire) != 0
            };
            if ended || self.dead() {
                flag.store(0, Ordering::SeqCst);
                return Err(RingError::Closed);
            }
            futex_wait(word, seen, NAP);
            flag.store(0, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn ring() -> (Ring, Ring) {
        let fd = sys::sealed_memfd("test-ring", BYTES as u64).expect("memfd");
        let m = Arc::new(Mapping::map(&fd, BYTES).expect("map"));
        let dead = Arc::new(AtomicBool::new(false));
        let a = Ring::new(m.clone(), dead.clone()).expect("ring");
        let b = Ring::new(m, dead).expect("ring");
        (a, b)
    }

    #[test]
    fn bytes_cross_the_wrap_in_order() {
        let (tx, rx) = ring();
        let chunk: Vec<u8> = (0..CAP / 3 + 7).map(|i| i as u8).collect();
        for _ in 0..10 {
            tx.write_all(&chunk).expect("write");
            let mut back = vec![0u8; chunk.len()];
            rx.read_exact(&mut back).expect("read");
            assert_eq!(back, chunk);
        }
    }

    /// A frame's head and payload written together ring a sleeping consumer once, arrive
    /// whole and in order across the wrap, and a part that does not fit is cut where the room
    /// ends (the payload only once the head went whole).
    #[test]
    fn two_parts_go_as_one_write_with_one_wake() {
        let (tx, rx) = ring();
        let rings = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tx = tx.with_peer_wake({
            let rings = rings.clone();
            Arc::new(move || {
                rings.fetch_add(1, Ordering::SeqCst);
            })
        });
        // Near the end of the data area, so that the parts wrap.
        let pad = vec![0u8; CAP - 10];
        tx.write_all(&pad).expect("write");
        rx.read_exact(&mut vec![0u8; pad.len()]).expect("read");
        let (head, payload): (Vec<u8>, Vec<u8>) = ((0..16).collect(), (100..140).collect());
        for round in 1..=3 {
            assert!(!rx.arm_read(), "nothing waits yet");
            assert_eq!(tx.try_write2(&head, &payload), Ok(56));
            assert_eq!(rings.load(Ordering::SeqCst), round, "one wake for both parts");
            rx.disarm_read();
            let mut back = vec![0u8; 56];
            rx.read_exact(&mut back).expect("read");
            assert_eq!(back, [head.clone(), payload.clone()].concat());
        }
        // Room for the head and part of the payload: the write stops where the room ends.
        tx.write_all(&vec![1u8; CAP - 20]).expect("write");
        assert_eq!(tx.try_write2(&head, &payload), Ok(20));
        // No room for all of the head: nothing of the payload goes.
        let (tx2, rx2) = ring();
        tx2.write_all(&vec![1u8; CAP - 8]).expect("write");
        assert_eq!(tx2.try_write2(&head, &payload), Ok(8));
        rx2.read_exact(&mut vec![0u8; CAP - 8]).expect("read");
        let mut back = [0u8; 8];
        rx2.read_exact(&mut back).expect("read");
        assert_eq!(back[..], head[..8]);
        drop(rx);
    }

    #[test]
    fn garbage_counters_are_an_error_not_a_wild_access() {
        let (tx, rx) = ring();
        // A peer writes nonsense into the shared header.
        rx.header().tail.store(u64::MAX - 3, Ordering::Release);
        rx.header().head.store(17, Ordering::Release);
        let mut buf = [0u8; 64];
        assert_eq!(rx.read_exact(&mut buf), Err(RingError::Corrupt));
        assert_eq!(tx.try_write(&buf), Err(RingError::Corrupt));
        // Counters that look sane but point anywhere stay inside the data area (modulo CAP).
        rx.header().head.store(u64::MAX - 10, Ordering::Release);
        rx.header()
            .tail
            .store((u64::MAX - 10).wrapping_add(64), Ordering::Release);
        rx.read_exact(&mut buf)
            .expect("64 bytes of whatever, from inside the ring");
    }

    #[test]
    fn a_closed_or_dead_peer_ends_the_wait() {
        let (tx, rx) = ring();
        tx.close();
        let mut buf = [0u8; 1];
        assert_eq!(rx.read_exact(&mut buf), Err(RingError::Closed));
        let (tx2, rx2) = ring();
        let dead = rx2.peer_dead.clone();
        let t = std::thread::spawn(move || {
            let mut b = [0u8; 1];
            rx2.read_exact(&mut b)
        });
        std::thread::sleep(Duration::from_millis(20));
        dead.store(true, Ordering::Release);
        tx2.wake_all();
        assert_eq!(t.join().expect("reader"), Err(RingError::Closed));
    }
}

/// Models of the ring's synchronisation under loom (see `rq`'s): `RUSTFLAGS="--cfg rdma_loom"
/// cargo test -p rdma-rpc-transport --release --lib shm::ring::models`.
#[cfg(all(test, rdma_loom))]
mod models {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A fresh ring's producer and consumer ends, in a memfd, with loom's atomics built in it.
    fn rings() -> (Ring, Ring) {
        let fd = sys::sealed_memfd("model-ring", BYTES as u64).expect("memfd");
        let m = Arc::new(Mapping::map(&fd, BYTES).expect("map"));
        init(&m);
        let dead = Arc::new(AtomicBool::new(false));
        (
            Ring::new(m.clone(), dead.clone()).expect("ring"),
            Ring::new(m, dead).expect("ring"),
        )
    }

    /// A producer writes while the consumer goes to sleep for want of bytes, and the other
    /// way round: every byte arrives, in order, and no side sleeps with nobody left to wake it.
    #[test]
    fn no_side_sleeps_through_the_others_progress() {
        loom::model(|| {
            let (tx, rx) = rings();
            let producer = loom::thread::spawn(move || {
                for b in [1u8, 2] {
                    tx.write_all(&[b]).expect("write");
                }
            });
            let mut got = Vec::new();
            while got.len() < 2 {
                let mut buf = [0u8; 2];
                rx.wait_data().expect("bytes or an end");
                let n = rx.try_read(&mut buf).expect("read");
                got.extend_from_slice(&buf[..n]);
            }
            producer.join().expect("the producer");
            assert_eq!(got, [1, 2]);
        });
    }

    /// The progress engine's way: the consumer disarms, reads, and arms before it waits (here
    /// for the wake-up the producer gives a sleeper: `data_seq` moving, the doorbell's stand-in);
    /// a producer that writes meanwhile either sees it armed and wakes it, or the arming sees
    /// the bytes. Fails if `arm_read` drops its fence.
    #[test]
    fn an_armed_reader_is_woken_or_sees_the_bytes() {
        loom::model(|| {
            let (tx, rx) = rings();
            let producer = loom::thread::spawn(move || {
                for b in [1u8, 2] {
                    while tx.try_write(&[b]).expect("write") == 0 {
                        loom::thread::yield_now();
                    }
                }
            });
            let mut got = Vec::new();
            while got.len() < 2 {
                rx.disarm_read();
                let mut buf = [0u8; 2];
                let n = rx.try_read(&mut buf).expect("read");
                got.extend_from_slice(&buf[..n]);
                if got.len() == 2 {
                    break;
                }
                let seen = rx.header().data_seq.load(Ordering::Acquire);
                if !rx.arm_read() {
                    // Asleep until woken: a lost wake-up leaves loom a model that never ends.
                    while rx.header().data_seq.load(Ordering::Acquire) == seen {
                        loom::thread::yield_now();
                    }
                }
            }
            producer.join().expect("the producer");
            assert_eq!(got, [1, 2]);
        });
    }
}
