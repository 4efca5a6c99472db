//! Stable method ids: FNV-1a (32 bit) of `Trait.method`, unless `#[rpc(id = N)]` says otherwise.

/// The id of `method` in the service `service`.
pub(crate) fn derived(service: &str, method: &str) -> u32 {
    fnv1a(format!("{service}.{method}").as_bytes())
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .fold(0x811c_9dc5, |h: u32, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
mod tests {
    use super::{derived, fnv1a};

    #[test]
    fn fnv1a_matches_the_published_vectors() {
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
        assert_eq!(derived("foo", "bar"), fnv1a(b"foo.bar"));
    }
}
