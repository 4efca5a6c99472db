//! Registered buffers held by the application: `Client::buffer` / `Client::call_buf` lend a
//! buffer to the server as it is, a handler that takes a `Body` gets a large request to the
//! handler in the buffer it was read into and a small one in its receive slot, and
//! `Client::call_body` returns a small response in its receive slot; a small registered request
//! is sent from its buffer, and a handler answers from one (a `RegisteredBuf` of `context::buffers`). Over
//! `RDMA_RPC_PROVIDER` (default `tcp`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{bounded, device, test_ip};

use parking_lot::Mutex;
use rdma_rpc_core::proto::{FRAGMENT, HEADER_LEN};
use rdma_rpc_core::transport::Device;
use rdma_rpc_core::{Body, Buffers, Bulk, CallOptions, Client, Config, Isolation, RpcError, Server, IN_SLOT_MIN};

/// Answers [len u64][checksum u64][1 if the body came in a registered buffer].
const SUM: u32 = 1;
/// Sleeps a little, then answers as SUM (for cancellations mid-call).
const SLOW_SUM: u32 = 2;
/// Answers as SUM and keeps the body (in `Setup::kept`) until the test lets go of it.
const KEEP_SUM: u32 = 3;
/// Answers `len` bytes (little-endian u64 in the request) of pattern `len`.
const MAKE: u32 = 4;
/// Answers the request reversed, from a buffer of the connection's.
const REVERSE_BUF: u32 = 5;
/// Answers `len` bytes (little-endian u64 in the request) of pattern `len`, from
/// a buffer of the first connection that called it (so a copy on any other).
const MAKE_BUF: u32 = 6;
const THRESHOLD: usize = 16 * 1024;

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn answer(body: &Body) -> Vec<u8> {
    let mut out = (body.len() as u64).to_le_bytes().to_vec();
    out.extend(checksum(&body.bytes()).to_le_bytes());
    out.push(u8::from(matches!(body, Body::Registered(_))));
    out
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// The tests here compare `Device::registered_bytes`, which counts every registration of the
/// process: they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Setup {
    dev: Device,
    client: Client,
    addr: SocketAddr,
    cfg: Config,
    handled: Arc<AtomicUsize>,
    kept: Arc<Mutex<Vec<Body>>>,
}

async fn setup(cfg: Config) -> (Setup, tokio::sync::MutexGuard<'static, ()>) {
    let serial = SERIAL.lock().await;
    let dev = device();
    let handled = Arc::new(AtomicUsize::new(0));
    let h = handled.clone();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let k = kept.clone();
    let first: Arc<Mutex<Option<Buffers>>> = Arc::default();
    let server = Server::builder(cfg.clone())
        .handler(KEEP_SUM, move |body: Body| {
            let out = answer(&body);
            k.lock().push(body);
            async move { Ok(out) }
        })
        .handler(MAKE, |req: Vec<u8>| async move {
            let len = u64::from_le_bytes(req.try_into().map_err(|_| RpcError::Application("8 bytes".into()))?);
            let mut out = vec![0u8; len as usize];
            fill(&mut out, len);
            Ok(out)
        })
        .handler(SUM, |body: Body| async move { Ok::<_, RpcError>(answer(&body)) })
        .handler(REVERSE_BUF, |body: Body, bufs: Buffers| async move {
            let mut out = bufs.buffer(body.len())?;
            out.bytes_mut().copy_from_slice(&body.bytes());
            out.bytes_mut().reverse();
            Ok(out)
        })
        .handler(MAKE_BUF, move |body: Body, bufs: Buffers| {
            let first = first.lock().get_or_insert(bufs).clone();
            async move {
                let len = u64::from_le_bytes(
                    body.bytes()[..]
                        .try_into()
                        .map_err(|_| RpcError::Application("8 bytes".into()))?,
                );
                let mut out = first.buffer(len as usize)?;
                fill(&mut out.bytes_mut(), len);
                Ok(out)
            }
        })
        .handler(SLOW_SUM, move |body: Body| {
            let h = h.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                h.fetch_add(1, Ordering::SeqCst);
                Ok(answer(&body))
            }
        })
        .bind(&dev, SocketAddr::new(test_ip(), 0))
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    tokio::spawn(server.serve());
    let client = Client::connect(&dev, addr, cfg.clone()).await.expect("connect");
    let s = Setup {
        dev,
        client,
        addr,
        cfg,
        handled,
        kept,
    };
    (s, serial)
}

fn config() -> Config {
    Config::default().eager_threshold(THRESHOLD)
}

/// Registered memory of the process from the end of warm-up round `at` on: it must not grow.
struct Warm {
    at: u64,
    bytes: u64,
}

impl Warm {
    fn after(at: u64) -> Self {
        Warm { at, bytes: 0 }
    }

    /// Call at the end of each round.
    fn check(&mut self, dev: &Device, round: u64) {
        if round == self.at {
            self.bytes = dev.registered_bytes();
        }
        if round > self.at {
            assert_eq!(
                dev.registered_bytes(),
                self.bytes,
                "round {round} registered more memory"
            );
        }
    }
}

/// `want` (pattern `want.len()`) made by `MAKE_BUF` in a handler's buffer, twice: read by the
/// client, then written into its landing buffer (a response hint of that length). Gives the
/// request and the hinted options, for a further call.
async fn made_read_and_written(client: &Client, want: &[u8]) -> (Vec<u8>, CallOptions) {
    let len = want.len();
    let req = (len as u64).to_le_bytes().to_vec();
    let got = bounded(client.call(MAKE_BUF, req.clone())).await.expect("read");
    assert!(got == want, "{len} bytes read from the handler's buffer");
    let hinted = CallOptions::default().response_hint(len);
    let got = bounded(client.with_options(hinted.clone()).call(MAKE_BUF, req.clone()))
        .await
        .expect("written");
    assert!(got == want, "{len} bytes written into the landing buffer");
    (req, hinted)
}

/// Another connection to the same server.
async fn second_client(s: &Setup) -> Client {
    Client::connect(&s.dev, s.addr, s.cfg.clone())
        .await
        .expect("second client")
}

/// Lets the server finish what was cancelled (every buffer then goes back to a free list, which
/// keeps at most 8 of a size class, or is deregistered), making healthy calls from buffers of
/// `len` bytes (the callers' size: taken from the free lists, never registered anew) until the
/// registered memory is down to `at_rest` or two seconds have passed; returns where it is.
async fn settle(s: &Setup, len: usize, at_rest: u64) -> u64 {
    let mut settled = s.dev.registered_bytes();
    for _ in 0..100 {
        if settled <= at_rest {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut b = s.client.buffer(len).expect("a buffer");
        b.bytes_mut().fill(1);
        bounded(s.client.call_buf(SUM, b)).await.expect("healthy");
        settled = s.dev.registered_bytes();
    }
    settled
}

fn expect_answer(got: &[u8], want: &[u8], registered: bool) {
    assert_eq!(got.len(), 17, "answer {got:?}");
    assert_eq!(&got[..8], &(want.len() as u64).to_le_bytes(), "length");
    assert_eq!(
        &got[8..16],
        &checksum(want).to_le_bytes(),
        "checksum of {} bytes",
        want.len()
    );
    assert_eq!(got[16] == 1, registered, "registered body for {} bytes", want.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_reach_the_handler_in_a_registered_buffer() {
    let (s, _serial) = setup(config()).await;
    for (i, len) in [0, 1, 100, THRESHOLD, THRESHOLD + 1, 1 << 20, 16 << 20]
        .into_iter()
        .enumerate()
    {
        let mut data = vec![0u8; len];
        fill(&mut data, i as u64);
        // A Vec request: copied into a lent buffer by the client, read in place by the server
        // (a small one stays in the receive slot it arrived in).
        let got = bounded(s.client.call(SUM, data.clone())).await.expect("call");
        expect_answer(&got, &data, registered(len, THRESHOLD));
        // A registered request: lent as it is, given back with the answer, bytes untouched.
        let mut buf = s.client.buffer(len).expect("buffer");
        buf.bytes_mut().copy_from_slice(&data);
        let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("call_buf");
        expect_answer(&got, &data, registered(len, THRESHOLD));
        assert_eq!(back.len(), len);
        assert!(back.bytes()[..] == data[..], "the lent buffer came back changed");
    }
}

/// Small requests reach a handler taking a `Body`, and small responses a `call_body` caller, in the
/// receive slot they arrived in; large ones in the buffer they were read into (or a vector,
/// on tcp); those joined from pieces are copied; the bytes are right either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_bodies_stay_in_their_receive_slots_both_ways() {
    let threshold = 64 << 10;
    let cfg = config().eager_threshold(threshold);
    let (s, _serial) = setup(cfg).await;
    let edge = IN_SLOT_MIN - HEADER_LEN;
    for (i, len) in [
        0,
        1,
        100,
        edge - 1,
        edge,
        4096,
        FRAGMENT,
        FRAGMENT + 1,
        40 << 10,
        threshold + 1,
        1 << 20,
    ]
    .into_iter()
    .enumerate()
    {
        let mut data = vec![0u8; len];
        fill(&mut data, i as u64);
        let got = bounded(s.client.call_body(SUM, data.clone())).await.expect("call_body");
        assert!(matches!(got, Body::Inline(_)), "a 17-byte answer is copied, by value");
        expect_answer(&got.bytes(), &data, registered(len, threshold));
        drop(got);
        let got = bounded(s.client.call_body(MAKE, (len as u64).to_le_bytes().to_vec()))
            .await
            .expect("call_body");
        let mut want = vec![0u8; len];
        fill(&mut want, len as u64);
        assert_eq!(got.len(), len);
        assert!(got.bytes()[..] == want[..], "response of {len} bytes");
        // A large one is read into registered memory and handed over there, except where
        // registering is cheap (tcp): then into a vector of its own, also without a copy.
        let read_in_place = len > threshold && !s.dev.caps().cheap_registration;
        assert_eq!(
            matches!(got, Body::Registered(_)),
            in_slot(len) || read_in_place,
            "response of {len} bytes where it landed"
        );
    }
}

/// Bodies the application holds keep their receive slots out of the ring: past half the ring
/// they come copied instead, calls never stall, and every slot is back in the ring once they
/// are dropped (a slot that never came back would leave them copied, or stall the ring).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_held_past_half_the_ring_come_copied_and_nothing_stalls() {
    let (s, _serial) = setup(config()).await;
    let ring = s.cfg.ring as usize;
    let len = 1000;
    assert!(in_slot(len));
    let data = vec![7u8; len];
    let make = || s.client.call_body(MAKE, (len as u64).to_le_bytes().to_vec());
    let mut want = vec![0u8; len];
    fill(&mut want, len as u64);
    // The caller holds responses.
    let mut held = Vec::new();
    for _ in 0..ring * 3 {
        held.push(bounded(make()).await.expect("call_body"));
    }
    assert!(held.iter().all(|b| b.bytes()[..] == want[..]), "responses intact");
    let in_slot = held.iter().filter(|b| matches!(b, Body::Registered(_))).count();
    assert_eq!(in_slot, ring / 2, "responses held in their slots");
    drop(held);
    for i in 0..ring * 4 {
        let b = bounded(make()).await.expect("call_body");
        assert!(
            matches!(b, Body::Registered(_)),
            "call {i} after the drop: slots back in the ring"
        );
        assert!(b.bytes()[..] == want[..]);
    }
    // The handler holds requests.
    let mut in_slot = 0;
    for _ in 0..ring * 3 {
        let got = bounded(s.client.call(KEEP_SUM, data.clone())).await.expect("call");
        let registered = got.get(16) == Some(&1);
        expect_answer(&got, &data, registered);
        in_slot += usize::from(registered);
    }
    assert_eq!(in_slot, ring / 2, "requests held in their slots");
    s.kept.lock().clear();
    for i in 0..ring * 4 {
        let got = bounded(s.client.call(SUM, data.clone())).await.expect("call");
        assert!(
            got.get(16) == Some(&1),
            "call {i} after the handler let go: slots back in the ring"
        );
    }
}

/// A caller reading a response in place, its bytes' guard held, still makes other calls on the
/// same connection. (With the receive ring in one registration, that guard locked every slot's
/// memory, and the next call's poll waited for it on the same thread: a deadlock.)
#[test]
fn reading_a_body_in_place_blocks_no_other_call() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (s, _serial) = setup(config()).await;
            let body = s
                .client
                .call_body(MAKE, 1000u64.to_le_bytes().to_vec())
                .await
                .expect("call_body");
            assert!(matches!(body, Body::Registered(_)), "in its slot");
            let view = body.bytes();
            for _ in 0..100 {
                let got = s
                    .client
                    .call(SUM, view[..600].to_vec())
                    .await
                    .expect("a call while the view is held");
                expect_answer(&got, &view[..600], true);
            }
        });
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("calls go on while a body's bytes are held");
}

/// Whether a request of `len` bytes reaches a handler taking a `Body` in registered memory: above the
/// threshold in the buffer it was read into, else in its receive slot unless it came in pieces
/// or is too short to be worth it (while the handlers hold fewer than half the ring's slots, as
/// in these tests).
fn registered(len: usize, threshold: usize) -> bool {
    len > threshold || in_slot(len)
}

/// Whether an eager body of `len` bytes stays in its receive slot.
fn in_slot(len: usize) -> bool {
    len <= FRAGMENT && HEADER_LEN + len >= IN_SLOT_MIN
}

/// With no threshold set, both sides take the provider's (`DeviceCaps::eager_hint`): a `Vec`
/// of exactly that many bytes travels eagerly, one byte more by rendezvous (read into a
/// registered buffer on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_threshold_is_the_providers() {
    let (s, _serial) = setup(Config::default()).await;
    let hint = s.dev.caps().eager_hint;
    assert_eq!(Config::default().eager_threshold_on(&s.dev), hint);
    for len in [hint, hint + 1] {
        let mut data = vec![0u8; len];
        fill(&mut data, len as u64);
        let got = bounded(s.client.call(SUM, data.clone())).await.expect("call");
        expect_answer(&got, &data, registered(len, hint));
    }
}

/// Under a threshold far above it, a registered buffer longer than one piece is still lent
/// (no copy), while a `Vec` of the same size travels eagerly, in pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_buffer_longer_than_a_piece_is_lent_whatever_the_threshold() {
    let cfg = config().eager_threshold(4 << 20);
    let (s, _serial) = setup(cfg).await;
    let piece = rdma_rpc_core::proto::FRAGMENT;
    for (i, len) in [piece, piece + 1, 1 << 20].into_iter().enumerate() {
        let mut data = vec![0u8; len];
        fill(&mut data, 7 + i as u64);
        let got = bounded(s.client.call(SUM, data.clone())).await.expect("call");
        expect_answer(&got, &data, registered(len, 4 << 20));
        let mut buf = s.client.buffer(len).expect("buffer");
        buf.bytes_mut().copy_from_slice(&data);
        let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("call_buf");
        expect_answer(&got, &data, true);
        assert!(back.bytes()[..] == data[..], "the lent buffer came back changed");
    }
}

/// A buffer larger than anything that can be registered is an error from `Client::buffer` and
/// from a handler's `Buffers::buffer`, not a panic (a size class past the largest power of two)
/// or a process abort (memory the allocator refuses); the connection serves on. Half a TiB may
/// legitimately exist, untouched, where the kernel grants any allocation
/// (`vm.overcommit_memory = 1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_too_large_to_register_are_errors() {
    let (s, _serial) = setup(config()).await;
    let grants_anything = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|v| v.trim() == "1");
    for len in [usize::MAX, usize::MAX - 4096, 1 << 62, 1 << 39] {
        match s.client.buffer(len) {
            Err(RpcError::Transport(_)) => {}
            Err(e) => panic!("{len} bytes: {e}"),
            Ok(b) => assert!(
                grants_anything && len == 1 << 39,
                "{len} bytes: a buffer of {}",
                b.len()
            ),
        }
    }
    for len in [u64::MAX, 1 << 62] {
        let r = bounded(s.client.call(MAKE_BUF, len.to_le_bytes().to_vec())).await;
        assert!(
            matches!(r, Err(RpcError::Internal(_))),
            "a handler's {len}-byte buffer: {r:?}"
        );
    }
    let (got, _) = bounded(s.client.call_buf(SUM, s.client.buffer(64).expect("a small buffer")))
        .await
        .expect("the connection serves on");
    assert_eq!(got.len(), 17);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_lent_again_and_again_costs_no_registration() {
    let (s, _serial) = setup(config()).await;
    let mut buf = s.client.buffer(1 << 20).expect("buffer");
    let mut warm = Warm::after(4);
    for round in 0..40u64 {
        fill(&mut buf.bytes_mut(), round);
        let want = buf.to_vec();
        let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("call_buf");
        expect_answer(&got, &want, true);
        buf = back;
        warm.check(&s.dev, round);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_connections_buffer_is_copied_and_given_back() {
    let (s, _serial) = setup(config()).await;
    let other = second_client(&s).await;
    let mut buf = other.buffer(THRESHOLD * 3).expect("buffer");
    fill(&mut buf.bytes_mut(), 9);
    let want = buf.to_vec();
    let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("call_buf");
    expect_answer(&got, &want, true);
    assert!(back.bytes()[..] == want[..]);
    // Still usable on its own connection.
    let (got, _) = bounded(other.call_buf(SUM, back)).await.expect("own connection");
    expect_answer(&got, &want, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_transfer_isolation_buffers_come_back_intact_without_piling_up() {
    let cfg = config().isolation(Isolation::Transfer);
    let (s, _serial) = setup(cfg).await;
    // Lent (above the threshold), and sent from the buffer itself (small).
    for (len, registered) in [(THRESHOLD * 4, true), (1000, in_slot(1000))] {
        let mut buf = s.client.buffer(len).expect("buffer");
        fill(&mut buf.bytes_mut(), 3);
        let want = buf.to_vec();
        let mut warm = Warm::after(1);
        for round in 0..10u64 {
            let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("call_buf");
            expect_answer(&got, &want, registered);
            assert!(
                back.bytes()[..] == want[..],
                "{len} bytes, round {round}: bytes changed"
            );
            buf = back;
            warm.check(&s.dev, round);
        }
    }
}

/// Callers that give up mid-call (their buffers stay lent until the server is done) and
/// callers that finish, on one connection: every request the server sees is intact, and once
/// everything settles the registered memory is back where it was after warm-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_calls_never_expose_a_lent_buffer_and_leak_nothing() {
    let (s, _serial) = setup(config()).await;
    let client = s.client.clone();
    // At rest, each side's free lists keep at most 8 buffers of a size class: the client's
    // lent ones and the server's read buffers, of 128 KiB and the length prefix. Every other
    // buffer is deregistered; a lent buffer that leaked would stay registered.
    // One small call first: the server's side of the connection is then fully set up.
    bounded(client.call(SUM, vec![1; 8])).await.expect("first call");
    let at_rest = s.dev.registered_bytes() + 2 * 8 * ((128 << 10) + HEADER_LEN as u64);
    // Measured after `at_rest`: its buffers end in the free lists that `at_rest` allows for.
    let span = drop_span(&client, THRESHOLD * 8).await;
    let handled_before = s.handled.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for caller in 0..8u64 {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = common::Rng::new(caller);
            let (mut done, mut dropped) = (0, 0);
            let mut buf = Some(c.buffer(THRESHOLD * 8).expect("buffer"));
            for i in 0..60u64 {
                let r = rng.next();
                let mut b = match buf.take() {
                    Some(b) => b,
                    None => c.buffer(THRESHOLD * 8).expect("a new buffer"),
                };
                fill(&mut b.bytes_mut(), caller << 32 | i);
                let want = b.to_vec();
                let wait = common::drop_wait(i, r, span);
                match tokio::time::timeout(wait, c.call_buf(SLOW_SUM, b)).await {
                    Ok(r) => {
                        let (got, back) = r.expect("call_buf");
                        expect_answer(&got, &want, true);
                        assert!(back.bytes()[..] == want[..]);
                        buf = Some(back);
                        done += 1;
                    }
                    Err(_) => dropped += 1,
                }
            }
            (done, dropped)
        }));
    }
    let (done, dropped) = common::tally(tasks).await;
    let settled = settle(&s, THRESHOLD * 8, at_rest).await;
    assert!(
        settled <= at_rest,
        "registered memory after the drops settled: {settled} > {at_rest} (a lent buffer leaked)"
    );
    let mut b = client.buffer(THRESHOLD * 8).expect("buffer");
    fill(&mut b.bytes_mut(), 77);
    let want = b.to_vec();
    let (got, _) = bounded(client.call_buf(SUM, b)).await.expect("healthy");
    expect_answer(&got, &want, true);
    assert!(s.handled.load(Ordering::SeqCst) - handled_before <= done + dropped);
}

/// Small registered requests go from their buffer (`call_buf_body`), and responses from the
/// handler's (a `RegisteredBuf`), at every size up to one piece: the bytes are right both ways, the
/// request's buffer comes back unchanged, and after warm-up no call registers memory (every
/// buffer sent from goes back where it came from).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_bodies_go_straight_from_registered_buffers_both_ways() {
    let (s, _serial) = setup(config()).await;
    let sizes = [0, 1, 7, 100, IN_SLOT_MIN, 1000, 4096, THRESHOLD - 1, THRESHOLD];
    let mut warm = Warm::after(2);
    for round in 0..12u64 {
        for (i, &len) in sizes.iter().enumerate() {
            let mut buf = s.client.buffer(len).expect("buffer");
            fill(&mut buf.bytes_mut(), round << 8 | i as u64);
            let want = buf.to_vec();
            let (got, back) = bounded(s.client.call_buf_body(REVERSE_BUF, buf)).await.expect("call");
            let mut reversed = want.clone();
            reversed.reverse();
            assert!(got.bytes()[..] == reversed[..], "{len} bytes: wrong answer");
            assert_eq!(matches!(got, Body::Registered(_)), in_slot(len), "{len} bytes");
            assert!(
                back.bytes()[..] == want[..],
                "{len} bytes: the buffer came back changed"
            );
            // The same through `call_buf`, the answer copied out.
            let (got, back) = bounded(s.client.call_buf(REVERSE_BUF, back)).await.expect("call_buf");
            assert!(got == reversed, "{len} bytes: wrong answer through call_buf");
            assert!(back.bytes()[..] == want[..]);
        }
        warm.check(&s.dev, round);
    }
}

/// A `RegisteredBuf` response above the threshold is lent as it is: read by the caller, or
/// written into its landing buffer when it advertised one (`response_hint`); a buffer of
/// another connection is copied. The bytes are right every way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buffer_responses_are_lent_or_written_and_foreign_ones_copied() {
    let (s, _serial) = setup(config()).await;
    let other = second_client(&s).await;
    for len in [0usize, 100, 4096, THRESHOLD, THRESHOLD + 1, FRAGMENT + 1, 1 << 20] {
        let mut want = vec![0u8; len];
        fill(&mut want, len as u64);
        // The first client's connection owns the handler's buffers: no copy there.
        let (req, hinted) = made_read_and_written(&s.client, &want).await;
        let got = bounded(other.with_options(hinted).call(MAKE_BUF, req))
            .await
            .expect("copied");
        assert!(got == want, "{len} bytes from another connection's buffer");
    }
}

/// Rendezvous bodies of lengths around the edges of the buffer size classes (a power of two
/// and the 24-byte length prefix a lent or landed payload has in front): a payload of
/// exactly a power of two fills its class to the byte, one byte more takes the next. Every way
/// a body goes, the bytes arrive intact: a `Vec` lent through a copy, an application's
/// buffer lent as it is, a handler's buffer read by the client or written into its landing
/// buffer, and a request read into a buffer the handler answers from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_at_the_edges_of_the_buffer_classes_arrive_intact_every_way() {
    let (s, _serial) = setup(config()).await;
    for p in [32usize << 10, 64 << 10, 1 << 20] {
        for len in [p - HEADER_LEN - 1, p - HEADER_LEN, p - 1, p, p + 1, p + HEADER_LEN + 1] {
            let mut data = vec![0u8; len];
            fill(&mut data, len as u64);
            let got = bounded(s.client.call(SUM, data.clone())).await.expect("a Vec lent");
            expect_answer(&got, &data, true);
            let mut buf = s.client.buffer(len).expect("a buffer");
            assert_eq!(buf.len(), len);
            buf.bytes_mut().copy_from_slice(&data);
            let (got, back) = bounded(s.client.call_buf(SUM, buf)).await.expect("a buffer lent");
            expect_answer(&got, &data, true);
            assert!(back.bytes()[..] == data[..], "the {len}-byte buffer came back changed");
            made_read_and_written(&s.client, &data).await;
            let got = bounded(s.client.call(REVERSE_BUF, data.clone()))
                .await
                .expect("reversed");
            assert!(
                got.iter().rev().eq(data.iter()),
                "{len} bytes reversed from a handler's buffer"
            );
        }
    }
}

/// A call refused before it starts (its payload above `max_payload`) after its buffer was
/// staged to be lent: the buffer goes back to the connection, so refusing again and again
/// registers nothing more, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_after_staging_gives_its_buffer_back() {
    let cfg = config().max_payload(64 << 10);
    let (s, _serial) = setup(cfg).await;
    let len = 128 << 10;
    assert!(
        registered(len, THRESHOLD),
        "lent, so staged before the session refuses it"
    );
    // No refused call reaches the server: one healthy call first, so that the server's side
    // of the connection has registered what it needs (its driver sets up after the client's
    // connect returns, which on soft-RoCE in the VM lane took until round 3).
    bounded(s.client.call(SUM, vec![1; 8])).await.expect("first call");
    let mut warm = Warm::after(1);
    for round in 0..20 {
        let mut b = s.client.buffer(len).expect("a buffer");
        b.bytes_mut().fill(3);
        let r = bounded(s.client.call_buf(SUM, b)).await;
        assert!(matches!(r, Err(RpcError::PayloadTooLarge { .. })), "{r:?}");
        warm.check(&s.dev, round);
    }
    let got = bounded(s.client.call(SUM, vec![5; 100]))
        .await
        .expect("the connection goes on");
    expect_answer(&got, &[5; 100], false);
}

/// The span (µs) the drop tests draw their eight callers' waits from (`common::drop_span`):
/// eight `SLOW_SUM` calls of `len` bytes timed at once, as the callers make theirs; at least
/// 1 ms. A fixed span of 6 ms once let none finish in the VM lane.
async fn drop_span(client: &Client, len: usize) -> u64 {
    let calls = (0..8)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move {
                let b = c.buffer(len).expect("buffer");
                let t = std::time::Instant::now();
                c.call_buf(SLOW_SUM, b).await.expect("a timed call");
                t.elapsed()
            })
        })
        .collect();
    common::drop_span(calls, 1_000).await
}

/// Small registered requests dropped mid-call (their buffers out in a Send, or queued), and
/// calls that finish, on one connection: every answer is right, and once everything settles
/// no registered memory is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_small_buffer_calls_leak_nothing() {
    let (s, _serial) = setup(config()).await;
    let client = s.client.clone();
    bounded(client.call(SUM, vec![1; 8])).await.expect("first call");
    // Each side keeps at most 8 free buffers of a size class (here 4 KiB and the prefix).
    let at_rest = s.dev.registered_bytes() + 2 * 8 * (4096 + HEADER_LEN as u64);
    let span = drop_span(&client, 4096).await;
    let handled_before = s.handled.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for caller in 0..8u64 {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = common::Rng::new(caller);
            let (mut done, mut dropped) = (0, 0);
            for i in 0..60u64 {
                let r = rng.next();
                let mut b = c.buffer(4096).expect("buffer");
                fill(&mut b.bytes_mut(), caller << 32 | i);
                let want = b.to_vec();
                let wait = common::drop_wait(i, r, span);
                match tokio::time::timeout(wait, c.call_buf_body(SLOW_SUM, b)).await {
                    Ok(r) => {
                        let (got, back) = r.expect("call_buf_body");
                        expect_answer(&got.bytes(), &want, in_slot(4096));
                        assert!(back.bytes()[..] == want[..]);
                        done += 1;
                    }
                    Err(_) => dropped += 1,
                }
            }
            (done, dropped)
        }));
    }
    let (done, dropped) = common::tally(tasks).await;
    let settled = settle(&s, 4096, at_rest).await;
    assert!(
        settled <= at_rest,
        "registered memory after the drops settled: {settled} > {at_rest} (a buffer leaked)"
    );
    assert!(s.handled.load(Ordering::SeqCst) - handled_before <= done + dropped);
}

/// A call dropped before it was ever polled starts nothing: the server sees no request, the
/// buffer goes back to the connection's free list (no registration grows), and later calls
/// are answered as if it never was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_before_its_first_poll_sends_nothing_and_gives_its_buffer_back() {
    let (s, _serial) = setup(config()).await;
    let mut b = s.client.buffer(4096).expect("buffer");
    b.bytes_mut().fill(3);
    bounded(s.client.call_buf(SLOW_SUM, b)).await.expect("warm-up call");
    // One buffer of each size class registered and in the free lists, before the count.
    for len in [100, 4096, 3 * THRESHOLD] {
        drop(s.client.buffer(len).expect("buffer"));
    }
    let before = (s.handled.load(Ordering::SeqCst), s.dev.registered_bytes());
    for len in [100, 4096, 3 * THRESHOLD] {
        for _ in 0..20 {
            let mut b = s.client.buffer(len).expect("buffer");
            b.bytes_mut().fill(9);
            drop(s.client.call_buf_body(SLOW_SUM, b));
            drop(s.client.call(SLOW_SUM, vec![9; len]));
        }
    }
    let mut b = s.client.buffer(4096).expect("buffer");
    fill(&mut b.bytes_mut(), 11);
    let want = b.to_vec();
    let (got, back) = bounded(s.client.call_buf(SLOW_SUM, b))
        .await
        .expect("a call after the drops");
    expect_answer(&got, &want, in_slot(4096));
    assert!(back.bytes()[..] == want[..]);
    drop(back);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        s.handled.load(Ordering::SeqCst),
        before.0 + 1,
        "only the last call reached the server"
    );
    let settled = settle(&s, 4096, before.1).await;
    assert!(settled <= before.1, "registered memory grew: {settled} > {}", before.1);
}

/// `Client::call` with a `Bulk`: a registered one, shared by its clones, sent as often as
/// wanted (lent as it is when large, with every call in flight at once), and one of another
/// connection or of a vector, small and large: the server gets the bytes right every time,
/// and the bulk's own bytes never change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_goes_as_a_call_payload_however_often_and_wherever_it_is() {
    let (s, _serial) = setup(config()).await;
    let other = Client::connect(&s.dev, s.addr, s.cfg.clone()).await.expect("connect");
    for (i, len) in [10usize, 1000, FRAGMENT + 1, THRESHOLD + 1, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let mut data = vec![0u8; len];
        fill(&mut data, 1000 + i as u64);
        let mut buf = s.client.buffer(len).expect("a buffer");
        buf.bytes_mut().copy_from_slice(&data);
        let mine = Bulk::from(buf);
        let mut theirs = other.buffer(len).expect("a buffer");
        theirs.bytes_mut().copy_from_slice(&data);
        let bulks = [
            mine.clone(),
            mine.clone(),
            mine.clone(),
            Bulk::from(theirs),
            Bulk::from(data.clone()),
        ];
        let calls = bulks.into_iter().map(|b| {
            let c = s.client.clone();
            async move { bounded(c.call(SUM, b)).await }
        });
        for got in futures_join(calls).await {
            let got = got.expect("a call with a Bulk");
            expect_answer(&got, &data, registered(len, THRESHOLD));
        }
        assert!(mine.bytes()[..] == data[..], "a lent Bulk is left as it was");
    }
}

/// Runs `futs` at once, in order of their results.
async fn futures_join<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for slot in pending.iter_mut() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        out.push(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out
}
