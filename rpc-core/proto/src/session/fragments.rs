//! Joining a long message from its pieces.

use super::*;

impl Session {
    /// Adds a piece to the message being joined; the header and whole body once complete.
    pub(super) fn join(&mut self, h: &Header, body: &[u8]) -> Result<Option<(Header, Vec<u8>)>, ProtoError> {
        let (pre, piece) = body
            .split_first_chunk::<FRAG_PREFIX>()
            .ok_or(ProtoError::BadFragment("no prefix"))?;
        let total = u32::from_le_bytes([pre[0], pre[1], pre[2], pre[3]]) as usize;
        let off = u32::from_le_bytes([pre[4], pre[5], pre[6], pre[7]]) as usize;
        if piece.is_empty() || piece.len() > self.cfg.piece() {
            return Err(ProtoError::BadFragment("piece length"));
        }
        let j = match &mut self.joining {
            Some(j) => {
                if (j.header.kind, j.header.call_id, j.total) != (h.kind, h.call_id, total) || off != j.body.len() {
                    return Err(ProtoError::BadFragment(
                        "not the next piece of the message being joined",
                    ));
                }
                j
            }
            None => {
                if off != 0 || !matches!(h.kind, Kind::Request | Kind::Response) {
                    return Err(ProtoError::BadFragment("not the first piece of a request or response"));
                }
                if total <= self.cfg.piece() || total > self.joined_max(h.kind) {
                    return Err(ProtoError::BadFragment("message length"));
                }
                let header = Header {
                    flags: h.flags & !FLAG_FRAGMENT,
                    body_len: total as u32,
                    ..*h
                };
                // The length is within the configuration's maximum; the allocator may still
                // refuse it, which ends this connection rather than the process.
                let mut body = Vec::new();
                body.try_reserve_exact(total).map_err(|_| ProtoError::NoMemory(total))?;
                self.joining.insert(Joining { header, total, body })
            }
        };
        if j.body.len() + piece.len() > j.total {
            return Err(ProtoError::BadFragment("pieces longer than the message"));
        }
        j.body.extend_from_slice(piece);
        if j.body.len() < j.total {
            return Ok(None);
        }
        Ok(self.joining.take().map(|j| (j.header, j.body)))
    }
}
