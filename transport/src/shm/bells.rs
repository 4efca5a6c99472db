//! The CQ doorbells of peer processes, one descriptor each however many connections name it:
//! a peer's QPs that share a CQ send its doorbell with every connection, and a server with
//! thousands of clients would otherwise hold a descriptor per connection for what is one
//! eventfd per client CQ.
//!
//! Keyed by the peer's process id (the kernel's word, from the socket) and the id the peer gave
//! its doorbell: a peer that lies about an id can only have its own doorbells rung, never
//! another process's.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Doorbells by (process id, doorbell id).
type Table = HashMap<(i32, u64), Weak<OwnedFd>>;

static BELLS: OnceLock<Mutex<Table>> = OnceLock::new();

/// The doorbell `id` of process `pid`: the one held already, else `fd` (kept from now on).
pub(crate) fn shared(pid: i32, id: u64, fd: OwnedFd) -> Arc<OwnedFd> {
    let mut bells = BELLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(held) = bells.get(&(pid, id)).and_then(Weak::upgrade) {
        return held; // `fd`, a duplicate, closes here
    }
    // Entries whose doorbell every connection let go are dropped as the table doubles.
    if bells.len() >= 64 && bells.len().is_power_of_two() {
        bells.retain(|_, b| b.strong_count() > 0);
    }
    let bell = Arc::new(fd);
    bells.insert((pid, id), Arc::downgrade(&bell));
    bell
}
