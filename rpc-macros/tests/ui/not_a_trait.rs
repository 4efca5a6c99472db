#[rdma_rpc_macros::service]
struct Echo {
    prefix: String,
}

fn main() {}
