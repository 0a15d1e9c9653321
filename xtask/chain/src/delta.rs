//! git's binary delta format (`delta N` hunks of `git diff --binary`, as in pack files).
//!
//! A delta is two varints (the source's size, the target's size), then opcodes: a byte with the
//! 0x80 bit copies a range of the source (bits 0x01-0x08 say which offset bytes follow, 0x10-0x40
//! which size bytes; size 0 means 0x10000), any other non-zero byte inserts that many literal
//! bytes, and 0 is reserved. Every bound is checked: a bad delta is an error, never a panic.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeltaError {
    #[error("the delta is truncated (it ends inside {0})")]
    Truncated(&'static str),
    #[error("a size in the delta header does not fit in 64 bits")]
    SizeOverflow,
    #[error("the delta is for a {expected}-byte source, the file has {found} bytes")]
    SourceSize { expected: u64, found: usize },
    #[error("the delta copies bytes {offset}..{offset}+{size}, past the end of its {len}-byte source")]
    CopyOutOfRange { offset: u64, size: u64, len: usize },
    #[error("the delta holds the reserved opcode 0 at byte {0}")]
    ReservedOpcode(usize),
    #[error("the delta says {expected} bytes, its opcodes make {found}")]
    TargetSize { expected: u64, found: u64 },
}

/// git's header varint: 7 bits a byte, least significant first, 0x80 = more.
fn varint(data: &[u8], pos: &mut usize) -> Result<u64, DeltaError> {
    let mut value = 0u64;
    let mut shift = 0u32;
    loop {
        let b = *data.get(*pos).ok_or(DeltaError::Truncated("the header"))?;
        *pos += 1;
        let bits = u64::from(b & 0x7f);
        if shift >= 64 || (shift > 0 && bits >> (64 - shift) != 0) {
            return Err(DeltaError::SizeOverflow);
        }
        value |= bits << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
    }
}

/// The source size a delta expects.
pub fn source_size(delta: &[u8]) -> Result<u64, DeltaError> {
    varint(delta, &mut 0)
}

/// Applies `delta` to `source`.
pub fn apply(source: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let mut pos = 0;
    let src_size = varint(delta, &mut pos)?;
    if u64::try_from(source.len()).ok() != Some(src_size) {
        return Err(DeltaError::SourceSize { expected: src_size, found: source.len() });
    }
    let dst_size = varint(delta, &mut pos)?;
    // The stated size is not trusted for the allocation; the output grows as the opcodes say.
    let mut out = Vec::with_capacity(usize::try_from(dst_size).unwrap_or(0).min(source.len().saturating_add(delta.len()).saturating_mul(2)));
    while pos < delta.len() {
        let at = pos;
        let cmd = delta[pos];
        pos += 1;
        if cmd & 0x80 != 0 {
            let mut byte = |bit: u8, shift: u32| -> Result<u64, DeltaError> {
                if cmd & bit == 0 {
                    return Ok(0);
                }
                let b = *delta.get(pos).ok_or(DeltaError::Truncated("a copy opcode"))?;
                pos += 1;
                Ok(u64::from(b) << shift)
            };
            let offset = byte(0x01, 0)? | byte(0x02, 8)? | byte(0x04, 16)? | byte(0x08, 24)?;
            let size = match byte(0x10, 0)? | byte(0x20, 8)? | byte(0x40, 16)? {
                0 => 0x10000,
                n => n,
            };
            let range = usize::try_from(offset).ok().and_then(|o| Some(o..o.checked_add(usize::try_from(size).ok()?)?));
            match range.and_then(|r| source.get(r)) {
                Some(bytes) => out.extend_from_slice(bytes),
                None => return Err(DeltaError::CopyOutOfRange { offset, size, len: source.len() }),
            }
        } else if cmd != 0 {
            let bytes = delta.get(pos..pos + usize::from(cmd)).ok_or(DeltaError::Truncated("an insert opcode"))?;
            out.extend_from_slice(bytes);
            pos += usize::from(cmd);
        } else {
            return Err(DeltaError::ReservedOpcode(at));
        }
    }
    let found = u64::try_from(out.len()).unwrap_or(u64::MAX);
    if found != dst_size {
        return Err(DeltaError::TargetSize { expected: dst_size, found });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_inserts() {
        let src = b"0123456789";
        // src 10, dst 7; copy offset 2 size 3 ("234"), insert "ab", copy offset 8 size 2 ("89").
        let delta = [10, 7, 0x91, 2, 3, 2, b'a', b'b', 0x91, 8, 2];
        assert_eq!(apply(src, &delta).expect("valid"), b"234ab89");
        assert_eq!(source_size(&delta), Ok(10));
    }

    #[test]
    fn size_zero_copies_64_kib_and_varints_span_bytes() {
        let src = vec![7u8; 0x10000];
        // 0x10000 = varint [0x80, 0x80, 0x04]; a copy with no size bytes copies 0x10000.
        let delta = [0x80, 0x80, 0x04, 0x80, 0x80, 0x04, 0x80];
        assert_eq!(apply(&src, &delta).expect("valid"), src);
    }

    #[test]
    fn bad_deltas_are_errors() {
        assert_eq!(apply(b"abc", &[4, 1, 1, b'x']), Err(DeltaError::SourceSize { expected: 4, found: 3 }));
        assert_eq!(apply(b"abc", &[3, 1, 0x91, 2, 5]), Err(DeltaError::CopyOutOfRange { offset: 2, size: 5, len: 3 }));
        assert_eq!(apply(b"abc", &[3, 1, 0]), Err(DeltaError::ReservedOpcode(2)));
        assert_eq!(apply(b"abc", &[3, 2, 1, b'x']), Err(DeltaError::TargetSize { expected: 2, found: 1 }));
        assert_eq!(apply(b"abc", &[3, 2, 5, b'x']), Err(DeltaError::Truncated("an insert opcode")));
        assert_eq!(apply(b"abc", &[3, 2, 0x9f, 1]), Err(DeltaError::Truncated("a copy opcode")));
        assert_eq!(apply(b"", &[0xff; 12]), Err(DeltaError::SizeOverflow));
        assert_eq!(apply(b"", &[0x80]), Err(DeltaError::Truncated("the header")));
    }
}
