#[rdma_rpc_macros::service]
trait Log {
    async fn append(&self, lines: impl Iterator<Item = String>);
}

fn main() {}
