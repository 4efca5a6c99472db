#[rdma_rpc_macros::service]
trait Echo {
    fn echo(&self, s: String) -> String;
}

fn main() {}
