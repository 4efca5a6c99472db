//! rdma_cm connection management: address and route resolution, connect, listen, accept.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::{check, last_os_error, Context, Qp};
use crate::{Error, QpOptions, Result};

/// rdma_set_option level and name (rdma_cma.h enums that bindgen does not export).
const RDMA_OPTION_ID: i32 = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// Local ACK timeout exponent: 4.096 µs × 2^18 ≈ 1.07 s per try (a 16 MiB RDMA Read on
/// soft-RoCE under emulation needs more than 2^14 ≈ 67 ms). Set on both sides.
const ACK_TIMEOUT: u8 = 18;
/// Transport retries after the first try: 7 tries of about 1.07 s, so a request the peer
/// never acknowledges fails with RETRY_EXC_ERR after about 7.5 s (ConnectX and rxe alike).
/// Not 7: rxe (and the IBA for RNR) read 7 as "retry for ever", and a peer whose host is
/// gone then hung its callers for good.
const RETRY_COUNT: u8 = 6;
/// RNR retries: 6 (7 would mean "forever").
const RNR_RETRY: u8 = 6;

/// An event channel, destroyed on drop unless handed on.
struct Channel(NonNull<rdma_event_channel>);

impl Channel {
    fn new() -> Result<Self> {
        // SAFETY: no preconditions.
        NonNull::new(unsafe { rdma_create_event_channel() })
            .map(Channel)
            .ok_or_else(|| last_os_error("rdma_create_event_channel"))
    }
    fn into_raw(self) -> NonNull<rdma_event_channel> {
        let p = self.0;
        std::mem::forget(self);
        p
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every id on this channel was destroyed first (Id is dropped before Channel).
        unsafe { rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// An rdma_cm id (and its QP, if one was created), destroyed on drop unless handed on.
struct Id(NonNull<rdma_cm_id>);

impl Id {
    fn create(ch: &Channel) -> Result<Self> {
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is live; id is a valid out-pointer.
        check("rdma_create_id", unsafe {
            rdma_create_id(
                ch.0.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        NonNull::new(id).map(Id).ok_or_else(|| last_os_error("rdma_create_id"))
    }
    fn raw(&self) -> *mut rdma_cm_id {
        self.0.as_ptr()
    }
    fn into_raw(self) -> NonNull<rdma_cm_id> {
        let p = self.0;
        std::mem::forget(self);
        p
    }
    fn check_device(&self, ctx: &Context) -> Result<()> {
        // SAFETY: the id is live; verbs is set once the address is bound or resolved.
        let verbs = unsafe { (*self.raw()).verbs };
        if verbs != ctx.raw() {
            return Err(Error::InvalidArgument(format!(
                "that address is not on device {}: open the device whose netdev carries it (verbs:<device>)",
                ctx.name()
            )));
        }
        Ok(())
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: the id is live; its QP (if any) goes first; each is destroyed once.
        unsafe {
            if !(*self.raw()).qp.is_null() {
                rdma_destroy_qp(self.raw());
            }
            rdma_destroy_id(self.raw());
        }
    }
}

/// What we keep of an rdma_cm event after acknowledging it.
pub(super) struct Event {
    pub(super) kind: u32,
    pub(super) status: i32,
    id: *mut rdma_cm_id,
    pub(super) private_data: Vec<u8>,
    /// A connect request's Read depths, seen from this side (the kernel swaps the peer's):
    /// the responder resources it asks of us and the initiator depth it grants us.
    pub(super) rd_atom: (u8, u8),
}

// SAFETY: `id` is only compared and handed back to the thread that owns the listener.
unsafe impl Send for Event {}

/// Copies what we need out of an event.
///
/// # Safety
/// `ev` must be a valid event from rdma_get_cm_event, not yet acknowledged.
pub(super) unsafe fn copy_event(ev: *const rdma_cm_event) -> Event {
    use rdma_cm_event_type::{
        RDMA_CM_EVENT_CONNECT_REQUEST, RDMA_CM_EVENT_CONNECT_RESPONSE, RDMA_CM_EVENT_ESTABLISHED,
        RDMA_CM_EVENT_REJECTED,
    };
    // SAFETY: the caller promises a valid event. `param` is a union: `conn` is its member only
    // for the connection events of RDMA_PS_TCP below, so no other event's bytes are read as
    // it; there private_data points at private_data_len bytes (or is NULL).
    unsafe {
        let e = &*ev;
        let with_conn = matches!(
            e.event,
            RDMA_CM_EVENT_CONNECT_REQUEST
                | RDMA_CM_EVENT_CONNECT_RESPONSE
                | RDMA_CM_EVENT_ESTABLISHED
                | RDMA_CM_EVENT_REJECTED
        );
        let rd_atom = if with_conn {
            (e.param.conn.responder_resources, e.param.conn.initiator_depth)
        } else {
            (0, 0)
        };
        let private_data = if with_conn {
            let conn = e.param.conn;
            if conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(conn.private_data.cast::<u8>(), usize::from(conn.private_data_len)).to_vec()
            }
        } else {
            Vec::new()
        };
        Event {
            kind: e.event,
            status: e.status,
            id: e.id,
            private_data,
            rd_atom,
        }
    }
}

fn next_event(ch: &Channel, deadline: Option<Instant>) -> Result<Event> {
    // SAFETY: the channel is live.
    let fd = unsafe { (*ch.0.as_ptr()).fd };
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout("waiting for an rdma_cm event"));
                }
                left.as_millis().min(i32::MAX as u128) as i32
            }
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("polling the rdma_cm channel", e));
        }
        if n == 0 {
            continue;
        }
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live and readable; ev is a valid out-pointer.
        check("rdma_get_cm_event", unsafe {
            rdma_get_cm_event(ch.0.as_ptr(), &mut ev)
        })?;
        // SAFETY: ev came from rdma_get_cm_event and is not acknowledged yet.
        let out = unsafe { copy_event(ev) };
        // SAFETY: acknowledged once; we copied what we need.
        unsafe { rdma_ack_cm_event(ev) };
        return Ok(out);
    }
}

/// The reject reason of a connect request no listener took (the IB CM's; RoCE's too).
const REJ_INVALID_SERVICE_ID: i32 = 8;

pub(super) fn expect(ev: Event, want: u32, what: &'static str) -> Result<Event> {
    use rdma_cm_event_type::*;
    if ev.kind == want {
        return Ok(ev);
    }
    Err(match ev.kind {
        // The CM on the peer's side answered for nobody: no listener at that port
        // (IB_CM_REJ_INVALID_SERVICE_ID), as a TCP stack answers with a reset.
        RDMA_CM_EVENT_REJECTED if ev.status == REJ_INVALID_SERVICE_ID => Error::Io {
            context: "connecting: nothing listens at that address",
            source: io::ErrorKind::ConnectionRefused.into(),
        },
        // A consumer's reject carries its reason in the private data (framed; the CM's own
        // rejects carry zeros, so none).
        RDMA_CM_EVENT_REJECTED => crate::cm::rejected(&unframe(&ev.private_data)),
        _ => Error::Verbs {
            call: what,
            source: io::Error::other(format!("rdma_cm event {} (status {})", ev.kind, ev.status)),
        },
    })
}

/// Private data travels as `[len][bytes]`: IB CM pads it to a fixed size.
fn frame(data: &[u8]) -> Vec<u8> {
    let mut v = vec![data.len() as u8];
    v.extend_from_slice(data);
    v
}

pub(super) fn unframe(raw: &[u8]) -> Vec<u8> {
    match raw.split_first() {
        Some((&n, rest)) => rest[..usize::from(n).min(rest.len())].to_vec(),
        None => Vec::new(),
    }
}

fn create_qp(id: &Id, opts: &QpOptions) -> Result<()> {
    let pd = crate::provider::pd_of::<super::Pd>(&opts.pd.inner, "a verbs QP")?;
    let cq = |c: &crate::CompletionQueue| crate::provider::cq_of::<super::Cq>(c, "a verbs QP").map(|c| c.raw());
    // SAFETY: ibv_qp_init_attr is plain old data.
    let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    init.send_cq = cq(&opts.send_cq)?;
    init.recv_cq = cq(&opts.recv_cq)?;
    init.cap = ibv_qp_cap {
        max_send_wr: opts.caps.max_send_wr,
        max_recv_wr: opts.caps.max_recv_wr,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: opts.caps.max_inline_data,
    };
    init.qp_type = ibv_qp_type::IBV_QPT_RC;
    init.sq_sig_all = 0;
    if let Some(srq) = &opts.srq {
        match srq.inner.imp.as_any().downcast_ref::<super::Srq>() {
            Some(s) => init.srq = s.raw(),
            None => return Err(Error::InvalidArgument("a verbs QP needs a verbs SRQ".into())),
        }
        init.cap.max_recv_wr = 0;
    }
    // SAFETY: the id is live and bound to the PD's device (checked by the caller); PD and CQs are
    // live and outlive the QP (QueuePair holds them).
    check("rdma_create_qp", unsafe {
        rdma_create_qp(id.raw(), pd.raw(), &mut init)
    })
}

/// The Read depths an accepting side answers with: its own device's limits (responder
/// resources, initiator depth), each no more than the connecting side offered for it (as the
/// connect request shows them from this side). The connecting side takes the answer's.
fn agree_rd_atom(own: (u8, u8), offered: (u8, u8)) -> (u8, u8) {
    (own.0.min(offered.0), own.1.min(offered.1))
}

fn set_ack_timeout(id: &Id) {
    let mut t = ACK_TIMEOUT;
    // SAFETY: the id is live; the option takes one u8.
    let rc = unsafe {
        rdma_set_option(
            id.raw(),
            RDMA_OPTION_ID,
            RDMA_OPTION_ID_ACK_TIMEOUT,
            (&mut t as *mut u8).cast(),
            1,
        )
    };
    if rc != 0 {
        tracing::debug!("rdma_set_option(ACK_TIMEOUT) not supported; keeping the default");
    }
}

struct SockAddr {
    storage: libc::sockaddr_storage,
}

impl SockAddr {
    fn new(addr: SocketAddr) -> Self {
        // SAFETY: sockaddr_storage is plain old data.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as u16,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
                unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as u16,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
                unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            }
        }
        Self { storage }
    }
    fn as_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.storage as *mut libc::sockaddr_storage).cast()
    }
}

/// Reads a socket address written by the kernel.
///
/// # Safety
/// `sa` must point at a valid sockaddr_in or sockaddr_in6 (as its family says), or be NULL.
unsafe fn socket_addr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller promises a valid sockaddr of the family it names.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                    u16::from_be(sin6.sin6_port),
                ))
            }
            _ => None,
        }
    }
}

pub(crate) fn connect(
    ctx: &Context,
    addr: SocketAddr,
    opts: &QpOptions,
    timeout: Duration,
) -> Result<(Qp, u32, Pending)> {
    let deadline = Instant::now() + timeout;
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    let ch = Channel::new()?;
    let id = Id::create(&ch)?;
    let mut dst = SockAddr::new(addr);
    // SAFETY: the id is live; a NULL source lets rdma_cm pick; dst is a valid sockaddr.
    check("rdma_resolve_addr", unsafe {
        rdma_resolve_addr(id.raw(), std::ptr::null_mut(), dst.as_ptr(), ms)
    })?;
    expect(
        next_event(&ch, Some(deadline))?,
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
        "rdma_resolve_addr",
    )?;
    id.check_device(ctx)?;
    set_ack_timeout(&id);
    // SAFETY: the id is live with a resolved address.
    check("rdma_resolve_route", unsafe { rdma_resolve_route(id.raw(), ms) })?;
    expect(
        next_event(&ch, Some(deadline))?,
        rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
        "rdma_resolve_route",
    )?;
    create_qp(&id, opts)?;
    let raw = id.raw();
    let (qp, num, setup) = Qp::new(id.into_raw(), ch.into_raw(), &opts.send_cq, &opts.recv_cq, false)?;
    let pending = Pending {
        id: raw,
        connect: true,
        peer: Some(addr),
        rd_atom: (ctx.max_rd_atom, ctx.max_init_rd_atom),
        setup,
        deadline,
    };
    Ok((qp, num, pending))
}

/// The last step of connection set-up (rdma_connect or rdma_accept, then ESTABLISHED), taken
/// once the new QP has its first receives posted.
pub(crate) struct Pending {
    /// Owned by the `Qp`, which outlives this value (the caller holds both).
    id: *mut rdma_cm_id,
    connect: bool,
    /// The address connected to (the connecting side): named when nothing listens there.
    peer: Option<SocketAddr>,
    rd_atom: (u8, u8),
    setup: std::sync::mpsc::Receiver<Event>,
    deadline: Instant,
}

impl Pending {
    /// Refuses the peer instead of accepting (this side's set-up failed after the QP was made).
    /// A connecting side has nobody to refuse.
    pub(crate) fn refuse(self, reason: &[u8]) {
        if !self.connect {
            // SAFETY: the id is live (its Qp is held by the caller) and not accepted yet.
            unsafe { reject(self.id, reason) };
        }
    }

    pub(crate) fn finish(self, private_data: &[u8]) -> Result<Vec<u8>> {
        let framed = frame(private_data);
        let mut param = rdma_conn_param {
            private_data: framed.as_ptr().cast(),
            private_data_len: framed.len() as u8,
            responder_resources: self.rd_atom.0,
            initiator_depth: self.rd_atom.1,
            flow_control: 1,
            retry_count: RETRY_COUNT,
            rnr_retry_count: RNR_RETRY,
            srq: 0,
            qp_num: 0,
        };
        let rc = if self.connect {
            // SAFETY: the id is live (its Qp is held by the caller) and has a QP; param and the
            // private data it points at live across the call.
            unsafe { rdma_connect(self.id, &mut param) }
        } else {
            // SAFETY: as above.
            unsafe { rdma_accept(self.id, &mut param) }
        };
        check(if self.connect { "rdma_connect" } else { "rdma_accept" }, rc)?;
        let left = self.deadline.saturating_duration_since(Instant::now());
        let ev = self
            .setup
            .recv_timeout(left)
            .map_err(|_| Error::Timeout("establishing the connection"))?;
        let ev = expect(
            ev,
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            if self.connect { "rdma_connect" } else { "rdma_accept" },
        )
        .map_err(|e| match (e, self.peer) {
            // Nothing listens there: say what may (a server of another provider).
            (Error::Io { source, .. }, Some(addr)) if source.kind() == io::ErrorKind::ConnectionRefused => {
                Error::connecting(addr, "verbs", source)
            }
            (e, _) => e,
        })?;
        Ok(unframe(&ev.private_data))
    }
}

/// Refuses the connect request of `id`, `reason` (if any) framed in the REJ's private data.
///
/// # Safety
/// `id` must be a live rdma_cm id of a connect request not answered yet.
pub(super) unsafe fn reject(id: *mut rdma_cm_id, reason: &[u8]) {
    let framed = frame(reason);
    let (data, len) = if reason.is_empty() {
        (std::ptr::null(), 0)
    } else {
        (framed.as_ptr().cast(), framed.len() as u8)
    };
    // SAFETY: the caller promises a live, unanswered id; the private data lives across the
    // call (`framed`), and `reject_reason` keeps it within the REJ's 148 bytes.
    unsafe { rdma_reject(id, data, len) };
}

/// A listening rdma_cm id.
pub(crate) struct Listener {
    // Field order is drop order: the id before its channel.
    id: Id,
    ch: Channel,
    ctx_name: String,
    ctx: *mut ibv_context,
}

// SAFETY: rdma_cm ids and channels are usable from any thread; accept takes &self but
// rdma_get_cm_event on one channel is serialised by the kernel.
unsafe impl Send for Listener {}
// SAFETY: as above.
unsafe impl Sync for Listener {}

impl Listener {
    pub(crate) fn bind(ctx: &Context, addr: SocketAddr) -> Result<Self> {
        let ch = Channel::new()?;
        let id = Id::create(&ch)?;
        let mut sa = SockAddr::new(addr);
        // SAFETY: the id is live; sa is a valid sockaddr.
        check("rdma_bind_addr", unsafe { rdma_bind_addr(id.raw(), sa.as_ptr()) })?;
        if !addr.ip().is_unspecified() {
            id.check_device(ctx)?;
        }
        // SAFETY: the id is bound.
        check("rdma_listen", unsafe { rdma_listen(id.raw(), 128) })?;
        Ok(Self {
            id,
            ch,
            ctx_name: ctx.name().to_owned(),
            ctx: ctx.raw(),
        })
    }

    pub(crate) fn local_addr(&self) -> Result<SocketAddr> {
        // SAFETY: the id is live and bound; route.addr.src_addr holds the bound address.
        let sa = unsafe { rdma_get_local_addr(&*self.id.raw()) as *const libc::sockaddr };
        // SAFETY: the kernel wrote a sockaddr of the id's family there.
        unsafe { socket_addr(sa) }.ok_or_else(|| Error::Protocol("listener has no address".into()))
    }

    pub(crate) fn accept(&self, timeout: Option<Duration>) -> Result<Request> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ev = next_event(&self.ch, deadline)?;
            if ev.kind != rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                tracing::debug!(kind = ev.kind, "ignoring a listener event");
                continue;
            }
            let child = Id(NonNull::new(ev.id).ok_or_else(|| Error::Protocol("connect request without id".into()))?);
            // SAFETY: the child id is live.
            if unsafe { (*child.raw()).verbs } != self.ctx {
                tracing::warn!(device = %self.ctx_name, "connect request on another device: rejecting");
                // SAFETY: the child id is live and not yet accepted.
                unsafe { rdma_reject(child.raw(), std::ptr::null(), 0) };
                continue;
            }
            // Its own channel for its later events; a failure (out of file descriptors, say)
            // refuses the peer with the reason, which would otherwise time out.
            let ch = Channel::new().and_then(|ch| {
                // SAFETY: both are live; the child moves to the channel.
                check("rdma_migrate_id", unsafe {
                    rdma_migrate_id(child.raw(), ch.0.as_ptr())
                })
                .map(|()| ch)
            });
            let ch = match ch {
                Ok(ch) => ch,
                Err(e) => {
                    // SAFETY: the child id is live (dropped after this) and unanswered.
                    unsafe { reject(child.raw(), &crate::cm::set_up_reason(&e)) };
                    return Err(e);
                }
            };
            // SAFETY: the child id is live; its route holds the peer's address.
            let peer = unsafe { socket_addr(rdma_get_peer_addr(&*child.raw()) as *const libc::sockaddr) };
            // This side's retries time out as the connecting side's do.
            set_ack_timeout(&child);
            return Ok(Request {
                id: Some(child),
                ch: Some(ch),
                private_data: unframe(&ev.private_data),
                peer,
                offered: ev.rd_atom,
            });
        }
    }
}

/// An incoming connect request on its own event channel.
pub(crate) struct Request {
    id: Option<Id>,
    ch: Option<Channel>,
    private_data: Vec<u8>,
    peer: Option<SocketAddr>,
    /// The Read depths the connecting side offered ([`Event::rd_atom`]).
    offered: (u8, u8),
}

// SAFETY: the id and channel are usable from any thread and owned by this value alone.
unsafe impl Send for Request {}

impl Request {
    pub(crate) fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    pub(crate) fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// When the QP cannot be made the peer is refused, with the error as the reason.
    pub(crate) fn accept(mut self, opts: &QpOptions) -> Result<(Qp, u32, Pending)> {
        let Some(ctx) = opts.pd.device().inner.imp.as_any().downcast_ref::<Context>() else {
            let e = Error::InvalidArgument("a verbs QP needs a verbs device".into());
            self.reject(&crate::cm::set_up_reason(&e));
            return Err(e);
        };
        if let Some(id) = &self.id {
            if let Err(e) = id.check_device(ctx).and_then(|()| create_qp(id, opts)) {
                self.reject(&crate::cm::set_up_reason(&e));
                return Err(e);
            }
        }
        let (Some(id), Some(ch)) = (self.id.take(), self.ch.take()) else {
            return Err(Error::Protocol("request already answered".into()));
        };
        let raw = id.raw();
        let (qp, num, setup) = Qp::new(id.into_raw(), ch.into_raw(), &opts.send_cq, &opts.recv_cq, true)?;
        let pending = Pending {
            id: raw,
            connect: false,
            peer: None,
            rd_atom: agree_rd_atom((ctx.max_rd_atom, ctx.max_init_rd_atom), self.offered),
            setup,
            deadline: Instant::now() + Duration::from_secs(30),
        };
        Ok((qp, num, pending))
    }

    /// Refuses the request, `reason` (if any) in the REJ's private data.
    pub(crate) fn reject(mut self, reason: &[u8]) {
        if let Some(id) = self.id.take() {
            // SAFETY: the id is live (held until the end of this block) and unanswered.
            unsafe { reject(id.raw(), reason) };
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            // SAFETY: an unanswered request is refused before its id is destroyed.
            unsafe { rdma_reject(id.raw(), std::ptr::null(), 0) };
        }
        // Then `id` (already None or dropped above) goes before `ch`, by field order.
    }
}

#[cfg(test)]
mod tests {
    use super::agree_rd_atom;

    /// Each depth is the smaller of this side's limit and what the connecting side offered.
    #[test]
    fn the_read_depths_are_the_smaller_of_both_sides() {
        assert_eq!(agree_rd_atom((16, 16), (4, 8)), (4, 8));
        assert_eq!(agree_rd_atom((2, 128), (16, 16)), (2, 16));
        assert_eq!(agree_rd_atom((16, 16), (0, 0)), (0, 0));
    }
}
