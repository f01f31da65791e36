//! What the store directory holds beside its manifest: the inventory that a
//! writable open, `verify` and `trajlog repair` share.
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
//! nothing is changed, and `crate::repair::repair` rebuilds the manifest from the files
//! (format-spec/manifest.md §4).

use crate::error::{Error, ErrorKind, Result};
use crate::format::manifest::Manifest;
use crate::format::segment::{decode_header, decode_trailer, HEADER_BYTES, TRAILER_BYTES};
use crate::segment::recovery::{next_valid_frame, read_aligned};
use crate::storage::{MANIFEST_NAME, SHARDS_DIR, SHARD_TABLES};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where `trajlog repair` moves files that cannot be part of the store (never deleted).
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
pub(crate) fn segment_facts(path: &Path) -> std::result::Result<(u64, bool, u64), String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let len = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    let mut head = [0u8; HEADER_BYTES as usize];
    let head = head.get_mut(..len.min(HEADER_BYTES) as usize).unwrap_or_default();
    file.read_exact_at(head, 0).map_err(|e| format!("cannot read: {e}"))?;
    let header = decode_header(head).map_err(|e| format!("no valid segment header ({})", e.what))?;
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
    /// The file, and what a writable open does with it.
    pub fn describe(&self) -> (PathBuf, &'static str) {
        match self {
            Leftover::Delete(p) => (p.clone(), "deleted by the next writable open"),
            Leftover::SetAside(p) => (p.clone(), "moved to lost+found/ by the next writable open"),
        }
    }

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
        // Retirement drops segments from the manifest (any sealed ones, not
        // only a prefix, since store format 9), then deletes the files: a
        // crash in between leaves these. A segment is listed from its roll
        // on, so an unlisted one below the next id was retired.
        out.push(Leftover::Delete(path.clone()));
    }
    let known: std::collections::HashSet<&str> = manifest
        .shards
        .iter()
        .map(|s| s.path.as_str())
        .chain(manifest.pending.iter().flat_map(|p| [p.staged.as_str(), p.shard.path.as_str()]))
        .chain(manifest.obsolete.iter().map(String::as_str))
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

pub(crate) fn move_aside(dir: &Path, path: &Path, dry_run: bool) -> Result<()> {
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
