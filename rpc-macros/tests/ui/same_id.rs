#[rdma_rpc_macros::service]
trait Counter {
    #[rpc(id = 7)]
    async fn incr(&self) -> u64;
    #[rpc(id = 7)]
    async fn decr(&self) -> u64;
}

fn main() {}
