//! The server: the table in registered memory (remote read only), the RPC service that
//! changes it, and the endpoint where clients connect queue pairs to read it one-sided, or to
//! PUT by RDMA Write with immediate (`writes.rs`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdma_rpc::transport::{AccessFlags, CompletionQueue, Device, Listener, MemoryRegion, ProtectionDomain, QpOptions};

use crate::common;
use crate::layout::{self, Entry, SlotRead, BUCKETS, ENTRY, INDEX_BYTES, MAX_KV, PROBE, SLOT, SLOTS, VALUES_BYTES};
use crate::service::Kv;
use crate::writes::{self, Writers};

/// The table and its one-sided endpoint.
pub struct Table {
    inner: Mutex<Inner>,
    /// A pause between the steps of a slot update (to show that torn reads are caught).
    torn_window: Duration,
    port: u16,
}

struct Inner {
    index: MemoryRegion,
    values: MemoryRegion,
    free: Vec<u32>,
    version: u64,
}

/// Where a key is, or may go.
enum Found {
    At { bucket: usize, entry: Entry },
    Free { bucket: usize },
    Full,
}

impl Inner {
    fn entry(&self, bucket: usize) -> Option<Entry> {
        let b = self.index.bytes();
        Entry::decode(&b[bucket * ENTRY..(bucket + 1) * ENTRY]).ok().flatten()
    }

    fn slot_key_is(&self, slot: u32, key: &[u8]) -> bool {
        let b = self.values.bytes();
        let at = slot as usize * SLOT;
        matches!(layout::decode_slot(&b[at..at + SLOT]), SlotRead::Value { key: k, .. } if k == key)
    }

    fn find(&self, key: &[u8]) -> Found {
        let hash = layout::key_hash(key);
        let mut free = None;
        for bucket in layout::home(hash)..layout::home(hash) + PROBE {
            match self.entry(bucket) {
                Some(e) if e.live && e.hash == hash && self.slot_key_is(e.slot, key) => {
                    return Found::At { bucket, entry: e }
                }
                Some(e) if e.live => {}
                _ => {
                    free.get_or_insert(bucket);
                }
            }
        }
        free.map_or(Found::Full, |bucket| Found::Free { bucket })
    }

    fn write_entry(&mut self, bucket: usize, e: Entry) -> common::Result<()> {
        self.index.write_at(bucket * ENTRY, &e.encode())?;
        Ok(())
    }
}

impl Table {
    /// Registers the table in `pd` and starts accepting one-sided readers on `ip`.
    pub fn new(
        device: &Device,
        pd: &ProtectionDomain,
        ip: std::net::IpAddr,
        torn_window: Duration,
    ) -> common::Result<Arc<Self>> {
        let index = pd.register(INDEX_BYTES, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
        let values = pd.register(VALUES_BYTES, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
        let private = postcard::to_allocvec(&(index.remote(), values.remote()))?;
        let listener = Listener::bind(device, SocketAddr::new(ip, 0))?;
        let port = listener.local_addr()?.port();
        let (pd, cq) = (pd.clone(), device.create_cq(64)?);
        let writers = Writers::new(device)?;
        let w = writers.clone();
        std::thread::spawn(move || keep_accepting(listener, pd, cq, private, &w));
        let table = Arc::new(Self {
            inner: Mutex::new(Inner {
                index,
                values,
                free: (0..SLOTS as u32).rev().collect(),
                version: 0,
            }),
            torn_window,
            port,
        });
        tokio::spawn(writers.serve(table.clone()));
        Ok(table)
    }

    /// Sets `key` to `value`, as the RPC `put` and a PUT by Write-with-immediate both do.
    pub fn put_now(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        if key.len() + value.len() > MAX_KV {
            return Err(format!(
                "key and value take {} bytes; a slot holds {MAX_KV}",
                key.len() + value.len()
            ));
        }
        let mut t = self.lock();
        t.version += 1;
        let version = t.version;
        let (bucket, slot) = match t.find(key) {
            Found::At { bucket, entry } => (bucket, entry.slot),
            Found::Free { bucket } => (bucket, t.free.pop().ok_or("the table is full")?),
            Found::Full => return Err(format!("all {PROBE} buckets of this key are taken")),
        };
        // In place and in steps, as a CPU writes: body, then header. A reader in between
        // sees a sum that does not match.
        let bytes = layout::encode_slot(version, key, value);
        let at = slot as usize * SLOT;
        t.values.write_at(at + 16, &bytes[16..]).map_err(|e| e.to_string())?;
        self.pause();
        t.values.write_at(at, &bytes[..16]).map_err(|e| e.to_string())?;
        let entry = Entry {
            hash: layout::key_hash(key),
            slot,
            live: true,
            version,
        };
        t.write_entry(bucket, entry).map_err(|e| e.to_string())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pause(&self) {
        if !self.torn_window.is_zero() {
            std::thread::sleep(self.torn_window);
        }
    }
}

impl Kv for Table {
    async fn get(&self, key: Vec<u8>) -> Option<Vec<u8>> {
        let t = self.lock();
        match t.find(&key) {
            Found::At { entry, .. } => {
                let b = t.values.bytes();
                let at = entry.slot as usize * SLOT;
                match layout::decode_slot(&b[at..at + SLOT]) {
                    SlotRead::Value { value, .. } => Some(value.to_vec()),
                    SlotRead::Torn => None, // not while we hold the lock
                }
            }
            _ => None,
        }
    }

    async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), String> {
        self.put_now(&key, &value)
    }

    async fn delete(&self, key: Vec<u8>) -> bool {
        let mut t = self.lock();
        let Found::At { bucket, entry } = t.find(&key) else {
            return false;
        };
        t.version += 1;
        let dead = Entry {
            live: false,
            version: t.version,
            ..entry
        };
        if t.write_entry(bucket, dead).is_err() {
            return false;
        }
        t.free.push(entry.slot);
        true
    }

    async fn one_sided_port(&self) -> u16 {
        self.port
    }

    async fn cpu_time_us(&self) -> u64 {
        common::process_cpu_time().as_micros() as u64
    }
}

const _: () = assert!(BUCKETS % PROBE == 0);

/// Accepts connections forever on the one-sided endpoint: readers (their queue pairs kept
/// open; the table's regions in the answer) and writers (`writes.rs`).
fn keep_accepting(listener: Listener, pd: ProtectionDomain, cq: CompletionQueue, private: Vec<u8>, writers: &Writers) {
    let mut readers = Vec::new();
    loop {
        let req = match listener.accept(None) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("the one-sided endpoint failed: {e}");
                return;
            }
        };
        let r = if req.private_data() == writes::HELLO {
            writers.accept(req)
        } else {
            req.accept(&QpOptions::new(&pd, &cq), &private)
                .map(|qp| readers.push(qp))
                .map_err(Into::into)
        };
        if let Err(e) = r {
            eprintln!("a peer failed to connect: {e}");
        }
    }
}
