#[rdma_rpc_macros::service]
trait Greeter {
    async fn greet(&self, name: &str) -> String;
}

fn main() {}
