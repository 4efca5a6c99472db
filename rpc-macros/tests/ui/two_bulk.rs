use rdma_rpc_macros::service;

pub struct Bulk;

#[service]
trait Diff {
    async fn diff(&self, old: Bulk, new: Bulk) -> u64;
}

fn main() {}
