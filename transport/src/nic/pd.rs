//! The software NIC's protection domain: the region table its responders check remote keys
//! against, with keys no peer can guess.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;

use crate::mr::Region;

/// A software protection domain: the region table its QPs' responders check remote keys against.
pub(crate) struct Pd {
    regions: RwLock<HashMap<u32, Weak<Region>>>,
}

impl Pd {
    pub(crate) fn new() -> Self {
        Self {
            regions: RwLock::new(HashMap::new()),
        }
    }

    /// A random rkey not in use here (and a random lkey). Sequential keys would let a peer guess.
    pub(crate) fn fresh_keys(&self) -> (u32, u32) {
        let table = self.regions.read();
        loop {
            let rkey = random_u32();
            if rkey != 0 && !table.contains_key(&rkey) {
                return (random_u32(), rkey);
            }
        }
    }

    pub(crate) fn register(&self, region: &Arc<Region>) {
        self.regions.write().insert(region.rkey, Arc::downgrade(region));
    }

    pub(crate) fn deregister(&self, rkey: u32, _lkey: u32) {
        self.regions.write().remove(&rkey);
    }

    pub(crate) fn lookup(&self, rkey: u32) -> Option<Arc<Region>> {
        self.regions.read().get(&rkey).and_then(Weak::upgrade)
    }
}

pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // getrandom fails only without any OS entropy source; fall back to a hash of the time.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x9e37_79b9);
        return t.wrapping_mul(0x9e37_79b9);
    }
    u32::from_ne_bytes(b)
}
