//! Baselines measured in the same run: a tokio TCP echo with TCP_NODELAY, and tarpc (bincode,
//! payload as `serde_bytes`), both on loopback.

use std::net::SocketAddr;

use futures::prelude::*;
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;

use crate::sampler::{self, Plan, Samples};

pub async fn tcp_echo(srv: &Handle, size: usize, plan: Plan) -> Samples {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    srv.spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = Vec::new();
        loop {
            let mut len = [0u8; 4];
            if s.read_exact(&mut len).await.is_err() {
                return;
            }
            let n = u32::from_le_bytes(len) as usize;
            buf.resize(4 + n, 0);
            buf[..4].copy_from_slice(&len);
            if s.read_exact(&mut buf[4..]).await.is_err() || s.write_all(&buf).await.is_err() {
                return;
            }
        }
    });
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let mut msg = (size as u32).to_le_bytes().to_vec();
    msg.extend(std::iter::repeat_n(0xa5u8, size));
    let mut back = vec![0u8; 4 + size];
    sampler::run(plan, async || {
        c.write_all(&msg).await.expect("write");
        c.read_exact(&mut back).await.expect("read");
        None
    })
    .await
}

#[tarpc::service]
pub trait Echo {
    async fn echo(data: serde_bytes::ByteBuf) -> serde_bytes::ByteBuf;
}

#[derive(Clone)]
pub struct EchoServer;

impl Echo for EchoServer {
    async fn echo(self, _: tarpc::context::Context, data: serde_bytes::ByteBuf) -> serde_bytes::ByteBuf {
        data
    }
}

pub async fn tarpc_echo(srv: &Handle, size: usize, plan: Plan) -> Samples {
    let mut incoming = tarpc::serde_transport::tcp::listen("127.0.0.1:0", Bincode::default)
        .await
        .expect("tarpc listen");
    incoming.config_mut().max_frame_length(usize::MAX);
    let addr: SocketAddr = incoming.local_addr();
    srv.spawn(async move {
        if let Some(Ok(t)) = incoming.next().await {
            BaseChannel::with_defaults(t)
                .execute(EchoServer.serve())
                .for_each(|f| async move {
                    tokio::spawn(f);
                })
                .await;
        }
    });
    let mut connect = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
    connect.config_mut().max_frame_length(usize::MAX);
    let transport = connect.await.expect("tarpc connect");
    let client = EchoClient::new(tarpc::client::Config::default(), transport).spawn();
    let payload = serde_bytes::ByteBuf::from(vec![0xa5u8; size]);
    sampler::run(plan, async || {
        let mut ctx = tarpc::context::current();
        ctx.deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
        let r = client.echo(ctx, payload.clone()).await.expect("tarpc echo");
        assert_eq!(r.len(), size);
        None
    })
    .await
}

/// A futex round trip: a message to a thread of the server runtime that sleeps until it comes,
/// and back to this one, which sleeps too. Both sides sleep in the kernel (`thread::park`)
/// without spinning or yielding first (std's channels spin and yield before they block, and so
/// caught most messages awake). On a KVM guest that halts idle vCPUs the row has two regimes:
/// an answer that comes before the other vCPU has halted takes a microsecond or two, one after
/// it tens (its 99th percentile shows them); the summary prints both beside event mode.
pub async fn wake(srv: &Handle, plan: Plan) -> Samples {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::thread::{self, Thread};

    /// Round `n` is asked for when `turn` is `2n + 1` and answered at `2n + 2`; `u64::MAX` ends.
    struct Pair {
        turn: AtomicU64,
        client: Thread,
    }
    let pair = Arc::new(Pair {
        turn: AtomicU64::new(0),
        client: thread::current(),
    });
    let (tx, rx) = std::sync::mpsc::sync_channel::<Thread>(1);
    let shared = Arc::clone(&pair);
    let echo = srv.spawn_blocking(move || {
        tx.send(thread::current()).expect("wake echo");
        let mut seen = 0;
        loop {
            let t = shared.turn.load(Ordering::Acquire);
            if t == u64::MAX {
                return;
            }
            if t > seen && t % 2 == 1 {
                seen = t + 1;
                shared.turn.store(seen, Ordering::Release);
                shared.client.unpark();
            } else {
                thread::park();
            }
        }
    });
    let server = rx.recv().expect("wake echo");
    let mut turn = 0u64;
    let samples = sampler::run(plan, async || {
        turn += 1;
        pair.turn.store(turn, Ordering::Release);
        server.unpark();
        turn += 1;
        while pair.turn.load(Ordering::Acquire) != turn {
            thread::park();
        }
        None
    })
    .await;
    pair.turn.store(u64::MAX, Ordering::Release);
    server.unpark();
    let _ = echo.await;
    samples
}

/// A round trip of one atomic word between this thread and a thread of the server runtime, both
/// spinning on it: each side waits for the other's store, so a round trip is two handoffs of
/// one cache line between the two cores, the floor of any messaging between those threads.
/// The summary counts the other round trips in it. It moves with the host's placement of the
/// two vCPUs: DESIGN.md measured about 80 ns; on a later hour a plain two-thread ping-pong took
/// 134-233 ns, and this row (which also reads the clock twice a round trip, as every row does)
/// 255-362 ns; everything on shm moves with it.
pub async fn spin_word(srv: &Handle, plan: Plan) -> Samples {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// Spins without news before a side offers its core (`--cpus 0,0` puts both on one; on
    /// two cores a round trip takes a few dozen spins).
    const PATIENCE: u32 = 4096;
    fn wait_a_little(spins: &mut u32) {
        *spins += 1;
        if *spins % PATIENCE == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    // Round `n` is asked for when the word is `2n + 1` and answered at `2n + 2`; `u64::MAX`
    // ends. Timed per round trip like every other row (two clock reads in each sample).
    let word = Arc::new(AtomicU64::new(0));
    let shared = Arc::clone(&word);
    let echo = srv.spawn_blocking(move || {
        let (mut seen, mut spins) = (0, 0);
        loop {
            let t = shared.load(Ordering::Acquire);
            if t == u64::MAX {
                return;
            }
            if t > seen && t % 2 == 1 {
                seen = t + 1;
                shared.store(seen, Ordering::Release);
                spins = 0;
            } else {
                wait_a_little(&mut spins);
            }
        }
    });
    let mut turn = 0u64;
    let samples = sampler::run(plan, async || {
        turn += 1;
        word.store(turn, Ordering::Release);
        turn += 1;
        let mut spins = 0;
        while word.load(Ordering::Acquire) != turn {
            wait_a_little(&mut spins);
        }
        None
    })
    .await;
    word.store(u64::MAX, Ordering::Release);
    let _ = echo.await;
    samples
}

/// Round trips the gauge after each row takes.
const GAUGE_TRIPS: usize = 2000;

/// The two threads' cross-core round trip right now, in ns: the median of `GAUGE_TRIPS` round
/// trips of [`spin_word`] (under a millisecond on two cores). The harness takes it after each
/// row: on an AMD EPYC guest the host moved the two vCPUs, several times an hour, between places
/// where this took 90-100 ns and places where it took 380-400 ns, and every shm row moved with
/// it (the raw 64 B Send from 0.29-0.34 to 0.59 µs each way).
pub async fn cross_core(srv: &Handle) -> Option<f64> {
    let plan = Plan {
        iters: Some(GAUGE_TRIPS),
        per_row: std::time::Duration::ZERO,
        min_iters: 1,
        max_iters: GAUGE_TRIPS,
    };
    let mut t = spin_word(srv, plan).await.times;
    t.sort_unstable();
    t.get(t.len() / 2).map(|d| d.as_secs_f64() * 1e9)
}

/// A plain copy of `size` bytes between two buffers of this process: the speed limit of any
/// software provider on one host.
pub async fn memcpy(size: usize, plan: Plan) -> Samples {
    let src = vec![0x3cu8; size];
    let mut dst = vec![0u8; size];
    sampler::run(plan, async || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        None
    })
    .await
}
