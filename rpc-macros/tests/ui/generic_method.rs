#[rdma_rpc_macros::service]
trait Store {
    async fn put<T: serde::Serialize>(&self, value: T);
}

fn main() {}
