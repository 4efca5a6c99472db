//! Isolation: what a connected peer can reach of a server's memory. The attacker here is a raw
//! client (the sans-IO session over a transport QP, so it sees every descriptor the server lends
//! it) that forges RDMA Reads and Writes: at another connection's lent buffer, at its own buffer
//! after the transfer ended, past the end of a buffer, at random rkeys. Each must fail with a
//! remote access error and move no byte. A peer that ignores the server's limit on requests
//! served at once gets the excess refused, unrun. Runs on the provider named by `RDMA_RPC_PROVIDER`
//! (tcp and shm in `scripts/test.sh`; verbs on rxe0 in the VM lane).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rdma_rpc_core::proto::{Event, Hello, Payload, Reply, Session, SessionConfig, Token, Transmit, FRAGMENT};
use rdma_rpc_core::transport::{
    self, AccessFlags, BufferPool, Completion, CompletionQueue, Device, MemoryRegion, QpOptions, QueuePair, RecvWr,
    RemoteAddr, RemoteRegion, SendOp, SendWr, WcStatus,
};
use rdma_rpc_core::{Config, Isolation, RpcError, Server};

const BIG: u32 = 1;
const ECHO: u32 = 2;
const RESPONSE: usize = 64 * 1024;
const THRESHOLD: usize = 16 * 1024;
const WAIT: Duration = Duration::from_secs(20);
const RECV: u64 = 1 << 60;
const SEND: u64 = 2 << 60;
const READ: u64 = 3 << 60;

fn device() -> Device {
    Device::open_default().expect("open the provider named by RDMA_RPC_PROVIDER")
}

fn test_ip() -> IpAddr {
    std::env::var("RDMA_RPC_TEST_IP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

fn response(tag: u8) -> Vec<u8> {
    (0..RESPONSE).map(|i| (i as u8).wrapping_mul(13) ^ tag).collect()
}

async fn server(isolation: Isolation) -> SocketAddr {
    // The threshold below RESPONSE on every provider, so that the response is lent.
    let config = Config::default().isolation(isolation).eager_threshold(THRESHOLD);
    let server = Server::builder(config)
        .handler(BIG, |req: Vec<u8>| async move {
            Ok(response(req.first().copied().unwrap_or(0)))
        })
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&device(), SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    addr
}

/// A client that speaks the protocol by hand and keeps what a well-behaved one would not.
struct Raw {
    session: Session,
    qp: QueuePair,
    cq: CompletionQueue,
    pd: transport::ProtectionDomain,
    sends: BufferPool,
    /// Read requests the session asked for, not yet run: the server's lent descriptors.
    reads: Vec<(Token, RemoteRegion)>,
}

impl Raw {
    async fn connect(dev: &Device, addr: SocketAddr) -> Raw {
        Raw::connect_with(dev, addr, Config::default().max_payload).await
    }

    /// As [`Raw::connect`], saying it accepts payloads up to `max_payload`.
    async fn connect_with(dev: &Device, addr: SocketAddr, max_payload: u64) -> Raw {
        let eager = THRESHOLD;
        let config = Config::default().eager_threshold(eager).max_payload(max_payload);
        let mine = Hello::from(&config);
        let slot = SessionConfig {
            ring: config.ring,
            eager_max: eager,
            fragment: FRAGMENT,
            max_payload: config.max_payload,
        }
        .slot_size();
        let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
        let ring = BufferPool::new(&pd, slot, config.ring as usize, AccessFlags::LOCAL_WRITE).expect("ring");
        let recvs = (0..config.ring as u64)
            .map(|i| RecvWr::new(RECV | i, ring.take().expect("slot")))
            .collect();
        let opts = QpOptions::new(&pd, &cq);
        let (qp, reply) = tokio::task::spawn_blocking(move || {
            transport::connect_with_recvs(addr, &opts, &mine.encode(), WAIT, recvs)
        })
        .await
        .expect("task")
        .expect("connect");
        let theirs = Hello::decode(&reply).expect("an rdma-rpc server");
        let session = Session::new(SessionConfig {
            ring: theirs.ring,
            eager_max: eager.min(theirs.eager_threshold as usize),
            fragment: FRAGMENT,
            max_payload: config.max_payload.min(theirs.max_payload),
        });
        let sends = BufferPool::new(&pd, slot, 128, AccessFlags::LOCAL_WRITE).expect("sends");
        Raw {
            session,
            qp,
            cq,
            pd,
            sends,
            reads: Vec::new(),
        }
    }

    fn flush(&mut self) {
        while let Some(t) = self.session.poll_transmit() {
            match t {
                Transmit::Send(bytes) => {
                    let mut buf = self.sends.take().expect("a send buffer");
                    assert!(bytes.write_to(&mut buf.bytes_mut()), "a message fits a send buffer");
                    self.qp
                        .post_send(SendWr::send(SEND, buf).len(bytes.len()))
                        .map_err(|e| e.error)
                        .expect("post send");
                }
                Transmit::Read { token, remote, .. } => self.reads.push((
                    token,
                    RemoteRegion {
                        addr: remote.addr,
                        len: remote.len,
                        rkey: remote.rkey,
                    },
                )),
                // A buffer this peer lent (by hand, in a test) is its own again.
                Transmit::Release(_) => {}
                other => panic!("unexpected transmit {other:?}"),
            }
        }
    }

    async fn completions(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        tokio::time::timeout(WAIT, self.cq.wait(&mut out, 32))
            .await
            .expect("a completion in time")
            .expect("cq");
        out
    }

    /// Runs until the session has something for us: the call's result or a lent descriptor.
    async fn pump(&mut self) -> Option<Result<Reply, RpcError>> {
        loop {
            self.flush();
            if !self.reads.is_empty() {
                return None;
            }
            // One completion batch may bring several results: those taken before waiting again.
            if let Some(Event::CallDone { result, .. }) = self.session.poll_event() {
                return Some(result.map_err(RpcError::from));
            }
            for c in self.completions().await {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                if c.wr_id & RECV == RECV && c.wr_id & READ != READ {
                    let buf = c.buf.expect("recv buffer");
                    let len = c.byte_len as usize;
                    self.session
                        .handle_message(&buf.bytes()[..len], Instant::now())
                        .expect("a valid message");
                    self.qp
                        .post_recv(RecvWr::new(c.wr_id, buf))
                        .map_err(|e| e.error)
                        .expect("repost");
                    self.session.reposted();
                }
            }
            if let Some(Event::CallDone { result, .. }) = self.session.poll_event() {
                return Some(result.map_err(RpcError::from));
            }
        }
    }

    /// Starts a call that makes the server lend us a 64 KiB response, and returns the lent
    /// descriptor without reading it.
    async fn lent_response(&mut self, tag: u8) -> (Token, RemoteRegion) {
        self.session
            .start_call(BIG, Payload::Eager(vec![tag]), None, None, Instant::now())
            .expect("start");
        assert!(self.pump().await.is_none(), "a 64 KiB response comes by rendezvous");
        let (token, remote) = self.reads.pop().expect("a lent descriptor");
        assert_eq!(remote.len, RESPONSE as u64);
        (token, remote)
    }

    /// An RDMA Read (or Write) on this QP; the completion status and the local buffer after.
    async fn one_sided(&mut self, remote: RemoteAddr, len: usize, write: bool) -> (WcStatus, MemoryRegion) {
        let mut buf = self.pd.register(len, AccessFlags::LOCAL_WRITE).expect("register");
        let op = if write {
            buf.bytes_mut().fill(0xee);
            SendOp::Write { remote, imm: None }
        } else {
            SendOp::Read { remote }
        };
        self.qp
            .post_send(SendWr::new(READ, op).buf(buf).len(len))
            .map_err(|e| e.error)
            .expect("post");
        loop {
            for c in self.completions().await {
                if c.wr_id == READ {
                    return (c.status, c.buf.expect("buffer back"));
                }
            }
        }
    }

    /// Reads a lent response properly and completes the call with it.
    async fn finish(&mut self, token: Token, remote: RemoteRegion) -> Vec<u8> {
        let (status, buf) = self.one_sided(remote.at(0), remote.len as usize, false).await;
        assert_eq!(status, WcStatus::Success);
        let bytes = buf.bytes()[..remote.len as usize].to_vec();
        self.session.handle_read_done(token, Ok(bytes), Instant::now());
        match self.pump().await {
            Some(Ok(Reply::Bytes(b))) => b,
            other => panic!("call did not finish: {other:?}"),
        }
    }

    /// A whole small call: when it returns, the server has handled everything sent before it.
    async fn echo(&mut self) {
        self.session
            .start_call(ECHO, Payload::Eager(b"sync".to_vec()), None, None, Instant::now())
            .expect("start");
        assert!(matches!(self.pump().await, Some(Ok(Reply::Bytes(b))) if b == b"sync"));
    }
}

fn denied(status: WcStatus, buf: &MemoryRegion, what: &str) {
    assert!(
        matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr),
        "{what}: expected a remote access error, got {status:?}"
    );
    assert!(
        buf.bytes().iter().all(|&b| b == 0),
        "{what}: bytes reached the attacker's buffer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_connections_lent_buffer_is_out_of_reach() {
    let addr = server(Isolation::Connection).await;
    let dev = device();
    let mut victim = Raw::connect(&dev, addr).await;
    let (token, lent) = victim.lent_response(1).await;

    // The attacker knows the victim's descriptor exactly (as if it had leaked).
    let mut attacker = Raw::connect(&dev, addr).await;
    let (status, buf) = attacker.one_sided(lent.at(0), 4096, false).await;
    denied(status, &buf, "read of another connection's lent buffer");
    let mut writer = Raw::connect(&dev, addr).await;
    let (status, _) = writer.one_sided(lent.at(0), 4096, true).await;
    assert!(
        matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr),
        "write into another connection's lent buffer: {status:?}"
    );
    // The victim's response is intact.
    assert_eq!(victim.finish(token, lent).await, response(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_bounds_and_random_keys_are_refused() {
    let addr = server(Isolation::Connection).await;
    let dev = device();
    // Past the end of our own lent buffer: the registration's bounds, not the descriptor's,
    // are what a NIC checks, so go past the registration (a size class: a power of two and
    // the length prefix).
    let mut peer = Raw::connect(&dev, addr).await;
    let (_, lent) = peer.lent_response(2).await;
    let beyond = RemoteAddr {
        addr: lent.addr + (RESPONSE as u64) * 4,
        rkey: lent.rkey,
    };
    let (status, buf) = peer.one_sided(beyond, 64, false).await;
    denied(status, &buf, "read past the registration");
    // Random rkeys and addresses, each on a fresh connection (an error ends a QP).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut p = Raw::connect(&dev, addr).await;
        let forged = RemoteAddr {
            addr: x & 0x0000_7fff_ffff_f000,
            rkey: (x >> 32) as u32,
        };
        let (status, buf) = p.one_sided(forged, 256, false).await;
        denied(status, &buf, &format!("read at random {forged:?}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_per_transfer_isolation_a_finished_transfers_buffer_is_out_of_reach() {
    let addr = server(Isolation::Transfer).await;
    let dev = device();
    let mut peer = Raw::connect(&dev, addr).await;
    let (token, lent) = peer.lent_response(3).await;
    assert_eq!(peer.finish(token, lent).await, response(3));
    peer.echo().await; // the server has handled our ReadDone and released the buffer
    let (status, buf) = peer.one_sided(lent.at(0), RESPONSE, false).await;
    denied(status, &buf, "read of a released rendezvous buffer");
}

/// A peer that ignores the limit the server stated in its hello (a `Client` keeps it) and
/// sends more requests than the server serves at once: the excess is refused at once, unrun,
/// and the requests within the limit are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_sends_beyond_the_servers_limit_is_refused_unrun() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let config = Config::default().max_concurrent_requests(2).eager_threshold(THRESHOLD);
    let server = Server::builder(config)
        .handler(ECHO, move |req: Vec<u8>| {
            r.fetch_add(1, Ordering::SeqCst);
            async move {
                // Long enough that the third request arrives while both run.
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, RpcError>(req)
            }
        })
        .bind(&device(), SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    let mut raw = Raw::connect(&device(), addr).await;
    for tag in 0..3u8 {
        raw.session
            .start_call(ECHO, Payload::Eager(vec![tag]), None, None, Instant::now())
            .expect("start");
    }
    let first = raw.pump().await.expect("a result");
    let refused = first.err();
    assert_eq!(refused, Some(RpcError::Overloaded { limit: 2 }));
    assert!(refused.is_some_and(|e| e.did_not_run()), "safe to retry");
    for _ in 0..2 {
        let r = raw.pump().await.expect("a result");
        assert!(matches!(r, Ok(Reply::Bytes(ref b)) if b.len() == 1), "{r:?}");
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "the refused request never reached its handler"
    );
}

/// A peer lends a request body far larger than the server's memory, to a server whose
/// `max_payload` lets it through: the server cannot allocate the buffer to read it into, and
/// that call fails with an error (the server lives on) instead of the allocation aborting the
/// server's process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_larger_than_memory_fails_its_call_not_the_server() {
    let config = Config::default().max_payload(u64::MAX).eager_threshold(THRESHOLD);
    let server = Server::builder(config)
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&device(), SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    let mut raw = Raw::connect_with(&device(), addr, u64::MAX).await;
    // 32 TiB: no allocator gives that on these machines.
    let huge = rdma_rpc_core::proto::RemoteRegion {
        addr: 0x1000,
        len: 1 << 45,
        rkey: 7,
    };
    raw.session
        .start_call(ECHO, Payload::Lent { desc: huge, buf: 1 }, None, None, Instant::now())
        .expect("start");
    // tcp reads it into a vector of its own, which the allocator refuses; shm and verbs refuse
    // the registration (beyond the provider's largest region, or the memory again).
    let r = raw.pump().await.expect("a result");
    assert!(
        matches!(&r, Err(RpcError::Internal(m)) if m.contains("fetching the request")),
        "{r:?}"
    );
    // The server is still there for the next call.
    raw.session
        .start_call(ECHO, Payload::Eager(vec![7]), None, None, Instant::now())
        .expect("start");
    let r = raw.pump().await.expect("a result");
    assert!(matches!(r, Ok(Reply::Bytes(ref b)) if b == &[7]), "{r:?}");
}

/// A peer that never reads its lent answers (no ReadDone): they count against the server's
/// request limit, so a further call is refused unrun and nothing more is lent; once
/// `lent_answer_timeout` passes, the server closes the connection and lets go of every buffer,
/// and a graceful shutdown started meanwhile ends then instead of waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lent_answers_nobody_reads_are_bounded_and_taken_back() {
    let server_dev = device();
    let config = Config::default()
        .max_concurrent_requests(2)
        .eager_threshold(THRESHOLD)
        .lent_answer_timeout(Duration::from_secs(1));
    let server = Server::builder(config)
        .handler(BIG, |req: Vec<u8>| async move {
            Ok(response(req.first().copied().unwrap_or(0)))
        })
        .bind(&server_dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let mut raw = Raw::connect(&device(), addr).await;
    let _unread = [raw.lent_response(1).await, raw.lent_response(2).await];
    raw.session
        .start_call(BIG, Payload::Eager(vec![3]), None, None, Instant::now())
        .expect("start");
    assert_eq!(
        raw.pump().await.expect("a result").err(),
        Some(RpcError::Overloaded { limit: 2 }),
        "two unread answers still count"
    );
    let started = Instant::now();
    stop.send(()).expect("the server listens for its signal");
    tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("the shutdown ends once the unread answers' time is up")
        .expect("the serving task")
        .expect("serve_with_shutdown");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        started.elapsed()
    );
    let deadline = Instant::now() + WAIT;
    while server_dev.registered_bytes() != 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server_dev.registered_bytes(), 0, "the server let go of every buffer");
}

/// Peers that connect and then say nothing hold a server's connection slots only for its idle
/// timeout: they are told to go, and dropped if they do not, and a new client gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_give_their_slots_back() {
    let config = Config::default()
        .max_connections(2)
        .idle_timeout(Duration::from_secs(3));
    let server = Server::builder(config)
        .handler(ECHO, |req: Vec<u8>| async move { Ok::<_, RpcError>(req) })
        .bind(&device(), SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    let dev = device();
    let _silent = [Raw::connect(&dev, addr).await, Raw::connect(&dev, addr).await];
    match rdma_rpc_core::Client::connect(&dev, addr, Config::default()).await {
        Err(RpcError::ConnectionRefused) => {}
        Err(e) => panic!("a third connection while two are held: {e}"),
        Ok(_) => panic!("a third connection while two are held was taken"),
    }
    let deadline = Instant::now() + WAIT;
    let client = loop {
        match rdma_rpc_core::Client::connect(&dev, addr, Config::default()).await {
            Ok(c) => break c,
            Err(RpcError::ConnectionRefused) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the silent peers' slots never came back: {e}"),
        }
    };
    assert_eq!(client.call(ECHO, b"in".to_vec()).await.expect("served"), b"in");
}

/// A buffer lent for its peer to read is registered for that alone: the peer cannot write it
/// with the key it was given (nor, the buffer reused, write a later request's body while a
/// handler reads it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_lent_to_be_read_cannot_be_written() {
    let addr = server(Isolation::Connection).await;
    let mut raw = Raw::connect(&device(), addr).await;
    let (_, lent) = raw.lent_response(4).await;
    let (status, _) = raw.one_sided(lent.at(0), 4096, true).await;
    assert!(
        matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr),
        "a write into a buffer lent to be read: {status:?}"
    );
}
