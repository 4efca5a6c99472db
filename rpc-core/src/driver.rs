//! The connection driver: a tokio task that runs a [`Session`] over a transport queue pair.
//!
//! It owns the QP, its CQ and every buffer of the connection (the receive ring, the send
//! buffers, the rendezvous stash), turns the session's transmits into work requests and
//! completions into session inputs, and waits by the configured completion mode.
//!
//! This file holds the connection and its completions; `post` turns transmits into work
//! requests, `rdma` runs Reads and Writes in pieces, `slots` keeps the receive ring, `task` is
//! the connection's task and `wait` the completion mode's wait policy.

use std::collections::VecDeque;
use std::sync::Arc;

use foldhash::HashMap;
use std::time::Instant;

use rdma_rpc_transport::{
    BufferPool, Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair, RecvWr, SendOp, SendWr,
    WcOpcode, WcStatus,
};

use crate::buf::{RegisteredBuf, SlotsBack};
use crate::colocate::Link;
use crate::config::CompletionMode;
use crate::proto::{
    BufId, CallError, Event, LocalError, Lost, LostKind, Session, Token, Transmit, HEADER_LEN, LANDING_PREFIX,
};
use crate::stash::Stash;
use crate::{RpcError, TransportError};

mod group;
mod keepalive;
mod pool;
mod post;
mod rdma;
mod slots;
mod task;
mod wait;

pub(crate) use group::{Groups, Member};
pub(crate) use pool::{ReceivePool, FLOOR as POOL_FLOOR};

use keepalive::Keepalive;
use rdma::{rdma_room, Job};
pub(crate) use task::run;
pub(crate) use wait::{reschedule, Backoff, Budget, SpinToken};

const KIND_SHIFT: u32 = 60;
const RECV: u64 = 1 << KIND_SHIFT;
const SEND: u64 = 2 << KIND_SHIFT;
const READ: u64 = 3 << KIND_SHIFT;
const WRITE: u64 = 4 << KIND_SHIFT;
/// A Send straight from a stash buffer ([`Transmit::SendPlaced`]); the id is the buffer's.
const PLACED: u64 = 5 << KIND_SHIFT;
/// A keepalive's zero-length Write ([`keepalive`]).
const PROBE: u64 = 6 << KIND_SHIFT;
const ID_MASK: u64 = (1 << KIND_SHIFT) - 1;

/// Messages (header included) shorter than this are copied out of their receive slot even for
/// an application that takes bodies in place ([`Body`](crate::Body)): below it the copy costs
/// less than lending the slot and taking it back.
pub const IN_SLOT_MIN: usize = 512;

/// One Send in this many is signaled; the send pool holds more buffers than that.
const SIGNAL_EVERY: u32 = 8;

/// Bytes of Sends one [`Conn::send_pending`] posts at most before it returns (the message that
/// crosses the line goes whole): a long message's pieces then leave one at a time between
/// the connection's polls, and a short call made or answered meanwhile goes after the next
/// piece, not after all the pieces the credits allow (64 slots of 32 KiB, each a copy on
/// `shm`; the benchmark's `rpc-behind` mode measures it). Whoever drives the connection posts the rest
/// before it sleeps ([`Conn::more_to_post`]).
const FLUSH_BYTES: usize = crate::proto::FRAGMENT;

/// Why the connection is lost when a work request of its QP failed with `status`. The first
/// failure the driver sees ends the connection, so a flush seen first means nothing of this
/// side's failed before it: the QP was moved to the error state from outside, by its peer.
fn failed(status: WcStatus, provider: &str) -> Lost {
    if status == WcStatus::WrFlushErr {
        return Lost::new(
            LostKind::Closed,
            format!(
                "the peer closed the connection or went away (its process ended, or the link \
                 dropped), and the work requests in flight were flushed ({status}): connect again"
            ),
        );
    }
    let hint = status.hint_on(provider).map(|h| format!(" ({h})")).unwrap_or_default();
    if status == WcStatus::RetryExcErr {
        return Lost::new(LostKind::Transport, format!("the peer is unreachable: {status}{hint}"));
    }
    Lost::new(LostKind::Transport, format!("work request failed: {status}{hint}"))
}

/// A loss of this side's own making, in `why`'s words.
pub(crate) fn local_loss(why: impl Into<String>) -> Lost {
    Lost::new(LostKind::Local, why)
}

/// The role-specific half of a driver: the client's call table or the server's handlers.
pub(crate) trait Role {
    /// Takes commands that arrived without waiting; returns whether there were any.
    fn drain_inputs(&mut self, conn: &mut Conn) -> bool;
    /// Handles one session event.
    fn on_event(&mut self, conn: &mut Conn, ev: Event);
    /// Waits for the next command; `false` when no more can come and the role is done.
    fn wait_input(&mut self) -> impl std::future::Future<Output = Option<RoleInput>> + Send;
    /// Handles a command returned by `wait_input`.
    fn on_input(&mut self, conn: &mut Conn, input: RoleInput);
    /// True when the driver may stop (client: all handles dropped and nothing pending).
    fn finished(&self, conn: &Conn) -> bool;
    /// The connection is lost; fail what the session does not know about.
    fn on_lost(&mut self, why: &Lost);
}

/// A command for a role, type-erased so the wait loop stays generic.
pub(crate) type RoleInput = Box<dyn std::any::Any + Send>;

/// The connection's resources and session.
pub(crate) struct Conn {
    pub(crate) session: Session,
    pub(crate) stash: Stash,
    qp: QueuePair,
    cq: CompletionQueue,
    send_pool: BufferPool,
    max_inline: usize,
    /// The provider needs CPU of its own (`DeviceCaps::progress_threads`): pollers give way.
    pub(crate) yield_cpu: bool,
    reads: HashMap<u64, Job>,
    writes: HashMap<BufId, Job>,
    next_read: u64,
    /// Largest single RDMA message on this device: longer transfers go in pieces.
    chunk: usize,
    /// Pieces of Reads and Writes posted and not completed, and how many the send queue
    /// takes beside its Sends ([`rdma_room`]).
    rdma_posted: usize,
    rdma_room: usize,
    /// Pieces of a started Read or Write not posted yet: one transfer of more pieces than
    /// the room goes in turns.
    rdma_waiting: VecDeque<SendWr>,
    backlog: VecDeque<Transmit>,
    scratch: Vec<Completion>,
    /// Sends posted without a completion since the last signaled one.
    unsignaled: u32,
    /// Receive slots consumed and not posted again yet.
    unposted: Vec<RecvWr>,
    /// Receive slots whose message stays in place for the application, by work request id:
    /// here until handed out ([`Conn::slot_body`]), then back through `slots_back`.
    held: Vec<(u64, MemoryRegion)>,
    /// Slots handed out and held by the application, at most `max_held`.
    out: usize,
    max_held: usize,
    slots_back: Arc<SlotsBack>,
    back: Vec<(u64, MemoryRegion)>,
    lost: Option<Lost>,
    /// The last `send_pending` stopped at [`FLUSH_BYTES`], maybe with more to post.
    cut_short: bool,
    /// Passed as `now` with messages whose handling does not read it ([`Session::needs_now`]).
    epoch: Instant,
    /// The peer's side when it is in this process: whether this thread drives it.
    pub(crate) link: Link,
    /// A Send waited for a buffer of the server's shared send pool: look again soon, as no
    /// completion of this connection's may come to say one is free.
    starved: bool,
    /// Completions seen, of every kind: what the keepalive looks at.
    completions: u64,
    /// Probes a quiet peer now and then (`Config::keepalive`); `None` never does.
    keepalive: Option<Keepalive>,
    /// A pooled server's connection takes its completions from its group's shared CQ
    /// (`group.rs`), not from `cq` alone. After the QP, so that the QP is destroyed (and its
    /// completions no longer handed out) before the connection leaves its group.
    member: Option<Member>,
    /// The server's receive pool this connection's receives come from. Last, so that it is
    /// dropped after the QP, the CQ and every slot the connection held ([`Lease`]).
    lease: Option<Lease>,
}

/// A connection's share of a [`ReceivePool`]: when the connection is gone (its QP, its CQ
/// and the slots in them dropped, so back in their pools), the pool posts those slots again,
/// and then takes back the credits the connection held beyond its floor.
struct Lease {
    pool: Arc<ReceivePool>,
    /// The connection's last window, set as it is dropped.
    window: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Err(e) = self.pool.refill() {
            tracing::warn!(%e, "posting the receive pool's slots again");
        }
        self.pool.give_spare(self.window.saturating_sub(pool::FLOOR));
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let window = self.session.credits().window();
        if let Some(lease) = &mut self.lease {
            lease.window = window;
        }
    }
}

impl Conn {
    /// The receive ring: `ring` buffers for the first posting.
    ///
    /// Each slot is a registration of its own, not a piece of one pool: a slot handed to the
    /// application ([`Conn::slot_body`]) may have its bytes borrowed for as long as it likes, and
    /// that borrow must not lock the memory of the slots the connection goes on receiving into
    /// (with one registration it did, and a caller reading a response in place while making
    /// its next call deadlocked).
    pub(crate) fn ring(pd: &ProtectionDomain, ring: u32, slot: usize) -> Result<Vec<RecvWr>, RpcError> {
        (0..ring)
            .map(|i| {
                pd.register(slot, rdma_rpc_transport::AccessFlags::LOCAL_WRITE)
                    .map(|mr| RecvWr::new(RECV | u64::from(i), mr))
                    .map_err(|e| {
                        RpcError::Transport(TransportError::with(
                            format!("registering a {slot}-byte receive slot"),
                            e,
                        ))
                    })
            })
            .collect()
    }

    /// A connection over `qp` as this side's `config` asks: its receive ring holds
    /// `config.ring` slots of `slot` bytes, its free rendezvous buffers stay registered up to
    /// `config.max_cached_buffer_bytes`.
    pub(crate) fn configured(
        session: Session,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        slot: usize,
        config: &crate::Config,
    ) -> Result<Self, RpcError> {
        let mut conn = Self::new(
            session,
            pd,
            qp,
            cq,
            (slot, config.ring),
            (config.isolation, config.cached_buffer_bytes()),
        )?;
        conn.keepalive = config.keepalive.map(Keepalive::new);
        Ok(conn)
    }

    /// A connection over `qp`, whose receive ring holds `own_ring` slots of `slot` bytes and
    /// whose free rendezvous buffers stay registered up to `cached` bytes.
    pub(crate) fn new(
        session: Session,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        (slot, own_ring): (usize, u32),
        (isolation, cached): (crate::Isolation, usize),
    ) -> Result<Self, RpcError> {
        let ring = session.config().ring as usize;
        let send_pool =
            BufferPool::new(pd, slot, ring + 8, rdma_rpc_transport::AccessFlags::LOCAL_WRITE).map_err(|e| {
                RpcError::Transport(TransportError::with(
                    format!("registering {} send buffers of {slot} bytes", ring + 8),
                    e,
                ))
            })?;
        Ok(Self::build(
            session,
            pd,
            qp,
            cq,
            send_pool,
            own_ring,
            (isolation, cached),
        ))
    }

    /// A connection over `qp` that sends from `send_pool`.
    fn build(
        session: Session,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        send_pool: BufferPool,
        own_ring: u32,
        (isolation, cached): (crate::Isolation, usize),
    ) -> Self {
        let ring = session.config().ring as usize;
        let max_inline = qp.caps().max_inline_data as usize;
        let yield_cpu = qp.pd().device().caps().progress_threads;
        let chunk = qp.pd().device().caps().max_msg_size.clamp(4096, 1 << 30) as usize;
        let room = rdma_room(qp.caps().max_send_wr, ring);
        Self {
            session,
            stash: Stash::new(pd, isolation, cached),
            qp,
            cq,
            send_pool,
            max_inline,
            yield_cpu,
            reads: HashMap::default(),
            writes: HashMap::default(),
            next_read: 0,
            chunk,
            rdma_posted: 0,
            rdma_room: room,
            rdma_waiting: VecDeque::new(),
            backlog: VecDeque::new(),
            scratch: Vec::with_capacity(64),
            unsignaled: 0,
            unposted: Vec::with_capacity(64),
            held: Vec::new(),
            out: 0,
            // Half the ring at most stays with the application: the other half keeps the
            // peer's messages (and credits) flowing whatever the application holds.
            max_held: own_ring as usize / 2,
            slots_back: Arc::default(),
            back: Vec::new(),
            lost: None,
            cut_short: false,
            epoch: Instant::now(),
            link: Link::default(),
            starved: false,
            completions: 0,
            keepalive: None,
            member: None,
            lease: None,
        }
    }

    /// A server's connection over `qp`, whose receives come from `pool` (its shared receive
    /// queue, which `qp` takes them from) and whose Sends go from the pool's buffers. It holds
    /// no slot for the application (bodies are copied out) and lends nothing: the pool's
    /// domain is every connection's. Its completions come through the CQ its `seat`'s group
    /// shares, which `qp` is on.
    pub(crate) fn pooled(
        session: Session,
        qp: QueuePair,
        seat: group::Seat,
        pool: &Arc<ReceivePool>,
        config: &crate::Config,
    ) -> Result<Self, RpcError> {
        let cq = seat.cq().clone();
        let mut conn = Self::build(
            session,
            &pool.pd,
            qp,
            cq,
            pool.send.clone(),
            0,
            (config.isolation, config.cached_buffer_bytes()),
        );
        conn.stash.private_only();
        conn.keepalive = config.keepalive.map(Keepalive::new);
        conn.join(seat);
        conn.lease = Some(Lease {
            pool: pool.clone(),
            window: pool::FLOOR,
        });
        Ok(conn)
    }

    /// The connection's completions come through a shared CQ's group from now on: `seat`'s,
    /// whose CQ its QP is on.
    pub(crate) fn join(&mut self, seat: group::Seat) {
        self.member = Some(seat.join(self.qp.qp_num()));
    }

    /// The inbox a connection of a group waits on ([`Member::inbox`]); `None` for one with a
    /// CQ of its own.
    pub(crate) fn inbox(&self) -> Option<Arc<group::Inbox>> {
        self.member.as_ref().map(Member::inbox)
    }

    /// Whether the connection's receives come from a server's pool ([`Conn::pooled`]).
    pub(crate) fn on_pool(&self) -> bool {
        self.lease.is_some()
    }

    /// Whether this connection may spin for completions now in `mode`: in
    /// [`CompletionMode::Adaptive`], while it holds (or can take) one of the process's few
    /// leaves to spin (`token`, [`SpinToken`]); [`CompletionMode::Spin`] spins as asked.
    pub(crate) fn may_spin(mode: CompletionMode, token: &mut Option<SpinToken>) -> bool {
        if !matches!(mode, CompletionMode::Adaptive { .. }) {
            return true;
        }
        if token.is_none() {
            *token = SpinToken::take();
        }
        token.is_some()
    }

    /// Ends a connection whose QP failed with nothing in flight to tell it: on a shared
    /// receive queue, a peer that went (closed, crashed, unplugged) flushes no receive of this
    /// QP's, as a ring of its own would, so a pooled connection looks after each wait.
    pub(crate) fn check_alive(&mut self) {
        if self.lease.is_some() && self.lost.is_none() && self.qp.is_error() {
            self.lose(Lost::new(
                LostKind::Closed,
                "the peer closed the connection or went away (its QP is in the error state)",
            ));
        }
    }

    /// Whether a Send waits for a buffer of a shared send pool ([`Conn::pooled`]): the wait
    /// should end soon to look again.
    pub(crate) fn starved(&self) -> bool {
        self.starved
    }

    /// A message of the peer's took a slot of the pool: when it used its whole window, grant
    /// it as much again (up to the ring) from the pool's spare credits.
    fn grow_window(&mut self) {
        let Some(lease) = &self.lease else { return };
        let credits = self.session.credits();
        if !credits.peer_at_window() {
            return;
        }
        let want = credits
            .window()
            .min(self.session.config().ring.saturating_sub(credits.window()));
        let got = lease.pool.take_spare(want);
        if got > 0 {
            let granted = self.session.grant_credits(got);
            lease.pool.give_spare(got - granted);
        }
    }

    /// Whether a shared payload ([`Bulk`](crate::Bulk)) of `len` bytes is lent rather than
    /// sent in messages: above the threshold, and past one message where lending beats pieces
    /// ([`Stash::lends_past_a_piece`]).
    pub(crate) fn lends_bulk(&self, len: usize) -> bool {
        self.session.is_rendezvous(len) || (!self.session.fits_placed(len) && self.stash.lends_past_a_piece())
    }

    pub(crate) fn lose(&mut self, why: Lost) {
        if self.lost.is_none() {
            tracing::debug!(%why, kind = ?why.kind(), "connection lost");
            self.session.handle_connection_lost(why.clone());
            self.lost = Some(why);
        }
    }

    /// Takes the bytes of a held buffer (the vector itself, for one read into a vector) and
    /// frees it.
    pub(crate) fn take_bytes(&mut self, buf: BufId, len: usize) -> Vec<u8> {
        let v = self.stash.take_vec(buf, len).unwrap_or_default();
        self.stash.release(buf);
        v
    }

    /// One round of progress without waiting: reaps completions, fires due deadlines and posts
    /// what the session wants sent. Returns whether anything happened.
    pub(crate) fn progress(&mut self) -> bool {
        let busy = self.take_inputs();
        busy | self.flush()
    }

    /// As [`Conn::progress`], without the flush: completions and timeouts only.
    pub(crate) fn take_inputs(&mut self) -> bool {
        let mut busy = self.poll_cq();
        if let Some(d) = self.session.poll_timeout() {
            let now = Instant::now();
            if d <= now {
                self.session.handle_timeout(now);
                // A lent answer nobody read ends the connection.
                if self.lost.is_none() {
                    if let Some(why) = self.session.lost_reason() {
                        self.lost = Some(why.clone());
                    }
                }
                busy = true;
            }
        }
        busy
    }

    /// True once this side's Close went out and every Send is complete
    /// ([`Session::go_away`]): nothing is left to deliver, and the connection may close.
    pub(crate) fn closed(&self) -> bool {
        self.session.is_closed()
            && self.backlog.is_empty()
            && self.rdma_waiting.is_empty()
            && self.qp.outstanding_sends() == 0
    }

    /// Why the connection was lost, once it is.
    pub(crate) fn lost(&self) -> Option<&Lost> {
        self.lost.as_ref()
    }

    /// The completion queue, to wait on outside the connection's lock.
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Whether the connection still has work a completion will advance: calls, transfers or
    /// transmits waiting for credits.
    pub(crate) fn has_work(&self) -> bool {
        self.session.pending_calls() > 0
            || self.session.serving() > 0
            || !self.backlog.is_empty()
            || !self.reads.is_empty()
            || !self.writes.is_empty()
    }

    /// After a loss: lets the flushed completions come back so their buffers return.
    pub(crate) fn drain_flushed(&mut self) {
        while self.poll_cq() {}
    }

    /// Whether the peer's poller runs on this thread's core (see
    /// `QueuePair::peer_shares_cpu`): then a spinning wait only delays it.
    pub(crate) fn peer_shares_cpu(&self) -> bool {
        self.qp.peer_shares_cpu()
    }

    /// Whether waiting in `mode` should not spin because the peer was last driven by this very
    /// thread (a client and its server on one current-thread runtime): it cannot answer
    /// while this side spins. Only [`CompletionMode::Adaptive`] gives way so;
    /// [`CompletionMode::Spin`] spins as asked.
    pub(crate) fn peer_on_this_thread(&self, mode: CompletionMode) -> bool {
        matches!(mode, CompletionMode::Adaptive { .. }) && self.link.peer_here()
    }

    /// Moves this thread off the peer's poller's CPU to another it may run on, when the two
    /// share one (`QueuePair::leave_peer_cpu`); true when it moved.
    pub(crate) fn leave_peer_cpu(&self) -> bool {
        self.qp.leave_peer_cpu()
    }

    /// A round of polls of a spinning connection: on a shared CQ, its group's waiter leaves
    /// the CQ to it until [`spin_end`](Self::spin_end).
    pub(crate) fn spin_round(&self) {
        if let Some(m) = &self.member {
            m.spin_round();
        }
    }

    /// The connection stops spinning: it sleeps, or nothing of it is in flight.
    pub(crate) fn spin_end(&self) {
        if let Some(m) = &self.member {
            m.spin_end();
        }
    }

    /// Reaps completions without blocking; returns whether there were any.
    pub(crate) fn poll_cq(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.scratch);
        let polled = match &self.member {
            Some(m) => m.poll(&mut done),
            None => self
                .cq
                .poll(&mut done, 64)
                .map_err(|e| format!("polling the CQ: {}", rdma_rpc_transport::Report(&e))),
        };
        let n = match polled {
            Ok(n) => n,
            Err(why) => {
                self.lose(local_loss(why));
                0
            }
        };
        // Spinning callers poll empty CQs nearly every time: nothing else to do then.
        if n > 0 {
            for c in done.drain(..) {
                self.on_completion(c);
            }
        }
        self.scratch = done;
        n > 0
    }

    fn on_completion(&mut self, mut c: Completion) {
        self.completions = self.completions.wrapping_add(1);
        if c.wr_id & !ID_MASK == PLACED {
            // The buffer is the stash's again, whatever the status (flushed after a loss too).
            if let Some(mr) = c.buf.take() {
                self.placed_back(c.wr_id & ID_MASK, mr);
            }
        }
        if matches!(c.wr_id & !ID_MASK, READ | WRITE | PROBE) {
            self.rdma_posted = self.rdma_posted.saturating_sub(1);
        }
        if c.wr_id == PROBE {
            self.keepalive_answered();
        }
        if !c.status.is_success() {
            let provider = self.qp.pd().device().provider();
            self.lose(failed(c.status, provider));
            return;
        }
        let id = c.wr_id & ID_MASK;
        match c.wr_id & !ID_MASK {
            RECV => {
                let Some(buf) = c.buf else { return };
                let r = match c.opcode {
                    WcOpcode::RecvRdmaWithImm => self
                        .session
                        .handle_write_imm(c.imm.unwrap_or(0), c.byte_len as usize)
                        .map(|()| false),
                    _ => {
                        let bytes = buf.bytes();
                        let len = (c.byte_len as usize).min(bytes.len());
                        if self.out + self.held.len() >= self.max_held {
                            // Slots given back count as free before this message is offered one.
                            self.collect_slots();
                        }
                        let offer =
                            (len >= IN_SLOT_MIN && self.out + self.held.len() < self.max_held).then_some(c.wr_id);
                        let msg = &bytes[..len];
                        // The header from the copy that came with the completion where there is
                        // one (shm): the slot's first line then stays unread for a message
                        // kept in place.
                        let head = c.head.bytes();
                        let first = if head.len() >= HEADER_LEN { head } else { msg };
                        // The clock only for a request with a budget (a syscall on some hosts,
                        // such as VMs whose clocksource is the HPET).
                        let now = if Session::needs_now(first) {
                            Instant::now()
                        } else {
                            self.epoch
                        };
                        self.session.handle_message_with_head(head, msg, offer, now)
                    }
                };
                if self.lost.is_none() {
                    // The peer's Close ends the session: the connection with it.
                    if let Some(why) = self.session.lost_reason() {
                        self.lost = Some(why.clone());
                    }
                }
                match r {
                    Err(e) => self.lose(Lost::new(LostKind::Protocol, format!("peer broke the protocol: {e}"))),
                    // The message stays in its slot for the application.
                    Ok(true) => self.held.push((c.wr_id, buf)),
                    // Reposted after what this message causes is sent (see `flush`).
                    Ok(false) => self.unposted.push(RecvWr::new(c.wr_id, buf)),
                }
                if self.lease.is_some() {
                    self.grow_window();
                }
            }
            SEND | PLACED => {} // a pool's send buffer returns to its pool as `c` drops
            PROBE => {}         // the peer's NIC answered: `completions` counted it
            READ => {
                let Some(job) = Job::piece_done(&mut self.reads, id, c.buf) else {
                    return;
                };
                let (local, len, token) = (job.buf, job.len, job.token);
                match job.join() {
                    Some(mr) => self.stash.put_back(local, mr),
                    None => return self.lose(local_loss("a read buffer came back in pieces that do not join")),
                }
                match token {
                    // A request stays in the buffer it was read into: the handler gets it as is.
                    Some(Token::Request(call)) => {
                        self.session.handle_request_read(call, Ok((local, len)), Instant::now());
                    }
                    // A response its caller takes where it lands: no copy either.
                    Some(Token::Response(call)) if self.session.reads_in_place(Token::Response(call)) => {
                        self.session.handle_response_read(call, Ok((local, len)));
                    }
                    Some(token) => {
                        let bytes = self.take_bytes(local, len);
                        self.session.handle_read_done(token, Ok(bytes), Instant::now());
                    }
                    None => self.stash.release(local),
                }
            }
            WRITE => {
                let Some(job) = Job::piece_done(&mut self.writes, id, c.buf) else {
                    return;
                };
                match job.join() {
                    Some(mr) => self.stash.put_back(id, mr),
                    None => return self.lose(local_loss("a write buffer came back in pieces that do not join")),
                }
                self.session.handle_write_done(id);
            }
            _ => tracing::warn!(wr_id = c.wr_id, "completion of unknown kind"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::proto::{Header, Payload, SessionConfig, FRAGMENT};
    use rdma_rpc_transport::{Device, Listener, QpOptions};

    /// A connection with a 16-slot ring whose free buffers are kept without a bound.
    fn test_conn(
        session: Session,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        slot: usize,
    ) -> Result<Conn, RpcError> {
        let isolation = crate::Isolation::Connection;
        Conn::new(session, pd, qp, cq, (slot, 16), (isolation, usize::MAX))
    }

    /// A connection over the tcp provider, its peer a raw QP on ring `peer_recvs` whose CQ is
    /// returned: `(conn's pd, conn's qp, conn's cq, peer's qp, peer's pd, peer's cq)`. The
    /// connection's send queue is as deep as a client's or a server's ([`qp_caps`]).
    ///
    /// [`qp_caps`]: crate::handshake::qp_caps
    fn raw_pair(
        cfg: &SessionConfig,
    ) -> (
        ProtectionDomain,
        QueuePair,
        CompletionQueue,
        QueuePair,
        ProtectionDomain,
        CompletionQueue,
    ) {
        let dev = Device::open("tcp").expect("the tcp provider");
        let slot = cfg.slot_size();
        let (pd, cq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
        let (ppd, pcq) = (dev.alloc_pd().expect("pd"), dev.create_cq(1024).expect("cq"));
        let listener = Listener::bind(&dev, "127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let peer_recvs = Conn::ring(&ppd, cfg.ring, slot).expect("the peer's ring");
        let popts = QpOptions::new(&ppd, &pcq);
        let peer = std::thread::spawn(move || {
            let req = listener.accept(Some(Duration::from_secs(30))).expect("accept");
            req.accept_with_recvs(&popts, b"", peer_recvs).expect("the peer's qp")
        });
        let recvs = Conn::ring(&pd, cfg.ring, slot).expect("our ring");
        let caps = crate::handshake::qp_caps(&dev, &crate::Config::default().ring(cfg.ring));
        let (qp, _) = rdma_rpc_transport::connect_with_recvs(
            addr,
            &QpOptions::new(&pd, &cq).caps(caps),
            b"",
            Duration::from_secs(30),
            recvs,
        )
        .expect("connect");
        let peer_qp = peer.join().expect("the peer's thread");
        (pd, qp, cq, peer_qp, ppd, pcq)
    }

    /// A connection quiet for its keepalive's time probes its peer once (a zero-length Write,
    /// no key), the peer's NIC answers without a receive or a message, and the connection
    /// lives on; one that sees completions between two looks does not probe.
    #[test]
    fn a_quiet_connection_probes_its_peer_and_a_busy_one_does_not() {
        let cfg = SessionConfig {
            ring: 16,
            eager_max: 1 << 16,
            fragment: FRAGMENT,
            max_payload: 1 << 20,
        };
        let (pd, qp, cq, _peer_qp, _ppd, pcq) = raw_pair(&cfg);
        let mut conn = test_conn(Session::new(cfg.clone()), &pd, qp, cq, cfg.slot_size()).expect("conn");
        let every = Duration::from_millis(10);
        conn.keepalive = Some(Keepalive::new(every));
        let probing = |c: &Conn| c.probing();
        // A completion between two looks: busy, no probe.
        let t0 = Instant::now();
        conn.completions += 1;
        conn.keepalive_look(t0 + every);
        assert!(
            !probing(&conn),
            "a connection with completions since its last look probed"
        );
        // Before its time, a look does nothing.
        conn.keepalive_look(t0 + every + every / 2);
        assert!(!probing(&conn), "a look before its time probed");
        // Quiet since: the next look probes.
        conn.keepalive_look(t0 + 3 * every);
        assert!(probing(&conn), "a quiet connection did not probe");
        let before = conn.completions;
        let deadline = Instant::now() + Duration::from_secs(10);
        while probing(&conn) {
            assert!(Instant::now() < deadline, "the probe was not answered");
            conn.poll_cq();
        }
        assert_eq!(conn.completions, before + 1, "one completion: the probe's");
        assert!(conn.lost.is_none(), "{:?}", conn.lost);
        // A probe is no message: nothing arrived at the peer.
        let mut out = Vec::new();
        pcq.poll(&mut out, 16).expect("poll");
        assert!(out.is_empty(), "the probe raised {} completions at the peer", out.len());
        // Looks go on: one probe per quiet interval, never two at once.
        conn.keepalive_look(t0 + 4 * every);
        conn.keepalive_look(t0 + 5 * every);
        assert!(probing(&conn), "a second quiet interval probes again");
    }

    /// The order a short call and the pieces of a long eager one leave a connection in, when
    /// the short call is made after the first flush: its place among the long one's pieces
    /// (0 = before the first), as the peer receives them. A raw QP stands in for the peer.
    fn short_call_place(pieces: usize) -> usize {
        let cfg = SessionConfig {
            ring: 16,
            eager_max: 1 << 20,
            fragment: FRAGMENT,
            max_payload: 1 << 20,
        };
        let slot = cfg.slot_size();
        let (pd, qp, cq, peer_qp, _ppd, pcq) = raw_pair(&cfg);
        let mut session = Session::new(cfg);
        session.interleave(true);
        let mut conn = test_conn(session, &pd, qp, cq, slot).expect("conn");
        let now = Instant::now();
        let long = conn
            .session
            .start_call(1, Payload::Eager(vec![1; pieces * FRAGMENT]), None, None, now)
            .expect("the long call");
        conn.flush();
        let short = conn
            .session
            .start_call(2, Payload::Eager(vec![2; 64]), None, None, now)
            .expect("the short call");
        while conn.flush() || conn.more_to_post() {}
        // The peer's receives, in order: the short request's place among the long one's pieces.
        let (mut order, mut out) = (Vec::new(), Vec::new());
        let deadline = Instant::now() + Duration::from_secs(30);
        while order.len() < pieces + 1 {
            assert!(
                Instant::now() < deadline,
                "only {} of {} messages came",
                order.len(),
                pieces + 1
            );
            pcq.poll(&mut out, 16).expect("poll");
            for wc in out.drain(..) {
                let wc = wc.ok().expect("a received message");
                let buf = wc.buf.expect("its slot");
                let bytes = buf.bytes();
                let (h, _) = Header::decode(&bytes[..wc.byte_len as usize]).expect("a header");
                order.push(h.call_id);
            }
        }
        drop(peer_qp);
        let place = order.iter().position(|&c| c == short).expect("the short request");
        assert_eq!(order.iter().filter(|&&c| c == long).count(), pieces);
        place
    }

    #[test]
    fn a_short_call_leaves_after_the_next_piece_of_a_long_one_not_after_all() {
        // Sixteen credits would let all six pieces go in the first flush; one flush posts one
        // piece (`FLUSH_BYTES`), so the short call goes right after the second.
        let place = short_call_place(6);
        assert!(place <= 2, "the short request left after {place} of 6 pieces");
    }

    /// A server connection on a device whose largest RDMA message the test sets, and its
    /// caller: a raw QP (with its protection domain and CQ) and a session that makes the
    /// requests.
    struct Rig {
        conn: Conn,
        peer_qp: QueuePair,
        ppd: ProtectionDomain,
        pcq: CompletionQueue,
        caller: Session,
    }

    impl Rig {
        /// For `n` requests at once, on a device whose largest RDMA message is `chunk` bytes.
        fn new(n: usize, chunk: usize) -> Self {
            let cfg = SessionConfig {
                ring: 16,
                eager_max: 1024,
                fragment: FRAGMENT,
                max_payload: 1 << 20,
            };
            // The first credits: the ring less the one a side keeps for a Credit message.
            assert!(n < cfg.ring as usize, "requests sent on the first credits");
            let slot = cfg.slot_size();
            let (pd, qp, cq, peer_qp, ppd, pcq) = raw_pair(&cfg);
            let session = Session::new(cfg.clone());
            let mut conn = test_conn(session, &pd, qp, cq, slot).expect("conn");
            conn.chunk = chunk;
            Self {
                conn,
                peer_qp,
                ppd,
                pcq,
                caller: Session::new(cfg),
            }
        }
    }

    /// A server connection told of `n` rendezvous requests of `len` bytes in one go, its
    /// device's largest RDMA message `chunk` bytes (so each Read goes in `len / chunk`
    /// pieces): the requests' bodies as it read them, and the most Read pieces it had posted
    /// at once, or why the connection was lost. A raw QP and a session stand in for the caller.
    fn read_many(n: usize, len: usize, chunk: usize) -> Result<(Vec<Vec<u8>>, usize), String> {
        let Rig {
            mut conn,
            peer_qp,
            ppd,
            pcq,
            mut caller,
        } = Rig::new(n, chunk);
        // The caller: `n` bodies in one registration its peer may read, and their requests.
        let bodies: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8 + 1; len]).collect();
        let lent = ppd
            .register_vec(
                bodies.concat(),
                rdma_rpc_transport::AccessFlags::LOCAL_WRITE | rdma_rpc_transport::AccessFlags::REMOTE_READ,
            )
            .expect("the bodies' registration");
        let whole = crate::region::desc(lent.remote());
        for i in 0..n {
            let desc = nth(&whole, len, i);
            caller
                .start_call(7, Payload::Lent { desc, buf: i as BufId }, None, None, Instant::now())
                .expect("a rendezvous call");
        }
        send_requests(&mut caller, &peer_qp, &ppd, n);
        // All of them arrive before the server posts anything, as when requests come faster
        // than Reads end.
        let deadline = Instant::now() + Duration::from_secs(30);
        await_requests(&mut conn, n, deadline);
        let (mut got, mut most) = (vec![Vec::new(); n], 0);
        let mut read = 0;
        let mut out = Vec::new();
        while read < n {
            assert!(Instant::now() < deadline, "{read} of {n} requests were read");
            conn.progress();
            most = most.max(conn.rdma_posted);
            if let Some(why) = conn.lost() {
                return Err(why.to_string());
            }
            while let Some(ev) = conn.session.poll_event() {
                if let Event::Request {
                    call,
                    payload: crate::proto::RequestBody::Held { buf, len },
                    ..
                } = ev
                {
                    got[call as usize - 1] = conn.take_bytes(buf, len);
                    read += 1;
                }
            }
            // The caller's side: its send completions and any credits (nothing to do with them).
            pcq.poll(&mut out, 64).expect("the caller's CQ");
            out.clear();
        }
        drop(peer_qp);
        Ok((got, most))
    }

    /// The `i`-th `each` bytes of `whole`.
    fn nth(whole: &crate::proto::RemoteRegion, each: usize, i: usize) -> crate::proto::RemoteRegion {
        crate::proto::RemoteRegion {
            addr: whole.addr + (i * each) as u64,
            len: each as u64,
            rkey: whole.rkey,
        }
    }

    /// Posts the `n` requests `caller` has to send, each a Send from a registration of its own.
    fn send_requests(caller: &mut Session, peer_qp: &QueuePair, ppd: &ProtectionDomain, n: usize) {
        let mut sent = 0;
        while let Some(t) = caller.poll_transmit() {
            let Transmit::Send(m) = t else { continue };
            let mr = ppd
                .register_vec(m.to_vec(), rdma_rpc_transport::AccessFlags::LOCAL_WRITE)
                .expect("a request's registration");
            peer_qp
                .post_send(SendWr::send(sent, mr).len(m.len()))
                .expect("a request's Send");
            sent += 1;
        }
        assert_eq!(sent, n as u64, "one Send per request");
    }

    /// Reaps `conn`'s completions, posting nothing, until it serves `n` requests.
    fn await_requests(conn: &mut Conn, n: usize, deadline: Instant) {
        while conn.session.serving() < n {
            assert!(
                Instant::now() < deadline,
                "{} of {n} requests came",
                conn.session.serving()
            );
            conn.poll_cq();
        }
    }

    /// As [`read_many`] for responses: a server connection answers `n` calls at once with
    /// `len` bytes each, written into the landing buffers the calls gave (RDMA Write with
    /// immediate, in `len / chunk` pieces). The responses as they landed, and the most Write
    /// pieces it had posted at once, or why the connection was lost.
    fn write_many(n: usize, len: usize, chunk: usize) -> Result<(Vec<Vec<u8>>, usize), String> {
        let Rig {
            mut conn,
            peer_qp,
            ppd,
            pcq,
            mut caller,
        } = Rig::new(n, chunk);
        let each = LANDING_PREFIX + len;
        let landing = ppd
            .register_zeroed_vec(
                n * each,
                rdma_rpc_transport::AccessFlags::LOCAL_WRITE | rdma_rpc_transport::AccessFlags::REMOTE_WRITE,
            )
            .expect("the landing buffers' registration");
        let whole = crate::region::desc(landing.remote());
        for i in 0..n {
            let desc = nth(&whole, each, i);
            caller
                .start_call(
                    7,
                    Payload::Eager(vec![i as u8]),
                    Some((desc, i as BufId)),
                    None,
                    Instant::now(),
                )
                .expect("a call with a landing buffer");
        }
        send_requests(&mut caller, &peer_qp, &ppd, n);
        let deadline = Instant::now() + Duration::from_secs(30);
        await_requests(&mut conn, n, deadline);
        // Every response given before the server posts any.
        while let Some(ev) = conn.session.poll_event() {
            if let Event::Request { call, .. } = ev {
                let (desc, buf) = conn.stash.lend(&vec![call as u8; len]).expect("a response buffer");
                assert!(
                    conn.session.lands(call, len),
                    "the response goes into the landing buffer"
                );
                conn.session.respond(call, Ok(Payload::Lent { desc, buf }));
            }
        }
        let (mut landed, mut most, mut out) = (0, 0, Vec::new());
        while landed < n {
            assert!(Instant::now() < deadline, "{landed} of {n} responses landed");
            conn.progress();
            most = most.max(conn.rdma_posted);
            if let Some(why) = conn.lost() {
                return Err(why.to_string());
            }
            pcq.poll(&mut out, 64).expect("the caller's CQ");
            for wc in out.drain(..) {
                let wc = wc.ok().expect("the caller's completion");
                if wc.opcode == WcOpcode::RecvRdmaWithImm {
                    landed += 1;
                }
                if let Some(buf) = wc.buf.filter(|_| wc.wr_id & !ID_MASK == RECV) {
                    // The Credit messages and immediates keep coming: post the slot again.
                    peer_qp.post_recv(RecvWr::new(wc.wr_id, buf)).expect("a repost");
                }
            }
        }
        let bytes = landing.bytes();
        let got = (0..n)
            .map(|i| bytes[i * each + LANDING_PREFIX..(i + 1) * each].to_vec())
            .collect();
        drop(peer_qp);
        Ok((got, most))
    }

    #[test]
    fn reads_beyond_the_send_queues_room_wait_for_it_instead_of_overflowing_it() {
        // Fifteen requests of 64 KiB in 4 KiB pieces: 240 Read work requests, against a send
        // queue of 2 x 16 + 64 = 96 (the room beside the Sends: 64). Posted at once, they
        // overflowed it and lost the connection ("send queue full").
        let (got, most) = read_many(15, 64 << 10, 4096).expect("the connection stays up");
        assert!(most <= 64, "{most} Read pieces posted at once, beyond the room of 64");
        assert!(most >= 32, "only {most} pieces at once: the room goes unused");
        for (i, body) in got.iter().enumerate() {
            assert!(
                body.len() == 64 << 10 && body.iter().all(|&b| b == i as u8 + 1),
                "request {} read wrong ({} bytes)",
                i + 1,
                body.len()
            );
        }
    }

    #[test]
    fn one_read_of_more_pieces_than_the_room_goes_in_turns() {
        // 512 KiB in 4 KiB pieces: 128 Read work requests, more than the whole queue of 96.
        let (got, most) = read_many(1, 512 << 10, 4096).expect("the connection stays up");
        assert!(most <= 64, "{most} Read pieces posted at once, beyond the room of 64");
        assert!(
            got[0].len() == 512 << 10 && got[0].iter().all(|&b| b == 1),
            "read wrong"
        );
    }

    #[test]
    fn writes_beyond_the_send_queues_room_wait_for_it_instead_of_overflowing_it() {
        // Fifteen responses of 64 KiB in 4 KiB pieces, written into their callers' landing
        // buffers: 255 Write work requests (the landing prefix makes each 17) against 96.
        let (got, most) = write_many(15, 64 << 10, 4096).expect("the connection stays up");
        assert!(most <= 64, "{most} Write pieces posted at once, beyond the room of 64");
        for (i, body) in got.iter().enumerate() {
            assert!(
                body.iter().all(|&b| b == i as u8 + 1),
                "response {} landed wrong",
                i + 1
            );
        }
    }
}
