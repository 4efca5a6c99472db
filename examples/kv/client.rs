//! The one-sided GET: RDMA Read of the key's index entries, then of its value slot; retry on a
//! torn copy or a slot reused by another key. And the PUT by RDMA Write with immediate.

use std::net::SocketAddr;

use rdma_rpc::transport::{AccessFlags, Device, MemoryRegion, RecvWr, RemoteAddr, RemoteRegion, SendOp, SendWr};

use crate::common::{self, Peer};
use crate::layout::{self, Entry, SlotRead, ENTRY, PROBE, SLOT};
use crate::writes;

/// Attempts before a GET gives up (only under a write storm on one key).
const ATTEMPTS: usize = 10_000;

/// A queue pair to the server's table, and two registered landing buffers.
pub struct OneSided {
    peer: Peer,
    index: RemoteRegion,
    values: RemoteRegion,
    ibuf: Option<MemoryRegion>,
    vbuf: Option<MemoryRegion>,
    /// Torn copies seen (and read again).
    pub torn: u64,
}

impl OneSided {
    /// Connects to the server's one-sided endpoint.
    pub async fn connect(device: &Device, addr: SocketAddr) -> common::Result<Self> {
        let (pd, cq) = Peer::resources(device, 16)?;
        let ibuf = pd.register(PROBE * ENTRY, AccessFlags::LOCAL_WRITE)?;
        let vbuf = pd.register(SLOT, AccessFlags::LOCAL_WRITE)?;
        let (peer, private) = Peer::connect(device, addr, pd, cq, 16, Vec::new(), Vec::new()).await?;
        let (index, values): (RemoteRegion, RemoteRegion) =
            postcard::from_bytes(&private).map_err(|e| format!("not a kv server: {e}"))?;
        Ok(Self {
            peer,
            index,
            values,
            ibuf: Some(ibuf),
            vbuf: Some(vbuf),
            torn: 0,
        })
    }

    async fn read(&mut self, remote: RemoteAddr, buf: MemoryRegion) -> common::Result<MemoryRegion> {
        self.peer.post(SendWr::new(0, SendOp::Read { remote }).buf(buf))?;
        self.peer
            .next()
            .await?
            .buf
            .ok_or_else(|| "a read without its buffer".into())
    }

    /// The value of `key`, read without the server's CPU.
    pub async fn get(&mut self, key: &[u8]) -> common::Result<Option<Vec<u8>>> {
        let hash = layout::key_hash(key);
        let first = (layout::home(hash) * ENTRY) as u64;
        for _ in 0..ATTEMPTS {
            let ibuf = self.ibuf.take().ok_or("index buffer in use")?;
            let ibuf = self.read(self.index.at(first), ibuf).await?;
            let mut torn = false;
            let mut slots = Vec::new();
            for e in ibuf.bytes().chunks(ENTRY) {
                match Entry::decode(e) {
                    Err(()) => torn = true,
                    Ok(Some(e)) if e.live && e.hash == hash => slots.push(e.slot),
                    Ok(_) => {}
                }
            }
            self.ibuf = Some(ibuf);
            if slots.is_empty() && !torn {
                return Ok(None);
            }
            for slot in slots {
                let vbuf = self.vbuf.take().ok_or("value buffer in use")?;
                let vbuf = self.read(self.values.at(slot as u64 * SLOT as u64), vbuf).await?;
                let found = match layout::decode_slot(&vbuf.bytes()) {
                    SlotRead::Value { key: k, value } if k == key => Some(value.to_vec()),
                    SlotRead::Value { .. } => None, // reused by another key (or a hash twin)
                    SlotRead::Torn => {
                        torn = true;
                        None
                    }
                };
                self.vbuf = Some(vbuf);
                if found.is_some() {
                    return Ok(found);
                }
            }
            if torn {
                self.torn += 1;
            }
        }
        Err(format!("no consistent read of the key after {ATTEMPTS} attempts").into())
    }
}

/// PUTs by RDMA Write with immediate (`writes.rs`): a queue pair of its own to the server's
/// one-sided endpoint, and the landing slots the server lent it.
pub struct Writer {
    peer: Peer,
    landing: RemoteRegion,
    /// The slot bytes of a PUT, staged here and written from here.
    buf: Option<MemoryRegion>,
    next: u32,
}

impl Writer {
    /// Connects to the server's one-sided endpoint as a writer.
    pub async fn connect(device: &Device, addr: SocketAddr) -> common::Result<Self> {
        let depth = writes::WINDOW as usize;
        let (pd, cq) = Peer::resources(device, depth)?;
        let buf = pd.register(SLOT, AccessFlags::LOCAL_WRITE)?;
        // The answers are zero-byte Sends: one receive each.
        let recvs = (0..depth as u64)
            .map(|i| Ok(RecvWr::new(ANSWER | i, pd.register(8, AccessFlags::LOCAL_WRITE)?)))
            .collect::<common::Result<Vec<_>>>()?;
        let (peer, private) = Peer::connect(device, addr, pd, cq, depth, writes::HELLO.to_vec(), recvs).await?;
        Ok(Self {
            peer,
            landing: common::region_from(&private)?,
            buf: Some(buf),
            next: 0,
        })
    }

    /// Sets `key` to `value`: one RDMA Write with immediate into a landing slot, and the
    /// server's answer. Returns once the table holds it, as the RPC `put` does.
    pub async fn put(&mut self, key: &[u8], value: &[u8]) -> common::Result<()> {
        if key.len() + value.len() > layout::MAX_KV {
            return Err(format!(
                "key and value take {} bytes; a slot holds {}",
                key.len() + value.len(),
                layout::MAX_KV
            )
            .into());
        }
        let slot = self.next;
        self.next = (self.next + 1) % writes::WINDOW;
        let bytes = layout::encode_slot(0, key, value);
        let mut buf = self.buf.take().ok_or("the PUT buffer is in use")?;
        buf.write_at(0, &bytes)?;
        let remote = self.landing.at(u64::from(slot) * SLOT as u64);
        self.peer.post(
            SendWr::new(
                WRITE,
                SendOp::Write {
                    remote,
                    imm: Some(slot),
                },
            )
            .buf(buf)
            .len(bytes.len()),
        )?;
        let written = self.peer.next_where_spinning(|c| c.wr_id == WRITE, SPIN).await?;
        self.buf = Some(written.buf.ok_or("a write without its buffer")?);
        let answer = self.peer.next_where_spinning(|c| c.wr_id & ANSWER != 0, SPIN).await?;
        let imm = answer.imm.ok_or("an answer without its immediate")?;
        self.peer.post_recv(RecvWr::new(
            answer.wr_id,
            answer.buf.ok_or("an answer without its buffer")?,
        ))?;
        if imm & !writes::REFUSED != slot {
            return Err(format!(
                "the answer names slot {}, the PUT went to {slot}",
                imm & !writes::REFUSED
            )
            .into());
        }
        if imm & writes::REFUSED != 0 {
            return Err("the server refused the PUT (table full, or the bytes arrived torn)".into());
        }
        Ok(())
    }
}

/// How long a PUT polls for its completions before it sleeps on the CQ.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// Work request ids of a [`Writer`].
const WRITE: u64 = 1;
const ANSWER: u64 = 1 << 40;
