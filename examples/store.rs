//! The README's example: a typed service and its client in one process.

use rdma_rpc::{service, transport::Device, Bulk, CallOptions, Config};
use serde::{Deserialize, Serialize};
use std::{collections::HashMap, sync::Mutex, time::Duration};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum StoreError {
    Missing(String),
}

/// A tiny store: every argument and result is any serde type; a `Bulk` is raw bytes that move
/// by RDMA Read or Write-with-immediate when large.
#[service]
trait Store {
    async fn put(&self, key: String, value: u64);
    async fn get(&self, key: String) -> Result<u64, StoreError>;
    async fn upload(&self, name: String, data: Bulk) -> usize;
}

#[derive(Default)]
struct Memory(Mutex<HashMap<String, u64>>);

impl Store for Memory {
    async fn put(&self, key: String, value: u64) {
        self.0.lock().expect("not poisoned").insert(key, value);
    }
    async fn get(&self, key: String) -> Result<u64, StoreError> {
        let map = self.0.lock().expect("not poisoned");
        map.get(&key).copied().ok_or(StoreError::Missing(key))
    }
    async fn upload(&self, _name: String, data: Bulk) -> usize {
        data.len()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The provider named by RDMA_RPC_PROVIDER: tcp (the default), shm or verbs.
    let dev = Device::open_default()?;
    let server = StoreServer::new(Memory::default()).bind(&dev, "127.0.0.1:0".parse()?, Config::default())?;
    let addr = server.local_addr()?;
    tokio::spawn(server.serve());

    let store = StoreClient::connect(&dev, addr, Config::default()).await?;
    store.put("a".into(), 1).await?; // Result<(), RpcError>
    assert_eq!(store.get("a".into()).await?, Ok(1)); // the service's own error inside
    assert_eq!(store.get("b".into()).await?, Err(StoreError::Missing("b".into())));
    assert_eq!(store.upload("blob".into(), vec![7u8; 1 << 20].into()).await?, 1 << 20);

    // A handle whose calls all carry a deadline.
    let options = CallOptions::default().deadline(Duration::from_secs(1));
    assert_eq!(store.with_options(options).get("a".into()).await?, Ok(1));
    println!("store: every call answered on {}", dev.provider());
    Ok(())
}
