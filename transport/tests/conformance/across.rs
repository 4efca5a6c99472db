//! The suite's cases about what crosses the wire, written so that the two ends can be on two
//! hosts: the target is a reflector that answers each message it receives with a report of
//! that receive, and the initiator checks the target's memory by reading it back. Everywhere
//! else the reflector runs in this process; in the two-host lane (`RDMA_RPC_ROLE=client`,
//! `scripts/wire-suites.sh`) it runs on the other host (`rpc-core/tests/common/split.rs`).
//!
//! The request (the connection's private data): the target region's length and access flags,
//! the seed of the pattern it starts with, and how many receives of what size the reflector
//! keeps posted. The reply: the region's address, rkey and length. A report is a text line —
//! the receive's id, status, opcode, length and immediate, the reflector's path attributes, and
//! an FNV-1a digest of its whole region — followed by the first bytes received.

use std::net::SocketAddr;

use rdma_rpc_transport::*;

use super::{device, keyless_write, ok, pattern, test_ip, KEYLESS, WAIT};

#[path = "../../../rpc-core/tests/common/split.rs"]
#[allow(dead_code)] // this file uses `serve`
mod split;

/// How many receives the initiator keeps for reports, and their size.
const REPORTS: usize = 16;
const REPORT_LEN: usize = 8192;
/// The received bytes a report carries at most.
const ECHOED: usize = 4096;

/// What the initiator asks of the reflector.
#[derive(Clone, Copy)]
struct Ask {
    region: u32,
    access: AccessFlags,
    seed: u32,
    recvs: u16,
    recv_len: u32,
}

impl Ask {
    fn new(region: u32) -> Self {
        Ask {
            region,
            access: AccessFlags::ALL,
            seed: 1,
            recvs: 8,
            recv_len: 4096,
        }
    }
    fn access(self, access: AccessFlags) -> Self {
        Ask { access, ..self }
    }
    fn recvs(self, recvs: u16) -> Self {
        Ask { recvs, ..self }
    }
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend(self.region.to_le_bytes());
        v.extend(self.access.bits().to_le_bytes());
        v.extend(self.seed.to_le_bytes());
        v.extend(self.recvs.to_le_bytes());
        v.extend(self.recv_len.to_le_bytes());
        v
    }
    fn decode(b: &[u8]) -> Option<Ask> {
        let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        Some(Ask {
            region: u32_at(0)?.min(64 << 20),
            access: access_from(u32_at(4)?),
            seed: u32_at(8)?,
            recvs: u16::from_le_bytes(b.get(12..14)?.try_into().ok()?).min(256),
            recv_len: u32_at(14)?.min(1 << 20),
        })
    }
}

/// The flags among `bits` (unknown bits are dropped).
fn access_from(bits: u32) -> AccessFlags {
    [
        AccessFlags::LOCAL_WRITE,
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_ATOMIC,
    ]
    .into_iter()
    .filter(|f| bits & f.bits() == f.bits())
    .fold(AccessFlags::NONE, |a, f| a | f)
}

/// FNV-1a over `b`.
fn digest(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn attrs_text(a: Option<PathAttrs>) -> String {
    match a {
        None => "none".into(),
        Some(a) => format!(
            "{},{},{},{},{},{}",
            a.path_mtu, a.read_depth, a.read_responder, a.ack_timeout, a.retry_count, a.rnr_retry
        ),
    }
}

/// The target: accepts connections and reflects each one's receives (see the module's text).
struct Reflector(Listener);

impl split::Serve for Reflector {
    fn addr(&self) -> SocketAddr {
        self.0.local_addr().expect("the reflector's address")
    }
    fn start(self) {
        // A thread that accepts, and one per connection with a runtime of its own.
        std::thread::spawn(move || {
            while let Ok(req) = self.0.accept(None) {
                let Some(ask) = Ask::decode(req.private_data()) else {
                    continue;
                };
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a reflector's runtime");
                    rt.block_on(reflect(req, ask));
                });
            }
        });
    }
}

/// Serves one connection until its QP fails or its peer goes.
async fn reflect(req: ConnectRequest, ask: Ask) {
    let dev = device();
    let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
    let mut region = pd
        .register(ask.region.max(1) as usize, ask.access | AccessFlags::LOCAL_WRITE)
        .expect("the region");
    region
        .write_at(0, &pattern(ask.region as usize, ask.seed))
        .expect("fill the region");
    let recv = |id: u64| {
        RecvWr::new(
            id,
            pd.register(ask.recv_len as usize, AccessFlags::LOCAL_WRITE)
                .expect("recv"),
        )
    };
    let recvs = (0..u64::from(ask.recvs)).map(recv).collect();
    let mut reply = region.addr().to_le_bytes().to_vec();
    reply.extend(region.rkey().to_le_bytes());
    reply.extend(ask.region.to_le_bytes());
    let opts = QpOptions::new(&pd, &cq);
    let Ok(qp) = req.accept_with_recvs(&opts, &reply, recvs) else {
        return;
    };
    let mut next = u64::from(ask.recvs);
    let mut wcs = Vec::new();
    loop {
        wcs.clear();
        if cq.wait(&mut wcs, 16).await.is_err() {
            return;
        }
        for wc in wcs.drain(..) {
            if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                continue;
            }
            let got = wc.buf.as_ref().map(|b| b.bytes().to_vec()).unwrap_or_default();
            let n = (wc.byte_len as usize).min(got.len()).min(ECHOED);
            let mut report = format!(
                "{} {:?} {:?} {} {} {} {:016x}\n",
                wc.wr_id,
                wc.status,
                wc.opcode,
                wc.byte_len,
                wc.imm.map_or("-".into(), |i| i.to_string()),
                attrs_text(qp.path_attrs()),
                digest(&region.bytes()),
            )
            .into_bytes();
            if wc.opcode == WcOpcode::Recv {
                report.extend(&got[..n]);
            }
            if !wc.status.is_success() {
                return;
            }
            let mut out = pd.register(report.len(), AccessFlags::LOCAL_WRITE).expect("report");
            out.write_at(0, &report).expect("report");
            if qp.post_recv(recv(next)).is_err() || qp.post_send(SendWr::send(next | 1 << 63, out)).is_err() {
                return;
            }
            next += 1;
        }
    }
}

/// The initiator's end of a connection to a reflector.
struct Initiator {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    /// The target region.
    region: RemoteRegion,
    /// Completions taken while waiting for others.
    early: Vec<Completion>,
}

/// A receive's report.
#[derive(Debug)]
struct Report {
    wr_id: u64,
    status: String,
    opcode: String,
    byte_len: u32,
    imm: Option<u32>,
    attrs: String,
    digest: u64,
    data: Vec<u8>,
}

impl Initiator {
    /// A reflector for this test (here or on the other host) and a connection to it.
    async fn new(ask: Ask) -> Initiator {
        let listener = Listener::bind(&device(), SocketAddr::new(test_ip(), 0)).expect("bind the reflector");
        let addr = split::serve(Reflector(listener)).await;
        Initiator::connect(addr, ask).await
    }

    async fn connect(addr: SocketAddr, ask: Ask) -> Initiator {
        tokio::task::spawn_blocking(move || {
            let dev = device();
            let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
            let recvs = (0..REPORTS as u64)
                .map(|i| RecvWr::new(i, pd.register(REPORT_LEN, AccessFlags::LOCAL_WRITE).expect("recv")))
                .collect();
            let opts = QpOptions::new(&pd, &cq);
            let (qp, reply) = connect_with_recvs(addr, &opts, &ask.encode(), WAIT, recvs).expect("connect");
            let at = |i: usize| u64::from_le_bytes(reply[i..i + 8].try_into().expect("8"));
            let rkey = u32::from_le_bytes(reply[8..12].try_into().expect("4"));
            let len = u64::from(u32::from_le_bytes(reply[12..16].try_into().expect("4")));
            Initiator {
                qp,
                region: RemoteRegion { addr: at(0), len, rkey },
                pd,
                cq,
                early: Vec::new(),
            }
        })
        .await
        .expect("the connecting task")
    }

    fn buf(&self, data: &[u8]) -> MemoryRegion {
        let mut mr = self
            .pd
            .register(data.len().max(1), AccessFlags::LOCAL_WRITE)
            .expect("register");
        mr.write_at(0, data).expect("fill");
        mr
    }

    fn post(&self, wr: SendWr) {
        self.qp.post_send(wr).map_err(|e| e.error).expect("post_send");
    }

    /// The next completion of a request this side posted (ids below 1<<32).
    async fn done(&mut self) -> Completion {
        self.next(|c| !matches!(c.opcode, WcOpcode::Recv)).await
    }

    /// The next report.
    async fn report(&mut self) -> Report {
        let wc = self.next(|c| matches!(c.opcode, WcOpcode::Recv)).await;
        ok(&wc);
        let bytes = wc.buf.as_ref().expect("the report's buffer").bytes().to_vec();
        let bytes = &bytes[..wc.byte_len as usize];
        // The receive goes back for the next report.
        let buf = wc.buf.expect("the report's buffer");
        self.qp
            .post_recv(RecvWr::new(wc.wr_id, buf))
            .map_err(|e| e.error)
            .expect("repost");
        let nl = bytes.iter().position(|&b| b == b'\n').expect("a report line");
        let line = String::from_utf8_lossy(&bytes[..nl]).into_owned();
        let w: Vec<&str> = line.split(' ').collect();
        assert_eq!(w.len(), 7, "a report: {line}");
        Report {
            wr_id: w[0].parse().expect("id"),
            status: w[1].into(),
            opcode: w[2].into(),
            byte_len: w[3].parse().expect("length"),
            imm: w[4].parse().ok(),
            attrs: w[5].into(),
            digest: u64::from_str_radix(w[6], 16).expect("digest"),
            data: bytes[nl + 1..].to_vec(),
        }
    }

    async fn next(&mut self, want: impl Fn(&Completion) -> bool) -> Completion {
        loop {
            if let Some(i) = self.early.iter().position(&want) {
                return self.early.remove(i);
            }
            let mut got = super::take(&self.cq, 1).await;
            self.early.append(&mut got);
        }
    }

    /// The target region's bytes `at..at+len`, read with RDMA Read.
    async fn read(&mut self, at: u64, len: usize) -> Vec<u8> {
        let dst = self.pd.register(len, AccessFlags::LOCAL_WRITE).expect("register");
        self.post(
            SendWr::new(
                7_000,
                SendOp::Read {
                    remote: self.region.at(at),
                },
            )
            .buf(dst),
        );
        let wc = self.done().await;
        ok(&wc);
        wc.buf.expect("the read's buffer").bytes()[..len].to_vec()
    }

    /// Sends `data` and gives the reflector's report of its receive.
    async fn say(&mut self, data: &[u8]) -> Report {
        self.post(SendWr::send(9_000, self.buf(data)));
        ok(&self.done().await);
        self.report().await
    }
}

#[tokio::test]
async fn send_recv_delivers_bytes() {
    let mut c = Initiator::new(Ask::new(64)).await;
    let r = c.say(b"ping over rdma").await;
    assert_eq!(
        (r.wr_id, r.status.as_str(), r.opcode.as_str(), r.byte_len, r.imm),
        (0, "Success", "Recv", 14, None)
    );
    assert_eq!(r.data, b"ping over rdma");
}

#[tokio::test]
async fn send_with_immediate_and_zero_bytes() {
    let mut c = Initiator::new(Ask::new(64)).await;
    c.post(SendWr::new(1, SendOp::Send { imm: Some(0xdead_beef) }).buf(c.buf(b"abc")));
    c.post(SendWr::new(2, SendOp::Send { imm: Some(7) }));
    let (a, b) = (c.report().await, c.report().await);
    assert_eq!((a.byte_len, a.imm, &a.data[..]), (3, Some(0xdead_beef), &b"abc"[..]));
    assert_eq!((b.byte_len, b.imm, b.data.len()), (0, Some(7), 0));
    ok(&c.done().await);
    ok(&c.done().await);
}

#[tokio::test]
async fn rdma_write_lands_silently() {
    let mut c = Initiator::new(Ask::new(4096)).await;
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let remote = c.region.at(100);
    c.post(SendWr::new(3, SendOp::Write { remote, imm: None }).buf(c.buf(&data)));
    let wc = c.done().await;
    ok(&wc);
    assert_eq!(wc.opcode, WcOpcode::RdmaWrite);
    // The first receive the target reports is the Send's: the Write took none.
    let r = c.say(b"after").await;
    assert_eq!((r.wr_id, r.opcode.as_str()), (0, "Recv"));
    let mut want = pattern(4096, 1);
    want[100..1100].copy_from_slice(&data);
    assert_eq!(r.digest, digest(&want), "the target's memory, at the target");
    assert_eq!(c.read(0, 4096).await, want);
}

#[tokio::test]
async fn rdma_write_with_immediate_consumes_a_receive() {
    let mut c = Initiator::new(Ask::new(64)).await;
    let remote = c.region.at(0);
    c.post(SendWr::new(1, SendOp::Write { remote, imm: Some(42) }).buf(c.buf(b"payload!")));
    c.post(SendWr::new(2, SendOp::Write { remote, imm: Some(43) }));
    let (a, b) = (c.report().await, c.report().await);
    assert_eq!(
        (a.wr_id, a.opcode.as_str(), a.imm, a.byte_len),
        (0, "RecvRdmaWithImm", Some(42), 8)
    );
    assert_eq!((b.wr_id, b.imm, b.byte_len), (1, Some(43), 0));
    assert_eq!(c.read(0, 8).await, b"payload!");
    ok(&c.done().await);
    ok(&c.done().await);
}

#[tokio::test]
async fn rdma_read_pulls_bytes() {
    let mut c = Initiator::new(Ask::new(8192).access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)).await;
    assert_eq!(c.read(4096, 4096).await, pattern(8192, 1)[4096..]);
}

#[tokio::test]
async fn atomics_return_the_old_value() {
    let mut c = Initiator::new(Ask::new(16)).await;
    let start = u64::from_ne_bytes(pattern(16, 1)[8..].try_into().expect("8"));
    let remote = c.region.at(8);
    let old = |wc: &Completion| u64::from_ne_bytes(wc.buf.as_ref().expect("buf").bytes()[..8].try_into().expect("8"));
    let word = || c.pd.register(8, AccessFlags::LOCAL_WRITE).expect("register");
    c.post(SendWr::new(1, SendOp::FetchAdd { remote, add: 5 }).buf(word()));
    let (compare, swap) = (start.wrapping_add(5), 7);
    c.post(SendWr::new(2, SendOp::CompareSwap { remote, compare, swap }).buf(word()));
    c.post(
        SendWr::new(
            3,
            SendOp::CompareSwap {
                remote,
                compare,
                swap: 9,
            },
        )
        .buf(word()),
    );
    let mut r = Vec::new();
    for _ in 0..3 {
        r.push(c.done().await);
    }
    r.iter().for_each(ok);
    assert_eq!(r.iter().map(old).collect::<Vec<_>>(), [start, compare, 7]);
    assert_eq!(
        c.read(8, 8).await,
        7u64.to_ne_bytes(),
        "the second CAS failed, the value stays"
    );
}

#[tokio::test]
async fn a_zero_length_write_needs_no_key() {
    let mut c = Initiator::new(Ask::new(64)).await;
    for (id, rkey) in KEYLESS {
        c.post(keyless_write(id, rkey));
        let wc = c.done().await;
        ok(&wc);
        assert_eq!((wc.wr_id, wc.byte_len), (id, 0));
    }
    // Nothing raised at the target, and the connection still carries a Send.
    assert_eq!(c.say(b"after").await.wr_id, 0);
}

/// Posts `wr` on a connection that has carried a Send, and expects a remote access error with
/// the buffer back and the initiator's QP in error.
async fn expect_remote_error(ask: Ask, wr: impl FnOnce(&Initiator) -> SendWr) {
    let mut c = Initiator::new(ask).await;
    assert_eq!(
        c.say(b"before").await.digest,
        digest(&pattern(ask.region as usize, ask.seed))
    );
    c.post(wr(&c));
    let wc = c.done().await;
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert!(wc.buf.is_some(), "the buffer comes back with the error");
    assert!(c.qp.is_error(), "the initiator's QP is in the error state");
}

#[tokio::test]
async fn wrong_rkey_is_a_remote_access_error() {
    expect_remote_error(Ask::new(64), |c| {
        let bad = RemoteAddr {
            addr: c.region.addr,
            rkey: c.region.rkey ^ 0x5a5a_0001,
        };
        SendWr::new(1, SendOp::Write { remote: bad, imm: None }).buf(c.buf(&[1; 16]))
    })
    .await;
}

#[tokio::test]
async fn out_of_bounds_is_a_remote_access_error() {
    expect_remote_error(Ask::new(64), |c| {
        SendWr::new(
            1,
            SendOp::Write {
                remote: c.region.at(60),
                imm: None,
            },
        )
        .buf(c.buf(&[1; 16]))
    })
    .await;
    expect_remote_error(Ask::new(64), |c| {
        SendWr::new(
            2,
            SendOp::Read {
                remote: c.region.at(32),
            },
        )
        .buf(c.buf(&[0; 64]))
    })
    .await;
}

#[tokio::test]
async fn missing_access_flag_is_a_remote_access_error() {
    let lw = AccessFlags::LOCAL_WRITE;
    let (r, w, a) = (
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_ATOMIC,
    );
    expect_remote_error(Ask::new(64).access(lw | r | a), |c| {
        SendWr::new(
            1,
            SendOp::Write {
                remote: c.region.at(0),
                imm: None,
            },
        )
        .buf(c.buf(&[1; 8]))
    })
    .await;
    expect_remote_error(Ask::new(64).access(lw | w | a), |c| {
        SendWr::new(1, SendOp::Read { remote: c.region.at(0) }).buf(c.buf(&[1; 8]))
    })
    .await;
    expect_remote_error(Ask::new(64).access(lw | r | w), |c| {
        SendWr::new(
            1,
            SendOp::FetchAdd {
                remote: c.region.at(0),
                add: 1,
            },
        )
        .buf(c.buf(&[1; 8]))
    })
    .await;
}

#[tokio::test]
async fn send_with_no_receive_posted_is_rnr() {
    let mut c = Initiator::new(Ask::new(64).recvs(0)).await;
    c.post(SendWr::send(1, c.buf(b"nobody home")));
    let wc = c.done().await;
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
    assert!(c.qp.is_error());
}

/// Writes of 256 KiB into a 4 MiB region, then a Send: when the Send arrives, every Write
/// before it has landed (the target's digest says so), and the bytes read back are the same.
#[tokio::test]
async fn large_writes_land_intact_before_a_later_send() {
    const REGION: usize = 4 << 20;
    let mut c = Initiator::new(Ask::new(REGION as u32)).await;
    let mut want = pattern(REGION, 1);
    for i in 0..16u64 {
        let data = pattern(256 << 10, 100 + i as u32);
        let at = i as usize * (256 << 10);
        want[at..at + data.len()].copy_from_slice(&data);
        c.post(
            SendWr::new(
                i + 1,
                SendOp::Write {
                    remote: c.region.at(at as u64),
                    imm: None,
                },
            )
            .buf(c.buf(&data)),
        );
    }
    let r = c.say(b"done").await;
    assert_eq!(
        r.digest,
        digest(&want),
        "a Write had not landed when the later Send arrived"
    );
    for _ in 0..16 {
        ok(&c.done().await);
    }
    assert_eq!(c.read(0, REGION).await, want);
    assert_eq!(c.region.len, REGION as u64);
}

/// Both ends agree on the path: the same MTU, Read depths within the other side's, the ACK
/// timeout and retry counts on both (verbs; the software providers report none).
#[tokio::test]
async fn both_sides_agree_the_path() {
    let mut c = Initiator::new(Ask::new(64)).await;
    let theirs = c.say(b"path?").await.attrs;
    let mine = c.qp.path_attrs();
    if device().provider() != "verbs" {
        assert_eq!((mine, theirs.as_str()), (None, "none"));
        return;
    }
    let ca = mine.expect("this side's attributes");
    let sa: Vec<u32> = theirs.split(',').map(|v| v.parse().expect("a number")).collect();
    assert_eq!(sa.len(), 6, "{theirs}");
    assert_eq!(ca.path_mtu, sa[0], "{ca:?} / {theirs}");
    assert!(
        u32::from(ca.read_depth) <= sa[2] && sa[1] <= u32::from(ca.read_responder),
        "{ca:?} / {theirs}"
    );
    assert_eq!((ca.ack_timeout, ca.retry_count, ca.rnr_retry), (18, 6, 6), "{ca:?}");
    assert_eq!(&sa[3..], [18, 6, 6], "{theirs}");
}
