#[rdma_rpc_macros::service]
trait Geometry {
    async fn area(&self, (w, h): (u32, u32)) -> u64;
}

fn main() {}
