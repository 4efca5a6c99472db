//! Short bodies held by value: a request or response of a few dozen bytes reaches a handler that
//! takes a `Body` (rdma-rpc-core), or a caller of `Client::call_body` (rdma-rpc-core),
//! without a heap allocation (and without a free where it is dropped).

use std::fmt;
use std::ops::Deref;

/// A body of at most [`Inline::MAX`] bytes, held by value. It makes a `Body` (rdma-rpc-core) no
/// larger than a registered buffer does, so moving one costs what moving any body costs.
///
/// ```
/// use rdma_rpc_proto::Inline;
/// let b = Inline::new(b"abc").expect("short enough");
/// assert_eq!(&b[..], b"abc");
/// assert!(Inline::new(&[0; Inline::MAX + 1]).is_none());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Inline {
    len: u8,
    bytes: [u8; Inline::MAX],
}

impl Inline {
    /// The longest body held inline.
    pub const MAX: usize = 64;

    /// A copy of `b`, or `None` when it is longer than [`Inline::MAX`].
    #[inline]
    pub fn new(b: &[u8]) -> Option<Self> {
        let len = u8::try_from(b.len()).ok().filter(|&n| usize::from(n) <= Self::MAX)?;
        let mut bytes = [0; Self::MAX];
        bytes[..b.len()].copy_from_slice(b);
        Some(Self { len, bytes })
    }

    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl Deref for Inline {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for Inline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Inline").field(&self.as_slice()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_up_to_max_bytes_and_no_more() {
        for n in [0, 1, 63, Inline::MAX] {
            let src: Vec<u8> = (0..n as u8).collect();
            let b = Inline::new(&src).expect("fits");
            assert_eq!(b.as_slice(), &src[..]);
            assert_eq!(b.len(), n);
        }
        assert!(Inline::new(&[1; Inline::MAX + 1]).is_none());
        assert!(Inline::new(&vec![1; 300]).is_none(), "longer than a u8 counts");
    }
}
