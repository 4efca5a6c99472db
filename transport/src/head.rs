//! A copy of a received message's first bytes that comes with its completion.

/// The most bytes a [`Head`] holds.
pub const HEAD_MAX: usize = 28;

/// A copy of the first bytes of a received message, delivered inside its completion by
/// providers that can (shm: the first [`HEAD_MAX`] bytes of every Send, written by the sender
/// into the same cache line as the completion itself). A protocol can read its header here
/// without touching the receive buffer, whose lines were just written by another core. The
/// buffer holds the whole message all the same. Real NICs do a smaller form of this (mlx5's
/// "scatter to CQE" puts messages of at most 32 or 64 bytes inside the CQE); `verbs` and `tcp`
/// deliver an empty head.
///
/// ```
/// use rdma_rpc_transport::Head;
///
/// let h = Head::copy_of(b"a header, then a body");
/// assert_eq!(h.bytes(), b"a header, then a body");
/// assert!(Head::default().bytes().is_empty());
/// ```
#[derive(Clone, Copy)]
pub struct Head {
    len: u8,
    bytes: [u8; HEAD_MAX],
}

impl Head {
    /// A head holding the first bytes of `msg` (at most [`HEAD_MAX`]).
    pub fn copy_of(msg: &[u8]) -> Head {
        let n = msg.len().min(HEAD_MAX);
        let mut bytes = [0u8; HEAD_MAX];
        bytes[..n].copy_from_slice(&msg[..n]);
        Head { len: n as u8, bytes }
    }

    /// The first `len` of `bytes` (at most [`HEAD_MAX`]), taken as they are: no second copy
    /// for a provider that assembled them in place.
    pub(crate) fn from_array(bytes: [u8; HEAD_MAX], len: usize) -> Head {
        Head {
            len: len.min(HEAD_MAX) as u8,
            bytes,
        }
    }

    /// The copied bytes: the message's first `bytes().len()` bytes, or none.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len).min(HEAD_MAX)]
    }
}

/// Heads are equal when their bytes are: what lies past `len` is not part of either.
impl PartialEq for Head {
    fn eq(&self, other: &Head) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for Head {}

impl Default for Head {
    /// An empty head.
    fn default() -> Head {
        Head {
            len: 0,
            bytes: [0; HEAD_MAX],
        }
    }
}

impl std::fmt::Debug for Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Head({} bytes)", self.len)
    }
}
