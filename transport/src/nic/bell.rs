//! A software CQ's doorbell: an eventfd the CQ's waiter sleeps on inside tokio's IO driver
//! (the CQ of both software providers: tcp's engine threads ring it too).
//!
//! Whoever adds a completion while the CQ is armed rings it: an engine thread of this process,
//! or (shm) the peer process that delivered into one of our receives, which holds a duplicate
//! of the descriptor. One ring wakes the waiting task directly: no thread in between.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use rustix::event::{eventfd, EventfdFlags};
use rustix::io::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::{Error, Result};

pub(crate) struct Bell {
    fd: Arc<OwnedFd>,
    /// Registered with the runtime of the first wait.
    waiter: Registration,
}

impl Bell {
    pub(crate) fn new() -> Result<Bell> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
            .map_err(|e| Error::io("creating a CQ doorbell (eventfd)", e.into()))?;
        Ok(Bell {
            fd: Arc::new(fd),
            waiter: Registration::default(),
        })
    }

    /// A duplicate to hand to a peer process.
    pub(crate) fn share(&self) -> Result<OwnedFd> {
        self.fd
            .try_clone()
            .map_err(|e| Error::io("duplicating a CQ doorbell", e))
    }

    /// Rings (never blocks: the counter saturating would only mean it is rung already).
    pub(crate) fn ring(&self) {
        ring(&self.fd);
    }

    /// Waits until rung (or spuriously); takes the rings so far.
    pub(crate) async fn wait(&self) -> Result<()> {
        let waiter = self.waiter.get(&self.fd, "registering a CQ doorbell with tokio")?;
        let mut guard = waiter
            .readable()
            .await
            .map_err(|e| Error::io("waiting on a CQ doorbell", e))?;
        let mut buf = [0u8; 8];
        match rustix::io::read(waiter.get_ref(), &mut buf) {
            Ok(_) | Err(Errno::AGAIN) => {
                // tokio keeps a ring that came after this read (its readiness tick moved on).
                guard.clear_ready();
                Ok(())
            }
            Err(e) => Err(Error::io("reading a CQ doorbell", e.into())),
        }
    }
}

/// A descriptor shared with tokio's registration of it: open while either holds it, so the
/// registration needs no duplicate (no descriptor more per CQ, and no `EMFILE` at a first wait
/// of a process at its limit of open files).
pub(crate) struct SharedFd(Arc<OwnedFd>);

impl AsRawFd for SharedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl AsFd for SharedFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// A descriptor's registration for readability with the runtime of the first wait: the CQ
/// doorbells, and tcp's socket sets (`tcp/watch.rs`).
#[derive(Default)]
pub(crate) struct Registration {
    slot: OnceLock<AsyncFd<SharedFd>>,
    /// One registration at a time: a descriptor registers with a runtime once.
    making: Mutex<()>,
}

impl Registration {
    /// The registration of `fd` (`what` names it in the error), made at the first call.
    pub(crate) fn get(&self, fd: &Arc<OwnedFd>, what: &'static str) -> Result<&AsyncFd<SharedFd>> {
        if let Some(w) = self.slot.get() {
            return Ok(w);
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoRuntime);
        }
        let _making = self.making.lock();
        if let Some(w) = self.slot.get() {
            return Ok(w);
        }
        let shared = SharedFd(Arc::clone(fd));
        // SAFETY: the AsyncFd owns a reference to the descriptor, which stays open and the same
        // while any reference lives, so for the whole life of the registration.
        let registration = unsafe { AsyncFd::register_with_interest(shared, Interest::READABLE) };
        let w = registration.map_err(|e| Error::io(what, e.into()))?;
        Ok(self.slot.get_or_init(|| w))
    }
}

/// Rings a doorbell through a descriptor (ours, or a peer's duplicate).
pub(crate) fn ring(fd: &OwnedFd) {
    // EAGAIN only when the counter is near overflow: it is rung already. Other errors cannot
    // happen on an eventfd with an 8-byte write.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}
