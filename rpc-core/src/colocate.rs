//! Whether a connection's peer is driven by this very thread.
//!
//! A client and a server in one process on one current-thread runtime (a test, a doc example,
//! a small tool) take turns on one thread. While one side spins for the other's message, the
//! other cannot run at all: each spinning round (256 polls of a call, 64 of a connection,
//! every poll a system call on `tcp`) only delays the answer it waits for. So the handshake
//! pairs the two sides of a connection made within one process (a random token per process in
//! the hello's tail, and a key per side), each side notes which thread drove it last, and a
//! side whose peer was last driven by the thread it runs on waits without spinning
//! ([`crate::CompletionMode::Adaptive`]). Connections between processes carry the tail too and
//! stay unpaired: their tokens differ. A peer that learnt this process's token (a client's
//! server sees it) and sent it back with some key could at most pair this side with another
//! side of this process: that changes whether this side spins, nothing else.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, Weak};

/// Bytes a side adds after its hello: the process token, then the key of its cell.
pub(crate) const TAIL: usize = 16;

/// The cells of this process's sides that a peer in this process may still look up, by key.
static OFFERED: LazyLock<Mutex<HashMap<u64, Weak<AtomicU64>>>> = LazyLock::new(Mutex::default);
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's number: never 0, which says "not driven yet".
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

fn thread() -> u64 {
    THREAD.with(|t| *t)
}

/// This process's token: random, so that no other process sends the same.
fn token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut b = [0u8; 8];
        // Without randomness the pid still tells processes apart on one host, and a peer on
        // another host cannot find the key anyway.
        if getrandom::fill(&mut b).is_err() {
            b = u64::from(std::process::id()).to_le_bytes();
        }
        u64::from_le_bytes(b) | 1
    })
}

/// One side of a connection: the cell it notes its thread in, and its peer's when the peer is
/// in this process.
#[derive(Debug, Default)]
pub(crate) struct Link {
    own: Arc<AtomicU64>,
    peer: Option<Arc<AtomicU64>>,
    /// The key `own` is offered under, until the peer has taken it.
    key: Option<u64>,
}

impl Link {
    /// Offers this side's cell to a peer in this process under a fresh key: the tail to send
    /// after the hello. The peer takes the offer when it pairs; else it goes with `withdraw` or
    /// with this side.
    pub(crate) fn offer(&mut self) -> [u8; TAIL] {
        self.withdraw();
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = OFFERED.lock() {
            // Offers of sides that ended before their peer looked.
            map.retain(|_, w| w.strong_count() > 0);
            map.insert(key, Arc::downgrade(&self.own));
            self.key = Some(key);
        }
        let mut tail = [0u8; TAIL];
        tail[..8].copy_from_slice(&token().to_le_bytes());
        tail[8..].copy_from_slice(&key.to_le_bytes());
        tail
    }

    /// Pairs with the peer whose hello ended in `tail` (the bytes after its hello, if any) and
    /// takes its offer: only a peer of this process is found. True when paired.
    pub(crate) fn pair(&mut self, tail: Option<&[u8]>) -> bool {
        let Some(t) = tail.and_then(|t| t.get(..TAIL)) else {
            return false;
        };
        let word = |r: std::ops::Range<usize>| {
            t.get(r)
                .and_then(|w| <[u8; 8]>::try_from(w).ok())
                .map(u64::from_le_bytes)
        };
        if word(0..8) != Some(token()) {
            return false;
        }
        let Some(key) = word(8..16) else {
            return false;
        };
        if let Ok(mut map) = OFFERED.lock() {
            self.peer = map.remove(&key).and_then(|w| w.upgrade());
        }
        self.peer.is_some()
    }

    /// The handshake is over: the peer has looked this side up (or never will).
    pub(crate) fn withdraw(&mut self) {
        if let (Some(key), Ok(mut map)) = (self.key.take(), OFFERED.lock()) {
            map.remove(&key);
        }
    }

    /// Notes that this thread drives this side now (nothing when the peer is elsewhere).
    /// Written only when it changes: the peer reads the cell whenever it is about to spin, and
    /// a write each turn would take the line from its cache every time.
    #[inline]
    pub(crate) fn driven_here(&self) {
        if self.peer.is_some() {
            let t = thread();
            if self.own.load(Ordering::Relaxed) != t {
                self.own.store(t, Ordering::Relaxed);
            }
        }
    }

    /// Whether the peer was last driven by this thread: then it cannot run while this side
    /// spins.
    #[inline]
    pub(crate) fn peer_here(&self) -> bool {
        self.peer
            .as_ref()
            .is_some_and(|p| p.load(Ordering::Relaxed) == thread())
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.withdraw();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_in_one_process_pair_and_see_each_others_thread() {
        let (mut client, mut server) = (Link::default(), Link::default());
        let client_tail = client.offer();
        assert!(server.pair(Some(&client_tail)));
        let server_tail = server.offer();
        assert!(client.pair(Some(&server_tail)));
        client.withdraw();
        assert!(!client.peer_here() && !server.peer_here(), "neither side driven yet");
        server.driven_here();
        assert!(client.peer_here(), "the server was driven by this thread");
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(!client.peer_here(), "not by that one");
                client.driven_here();
            });
        });
        assert!(!server.peer_here(), "the client was last driven by another thread");
        client.driven_here();
        assert!(server.peer_here());
    }

    #[test]
    fn an_offer_is_taken_once() {
        let mut theirs = Link::default();
        let tail = theirs.offer();
        let (mut a, mut b) = (Link::default(), Link::default());
        assert!(a.pair(Some(&tail)));
        assert!(!b.pair(Some(&tail)), "taken by the first");
    }

    #[test]
    fn a_peer_of_another_process_or_no_tail_stays_unpaired() {
        let mut theirs = Link::default();
        let mut tail = theirs.offer();
        let mut mine = Link::default();
        assert!(!mine.pair(Some(&tail[..TAIL - 1])), "short");
        assert!(!mine.pair(None), "an earlier peer: no tail");
        tail[0] ^= 0x80;
        assert!(!mine.pair(Some(&tail)), "another process's token");
        mine.driven_here();
        assert!(mine.peer.is_none() && !mine.peer_here());
    }

    #[test]
    fn a_withdrawn_or_dropped_side_is_not_found() {
        let mut gone = Link::default();
        let tail = gone.offer();
        gone.withdraw();
        assert!(!Link::default().pair(Some(&tail)), "withdrawn");
        let mut dropped = Link::default();
        let tail = dropped.offer();
        drop(dropped);
        assert!(!Link::default().pair(Some(&tail)), "dropped");
    }
}
