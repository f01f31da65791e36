//! The manifest (format-spec/manifest.md): the live segments, the published
//! Parquet shards and an in-flight shard publication; replaced atomically
//! (write `MANIFEST.tmp`, fsync, rename over `MANIFEST`, fsync dir).
//!
//! Version 2 (written) adds shards and the pending publication to version 1
//! (still read).

use super::{Cursor, DecodeError, PutLe};

pub const MANIFEST_MAGIC: [u8; 8] = *b"TRJLMAN\0";
/// The manifest version this build writes.
pub const MANIFEST_VERSION: u32 = 2;

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

/// A published shard: its path relative to `DIR/shards/` and its row count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestShard {
    pub path: String,
    pub rows: u64,
}

/// A shard publication that was decided but may not be finished: each staged
/// file (relative to `DIR/shards/`) is renamed to its final name on recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRename {
    pub staged: String,
    pub shard: ManifestShard,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Manifest {
    pub next_segment_id: u64,
    /// Ascending ids; at most the last one is active.
    pub segments: Vec<ManifestSegment>,
    pub next_shard_generation: u64,
    pub shards: Vec<ManifestShard>,
    pub pending: Vec<PendingRename>,
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    out.put_str16(s);
}

pub fn encode_manifest(m: &Manifest) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * m.segments.len() + 48 * m.shards.len());
    out.extend_from_slice(&MANIFEST_MAGIC);
    out.put_u32(MANIFEST_VERSION);
    out.put_u32(m.segments.len() as u32);
    out.put_u64(m.next_segment_id);
    out.put_u64(m.next_shard_generation);
    out.put_u32(m.shards.len() as u32);
    out.put_u32(m.pending.len() as u32);
    for s in &m.segments {
        out.put_u64(s.id);
        out.put_u8(match s.state {
            SegmentState::Active => 0,
            SegmentState::Sealed => 1,
        });
        out.extend_from_slice(&[0; 7]);
    }
    for s in &m.shards {
        put_name(&mut out, &s.path);
        out.put_u64(s.rows);
    }
    for p in &m.pending {
        put_name(&mut out, &p.staged);
        put_name(&mut out, &p.shard.path);
        out.put_u64(p.shard.rows);
    }
    let crc = crc32fast::hash(&out);
    out.put_u32(crc);
    out
}

/// A shard path must stay inside `shards/`: `steps/` or `trajectories/` and a
/// plain file name.
fn check_shard_path(path: &str, at: usize) -> Result<(), DecodeError> {
    let ok = path.split_once('/').is_some_and(|(dir, name)| {
        (dir == "steps" || dir == "trajectories")
            && !name.is_empty()
            && !name.contains('/')
            && !name.contains('\\')
            && name != "."
            && name != ".."
    });
    if ok {
        Ok(())
    } else {
        Err(DecodeError::new(at, format!("shard path {path:?} is not steps/NAME or trajectories/NAME")))
    }
}

/// Decode a manifest of version 1 or 2. An unknown version is reported as such
/// (the caller turns it into `ErrorKind::Incompatible`).
pub fn decode_manifest(buf: &[u8]) -> Result<Manifest, DecodeError> {
    let mut c = Cursor::new(buf);
    if c.bytes(8, "manifest magic")? != MANIFEST_MAGIC {
        return Err(DecodeError::new(0, "not a trajlog manifest (bad magic)"));
    }
    let version = c.u32("format version")?;
    if version != 1 && version != 2 {
        return Err(DecodeError::new(
            8,
            format!("unsupported format version {version} (this build reads 1 and {MANIFEST_VERSION})"),
        ));
    }
    let count = c.u32("segment count")?;
    let next_segment_id = c.u64("next segment id")?;
    let (next_shard_generation, shard_count, pending_count) = if version >= 2 {
        (c.u64("next shard generation")?, c.u32("shard count")?, c.u32("pending count")?)
    } else {
        (1, 0, 0)
    };
    let seg_start = c.pos();
    if (buf.len() as u64) < seg_start as u64 + 16 * u64::from(count) + 4 {
        return Err(DecodeError::new(12, format!("manifest is {} bytes, too short for {count} segments", buf.len())));
    }
    let mut segments = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        let id = c.u64("segment id")?;
        let state = match c.u8("segment state")? {
            0 => SegmentState::Active,
            1 => SegmentState::Sealed,
            s => return Err(DecodeError::new(seg_start + i * 16 + 8, format!("unknown segment state {s}"))),
        };
        c.bytes(7, "reserved")?;
        if segments.last().is_some_and(|p: &ManifestSegment| p.id >= id) || id >= next_segment_id {
            return Err(DecodeError::new(seg_start + i * 16, format!("segment id {id} out of order")));
        }
        segments.push(ManifestSegment { id, state });
    }
    // Each shard entry takes at least 10 bytes: bound allocations by the input.
    let mut shards = Vec::with_capacity((shard_count as usize).min(buf.len() / 10));
    for _ in 0..shard_count {
        let at = c.pos();
        let path = c.str16("shard path")?.to_owned();
        check_shard_path(&path, at)?;
        shards.push(ManifestShard { path, rows: c.u64("shard rows")? });
    }
    let mut pending = Vec::with_capacity((pending_count as usize).min(buf.len() / 12));
    for _ in 0..pending_count {
        let at = c.pos();
        let staged = c.str16("staged shard path")?.to_owned();
        check_shard_path(&staged, at)?;
        let at = c.pos();
        let path = c.str16("shard path")?.to_owned();
        check_shard_path(&path, at)?;
        pending.push(PendingRename { staged, shard: ManifestShard { path, rows: c.u64("shard rows")? } });
    }
    let body_end = c.pos();
    let crc = c.u32("manifest crc")?;
    if c.pos() != buf.len() {
        return Err(DecodeError::new(c.pos(), "trailing bytes after the manifest"));
    }
    let body = buf.get(..body_end).ok_or_else(|| DecodeError::new(0, "short manifest"))?;
    if crc32fast::hash(body) != crc {
        return Err(DecodeError::new(body_end, "manifest crc mismatch"));
    }
    if segments.iter().rev().skip(1).any(|s| s.state == SegmentState::Active) {
        return Err(DecodeError::new(seg_start, "only the last segment may be active"));
    }
    Ok(Manifest { next_segment_id, segments, next_shard_generation, shards, pending })
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
            next_shard_generation: 2,
            shards: vec![ManifestShard { path: "steps/part-000001-0000.parquet".into(), rows: 7 }],
            pending: vec![PendingRename {
                staged: "trajectories/_tmp-000001-0000.parquet".into(),
                shard: ManifestShard { path: "trajectories/part-000001-0000.parquet".into(), rows: 2 },
            }],
        };
        let bytes = encode_manifest(&m);
        assert_eq!(&bytes[..12], b"TRJLMAN\0\x02\0\0\0");
        assert_eq!(decode_manifest(&bytes), Ok(m));
        for i in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(decode_manifest(&bad).is_err(), "bit {i}");
        }
    }

    #[test]
    fn reads_version_1() {
        // A version-1 manifest: magic, version, count, next id, entries, crc.
        let mut v1 = Vec::new();
        v1.extend_from_slice(&MANIFEST_MAGIC);
        v1.put_u32(1);
        v1.put_u32(1);
        v1.put_u64(2);
        v1.put_u64(1);
        v1.extend_from_slice(&[0; 8]);
        let crc = crc32fast::hash(&v1);
        v1.put_u32(crc);
        let m = decode_manifest(&v1).unwrap();
        assert_eq!(m.segments, [ManifestSegment { id: 1, state: SegmentState::Active }]);
        assert!(m.shards.is_empty() && m.pending.is_empty());
    }

    #[test]
    fn shard_paths_cannot_escape() {
        for bad in ["../x.parquet", "steps/../../etc", "other/x", "steps/", "steps/a/b"] {
            assert!(check_shard_path(bad, 0).is_err(), "{bad}");
        }
    }
}
