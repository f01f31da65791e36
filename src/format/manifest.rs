//! The manifest (format-spec/manifest.md): the list of live segments, replaced
//! atomically (write `MANIFEST.tmp`, fsync, rename over `MANIFEST`, fsync dir).
//!
//! ```text
//! 0   [u8; 8]  magic "TRJLMAN\0"
//! 8   u32      format version
//! 12  u32      segment count N
//! 16  u64      next segment id
//! 24  N × 16   { u64 segment id, u8 state (0 active, 1 sealed), [u8; 7] zero }
//! ..  u32      crc32 of every byte before it
//! ```

use super::{Cursor, DecodeError, PutLe, FORMAT_VERSION};

pub const MANIFEST_MAGIC: [u8; 8] = *b"TRJLMAN\0";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentState {
    Active,
    Sealed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManifestSegment {
    pub id: u64,
    pub state: SegmentState,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Manifest {
    pub next_segment_id: u64,
    /// Ascending ids; at most the last one is active.
    pub segments: Vec<ManifestSegment>,
}

pub fn encode_manifest(m: &Manifest) -> Vec<u8> {
    let mut out = Vec::with_capacity(28 + 16 * m.segments.len());
    out.extend_from_slice(&MANIFEST_MAGIC);
    out.put_u32(FORMAT_VERSION);
    out.put_u32(m.segments.len() as u32);
    out.put_u64(m.next_segment_id);
    for s in &m.segments {
        out.put_u64(s.id);
        out.put_u8(match s.state {
            SegmentState::Active => 0,
            SegmentState::Sealed => 1,
        });
        out.extend_from_slice(&[0; 7]);
    }
    let crc = crc32fast::hash(&out);
    out.put_u32(crc);
    out
}

/// Decode a manifest. A newer format version is reported as such (the caller
/// turns it into `ErrorKind::Incompatible`).
pub fn decode_manifest(buf: &[u8]) -> Result<Manifest, DecodeError> {
    let mut c = Cursor::new(buf);
    if c.bytes(8, "manifest magic")? != MANIFEST_MAGIC {
        return Err(DecodeError::new(0, "not a trajlog manifest (bad magic)"));
    }
    let version = c.u32("format version")?;
    if version != FORMAT_VERSION {
        return Err(DecodeError::new(
            8,
            format!("unsupported format version {version} (this build reads {FORMAT_VERSION})"),
        ));
    }
    let count = c.u32("segment count")?;
    let next_segment_id = c.u64("next segment id")?;
    let expect = 24u64 + 16 * u64::from(count) + 4;
    if buf.len() as u64 != expect {
        return Err(DecodeError::new(12, format!("manifest is {} bytes, {count} segments need {expect}", buf.len())));
    }
    let mut segments = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        let id = c.u64("segment id")?;
        let state = match c.u8("segment state")? {
            0 => SegmentState::Active,
            1 => SegmentState::Sealed,
            s => return Err(DecodeError::new(24 + i * 16 + 8, format!("unknown segment state {s}"))),
        };
        c.bytes(7, "reserved")?;
        if segments.last().is_some_and(|p: &ManifestSegment| p.id >= id) || id >= next_segment_id {
            return Err(DecodeError::new(24 + i * 16, format!("segment id {id} out of order")));
        }
        segments.push(ManifestSegment { id, state });
    }
    let body_end = c.pos();
    let crc = c.u32("manifest crc")?;
    let body = buf.get(..body_end).ok_or_else(|| DecodeError::new(0, "short manifest"))?;
    if crc32fast::hash(body) != crc {
        return Err(DecodeError::new(body_end, "manifest crc mismatch"));
    }
    if segments.iter().rev().skip(1).any(|s| s.state == SegmentState::Active) {
        return Err(DecodeError::new(24, "only the last segment may be active"));
    }
    Ok(Manifest { next_segment_id, segments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let m = Manifest {
            next_segment_id: 3,
            segments: vec![
                ManifestSegment { id: 1, state: SegmentState::Sealed },
                ManifestSegment { id: 2, state: SegmentState::Active },
            ],
        };
        let bytes = encode_manifest(&m);
        assert_eq!(bytes.len(), 24 + 32 + 4);
        assert_eq!(&bytes[..12], b"TRJLMAN\0\x01\0\0\0");
        assert_eq!(decode_manifest(&bytes), Ok(m));
        for i in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(decode_manifest(&bad).is_err(), "bit {i}");
        }
    }
}
