//! The primary: appends records into the backup's ring by RDMA Write-with-immediate, never past
//! what the backup has applied, and times each append; then the same appends as RPCs.

use std::collections::VecDeque;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use rdma_rpc::transport::{
    AccessFlags, BufferPool, Completion, Device, RecvWr, RemoteRegion, SendOp, SendWr, WcOpcode,
};
use rdma_rpc::{Bulk, Config};

use crate::common::{self, fnv64, Peer, FNV64};
use crate::record::{self, END};
use crate::sink::LogSinkClient;
use crate::Offer;

/// Where the ring stands, as the primary sees it. Positions are logical (they only grow); the
/// ring offset is the position modulo the ring's length.
struct Window {
    ring: RemoteRegion,
    depth: u64,
    /// Where the next record goes.
    tail: u64,
    /// Ends of the records not yet applied, oldest first.
    in_flight: VecDeque<u64>,
    /// Records sent, and records the backup said it applied.
    sent: u64,
    applied: u64,
    /// Everything before this position may be overwritten.
    free_from: u64,
}

impl Window {
    /// A credit: the backup applied `applied` records in all.
    fn credit(&mut self, applied: u64) {
        while self.applied < applied {
            if let Some(end) = self.in_flight.pop_front() {
                self.free_from = end;
            }
            self.applied += 1;
        }
    }

    /// Where a record of `size` bytes would go now: its position, or `None` until credits come.
    fn place(&self, size: u64) -> Option<u64> {
        let len = self.ring.len;
        let mut at = self.tail;
        if at % len + size > len {
            at += len - at % len; // records never wrap: skip to the ring's start
        }
        let fits = at + size - self.free_from <= len;
        (fits && (self.sent - self.applied < self.depth)).then_some(at)
    }
}

pub async fn run(
    device: &Device,
    backup: SocketAddr,
    total: usize,
    rpc_appends: u64,
    out: Option<PathBuf>,
) -> common::Result<()> {
    let depth = 160; // credit receives: more than the backup's notification depth
    let (pd, cq) = Peer::resources(device, depth + 64)?;
    let credit_bufs = BufferPool::new(&pd, 8, depth, AccessFlags::LOCAL_WRITE)?;
    let recvs = (0..depth as u64)
        .map(|i| credit_bufs.take().map(|b| RecvWr::new(i, b)).ok_or("credit buffers"))
        .collect::<Result<Vec<_>, _>>()?;
    let (mut peer, offer) = Peer::connect(device, backup, pd, cq, depth + 64, Vec::new(), recvs).await?;
    let offer: Offer = postcard::from_bytes(&offer).map_err(|e| format!("not a logsync backup: {e}"))?;
    if (offer.depth as usize) > depth {
        return Err("the backup posts more notification receives than this primary has credit receives".into());
    }

    // The same append as an RPC, first (the backup's RPC side is then idle for the rest).
    let sink = LogSinkClient::connect(device, SocketAddr::new(backup.ip(), offer.rpc_port), Config::default()).await?;
    let mut rpc_times = common::Latencies::new()?;
    for seq in 0..rpc_appends {
        let rec = record::encode(seq, 0, &record::payload(seq));
        let t = Instant::now();
        let n = sink.append(Bulk::from(rec)).await??;
        rpc_times.record(t.elapsed());
        if n != seq + 1 {
            return Err(format!("RPC append {seq}: the backup counts {n}").into());
        }
    }

    let staging = BufferPool::new(&peer.pd.clone(), record::padded(1 << 13), 2, AccessFlags::LOCAL_WRITE)?;
    let mut w = Window {
        ring: offer.ring,
        depth: u64::from(offer.depth),
        tail: 0,
        in_flight: VecDeque::new(),
        sent: 0,
        applied: 0,
        free_from: 0,
    };
    let mut out = out.map(std::fs::File::create).transpose()?.map(std::io::BufWriter::new);
    let (mut bytes, mut digest, mut stalls) = (0u64, FNV64, 0u64);
    let mut times = common::Latencies::new()?;
    let mut seq = 0u64;
    let started = Instant::now();
    loop {
        let last = bytes >= total as u64;
        let payload = if last { Vec::new() } else { record::payload(seq) };
        let rec = record::encode(seq, if last { END } else { 0 }, &payload);
        let size = rec.len() as u64;
        let at = loop {
            if let Some(at) = w.place(size) {
                break at;
            }
            stalls += 1;
            let c = peer.next_where(|c| c.opcode == WcOpcode::Recv).await?;
            on_credit(&mut peer, &mut w, c)?;
        };
        let mut buf = staging.take().ok_or("a staging buffer")?;
        buf.write_at(0, &rec)?;
        let offset = at % w.ring.len;
        let t = Instant::now();
        peer.post(
            SendWr::new(
                seq,
                SendOp::Write {
                    remote: w.ring.at(offset),
                    imm: Some((offset / 8) as u32),
                },
            )
            .buf(buf)
            .len(rec.len()),
        )?;
        w.tail = at + size;
        w.in_flight.push_back(w.tail);
        w.sent += 1;
        // The append is done when the write completes: the bytes are in the backup's memory.
        loop {
            let c = peer.next().await?;
            if c.opcode == WcOpcode::RdmaWrite && c.wr_id == seq {
                break;
            }
            on_credit(&mut peer, &mut w, c)?;
        }
        times.record(t.elapsed());
        if last {
            break;
        }
        digest = fnv64(digest, &payload);
        bytes += payload.len() as u64;
        if let Some(f) = &mut out {
            f.write_all(&payload)?;
        }
        seq += 1;
    }
    // Wait until the backup has applied everything, the end record included.
    while w.applied < w.sent {
        let c = peer.next_where(|c| c.opcode == WcOpcode::Recv).await?;
        on_credit(&mut peer, &mut w, c)?;
    }
    let elapsed = started.elapsed();
    if let Some(mut f) = out {
        f.flush()?;
    }
    println!("primary: appended {seq} records, {bytes} bytes, log digest {digest:016x}");
    println!(
        "primary: {:.1} MB/s replicated, {stalls} waits for credits (ring {} KiB)",
        bytes as f64 / elapsed.as_secs_f64() / 1e6,
        w.ring.len >> 10
    );
    let (w50, w99) = times.p50_p99();
    let (r50, r99) = rpc_times.p50_p99();
    println!(
        "{:<28} {:>8} {:>10} {:>10}",
        "append (records 16..4111 B)", "#appends", "p50[usec]", "p99[usec]"
    );
    println!(
        "{:<28} {:>8} {w50:>10.2} {w99:>10.2}",
        "RDMA Write-with-imm",
        times.len()
    );
    println!(
        "{:<28} {:>8} {r50:>10.2} {r99:>10.2}",
        "RPC (LogSink::append)",
        rpc_times.len()
    );
    Ok(())
}

/// A credit arrived: note it and repost its receive.
fn on_credit(peer: &mut Peer, w: &mut Window, c: Completion) -> common::Result<()> {
    if c.opcode != WcOpcode::Recv {
        return Err(format!("unexpected completion {:?} (wr {})", c.opcode, c.wr_id).into());
    }
    let buf = c.buf.ok_or("a credit without its buffer")?;
    let applied = u64::from_le_bytes(buf.bytes()[..8].try_into()?);
    w.credit(applied);
    peer.post_recv(RecvWr::new(c.wr_id, buf))?;
    Ok(())
}
