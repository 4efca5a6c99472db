//! [`Bulk`]: bytes a `#[service]` method sends or returns raw, shared without copies.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::buf::{Body, BodyRef, RegisteredBuf};
use crate::proto::Inline;

/// Bytes that a `#[service]` method sends or returns raw; cheap to clone (clones share the
/// bytes, as `bytes::Bytes` clones do) and immutable once made.
///
/// As an argument (one per method) or as the whole return type, a `Bulk` is not serialized:
/// its bytes are the message body, so above the rendezvous threshold they move by RDMA Read
/// (or Write-with-immediate) with no encoding step. Where the bytes are is the caller's
/// choice:
///
/// - **in registered memory** ([`Bulk::from`] a [`RegisteredBuf`] of the connection, from
///   [`Client::buffer`](crate::Client::buffer) or, in a handler,
///   [`context::buffers`](crate::context::buffers)): a large one is lent to the peer as it is,
///   with no copy on this side, however often it is sent; the other arguments travel in the
///   request message beside it. A large `Bulk` a handler receives is in the buffer the
///   request was read into, also without a copy (a small one is copied out of its receive
///   slot, which the handler then does not hold while it runs).
/// - **in a `Vec`** ([`Bulk::from`] a `Vec<u8>`): sent as it is where registering memory is
///   cheap (the tcp provider), copied once into registered memory elsewhere (shm, verbs).
///
/// Elsewhere (inside a struct, in a `Result`) it serializes as a byte string, like
/// `serde_bytes`. The macro recognizes it by name: write `Bulk` or `rdma_rpc::Bulk`, not an
/// alias.
///
/// # Examples
/// ```
/// use rdma_rpc_core::Bulk;
/// let b = Bulk::from(vec![1u8, 2, 3]);
/// let shared = b.clone(); // no copy
/// assert_eq!(&b.bytes()[..], &[1, 2, 3]);
/// assert_eq!(shared.slice(1..3).map(|s| s.to_vec()), Some(vec![2, 3]));
/// assert_eq!(Vec::from(b), vec![1, 2, 3]);
/// ```
#[derive(Clone)]
pub struct Bulk {
    repr: Repr,
    range: Range<usize>,
}

#[derive(Clone)]
enum Repr {
    /// Short: held by value, no allocation (a clone copies at most [`Inline::MAX`] bytes).
    Inline(Inline),
    Heap(Arc<Vec<u8>>),
    Registered(Arc<RegisteredBuf>),
}

impl Bulk {
    /// An empty bulk value.
    pub fn new() -> Self {
        Self::from(Vec::new())
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The bytes, for reading. In registered memory the borrow shares the buffer's lock
    /// (see [`RegisteredBuf::bytes`]): drop it before sending the value on this thread.
    pub fn bytes(&self) -> BodyRef<'_> {
        match &self.repr {
            Repr::Inline(i) => BodyRef::slice(&i[self.range.clone()]),
            Repr::Heap(v) => BodyRef::slice(&v[self.range.clone()]),
            Repr::Registered(b) => BodyRef::buf(b.bytes_in(self.range.clone())),
        }
    }

    /// Whether its bytes are in registered memory (and so sent without a copy by a connection
    /// they are registered with).
    pub fn is_registered(&self) -> bool {
        matches!(self.repr, Repr::Registered(_))
    }

    /// The bytes `range` of it, sharing them; `None` when `range` is not within it.
    pub fn slice(&self, range: Range<usize>) -> Option<Bulk> {
        if range.start > range.end || range.end > self.len() {
            return None;
        }
        let start = self.range.start + range.start;
        Some(Bulk {
            repr: self.repr.clone(),
            range: start..start + range.len(),
        })
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }

    /// The bytes as a vector: without a copy when this value alone holds a whole `Vec`,
    /// copied otherwise.
    pub fn into_vec(self) -> Vec<u8> {
        match self.repr {
            Repr::Inline(i) => i[self.range].to_vec(),
            Repr::Heap(v) => match Arc::try_unwrap(v) {
                Ok(mut v) if self.range.start == 0 => {
                    v.truncate(self.range.end);
                    v
                }
                Ok(v) => v[self.range].to_vec(),
                Err(v) => v[self.range].to_vec(),
            },
            Repr::Registered(b) => b.bytes_in(self.range).to_vec(),
        }
    }

    /// The registered buffer and the range of it this value is, for sending it as it is.
    pub(crate) fn registered(&self) -> Option<(&Arc<RegisteredBuf>, Range<usize>)> {
        match &self.repr {
            Repr::Registered(b) => Some((b, self.range.clone())),
            Repr::Heap(_) | Repr::Inline(_) => None,
        }
    }

    /// The whole vector, when this value alone holds all of it (to send it without a copy).
    pub(crate) fn try_into_whole_vec(self) -> Result<Vec<u8>, Bulk> {
        match self.repr {
            Repr::Heap(v) if self.range.start == 0 && self.range.end == v.len() => match Arc::try_unwrap(v) {
                Ok(v) => Ok(v),
                Err(v) => Err(Bulk {
                    repr: Repr::Heap(v),
                    range: self.range,
                }),
            },
            repr => Err(Bulk {
                repr,
                range: self.range,
            }),
        }
    }
}

impl Default for Bulk {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Bulk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = if self.is_registered() { ", registered" } else { "" };
        write!(f, "Bulk({} bytes{at})", self.len())
    }
}

impl PartialEq for Bulk {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && *self.bytes() == *other.bytes()
    }
}

impl Eq for Bulk {}

impl PartialOrd for Bulk {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bulk {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (*self.bytes()).cmp(&*other.bytes())
    }
}

impl std::hash::Hash for Bulk {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (*self.bytes()).hash(state);
    }
}

impl From<Vec<u8>> for Bulk {
    fn from(v: Vec<u8>) -> Self {
        let range = 0..v.len();
        let repr = match Inline::new(&v) {
            Some(i) => Repr::Inline(i),
            None => Repr::Heap(Arc::new(v)),
        };
        Self { repr, range }
    }
}

impl From<&[u8]> for Bulk {
    fn from(v: &[u8]) -> Self {
        match Inline::new(v) {
            Some(i) => Self::from(i),
            None => Self::from(v.to_vec()),
        }
    }
}

impl From<Inline> for Bulk {
    fn from(i: Inline) -> Self {
        let range = 0..i.len();
        Self {
            repr: Repr::Inline(i),
            range,
        }
    }
}

/// A buffer registered with a connection ([`Client::buffer`](crate::Client::buffer),
/// [`Buffers::buffer`](crate::Buffers::buffer)), filled, becomes a `Bulk` that the connection
/// lends as it is.
impl From<RegisteredBuf> for Bulk {
    fn from(b: RegisteredBuf) -> Self {
        let range = 0..b.len();
        Self {
            repr: Repr::Registered(Arc::new(b)),
            range,
        }
    }
}

/// A body where it arrived: one read into a registered buffer stays there (which goes back to
/// the connection when the last clone is dropped). One in a receive slot is copied out (at
/// most one message): a `Bulk` may live long, and a held slot is a credit the peer waits for.
impl From<Body> for Bulk {
    fn from(b: Body) -> Self {
        match b {
            Body::Registered(r) if r.in_ring() => Self::from(&r.bytes()[..]),
            Body::Registered(r) => Self::from(r),
            Body::Bytes(v) => Self::from(v),
            Body::Inline(i) => Self::from(i),
        }
    }
}

impl From<Bulk> for Vec<u8> {
    fn from(b: Bulk) -> Self {
        b.into_vec()
    }
}

impl Serialize for Bulk {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.bytes())
    }
}

impl<'de> Deserialize<'de> for Bulk {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Bulk;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bulk, E> {
                Ok(Bulk::from(v))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bulk, E> {
                Ok(Bulk::from(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bulk, A::Error> {
                // Self-describing formats may send bytes as a sequence; cap the pre-allocation.
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(Bulk::from(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_and_slices_share_and_vectors_come_back_whole() {
        let b = Bulk::from(vec![1u8, 2, 3, 4]);
        let c = b.clone();
        assert_eq!(b, c);
        assert_eq!(c.slice(1..3).map(|s| s.to_vec()), Some(vec![2, 3]));
        assert!(c.slice(3..5).is_none());
        drop(c);
        assert_eq!(b.into_vec(), [1, 2, 3, 4]);
        let long = vec![5u8; Inline::MAX + 1];
        let b = Bulk::from(long.clone());
        assert_eq!(b.clone().try_into_whole_vec().ok(), None, "shared: not taken");
        assert_eq!(b.try_into_whole_vec().ok(), Some(long), "held alone: taken as it is");
        let held = Bulk::from(vec![1u8, 2, 3, 4]);
        let body = Bulk::from(Body::Bytes(vec![9, 8, 7]));
        assert_eq!(body.slice(0..2).map(|s| s.to_vec()), Some(vec![9, 8]));
        assert_eq!(held.into_vec(), [1, 2, 3, 4]);
    }
}
