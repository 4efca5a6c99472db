//! Raw provider operations, measured as perftest does: Send/Recv and Write ping-pong (RTT/2),
//! Read and fetch-and-add (full round trip).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc::transport::*;
use tokio::runtime::Handle;

use crate::sampler::{self, Plan, Samples};

/// Receives each side of the Send ping-pong keeps posted unless `--raw-ring` says otherwise
/// (the QPs take 256 at most).
pub const RING: u32 = 16;

pub struct Side {
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
}

/// Two connected QPs in this process, each with its own PD and CQ.
pub fn pair(dev: &Device, ip: IpAddr) -> (Side, Side) {
    let mk = || (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    let ((spd, scq), (cpd, ccq)) = (mk(), mk());
    let listener = Listener::bind(dev, SocketAddr::new(ip, 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_inline_data: dev.caps().max_inline_data.min(64),
    };
    let sopts = QpOptions::new(&spd, &scq).caps(caps);
    let server = std::thread::spawn(move || listener.accept(None).expect("accept").accept(&sopts, b"").expect("qp"));
    let (cqp, _) = connect(
        addr,
        &QpOptions::new(&cpd, &ccq).caps(caps),
        b"",
        Duration::from_secs(30),
    )
    .expect("connect");
    let sqp = server.join().expect("server");
    (
        Side {
            pd: cpd,
            cq: ccq,
            qp: cqp,
        },
        Side {
            pd: spd,
            cq: scq,
            qp: sqp,
        },
    )
}

/// How long raw modes poll the CQ before waiting on the completion channel (`--raw-spin-us`).
/// perftest only polls: give a large value to compare with it.
pub static SPIN_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(20);

/// CQ polls between two turns through the runtime, and between two clock reads: as many as the
/// RPC's spinning caller makes (`rpc-core`'s client, 256; its server driver makes 64), so that the
/// raw baseline polls at least as closely as the RPC it is compared with. With 16, the raw
/// ping-pong read the clock every 16 polls, which in the soft-RoCE VM (clocksource HPET: each
/// read an emulated MMIO access) slowed our raw Send against perftest's, which never reads it
/// while polling: 64 B 52.8, 51.5, 61.2 us with 16 against 44.5, 49.7, 55.3 us with 256, in three
/// interleaved VM runs.
const INNER_POLLS: u32 = 256;

/// The Sends and Writes of the raw ping-pongs ask for a completion once in this many
/// (`--raw-cq-mod`), as perftest's latency tests do (`cq_mod`, 100 there): the others are
/// unsignaled. After posting one that asks, the client and the Write ping-pong's echo wait for
/// its completion before they go on; the Send ping-pong's echo waits for it only when it needs
/// a send buffer back. Signaling every request instead costs a completion per message, and on the tcp provider
/// an acknowledgement frame each, which neither perftest nor the RPC (a completion every eighth
/// Send from its pool) pays.
pub static CQ_MOD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(100);

/// The most a side of a raw ping-pong holds in send buffers: their request's buffer comes back
/// only with the next signaled completion, so at large sizes a completion is asked for more often
/// than `CQ_MOD` says (at 8 MiB, every fourth).
const SEND_MEMORY: usize = 32 << 20;

/// One request in how many asks for a completion at this message length (see [`CQ_MOD`]).
fn signal_every(len: usize) -> usize {
    CQ_MOD
        .load(std::sync::atomic::Ordering::Relaxed)
        .min(SEND_MEMORY / len.max(1))
        .max(1)
}

/// Requests posted from a pool of send buffers, one in `every` signaled (see [`CQ_MOD`]).
struct Signaler {
    pool: BufferPool,
    every: usize,
    posted: usize,
}

impl Signaler {
    fn new(pd: &ProtectionDomain, len: usize) -> Self {
        let every = signal_every(len);
        let pool = BufferPool::new(pd, len, every, AccessFlags::NONE).expect("send buffers");
        Self { pool, every, posted: 0 }
    }

    /// A free send buffer: all of them are free again once the last signaled request completed.
    fn take(&self) -> MemoryRegion {
        self.pool
            .take()
            .expect("a send buffer (the last signaled completion gave them back)")
    }

    /// `wr` as it is posted: unsignaled unless it is the `every`-th; the bool says whether it asks
    /// for a completion (whose wait then comes before anything else).
    fn mark(&mut self, wr: SendWr) -> (SendWr, bool) {
        self.posted += 1;
        if self.posted % self.every == 0 {
            (wr, true)
        } else {
            (wr.unsignaled(), false)
        }
    }
}

/// The spin budget of `--raw-spin-us`.
pub fn spin_budget() -> Duration {
    Duration::from_micros(SPIN_US.load(std::sync::atomic::Ordering::Relaxed))
}

/// Next completion: polling for `budget`, then a wait on the completion channel (at once when
/// `budget` is zero, as the RPC driver's event mode waits). `out` is the caller's scratch
/// vector, kept from call to call: perftest allocates nothing per poll, and neither may the
/// baseline (a vector per call cost the raw ping-pong about 580 instructions per round trip).
async fn next(cq: &CompletionQueue, budget: Duration, out: &mut Vec<Completion>) -> Completion {
    out.clear();
    // The clock is read only after a first round of polls finds nothing: a completion that
    // comes within it costs no clock read (one can be a syscall, e.g. in the soft-RoCE VM).
    let mut started: Option<Instant> = None;
    while !budget.is_zero() && started.is_none_or(|t| t.elapsed() < budget) {
        // Polls back to back, as perftest does, reading the clock and giving way to the
        // runtime only between rounds.
        for _ in 0..INNER_POLLS {
            if cq.poll(out, 1).expect("poll") > 0 {
                return out.pop().expect("one");
            }
            std::hint::spin_loop();
        }
        started.get_or_insert_with(Instant::now);
        give_way().await;
    }
    cq.wait(out, 1).await.expect("wait");
    out.pop().expect("one")
}

/// Queues this task behind the others once, without the IO-driver poll (a syscall) that
/// `tokio::task::yield_now` waits for: how the spinning loops here give way.
async fn give_way() {
    let mut queued = false;
    std::future::poll_fn(|cx| {
        if queued {
            return std::task::Poll::Ready(());
        }
        queued = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

fn ok(c: Completion) -> Completion {
    assert!(c.status.is_success(), "{c:?}");
    c
}

fn inline(size: usize, qp: &QueuePair, wr: SendWr) -> SendWr {
    if size <= qp.caps().max_inline_data as usize {
        wr.inline()
    } else {
        wr
    }
}

/// What each side of the Send ping-pong does with a message it receives before answering.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    /// Nothing, as perftest's `ib_send_lat`.
    Nothing,
    /// Reads its first 8 bytes, as any protocol reads its header.
    Head,
    /// Copies it into a new `Vec`, as an RPC's `Vec` API hands bytes over.
    Copy,
}

impl Touch {
    /// Does it to the first `size` bytes of `buf` (the raw `send` mode does not even borrow them).
    fn apply(self, buf: &MemoryRegion, size: usize) {
        match self {
            Touch::Nothing => {}
            Touch::Head => {
                let mut head = [0u8; 8];
                let n = size.min(8);
                head[..n].copy_from_slice(&buf.bytes()[..n]);
                std::hint::black_box(u64::from_le_bytes(head));
            }
            Touch::Copy => {
                std::hint::black_box(buf.bytes()[..size].to_vec());
            }
        }
    }
}

/// How a Send ping-pong runs.
#[derive(Clone, Copy)]
pub struct PingPong {
    /// What each side does with a message it receives before answering.
    pub touch: Touch,
    /// Receives posted on each side.
    pub ring: u32,
    /// How long each side polls its CQ before it sleeps on the completion channel.
    pub spin: Duration,
}

/// Send/Recv ping-pong as `how` says; reports half the round trip.
pub async fn send(rt: &Handle, client: Side, server: Side, size: usize, how: PingPong, plan: Plan) -> Samples {
    let PingPong { touch, ring, spin } = how;
    let len = size.max(1);
    for s in [&client, &server] {
        for i in 0..ring {
            s.qp.post_recv(RecvWr::new(
                u64::from(i),
                s.pd.register(len, AccessFlags::LOCAL_WRITE).expect("reg"),
            ))
            .map_err(|e| e.error)
            .expect("recv");
        }
    }
    let server = Arc::new(server);
    let srv = server.clone();
    let echo = rt.spawn(async move {
        // Send completions may come back after the next message: its answer then waits for
        // them (for a free send buffer).
        let mut sends = Signaler::new(&srv.pd, len);
        let mut owed = 0usize;
        let mut out = Vec::with_capacity(1);
        loop {
            let c = next(&srv.cq, spin, &mut out).await;
            if !c.status.is_success() {
                return;
            }
            if c.opcode == WcOpcode::Recv {
                owed += 1;
                let buf = c.buf.expect("buf");
                touch.apply(&buf, size);
                let wr = RecvWr::new(c.wr_id, buf);
                srv.qp.post_recv(wr).map_err(|e| e.error).expect("recv");
            } else {
                drop(c); // its send buffers go back to the pool
            }
            while owed > 0 {
                let Some(buf) = sends.pool.take() else { break };
                let (wr, _) = sends.mark(inline(size, &srv.qp, SendWr::send(0, buf).len(size)));
                srv.qp.post_send(wr).map_err(|e| e.error).expect("send");
                owed -= 1;
            }
        }
    });
    let mut sends = Signaler::new(&client.pd, len);
    let mut out = Vec::with_capacity(1);
    let samples = sampler::run(plan, async || {
        let t = Instant::now();
        let wr = inline(size, &client.qp, SendWr::send(0, sends.take()).len(size));
        let (wr, signaled) = sends.mark(wr);
        client.qp.post_send(wr).map_err(|e| e.error).expect("send");
        let (mut got, mut sent) = (false, !signaled);
        while !sent || !got {
            let c = ok(next(&client.cq, spin, &mut out).await);
            match c.opcode {
                WcOpcode::Recv => {
                    got = true;
                    let buf = c.buf.expect("buf");
                    touch.apply(&buf, size);
                    let wr = RecvWr::new(c.wr_id, buf);
                    client.qp.post_recv(wr).map_err(|e| e.error).expect("recv");
                }
                _ => sent = true, // its send buffers go back to the pool as `c` drops
            }
        }
        Some(t.elapsed() / 2)
    })
    .await;
    echo.abort();
    samples
}

/// RDMA Read of `size` bytes; full round trip.
pub async fn read(client: Side, server: Side, size: usize, plan: Plan) -> Samples {
    let len = size.max(1);
    let target = server
        .pd
        .register(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
        .expect("reg");
    let remote = target.remote().at(0);
    let mut local = Some(client.pd.register(len, AccessFlags::LOCAL_WRITE).expect("reg"));
    let mut out = Vec::with_capacity(1);
    let r = sampler::run(plan, async || {
        let wr = SendWr::new(0, SendOp::Read { remote })
            .buf(local.take().expect("buffer"))
            .len(size);
        client.qp.post_send(wr).map_err(|e| e.error).expect("read");
        local = ok(next(&client.cq, spin_budget(), &mut out).await).buf;
        None
    })
    .await;
    drop((server, target));
    r
}

/// Fetch-and-add on an 8-byte word; full round trip.
pub async fn atomic(client: Side, server: Side, plan: Plan) -> Samples {
    let word = server
        .pd
        .register(8, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)
        .expect("reg");
    let remote = word.remote().at(0);
    let mut local = Some(client.pd.register(8, AccessFlags::LOCAL_WRITE).expect("reg"));
    let mut out = Vec::with_capacity(1);
    let r = sampler::run(plan, async || {
        let wr = SendWr::new(0, SendOp::FetchAdd { remote, add: 1 }).buf(local.take().expect("buffer"));
        client.qp.post_send(wr).map_err(|e| e.error).expect("faa");
        local = ok(next(&client.cq, spin_budget(), &mut out).await).buf;
        None
    })
    .await;
    drop((server, word));
    r
}

/// Whether the last of `len` bytes of `mr` reads `tag`, checked up to [`INNER_POLLS`] times
/// back to back (as ib_write_lat spins on it) before the caller gives way to the runtime.
fn landed(mr: &MemoryRegion, len: usize, tag: u8) -> bool {
    (0..INNER_POLLS).any(|_| {
        let seen = mr.bytes()[len - 1] == tag;
        if !seen {
            std::hint::spin_loop();
        }
        seen
    })
}

/// Write ping-pong as ib_write_lat: each side writes the other's buffer and polls its own last
/// byte for the round's tag; reports half the round trip.
pub async fn write(rt: &Handle, client: Side, server: Side, size: usize, plan: Plan) -> Samples {
    let len = size.max(1);
    let acc = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let (cdst, sdst) = (
        client.pd.register(len, acc).expect("reg"),
        server.pd.register(len, acc).expect("reg"),
    );
    let (to_server, to_client) = (sdst.remote().at(0), cdst.remote().at(0));
    let server = Arc::new((server, sdst));
    let srv = server.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let echo = rt.spawn(async move {
        let (s, mine) = (&srv.0, &srv.1);
        let mut writes = Signaler::new(&s.pd, len);
        let mut expect: u8 = 1;
        let mut out = Vec::with_capacity(1);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if !landed(mine, len, expect) {
                give_way().await;
                continue;
            }
            let mut b = writes.take();
            b.bytes_mut()[len - 1] = expect;
            let wr = inline(
                size,
                &s.qp,
                SendWr::new(
                    0,
                    SendOp::Write {
                        remote: to_client,
                        imm: None,
                    },
                )
                .buf(b)
                .len(len),
            );
            let (wr, signaled) = writes.mark(wr);
            s.qp.post_send(wr).map_err(|e| e.error).expect("write");
            if signaled {
                ok(next(&s.cq, spin_budget(), &mut out).await); // the pool's buffers come back
            }
            expect = expect.wrapping_add(1).max(1);
        }
    });
    let mut writes = Signaler::new(&client.pd, len);
    let mut tag = 1u8;
    let mut out = Vec::with_capacity(1);
    let r = sampler::run(plan, async || {
        let t = Instant::now();
        let mut b = writes.take();
        b.bytes_mut()[len - 1] = tag;
        let wr = SendWr::new(
            0,
            SendOp::Write {
                remote: to_server,
                imm: None,
            },
        )
        .buf(b)
        .len(len);
        let (wr, signaled) = writes.mark(inline(size, &client.qp, wr));
        client.qp.post_send(wr).map_err(|e| e.error).expect("write");
        if signaled {
            ok(next(&client.cq, spin_budget(), &mut out).await); // the pool's buffers come back
        }
        while !landed(&cdst, len, tag) {
            give_way().await;
        }
        tag = tag.wrapping_add(1).max(1);
        Some(t.elapsed() / 2)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = echo.await;
    r
}
