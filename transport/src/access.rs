//! Memory access flags (`enum ibv_access_flags`).

use std::ops::{BitOr, BitOrAssign};

/// Access rights of a memory region. LOCAL_READ is implied, as in verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No remote access and no local write.
    pub const NONE: Self = Self(0);
    /// IBV_ACCESS_LOCAL_WRITE: the local NIC may write it (needed for receives and Read/atomic targets).
    pub const LOCAL_WRITE: Self = Self(1);
    /// IBV_ACCESS_REMOTE_WRITE: peers may RDMA Write into it (requires LOCAL_WRITE).
    pub const REMOTE_WRITE: Self = Self(1 << 1);
    /// IBV_ACCESS_REMOTE_READ: peers may RDMA Read from it.
    pub const REMOTE_READ: Self = Self(1 << 2);
    /// IBV_ACCESS_REMOTE_ATOMIC: peers may run CAS/FAA on it (requires LOCAL_WRITE).
    pub const REMOTE_ATOMIC: Self = Self(1 << 3);
    /// Everything above.
    pub const ALL: Self = Self(0b1111);

    /// The raw bits, equal to the ibverbs values.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// The flags of both, in a `const` (where `|` cannot go).
    ///
    /// # Examples
    /// ```
    /// use rdma_rpc_transport::AccessFlags;
    /// const RW: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_WRITE);
    /// assert_eq!(RW, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    /// ```
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The flags among `bits` (others dropped).
    pub(crate) fn from_bits_truncate(bits: u32) -> Self {
        Self(bits & Self::ALL.0)
    }

    /// True if every flag of `other` is set here.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for AccessFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}
