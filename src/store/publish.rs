//! Publishing a compaction (format-spec/shard.md §5), split by who owns what.
//!
//! The compacting thread does the work proportional to the store: it opens
//! and checks the new `steps` shards and reads their rows, builds the shard
//! set the publication makes (the placement of every row by log position,
//! see `ShardSet`), and counts, for retirement, the live calls still in
//! segments. The trace map is not touched: a compacted call keeps its entry,
//! and reads find its row by the entry's log position. The writer thread,
//! which owns the manifest and the indexes, then commits the publication and
//! switches to the new set, re-counting only the trace ids it changed since
//! the compaction began (it notes them from then on). A replacement or a
//! deletion made meanwhile wins by itself: the new entry's log position has
//! no row.

use super::recovery::Rebuilt;
use super::*;
use crate::index::LiveCall;
use crate::shard::set::ShardSet;

/// Cold calls a walk of the cold layer reads between two givebacks of its
/// mapped pages.
const COLD_RELEASE_EVERY: usize = 1 << 20;

/// A compaction begun ([`Store::begin_compaction`]): its shard generation and
/// the snapshot it compacts. Dropped without publishing, it tells the writer
/// to stop noting changes for it.
pub(crate) struct Compaction {
    inner: Arc<Inner>,
    base: Option<CompactionBase>,
}

impl Compaction {
    /// The shard generation reserved for this compaction's files.
    pub(crate) fn generation(&self) -> u64 {
        self.base.as_ref().map_or(0, |b| b.generation)
    }

    /// How many shard rows carried trace id `trace` when the compaction
    /// began (or another id of its hash); `usize::MAX` without a base.
    pub(crate) fn shard_rows_of_trace(&self, trace: &str) -> usize {
        self.base.as_ref().map_or(usize::MAX, |b| b.shard_traces.count(trace))
    }

    /// What the compaction reads: everything durable when it began, with the
    /// active segment sealed.
    pub(crate) fn snapshot(&self) -> Result<Snapshot> {
        self.base.as_ref().map(|b| Snapshot::new(b.view.clone())).ok_or_else(Error::closed)
    }
}

impl Drop for Compaction {
    fn drop(&mut self) {
        if let Some(base) = &self.base {
            end_compaction(&self.inner, base.token);
        }
    }
}

/// Tell the writer that compaction `token` ends unpublished (best effort: a
/// writer that is gone notes nothing any more).
fn end_compaction(inner: &Inner, token: u64) {
    if let Some(tx) = &inner.tx {
        let _ = tx.send(Cmd::EndCompaction { token });
    }
}

impl Store {
    /// Start a compaction: seal the active segment so that what is compacted
    /// can be retired, make everything durable, reserve a shard generation.
    pub(crate) fn begin_compaction(&self) -> Result<Compaction> {
        let base = self.control(|reply| Cmd::BeginCompaction { reply })?;
        // What a compaction reads of the shard index file it reads whole
        // (a publication's merge, a retirement, the plan's row counts): the
        // blocks a writable open left unchecked are checked here, in the
        // compacting thread, not in the writer's.
        let checked = base.view.shards.index_file().map_or(Ok(()), |ix| ix.check_whole());
        let compaction = Compaction { inner: self.inner.clone(), base: Some(base) };
        if let Err(e) = checked {
            drop(compaction);
            return Err(self.inner.index_damaged(&e));
        }
        Ok(compaction)
    }

    /// Publish the staged shards of `compaction`, which compacted `sessions`:
    /// prepare the index changes here, in the caller's thread, then have the
    /// writer commit and apply them.
    pub(crate) fn publish_compaction(
        &self,
        mut compaction: Compaction,
        staged: Vec<PendingRename>,
        sessions: Vec<String>,
        obsolete: &Obsolete,
        copy_forward: Option<f64>,
        keep_liveness: bool,
    ) -> Result<PublishOutcome> {
        self.writable()?;
        let base = compaction.base.take().ok_or_else(Error::closed)?;
        let token = base.token;
        let prepared = match prepare(&self.inner.dir, base, &staged, obsolete, &self.inner.options.faults) {
            Ok(p) => Prepared { copy_forward, ..p },
            Err(e) => {
                // Nothing was published.
                end_compaction(&self.inner, token);
                let shards_dir = self.inner.dir.join(SHARDS_DIR);
                for p in &staged {
                    let _ = fs::remove_file(shards_dir.join(&p.staged));
                }
                return Err(e);
            }
        };
        let (tx, rx) = bounded(1);
        self.inner.send(Cmd::Publish { staged, sessions, prepared: Box::new(prepared), reply: tx })?;
        // The writer hands back what it did not keep, to be freed here.
        let (mut outcome, leftovers) = rx.recv().map_err(|_| self.inner.dead_error())?;
        drop(leftovers);
        if let Ok(outcome) = &mut outcome {
            // The manifest the publication wrote, read once for both.
            let manifest = super::recovery::read_manifest(&self.inner.dir);
            if let Ok(Some(manifest)) = &manifest {
                self.write_annotation_cache(manifest);
            }
            // The deletion vectors of the shards just published (shard.md
            // §9): a failure is reported, the shards stay published, and
            // the next publication writes the table.
            let written = match manifest {
                Ok(Some(m)) => self.write_deletions(&m, keep_liveness),
                Ok(None) => Ok(Vec::new()),
                Err(e) => Err(e),
            };
            match written {
                Ok(skipped) => outcome.deletions_skipped = skipped,
                Err(e) => return Err(Error::new(
                    e.kind().clone(),
                    format!(
                        "the shards were published, but the deletions side table (shards/{}) was not rewritten: {}; until a compaction rewrites it, readers of the shard files see the rows deleted since the last one",
                        super::deletions::DELETIONS_FILE,
                        e.message()
                    ),
                )),
            }
        }
        outcome
    }

    /// Write the annotation cache (store/annotation_cache.rs) for the store
    /// as it stands after a publication, which may have retired listed
    /// segments, carried annotations into new ones or rewritten the shard
    /// index file: here, in the compacting thread, while no other
    /// publication can run — reading only the segments sealed since the
    /// last publication's when that one's file still stands for the same
    /// index file and segments (else one footer read per sealed segment).
    /// Best effort: without it, opens replay the annotation segments.
    fn write_annotation_cache(&self, manifest: &Manifest) {
        let view = lock(&self.inner.view).clone();
        let mut last = lock(&self.inner.annotation_built);
        let Some(ix) = view.shards.index_file() else {
            *last = None;
            return;
        };
        let dir = &self.inner.dir;
        *last = super::annotation_cache::write_after(dir, manifest, ix, &self.inner.options.faults, last.as_ref());
    }
}

/// What a collection replaces (compact/collect.rs): every file of these
/// generations, whose `steps` files are these shard ids of the base view.
/// Their live rows are among the staged files.
#[derive(Debug, Clone, Default)]
pub(crate) struct Obsolete {
    pub generations: Vec<u64>,
    pub shard_ids: Vec<u32>,
}

/// The compacting thread's part of a publication: open the new `steps`
/// shards (still under their staged names) and build the shard set the
/// publication makes; take the rows of the obsolete `steps` files out of
/// the row counts.
fn prepare(
    dir: &Path,
    base: CompactionBase,
    staged: &[PendingRename],
    obsolete: &Obsolete,
    faults: &crate::storage::fault::Faults,
) -> Result<Prepared> {
    let shards_dir = dir.join(SHARDS_DIR);
    // Its collection plan has counted what it needed.
    base.view.shards.liveness_memo().clear();
    let first_shard_id = u32::try_from(base.view.shards.slots())
        .map_err(|_| Error::new(ErrorKind::Io, "too many shard files (more than u32::MAX)"))?;
    // The rows the obsolete files take away and the new files add, by the
    // hashes the row counts keep.
    let (mut gone_traces, mut gone_sessions) = (Vec::new(), Vec::new());
    let (mut new_traces, mut new_sessions) = (Vec::new(), Vec::new());
    let mut rows = Vec::new();
    for id in &obsolete.shard_ids {
        let Some(f) = base.view.shards.file(*id) else { continue };
        rows.clear();
        f.index_rows(&mut rows)?;
        for row in &rows {
            gone_traces.push(RowCounts::hash(&row.trace_id));
            gone_sessions.extend(row.sessions.iter().map(|s| RowCounts::hash(s)));
        }
    }
    let mut files = Vec::new();
    let mut placements = Vec::new();
    // The shard index file is rewritten from the base view's and the new
    // rows when the base view has one (or no shards yet); the new rows are
    // kept for it, else one file's rows at a time.
    let base_index = base.view.shards.index_file().cloned();
    let may_write_index = base_index.is_some() || base.view.shards.files().next().is_none();
    let mut new_rows = Vec::new();
    for (i, p) in staged.iter().filter(|p| p.shard.path.starts_with("steps/")).enumerate() {
        let mut f = ShardFile::open(&shards_dir.join(&p.staged), first_shard_id + i as u32, p.shard.checksum)?;
        rows.clear();
        f.index_rows(&mut rows)?;
        // Read from where it will be once published.
        f.path = shards_dir.join(&p.shard.path);
        files.push(f);
        // Grown file by file to what they hold (a large publication's are
        // ~100 MB each: not doubled, nor copied to double them).
        new_traces.reserve_exact(rows.len());
        new_sessions.reserve_exact(rows.iter().map(|r| r.sessions.len()).sum());
        placements.reserve_exact(rows.len());
        if may_write_index {
            new_rows.reserve_exact(rows.len());
        }
        for row in &rows {
            new_traces.push(RowCounts::hash(&row.trace_id));
            new_sessions.extend(row.sessions.iter().map(|s| RowCounts::hash(s)));
            placements.push((row.loc, row.pos));
        }
        if may_write_index {
            new_rows.append(&mut rows);
        }
    }
    drop(rows);
    // Each change is a binary search of the index file's hash tables (80 MB
    // each at 10M calls): a large publication touches most of their pages,
    // given back after each.
    let release = || base_index.as_ref().map(|ix| ix.release_pages());
    let mut shard_traces = base.shard_traces.changed(gone_traces, new_traces);
    release();
    let mut shard_sessions = base.shard_sessions.changed(gone_sessions, new_sessions);
    release();
    let base_set = &base.view.shards;
    let (published, emptied) = base_set.published_files(&obsolete.shard_ids, files);
    // The file is written anew for the first shards, when a collection
    // takes away files it describes (the shard set would be one table
    // again, `ShardSet::place`), or when the files it does not describe hold
    // too many rows ([`index_rewrite_due`]). A merge of files added since
    // (the usual small merge) leaves it.
    let keeps_base = base_set.keeps_base(&obsolete.shard_ids);
    let write_index = match &base_index {
        _ if base_set.files().next().is_none() => true,
        None => false,
        Some(_) if !keeps_base => true,
        Some(ix) => {
            let gone: HashSet<u32> = obsolete.shard_ids.iter().copied().collect();
            let kept_extra = base_set.undescribed_rows_but(&gone);
            index_rewrite_due(kept_extra.saturating_add(placements.len()), ix.placements().len())
        }
    };
    // With the file written, the set is placed by its tables: a set that
    // would be one table is never copied in memory (every placement of the
    // store: ~0.35 GB at 11M rows, the largest part of a merge's peak),
    // only when the file could not be written.
    let written = match write_index {
        // Best effort: without the file the next open decodes the shards.
        true => write_index_file(&shards_dir, base_set, base_index.as_deref(), obsolete, &published, new_rows, faults),
        false => None,
    };
    let shards = match written {
        Some(ix) => {
            (shard_traces, shard_sessions) = RowCounts::of_index(&ix);
            published.with_index(Arc::new(ix))
        }
        None => base_set.place(published, &obsolete.shard_ids, placements),
    };
    let shards = Arc::new(shards);
    // The frozen layer's calls are all compacted: none is in segments; the
    // maps' and the cold layer's may be.
    let base_index = base.view.index.clone();
    let base_shards = base.view.shards.clone();
    let mut in_segments: std::collections::HashMap<Arc<str>, u64> = std::collections::HashMap::new();
    let mut staying = 0usize;
    let hot = base_index.hot_calls().values().map(|m| LiveCall::Hot(m));
    let cold = base_index.cold_calls().map(|(loc, session)| LiveCall::Frozen { loc, session });
    // The walk reads the whole cold layer (mapped from the backlog index
    // file: 0.76 GB at 10M calls in segments): its pages are given back
    // as it goes.
    for (n, call) in hot.chain(cold).enumerate() {
        if let Some(s) = in_segments_of(Some(call), &shards) {
            count_in_segments(&mut in_segments, s);
            staying += 1;
        }
        if n % COLD_RELEASE_EVERY == COLD_RELEASE_EVERY - 1 {
            base_index.cold().release_pages();
        }
    }
    base_index.cold().release_pages();
    let in_maps_or_cold = base_index.hot_calls().len() + base_index.cold_stats().0;
    // With the file written for every `steps` file, the writer takes an
    // index replayed over it, as an open would build it, instead of its
    // own (recovery.rs `Rebuilt`): what this and earlier compactions moved
    // into shards leaves its maps for the file's frozen layer. The base
    // view's sealed segments are replayed here, off the writer's thread;
    // the writer replays the records written since. The replay holds a
    // second copy of the calls that stay in segments until the writer
    // drops its own: it is done when they are at most a quarter of the
    // maps' calls (a compaction then at least frees three times what it
    // copies; one that compacts little of a large backlog does not). Not
    // when this publication takes rows out of the shards (a collection or
    // merge) either: the replay holds the base's segments, and with the
    // segments the publication retires, a dead row dropped can be what
    // replaced one of their calls, which would come back (a call replaced
    // by one with another session among its uids, that session deleted,
    // the dead row collected; found in review).
    let rows_removed = !obsolete.shard_ids.is_empty();
    let rebuilt = if write_index && !rows_removed && staying.saturating_mul(REBUILD_STAYING_DIVISOR) <= in_maps_or_cold
    {
        rebuild_base(dir, &shards, &base.view)
    } else {
        None
    };
    // The first publication after an open: retirement's verdicts on the
    // segments of carried seals and rewards, judged here instead of on the
    // writer thread.
    let prejudged = base.prejudge.map(|epoch| super::retire::prejudge(&base.view, epoch));
    drop(base.view);
    Ok(Prepared {
        token: base.token,
        shards,
        rebuilt,
        base_shards,
        emptied,
        base_index,
        shard_traces,
        shard_sessions,
        obsolete: obsolete.clone(),
        in_segments,
        copy_forward: None,
        prejudged,
    })
}

/// Whether a publication writes the shard index file anew when the `steps`
/// files it does not describe would hold `undescribed` rows beside the
/// `described` ones (format-spec/shard-index.md §1): past 1/8 of them (each
/// row is then written again O(1) times on average) or past
/// [`crate::limits::INDEX_UNDESCRIBED_MAX`] (an open decodes those rows and
/// keeps them in its maps: bounded whatever the history, at the cost of a
/// rewrite of a large file every that many rows).
fn index_rewrite_due(undescribed: usize, described: usize) -> bool {
    undescribed > crate::limits::INDEX_UNDESCRIBED_MAX
        || undescribed.saturating_mul(crate::limits::INDEX_REWRITE_DIVISOR) > described
}

/// A publication rebuilds the writer's index when the calls that stay in
/// segments are at most 1/this of the maps' calls (see [`prepare`]).
const REBUILD_STAYING_DIVISOR: usize = 4;

/// [`Rebuilt`] over `shards` (whose index file a publication just wrote)
/// through the records of `base`'s sealed segments, with the last one's
/// id; `None` when one of them does not read cleanly.
fn rebuild_base(dir: &Path, shards: &crate::snapshot::ShardSlots, base: &View) -> Option<(Rebuilt, u64)> {
    let mut rebuilt = Rebuilt::new(shards)?;
    let sealed = || base.segments.iter().filter(|(_, s)| s.sealed);
    let through = sealed().next_back().map_or(0, |(id, _)| *id);
    rebuilt.extend_base(dir, sealed().map(|(_, s)| s)).then_some((rebuilt, through))
}

/// Write the shard index file of `published` (the set a publication makes
/// from `base`, `obsolete` emptied, the files of `new_rows` added) from
/// `base_index` (the file of `base`; `None` when `base` has no files) and
/// the new rows, and open it back. `None` when that fails (the file left is
/// then the old one or none, which the next open sees does not describe the
/// manifest's shards).
fn write_index_file(
    shards_dir: &Path,
    base: &ShardSet,
    base_index: Option<&crate::shard::index_file::ShardIndex>,
    obsolete: &Obsolete,
    published: &ShardSet,
    mut new_rows: Vec<ShardRow>,
    faults: &crate::storage::fault::Faults,
) -> Option<crate::shard::index_file::ShardIndex> {
    use crate::shard::index_file::ShardKey;
    // The file numbers the files present in order: a slot's number is its
    // place among the present slots of the published set.
    let present: Vec<u32> = published.present_slots().collect();
    let number = |slot: u32| present.binary_search(&slot).ok().map(|i| i as u32);
    let keys: Vec<ShardKey> =
        present.iter().filter_map(|s| published.file(*s)).map(|f| ShardKey::of(f, shards_dir)).collect();
    let gone: HashSet<u32> = obsolete.shard_ids.iter().copied().collect();
    // The rows of the base's files the base's file does not describe.
    let described: HashSet<u32> = base.described_slots().into_iter().collect();
    let mut undescribed = Vec::new();
    for slot in base.present_slots().filter(|s| !described.contains(s) && !gone.contains(s)) {
        base.file(slot)?.index_rows(&mut undescribed).ok()?;
    }
    for r in undescribed.iter_mut().chain(new_rows.iter_mut()) {
        r.pos.shard = number(r.pos.shard)?;
    }
    if base_index.is_none() && undescribed.is_empty() {
        // The first shards: built from their decoded rows, no second copy.
        new_rows.sort_by_key(|r| r.loc);
        return write_built(shards_dir, &keys, &new_rows, faults);
    }
    if let Some(ix) = base_index {
        // From the file it replaces, streamed (shard/index_merge.rs): the
        // same bytes as a build from every row, in memory O(the rows added).
        let renumber = |k: u32| base.slot(k).filter(|s| !gone.contains(s)).and_then(number);
        // The rows read in place (a copy of each as a `RowRef` was 80
        // bytes a row).
        match crate::shard::index_merge::write_merged(
            shards_dir,
            &keys,
            ix,
            &renumber,
            &[&undescribed, &new_rows],
            crate::shard::index_merge::Dest::Store(faults),
        ) {
            Ok(true) => {
                return crate::shard::index_file::ShardIndex::open(shards_dir)
                    .ok()
                    .flatten()
                    .filter(|ix| ix.shards() == keys.as_slice());
            }
            Ok(false) => {}
            Err(_) => return None,
        }
    }
    let frozen = base_index.map(|ix| ix.frozen()).unwrap_or_default();
    let mut rows = match base_index {
        Some(ix) => ix.rows(&frozen, |k| base.slot(k).filter(|s| !gone.contains(s)).and_then(number)),
        None => Vec::new(),
    };
    rows.extend(undescribed.iter().chain(&new_rows).map(crate::index::frozen::RowRef::from));
    rows.sort_by_key(|r| r.loc);
    write_built(shards_dir, &keys, &rows, faults)
}

/// Build and write the shard index file of `rows`, sorted by log position,
/// and open it back.
fn write_built<R: crate::index::frozen::AsRow>(
    shards_dir: &Path,
    keys: &[crate::shard::index_file::ShardKey],
    rows: &[R],
    faults: &crate::storage::fault::Faults,
) -> Option<crate::shard::index_file::ShardIndex> {
    use crate::shard::index_file;
    let built = index_file::build(rows, true)?;
    let hot = built.hot_rows(rows);
    index_file::write_and_open(shards_dir, keys, &built.contents(&hot), faults)
}

/// One more call still in segments for `session` (its name is copied only
/// the first time).
fn count_in_segments(in_segments: &mut std::collections::HashMap<Arc<str>, u64>, session: &str) {
    match in_segments.get_mut(session) {
        Some(n) => *n += 1,
        None => {
            in_segments.insert(Arc::from(session), 1);
        }
    }
}

/// What a trace id's live call counts for in [`Prepared::in_segments`]:
/// its primary session, if it is still in segments.
fn in_segments_of<'a>(call: Option<LiveCall<'a>>, shards: &ShardSet) -> Option<&'a str> {
    call.filter(|c| !shards.is_compacted(c.loc())).and_then(|c| c.primary_session())
}

impl Writer {
    /// Begin a compaction (see [`Cmd::BeginCompaction`]).
    pub(super) fn begin_compaction(&mut self) -> Result<CompactionBase> {
        if let Some(e) = self.inner.poisoned_error() {
            return Err(e);
        }
        // A refresh of the backlog index file started by this roll could
        // not be taken (store/backlog_refresh.rs): none starts.
        self.backlog.paused = true;
        let rolled = self.roll();
        self.backlog.paused = false;
        if let Err(e) = rolled {
            self.fail(&e);
            return Err(e);
        }
        self.commit(true);
        if let Some(e) = self.inner.poisoned_error() {
            return Err(e);
        }
        // The view just published is exactly `self.index`: the changes noted
        // from here on are the changes since that view.
        let generation = self.manifest.next_shard_generation.max(1);
        self.manifest.next_shard_generation = generation + 1;
        self.compactions += 1;
        let token = self.compactions;
        self.journal = Some(Journal { token, touched: HashSet::new() });
        Ok(CompactionBase {
            token,
            generation,
            view: lock(&self.inner.view).clone(),
            shard_traces: self.shard_traces.clone(),
            shard_sessions: self.shard_sessions.clone(),
            prejudge: self.annotation_verdicts.begin(),
        })
    }

    /// The trace ids changed since `p`'s compaction began, which ends it —
    /// or why `p` cannot be published (checked before the commit point).
    pub(super) fn changed_since(&mut self, p: &Prepared) -> Result<HashSet<Arc<str>>> {
        let mine = self.journal.as_ref().is_some_and(|j| j.token == p.token);
        match if mine { self.journal.take() } else { None } {
            Some(j) if Arc::ptr_eq(&self.shards, &p.base_shards) => Ok(j.touched),
            _ => Err(Error::new(
                ErrorKind::Io,
                "internal: this publication does not belong to the compaction under way; nothing was published, compact again",
            )),
        }
    }

    /// Take `rebuilt` (a publication's, see [`Rebuilt`]) as the index once
    /// it has replayed the records written since its base: those of the
    /// segments after `through`, the active one's included. Whether it did:
    /// not when the writer is poisoned or has frames not yet written, or a
    /// segment does not read cleanly. Nor when the publication retired a
    /// segment after `through` (`retired`): its records never reach the
    /// rebuilt index, which replayed the base's segments before they went (a
    /// deletion appended during the compaction, in a segment sealed since,
    /// of a session whose calls were all in retired base segments, brought
    /// the session back; found in review). (A publication that takes rows
    /// out of the shards prepares no rebuilt index: `prepare`.) The index
    /// then stays as it is.
    pub(super) fn adopt_rebuilt(&mut self, mut rebuilt: Rebuilt, through: u64, retired: &[u64]) -> bool {
        let diverges = retired.iter().any(|&id| id > through);
        if self.poisoned() || !self.buf.is_empty() || !self.pending.is_empty() || diverges {
            return false;
        }
        let Some(a) = self.active.as_ref() else { return false };
        let seg = SegmentRef::new(a.id, a.path.clone(), a.map.clone(), a.len, false);
        let active = (a.id > through).then_some((&seg, a.entries.as_slice()));
        if !rebuilt.extend_after(&self.dir, self.sealed_segments.range(through + 1..).map(|(_, s)| s), active) {
            return false;
        }
        self.index = rebuilt.finish();
        true
    }

    /// Note that the live call of `trace_id` changed, if a compaction is under way.
    pub(super) fn touch(&mut self, trace_id: &Arc<str>) {
        if let Some(j) = &mut self.journal {
            j.touched.insert(trace_id.clone());
        }
    }

    /// Publish a compaction (format-spec/shard.md §5): record the staged files as
    /// pending in the manifest (the commit point), rename them into place, list
    /// them as published, serve the compacted calls from them, and retire the
    /// segments nothing needs any more.
    ///
    /// Cost on this thread: the manifest writes and renames, the trace ids
    /// changed since the compaction began, and the retired segments.
    pub(super) fn publish(
        &mut self,
        staged: Vec<PendingRename>,
        sessions: &[String],
        p: &mut Prepared,
        touched: &HashSet<Arc<str>>,
    ) -> Result<PublishOutcome> {
        let shards_dir = self.dir.join(SHARDS_DIR);
        // A collection's obsolete files leave the published list in the same
        // manifest write that decides the new ones (the commit point), and
        // are listed as obsolete until they are deleted.
        let gens = &p.obsolete.generations;
        let mut obsolete = Vec::new();
        if !gens.is_empty() {
            self.manifest.shards.retain(|s| {
                let gone = crate::shard::generation_of(&s.path).is_some_and(|g| gens.contains(&g));
                if gone {
                    obsolete.push(s.path.clone());
                }
                !gone
            });
            self.manifest.obsolete.extend(obsolete.iter().cloned());
        }
        self.manifest.pending = staged.clone();
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        for r in &staged {
            let (from, to) = (shards_dir.join(&r.staged), shards_dir.join(&r.shard.path));
            fs::rename(&from, &to).map_err(|e| Error::io(format!("publish shard {}", to.display()), e))?;
        }
        super::recovery::sync_shard_dirs(&shards_dir, &self.options.faults)?;
        self.manifest.pending.clear();
        self.manifest.shards.extend(staged.iter().map(|r| r.shard.clone()));
        crate::storage::write_atomic(&self.dir, MANIFEST_NAME, &encode_manifest(&self.manifest), &self.options.faults)?;
        // Serve compacted calls from the new shards. Snapshots still
        // holding an obsolete `steps` file read it through a descriptor
        // opened now; the files are deleted at once, so no directory listing
        // sees the old and the new rows together, and their space is freed
        // when the last such snapshot is dropped.
        for f in std::mem::take(&mut p.emptied) {
            f.pin()?;
        }
        if !obsolete.is_empty() {
            // Best effort: a file that cannot be deleted now stays listed
            // as obsolete, and the next writable open deletes it.
            let deleted: Vec<&String> = obsolete
                .iter()
                .filter(|rel| super::recovery::remove_if_present(&shards_dir.join(rel)).is_ok())
                .collect();
            super::recovery::sync_shard_dirs(&shards_dir, &self.options.faults)?;
            self.manifest.obsolete.retain(|o| !deleted.contains(&o));
        }
        self.shards = p.shards.clone();
        // The counts of live calls in segments were taken on the base view:
        // re-count the trace ids changed since (the writer's entry wins; a
        // new entry has no shard row, being later than the compaction).
        for id in touched {
            if let Some(s) = in_segments_of(p.base_index.live(id), &self.shards) {
                if let Some(n) = p.in_segments.get_mut(s) {
                    *n = n.saturating_sub(1);
                }
            }
            if let Some(s) = in_segments_of(self.index.live(id), &self.shards) {
                count_in_segments(&mut p.in_segments, s);
            }
        }
        self.shard_traces = std::mem::take(&mut p.shard_traces);
        self.shard_sessions = std::mem::take(&mut p.shard_sessions);
        for s in sessions {
            self.delta.forget(s);
        }
        if let Some(pre) = p.prejudged.take() {
            let _taken = self.annotation_verdicts.adopt(pre);
            #[cfg(test)]
            self.inner.verdicts_adopted.fetch_add(_taken, std::sync::atomic::Ordering::Relaxed);
        }
        let (retired_segments, copied_forward) = self.retire(&p.in_segments, p.copy_forward)?;
        self.delta.forget_segments(&retired_segments);
        Ok(PublishOutcome { retired_segments, copied_forward, deletions_skipped: Vec::new() })
    }
}

#[cfg(test)]
mod tests {
    use super::index_rewrite_due;
    use crate::limits::INDEX_UNDESCRIBED_MAX;

    /// Small stores follow the 1/8 rule; large ones rewrite once the rows
    /// not described pass the bound, long before 1/8 of them.
    #[test]
    fn the_index_file_is_rewritten_past_an_eighth_or_past_the_bound() {
        assert!(!index_rewrite_due(6, 48));
        assert!(index_rewrite_due(7, 48));
        assert!(!index_rewrite_due(INDEX_UNDESCRIBED_MAX, 10_000_000));
        assert!(index_rewrite_due(INDEX_UNDESCRIBED_MAX + 1, 10_000_000));
        // 1M rows beside 10M: the rows a batched compaction of a 1M
        // backlog left an open to decode before the bound.
        assert!(index_rewrite_due(1_000_000, 10_000_000));
        assert!(!index_rewrite_due(0, 0));
    }
}
