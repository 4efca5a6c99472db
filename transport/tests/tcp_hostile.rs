//! The tcp provider against a peer that speaks its wire format but not its rules.
//!
//! The tcp provider listens on a TCP port that any host can reach, so whatever arrives after a
//! handshake is input, not trust. These tests open a plain socket, make the handshake by hand,
//! and send frames built here byte by byte from the format (`src/tcp/wire.rs`), as a buggy or
//! hostile peer could: forged keys and ranges, unaligned atomics, responses to requests never
//! made, unknown kinds, cut fields, absurd lengths. The target must answer as an RC responder
//! does (the data a NIC would move, the NAK it would send), touch no byte it must not, and
//! never panic; a panic on any of the provider's threads fails the test (a hook counts them).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use rdma_rpc_transport::*;

mod rng;
use rng::Rng;

const WAIT: Duration = Duration::from_secs(30);
const MAGIC: &[u8; 8] = b"RDRPCTCP";

// Frame kinds, as the format defines them.
const SEND: u8 = 1;
const WRITE: u8 = 2;
const READ_REQ: u8 = 3;
const ATOMIC: u8 = 4;
const ACK: u8 = 10;
const NAK: u8 = 11;
const READ_RESP: u8 = 12;
const ATOMIC_RESP: u8 = 13;
const READ_PART: u8 = 14;
const FATAL: u8 = 20;
/// The immediate-and-ack flags byte: bit 0 an immediate follows, bit 1 acknowledge this.
const ACK_REQ: u8 = 2;

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Counts panics on every thread (the provider's included), then reports them as usual.
fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // The provider's threads (a panic on a test's own thread fails that test anyway).
            if std::thread::current().name().is_some_and(|n| n.starts_with("rdma-")) {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            default(info);
        }));
    });
}

/// One frame: the 4-byte little-endian length of what follows, the kind, the fields, the data.
fn frame(kind: u8, fields: &[u8], data: &[u8]) -> Vec<u8> {
    let mut f = ((1 + fields.len() + data.len()) as u32).to_le_bytes().to_vec();
    f.push(kind);
    f.extend_from_slice(fields);
    f.extend_from_slice(data);
    f
}

fn fields(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// The hostile side: a plain socket that made the handshake by hand.
struct Peer(TcpStream);

impl Peer {
    fn connect(addr: SocketAddr) -> Peer {
        let mut s = TcpStream::connect(addr).expect("connect the raw peer");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        s.set_nodelay(true).expect("nodelay");
        let mut hello = MAGIC.to_vec();
        hello.push(2);
        hello.extend_from_slice(&3u16.to_le_bytes());
        s.write_all(&hello).expect("send the hello");
        let mut head = [0u8; 9];
        s.read_exact(&mut head).expect("read the reply");
        assert_eq!(&head[..8], MAGIC);
        let mut reply = vec![0u8; usize::from(head[8])];
        s.read_exact(&mut reply).expect("read the reply's data");
        assert_eq!(reply.first(), Some(&1), "the target accepted");
        Peer(s)
    }

    /// Sends bytes; the target may have closed already (after a Fatal), which is fine.
    fn send(&mut self, bytes: &[u8]) {
        let _ = self.0.write_all(bytes);
    }

    /// Asks to Read all of `mr`, once for each request number in `ssns`.
    fn read_whole(&mut self, mr: &MemoryRegion, ssns: std::ops::RangeInclusive<u64>) {
        let (addr, rkey) = (mr.addr().to_le_bytes(), mr.rkey().to_le_bytes());
        let len = (mr.len() as u32).to_le_bytes();
        for ssn in ssns {
            self.send(&frame(
                READ_REQ,
                &fields(&[&ssn.to_le_bytes(), &addr, &rkey, &len]),
                &[],
            ));
        }
    }

    /// The next frame, or `None` once the target closed the connection.
    fn next(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut len = [0u8; 4];
        if self.0.read_exact(&mut len).is_err() {
            return None;
        }
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut body).expect("a whole frame");
        let (&kind, rest) = body.split_first().expect("a kind byte");
        Some((kind, rest.to_vec()))
    }

    /// The next frame, a read response's parts joined into one `READ_RESP` (each part checked
    /// to be of the same Read).
    fn next_whole(&mut self) -> Option<(u8, Vec<u8>)> {
        let (mut kind, mut body) = self.next()?;
        while kind == READ_PART {
            let (k, more) = self.next().expect("the rest of a read response");
            assert!(
                matches!(k, READ_PART | READ_RESP) && more[..8] == body[..8],
                "a part of the same read response"
            );
            body.extend_from_slice(&more[8..]);
            kind = k;
        }
        Some((kind, body))
    }
}

/// Waits (bounded) for `qp` to be in the error state.
fn wait_error(qp: &QueuePair, what: &str) {
    let deadline = Instant::now() + WAIT;
    while !qp.is_error() {
        assert!(
            Instant::now() < deadline,
            "{what}, but the QP is not in the error state"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The target: a tcp device listening, each connection's QP with two registrations a peer
/// may know about (one it may only read, one it may do everything with).
struct Target {
    dev: Device,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    listener: Option<Listener>,
    addr: SocketAddr,
}

impl Target {
    fn new() -> Target {
        let dev = Device::open("tcp").expect("the tcp provider");
        let pd = dev.alloc_pd().expect("pd");
        let cq = dev.create_cq(4096).expect("cq");
        let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        Target {
            dev,
            pd,
            cq,
            listener: Some(listener),
            addr,
        }
    }

    /// A raw peer connected to a new QP of the target.
    fn connection(&mut self) -> (Peer, QueuePair) {
        let listener = self.listener.take().expect("the listener");
        let opts = QpOptions::new(&self.pd, &self.cq);
        let server = std::thread::spawn(move || {
            let req = listener.accept(Some(WAIT)).expect("accept");
            let qp = req.accept(&opts, b"").expect("accept the qp");
            (listener, qp)
        });
        let peer = Peer::connect(self.addr);
        let (listener, qp) = server.join().expect("the accepting thread");
        self.listener = Some(listener);
        (peer, qp)
    }

    fn filled(&self, len: usize, access: AccessFlags, seed: u8) -> MemoryRegion {
        let mut mr = self.pd.register(len, access).expect("register");
        let bytes: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        mr.write_at(0, &bytes).expect("fill");
        mr
    }
}

/// What an RC responder does with a one-sided request: the outcome a NIC gives, computed from
/// the registrations alone.
#[derive(Debug, Clone, Copy)]
enum Op {
    Write { len: usize },
    Read { len: u32 },
    Cas { compare: u64, swap: u64 },
    Faa { add: u64 },
}

/// A registration as the model sees it: where it is, its key, what it allows, its bytes.
struct Model {
    addr: u64,
    rkey: u32,
    access: AccessFlags,
    bytes: Vec<u8>,
}

/// The status a responder answers `op` at `addr` under `rkey` with, and the model's registration
/// it acts on when it succeeds (`None` for a zero-length Read or Write, which touch nothing).
fn expect(models: &[Model], op: Op, addr: u64, rkey: u32) -> Result<Option<usize>, WcStatus> {
    let (len, need) = match op {
        Op::Write { len } => (len as u64, AccessFlags::REMOTE_WRITE),
        Op::Read { len } => (u64::from(len), AccessFlags::REMOTE_READ),
        Op::Cas { .. } | Op::Faa { .. } => {
            if addr % 8 != 0 {
                return Err(WcStatus::RemInvReqErr);
            }
            (8, AccessFlags::REMOTE_ATOMIC)
        }
    };
    if len == 0 {
        return Ok(None);
    }
    let i = models
        .iter()
        .position(|m| m.rkey == rkey)
        .ok_or(WcStatus::RemAccessErr)?;
    let m = &models[i];
    let inside = addr >= m.addr
        && addr
            .checked_add(len)
            .is_some_and(|end| end <= m.addr + m.bytes.len() as u64);
    if !m.access.contains(need) || !inside {
        return Err(WcStatus::RemAccessErr);
    }
    Ok(Some(i))
}

/// Forged one-sided requests against the model: each connection runs requests one at a time
/// until one fails; every answer, and every byte of both registrations, must be the model's.
#[test]
fn one_sided_requests_are_checked_as_a_nic_checks_them() {
    count_panics();
    let mut t = Target::new();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let ro = t.filled(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, 1);
    let rw = t.filled(4096, AccessFlags::ALL, 2);
    let mut models = [&ro, &rw].map(|mr| Model {
        addr: mr.addr(),
        rkey: mr.rkey(),
        access: mr.access(),
        bytes: mr.bytes().to_vec(),
    });
    let (mut ok, mut refused) = (0, 0);
    for conn in 0..500 {
        let (mut peer, qp) = t.connection();
        let mut ssn = 0u64;
        loop {
            ssn += 1;
            let m = rng.pick(&[0usize, 1, 1, 1, 1, 1]);
            let rkey = match rng.below(32) {
                0 => rng.next() as u32,
                1 => models[m].rkey ^ 1,
                _ => models[m].rkey,
            };
            let op = match rng.below(4) {
                0 => Op::Write {
                    len: match rng.below(4) {
                        0 => rng.pick(&[0, 1, 8, 4096, 4097]),
                        _ => rng.below(4097) as usize,
                    },
                },
                1 => Op::Read {
                    len: match rng.below(4) {
                        0 => rng.pick(&[0, 1, 8, 4096, 4097, u32::MAX]),
                        _ => rng.below(4097) as u32,
                    },
                },
                2 => Op::Cas {
                    compare: if rng.below(2) == 0 { rng.next() } else { 0 },
                    swap: rng.next(),
                },
                _ => Op::Faa { add: rng.next() },
            };
            let len = match op {
                Op::Write { len } => len as u64,
                Op::Read { len } => u64::from(len),
                Op::Cas { .. } | Op::Faa { .. } => 8,
            };
            // Mostly inside the registration (atomics on 8-byte words), sometimes across
            // either end, at the top of the address space, or unaligned.
            let base = models[m].addr;
            let room = 4096u64.saturating_sub(len) + 1;
            let addr = match rng.below(48) {
                0 => base.wrapping_sub(rng.below(64) + 1),
                1 => (base + 4096).wrapping_sub(len).wrapping_add(rng.below(16) + 1),
                2 => u64::MAX - rng.below(16),
                3 => base + (rng.below(room) | 1),
                _ if len == 8 => base + rng.below(room) / 8 * 8,
                _ => base + rng.below(room),
            };
            let want = expect(&models, op, addr, rkey);
            let (a, k) = (addr.to_le_bytes(), rkey.to_le_bytes());
            let s = ssn.to_le_bytes();
            let mut data = Vec::new();
            let bytes = match op {
                Op::Write { len } => {
                    data = (0..len).map(|_| rng.next() as u8).collect();
                    frame(WRITE, &fields(&[&s, &a, &k, &[ACK_REQ], &[0; 4]]), &data)
                }
                Op::Read { len } => frame(READ_REQ, &fields(&[&s, &a, &k, &len.to_le_bytes()]), &[]),
                Op::Cas { compare, swap } => frame(
                    ATOMIC,
                    &fields(&[&s, &a, &k, &[0], &compare.to_le_bytes(), &swap.to_le_bytes()]),
                    &[],
                ),
                Op::Faa { add } => frame(ATOMIC, &fields(&[&s, &a, &k, &[1], &add.to_le_bytes(), &[0; 8]]), &[]),
            };
            peer.send(&bytes);
            let (kind, body) = peer.next_whole().expect("an answer to the request");
            match want {
                Err(status) => {
                    refused += 1;
                    assert_eq!((kind, u64_at(&body, 0)), (NAK, ssn), "conn {conn} {op:?} at {addr:#x}");
                    assert_eq!(WcStatus::from_raw(u32::from(body[8])), status, "{op:?} at {addr:#x}");
                    // Then the QP is in the error state: a Fatal, and the connection closes.
                    assert_eq!(peer.next().map(|f| f.0), Some(FATAL));
                    assert_eq!(peer.next().map(|f| f.0), None, "closed after the Fatal");
                    wait_error(&qp, &format!("conn {conn}: the target's QP after a NAK"));
                    break;
                }
                Ok(target) => {
                    ok += 1;
                    let off = target.map(|i| (i, (addr - models[i].addr) as usize));
                    match op {
                        Op::Write { len } => {
                            assert_eq!((kind, u64_at(&body, 0)), (ACK, ssn), "{op:?}");
                            if let Some((i, off)) = off {
                                models[i].bytes[off..off + len].copy_from_slice(&data);
                            }
                        }
                        Op::Read { len } => {
                            assert_eq!((kind, u64_at(&body, 0)), (READ_RESP, ssn), "{op:?}");
                            let want: &[u8] = match off {
                                Some((i, off)) => &models[i].bytes[off..off + len as usize],
                                None => &[],
                            };
                            assert_eq!(&body[8..], want, "the bytes read");
                        }
                        Op::Cas { .. } | Op::Faa { .. } => {
                            let (i, off) = off.expect("an atomic acts on 8 bytes");
                            let word = &mut models[i].bytes[off..off + 8];
                            let old = u64::from_ne_bytes(word.try_into().expect("8 bytes"));
                            assert_eq!((kind, u64_at(&body, 0), u64_at(&body, 8)), (ATOMIC_RESP, ssn, old));
                            let new = match op {
                                Op::Cas { compare, swap } if old == compare => swap,
                                Op::Faa { add } => old.wrapping_add(add),
                                _ => old,
                            };
                            word.copy_from_slice(&new.to_ne_bytes());
                        }
                    }
                }
            }
            if ssn > 12 {
                break;
            }
        }
        assert_eq!(ro.bytes().to_vec(), models[0].bytes, "the read-only registration");
        assert_eq!(rw.bytes().to_vec(), models[1].bytes, "the read-write registration");
        drop(qp);
    }
    println!("{ok} requests answered, {refused} refused");
    drop(t);
    // The generator must reach both outcomes often, or the test checks little.
    assert!(ok > 1000 && refused > 250, "{ok} answered, {refused} refused");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// One frame no well-behaved initiator sends, or one that is fine (to get past the first).
fn junk(rng: &mut Rng, ssn: u64) -> Vec<u8> {
    let s = ssn.to_le_bytes();
    let any = rng.next().to_le_bytes();
    match rng.below(20) {
        // Responses to requests the target never made.
        0 => frame(ACK, &any, &[]),
        1 => frame(NAK, &fields(&[&any, &[rng.below(30) as u8]]), &[]),
        2 => frame(
            rng.pick(&[READ_RESP, READ_PART]),
            &any,
            &vec![9; rng.below(100) as usize],
        ),
        3 => frame(ATOMIC_RESP, &fields(&[&any, &any]), &[]),
        4 => frame(FATAL, &[], &[]),
        // Kinds the format does not have, with whatever follows.
        5 => {
            let kind = rng.pick(&[0u8, 5, 9, 15, 19, 21, 255]);
            frame(kind, &vec![1; rng.below(40) as usize], &[])
        }
        // A known kind with its fields cut short, or with bytes after a fixed-size frame.
        6 => {
            let kind = rng.pick(&[SEND, WRITE, READ_REQ, ATOMIC, ACK, NAK, ATOMIC_RESP]);
            frame(kind, &any[..rng.below(8) as usize], &[])
        }
        7 => frame(READ_REQ, &fields(&[&s, &any, &any[..4], &[0; 4], &[1]]), &[]),
        // Flags with bits the format does not define; an atomic opcode it does not have.
        8 => frame(SEND, &fields(&[&s, &[4 | rng.below(250) as u8], &[0; 4]]), &[1, 2, 3]),
        9 => frame(
            ATOMIC,
            &fields(&[&s, &[0; 8], &[0; 4], &[2 + rng.below(200) as u8], &any, &any]),
            &[],
        ),
        // A length no message has, or none at all.
        10 => rng.pick(&[u32::MAX, (1 << 30) + 65 + 1, 0]).to_le_bytes().to_vec(),
        // A Send too long for the receive it lands in, or one that fits.
        11 => frame(
            SEND,
            &fields(&[&s, &[ACK_REQ], &[0; 4]]),
            &vec![3; 65 + rng.below(100) as usize],
        ),
        _ => frame(
            SEND,
            &fields(&[&s, &[ACK_REQ], &[0; 4]]),
            &vec![4; rng.below(65) as usize],
        ),
    }
}

/// Junk after a good handshake: responses to nothing, unknown kinds, cut fields, absurd
/// lengths, Sends too long for their receive. Whatever comes, the target's QP either still
/// serves (a Write asked to be acknowledged is) or is in the error state and has closed the
/// connection: never a state between, never a panic. Then a well-behaved peer on the same
/// device is served as usual.
#[test]
fn junk_leaves_a_qp_serving_or_closed_never_between() {
    count_panics();
    let mut t = Target::new();
    let mut rng = Rng(0x0dd_f00d_0002);
    let (mut serving, mut closed) = (0, 0);
    let mut seen = std::collections::HashMap::new();
    for conn in 0..300u64 {
        let (mut peer, qp) = t.connection();
        // One receive per frame: a Send that fits never waits for one (RNR).
        for i in 0..3 {
            let buf = t.pd.register(64, AccessFlags::LOCAL_WRITE).expect("register");
            qp.post_recv(RecvWr::new(conn * 4 + i, buf))
                .map_err(|e| e.error)
                .expect("post_recv");
        }
        let n = 1 + rng.below(3);
        let mut frames = Vec::new();
        for ssn in 1..=n {
            frames.extend(junk(&mut rng, ssn));
        }
        peer.send(&frames);
        // A zero-length Write asking to be acknowledged: any live responder answers it.
        let probe: u64 = 1000 + conn;
        peer.send(&frame(
            WRITE,
            &fields(&[&probe.to_le_bytes(), &[0; 8], &[0; 4], &[ACK_REQ], &[0; 4]]),
            &[],
        ));
        let mut answered = false;
        while let Some((kind, body)) = peer.next() {
            if kind == ACK && u64_at(&body, 0) == probe {
                answered = true;
                break;
            }
        }
        if answered {
            serving += 1;
            assert!(!qp.is_error(), "conn {conn}: acknowledged by a QP in the error state");
        } else {
            closed += 1;
            wait_error(&qp, &format!("conn {conn}: closed"));
            let deadline = Instant::now() + WAIT;
            // A QP in error has completed each of its receives: delivered, failed or flushed.
            while !(0..3).all(|i| seen.contains_key(&(conn * 4 + i))) {
                assert!(Instant::now() < deadline, "conn {conn}: a receive never completed");
                reap(&t.cq, &mut seen);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(qp);
    }
    reap(&t.cq, &mut seen);
    println!("{serving} connections still served, {closed} closed");
    assert!(serving > 20 && closed > 100, "{serving} served, {closed} closed");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
    well_behaved_peer_is_served(&t);
}

/// Takes what the CQ holds, counting completions by work request: none may complete twice.
fn reap(cq: &CompletionQueue, seen: &mut std::collections::HashMap<u64, WcStatus>) {
    let mut out = Vec::new();
    cq.poll(&mut out, 64).expect("poll");
    for c in out {
        if let Some(first) = seen.insert(c.wr_id, c.status) {
            panic!("receive {} completed twice ({first:?}, then {c:?})", c.wr_id);
        }
    }
}

/// The transport's own client on the same device: a Send and an RDMA Write, as usual.
fn well_behaved_peer_is_served(t: &Target) {
    let cpd = t.dev.alloc_pd().expect("pd");
    let ccq = t.dev.create_cq(64).expect("cq");
    let listener = Listener::bind(&t.dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let sopts = QpOptions::new(&t.pd, &t.cq);
    let server = std::thread::spawn(move || {
        let req = listener.accept(Some(WAIT)).expect("accept");
        req.accept(&sopts, b"").expect("accept the qp")
    });
    let (cqp, _) = connect(addr, &QpOptions::new(&cpd, &ccq), b"", WAIT).expect("connect");
    let sqp = server.join().expect("server");
    let buf = t.pd.register(16, AccessFlags::LOCAL_WRITE).expect("register");
    sqp.post_recv(RecvWr::new(77, buf))
        .map_err(|e| e.error)
        .expect("post_recv");
    let mut msg = cpd.register(5, AccessFlags::LOCAL_WRITE).expect("register");
    msg.write_at(0, b"hello").expect("fill");
    cqp.post_send(SendWr::send(1, msg))
        .map_err(|e| e.error)
        .expect("post_send");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut got = Vec::new();
    rt.block_on(async {
        while !got.iter().any(|c: &Completion| c.wr_id == 77) {
            tokio::time::timeout(WAIT, t.cq.wait(&mut got, 1))
                .await
                .expect("the Send arrives")
                .expect("cq wait");
        }
    });
    let c = got.iter().find(|c| c.wr_id == 77).expect("the receive");
    assert_eq!((c.status, c.byte_len), (WcStatus::Success, 5), "{c:?}");
}

/// Connecting to a port where something else listens: one that stays silent, and one that
/// answers in another protocol. Each is an error that says what to check, within the
/// connection timeout.
#[test]
fn connecting_to_something_else_says_so() {
    let dev = Device::open("tcp").expect("the tcp provider");
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(4).expect("cq"));
    for reply in [&b""[..], b"HTTP/1.1 400 Bad Request\r\n\r\n"] {
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = other.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut s, _) = other.accept().expect("accept");
            let _ = s.write_all(reply);
            // Open until the client has given up.
            std::thread::sleep(Duration::from_millis(1500));
        });
        let started = Instant::now();
        let err = connect(addr, &QpOptions::new(&pd, &cq), b"", Duration::from_secs(1))
            .map(|_| ())
            .expect_err("not an rdma-rpc peer");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "took {:?}",
            started.elapsed()
        );
        let msg = err.to_string();
        match reply.len() {
            0 => assert!(
                matches!(err, Error::Timeout(_)) && msg.contains("check the address and the provider"),
                "{msg}"
            ),
            _ => assert!(
                matches!(err, Error::Protocol(_)) && msg.contains("not an rdma-rpc"),
                "{msg}"
            ),
        }
        server.join().expect("the other server");
    }
}

/// Both ends of a handshake between builds of two wire versions say which versions they are:
/// the listener replies with its own (and goes on serving others), and `connect` turns that
/// reply into an error that names both.
#[test]
fn a_peer_of_another_wire_version_is_refused_by_name() {
    count_panics();
    let mut t = Target::new();
    let mut old = TcpStream::connect(t.addr).expect("connect");
    old.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut hello = MAGIC.to_vec();
    hello.push(2);
    hello.extend_from_slice(&1u16.to_le_bytes());
    old.write_all(&hello).expect("an old hello");
    let mut reply = [0u8; 12];
    old.read_exact(&mut reply).expect("the listener's reply");
    assert_eq!(&reply[..9], &[&MAGIC[..], &[3]].concat()[..]);
    assert_eq!(reply[9], 2, "refused for its version");
    assert_eq!(u16::from_le_bytes([reply[10], reply[11]]), 3, "the listener's version");
    // The listener still serves peers of its own version.
    let (_peer, qp) = t.connection();
    assert!(!qp.is_error());

    // A client of this build against a listener of version 9.
    let other = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = other.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (mut s, _) = other.accept().expect("accept");
        let mut head = [0u8; 9];
        s.read_exact(&mut head).expect("the hello's head");
        let mut rest = vec![0u8; usize::from(head[8])];
        s.read_exact(&mut rest).expect("the hello");
        let mut reply = MAGIC.to_vec();
        reply.extend_from_slice(&[3, 2, 9, 0]);
        s.write_all(&reply).expect("the refusal");
    });
    let err = connect(addr, &QpOptions::new(&t.pd, &t.cq), b"", WAIT)
        .map(|_| ())
        .expect_err("refused");
    let msg = err.to_string();
    assert!(
        matches!(err, Error::Protocol(_)) && msg.contains("version 9") && msg.contains("speaks 3"),
        "{msg}"
    );
    server.join().expect("the other listener");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// A read response whose request number is one of the target's Sends is not a Read's answer:
/// the target's QP fails (`BAD_RESP_ERR`) and nothing lands in the Send's buffer. Before, an
/// answer of the Send's length landed in it, a buffer registered without `LOCAL_WRITE`.
#[test]
fn a_read_answer_for_a_send_lands_nowhere() {
    count_panics();
    let mut t = Target::new();
    let msg = t.filled(64, AccessFlags::NONE, 9);
    let before = msg.bytes().to_vec();
    let (mut peer, qp) = t.connection();
    qp.post_send(SendWr::send(1, msg).len(64))
        .map_err(|e| e.error)
        .expect("post_send");
    let (kind, body) = peer.next().expect("the Send");
    assert_eq!(kind, SEND);
    let ssn = u64_at(&body, 0);
    peer.send(&frame(READ_RESP, &ssn.to_le_bytes(), &[0xee; 64]));
    let mut out = Vec::new();
    let deadline = Instant::now() + WAIT;
    while out.is_empty() {
        assert!(Instant::now() < deadline, "no completion for the Send");
        t.cq.poll(&mut out, 1).expect("poll");
        std::thread::yield_now();
    }
    let wc = out.pop().expect("one");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::BadRespErr), "{wc:?}");
    let buf = wc.buf.expect("the Send's buffer back");
    assert_eq!(buf.bytes().to_vec(), before, "nothing landed in the Send's buffer");
    wait_error(&qp, "a read answer for a Send");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// The tests that measure the process's memory run one at a time.
static MEMORY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Field `i` of `/proc/self/statm`, in bytes (0: the virtual size, 1: the resident set).
fn statm_bytes(i: usize) -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(i)
        .and_then(|p| p.parse().ok())
        .expect("a field of statm");
    pages * 4096
}

/// The process's resident memory.
fn resident_bytes() -> u64 {
    statm_bytes(1)
}

/// A peer that asks for reads and does not take the answers costs the target no copy of them:
/// they wait in the registration, as a NIC's would, and go out whole once the peer reads. On
/// the way the target's application still writes the registration (nothing holds its lock
/// while the link is full). Before, each answer the socket did not take was copied into the
/// sending backlog: these 128 reads of a 4 MiB registration grew the process by
/// about 500 MiB (64 of 16 MiB by 1 GiB).
#[test]
fn answers_the_peer_does_not_take_cost_no_copies() {
    count_panics();
    let _alone = MEMORY.lock();
    let mut t = Target::new();
    let len = 4usize << 20;
    let reads = 128u64;
    let mut mr = t.filled(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, 3);
    let flag = t.filled(8, AccessFlags::ALL, 0);
    let want = mr.bytes().to_vec();
    let (mut peer, qp) = t.connection();
    let before = resident_bytes();
    peer.read_whole(&mr, 1..=reads);
    // A Write behind them sets the flag: the target's engine takes requests in order, so it
    // has taken every read by then (their answers queued), and the peer still reads nothing.
    let ssn = reads + 1;
    peer.send(&frame(
        WRITE,
        &fields(&[
            &ssn.to_le_bytes(),
            &flag.addr().to_le_bytes(),
            &flag.rkey().to_le_bytes(),
            &[0],
            &[0; 4],
        ]),
        &[1],
    ));
    let deadline = Instant::now() + WAIT;
    while flag.bytes()[0] != 1 {
        assert!(
            Instant::now() < deadline,
            "the target never handled the Write behind the reads"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let grown = resident_bytes().saturating_sub(before);
    println!(
        "{reads} answers of {} MiB waiting: the process grew by {} MiB",
        len >> 20,
        grown >> 20
    );
    assert!(
        grown < 64 << 20,
        "the answers waiting cost {} MiB: copies of them, not references",
        grown >> 20
    );
    // The application writes its registration meanwhile (the same bytes, so that the answers
    // stay checkable): the sending side must not hold its lock while the peer reads nothing.
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        let head = mr.bytes()[..4096].to_vec();
        mr.write_at(0, &head).expect("write");
        let _ = tx.send(());
        mr
    });
    rx.recv_timeout(WAIT)
        .expect("the application could not write its registration while answers waited");
    let mr = writer.join().expect("the writing thread");
    for ssn in 1..=reads {
        let (kind, body) = peer.next_whole().expect("an answer");
        assert_eq!((kind, u64_at(&body, 0)), (READ_RESP, ssn));
        assert!(body[8..] == want[..], "answer {ssn}: the bytes read differ");
    }
    assert!(!qp.is_error());
    drop((mr, qp));
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// A long read response goes in parts, and the target's own requests go between them: with
/// a 32 MiB answer backed up behind a peer that reads nothing (the link takes a few MiB), the
/// application holds the memory it comes from and posts a Send. The Send reaches the peer
/// before the answer is out (before, the writer waited in the middle of the answer's frame for
/// the memory, and the Send behind it waited with it), and the answer comes whole once the
/// memory is let go.
#[test]
fn a_send_goes_between_the_parts_of_an_answer_waiting_for_held_memory() {
    count_panics();
    let _alone = MEMORY.lock();
    let mut t = Target::new();
    let len = 32usize << 20;
    let reads = 1u64;
    let mut mr = t.filled(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, 7);
    let want = mr.bytes().to_vec();
    let note = t.filled(5, AccessFlags::NONE, 1);
    let (mut peer, qp) = t.connection();
    peer.read_whole(&mr, 1..=reads);
    // Time for the target to take the requests and fill the link with what it takes.
    std::thread::sleep(Duration::from_millis(300));
    let held = mr.bytes_mut();
    qp.post_send(SendWr::send(1, note).len(5))
        .map_err(|e| e.error)
        .expect("post_send");
    // The peer reads: the Send comes before the last answer's last part.
    let mut answers = Vec::new();
    let mut parts_after = 0;
    let mut send_seen = false;
    while !send_seen {
        let (kind, body) = peer.next().expect("a frame");
        match kind {
            SEND => send_seen = true,
            READ_PART | READ_RESP => answers.push((kind, body)),
            other => panic!("an unexpected frame of kind {other}"),
        }
        assert!(
            answers.iter().filter(|(k, _)| *k == READ_RESP).count() < reads as usize,
            "the answer went out whole before the Send, with the memory held"
        );
    }
    drop(held);
    while answers.iter().filter(|(k, _)| *k == READ_RESP).count() < reads as usize {
        let (kind, body) = peer.next().expect("the rest of the answers");
        assert!(matches!(kind, READ_PART | READ_RESP), "kind {kind}");
        answers.push((kind, body));
        parts_after += 1;
    }
    assert!(parts_after > 0);
    // Joined by Read, in order, each answer is the registration's bytes.
    let mut whole = Vec::new();
    let mut ssn = 1;
    for (kind, body) in answers {
        assert_eq!(u64_at(&body, 0), ssn, "the parts of one answer, then the next");
        whole.extend_from_slice(&body[8..]);
        if kind == READ_RESP {
            assert!(whole == want, "answer {ssn}: the bytes read differ");
            whole.clear();
            ssn += 1;
        }
    }
    assert!(!qp.is_error());
    drop((mr, qp));
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// The most the process has held resident since the last [`reset_peak`] (`VmHWM`).
fn peak_resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kib * 1024
}

/// Starts the peak over from what is resident now (Linux 4.0 and later).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak (/proc/self/clear_refs)");
}

/// Sends streamed at a QP with no receive posted: the target holds what arrives behind the
/// first one (RNR) only up to a cap, then stops reading until the stall ends; here the RNR
/// budget runs out, the first Send is refused with RNR_RETRY_EXC_ERR and the rest discarded.
/// Before the cap the target held whatever the link delivered in the budget's 70 ms (36-57 MiB
/// of these 64 in three runs; 6-7 MiB with it).
#[test]
fn sends_waiting_for_a_receive_are_held_up_to_a_cap() {
    count_panics();
    let _alone = MEMORY.lock();
    let mut t = Target::new();
    let (mut peer, qp) = t.connection();
    let mut stream = peer.0.try_clone().expect("clone the socket");
    let sends = 64u64;
    reset_peak();
    let before = peak_resident_bytes();
    let sender = std::thread::spawn(move || {
        let payload = vec![7u8; 1 << 20];
        for ssn in 1..=sends {
            // Once the target has refused the first, it may close after the Fatal.
            let f = frame(SEND, &fields(&[&ssn.to_le_bytes(), &[ACK_REQ]]), &payload);
            if stream.write_all(&f).is_err() {
                break;
            }
        }
    });
    let (kind, body) = peer.next().expect("an answer to the first Send");
    assert_eq!((kind, u64_at(&body, 0)), (NAK, 1), "the first Send is refused");
    assert_eq!(WcStatus::from_raw(u32::from(body[8])), WcStatus::RnrRetryExcErr);
    sender.join().expect("the sending thread");
    let grown = peak_resident_bytes().saturating_sub(before);
    println!(
        "{sends} Sends of 1 MiB with no receive posted: the peak grew by {} MiB",
        grown >> 20
    );
    assert!(
        grown < 16 << 20,
        "the target held {} MiB of Sends waiting for a receive",
        grown >> 20
    );
    drop(qp);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// Two fetch-and-adds on one word run in the order they came, even when the first had to wait
/// for the application's borrow and the second did not: the first found the word held, the
/// application let go, then the second came, while answers the peer has not taken yet sat in
/// front of both. Each must return the word as the one before it left it.
#[test]
fn atomics_that_waited_for_a_borrow_keep_their_order() {
    count_panics();
    let mut t = Target::new();
    let len = 4usize << 20;
    let bulk = t.filled(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, 5);
    let mut word = t.filled(8, AccessFlags::ALL, 0);
    let flag = t.filled(8, AccessFlags::ALL, 0);
    let start = u64::from_ne_bytes(word.bytes()[..8].try_into().expect("8 bytes"));
    let (mut peer, qp) = t.connection();
    let (wa, wk) = (word.addr().to_le_bytes(), word.rkey().to_le_bytes());
    let faa = |ssn: u64, add: u64| {
        let (a, k) = (wa, wk);
        frame(
            ATOMIC,
            &fields(&[&ssn.to_le_bytes(), &a, &k, &[1], &add.to_le_bytes(), &[0; 8]]),
            &[],
        )
    };
    let mark = |ssn: u64, value: u8| {
        let (a, k) = (flag.addr().to_le_bytes(), flag.rkey().to_le_bytes());
        frame(WRITE, &fields(&[&ssn.to_le_bytes(), &a, &k, &[0], &[0; 4]]), &[value])
    };
    let until_marked = |value: u8| {
        let deadline = Instant::now() + WAIT;
        while flag.bytes()[0] != value {
            assert!(Instant::now() < deadline, "the target never took mark {value}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // Answers the peer does not take yet: the target's sending side is backed up.
    peer.read_whole(&bulk, 1..=4);
    let held = word.bytes_mut();
    peer.send(&faa(5, 1));
    peer.send(&mark(6, 1));
    until_marked(1);
    drop(held);
    peer.send(&faa(7, 2));
    peer.send(&mark(8, 2));
    until_marked(2);
    let mut olds = Vec::new();
    while olds.len() < 2 {
        let (kind, body) = peer.next().expect("an answer");
        if kind == ATOMIC_RESP {
            olds.push((u64_at(&body, 0), u64_at(&body, 8)));
        }
    }
    assert_eq!(
        olds,
        [(5, start), (7, start.wrapping_add(1))],
        "each fetch-and-add returns the word as the one before it left it"
    );
    let now = u64::from_ne_bytes(word.bytes()[..8].try_into().expect("8 bytes"));
    assert_eq!(now, start.wrapping_add(3));
    drop(qp);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// 256 sockets that trickle their hello a byte every 2 s (never finishing it) fill every
/// handshake slot of a listener. A prompt client still connects: the oldest trickler gives way.
/// And each trickler is cut off once its whole handshake has taken the listener's 10 s, however
/// often its bytes come.
#[test]
fn clients_that_trickle_their_handshake_keep_no_one_out_and_are_cut_off() {
    count_panics();
    let dev = Device::open("tcp").expect("tcp");
    let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let started = Instant::now();
    let tricklers: Vec<TcpStream> = (0..256)
        .map(|_| {
            let s = TcpStream::connect(addr).expect("connect a trickler");
            s.set_nonblocking(true).expect("nonblocking");
            s
        })
        .collect();
    // The tricklers' byte every 2 s, from their own thread, until the listener closes them.
    let writers: Vec<TcpStream> = tricklers.iter().map(|s| s.try_clone().expect("clone")).collect();
    let trickle = std::thread::spawn(move || {
        for i in 0..8 {
            for w in &writers {
                let _ = (&*w).write(&MAGIC[i % MAGIC.len()..][..1]);
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    std::thread::sleep(Duration::from_millis(500)); // every trickler holds its slot now
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    let opts = QpOptions::new(&pd, &cq);
    let server = std::thread::spawn(move || {
        listener
            .accept(Some(WAIT))
            .expect("the prompt client's request")
            .accept(&opts, b"")
            .map(|_qp| ())
    });
    let (pd2, cq2) = (dev.alloc_pd().expect("pd"), dev.create_cq(16).expect("cq"));
    connect(addr, &QpOptions::new(&pd2, &cq2), b"", Duration::from_secs(5)).expect("a prompt client connects");
    server.join().expect("server thread").expect("accepted");
    // Every trickler is closed by the listener within its 10 s, with some margin.
    let mut open = tricklers.len();
    while open > 0 && started.elapsed() < Duration::from_secs(16) {
        std::thread::sleep(Duration::from_millis(200));
        open = tricklers
            .iter()
            .filter(|s| {
                let (mut b, mut r): ([u8; 64], &TcpStream) = ([0u8; 64], s);
                matches!(r.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            })
            .count();
    }
    assert_eq!(open, 0, "tricklers still open after {:?}", started.elapsed());
    trickle.join().expect("trickle thread");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a provider thread panicked");
}

/// The process's virtual memory: what allocations take even before their pages are touched.
fn virtual_bytes() -> u64 {
    statm_bytes(0)
}

/// A frame's length field alone allocates nothing: eight peers announce Sends of almost 1 GiB
/// (no receive posted, so they would be held) and send only their heads, and another announces
/// a 1 GiB atomic, which no payload-less frame can be. The target's memory does not grow by
/// what they announce, and the atomic's connection is ended as a protocol breach.
#[test]
fn a_length_field_alone_allocates_nothing() {
    count_panics();
    let _alone = MEMORY.lock();
    let mut t = Target::new();
    let mut peers: Vec<_> = (0..8).map(|_| t.connection()).collect();
    let (mut liar, liar_qp) = t.connection();
    std::thread::sleep(Duration::from_millis(200)); // every connection's threads are up
    let before = virtual_bytes();
    for (peer, _) in &mut peers {
        let fields = fields(&[&1u64.to_le_bytes(), &[0u8; 5]]);
        let mut f = ((1 + fields.len() + (1 << 30) - 64) as u32).to_le_bytes().to_vec();
        f.push(SEND);
        f.extend_from_slice(&fields);
        f.extend_from_slice(&[7; 4096]); // the first bytes of the payload, and no more
        peer.send(&f);
    }
    let mut f = (1u32 << 30).to_le_bytes().to_vec();
    f.push(ATOMIC);
    liar.send(&f);
    wait_error(&liar_qp, "a 1 GiB atomic");
    std::thread::sleep(Duration::from_millis(300)); // the Sends' heads are read by now
    let grown = virtual_bytes().saturating_sub(before);
    // Each announced length allocated whole would be 8 GiB and more; the rest of the process
    // (other tests' threads and their malloc arenas) stays well below half that.
    assert!(
        grown < 4 << 30,
        "the target's memory grew by {} MiB for announced lengths",
        grown >> 20
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
    drop(peers);
}

/// A key is worth only its own protection domain and only while its registration lives: a
/// peer connected to a QP of one PD that names a registration of another PD of the same
/// process, or one that was deregistered, gets a remote access error and moves no byte, as on
/// a NIC.
#[test]
fn keys_of_another_domain_or_of_a_deregistered_region_are_refused() {
    count_panics();
    let mut t = Target::new();
    let other_pd = t.dev.alloc_pd().expect("a second protection domain");
    let mut elsewhere = other_pd.register(4096, AccessFlags::ALL).expect("register");
    elsewhere.bytes_mut().fill(0x5a);
    let gone = t.filled(4096, AccessFlags::ALL, 3);
    let (gone_addr, gone_rkey) = (gone.addr(), gone.rkey());
    drop(gone);
    let cases = [
        ("another domain's registration", elsewhere.addr(), elsewhere.rkey()),
        ("a deregistered registration", gone_addr, gone_rkey),
    ];
    for (what, addr, rkey) in cases {
        for write in [false, true] {
            let (mut peer, qp) = t.connection();
            let (a, k) = (addr.to_le_bytes(), rkey.to_le_bytes());
            let bytes = if write {
                frame(
                    WRITE,
                    &fields(&[&1u64.to_le_bytes(), &a, &k, &[ACK_REQ], &[0; 4]]),
                    &[0xee; 64],
                )
            } else {
                frame(
                    READ_REQ,
                    &fields(&[&1u64.to_le_bytes(), &a, &k, &64u32.to_le_bytes()]),
                    &[],
                )
            };
            peer.send(&bytes);
            let (kind, body) = peer.next_whole().expect("an answer");
            assert_eq!((kind, u64_at(&body, 0)), (NAK, 1), "{what}, write {write}");
            assert_eq!(
                WcStatus::from_raw(u32::from(body[8])),
                WcStatus::RemAccessErr,
                "{what}, write {write}"
            );
            wait_error(&qp, what);
        }
    }
    assert!(
        elsewhere.bytes().iter().all(|&b| b == 0x5a),
        "another domain's registration was written"
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}

/// A TCP peer whose process stopped still has its kernel acknowledge, so the connection never
/// breaks by itself; each side's writer beats while idle instead, and a peer that sends nothing
/// at all, beats included, for 10 s is taken for dead (its QP to the error state, what waits on
/// it flushed). A raw peer that says nothing after the handshake is that peer. Two QPs of this
/// provider that stay idle as long keep each other alive with their beats.
#[test]
fn a_peer_silent_past_the_keepalive_is_taken_for_dead_and_idle_ones_are_not() {
    count_panics();
    let mut t = Target::new();
    let (mut silent, silent_qp) = t.connection();
    // An idle pair of this provider's own QPs.
    let idle_listener = Listener::bind(&t.dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let idle_addr = idle_listener.local_addr().expect("addr");
    let (pd, cq) = (t.dev.alloc_pd().expect("pd"), t.dev.create_cq(16).expect("cq"));
    let opts = QpOptions::new(&pd, &cq);
    let accepting = std::thread::spawn(move || {
        idle_listener
            .accept(Some(WAIT))
            .expect("accept")
            .accept(&opts, b"")
            .expect("the idle server's QP")
    });
    let (idle_client, _) = connect(idle_addr, &QpOptions::new(&t.pd, &t.cq), b"", WAIT).expect("the idle client's QP");
    let idle_server = accepting.join().expect("the accepting thread");
    let started = Instant::now();
    // The target beats towards the silent peer meanwhile.
    let (kind, _) = silent.next().expect("a frame from the target");
    assert_eq!(kind, 21, "a beat");
    wait_error(&silent_qp, "a peer silent past the keepalive");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    std::thread::sleep(Duration::from_secs(12).saturating_sub(took));
    assert!(
        !idle_client.is_error() && !idle_server.is_error(),
        "an idle pair of live QPs was taken for dead"
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
}
