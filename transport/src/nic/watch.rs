//! A CQ waiter that watches its QPs' sockets itself, so that what arrives wakes the waiting task
//! directly.
//!
//! Without it, a task that sleeps on a tcp CQ waits for its doorbell, which the QP's reader
//! thread rings after it woke on the socket, read the frame and made the completion: two
//! sleeping threads woken one after the other per message (the reader, then the task). With
//! the CQ's socket set registered with the task's runtime, the same arrival wakes both at once,
//! and the task's next poll reads the socket itself when the reader thread has not taken the
//! frame yet (`engine/progress.rs`: a polling thread reads the link when the reader is free).
//! One wake-up per message instead of two (docs/decisions.md).
//!
//! The reader thread still watches the socket while a CQ is armed, as before: it handles what
//! a poll may not (frames for a registration the application holds, long bodies), and it
//! serves one-sided requests whatever the task does.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::event::epoll;

use crate::nic::bell::Registration;
use crate::{Error, Result};

/// The runtime's view of a CQ's socket set (an epoll descriptor, readable while any of its
/// sockets is).
pub(super) struct Watch {
    /// Registered with the runtime of the first wait.
    fd: Registration,
    /// The last wait ended because a socket was readable, and no poll has returned a
    /// completion since. The next wait then sleeps on the doorbell alone: what arrived is part
    /// of a longer message, or something a poll may not take (the reader thread's to handle,
    /// which it does while a CQ is armed, and rings the doorbell), and waking again at each
    /// further arrival would only have the two threads take turns on the socket.
    woke_on_sockets: AtomicBool,
}

impl Watch {
    pub(super) fn new() -> Self {
        Self {
            fd: Registration::default(),
            woke_on_sockets: AtomicBool::new(false),
        }
    }

    /// Whether the next wait watches the sockets (not the doorbell alone).
    pub(super) fn will_watch(&self) -> bool {
        !self.woke_on_sockets.load(Ordering::Relaxed)
    }

    /// A poll returned completions: the next wait watches the sockets again.
    pub(super) fn polled_some(&self) {
        // A load first: the store only after a wake-up by the sockets.
        if self.woke_on_sockets.load(Ordering::Relaxed) {
            self.woke_on_sockets.store(false, Ordering::Relaxed);
        }
    }

    /// Waits until the doorbell rings or one of the sockets in `set` has something to read
    /// (or spuriously): the caller polls the CQ next.
    pub(super) async fn wait(&self, set: &Arc<OwnedFd>, bell: &crate::nic::bell::Bell) -> Result<()> {
        let fd = self.fd.get(set, "registering a CQ's socket set with tokio")?;
        if self.woke_on_sockets.swap(false, Ordering::Relaxed) {
            return bell.wait().await;
        }
        let sockets = async {
            loop {
                let mut ready = fd
                    .readable()
                    .await
                    .map_err(|e| Error::io("waiting on a CQ's sockets", e))?;
                // tokio's readiness is edge-triggered: cleared only when the set has nothing,
                // so that a later arrival wakes this task again.
                match ready.try_io(|fd| {
                    if readable(fd.get_ref().as_fd()) {
                        Ok(())
                    } else {
                        Err(std::io::ErrorKind::WouldBlock.into())
                    }
                }) {
                    Ok(r) => return r.map_err(|e| Error::io("looking at a CQ's sockets", e)),
                    Err(_would_block) => continue,
                }
            }
        };
        tokio::select! {
            // The doorbell first: a ring means a completion is there.
            biased;
            r = bell.wait() => r,
            r = sockets => {
                self.woke_on_sockets.store(true, Ordering::Relaxed);
                r
            }
        }
    }
}

/// Whether a socket of the epoll set `set` has something to read now (level-triggered: looking
/// takes nothing). An error counts as readable: the caller's poll finds out.
fn readable(set: BorrowedFd<'_>) -> bool {
    let mut one = [MaybeUninit::<epoll::Event>::uninit(); 1];
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    !matches!(epoll::wait(set, &mut one[..], Some(&zero)), Ok((events, _)) if events.is_empty())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;
    use crate::nic::bell::Bell;

    /// An epoll set holding the reading end of a socket pair, as a CQ's set holds its QPs'.
    fn set_with_socket() -> (Arc<OwnedFd>, UnixStream, UnixStream) {
        let set = Arc::new(epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll set"));
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        epoll::add(&set, ours.as_fd(), epoll::EventData::new_u64(0), epoll::EventFlags::IN).expect("add");
        (set, ours, theirs)
    }

    /// Whether `wait` is still waiting after a while: it returns only on a ring or an arrival.
    async fn still_waiting(w: &Watch, set: &Arc<OwnedFd>, bell: &Bell) -> bool {
        tokio::time::timeout(Duration::from_millis(100), w.wait(set, bell))
            .await
            .is_err()
    }

    async fn returns(w: &Watch, set: &Arc<OwnedFd>, bell: &Bell) {
        tokio::time::timeout(Duration::from_secs(10), w.wait(set, bell))
            .await
            .expect("the wait returned")
            .expect("no error");
    }

    #[tokio::test]
    async fn an_arrival_wakes_the_waiter_without_the_bell() {
        let (set, mut ours, mut theirs) = set_with_socket();
        let (w, bell) = (Watch::new(), Bell::new().expect("bell"));
        assert!(still_waiting(&w, &set, &bell).await, "nothing came, nothing rang");
        theirs.write_all(b"x").expect("write");
        returns(&w, &set, &bell).await;
        // The poll after it takes the byte and returns a completion: the next wait watches
        // the socket again.
        let mut b = [0u8; 1];
        ours.read_exact(&mut b).expect("read");
        w.polled_some();
        assert!(still_waiting(&w, &set, &bell).await, "the byte was taken");
        theirs.write_all(b"y").expect("write");
        returns(&w, &set, &bell).await;
    }

    #[tokio::test]
    async fn what_a_poll_left_unread_does_not_wake_the_next_wait() {
        let (set, _ours, mut theirs) = set_with_socket();
        let (w, bell) = (Watch::new(), Bell::new().expect("bell"));
        theirs.write_all(b"x").expect("write");
        returns(&w, &set, &bell).await;
        // Nobody read the byte (the reader thread's to handle): no wait-return loop on it.
        assert!(
            still_waiting(&w, &set, &bell).await,
            "woke again on what was there before"
        );
        bell.ring();
        returns(&w, &set, &bell).await;
    }

    #[tokio::test]
    async fn after_a_wake_up_that_completed_nothing_further_parts_do_not_wake_the_waiter() {
        let (set, mut ours, mut theirs) = set_with_socket();
        let (w, bell) = (Watch::new(), Bell::new().expect("bell"));
        theirs.write_all(b"x").expect("write");
        returns(&w, &set, &bell).await;
        // A poll read it but completed nothing (the first part of a long message): the rest
        // is the reader thread's, whose doorbell wakes the waiter.
        let mut b = [0u8; 1];
        ours.read_exact(&mut b).expect("read");
        theirs.write_all(b"y").expect("write");
        assert!(still_waiting(&w, &set, &bell).await, "woke on a further part");
        bell.ring();
        returns(&w, &set, &bell).await;
    }

    #[tokio::test]
    async fn the_bell_wakes_the_waiter_as_before() {
        let (set, _ours, _theirs) = set_with_socket();
        let (w, bell) = (Watch::new(), Bell::new().expect("bell"));
        bell.ring();
        returns(&w, &set, &bell).await;
        assert!(still_waiting(&w, &set, &bell).await, "one ring, one return");
    }
}
