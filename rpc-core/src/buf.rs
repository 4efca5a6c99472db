//! Registered memory an application holds: buffers it fills in place for a large request
//! ([`Client::buffer`](crate::Client::buffer), [`Client::call_buf`](crate::Client::call_buf))
//! and the registered buffer a large request was read into, handed to a handler as is
//! ([`ServerBuilder::handler_body`](crate::ServerBuilder::handler_body)). No copies: the peer
//! reads from, or the transport reads into, exactly these bytes.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rdma_rpc_transport::{BufMut, BufRef, MemoryRegion};

use crate::stash::Free;

/// A buffer registered with one connection's protection domain, owned by the application.
/// Dropping it gives it back to its connection for reuse (or deregisters it once the
/// connection is gone).
pub struct RegisteredBuf {
    mr: Option<MemoryRegion>,
    off: usize,
    len: usize,
    home: Weak<Mutex<Free>>,
}

impl RegisteredBuf {
    pub(crate) fn new(mr: MemoryRegion, off: usize, len: usize, home: &Arc<Mutex<Free>>) -> Self {
        Self {
            mr: Some(mr),
            off,
            len,
            home: Arc::downgrade(home),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for reading.
    pub fn bytes(&self) -> BufRef<'_> {
        let (off, len) = (self.off, self.len);
        self.region()
            .bytes()
            .slice(off..off + len)
            .unwrap_or_else(|| unreachable_range(off, len))
    }

    /// The bytes, for writing.
    pub fn bytes_mut(&mut self) -> BufMut<'_> {
        let (off, len) = (self.off, self.len);
        self.region_mut()
            .bytes_mut()
            .slice(off..off + len)
            .unwrap_or_else(|| unreachable_range(off, len))
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }

    /// Whether it belongs to the connection whose free lists are `home`, with room for the
    /// length prefix a lent buffer carries before its bytes.
    pub(crate) fn lendable_on(&self, home: &Arc<Mutex<Free>>, prefix: usize) -> bool {
        self.off == prefix && std::ptr::eq(self.home.as_ptr(), Arc::as_ptr(home))
    }

    /// The registration, for lending it (its bytes start at the prefix).
    pub(crate) fn into_region(mut self) -> MemoryRegion {
        self.mr.take().unwrap_or_else(|| unreachable_taken())
    }

    fn region(&self) -> &MemoryRegion {
        // Only `into_region` and `drop` take the region out, and both consume `self`.
        self.mr.as_ref().unwrap_or_else(|| unreachable_taken())
    }

    fn region_mut(&mut self) -> &mut MemoryRegion {
        self.mr.as_mut().unwrap_or_else(|| unreachable_taken())
    }
}

#[cold]
fn unreachable_range(off: usize, len: usize) -> ! {
    unreachable!("a registered buffer always covers its bytes ({off}+{len})")
}

#[cold]
fn unreachable_taken() -> ! {
    unreachable!("a registered buffer's region is only taken when it is consumed")
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        if let (Some(mr), Some(home)) = (self.mr.take(), self.home.upgrade()) {
            home.lock().put(mr);
        }
    }
}

impl std::fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf").field("len", &self.len).finish()
    }
}

/// A request's bytes as a [`handler_body`](crate::ServerBuilder::handler_body) gets them:
/// inside the message (small requests), or in the registered buffer the request was read into
/// (large ones), without a copy.
#[derive(Debug)]
#[non_exhaustive]
pub enum Body {
    /// A small request, copied out of its message.
    Bytes(Vec<u8>),
    /// A large request, in the registered buffer the server read it into.
    Registered(RegisteredBuf),
}

impl Body {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Body::Bytes(b) => b.len(),
            Body::Registered(r) => r.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, for reading.
    pub fn bytes(&self) -> BodyRef<'_> {
        BodyRef(match self {
            Body::Bytes(b) => Inner::Slice(b),
            Body::Registered(r) => Inner::Buf(r.bytes()),
        })
    }

    /// The bytes as a vector (a copy for a registered body).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Body::Bytes(b) => b,
            Body::Registered(r) => r.to_vec(),
        }
    }
}

/// Read access to a [`Body`]'s bytes.
pub struct BodyRef<'a>(Inner<'a>);

enum Inner<'a> {
    Slice(&'a [u8]),
    Buf(BufRef<'a>),
}

impl std::ops::Deref for BodyRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Inner::Slice(s) => s,
            Inner::Buf(b) => b,
        }
    }
}
