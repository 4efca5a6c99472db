//! What generated code calls to encode and decode calls: postcard for arguments and results,
//! raw bytes for a [`Bulk`] argument or result. Not a public API (`rdma_rpc::__private`).
//!
//! A request with a bulk argument is laid out `bulk bytes ‖ postcard(other args) ‖ u64 LE
//! length of the bulk bytes`, so the receiver splits it without copying the bulk part. The
//! caller never joins the two: the bulk goes as it is (lent when large) and the rest as the
//! request's tail ([`end_bulk`], `Client::call_bulk_tail`).

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::core::TypedAnswer;
use crate::{Body, Bulk, RpcError};

const TRAILER: usize = 8;

/// Encodes the arguments (a tuple of references).
pub fn encode_args<T: Serialize>(args: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    postcard::to_allocvec(args).map_err(|e| RpcError::Encode(format!("arguments of {method}: {e}")))
}

/// Encodes a bulk argument and the others, joined (the layout a server reads).
pub fn encode_args_bulk<T: Serialize>(bulk: Bulk, args: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    let len = bulk.len() as u64;
    let mut out = bulk.into_vec();
    out = postcard::to_extend(args, out).map_err(|e| RpcError::Encode(format!("arguments of {method}: {e}")))?;
    out.extend_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Decodes the arguments; every byte must be used.
pub fn decode_args<T: DeserializeOwned>(request: &[u8], method: &str) -> Result<T, RpcError> {
    exact(request).map_err(|e| RpcError::BadRequest(format!("arguments of {method}: {e}")))
}

/// Splits off and decodes the arguments of a request with a bulk argument; the bulk stays
/// where the request is.
pub fn decode_args_bulk<T: DeserializeOwned>(request: Body, method: &str) -> Result<(Bulk, T), RpcError> {
    let (bulk_len, args) = {
        let bytes = request.bytes();
        let (bulk_len, end) = bulk_layout(&bytes, method)?;
        let args =
            exact(&bytes[bulk_len..end]).map_err(|e| RpcError::BadRequest(format!("arguments of {method}: {e}")))?;
        (bulk_len, args)
    };
    Ok((into_bulk(request, bulk_len), args))
}

// One argument at a time, for generated code: postcard lays a tuple out as its fields one
// after the other, so these make the same bytes as `encode_args` and read what `decode_args`
// reads. The macro calls each at its argument's type, so that a type without serde's traits
// is reported at the argument, not at the macro.

/// Appends argument `arg` to the request being built.
pub fn push_arg<T: Serialize>(out: Vec<u8>, arg: &T, method: &str) -> Result<Vec<u8>, RpcError> {
    postcard::to_extend(arg, out).map_err(|e| RpcError::Encode(format!("arguments of {method}: {e}")))
}

/// Ends the tail of a request with a bulk argument of `bulk_len` bytes (the other arguments,
/// pushed to `out`): its trailer.
pub fn end_bulk(mut out: Vec<u8>, bulk_len: usize) -> Vec<u8> {
    out.extend_from_slice(&(bulk_len as u64).to_le_bytes());
    out
}

/// Takes the next argument off `rest`.
pub fn take_arg<T: DeserializeOwned>(rest: &mut &[u8], method: &str) -> Result<T, RpcError> {
    let (v, left) =
        postcard::take_from_bytes(rest).map_err(|e| RpcError::BadRequest(format!("arguments of {method}: {e}")))?;
    *rest = left;
    Ok(v)
}

/// Checks that every byte of the arguments was used.
pub fn end_args(rest: &[u8], method: &str) -> Result<(), RpcError> {
    if rest.is_empty() {
        return Ok(());
    }
    Err(RpcError::BadRequest(format!(
        "arguments of {method}: {} bytes after the last argument",
        rest.len()
    )))
}

/// Where the other arguments of a request with a bulk argument are: `bulk_len..end`.
pub fn bulk_layout(request: &[u8], method: &str) -> Result<(usize, usize), RpcError> {
    let bad = |what: &str| RpcError::BadRequest(format!("arguments of {method}: {what}"));
    let end = request
        .len()
        .checked_sub(TRAILER)
        .ok_or_else(|| bad("shorter than its trailer"))?;
    let mut n = [0u8; TRAILER];
    n.copy_from_slice(&request[end..]);
    let bulk_len = usize::try_from(u64::from_le_bytes(n))
        .ok()
        .filter(|&l| l <= end)
        .ok_or_else(|| bad("bulk length beyond the request"))?;
    Ok((bulk_len, end))
}

/// The bulk argument: the request's first `bulk_len` bytes (as [`bulk_layout`] found them),
/// where the request is.
pub fn into_bulk(request: Body, bulk_len: usize) -> Bulk {
    let whole = Bulk::from(request);
    let len = bulk_len.min(whole.len());
    whole.slice(0..len).unwrap_or_default()
}

/// A handler's result as the response, encoded (a `Bulk` result goes as it is instead).
pub fn encode_answer<T: Serialize>(ret: &T, method: &str) -> Result<TypedAnswer, RpcError> {
    encode_ret(ret, method).map(TypedAnswer::Bytes)
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
        let (bulk, (a, b)): (Bulk, (u32, String)) = decode_args_bulk(Body::Bytes(req), "S.m").expect("decode");
        assert_eq!((bulk.len(), a, b.as_str()), (100, 5, "x"));
    }

    #[test]
    fn bad_requests_are_errors_not_panics() {
        for req in [vec![], vec![1, 2, 3], vec![0xff; 8], 1000u64.to_le_bytes().to_vec()] {
            assert!(matches!(
                decode_args_bulk::<(u32,)>(Body::Bytes(req), "S.m"),
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

    #[test]
    fn arguments_one_at_a_time_make_and_read_the_bytes_of_the_tuple() {
        let whole = encode_args(&(&5u32, &"x".to_string(), &vec![1u16, 2]), "S.m").expect("encode");
        let out = push_arg(Vec::new(), &5u32, "S.m").expect("a");
        let out = push_arg(out, &"x".to_string(), "S.m").expect("b");
        let out = push_arg(out, &vec![1u16, 2], "S.m").expect("c");
        assert_eq!(out, whole);
        let mut rest: &[u8] = &whole;
        let a: u32 = take_arg(&mut rest, "S.m").expect("a");
        let b: String = take_arg(&mut rest, "S.m").expect("b");
        let c: Vec<u16> = take_arg(&mut rest, "S.m").expect("c");
        end_args(rest, "S.m").expect("all used");
        assert_eq!((a, b.as_str(), c), (5, "x", vec![1, 2]));
        // With a bulk argument: the same layout as `encode_args_bulk`.
        let whole = encode_args_bulk(Bulk::from(vec![7u8; 10]), &(&5u32,), "S.m").expect("encode");
        let tail = end_bulk(push_arg(Vec::new(), &5u32, "S.m").expect("a"), 10);
        assert_eq!([vec![7u8; 10], tail].concat(), whole);
        let (bulk_len, end) = bulk_layout(&whole, "S.m").expect("layout");
        let mut rest: &[u8] = &whole[bulk_len..end];
        assert_eq!(take_arg::<u32>(&mut rest, "S.m"), Ok(5));
        end_args(rest, "S.m").expect("all used");
        assert_eq!(into_bulk(Body::Bytes(whole), bulk_len).to_vec(), [7u8; 10]);
        // Bytes left over, or too few, are the caller's fault.
        assert!(matches!(end_args(&[0], "S.m"), Err(RpcError::BadRequest(_))));
        assert!(matches!(
            take_arg::<u64>(&mut &[0xff][..], "S.m"),
            Err(RpcError::BadRequest(_))
        ));
        assert!(matches!(bulk_layout(&[1, 2], "S.m"), Err(RpcError::BadRequest(_))));
    }
}
