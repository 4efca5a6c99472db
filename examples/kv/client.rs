//! The one-sided GET: RDMA Read of the key's index entries, then of its value slot; retry on a
//! torn copy or a slot reused by another key.

use std::net::SocketAddr;

use rdma_rpc::transport::{AccessFlags, Device, MemoryRegion, RemoteAddr, RemoteRegion, SendOp, SendWr};

use crate::common::{self, Peer};
use crate::layout::{self, Entry, SlotRead, ENTRY, PROBE, SLOT};

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
