//! The backup: a registered ring that only the primary writes; each Write-with-immediate names
//! the record's offset; apply, repost the receive, return a credit.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rdma_rpc::transport::{AccessFlags, BufferPool, Device, Listener, RecvWr, SendWr, WcOpcode};
use rdma_rpc::Config;

use crate::common::{self, fnv64, Peer, FNV64};
use crate::record::{self, END};
use crate::sink::{LogSinkServer, Sink};
use crate::Offer;

/// Receives posted for notifications (records in flight at most).
const DEPTH: usize = 128;

pub async fn run(
    device: &Device,
    listen: SocketAddr,
    ring_len: usize,
    delay_us: u64,
    out: Option<PathBuf>,
) -> common::Result<()> {
    if ring_len % 8 != 0 || ring_len < 8192 {
        return Err(format!("--ring {ring_len}: give a multiple of 8, at least 8192").into());
    }
    let listener = Arc::new(Listener::bind(device, listen)?);
    let rpc = LogSinkServer::new(Sink::default()).bind(device, SocketAddr::new(listen.ip(), 0), Config::default())?;
    let offer_rpc_port = rpc.local_addr()?.port();
    let rpc_sink = tokio::spawn(rpc.serve());
    println!("listening on {}", listener.local_addr()?);

    let (pd, cq) = Peer::resources(device, DEPTH + 64)?;
    let ring = pd.register(ring_len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let credits = BufferPool::new(&pd, 8, DEPTH, AccessFlags::LOCAL_WRITE)?;
    let offer = Offer {
        ring: ring.remote(),
        depth: DEPTH as u32,
        rpc_port: offer_rpc_port,
    };
    let recvs = (0..DEPTH as u64).map(RecvWr::empty).collect();
    let (mut peer, _) = Peer::accept(&listener, pd, cq, DEPTH + 64, postcard::to_allocvec(&offer)?, recvs).await?;

    let mut out = out.map(std::fs::File::create).transpose()?.map(std::io::BufWriter::new);
    let (mut applied, mut bytes, mut digest) = (0u64, 0u64, FNV64);
    loop {
        let c = peer.next().await?;
        match c.opcode {
            WcOpcode::RecvRdmaWithImm => {}
            WcOpcode::Send => continue, // a credit went out; its buffer is back in the pool
            other => return Err(format!("unexpected completion {other:?}").into()),
        }
        let offset = c.imm.ok_or("a notification without its immediate")? as usize * 8;
        let view = ring.bytes();
        let (seq, flags, payload) = record::decode(view.get(offset..).ok_or("offset beyond the ring")?)?;
        if seq != applied {
            return Err(format!("record {seq} arrived where {applied} was due").into());
        }
        digest = fnv64(digest, payload);
        bytes += payload.len() as u64;
        if let Some(f) = &mut out {
            f.write_all(payload)?;
        }
        drop(view);
        if delay_us > 0 {
            std::thread::sleep(Duration::from_micros(delay_us));
        }
        applied += 1;
        // The receive goes back before the credit that lets the primary use it.
        peer.post_recv(RecvWr::empty(c.wr_id))?;
        let mut buf = match credits.take() {
            Some(b) => b,
            None => {
                peer.next_where(|c| c.opcode == WcOpcode::Send).await?;
                credits.take().ok_or("no credit buffer after a send completed")?
            }
        };
        buf.write_at(0, &applied.to_le_bytes())?;
        peer.post(SendWr::send(applied, buf).len(8))?;
        if flags & END != 0 {
            peer.next_where(|c| c.opcode == WcOpcode::Send && c.wr_id == applied)
                .await?;
            break;
        }
    }
    if let Some(mut f) = out {
        f.flush()?;
    }
    println!(
        "backup: applied {} records, {bytes} bytes, log digest {digest:016x}",
        applied - 1
    );
    rpc_sink.abort();
    Ok(())
}
