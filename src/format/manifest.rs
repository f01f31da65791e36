//! The manifest (format-spec/manifest.md): the live segments, the published
//! Parquet shards and an in-flight shard publication; replaced atomically
//! (write `MANIFEST.tmp`, fsync, rename over `MANIFEST`, fsync dir).
//!
//! Version 4 (written) adds the obsolete list: shard files a collection took
//! out of the published set, to be deleted. Version 3 added to each shard
//! entry the file's length and the crc32 of its Parquet footer; versions 3, 2
//! (shards and the pending publication, no checksums) and 1 (segments only)
//! are still read.

use super::{Cursor, DecodeError, PutLe};

pub const MANIFEST_MAGIC: [u8; 8] = *b"TRJLMAN\0";
/// The manifest version this build writes.
pub const MANIFEST_VERSION: u32 = 4;
/// The oldest manifest version this build reads.
pub const MANIFEST_VERSION_MIN: u32 = 1;
/// A Parquet file is at least `"PAR1"`, a footer length and `"PAR1"`.
const PARQUET_BYTES_MIN: u64 = 12;

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

/// What the manifest knows of a shard file's bytes (format-spec/manifest.md §2):
/// its length and the crc32 of its last `footer_len + 8` bytes (the Parquet
/// footer, its length and the closing `"PAR1"`), which hold the row group
/// checksums (format-spec/shard.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardChecksum {
    pub len: u64,
    pub footer_crc32: u32,
}

/// A published shard: its path relative to `DIR/shards/`, its row count, and
/// its checksum (`None` for shards listed by a version 1 or 2 manifest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestShard {
    pub path: String,
    pub rows: u64,
    pub checksum: Option<ShardChecksum>,
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
    /// Shard files (relative to `DIR/shards/`) taken out of the published
    /// set by a collection (version 4): the next writer deletes those that
    /// still exist. Never read as data.
    pub obsolete: Vec<String>,
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    out.put_str16(s);
}

/// Row count, file length and footer crc32 of a shard entry; length 0 (with
/// crc 0) stands for "no checksum".
fn put_shard_tail(out: &mut Vec<u8>, s: &ManifestShard) {
    out.put_u64(s.rows);
    let c = s.checksum.unwrap_or(ShardChecksum { len: 0, footer_crc32: 0 });
    out.put_u64(c.len);
    out.put_u32(c.footer_crc32);
}

fn shard_tail(c: &mut Cursor<'_>, version: u32) -> Result<(u64, Option<ShardChecksum>), DecodeError> {
    let rows = c.u64("shard rows")?;
    if version < 3 {
        return Ok((rows, None));
    }
    let at = c.pos();
    let len = c.u64("shard file length")?;
    let footer_crc32 = c.u32("shard footer crc")?;
    match len {
        0 if footer_crc32 == 0 => Ok((rows, None)),
        0 => Err(DecodeError::new(at, "shard entry without a length has a footer crc")),
        l if l < PARQUET_BYTES_MIN => {
            Err(DecodeError::new(at, format!("shard length {l} is too short for a parquet file")))
        }
        _ => Ok((rows, Some(ShardChecksum { len, footer_crc32 }))),
    }
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
        put_shard_tail(&mut out, s);
    }
    for p in &m.pending {
        put_name(&mut out, &p.staged);
        put_name(&mut out, &p.shard.path);
        put_shard_tail(&mut out, &p.shard);
    }
    out.put_u32(m.obsolete.len() as u32);
    for o in &m.obsolete {
        put_name(&mut out, o);
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

/// The version field of a manifest with a valid magic (read before decoding,
/// so an unknown version is told apart from corruption by value, not text).
pub fn manifest_version(buf: &[u8]) -> Option<u32> {
    let mut c = Cursor::new(buf);
    if c.bytes(8, "manifest magic").ok()? != MANIFEST_MAGIC {
        return None;
    }
    c.u32("format version").ok()
}

/// Whether this build reads manifests of `version`.
pub fn reads_version(version: u32) -> bool {
    (MANIFEST_VERSION_MIN..=MANIFEST_VERSION).contains(&version)
}

/// Decode a manifest of version 1 to 4. An unknown version is reported as
/// such (the caller turns it into `ErrorKind::Incompatible`).
pub fn decode_manifest(buf: &[u8]) -> Result<Manifest, DecodeError> {
    let mut c = Cursor::new(buf);
    if c.bytes(8, "manifest magic")? != MANIFEST_MAGIC {
        return Err(DecodeError::new(0, "not a trajlog manifest (bad magic)"));
    }
    let version = c.u32("format version")?;
    if !(MANIFEST_VERSION_MIN..=MANIFEST_VERSION).contains(&version) {
        return Err(DecodeError::new(
            8,
            format!(
                "unsupported format version {version} (this build reads {MANIFEST_VERSION_MIN} to {MANIFEST_VERSION})"
            ),
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
        let (rows, checksum) = shard_tail(&mut c, version)?;
        shards.push(ManifestShard { path, rows, checksum });
    }
    let mut pending = Vec::with_capacity((pending_count as usize).min(buf.len() / 12));
    for _ in 0..pending_count {
        let at = c.pos();
        let staged = c.str16("staged shard path")?.to_owned();
        check_shard_path(&staged, at)?;
        let at = c.pos();
        let path = c.str16("shard path")?.to_owned();
        check_shard_path(&path, at)?;
        let (rows, checksum) = shard_tail(&mut c, version)?;
        pending.push(PendingRename { staged, shard: ManifestShard { path, rows, checksum } });
    }
    let mut obsolete = Vec::new();
    if version >= 4 {
        let count = c.u32("obsolete count")?;
        obsolete.reserve((count as usize).min(buf.len() / 2));
        for _ in 0..count {
            let at = c.pos();
            let path = c.str16("obsolete shard path")?.to_owned();
            check_shard_path(&path, at)?;
            obsolete.push(path);
        }
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
    Ok(Manifest { next_segment_id, segments, next_shard_generation, shards, pending, obsolete })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            next_segment_id: 3,
            segments: vec![
                ManifestSegment { id: 1, state: SegmentState::Sealed },
                ManifestSegment { id: 2, state: SegmentState::Active },
            ],
            next_shard_generation: 2,
            shards: vec![
                ManifestShard { path: "steps/part-000001-0000.parquet".into(), rows: 7, checksum: None },
                ManifestShard {
                    path: "steps/part-000001-0001.parquet".into(),
                    rows: 9,
                    checksum: Some(ShardChecksum { len: 4096, footer_crc32: 0xdead_beef }),
                },
            ],
            pending: vec![PendingRename {
                staged: "trajectories/_tmp-000001-0000.parquet".into(),
                shard: ManifestShard {
                    path: "trajectories/part-000001-0000.parquet".into(),
                    rows: 2,
                    checksum: Some(ShardChecksum { len: 12, footer_crc32: 0 }),
                },
            }],
            obsolete: vec!["steps/part-000000-0003.parquet".into()],
        }
    }

    #[test]
    fn round_trip_and_corruption() {
        let m = sample();
        let bytes = encode_manifest(&m);
        assert_eq!(&bytes[..12], b"TRJLMAN\0\x04\0\0\0");
        assert_eq!(decode_manifest(&bytes), Ok(m));
        for i in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(decode_manifest(&bad).is_err(), "bit {i}");
        }
    }

    /// Byte-exact: format-spec/manifest.md §2, version 4.
    #[test]
    fn golden_bytes_version_4() {
        let m = Manifest {
            next_segment_id: 2,
            segments: vec![ManifestSegment { id: 1, state: SegmentState::Sealed }],
            next_shard_generation: 2,
            shards: vec![ManifestShard {
                path: "steps/a".into(),
                rows: 5,
                checksum: Some(ShardChecksum { len: 0x1234, footer_crc32: 0x0a0b_0c0d }),
            }],
            pending: vec![PendingRename {
                staged: "steps/_b".into(),
                shard: ManifestShard { path: "steps/b".into(), rows: 1, checksum: None },
            }],
            obsolete: vec!["steps/c".into()],
        };
        let mut want: Vec<u8> = Vec::new();
        want.extend_from_slice(b"TRJLMAN\0");
        want.extend_from_slice(&[4, 0, 0, 0]); // version
        want.extend_from_slice(&[1, 0, 0, 0]); // segment_count
        want.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]); // next_segment_id
        want.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]); // next_shard_generation
        want.extend_from_slice(&[1, 0, 0, 0]); // shard_count
        want.extend_from_slice(&[1, 0, 0, 0]); // pending_count
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]); // segment 1, sealed
        want.extend_from_slice(&[7, 0]); // shard: path length
        want.extend_from_slice(b"steps/a");
        want.extend_from_slice(&[5, 0, 0, 0, 0, 0, 0, 0]); // rows
        want.extend_from_slice(&[0x34, 0x12, 0, 0, 0, 0, 0, 0]); // file_len
        want.extend_from_slice(&[0x0d, 0x0c, 0x0b, 0x0a]); // footer_crc32
        want.extend_from_slice(&[8, 0]); // pending: staged path
        want.extend_from_slice(b"steps/_b");
        want.extend_from_slice(&[7, 0]); // final path
        want.extend_from_slice(b"steps/b");
        want.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]); // rows
        want.extend_from_slice(&[0; 12]); // no checksum: file_len 0, footer_crc32 0
        want.extend_from_slice(&[1, 0, 0, 0]); // obsolete_count
        want.extend_from_slice(&[7, 0]); // obsolete path length
        want.extend_from_slice(b"steps/c");
        let crc = crc32fast::hash(&want);
        want.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(encode_manifest(&m), want);
        assert_eq!(decode_manifest(&want), Ok(m));
    }

    /// Rebuild `bytes`' crc after editing the body.
    fn recrc(mut bytes: Vec<u8>) -> Vec<u8> {
        let body = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..body]);
        bytes[body..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    #[test]
    fn checksum_fields_are_checked() {
        let one = |len: u64, crc: u32| Manifest {
            next_segment_id: 1,
            shards: vec![ManifestShard {
                path: "steps/a".into(),
                rows: 1,
                checksum: Some(ShardChecksum { len, footer_crc32: crc }),
            }],
            ..Manifest::default()
        };
        // file_len 0 with a crc, and a length too short for Parquet, are refused.
        assert!(decode_manifest(&encode_manifest(&one(0, 1))).is_err());
        assert!(decode_manifest(&encode_manifest(&one(11, 1))).is_err());
        assert_eq!(decode_manifest(&encode_manifest(&one(12, 1))), Ok(one(12, 1)));
        // An unknown version is refused as such.
        let mut v5 = encode_manifest(&one(12, 1));
        v5[8] = 5;
        let err = decode_manifest(&recrc(v5)).unwrap_err();
        assert!(err.what.contains("unsupported format version 5"), "{}", err.what);
    }

    #[test]
    fn reads_version_2_without_checksums() {
        // A version-2 manifest: the v3 layout without file_len and footer_crc32.
        let mut v2 = Vec::new();
        v2.extend_from_slice(&MANIFEST_MAGIC);
        v2.put_u32(2);
        v2.put_u32(1);
        v2.put_u64(2);
        v2.put_u64(3);
        v2.put_u32(1);
        v2.put_u32(1);
        v2.put_u64(1);
        v2.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        v2.put_str16("steps/part-000001-0000.parquet");
        v2.put_u64(4);
        v2.put_str16("steps/_tmp-000002-0000.parquet");
        v2.put_str16("steps/part-000002-0000.parquet");
        v2.put_u64(6);
        let crc = crc32fast::hash(&v2);
        v2.put_u32(crc);
        let m = decode_manifest(&v2).unwrap();
        assert_eq!(m.next_shard_generation, 3);
        assert_eq!(
            m.shards,
            [ManifestShard { path: "steps/part-000001-0000.parquet".into(), rows: 4, checksum: None }]
        );
        assert_eq!(
            m.pending,
            [PendingRename {
                staged: "steps/_tmp-000002-0000.parquet".into(),
                shard: ManifestShard { path: "steps/part-000002-0000.parquet".into(), rows: 6, checksum: None },
            }]
        );
        // Written back, it becomes version 4 with the same content.
        let v4 = encode_manifest(&m);
        assert_eq!(v4[8], 4);
        assert_eq!(decode_manifest(&v4), Ok(m));
    }

    #[test]
    fn reads_version_3_without_the_obsolete_list() {
        // Version 3 is version 4 without obsolete_count and its entries.
        let m = Manifest { obsolete: Vec::new(), ..sample() };
        let v4 = encode_manifest(&m);
        let body = v4.len() - 4;
        let mut v3 = v4[..body - 4].to_vec();
        v3[8] = 3;
        let crc = crc32fast::hash(&v3);
        v3.put_u32(crc);
        assert_eq!(decode_manifest(&v3), Ok(m));
        // An obsolete path must stay inside shards/ like any other.
        let bad = Manifest { obsolete: vec!["../x".into()], ..sample() };
        assert!(decode_manifest(&encode_manifest(&bad)).is_err());
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
