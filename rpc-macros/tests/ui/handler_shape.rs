// A raw handler whose answer is not one the server can send, and one whose argument is not a
// request type: each error names the handler and what it should look like.
use renamed_rpc::{Config, RpcError, Server};

fn main() {
    let _ = Server::builder(Config::default())
        .handler(1, |req: Vec<u8>| async move { Ok::<_, RpcError>(String::from_utf8_lossy(&req).into_owned()) })
        .handler(2, |req: String| async move { Ok::<_, RpcError>(req.into_bytes()) })
        .handler_sync(3, |req: &[u8]| Ok::<_, RpcError>(req.to_vec()));
}
