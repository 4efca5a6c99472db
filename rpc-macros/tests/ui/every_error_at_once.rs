// The macro reports every problem in one pass, not only the first.
#[rdma_rpc_macros::service]
trait Messy {
    fn sync(&self);
    async fn mutates(&mut self);
    async fn no_receiver(x: u32);
    async fn defaulted(&self) -> u32 {
        1
    }
    const LIMIT: u32;
}

fn main() {}
