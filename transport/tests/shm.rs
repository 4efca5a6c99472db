//! What only the shm provider promises: one-sided operations, and Sends that find a posted
//! receive, need no CPU of the target process (they complete while it is stopped), and a peer
//! killed mid-transfer turns into errors at once.
//! The rest of its semantics are the conformance suite's (run it with RDMA_RPC_PROVIDER=shm).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdma_rpc_transport::{
    connect, AccessFlags, Completion, CompletionQueue, Device, Listener, ProtectionDomain, QpOptions, QueuePair,
    RecvWr, RemoteRegion, SendOp, SendWr, WcStatus,
};

const CHILD_ENV: &str = "RDMA_RPC_SHM_CHILD";
const WAIT: Duration = Duration::from_secs(20);

fn encode(r: &RemoteRegion) -> Vec<u8> {
    let mut v = r.addr.to_le_bytes().to_vec();
    v.extend_from_slice(&r.len.to_le_bytes());
    v.extend_from_slice(&r.rkey.to_le_bytes());
    v
}

fn decode(b: &[u8]) -> RemoteRegion {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
    RemoteRegion {
        addr: u64_at(0),
        len: u64_at(8),
        rkey: u32::from_le_bytes(b[16..20].try_into().expect("4")),
    }
}

/// Not a test: the target process. Registers 4 KiB (bytes `i as u8`, word 64 = 100), accepts
/// one connection with one 64-byte receive posted, then on each line from stdin prints its bytes
/// 0..8, word 64 and what the receive got.
#[test]
#[ignore = "helper process for the shm tests"]
fn shm_target() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let dev = Device::open("shm").expect("shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let access =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let mut mr = pd.register(4096, access).expect("register");
    for (i, b) in mr.bytes_mut().iter_mut().enumerate() {
        *b = i as u8;
    }
    mr.write_at(64, &100u64.to_ne_bytes()).expect("word");
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    println!("LISTEN {}", listener.local_addr().expect("addr"));
    let req = listener.accept(Some(WAIT)).expect("a connection");
    let recv = RecvWr::new(9, pd.register(64, AccessFlags::LOCAL_WRITE).expect("recv buffer"));
    let _qp = req
        .accept_with_recvs(&QpOptions::new(&pd, &cq), &encode(&mr.remote()), vec![recv])
        .expect("accept");
    let mut received = String::from("none");
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
        let mut done = Vec::new();
        cq.poll(&mut done, 8).expect("poll");
        for c in done {
            if let Some(b) = c.buf {
                received = String::from_utf8_lossy(&b.bytes()[..c.byte_len as usize]).into_owned();
            }
        }
        let b = mr.bytes();
        let word = u64::from_ne_bytes(b[64..72].try_into().expect("8"));
        println!("BYTES {:?} WORD {word} RECV {received}", &b[..8]);
    }
}

struct Target {
    child: Child,
    addr: SocketAddr,
    out: BufReader<std::process::ChildStdout>,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn target() -> Target {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args(["--ignored", "--exact", "shm_target", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the target");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let addr = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).expect("read") > 0, "the target ended early");
        if let Some(at) = line.find("LISTEN ") {
            break line[at + 7..].trim().parse().expect("addr");
        }
    };
    Target { child, addr, out }
}

async fn one(cq: &CompletionQueue) -> Completion {
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, cq.wait(&mut out, 1))
        .await
        .expect("a completion in time")
        .expect("wait");
    out.pop().expect("one")
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig}");
}

#[tokio::test]
async fn one_sided_operations_complete_while_the_target_process_is_stopped() {
    let mut t = target();
    let dev = Device::open("shm").expect("shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let (qp, data) = connect(t.addr, &QpOptions::new(&pd, &cq), b"", WAIT).expect("connect");
    let region = decode(&data);

    signal(&t.child, "-STOP");
    let started = Instant::now();
    let buf = pd.register(8, AccessFlags::LOCAL_WRITE).expect("buf");
    qp.post_send(SendWr::new(1, SendOp::Read { remote: region.at(0) }).buf(buf))
        .map_err(|e| e.error)
        .expect("post read");
    let c = one(&cq).await;
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(&c.buf.expect("buf").bytes()[..], &[0, 1, 2, 3, 4, 5, 6, 7]);

    let mut src = pd.register(8, AccessFlags::LOCAL_WRITE).expect("src");
    src.write_at(0, b"written!").expect("fill");
    let write = SendOp::Write {
        remote: region.at(0),
        imm: None,
    };
    qp.post_send(SendWr::new(2, write).buf(src))
        .map_err(|e| e.error)
        .expect("post write");
    assert_eq!(one(&cq).await.status, WcStatus::Success);

    let word = region.at(64);
    let faa = SendOp::FetchAdd { remote: word, add: 5 };
    qp.post_send(SendWr::new(3, faa).buf(pd.register(8, AccessFlags::LOCAL_WRITE).expect("b")))
        .map_err(|e| e.error)
        .expect("post faa");
    let c = one(&cq).await;
    assert_eq!(
        u64::from_ne_bytes(c.buf.expect("buf").bytes()[..8].try_into().expect("8")),
        100
    );
    let cas = SendOp::CompareSwap {
        remote: word,
        compare: 105,
        swap: 7,
    };
    qp.post_send(SendWr::new(4, cas).buf(pd.register(8, AccessFlags::LOCAL_WRITE).expect("b")))
        .map_err(|e| e.error)
        .expect("post cas");
    let c = one(&cq).await;
    assert_eq!(
        u64::from_ne_bytes(c.buf.expect("buf").bytes()[..8].try_into().expect("8")),
        105
    );
    // A Send into the receive the target posted before it stopped: delivered by us.
    let mut msg = pd.register(16, AccessFlags::LOCAL_WRITE).expect("msg");
    msg.write_at(0, b"while you slept").expect("fill");
    qp.post_send(SendWr::send(5, msg).len(15))
        .map_err(|e| e.error)
        .expect("post send");
    assert_eq!(one(&cq).await.status, WcStatus::Success);
    println!(
        "read, write, FAA, CAS and a Send took {:?} with the target stopped",
        started.elapsed()
    );

    // The target, resumed, sees what was done to its memory while it slept.
    signal(&t.child, "-CONT");
    writeln!(t.child.stdin.as_mut().expect("stdin")).expect("ask");
    let mut line = String::new();
    t.out.read_line(&mut line).expect("answer");
    assert_eq!(
        line.trim(),
        format!("BYTES {:?} WORD 7 RECV while you slept", b"written!")
    );
}

#[tokio::test]
async fn a_peer_killed_mid_transfer_fails_the_transfer_at_once() {
    let mut t = target();
    let dev = Device::open("shm").expect("shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let (qp, _) = connect(t.addr, &QpOptions::new(&pd, &cq), b"", WAIT).expect("connect");
    // The first Send fills the one receive the target posted; the rest find none and wait
    // (RNR) in its engine, in flight, when the process dies.
    for i in 0..8 {
        let mut b = pd.register(4096, AccessFlags::LOCAL_WRITE).expect("buf");
        b.write_at(0, &[i as u8; 16]).expect("fill");
        qp.post_send(SendWr::send(i, b).len(16))
            .map_err(|e| e.error)
            .expect("post");
    }
    t.child.kill().expect("kill");
    let killed = Instant::now();
    assert_eq!(one(&cq).await.status, WcStatus::Success, "the first Send had a receive");
    let first = one(&cq).await;
    assert!(
        matches!(first.status, WcStatus::RetryExcErr | WcStatus::WrFlushErr),
        "{first:?}"
    );
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "the survivor saw the death after {:?}",
        killed.elapsed()
    );
    let mut rest = Vec::new();
    while rest.len() < 6 {
        let c = one(&cq).await;
        assert!(!c.status.is_success());
        rest.push(c);
    }
    assert!(qp.is_error());
    println!("first error {:?} {:?} after the kill", first.status, killed.elapsed());
}

/// Two QPs of this process connected over shm, each with its PD and a CQ of `depth`.
struct Connected {
    server: (ProtectionDomain, CompletionQueue, QueuePair),
    client: (ProtectionDomain, CompletionQueue, QueuePair),
}

fn connected(depth: u32) -> Connected {
    let dev = Device::open("shm").expect("shm");
    let mk = || (dev.alloc_pd().expect("pd"), dev.create_cq(depth).expect("cq"));
    let ((spd, scq), (cpd, ccq)) = (mk(), mk());
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let sopts = QpOptions::new(&spd, &scq);
    let accepting = std::thread::spawn(move || {
        let req = listener.accept(Some(WAIT)).expect("a connection");
        req.accept(&sopts, b"").expect("accept")
    });
    let (cqp, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", WAIT).expect("connect");
    let sqp = accepting.join().expect("accept thread");
    Connected {
        server: (spd, scq, sqp),
        client: (cpd, ccq, cqp),
    }
}

/// A task asleep on its CQ (armed, no thread of its process polling) is woken by the peer's
/// direct delivery into its posted receive: the sender rings the CQ's doorbell itself.
#[tokio::test]
async fn a_delivery_wakes_the_task_asleep_on_the_cq() {
    let Connected {
        server: (spd, scq, sqp),
        client: (cpd, ccq, cqp),
    } = connected(16);
    for round in 0..3u64 {
        let recv = RecvWr::new(round, spd.register(64, AccessFlags::LOCAL_WRITE).expect("recv buffer"));
        sqp.post_recv(recv).map_err(|e| e.error).expect("post recv");
        let waiter = {
            let scq = scq.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                scq.wait(&mut got, 1).await.expect("wait");
                got.pop().expect("one completion")
            })
        };
        // Let the waiter arm its CQ and fall asleep before the Send is posted.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut msg = cpd.register(8, AccessFlags::LOCAL_WRITE).expect("send buffer");
        msg.write_at(0, &round.to_le_bytes()).expect("write");
        cqp.post_send(SendWr::send(100 + round, msg))
            .map_err(|e| e.error)
            .expect("send");
        let c = tokio::time::timeout(WAIT, waiter)
            .await
            .expect("the sleeping waiter was never woken")
            .expect("waiter task");
        assert_eq!(c.status, WcStatus::Success);
        assert_eq!(c.wr_id, round);
        let b = c.buf.expect("receive buffer");
        assert_eq!(&b.bytes()[..8], &round.to_le_bytes());
        one(&ccq).await.ok().expect("send completion");
    }
}

/// A stopped target process (SIGSTOP) keeps its socket open, so its death is not what ends
/// the wait: its heartbeat stands still, and within the keepalive a Send that waits for it
/// (no receive posted, so its engine must answer) fails instead of waiting for ever.
#[tokio::test]
async fn a_stopped_peer_is_taken_for_dead_within_the_keepalive() {
    let t = target();
    let dev = Device::open("shm").expect("shm");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(64).expect("cq"));
    let (qp, _) = connect(t.addr, &QpOptions::new(&pd, &cq), b"", WAIT).expect("connect");
    signal(&t.child, "-STOP");
    let started = Instant::now();
    for id in [1, 2] {
        let mut msg = pd.register(8, AccessFlags::LOCAL_WRITE).expect("msg");
        msg.write_at(0, b"anyone?").expect("fill");
        qp.post_send(SendWr::send(id, msg).len(7))
            .map_err(|e| e.error)
            .expect("post send");
    }
    // The first takes the receive the target posted (delivered by us); the second waits.
    assert_eq!(one(&cq).await.status, WcStatus::Success);
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(40), cq.wait(&mut out, 1))
        .await
        .expect("the waiting Send ends once the stopped peer is taken for dead")
        .expect("wait");
    let c = out.pop().expect("one");
    assert_eq!(c.wr_id, 2);
    assert!(!c.status.is_success(), "a Send to a stopped peer: {c:?}");
    println!("a stopped peer was taken for dead after {:?}", started.elapsed());
    assert!(qp.is_error());
}

/// Sends are delivered through the receiver's staging area (1 MiB), which its polls copy into
/// the receives' own buffers. Past it, Sends go on as frames: 48 Sends of 32 KiB into 48
/// receives nobody drains meanwhile all arrive, whole and in order. A poll made while the
/// application holds a borrow of the registration the receives are pieces of returns; their
/// completions come once it lets go. And a Send that lands across the area's end arrives whole.
#[tokio::test]
async fn sends_past_the_staging_area_and_behind_a_held_buffer_arrive_whole_and_in_order() {
    const N: usize = 48;
    const LEN: usize = 32 << 10;
    let Connected {
        server: (spd, scq, sqp),
        client: (cpd, ccq, cqp),
    } = connected(256);
    let mut fill = 0u8;
    for (sends, hold) in [(N, false), (4, true)] {
        // One registration: the receive pieces, and a last piece the application keeps.
        let mut all = spd
            .register((sends + 1) * LEN, AccessFlags::LOCAL_WRITE)
            .expect("register");
        let kept = all.split_off(sends * LEN).expect("split");
        for i in 0..sends {
            let rest = all.split_off(LEN).expect("split");
            sqp.post_recv(RecvWr::new(i as u64, std::mem::replace(&mut all, rest)))
                .map_err(|e| e.error)
                .expect("post_recv");
        }
        let guard = hold.then(|| kept.bytes());
        let first = fill;
        for i in 0..sends {
            let mut b = cpd.register(LEN, AccessFlags::LOCAL_WRITE).expect("buf");
            fill = fill.wrapping_add(1);
            b.write_at(0, &vec![fill; LEN]).expect("fill");
            cqp.post_send(SendWr::send(100 + i as u64, b))
                .map_err(|e| e.error)
                .expect("post_send");
        }
        for _ in 0..sends {
            assert!(one(&ccq).await.status.is_success(), "every Send completed");
        }
        let mut got = Vec::new();
        if guard.is_some() {
            // Every Send sits in the staging area; a poll holding the borrow returns without it.
            for _ in 0..100 {
                scq.poll(&mut got, 64).expect("poll");
            }
            assert!(got.is_empty(), "completed into a buffer the application borrows");
        }
        drop(guard);
        let deadline = Instant::now() + WAIT;
        while got.len() < sends && Instant::now() < deadline {
            scq.poll(&mut got, 64).expect("poll");
            tokio::task::yield_now().await;
        }
        assert_eq!(got.len(), sends, "every Send arrived (holding: {hold})");
        for (i, c) in got.iter().enumerate() {
            assert_eq!(
                (c.wr_id, c.status, c.byte_len as usize),
                (i as u64, WcStatus::Success, LEN)
            );
            let b = c.buf.as_ref().expect("the receive's buffer");
            let want = first.wrapping_add(i as u8 + 1);
            assert!(b.bytes().iter().all(|&x| x == want), "receive {i} holds its Send whole");
        }
        drop(kept);
    }
    // One at a time, each Send finds room and goes directly, and one of them lands across the
    // staging area's end: it arrives whole all the same.
    const ODD: usize = 30_000;
    for i in 0..2 * (1 << 20) / ODD {
        let r = spd.register(ODD, AccessFlags::LOCAL_WRITE).expect("register");
        sqp.post_recv(RecvWr::new(i as u64, r))
            .map_err(|e| e.error)
            .expect("post_recv");
        let mut b = cpd.register(ODD, AccessFlags::LOCAL_WRITE).expect("buf");
        let data: Vec<u8> = (0..ODD).map(|j| (i * 7 + j) as u8).collect();
        b.write_at(0, &data).expect("fill");
        cqp.post_send(SendWr::send(i as u64, b))
            .map_err(|e| e.error)
            .expect("post_send");
        assert!(one(&ccq).await.status.is_success());
        let c = one(&scq).await;
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        assert_eq!(
            &c.buf.as_ref().expect("buffer").bytes()[..],
            &data[..],
            "Send {i} whole"
        );
    }
}
