//! Descriptors between the protocol and the transport: the session names a peer's buffer with
//! its own [`RemoteRegion`](crate::proto::RemoteRegion), the driver reaches it through the
//! transport's.

use rdma_rpc_transport::{RemoteAddr, RemoteRegion};

/// The descriptor the session carries for `r`.
pub(crate) fn desc(r: RemoteRegion) -> crate::proto::RemoteRegion {
    crate::proto::RemoteRegion {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey,
    }
}

/// The address `offset` bytes into the peer's buffer `d` (no bounds check here: the target
/// checks, as a NIC does).
pub(crate) fn at(d: &crate::proto::RemoteRegion, offset: u64) -> RemoteAddr {
    RemoteRegion {
        addr: d.addr,
        len: d.len,
        rkey: d.rkey,
    }
    .at(offset)
}
