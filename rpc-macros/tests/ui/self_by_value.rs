#[rdma_rpc_macros::service]
trait Worker {
    async fn finish(self) -> u64;
}

fn main() {}
