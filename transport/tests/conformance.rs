//! The conformance suite: the semantics every provider must keep, checked the same way on each.
//!
//! The provider comes from `RDMA_RPC_PROVIDER` (default `tcp`); the address to listen on from
//! `RDMA_RPC_TEST_IP` (default 127.0.0.1; on soft-RoCE, the IP of the rxe netdev).
//! Every wait is bounded, so a broken provider fails the suite instead of hanging it.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rdma_rpc_transport::*;

mod limits;
mod rng;
use rng::Rng;

/// Shared receive queues.
#[path = "conformance/srq.rs"]
mod srq;

/// The cases about what crosses the wire, with a target that may be on another host.
#[path = "conformance/across.rs"]
mod across;

const WAIT: Duration = Duration::from_secs(60);
const RW: AccessFlags = AccessFlags::ALL;

fn device() -> Device {
    Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER")
}

fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

/// One side of a connection: its own PD and CQ, as two processes would have.
struct Side {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

impl Side {
    fn reg(&self, len: usize, access: AccessFlags) -> MemoryRegion {
        self.pd.register(len, access).expect("register")
    }
    fn filled(&self, data: &[u8], access: AccessFlags) -> MemoryRegion {
        let mut mr = self.reg(data.len().max(1), access);
        mr.write_at(0, data).expect("fill");
        mr
    }
    fn post(&self, wr: SendWr) {
        self.qp.post_send(wr).map_err(|e| e.error).expect("post_send");
    }
    fn recv(&self, wr_id: u64, len: usize) {
        let buf = self.reg(len, AccessFlags::LOCAL_WRITE);
        self.qp
            .post_recv(RecvWr::new(wr_id, buf))
            .map_err(|e| e.error)
            .expect("post_recv");
    }
    async fn take(&self, n: usize) -> Vec<Completion> {
        take(&self.cq, n).await
    }
    async fn one(&self) -> Completion {
        self.take(1).await.pop().expect("one completion")
    }
}

/// Waits (bounded) for exactly `n` completions.
async fn take(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + WAIT;
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let want = n - out.len();
        tokio::time::timeout(left, cq.wait(&mut out, want))
            .await
            .unwrap_or_else(|_| panic!("timed out with {} of {n} completions: {out:?}", out.len()))
            .expect("cq wait");
    }
    out
}

/// Asserts that no completion arrives for a while.
async fn quiet(cq: &CompletionQueue) {
    let mut out = Vec::new();
    tokio::time::sleep(Duration::from_millis(100)).await;
    cq.poll(&mut out, 16).expect("poll");
    assert!(out.is_empty(), "unexpected completions: {out:?}");
}

fn pair_with(caps: QpCaps) -> (Side, Side) {
    let dev = device();
    let mk = || (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let ((spd, scq), (cpd, ccq)) = (mk(), mk());
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let sopts = QpOptions::new(&spd, &scq).caps(caps);
    let server = std::thread::spawn(move || {
        let req = listener.accept(Some(WAIT)).expect("accept");
        req.accept(&sopts, b"server").expect("accept qp")
    });
    let copts = QpOptions::new(&cpd, &ccq).caps(caps);
    let (cqp, data) = connect(addr, &copts, b"client", WAIT).expect("connect");
    assert_eq!(data, b"server");
    let sqp = server.join().expect("server thread");
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

fn pair() -> (Side, Side) {
    pair_with(QpCaps {
        max_send_wr: 1024,
        max_recv_wr: 1024,
        max_inline_data: 64,
    })
}

/// One more connection to `listener` (at `addr`): the server's QP with `sopts`, the client's
/// with `copts`, for tests whose QPs share PDs or CQs.
fn accept_and_connect(
    listener: &Listener,
    addr: SocketAddr,
    sopts: &QpOptions,
    copts: &QpOptions,
) -> (QueuePair, QueuePair) {
    std::thread::scope(|sc| {
        let server = sc.spawn(|| {
            listener
                .accept(Some(WAIT))
                .expect("accept")
                .accept(sopts, b"")
                .expect("the server's qp")
        });
        let (client, _) = connect(addr, copts, b"", WAIT).expect("connect");
        (server.join().expect("the accepting thread"), client)
    })
}

fn ok(c: &Completion) {
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
}

#[tokio::test]
async fn provider_is_the_one_asked_for() {
    let dev = device();
    let want = ProviderSpec::from_env().expect("spec");
    assert_eq!(dev.spec(), &want);
    println!(
        "provider {} device {} caps {:?}",
        dev.provider(),
        dev.name(),
        dev.caps()
    );
}

#[tokio::test]
async fn send_recv_delivers_bytes() {
    let (c, s) = pair();
    s.recv(7, 64);
    c.post(SendWr::send(1, c.filled(b"ping over rdma", AccessFlags::LOCAL_WRITE)));
    let sc = c.one().await;
    ok(&sc);
    assert_eq!((sc.wr_id, sc.opcode), (1, WcOpcode::Send));
    assert!(sc.buf.is_some(), "the send buffer comes back with its completion");
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(
        (rc.wr_id, rc.opcode, rc.byte_len, rc.imm),
        (7, WcOpcode::Recv, 14, None)
    );
    assert_eq!(&rc.buf.expect("recv buffer").bytes()[..14], b"ping over rdma");
}

/// The copy of a message's first bytes a completion may carry (`Completion::head`) is exactly
/// those bytes: shm gives it for every Send, the other providers give none.
#[tokio::test]
async fn a_receive_head_is_the_start_of_its_message() {
    let shm = device().provider() == "shm";
    let (c, s) = pair();
    let msgs = [b"ping".to_vec(), pattern(HEAD_MAX, 4), pattern(4096, 5)];
    for (i, m) in msgs.iter().enumerate() {
        s.recv(i as u64, 4096);
        c.post(SendWr::send(10 + i as u64, c.filled(m, AccessFlags::NONE)));
    }
    s.qp.post_recv(RecvWr::empty(3))
        .map_err(|e| e.error)
        .expect("empty recv");
    c.post(SendWr::new(13, SendOp::Send { imm: Some(1) }));
    c.take(4).await.iter().for_each(ok);
    let r = s.take(4).await;
    for (rc, m) in r.iter().zip(&msgs) {
        ok(rc);
        let want = if shm { &m[..m.len().min(HEAD_MAX)] } else { &[][..] };
        assert_eq!(rc.head.bytes(), want, "receive {}", rc.wr_id);
    }
    assert!(r[3].head.bytes().is_empty(), "no bytes, no head");
}

#[tokio::test]
async fn send_with_immediate_and_zero_bytes() {
    let (c, s) = pair();
    s.recv(1, 16);
    s.qp.post_recv(RecvWr::empty(2))
        .map_err(|e| e.error)
        .expect("empty recv");
    c.post(SendWr::new(10, SendOp::Send { imm: Some(0xdead_beef) }).buf(c.filled(b"abc", AccessFlags::NONE)));
    c.post(SendWr::new(11, SendOp::Send { imm: Some(7) }));
    let r = s.take(2).await;
    r.iter().for_each(ok);
    assert_eq!((r[0].byte_len, r[0].imm), (3, Some(0xdead_beef)));
    assert_eq!((r[1].wr_id, r[1].byte_len, r[1].imm), (2, 0, Some(7)));
    c.take(2).await.iter().for_each(ok);
}

#[tokio::test]
async fn rdma_write_lands_silently() {
    let (c, s) = pair();
    let target = s.reg(4096, RW);
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let wr = SendWr::new(
        3,
        SendOp::Write {
            remote: target.remote().at(100),
            imm: None,
        },
    );
    c.post(wr.buf(c.filled(&data, AccessFlags::NONE)));
    let wc = c.one().await;
    ok(&wc);
    assert_eq!(wc.opcode, WcOpcode::RdmaWrite);
    assert_eq!(&target.bytes()[100..1100], &data[..]);
    assert!(target.bytes()[..100].iter().all(|&b| b == 0));
    quiet(&s.cq).await; // a plain Write raises nothing at the target
}

/// On a device with path attributes (verbs), both sides of a connection agree: the same path
/// MTU from rdma_cm, Read depths that fit the other side's (each side's reads in flight at
/// most what the other serves), the ACK timeout on both sides, and retry counts that end
/// (never 7, "for ever" on rxe). The software providers have none.
#[tokio::test]
async fn both_sides_agree_the_path() {
    let (c, s) = pair();
    let (ca, sa) = (c.qp.path_attrs(), s.qp.path_attrs());
    if device().provider() != "verbs" {
        assert_eq!((ca, sa), (None, None), "a software provider reported path attributes");
        return;
    }
    let (ca, sa) = (
        ca.expect("the client's attributes"),
        sa.expect("the server's attributes"),
    );
    assert_eq!(ca.path_mtu, sa.path_mtu, "{ca:?} / {sa:?}");
    assert!((256..=4096).contains(&ca.path_mtu), "{ca:?}");
    assert!(
        ca.read_depth <= sa.read_responder && sa.read_depth <= ca.read_responder,
        "{ca:?} / {sa:?}"
    );
    assert!(ca.read_depth > 0 && sa.read_depth > 0, "{ca:?} / {sa:?}");
    for a in [ca, sa] {
        assert_eq!((a.ack_timeout, a.retry_count, a.rnr_retry), (18, 6, 6), "{a:?}");
    }
}

/// The zero-length Writes of `a_zero_length_write_needs_no_key`: ids and rkeys, none valid.
const KEYLESS: [(u64, u32); 2] = [(1, 0), (2, 0xdead_beef)];

/// A Write of no bytes to address 0 with `rkey`.
fn keyless_write(id: u64, rkey: u32) -> SendWr {
    SendWr::new(
        id,
        SendOp::Write {
            remote: RemoteAddr { addr: 0, rkey },
            imm: None,
        },
    )
}

/// A Write of no bytes touches no memory, so the target checks no key or address (IBA C9-88):
/// it completes with any rkey, raises nothing at the target, and proves the peer's NIC
/// answered (the keepalive probe of rdma-rpc's driver).
#[tokio::test]
async fn a_zero_length_write_needs_no_key() {
    let (c, s) = pair();
    for (id, rkey) in KEYLESS {
        c.post(keyless_write(id, rkey));
        let wc = c.one().await;
        ok(&wc);
        assert_eq!((wc.wr_id, wc.opcode, wc.byte_len), (id, WcOpcode::RdmaWrite, 0));
    }
    quiet(&s.cq).await;
    // The QP is still usable: a real Write after the probes lands.
    let target = s.reg(64, RW);
    c.post(
        SendWr::new(
            3,
            SendOp::Write {
                remote: target.remote().at(0),
                imm: None,
            },
        )
        .buf(c.filled(b"after", AccessFlags::NONE)),
    );
    ok(&c.one().await);
    assert_eq!(&target.bytes()[..5], b"after");
}

#[tokio::test]
async fn rdma_write_with_immediate_consumes_a_receive() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    s.recv(5, 8);
    s.qp.post_recv(RecvWr::empty(6)).map_err(|e| e.error).expect("recv");
    let wr = SendWr::new(
        1,
        SendOp::Write {
            remote: target.remote().at(0),
            imm: Some(42),
        },
    );
    c.post(wr.buf(c.filled(b"payload!", AccessFlags::NONE)));
    c.post(SendWr::new(
        2,
        SendOp::Write {
            remote: target.remote().at(0),
            imm: Some(43),
        },
    ));
    let r = s.take(2).await;
    r.iter().for_each(ok);
    assert_eq!(
        (r[0].wr_id, r[0].opcode, r[0].imm, r[0].byte_len),
        (5, WcOpcode::RecvRdmaWithImm, Some(42), 8)
    );
    assert_eq!((r[1].wr_id, r[1].imm, r[1].byte_len), (6, Some(43), 0));
    assert!(
        r[0].buf.as_ref().expect("buf").bytes().iter().all(|&b| b == 0),
        "imm data does not touch the receive buffer"
    );
    assert_eq!(&target.bytes()[..8], b"payload!");
    c.take(2).await.iter().for_each(ok);
}

#[tokio::test]
async fn rdma_read_pulls_bytes() {
    let (c, s) = pair();
    let mut source = s.reg(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let data: Vec<u8> = (0..8192u32).map(|i| (i ^ (i >> 8)) as u8).collect();
    source.write_at(0, &data).expect("fill");
    let dst = c.reg(4096, AccessFlags::LOCAL_WRITE);
    c.post(
        SendWr::new(
            9,
            SendOp::Read {
                remote: source.remote().at(4096),
            },
        )
        .buf(dst),
    );
    let wc = c.one().await;
    ok(&wc);
    assert_eq!((wc.opcode, wc.byte_len), (WcOpcode::RdmaRead, 4096));
    assert_eq!(&wc.buf.expect("buf").bytes()[..], &data[4096..]);
}

#[tokio::test]
async fn atomics_return_the_old_value() {
    let (c, s) = pair();
    let mut word = s.reg(16, RW);
    word.write_at(8, &100u64.to_ne_bytes()).expect("init");
    let remote = word.remote().at(8);
    let old = |wc: &Completion| u64::from_ne_bytes(wc.buf.as_ref().expect("buf").bytes()[..8].try_into().expect("8"));
    c.post(SendWr::new(1, SendOp::FetchAdd { remote, add: 5 }).buf(c.reg(8, AccessFlags::LOCAL_WRITE)));
    c.post(
        SendWr::new(
            2,
            SendOp::CompareSwap {
                remote,
                compare: 105,
                swap: 7,
            },
        )
        .buf(c.reg(8, AccessFlags::LOCAL_WRITE)),
    );
    c.post(
        SendWr::new(
            3,
            SendOp::CompareSwap {
                remote,
                compare: 105,
                swap: 9,
            },
        )
        .buf(c.reg(8, AccessFlags::LOCAL_WRITE)),
    );
    let r = c.take(3).await;
    r.iter().for_each(ok);
    assert_eq!(
        r.iter().map(|w| w.opcode).collect::<Vec<_>>(),
        [WcOpcode::FetchAdd, WcOpcode::CompSwap, WcOpcode::CompSwap]
    );
    assert_eq!(r.iter().map(old).collect::<Vec<_>>(), [100, 105, 7]);
    assert_eq!(r[0].byte_len, 8);
    assert_eq!(
        u64::from_ne_bytes(word.bytes()[8..].try_into().expect("8")),
        7,
        "second CAS failed, value stays"
    );
}

#[tokio::test]
async fn write_is_visible_before_a_later_send() {
    let (c, s) = pair();
    let target = s.reg(1 << 16, RW);
    for round in 0..20u8 {
        s.recv(u64::from(round), 8);
        let data = vec![round.wrapping_add(1); 1 << 16];
        let wr = SendWr::new(
            0,
            SendOp::Write {
                remote: target.remote().at(0),
                imm: None,
            },
        )
        .buf(c.filled(&data, AccessFlags::NONE));
        c.qp.post_send_batch([wr.unsignaled(), SendWr::send(1, c.filled(&[round], AccessFlags::NONE))])
            .map_err(|e| e.error)
            .expect("post");
        let rc = s.one().await;
        ok(&rc);
        assert!(
            target.bytes().iter().all(|&b| b == round.wrapping_add(1)),
            "round {round}: write not visible at the send"
        );
        c.one().await;
    }
}

#[tokio::test]
async fn thousand_pipelined_requests_complete_in_order() {
    let (c, s) = pair();
    let target = s.reg(8 * 1000, RW);
    let pool = BufferPool::new(&c.pd, 8, 1000, AccessFlags::LOCAL_WRITE).expect("pool");
    for i in 0..1000u64 {
        let mut b = pool.take().expect("buf");
        b.write_at(0, &i.to_le_bytes()).expect("fill");
        let op = if i % 3 == 2 {
            SendOp::Read {
                remote: target.remote().at(0),
            }
        } else {
            SendOp::Write {
                remote: target.remote().at(8 * i),
                imm: None,
            }
        };
        c.post(SendWr::new(i, op).buf(b));
    }
    let r = c.take(1000).await;
    r.iter().for_each(ok);
    assert_eq!(
        r.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..1000).collect::<Vec<_>>()
    );
    drop(r);
    assert_eq!(pool.available(), 1000, "every buffer is back in the pool");
    for i in (0..1000u64).filter(|i| i % 3 != 2) {
        assert_eq!(target.bytes()[8 * i as usize..][..8], i.to_le_bytes());
    }
}

/// One-sided requests are served while the target's application sleeps on its CQ, even more of
/// them at once than one poll takes (on tcp a sleeping waiter's poll reads the socket itself,
/// 64 frames at a time: what it reads ahead and leaves is the reader thread's, which no socket
/// readiness calls).
#[tokio::test]
async fn a_burst_of_reads_is_served_while_the_targets_application_sleeps_on_its_cq() {
    let (c, s) = pair();
    let target = s.filled(&pattern(8 * 512, 11), RW);
    let remote = target.remote();
    let cq = s.cq.clone();
    let sleeper = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(WAIT, cq.wait(&mut out, 1)).await;
        out.len()
    });
    // Asleep on its CQ by now (the test's runtime has one thread: the sleeper ran first).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let pool = BufferPool::new(&c.pd, 8, 1000, AccessFlags::LOCAL_WRITE).expect("pool");
    for i in 0..1000u64 {
        let remote = remote.at(8 * (i % 512));
        c.post(SendWr::new(i, SendOp::Read { remote }).buf(pool.take().expect("buf")));
    }
    let got = c.take(1000).await;
    let want = pattern(8 * 512, 11);
    for w in &got {
        ok(w);
        let at = 8 * (w.wr_id % 512) as usize;
        assert_eq!(
            w.buf.as_ref().expect("buf").bytes()[..8],
            want[at..at + 8],
            "read {}",
            w.wr_id
        );
    }
    sleeper.abort();
}

#[tokio::test]
async fn atomics_lose_nothing_under_two_contending_qps() {
    // Two clients, each with its own PD, CQ and QP, hit one word in the server's PD.
    let (c1, s) = pair();
    let dev = device();
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(8192).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_s_q2, q2) = accept_and_connect(
        &listener,
        addr,
        &QpOptions::new(&s.pd, &s.cq),
        &QpOptions::new(&cpd, &ccq),
    );
    let word = s.reg(8, RW);
    let remote = word.remote().at(0);
    const N: u64 = 5000;
    let mut olds = Vec::new();
    let mut posted = [0u64; 2];
    let mut done = [0u64; 2];
    let qps = [&c1.qp, &q2];
    let pds = [&c1.pd, &cpd];
    let cqs = [&c1.cq, &ccq];
    while done != [N, N] {
        for k in 0..2 {
            while posted[k] < N && posted[k] - done[k] < 64 {
                let wr = SendWr::new(posted[k], SendOp::FetchAdd { remote, add: 1 })
                    .buf(pds[k].register(8, AccessFlags::LOCAL_WRITE).expect("reg"));
                qps[k].post_send(wr).map_err(|e| e.error).expect("post");
                posted[k] += 1;
            }
            let mut out = Vec::new();
            cqs[k].poll(&mut out, 64).expect("poll");
            for wc in out {
                ok(&wc);
                olds.push(u64::from_ne_bytes(
                    wc.buf.expect("buf").bytes()[..8].try_into().expect("8"),
                ));
                done[k] += 1;
            }
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(
        u64::from_ne_bytes(word.bytes()[..8].try_into().expect("8")),
        2 * N,
        "no lost update"
    );
    olds.sort_unstable();
    assert_eq!(
        olds,
        (0..2 * N).collect::<Vec<_>>(),
        "every old value seen exactly once"
    );
}

/// Posts `wr` expecting a remote access error, and checks the target's bytes did not change.
async fn expect_remote_error(c: &Side, s: &Side, wr: SendWr, want: WcStatus, target: &MemoryRegion) {
    let before = target.bytes().to_vec();
    c.post(wr);
    let wc = c.one().await;
    assert_eq!(wc.status, want, "{wc:?}");
    assert!(wc.buf.is_some(), "the buffer comes back with the error");
    assert_eq!(&target.bytes()[..], &before[..], "target memory unchanged");
    assert!(c.qp.is_error(), "the initiator QP is in the error state");
    let _ = s;
}

#[tokio::test]
async fn wrong_rkey_is_a_remote_access_error() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let bad = RemoteAddr {
        addr: target.addr(),
        rkey: target.rkey() ^ 0x5a5a_0001,
    };
    let wr = SendWr::new(1, SendOp::Write { remote: bad, imm: None }).buf(c.filled(&[1; 16], AccessFlags::NONE));
    expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &target).await;
}

#[tokio::test]
async fn out_of_bounds_is_a_remote_access_error() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let wr = SendWr::new(
        1,
        SendOp::Write {
            remote: target.remote().at(60),
            imm: None,
        },
    )
    .buf(c.filled(&[1; 16], AccessFlags::NONE));
    expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &target).await;
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let wr = SendWr::new(
        2,
        SendOp::Read {
            remote: target.remote().at(32),
        },
    )
    .buf(c.reg(64, AccessFlags::LOCAL_WRITE));
    expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &target).await;
}

#[tokio::test]
async fn missing_access_flag_is_a_remote_access_error() {
    let lw = AccessFlags::LOCAL_WRITE;
    type OpOn = fn(RemoteAddr) -> SendOp;
    let cases: [(AccessFlags, OpOn); 3] = [
        (lw | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC, |r| {
            SendOp::Write { remote: r, imm: None }
        }),
        (lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC, |r| {
            SendOp::Read { remote: r }
        }),
        (lw | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE, |r| {
            SendOp::FetchAdd { remote: r, add: 1 }
        }),
    ];
    for (access, op) in cases {
        let (c, s) = pair();
        let mut target = s.reg(64, access);
        target.write_at(0, &[9; 64]).expect("fill");
        let wr = SendWr::new(1, op(target.remote().at(0))).buf(c.filled(&[1; 8], lw));
        expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &target).await;
    }
}

/// Bytes `i` of a pattern that differs per `seed` and has no short period.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13 ^ seed) as u8)
        .collect()
}

#[tokio::test]
async fn large_transfers_land_intact_and_in_order() {
    const MIB: usize = 1 << 20;
    let (c, s) = pair();
    let target = s.reg(2 * MIB, RW);
    s.recv(1, MIB);
    let (a, b) = (pattern(MIB, 1), pattern(MIB, 2));
    let at = target.remote().at((MIB / 2 + 3) as u64);
    // Pipelined: a Write, a Send, then a Read of what the Write put there (RC runs them in order).
    c.post(SendWr::new(10, SendOp::Write { remote: at, imm: None }).buf(c.filled(&a, AccessFlags::NONE)));
    c.post(SendWr::send(11, c.filled(&b, AccessFlags::NONE)));
    c.post(SendWr::new(12, SendOp::Read { remote: at }).buf(c.reg(MIB, AccessFlags::LOCAL_WRITE)));
    let done = c.take(3).await;
    done.iter().for_each(ok);
    assert_eq!(done.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [10, 11, 12]);
    assert!(
        done[2].buf.as_ref().expect("read buf").bytes()[..] == a[..],
        "the Read returns the Write's bytes"
    );
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(rc.byte_len as usize, MIB);
    assert!(
        rc.buf.expect("recv buf").bytes()[..] == b[..],
        "the Send's bytes arrive intact"
    );
    let t = target.bytes();
    assert!(t[MIB / 2 + 3..MIB / 2 + 3 + MIB] == a[..] && t[..MIB / 2 + 3].iter().all(|&x| x == 0));

    // A large Send that finds no receive waits (RNR) and lands once one is posted.
    let late = pattern(300 << 10, 3);
    c.post(SendWr::send(13, c.filled(&late, AccessFlags::NONE)));
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.recv(2, 512 << 10);
    ok(&c.one().await);
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(rc.byte_len as usize, late.len());
    assert!(rc.buf.expect("recv buf").bytes()[..late.len()] == late[..]);
}

/// A Send that finds no receive (RNR) with 8 MiB of Writes behind it: once a receive is posted,
/// the Send lands and then every Write, in order. (The software providers hold what arrives
/// behind the stalled Send only up to 4 MiB and then stop reading their link until the stall
/// ends: this is the path where they start reading again.)
#[tokio::test]
async fn writes_behind_a_send_waiting_for_a_receive_land_after_it() {
    const MIB: usize = 1 << 20;
    let (c, s) = pair();
    let target = s.reg(8 * MIB, RW);
    let head = pattern(256, 20);
    // Everything made first: the RNR budget (70 ms on the software providers) starts at the Send.
    let writes: Vec<_> = (0..8u32)
        .map(|i| c.filled(&pattern(MIB, 21 + i), AccessFlags::NONE))
        .collect();
    c.post(SendWr::send(1, c.filled(&head, AccessFlags::NONE)));
    for (i, data) in (0..8u32).zip(writes) {
        let at = target.remote().at(u64::from(i) * MIB as u64);
        c.post(SendWr::new(2 + u64::from(i), SendOp::Write { remote: at, imm: None }).buf(data));
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.recv(100, 4096);
    let done = c.take(9).await;
    done.iter().for_each(ok);
    assert_eq!(
        done.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (1..=9).collect::<Vec<_>>()
    );
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(rc.byte_len as usize, head.len());
    assert!(rc.buf.expect("recv buf").bytes()[..head.len()] == head[..]);
    let t = target.bytes();
    for i in 0..8u32 {
        let at = i as usize * MIB;
        assert!(t[at..at + MIB] == pattern(MIB, 21 + i)[..], "Write {i}'s bytes");
    }
}

/// Posts from `c` a Read of `len` bytes at `read_at` of `remote` (id 1) and a fetch-and-add of
/// `add` at `add_at` (id 2), then waits a moment for both to reach the target, whose
/// application holds that memory. (If they come later, what the case does next meets nothing
/// ahead of it: the case checks less, but never fails for it.)
fn reach_held_memory(c: &Side, remote: RemoteRegion, read_at: u64, len: usize, add_at: u64, add: u64) {
    let read = SendOp::Read {
        remote: remote.at(read_at),
    };
    c.post(SendWr::new(1, read).buf(c.reg(len, AccessFlags::LOCAL_WRITE)));
    let faa = SendOp::FetchAdd {
        remote: remote.at(add_at),
        add,
    };
    c.post(SendWr::new(2, faa).buf(c.reg(8, AccessFlags::LOCAL_WRITE)));
    std::thread::sleep(Duration::from_millis(100));
}

/// After [`reach_held_memory`] and the memory let go: the Read (id 1) returned `want`, the
/// fetch-and-add (id 2) the word's value `word` from before, and the word at `add_at` of
/// `target` holds `word + add`.
fn check_reached(reply: &[Completion], want: &[u8], target: &MemoryRegion, add_at: usize, word: u64, add: u64) {
    let by_id = |id| reply.iter().find(|w| w.wr_id == id).expect("a completion");
    assert!(
        by_id(1).buf.as_ref().expect("read buf").bytes()[..] == want[..],
        "the Read's bytes"
    );
    let old = by_id(2).buf.as_ref().expect("faa buf").bytes()[..8].to_vec();
    let old = u64::from_ne_bytes(old.try_into().expect("8 bytes"));
    assert_eq!(old, word, "the old value");
    let now = u64::from_ne_bytes(target.bytes()[add_at..add_at + 8].try_into().expect("8 bytes"));
    assert_eq!(now, word.wrapping_add(add), "the fetch-and-add applied");
}

/// The application holds a registration for writing while a peer's Read and fetch-and-add
/// reach it, and meanwhile posts on the same QP (a receive, then a Send from another buffer):
/// the posts return, and once the borrow ends the Read and the fetch-and-add complete. A NIC
/// takes no lock; the software providers do, and their responder must not wait for a
/// registration's lock while it holds the QP (on tcp the posts waited forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posting_while_holding_memory_a_peer_reaches_does_not_wait() {
    let (c, s) = pair();
    let mut target = s.filled(&pattern(4096, 30), AccessFlags::ALL);
    let want = target.bytes()[64..128].to_vec();
    let word = u64::from_ne_bytes(target.bytes()[8..16].try_into().expect("8 bytes"));
    c.recv(9, 64);
    let remote = target.remote();
    let (reply, sent) = {
        let held = target.bytes_mut();
        reach_held_memory(&c, remote, 64, 64, 8, 5);
        let (tx, rx) = std::sync::mpsc::channel();
        let (sqp, sbuf) = (&s.qp, s.filled(b"hello", AccessFlags::NONE));
        let rbuf = s.reg(64, AccessFlags::LOCAL_WRITE);
        std::thread::scope(|sc| {
            sc.spawn(move || {
                sqp.post_recv(RecvWr::new(7, rbuf))
                    .map_err(|e| e.error)
                    .expect("post_recv");
                sqp.post_send(SendWr::send(8, sbuf).len(5))
                    .map_err(|e| e.error)
                    .expect("post_send");
                let _ = tx.send(());
            });
            let posted = rx.recv_timeout(WAIT).is_ok();
            drop(held);
            assert!(
                posted,
                "posting on the QP waited for the registration the application held"
            );
        });
        (c.take(3).await, s.one().await)
    };
    reply.iter().for_each(ok);
    ok(&sent);
    let by_id = |id| reply.iter().find(|w| w.wr_id == id).expect("a completion");
    assert_eq!(by_id(9).byte_len, 5, "the Send posted meanwhile arrived");
    check_reached(&reply, &want, &target, 8, word, 5);
}

/// A NIC answers a peer's Read and atomic from host memory whatever the application does with
/// it, so a Send of the application's own never waits for them: an application that writes
/// into memory a peer reads and waits for its own Send's completion meanwhile gets it. The
/// acknowledgements it owes the peer still go after those answers (RC orders responses), and
/// the peer's completions come in order once the memory is let go.
#[tokio::test]
async fn a_send_completes_while_its_poster_holds_memory_a_peer_reads() {
    let (c, s) = pair();
    let mut target = s.filled(&pattern(4096, 31), AccessFlags::ALL);
    let want = target.bytes()[256..512].to_vec();
    let word = u64::from_ne_bytes(target.bytes()[16..24].try_into().expect("8 bytes"));
    c.recv(9, 64);
    c.recv(12, 64);
    s.recv(7, 64);
    let remote = target.remote();
    {
        let held = target.bytes_mut();
        reach_held_memory(&c, remote, 256, 256, 16, 7);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (scq, sqp) = (&s.cq, &s.qp);
        let (first, second) = (
            s.filled(b"while held", AccessFlags::NONE),
            s.filled(b"again", AccessFlags::NONE),
        );
        std::thread::scope(|sc| {
            sc.spawn(move || {
                // The application's own polls, on a thread that holds nothing else.
                let next = || {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut out = Vec::new();
                    while out.is_empty() && Instant::now() < deadline {
                        scq.poll(&mut out, 1).expect("poll");
                        std::thread::yield_now();
                    }
                    out.pop()
                };
                let post = |id, buf, len| {
                    sqp.post_send(SendWr::send(id, buf).len(len))
                        .map_err(|e| e.error)
                        .expect("post_send")
                };
                post(8, first, 10);
                let _ = done_tx.send(next());
                // The peer's Send arrives; what this side owes for it rides with the next Send.
                if go_rx.recv_timeout(WAIT).is_err() {
                    return;
                }
                let _ = done_tx.send(next());
                post(11, second, 5);
                let _ = done_tx.send(next());
            });
            let next = || done_rx.recv_timeout(WAIT).ok().flatten();
            let mut done = vec![next()];
            if done[0].is_some() {
                c.post(SendWr::send(10, c.filled(b"to the holder", AccessFlags::NONE)));
                let _ = go_tx.send(());
                done.extend([next(), next()]);
            }
            // The peer's Read and atomic may run only now.
            drop(held);
            let done: Vec<Completion> = done
                .into_iter()
                .map(|w| w.expect("a completion while the poster held memory a peer reads"))
                .collect();
            done.iter().for_each(ok);
            let ids: Vec<u64> = done.iter().map(|w| w.wr_id).collect();
            assert_eq!(ids, [8, 7, 11], "the holder's Send, its receive, its second Send");
        });
    }
    let reply = c.take(5).await;
    reply.iter().for_each(ok);
    let ids: Vec<u64> = reply
        .iter()
        .filter(|w| [1, 2, 10].contains(&w.wr_id))
        .map(|w| w.wr_id)
        .collect();
    assert_eq!(ids, [1, 2, 10], "the peer's requests complete in order");
    let by_id = |id| reply.iter().find(|w| w.wr_id == id).expect("a completion");
    assert_eq!(by_id(9).byte_len, 10, "the first Send arrived");
    assert_eq!(by_id(12).byte_len, 5, "the second Send arrived");
    check_reached(&reply, &want, &target, 16, word, 7);
}

/// Dropping a QP does not wait for a peer's Read or atomic that waits for memory the
/// application holds: the application may be the one dropping it.
#[tokio::test]
async fn a_qp_dropped_while_a_peer_reads_memory_its_application_holds_goes_at_once() {
    let (c, s) = pair();
    let mut target = s.filled(&pattern(4096, 32), AccessFlags::ALL);
    let remote = target.remote();
    let held = target.bytes_mut();
    reach_held_memory(&c, remote, 0, 64, 8, 1);
    let Side { qp, cq, pd } = s;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(qp);
        let _ = tx.send(());
    });
    let dropped = rx.recv_timeout(WAIT).is_ok();
    drop(held);
    assert!(dropped, "dropping the QP waited for memory its application held");
    drop((cq, pd, target, c));
}

/// Takes the next completion by polling back to back (an application spinning on its CQ).
async fn spin_one(cq: &CompletionQueue) -> Completion {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while cq.poll(&mut out, 1).expect("poll") == 0 {
        assert!(Instant::now() < deadline, "no completion while spinning");
        std::hint::spin_loop();
    }
    out.pop().expect("one")
}

/// A NIC acknowledges a Send when it lands, whatever the application does next: a receiver
/// that takes a message and drops its QP at once (a process that exits after its last message)
/// leaves the sender's Send completed, not failed as if nobody had taken it. On tcp the
/// acknowledgement of a message a spinning poll took may wait for this side's next request or
/// poll: dropping the QP sends it first.
#[tokio::test]
async fn a_send_taken_just_before_its_receiver_drops_the_qp_completes() {
    for round in 0..5 {
        let (c, s) = pair();
        s.recv(1, 64);
        s.recv(2, 64);
        // A first message while the receiver spins: on tcp its provider then leaves what comes
        // to the spinning polls, which acknowledge later.
        c.post(SendWr::send(1, c.filled(b"first", AccessFlags::NONE)));
        ok(&spin_one(&s.cq).await);
        ok(&c.one().await);
        c.post(SendWr::send(2, c.filled(b"last", AccessFlags::NONE)));
        let rc = spin_one(&s.cq).await;
        ok(&rc);
        drop(s);
        let sc = c.one().await;
        assert_eq!(
            (sc.status, sc.wr_id),
            (WcStatus::Success, 2),
            "round {round}: the last Send, which the receiver took: {sc:?}"
        );
    }
}

#[tokio::test]
async fn receive_buffer_too_small_is_a_length_error() {
    let (c, s) = pair();
    s.recv(1, 8);
    c.post(SendWr::send(2, c.filled(&[3; 64], AccessFlags::NONE)));
    let rc = s.one().await;
    // The IB spec and ConnectX say LOC_LEN_ERR; soft-RoCE (rxe, Linux 6.1) reports
    // LOC_QP_OP_ERR for the same event. Both are the receiver's local error for this message.
    assert!(
        matches!(rc.status, WcStatus::LocLenErr | WcStatus::LocQpOpErr),
        "{rc:?}"
    );
    let sc = c.one().await;
    assert!(!sc.status.is_success(), "the sender sees the failure too: {sc:?}");
}

#[tokio::test]
async fn send_with_no_receive_posted_is_rnr() {
    let (c, s) = pair();
    c.post(SendWr::send(1, c.filled(b"nobody home", AccessFlags::NONE)));
    let wc = c.one().await;
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
    assert!(c.qp.is_error());
    drop(s);
}

#[tokio::test]
async fn a_receive_posted_in_time_saves_the_send() {
    let (c, s) = pair();
    c.post(SendWr::send(1, c.filled(b"late receive", AccessFlags::NONE)));
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.recv(9, 64);
    ok(&c.one().await);
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(rc.byte_len, 12);
}

#[tokio::test]
async fn after_an_error_everything_outstanding_is_flushed() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    for i in 0..4 {
        c.recv(100 + i, 16);
    }
    s.recv(5, 8);
    let bad = RemoteAddr {
        addr: target.addr(),
        rkey: target.rkey().wrapping_add(1),
    };
    let mut wrs =
        vec![SendWr::new(0, SendOp::Write { remote: bad, imm: None }).buf(c.filled(&[1; 8], AccessFlags::NONE))];
    for i in 1..10 {
        let wr = SendWr::new(
            i,
            SendOp::Write {
                remote: target.remote().at(0),
                imm: None,
            },
        );
        wrs.push(wr.buf(c.filled(&[2; 8], AccessFlags::NONE)).unsignaled());
    }
    c.qp.post_send_batch(wrs).map_err(|e| e.error).expect("post");
    let r = c.take(14).await;
    let sends: Vec<_> = r.iter().filter(|w| w.wr_id < 100).collect();
    let recvs: Vec<_> = r.iter().filter(|w| w.wr_id >= 100).collect();
    assert_eq!(sends[0].status, WcStatus::RemAccessErr);
    assert_eq!(sends.len(), 10, "unsignaled requests are flushed with a completion too");
    assert!(sends[1..].iter().all(|w| w.status == WcStatus::WrFlushErr), "{sends:?}");
    assert_eq!(recvs.len(), 4);
    assert!(recvs
        .iter()
        .all(|w| w.status == WcStatus::WrFlushErr && w.buf.is_some()));
    assert!(
        target.bytes().iter().all(|&b| b == 0),
        "nothing after the error was executed"
    );
    // Posting to a QP in the error state completes at once with a flush error.
    c.post(SendWr::send(77, c.filled(b"late", AccessFlags::NONE)));
    let late = c.one().await;
    assert_eq!((late.wr_id, late.status), (77, WcStatus::WrFlushErr));
    // The peer learns of it: its QP goes to the error state and its receives are flushed.
    let sr = s.one().await;
    assert_eq!((sr.wr_id, sr.status), (5, WcStatus::WrFlushErr));
    assert!(s.qp.is_error());
}

#[tokio::test]
async fn unaligned_atomic_is_an_error() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let wr = SendWr::new(
        1,
        SendOp::FetchAdd {
            remote: target.remote().at(4),
            add: 1,
        },
    )
    .buf(c.reg(8, AccessFlags::LOCAL_WRITE));
    let err = c.qp.post_send(wr).expect_err("an unaligned atomic is refused");
    assert!(matches!(err.error, Error::InvalidArgument(_)), "{err}");
    assert_eq!(err.unposted.len(), 1);
    assert!(target.bytes().iter().all(|&b| b == 0));
    assert!(!c.qp.is_error(), "a refused post does not break the QP");
}

/// A CQ a waiter armed before a QP was attached to it wakes the waiter for that QP's
/// completions, as `ibv_req_notify_cq` covers every QP of the CQ: a server that waits on one CQ
/// for all its connections hears from the ones that come later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_begun_before_a_qp_joins_its_cq_wakes_for_that_qp() {
    let dev = device();
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    // The waiter first: the CQ is armed with no QP on it.
    let waiting = scq.clone();
    let waiter = tokio::spawn(async move {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), waiting.wait(&mut out, 1))
            .await
            .map(|r| r.map(|_| out))
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (sopts, copts) = (QpOptions::new(&spd, &scq), QpOptions::new(&cpd, &ccq));
    let (sqp, cqp) = accept_and_connect(&listener, addr, &sopts, &copts);
    sqp.post_recv(RecvWr::new(7, spd.register(16, AccessFlags::LOCAL_WRITE).expect("reg")))
        .map_err(|e| e.error)
        .expect("recv");
    let mut b = cpd.register(16, AccessFlags::NONE).expect("reg");
    b.write_at(0, &[5; 16]).expect("fill");
    cqp.post_send(SendWr::send(1, b)).map_err(|e| e.error).expect("send");
    let got = waiter
        .await
        .expect("the waiter")
        .expect("the waiter woke for the QP that joined after it armed the CQ")
        .expect("wait");
    let c = got.first().expect("a completion");
    ok(c);
    assert_eq!((c.wr_id, c.qp_num), (7, sqp.qp_num()));
    take(&ccq, 1).await.iter().for_each(ok);
}

#[tokio::test]
async fn many_qps_share_one_cq() {
    let dev = device();
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    const QPS: usize = 8;
    let sopts = QpOptions::new(&spd, &scq);
    let server = std::thread::spawn(move || {
        (0..QPS)
            .map(|_| {
                listener
                    .accept(Some(WAIT))
                    .expect("accept")
                    .accept(&sopts, b"")
                    .expect("qp")
            })
            .collect::<Vec<_>>()
    });
    let copts = QpOptions::new(&cpd, &ccq);
    let clients: Vec<QueuePair> = (0..QPS)
        .map(|_| connect(addr, &copts, b"", WAIT).expect("connect").0)
        .collect();
    let servers = server.join().expect("server");
    for (i, sq) in servers.iter().enumerate() {
        for j in 0..4 {
            sq.post_recv(RecvWr::new(
                (i * 10 + j) as u64,
                spd.register(16, AccessFlags::LOCAL_WRITE).expect("reg"),
            ))
            .map_err(|e| e.error)
            .expect("recv");
        }
    }
    for (i, cq) in clients.iter().enumerate() {
        for j in 0..4 {
            let mut b = cpd.register(16, AccessFlags::NONE).expect("reg");
            b.write_at(0, &[(i * 10 + j) as u8; 16]).expect("fill");
            cq.post_send(SendWr::send((i * 10 + j) as u64, b))
                .map_err(|e| e.error)
                .expect("send");
        }
    }
    let sent = take(&ccq, QPS * 4).await;
    sent.iter().for_each(ok);
    let got = take(&scq, QPS * 4).await;
    let nums: std::collections::HashSet<u32> = got.iter().map(|w| w.qp_num).collect();
    assert_eq!(nums.len(), QPS, "completions from every QP");
    for w in &got {
        ok(w);
        let qp_index = servers.iter().position(|q| q.qp_num() == w.qp_num).expect("known qp");
        assert_eq!(
            w.wr_id as usize / 10,
            qp_index,
            "completion routed to its own QP's receive"
        );
        assert!(w
            .buf
            .as_ref()
            .expect("buf")
            .bytes()
            .iter()
            .all(|&b| u64::from(b) == w.wr_id));
    }
}

#[tokio::test]
async fn connection_carries_private_data_and_can_be_rejected() {
    let dev = device();
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let req = listener.accept(Some(WAIT)).expect("accept");
        assert_eq!(&req.private_data()[..4], b"nope");
        req.reject();
    });
    let err = connect(addr, &QpOptions::new(&pd, &cq), b"nope", WAIT).expect_err("rejected");
    assert!(matches!(err, Error::Rejected), "{err}");
    server.join().expect("server");
    let too_long = [0u8; MAX_PRIVATE_DATA + 1];
    let err = connect(addr, &QpOptions::new(&pd, &cq), &too_long, WAIT).expect_err("too long");
    assert!(matches!(err, Error::PrivateDataTooLong { .. }), "{err}");
}

#[tokio::test]
async fn a_rejection_says_why_and_so_does_an_accept_that_fails() {
    let dev = device();
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    // A long reason keeps its start and its end (an error chain's root cause), within the limit.
    let long = format!("the frame: {}: the root cause", "context ".repeat(40));
    let server = std::thread::spawn({
        let (pd, long) = (dev.alloc_pd().expect("pd"), long.clone());
        let scq = dev.create_cq(16).expect("cq");
        move || {
            listener
                .accept(Some(WAIT))
                .expect("accept")
                .reject_with("no room — try later");
            listener.accept(Some(WAIT)).expect("accept").reject_with(&long);
            // This side's set-up fails (more receives than its queue holds): the peer is told.
            let opts = QpOptions::new(&pd, &scq).caps(QpCaps {
                max_recv_wr: 4,
                ..QpCaps::default()
            });
            let recvs = (0..8)
                .map(|i| RecvWr::new(i, pd.register(64, AccessFlags::LOCAL_WRITE).expect("buf")))
                .collect();
            let req = listener.accept(Some(WAIT)).expect("accept");
            let e = req.accept_with_recvs(&opts, b"", recvs).expect_err("too many receives");
            assert!(matches!(e, Error::QueueFull { .. }), "{e}");
        }
    });
    let opts = QpOptions::new(&pd, &cq);
    let why = |e: Error| match e {
        Error::RejectedWith(why) => why,
        e => panic!("not a rejection with a reason: {e}"),
    };
    let first = connect(addr, &opts, b"", WAIT).map(|_| ()).expect_err("rejected");
    assert_eq!(
        first.to_string(),
        "connection rejected by the peer: no room — try later"
    );
    assert_eq!(why(first), "no room — try later");
    let second = why(connect(addr, &opts, b"", WAIT).map(|_| ()).expect_err("rejected"));
    assert!(second.len() <= MAX_REJECT_REASON, "{} bytes", second.len());
    assert!(second.starts_with("the frame: context"), "{second}");
    assert!(
        second.contains("...") && second.ends_with("context : the root cause"),
        "{second}"
    );
    let third = why(connect(addr, &opts, b"", WAIT).map(|_| ()).expect_err("refused"));
    assert!(third.starts_with("its set-up failed: receive queue full"), "{third}");
    server.join().expect("server");
}

#[tokio::test]
async fn inline_sends_and_their_limit() {
    let (c, s) = pair();
    s.recv(1, 64);
    c.post(SendWr::send(1, c.filled(&[5; 32], AccessFlags::NONE)).inline());
    ok(&c.one().await);
    let rc = s.one().await;
    ok(&rc);
    assert_eq!(rc.byte_len, 32);
    let err =
        c.qp.post_send(SendWr::send(2, c.filled(&[5; 65], AccessFlags::NONE)).inline())
            .expect_err("too long");
    assert!(matches!(err.error, Error::InlineTooLarge { len: 65, max: 64 }), "{err}");
    assert_eq!(err.unposted.len(), 1, "the request and its buffer come back");
}

#[tokio::test]
async fn a_full_send_queue_refuses_and_returns_the_request() {
    let (c, s) = pair_with(QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_inline_data: 0,
    });
    let target = s.reg(8, RW);
    let wrs: Vec<SendWr> = (0..6)
        .map(|i| {
            SendWr::new(
                i,
                SendOp::Write {
                    remote: target.remote().at(0),
                    imm: None,
                },
            )
            .buf(c.filled(&[1; 8], AccessFlags::NONE))
        })
        .collect();
    let err = c.qp.post_send_batch(wrs).expect_err("queue full");
    assert!(
        matches!(
            err.error,
            Error::QueueFull {
                queue: "send",
                depth: 4
            }
        ),
        "{err}"
    );
    assert_eq!(err.unposted.iter().map(SendWr::wr_id).collect::<Vec<_>>(), [4, 5]);
    c.take(4).await.iter().for_each(ok);
}

#[tokio::test]
async fn unsignaled_buffers_return_with_a_later_signaled_completion() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let pool = BufferPool::new(&c.pd, 8, 10, AccessFlags::NONE).expect("pool");
    let mut wrs = Vec::new();
    for i in 0..10 {
        let wr = SendWr::new(
            i,
            SendOp::Write {
                remote: target.remote().at(0),
                imm: None,
            },
        )
        .buf(pool.take().expect("buf"));
        wrs.push(if i == 9 { wr } else { wr.unsignaled() });
    }
    c.qp.post_send_batch(wrs).map_err(|e| e.error).expect("post");
    assert_eq!(pool.available(), 0, "buffers in flight are not in the pool");
    let wc = c.one().await;
    ok(&wc);
    assert_eq!(wc.wr_id, 9);
    assert_eq!(pool.available(), 9, "the unsignaled requests' buffers came back");
    drop(wc);
    assert_eq!(pool.available(), 10);
}

/// Unsignaled Sends and Writes followed by a Read and an atomic: each response completes
/// what came before it (RC executes in order), and their buffers come back with it.
#[tokio::test]
async fn a_response_completes_the_unsignaled_requests_before_it() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let pool = BufferPool::new(&c.pd, 8, 6, AccessFlags::NONE).expect("pool");
    for i in 0..3 {
        s.recv(i, 8);
    }
    for i in 0..3 {
        c.post(SendWr::send(i, pool.take().expect("buf")).unsignaled());
    }
    let write = SendOp::Write {
        remote: target.remote().at(8),
        imm: None,
    };
    c.post(SendWr::new(3, write).buf(pool.take().expect("buf")).unsignaled());
    let read = SendOp::Read {
        remote: target.remote().at(0),
    };
    c.post(SendWr::new(4, read).buf(c.reg(16, AccessFlags::LOCAL_WRITE)));
    let wc = c.one().await;
    ok(&wc);
    assert_eq!((wc.wr_id, wc.opcode), (4, WcOpcode::RdmaRead));
    assert_eq!(pool.available(), 6, "the four unsignaled requests' buffers came back");
    assert_eq!(s.take(3).await.iter().filter(|w| w.status.is_success()).count(), 3);
    c.post(SendWr::new(5, write).buf(pool.take().expect("buf")).unsignaled());
    let faa = SendOp::FetchAdd {
        remote: target.remote().at(0),
        add: 1,
    };
    c.post(SendWr::new(6, faa).buf(c.reg(8, AccessFlags::LOCAL_WRITE)));
    let wc = c.one().await;
    ok(&wc);
    assert_eq!(wc.wr_id, 6);
    quiet(&c.cq).await;
}

#[tokio::test]
async fn dropping_a_qp_with_requests_in_flight_is_safe() {
    let (c, s) = pair();
    let pool = BufferPool::new(&c.pd, 4096, 64, AccessFlags::LOCAL_WRITE).expect("pool");
    let source = s.reg(4096, RW);
    for i in 0..64 {
        c.post(
            SendWr::new(
                i,
                SendOp::Read {
                    remote: source.remote().at(0),
                },
            )
            .buf(pool.take().expect("buf")),
        );
    }
    drop(c.qp);
    assert_eq!(pool.available(), 64, "destroying the QP released every buffer it held");
    drop(s);
}

/// An application may read its memory and poll its CQ on one thread, holding the memory's
/// guard across the poll, while the peer's Send, Read and atomic need that same registration.
/// On a software provider whose polls do the NIC's work, a poll that waited for that guard
/// would never return; it must leave such work to the provider's own thread, which finishes it
/// once the guard is gone. (The poll runs on a thread of its own so that a hang fails the test.)
#[tokio::test]
async fn polling_while_holding_the_memory_an_arrival_needs_neither_deadlocks_nor_loses_it() {
    let (c, s) = pair();
    let mut held = s.reg(8192, RW);
    let landing = held.split_off(4096).expect("split one registration in two");
    held.write_at(0, &pattern(64, 3)).expect("fill");
    held.write_at(64, &40u64.to_ne_bytes()).expect("fill");
    s.qp.post_recv(RecvWr::new(5, landing))
        .map_err(|e| e.error)
        .expect("post_recv");
    let (read_from, word) = (held.remote().at(0), held.remote().at(64));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let poller = std::thread::spawn(move || {
        let mut out = Vec::new();
        let guard = held.bytes();
        // Polls with the guard held while the peer's requests arrive.
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            s.cq.poll(&mut out, 16).expect("poll");
        }
        let seen_before = guard[0];
        drop(guard);
        let _ = done_tx.send(());
        let deadline = Instant::now() + WAIT;
        while out.is_empty() && Instant::now() < deadline {
            s.cq.poll(&mut out, 16).expect("poll");
            std::thread::yield_now();
        }
        (s, held, out, seen_before)
    });
    c.post(SendWr::send(
        1,
        c.filled(b"into the held registration", AccessFlags::LOCAL_WRITE),
    ));
    c.post(SendWr::new(2, SendOp::Read { remote: read_from }).buf(c.reg(64, AccessFlags::LOCAL_WRITE)));
    c.post(SendWr::new(3, SendOp::FetchAdd { remote: word, add: 2 }).buf(c.reg(8, AccessFlags::LOCAL_WRITE)));
    tokio::task::spawn_blocking(move || done_rx.recv_timeout(WAIT))
        .await
        .expect("join")
        .expect("a poll holding a guard of the memory the arrivals need returned: no deadlock");
    let r = c.take(3).await;
    r.iter().for_each(ok);
    assert_eq!(r.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(&r[1].buf.as_ref().expect("buf").bytes()[..], &pattern(64, 3)[..]);
    assert_eq!(&r[2].buf.as_ref().expect("buf").bytes()[..], &40u64.to_ne_bytes());
    let (s, held, out, seen_before) = tokio::task::spawn_blocking(move || poller.join().expect("poller"))
        .await
        .expect("join");
    assert_eq!(seen_before, pattern(64, 3)[0]);
    assert_eq!(out.len(), 1, "{out:?}");
    ok(&out[0]);
    assert_eq!((out[0].wr_id, out[0].byte_len), (5, 26));
    assert_eq!(
        &out[0].buf.as_ref().expect("buf").bytes()[..26],
        b"into the held registration"
    );
    assert_eq!(u64::from_ne_bytes(held.bytes()[64..72].try_into().expect("8")), 42);
    drop(s);
}

/// Borrows that read a registration share it: a peer's RDMA Read of memory the application is
/// reading completes meanwhile, and the application may borrow the same bytes again while the
/// provider waits to write into that registration (an arriving Send) — two reads of one buffer
/// in one expression must not deadlock. (The borrows live on a thread of their own, so that a
/// hang fails the test.)
#[tokio::test]
async fn readers_of_a_registration_share_it_even_with_a_writer_waiting() {
    let (c, s) = pair();
    let mut held = s.reg(8192, RW);
    let landing = held.split_off(4096).expect("split one registration in two");
    held.write_at(0, &pattern(64, 5)).expect("fill");
    s.qp.post_recv(RecvWr::new(9, landing))
        .map_err(|e| e.error)
        .expect("post_recv");
    let read_from = held.remote().at(0);
    let (borrowed_tx, borrowed_rx) = std::sync::mpsc::channel();
    let (again_tx, again_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let first = held.bytes();
        let _ = borrowed_tx.send(());
        // By now the peer's Send waits to write into the other half of the registration.
        let _ = release_rx.recv_timeout(WAIT);
        let second = held.bytes();
        let _ = again_tx.send(first[..64] == second[..64]);
        drop((first, second));
        (s, held)
    });
    tokio::task::spawn_blocking(move || borrowed_rx.recv_timeout(WAIT))
        .await
        .expect("join")
        .expect("borrowed");
    c.post(SendWr::new(1, SendOp::Read { remote: read_from }).buf(c.reg(64, AccessFlags::LOCAL_WRITE)));
    let read = c.one().await;
    ok(&read);
    assert_eq!(&read.buf.as_ref().expect("buf").bytes()[..], &pattern(64, 5)[..]);
    c.post(SendWr::send(
        2,
        c.filled(b"into the borrowed registration", AccessFlags::LOCAL_WRITE),
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = release_tx.send(());
    let same = tokio::task::spawn_blocking(move || again_rx.recv_timeout(WAIT))
        .await
        .expect("join")
        .expect("a second borrow while a writer waits returned: no deadlock");
    assert!(same, "both borrows read the same bytes");
    ok(&c.one().await);
    let (s, _held) = tokio::task::spawn_blocking(move || reader.join().expect("reader"))
        .await
        .expect("join");
    let got = s.one().await;
    ok(&got);
    assert_eq!(
        &got.buf.as_ref().expect("buf").bytes()[..30],
        b"into the borrowed registration"
    );
}

/// A target that has just polled its CQ (as after a completion of its own) and then spins on
/// its memory, not on the CQ, still sees each of the peer's Writes land: on a software provider
/// whose polls do the NIC's work, its own thread must take over when the polls stop.
#[tokio::test]
async fn writes_land_while_the_target_spins_on_memory_instead_of_its_cq() {
    let (c, s) = pair();
    let target = s.reg(64, RW);
    let remote = target.remote().at(0);
    for round in 1..=20u8 {
        let mut out = Vec::new();
        s.cq.poll(&mut out, 16).expect("poll");
        assert!(out.is_empty(), "{out:?}");
        let data = c.filled(&[round; 64], AccessFlags::LOCAL_WRITE);
        c.post(SendWr::new(u64::from(round), SendOp::Write { remote, imm: None }).buf(data));
        let deadline = Instant::now() + WAIT;
        while target.bytes()[63] != round {
            assert!(Instant::now() < deadline, "write {round} never landed");
            std::thread::yield_now();
        }
        assert_eq!(&target.bytes()[..], &[round; 64]);
        ok(&c.one().await);
    }
}

/// A target whose application polls its CQ until a Send arrives and then neither polls nor
/// posts for a while still acknowledges it: the initiator's completion does not wait for the
/// target's application (a NIC acknowledges by itself; a software provider that lets the
/// acknowledgement wait for the target's next request must send it anyway, and soon). Each
/// round the target goes quiet for 1.5 s; the initiator must see its completion within 1 s.
#[tokio::test]
async fn a_sends_completion_does_not_wait_for_the_targets_application() {
    let (c, s) = pair();
    let s = std::sync::Arc::new(s);
    for round in 0..3u64 {
        s.recv(round, 64);
        let target = s.clone();
        let quiet_target = std::thread::spawn(move || {
            let (mut out, deadline) = (Vec::new(), Instant::now() + WAIT);
            while out.is_empty() {
                assert!(Instant::now() < deadline, "the Send never arrived");
                target.cq.poll(&mut out, 1).expect("poll");
            }
            ok(&out[0]);
            std::thread::sleep(Duration::from_millis(1500));
        });
        c.post(SendWr::send(round, c.filled(b"ack me", AccessFlags::LOCAL_WRITE)));
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(1), c.cq.wait(&mut got, 1))
            .await
            .unwrap_or_else(|_| panic!("round {round}: no completion while the target's application is quiet"))
            .expect("cq wait");
        ok(&got[0]);
        assert_eq!(got[0].wr_id, round);
        quiet_target.join().expect("the target's thread");
    }
}

// ---- a peer process killed mid-stream ----

const CHILD_ENV: &str = "RDMA_RPC_CONFORMANCE_CHILD";

/// Not a test: the peer process of `a_killed_peer_turns_into_errors`, run by it with
/// `--ignored --exact child_peer`. Listens, hands out a region, then serves until killed.
#[test]
#[ignore = "helper process for a_killed_peer_turns_into_errors"]
fn child_peer() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let dev = device();
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    println!("LISTEN {}", listener.local_addr().expect("addr"));
    let region = pd.register(1 << 20, RW).expect("reg");
    let mut data = region.remote().addr.to_le_bytes().to_vec();
    data.extend_from_slice(&region.remote().len.to_le_bytes());
    data.extend_from_slice(&region.rkey().to_le_bytes());
    let _qp = listener
        .accept(Some(WAIT))
        .expect("accept")
        .accept(&QpOptions::new(&pd, &cq), &data)
        .expect("qp");
    std::thread::sleep(Duration::from_secs(600));
}

#[tokio::test]
async fn a_killed_peer_turns_into_errors() {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe().expect("exe");
    let mut child = tokio::process::Command::new(exe)
        .args(["--ignored", "--exact", "child_peer", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn child");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let addr: SocketAddr = loop {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("child listens")
            .expect("read")
            .expect("line");
        if let Some(at) = line.find("LISTEN ") {
            break line[at + 7..].trim().parse().expect("addr");
        }
    };
    let dev = device();
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    let (qp, data) = connect(addr, &QpOptions::new(&pd, &cq), b"", WAIT).expect("connect");
    let u64_at = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
    let rkey = u32::from_le_bytes(data[16..20].try_into().expect("4 bytes"));
    let remote = RemoteRegion {
        addr: u64_at(0),
        len: u64_at(8),
        rkey,
    };
    let pool = BufferPool::new(&pd, 4096, 32, AccessFlags::LOCAL_WRITE).expect("pool");
    let (mut posted, mut completed, mut killed_at) = (0u64, 0u64, None);
    let started = Instant::now();
    let first_error = loop {
        while let Some(b) = pool.take() {
            let op = if posted % 2 == 0 {
                SendOp::Write {
                    remote: remote.at(0),
                    imm: None,
                }
            } else {
                SendOp::Read {
                    remote: remote.at(4096),
                }
            };
            qp.post_send(SendWr::new(posted, op).buf(b))
                .map_err(|e| e.error)
                .expect("post");
            posted += 1;
        }
        let mut out = Vec::new();
        tokio::time::timeout(WAIT, cq.wait(&mut out, 32))
            .await
            .expect("completions keep coming: no hang")
            .expect("wait");
        if let Some(bad) = out.iter().find(|w| !w.status.is_success()) {
            break bad.status;
        }
        completed += out.len() as u64;
        if completed >= 200 && killed_at.is_none() {
            child.start_kill().expect("kill");
            killed_at = Some(Instant::now());
        }
        assert!(started.elapsed() < Duration::from_secs(300), "no error after the kill");
    };
    let killed_at = killed_at.expect("the peer was killed before any error");
    println!("first error {first_error:?} {:?} after the kill", killed_at.elapsed());
    assert!(
        matches!(
            first_error,
            WcStatus::RetryExcErr | WcStatus::WrFlushErr | WcStatus::RemAbortErr | WcStatus::RemOpErr
        ),
        "{first_error:?}"
    );
    // Everything else still outstanding fails too, promptly, and every buffer comes back.
    let deadline = Instant::now() + WAIT;
    while qp.outstanding_sends() > 0 {
        let mut out = Vec::new();
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, cq.wait(&mut out, 32))
            .await
            .expect("flush arrives")
            .expect("wait");
        assert!(out.iter().all(|w| !w.status.is_success() || w.opcode != WcOpcode::Recv));
    }
    assert!(qp.is_error());
    assert_eq!(pool.available(), pool.capacity());
    let _ = child.wait().await;
}

#[tokio::test]
async fn registered_bytes_count_until_the_last_piece_is_gone() {
    let (c, s) = pair();
    let dev = c.pd.device().clone();
    s.recv(1, 1 << 16); // (both sides share `dev`: the peer's receive buffer counts before `base`)
    let base = dev.registered_bytes();
    let mut mr = c.reg(1 << 16, AccessFlags::LOCAL_WRITE);
    assert_eq!(dev.registered_bytes(), base + (1 << 16));
    let tail = mr.split_off(4096).expect("split");
    drop(mr);
    assert_eq!(
        dev.registered_bytes(),
        base + (1 << 16),
        "a piece still names the registration"
    );
    // In flight, the work request holds the piece; its completion gives it back.
    c.post(SendWr::send(2, tail).len(100));
    let wc = c.one().await;
    ok(&wc);
    assert_eq!(dev.registered_bytes(), base + (1 << 16));
    drop(wc);
    assert_eq!(
        dev.registered_bytes(),
        base,
        "every byte comes back once the last piece is dropped"
    );
}

#[tokio::test]
async fn a_silent_client_does_not_hold_up_other_connections() {
    let dev = device();
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    // A plain TCP connection that never says anything (on verbs nothing listens on TCP there,
    // so this is refused, and the rest of the test still holds).
    let _silent = std::net::TcpStream::connect(addr);
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let opts = QpOptions::new(&pd, &cq);
    let client = std::thread::spawn(move || connect(addr, &opts, b"late", WAIT));
    let started = Instant::now();
    let req = listener
        .accept(Some(Duration::from_secs(5)))
        .expect("the real client's request");
    assert_eq!(req.private_data(), b"late");
    assert!(started.elapsed() < Duration::from_secs(5));
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let _qp = req.accept(&QpOptions::new(&spd, &scq), b"ok").expect("accept");
    let (_cqp, data) = client.join().expect("client").expect("connect");
    assert_eq!(data, b"ok");
}

#[tokio::test]
async fn a_registered_vector_is_read_written_bounds_checked_and_given_back() {
    let (c, s) = pair();
    let dev = c.pd.device().clone();
    let data = pattern(10_000, 3);
    // Lent: the peer reads it (not a whole number of words, at any offset).
    let lent =
        s.pd.register_vec(data.clone(), AccessFlags::REMOTE_READ)
            .expect("register a vector");
    assert_eq!(lent.len(), data.len());
    let dst = c.reg(data.len() - 3, AccessFlags::LOCAL_WRITE);
    c.post(
        SendWr::new(
            1,
            SendOp::Read {
                remote: lent.remote().at(3),
            },
        )
        .buf(dst),
    );
    let wc = c.one().await;
    ok(&wc);
    assert_eq!(&wc.buf.expect("buf").bytes()[..], &data[3..]);
    // The target of a Write, then given back with what landed.
    let target = s.pd.register_vec(vec![0u8; 100], RW).expect("register a vector");
    let base = dev.registered_bytes();
    let wr = SendWr::new(
        2,
        SendOp::Write {
            remote: target.remote().at(10),
            imm: None,
        },
    )
    .buf(c.filled(&[9; 20], AccessFlags::NONE));
    c.post(wr);
    ok(&c.one().await);
    let back = target.into_vec().expect("registered from a vector, whole, not in use");
    assert_eq!(back.len(), 100);
    assert!(back[..10].iter().chain(&back[30..]).all(|&b| b == 0));
    assert!(back[10..30].iter().all(|&b| b == 9));
    assert_eq!(dev.registered_bytes(), base - 100, "deregistered when given back");
    // Its bounds and access flags hold as any registration's do: a read past its end, and a
    // write into a vector lent for reading only, fail, and the bytes stay as they were.
    let wr = SendWr::new(
        3,
        SendOp::Read {
            remote: lent.remote().at(9_990),
        },
    )
    .buf(c.reg(64, AccessFlags::LOCAL_WRITE));
    expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &lent).await;
    let (c, s) = pair();
    let lent =
        s.pd.register_vec(data.clone(), AccessFlags::REMOTE_READ)
            .expect("register a vector");
    let wr = SendWr::new(
        4,
        SendOp::Write {
            remote: lent.remote().at(0),
            imm: None,
        },
    )
    .buf(c.filled(&[1; 16], AccessFlags::NONE));
    expect_remote_error(&c, &s, wr, WcStatus::RemAccessErr, &lent).await;
    assert_eq!(lent.into_vec().ok(), Some(data), "unchanged, and given back");
}

#[tokio::test]
async fn only_a_whole_unshared_vector_registration_is_given_back() {
    let (c, _s) = pair();
    let plain = c.reg(64, AccessFlags::LOCAL_WRITE);
    let plain = plain.into_vec().expect_err("not registered from a vector");
    assert_eq!(plain.len(), 64, "given back as it was");
    let mut v =
        c.pd.register_vec(vec![5u8; 64], AccessFlags::LOCAL_WRITE)
            .expect("register");
    let tail = v.split_off(32).expect("split");
    let mut v = v
        .into_vec()
        .expect_err("a piece, while another piece holds the registration");
    let tail = tail.into_vec().expect_err("a piece");
    v.unsplit(tail).expect("the two pieces join");
    let in_flight = v.split_off(64).expect("an empty piece at the end");
    let v = v
        .into_vec()
        .expect_err("whole, but another piece still names the registration");
    drop(in_flight);
    assert_eq!(v.into_vec().ok(), Some(vec![5u8; 64]), "whole and unshared: given back");
    let empty = c.pd.register_vec(Vec::new(), AccessFlags::LOCAL_WRITE);
    assert!(
        matches!(empty, Err(rdma_rpc_transport::Error::InvalidArgument(_))),
        "an empty vector is a zero-length registration"
    );
}

/// Asking for more memory than the machine has, or than the device allows, is an error, as
/// `ibv_reg_mr`'s ENOMEM or EINVAL is, not a process abort. Half a TiB where the device allows
/// that much (tcp, verbs): more than RAM and swap of any machine this runs on, which the kernel
/// refuses, unless it is set to grant any allocation (`vm.overcommit_memory = 1`), when the
/// untouched region may legitimately exist. One byte over `max_mr_size` everywhere.
#[test]
fn registering_more_memory_than_there_is_fails_cleanly() {
    let dev = device();
    let pd = dev.alloc_pd().expect("pd");
    let max = dev.caps().max_mr_size;
    if let Some(over) = max.checked_add(1).and_then(|n| usize::try_from(n).ok()) {
        let r = pd.register(over, AccessFlags::LOCAL_WRITE);
        assert!(
            matches!(r, Err(Error::InvalidArgument(_))),
            "{over} bytes: {:?}",
            r.map(|m| m.len())
        );
    }
    const HUGE: u64 = 1 << 39;
    if max >= HUGE {
        let grants_anything = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|s| s.trim() == "1");
        match pd.register(HUGE as usize, AccessFlags::LOCAL_WRITE) {
            Err(e) => assert!(matches!(e, Error::OutOfMemory { .. } | Error::Verbs { .. }), "{e}"),
            Ok(mr) => assert!(grants_anything, "{} bytes registered", mr.len()),
        }
    }
    // The device is fine afterwards.
    let mr = pd.register(4096, AccessFlags::LOCAL_WRITE).expect("a small region");
    assert_eq!(mr.len(), 4096);
}

/// A QP dropped with completions still in its CQ: they are cleaned from it (as ConnectX's
/// provider cleans a destroyed QP's entries), and the CQ goes on serving the QPs that share
/// it, each completion with the id its own request was posted with.
#[tokio::test]
async fn a_dropped_qps_completions_leave_the_cq_it_shared() {
    let dev = device();
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Two connections whose server ends share one CQ.
    let mut ends = Vec::new();
    for _ in 0..2 {
        let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
        let (sqp, cqp) = accept_and_connect(
            &listener,
            addr,
            &QpOptions::new(&spd, &scq),
            &QpOptions::new(&cpd, &ccq),
        );
        ends.push((
            sqp,
            Side {
                pd: cpd,
                cq: ccq,
                qp: cqp,
            },
        ));
    }
    // Each server QP posts receives with ids of its own; each client sends one message.
    for (k, (sqp, c)) in ends.iter().enumerate() {
        for i in 0..2 {
            let buf = spd.register(64, AccessFlags::LOCAL_WRITE).expect("register");
            sqp.post_recv(RecvWr::new(100 * k as u64 + 10 + i, buf))
                .map_err(|e| e.error)
                .expect("post_recv");
        }
        c.post(SendWr::send(1, c.filled(b"first", AccessFlags::LOCAL_WRITE)));
        ok(&c.one().await);
    }
    // The first server QP goes with its receive's completion unpolled: landed, and even
    // taken from the provider by `ready` (which holds what it reaps for the next poll).
    tokio::time::sleep(Duration::from_millis(100)).await;
    tokio::time::timeout(WAIT, scq.ready())
        .await
        .expect("a completion is there")
        .expect("ready");
    let (gone, _) = ends.remove(0);
    drop(gone);
    let (sqp, c) = &ends[0];
    c.post(SendWr::send(2, c.filled(b"second", AccessFlags::LOCAL_WRITE)));
    ok(&c.one().await);
    let got = take(&scq, 2).await;
    let ids: Vec<_> = got.iter().map(|w| (w.qp_num, w.wr_id, w.byte_len)).collect();
    let me = sqp.qp_num();
    assert_eq!(
        ids,
        [(me, 110, 5), (me, 111, 6)],
        "only the live QP's receives, by its ids"
    );
    quiet(&scq).await;
}

/// QPs made and dropped at random on two shared CQs (one per side) while Sends flow: every
/// completion names a live QP and the oldest request of that QP still waiting for one (RC
/// completes each queue in posting order), by the id it was posted with, and succeeds. Once
/// the churn ends, every request of the live QPs completes.
#[tokio::test]
async fn shared_cqs_under_churn_report_only_what_live_qps_posted() {
    use std::collections::{HashMap, VecDeque};
    struct Conn {
        server: QueuePair,
        client: QueuePair,
        recvs: VecDeque<u64>,
        sends: VecDeque<u64>,
        /// Sends posted, and receives completed.
        sent: usize,
        received: usize,
    }
    let dev = device();
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (sopts, copts) = (QpOptions::new(&spd, &scq), QpOptions::new(&cpd, &ccq));
    let open = || accept_and_connect(&listener, addr, &sopts, &copts);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Keyed by (side, qp_num): 0 the server's, 1 the client's.
    let mut live: HashMap<u32, usize> = HashMap::new();
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut next_id = 1u64;
    let (mut opened, mut dropped, mut checked) = (0, 0, 0);
    let mut check = |cq: &CompletionQueue, conns: &mut Vec<Option<Conn>>, live: &HashMap<u32, usize>| {
        let mut out = Vec::new();
        cq.poll(&mut out, 64).expect("poll");
        for wc in out {
            ok(&wc);
            let k = *live
                .get(&wc.qp_num)
                .unwrap_or_else(|| panic!("a completion of a QP that is not live: {wc:?}"));
            let c = conns[k].as_mut().expect("a live connection");
            let queue = if wc.qp_num == c.server.qp_num() {
                c.received += 1;
                &mut c.recvs
            } else {
                &mut c.sends
            };
            assert_eq!(
                queue.pop_front(),
                Some(wc.wr_id),
                "completed out of order or never posted: {wc:?}"
            );
            checked += 1;
        }
    };
    for _ in 0..8000 {
        let alive: Vec<usize> = (0..conns.len()).filter(|&k| conns[k].is_some()).collect();
        match rng.below(40) {
            0 if alive.len() < 5 => {
                let (server, client) = open();
                live.insert(server.qp_num(), conns.len());
                live.insert(client.qp_num(), conns.len());
                conns.push(Some(Conn {
                    server,
                    client,
                    recvs: VecDeque::new(),
                    sends: VecDeque::new(),
                    sent: 0,
                    received: 0,
                }));
                opened += 1;
            }
            1 if !alive.is_empty() => {
                // Both ends go, whatever they have in flight: none of it may be reported.
                let k = rng.pick(&alive);
                let c = conns[k].take().expect("live");
                live.remove(&c.server.qp_num());
                live.remove(&c.client.qp_num());
                let (client, server) = (c.client, c.server);
                if rng.below(2) == 0 {
                    drop(client);
                    drop(server);
                } else {
                    drop(server);
                    drop(client);
                }
                dropped += 1;
            }
            2..=17 if !alive.is_empty() => {
                let c = conns[rng.pick(&alive)].as_mut().expect("live");
                if c.recvs.len() < 8 {
                    let buf = spd.register(64, AccessFlags::LOCAL_WRITE).expect("register");
                    c.server
                        .post_recv(RecvWr::new(next_id, buf))
                        .map_err(|e| e.error)
                        .expect("post_recv");
                    c.recvs.push_back(next_id);
                    next_id += 1;
                }
            }
            18..=31 if !alive.is_empty() => {
                // Only into a receive posted already (no RNR): fewer Sends in flight than receives.
                let c = conns[rng.pick(&alive)].as_mut().expect("live");
                if c.sends.len() < c.recvs.len() {
                    let mut buf = cpd
                        .register(1 + rng.below(64) as usize, AccessFlags::LOCAL_WRITE)
                        .expect("register");
                    buf.write_at(0, &[7]).expect("fill");
                    c.client
                        .post_send(SendWr::send(next_id, buf))
                        .map_err(|e| e.error)
                        .expect("post_send");
                    c.sends.push_back(next_id);
                    c.sent += 1;
                    next_id += 1;
                }
            }
            _ => {
                check(&scq, &mut conns, &live);
                check(&ccq, &mut conns, &live);
                tokio::task::yield_now().await;
            }
        }
    }
    // Every Send of the live QPs completes, and the receive it landed in.
    let deadline = Instant::now() + WAIT;
    loop {
        check(&scq, &mut conns, &live);
        check(&ccq, &mut conns, &live);
        let unmatched = conns
            .iter()
            .flatten()
            .any(|c| !c.sends.is_empty() || c.received != c.sent);
        if !unmatched {
            break;
        }
        assert!(Instant::now() < deadline, "requests of live QPs never completed");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!("{opened} connections opened, {dropped} dropped, {checked} completions checked");
    assert!(
        opened > 20 && dropped > 15 && checked > 2000,
        "{opened} {dropped} {checked}"
    );
}

/// The NIC's local checks: a buffer of another protection domain, a Read or atomic result
/// into memory registered without LOCAL_WRITE, a receive buffer without it. Each fails its
/// request with LOC_PROT_ERR (the receive: the receiver's own local error), writes nothing
/// into the local buffer, and puts the QP in the error state.
#[tokio::test]
async fn local_protection_is_checked_as_the_nic_checks_it() {
    // ConnectX and the IB spec say LOC_PROT_ERR, and so do the software providers; soft-RoCE
    // (rxe, Linux 6.1) reports some of these as LOC_QP_OP_ERR, its local error for anything
    // its requester or responder cannot copy.
    let on_rxe = device().provider() == "verbs";
    let prot = |wc: &Completion, what: &str| {
        let rxe = on_rxe && wc.status == WcStatus::LocQpOpErr;
        assert!(wc.status == WcStatus::LocProtErr || rxe, "{what}: {wc:?}");
        println!("{what}: {:?}", wc.status);
    };
    // A Send from a buffer registered in another PD of the same device.
    let (c, _s) = pair();
    let other = c.pd.device().alloc_pd().expect("pd");
    let mut foreign = other.register(8, AccessFlags::LOCAL_WRITE).expect("register");
    foreign.write_at(0, b"elsewhre").expect("fill");
    c.post(SendWr::send(1, foreign));
    prot(&c.one().await, "a Send from another PD's buffer");
    assert!(c.qp.is_error());

    // An RDMA Read, and a fetch-and-add, whose local buffer may not be written.
    for (i, atomic) in [false, true].into_iter().enumerate() {
        let (c, s) = pair();
        let source = s.filled(&7u64.to_ne_bytes(), RW);
        let remote = source.remote().at(0);
        let op = if atomic {
            SendOp::FetchAdd { remote, add: 1 }
        } else {
            SendOp::Read { remote }
        };
        let local = c.filled(&[0; 8], AccessFlags::NONE);
        c.post(SendWr::new(i as u64, op).buf(local));
        let wc = c.one().await;
        prot(
            &wc,
            if atomic {
                "a fetch-and-add's result"
            } else {
                "an RDMA Read"
            },
        );
        let back = wc.buf.expect("the buffer comes back");
        assert_eq!(back.bytes()[..], [0; 8], "nothing was written into it");
        // Whether the target ran the fetch-and-add is not the local check's to say: rxe
        // checks the local buffer when the response comes back (the word is 8 by then), the
        // software providers before the request goes out (it stays 7).
        drop(source);
        assert!(c.qp.is_error());
    }

    // A receive whose buffer may not be written: the Send that lands in it fails on both sides.
    let (c, s) = pair();
    let rbuf = s.reg(64, AccessFlags::NONE);
    s.qp.post_recv(RecvWr::new(9, rbuf))
        .map_err(|e| e.error)
        .expect("post_recv");
    c.post(SendWr::send(3, c.filled(b"no write access", AccessFlags::NONE)));
    let rc = s.one().await;
    assert_eq!(rc.wr_id, 9);
    prot(&rc, "a receive");
    assert!(rc.buf.expect("the buffer comes back").bytes().iter().all(|&b| b == 0));
    let sc = c.one().await;
    assert!(!sc.status.is_success(), "the sender sees the failure too: {sc:?}");
}

/// Not a test: the process of `a_cq_waits_without_opening_a_descriptor`, alone in its process
/// so that nothing else opens or closes descriptors meanwhile (run with `--ignored --exact`).
#[test]
#[ignore = "helper process for a_cq_waits_without_opening_a_descriptor"]
fn child_descriptors() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let open = || std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (c, s) = pair();
        // Each CQ's first wait registers it with the runtime; it must not need a descriptor:
        // a process at its limit of open files would lose a live connection at its first
        // sleep (tcp and shm duplicated the doorbell and the socket set for it before).
        // Set-up's threads may still be closing what they used: count once nothing moves.
        let mut before = open();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = open();
            if now == before {
                break;
            }
            before = now;
        }
        for side in [&c, &s] {
            let waited = tokio::time::timeout(Duration::from_millis(50), side.cq.ready()).await;
            assert!(waited.is_err(), "nothing was sent, nothing completes");
        }
        let after = open();
        assert_eq!(after, before, "descriptors open before and after the first waits");
        // And the registration works: a Send wakes the waiting receiver.
        s.recv(1, 64);
        c.post(SendWr::send(1, c.filled(&[7; 8], AccessFlags::NONE)));
        ok(&s.one().await);
        println!("DESCRIPTORS OK {before} {after}");
    });
}

#[test]
fn a_cq_waits_without_opening_a_descriptor() {
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--ignored",
            "--exact",
            "child_descriptors",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("DESCRIPTORS OK"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a borrow of a registration shows does not change under it, also where a peer's Write
/// does not wait for it (on `shm` the peer's process writes the memory, on `verbs` the NIC):
/// there the borrow is a copy, since a Rust reference to memory written behind it would be
/// unsound. Once it ends, the Write shows. A mutable borrow changes only the bytes it changed:
/// a Write meanwhile to other bytes stays.
#[tokio::test]
async fn a_borrow_shows_bytes_that_do_not_change_under_it() {
    let (c, s) = pair();
    let mut target = s.reg(64, RW);
    target.write_at(0, &[1; 64]).expect("fill");
    let remote = target.remote();
    let write = |at: u64, byte: u8| {
        SendWr::new(
            u64::from(byte),
            SendOp::Write {
                remote: remote.at(at),
                imm: None,
            },
        )
        .buf(c.filled(&[byte; 8], AccessFlags::LOCAL_WRITE))
    };
    {
        let held = target.bytes();
        c.post(write(0, 2));
        // The Write lands at once on shm and verbs; on tcp it waits for the borrow.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(held.iter().all(|&b| b == 1), "the bytes changed under a borrow");
    }
    ok(&c.one().await);
    assert_eq!(&target.bytes()[..9], &[2, 2, 2, 2, 2, 2, 2, 2, 1]);
    {
        let mut m = target.bytes_mut();
        m[40] = 9;
        c.post(write(48, 3));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ok(&c.one().await);
    let now = target.bytes();
    assert_eq!((now[39], now[40], now[41]), (1, 9, 1), "the borrow's own change");
    assert_eq!(&now[48..56], &[3; 8], "the Write to other bytes");
}

#[tokio::test]
async fn a_thousand_qps_on_one_device_each_carry_a_message() {
    const QPS: usize = 1000;
    // Both ends here: each connection holds descriptors on both sides.
    limits::raise_fd_limit();
    let dev = device();
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let caps = QpCaps {
        max_send_wr: 2,
        max_recv_wr: 2,
        max_inline_data: 0,
    };
    let (sopts, copts) = (
        QpOptions::new(&spd, &scq).caps(caps),
        QpOptions::new(&cpd, &ccq).caps(caps),
    );
    let pairs: Vec<(QueuePair, QueuePair)> = (0..QPS)
        .map(|_| accept_and_connect(&listener, addr, &sopts, &copts))
        .collect();
    let rpool = BufferPool::new(&spd, 4, QPS, AccessFlags::LOCAL_WRITE).expect("buffers");
    let spool = BufferPool::new(&cpd, 4, QPS, AccessFlags::NONE).expect("buffers");
    for (i, (s, c)) in pairs.iter().enumerate() {
        s.post_recv(RecvWr::new(i as u64, rpool.take().expect("buffer")))
            .map_err(|e| e.error)
            .expect("post_recv");
        let mut b = spool.take().expect("buffer");
        b.write_at(0, &(i as u32).to_le_bytes()).expect("fill");
        c.post_send(SendWr::send(i as u64, b))
            .map_err(|e| e.error)
            .expect("post_send");
    }
    take(&ccq, QPS).await.iter().for_each(ok);
    let got = take(&scq, QPS).await;
    let mut seen = vec![false; QPS];
    for c in &got {
        ok(c);
        let i = c.wr_id as usize;
        assert_eq!(c.qp_num, pairs[i].0.qp_num(), "the receive posted on QP {i} names it");
        let b = c.buf.as_ref().expect("buffer");
        assert_eq!(u32::from_le_bytes(b.bytes()[..4].try_into().expect("4")), i as u32);
        assert!(!std::mem::replace(&mut seen[i], true), "QP {i} carried one message");
    }
}
