//! Provider `verbs`: real libibverbs + librdmacm through `rdma-sys` (ConnectX, soft-RoCE rxe, ...).
//!
//! This module and the shared-memory provider are the only places with `unsafe`; every block
//! says why it holds. Object lifetimes follow verbs' rules through ownership: a region keeps its
//! PD alive, a QP keeps its PD and CQs alive, and a QP is destroyed before its CQs.

mod cm;
mod cq;
mod provider;
mod qp;
mod srq;

use std::ffi::CStr;
use std::io;
use std::ptr::NonNull;

use rdma_sys::*;

use crate::{AccessFlags, DeviceCaps, Error, Result};

/// The switch point a NIC suggests ([`DeviceCaps::eager_hint`]): above it an RDMA Read moves the
/// bytes and spares both CPUs the copies.
const EAGER_HINT: usize = 16 * 1024;

use cq::Cq;
use qp::Qp;
use srq::Srq;

fn last_os_error(call: &'static str) -> Error {
    Error::Verbs {
        call,
        source: io::Error::last_os_error(),
    }
}

/// Maps a verbs return code (0 or errno / -errno) to a result.
fn check(call: &'static str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(Error::Verbs {
            call,
            source: io::Error::from_raw_os_error(rc),
        }),
        _ => Err(last_os_error(call)),
    }
}

/// An opened device: librdmacm's context for it, so that rdma_cm ids and our PDs and CQs meet.
pub(crate) struct Context {
    ctx: NonNull<ibv_context>,
    list: NonNull<*mut ibv_context>,
    name: String,
    caps: DeviceCaps,
    pub(crate) max_rd_atom: u8,
    pub(crate) max_init_rd_atom: u8,
    /// The device's async events (SRQ limit events).
    pub(crate) events: srq::AsyncEvents,
}

// SAFETY: libibverbs contexts are thread-safe (verbs are documented as callable from any thread),
// and the pointers stay valid until `Drop`.
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` only passes the pointer to thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn open(want: Option<&str>) -> Result<Self> {
        let wanted = want.unwrap_or("any").to_owned();
        let mut n: i32 = 0;
        // SAFETY: rdma_get_devices writes the count and returns a NULL-terminated array that we
        // own until rdma_free_devices (in Drop, or below on failure).
        let list = unsafe { rdma_get_devices(&mut n) };
        let Some(list) = NonNull::new(list) else {
            return Err(Error::NoDevice {
                wanted,
                detail: format!("rdma_get_devices: {}", io::Error::last_os_error()),
            });
        };
        let mut found = None;
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n, the array has n valid entries.
            let ctx = unsafe { *list.as_ptr().add(i) };
            let Some(ctx) = NonNull::new(ctx) else { continue };
            // SAFETY: ctx is a live context; its device pointer and name are valid C strings.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name((*ctx.as_ptr()).device)) }
                .to_string_lossy()
                .into_owned();
            if found.is_none() && want.is_none_or(|w| w == name) {
                found = Some((ctx, name.clone()));
            }
            names.push(name);
        }
        let Some((ctx, name)) = found else {
            // SAFETY: list came from rdma_get_devices and is freed once.
            unsafe { rdma_free_devices(list.as_ptr()) };
            let detail = if names.is_empty() {
                "no RDMA devices".to_owned()
            } else {
                format!("devices present: {}", names.join(", "))
            };
            return Err(Error::NoDevice { wanted, detail });
        };
        let mut this = Self {
            ctx,
            list,
            name,
            caps: DeviceCaps {
                max_inline_data: 0,
                max_msg_size: 0,
                atomics: false,
                max_qp_wr: 0,
                max_cqe: 0,
                max_mr_size: 0,
                eager_hint: EAGER_HINT,
                progress_threads: false,
                cheap_registration: false,
            },
            max_rd_atom: 0,
            max_init_rd_atom: 0,
            events: srq::AsyncEvents::default(),
        };
        this.query()?;
        Ok(this)
    }

    fn query(&mut self) -> Result<()> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is live and attr is a valid out-pointer.
        check("ibv_query_device", unsafe {
            ibv_query_device(self.ctx.as_ptr(), &mut attr)
        })?;
        // SAFETY: ibv_port_attr is plain old data.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: port 1 exists on every device; port is a valid out-pointer.
        check("ibv_query_port", unsafe {
            ___ibv_query_port(self.ctx.as_ptr(), 1, &mut port)
        })?;
        self.caps = DeviceCaps {
            max_inline_data: 0,
            max_msg_size: u64::from(port.max_msg_sz),
            atomics: attr.atomic_cap != ibv_atomic_cap::IBV_ATOMIC_NONE,
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_mr_size: attr.max_mr_size,
            eager_hint: EAGER_HINT,
            progress_threads: false,
            cheap_registration: false,
        };
        self.max_rd_atom = attr.max_qp_rd_atom.clamp(0, 16) as u8;
        self.max_init_rd_atom = attr.max_qp_init_rd_atom.clamp(0, 16) as u8;
        self.caps.max_inline_data = self.probe_inline()?;
        Ok(())
    }

    /// max_inline_data is a property of QP creation, not of the device: ask for decreasing sizes
    /// on a throw-away QP and keep what the device grants.
    fn probe_inline(&self) -> Result<u32> {
        let pd = Pd::new(self)?;
        let cq = Cq::new(self, 4)?;
        for want in [1024u32, 512, 256, 128, 64, 32, 0] {
            // SAFETY: ibv_qp_init_attr is plain old data.
            let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            init.send_cq = cq.raw();
            init.recv_cq = cq.raw();
            init.cap = ibv_qp_cap {
                max_send_wr: 1,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: want,
            };
            init.qp_type = ibv_qp_type::IBV_QPT_RC;
            // SAFETY: pd and the CQ are live; init is a valid in/out pointer.
            let qp = unsafe { ibv_create_qp(pd.raw(), &mut init) };
            if !qp.is_null() {
                // SAFETY: qp was just created and is destroyed once.
                unsafe { ibv_destroy_qp(qp) };
                return Ok(init.cap.max_inline_data);
            }
        }
        Ok(0)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    pub(crate) fn raw(&self) -> *mut ibv_context {
        self.ctx.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // The contexts themselves belong to librdmacm; only the array is ours.
        // SAFETY: list came from rdma_get_devices and is freed exactly once.
        unsafe { rdma_free_devices(self.list.as_ptr()) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pd: NonNull<ibv_pd>,
}

// SAFETY: PDs are thread-safe verbs objects; the pointer is valid until Drop.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is live.
        let pd = unsafe { ibv_alloc_pd(ctx.raw()) };
        NonNull::new(pd)
            .map(|pd| Self { pd })
            .ok_or_else(|| last_os_error("ibv_alloc_pd"))
    }

    pub(crate) fn raw(&self) -> *mut ibv_pd {
        self.pd.as_ptr()
    }

    /// Registers `len` bytes at `addr`.
    ///
    /// The caller ([`MemoryRegion::register`](crate::MemoryRegion)) owns that memory and keeps
    /// it allocated, unmoved, until the returned `Mr` is dropped (field order in `Region`).
    pub(crate) fn register(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<Mr> {
        // SAFETY: addr..addr+len is memory owned by the caller for longer than the registration
        // (see above); the PD is live.
        let mr = unsafe { ibv_reg_mr(self.raw(), addr.cast(), len, access.bits() as i32) };
        NonNull::new(mr)
            .map(|mr| Mr { mr, gone: false })
            .ok_or_else(|| last_os_error("ibv_reg_mr"))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc to it, so none is left; freed once.
        let rc = unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A memory registration.
pub(crate) struct Mr {
    mr: NonNull<ibv_mr>,
    /// Deregistered already ([`Mr::deregister`]).
    gone: bool,
}

// SAFETY: an ibv_mr is immutable after registration and deregistration happens once, in Drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the mr is live until Drop.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: the mr is live until Drop.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Mr {
    /// Deregisters the memory; `false` when the NIC refused, in which case it may still reach
    /// the memory, which must then never be freed or reused (the caller leaks it).
    pub(crate) fn deregister(&mut self) -> bool {
        if self.gone {
            return true;
        }
        self.gone = true;
        // SAFETY: no work request names this memory any more (each holds the Region); called
        // once (`gone`).
        let rc = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                rc,
                "ibv_dereg_mr failed: the registration's memory is leaked, not freed"
            );
        }
        rc == 0
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.deregister();
    }
}
