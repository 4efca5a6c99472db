//! A peer's registered buffer as the protocol names it.

/// A registered buffer as a descriptor names it on the wire: what one side lends the other to
/// Read from or Write into. The session only carries these between the peer and the driver;
/// the driver turns them into its transport's remote addresses, whose target checks them as a
/// NIC does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
}
