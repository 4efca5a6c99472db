//! Many connected QPs on one device: a server process accepts them all (one PD, one CQ, one
//! shared receive queue), a client process connects them all, and every one of them carries a
//! message. The server's thread count is the same at 10 connections as at all of them.
//!
//! The provider comes from `RDMA_RPC_PROVIDER` (default `tcp`): 10,000 QPs on `tcp` and `shm`,
//! which hold one descriptor a connection on each side (a socket), within the 20,000 that
//! machines of this kind allow a process (`ulimit -Hn`, not raisable without CAP_SYS_RESOURCE).
//! `verbs` does not run this file (the VM lane has `conformance`'s thousand QPs).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdma_rpc_transport::*;

mod limits;
use limits::raise_fd_limit;

const CHILD_ENV: &str = "RDMA_RPC_SCALE_CHILD";
const WAIT: Duration = Duration::from_secs(120);

fn device() -> Device {
    Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER")
}

/// QPs to connect.
const QPS: usize = 10_000;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(Iterator::count).unwrap_or(0)
}

/// Completions until `n` came (each must succeed), bounded by [`WAIT`].
fn reap(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + WAIT;
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions within {WAIT:?}",
            out.len()
        );
        if cq.poll(&mut out, 256).expect("poll") == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    for c in &out {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
    }
    out
}

#[test]
#[ignore = "helper process for many_qps_on_one_device_each_carry_a_message"]
fn child_connects() {
    let Ok(addr) = std::env::var(CHILD_ENV) else { return };
    raise_fd_limit();
    let addr: SocketAddr = addr.parse().expect("the server's address");
    let dev = device();
    let n = QPS;
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1 << 16).expect("cq"));
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_inline_data: 0,
    };
    let opts = QpOptions::new(&pd, &cq).caps(caps);
    let qps: Vec<QueuePair> = (0..n)
        .map(|i| {
            let (qp, _) = connect(addr, &opts, &(i as u32).to_le_bytes(), WAIT)
                .unwrap_or_else(|e| panic!("connection {i} of {n}: {e}"));
            qp
        })
        .collect();
    println!("CONNECTED {n}");
    // One message per QP: its own number.
    let pool = BufferPool::new(&pd, 4, n, AccessFlags::NONE).expect("buffers");
    for (i, qp) in qps.iter().enumerate() {
        let mut b = pool.take().expect("a buffer");
        b.write_at(0, &(i as u32).to_le_bytes()).expect("fill");
        qp.post_send(SendWr::send(i as u64, b))
            .map_err(|e| e.error)
            .expect("post");
    }
    reap(&cq, n);
    println!("SENT {n}");
    // Held until the server read everything (it closes our stdin).
    let _ = std::io::stdin().lines().count();
}

#[test]
fn many_qps_on_one_device_each_carry_a_message() {
    raise_fd_limit();
    let dev = device();
    let n = QPS;
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1 << 16).expect("cq"));
    let srq = pd.create_srq(n as u32).expect("an SRQ");
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--ignored",
            "--exact",
            "child_connects",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, addr.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the client process");
    let opts = QpOptions::new(&pd, &cq).srq(&srq);
    let started = Instant::now();
    let mut qps = Vec::with_capacity(n);
    let mut threads_at_10 = 0;
    for _ in 0..n {
        let req = listener.accept(Some(WAIT)).expect("a connection request");
        let i = u32::from_le_bytes(req.private_data().try_into().expect("the client's number"));
        qps.push((i, req.accept(&opts, b"").expect("accept")));
        if qps.len() == 10 {
            threads_at_10 = threads();
        }
    }
    let setup = started.elapsed();
    let threads_at_n = threads();
    // Every QP's message lands in a receive of the one shared queue.
    let pool = BufferPool::new(&pd, 4, n, AccessFlags::LOCAL_WRITE).expect("buffers");
    let recvs: Vec<RecvWr> = (0..n)
        .map(|k| RecvWr::new(k as u64, pool.take().expect("a buffer")))
        .collect();
    srq.post_recv_batch(recvs).map_err(|e| e.error).expect("post");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut sent = false;
    for line in lines.by_ref() {
        let line = line.expect("the client's output");
        if line.contains("SENT ") {
            sent = true;
            break;
        }
    }
    assert!(sent, "the client sent on every QP");
    let got = reap(&cq, n);
    let by_qp: std::collections::HashMap<u32, u32> = qps.iter().map(|(i, qp)| (qp.qp_num(), *i)).collect();
    let mut seen = vec![false; n];
    for c in &got {
        let from = by_qp
            .get(&c.qp_num)
            .copied()
            .expect("a completion names one of our QPs");
        let buf = c.buf.as_ref().expect("the receive's buffer");
        let said = u32::from_le_bytes(buf.bytes()[..4].try_into().expect("4 bytes"));
        assert_eq!(said, from, "QP {from} carried its own client's message");
        assert!(!seen[from as usize], "QP {from} carried one message");
        seen[from as usize] = true;
    }
    assert!(seen.iter().all(|&s| s), "every QP carried its message");
    println!(
        "{} QPs on provider {}: set up at {:.0} per second; server threads {} at 10 connections, {} at {}",
        n,
        dev.provider(),
        n as f64 / setup.as_secs_f64(),
        threads_at_10,
        threads_at_n,
        n
    );
    assert_eq!(
        threads_at_n, threads_at_10,
        "the process's threads do not grow with its connections"
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = std::io::stdout().flush();
}
