//! The deletions side table, `DIR/shards/_deleted.parquet` (format-spec/shard.md
//! §9): the rows of the published shards whose calls are no longer live
//! (their session deleted, or the call replaced), for readers of the shards.
//! The shard files are immutable until a collection rewrites them (§6.1);
//! until then a dataloader skips the rows listed here (a deletion vector per
//! file, by row number).
//!
//! Each publication rewrites it from the view it published: the `steps`
//! files with a dead row are read (index columns only) and each row checked
//! against the index; the `trajectories` rows of the same generations that
//! hold a dead call are listed too. A file whose dead-row count did not
//! change since the table on disk keeps its listed rows without being read
//! (a dead row never comes back), so the work is proportional to the files
//! whose rows died since the last publication.

use super::*;
use crate::shard::writer::parquet_err;
use crate::snapshot::Snapshot;
use crate::verify::DeletionsCheck;
use arrow_array::builder::{Int64Builder, StringBuilder};
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// The side table's file name, in `DIR/shards/`.
pub const DELETIONS_FILE: &str = "_deleted.parquet";
/// `trajlog.deletions_format_version` of the files written here.
pub const DELETIONS_FORMAT_VERSION: &str = "1";
const KEY_VERSION: &str = "trajlog.deletions_format_version";
/// Key-value metadata: the files the table could not read, one path per
/// line (absent when none).
const KEY_UNREAD: &str = "trajlog.deletions_unread";

/// A listed row of one file: its row number in the file (0-based, over all
/// row groups), its `session_id`, and for a `steps` row its `trace_id`.
pub(crate) type DeadRow = (u64, String, Option<String>);
/// Listed rows by file path under `DIR/shards/` (`steps/…`,
/// `trajectories/…`), each file's rows ascending.
pub(crate) type Deletions = BTreeMap<String, Vec<DeadRow>>;

/// The table: its rows, and the files it could not read when it was
/// written (their rows dead since may be missing: the next publication
/// reads them again rather than keep what is listed of them).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Table {
    pub(crate) rows: Deletions,
    pub(crate) unread: BTreeSet<String>,
}

/// The side table's schema (format-spec/shard.md §9).
pub fn deletions_schema() -> Schema {
    Schema::new(vec![
        Field::new("path", DataType::Utf8, false),
        Field::new("row", DataType::Int64, false),
        Field::new("session_id", DataType::Utf8, false),
        Field::new("trace_id", DataType::Utf8, true),
    ])
}

/// The dead rows of the shards `snap` serves (the `steps` files of its view,
/// the `trajectories` files of `manifest`, which must be the manifest that
/// published that view). `previous`: the table on disk, whose rows of a
/// `steps` file are kept when the file still has that many dead rows (and
/// those of its generation's `trajectories` files when all its `steps` files'
/// are kept).
///
/// A file that cannot be read (damaged: `trajlog verify` names it) keeps
/// the rows `previous` lists of it, which are still dead, and is returned
/// with its error; so is a generation's `trajectories` file that cannot be
/// read, and the `trajectories` files of a generation whose `steps` file
/// could not be read keep theirs.
pub(crate) fn dead_rows(
    snap: &Snapshot,
    manifest: &Manifest,
    shards_dir: &Path,
    previous: Option<&Table>,
    keep_liveness: bool,
) -> (Table, Vec<(String, String)>) {
    let mut out = Deletions::new();
    let mut skipped = Vec::new();
    let kept_of = |path: &str| previous.and_then(|p| p.rows.get(path)).cloned().unwrap_or_default();
    let reusable = |path: &str| previous.filter(|p| !p.unread.contains(path)).and_then(|p| p.rows.get(path));
    // generation → (its dead trace ids, their sessions, whether every steps
    // file of it was kept)
    let mut generations: HashMap<u64, (HashSet<String>, BTreeSet<String>, bool)> = HashMap::new();
    for (id, path, rows, live) in snap.shard_liveness_keeping(keep_liveness) {
        let rel = relative(shards_dir, &path);
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                // Its footer cannot be decoded: it keeps what was listed of
                // it, as a file that cannot be read.
                skipped.push((rel.clone(), e.message().to_owned()));
                let listed = kept_of(&rel);
                if let Some(g) = crate::shard::generation_of(&rel) {
                    let (traces, sessions, all_kept) =
                        generations.entry(g).or_insert_with(|| (HashSet::new(), BTreeSet::new(), true));
                    *all_kept = false;
                    traces.extend(listed.iter().filter_map(|(_, _, t)| t.clone()));
                    sessions.extend(listed.iter().map(|(_, s, _)| s.clone()));
                }
                if !listed.is_empty() {
                    out.insert(rel, listed);
                }
                continue;
            }
        };
        let dead = rows.saturating_sub(live);
        if dead == 0 {
            continue;
        }
        let Some(g) = crate::shard::generation_of(&rel) else { continue };
        let kept = reusable(&rel).filter(|listed| listed.len() as u64 == dead);
        let (traces, sessions, all_kept) =
            generations.entry(g).or_insert_with(|| (HashSet::new(), BTreeSet::new(), true));
        let listed = match kept {
            Some(listed) => listed.clone(),
            None => match snap.dead_steps_rows(id) {
                Ok(rows) => {
                    *all_kept = false;
                    rows
                }
                Err(e) => {
                    // Its generation's trajectories keep what they had.
                    skipped.push((rel.clone(), e.message().to_owned()));
                    kept_of(&rel)
                }
            },
        };
        traces.extend(listed.iter().filter_map(|(_, _, t)| t.clone()));
        sessions.extend(listed.iter().map(|(_, s, _)| s.clone()));
        if !listed.is_empty() {
            out.insert(rel, listed);
        }
    }
    for shard in manifest.shards.iter().filter(|s| s.path.starts_with("trajectories/")) {
        let Some((traces, sessions, all_kept)) =
            crate::shard::generation_of(&shard.path).and_then(|g| generations.get(&g))
        else {
            continue;
        };
        let reuse = *all_kept && previous.is_some_and(|p| !p.unread.contains(&shard.path));
        let listed = match previous.filter(|_| reuse) {
            Some(p) => p.rows.get(&shard.path).cloned().unwrap_or_default(),
            None => {
                // A trajectory holds calls of its own session only: the
                // rows of the dead rows' sessions are the ones to check.
                let path = shards_dir.join(&shard.path);
                match crate::shard::reader::trajectory_trace_ids(&path, shard.checksum, sessions) {
                    Ok(rows) => rows
                        .into_iter()
                        .filter(|(_, _, ids)| ids.iter().any(|t| traces.contains(t)))
                        .map(|(row, session, _)| (row, session, None))
                        .collect(),
                    Err(e) => {
                        skipped.push((shard.path.clone(), e.message().to_owned()));
                        kept_of(&shard.path)
                    }
                }
            }
        };
        if !listed.is_empty() {
            out.insert(shard.path.clone(), listed);
        }
    }
    let unread = skipped.iter().map(|(p, _)| p.clone()).collect();
    (Table { rows: out, unread }, skipped)
}

/// `path` under `shards_dir`, as the manifest names it (`steps/NAME`).
fn relative(shards_dir: &Path, path: &Path) -> String {
    match path.strip_prefix(shards_dir) {
        Ok(rel) => rel.to_string_lossy().into_owned(),
        Err(_) => format!("steps/{}", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()),
    }
}

/// The side table's bytes.
fn encode(t: &Table) -> Result<Vec<u8>> {
    let table = &t.rows;
    let (mut path, mut row, mut sid, mut tid) =
        (StringBuilder::new(), Int64Builder::new(), StringBuilder::new(), StringBuilder::new());
    for (p, rows) in table {
        for (r, s, t) in rows {
            path.append_value(p);
            row.append_value(i64::try_from(*r).unwrap_or(i64::MAX));
            sid.append_value(s);
            tid.append_option(t.as_deref());
        }
    }
    let columns: Vec<ArrayRef> =
        vec![Arc::new(path.finish()), Arc::new(row.finish()), Arc::new(sid.finish()), Arc::new(tid.finish())];
    let batch = RecordBatch::try_new(Arc::new(deletions_schema()), columns)
        .map_err(|e| Error::new(ErrorKind::Io, format!("internal: deletions side table batch: {e}")))?;
    let mut kv = vec![KeyValue::new(KEY_VERSION.to_owned(), DELETIONS_FORMAT_VERSION.to_owned())];
    if !t.unread.is_empty() {
        kv.push(KeyValue::new(KEY_UNREAD.to_owned(), t.unread.iter().cloned().collect::<Vec<_>>().join("\n")));
    }
    let props = WriterProperties::builder().set_key_value_metadata(Some(kv)).build();
    let mut bytes = Vec::new();
    let mut w = ArrowWriter::try_new(&mut bytes, batch.schema(), Some(props))
        .map_err(|e| parquet_err("deletions side table", e))?;
    w.write(&batch).map_err(|e| parquet_err("deletions side table", e))?;
    w.close().map_err(|e| parquet_err("deletions side table", e))?;
    Ok(bytes)
}

/// Why a side table file cannot be used.
pub(crate) enum Bad {
    /// `trajlog.deletions_format_version` names another version.
    Version(String),
    /// Anything else: what is wrong.
    Other(String),
}

/// Read and check a side table file: format version, schema, no nulls but
/// in `trace_id`, rows in (path, row) order without repeats.
pub(crate) fn read(path: &Path) -> std::result::Result<Table, Bad> {
    let bad = |what: String| Bad::Other(what);
    let file = File::open(path).map_err(|e| bad(format!("cannot be opened: {e}")))?;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| bad(format!("not a readable Parquet file: {e}")))?;
    let kv = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    match kv.iter().find(|e| e.key == KEY_VERSION).and_then(|e| e.value.clone()) {
        Some(v) if v == DELETIONS_FORMAT_VERSION => {}
        Some(v) => return Err(Bad::Version(v)),
        None => return Err(bad(format!("{KEY_VERSION} is missing"))),
    }
    let unread: BTreeSet<String> = kv
        .iter()
        .find(|e| e.key == KEY_UNREAD)
        .and_then(|e| e.value.as_deref())
        .map(|v| v.lines().map(str::to_owned).collect())
        .unwrap_or_default();
    let have = builder.schema();
    if !super::rewards::same_columns(have, &deletions_schema()) {
        return Err(bad(format!("schema is {have:?}, expected path utf8, row int64, session_id utf8, trace_id utf8")));
    }
    let reader = builder.build().map_err(|e| bad(format!("cannot be read: {e}")))?;
    let mut out = Deletions::new();
    let mut last: Option<(String, i64)> = None;
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("cannot be read: {e}")))?;
        let (Some(p), Some(r), Some(s), Some(t)) = (
            batch.column(0).as_string_opt::<i32>(),
            batch.column(1).as_primitive_opt::<arrow_array::types::Int64Type>(),
            batch.column(2).as_string_opt::<i32>(),
            batch.column(3).as_string_opt::<i32>(),
        ) else {
            return Err(bad("columns of the wrong types".into()));
        };
        for i in 0..batch.num_rows() {
            if p.is_null(i) || r.is_null(i) || s.is_null(i) {
                return Err(bad(format!("row {i} of a batch: path, row or session_id is null")));
            }
            let (path, row) = (p.value(i), r.value(i));
            if row < 0 {
                return Err(bad(format!("{path}: row {row} is negative")));
            }
            let steps = path.starts_with("steps/");
            if !steps && !path.starts_with("trajectories/") {
                return Err(bad(format!("path {path:?} is not steps/NAME or trajectories/NAME")));
            }
            if steps == t.is_null(i) {
                return Err(bad(format!("{path} row {row}: trace_id must be set for a steps row, null otherwise")));
            }
            if last.as_ref().is_some_and(|(lp, lr)| (lp.as_str(), *lr) >= (path, row)) {
                return Err(bad(format!("{path} row {row}: rows are not in (path, row) order, or repeated")));
            }
            last = Some((path.to_owned(), row));
            let trace = (!t.is_null(i)).then(|| t.value(i).to_owned());
            out.entry(path.to_owned()).or_default().push((row as u64, s.value(i).to_owned(), trace));
        }
    }
    Ok(Table { rows: out, unread })
}

/// Check the side table of the store in `dir` (`trajlog verify`): readable,
/// of this format, and listing only rows that are dead in what a read-only
/// open of the store serves. A listed live row would hide a call from the
/// readers of the shards.
///
/// A store that a writer changes meanwhile moves on between the reads: the
/// manifest is read before the table and again after the open, and the
/// check is made only over one manifest (the table then is this
/// publication's, or an earlier one's, whose dead rows are still dead in the
/// files still published); else it is tried again, and after a few tries
/// it is not made ("the store changed while verify ran"). `manifest`
/// is the one verify read first.
pub(crate) fn check(dir: &Path, manifest: &Manifest) -> std::result::Result<DeletionsCheck, String> {
    const TRIES: usize = 4;
    let read_manifest = || std::fs::read(dir.join(crate::storage::MANIFEST_NAME)).ok();
    for _ in 0..TRIES {
        let before = read_manifest();
        let listed = match read(&dir.join(SHARDS_DIR).join(DELETIONS_FILE)) {
            Ok(t) => t,
            Err(Bad::Version(v)) => {
                return Err(format!("{KEY_VERSION} is {v:?}, expected \"{DELETIONS_FORMAT_VERSION}\""))
            }
            Err(Bad::Other(what)) => return Err(what),
        };
        let store = Store::open_read_only(dir).map_err(|e| format!("not checked: the store does not open: {e}"))?;
        if before.is_none() || read_manifest() != before {
            continue;
        }
        let current = before.as_deref().and_then(|b| crate::format::manifest::decode_manifest(b).ok());
        return check_over(dir, current.as_ref().unwrap_or(manifest), &listed, &store);
    }
    Err(format!("not checked: the store changed while verify ran ({TRIES} tries: a writer rolled or compacted); run it again while no writer changes it"))
}

/// [`check`] of `listed` against `store`, opened over `manifest`.
fn check_over(
    dir: &Path,
    manifest: &Manifest,
    listed: &Table,
    store: &Store,
) -> std::result::Result<DeletionsCheck, String> {
    let shards_dir = dir.join(SHARDS_DIR);
    let snap = store.snapshot();
    let (dead, skipped) = dead_rows(&snap, manifest, &shards_dir, None, false);
    if let Some((path, e)) = skipped.first() {
        return Err(format!("not checked: shards/{path} cannot be read: {e}"));
    }
    let published: HashSet<&str> = manifest.shards.iter().map(|s| s.path.as_str()).collect();
    let mut check = DeletionsCheck::default();
    for (path, rows) in &listed.rows {
        if !published.contains(path.as_str()) {
            continue; // a file a collection took away since: nothing reads it
        }
        let now: HashSet<u64> = dead.rows.get(path).map(|d| d.iter().map(|(r, _, _)| *r).collect()).unwrap_or_default();
        if let Some((row, _, _)) = rows.iter().find(|(r, _, _)| !now.contains(r)) {
            return Err(format!(
                "it lists {path} row {row}, which holds a live call: a reader applying it would miss that call; delete it (a compaction writes it anew)"
            ));
        }
        check.listed += rows.len() as u64;
    }
    let all: u64 = dead.rows.values().map(|d| d.len() as u64).sum();
    check.not_yet_listed = all - check.listed;
    Ok(check)
}

impl Store {
    /// Rewrite the side table for the view a publication just made, whose
    /// manifest is `manifest` (in the compacting thread, while no other
    /// publication can run). Nothing to do for a store without shards and
    /// without a table; an unchanged table is not rewritten. On failure the previous table stays. Returns the shard
    /// files that could not be read (see [`dead_rows`]).
    /// `keep_liveness`: the compaction is batched, so the next batch's
    /// collection plan counts the same live rows
    /// (`Snapshot::shard_liveness_keeping`).
    pub(super) fn write_deletions(&self, manifest: &Manifest, keep_liveness: bool) -> Result<Vec<(String, String)>> {
        let shards_dir = self.inner.dir.join(SHARDS_DIR);
        let file = shards_dir.join(DELETIONS_FILE);
        let previous = read(&file).ok();
        if manifest.shards.is_empty() && !file.exists() {
            return Ok(Vec::new());
        }
        let snap = Snapshot::new(lock(&self.inner.view).clone());
        // The view holds only records the writer wrote; with `Buffered`
        // durability they may not be durable yet. Made so before the table
        // lists a deletion of theirs (a power loss must not leave a listed
        // row live again).
        self.sync()?;
        // An open that left damaged records out (skip-corrupted) may have
        // brought a listed row back to life: nothing listed is reused then.
        let previous = previous.filter(|_| snap.damage().is_empty());
        let (table, skipped) = dead_rows(&snap, manifest, &shards_dir, previous.as_ref(), keep_liveness);
        drop(snap);
        if previous.as_ref() != Some(&table) {
            let bytes = encode(&table)?;
            crate::storage::write_atomic(&shards_dir, DELETIONS_FILE, &bytes, &self.inner.options.faults)?;
        }
        Ok(skipped)
    }
}
