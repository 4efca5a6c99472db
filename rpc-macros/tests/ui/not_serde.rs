struct NotSerde;

#[rdma_rpc_macros::service]
trait Store {
    async fn put(&self, key: u32, value: NotSerde) -> u32;
    async fn get(&self, key: u32) -> NotSerde;
}

fn main() {}
