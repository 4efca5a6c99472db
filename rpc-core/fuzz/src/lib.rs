//! The fuzz targets' bodies, shared by the libFuzzer binaries (`fuzz_targets/`, nightly,
//! `cargo fuzz run <target>` in `rpc-core/`) and by the stable replay test
//! (`tests/fuzz_corpus.rs` at the workspace root), which runs every committed corpus file and
//! random inputs through the same functions on every `cargo test`.
//!
//! Each function takes arbitrary bytes; a panic is a bug.

use std::time::{Duration, Instant};

use rdma_rpc::__private::{decode_args, decode_args_bulk, decode_ret};
use rdma_rpc_core::proto::RemoteRegion;
use rdma_rpc_core::proto::{
    decode_desc, encode_desc, Event, Header, Hello, Payload, RequestBody, Session, SessionConfig, Token, Transmit,
};
use serde::Deserialize;

/// The frame decoder: a header, then a rendezvous descriptor in its body; what decodes
/// re-encodes to the same bytes.
pub fn frame(msg: &[u8]) {
    if let Ok((h, body)) = Header::decode(msg) {
        let mut again = Vec::new();
        h.encode(&mut again);
        assert_eq!(&again[..], &msg[..again.len()], "header round trip");
        if let Ok((d, rest)) = decode_desc(body) {
            let mut out = Vec::new();
            encode_desc(&d, &mut out);
            assert_eq!(&out[..], &body[..body.len() - rest.len()], "descriptor round trip");
        }
    }
}

/// The connection handshake (private data): what decodes re-encodes to its prefix, up to the
/// last whole field (a field after the largest payload that is cut short decodes as 0, as
/// from a peer built before it).
pub fn hello(data: &[u8]) {
    if let Some(h) = Hello::decode(data) {
        assert!((2..=4096).contains(&h.ring));
        let enc = h.encode();
        // The optional fields end at 25, 29, 37, 38 and 39 bytes; each is read only when whole.
        let n = [39, 38, 37, 29, 25, 21]
            .into_iter()
            .find(|&end| data.len() >= end)
            .unwrap_or(21);
        assert_eq!(&enc[..n], &data[..n]);
        if n < 25 {
            assert_eq!(h.max_requests, 0, "a limit decoded from a hello that has none");
        }
        if n < 29 {
            assert_eq!(h.flags, 0, "flags decoded from a hello that has none");
        }
        if n < 37 {
            assert_eq!(
                h.max_request_bytes, 0,
                "a byte limit decoded from a hello that has none"
            );
        }
        if n < 38 {
            assert_eq!(h.credits, 0, "credits decoded from a hello that has none");
        }
        if n < 39 {
            assert_eq!(h.piece, 0, "a piece size decoded from a hello that has none");
        }
    }
}

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
struct Item {
    name: String,
    tags: Vec<u32>,
    blob: rdma_rpc::Bulk,
    nested: Option<Box<Item>>,
}

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
enum AppError {
    Missing(String),
    Code { code: i64, why: Option<String> },
}

/// The typed request path of `#[service]` handlers and clients: postcard arguments, a bulk
/// argument split off its trailer, results. Errors, never panics; no allocation beyond what
/// the input justifies (libFuzzer's `-malloc_limit_mb` watches).
pub fn request(data: &[u8]) {
    let _ = decode_args::<(String, u64, Vec<u32>, Option<(i8, bool)>)>(data, "F.a");
    let _ = decode_args::<(Item, f64, char)>(data, "F.b");
    let _ = decode_args::<(std::collections::BTreeMap<String, Vec<u8>>,)>(data, "F.c");
    let _ = decode_args_bulk::<(String, u32)>(rdma_rpc::Body::Bytes(data.to_vec()), "F.d");
    let _ = decode_ret::<Result<Vec<Item>, AppError>>(data, "F.e");
}

const MAX: u64 = 1 << 20;
const RING: u32 = 8;
/// The fuzzed session's limits on what it serves at once (`Session::limit_serving`).
const SERVING: usize = 3;
const SERVING_BYTES: u64 = 6000;

/// A session fed a hostile peer: after calls of its own (eager, lent, with a landing buffer)
/// and while serving, it receives arbitrary messages, Writes-with-immediate and timeouts, as
/// records `[op, len, bytes...]`. It never panics, never holds more credits than the peer's
/// ring, never asks for a Read beyond the maximum payload, and never serves more requests or
/// holds more request bytes at once than its limits allow (the driver answers some requests
/// only at the next timeout, so that requests pile up).
pub fn session(data: &[u8]) {
    let cfg = SessionConfig {
        ring: RING,
        eager_max: 1024,
        fragment: 64,
        max_payload: MAX,
    };
    let mut s = Session::new(cfg);
    s.limit_serving(SERVING, SERVING_BYTES);
    s.limit_calls(3);
    s.limit_call_bytes(1500);
    // Whole responses between the pieces of our long request (which the hostile peer's credits
    // let out a few at a time).
    s.interleave(true);
    let mut later = Vec::new();
    let t0 = Instant::now();
    let _ = s.start_call(5, Payload::Eager(vec![5; 1000]), None, None, t0);
    let region = |len| RemoteRegion {
        addr: 0x1000,
        len,
        rkey: 7,
    };
    let _ = s.start_call(1, Payload::Eager(vec![1; 10]), None, None, t0);
    let lent = Payload::Lent {
        desc: region(5000),
        buf: 1,
    };
    let _ = s.start_call(2, lent, None, Some(Duration::from_millis(5)), t0);
    let _ = s.start_call(3, Payload::Eager(vec![]), Some((region(9000), 2)), None, t0);
    let _ = s.start_call(4, Payload::Placed { buf: 3, len: 40 }, None, None, t0);
    drain(&mut s, &mut later);
    let mut rest = data;
    let mut now = t0;
    while let [op, len, tail @ ..] = rest {
        let n = (*len as usize).min(tail.len());
        let (chunk, after) = tail.split_at(n);
        rest = after;
        match op % 4 {
            0 | 1 => {
                let _ = s.handle_message(chunk, now);
                s.reposted();
            }
            2 => {
                let imm = chunk.iter().fold(0u32, |a, b| a.rotate_left(8) ^ u32::from(*b));
                let _ = s.handle_write_imm(imm, n * 100);
                s.reposted();
            }
            _ => {
                now += Duration::from_millis(u64::from(*len) % 8);
                s.handle_timeout(now);
                for call in later.drain(..) {
                    s.respond(call, Ok(Payload::Eager(vec![4; 2])));
                }
            }
        }
        drain(&mut s, &mut later);
        if s.is_lost() {
            break;
        }
    }
    s.handle_connection_lost(rdma_rpc_core::proto::Lost::new(
        rdma_rpc_core::proto::LostKind::Local,
        "fuzz end",
    ));
    drain(&mut s, &mut later);
}

/// Buffer ids this driver reads requests into (`handle_request_read`), far from the session's.
const HELD_BASE: u64 = 1 << 40;

fn drain(s: &mut Session, later: &mut Vec<u32>) {
    let mut reads = Vec::new();
    while let Some(t) = s.poll_transmit() {
        if let Transmit::Read { remote, token, tail } = t {
            let len = remote.len + tail.len() as u64;
            assert!(len <= MAX, "a read and its tail beyond the maximum payload");
            reads.push((token, len));
        }
    }
    // Every other request read stays in its buffer; the rest are copied out.
    for (i, (token, len)) in reads.into_iter().enumerate() {
        let now = Instant::now();
        match token {
            Token::Request(call) if i % 2 == 0 => {
                s.handle_request_read(call, Ok((HELD_BASE + u64::from(call), len as usize)), now)
            }
            _ => s.handle_read_done(token, Ok(vec![5; (len as usize).min(64)]), now),
        }
    }
    assert!(s.credits().available() <= RING, "credits beyond the peer's ring");
    assert!(s.unanswered() <= SERVING, "more requests served at once than allowed");
    // What waits to be sent: answers (counted within SERVING), refusals of requests the
    // peer's credits let through (within the ring), and this side's own five calls with a
    // Cancel or ReadDone each.
    assert!(
        s.queued() <= RING as usize + SERVING + 3 * 5,
        "{} messages queued for a peer that takes none",
        s.queued()
    );
    assert!(
        s.held_request_bytes() <= SERVING_BYTES.max(MAX),
        "more request bytes held than allowed"
    );
    let mut respond = Vec::new();
    while let Some(e) = s.poll_event() {
        if let Event::Request { call, payload, .. } = e {
            if let RequestBody::Held { buf, .. } = payload {
                assert_eq!(
                    buf,
                    HELD_BASE + u64::from(call),
                    "a request in a buffer it was not read into"
                );
            }
            respond.push(call);
        }
    }
    // Every third request is answered only at the next timeout; of the others, every other
    // response is sent from a buffer of the driver's.
    for call in respond {
        if call % 3 == 0 {
            later.push(call);
            continue;
        }
        let p = match call % 2 {
            0 => Payload::Eager(vec![3; 4]),
            _ => Payload::Placed {
                buf: HELD_BASE * 2 + u64::from(call),
                len: 4,
            },
        };
        s.respond(call, Ok(p));
    }
}
