//! The free lists of a connection's registered buffers: by role (the access a buffer is
//! registered with) and size class, shared by the connection's stash and the application's
//! buffers, which come back to them when dropped.

use rdma_rpc_transport::{AccessFlags, MemoryRegion, ProtectionDomain};

use crate::proto::LANDING_PREFIX;
use crate::Isolation;

/// What a buffer of the free lists is registered for: exactly the access its use needs, so
/// that a peer that kept a key of it can do nothing else with it (write a buffer it was only
/// lent to read, say, once that buffer holds another request's body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Lent for the peer to read; the application's buffers (which it may lend) too.
    Lend,
    /// A landing buffer the peer writes a response into.
    Land,
    /// Read into by this side: never named to the peer.
    Private,
}

impl Role {
    pub(crate) const ALL: [Role; 3] = [Role::Lend, Role::Land, Role::Private];

    pub(crate) fn access(self) -> AccessFlags {
        match self {
            Role::Lend => AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_READ),
            Role::Land => AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_WRITE),
            Role::Private => AccessFlags::LOCAL_WRITE,
        }
    }

    /// The role a registration with `access` serves, if any.
    pub(crate) fn of(access: AccessFlags) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.access() == access)
    }
}

/// Free buffers by role and size class: `lists[role][i]` holds buffers of
/// `(MIN_CLASS << i) + SLACK` bytes; and the protection domain new ones are registered with
/// (here, so that [`Buffers`] is one `Arc`).
pub(crate) struct Free {
    pub(crate) lists: [Vec<Vec<MemoryRegion>>; 3],
    /// Bytes of the buffers in `lists`.
    pub(crate) kept: usize,
    /// The most `kept` may reach ([`Config::max_cached_buffer_bytes`](crate::Config)).
    cap: usize,
    isolation: Isolation,
    pub(crate) pd: ProtectionDomain,
    /// Every buffer is registered [`Role::Private`], whatever it is asked for: the domain is
    /// shared by many connections (a server on a receive pool), and a buffer one peer could
    /// reach would be within reach of all of them.
    pub(crate) private: bool,
}

impl Free {
    pub(crate) fn new(pd: &ProtectionDomain, isolation: Isolation, cap: usize) -> Self {
        Self {
            lists: Default::default(),
            kept: 0,
            cap,
            isolation,
            pd: pd.clone(),
            private: false,
        }
    }

    /// The role a buffer asked for as `role` is registered with ([`Free::private`]).
    pub(crate) fn role(&self, role: Role) -> Role {
        if self.private {
            Role::Private
        } else {
            role
        }
    }

    pub(crate) fn pop(&mut self, class: usize, role: Role) -> Option<MemoryRegion> {
        let mr = self.lists[role as usize]
            .get_mut(class_index(class)?)
            .and_then(Vec::pop)?;
        self.kept -= mr.len();
        Some(mr)
    }

    /// A buffer no peer can reach through the session any more: kept for reuse, or (with
    /// [`Isolation::Transfer`], beyond [`KEEP`] of its class or the byte cap, or of no class's
    /// size) deregistered, so that its rkey dies and its memory goes back.
    pub(crate) fn put(&mut self, mr: MemoryRegion) {
        // Only what `fresh` registers, back to the list of its role: a buffer with other
        // access flags would fail whoever takes it next, or give its peer more than it needs.
        let Some(role) = Role::of(mr.access()) else { return };
        if self.isolation != Isolation::Connection {
            return;
        }
        let Some(i) = class_index(mr.len()) else { return };
        if self.kept.saturating_add(mr.len()) > self.cap {
            return;
        }
        let lists = &mut self.lists[role as usize];
        if lists.len() <= i {
            lists.resize_with(i + 1, Vec::new);
        }
        if lists[i].len() < KEEP {
            self.kept += mr.len();
            lists[i].push(mr);
        }
    }
}

/// The free list of buffers of `len` bytes, when that is a class's size.
pub(crate) fn class_index(len: usize) -> Option<usize> {
    let p = len.checked_sub(SLACK)?;
    (p >= MIN_CLASS && p.is_power_of_two()).then(|| (p / MIN_CLASS).trailing_zeros() as usize)
}

pub(crate) const MIN_CLASS: usize = 4096;
/// Bytes a class holds past its power of two: a lent or landed payload of a power-of-two
/// length has its length prefix in front, and with this it takes the class of its own
/// length, not one twice as large (1 MiB and 24 bytes, not 2 MiB). Buffers read into (no
/// prefix) share the class.
pub(crate) const SLACK: usize = LANDING_PREFIX;
/// Free buffers kept per size class; more are deregistered.
pub(crate) const KEEP: usize = 8;

/// The size class of a buffer of `len` bytes: the least power of two (at least [`MIN_CLASS`])
/// that holds `len` with [`SLACK`] to spare, plus [`SLACK`]; `None` beyond the largest.
pub(crate) fn class(len: usize) -> Option<usize> {
    len.saturating_sub(SLACK)
        .max(MIN_CLASS)
        .checked_next_power_of_two()?
        .checked_add(SLACK)
}
