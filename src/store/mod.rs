//! `Store`: owns the writer thread, the segments and the published indexes —
//! the only place in the crate with locks and threads.
//!
//! # Write path
//! `append` validates the call (nothing is written if that fails), takes room
//! in the queue — waiting, with no lock held, while the records in flight to
//! the writer pass `queue_depth` or `queue_bytes` (back-pressure, never a
//! drop; queue.rs) — then, under the append lock, takes a sequence number and
//! sends the call on an unbounded channel to the writer thread, so sends never
//! block and the writer sees records in sequence order.
//! The writer drains the channel in batches, chooses each call's prefix-delta
//! parent, frames and CRCs it, writes the batch with one positional write, and
//! makes it durable according to [`Durability`]. Only then does it publish a new
//! index view and advance the durable sequence number that [`Receipt`]s wait on.
//! Any failed write or fsync poisons the store: every pending and later call
//! (durability waits, appenders waiting for room) gets the failure, whose
//! kind is `StorageFull` for a full disk and `Poisoned` otherwise.
//!
//! # Read path
//! [`Store::snapshot`] clones an `Arc` of the last published view. A view holds
//! persistent maps and `Arc`s of the segment mappings, so it stays consistent
//! and valid however long it is held, while the writer appends, seals and rolls.

mod admission;
mod annotation_cache;
mod backlog_file;
mod backlog_refresh;
mod cold;
mod deletions;
mod options;
mod protocol;
mod publish;
mod queue;
mod receipt;
mod recovery;
mod recovery_report;
mod refresh;
mod retire;
mod rewards;
#[cfg(test)]
mod tests;
mod writer;

pub(crate) use annotation_cache::{check as check_annotation_cache, CACHE_FILE_NAME as ANNOTATION_CACHE_FILE};
pub(crate) use backlog_file::{
    check as check_backlog_file, BACKLOG_FILE_NAME as BACKLOG_FILE, DELTA_FILE_NAME as BACKLOG_DELTA_FILE,
};
pub(crate) use deletions::{check as check_deletions, DELETIONS_FILE};

pub use options::{Durability, Options, RecoveryMode};
pub(crate) use protocol::PublishOutcome;
pub(crate) use publish::Obsolete;
pub use receipt::{Receipt, TryAppend};
pub(crate) use recovery::{lazy_damage, load_for_repair, lock_dir};
pub use recovery_report::{RecoveryEvent, RecoveryEventKind, RecoveryReport};
pub(crate) use rewards::{check_file as check_rewards_file, REWARDS_FILE};

use admission::{check_trace_id, ChatPrev, SendState};
use protocol::{Cmd, CompactionBase, Prepared, RowCounts};
use queue::{annotation_bytes, call_bytes, Permit, Queue};
use receipt::{lock, Durable, Inner};
use recovery::seal_skipped_active;
use recovery::{
    apply_annotation, check_absolute, finish_obsolete, finish_pending, load_dir, load_read_only, read_manifest,
};
use writer::{Journal, Writer};

use crate::delta::{Context, DeltaCache};
use crate::error::Problem;
use crate::error::{Error, ErrorKind, Result};
use crate::format::docs::ExtraCuts;
use crate::format::frame::{frame_bytes, write_frame};
use crate::format::manifest::{
    decode_manifest, encode_manifest, Manifest, ManifestSegment, PendingRename, SegmentState, ShardChecksum,
};
use crate::format::record::{
    call_body_len, decode_annotation, encode_annotation, encode_call, Loc, KIND_CALL, KIND_DELETE_SESSION,
};
use crate::format::segment::FooterEntry;
use crate::index::{sessions_of, CallMeta, Index};
use crate::limits::*;
use crate::record::{Annotation, Call, Target, ValidCall};
use crate::segment::recovery::{load_segment, OnDamage};
use crate::segment::writer::ActiveSegment;
use crate::segment::SegmentRef;
use crate::shard::reader::{ShardFile, ShardRow};
use crate::snapshot::{Snapshot, View};
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An open trajlog store directory.
pub struct Store {
    inner: Arc<Inner>,
    writer: Option<JoinHandle<()>>,
    read_only: bool,
    /// What the open (read-only: the last refresh) found and did.
    recovery: Mutex<Arc<RecoveryReport>>,
    /// Read-only stores: the manifest the view reflects, for an incremental
    /// [`Store::refresh`] (the lock also makes refreshes take turns).
    read_point: Mutex<Option<Manifest>>,
    _lock: Option<crate::storage::lock::HeldLock>,
}

pub(crate) use crate::storage::{LOCK_NAME, MANIFEST_NAME, SHARDS_DIR, SHARD_TABLES};

impl Store {
    /// Open (or create) a store for writing. Only one writer per directory: a
    /// second one gets `ErrorKind::Locked`. `options.recovery` decides what
    /// damage in the log does ([`RecoveryMode`]); what was cut or skipped is
    /// in [`Store::recovery_report`].
    pub fn open(dir: impl AsRef<Path>, options: Options) -> Result<Self> {
        options.validate()?;
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create store directory {}", dir.display()), e))?;
        let lock_file = lock_dir(&dir)?;
        let manifest = match read_manifest(&dir)? {
            Some(m) => {
                if options.recovery == RecoveryMode::AbsoluteConsistency {
                    check_absolute(&dir, true)?;
                }
                m
            }
            None => {
                // A new store — unless there are data files: never start an
                // empty manifest over them (it would make them orphans).
                let inv = crate::inventory::inventory(&dir)?;
                if inv.holds_data()? {
                    return Err(crate::inventory::no_manifest_error(&dir, &inv));
                }
                let m = Manifest { next_segment_id: 1, next_shard_generation: 1, ..Manifest::default() };
                crate::storage::write_atomic(&dir, MANIFEST_NAME, &encode_manifest(&m), &options.faults)?;
                m
            }
        };
        let mut manifest = manifest;
        finish_pending(&dir, &mut manifest, &options.faults)?;
        finish_obsolete(&dir, &mut manifest, &options.faults)?;
        // Every unlisted data file must be the leftover of an interrupted
        // operation (else refuse); they are deleted once the store loaded.
        let leftovers = crate::inventory::leftovers(&dir, &manifest, &crate::inventory::inventory(&dir)?)?;
        // Rewards the side table does not reflect yet (store/rewards.rs):
        // only those are kept while loading.
        let mut rewards = rewards::RewardsTable::open(&dir)?;
        // The shard index file is checked a block at a time, as lookups
        // read it (10M compacted calls: a 1.2 GB file, ~1.4 s to read from
        // disk). If this open's lookups met a damaged block, it is done
        // again checking the file whole, which then does without it.
        let mut lazy = true;
        let mut loaded = loop {
            let mut loaded =
                load_dir(&dir, manifest.clone(), options.recovery, true, &|loc| rewards.after_through(loc), lazy)?;
            for (_, target) in std::mem::take(&mut loaded.rewards) {
                for s in rewards::sessions_of_target(&loaded.index, &target) {
                    if loaded.shard_sessions.contains(&s) {
                        rewards.dirty.insert(s);
                    }
                }
            }
            if !lazy
                || recovery::writer_damage(
                    &loaded.shards,
                    &loaded.index,
                    &[&loaded.shard_traces, &loaded.shard_sessions],
                )
                .is_none()
            {
                break loaded;
            }
            rewards.dirty.clear();
            lazy = false;
        };
        for leftover in &leftovers {
            leftover.dispose(&dir)?;
        }
        // A shard index file a crash left half written (never read).
        recovery::remove_if_present(&dir.join(SHARDS_DIR).join(crate::shard::index_file::TMP_NAME))
            .map_err(|e| Error::io("remove a half-written shard index file", e))?;
        recovery::remove_if_present(&dir.join(SHARDS_DIR).join(annotation_cache::CACHE_TMP_NAME))
            .map_err(|e| Error::io("remove a half-written annotation cache", e))?;
        for tmp in [backlog_file::BACKLOG_TMP_NAME, backlog_file::DELTA_TMP_NAME] {
            recovery::remove_if_present(&dir.join(tmp))
                .map_err(|e| Error::io("remove a half-written backlog index file", e))?;
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
        seal_skipped_active(&mut loaded, &options)?;
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
        if let Some(w) = loaded.index_to_write.take() {
            w.write(&dir, &mut loaded, &options.faults);
        }
        // The annotation cache, when the open found none it could use (one
        // it set aside would be written the same); a store without an
        // index file in use has nothing to key one to.
        match loaded.shards.index_file() {
            Some(ix) if loaded.annotation_cache == recovery::CacheUse::NotUsed => {
                annotation_cache::write(&dir, &loaded.manifest, ix, &options.faults);
            }
            Some(_) => {}
            None => {
                let _ = recovery::remove_if_present(&dir.join(SHARDS_DIR).join(annotation_cache::CACHE_FILE_NAME));
            }
        }
        let backlog_written = write_backlog_file(&dir, &loaded, &options);
        let sealed_ids = loaded.segments.values().filter(|s| s.sealed).map(|s| s.id);
        let backlog = match (loaded.backlog_used, backlog_written) {
            (true, _) => {
                let (listed, delta) = loaded.backlog_listed;
                backlog_refresh::BacklogRefresh::at_open(listed, delta, sealed_ids.skip(listed))
            }
            (false, true) => backlog_refresh::BacklogRefresh::at_open(sealed_ids.count(), None, []),
            (false, false) => backlog_refresh::BacklogRefresh::at_open(0, None, sealed_ids),
        };
        let sealed = admission::Sealed::new(loaded.index.clone());
        let mut segments = loaded.segments.clone();
        segments
            .insert(active.id, SegmentRef::new(active.id, active.path.clone(), active.map.clone(), active.len, false));
        let shards: crate::snapshot::ShardSlots = Arc::new(loaded.shards);
        let damage = Arc::new(std::mem::take(&mut loaded.damage));
        let report = Mutex::new(Arc::new(std::mem::take(&mut loaded.report)));
        let view =
            Arc::new(View { index: loaded.index.clone(), segments, shards: shards.clone(), damage: damage.clone() });
        let (tx, rx) = unbounded();
        let inner = Arc::new(Inner {
            dir: dir.clone(),
            options: options.clone(),
            tx: Some(tx),
            queue: Arc::new(Queue::new(options.queue_depth as u64, options.queue_bytes)),
            send: Mutex::new(SendState::new(sealed, options.delta_cache_bytes)),
            durable: Mutex::new(Durable { seq: 0, poisoned: None, closed: false }),
            durable_cv: Condvar::new(),
            durable_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            view: Mutex::new(view),
            compacting: Mutex::new(()),
            annotation_built: Mutex::new(None),
            listeners: Mutex::new(Vec::new()),
            #[cfg(test)]
            verdicts_reused: AtomicU64::new(0),
            #[cfg(test)]
            verdicts_adopted: AtomicU64::new(0),
        });
        let mut writer = Writer {
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
            journal: None,
            rewards,
            compactions: 0,
            damage,
            retiring: Vec::new(),
            old_maps: std::collections::HashMap::new(),
            delta: DeltaCache::with_chain_max(inner.options.delta_cache_bytes, inner.options.prompt_chain_max),
            buf: Vec::with_capacity(1 << 20),
            pending: Vec::new(),
            written_seq: 0,
            annotation_verdicts: Default::default(),
            unsynced_since: None,
            last_sync: Instant::now() - Duration::from_secs(3600),
            backlog,
        };
        if backlog_written {
            // The open's cold layer is in its heap (~78 bytes a call): the
            // writer takes one mapped from the file it just wrote.
            writer.start_backlog_refresh(false);
        }
        let handle = std::thread::Builder::new()
            .name("trajlog-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| Error::io("spawn the writer thread", e))?;
        Ok(Store {
            inner,
            writer: Some(handle),
            read_only: false,
            recovery: report,
            read_point: Mutex::new(None),
            _lock: Some(lock_file),
        })
    }

    /// Open a store read-only: no lock, no writer thread. It sees everything
    /// that was flushed when it was opened; call [`Store::refresh`] to see more.
    /// Recovery mode: the default ([`RecoveryMode::TolerateTornTail`]).
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_read_only_with(dir, RecoveryMode::default())
    }

    /// [`Store::open_read_only`] in recovery mode `recovery` (also used by
    /// [`Store::refresh`]). A read-only open writes nothing: a skipped region
    /// is only left out of its view, a torn tail is left out and not reported.
    pub fn open_read_only_with(dir: impl AsRef<Path>, recovery: RecoveryMode) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let (view, report, manifest) = load_read_only(&dir, recovery, true)?;
        let inner = Arc::new(Inner {
            dir,
            options: Options::default().recovery(recovery),
            tx: None,
            queue: Arc::new(Queue::new(1, 1)),
            send: Mutex::new(SendState::new(admission::Sealed::default(), 0)),
            durable: Mutex::new(Durable { seq: 0, poisoned: None, closed: true }),
            durable_cv: Condvar::new(),
            durable_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            view: Mutex::new(Arc::new(view)),
            compacting: Mutex::new(()),
            annotation_built: Mutex::new(None),
            listeners: Mutex::new(Vec::new()),
            #[cfg(test)]
            verdicts_reused: AtomicU64::new(0),
            #[cfg(test)]
            verdicts_adopted: AtomicU64::new(0),
        });
        Ok(Store {
            inner,
            writer: None,
            read_only: true,
            recovery: Mutex::new(Arc::new(report)),
            read_point: Mutex::new(Some(manifest)),
            _lock: None,
        })
    }

    /// Read-only stores: load what the writer has flushed since. Writable
    /// stores always see their own acknowledged writes; this is a no-op there.
    ///
    /// When the writer has only appended since (no compaction published,
    /// no segment retired), this replays just the new records onto the
    /// current index: its work is what was appended plus one read of the
    /// active segment's written part, not the store's history. Otherwise it
    /// loads the store again, as [`Store::open_read_only`] does.
    pub fn refresh(&self) -> Result<()> {
        if !self.read_only {
            return Ok(());
        }
        let mut point = lock(&self.read_point);
        let recovery = self.inner.options.recovery;
        let view = lock(&self.inner.view).clone();
        // A view whose lookups met a damaged block of the shard index file
        // is loaded again checking the file whole: it is then done without.
        let damaged = recovery::lazy_damage(&view.shards, &view.index).is_some();
        // Anything the incremental step cannot read makes a whole load,
        // which reports it if it persists.
        let step = point
            .as_ref()
            .filter(|_| !damaged)
            .and_then(|before| refresh::refresh_view(&self.inner.dir, recovery, before, &view).ok().flatten());
        // A step whose own replay met a damaged block may have missed a
        // lookup: loaded whole instead, without the file.
        let mut stepped_damage = false;
        let step = step.filter(|(stepped, _)| {
            stepped_damage = recovery::lazy_damage(&stepped.shards, &stepped.index).is_some();
            !stepped_damage
        });
        let damaged = damaged || stepped_damage;
        match step {
            Some((view, manifest)) => {
                *lock(&self.inner.view) = Arc::new(view);
                *point = Some(manifest);
            }
            None => {
                let (view, report, manifest) = load_read_only(&self.inner.dir, recovery, !damaged)?;
                *lock(&self.inner.view) = Arc::new(view);
                *lock(&self.recovery) = Arc::new(report);
                *point = Some(manifest);
            }
        }
        Ok(())
    }

    /// What opening the store found in its log and did about it — torn tails
    /// cut, damaged regions skipped, footers rebuilt (format-spec/segment.md
    /// §6) — for a read-only store, as of the last [`Store::refresh`]. Empty
    /// when there was nothing to do.
    pub fn recovery_report(&self) -> Arc<RecoveryReport> {
        lock(&self.recovery).clone()
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &Options {
        &self.inner.options
    }

    /// The error every write now returns when a failed write or fsync (or
    /// the writer thread's panic) poisoned the store, `None` while it takes
    /// writes. A poisoned store recovers only by being closed and opened
    /// again (after freeing space, when the kind is `StorageFull`); a
    /// long-lived owner such as `trajlog serve` checks this to know when to.
    pub fn poisoned(&self) -> Option<Error> {
        self.inner.poisoned_error()
    }

    /// Refuse writes to a read-only or poisoned store.
    fn writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::Closed, "store is open read-only; open it with Store::open to write"));
        }
        match self.inner.poisoned_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Send a command that takes a sequence number, under the append lock
    /// (which `s` is); the lock is released before a dead writer is waited on.
    fn send_in_order(&self, s: MutexGuard<'_, SendState>, cmd: Cmd) -> Result<()> {
        let tx = self.inner.tx.as_ref().ok_or_else(Error::closed)?;
        let sent = tx.send(cmd);
        drop(s);
        sent.map_err(|_| self.inner.dead_error())
    }

    /// Append a call. Returns once the writer has it (waiting while the queue
    /// is full: see [`Options::queue_depth`], [`Options::queue_bytes`]);
    /// [`Receipt::wait`] or [`Store::flush`] make it durable.
    pub fn append(&self, call: Call) -> Result<Receipt> {
        self.append_valid(ValidCall::new(call)?)
    }

    /// [`Store::append`] for a call already checked ([`ValidCall`]): the
    /// boundary check is not run twice.
    pub fn append_valid(&self, call: ValidCall) -> Result<Receipt> {
        let (call, found) = call.into_parts();
        self.writable()?;
        // Back-pressure first, holding no lock.
        let permit = self.inner.queue.acquire(call_bytes(&call))?;
        self.append_admitted(call, found.map(|f| *f), permit)
    }

    /// [`Store::append_valid`] that never waits for room: when the queue is
    /// full ([`Options::queue_depth`], [`Options::queue_bytes`]) or others
    /// already wait for room, the call comes back untouched
    /// ([`TryAppend::Full`]) to be appended later or from a thread that may
    /// wait. For callers that must not block, such as an event loop.
    pub fn try_append_valid(&self, call: ValidCall) -> Result<TryAppend> {
        self.writable()?;
        let Some(permit) = self.inner.queue.try_acquire(call_bytes(call.call()))? else {
            return Ok(TryAppend::Full(Box::new(call)));
        };
        let (call, found) = call.into_parts();
        self.append_admitted(call, found.map(|f| *f), permit).map(TryAppend::Appended)
    }

    /// Call `listener` each time the store's durability state changes:
    /// after each commit that makes appends durable (once per group
    /// commit, however many records it covers), when the store is poisoned,
    /// and when it closes. It runs on the writer thread (or the one that
    /// poisons or closes the store), so it must be quick and must not
    /// block or call into the store: it is meant to wake an event loop,
    /// which then polls its receipts ([`Receipt::poll`]). A listener is
    /// kept until the store is dropped.
    pub fn on_durable(&self, listener: impl Fn() + Send + Sync + 'static) {
        lock(&self.inner.listeners).push(Arc::new(listener));
    }

    /// `found`: the cuts of `extra` its writer found (`ValidCall::with_found_cuts`).
    fn append_admitted(&self, call: Call, found: Option<ExtraCuts>, permit: Permit) -> Result<Receipt> {
        // Structure-aware documents, made here so that appenders share the
        // work: `messages` as a delta against the session's previous append
        // (the writer checks that it is the parent it chooses).
        let prev = lock(&self.inner.send).chat.get(&call.session_id);
        let parent = prev.as_deref().filter(|p| p.depth < crate::limits::MESSAGES_DELTA_DEPTH_MAX).map(|p| {
            crate::format::docs::Parent { messages: &p.messages, response_message: p.response_message.as_deref() }
        });
        let docs = crate::format::docs::encode_found(&call, parent, found);
        let (docs_parent_seq, depth) = match (&docs, &prev) {
            (Some(d), Some(p)) if d.uses_parent => (Some(p.seq), p.depth + 1),
            _ => (None, 0),
        };
        let chat = call.messages.clone().map(|messages| (messages, call.response_message.clone()));
        let mut s = lock(&self.inner.send);
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
        if s.sealed.wants_rebase() {
            // The view published is at least as new as `durable_seq`.
            let view = lock(&self.inner.view).clone();
            s.sealed.rebase(view.index.clone(), durable_seq);
        }
        let view = lock(&self.inner.view).clone();
        let current: Option<Arc<[Arc<str>]>> = match s.calls_in_flight.get(call.trace_id.as_str()) {
            Some((seq, sessions)) if *seq > durable_seq => {
                (!sessions.first().is_some_and(|p| s.deleted_after(p, *seq))).then(|| sessions.clone())
            }
            _ => view
                .index
                .live(call.trace_id.as_str())
                .filter(|m| !m.primary_session().is_some_and(|p| s.deleted_after(p, durable_seq)))
                .map(|m| m.sessions()),
        };
        if let Some(current) = current {
            check_trace_id(&call, &current, &s.sealed)?;
        }
        // The lookups above read the shard index file a block at a time: if
        // one met a damaged block it may have missed (a seal, a trace id).
        let damage = s.sealed.damage().or_else(|| recovery::writer_damage(&view.shards, &view.index, &[]));
        if let Some(e) = damage {
            drop(s);
            return Err(self.inner.index_damaged(&e));
        }
        s.next_seq += 1;
        let seq = s.next_seq;
        s.calls_in_flight.insert(call.trace_id.clone(), (seq, sessions_of(&call.session_id, &call.session_uids)));
        let chat = chat.map(|(messages, response_message)| ChatPrev { seq, messages, response_message, depth });
        s.chat.put(&call.session_id, chat);
        self.send_in_order(s, Cmd::Append { seq, call: Box::new(call), docs, docs_parent_seq, permit })?;
        Ok(Receipt { seq, inner: self.inner.clone() })
    }

    /// Append and wait until durable.
    pub fn append_durable(&self, call: Call) -> Result<()> {
        self.append(call)?.wait()
    }

    fn annotate(&self, ann: Annotation, reply: Option<Sender<u64>>) -> Result<Receipt> {
        ann.validate()?;
        self.writable()?;
        let permit = self.inner.queue.acquire(annotation_bytes(&ann))?;
        let mut s = lock(&self.inner.send);
        s.next_seq += 1;
        let seq = s.next_seq;
        match &ann {
            Annotation::Seal { session_id } => {
                s.sealed.insert(session_id.clone(), seq);
                s.chat.remove(session_id);
            }
            Annotation::DeleteSession { session_id } => {
                s.sealed.remove(session_id, seq);
                s.chat.remove(session_id);
            }
            Annotation::Reward { .. } | Annotation::MoveSession { .. } => {}
        }
        if let Annotation::DeleteSession { session_id } = &ann {
            s.deletes_in_flight.push((seq, session_id.clone()));
        }
        self.send_in_order(s, Cmd::Annotate { seq, ann, reply, permit })?;
        Ok(Receipt { seq, inner: self.inner.clone() })
    }

    /// Record a reward on a trace or a session (last one wins); durable on return.
    ///
    /// A trace reward goes to the trace id's live call: one appended before
    /// it (durable or not) and not deleted since. A trace id with no live
    /// call is refused with [`ErrorKind::NotFound`], and nothing is written.
    /// A session reward needs no call (it may come before the session's
    /// first one).
    pub fn set_reward(&self, target: Target, value: f64) -> Result<()> {
        let Target::Trace(trace_id) = &target else {
            return self.annotate(Annotation::Reward { target, value }, None)?.wait();
        };
        let trace_id = trace_id.clone();
        let (tx, rx) = bounded(1);
        self.annotate(Annotation::Reward { target, value }, Some(tx))?.wait()?;
        match rx.recv().map_err(|_| self.inner.dead_error())? {
            0 => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "set_reward: trace_id {trace_id:?} has no live call in this store (never appended, or deleted with its session); nothing was written"
                ),
            )),
            _ => Ok(()),
        }
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
        rx.recv().map_err(|_| self.inner.dead_error())
    }

    /// Send a command that needs no sequence number (no lock, no wait for
    /// room: it follows every append that returned before it) and wait for
    /// its answer.
    fn control<T>(&self, make: impl FnOnce(Sender<Result<T>>) -> Cmd) -> Result<T> {
        self.writable()?;
        let (tx, rx) = bounded(1);
        self.inner.send(make(tx))?;
        rx.recv().map_err(|_| self.inner.dead_error())?
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

    /// Held by a compaction while it runs: one at a time (`Store::compact`
    /// lives in `crate::compact`, which sits above the store).
    pub(crate) fn compaction_guard(&self) -> MutexGuard<'_, ()> {
        lock(&self.inner.compacting)
    }

    /// Test hook: wait for the writer's refresh of the backlog index file
    /// under way, if any (store/backlog_refresh.rs), and have the writer
    /// take the index it built if it still can; how many refreshes the
    /// writer started since the open, and how many of their indexes it took.
    #[cfg(any(test, feature = "internals"))]
    #[doc(hidden)]
    pub fn wait_backlog_refresh(&self) -> Result<(u64, u64)> {
        self.wait_backlog_refresh_counts().map(|(started, taken, _, _)| (started, taken))
    }

    /// Test hook: [`Store::wait_backlog_refresh`], how many of the
    /// refreshes wrote the file from the one before instead of from every
    /// footer, and how many wrote a delta over it whose index the writer
    /// took.
    #[cfg(any(test, feature = "internals"))]
    #[doc(hidden)]
    pub fn wait_backlog_refresh_counts(&self) -> Result<(u64, u64, u64, u64)> {
        self.writable()?;
        let (reply, rx) = bounded(1);
        self.inner.send(Cmd::WaitBacklogRefresh { reply })?;
        rx.recv().map_err(|_| Error::closed())
    }

    /// Test hook: make the writer thread panic, as a bug would. Every pending
    /// and later call then fails with `ErrorKind::Poisoned` (none hangs).
    #[cfg(any(test, feature = "internals"))]
    #[doc(hidden)]
    pub fn inject_writer_panic(&self) -> Result<()> {
        self.writable()?;
        self.inner.send(Cmd::Panic)
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
        // No other call can be under way (`&mut self`); receipts may still ask
        // for a sync, which the writer ignores once it stops.
        let _ = self.inner.send(Cmd::Close);
        let joined = handle.join();
        {
            let mut d = lock(&self.inner.durable);
            d.closed = true;
            self.inner.durable_cv.notify_all();
        }
        self.inner.queue.stop(Error::closed());
        self.inner.notify_listeners();
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

/// The backlog index file (store/backlog_file.rs) after a writable open
/// that did not use one: written when the open's survey built a cold layer
/// of at least [`Options::backlog_index_min_calls`] calls over the sealed
/// segments, read cleanly, else any file there (stale, or set aside) is
/// removed. Whether it was written. Best effort, as for the other caches:
/// without it an open only takes longer.
fn write_backlog_file(dir: &Path, loaded: &recovery::Loaded, options: &Options) -> bool {
    if loaded.backlog_used {
        return false;
    }
    let written = backlog_file_written(dir, loaded, options);
    if !written {
        let _ = recovery::remove_if_present(&dir.join(backlog_file::BACKLOG_FILE_NAME));
        let _ = recovery::remove_if_present(&dir.join(backlog_file::DELTA_FILE_NAME));
    }
    written
}

/// Write the backlog index file from `loaded` (a load that surveyed its
/// sealed segments) if it is worth it and `loaded` is a clean replay of
/// them; whether it was written. Nothing is removed.
fn backlog_file_written(dir: &Path, loaded: &recovery::Loaded, options: &Options) -> bool {
    // Only from a replay of every sealed segment as its footer has it: a
    // skip-corrupted open leaves damaged records out of its layer that
    // the footers still name. And not beside the annotation cache, which
    // an open uses first (the file would never be read).
    let clean = options.recovery != RecoveryMode::SkipCorrupted
        && loaded.report.events.iter().all(|e| e.kind == crate::segment::recovery::RecoveryEventKind::TornTailCut)
        && loaded.annotation_cache != recovery::CacheUse::Used;
    // The open's survey built one layer at most.
    let cold = match loaded.index.cold().first() {
        Some(cold) if loaded.index.cold().count() == 1 => cold,
        _ => return false,
    };
    let any_shards = loaded.shards.files().next().is_some();
    let key = recovery::backlog_key(&loaded.shards);
    let worth = options.backlog_index_min_calls > 0 && cold.len() as u64 >= options.backlog_index_min_calls;
    match &loaded.cold_taken {
        Some(taken) if clean && worth && (key.is_some() || !any_shards) => {
            // Every sealed segment, in log order (the active one is not in
            // `segments` any more).
            let segments: Vec<&crate::segment::SegmentRef> = loaded.segments.values().filter(|s| s.sealed).collect();
            let w = backlog_file::ToWrite { segments, cold, taken, shard_key: key };
            backlog_file::write(dir, &w, &options.faults).is_ok_and(|n| n > 0)
        }
        _ => false,
    }
}
