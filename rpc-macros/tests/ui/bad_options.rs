#[rdma_rpc_macros::service(krate = "x")]
trait Opts {
    #[rpc(name = "y")]
    async fn a(&self);
}

fn main() {}
