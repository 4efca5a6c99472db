//! Deterministic tests of the sans-IO session: two sessions wired in memory, with a model of the
//! NIC between them that checks what a real one would punish — a Send into an empty receive ring
//! (RNR), and a Read or Write that reaches a buffer its owner already released (the memory-safety
//! bug the ownership rules exist to prevent).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rdma_rpc_proto::*;

const RING: u32 = 8;

fn cfg() -> SessionConfig {
    SessionConfig {
        ring: RING,
        eager_max: 64,
        // Messages with more than 24 bytes of body go in pieces (up to 4, in a ring of 8).
        fragment: 24,
        max_payload: 1 << 20,
    }
}

enum Wire {
    Send(Vec<u8>),
    WriteImm { imm: u32, len: usize },
}

/// One side: a session plus what its driver and NIC would hold.
struct Side {
    s: Session,
    posted: u32,
    bufs: HashMap<BufId, Vec<u8>>,
    /// Buffers whose descriptor went to the peer and that were not yet released.
    lent: HashSet<BufId>,
    next_buf: BufId,
    inbox: VecDeque<Wire>,
    /// Reads and writes this side's NIC has yet to run against the peer.
    rdma: VecDeque<Transmit>,
    done: HashMap<u32, Result<Reply, CallError>>,
    /// Requests for the handler: call, bytes, and the receive slot it holds (in-slot mode).
    requests: Vec<(u32, Vec<u8>, Option<u64>)>,
    aborted: HashSet<u32>,
    rnr: u32,
    /// Requests read by rendezvous stay in the driver's buffer (`handle_request_read`) instead
    /// of being copied out (`handle_read_done`).
    held_reads: bool,
    /// Buffers this side read a request into that the session has not let go of yet.
    reading: HashSet<BufId>,
    /// Consumed receive slots are posted again only after the next pump (as the driver does:
    /// what a message causes is sent first), not as soon as the message is decoded.
    defer_reposts: bool,
    unposted: u32,
    /// Requests and responses stay in their receive slots (as a handler of a `Body` and `call_body`
    /// take them), offered while fewer than half the ring is held, as the driver does.
    in_slot: bool,
    /// Receive slots held for the application, with the message in each.
    slots: HashMap<u64, Vec<u8>>,
    next_slot: u64,
    /// Messages the session kept in their slots.
    kept: u32,
    /// Small payloads go as [`Payload::Placed`], from a buffer of the driver's.
    placed: bool,
    /// Placed buffers the session has neither sent from nor released.
    sending: HashSet<BufId>,
    /// Messages sent from placed buffers.
    placed_sent: u32,
    /// Calls whose handler ran (the server's side).
    ran: HashSet<u32>,
    /// Lent requests keep their last few bytes back as a tail ([`Payload::LentWith`]).
    tails: bool,
}

impl Side {
    fn new(base: BufId) -> Self {
        Side {
            s: Session::new(cfg()),
            posted: RING,
            bufs: HashMap::new(),
            lent: HashSet::new(),
            next_buf: base,
            inbox: VecDeque::new(),
            rdma: VecDeque::new(),
            done: HashMap::new(),
            requests: Vec::new(),
            aborted: HashSet::new(),
            rnr: 0,
            held_reads: false,
            reading: HashSet::new(),
            defer_reposts: false,
            unposted: 0,
            in_slot: false,
            slots: HashMap::new(),
            next_slot: 0,
            kept: 0,
            placed: false,
            sending: HashSet::new(),
            placed_sent: 0,
            ran: HashSet::new(),
            tails: false,
        }
    }

    fn placing(mut self) -> Self {
        self.placed = true;
        self
    }

    /// Sends short messages queued together in one Send, as to a peer that takes batches.
    fn batching(mut self) -> Self {
        self.s.batch(true);
        self
    }

    fn in_slots(mut self) -> Self {
        self.in_slot = true;
        self.s.serve_in_slot([1]);
        self
    }

    /// The bytes `range` of held slot `slot`.
    fn slot_bytes(&self, slot: u64, range: std::ops::Range<usize>) -> Vec<u8> {
        let m = self.slots.get(&slot).expect("a message in a slot that is not held");
        m.get(range).expect("a range outside the message").to_vec()
    }

    /// The application lets go of a held slot: it is posted again (now, or with the deferred ones).
    fn release_slot(&mut self, slot: u64) {
        assert!(self.slots.remove(&slot).is_some(), "slot {slot} released twice");
        if self.defer_reposts {
            self.unposted += 1;
        } else {
            self.posted += 1;
            self.s.reposted();
        }
    }

    fn deferring_reposts(mut self) -> Self {
        self.defer_reposts = true;
        self
    }

    /// Posts the consumed slots again and reports them to the session.
    fn repost(&mut self) {
        for _ in 0..std::mem::take(&mut self.unposted) {
            self.posted += 1;
            self.s.reposted();
        }
    }

    fn holding_reads(mut self) -> Self {
        self.held_reads = true;
        self
    }

    fn with_tails(mut self) -> Self {
        self.tails = true;
        self
    }

    fn stage(&mut self, data: Vec<u8>) -> (RemoteRegion, BufId) {
        let id = self.next_buf;
        self.next_buf += 1;
        let desc = RemoteRegion {
            addr: id,
            len: data.len() as u64,
            rkey: 7,
        };
        self.bufs.insert(id, data);
        self.lent.insert(id);
        (desc, id)
    }

    /// `data` as the driver would hand it over (`landing`: a landing descriptor goes with it).
    fn payload(&mut self, data: Vec<u8>, landing: bool) -> Payload {
        if self.s.is_rendezvous(data.len()) {
            let (desc, buf) = self.stage(data);
            Payload::Lent { desc, buf }
        } else if self.placed && !landing && self.s.fits_placed(data.len()) {
            let (buf, len) = (self.next_buf, data.len());
            self.next_buf += 1;
            self.bufs.insert(buf, data);
            self.sending.insert(buf);
            Payload::Placed { buf, len }
        } else {
            Payload::Eager(data)
        }
    }

    fn call(&mut self, len: usize, landing: Option<usize>, budget: Option<Duration>, now: Instant) -> u32 {
        self.try_call(len, landing, budget, now).expect("start_call")
    }

    /// As [`Side::call`]; a call refused at the start gives its buffers back to this side.
    fn try_call(
        &mut self,
        len: usize,
        landing: Option<usize>,
        budget: Option<Duration>,
        now: Instant,
    ) -> Result<u32, CallError> {
        let mut p = self.payload(pattern(len, len as u8), landing.is_some());
        if let (true, Payload::Lent { desc, buf }) = (self.tails, &p) {
            // The last bytes (up to 10) go in the message; the peer reads the rest.
            let k = (len / 3).min(10);
            let data = &self.bufs[buf];
            let tail = data[len - k..].to_vec();
            let desc = RemoteRegion {
                len: (len - k) as u64,
                ..*desc
            };
            p = Payload::LentWith { desc, buf: *buf, tail };
        }
        let staged = match &p {
            Payload::Lent { buf, .. } | Payload::LentWith { buf, .. } | Payload::Placed { buf, .. } => Some(*buf),
            Payload::Eager(_) => None,
        };
        let landing = landing.map(|l| self.stage(vec![0; l]));
        let landing_buf = landing.map(|(_, b)| b);
        let id = match self.s.start_call(1, p, landing, budget, now) {
            Ok(id) => id,
            Err(e) => {
                // Never sent: the driver has its buffers back.
                for b in staged.into_iter().chain(landing_buf) {
                    self.lent.remove(&b);
                    self.sending.remove(&b);
                    self.bufs.remove(&b);
                }
                return Err(e);
            }
        };
        if self.in_slot {
            self.s.keep_in_slot(id);
        }
        Ok(id)
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.s.poll_event() {
            match e {
                Event::CallDone { call, mut result } => {
                    if let Ok(Reply::Landed { buf }) = &result {
                        assert!(self.lent.remove(buf), "landed in a buffer that was not lent");
                    }
                    if let Ok(Reply::InSlot { slot, range }) = result {
                        assert!(self.in_slot, "a response kept in place for a call that did not ask");
                        result = Ok(Reply::Bytes(self.slot_bytes(slot, range)));
                        self.release_slot(slot);
                    }
                    assert!(self.done.insert(call, result).is_none(), "call {call} completed twice");
                }
                Event::Request {
                    call,
                    payload: RequestBody::Bytes(payload),
                    ..
                } => self.requests.push((call, payload, None)),
                Event::Request {
                    call,
                    payload: RequestBody::Inline(payload),
                    ..
                } => self.requests.push((call, payload.to_vec(), None)),
                Event::Request {
                    call,
                    payload: RequestBody::InSlot { slot, range },
                    ..
                } => {
                    assert!(self.in_slot, "a request kept in place for a method not served so");
                    let data = self.slot_bytes(slot, range);
                    self.requests.push((call, data, Some(slot)));
                }
                Event::Request {
                    call,
                    payload: RequestBody::Held { buf, len },
                    ..
                } => {
                    // The handler owns the buffer now; the session must never mention it again.
                    assert!(
                        self.reading.remove(&buf),
                        "request in buffer {buf} that was not read into"
                    );
                    let data = self.bufs.remove(&buf).expect("the read buffer");
                    self.requests.push((call, data[..len].to_vec(), None));
                }
                Event::Abort { call } => {
                    self.aborted.insert(call);
                }
            }
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Moves everything `from` wants to transmit: Sends and writes go on the wire (or to the NIC
/// queue), releases free buffers.
fn pump(from: &mut Side, to: &mut Side) {
    loop {
        let wants = from.s.has_transmit();
        let Some(t) = from.s.poll_transmit() else { break };
        assert!(
            wants,
            "poll_transmit gave {t:?} where has_transmit said nothing was due"
        );
        match t {
            Transmit::Send(m) => to.inbox.push_back(Wire::Send(m.to_vec())),
            Transmit::SendPlaced { head, buf, len } => {
                assert!(
                    from.sending.remove(&buf),
                    "sent from buffer {buf} twice or never placed"
                );
                let body = from.bufs.remove(&buf).expect("the placed buffer");
                let mut m = head.to_vec();
                m.extend_from_slice(&body[..len]);
                from.placed_sent += 1;
                to.inbox.push_back(Wire::Send(m));
            }
            Transmit::Release(b) if from.sending.remove(&b) => {
                // Placed and never sent (the connection was lost).
                from.bufs.remove(&b);
            }
            Transmit::Release(b) if from.reading.remove(&b) => {
                // A request read for a handler that will not run.
                from.bufs.remove(&b);
            }
            Transmit::Release(b) => {
                assert!(from.lent.remove(&b), "buffer {b} released twice or never lent");
                from.bufs.remove(&b);
            }
            other => from.rdma.push_back(other),
        }
    }
}

/// Runs one queued RDMA operation of `from` against `to`'s memory.
fn run_rdma(from: &mut Side, to: &mut Side, now: Instant) {
    let Some(op) = from.rdma.pop_front() else { return };
    match op {
        Transmit::Read { token, remote, tail } => {
            assert!(
                to.lent.contains(&remote.addr),
                "RDMA Read of buffer {} after its release",
                remote.addr
            );
            let mut data = to.bufs[&remote.addr][..remote.len as usize].to_vec();
            data.extend_from_slice(&tail);
            match token {
                Token::Request(call) if from.held_reads => {
                    let id = from.next_buf;
                    from.next_buf += 1;
                    let len = data.len();
                    from.bufs.insert(id, data);
                    from.reading.insert(id);
                    from.s.handle_request_read(call, Ok((id, len)), now);
                }
                _ => from.s.handle_read_done(token, Ok(data), now),
            }
        }
        Transmit::WriteImm { buf, len, remote, imm } => {
            assert!(
                to.lent.contains(&remote.addr),
                "RDMA Write into landing buffer {} after its release",
                remote.addr
            );
            assert!(
                from.lent.contains(&buf),
                "RDMA Write from buffer {buf} after its release"
            );
            let mut data = (len as u64).to_le_bytes().to_vec();
            data.resize(LANDING_PREFIX, 0);
            data.extend_from_slice(&from.bufs[&buf][..len]);
            to.bufs.get_mut(&remote.addr).expect("landing")[..LANDING_PREFIX + len].copy_from_slice(&data);
            to.inbox.push_back(Wire::WriteImm { imm, len });
            from.s.handle_write_done(buf);
        }
        _ => unreachable!(),
    }
}

/// Delivers one message into `to`'s receive ring, as the NIC would.
fn deliver(to: &mut Side, now: Instant) -> Result<(), ProtoError> {
    let Some(w) = to.inbox.pop_front() else { return Ok(()) };
    if to.posted == 0 {
        to.rnr += 1;
        return Ok(());
    }
    to.posted -= 1;
    let r = match w {
        Wire::Send(m) => {
            assert!(
                m.len() <= cfg().slot_size(),
                "a {}-byte Send into a {}-byte slot",
                m.len(),
                cfg().slot_size()
            );
            let slot = to.next_slot;
            to.next_slot += 1;
            let offer = (to.in_slot && to.slots.len() < RING as usize / 2).then_some(slot);
            match to.s.handle_message_in(&m, offer, now) {
                Ok(true) => {
                    // Held for the application: posted again when it lets go.
                    assert!(offer.is_some(), "a slot kept that was not offered");
                    to.slots.insert(slot, m);
                    to.kept += 1;
                    return Ok(());
                }
                r => r.map(|_| ()),
            }
        }
        Wire::WriteImm { imm, len } => to.s.handle_write_imm(imm, len),
    };
    if to.defer_reposts {
        to.unposted += 1;
    } else {
        to.posted += 1; // reposted as soon as decoded, and reported
        to.s.reposted();
    }
    r
}

/// The server's handler: echo the request reversed, at a size chosen by the test.
fn serve(server: &mut Side, resp_len: impl Fn(usize) -> usize) {
    for (call, req, slot) in std::mem::take(&mut server.requests) {
        // The handler holds the request's slot until it is done.
        if let Some(slot) = slot {
            server.release_slot(slot);
        }
        if server.aborted.contains(&call) {
            continue;
        }
        server.ran.insert(call);
        let len = resp_len(req.len());
        let mut body = pattern(len, req.len() as u8);
        body.iter_mut().zip(req.iter()).for_each(|(b, r)| *b ^= r);
        let p = server.payload(body, false);
        server.s.respond(call, Ok(p));
    }
}

fn expected_response(req_len: usize, resp_len: usize) -> Vec<u8> {
    let req = pattern(req_len, req_len as u8);
    let mut body = pattern(resp_len, req_len as u8);
    body.iter_mut().zip(req.iter()).for_each(|(b, r)| *b ^= r);
    body
}

/// One step of both sides, without serving: what each wants sent moves, one RDMA operation
/// each runs, one message each is delivered, and the events are taken.
fn step(a: &mut Side, b: &mut Side, now: Instant) {
    pump(a, b);
    pump(b, a);
    run_rdma(a, b, now);
    run_rdma(b, a, now);
    deliver(b, now).expect("server accepts");
    deliver(a, now).expect("client accepts");
    a.drain_events();
    b.drain_events();
}

fn settle(a: &mut Side, b: &mut Side, now: Instant, resp_len: impl Fn(usize) -> usize + Copy) {
    for _ in 0..10_000 {
        step(a, b, now);
        serve(b, resp_len);
        // Deferred reposts land after what the messages caused was sent, and after the peer
        // had a chance to send into the slots the credits say are posted.
        a.repost();
        b.repost();
        let idle = a.inbox.is_empty() && b.inbox.is_empty() && a.rdma.is_empty() && b.rdma.is_empty();
        if idle && b.requests.is_empty() && a.unposted == 0 && b.unposted == 0 {
            pump(a, b);
            pump(b, a);
            if a.inbox.is_empty() && b.inbox.is_empty() && a.rdma.is_empty() && b.rdma.is_empty() {
                return;
            }
        }
    }
    panic!("did not settle");
}

fn reply_bytes(a: &Side, r: &Reply) -> Vec<u8> {
    match r {
        Reply::Bytes(b) => b.clone(),
        Reply::Inline(b) => b.to_vec(),
        Reply::InSlot { .. } => panic!("in-slot replies are taken out when they arrive"),
        Reply::Held { .. } => panic!("this driver reads responses into vectors"),
        Reply::Landed { buf } => {
            let b = &a.bufs[buf];
            let len = u64::from_le_bytes(b[..8].try_into().expect("prefix")) as usize;
            b[LANDING_PREFIX..LANDING_PREFIX + len].to_vec()
        }
    }
}

#[test]
fn eager_and_rendezvous_both_ways() {
    eager_and_rendezvous(Side::new(1000), Side::new(2000));
}

#[test]
fn eager_and_rendezvous_with_requests_held_in_their_read_buffers() {
    eager_and_rendezvous(Side::new(1000), Side::new(2000).holding_reads());
}

#[test]
fn lent_requests_with_a_tail_arrive_as_the_lent_bytes_then_the_tail() {
    eager_and_rendezvous(Side::new(1000).with_tails(), Side::new(2000));
    eager_and_rendezvous(Side::new(1000).with_tails(), Side::new(2000).holding_reads());
}

/// A request of method 1 whose payload is `desc`'s lent bytes, then `tail`.
fn lent_request(call: u32, desc: RemoteRegion, tail: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    encode_desc(&desc, &mut body);
    body.extend_from_slice(tail);
    let mut m = Vec::new();
    Header {
        kind: Kind::Request,
        flags: FLAG_RENDEZVOUS,
        call_id: call,
        method: 1,
        status: 0,
        credits: 0,
        body_len: body.len() as u32,
        budget_us: 0,
    }
    .encode(&mut m);
    m.extend_from_slice(&body);
    m
}

/// A tail is the caller's bytes: bounded like an eager payload, counted in the payload's
/// length at both ends, and never part of a response.
#[test]
fn tails_are_bounded_counted_and_requests_only() {
    let now = Instant::now();
    let c = cfg();
    let desc = |len: u64| RemoteRegion { addr: 1, len, rkey: 7 };
    let mut s = Session::new(c.clone());
    // Longer than an eager payload may be: refused at the start, buffers still the caller's.
    let long = Payload::LentWith {
        desc: desc(100),
        buf: 1,
        tail: vec![0; c.eager_max + 1],
    };
    assert!(matches!(
        s.start_call(1, long, None, None, now),
        Err(CallError::Protocol(_))
    ));
    // The lent bytes and the tail together beyond the largest payload.
    let over = Payload::LentWith {
        desc: desc(c.max_payload - 2),
        buf: 2,
        tail: vec![0; 3],
    };
    assert!(matches!(
        s.start_call(1, over, None, None, now),
        Err(CallError::PayloadTooLarge { len, .. }) if len == c.max_payload + 1
    ));
    // A hostile caller that claims as much anyway is answered "too large", and nothing is read.
    let mut server = Session::new(c.clone());
    let m = lent_request(5, desc(c.max_payload - 2), &[1, 2, 3]);
    server.handle_message(&m, now).expect("a well-formed request");
    server.reposted();
    let answer = sent(&mut server);
    let (h, _) = Header::decode(&answer).expect("a header");
    assert_eq!(h.status, Status::PayloadTooLarge as u16);
    assert!(server.poll_transmit().is_none(), "no Read of a refused request");
    // One within the limit is read with its tail, whose bytes count against the server's.
    let mut server = Session::new(c.clone());
    server.limit_serving(4, 1000);
    let m = lent_request(6, desc(995), &[1, 2, 3, 4, 5]);
    server.handle_message(&m, now).expect("a request");
    match server.poll_transmit() {
        Some(Transmit::Read { remote, tail, .. }) => assert_eq!((remote.len, tail), (995, vec![1, 2, 3, 4, 5])),
        other => panic!("expected the Read, got {other:?}"),
    }
    assert_eq!(server.held_request_bytes(), 1000);
    // A response cannot carry one: the caller gets an error, the buffer comes back.
    server.handle_read_done(Token::Request(6), Ok(vec![0; 1000]), now);
    while server.poll_event().is_some() {}
    server.respond(
        6,
        Ok(Payload::LentWith {
            desc: desc(10),
            buf: 44,
            tail: vec![1],
        }),
    );
    let mut released = false;
    let mut status = None;
    while let Some(t) = server.poll_transmit() {
        match t {
            Transmit::Release(44) => released = true,
            Transmit::Send(m) => status = Header::decode(&m.to_vec()).ok().map(|(h, _)| h.status),
            _ => {}
        }
    }
    assert!(released, "the buffer goes back");
    assert_eq!(status, Some(Status::Internal as u16));
}

#[test]
fn eager_and_rendezvous_with_small_messages_kept_in_their_receive_slots() {
    let (a, b) = eager_and_rendezvous(Side::new(1000).in_slots(), Side::new(2000).in_slots().holding_reads());
    assert!(
        a.kept > 0 && b.kept > 0,
        "responses and requests kept in place: {} {}",
        a.kept,
        b.kept
    );
    assert!(a.slots.is_empty() && b.slots.is_empty(), "every held slot given back");
}

fn eager_and_rendezvous(client: Side, server: Side) -> (Side, Side) {
    let now = Instant::now();
    let (mut a, mut b) = (client, server);
    let cases = [
        (0, 0, None),
        (10, 64, None),
        (65, 10, None),
        (10, 500, None),
        (300, 900, Some(1000)),
        (300, 900, Some(100)),
    ];
    let mut calls = Vec::new();
    for (req, resp, landing) in cases {
        let id = a.call(req, landing, None, now);
        calls.push((id, req, resp));
        settle(&mut a, &mut b, now, move |_| resp);
        let got = a.done.remove(&id).expect("done").expect("ok");
        assert_eq!(
            reply_bytes(&a, &got),
            expected_response(req, resp),
            "req {req} resp {resp} landing {landing:?}"
        );
        if let Reply::Landed { buf } = got {
            a.bufs.remove(&buf);
        }
    }
    assert!(a.lent.is_empty() && b.lent.is_empty(), "every lent buffer released");
    assert!(b.reading.is_empty(), "every read buffer handed out or released");
    assert_eq!((a.rnr, b.rnr), (0, 0));
    (a, b)
}

#[test]
fn eager_and_rendezvous_with_small_payloads_sent_from_their_buffers() {
    let (a, b) = eager_and_rendezvous(Side::new(1000).placing(), Side::new(2000).placing());
    assert!(
        a.placed_sent > 0 && b.placed_sent > 0,
        "requests and responses sent from their buffers: {} and {}",
        a.placed_sent,
        b.placed_sent
    );
    assert!(a.sending.is_empty() && b.sending.is_empty(), "every placed buffer sent");
}

#[test]
fn registered_payloads_are_sent_from_their_buffer_lent_or_copied_by_size() {
    let s = Session::new(cfg()); // eager_max 64, pieces of 24
    for len in [0, 1, 24] {
        assert_eq!(s.registered_route(len, false), Route::Place, "{len} bytes");
        // A landing descriptor goes in front of the payload: only a copy has room for it.
        assert_eq!(s.registered_route(len, true), Route::Copy, "{len} bytes");
    }
    // Longer than a piece (lending costs no copy, whatever the threshold), or above it.
    for len in [25, 64, 65, 1 << 20] {
        assert_eq!(s.registered_route(len, false), Route::Lend, "{len} bytes");
        assert_eq!(s.registered_route(len, true), Route::Lend, "{len} bytes");
    }
}

#[test]
fn placed_payloads_are_checked_and_given_back_when_unsent() {
    let now = Instant::now();
    let piece = 24; // cfg().fragment
    let mut s = Session::new(cfg());
    assert!(s.fits_placed(piece) && !s.fits_placed(piece + 1));
    let too_long = s.start_call(1, Payload::Placed { buf: 1, len: piece + 1 }, None, None, now);
    assert!(matches!(too_long, Err(CallError::Protocol(_))), "{too_long:?}");
    let landing = RemoteRegion {
        addr: 9,
        len: 100,
        rkey: 1,
    };
    let with_landing = s.start_call(1, Payload::Placed { buf: 2, len: 4 }, Some((landing, 9)), None, now);
    assert!(matches!(with_landing, Err(CallError::Protocol(_))), "{with_landing:?}");
    assert!(s.poll_transmit().is_none(), "a refused call sends nothing");
    // Queued, then the connection dies before it leaves: the buffer comes back.
    for _ in 0..RING {
        s.start_call(1, Payload::Eager(vec![0]), None, None, now).expect("call");
    }
    s.start_call(1, Payload::Placed { buf: 3, len: 4 }, None, None, now)
        .expect("placed call");
    while let Some(t) = s.poll_transmit() {
        assert!(
            matches!(t, Transmit::Send(_)),
            "only the calls with credits leave: {t:?}"
        );
    }
    s.handle_connection_lost(Lost::new(LostKind::Transport, "gone"));
    assert_eq!(s.poll_transmit(), Some(Transmit::Release(3)));

    // A server's placed response to a call cancelled meanwhile is released, not sent.
    let (mut client, mut server) = (Session::new(cfg()), Session::new(cfg()));
    let call = client
        .start_call(1, Payload::Eager(b"hi".to_vec()), None, None, now)
        .expect("call");
    client.cancel(call);
    while let Some(Transmit::Send(m)) = client.poll_transmit() {
        server.handle_message(&m.to_vec(), now).expect("request, then cancel");
    }
    while server.poll_event().is_some() {}
    while let Some(t) = server.poll_transmit() {
        assert!(matches!(t, Transmit::Send(_)), "{t:?}");
    }
    server.respond(call, Ok(Payload::Placed { buf: 5, len: 2 }));
    assert_eq!(server.poll_transmit(), Some(Transmit::Release(5)));
    assert_eq!(server.poll_transmit(), None);
}

#[test]
fn a_message_that_can_go_at_once_leaves_first_with_its_credits_or_comes_back_when_lost() {
    let now = Instant::now();
    let decode = |head: &[u8], body: usize| {
        let mut msg = head.to_vec();
        msg.resize(HEADER_LEN + body, 0);
        Header::decode(&msg).map(|(h, _)| h).expect("a header")
    };
    let mut s = Session::new(cfg());
    // Two slots posted again since the last message: their credits go with the next one.
    s.reposted();
    s.reposted();
    let first = s
        .start_call(1, Payload::Placed { buf: 7, len: 4 }, None, None, now)
        .expect("call");
    assert!(s.has_transmit());
    // Made after it, it leaves after it, with no credit of the two.
    let second = s
        .start_call(2, Payload::Eager(vec![1, 2]), None, None, now)
        .expect("call");
    match s.poll_transmit() {
        Some(Transmit::SendPlaced { head, buf: 7, len: 4 }) => {
            let h = decode(&head, 4);
            assert_eq!(
                (h.kind, h.call_id, h.method, h.credits, h.body_len),
                (Kind::Request, first, 1, 2, 4)
            );
        }
        t => panic!("the first call's request first: {t:?}"),
    }
    match s.poll_transmit() {
        Some(Transmit::Send(m)) => {
            let (h, body) = Header::decode(&m.to_vec())
                .map(|(h, b)| (h, b.to_vec()))
                .expect("a message");
            assert_eq!((h.call_id, h.credits, body), (second, 0, vec![1, 2]));
        }
        t => panic!("then the second's: {t:?}"),
    }
    assert_eq!(s.poll_transmit(), None);
    assert_eq!(s.credits().available(), RING - 2, "one credit spent for each");

    // Lost before the driver took it: the buffer comes back, and nothing is sent.
    let mut s = Session::new(cfg());
    s.start_call(1, Payload::Placed { buf: 9, len: 4 }, None, None, now)
        .expect("call");
    s.handle_connection_lost(Lost::new(LostKind::Transport, "gone"));
    assert_eq!(s.poll_transmit(), Some(Transmit::Release(9)));
    assert_eq!(s.poll_transmit(), None);
}

#[test]
fn credit_exhaustion_holds_the_sender_and_recovers() {
    credit_exhaustion(Side::new(1000), Side::new(2000));
}

#[test]
fn credits_come_back_only_for_slots_posted_again() {
    credit_exhaustion(Side::new(1000).deferring_reposts(), Side::new(2000).deferring_reposts());
}

#[test]
fn slots_held_by_the_application_hold_credits_back_without_stalling() {
    credit_exhaustion(
        Side::new(1000).in_slots().deferring_reposts(),
        Side::new(2000).in_slots().deferring_reposts(),
    );
}

fn credit_exhaustion(a: Side, b: Side) {
    let now = Instant::now();
    let (mut a, mut b) = (a, b);
    for _ in 0..100 {
        a.call(8, None, None, now);
    }
    pump(&mut a, &mut b);
    assert!(
        b.inbox.len() < RING as usize,
        "at most ring-1 messages in flight without credits back: {}",
        b.inbox.len()
    );
    // a slow consumer: the server drains one message at a time, much later
    settle(&mut a, &mut b, now, |_| 8);
    assert_eq!(a.done.len(), 100);
    assert!(a.done.values().all(Result::is_ok));
    assert_eq!((a.rnr, b.rnr), (0, 0));
    assert!(a.s.credits().available() <= RING && b.s.credits().available() <= RING);
}

#[test]
fn batched_sessions_carry_every_call_through_credit_exhaustion() {
    credit_exhaustion(Side::new(1000).batching(), Side::new(2000).batching());
    credit_exhaustion(
        Side::new(1000).batching().in_slots().deferring_reposts(),
        Side::new(2000).batching().in_slots().deferring_reposts(),
    );
    eager_and_rendezvous(Side::new(1000).batching(), Side::new(2000).batching().holding_reads());
}

#[test]
fn short_messages_queued_together_share_one_send_and_one_credit() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000).batching(), Side::new(2000).batching());
    // The first call may leave at once; the one made behind it before anything was posted
    // goes with it, in its Send, as far as a slot holds (here 56 bytes: two empty requests).
    let before = a.s.credits().available();
    let calls: Vec<u32> = (0..6).map(|_| a.call(0, None, None, now)).collect();
    pump(&mut a, &mut b);
    assert_eq!(b.inbox.len(), 3, "six empty requests in three Sends");
    assert_eq!(
        before - a.s.credits().available(),
        3,
        "a credit per Send, not per request"
    );
    for _ in 0..3 {
        deliver(&mut b, now).expect("the server takes the batch");
    }
    b.drain_events();
    assert_eq!(b.requests.len(), 6, "every request of the batches arrives, in order");
    assert!(b.requests.windows(2).all(|w| w[0].0 < w[1].0));
    // The answers, made together, go back together.
    serve(&mut b, |n| n);
    pump(&mut b, &mut a);
    assert_eq!(a.inbox.len(), 3, "six empty responses in three Sends");
    settle(&mut a, &mut b, now, |n| n);
    for id in &calls {
        let got = a.done.remove(id).expect("done").expect("ok");
        assert_eq!(reply_bytes(&a, &got), expected_response(0, 0));
    }
    assert_eq!((a.rnr, b.rnr), (0, 0));
}

#[test]
fn a_session_batches_only_towards_a_peer_that_takes_batches() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    for i in 0..4 {
        a.call(8 + i, None, None, now);
    }
    pump(&mut a, &mut b);
    assert_eq!(b.inbox.len(), 4, "one Send each without the peer's word");
}

#[test]
fn long_and_lent_messages_are_never_batched() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000).batching(), Side::new(2000).batching());
    // A request in pieces (over 24 bytes of body), then short ones: the pieces go alone.
    a.call(60, None, None, now);
    a.call(4, None, None, now);
    a.call(4, None, None, now);
    pump(&mut a, &mut b);
    for w in &b.inbox {
        let Wire::Send(m) = w else { continue };
        let h = Header::decode(&m[..HEADER_LEN + u32::from_le_bytes(m[16..20].try_into().expect("len")) as usize])
            .map(|(h, _)| h);
        if let Ok(h) = h {
            assert!(
                h.flags & FLAG_FRAGMENT == 0 || h.flags & FLAG_MORE == 0,
                "a piece in a batch"
            );
        }
    }
    settle(&mut a, &mut b, now, |n| n);
    assert_eq!(a.done.len(), 3);
    assert!(a.done.values().all(Result::is_ok));
}

#[test]
fn hostile_batches_end_the_session_with_an_error() {
    let now = Instant::now();
    let msg = |kind: Kind, body: &[u8], flags: u16| {
        let mut h = Header::credit(0);
        h.kind = kind;
        h.flags = flags;
        h.body_len = body.len() as u32;
        let mut v = h.to_bytes().to_vec();
        v.extend_from_slice(body);
        v
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a flag says more, nothing follows", msg(Kind::Credit, b"", FLAG_MORE)),
        ("trailing bytes", {
            let mut v = msg(Kind::Credit, b"", FLAG_MORE);
            v.extend(msg(Kind::Credit, b"", 0));
            v.push(7);
            v
        }),
        ("a piece inside", {
            let mut v = msg(Kind::Credit, b"", FLAG_MORE);
            v.extend(msg(Kind::Request, &[0; 12], FLAG_FRAGMENT));
            v
        }),
        ("an unknown kind inside", {
            let mut v = msg(Kind::Credit, b"", FLAG_MORE);
            let mut bad = msg(Kind::Credit, b"", 0);
            bad[1] = 99;
            v.extend(bad);
            v
        }),
    ];
    for (what, bytes) in cases {
        let mut s = Session::new(cfg());
        assert!(s.handle_message(&bytes, now).is_err(), "{what}: accepted");
    }
    // A good batch of credits is taken, for one slot.
    let mut s = Session::new(cfg());
    let mut v = msg(Kind::Credit, b"", FLAG_MORE);
    v.extend(msg(Kind::Credit, b"", 0));
    s.handle_message(&v, now).expect("a good batch");
    assert!(Session::needs_now(&v), "a batch may hold a budgeted request further in");
}

#[test]
fn deadline_fails_the_call_and_aborts_the_handler() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    let id = a.call(100, None, Some(Duration::from_millis(5)), now);
    pump(&mut a, &mut b);
    deliver(&mut b, now).expect("ok");
    pump(&mut b, &mut a);
    run_rdma(&mut b, &mut a, now);
    b.drain_events();
    assert_eq!(b.requests.len(), 1, "request fetched by rendezvous");
    let later = now + Duration::from_millis(10);
    a.s.handle_timeout(later);
    b.s.handle_timeout(later);
    a.drain_events();
    b.drain_events();
    assert_eq!(a.done.get(&id), Some(&Err(CallError::DeadlineExceeded)));
    assert!(
        b.aborted.contains(&b.requests[0].0),
        "the server aborts the late handler"
    );
    settle(&mut a, &mut b, later, |_| 8);
    assert!(
        a.lent.is_empty(),
        "the lent request buffer is released once the server is done"
    );
    assert_eq!(a.s.pending_calls(), 0);
}

#[test]
fn cancel_keeps_the_buffer_lent_until_the_server_is_done() {
    cancel_keeps_the_buffer_lent(Side::new(2000));
}

#[test]
fn a_request_held_for_a_cancelled_call_never_leaks_its_buffer() {
    cancel_keeps_the_buffer_lent(Side::new(2000).holding_reads());
}

fn cancel_keeps_the_buffer_lent(server: Side) {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), server);
    let id = a.call(500, None, None, now);
    pump(&mut a, &mut b);
    deliver(&mut b, now).expect("ok"); // server now reads the request
    pump(&mut b, &mut a);
    a.s.cancel(id);
    pump(&mut a, &mut b);
    assert!(
        !a.lent.is_empty(),
        "cancelled, but the server may still be reading: not released"
    );
    run_rdma(&mut b, &mut a, now); // the Read runs after the cancel: must still be valid memory
    settle(&mut a, &mut b, now, |_| 8);
    assert!(a.lent.is_empty());
    assert!(!a.done.contains_key(&id), "a cancelled call reports nothing");
    assert_eq!(a.s.pending_calls(), 0);
    assert_eq!(b.s.serving(), 0);
    assert!(b.reading.is_empty(), "the read buffer was released");
}

#[test]
fn peer_crash_fails_every_pending_call_at_once() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    let ids: Vec<u32> = (0..5)
        .map(|i| a.call(if i % 2 == 0 { 10 } else { 1000 }, Some(2000), None, now))
        .collect();
    pump(&mut a, &mut b);
    let inbox = inbox_order(&b);
    let left: Vec<u32> = inbox.iter().map(|&(call, _)| call).collect();
    let whole: Vec<u32> = inbox
        .iter()
        .filter(|&&(_, piece)| !piece)
        .map(|&(call, _)| call)
        .collect();
    a.s.handle_connection_lost(Lost::new(LostKind::Transport, "peer died"));
    a.drain_events();
    pump(&mut a, &mut b);
    for id in ids {
        // A request that went out may have run; one still queued here, whole or some of its
        // pieces (no credit left for them), did not, and says so.
        match a.done.get(&id) {
            Some(Err(CallError::ConnectionLost(_))) => assert!(left.contains(&id), "call {id}"),
            Some(Err(CallError::Unsent(_))) => assert!(!whole.contains(&id), "call {id} went out whole"),
            other => panic!("call {id}: {other:?}"),
        }
    }
    assert!(a.lent.is_empty(), "all buffers back: no peer can reach them");
    assert!(matches!(
        a.s.start_call(1, Payload::Eager(vec![]), None, None, now),
        Err(CallError::ConnectionLost(_))
    ));
    drop(b);
}

/// A client and a server side, and the Send of the client's first call (4 bytes), not yet
/// handled by the server.
fn one_request(now: Instant) -> (Side, Side, Vec<u8>) {
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    a.call(4, None, None, now);
    pump(&mut a, &mut b);
    let Some(Wire::Send(m)) = b.inbox.pop_front() else {
        panic!("a request")
    };
    (a, b, m)
}

#[test]
fn duplicate_and_unknown_call_ids_are_errors() {
    let now = Instant::now();
    let (mut a, mut b, m) = one_request(now);
    b.s.handle_message(&m, now).expect("first");
    assert_eq!(b.s.handle_message(&m, now), Err(ProtoError::DuplicateCall(1)));
    let mut resp = Vec::new();
    Header {
        kind: Kind::Response,
        flags: 0,
        call_id: 99,
        method: 0,
        status: 0,
        credits: 0,
        body_len: 0,
        budget_us: 0,
    }
    .encode(&mut resp);
    assert_eq!(a.s.handle_message(&resp, now), Err(ProtoError::UnknownCall(99)));
    assert_eq!(a.s.handle_write_imm(77, 8), Err(ProtoError::UnknownCall(77)));
}

#[test]
fn a_header_that_came_with_the_completion_is_read_instead_of_the_slot() {
    let now = Instant::now();
    let (_a, mut b, m) = one_request(now);
    // The slot's first bytes spoiled: only the copy that came with the completion is whole.
    let mut spoiled = m.clone();
    spoiled[..HEADER_LEN].fill(0xee);
    let head = &m[..HEADER_LEN + 4];
    assert_eq!(
        b.s.handle_message_with_head(&head[..HEADER_LEN - 1], &spoiled, None, now),
        Err(ProtoError::BadVersion(0xee)),
        "a head shorter than a header is not used"
    );
    assert_eq!(b.s.handle_message_with_head(head, &spoiled, None, now), Ok(false));
    // The body is the slot's: its length is checked against the slot's message.
    let h = Header::decode(&m).expect("a request").0;
    let mut longer = m.clone();
    longer.push(0);
    assert_eq!(
        b.s.handle_message_with_head(head, &longer, None, now),
        Err(ProtoError::BodyLength {
            announced: h.body_len,
            actual: h.body_len as usize + 1
        })
    );
}

/// The Sends a fresh session emits for one call with a `len`-byte eager request.
fn request_sends(len: usize, call_seed: u8) -> Vec<Vec<u8>> {
    let mut s = Session::new(cfg());
    s.start_call(7, Payload::Eager(pattern(len, call_seed)), None, None, Instant::now())
        .expect("start");
    std::iter::from_fn(|| s.poll_transmit())
        .map(|t| match t {
            Transmit::Send(m) => m.to_vec(),
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

#[test]
fn only_offered_slots_of_methods_and_calls_that_ask_are_kept() {
    let now = Instant::now();
    let one = |len: usize| request_sends(len, 9).remove(0);
    // A method served in place, offered a slot: the request stays there.
    let mut b = Session::new(cfg());
    b.serve_in_slot([7]);
    let m = one(20);
    assert_eq!(b.handle_message_in(&m, Some(5), now), Ok(true));
    match b.poll_event() {
        Some(Event::Request {
            payload: RequestBody::InSlot { slot: 5, range },
            ..
        }) => assert_eq!(m[range], pattern(20, 9)[..]),
        other => panic!("expected a request in slot 5, got {other:?}"),
    }
    // Not offered, or another method: copied, and the slot is the driver's again.
    for (served, offer) in [(7, None), (8, Some(5))] {
        let mut b = Session::new(cfg());
        b.serve_in_slot([served]);
        assert_eq!(b.handle_message_in(&one(20), offer, now), Ok(false));
        let copied = matches!(b.poll_event(), Some(Event::Request { payload: RequestBody::Inline(p), .. }) if p[..] == pattern(20, 9)[..]);
        assert!(copied, "method {served} served in place, offer {offer:?}: copied");
    }
    // A message in pieces is joined, never kept in any one slot.
    let mut b = Session::new(cfg());
    b.serve_in_slot([7]);
    for (i, m) in request_sends(60, 3).iter().enumerate() {
        assert_eq!(b.handle_message_in(m, Some(i as u64), now), Ok(false));
    }
    assert!(
        matches!(b.poll_event(), Some(Event::Request { payload: RequestBody::Bytes(p), .. }) if p == pattern(60, 3))
    );

    // Responses: kept for a call that asked, copied for one that did not, and errors never.
    let mut b = Session::new(cfg());
    let mut a = Session::new(cfg());
    let ids: Vec<u32> = (0..3)
        .map(|_| {
            a.start_call(7, Payload::Eager(vec![1]), None, None, now)
                .expect("start")
        })
        .collect();
    a.keep_in_slot(ids[0]);
    a.keep_in_slot(ids[2]);
    while let Some(Transmit::Send(m)) = a.poll_transmit() {
        b.handle_message(&m.to_vec(), now).expect("request");
    }
    while let Some(Event::Request { call, .. }) = b.poll_event() {
        let r = if call == ids[2] {
            Err(ErrorReply::new(Status::Internal, "no"))
        } else {
            Ok(Payload::Eager(pattern(16, 1)))
        };
        b.respond(call, r);
    }
    let mut kept = Vec::new();
    let mut slot = 0;
    while let Some(Transmit::Send(m)) = b.poll_transmit() {
        let m = m.to_vec();
        slot += 1;
        if a.handle_message_in(&m, Some(slot), now).expect("response") {
            kept.push(slot);
        }
        match a.poll_event() {
            Some(Event::CallDone {
                call,
                result: Ok(Reply::InSlot { slot: s, range }),
            }) => {
                assert_eq!((call, s), (ids[0], slot));
                assert_eq!(m[range], pattern(16, 1)[..]);
            }
            Some(Event::CallDone {
                call,
                result: Ok(Reply::Bytes(b)),
            }) => assert_eq!((call, b), (ids[1], pattern(16, 1))),
            Some(Event::CallDone { call, result: Err(_) }) => assert_eq!(call, ids[2]),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(kept.len(), 1, "only the call that asked keeps its response in place");
}

#[test]
fn short_bodies_not_kept_in_a_slot_come_inline_for_body_takers_only() {
    let now = Instant::now();
    // One piece for every message here.
    let wide = SessionConfig {
        eager_max: 4096,
        fragment: 4096,
        ..cfg()
    };
    let (mut a, mut b) = (Session::new(wide.clone()), Session::new(wide));
    b.serve_in_slot([7]);
    // Requests of Inline::MAX and Inline::MAX + 1 bytes, and a response of each length to a
    // call that takes a `Body` (keep_in_slot) and to one that takes a `Vec`.
    for (len, body_taker) in [(Inline::MAX, true), (Inline::MAX + 1, true), (Inline::MAX, false)] {
        let call = a
            .start_call(7, Payload::Eager(pattern(len, 2)), None, None, now)
            .expect("start");
        if body_taker {
            a.keep_in_slot(call);
        }
        let Some(Transmit::Send(m)) = a.poll_transmit() else {
            panic!("a request")
        };
        // Offered no slot: copied out, whichever way suits its length.
        b.handle_message_in(&m.to_vec(), None, now).expect("request");
        match b.poll_event() {
            Some(Event::Request {
                payload: RequestBody::Inline(p),
                ..
            }) => {
                assert!(len <= Inline::MAX);
                assert_eq!(p[..], pattern(len, 2)[..]);
            }
            Some(Event::Request {
                payload: RequestBody::Bytes(p),
                ..
            }) => {
                assert!(len > Inline::MAX);
                assert_eq!(p, pattern(len, 2));
            }
            other => panic!("unexpected {other:?}"),
        }
        b.respond(call, Ok(Payload::Eager(pattern(len, 3))));
        let Some(Transmit::Send(m)) = b.poll_transmit() else {
            panic!("a response")
        };
        assert!(!a.handle_message_in(&m.to_vec(), None, now).expect("response"));
        match a.poll_event() {
            Some(Event::CallDone {
                result: Ok(Reply::Inline(r)),
                ..
            }) => {
                assert!(
                    body_taker && len <= Inline::MAX,
                    "inline only for a Body taker, and short"
                );
                assert_eq!(r[..], pattern(len, 3)[..]);
            }
            Some(Event::CallDone {
                result: Ok(Reply::Bytes(r)),
                ..
            }) => {
                assert!(
                    !body_taker || len > Inline::MAX,
                    "a vector for a Vec taker, or a long one"
                );
                assert_eq!(r, pattern(len, 3));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn long_messages_travel_in_pieces_joined_in_order_only() {
    let now = Instant::now();
    let pieces = request_sends(60, 3);
    assert_eq!(pieces.len(), 3, "60 bytes of body in pieces of 24");
    assert!(pieces.iter().all(|m| m.len() <= cfg().slot_size()));

    let mut b = Session::new(cfg());
    for m in &pieces {
        assert!(b.poll_event().is_none(), "no request before its last piece");
        b.handle_message(m, now).expect("piece");
    }
    match b.poll_event() {
        Some(Event::Request {
            method: 7,
            payload: RequestBody::Bytes(p),
            ..
        }) => assert_eq!(p, pattern(60, 3)),
        other => panic!("expected the joined request, got {other:?}"),
    }

    let bad = |steps: &[&[u8]]| {
        let mut b = Session::new(cfg());
        let (last, first) = steps.split_last().expect("steps");
        for m in first {
            b.handle_message(m, now).expect("accepted before the bad one");
        }
        b.handle_message(last, now)
    };
    let other = request_sends(8, 4).remove(0); // a whole message of another call (id 1 too)
    let mut credit = Vec::new();
    Header::credit(0).encode(&mut credit);
    let err = |r: Result<(), ProtoError>| assert!(matches!(r, Err(ProtoError::BadFragment(_))), "{r:?}");
    err(bad(&[&pieces[1]]));
    err(bad(&[&pieces[0], &pieces[2]]));
    err(bad(&[&pieces[0], &pieces[0]]));
    err(bad(&[&pieces[0], &other]));
    let mut longer = pieces[2].clone();
    longer.extend_from_slice(&[0; 13]); // past the message's announced length
    let n = (longer.len() - HEADER_LEN) as u32;
    longer[16..20].copy_from_slice(&n.to_le_bytes());
    err(bad(&[&pieces[0], &pieces[1], &longer]));
    // Credits may come between the pieces.
    assert_eq!(bad(&[&pieces[0], &credit, &pieces[1], &pieces[2]]), Ok(()));
}

#[test]
fn malformed_headers_are_errors() {
    let now = Instant::now();
    let mut s = Session::new(cfg());
    assert_eq!(s.handle_message(&[], now), Err(ProtoError::Truncated));
    let mut m = Vec::new();
    Header {
        kind: Kind::Request,
        flags: FLAG_RENDEZVOUS,
        call_id: 1,
        method: 1,
        status: 0,
        credits: 0,
        body_len: 3,
        budget_us: 0,
    }
    .encode(&mut m);
    m.extend_from_slice(&[1, 2, 3]);
    assert_eq!(
        s.handle_message(&m, now),
        Err(ProtoError::Truncated),
        "a rendezvous request without descriptor"
    );
    m[0] = 9;
    assert_eq!(s.handle_message(&m, now), Err(ProtoError::BadVersion(9)));
    let mut c = Vec::new();
    Header::credit(1000).encode(&mut c);
    assert_eq!(
        s.handle_message(&c, now),
        Err(ProtoError::Overrun),
        "more credits than the ring"
    );
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut s = Session::new(cfg());
        let _ = s.handle_message(&bytes, Instant::now());
        let _ = s.handle_write_imm(u32::from(bytes.first().copied().unwrap_or(0)), bytes.len());
        while s.poll_transmit().is_some() {}
    }

    #[test]
    fn random_headers_never_panic(kind in 0u8..8, flags in 0u16..4, call in 0u32..4, status in 0u16..10,
                                  credits in 0u16..20, body in proptest::collection::vec(any::<u8>(), 0..80)) {
        let mut s = Session::new(cfg());
        let _ = s.start_call(1, Payload::Eager(vec![1]), None, None, Instant::now());
        let mut m = vec![1, kind];
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&call.to_le_bytes());
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&status.to_le_bytes());
        m.extend_from_slice(&credits.to_le_bytes());
        m.extend_from_slice(&(body.len() as u32).to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&body);
        let _ = s.handle_message(&m, Instant::now());
        while s.poll_transmit().is_some() {}
        while s.poll_event().is_some() {}
    }

    /// A header read from a copy of the message's start (a transport `Head`, at most 28 bytes)
    /// decodes as the message itself does, whatever the bytes; a copy shorter than a header
    /// leaves the message to be read.
    #[test]
    fn a_head_copy_decodes_as_the_message(mut msg in proptest::collection::vec(any::<u8>(), 0..80),
                                          cut in 0usize..29, kind in 1u8..8, whole in any::<bool>()) {
        // Half of them a well-formed header over the rest of the bytes.
        if whole && msg.len() >= HEADER_LEN {
            msg[0] = VERSION;
            msg[1] = kind;
            let body = (msg.len() - HEADER_LEN) as u32;
            msg[16..20].copy_from_slice(&body.to_le_bytes());
        }
        let head = &msg[..cut.min(msg.len())];
        prop_assert_eq!(Header::decode_with_head(head, &msg), Header::decode(&msg));
    }

    /// Random call mixes, sizes across the threshold, cancellations, deadlines and interleavings:
    /// never RNR, credits within the ring, every live call answered once and correctly, and no
    /// buffer reached after its release.
    #[test]
    ///
    /// With limits (`limits.0`: 1 the server's and the client keeping them, 2 the server's
    /// alone): the server never has more requests unanswered, nor more request bytes held, than
    /// it allows (one request alone excepted); a client that keeps the limit never sees
    /// `Overloaded`, and a call refused so never ran.
    #[test]
    fn random_mixes_keep_every_promise(ops in proptest::collection::vec((0u8..8, 0usize..400, 0usize..400), 1..120), held in any::<bool>(), deferred in any::<bool>(), in_slot in any::<bool>(), placed in any::<bool>(), limits in (0u8..3, 1usize..4, 1u64..800), interleave in any::<bool>()) {
        let t0 = Instant::now();
        let server = if held { Side::new(2000).holding_reads() } else { Side::new(2000) };
        let client = Side::new(1000);
        let (client, server) = if placed { (client.placing(), server.placing()) } else { (client, server) };
        let (client, server) = if in_slot { (client.in_slots(), server.in_slots()) } else { (client, server) };
        let (mut a, mut b) = if deferred {
            (client.deferring_reposts(), server.deferring_reposts())
        } else {
            (client, server)
        };
        let (limited, max_requests, max_bytes) = limits;
        if limited > 0 {
            b.s.limit_serving(max_requests, max_bytes);
            b.s.limit_reading(max_bytes / 2 + 1);
        }
        if limited == 1 {
            a.s.limit_calls(max_requests);
            a.s.limit_call_bytes(max_bytes);
        }
        // Short messages between the pieces of longer ones, both ways (as two current peers).
        a.s.interleave(interleave);
        b.s.interleave(interleave);
        let mut started: HashMap<u32, (usize, usize)> = HashMap::new();
        let mut cancelled = HashSet::new();
        let mut now = t0;
        let resp_for = |req: usize| (req * 7 + 3) % 400;
        for (op, x, y) in ops {
            match op {
                0 | 1 => {
                    let landing = (y % 3 == 0).then_some(y);
                    let budget = (x % 11 == 0).then(|| Duration::from_millis(1 + (y % 5) as u64));
                    let id = a.call(x, landing, budget, now);
                    started.insert(id, (x, resp_for(x)));
                }
                2 => { if let Some(&id) = started.keys().nth(x % started.len().max(1)) { a.s.cancel(id); cancelled.insert(id); } }
                3 if x % 2 == 0 => { pump(&mut a, &mut b); pump(&mut b, &mut a); }
                3 => { a.repost(); b.repost(); }
                4 => { deliver(&mut b, now).expect("server"); b.drain_events(); }
                5 => { deliver(&mut a, now).expect("client"); a.drain_events(); }
                6 => { run_rdma(&mut a, &mut b, now); run_rdma(&mut b, &mut a, now); }
                _ => {
                    now += Duration::from_millis((x % 3) as u64);
                    a.s.handle_timeout(now); b.s.handle_timeout(now);
                    a.drain_events(); b.drain_events();
                    serve(&mut b, resp_for);
                }
            }
            prop_assert!(a.s.credits().available() <= RING && b.s.credits().available() <= RING);
            if limited > 0 {
                prop_assert!(b.s.unanswered() <= max_requests, "{} requests unanswered, limit {}", b.s.unanswered(), max_requests);
                prop_assert!(b.s.held_request_bytes() <= max_bytes.max(400), "{} request bytes held, limit {}", b.s.held_request_bytes(), max_bytes);
                prop_assert!(b.s.reading_request_bytes() <= (max_bytes / 2 + 1).max(400), "{} request bytes being read, limit {}", b.s.reading_request_bytes(), max_bytes / 2 + 1);
            }
        }
        settle(&mut a, &mut b, now, resp_for);
        prop_assert_eq!((a.rnr, b.rnr), (0, 0));
        for (id, (req, resp)) in &started {
            match a.done.get(id) {
                Some(Ok(r)) => prop_assert_eq!(reply_bytes(&a, r), expected_response(*req, *resp)),
                Some(Err(CallError::DeadlineExceeded | CallError::Cancelled)) => {}
                Some(Err(CallError::Expired)) => {
                    prop_assert!(!b.ran.contains(id), "call {} expired unrun, yet ran", id);
                }
                Some(Err(CallError::Remote { status: Status::Overloaded, message, .. })) if limited == 2 => {
                    prop_assert_eq!(message.parse::<u64>().ok(), Some(max_requests as u64));
                    prop_assert!(!b.ran.contains(id), "call {} was refused as overloaded, yet ran", id);
                }
                Some(Err(e)) => prop_assert!(false, "call {} failed: {}", id, e),
                None => prop_assert!(cancelled.contains(id), "call {} never answered", id),
            }
        }
        let landed: HashSet<BufId> = a.done.values().filter_map(|r| match r { Ok(Reply::Landed { buf }) => Some(*buf), _ => None }).collect();
        prop_assert!(a.lent.iter().all(|b| landed.contains(b)), "client buffers still lent: {:?}", a.lent);
        prop_assert!(b.lent.is_empty(), "server buffers still lent: {:?}", b.lent);
        prop_assert!(b.reading.is_empty(), "server read buffers neither handed out nor released: {:?}", b.reading);
        prop_assert_eq!(a.s.pending_calls(), 0);
        prop_assert_eq!(b.s.serving(), 0);
        prop_assert_eq!((b.s.unanswered(), b.s.held_request_bytes(), b.s.reading_request_bytes(), a.s.held_back_calls()), (0, 0, 0, 0));
        prop_assert!(a.slots.is_empty() && b.slots.is_empty(), "receive slots still held");
        prop_assert!(a.sending.is_empty() && b.sending.is_empty(), "placed buffers neither sent nor released");
    }
}

/// The message a session wants sent next, which must be a Send.
fn sent(s: &mut Session) -> Vec<u8> {
    match s.poll_transmit() {
        Some(Transmit::Send(m)) => m.to_vec(),
        other => panic!("expected a Send, got {other:?}"),
    }
}

#[test]
fn only_requests_with_a_budget_need_the_clock() {
    let now = Instant::now();
    let mut client = Session::new(cfg());
    let mut server = Session::new(cfg());
    client
        .start_call(1, Payload::Eager(b"plain".to_vec()), None, None, now)
        .expect("call");
    let plain = sent(&mut client);
    client
        .start_call(
            1,
            Payload::Eager(b"timed".to_vec()),
            None,
            Some(Duration::from_secs(5)),
            now,
        )
        .expect("call");
    let timed = sent(&mut client);
    assert!(!Session::needs_now(&plain));
    assert!(Session::needs_now(&timed));
    assert!(
        Session::needs_now(b"not a message"),
        "undecodable: read the clock, to be safe"
    );
    // A request without a budget handled with any instant at all places no deadline...
    let long_ago = now.checked_sub(Duration::from_secs(3600)).unwrap_or(now);
    server.handle_message(&plain, long_ago).expect("plain request");
    assert_eq!(server.poll_timeout(), None);
    // ...and one with a budget places it from the instant it is given.
    server.handle_message(&timed, now).expect("timed request");
    assert_eq!(server.poll_timeout(), Some(now + Duration::from_secs(5)));
    let Some(Event::Request { call, .. }) = server.poll_event() else {
        panic!("request")
    };
    server.respond(call, Ok(Payload::Eager(b"ok".to_vec())));
    let response = sent(&mut server);
    assert!(!Session::needs_now(&response));
}

#[test]
fn poll_timeout_follows_deadlines_as_calls_come_and_go() {
    let now = Instant::now();
    let secs = Duration::from_secs;
    let mut client = Session::new(cfg());
    let mut server = Session::new(cfg());
    assert_eq!(client.poll_timeout(), None);
    client
        .start_call(1, Payload::Eager(b"timed".to_vec()), None, Some(secs(5)), now)
        .expect("call");
    let timed = sent(&mut client);
    client
        .start_call(1, Payload::Eager(b"plain".to_vec()), None, None, now)
        .expect("call");
    let plain = sent(&mut client);
    // Seen on every look while the call lives, not only the first.
    assert_eq!(client.poll_timeout(), Some(now + secs(5)));
    assert_eq!(client.poll_timeout(), Some(now + secs(5)));
    // The server sees the budget of the one request that has it, until it is answered.
    server.handle_message(&plain, now).expect("plain request");
    assert_eq!(server.poll_timeout(), None);
    server.handle_message(&timed, now).expect("timed request");
    assert_eq!(server.poll_timeout(), Some(now + secs(5)));
    let mut responses = Vec::new();
    while let Some(ev) = server.poll_event() {
        if let Event::Request { call, .. } = ev {
            server.respond(call, Ok(Payload::Eager(b"ok".to_vec())));
            responses.push(sent(&mut server));
        }
    }
    assert_eq!(responses.len(), 2);
    assert_eq!(server.poll_timeout(), None);
    for r in &responses {
        client.handle_message(r, now).expect("response");
    }
    assert_eq!(client.pending_calls(), 0);
    assert_eq!(client.poll_timeout(), None);
    // Looked at and found none: a deadline added after that is seen again.
    client
        .start_call(1, Payload::Eager(b"again".to_vec()), None, Some(secs(1)), now)
        .expect("call");
    assert_eq!(client.poll_timeout(), Some(now + secs(1)));
}

#[test]
fn a_response_replayed_after_its_call_finished_is_refused() {
    let now = Instant::now();
    let mut client = Session::new(cfg());
    let mut server = Session::new(cfg());
    let answer = |client: &mut Session, server: &mut Session| {
        let req = sent(client);
        server.handle_message(&req, now).expect("request");
        let Some(Event::Request { call, .. }) = server.poll_event() else {
            panic!("request")
        };
        server.respond(call, Ok(Payload::Eager(b"ok".to_vec())));
        sent(server)
    };
    let first = client
        .start_call(1, Payload::Eager(b"a".to_vec()), None, None, now)
        .expect("call");
    let resp = answer(&mut client, &mut server);
    client.handle_message(&resp, now).expect("response");
    assert!(matches!(client.poll_event(), Some(Event::CallDone { call, result: Ok(_) }) if call == first));
    // Another call in flight: the replay must not be taken for its response.
    let second = client
        .start_call(1, Payload::Eager(b"b".to_vec()), None, None, now)
        .expect("call");
    assert_ne!(first, second);
    assert_eq!(
        client.handle_message(&resp, now),
        Err(ProtoError::UnknownCall(first)),
        "the first call's response again"
    );
    assert_eq!(client.pending_calls(), 1);
}

/// Steps the two sides a while without serving, until what is in flight has arrived.
fn exchange(a: &mut Side, b: &mut Side, now: Instant) {
    for _ in 0..64 {
        step(a, b, now);
    }
}

#[test]
fn go_away_serves_what_was_sent_refuses_new_calls_and_closes_when_drained() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    // Two calls reach the server (one by rendezvous); neither is answered yet.
    let small = a.call(10, None, None, now);
    let large = a.call(300, None, None, now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 2, "both requests are at the handler");
    b.s.go_away();
    exchange(&mut a, &mut b, now);
    assert!(a.s.is_going_away(), "the client heard GoAway");
    assert!(!b.s.is_closed(), "no Close while two requests are being served");
    assert_eq!(
        a.s.start_call(1, Payload::Eager(vec![1]), None, None, now),
        Err(CallError::ShuttingDown),
        "no new call starts after GoAway"
    );
    // The handler answers both: the responses come, then Close.
    serve(&mut b, |n| n + 1);
    exchange(&mut a, &mut b, now);
    for (id, req) in [(small, 10), (large, 300)] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(req, req + 1));
    }
    assert!(b.s.is_closed(), "Close went once nothing was left to serve");
    assert!(a.s.is_lost(), "the client's session ends with the server's Close");
    assert_eq!(
        a.s.start_call(1, Payload::Eager(vec![1]), None, None, now),
        Err(CallError::ShuttingDown),
        "after Close a call still fails as not run, not as a lost connection"
    );
    assert!(
        !b.s.has_transmit() && b.s.poll_transmit().is_none(),
        "nothing follows Close"
    );
    assert!(a.lent.is_empty() && b.lent.is_empty(), "every lent buffer released");
    assert_eq!((a.rnr, b.rnr), (0, 0));
}

#[test]
fn a_request_that_crosses_close_is_not_run_and_fails_as_not_run() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.go_away();
    // GoAway and Close leave the server before the client hears either; the client's call
    // crosses them on the wire.
    pump(&mut b, &mut a);
    assert!(b.s.is_closed(), "an idle server closes right after GoAway");
    let late = a.call(10, None, None, now);
    let rendezvous = a.call(300, None, None, now);
    exchange(&mut a, &mut b, now);
    assert!(
        b.requests.is_empty(),
        "no handler runs for a request that came after Close"
    );
    assert!(b.rdma.is_empty(), "nor is a lent request read");
    for id in [late, rendezvous] {
        assert_eq!(a.done.remove(&id), Some(Err(CallError::ShuttingDown)), "call {id}");
    }
    assert!(a.lent.is_empty(), "the lent request's buffer is the client's again");
    assert!(a.s.is_lost());
    assert_eq!((a.rnr, b.rnr), (0, 0));
}

#[test]
fn close_waits_for_a_lent_response_to_be_read() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    let id = a.call(10, None, None, now);
    exchange(&mut a, &mut b, now);
    b.s.go_away();
    // A large response: lent, so the server must wait for the client's ReadDone.
    serve(&mut b, |_| 500);
    pump(&mut b, &mut a);
    assert!(
        !b.s.is_closed(),
        "no Close while the client may still read the lent response"
    );
    exchange(&mut a, &mut b, now);
    let r = a.done.remove(&id).expect("answered").expect("ok");
    assert_eq!(reply_bytes(&a, &r), expected_response(10, 500));
    assert!(b.s.is_closed(), "Close once the response was read");
    assert!(b.lent.is_empty(), "the lent response released");
}

proptest! {
    /// Random call mixes as in `random_mixes_keep_every_promise`, with the server's shutdown
    /// starting at a random point: every call either ran once and got its answer, or failed with
    /// `ShuttingDown` and never reached a handler (or was cancelled or timed out); the server
    /// ends with Close, the client's session with it, with no RNR and no buffer left lent.
    #[test]
    fn random_mixes_with_a_shutdown_run_each_call_once_or_not_at_all(ops in proptest::collection::vec((0u8..9, 0usize..400, 0usize..400), 1..120), stop_at in 0usize..120, held in any::<bool>(), placed in any::<bool>(), limits in proptest::option::of((1usize..4, 1u64..800)), interleave in any::<bool>()) {
        let mut now = Instant::now();
        let server = if held { Side::new(2000).holding_reads() } else { Side::new(2000) };
        let (mut a, mut b) = if placed { (Side::new(1000).placing(), server.placing()) } else { (Side::new(1000), server) };
        // With limits, some calls wait unsent in the client when GoAway comes: they fail as not run.
        if let Some((requests, bytes)) = limits {
            b.s.limit_serving(requests, bytes);
            a.s.limit_calls(requests);
            a.s.limit_call_bytes(bytes);
        }
        a.s.interleave(interleave);
        b.s.interleave(interleave);
        let resp_for = |req: usize| (req * 7 + 3) % 400;
        let mut started: HashMap<u32, (usize, usize)> = HashMap::new();
        for (i, (op, x, y)) in ops.into_iter().enumerate() {
            if i == stop_at {
                b.s.go_away();
            }
            match op {
                0 | 1 => {
                    let landing = (y % 3 == 0).then_some(y);
                    let budget = (x % 11 == 0).then(|| Duration::from_millis(1 + (y % 5) as u64));
                    match a.try_call(x, landing, budget, now) {
                        Ok(id) => { started.insert(id, (x, resp_for(x))); }
                        Err(e) => {
                            prop_assert_eq!(e, CallError::ShuttingDown);
                            prop_assert!(i > stop_at, "a call refused before the shutdown");
                        }
                    }
                }
                2 => { if let Some(&id) = started.keys().nth(x % started.len().max(1)) { a.s.cancel(id); } }
                3 => { pump(&mut a, &mut b); pump(&mut b, &mut a); }
                4 => { deliver(&mut b, now).expect("server"); b.drain_events(); }
                5 => { deliver(&mut a, now).expect("client"); a.drain_events(); }
                6 => { run_rdma(&mut a, &mut b, now); run_rdma(&mut b, &mut a, now); }
                7 => {
                    now += Duration::from_millis((x % 3) as u64);
                    a.s.handle_timeout(now); b.s.handle_timeout(now);
                    a.drain_events(); b.drain_events();
                }
                _ => serve(&mut b, resp_for),
            }
        }
        b.s.go_away();
        settle(&mut a, &mut b, now, resp_for);
        prop_assert_eq!((a.rnr, b.rnr), (0, 0));
        prop_assert!(b.s.is_closed(), "the server closed once it had nothing left to serve");
        prop_assert!(a.s.is_lost(), "the client's session ended with the server's Close");
        for (id, (req, resp)) in &started {
            match a.done.get(id) {
                Some(Ok(r)) => {
                    prop_assert!(b.ran.contains(id), "call {} answered without running", id);
                    prop_assert_eq!(reply_bytes(&a, r), expected_response(*req, *resp));
                }
                Some(Err(CallError::ShuttingDown)) => {
                    prop_assert!(!b.ran.contains(id), "call {} ran but failed as not run", id);
                }
                Some(Err(CallError::DeadlineExceeded)) => {}
                Some(Err(CallError::Expired)) => {
                    prop_assert!(!b.ran.contains(id), "call {} expired unrun, yet ran", id);
                }
                Some(Err(e)) => prop_assert!(false, "call {} failed: {}", id, e),
                // Cancelled by the caller (its future dropped): no result to give.
                None => {}
            }
        }
        let landed: HashSet<BufId> = a.done.values().filter_map(|r| match r { Ok(Reply::Landed { buf }) => Some(*buf), _ => None }).collect();
        prop_assert!(a.lent.iter().all(|b| landed.contains(b)), "client buffers still lent: {:?}", a.lent);
        prop_assert!(b.lent.is_empty(), "server buffers still lent: {:?}", b.lent);
        prop_assert!(b.reading.is_empty(), "server read buffers neither handed out nor released: {:?}", b.reading);
        prop_assert_eq!(b.s.serving(), 0);
        prop_assert_eq!(a.s.held_back_calls(), 0);
        prop_assert!(a.sending.is_empty() && b.sending.is_empty(), "placed buffers neither sent nor released");
    }
}

#[test]
fn a_server_refuses_requests_beyond_its_limit_unrun() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_serving(2, u64::MAX);
    // A caller that does not keep the limit (no `limit_calls`): three calls, one eager beyond.
    let ids = [
        a.call(10, None, None, now),
        a.call(300, None, None, now),
        a.call(20, None, None, now),
    ];
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 2, "two requests at the handler");
    assert_eq!(b.s.unanswered(), 2);
    assert!(
        matches!(
            a.done.get(&ids[2]),
            Some(Err(CallError::Remote { status: Status::Overloaded, message, .. })) if message == "2"
        ),
        "{:?}",
        a.done.get(&ids[2])
    );
    // Once one is answered, the next call is served.
    serve(&mut b, |n| n);
    let again = a.call(20, None, None, now);
    settle(&mut a, &mut b, now, |n| n);
    assert!(!b.ran.contains(&ids[2]), "the refused call never ran");
    for (id, len) in [(ids[0], 10), (ids[1], 300), (again, 20)] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(len, len));
    }
    assert!(a.lent.is_empty() && b.lent.is_empty());
}

#[test]
fn a_client_holds_calls_beyond_the_servers_limit_back_until_earlier_ones_finish() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_serving(2, u64::MAX);
    a.s.limit_calls(2);
    let ids: Vec<u32> = (0..6).map(|i| a.call(10 + i * 60, None, None, now)).collect();
    let late = a.call(5, None, Some(Duration::from_millis(1)), now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 2, "the server sees only as many as it serves");
    assert_eq!(a.s.held_back_calls(), 5);
    // A call that waits can be cancelled, or time out, without ever reaching the server.
    a.s.cancel(ids[3]);
    a.s.handle_timeout(now + Duration::from_millis(2));
    a.drain_events();
    assert_eq!(a.done.get(&late), Some(&Err(CallError::Expired)), "it never left");
    assert_eq!(a.s.held_back_calls(), 3);
    settle(&mut a, &mut b, now, |n| n + 1);
    for (i, id) in ids.iter().enumerate() {
        let len = 10 + i * 60;
        match a.done.remove(id) {
            None => assert_eq!(i, 3, "only the cancelled call has no result"),
            Some(r) => {
                let r = r.expect("answered");
                assert_eq!(reply_bytes(&a, &r), expected_response(len, len + 1));
            }
        }
    }
    assert!(!b.ran.contains(&ids[3]) && !b.ran.contains(&late));
    assert_eq!((a.s.pending_calls(), a.s.held_back_calls()), (0, 0));
    assert!(a.lent.is_empty(), "the waiting calls' buffers came back");
}

#[test]
fn calls_held_back_when_the_server_goes_away_fail_as_not_run() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000).placing(), Side::new(2000));
    a.s.limit_calls(1);
    let sent = a.call(10, None, None, now);
    let waiting = [a.call(10, None, None, now), a.call(300, None, None, now)];
    exchange(&mut a, &mut b, now);
    b.s.go_away();
    exchange(&mut a, &mut b, now);
    for id in waiting {
        assert_eq!(a.done.remove(&id), Some(Err(CallError::ShuttingDown)), "call {id}");
    }
    settle(&mut a, &mut b, now, |n| n);
    assert!(a.done.remove(&sent).expect("answered").is_ok());
    assert!(b.s.is_closed());
    assert!(
        a.lent.is_empty() && a.sending.is_empty(),
        "the waiting calls' buffers came back"
    );
}

#[test]
fn rendezvous_requests_beyond_the_byte_limit_wait_unread() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_serving(usize::MAX, 500);
    let ids = [
        a.call(300, None, None, now),
        a.call(200, None, None, now),
        a.call(100, None, None, now),
    ];
    exchange(&mut a, &mut b, now);
    // 300 + 200 fit; the third waits, unread, though a request behind it is small.
    assert_eq!(b.requests.len(), 2);
    assert_eq!(b.s.held_request_bytes(), 500);
    assert_eq!(b.s.unanswered(), 3, "the waiting one counts as a request");
    serve(&mut b, |n| n);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 1, "read once the others were answered");
    // One request larger than the limit is read when it is alone.
    let big = a.call(900, None, None, now);
    let small = a.call(10, None, None, now);
    settle(&mut a, &mut b, now, |n| n);
    for (id, len) in [(ids[0], 300), (ids[1], 200), (ids[2], 100), (big, 900), (small, 10)] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(len, len));
    }
    assert_eq!((b.s.unanswered(), b.s.held_request_bytes()), (0, 0));
}

#[test]
fn a_request_waiting_for_bytes_can_be_cancelled_or_time_out() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_serving(usize::MAX, 300);
    let first = a.call(300, None, None, now);
    let cancelled = a.call(300, None, None, now);
    let timed = a.call(300, None, Some(Duration::from_millis(5)), now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 1);
    assert_eq!(b.s.unanswered(), 3);
    a.s.cancel(cancelled);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.s.unanswered(), 2, "the server let the cancelled one go unread");
    let later = now + Duration::from_millis(6);
    assert!(
        b.s.poll_timeout().is_some_and(|t| t <= later),
        "a waiting request's deadline runs"
    );
    b.s.handle_timeout(later);
    b.drain_events();
    assert!(b.aborted.is_empty(), "no handler ran for it, none to abort");
    exchange(&mut a, &mut b, later);
    assert_eq!(a.done.remove(&timed), Some(Err(CallError::DeadlineExceeded)));
    settle(&mut a, &mut b, later, |n| n);
    assert!(a.done.remove(&first).expect("answered").is_ok());
    assert!(!b.ran.contains(&cancelled) && !b.ran.contains(&timed));
    assert!(a.lent.is_empty(), "the lent bodies of the unread requests came back");
    assert_eq!((b.s.unanswered(), b.s.held_request_bytes()), (0, 0));
}

#[test]
fn calls_held_back_when_the_connection_is_lost_say_they_never_ran() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000).placing(), Side::new(2000));
    a.s.limit_calls(1);
    let sent = a.call(10, None, None, now);
    let waiting = [a.call(10, None, None, now), a.call(300, None, None, now)];
    pump(&mut a, &mut b);
    a.s.handle_connection_lost(Lost::new(LostKind::Transport, "peer died"));
    a.drain_events();
    pump(&mut a, &mut b);
    assert_eq!(
        a.done.remove(&sent),
        Some(Err(CallError::ConnectionLost(Lost::new(
            LostKind::Transport,
            "peer died"
        )))),
        "a call that was sent may have run: no more is known"
    );
    for id in waiting {
        assert_eq!(
            a.done.remove(&id),
            Some(Err(CallError::Unsent(Lost::new(LostKind::Transport, "peer died")))),
            "call {id} never left"
        );
    }
    assert!(a.lent.is_empty() && a.sending.is_empty(), "every buffer back");
}

/// (call, whether it is a piece) of each message waiting in `side`'s inbox, in order.
fn inbox_order(side: &Side) -> Vec<(u32, bool)> {
    side.inbox
        .iter()
        .map(|w| match w {
            Wire::Send(m) => {
                let (h, _) = Header::decode(m).expect("a message");
                (h.call_id, h.flags & FLAG_FRAGMENT != 0)
            }
            Wire::WriteImm { .. } => panic!("a Write-with-immediate"),
        })
        .collect()
}

#[test]
fn short_messages_go_between_the_pieces_of_a_long_one_when_the_peer_takes_them() {
    let now = Instant::now();
    for interleave in [false, true] {
        let (mut a, mut b) = (Side::new(1000), Side::new(2000));
        a.s.interleave(interleave);
        b.s.interleave(interleave);
        let long = a.call(61, None, None, now); // 61 bytes of body: 3 pieces of at most 24
        let Some(Transmit::Send(m)) = a.s.poll_transmit() else {
            panic!("the first piece")
        };
        b.inbox.push_back(Wire::Send(m.to_vec()));
        let short = a.call(10, None, None, now);
        let short2 = a.call(11, None, None, now);
        pump(&mut a, &mut b);
        let expected = if interleave {
            // One short call after each piece: the long one keeps every other turn.
            vec![
                (long, true),
                (short, false),
                (long, true),
                (short2, false),
                (long, true),
            ]
        } else {
            vec![
                (long, true),
                (long, true),
                (long, true),
                (short, false),
                (short2, false),
            ]
        };
        assert_eq!(inbox_order(&b), expected, "interleave {interleave}");
        // The server takes them in that order: the short calls while it joins the long one.
        settle(&mut a, &mut b, now, |n| n);
        for (id, len) in [(long, 61), (short, 10), (short2, 11)] {
            let r = a.done.remove(&id).expect("answered").expect("ok");
            assert_eq!(reply_bytes(&a, &r), expected_response(len, len), "call of {len} bytes");
        }
    }
}

#[test]
fn between_pieces_only_credits_and_whole_messages_of_other_calls_are_taken() {
    let now = Instant::now();
    let pieces = request_sends(60, 3);
    let with = |between: &[u8]| {
        let mut b = Session::new(cfg());
        b.handle_message(&pieces[0], now).expect("first piece");
        b.handle_message(between, now)?;
        b.handle_message(&pieces[1], now)?;
        b.handle_message(&pieces[2], now)?;
        Ok::<_, ProtoError>(std::iter::from_fn(|| b.poll_event()).count())
    };
    // A whole request of another call: both requests come out.
    let mut other = request_sends(8, 4).remove(0);
    other[4..8].copy_from_slice(&9u32.to_le_bytes());
    assert_eq!(with(&other), Ok(2));
    // One of the call being joined, or a cancel, a shutdown: out of place.
    let same = request_sends(8, 4).remove(0);
    assert!(matches!(with(&same), Err(ProtoError::BadFragment(_))));
    for kind in [Kind::Cancel, Kind::GoAway, Kind::Close] {
        let mut m = Vec::new();
        Header::control(kind).encode(&mut m);
        m[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(matches!(with(&m), Err(ProtoError::BadFragment(_))), "{kind:?}");
    }
}

#[test]
fn a_client_holds_eager_calls_beyond_the_servers_byte_limit_back() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_serving(usize::MAX, 100);
    a.s.limit_call_bytes(100);
    let ids = [
        a.call(60, None, None, now),
        a.call(30, None, None, now),
        a.call(40, None, None, now),
        a.call(5, None, None, now),
    ];
    exchange(&mut a, &mut b, now);
    // 60 + 30 fit; 40 waits, unsent, and the call behind it too (calls go in order).
    assert_eq!(b.requests.len(), 2);
    assert_eq!(a.s.held_back_calls(), 2);
    serve(&mut b, |n| n);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 2, "sent once the others were answered");
    assert_eq!(a.s.held_back_calls(), 0);
    // One call above the limit goes when it is alone.
    a.s.limit_call_bytes(50);
    let big = a.call(60, None, None, now);
    settle(&mut a, &mut b, now, |n| n);
    for (id, len) in [(ids[0], 60), (ids[1], 30), (ids[2], 40), (ids[3], 5), (big, 60)] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(len, len));
    }
    assert_eq!((a.s.pending_calls(), a.s.held_back_calls()), (0, 0));
}

proptest! {
    /// Eager calls only (1 to 64 bytes, longer than 24 in pieces), made, sent, delivered and
    /// answered in random order, with short messages between the pieces or not: a client that
    /// keeps the server's byte limit never has more eager request bytes waiting at the server
    /// than the limit (one request alone excepted), and every call gets its own answer once.
    #[test]
    fn eager_request_bytes_at_the_server_stay_within_the_limit(ops in proptest::collection::vec((0u8..5, 1usize..=64), 1..150), limit in 1u64..200, interleave in any::<bool>()) {
        let now = Instant::now();
        let (mut a, mut b) = (Side::new(1000), Side::new(2000));
        b.s.limit_serving(usize::MAX, limit);
        a.s.limit_call_bytes(limit);
        a.s.interleave(interleave);
        b.s.interleave(interleave);
        let mut started = HashMap::new();
        for (op, len) in ops {
            match op {
                0 | 1 => { started.insert(a.call(len, None, None, now), len); }
                2 => { pump(&mut a, &mut b); pump(&mut b, &mut a); }
                3 => {
                    deliver(&mut b, now).expect("server");
                    b.drain_events();
                    deliver(&mut a, now).expect("client");
                    a.drain_events();
                }
                _ => serve(&mut b, |n| n),
            }
            let waiting: Vec<usize> = b.requests.iter().map(|(_, r, _)| r.len()).collect();
            prop_assert!(waiting.iter().sum::<usize>() as u64 <= limit || waiting.len() == 1,
                "eager request bytes waiting at the server: {:?}, limit {}", waiting, limit);
        }
        settle(&mut a, &mut b, now, |n| n);
        prop_assert_eq!(a.done.len(), started.len());
        for (id, len) in started {
            let r = a.done.remove(&id).expect("answered").expect("ok");
            prop_assert_eq!(reply_bytes(&a, &r), expected_response(len, len));
        }
        prop_assert_eq!((a.s.pending_calls(), a.s.held_back_calls(), a.rnr, b.rnr), (0, 0, 0, 0));
    }
}

/// Moves messages both ways and delivers them, without running any RDMA operation.
fn talk(a: &mut Side, b: &mut Side, now: Instant) {
    for _ in 0..64 {
        pump(a, b);
        pump(b, a);
        deliver(b, now).expect("server accepts");
        deliver(a, now).expect("client accepts");
        a.drain_events();
        b.drain_events();
    }
}

#[test]
fn reads_beyond_the_read_limit_wait_and_a_cancel_answers_them_at_once() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_reading(600);
    let ids: Vec<u32> = (0..5).map(|_| a.call(300, None, None, now)).collect();
    talk(&mut a, &mut b, now);
    assert_eq!(b.rdma.len(), 2, "two 300-byte Reads fit 600 bytes, three do not");
    assert_eq!(b.s.reading_request_bytes(), 600);
    assert_eq!(b.s.unanswered(), 5, "the three waiting count as requests");
    // A cancel answers a request that waits at once: its buffer comes back unread.
    a.s.cancel(ids[4]);
    talk(&mut a, &mut b, now);
    assert_eq!(a.lent.len(), 4, "the waiting request's buffer came back");
    assert_eq!(b.s.unanswered(), 4);
    // One being read is answered only once the Read is done: its memory is still read.
    a.s.cancel(ids[0]);
    talk(&mut a, &mut b, now);
    assert_eq!(a.lent.len(), 4, "a request being read keeps its buffer lent");
    run_rdma(&mut b, &mut a, now);
    talk(&mut a, &mut b, now);
    assert_eq!(b.rdma.len(), 2, "the finished Read let the next one go, no more");
    assert_eq!(b.s.reading_request_bytes(), 600);
    settle(&mut a, &mut b, now, |n| n);
    for &id in &ids[1..4] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(300, 300));
    }
    assert!(a.done.is_empty(), "the cancelled calls report nothing");
    assert!(!b.ran.contains(&ids[0]) && !b.ran.contains(&ids[4]));
    assert!(a.lent.is_empty());
    assert_eq!((b.s.unanswered(), b.s.reading_request_bytes()), (0, 0));
}

#[test]
fn one_read_alone_goes_whatever_the_read_limit() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.limit_reading(1);
    let ids = [a.call(900, None, None, now), a.call(300, None, None, now)];
    talk(&mut a, &mut b, now);
    assert_eq!(b.rdma.len(), 1, "the first alone, the second after it");
    settle(&mut a, &mut b, now, |n| n);
    for (id, len) in [(ids[0], 900), (ids[1], 300)] {
        let r = a.done.remove(&id).expect("answered").expect("ok");
        assert_eq!(reply_bytes(&a, &r), expected_response(len, len));
    }
}

/// A request from a peer that writes its messages by hand: call `call`, method 1, one byte.
fn raw_request(call: u32) -> Vec<u8> {
    let mut m = Vec::new();
    Header {
        kind: Kind::Request,
        flags: 0,
        call_id: call,
        method: 1,
        status: 0,
        credits: 0,
        body_len: 1,
        budget_us: 0,
    }
    .encode(&mut m);
    m.push(7);
    m
}

#[test]
fn a_peer_that_sends_beyond_its_credits_is_cut_off() {
    let now = Instant::now();
    let mut s = Session::new(cfg());
    for call in 1..=RING {
        s.handle_message(&raw_request(call), now).expect("within the ring");
        s.reposted();
    }
    // Nothing went back to the peer, so no credit did: one more is a breach.
    assert_eq!(s.handle_message(&raw_request(100), now), Err(ProtoError::NoCredit));
    // Credits returned with a message of ours may be spent again.
    let mut s = Session::new(cfg());
    for call in 1..=RING {
        s.handle_message(&raw_request(call), now).expect("within the ring");
        s.reposted();
    }
    s.respond(1, Ok(Payload::Eager(vec![1])));
    let answer = sent(&mut s);
    assert_eq!(Header::decode(&answer).expect("a header").0.credits, RING as u16);
    for call in 100..100 + RING {
        s.handle_message(&raw_request(call), now)
            .expect("within the credits returned");
        s.reposted();
    }
    assert_eq!(s.handle_message(&raw_request(200), now), Err(ProtoError::NoCredit));
}

/// A peer that returns no credits: the server's answers pile up unsent once its own credits
/// run out. They count against the request limit until they leave, so the server never runs
/// more than the limit's worth of handlers beyond the answers that went out, and the peer's
/// own credits bound what it can make the server queue.
#[test]
fn answers_count_until_they_leave_so_a_peer_taking_none_holds_the_server_to_its_limit() {
    let now = Instant::now();
    let limit = 2;
    let mut s = Session::new(cfg());
    s.limit_serving(limit, u64::MAX);
    let (mut ran, mut went, mut refused) = (0usize, 0usize, 0usize);
    let mut call = 0;
    let cut_off = loop {
        call += 1;
        assert!(call < 1000, "the peer was never cut off");
        match s.handle_message(&raw_request(call), now) {
            Ok(()) => s.reposted(),
            Err(e) => break e,
        }
        while let Some(ev) = s.poll_event() {
            if let Event::Request { call, .. } = ev {
                ran += 1;
                s.respond(call, Ok(Payload::Eager(vec![0; 16])));
            }
        }
        while let Some(t) = s.poll_transmit() {
            if let Transmit::Send(m) = t {
                let (h, _) = Header::decode(&m.to_vec()).expect("a header");
                if h.status == rdma_rpc_proto::Status::Overloaded as u16 {
                    refused += 1;
                } else {
                    went += 1;
                }
            }
        }
        assert!(
            ran <= went + limit,
            "{ran} handlers ran with {went} answers sent: more than the limit of {limit} unsent"
        );
        assert!(s.unanswered() <= limit);
    };
    assert_eq!(cut_off, ProtoError::NoCredit);
    // Every request that arrived and did not run was refused (sent or queued), never kept.
    let arrived = call as usize - 1;
    assert!(
        ran > limit && arrived > ran,
        "{arrived} requests, {ran} ran, {refused} refusals sent"
    );
    assert!(
        call <= 3 * RING,
        "the peer sent {call} messages on {RING} credits and what came back"
    );
}

/// A lent answer counts until its caller's ReadDone, and one that never comes ends the
/// connection once the lent answer's time is up, releasing the buffer: nobody can make a
/// server hold an answer for ever.
#[test]
fn a_lent_answer_nobody_reads_ends_the_connection_after_its_time() {
    let t0 = Instant::now();
    let limit = Duration::from_secs(10);
    let mut s = Session::new(cfg());
    s.limit_serving(1, u64::MAX);
    s.limit_lent(limit);
    s.handle_message(&raw_request(1), t0).expect("a request");
    s.reposted();
    while s.poll_event().is_some() {}
    let desc = RemoteRegion {
        addr: 0x1000,
        len: 4096,
        rkey: 9,
    };
    s.respond(1, Ok(Payload::Lent { desc, buf: 77 }));
    let answer = sent(&mut s);
    assert_ne!(Header::decode(&answer).expect("a header").0.flags & FLAG_RENDEZVOUS, 0);
    // Unread, it still counts: a second request is refused.
    s.handle_message(&raw_request(2), t0).expect("a request");
    s.reposted();
    let refusal = sent(&mut s);
    assert_eq!(
        Header::decode(&refusal).expect("a header").0.status,
        rdma_rpc_proto::Status::Overloaded as u16
    );
    // The session wants the clock once, to note when the answer was lent.
    assert!(s.poll_timeout().is_some_and(|d| d <= Instant::now()));
    s.handle_timeout(t0);
    assert_eq!(s.poll_timeout(), Some(t0 + limit));
    s.handle_timeout(t0 + limit - Duration::from_millis(1));
    assert!(!s.is_lost());
    s.handle_timeout(t0 + limit);
    assert!(
        s.lost_reason()
            .is_some_and(|w| w.kind() == LostKind::Timeout && w.reason().contains("lent_answer_timeout")),
        "{:?}",
        s.lost_reason()
    );
    let mut released = false;
    while let Some(t) = s.poll_transmit() {
        released |= matches!(t, Transmit::Release(77));
    }
    assert!(released, "the lent buffer goes back");

    // Read in time, it is done with and nothing is lost.
    let mut s = Session::new(cfg());
    s.limit_lent(limit);
    s.handle_message(&raw_request(1), t0).expect("a request");
    s.reposted();
    while s.poll_event().is_some() {}
    s.respond(1, Ok(Payload::Lent { desc, buf: 78 }));
    let _ = sent(&mut s);
    s.handle_timeout(t0);
    let mut done = Vec::new();
    Header {
        kind: Kind::ReadDone,
        flags: 0,
        call_id: 1,
        method: 0,
        status: 0,
        credits: 0,
        body_len: 0,
        budget_us: 0,
    }
    .encode(&mut done);
    s.handle_message(&done, t0).expect("ReadDone");
    s.handle_timeout(t0 + 2 * limit);
    assert!(!s.is_lost());
    assert_eq!(s.unanswered(), 0);
}

/// The client's side of a server that gives nothing back: first no credits at all, then
/// credits but no answer, no read of a lent body (so no ReadDone) and no answer to a cancel.
/// The client sends no more messages than its credits allow, every call ends by its deadline,
/// and a call that did counts until the server answers its cancel (the server may still run
/// it), so the client stops at its call limit: new calls wait unsent and end by their
/// deadline, and what it lends (request bodies the server may still be reading) stays within
/// that limit.
#[test]
fn a_server_that_gives_nothing_back_holds_the_client_to_its_credits_and_its_call_limit() {
    let limit = 4;
    for credits_back in [false, true] {
        let t0 = Instant::now();
        let (mut a, mut b) = (Side::new(1000), Side::new(2000));
        a.s.limit_calls(limit);
        let mut now = t0;
        let mut sent = 0;
        for i in 0..200usize {
            // Every other call's body is lent (rendezvous above eager_max), the rest go eager.
            let len = if i % 2 == 0 { 500 } else { 10 };
            a.call(len, None, Some(Duration::from_millis(1)), now);
            pump(&mut a, &mut b);
            let taken = std::mem::take(&mut b.inbox).len();
            sent += taken;
            if credits_back && taken > 0 {
                // A raw server: it takes the messages and returns their credits in a Credit
                // message, and nothing else.
                let mut m = Vec::new();
                Header::credit(taken as u16).encode(&mut m);
                a.inbox.push_back(Wire::Send(m));
                deliver(&mut a, now).expect("a credit");
            }
            now += Duration::from_millis(2);
            a.s.handle_timeout(now);
            a.drain_events();
            assert!(a.s.pending_calls() <= limit);
            assert!(
                a.lent.len() <= limit,
                "{} bodies lent with a limit of {limit} calls (credits back: {credits_back})",
                a.lent.len()
            );
        }
        let most = if credits_back { 2 * limit } else { RING as usize };
        assert!(
            sent <= most,
            "{sent} messages sent (credits back: {credits_back}): calls and their cancels only"
        );
        assert_eq!(a.done.len(), 200, "every call ended");
        assert!(
            a.done
                .values()
                .all(|r| matches!(r, Err(CallError::DeadlineExceeded | CallError::Expired))),
            "every call ended by its deadline"
        );
    }
}

#[test]
fn a_budget_under_a_microsecond_expires_before_anything_is_sent() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    for budget in [Duration::ZERO, Duration::from_nanos(1), Duration::from_nanos(999)] {
        assert_eq!(
            a.try_call(300, Some(600), Some(budget), now),
            Err(CallError::Expired),
            "{budget:?}"
        );
    }
    assert!(a.s.poll_transmit().is_none(), "nothing of them goes out");
    assert!(a.lent.is_empty() && a.sending.is_empty(), "their buffers came back");
    // A microsecond is carried, and the call goes.
    let id = a.call(10, None, Some(Duration::from_micros(1)), now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 1, "the request with a microsecond left went");
    assert_eq!(a.s.pending_calls(), 1, "call {id} is on its way");
}

#[test]
fn a_call_held_back_past_its_deadline_expires_unsent_and_one_sent_may_have_run() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    a.s.limit_calls(1);
    let secs = Duration::from_secs;
    let sent = a.call(10, None, Some(secs(5)), now);
    let waiting = a.call(10, None, Some(secs(5)), now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 1, "one request at the server, one held back");
    a.s.handle_timeout(now + secs(6));
    a.drain_events();
    assert_eq!(a.done.remove(&waiting), Some(Err(CallError::Expired)), "never left");
    assert_eq!(
        a.done.remove(&sent),
        Some(Err(CallError::DeadlineExceeded)),
        "left: may have run"
    );
    assert_eq!(a.s.held_back_calls(), 0);
}

/// `a` (limited to one call at a time) sends `first`, then waits for it: the server answers,
/// and `a` hears it `later`.
fn answer_first_at(a: &mut Side, b: &mut Side, later: Instant) {
    serve(b, |n| n);
    while let Some(Transmit::Send(m)) = b.s.poll_transmit() {
        a.s.handle_message(&m.to_vec(), later).expect("the response");
    }
    a.drain_events();
}

#[test]
fn a_call_that_waited_for_the_servers_limit_carries_the_budget_it_has_left() {
    let now = Instant::now();
    let secs = Duration::from_secs;
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    a.s.limit_calls(1);
    let first = a.call(10, None, None, now);
    let waiting = a.call(10, None, Some(secs(5)), now);
    exchange(&mut a, &mut b, now);
    assert_eq!(b.requests.len(), 1, "the other waits for the server's limit");
    // The first is answered three seconds on: the next one goes, with two seconds left.
    answer_first_at(&mut a, &mut b, now + secs(3));
    assert!(a.done.remove(&first).expect("answered").is_ok());
    assert!(
        a.s.budgets_stale(),
        "the call let go carries the budget it started with"
    );
    a.s.refresh_budgets(now + secs(3));
    assert!(!a.s.budgets_stale());
    let Some(Transmit::Send(m)) = a.s.poll_transmit() else {
        panic!("the waiting call's request goes out");
    };
    let (h, _) = Header::decode(&m.to_vec()).expect("a request");
    assert_eq!(
        (h.call_id, h.budget_us),
        (waiting, 2_000_000),
        "what the deadline leaves"
    );

    // One let go after its deadline passed (no timer fired meanwhile) expires, unsent.
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    a.s.limit_calls(1);
    let first = a.call(10, None, None, now);
    let doomed = a.call(10, None, Some(secs(2)), now);
    exchange(&mut a, &mut b, now);
    answer_first_at(&mut a, &mut b, now + secs(3));
    assert!(a.done.remove(&first).expect("answered").is_ok());
    a.s.refresh_budgets(now + secs(3));
    a.drain_events();
    assert_eq!(a.done.remove(&doomed), Some(Err(CallError::Expired)), "it never left");
    assert!(a.s.poll_transmit().is_none(), "nothing of it goes out");
    assert_eq!(a.s.pending_calls(), 0);
}

/// A server on a receive pool: the client's window starts at the pool's floor of 2, grows by
/// the credits the pool grants when the client sends as fast as its window lets it, and shrinks
/// back to 2 as the server keeps the slots its messages used. The model's slots for this
/// connection are its window: a Send beyond them would be an RNR on the shared queue.
#[test]
fn a_pooled_window_starts_at_two_grows_by_grants_and_shrinks_by_withheld_slots() {
    let now = Instant::now();
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    a.s.start_grants(RING, 2);
    b.s.start_grants(2, RING);
    b.posted = 2;
    for _ in 0..40 {
        a.call(8, None, None, now);
    }
    pump(&mut a, &mut b);
    assert_eq!(b.inbox.len(), 1, "a window of 2: one message, one credit held back");
    let mut widest = 0;
    // Grow while the pool has spare credits, then give them all back.
    for (grow, calls) in [(true, 0), (false, 40)] {
        for _ in 0..calls {
            a.call(8, None, None, now);
        }
        for _ in 0..1000 {
            pump(&mut a, &mut b);
            widest = widest.max(b.inbox.len() as u32);
            while let Some(Wire::Send(m)) = b.inbox.pop_front() {
                assert!(b.posted > 0, "a Send beyond the window: RNR on the pool's queue");
                b.posted -= 1;
                b.s.handle_message_in(&m, None, now).expect("server accepts");
                if !grow && b.s.withhold_credit() {
                    // The slot goes back to the pool, not to this peer.
                } else {
                    b.posted += 1;
                    b.s.reposted();
                }
                if grow && b.s.credits().peer_at_window() {
                    b.posted += b.s.grant_credits(2);
                }
            }
            b.drain_events();
            serve(&mut b, |_| 8);
            pump(&mut b, &mut a);
            while !a.inbox.is_empty() {
                deliver(&mut a, now).expect("client accepts");
            }
            a.drain_events();
            if a.s.pending_calls() == 0 {
                break;
            }
        }
        assert_eq!(a.s.pending_calls(), 0, "every call answered");
        if grow {
            assert_eq!(b.s.credits().window(), RING, "grants took the window to the ring");
        }
    }
    assert_eq!(a.done.len(), 80);
    assert!(a.done.values().all(Result::is_ok));
    assert!(widest > 2, "the grants let more than one message go at once ({widest})");
    assert_eq!(b.s.credits().window(), 2, "withheld slots took the window back to 2");
    assert_eq!(b.s.grant_credits(100), RING - 2, "never granted past the ring");
    assert_eq!((a.rnr, b.rnr), (0, 0));
}

/// A server that lends nothing answers above the threshold in pieces, up to the largest
/// payload; its client joins them only because the server said so in its hello.
#[test]
fn a_server_that_lends_nothing_answers_large_in_pieces_its_client_alone_takes() {
    let now = Instant::now();
    for told in [true, false] {
        let (mut a, mut b) = (Side::new(1000), Side::new(2000));
        b.s.lend_nothing(true);
        a.s.peer_lends_nothing(told);
        let call = a.call(8, None, None, now);
        pump(&mut a, &mut b);
        deliver(&mut b, now).expect("server accepts");
        b.drain_events();
        b.requests.clear();
        let body = pattern(1000, 7);
        b.s.respond(call, Ok(Payload::Eager(body.clone())));
        let mut refused = None;
        for _ in 0..1000 {
            pump(&mut b, &mut a);
            match deliver(&mut a, now) {
                Ok(()) => {}
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
            a.drain_events();
            pump(&mut a, &mut b);
            while !b.inbox.is_empty() {
                deliver(&mut b, now).expect("server accepts");
            }
            if a.done.contains_key(&call) {
                break;
            }
        }
        if told {
            let reply = a.done[&call].as_ref().expect("the answer");
            assert_eq!(reply_bytes(&a, reply), body, "joined from {} pieces", 1000 / 24 + 1);
        } else {
            assert!(
                matches!(refused, Some(ProtoError::BadFragment(_))),
                "a client not told takes no answer beyond the threshold: {refused:?}"
            );
        }
    }
    // Nor beyond the largest payload, and nothing lent without a landing buffer.
    let (mut a, mut b) = (Side::new(1000), Side::new(2000));
    b.s.lend_nothing(true);
    let (big, lent) = (a.call(8, None, None, now), a.call(8, None, None, now));
    pump(&mut a, &mut b);
    for _ in 0..2 {
        deliver(&mut b, now).expect("server accepts");
    }
    b.drain_events();
    b.requests.clear();
    b.s.respond(big, Ok(Payload::Eager(vec![0; (1 << 20) + 1])));
    let (desc, buf) = b.stage(vec![1; 100]);
    b.s.respond(lent, Ok(Payload::Lent { desc, buf }));
    settle(&mut a, &mut b, now, |_| 8);
    for call in [big, lent] {
        assert!(
            matches!(&a.done[&call], Err(CallError::Remote { .. })),
            "{:?}",
            a.done[&call]
        );
    }
    assert!(b.lent.is_empty(), "the buffer refused was released");
}
