//! What the store directory holds beside its manifest, and `trajlog repair`.
//!
//! The manifest is the one list of what is live (format-spec/manifest.md). A
//! writer that opens a store cleans up files a crash can leave behind — and
//! only those: a segment created by an interrupted roll (no valid frame in
//! it, id not below the manifest's next segment id), a segment retired by
//! compaction whose deletion was interrupted (its own id in its header, below
//! every listed segment), a shard staged by an interrupted compaction (a
//! `_tmp-` name). A record-less leftover whose header is torn cannot be told
//! from a stranger's file: it is moved to `DIR/lost+found/`, not deleted. Any other data file the manifest does not list — or data
//! files with no manifest at all — means the manifest is not the one that goes
//! with the files (lost, or restored from an old copy): the open is refused,
//! nothing is changed, and [`repair`] rebuilds the manifest from the files
//! (format-spec/manifest.md §4).

use crate::error::{Error, ErrorKind, Result};
use crate::format::manifest::{encode_manifest, Manifest, ManifestSegment, ManifestShard, SegmentState, ShardChecksum};
use crate::format::segment::{decode_header, decode_trailer, HEADER_BYTES, TRAILER_BYTES};
use crate::segment::recovery::{load_segment, next_valid_frame, read_aligned, OnDamage};
use crate::store::{MANIFEST_NAME, SHARDS_DIR, SHARD_TABLES};
use crate::verify::Problem;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where [`repair`] moves files that cannot be part of the store (never deleted).
pub const LOST_AND_FOUND: &str = "lost+found";

/// The data files of a store directory.
#[derive(Debug, Default)]
pub(crate) struct Inventory {
    /// Segment files by the id in their name.
    pub segments: BTreeMap<u64, PathBuf>,
    /// Published-name shard files, relative to `DIR/shards/` (`steps/part-…`).
    pub shards: Vec<String>,
    /// Staged shard files (`_tmp-` names), relative to `DIR/shards/`.
    pub staged: Vec<String>,
}

impl Inventory {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty() && self.shards.is_empty()
    }

    /// Whether any file holds data: a shard, or a segment with a valid frame
    /// (a segment whose creation a crash interrupted holds none).
    pub fn holds_data(&self) -> Result<bool> {
        if !self.shards.is_empty() {
            return Ok(true);
        }
        for path in self.segments.values() {
            if !holds_no_record(path)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn describe(&self) -> String {
        format!("{} segment files and {} shard files", self.segments.len(), self.shards.len())
    }
}

/// List the data files of `dir`.
pub(crate) fn inventory(dir: &Path) -> Result<Inventory> {
    let mut inv = Inventory::default();
    let entries = fs::read_dir(dir).map_err(|e| Error::io(format!("list {}", dir.display()), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("list {}", dir.display()), e))?;
        let name = entry.file_name();
        if let Some(id) = name.to_str().and_then(crate::storage::parse_segment_file_name) {
            inv.segments.insert(id, entry.path());
        }
    }
    for table in SHARD_TABLES {
        let tdir = dir.join(SHARDS_DIR).join(table);
        let Ok(entries) = fs::read_dir(&tdir) else { continue };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(format!("list {}", tdir.display()), e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !name.ends_with(".parquet") {
                continue;
            }
            let rel = format!("{table}/{name}");
            if name.starts_with("_tmp-") {
                inv.staged.push(rel);
            } else {
                inv.shards.push(rel);
            }
        }
    }
    inv.shards.sort();
    inv.staged.sort();
    Ok(inv)
}

fn hint(dir: &Path) -> String {
    format!(
        "trajlog changed nothing. If the MANIFEST was lost or restored from an old copy, rebuild it from the files with `trajlog repair --store {}`; if a file does not belong to this store, move it out of the directory",
        dir.display()
    )
}

/// The error for data files without a manifest.
pub(crate) fn no_manifest_error(dir: &Path, inv: &Inventory) -> Error {
    let path = dir.join(MANIFEST_NAME);
    Error::new(
        ErrorKind::Corrupt { path: path.clone(), offset: 0 },
        format!("{} has {} but no MANIFEST. {}", dir.display(), inv.describe(), hint(dir)),
    )
}

/// A segment file's header id and whether it is sealed (valid trailer).
fn segment_facts(path: &Path) -> std::result::Result<(u64, bool, u64), String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let len = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    let mut head = [0u8; HEADER_BYTES as usize];
    let n = len.min(HEADER_BYTES) as usize;
    file.read_exact_at(&mut head[..n], 0).map_err(|e| format!("cannot read: {e}"))?;
    let header = decode_header(&head[..n]).map_err(|e| format!("no valid segment header ({})", e.what))?;
    let mut tail = [0u8; TRAILER_BYTES as usize];
    let sealed = len >= HEADER_BYTES + TRAILER_BYTES
        && file.read_exact_at(&mut tail, len - TRAILER_BYTES).is_ok()
        && decode_trailer(&tail, len).is_some();
    Ok((header.segment_id, sealed, len))
}

/// Whether a segment file holds no valid frame anywhere (frames are CRC'd,
/// so torn or zeroed bytes never pass for one).
fn holds_no_record(path: &Path) -> Result<bool> {
    let file = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let len = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?.len();
    let buf = read_aligned(&file, len, path)?;
    let bytes: &[u8] = bytemuck::cast_slice(&buf);
    let bytes = bytes.get(..len as usize).unwrap_or(bytes);
    let first = crate::segment::recovery::scan_frames(bytes);
    Ok(first.entries.is_empty() && next_valid_frame(bytes, HEADER_BYTES).is_none())
}

/// What to do with a leftover of an interrupted operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Leftover {
    /// Recognizably the store's own and holding nothing live: delete it.
    Delete(PathBuf),
    /// Holds no record but cannot be recognized (a torn header): move it to
    /// `DIR/lost+found/` rather than destroy bytes nobody can account for.
    SetAside(PathBuf),
}

impl Leftover {
    /// Delete or set aside the file.
    pub fn dispose(&self, dir: &Path) -> Result<()> {
        match self {
            Leftover::Delete(p) => {
                fs::remove_file(p).map_err(|e| Error::io(format!("remove leftover {}", p.display()), e))
            }
            Leftover::SetAside(p) => move_aside(dir, p, false),
        }
    }
}

/// Check the files `manifest` does not list. Returns the leftovers of
/// interrupted operations (they hold nothing that is live elsewhere); any
/// other unlisted data file is an error naming it.
pub(crate) fn leftovers(dir: &Path, manifest: &Manifest, inv: &Inventory) -> Result<Vec<Leftover>> {
    let listed: std::collections::HashSet<u64> = manifest.segments.iter().map(|s| s.id).collect();
    let min_listed = manifest.segments.iter().map(|s| s.id).min().unwrap_or(manifest.next_segment_id);
    let mut out = Vec::new();
    for (&id, path) in &inv.segments {
        if listed.contains(&id) {
            continue;
        }
        let refuse = |why: String| {
            Error::new(
                ErrorKind::Corrupt { path: path.clone(), offset: 0 },
                format!("{} is not listed in the MANIFEST and {why}. {}", path.display(), hint(dir)),
            )
        };
        if id >= manifest.next_segment_id {
            // Created by a roll (or the store's creation) that a crash
            // interrupted before the manifest listed it: it holds no record,
            // and its header is its own (or torn, never another segment's).
            let header = segment_facts(path).map(|(header_id, _, _)| header_id);
            if header.as_ref().map_or(true, |h| *h == id) && holds_no_record(path)? {
                out.push(match header {
                    Ok(_) => Leftover::Delete(path.clone()),
                    Err(_) => Leftover::SetAside(path.clone()),
                });
                continue;
            }
            return Err(refuse(format!(
                "holds records of a segment newer than the MANIFEST knows (its next segment id is {})",
                manifest.next_segment_id
            )));
        }
        let (header_id, _, _) = segment_facts(path).map_err(|e| refuse(format!("has {e}")))?;
        if header_id != id {
            return Err(refuse(format!("its header says segment {header_id} (a copied or renamed file?)")));
        }
        if id < min_listed {
            // Retirement drops a prefix of the segments from the manifest,
            // then deletes the files: a crash in between leaves these.
            out.push(Leftover::Delete(path.clone()));
            continue;
        }
        return Err(refuse("is neither a retired segment nor the leftover of an interrupted roll".into()));
    }
    let known: std::collections::HashSet<&str> = manifest
        .shards
        .iter()
        .map(|s| s.path.as_str())
        .chain(manifest.pending.iter().flat_map(|p| [p.staged.as_str(), p.shard.path.as_str()]))
        .collect();
    for rel in &inv.shards {
        if !known.contains(rel.as_str()) {
            let path = dir.join(SHARDS_DIR).join(rel);
            return Err(Error::new(
                ErrorKind::Corrupt { path: path.clone(), offset: 0 },
                format!("shard {} is not listed in the MANIFEST. {}", path.display(), hint(dir)),
            ));
        }
    }
    for rel in &inv.staged {
        if !known.contains(rel.as_str()) {
            out.push(Leftover::Delete(dir.join(SHARDS_DIR).join(rel))); // staged by an interrupted compaction
        }
    }
    Ok(out)
}

/// What [`repair`] found and did.
#[derive(Debug, Clone, Default)]
pub struct RepairReport {
    /// Segments listed in the rebuilt manifest: (id, sealed).
    pub segments: Vec<(u64, bool)>,
    /// Segments that were unsealed but not last, sealed by the repair.
    pub sealed_now: Vec<u64>,
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
        let f = crate::compact::reader::ShardFile::open(path, 0, None).map_err(|e| e.to_string())?;
        let mut index = Vec::new();
        f.index_rows(&mut index).map_err(|e| e.to_string())?;
        segments.extend(index.iter().map(|r| r.loc.segment));
    }
    Ok((u64::try_from(rows).unwrap_or(0), segments, checksum))
}

fn move_aside(dir: &Path, path: &Path, dry_run: bool) -> Result<()> {
    if dry_run {
        return Ok(());
    }
    let lf = dir.join(LOST_AND_FOUND);
    fs::create_dir_all(&lf).map_err(|e| Error::io(format!("create {}", lf.display()), e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let table = path.parent().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned());
    let to = match table {
        Some(t) if SHARD_TABLES.contains(&t.as_str()) => lf.join(format!("{t}-{name}")),
        _ => lf.join(name),
    };
    fs::rename(path, &to).map_err(|e| Error::io(format!("move {} to {}", path.display(), to.display()), e))
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
        if !dry_run {
            let seg = load_segment(dir, *id, false, OnDamage::Refuse)?;
            let path = seg.path.as_path().to_path_buf();
            let (data_end, entries) = (seg.data_end, seg.entries);
            drop(seg.map);
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
    Ok(report)
}
