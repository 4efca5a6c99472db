//! What generated code calls to encode and decode calls: postcard for arguments and results,
//! raw bytes for a [`Bulk`] argument or result. Not a public API (`rdma_rpc::__private`).
//!
//! A request with a bulk argument is laid out `bulk bytes ‖ postcard(other args) ‖ u64 LE
//! length of the bulk bytes`, so the receiver splits it without copying the bulk part.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Bulk, RpcError};

const TRAILER: usize = 8;

/// Encodes the arguments (a tuple of references).
pub fn encode_args<T: Serialize>(args: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    postcard::to_allocvec(args).map_err(|e| RpcError::Encode(format!("arguments of {method}: {e}")))
}

/// Encodes a bulk argument and the others.
pub fn encode_args_bulk<T: Serialize>(bulk: Bulk, args: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    let mut out = bulk.into_vec();
    let len = out.len() as u64;
    out = postcard::to_extend(args, out).map_err(|e| RpcError::Encode(format!("arguments of {method}: {e}")))?;
    out.extend_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Decodes the arguments; every byte must be used.
pub fn decode_args<T: DeserializeOwned>(request: &[u8], method: &str) -> Result<T, RpcError> {
    exact(request).map_err(|e| RpcError::BadRequest(format!("arguments of {method}: {e}")))
}

/// Splits off and decodes the arguments of a request with a bulk argument.
pub fn decode_args_bulk<T: DeserializeOwned>(mut request: Vec<u8>, method: &str) -> Result<(Bulk, T), RpcError> {
    let bad = |what: &str| RpcError::BadRequest(format!("arguments of {method}: {what}"));
    let body = request
        .len()
        .checked_sub(TRAILER)
        .ok_or_else(|| bad("shorter than its trailer"))?;
    let mut n = [0u8; TRAILER];
    n.copy_from_slice(&request[body..]);
    let bulk_len = usize::try_from(u64::from_le_bytes(n))
        .ok()
        .filter(|&l| l <= body)
        .ok_or_else(|| bad("bulk length beyond the request"))?;
    let args = exact(&request[bulk_len..body]).map_err(|e| bad(&e.to_string()))?;
    request.truncate(bulk_len);
    Ok((Bulk::from(request), args))
}

/// Encodes a handler's result (server side).
pub fn encode_ret<T: Serialize>(ret: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    postcard::to_allocvec(ret).map_err(|e| RpcError::Internal(format!("could not encode the result of {method}: {e}")))
}

/// Decodes a result (client side).
pub fn decode_ret<T: DeserializeOwned>(response: &[u8], method: &str) -> Result<T, RpcError> {
    exact(response).map_err(|e| {
        RpcError::Protocol(format!(
            "the result of {method} did not decode ({e}): is the server running the same service version?"
        ))
    })
}

fn exact<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    match postcard::take_from_bytes(bytes)? {
        (v, []) => Ok(v),
        (_, _) => Err(postcard::Error::DeserializeBadEncoding),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_requests_split_back_into_their_parts() {
        let req = encode_args_bulk(Bulk::from(vec![7u8; 100]), &(&5u32, &"x".to_string()), "S.m").expect("encode");
        let (bulk, (a, b)): (Bulk, (u32, String)) = decode_args_bulk(req, "S.m").expect("decode");
        assert_eq!((bulk.len(), a, b.as_str()), (100, 5, "x"));
    }

    #[test]
    fn bad_requests_are_errors_not_panics() {
        for req in [vec![], vec![1, 2, 3], vec![0xff; 8], 1000u64.to_le_bytes().to_vec()] {
            assert!(matches!(
                decode_args_bulk::<(u32,)>(req, "S.m"),
                Err(RpcError::BadRequest(_))
            ));
        }
        assert!(matches!(
            decode_args::<(u8,)>(&[1, 2], "S.m"),
            Err(RpcError::BadRequest(_))
        ));
        assert!(matches!(
            decode_args::<(String,)>(&[200], "S.m"),
            Err(RpcError::BadRequest(_))
        ));
    }
}
