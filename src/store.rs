//! `Store`: owns the writer thread, the segments and the published indexes —
//! the only place in the crate with locks and threads.
//!
//! # Write path
//! `append` validates the call (nothing is written if that fails), takes a
//! sequence number and hands the call over a bounded channel to the writer
//! thread (a full channel makes the caller wait: back-pressure, never a drop).
//! The writer drains the channel in batches, chooses each call's prefix-delta
//! parent, frames and CRCs it, writes the batch with one positional write, and
//! makes it durable according to [`Durability`]. Only then does it publish a new
//! index view and advance the durable sequence number that [`Receipt`]s wait on.
//! Any failed write or fsync poisons the store.
//!
//! # Read path
//! [`Store::snapshot`] clones an `Arc` of the last published view. A view holds
//! persistent maps and `Arc`s of the segment mappings, so it stays consistent
//! and valid however long it is held, while the writer appends, seals and rolls.

use crate::compact::reader::{ShardFile, ShardRow};
use crate::delta::{Context, DeltaCache};
use crate::error::{Error, ErrorKind, Result};
use crate::format::frame::{frame_bytes, write_frame};
use crate::format::manifest::{
    decode_manifest, encode_manifest, Manifest, ManifestSegment, PendingRename, SegmentState, ShardChecksum,
};
use crate::format::record::{
    call_body_len, decode_annotation, encode_annotation, encode_call, Loc, KIND_CALL, KIND_DELETE_SESSION, KIND_SEAL,
};
use crate::format::segment::FooterEntry;
use crate::index::{sessions_of, CallMeta, Index};
use crate::limits::*;
use crate::record::{Annotation, Call, Target};
use crate::segment::recovery::load_segment;
use crate::segment::writer::ActiveSegment;
use crate::segment::SegmentRef;
use crate::snapshot::{Snapshot, View};
use crate::verify::Problem;
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// When an append counts as done (see README "Durability").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Written to the OS page cache in the writer's batch: survives a crash of
    /// this process, not a power loss.
    Buffered,
    /// fsync every `group_commit_ms` while records wait for one, and at once
    /// when a caller waits for durability (callers waiting together share one
    /// fsync); acknowledged after that fsync: survives power loss once
    /// acknowledged.
    Group,
    /// fsync before each acknowledgement (concurrent appends share one fsync).
    Sync,
}

impl std::str::FromStr for Durability {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "buffered" => Ok(Durability::Buffered),
            "group" => Ok(Durability::Group),
            "sync" => Ok(Durability::Sync),
            _ => Err(Error::invalid("durability", format!("{s:?} is not one of buffered, group, sync"))),
        }
    }
}

/// How to open a store. `Options::default()` is a sensible start.
#[derive(Debug, Clone)]
pub struct Options {
    pub durability: Durability,
    /// Group-commit interval for [`Durability::Group`].
    pub group_commit_ms: u64,
    /// Seal and roll to a new segment when the active one reaches this size.
    pub segment_bytes: u64,
    /// Records in flight between appenders and the writer thread.
    pub queue_depth: usize,
    /// Memory for prefix-delta contexts.
    pub delta_cache_bytes: u64,
    /// Fault injection for tests (see [`crate::storage::fault`]); None in use.
    pub faults: crate::storage::fault::Faults,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            durability: Durability::Group,
            group_commit_ms: DEFAULT_GROUP_COMMIT_MS,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            delta_cache_bytes: DEFAULT_DELTA_CACHE_BYTES,
            faults: None,
        }
    }
}

impl Options {
    fn validate(&self) -> Result<()> {
        if self.segment_bytes < SEGMENT_BYTES_MIN {
            return Err(Error::limit(
                "SEGMENT_BYTES_MIN",
                "segment_bytes (too small)",
                self.segment_bytes,
                SEGMENT_BYTES_MIN,
            ));
        }
        if self.queue_depth == 0 {
            return Err(Error::invalid("queue_depth", "must be at least 1"));
        }
        Ok(())
    }
}

enum Cmd {
    Append {
        seq: u64,
        call: Box<Call>,
    },
    Annotate {
        seq: u64,
        ann: Annotation,
        reply: Option<Sender<u64>>,
    },
    Flush {
        fsync: bool,
        reply: Sender<Result<()>>,
    },
    /// A caller waits for durability (group commit): fsync after this batch
    /// instead of at the timer.
    SyncSoon,
    Roll {
        reply: Sender<Result<()>>,
    },
    /// Reserve a shard generation number for a compaction.
    ReserveGeneration {
        reply: Sender<u64>,
    },
    /// Publish staged shards, switch compacted calls to them, retire segments.
    Publish {
        staged: Vec<PendingRename>,
        sessions: Vec<String>,
        reply: Sender<Result<PublishOutcome>>,
    },
}

/// What publishing a compaction did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishOutcome {
    pub calls_placed: u64,
    pub retired_segments: Vec<u64>,
}

/// An append not yet durable: its sequence number and its sessions.
type InFlightCall = (u64, Arc<[Arc<str>]>);

struct SendState {
    next_seq: u64,
    tx: Option<Sender<Cmd>>,
    /// Sealed sessions: appends to them are refused at the boundary.
    sealed: HashSet<String>,
    /// Appends not yet durable (so not yet in the published view), by trace id:
    /// their sequence number and sessions. Checked with the view for the trace
    /// id rule; pruned once durable.
    calls_in_flight: std::collections::HashMap<String, InFlightCall>,
    /// Session deletions not yet durable: (sequence number, session).
    deletes_in_flight: Vec<(u64, String)>,
    /// Prune `calls_in_flight` when it grows past this (amortized O(1)).
    prune_at: usize,
}

impl SendState {
    fn new(tx: Option<Sender<Cmd>>, sealed: HashSet<String>) -> Self {
        Self {
            next_seq: 0,
            tx,
            sealed,
            calls_in_flight: std::collections::HashMap::new(),
            deletes_in_flight: Vec::new(),
            prune_at: 1024,
        }
    }

    /// Forget in-flight entries the published view now covers.
    fn prune(&mut self, durable_seq: u64) {
        if self.calls_in_flight.len() > self.prune_at {
            self.calls_in_flight.retain(|_, (seq, _)| *seq > durable_seq);
            self.prune_at = (2 * self.calls_in_flight.len()).max(1024);
        }
        if self.deletes_in_flight.len() > 64 {
            self.deletes_in_flight.retain(|(seq, _)| *seq > durable_seq);
        }
    }

    /// Whether `session` is deleted by a deletion appended after `seq`.
    fn deleted_after(&self, session: &str, seq: u64) -> bool {
        self.deletes_in_flight.iter().any(|(s, id)| *s > seq && id == session)
    }
}

/// The trace id rule (format-spec/record.md §6): trace ids are unique per store.
/// Re-appending a live trace id replaces that call only within the same session
/// (`session_id`), and never takes it out of a sealed session.
fn check_trace_id(call: &Call, current: &[Arc<str>], sealed: &HashSet<String>) -> Result<()> {
    let Some(primary) = current.first() else { return Ok(()) };
    if **primary != *call.session_id {
        return Err(Error::invalid(
            "trace_id",
            format!(
                "trace {:?} already belongs to session {:?}, so it cannot be appended to session {:?}: trace ids are unique per store (re-appending one replaces the call only within its own session); use a new trace id, or delete session {:?} first",
                call.trace_id, &**primary, call.session_id, &**primary
            ),
        ));
    }
    for s in current.iter().skip(1) {
        if sealed.contains(&**s) && !call.session_uids.iter().any(|u| u == &**s) {
            return Err(Error::invalid(
                "session_uids",
                format!(
                    "trace {:?} belongs to the sealed session {:?}; replacing it without that session uid would take it out of a sealed session",
                    call.trace_id, &**s
                ),
            ));
        }
    }
    Ok(())
}

struct Durable {
    seq: u64,
    poisoned: Option<String>,
    closed: bool,
}

struct Inner {
    dir: PathBuf,
    options: Options,
    send: Mutex<SendState>,
    durable: Mutex<Durable>,
    durable_cv: Condvar,
    durable_seq: AtomicU64,
    poisoned: AtomicBool,
    view: Mutex<Arc<View>>,
    /// One compaction at a time (two would compact the same sessions twice).
    compacting: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn wait_durable(&self, seq: u64) -> Result<()> {
        if self.durable_seq.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        let mut d = lock(&self.durable);
        loop {
            if d.seq >= seq {
                return Ok(());
            }
            if let Some(p) = &d.poisoned {
                return Err(Error::poisoned(p));
            }
            if d.closed {
                return Err(Error::closed());
            }
            d = self.durable_cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn poison(&self, cause: &Error) {
        let mut d = lock(&self.durable);
        if d.poisoned.is_none() {
            d.poisoned = Some(cause.to_string());
        }
        self.poisoned.store(true, Ordering::Release);
        self.durable_cv.notify_all();
    }

    fn poisoned_error(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        let d = lock(&self.durable);
        d.poisoned.as_deref().map(Error::poisoned)
    }

    fn set_view(&self, view: Arc<View>) {
        *lock(&self.view) = view;
    }

    fn advance(&self, seq: u64) {
        let mut d = lock(&self.durable);
        d.seq = d.seq.max(seq);
        self.durable_seq.store(d.seq, Ordering::Release);
        self.durable_cv.notify_all();
    }
}

/// Proof that an append was accepted; [`Receipt::wait`] blocks until it is
/// durable at the store's level.
#[derive(Clone)]
pub struct Receipt {
    seq: u64,
    inner: Arc<Inner>,
}

impl Receipt {
    /// Wait until the record is durable; an error if the store was poisoned or
    /// closed before that.
    pub fn wait(&self) -> Result<()> {
        if self.inner.durable_seq.load(Ordering::Acquire) >= self.seq {
            return Ok(());
        }
        if self.inner.options.durability == Durability::Group {
            // Someone waits: commit after the writer's current batch rather than
            // at the group-commit timer. Waiters queued together share the fsync.
            let s = lock(&self.inner.send);
            if let Some(tx) = &s.tx {
                let _ = tx.send(Cmd::SyncSoon);
            }
        }
        self.inner.wait_durable(self.seq)
    }

    /// The record's sequence number in this store session (1-based, in append order).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// An open trajlog store directory.
pub struct Store {
    inner: Arc<Inner>,
    writer: Option<JoinHandle<()>>,
    read_only: bool,
    _lock: Option<File>,
}

pub(crate) const MANIFEST_NAME: &str = "MANIFEST";
/// Shards live under `DIR/shards/{steps,trajectories}/`.
pub(crate) const SHARDS_DIR: &str = "shards";
pub(crate) const SHARD_TABLES: [&str; 2] = ["steps", "trajectories"];
const LOCK_NAME: &str = "LOCK";

fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join(MANIFEST_NAME);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
    };
    decode_manifest(&bytes).map(Some).map_err(|e| {
        if e.what.contains("unsupported format version") {
            Error::new(ErrorKind::Incompatible, format!("{}: {}; use a matching trajlog", path.display(), e.what))
        } else {
            Error::corrupt(&path, e.offset, e.what)
        }
    })
}

/// Everything recovered from a directory.
struct Loaded {
    manifest: Manifest,
    index: Index,
    segments: imbl::OrdMap<u64, SegmentRef>,
    shards: Vec<Arc<ShardFile>>,
    /// Every session name that appears in a shard row (live or not).
    shard_sessions: HashSet<Arc<str>>,
    /// Every trace id that appears in a shard row (live or not).
    shard_traces: HashSet<Arc<str>>,
    /// The last segment, if unsealed: its entries and valid end.
    active: Option<(u64, PathBuf, u64, Vec<FooterEntry>)>,
    /// Damage found and confined while loading (see [`Snapshot::damage`]).
    damage: Vec<Problem>,
}

/// Apply one footer entry (and, for annotations, the record) to `index`.
///
/// A damaged annotation stays confined: seals and deletions are applied from
/// the footer entry (kind and target), which is all they hold; a damaged
/// reward is skipped. Either way the damage is reported in `damage`.
fn apply_entry(index: &mut Index, seg: &SegmentRef, e: &FooterEntry, damage: &mut Vec<Problem>) {
    let loc = Loc { segment: seg.id, offset: e.frame_offset };
    if e.kind == KIND_CALL {
        index.apply_call(CallMeta {
            loc,
            shard: None,
            timestamp: e.timestamp,
            trace_id: Arc::from(e.id.as_str()),
            sessions: sessions_of(&e.session_id, &e.session_uids),
        });
        return;
    }
    let decoded = seg.body_at(e.frame_offset).and_then(|body| {
        decode_annotation(body).map_err(|d| Error::corrupt(seg.path.as_path(), e.frame_offset, d.what))
    });
    let ann = match decoded {
        Ok(ann) => ann,
        Err(err) => {
            let from_footer = match e.kind {
                KIND_SEAL => Some(Annotation::Seal { session_id: e.id.clone() }),
                KIND_DELETE_SESSION => Some(Annotation::DeleteSession { session_id: e.id.clone() }),
                _ => None,
            };
            let what = match &from_footer {
                Some(_) => format!("damaged annotation, applied from the footer entry: {}", err.message()),
                None => format!("damaged reward annotation skipped (target {:?}): {}", e.id, err.message()),
            };
            damage.push(Problem { path: seg.path.as_path().to_path_buf(), offset: e.frame_offset, what });
            match from_footer {
                Some(ann) => ann,
                None => return,
            }
        }
    };
    apply_annotation(index, &ann);
}

fn apply_shard_row(index: &mut Index, row: &ShardRow) {
    index.apply_call(CallMeta {
        loc: row.loc,
        shard: Some(row.pos),
        timestamp: row.timestamp,
        trace_id: Arc::from(row.trace_id.as_str()),
        sessions: sessions_of(&row.session_id, &row.session_uids),
    });
}

fn apply_annotation(index: &mut Index, ann: &Annotation) -> u64 {
    match ann {
        Annotation::Reward { target: Target::Trace(t), value } => index.set_trace_reward(t, *value),
        Annotation::Reward { target: Target::Session(s), value } => index.set_session_reward(s, *value),
        Annotation::Seal { session_id } => index.seal(session_id),
        Annotation::DeleteSession { session_id } => return index.delete_session(session_id),
    }
    0
}

/// The `steps` shards of a manifest, in publication order (their shard ids).
/// `pending` publications count too, at their final path if the rename
/// happened, else at their staged path (read-only opens do not rename).
/// Each with the manifest entry's checksum, if it has one.
fn steps_shard_paths(dir: &Path, manifest: &Manifest) -> Vec<(PathBuf, Option<ShardChecksum>)> {
    let shards = dir.join(SHARDS_DIR);
    let published = manifest.shards.iter().map(|s| (shards.join(&s.path), s.checksum));
    let pending = manifest.pending.iter().map(|p| {
        let done = shards.join(&p.shard.path);
        if done.exists() {
            (done, p.shard.checksum)
        } else {
            (shards.join(&p.staged), p.shard.checksum)
        }
    });
    let steps = |(p, _): &(PathBuf, _)| p.parent().and_then(|d| d.file_name()).is_some_and(|n| n == "steps");
    published.chain(pending).filter(steps).collect()
}

/// Open shards and read their index rows (sorted by log position).
fn load_shards(paths: &[(PathBuf, Option<ShardChecksum>)]) -> Result<(Vec<Arc<ShardFile>>, Vec<ShardRow>)> {
    let mut files = Vec::with_capacity(paths.len());
    let mut rows = Vec::new();
    for (i, (path, expected)) in paths.iter().enumerate() {
        if !path.exists() {
            let dir = path.parent().and_then(Path::parent).and_then(Path::parent).unwrap_or(Path::new("."));
            return Err(missing_listed_file(dir, path));
        }
        let f = ShardFile::open(path, i as u32, *expected)?;
        f.index_rows(&mut rows)?;
        files.push(Arc::new(f));
    }
    rows.sort_by_key(|r| r.loc);
    Ok((files, rows))
}

/// A file the manifest lists is gone.
fn missing_listed_file(dir: &Path, path: &Path) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!(
            "{} is listed in the MANIFEST but missing. Restore it if you can; otherwise `trajlog repair --store {}` rebuilds the MANIFEST from the files that exist (the records only that file held are lost)",
            path.display(),
            dir.display()
        ),
    )
}

/// Load every segment and shard of the manifest and rebuild the indexes by
/// replaying records in log order; a shard row stands at the log position of
/// the call it was compacted from (format-spec/shard.md §4).
fn load_dir(dir: &Path, manifest: Manifest) -> Result<Loaded> {
    let mut index = Index::default();
    let mut segments = imbl::OrdMap::new();
    let mut active = None;
    let (shards, rows) = load_shards(&steps_shard_paths(dir, &manifest))?;
    let mut shard_sessions = HashSet::new();
    let shard_traces: HashSet<Arc<str>> = rows.iter().map(|r| Arc::from(r.trace_id.as_str())).collect();
    for r in &rows {
        for s in sessions_of(&r.session_id, &r.session_uids).iter() {
            shard_sessions.insert(s.clone());
        }
    }
    let mut rows = rows.into_iter().peekable();
    let last = manifest.segments.last().map(|s| s.id);
    let mut damage = Vec::new();
    for ms in &manifest.segments {
        let path = crate::storage::segment_path(dir, ms.id);
        if !path.exists() {
            return Err(missing_listed_file(dir, &path));
        }
        let seg = load_segment(dir, ms.id, ms.state == SegmentState::Sealed)?;
        damage.extend(seg.damage.iter().map(|d| Problem {
            path: seg.path.as_path().to_path_buf(),
            offset: d.offset,
            what: d.what.clone(),
        }));
        if !seg.sealed && Some(ms.id) != last {
            return Err(Error::corrupt(
                seg.path.as_path(),
                seg.data_end,
                "a segment before the last one is not sealed",
            ));
        }
        let r = SegmentRef::new(seg.id, seg.path.clone(), seg.map.clone(), seg.data_end, seg.sealed);
        for e in &seg.entries {
            let loc = Loc { segment: seg.id, offset: e.frame_offset };
            while let Some(row) = rows.next_if(|row| row.loc < loc) {
                apply_shard_row(&mut index, &row);
            }
            if let Some(row) = rows.next_if(|row| row.loc == loc) {
                // The call was compacted: its shard row stands for its record.
                apply_shard_row(&mut index, &row);
                continue;
            }
            apply_entry(&mut index, &r, e, &mut damage);
        }
        if !seg.sealed {
            active = Some((seg.id, seg.path.as_path().to_path_buf(), seg.data_end, seg.entries));
        }
        segments.insert(seg.id, r);
    }
    for row in rows {
        apply_shard_row(&mut index, &row);
    }
    Ok(Loaded { manifest, index, segments, shards, shard_sessions, shard_traces, active, damage })
}

/// Finish a shard publication that was decided (listed as pending in the
/// manifest) but maybe not completed: rename what is still staged, then list
/// the shards as published.
fn finish_pending(dir: &Path, manifest: &mut Manifest, faults: &crate::storage::fault::Faults) -> Result<()> {
    if manifest.pending.is_empty() {
        return Ok(());
    }
    let shards = dir.join(SHARDS_DIR);
    for p in &manifest.pending {
        let (from, to) = (shards.join(&p.staged), shards.join(&p.shard.path));
        if from.exists() {
            fs::rename(&from, &to).map_err(|e| Error::io(format!("publish shard {}", to.display()), e))?;
        } else if !to.exists() {
            return Err(Error::corrupt(&to, 0, "a shard being published has neither its staged nor its final file"));
        }
    }
    for table in SHARD_TABLES {
        crate::storage::sync_dir(&shards.join(table), faults)?;
    }
    let pending = std::mem::take(&mut manifest.pending);
    manifest.shards.extend(pending.into_iter().map(|p| p.shard));
    crate::storage::write_atomic(dir, MANIFEST_NAME, &encode_manifest(manifest), faults)
}

/// Take the single-writer lock of a store directory (its `LOCK` file).
pub(crate) fn lock_dir(dir: &Path) -> Result<File> {
    let lock_path = dir.join(LOCK_NAME);
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| Error::io(format!("open {}", lock_path.display()), e))?;
    match lock_file.try_lock() {
        Ok(()) => Ok(lock_file),
        Err(fs::TryLockError::WouldBlock) => Err(Error::new(
            ErrorKind::Locked,
            format!(
                "{} is locked by another writer (its LOCK file is held); stop that process or open the store read-only",
                dir.display()
            ),
        )),
        Err(fs::TryLockError::Error(e)) => Err(Error::io(format!("lock {}", lock_path.display()), e)),
    }
}

/// Load the store `manifest` describes (read-only): the live call count and
/// the damage confined, for `trajlog repair` to check a manifest before
/// writing it.
pub(crate) fn load_for_repair(dir: &Path, manifest: Manifest) -> Result<(usize, Vec<Problem>)> {
    let loaded = load_dir(dir, manifest)?;
    Ok((loaded.index.call_count(), loaded.damage))
}

impl Store {
    /// Open (or create) a store for writing. Only one writer per directory: a
    /// second one gets `ErrorKind::Locked`.
    pub fn open(dir: impl AsRef<Path>, options: Options) -> Result<Self> {
        options.validate()?;
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create store directory {}", dir.display()), e))?;
        let lock_file = lock_dir(&dir)?;
        let manifest = match read_manifest(&dir)? {
            Some(m) => m,
            None => {
                // A new store — unless there are data files: never start an
                // empty manifest over them (it would make them orphans).
                let inv = crate::repair::inventory(&dir)?;
                if inv.holds_data()? {
                    return Err(crate::repair::no_manifest_error(&dir, &inv));
                }
                let m = Manifest { next_segment_id: 1, next_shard_generation: 1, ..Manifest::default() };
                crate::storage::write_atomic(&dir, MANIFEST_NAME, &encode_manifest(&m), &options.faults)?;
                m
            }
        };
        let mut manifest = manifest;
        finish_pending(&dir, &mut manifest, &options.faults)?;
        // Every unlisted data file must be the leftover of an interrupted
        // operation (else refuse); they are deleted once the store loaded.
        let leftovers = crate::repair::leftovers(&dir, &manifest, &crate::repair::inventory(&dir)?)?;
        let mut loaded = load_dir(&dir, manifest)?;
        for leftover in &leftovers {
            leftover.dispose(&dir)?;
        }
        // A segment found sealed on disk but listed as active (a crash between
        // a seal and the manifest update) is written back as sealed first, so
        // that no manifest ever lists two active segments.
        let mut manifest_fixed = false;
        for ms in &mut loaded.manifest.segments {
            if ms.state == SegmentState::Active && loaded.segments.get(&ms.id).is_some_and(|s| s.sealed) {
                ms.state = SegmentState::Sealed;
                manifest_fixed = true;
            }
        }
        if manifest_fixed {
            crate::storage::write_atomic(&dir, MANIFEST_NAME, &encode_manifest(&loaded.manifest), &options.faults)?;
        }
        let active = match loaded.active.take() {
            Some((id, path, valid_end, entries)) => {
                ActiveSegment::reopen(path, id, valid_end, options.segment_bytes, entries, options.faults.clone())?
            }
            None => {
                let id = loaded.manifest.next_segment_id;
                let seg = ActiveSegment::create(&dir, id, options.segment_bytes, options.faults.clone())?;
                loaded.manifest.segments.push(ManifestSegment { id, state: SegmentState::Active });
                loaded.manifest.next_segment_id = id + 1;
                crate::storage::write_atomic(&dir, MANIFEST_NAME, &encode_manifest(&loaded.manifest), &options.faults)?;
                seg
            }
        };
        loaded.segments.remove(&active.id);
        let sealed: HashSet<String> =
            loaded.index.sessions.iter().filter(|(_, e)| e.sealed).map(|(k, _)| k.to_string()).collect();
        let mut segments = loaded.segments.clone();
        segments
            .insert(active.id, SegmentRef::new(active.id, active.path.clone(), active.map.clone(), active.len, false));
        let shards = Arc::new(loaded.shards);
        let damage = Arc::new(std::mem::take(&mut loaded.damage));
        let view =
            Arc::new(View { index: loaded.index.clone(), segments, shards: shards.clone(), damage: damage.clone() });
        let (tx, rx) = bounded(options.queue_depth);
        let inner = Arc::new(Inner {
            dir: dir.clone(),
            options: options.clone(),
            send: Mutex::new(SendState::new(Some(tx), sealed)),
            durable: Mutex::new(Durable { seq: 0, poisoned: None, closed: false }),
            durable_cv: Condvar::new(),
            durable_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            view: Mutex::new(view),
            compacting: Mutex::new(()),
        });
        let writer = Writer {
            inner: inner.clone(),
            dir,
            options,
            manifest: loaded.manifest,
            sealed_segments: loaded.segments,
            active: Some(active),
            index: loaded.index,
            shards,
            shard_sessions: loaded.shard_sessions,
            shard_traces: loaded.shard_traces,
            damage,
            retiring: Vec::new(),
            old_maps: std::collections::HashMap::new(),
            delta: DeltaCache::new(inner.options.delta_cache_bytes),
            buf: Vec::with_capacity(1 << 20),
            pending: Vec::new(),
            written_seq: 0,
            unsynced_since: None,
            last_sync: Instant::now() - Duration::from_secs(3600),
        };
        let handle = std::thread::Builder::new()
            .name("trajlog-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| Error::io("spawn the writer thread", e))?;
        Ok(Store { inner, writer: Some(handle), read_only: false, _lock: Some(lock_file) })
    }

    /// Open a store read-only: no lock, no writer thread. It sees everything
    /// that was flushed when it was opened; call [`Store::refresh`] to see more.
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let view = load_read_only(&dir)?;
        let inner = Arc::new(Inner {
            dir,
            options: Options::default(),
            send: Mutex::new(SendState::new(None, HashSet::new())),
            durable: Mutex::new(Durable { seq: 0, poisoned: None, closed: true }),
            durable_cv: Condvar::new(),
            durable_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            view: Mutex::new(Arc::new(view)),
            compacting: Mutex::new(()),
        });
        Ok(Store { inner, writer: None, read_only: true, _lock: None })
    }

    /// Read-only stores: reload what the writer has flushed since. Writable
    /// stores always see their own acknowledged writes; this is a no-op there.
    pub fn refresh(&self) -> Result<()> {
        if self.read_only {
            *lock(&self.inner.view) = Arc::new(load_read_only(&self.inner.dir)?);
        }
        Ok(())
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &Options {
        &self.inner.options
    }

    fn sender(&self) -> Result<MutexGuard<'_, SendState>> {
        if self.read_only {
            return Err(Error::new(ErrorKind::Closed, "store is open read-only; open it with Store::open to write"));
        }
        if let Some(e) = self.inner.poisoned_error() {
            return Err(e);
        }
        Ok(lock(&self.inner.send))
    }

    fn send(state: &mut SendState, cmd: Cmd) -> Result<()> {
        let tx = state.tx.as_ref().ok_or_else(Error::closed)?;
        tx.send(cmd).map_err(|_| Error::closed())
    }

    /// Append a call. Returns once the writer has it (waiting if the queue is
    /// full); [`Receipt::wait`] or [`Store::flush`] make it durable.
    pub fn append(&self, call: Call) -> Result<Receipt> {
        call.validate()?;
        let mut s = self.sender()?;
        for id in std::iter::once(&call.session_id).chain(&call.session_uids) {
            if s.sealed.contains(id) {
                return Err(Error::invalid(
                    "session_id",
                    format!("session {id:?} is sealed (all its calls are in); append to a new session id, or delete the session first"),
                ));
            }
        }
        let durable_seq = self.inner.durable_seq.load(Ordering::Acquire);
        s.prune(durable_seq);
        let current: Option<Arc<[Arc<str>]>> = match s.calls_in_flight.get(call.trace_id.as_str()) {
            Some((seq, sessions)) if *seq > durable_seq => {
                (!sessions.first().is_some_and(|p| s.deleted_after(p, *seq))).then(|| sessions.clone())
            }
            _ => {
                let view = lock(&self.inner.view).clone();
                view.index
                    .traces
                    .get(call.trace_id.as_str())
                    .filter(|m| !m.sessions.first().is_some_and(|p| s.deleted_after(p, durable_seq)))
                    .map(|m| m.sessions.clone())
            }
        };
        if let Some(current) = current {
            check_trace_id(&call, &current, &s.sealed)?;
        }
        s.next_seq += 1;
        let seq = s.next_seq;
        s.calls_in_flight.insert(call.trace_id.clone(), (seq, sessions_of(&call.session_id, &call.session_uids)));
        Self::send(&mut s, Cmd::Append { seq, call: Box::new(call) })?;
        Ok(Receipt { seq, inner: self.inner.clone() })
    }

    /// Append and wait until durable.
    pub fn append_durable(&self, call: Call) -> Result<()> {
        self.append(call)?.wait()
    }

    fn annotate(&self, ann: Annotation, reply: Option<Sender<u64>>) -> Result<Receipt> {
        ann.validate()?;
        let mut s = self.sender()?;
        match &ann {
            Annotation::Seal { session_id } => {
                s.sealed.insert(session_id.clone());
            }
            Annotation::DeleteSession { session_id } => {
                s.sealed.remove(session_id);
            }
            Annotation::Reward { .. } => {}
        }
        s.next_seq += 1;
        let seq = s.next_seq;
        if let Annotation::DeleteSession { session_id } = &ann {
            s.deletes_in_flight.push((seq, session_id.clone()));
        }
        Self::send(&mut s, Cmd::Annotate { seq, ann, reply })?;
        Ok(Receipt { seq, inner: self.inner.clone() })
    }

    /// Record a reward on a trace or a session (last one wins); durable on return.
    pub fn set_reward(&self, target: Target, value: f64) -> Result<()> {
        self.annotate(Annotation::Reward { target, value }, None)?.wait()
    }

    /// Mark a session complete: later appends to it are refused. Durable on return.
    pub fn seal_session(&self, session_id: &str) -> Result<()> {
        self.annotate(Annotation::Seal { session_id: session_id.to_owned() }, None)?.wait()
    }

    /// Delete every call of a session; returns how many were deleted. Durable on return.
    pub fn delete_session(&self, session_id: &str) -> Result<u64> {
        let (tx, rx) = bounded(1);
        let receipt = self.annotate(Annotation::DeleteSession { session_id: session_id.to_owned() }, Some(tx))?;
        receipt.wait()?;
        rx.recv().map_err(|_| Error::closed())
    }

    fn control(&self, make: impl FnOnce(Sender<Result<()>>) -> Cmd) -> Result<()> {
        let (tx, rx) = bounded(1);
        {
            let mut s = self.sender()?;
            Self::send(&mut s, make(tx))?;
        }
        rx.recv().map_err(|_| Error::closed())?
    }

    /// Barrier: returns once everything appended before it is durable at the
    /// store's level, or the error that prevented it.
    pub fn flush(&self) -> Result<()> {
        let fsync = self.inner.options.durability != Durability::Buffered;
        self.control(|reply| Cmd::Flush { fsync, reply })
    }

    /// Like [`Store::flush`], but always fsyncs (also for `Buffered`).
    pub fn sync(&self) -> Result<()> {
        self.control(|reply| Cmd::Flush { fsync: true, reply })
    }

    /// Seal the active segment now and start a new one.
    pub fn roll(&self) -> Result<()> {
        self.control(|reply| Cmd::Roll { reply })
    }

    /// Compact finished sessions into Parquet shards under `DIR/shards/`
    /// (format-spec/shard.md), then retire the segments nothing needs any more.
    /// Reads keep answering for compacted calls, now from the shards.
    pub fn compact(&self, options: &crate::compact::CompactOptions) -> Result<crate::compact::CompactReport> {
        let _one_at_a_time = lock(&self.inner.compacting);
        crate::compact::run(self, options)
    }

    pub(crate) fn reserve_generation(&self) -> Result<u64> {
        let (tx, rx) = bounded(1);
        {
            let mut s = self.sender()?;
            Self::send(&mut s, Cmd::ReserveGeneration { reply: tx })?;
        }
        rx.recv().map_err(|_| Error::closed())
    }

    pub(crate) fn publish_compaction(
        &self,
        staged: Vec<PendingRename>,
        sessions: Vec<String>,
    ) -> Result<PublishOutcome> {
        let (tx, rx) = bounded(1);
        {
            let mut s = self.sender()?;
            Self::send(&mut s, Cmd::Publish { staged, sessions, reply: tx })?;
        }
        rx.recv().map_err(|_| Error::closed())?
    }

    /// A consistent view of everything acknowledged so far; cheap, and safe to
    /// hold while the writer goes on.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot::new(lock(&self.inner.view).clone())
    }

    /// Flush, stop the writer thread and release the lock. Dropping the store
    /// does the same but cannot report errors.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(handle) = self.writer.take() else { return Ok(()) };
        let flushed = self.sync();
        lock(&self.inner.send).tx = None;
        let joined = handle.join();
        {
            let mut d = lock(&self.inner.durable);
            d.closed = true;
            self.inner.durable_cv.notify_all();
        }
        if joined.is_err() {
            return Err(Error::new(ErrorKind::Io, "the writer thread panicked; reopen the store to recover"));
        }
        flushed
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

fn load_read_only(dir: &Path) -> Result<View> {
    // The writer may replace the manifest (and, later, retire segments) while we
    // read; retry a few times on a vanished file.
    let mut last_err = None;
    for _ in 0..5 {
        let manifest = match read_manifest(dir)? {
            Some(m) => m,
            None => {
                let inv = crate::repair::inventory(dir).unwrap_or_default();
                if inv.holds_data().unwrap_or(true) {
                    return Err(crate::repair::no_manifest_error(dir, &inv));
                }
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "no trajlog store at {} (no MANIFEST); create one with `trajlog ingest` or Store::open",
                        dir.display()
                    ),
                ));
            }
        };
        match load_dir(dir, manifest) {
            Ok(loaded) => {
                return Ok(View {
                    index: loaded.index,
                    segments: loaded.segments,
                    shards: Arc::new(loaded.shards),
                    damage: Arc::new(loaded.damage),
                })
            }
            Err(e) if e.kind() == &ErrorKind::NotFound => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| Error::new(ErrorKind::Io, "store changed too often while opening")))
}

/// The writer thread's state.
struct Writer {
    inner: Arc<Inner>,
    dir: PathBuf,
    options: Options,
    manifest: Manifest,
    sealed_segments: imbl::OrdMap<u64, SegmentRef>,
    active: Option<ActiveSegment>,
    index: Index,
    shards: Arc<Vec<Arc<ShardFile>>>,
    shard_sessions: HashSet<Arc<str>>,
    shard_traces: HashSet<Arc<str>>,
    /// Damage confined at open (published with every view).
    damage: Arc<Vec<Problem>>,
    /// Retired segment files, deleted once no snapshot maps them any more.
    retiring: Vec<(PathBuf, Vec<Weak<crate::storage::mmap::Mapping>>)>,
    /// Mappings sealed segments had while they were active.
    old_maps: std::collections::HashMap<u64, Vec<Weak<crate::storage::mmap::Mapping>>>,
    delta: DeltaCache,
    /// Frames encoded but not yet written.
    buf: Vec<u8>,
    /// Footer entries of the frames in `buf`.
    pending: Vec<FooterEntry>,
    written_seq: u64,
    unsynced_since: Option<Instant>,
    last_sync: Instant,
}

const BATCH_RECORDS_MAX: usize = 1024;
const BATCH_BYTES_MAX: usize = 16 << 20;

impl Writer {
    fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            let first = match self.group_deadline() {
                Some(deadline) => match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(cmd) => cmd,
                    Err(RecvTimeoutError::Timeout) => {
                        self.commit(true);
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(cmd) => cmd,
                    Err(_) => break,
                },
            };
            // A batch is bounded in records here and in bytes by `append_call`,
            // which writes the buffer out whenever it passes BATCH_BYTES_MAX.
            let mut batch = vec![first];
            while batch.len() < BATCH_RECORDS_MAX {
                match rx.try_recv() {
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            let mut sync_soon = false;
            for cmd in batch {
                match cmd {
                    Cmd::SyncSoon => sync_soon = true,
                    cmd => self.handle(cmd),
                }
            }
            let force = match self.options.durability {
                Durability::Buffered => false,
                Durability::Sync => true,
                Durability::Group => {
                    sync_soon || self.last_sync.elapsed() >= Duration::from_millis(self.options.group_commit_ms)
                }
            };
            self.commit(force);
        }
        // Channel closed: the store is shutting down (it flushed first).
        self.commit(true);
        if !self.poisoned() {
            if let Some(active) = self.active.as_mut() {
                if let Err(e) = active.trim() {
                    self.inner.poison(&e);
                }
            }
        }
    }

    /// When the group-commit timer fires, if records wait for an fsync.
    fn group_deadline(&self) -> Option<Instant> {
        if self.options.durability != Durability::Group {
            return None;
        }
        self.unsynced_since.map(|_| self.last_sync + Duration::from_millis(self.options.group_commit_ms))
    }

    fn poisoned(&self) -> bool {
        self.inner.poisoned.load(Ordering::Acquire)
    }

    fn fail(&mut self, e: &Error) {
        self.inner.poison(e);
        self.buf.clear();
        self.pending.clear();
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Append { seq, call } => {
                if !self.poisoned() {
                    if let Err(e) = self.append_call(*call) {
                        self.fail(&e);
                    }
                }
                self.written_seq = seq;
            }
            Cmd::Annotate { seq, ann, reply } => {
                if !self.poisoned() {
                    match self.append_annotation(&ann) {
                        Ok(count) => {
                            if let Some(reply) = reply {
                                let _ = reply.send(count);
                            }
                        }
                        Err(e) => self.fail(&e),
                    }
                }
                self.written_seq = seq;
            }
            Cmd::Flush { fsync, reply } => {
                self.commit(fsync);
                let result = match self.inner.poisoned_error() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                let _ = reply.send(result);
            }
            // Taken by `run`, which decides when to commit.
            Cmd::SyncSoon => {}
            Cmd::ReserveGeneration { reply } => {
                let generation = self.manifest.next_shard_generation.max(1);
                self.manifest.next_shard_generation = generation + 1;
                let _ = reply.send(generation);
            }
            Cmd::Publish { staged, sessions, reply } => {
                let result = match self.inner.poisoned_error() {
                    Some(e) => Err(e),
                    None => self.publish(staged, &sessions),
                };
                if let Err(e) = &result {
                    if !matches!(e.kind(), ErrorKind::Poisoned) {
                        self.fail(e);
                    }
                }
                self.commit(true);
                let _ = reply.send(result);
            }
            Cmd::Roll { reply } => {
                let result = if self.poisoned() {
                    Err(self.inner.poisoned_error().unwrap_or_else(Error::closed))
                } else {
                    self.roll()
                };
                if let Err(e) = &result {
                    self.fail(e);
                }
                self.commit(false);
                let _ = reply.send(result);
            }
        }
    }

    fn active(&mut self) -> Result<&mut ActiveSegment> {
        self.active
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Poisoned, "no active segment (an earlier roll failed)"))
    }

    /// Make room for a frame of `frame_len` bytes: roll if the active segment
    /// would pass its size (and already holds something).
    fn reserve(&mut self, frame_len: u64) -> Result<Loc> {
        let segment_bytes = self.options.segment_bytes;
        let (len, has_records) = {
            let a = self.active()?;
            (a.len, !a.entries.is_empty())
        };
        let pending = self.buf.len() as u64;
        if len + pending + frame_len > segment_bytes && (has_records || pending > 0) {
            self.roll()?;
        }
        let pending = self.buf.len() as u64;
        let a = self.active()?;
        Ok(Loc { segment: a.id, offset: a.len + pending })
    }

    fn append_call(&mut self, call: Call) -> Result<()> {
        if !self.delta.knows(&call.session_id) {
            self.load_contexts(&call.session_id)?;
        }
        let delta = self.delta.choose(&call.session_id, &call.prompt_token_ids);
        let body_len = call_body_len(&call, &delta);
        if frame_bytes(body_len) > RECORD_BYTES_MAX {
            // Unreachable with validated input (the per-field limits sum below it).
            return Err(Error::limit("RECORD_BYTES_MAX", "record bytes", body_len, RECORD_BYTES_MAX));
        }
        let loc = self.reserve(frame_bytes(body_len))?;
        let mut body = Vec::with_capacity(body_len as usize);
        encode_call(&mut body, &call, &delta);
        write_frame(&mut self.buf, &body);
        self.pending.push(FooterEntry {
            frame_offset: loc.offset,
            body_len: body.len() as u32,
            kind: KIND_CALL,
            timestamp: call.timestamp,
            id: call.trace_id.clone(),
            session_id: call.session_id.clone(),
            session_uids: call.session_uids.clone(),
        });
        let session: Arc<str> = Arc::from(call.session_id.as_str());
        self.index.apply_call(CallMeta {
            loc,
            shard: None,
            timestamp: call.timestamp,
            trace_id: Arc::from(call.trace_id.as_str()),
            sessions: sessions_of(&call.session_id, &call.session_uids),
        });
        let prompt_len = call.prompt_token_ids.len();
        let mut tokens = call.prompt_token_ids;
        tokens.extend_from_slice(&call.completion_token_ids);
        self.delta.remember(&session, Context { loc, prompt_len, tokens: Arc::new(tokens) });
        if self.buf.len() >= BATCH_BYTES_MAX {
            // Bound the writer's memory: write now, make durable at batch end.
            self.write_buf()?;
        }
        Ok(())
    }

    /// A session the delta cache does not know may still have calls on disk
    /// (after a reopen, or after eviction): load its most recent contexts.
    fn load_contexts(&mut self, session: &str) -> Result<()> {
        let Some(entry) = self.index.sessions.get(session) else { return Ok(()) };
        let keys: Vec<Loc> = {
            // Only calls still in segments can be parents (compacted ones may
            // have had their segment retired).
            let in_segments = |k: &&crate::index::CallKey| {
                self.index.traces.get(&k.trace_id).is_some_and(|m| m.loc == k.loc && m.shard.is_none())
            };
            let mut locs: Vec<Loc> = entry.calls.iter().filter(in_segments).map(|k| k.loc).collect();
            locs.sort();
            locs.into_iter().rev().take(DELTA_LOOKBACK_CALLS).rev().collect()
        };
        if keys.is_empty() {
            return Ok(());
        }
        // Parents must be readable: write what is buffered first.
        self.write_buf()?;
        let snap = Snapshot::new(Arc::new(self.view()?));
        let session_arc: Arc<str> = Arc::from(session);
        for loc in keys {
            // A damaged call (or one built on a damaged parent) cannot be a
            // parent: skip it rather than fail the append (and poison the store).
            let Ok(call) = snap.call_at(loc) else { continue };
            if call.record.session_id != session {
                continue;
            }
            let Ok(mut tokens) = call.prompt() else { continue };
            let prompt_len = tokens.len();
            tokens.extend_from_slice(call.record.completion);
            self.delta.remember(&session_arc, Context { loc, prompt_len, tokens: Arc::new(tokens) });
        }
        Ok(())
    }

    fn append_annotation(&mut self, ann: &Annotation) -> Result<u64> {
        let mut body = Vec::with_capacity(64);
        encode_annotation(&mut body, ann);
        let loc = self.reserve(frame_bytes(body.len() as u64))?;
        write_frame(&mut self.buf, &body);
        let entry = crate::segment::recovery::entry_of_body(loc.offset, &body)
            .map_err(|e| Error::new(ErrorKind::Io, format!("internal: annotation does not decode: {e}")))?;
        self.pending.push(entry);
        match ann {
            Annotation::Seal { session_id } | Annotation::DeleteSession { session_id } => self.delta.forget(session_id),
            Annotation::Reward { .. } => {}
        }
        Ok(apply_annotation(&mut self.index, ann))
    }

    fn write_buf(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let buf = std::mem::take(&mut self.buf);
        let pending = std::mem::take(&mut self.pending);
        let active = self.active()?;
        active.write(&buf)?;
        active.entries.extend(pending);
        self.buf = buf;
        self.buf.clear();
        if self.unsynced_since.is_none() {
            self.unsynced_since = Some(Instant::now());
        }
        Ok(())
    }

    fn view(&mut self) -> Result<View> {
        let mut segments = self.sealed_segments.clone();
        let a = self.active()?;
        segments.insert(a.id, SegmentRef::new(a.id, a.path.clone(), a.map.clone(), a.len, false));
        Ok(View { index: self.index.clone(), segments, shards: self.shards.clone(), damage: self.damage.clone() })
    }

    /// Write what is buffered; fsync if `fsync` (or keep waiting for the group
    /// timer); publish what became durable.
    fn commit(&mut self, fsync: bool) {
        if self.poisoned() {
            return;
        }
        if let Err(e) = self.write_buf() {
            self.fail(&e);
            return;
        }
        let durable = match self.options.durability {
            Durability::Buffered => true,
            _ => fsync || self.unsynced_since.is_none(),
        };
        if fsync && self.unsynced_since.is_some() {
            let synced = self.active().and_then(|a| a.sync());
            if let Err(e) = synced {
                self.fail(&e);
                return;
            }
            self.unsynced_since = None;
            self.last_sync = Instant::now();
        }
        if durable {
            match self.view() {
                Ok(view) => {
                    // Publish the view, drop retired files the old one was the
                    // last to map, then acknowledge.
                    self.inner.set_view(Arc::new(view));
                    self.reap();
                    self.inner.advance(self.written_seq);
                }
                Err(e) => self.fail(&e),
            }
        }
    }

    /// Delete retired segment files no snapshot maps any more.
    fn reap(&mut self) {
        self.retiring.retain(|(path, maps)| {
            if maps.iter().any(|m| m.strong_count() > 0) {
                return true;
            }
            // Best effort: a file left behind is removed as an orphan at the next open.
            let _ = fs::remove_file(path);
            false
        });
    }

    /// Publish a compaction (format-spec/shard.md §5): record the staged files as
    /// pending in the manifest (the commit point), rename them into place, list
    /// them as published, serve the compacted calls from them, and retire the
    /// segments nothing needs any more.
    fn publish(&mut self, staged: Vec<PendingRename>, sessions: &[String]) -> Result<PublishOutcome> {
        let shards_dir = self.dir.join(SHARDS_DIR);
        self.manifest.pending = staged.clone();
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        for p in &staged {
            let (from, to) = (shards_dir.join(&p.staged), shards_dir.join(&p.shard.path));
            fs::rename(&from, &to).map_err(|e| Error::io(format!("publish shard {}", to.display()), e))?;
        }
        for table in SHARD_TABLES {
            let tdir = shards_dir.join(table);
            if tdir.exists() {
                crate::storage::sync_dir(&tdir, &self.options.faults)?;
            }
        }
        self.manifest.pending.clear();
        self.manifest.shards.extend(staged.iter().map(|p| p.shard.clone()));
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        // Serve compacted calls from the new shards.
        let first_id = self.shards.len() as u32;
        let mut files: Vec<Arc<ShardFile>> = self.shards.as_ref().clone();
        let mut rows = Vec::new();
        for (i, p) in staged.iter().filter(|p| p.shard.path.starts_with("steps/")).enumerate() {
            let f = ShardFile::open(&shards_dir.join(&p.shard.path), first_id + i as u32, p.shard.checksum)?;
            f.index_rows(&mut rows)?;
            files.push(Arc::new(f));
        }
        self.shards = Arc::new(files);
        let mut outcome = PublishOutcome::default();
        for row in &rows {
            if self.index.place_in_shard(&row.trace_id, row.loc, row.pos) {
                outcome.calls_placed += 1;
            }
            for s in sessions_of(&row.session_id, &row.session_uids).iter() {
                self.shard_sessions.insert(s.clone());
            }
            self.shard_traces.insert(Arc::from(row.trace_id.as_str()));
        }
        for s in sessions {
            self.delta.forget(s);
        }
        outcome.retired_segments = self.retire()?;
        self.delta.forget_segments(&outcome.retired_segments);
        Ok(outcome)
    }

    /// Retire the longest prefix of sealed segments whose every record is no
    /// longer needed (format-spec/shard.md §6): each call record belongs to a
    /// session with no live call left in segments (so it is compacted, dead, and
    /// no live call can use it as a prefix-delta parent), and no session deletion
    /// in it concerns compacted rows. Rewards and seals in them are re-appended
    /// with their current values first, so that they outlive their segment.
    fn retire(&mut self) -> Result<Vec<u64>> {
        let mut in_segments: HashSet<Arc<str>> = HashSet::new();
        for (_, meta) in self.index.traces.iter() {
            if meta.shard.is_none() {
                if let Some(s) = meta.sessions.first() {
                    in_segments.insert(s.clone());
                }
            }
        }
        let mut retire = Vec::new();
        let mut annotations = Vec::new();
        'segments: for ms in &self.manifest.segments {
            if ms.state != SegmentState::Sealed {
                break;
            }
            let Some(seg) = self.sealed_segments.get(&ms.id) else { break };
            let trailer = crate::format::segment::read_trailer(seg.mapped_bytes());
            let entries = match trailer.map(|t| crate::format::segment::decode_footer(seg.mapped_bytes(), &t)) {
                Some(Ok(entries)) => entries,
                _ => break,
            };
            let mut anns = Vec::new();
            for e in &entries {
                if e.kind == KIND_CALL {
                    if in_segments.contains(e.session_id.as_str()) {
                        break 'segments;
                    }
                    // A dead call whose trace has a shard row: this record (or
                    // the deletion after it) is what keeps that row dead.
                    let loc = Loc { segment: ms.id, offset: e.frame_offset };
                    let live = self.index.traces.get(e.id.as_str()).is_some_and(|m| m.loc == loc);
                    if !live && self.shard_traces.contains(e.id.as_str()) {
                        break 'segments;
                    }
                } else if e.kind == KIND_DELETE_SESSION {
                    if self.shard_sessions.contains(e.id.as_str()) {
                        break 'segments;
                    }
                } else {
                    let body = seg.body_at(e.frame_offset)?;
                    let ann = decode_annotation(body)
                        .map_err(|d| Error::corrupt(seg.path.as_path(), e.frame_offset, d.what))?;
                    anns.push(ann);
                }
            }
            annotations.extend(anns);
            retire.push(ms.id);
        }
        if retire.is_empty() {
            return Ok(retire);
        }
        // Carry current rewards and seals forward (deduplicated by target).
        let mut seen: HashSet<(u8, String)> = HashSet::new();
        for ann in annotations {
            let carried = match &ann {
                Annotation::Reward { target: Target::Trace(t), .. } if seen.insert((0, t.clone())) => self
                    .index
                    .trace_rewards
                    .get(t.as_str())
                    .map(|v| Annotation::Reward { target: Target::Trace(t.clone()), value: *v }),
                Annotation::Reward { target: Target::Session(s), .. } if seen.insert((1, s.clone())) => self
                    .index
                    .sessions
                    .get(s.as_str())
                    .and_then(|e| e.reward)
                    .map(|v| Annotation::Reward { target: Target::Session(s.clone()), value: v }),
                Annotation::Seal { session_id } if seen.insert((2, session_id.clone())) => {
                    self.index.sessions.get(session_id.as_str()).is_some_and(|e| e.sealed).then(|| ann.clone())
                }
                _ => None,
            };
            if let Some(a) = carried {
                self.append_annotation(&a)?;
            }
        }
        self.write_buf()?;
        self.active()?.sync()?;
        self.unsynced_since = None;
        self.last_sync = Instant::now();
        self.manifest.segments.retain(|s| !retire.contains(&s.id));
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        for id in &retire {
            if let Some(seg) = self.sealed_segments.remove(id) {
                let mut maps = self.old_maps.remove(id).unwrap_or_default();
                maps.push(seg.weak_map());
                self.retiring.push((seg.path.as_path().to_path_buf(), maps));
            }
        }
        Ok(retire)
    }

    /// Seal the active segment, start the next one, publish both in the manifest.
    fn roll(&mut self) -> Result<()> {
        self.write_buf()?;
        if self.active.as_ref().is_some_and(|a| a.entries.is_empty()) {
            return Ok(()); // nothing to seal
        }
        let old = self.active.take().ok_or_else(|| Error::new(ErrorKind::Poisoned, "no active segment"))?;
        let old_id = old.id;
        let sealed = old.seal()?;
        self.old_maps.insert(old_id, sealed.old_maps);
        let (path, map, data_end) = (sealed.path, sealed.map, sealed.data_end);
        self.unsynced_since = None;
        self.last_sync = Instant::now();
        self.sealed_segments.insert(old_id, SegmentRef::new(old_id, path, map, data_end, true));
        let id = self.manifest.next_segment_id;
        let new = ActiveSegment::create(&self.dir, id, self.options.segment_bytes, self.options.faults.clone())?;
        for ms in &mut self.manifest.segments {
            if ms.id == old_id {
                ms.state = SegmentState::Sealed;
            }
        }
        self.manifest.segments.push(ManifestSegment { id, state: SegmentState::Active });
        self.manifest.next_segment_id = id + 1;
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        self.active = Some(new);
        Ok(())
    }
}
