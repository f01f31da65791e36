//! `trajlog repair`: a manifest rebuilt from the files of a store directory
//! (format-spec/manifest.md §4). Nothing is deleted; files that cannot belong
//! to the store are moved to `DIR/lost+found/`.

use crate::error::{Error, ErrorKind, Problem, Result};
use crate::format::manifest::{encode_manifest, Manifest, ManifestSegment, ManifestShard, SegmentState, ShardChecksum};
pub use crate::inventory::LOST_AND_FOUND;
use crate::inventory::{inventory, move_aside, segment_facts};
use crate::segment::recovery::{load_segment, OnDamage};
use crate::storage::{MANIFEST_NAME, SHARDS_DIR};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What [`repair`] found and did.
#[derive(Debug, Clone, Default)]
pub struct RepairReport {
    /// Segments listed in the rebuilt manifest: (id, sealed).
    pub segments: Vec<(u64, bool)>,
    /// Segments that were unsealed but not last, sealed by the repair.
    pub sealed_now: Vec<u64>,
    /// What sealing them cut off (or would, with `dry_run`): the torn tail
    /// after the last valid frame of each, which the footer replaces.
    pub cut: Vec<crate::RecoveryEvent>,
    /// Shards listed in the rebuilt manifest (relative to `DIR/shards/`).
    pub shards: Vec<String>,
    /// Files that cannot be part of the store, moved to `DIR/lost+found/`
    /// (or that would be, with `dry_run`), and why.
    pub moved_aside: Vec<(PathBuf, String)>,
    /// Where the manifest found before the repair was kept, if there was one.
    pub previous_manifest: Option<PathBuf>,
    pub next_segment_id: u64,
    /// Live calls the rebuilt store serves.
    pub calls: usize,
    /// Damage the rebuilt store confines (see `Snapshot::damage`).
    pub damage: Vec<Problem>,
    /// Whether the manifest was written (false with `dry_run`).
    pub written: bool,
}

/// `part-GGGGGG-PPPP.parquet` → (generation, part).
fn shard_name_order(rel: &str) -> Option<(u64, u64)> {
    let name = rel.rsplit('/').next()?;
    let rest = name.strip_prefix("part-")?.strip_suffix(".parquet")?;
    let (g, p) = rest.split_once('-')?;
    Some((g.parse().ok()?, p.parse().ok()?))
}

/// The checksum a manifest entry records for a shard file as it is now
/// (format-spec/manifest.md §2): its length and the crc32 of its footer.
fn shard_checksum(file: &File) -> std::result::Result<ShardChecksum, String> {
    let len = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    let mut tail = [0u8; 8];
    if len < 12 {
        return Err(format!("too short for Parquet ({len} bytes)"));
    }
    file.read_exact_at(&mut tail, len - 8).map_err(|e| format!("cannot read: {e}"))?;
    let footer_len = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    let covered = footer_len + 8;
    if covered > len - 4 {
        return Err(format!("footer length {footer_len} runs past the start of the file"));
    }
    let mut footer = vec![0u8; covered as usize];
    file.read_exact_at(&mut footer, len - covered).map_err(|e| format!("cannot read: {e}"))?;
    Ok(ShardChecksum { len, footer_crc32: crc32fast::hash(&footer) })
}

fn shard_rows(path: &Path) -> std::result::Result<(u64, Vec<u64>, ShardChecksum), String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    // Recorded as the file is now; a damaged column chunk inside it is still
    // caught by its own crc on read (damage stays confined to its rows).
    let checksum = shard_checksum(&file)?;
    let reader =
        parquet::file::reader::SerializedFileReader::new(file).map_err(|e| format!("not readable Parquet: {e}"))?;
    let rows = parquet::file::reader::FileReader::metadata(&reader).file_metadata().num_rows();
    let mut segments = Vec::new();
    if path.parent().and_then(|p| p.file_name()).is_some_and(|n| n == "steps") {
        let f = crate::shard::reader::ShardFile::open(path, 0, None).map_err(|e| e.to_string())?;
        let mut index = Vec::new();
        f.index_rows(&mut index).map_err(|e| e.to_string())?;
        segments.extend(index.iter().map(|r| r.loc.segment));
    }
    Ok((u64::try_from(rows).unwrap_or(0), segments, checksum))
}

/// Rebuild `dir`'s manifest from the segment and shard files it holds
/// (format-spec/manifest.md §4). Files that cannot belong to the store are
/// moved to `DIR/lost+found/`, never deleted; the manifest found before is
/// kept as `MANIFEST.before-repair-<unix seconds>`. Takes the writer lock.
/// With `dry_run`, only reports what it would do.
pub fn repair(dir: &Path, dry_run: bool) -> Result<RepairReport> {
    if !dir.is_dir() {
        return Err(Error::new(ErrorKind::NotFound, format!("{} is not a directory", dir.display())));
    }
    let _lock = crate::store::lock_dir(dir)?;
    let inv = inventory(dir)?;
    if inv.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("{} holds no segment or shard file: there is nothing to rebuild a manifest from", dir.display()),
        ));
    }
    let mut report = RepairReport::default();
    // Segments: valid header with the id of the file name, else set aside.
    let mut segments: Vec<(u64, bool)> = Vec::new();
    for (&id, path) in &inv.segments {
        match segment_facts(path) {
            Ok((header_id, sealed, _)) if header_id == id => segments.push((id, sealed)),
            Ok((header_id, _, _)) => {
                report.moved_aside.push((path.clone(), format!("its header says segment {header_id}, not {id}")));
                move_aside(dir, path, dry_run)?;
            }
            Err(why) => {
                report.moved_aside.push((path.clone(), why));
                move_aside(dir, path, dry_run)?;
            }
        }
    }
    // Only the last segment may be unsealed: seal the others in place (their
    // valid frames, up to a torn tail, get a footer).
    let last = segments.last().map(|s| s.0);
    for (id, sealed) in segments.iter_mut() {
        if *sealed || Some(*id) == last {
            continue;
        }
        // Read in a dry run too (reading writes nothing), so that it says
        // what the seal would cut.
        let seg = load_segment(dir, *id, false, OnDamage::Refuse)?;
        let path = seg.path.as_path().to_path_buf();
        report.cut.extend(seg.events.iter().map(|e| e.report(*id, &path)));
        let (data_end, entries) = (seg.data_end, seg.entries);
        drop(seg.map);
        if !dry_run {
            let active = crate::segment::writer::ActiveSegment::reopen(path, *id, data_end, data_end, entries, None)?;
            active.seal()?;
        }
        *sealed = true;
        report.sealed_now.push(*id);
    }
    // Shards: readable files with a published name, in publication order.
    let mut shards: Vec<((u64, u64), String, u64, ShardChecksum)> = Vec::new();
    let mut max_loc_segment = 0;
    for rel in &inv.shards {
        let path = dir.join(SHARDS_DIR).join(rel);
        let Some(order) = shard_name_order(rel) else {
            report.moved_aside.push((path.clone(), "not a trajlog shard name (part-GGGGGG-PPPP.parquet)".into()));
            move_aside(dir, &path, dry_run)?;
            continue;
        };
        match shard_rows(&path) {
            Ok((rows, locs, checksum)) => {
                max_loc_segment = locs.into_iter().fold(max_loc_segment, u64::max);
                shards.push((order, rel.clone(), rows, checksum));
            }
            Err(why) => {
                report.moved_aside.push((path.clone(), why));
                move_aside(dir, &path, dry_run)?;
            }
        }
    }
    shards.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let max_segment = segments.iter().map(|s| s.0).max().unwrap_or(0);
    let next_generation = shards.iter().map(|s| s.0 .0).max().map_or(1, |g| g + 1);
    let manifest = Manifest {
        next_segment_id: max_segment.max(max_loc_segment) + 1,
        segments: segments
            .iter()
            .map(|&(id, sealed)| ManifestSegment {
                id,
                state: if sealed { SegmentState::Sealed } else { SegmentState::Active },
            })
            .collect(),
        next_shard_generation: next_generation,
        shards: shards
            .iter()
            .map(|(_, path, rows, checksum)| ManifestShard {
                path: path.clone(),
                rows: *rows,
                checksum: Some(*checksum),
            })
            .collect(),
        pending: Vec::new(),
        obsolete: Vec::new(),
    };
    report.segments = segments;
    report.shards = shards.into_iter().map(|s| s.1).collect();
    report.next_segment_id = manifest.next_segment_id;
    if dry_run && !report.sealed_now.is_empty() {
        // The result can only be loaded once those segments are sealed.
        return Ok(report);
    }
    // Load the store the new manifest describes before writing it.
    let loaded = crate::store::load_for_repair(dir, manifest.clone())?;
    report.calls = loaded.0;
    report.damage = loaded.1;
    if dry_run {
        return Ok(report);
    }
    let current = dir.join(MANIFEST_NAME);
    if current.exists() {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let keep = dir.join(format!("{MANIFEST_NAME}.before-repair-{secs}"));
        fs::copy(&current, &keep)
            .map_err(|e| Error::io(format!("keep {} as {}", current.display(), keep.display()), e))?;
        report.previous_manifest = Some(keep);
    }
    crate::storage::write_atomic(dir, MANIFEST_NAME, &encode_manifest(&manifest), &None)?;
    report.written = true;
    // The backlog index file (and its delta) describes the log of the
    // manifest it was written under; it is a cache (format-spec/backlog-index.md), so the
    // repaired store does without it until a writable open writes it anew.
    let mut removed = false;
    for name in [crate::store::BACKLOG_FILE, crate::store::BACKLOG_DELTA_FILE] {
        let backlog = dir.join(name);
        if backlog.exists() {
            fs::remove_file(&backlog).map_err(|e| Error::io(format!("remove {}", backlog.display()), e))?;
            removed = true;
        }
    }
    if removed {
        crate::storage::sync_dir(dir, &None)?;
    }
    Ok(report)
}
