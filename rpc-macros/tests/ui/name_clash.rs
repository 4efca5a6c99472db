#[rdma_rpc_macros::service]
trait Session {
    async fn connect(&self, user: String) -> bool;
}

fn main() {}
