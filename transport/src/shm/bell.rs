//! A software CQ's doorbell: an eventfd the CQ's waiter sleeps on inside tokio's IO driver
//! (the CQ of both software providers: tcp's engine threads ring it too).
//!
//! Whoever adds a completion while the CQ is armed rings it: an engine thread of this process,
//! or (shm) the peer process that delivered into one of our receives, which holds a duplicate
//! of the descriptor. One ring wakes the waiting task directly: no thread in between.

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use rustix::event::{eventfd, EventfdFlags};
use rustix::io::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::{Error, Result};

pub(crate) struct Bell {
    fd: OwnedFd,
    /// Registered with the runtime of the first wait.
    waiter: OnceLock<AsyncFd<OwnedFd>>,
}

impl Bell {
    pub(crate) fn new() -> Result<Bell> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
            .map_err(|e| Error::io("creating a CQ doorbell (eventfd)", e.into()))?;
        Ok(Bell {
            fd,
            waiter: OnceLock::new(),
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

    fn waiter(&self) -> Result<&AsyncFd<OwnedFd>> {
        registered(&self.waiter, || self.share(), "registering a CQ doorbell with tokio")
    }

    /// Waits until rung (or spuriously); takes the rings so far.
    pub(crate) async fn wait(&self) -> Result<()> {
        let waiter = self.waiter()?;
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

/// The registration in `slot` for readability with the runtime of the first call, made then
/// from the descriptor `fd` gives (`what` names it in the error): the CQ doorbells, and tcp's
/// socket sets (`tcp/watch.rs`).
pub(crate) fn registered<'a>(
    slot: &'a OnceLock<AsyncFd<OwnedFd>>,
    fd: impl FnOnce() -> Result<OwnedFd>,
    what: &'static str,
) -> Result<&'a AsyncFd<OwnedFd>> {
    if let Some(w) = slot.get() {
        return Ok(w);
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(Error::NoRuntime);
    }
    let fd = fd()?;
    // SAFETY: the AsyncFd owns `fd` from here on: open, the same descriptor while it lives, closed when it drops.
    let registration = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
    let w = registration.map_err(|e| Error::io(what, e.into()))?;
    // Another waiter may have registered first; either registration works.
    Ok(slot.get_or_init(|| w))
}

/// Rings a doorbell through a descriptor (ours, or a peer's duplicate).
pub(crate) fn ring(fd: &OwnedFd) {
    // EAGAIN only when the counter is near overflow: it is rung already. Other errors cannot
    // happen on an eventfd with an 8-byte write.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}
