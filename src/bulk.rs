//! [`Bulk`]: the byte type that travels raw.

use std::fmt;
use std::ops::{Deref, DerefMut};

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes that a `#[service]` method sends or returns raw.
///
/// As an argument (one per method) or as the whole return type, a `Bulk` is not serialized: its
/// bytes are the body of the message, so above the rendezvous threshold they move by one RDMA
/// Read (request) or RDMA Write-with-immediate / Read (response) with no encoding step, and the
/// generated code neither copies nor scans them. The RPC core copies them once into registered
/// memory at the sender and once out of it at the receiver.
///
/// Elsewhere (inside a struct, in a `Result`) it serializes as a byte string, like
/// `serde_bytes`: one `memcpy`, never element by element.
///
/// The macro recognizes it by name: write `Bulk` or `rdma_rpc::Bulk`, not an alias.
///
/// # Examples
/// ```
/// let b = rdma_rpc::Bulk::from(vec![1u8, 2, 3]);
/// assert_eq!(&b[..], &[1, 2, 3]);
/// assert_eq!(Vec::from(b), vec![1, 2, 3]);
/// ```
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bulk(Vec<u8>);

impl Bulk {
    /// An empty bulk value.
    pub fn new() -> Self {
        Self(Vec::new())
    }

    /// The bytes, without a copy.
    pub fn into_vec(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for Bulk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bulk({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Bulk {
    fn from(v: Vec<u8>) -> Self {
        Self(v)
    }
}

impl From<&[u8]> for Bulk {
    fn from(v: &[u8]) -> Self {
        Self(v.to_vec())
    }
}

impl From<Bulk> for Vec<u8> {
    fn from(b: Bulk) -> Self {
        b.0
    }
}

impl Deref for Bulk {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl DerefMut for Bulk {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl AsRef<[u8]> for Bulk {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Serialize for Bulk {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
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
                Ok(Bulk(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bulk, E> {
                Ok(Bulk(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bulk, A::Error> {
                // Self-describing formats may send bytes as a sequence; cap the pre-allocation.
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(Bulk(v))
            }
        }
        d.deserialize_byte_buf(V)
    }
}
