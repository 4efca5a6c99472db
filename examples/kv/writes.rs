//! PUTs by RDMA Write with immediate: a writer connects a queue pair of its own to the
//! server's one-sided endpoint and gets `WINDOW` landing slots, registered for it alone (in a
//! protection domain of its own, so no other peer's key reaches them). A PUT writes the slot's
//! bytes (`layout::encode_slot`) into landing slot `i` with immediate `i`; the server's CPU sees
//! one receive completion, checks the bytes' sum, updates the table as an RPC `put` does, and
//! answers with a zero-byte Send whose immediate is `i`, plus [`REFUSED`] when it refused the
//! PUT. No request is parsed, no RPC machinery runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdma_rpc::transport::{
    AccessFlags, Completion, CompletionQueue, ConnectRequest, Device, MemoryRegion, ProtectionDomain, QpOptions,
    QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
};

use crate::common;
use crate::layout::{self, SlotRead, SLOT};
use crate::server::Table;

/// Landing slots per writer: PUTs one writer may have in flight.
pub const WINDOW: u32 = 16;
/// The private data a writer connects with.
pub const HELLO: &[u8] = b"kv-writer";
/// Set in an answer's immediate when the PUT was refused (torn bytes, full table).
pub const REFUSED: u32 = 1 << 31;

/// Receive work requests of a writer's queue pair: one per landing slot.
const RECV: u64 = 1 << 40;

/// A writer's queue pair and landing slots.
struct Writer {
    qp: QueuePair,
    landing: MemoryRegion,
    _pd: ProtectionDomain,
}

/// The writers, by queue pair number, and the one CQ their completions go to.
pub struct Writers {
    by_qp: Mutex<HashMap<u32, Writer>>,
    cq: CompletionQueue,
    device: Device,
    /// A writer was filed: completions that came before it can be handled now.
    filed: tokio::sync::Notify,
}

impl Writers {
    pub fn new(device: &Device) -> common::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            by_qp: Mutex::new(HashMap::new()),
            cq: device.create_cq(4096)?,
            device: device.clone(),
            filed: tokio::sync::Notify::new(),
        }))
    }

    /// Accepts a writer: its own protection domain, landing slots and receives; the answer's
    /// private data is where the slots are.
    pub fn accept(&self, req: ConnectRequest) -> common::Result<()> {
        let pd = self.device.alloc_pd()?;
        let landing = pd.register(
            WINDOW as usize * SLOT,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        let recvs = (0..u64::from(WINDOW))
            .map(|i| Ok(RecvWr::new(RECV | i, pd.register(8, AccessFlags::LOCAL_WRITE)?)))
            .collect::<common::Result<Vec<_>>>()?;
        let private = common::region_bytes(&landing.remote())?;
        let opts = QpOptions::new(&pd, &self.cq);
        // Known before the answer leaves: the writer's first PUT finds it.
        let qp = req.accept_with_recvs(&opts, &private, recvs)?;
        let num = qp.qp_num();
        self.by_qp
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(num, Writer { qp, landing, _pd: pd });
        self.filed.notify_one();
        Ok(())
    }

    /// Applies the writers' PUTs as their completions come, for ever.
    pub async fn serve(self: Arc<Self>, table: Arc<Table>) {
        let mut got = Vec::new();
        // Completions of writers whose queue pair `accept` had not filed yet.
        let mut early: Vec<Completion> = Vec::new();
        loop {
            got.clear();
            // Poll a while before sleeping: a writer waits for this loop's answer, and a
            // wake-up costs more than most PUTs take.
            let until = std::time::Instant::now() + std::time::Duration::from_micros(200);
            while got.is_empty() && early.is_empty() && std::time::Instant::now() < until {
                if let Err(e) = self.cq.poll(&mut got, 64) {
                    eprintln!("the writers' CQ failed: {e}");
                    return;
                }
                std::hint::spin_loop();
            }
            if got.is_empty() {
                tokio::select! {
                r = self.cq.wait(&mut got, 64) => {
                    if let Err(e) = r {
                        eprintln!("the writers' CQ failed: {e}");
                        return;
                    }
                }
                () = self.filed.notified(), if !early.is_empty() => {}
                }
            }
            got.append(&mut early);
            for c in got.drain(..) {
                if let Some(c) = self.handle(c, &table) {
                    early.push(c);
                }
            }
        }
    }

    /// Handles one completion; gives it back when its writer is not filed yet.
    fn handle(&self, c: Completion, table: &Table) -> Option<Completion> {
        let mut writers = self.by_qp.lock().unwrap_or_else(|p| p.into_inner());
        let Some(w) = writers.get(&c.qp_num) else {
            return (c.wr_id & RECV != 0).then_some(c);
        };
        if !c.status.is_success() {
            // The writer went away (or broke its queue pair): forget it.
            writers.remove(&c.qp_num);
            return None;
        }
        if c.opcode != WcOpcode::RecvRdmaWithImm {
            return None; // an answer's Send completed
        }
        let i = c.imm.unwrap_or(u32::MAX);
        let refused = if i < WINDOW {
            let at = i as usize * SLOT;
            // This slot alone, not a copy of all the writer's landing slots.
            match w.landing.bytes_at(at..at + SLOT) {
                Err(_) => true,
                Ok(bytes) => match layout::decode_slot(&bytes) {
                    SlotRead::Value { key, value } => table.put_now(key, value).is_err(),
                    SlotRead::Torn => true,
                },
            }
        } else {
            true
        };
        let answer = (i % WINDOW) | if refused { REFUSED } else { 0 };
        // The slot's receive goes back before the answer, which lets the writer reuse it.
        let ok = c.buf.is_some_and(|b| w.qp.post_recv(RecvWr::new(c.wr_id, b)).is_ok())
            && w.qp
                .post_send(SendWr::new(0, SendOp::Send { imm: Some(answer) }))
                .is_ok();
        if !ok {
            writers.remove(&c.qp_num);
        }
        None
    }
}
