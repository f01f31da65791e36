//! The rewards side table, `DIR/shards/_rewards.parquet` (format-spec/shard.md
//! §8): the current rewards of sessions whose rewards changed after they were
//! compacted, for readers of the shards (a shard row keeps the reward its
//! session had when it was compacted).
//!
//! The writer notes, in `dirty`, every session a reward annotation concerns
//! while the session has shard rows or a compaction is under way; each
//! publication rewrites the table with the current rewards of the sessions it
//! listed plus the dirty ones, and records how far into the log it reflects
//! (`through`). At open, the reward annotations found in the log after that
//! point are noted again, so a crash between a reward and the next
//! publication loses nothing: the work and the table stay proportional to the
//! rewards set after compaction, not to the store.

use super::*;
use crate::shard::writer::parquet_err;
use arrow_array::builder::{Float64Builder, StringBuilder};
use arrow_array::cast::AsArray;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use std::collections::BTreeSet;

/// The side table's file name, in `DIR/shards/`.
pub const REWARDS_FILE: &str = "_rewards.parquet";
/// `trajlog.rewards_format_version` of the files written here.
pub const REWARDS_FORMAT_VERSION: &str = "1";
const KEY_VERSION: &str = "trajlog.rewards_format_version";
const KEY_THROUGH: &str = "trajlog.rewards_through";

/// The writer's state of the side table.
#[derive(Debug, Default)]
pub(super) struct RewardsTable {
    /// Reward annotations before this log position are reflected in the file
    /// (None: no usable file, so every reward annotation in the log counts).
    pub(super) through: Option<Loc>,
    /// The sessions the file lists.
    pub(super) listed: BTreeSet<Arc<str>>,
    /// Sessions whose rewards may differ from their shard rows' and are not
    /// in the file yet.
    pub(super) dirty: HashSet<Arc<str>>,
}

/// The side table's schema (format-spec/shard.md §8).
pub fn rewards_schema() -> Schema {
    Schema::new(vec![
        Field::new("session_id", DataType::Utf8, false),
        Field::new("trace_id", DataType::Utf8, true),
        Field::new("reward", DataType::Float64, true),
    ])
}

impl RewardsTable {
    /// Read the file the last publication wrote, if any. A missing file is
    /// an empty table reflecting nothing; so is an unreadable one (it is
    /// rebuilt, from every reward annotation in the log, at the next
    /// publication). A file of another format version is refused.
    pub(super) fn open(dir: &Path) -> Result<RewardsTable> {
        let path = dir.join(SHARDS_DIR).join(REWARDS_FILE);
        match read(&path) {
            Ok((through, listed)) => Ok(RewardsTable { through: Some(through), listed, dirty: HashSet::new() }),
            Err(Bad::Version(v)) => Err(Error::new(
                ErrorKind::Incompatible,
                format!(
                    "{}: rewards side table format {v:?} (this build reads 1); use a matching trajlog",
                    path.display()
                ),
            )),
            Err(Bad::Other(_)) => Ok(RewardsTable::default()),
        }
    }

    /// Whether a reward annotation at `loc`, found at open, is not yet
    /// reflected in the file.
    pub(super) fn after_through(&self, loc: Loc) -> bool {
        self.through.is_none_or(|t| loc >= t)
    }
}

/// Why a side table file cannot be used.
enum Bad {
    /// `trajlog.rewards_format_version` names another version.
    Version(String),
    /// Anything else: what is wrong.
    Other(String),
}

/// Check a side table file (`trajlog verify`): its format version, its
/// `through` position, its schema, and its rows' order (one session row per
/// listed session, each session's trace rows after it, a reward on every trace
/// row). Returns how many sessions it lists, or what is wrong.
pub(crate) fn check_file(path: &Path) -> std::result::Result<usize, String> {
    match read(path) {
        Ok((_, listed)) => Ok(listed.len()),
        Err(Bad::Version(v)) => Err(format!("{KEY_VERSION} is {v:?}, expected \"{REWARDS_FORMAT_VERSION}\"")),
        Err(Bad::Other(what)) => Err(what),
    }
}

/// Read and check a side table file: its `through` position and the
/// sessions it lists.
fn read(path: &Path) -> std::result::Result<(Loc, BTreeSet<Arc<str>>), Bad> {
    use arrow_array::Array;
    let bad = |what: String| Bad::Other(what);
    let file = File::open(path).map_err(|e| bad(format!("cannot be opened: {e}")))?;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| bad(format!("not a readable Parquet file: {e}")))?;
    let kv = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    let get = |k: &str| kv.iter().find(|e| e.key == k).and_then(|e| e.value.clone());
    match get(KEY_VERSION) {
        Some(v) if v == REWARDS_FORMAT_VERSION => {}
        Some(v) => return Err(Bad::Version(v)),
        None => return Err(bad(format!("{KEY_VERSION} is missing"))),
    }
    let through = get(KEY_THROUGH)
        .as_deref()
        .and_then(parse_loc)
        .ok_or_else(|| bad(format!("{KEY_THROUGH} is missing or not SEGMENT:OFFSET")))?;
    let have = builder.schema();
    if !same_columns(have, &rewards_schema()) {
        return Err(bad(format!("schema is {have:?}, expected session_id utf8, trace_id utf8, reward float64")));
    }
    let reader = builder.build().map_err(|e| bad(format!("cannot be read: {e}")))?;
    let mut listed: BTreeSet<Arc<str>> = BTreeSet::new();
    let mut current: Option<Arc<str>> = None;
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("cannot be read: {e}")))?;
        let (Some(sid), Some(tid), Some(reward)) = (
            batch.column(0).as_string_opt::<i32>(),
            batch.column(1).as_string_opt::<i32>(),
            batch.column(2).as_primitive_opt::<arrow_array::types::Float64Type>(),
        ) else {
            return Err(bad("columns of the wrong types".into()));
        };
        for i in 0..batch.num_rows() {
            if sid.is_null(i) {
                return Err(bad(format!("row {i}: session_id is null")));
            }
            let s = sid.value(i);
            if tid.is_null(i) {
                let s: Arc<str> = Arc::from(s);
                if !listed.insert(s.clone()) {
                    return Err(bad(format!("session {s:?} has two session rows")));
                }
                current = Some(s);
            } else if current.as_deref() != Some(s) {
                return Err(bad(format!("trace {:?} of session {s:?} does not follow its session row", tid.value(i))));
            } else if reward.is_null(i) {
                return Err(bad(format!("trace {:?} has a null reward", tid.value(i))));
            }
        }
    }
    Ok((through, listed))
}

/// Whether a side table's schema has `want`'s column names and types, in
/// order (nullability aside).
pub(super) fn same_columns(have: &Schema, want: &Schema) -> bool {
    have.fields().len() == want.fields().len()
        && have.fields().iter().zip(want.fields()).all(|(h, w)| h.name() == w.name() && h.data_type() == w.data_type())
}

fn parse_loc(s: &str) -> Option<Loc> {
    let (segment, offset) = s.split_once(':')?;
    Some(Loc { segment: segment.parse().ok()?, offset: offset.parse().ok()? })
}

/// The sessions a reward on `target` concerns (a trace's sessions: its
/// primary session and its uids).
pub(super) fn sessions_of_target(index: &Index, target: &Target) -> Vec<Arc<str>> {
    match target {
        Target::Session(s) => vec![Arc::from(s.as_str())],
        Target::Trace(t) => index.live(t.as_str()).map(|m| m.sessions().to_vec()).unwrap_or_default(),
    }
}

/// The side table's bytes: a session row (trace_id null, the session's
/// reward) then one row per rewarded trace of the session, for each session
/// of `sessions` that still exists, in session order.
fn encode(index: &Index, sessions: &BTreeSet<Arc<str>>, through: Loc) -> Result<(Vec<u8>, BTreeSet<Arc<str>>)> {
    let mut sid = StringBuilder::new();
    let mut tid = StringBuilder::new();
    let mut reward = Float64Builder::new();
    let mut listed = BTreeSet::new();
    for s in sessions {
        let Some(summary) = index.session_summary(s.as_ref()) else { continue };
        listed.insert(s.clone());
        sid.append_value(s.as_ref());
        tid.append_null();
        reward.append_option(summary.reward);
        for key in index.session_calls(s.as_ref()).iter() {
            if let Some(v) = index.trace_reward(key.trace_id.as_ref()) {
                sid.append_value(s.as_ref());
                tid.append_value(key.trace_id.as_ref());
                reward.append_value(v);
            }
        }
    }
    let columns: Vec<ArrayRef> = vec![Arc::new(sid.finish()), Arc::new(tid.finish()), Arc::new(reward.finish())];
    let batch = RecordBatch::try_new(Arc::new(rewards_schema()), columns)
        .map_err(|e| Error::new(ErrorKind::Io, format!("internal: rewards side table batch: {e}")))?;
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(vec![
            KeyValue::new(KEY_VERSION.to_owned(), REWARDS_FORMAT_VERSION.to_owned()),
            KeyValue::new(KEY_THROUGH.to_owned(), format!("{}:{}", through.segment, through.offset)),
        ]))
        .build();
    let mut bytes = Vec::new();
    let mut w = ArrowWriter::try_new(&mut bytes, batch.schema(), Some(props))
        .map_err(|e| parquet_err("rewards side table", e))?;
    w.write(&batch).map_err(|e| parquet_err("rewards side table", e))?;
    w.close().map_err(|e| parquet_err("rewards side table", e))?;
    Ok((bytes, listed))
}

impl Writer {
    /// Note a reward annotation applied now: the sessions it concerns are
    /// dirty if they have shard rows, or if a compaction is under way (it may
    /// be compacting them with the reward they had when it began).
    pub(super) fn note_reward(&mut self, target: &Target) {
        for s in sessions_of_target(&self.index, target) {
            if self.journal.is_some() || self.shard_sessions.contains(&s) {
                self.rewards.dirty.insert(s);
            }
        }
    }

    /// Rewrite the side table after a publication (format-spec/shard.md §8):
    /// the sessions listed plus the dirty ones, with their current rewards,
    /// reflecting the log up to its end now. Nothing to do while no shard
    /// exists. On failure the table on disk is the previous one and the
    /// dirty sessions stay noted, for the next publication.
    pub(super) fn write_rewards(&mut self) -> Result<()> {
        if self.manifest.shards.is_empty() && self.rewards.listed.is_empty() {
            return Ok(());
        }
        self.write_buf()?;
        let through = {
            let a = self.active()?;
            Loc { segment: a.id, offset: a.len }
        };
        if self.rewards.dirty.is_empty() && self.rewards.through == Some(through) {
            return Ok(());
        }
        let mut sessions = self.rewards.listed.clone();
        sessions.extend(self.rewards.dirty.iter().cloned());
        let (bytes, listed) = encode(&self.index, &sessions, through)?;
        let shards_dir = self.dir.join(SHARDS_DIR);
        fs::create_dir_all(&shards_dir).map_err(|e| Error::io(format!("create {}", shards_dir.display()), e))?;
        crate::storage::write_atomic(&shards_dir, REWARDS_FILE, &bytes, &self.options.faults)?;
        self.rewards.listed = listed;
        self.rewards.dirty.clear();
        self.rewards.through = Some(through);
        Ok(())
    }
}
