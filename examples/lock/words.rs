//! The server's words, reached by one-sided operations on one queue pair.

use std::net::SocketAddr;

use rdma_rpc::transport::{AccessFlags, Device, MemoryRegion, RemoteRegion, SendOp, SendWr};

use crate::common::{self, Peer};

/// Offsets of the words (each 8-byte aligned, as atomics require).
pub const LOCK: u64 = 0;
pub const COUNTER: u64 = 8;
pub const SEQUENCER: u64 = 16;
/// The region's size.
pub const BYTES: usize = 64;

/// A connection to the words and one registered 8-byte landing buffer.
pub struct Words {
    peer: Peer,
    region: RemoteRegion,
    buf: Option<MemoryRegion>,
}

impl Words {
    pub async fn connect(device: &Device, addr: SocketAddr) -> common::Result<Self> {
        let (pd, cq) = Peer::resources(device, 16)?;
        let buf = pd.register(8, AccessFlags::LOCAL_WRITE)?;
        let (peer, private) = Peer::connect(device, addr, pd, cq, 16, Vec::new(), Vec::new()).await?;
        Ok(Self {
            peer,
            region: common::region_from(&private)?,
            buf: Some(buf),
        })
    }

    /// Posts `op` with the landing buffer; returns the 8 bytes it holds afterwards (native
    /// byte order, as atomics return them).
    async fn run(&mut self, op: SendOp, fill: Option<u64>) -> common::Result<u64> {
        let mut buf = self.buf.take().ok_or("buffer in use")?;
        if let Some(v) = fill {
            buf.write_at(0, &v.to_ne_bytes())?;
        }
        self.peer.post(SendWr::new(0, op).buf(buf).len(8))?;
        let buf = self.peer.next().await?.buf.ok_or("a completion without its buffer")?;
        let v = u64::from_ne_bytes(buf.bytes()[..8].try_into()?);
        self.buf = Some(buf);
        Ok(v)
    }

    /// CAS: the old value (the swap happened if it equals `compare`).
    pub async fn compare_swap(&mut self, at: u64, compare: u64, swap: u64) -> common::Result<u64> {
        let remote = self.region.at(at);
        self.run(SendOp::CompareSwap { remote, compare, swap }, None).await
    }

    /// FAA: the old value.
    pub async fn fetch_add(&mut self, at: u64, add: u64) -> common::Result<u64> {
        let remote = self.region.at(at);
        self.run(SendOp::FetchAdd { remote, add }, None).await
    }

    /// RDMA Read of one word.
    pub async fn read(&mut self, at: u64) -> common::Result<u64> {
        let remote = self.region.at(at);
        self.run(SendOp::Read { remote }, None).await
    }

    /// RDMA Write of one word; returns when it is in the server's memory.
    pub async fn write(&mut self, at: u64, value: u64) -> common::Result<()> {
        let remote = self.region.at(at);
        self.run(SendOp::Write { remote, imm: None }, Some(value))
            .await
            .map(|_| ())
    }
}
