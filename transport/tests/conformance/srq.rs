//! Shared receive queues: many QPs take one queue's receives, each completion names its QP, the
//! limit event, RNR on an empty queue, and a QP's failure or end leaving the queue to the rest.

use super::*;

/// `n` connections whose server QPs share one SRQ and one CQ (and a PD); the clients share a
/// PD and a CQ. `servers[i]` is connected to `clients[i]`.
struct Shared {
    spd: ProtectionDomain,
    scq: CompletionQueue,
    srq: SharedReceiveQueue,
    servers: Vec<QueuePair>,
    cpd: ProtectionDomain,
    ccq: CompletionQueue,
    clients: Vec<QueuePair>,
}

fn shared(n: usize, depth: u32) -> Shared {
    let dev = device();
    let (spd, scq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let (cpd, ccq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4096).expect("cq"));
    let srq = spd.create_srq(depth).expect("create an SRQ");
    let listener = Listener::bind(&dev, SocketAddr::new(test_ip(), 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let sopts = QpOptions::new(&spd, &scq).srq(&srq);
    let copts = QpOptions::new(&cpd, &ccq);
    let (servers, clients) = (0..n)
        .map(|_| accept_and_connect(&listener, addr, &sopts, &copts))
        .unzip();
    Shared {
        spd,
        scq,
        srq,
        servers,
        cpd,
        ccq,
        clients,
    }
}

impl Shared {
    fn post_recvs(&self, ids: std::ops::Range<u64>, len: usize) {
        let wrs: Vec<RecvWr> = ids
            .map(|i| RecvWr::new(i, self.spd.register(len, AccessFlags::LOCAL_WRITE).expect("register")))
            .collect();
        self.srq
            .post_recv_batch(wrs)
            .map_err(|e| e.error)
            .expect("post on the SRQ");
    }

    /// Client `i` Sends `bytes`.
    fn send(&self, i: usize, wr_id: u64, bytes: &[u8]) {
        let mut b = self
            .cpd
            .register(bytes.len().max(1), AccessFlags::NONE)
            .expect("register");
        b.write_at(0, bytes).expect("fill");
        let wr = SendWr::send(wr_id, b).len(bytes.len());
        self.clients[i].post_send(wr).map_err(|e| e.error).expect("post_send");
    }

    /// Which server QP a completion names.
    fn server_of(&self, c: &Completion) -> usize {
        self.servers
            .iter()
            .position(|q| q.qp_num() == c.qp_num)
            .unwrap_or_else(|| panic!("a completion names no server QP: {c:?}"))
    }
}

#[tokio::test]
async fn an_srq_feeds_many_qps_and_each_completion_names_its_qp() {
    const QPS: usize = 4;
    const EACH: u8 = 8;
    let s = shared(QPS, 64);
    s.post_recvs(0..(QPS as u64 * u64::from(EACH)), 64);
    for k in 0..EACH {
        for i in 0..QPS {
            s.send(i, u64::from(k), &[i as u8, k, 0xa5]);
        }
    }
    for c in take(&s.ccq, QPS * usize::from(EACH)).await {
        ok(&c);
    }
    let got = take(&s.scq, QPS * usize::from(EACH)).await;
    let mut next = [0u8; QPS];
    let mut ids = std::collections::HashSet::new();
    for c in &got {
        ok(c);
        assert_eq!(c.byte_len, 3, "{c:?}");
        let qp = s.server_of(c);
        let buf = c.buf.as_ref().expect("the receive's buffer comes back");
        let b = buf.bytes();
        assert_eq!(usize::from(b[0]), qp, "the completion names the QP the message came to");
        assert_eq!(b[1], next[qp], "a QP's messages arrive in order");
        assert_eq!(b[2], 0xa5);
        next[qp] += 1;
        assert!(ids.insert(c.wr_id), "each receive is taken once: {c:?}");
    }
    assert_eq!(next, [EACH; QPS]);
    quiet(&s.scq).await;
    // A QP with a shared queue has none of its own.
    let own = RecvWr::new(99, s.spd.register(8, AccessFlags::LOCAL_WRITE).expect("register"));
    let refused = s.servers[0].post_recv(own).expect_err("posting to the QP refuses");
    assert!(matches!(refused.error, Error::InvalidArgument(_)), "{refused}");
    assert_eq!(refused.unposted.len(), 1, "the receive comes back");
}

#[tokio::test]
async fn the_srq_limit_event_fires_once_when_receives_fall_below_it() {
    let s = shared(1, 16);
    s.post_recvs(0..8, 16);
    s.srq.arm_limit(4).expect("arm");
    for k in 0..4 {
        s.send(0, k, b"four");
    }
    take(&s.ccq, 4).await;
    take(&s.scq, 4).await;
    assert!(!s.srq.limit_fired(), "4 left is not below the limit of 4");
    s.send(0, 4, b"fifth");
    take(&s.ccq, 1).await;
    take(&s.scq, 1).await;
    tokio::time::timeout(WAIT, s.srq.limit_reached())
        .await
        .expect("the limit event within the wait")
        .expect("no error");
    // Fired once: it stays quiet until armed again.
    s.send(0, 5, b"sixth");
    take(&s.ccq, 1).await;
    take(&s.scq, 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!s.srq.limit_fired(), "the event disarms when it fires");
    s.srq.arm_limit(2).expect("arm again");
    s.send(0, 6, b"seventh");
    take(&s.ccq, 1).await;
    take(&s.scq, 1).await;
    tokio::time::timeout(WAIT, s.srq.limit_reached())
        .await
        .expect("armed again, it fires again")
        .expect("no error");
    assert!(matches!(s.srq.arm_limit(17), Err(Error::InvalidArgument(_))));
}

#[tokio::test]
async fn an_empty_srq_holds_a_send_then_fails_it_with_rnr() {
    let s = shared(1, 16);
    s.send(0, 1, b"nobody home");
    let wc = take(&s.ccq, 1).await.pop().expect("one");
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
    assert!(s.clients[0].is_error());
}

#[tokio::test]
async fn a_receive_posted_on_the_srq_in_time_saves_the_send() {
    let s = shared(2, 16);
    s.send(1, 1, b"late receive");
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.post_recvs(0..1, 64);
    ok(&take(&s.ccq, 1).await[0]);
    let rc = take(&s.scq, 1).await.pop().expect("one");
    ok(&rc);
    assert_eq!((rc.byte_len, s.server_of(&rc)), (12, 1));
}

#[tokio::test]
async fn a_failed_or_dropped_qp_leaves_the_srqs_receives_to_the_others() {
    let s = shared(2, 16);
    s.post_recvs(0..4, 64);
    // Client 0 writes with a key that does not exist: both ends of its connection fail.
    let target = s.spd.register(64, RW).expect("register");
    let bad = RemoteAddr {
        addr: target.addr(),
        rkey: target.rkey() ^ 0x5a5a_0001,
    };
    let mut src = s.cpd.register(8, AccessFlags::NONE).expect("register");
    src.write_at(0, &[1; 8]).expect("fill");
    let wr = SendWr::new(7, SendOp::Write { remote: bad, imm: None }).buf(src);
    s.clients[0].post_send(wr).map_err(|e| e.error).expect("post");
    let wc = take(&s.ccq, 1).await.pop().expect("one");
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    let deadline = Instant::now() + WAIT;
    while !s.servers[0].is_error() {
        assert!(Instant::now() < deadline, "the server's QP learns that its peer failed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Its flush took none of the shared receives.
    quiet(&s.scq).await;
    for k in 0..2 {
        s.send(1, k, &[k as u8; 4]);
    }
    take(&s.ccq, 2).await.iter().for_each(ok);
    for c in take(&s.scq, 2).await {
        ok(&c);
        assert_eq!(s.server_of(&c), 1);
    }
    // Destroyed while the other keeps using the queue.
    let mut s = s;
    drop(s.servers.remove(0));
    drop(s.clients.remove(0));
    for k in 2..4 {
        s.send(0, k, &[k as u8; 4]);
    }
    take(&s.ccq, 2).await.iter().for_each(ok);
    let got = take(&s.scq, 2).await;
    for c in &got {
        ok(c);
        assert_eq!(c.qp_num, s.servers[0].qp_num());
    }
    let mut ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        [2, 3],
        "the receives the failed QP did not take are the survivor's"
    );
}
