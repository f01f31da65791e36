//! Opening a directory: the manifest, finishing a decided publication,
//! loading segments and shards and replaying them into the indexes
//! (format-spec/segment.md §6, shard.md §4), read-only loads.

use super::annotation_cache::{self, AnnotationCache};
use super::*;
use crate::format::segment::FooterEntryRef;
use crate::index::frozen::RowRef;
use crate::segment::recovery::LoadedSegment;
use crate::storage::fault::Faults;

pub(super) fn read_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let path = dir.join(MANIFEST_NAME);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
    };
    decode_manifest(&bytes).map(Some).map_err(|e| match crate::format::manifest::manifest_version(&bytes) {
        Some(v) if !crate::format::manifest::reads_version(v) => {
            Error::new(ErrorKind::Incompatible, format!("{}: {}; use a matching trajlog", path.display(), e.what))
        }
        _ => Error::corrupt(&path, e.offset, e.what),
    })
}

/// Everything recovered from a directory.
pub(crate) struct Loaded {
    pub(super) manifest: Manifest,
    pub(super) index: Index,
    pub(super) segments: imbl::OrdMap<u64, SegmentRef>,
    pub(super) shards: crate::shard::set::ShardSet,
    /// Shard rows (live or not) per session name.
    pub(super) shard_sessions: RowCounts,
    /// Shard rows (live or not) per trace id.
    pub(super) shard_traces: RowCounts,
    /// The last segment, if unsealed: its entries and valid end.
    pub(super) active: Option<(u64, PathBuf, u64, Vec<FooterEntry>)>,
    /// The active segment had damaged regions skipped (seal it before appending).
    pub(super) active_skipped: bool,
    /// Damage found and confined while loading (see [`Snapshot::damage`]).
    pub(super) damage: Vec<Problem>,
    /// What recovery found and did (see [`Store::recovery_report`]).
    pub(super) report: RecoveryReport,
    /// The reward annotations replayed that `load_dir` was asked to keep
    /// (those the rewards side table may not reflect): position and target.
    pub(super) rewards: Vec<(Loc, Target)>,
    /// The shard index file to write once the open succeeded, if it has
    /// none that describes its shards.
    pub(super) index_to_write: Option<IndexToWrite>,
    /// Whether the open used the annotation cache.
    pub(super) annotation_cache: CacheUse,
    /// Whether the open took its cold layer from the backlog index file.
    pub(super) backlog_used: bool,
    /// The segments that file lists, and the last one its delta lists (if
    /// the open used one).
    pub(super) backlog_listed: (usize, Option<u64>),
    /// The sessions (by name hash) of the cold layer a survey built (not
    /// one the backlog index file held), for the file a writer writes.
    pub(super) cold_taken: Option<std::collections::HashSet<u64>>,
}

/// What an open did with the annotation cache (store/annotation_cache.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CacheUse {
    /// It took the listed segments' seals and rewards from it.
    Used,
    /// There was none it could use (none, stale, or a skip-corrupted open).
    NotUsed,
    /// It had a current one but could not use it (a record that breaks
    /// its rule, which made the open replay everything again without it,
    /// or a listed reward the rewards side table may not reflect yet):
    /// written again, it would be the same file.
    SetAside,
}

/// Apply one footer entry to `index`.
///
/// Calls, seals, deletions and (since segment format 4) rewards are applied
/// from the footer entry alone, so an open reads no record body and touches
/// only the footers' pages (format-spec/segment.md §4). A reward in an older
/// footer is read from its record; a damaged one is skipped and reported in
/// `damage` (a damaged seal or deletion is found by `trajlog verify`, as a
/// damaged call is).
pub(super) fn apply_entry(
    index: &mut Index,
    seg: &SegmentRef,
    e: &FooterEntryRef<'_>,
    damage: &mut Vec<Problem>,
    rewards: &mut Vec<(Loc, Target)>,
    keep_reward: &dyn Fn(Loc) -> bool,
    hits: Option<&crate::index::FrozenHits>,
) {
    let loc = Loc { segment: seg.id, offset: e.frame_offset };
    // Seals and session rewards straight from the entry, with no copy of
    // their target: an open replays one of each per compacted session.
    match (e.kind, e.reward_target) {
        (crate::format::record::KIND_SEAL, _) => {
            index.seal(e.id);
            return;
        }
        (crate::format::record::KIND_REWARD, 2) if !keep_reward(loc) => {
            index.set_session_reward(e.id, e.timestamp);
            return;
        }
        _ => {}
    }
    let ann = match crate::segment::recovery::annotation_of_entry_ref(e) {
        Some(ann) => ann,
        None if e.kind == KIND_CALL => {
            let sessions = if e.session_uids.is_empty() {
                index.sessions_of::<&str>(e.session_id, &[])
            } else {
                index.sessions_of(e.session_id, &e.session_uids.iter().collect::<Vec<_>>())
            };
            index.apply_surveyed_call(Arc::from(e.id), CallMeta { loc, timestamp: e.timestamp, sessions }, hits);
            return;
        }
        None => {
            let decoded = seg.body_at(e.frame_offset).and_then(|body| {
                decode_annotation(body).map_err(|d| Error::corrupt(seg.path.as_path(), e.frame_offset, d.what))
            });
            match decoded {
                Ok(ann) => ann,
                Err(err) => {
                    let what = format!("damaged reward annotation skipped (target {:?}): {}", e.id, err.message());
                    damage.push(Problem { path: seg.path.as_path().to_path_buf(), offset: e.frame_offset, what });
                    return;
                }
            }
        }
    };
    let applied = apply_annotation(index, &ann, loc) > 0;
    if let Annotation::Reward { target, .. } = ann {
        if applied && keep_reward(loc) {
            rewards.push((loc, target));
        }
    }
}

/// Apply a shard row to the maps, unless it stands in the frozen layer:
/// `frozen` is its frozen session, if it was frozen at the open (a record
/// naming the session or the trace id since may have thawed it).
pub(super) fn apply_shard_row(index: &mut Index, row: &ShardRow, frozen: Option<u32>) {
    if frozen.is_some_and(|s| index.is_frozen(s)) {
        return;
    }
    index.apply_call(
        row.trace_id.clone(),
        CallMeta { loc: row.loc, timestamp: row.timestamp, sessions: row.sessions.clone() },
    );
}

/// Apply an annotation, a record at `at`; returns how many calls a deletion
/// deleted, 1 for a reward that was set and 0 for one that was not (a trace
/// id with no live call), 0 for a seal.
pub(super) fn apply_annotation(index: &mut Index, ann: &Annotation, at: Loc) -> u64 {
    match ann {
        Annotation::Reward { target: Target::Trace(t), value } => u64::from(index.set_trace_reward(t, *value, at)),
        Annotation::Reward { target: Target::Session(s), value } => {
            index.set_session_reward(s, *value);
            1
        }
        Annotation::Seal { session_id } => {
            index.seal(session_id);
            0
        }
        Annotation::DeleteSession { session_id } => index.delete_session(session_id, at),
        Annotation::MoveSession { session_id } => {
            index.set_floor(session_id, at);
            0
        }
    }
}

/// The `steps` shards of a manifest, in publication order (their shard ids).
/// `pending` publications count too, at their final path if the rename
/// happened, else at their staged path (read-only opens do not rename).
/// Each with the manifest entry's checksum, if it has one.
pub(super) fn steps_shard_paths(dir: &Path, manifest: &Manifest) -> Vec<(PathBuf, Option<ShardChecksum>)> {
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

/// Open shards (ids in the order given), their footers decoded at their
/// first read when the manifest gives their checksums
/// ([`ShardFile::open_deferred`]).
pub(super) fn open_shards(paths: &[(PathBuf, Option<ShardChecksum>)]) -> Result<Vec<Arc<ShardFile>>> {
    let mut files = Vec::with_capacity(paths.len());
    for (i, (path, expected)) in paths.iter().enumerate() {
        if !path.exists() {
            let dir = path.parent().and_then(Path::parent).and_then(Path::parent).unwrap_or(Path::new("."));
            return Err(missing_listed_file(dir, path));
        }
        files.push(Arc::new(ShardFile::open_deferred(path, i as u32, *expected)?));
    }
    Ok(files)
}

/// Every index row of `files`, sorted by log position.
pub(super) fn shard_rows(files: &[Arc<ShardFile>]) -> Result<Vec<ShardRow>> {
    let mut rows = Vec::new();
    for f in files {
        f.index_rows(&mut rows)?;
    }
    rows.sort_by_key(|r| r.loc);
    Ok(rows)
}

/// A file the manifest lists is gone.
pub(super) fn missing_listed_file(dir: &Path, path: &Path) -> Error {
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
/// the call it was compacted from (format-spec/shard.md §4). `recovery`
/// decides what damage does (format-spec/segment.md §6); `writable`: a torn
/// tail will be cut (and is reported), else it is only left out. Reward
/// annotations at a position `keep_reward` accepts are listed in
/// [`Loaded::rewards`] (none while the store has no shards).
pub(super) fn load_dir(
    dir: &Path,
    manifest: Manifest,
    recovery: RecoveryMode,
    writable: bool,
    keep_reward: &dyn Fn(Loc) -> bool,
    lazy: bool,
) -> Result<Loaded> {
    // A `lazy` open checks the tables of the shard index file and of the
    // annotation cache a block at a time, as its replay and later lookups
    // read them (at 10M calls: 1.2 GB and 20 MB). A block that failed
    // during the replay may have made a lookup miss: the open is done
    // again, checking the files whole, and does without the one that fails
    // (it decodes the shards, or replays the annotation segments).
    let loaded = load_dir_lazy(dir, manifest.clone(), recovery, writable, keep_reward, lazy)?;
    if lazy_damage(&loaded.shards, &loaded.index).is_some() {
        return load_dir_lazy(dir, manifest, recovery, writable, keep_reward, false);
    }
    Ok(loaded)
}

/// The error of a block of the shard index file or of the annotation
/// cache that failed its check since a read-only open mapped it (both are
/// checked a block at a time, as lookups read them): a lookup may have
/// missed.
pub(crate) fn lazy_damage(shards: &crate::shard::set::ShardSet, index: &Index) -> Option<Error> {
    shards
        .index_file()
        .and_then(|ix| ix.damage())
        .or_else(|| index.frozen().cache_damage())
        .or_else(|| index.cold().table_damage())
        .or_else(|| index.cold().cache_damage())
}

/// What failed of the lazily checked tables a writer's lookups read —
/// the shard index file of its shard set, the frozen layer's tables (of
/// that file, or of the one an older view mapped) and annotation cache, the
/// row counts' — once a block did: a lookup may have missed, so the writer
/// must not act on it.
pub(crate) fn writer_damage(
    shards: &crate::shard::set::ShardSet,
    index: &Index,
    counts: &[&RowCounts],
) -> Option<Error> {
    shards
        .index_file()
        .and_then(|ix| ix.damage())
        .or_else(|| index.frozen().table_damage())
        .or_else(|| index.frozen().cache_damage())
        .or_else(|| index.cold().table_damage())
        .or_else(|| index.cold().cache_damage())
        .or_else(|| counts.iter().find_map(|c| c.damage()))
}

/// [`load_dir`], checking the shard index file a block at a time if `lazy`.
fn load_dir_lazy(
    dir: &Path,
    manifest: Manifest,
    recovery: RecoveryMode,
    writable: bool,
    keep_reward: &dyn Fn(Loc) -> bool,
    lazy: bool,
) -> Result<Loaded> {
    // A skip-corrupted open checks every frame of every segment: it reads
    // the listed ones too.
    let cache = match recovery {
        RecoveryMode::SkipCorrupted => None,
        _ => annotation_cache::usable(dir, &manifest, lazy, writable),
    };
    let mut used = CacheUse::NotUsed;
    if let Some(cache) = cache {
        let cache = Arc::new(cache);
        // A writable open notes the rewards the side table may not reflect
        // yet from their records: a listed one among them sets it aside.
        if cache.listed.iter().any(|l| keep_reward(Loc { segment: l.id, offset: u64::MAX })) {
            used = CacheUse::SetAside;
        } else {
            match load_dir_with(
                dir,
                manifest.clone(),
                recovery,
                writable,
                keep_reward,
                Offered::Cache(cache.clone()),
                lazy,
            )? {
                Some(loaded) => return Ok(loaded),
                None => used = CacheUse::SetAside,
            }
        }
        // A writer leaves a cache it set aside as it is (it would write the
        // same): unless, checked lazily so far, a block of it fails.
        if writable && lazy && !cache.check_whole() {
            used = CacheUse::NotUsed;
        }
    }
    // The backlog index file, read by an open that reads the listed
    // segments no other way (not through the annotation cache, not frame
    // by frame) and keeps none of their rewards for the side table (which
    // matters only once some session is in a shard).
    // A writable open does without it once the sealed segments it does not
    // list are more than an eighth of those it lists: its survey then
    // builds the layer of them all, and it writes the file anew (so the
    // segments an open reads stay a bounded share of the backlog, and the
    // bytes written O(1) a call).
    let any_shards = !steps_shard_paths(dir, &manifest).is_empty();
    let backlog = match recovery {
        RecoveryMode::SkipCorrupted => None,
        _ => backlog_file::usable(dir, &manifest, lazy)
            .filter(|b| !any_shards || !b.listed.iter().any(|l| keep_reward(Loc { segment: l.id, offset: u64::MAX })))
            .filter(|b| !writable || !backlog_file::outgrown(b, &manifest))
            .map(Arc::new),
    };
    let offered = backlog.map_or(Offered::Nothing, Offered::Backlog);
    let mut loaded = load_dir_with(dir, manifest, recovery, writable, keep_reward, offered, lazy)?
        .ok_or_else(|| Error::new(ErrorKind::Io, "internal: an open without the annotation cache stopped"))?;
    loaded.annotation_cache = used;
    Ok(loaded)
}

/// What loading a segment does about damage in `recovery` mode.
fn on_damage_of(recovery: RecoveryMode) -> OnDamage {
    match recovery {
        RecoveryMode::SkipCorrupted => OnDamage::Skip,
        // Absolute consistency checked the whole store before (check_absolute).
        RecoveryMode::TolerateTornTail | RecoveryMode::AbsoluteConsistency => OnDamage::Refuse,
    }
}

/// The segments of `manifest` (sealed ones: the writer's refresh of the
/// backlog index file, store/backlog_refresh.rs, lists those up to a
/// point) loaded as a writable open without either cache loads them: every
/// footer read and surveyed, so that the cold layer is built and
/// [`Loaded::cold_taken`] says what it took. `None` as [`load_dir_with`].
pub(super) fn load_surveyed(dir: &Path, manifest: Manifest) -> Result<Option<Loaded>> {
    load_dir_with(dir, manifest, RecoveryMode::TolerateTornTail, false, &|_| false, Offered::Nothing, true)
}

/// What an open is offered to read the listed segments' footers from
/// instead of the segments: at most one of the two files.
enum Offered {
    Nothing,
    Cache(Arc<AnnotationCache>),
    Backlog(Arc<backlog_file::BacklogFile>),
}

/// [`load_dir`], with the annotation cache or the backlog index file if
/// `offered`: `None` when
/// a record replayed before a listed one changes a session the cache sets
/// something on: the open must then replay without it. (When the shards
/// were not loaded through the index file the cache is keyed to, the
/// replay reads the listed segments itself and does without it.)
fn load_dir_with(
    dir: &Path,
    manifest: Manifest,
    recovery: RecoveryMode,
    writable: bool,
    keep_reward: &dyn Fn(Loc) -> bool,
    offered: Offered,
    lazy: bool,
) -> Result<Option<Loaded>> {
    let (cache, backlog) = match offered {
        Offered::Nothing => (None, None),
        Offered::Cache(c) => (Some(c), None),
        Offered::Backlog(b) => (None, Some(b)),
    };
    let on_damage = on_damage_of(recovery);
    // A helper thread reads the segments and decodes their footers, one
    // segment ahead of the replay, while this thread loads the shards (the
    // shard index file's checksums) and then replays: the two halves of an
    // open overlap (10M compacted calls: the footers of 2.5M carried seals
    // and rewards against a 1.2 GB index file). Errors reach the replay in
    // the order a sequential open meets them; if the replay stops early,
    // the helper's next send fails and it stops too.
    let listed = manifest.segments.clone();
    let cached = cache.clone();
    let in_backlog = backlog.clone();
    std::thread::scope(|scope| {
        let (ahead, read_ahead) = crossbeam_channel::bounded::<Result<LoadedSegment>>(1);
        scope.spawn(move || {
            for ms in &listed {
                let path = crate::storage::segment_path(dir, ms.id);
                // What its footer says is in the cache or the backlog
                // index file: where its frames end is all the open reads.
                let unread_from = cached
                    .as_ref()
                    .and_then(|c| c.listed.iter().find(|l| l.id == ms.id).map(|l| l.footer_offset))
                    .or_else(|| in_backlog.as_ref().and_then(|b| b.listed(ms.id)).map(|l| l.footer_offset));
                let seg = if let Some(footer_offset) = unread_from {
                    crate::segment::recovery::map_sealed_unread(dir, ms.id, footer_offset)
                } else if path.exists() {
                    crate::segment::recovery::load_segment_in_place(
                        dir,
                        ms.id,
                        ms.state == SegmentState::Sealed,
                        on_damage,
                    )
                } else {
                    Err(missing_listed_file(dir, &path))
                };
                if let Ok(seg) = &seg {
                    if seg.sealed && seg.in_footer.is_none() {
                        // Its footer is decoded: the replay reads no more
                        // of it (a read of a record faults its pages in).
                        seg.map.release_pages();
                    }
                }
                let failed = seg.is_err();
                if ahead.send(seg).is_err() || failed {
                    return;
                }
            }
        });
        replay(dir, manifest, writable, recovery, keep_reward, &read_ahead, cache, backlog, lazy)
    })
}

/// The body of [`load_dir`]: the shards, then each segment from
/// `read_ahead` replayed in manifest order.
#[allow(clippy::too_many_arguments)]
fn replay(
    dir: &Path,
    manifest: Manifest,
    writable: bool,
    recovery: RecoveryMode,
    keep_reward: &dyn Fn(Loc) -> bool,
    read_ahead: &crossbeam_channel::Receiver<Result<LoadedSegment>>,
    cache: Option<Arc<AnnotationCache>>,
    backlog: Option<Arc<backlog_file::BacklogFile>>,
    lazy: bool,
) -> Result<Option<Loaded>> {
    let mut segments = imbl::OrdMap::new();
    let mut active = None;
    let files = open_shards(&steps_shard_paths(dir, &manifest))?;
    let any_shards = !files.is_empty();
    let Shards { shards, mut index, mut feed, shard_traces, shard_sessions, to_write } =
        load_shards(dir, files, writable, lazy)?;
    // The segments the helper thread mapped without reading their footers.
    let unread = cache.clone();
    let annotation_cache = match cache {
        // One that lists nothing (no segment qualified) changes nothing.
        Some(c) if c.listed.is_empty() => CacheUse::Used,
        Some(c) => {
            // The frozen layer must be the one of the file it was built on
            // (the open may have decoded the shards instead: the file does
            // not describe them); else the listed segments are read here.
            let same_file = shards.index_file().and_then(|ix| annotation_cache::key_of(ix)) == Some(c.index);
            if same_file && index.apply_cached(c.listed.len(), c.sessions, c.marks(), &c.trace_rewards) {
                feed.guard = Some(c);
                CacheUse::Used
            } else {
                CacheUse::NotUsed
            }
        }
        None => CacheUse::NotUsed,
    };
    // The backlog index file's cold layer, when the file was keyed to
    // these shards (all of them in the shard index file, or none at all)
    // and the open read no listed segment through the annotation cache.
    let offered = backlog.clone();
    let backlog = backlog.filter(|b| {
        annotation_cache != CacheUse::Used
            && b.shard_key == backlog_key(&shards)
            && (b.shard_key.is_some() || !any_shards)
            && index.cold().is_empty()
    });
    let backlog = match backlog.as_ref().and_then(|b| b.frozen().map(|f| (b, f))) {
        Some((b, frozen)) => {
            index.set_cold_from_backlog(frozen, b.listed.len());
            // Its delta's layer next; without it, the delta's segments are
            // read from their footers.
            let pushed = b.delta_frozen().is_some_and(|delta| index.push_cold(delta));
            let b = match pushed || b.delta_through().is_none() {
                true => b.clone(),
                false => Arc::new(b.without_delta()),
            };
            index.set_backlog_segments(b.listed_count());
            Some(b)
        }
        None => None,
    };
    // Rewards matter to the side table only once some session is in a shard.
    let keep = |loc: Loc| any_shards && keep_reward(loc);
    let last = manifest.segments.last().map(|s| s.id);
    let mut damage = Vec::new();
    let mut rewards = Vec::new();
    let mut report = RecoveryReport { mode: recovery, read_only: !writable, events: Vec::new() };
    let mut active_skipped = false;
    // Every segment, loaded (mapped, footers checked; the helper thread
    // reads one ahead) and surveyed before the replay: which sessions go
    // to the cold layer depends on the whole log (cold.rs).
    let mut loaded_segments = Vec::with_capacity(manifest.segments.len());
    for ms in &manifest.segments {
        let mut seg = read_ahead
            .recv()
            .map_err(|_| Error::new(ErrorKind::Io, "internal: the segment reader stopped early"))??;
        // Mapped unread for a file this open does not use after all.
        let unread_by_cache = annotation_cache != CacheUse::Used && unread.as_ref().is_some_and(|c| c.lists(ms.id));
        let unread_by_backlog =
            offered.as_ref().is_some_and(|b| b.lists(ms.id)) && !backlog.as_ref().is_some_and(|b| b.lists(ms.id));
        if unread_by_cache || unread_by_backlog {
            seg = crate::segment::recovery::load_segment_in_place(dir, ms.id, true, on_damage_of(recovery))?;
        }
        if seg.in_footer.is_some() {
            // Its footer's checks touched it; the survey and the replay
            // read it again, one segment at a time.
            seg.map.release_pages();
        }
        loaded_segments.push(seg);
    }
    // With the backlog index file, the first cold layer is the file's (and
    // the second its delta's): the replay looks them up only for the names
    // the records they do not hold carry (records naming a cold session
    // thaw it as they apply), and the survey is of those records (the warm
    // entries and the segments not listed), for one more layer.
    if let Some(b) = &backlog {
        // The delta's warm entries may name sessions of the file's layer
        // (they continue, seal or reward them); the file's own name none.
        let unlisted =
            loaded_segments.iter().filter(|s| !b.lists(s.id) || b.delta_lists(s.id)).map(|s| entries_of(Some(b), s));
        if let Some(named) = names_of(unlisted, feed.row_hashes()) {
            index.narrow_cold_lookups(named);
        }
        // The survey and the replay read each footer again, one segment at
        // a time.
        for seg in loaded_segments.iter().filter(|s| s.in_footer.is_some()) {
            seg.map.release_pages();
        }
    }
    let listed = backlog.as_deref();
    let mut cold = {
        let surveyed = loaded_segments.iter().map(|s| (s.id, s.sealed, entries_of(listed, s)));
        super::cold::ColdPlan::survey(surveyed, &index, feed.row_hashes(), &keep, &mut |id| {
            release_footer(&loaded_segments, id, |s| s)
        })
    };
    for seg in &loaded_segments {
        active_skipped |= seg.skipped_damage();
        for (offset, what) in &seg.applied_from_footer {
            let what = format!("damaged annotation record, applied from its footer entry: {what}");
            damage.push(Problem { path: seg.path.as_path().to_path_buf(), offset: *offset, what });
        }
        for e in &seg.events {
            if e.kind == RecoveryEventKind::TornTailCut && !writable {
                continue;
            }
            let path = seg.path.as_path().to_path_buf();
            let what = match e.kind {
                RecoveryEventKind::TornTailCut => None,
                RecoveryEventKind::CorruptedRecordSkipped => {
                    Some(format!("{}; skipped (recovery mode skip-corrupted), {} bytes left in place", e.what, e.len))
                }
                _ => Some(e.what.clone()),
            };
            if let Some(what) = what {
                damage.push(Problem { path: path.clone(), offset: e.offset, what });
            }
            report.events.push(e.report(seg.id, &path));
        }
        if !seg.sealed && Some(seg.id) != last {
            return Err(Error::corrupt(
                seg.path.as_path(),
                seg.data_end,
                "a segment before the last one is not sealed",
            ));
        }
        let r = SegmentRef::new(seg.id, seg.path.clone(), seg.map.clone(), seg.data_end, seg.sealed);
        let entries = entries_of(listed, seg);
        feed.replay_segment(&mut index, &shards, &r, entries, &mut damage, &mut rewards, &keep, cold.as_mut());
        if feed.conflict {
            return Ok(None);
        }
        if seg.in_footer.is_some() {
            // Its footer was read in place: the replay reads no more of it.
            seg.map.release_pages();
        }
        if !seg.sealed {
            active = Some((seg.id, seg.path.as_path().to_path_buf(), seg.data_end));
        }
        segments.insert(seg.id, r);
    }
    if backlog.is_some() {
        // What the lookups of the replayed records (is it a cold call?)
        // touched of the file need not stay resident: later reads touch
        // the pages they read.
        index.cold().release_pages();
    }
    let mut cold_taken = None;
    if let Some(cold) = cold {
        // What the replay touched of the shard index file (up to the
        // replay's page budget) need not stay resident beside the layer's
        // build: 10M compacted calls and 1.37M cold ones peaked at ~560 MB
        // with it.
        if let Some(ix) = shards.index_file() {
            ix.release_pages();
        }
        cold_taken = cold.finish(&mut index);
        // The layer's build read the ids and names it copied from the
        // footers: their pages need not stay resident (~0.6 GB at 10M
        // calls in segments).
        for seg in loaded_segments.iter().filter(|s| s.in_footer.is_some()) {
            seg.map.release_pages();
        }
    }
    // The active segment's entries, for the writer (the plan, which
    // borrowed the segments, is done).
    let active = active.map(|(id, path, end)| {
        let entries = loaded_segments.iter_mut().find(|s| s.id == id).map(|s| std::mem::take(&mut s.entries));
        (id, path, end, entries.unwrap_or_default())
    });
    drop(loaded_segments);
    feed.apply(&mut index, |_| true);
    index.widen_cold_lookups();
    if feed.conflict {
        return Ok(None);
    }
    index.record_thaws(false);
    drop(feed);
    if any_shards {
        // The shard rows just dropped were most of the open's heap.
        crate::storage::mmap::trim_heap();
        // And what the replay touched of the shard index file (the session
        // table and names, 45 MB at 1.25M compacted sessions) need not stay
        // resident: later lookups touch the pages they read.
        if let Some(ix) = shards.index_file() {
            ix.release_pages();
        }
    }
    Ok(Some(Loaded {
        manifest,
        index,
        segments,
        shards,
        shard_sessions,
        shard_traces,
        active,
        active_skipped,
        damage,
        report,
        rewards,
        index_to_write: to_write,
        annotation_cache,
        backlog_used: backlog.is_some(),
        backlog_listed: backlog.as_ref().map_or((0, None), |b| (b.listed.len(), b.delta_through())),
        cold_taken,
    }))
}

/// The footer entries an open replays for `seg`: the backlog index file's
/// warm entries of it when `listed` lists it, else its footer's.
fn entries_of<'a>(
    listed: Option<&'a backlog_file::BacklogFile>,
    seg: &'a LoadedSegment,
) -> Box<dyn Iterator<Item = FooterEntryRef<'a>> + 'a> {
    match listed.filter(|b| b.lists(seg.id)) {
        Some(b) => Box::new(b.warm(seg.id)),
        None => seg.entry_refs(),
    }
}

/// The key a backlog index file over `shards` carries: the shard index
/// file's, when it describes every shard row; `None` otherwise (a store
/// without shards, or one whose rows an open decodes: no file is written
/// for it, and none keyed `None` is used while it has shards).
pub(super) fn backlog_key(shards: &crate::shard::set::ShardSet) -> Option<annotation_cache::IndexKey> {
    let ix = shards.index_file()?;
    if shards.undescribed_rows() > 0 {
        return None;
    }
    annotation_cache::key_of(ix)
}

/// What an open takes from the `steps` shards: their set, the index with
/// its frozen layer, the rows its replay applies, the writer's row counts.
struct Shards {
    shards: crate::shard::set::ShardSet,
    index: Index,
    feed: RowFeed,
    shard_traces: RowCounts,
    shard_sessions: RowCounts,
    to_write: Option<IndexToWrite>,
}

/// The shards of an open: from the shard index file when it describes the
/// first of `files` (format-spec/shard-index.md; the others' rows are
/// decoded), else from every file's index columns, decoded and sorted; a
/// writable open then writes the file once it succeeded, for the next open
/// (best effort: without it an open only takes longer).
fn load_shards(dir: &Path, files: Vec<Arc<ShardFile>>, writable: bool, lazy: bool) -> Result<Shards> {
    use crate::shard::index_file::{self, ShardIndex, ShardKey};
    let shards_dir = dir.join(SHARDS_DIR);
    let keys: Vec<ShardKey> = files.iter().map(|f| ShardKey::of(f, &shards_dir)).collect();
    if files.is_empty() {
        return Ok(Shards {
            shards: crate::shard::set::ShardSet::new(files, []),
            index: Index::default(),
            feed: RowFeed::default(),
            shard_traces: RowCounts::default(),
            shard_sessions: RowCounts::default(),
            to_write: None,
        });
    }
    // A file that describes the first files (publications since added
    // others, which it does not describe yet) is used with their rows.
    let opened = match (lazy, writable) {
        (false, _) => ShardIndex::open(&shards_dir),
        (true, false) => ShardIndex::open_lazy(&shards_dir),
        (true, true) => ShardIndex::open_lazy_for_writer(&shards_dir),
    };
    if let Ok(Some(ix)) = opened {
        if keys.starts_with(ix.shards()) {
            return from_index_file(files, Arc::new(ix), writable);
        }
    }
    // Sessions wholly in shards, of no other call's trace id, go to the
    // frozen layer; the log's records thaw what they name as the replay
    // meets them (index/frozen.rs).
    let rows = shard_rows(&files)?;
    let Some(built) = index_file::build(&rows, writable) else {
        // Past the frozen layer's 32-bit row numbers: every row in the maps.
        let shards = crate::shard::set::ShardSet::new(files, rows.iter().map(|r| (r.loc, r.pos)));
        let hashes = |f: &dyn Fn(&ShardRow) -> Vec<u64>| RowCounts::from_hashes(rows.iter().flat_map(f).collect());
        let shard_traces = hashes(&|r| vec![RowCounts::hash(&r.trace_id)]);
        let shard_sessions = hashes(&|r| r.sessions.iter().map(|s| RowCounts::hash(s)).collect());
        let feed = RowFeed { rows: rows.into_iter().map(|r| (r, None)).collect(), ..RowFeed::default() };
        return Ok(Shards { shards, index: Index::default(), feed, shard_traces, shard_sessions, to_write: None });
    };
    let index_file::Built { frozen, frozen_row, placements, hot, trace_hashes, session_hashes } = built;
    // A writable open writes the file once the open succeeded
    // ([`IndexToWrite`]): the rows not frozen are kept for it.
    let to_write = writable
        .then(|| IndexToWrite { keys, hot: hot.iter().filter_map(|i| rows.get(*i as usize).cloned()).collect() });
    let shards = crate::shard::set::ShardSet::from_placements(files, placements);
    let sessions: Vec<Option<u32>> =
        frozen_row.iter().map(|r| r.and_then(|r| frozen.rows().get(r as usize)).map(|r| r.session)).collect();
    let feed = RowFeed { rows: rows.into_iter().zip(sessions).collect(), ..RowFeed::default() };
    Ok(Shards {
        shards,
        index: Index::with_frozen(frozen),
        feed,
        shard_traces: RowCounts::from_sorted(trace_hashes.into()),
        shard_sessions: RowCounts::from_sorted(session_hashes.into()),
        to_write,
    })
}

/// The shard index file a writable open that found none (or a stale one)
/// writes once it succeeded (a refused open changes no file): the rest of
/// it is in the loaded index's frozen layer, the shard set's placements and
/// the row counts.
pub(super) struct IndexToWrite {
    keys: Vec<crate::shard::index_file::ShardKey>,
    hot: Vec<ShardRow>,
}

impl IndexToWrite {
    /// Write the file and open it back, for `loaded` to use: its shard set
    /// and row counts then read the file (best effort: on failure the next
    /// open decodes the shards again).
    pub(super) fn write(self, dir: &Path, loaded: &mut Loaded, faults: &Faults) {
        use crate::shard::index_file;
        let shards_dir = dir.join(SHARDS_DIR);
        let hot: Vec<RowRef<'_>> = self.hot.iter().map(RowRef::from).collect();
        let contents = index_file::Contents {
            frozen: loaded.index.frozen().tables(),
            placements: loaded.shards.placements(),
            hot: &hot,
            trace_hashes: loaded.shard_traces.base(),
            session_hashes: loaded.shard_sessions.base(),
        };
        if let Some(ix) = index_file::write_and_open(&shards_dir, &self.keys, &contents, faults) {
            (loaded.shard_traces, loaded.shard_sessions) = RowCounts::of_index(&ix);
            loaded.shards = loaded.shards.with_index(Arc::new(ix));
        }
    }
}

/// The shards of an open, from a shard index file that describes the
/// first of `files`; the rows of the others are decoded and replayed like
/// rows that are not frozen (a record of them naming a frozen session
/// thaws it, as a record of the log does).
fn from_index_file(
    files: Vec<Arc<ShardFile>>,
    ix: Arc<crate::shard::index_file::ShardIndex>,
    writable: bool,
) -> Result<Shards> {
    let mut index = Index::with_frozen(ix.frozen());
    index.record_thaws(true);
    let later = shard_rows(files.get(ix.shards().len()..).unwrap_or_default())?;
    let (mut shard_traces, mut shard_sessions) = (RowCounts::default(), RowCounts::default());
    if writable {
        let (traces, sessions) = RowCounts::of_index(&ix);
        shard_traces = traces.with(later.iter().map(|r| RowCounts::hash(&r.trace_id)).collect());
        shard_sessions =
            sessions.with(later.iter().flat_map(|r| r.sessions.iter().map(|s| RowCounts::hash(s))).collect());
    }
    let shards = crate::shard::set::ShardSet::from_index(files, ix.clone(), later.iter().map(|r| (r.loc, r.pos)));
    let mut rows: Vec<ShardRow> = ix.hot_rows().to_vec();
    rows.extend(later);
    rows.sort_by_key(|r| r.loc);
    let feed = RowFeed { rows: rows.into_iter().map(|r| (r, None)).collect(), mapped: true, ..RowFeed::default() };
    Ok(Shards { shards, index, feed, shard_traces, shard_sessions, to_write: None })
}

/// The shard rows an open's replay applies at their log positions, in
/// order: every row when the shards were decoded (with its frozen session,
/// if frozen: applied only once thawed), or, from a shard index file, the
/// rows not frozen and the later rows of each session the replay thaws.
#[derive(Default)]
struct RowFeed {
    rows: std::collections::VecDeque<(ShardRow, Option<u32>)>,
    /// Frozen rows of thawed sessions, by (log position, frozen row).
    thawed: std::collections::BinaryHeap<std::cmp::Reverse<(Loc, u32)>>,
    /// From a shard index file: `rows` are not every shard row.
    mapped: bool,
    /// Every shard row's placement, when the replay asks about positions
    /// in increasing order only (a [`Rebuilt`]), with how far it has read:
    /// whether a call is compacted is then a step forward, not a binary
    /// search of the whole table (10M rows: seconds of a rebuild).
    ordered: Option<(crate::storage::table::Table<crate::shard::set::Placement>, usize)>,
    /// Otherwise: the last position asked and where the walk through the
    /// shard set's placements found it (an open replays in log order, so
    /// each call is a step forward, not a binary search of every row).
    walk: Option<(Loc, usize)>,
    /// The annotation cache an open took its listed segments' seals and
    /// rewards from: each record and row it applies before the last listed
    /// segment is checked against it.
    guard: Option<Arc<AnnotationCache>>,
    /// One of them concerned a session the cache sets something on, before
    /// a listed record of it: the open stops and replays without the cache.
    conflict: bool,
}

/// Whether a record or row at `loc` that replaces trace id `trace`, or
/// sets its reward, concerns a frozen session (the one with that trace id)
/// before a listed record of it (store/annotation_cache.rs). A call that
/// only names a frozen session thaws it with the cache's values, which the
/// listed records after it would have set on the thawed session anyway.
fn trace_conflicts(c: &AnnotationCache, frozen: &crate::index::frozen::Frozen, loc: Loc, trace: &str) -> bool {
    c.last_listed().is_some_and(|last| loc.segment < last)
        && frozen.trace(trace).is_some_and(|r| c.conflicts(r.session, loc))
}

/// What an open from the annotation cache does with a footer entry.
#[derive(PartialEq)]
enum Check {
    Apply,
    /// A session reward a listed one overwrites later: not applied.
    Skip,
    /// It breaks the cache's rule: replay without the cache.
    Conflict,
}

/// What to do with a footer entry about to be applied before the last
/// listed segment: a call replacing a frozen trace id or a trace reward of
/// one ([`trace_conflicts`]), or a deletion of a frozen session, before a
/// listed record of that session conflicts; a session reward followed by
/// a listed one is skipped (its value would be overwritten, and a deletion
/// between them conflicts on its own), one that is not conflicts like a
/// deletion; seals and calls that only name a session commute with the
/// listed records; a reward whose target is only in its record (segment
/// format < 4), or a kind this build does not know, conflicts.
fn check_entry(c: &AnnotationCache, frozen: &crate::index::frozen::Frozen, e: &FooterEntryRef<'_>, loc: Loc) -> Check {
    use crate::format::record::{KIND_DELETE_SESSION, KIND_REWARD, KIND_SEAL};
    if c.last_listed().is_none_or(|last| loc.segment >= last) {
        return Check::Apply;
    }
    let conflict = match (e.kind, e.reward_target) {
        // A session-moved record changes no call: it commutes like a seal.
        (KIND_SEAL, _) | (crate::format::record::KIND_MOVE_SESSION, _) => false,
        (KIND_CALL, _) | (KIND_REWARD, 1) => trace_conflicts(c, frozen, loc, e.id),
        (KIND_REWARD, 2) => match frozen.session(e.id) {
            Some(s) if c.reward_superseded(s, loc) => return Check::Skip,
            Some(s) => c.conflicts(s, loc),
            None => false,
        },
        (KIND_DELETE_SESSION, _) => frozen.session(e.id).is_some_and(|s| c.conflicts(s, loc)),
        _ => true,
    };
    if conflict {
        Check::Conflict
    } else {
        Check::Apply
    }
}

impl RowFeed {
    /// The survey's view of the rows left (cold.rs): each one's trace id
    /// hash and session name hashes.
    fn row_hashes(&self) -> impl Iterator<Item = (u64, Vec<u64>)> + '_ {
        use crate::index::frozen::id_hash;
        self.rows.iter().map(|(r, _)| (id_hash(&r.trace_id), r.sessions.iter().map(|s| id_hash(s)).collect()))
    }

    /// Apply, in log order, the rows at positions `upto` accepts (a prefix
    /// of the rows left); whether any was applied.
    fn apply(&mut self, index: &mut Index, upto: impl Fn(Loc) -> bool) -> bool {
        let mut any = false;
        loop {
            for (session, before) in index.take_thaws() {
                let frozen = index.frozen();
                let Some(first) = frozen.first_row(session) else { continue };
                for (i, r) in frozen.session_rows(session).iter().enumerate() {
                    if r.loc() >= before {
                        self.thawed.push(std::cmp::Reverse((r.loc(), first + i as u32)));
                    }
                }
            }
            let next_row = self.rows.front().map(|(r, _)| r.loc);
            let next_thawed = self.thawed.peek().map(|std::cmp::Reverse((loc, _))| *loc);
            match (next_row, next_thawed) {
                (Some(a), b) if b.is_none_or(|b| a <= b) && upto(a) => {
                    if let (Some(c), Some((row, _))) = (&self.guard, self.rows.front()) {
                        if trace_conflicts(c, index.frozen(), row.loc, &row.trace_id) {
                            self.conflict = true;
                            return any;
                        }
                    }
                    if let Some((row, frozen)) = self.rows.pop_front() {
                        apply_shard_row(index, &row, frozen);
                    }
                }
                (_, Some(b)) if upto(b) => {
                    if let Some(std::cmp::Reverse((_, i))) = self.thawed.pop() {
                        let frozen = index.frozen();
                        let Some(r) = frozen.row(i) else { continue };
                        let (trace, name) = (Arc::from(frozen.trace_id(r)), frozen.session_name(r.session).to_owned());
                        let meta = CallMeta {
                            loc: r.loc(),
                            timestamp: r.timestamp,
                            sessions: index.sessions_of::<&str>(&name, &[]),
                        };
                        index.apply_call(trace, meta);
                    }
                }
                _ => return any,
            }
            any = true;
        }
    }

    /// Whether the call at `loc` was compacted into a row this feed does not
    /// give (a frozen row, when the rows came from a shard index file).
    fn is_compacted(&mut self, shards: &crate::shard::set::ShardSet, loc: Loc) -> bool {
        if !self.mapped {
            return false;
        }
        match &mut self.ordered {
            Some((placements, at)) => {
                // A gallop from where the last call was found: the next one
                // is usually a few rows on, but the first call of a
                // replayed segment can be millions on (every row compacted
                // from segments retired since), whose pages a walk row by
                // row would read: 0.3 GB at 10M rows, at the peak of a
                // batched compaction. The pages passed (32 bytes a row)
                // are given back every 1M rows; a block that does not
                // check leaves the walk where it was (the call is then
                // replayed from its record).
                placements.walk_to(at, |p| p.loc() < loc).is_some_and(|p| p.loc() == loc)
            }
            None => match &mut self.walk {
                Some((last, at)) if *last <= loc => {
                    *last = loc;
                    shards.is_compacted_from(at, loc)
                }
                // Out of order (never in an open's replay): a search.
                Some(_) => shards.is_compacted(loc),
                None => {
                    let mut at = 0;
                    let found = shards.is_compacted_from(&mut at, loc);
                    self.walk = Some((loc, at));
                    found
                }
            },
        }
    }

    /// Replay the records of segment `seg` (its footer entries, in log
    /// order) with the shard rows at their positions among them.
    #[allow(clippy::too_many_arguments)]
    fn replay_segment<'e>(
        &mut self,
        index: &mut Index,
        shards: &crate::shard::set::ShardSet,
        seg: &SegmentRef,
        entries: impl IntoIterator<Item = FooterEntryRef<'e>>,
        damage: &mut Vec<Problem>,
        rewards: &mut Vec<(Loc, Target)>,
        keep: &dyn Fn(Loc) -> bool,
        mut cold: Option<&mut super::cold::ColdPlan<'e>>,
    ) {
        // Each seal, reward or call of a frozen session is a lookup in the
        // index file's hash tables: a segment of the 1.25M carried seals of
        // a 10M-call store reads pages all over them, given back as the
        // replay goes (at most a reading of /proc/self/statm per 1,024
        // entries otherwise).
        let mut budget = crate::storage::mmap::PageBudget::compaction();
        for e in entries {
            budget.tick(|| {
                seg.release_pages();
                index.frozen().release_pages();
            });
            let loc = Loc { segment: seg.id, offset: e.frame_offset };
            self.apply(index, |at| at < loc);
            // A compacted call: its shard row stands for its record.
            if self.apply(index, |at| at == loc) || (e.kind == KIND_CALL && self.is_compacted(shards, loc)) {
                continue;
            }
            if self.conflict {
                return;
            }
            // A cold session's record (cold.rs): the layer takes it.
            if cold.as_deref_mut().is_some_and(|c| c.take(&e, loc, keep(loc))) {
                continue;
            }
            match self.guard.as_ref().map(|c| check_entry(c, index.frozen(), &e, loc)) {
                Some(Check::Conflict) => {
                    self.conflict = true;
                    return;
                }
                Some(Check::Skip) => continue,
                Some(Check::Apply) | None => {
                    apply_entry(index, seg, &e, damage, rewards, keep, cold.as_deref().map(|c| &c.hits))
                }
            }
        }
    }
}

/// The hashes of every name (trace id, session name, session uid) the
/// records of `segments` and the shard rows `rows` (trace id hash, session
/// hashes) name, for [`Index::narrow_cold_lookups`]; `None` when a record
/// names what its footer entry does not say (a reward in a footer older
/// than segment format 4: its target is in its body).
pub(super) fn names_of<'e>(
    segments: impl IntoIterator<Item = Box<dyn Iterator<Item = FooterEntryRef<'e>> + 'e>>,
    rows: impl IntoIterator<Item = (u64, Vec<u64>)>,
) -> Option<Vec<u64>> {
    use crate::index::frozen::id_hash;
    let mut named = Vec::new();
    for e in segments.into_iter().flatten() {
        if e.kind == crate::format::record::KIND_REWARD && !matches!(e.reward_target, 1 | 2) {
            return None;
        }
        named.push(id_hash(e.id));
        if !e.session_id.is_empty() {
            named.push(id_hash(e.session_id));
        }
        named.extend(e.session_uids.iter().map(id_hash));
    }
    for (trace, sessions) in rows {
        named.push(trace);
        named.extend(sessions);
    }
    Some(named)
}

/// An index replayed as an open of the store would build it, over the
/// shard index file `ix` that a publication has just written for every
/// `steps` file of `shards` (its frozen layer mapped, the rows it keeps
/// hot replayed at their positions), through the records of `segments`
/// (each with its footer entries, in log order; the sealed ones surveyed
/// first for the cold layer, [`Rebuilt::extend_base`]); then
/// [`Rebuilt::extend_after`] replays later records. A writer whose compacted
/// calls stay in its maps until it reopens (~0.4 KB a call) takes it
/// instead of its own index after a publication (store/publish.rs): a
/// long-lived writer's memory then does not grow with what it compacted.
pub(super) struct Rebuilt {
    index: Index,
    feed: RowFeed,
    shards: crate::snapshot::ShardSlots,
}

impl Rebuilt {
    /// `None` unless `shards` reads every row from its index file.
    pub(super) fn new(shards: &crate::snapshot::ShardSlots) -> Option<Rebuilt> {
        let ix = shards.index_file()?;
        if shards.undescribed_rows() > 0 {
            return None;
        }
        let mut index = Index::with_frozen(ix.frozen());
        index.record_thaws(true);
        let mut rows: Vec<ShardRow> = ix.hot_rows().to_vec();
        rows.sort_by_key(|r| r.loc);
        // Every placement is of a file of `shards` (the file was written
        // for them), and the replay goes forward in log order.
        let ordered = Some((ix.placements(), 0));
        let feed = RowFeed {
            rows: rows.into_iter().map(|r| (r, None)).collect(),
            mapped: true,
            ordered,
            ..RowFeed::default()
        };
        Some(Rebuilt { index, feed, shards: shards.clone() })
    }

    /// An index loaded without shards (store/backlog_refresh.rs: one whose
    /// cold layer is mapped from the backlog index file), to replay the
    /// records written since its last segment onto.
    pub(super) fn of_index(index: Index, shards: &crate::snapshot::ShardSlots) -> Rebuilt {
        Rebuilt { index, feed: RowFeed::default(), shards: shards.clone() }
    }

    /// Replay the records written after those replayed so far: sealed
    /// segments `sealed`, each read again from disk, then the active
    /// segment's `active` entries. `false` (nothing replayed) when a
    /// sealed one does not read cleanly (damage an open confined, a footer
    /// it rebuilt): the caller then keeps its own index. The cold layer is
    /// looked up only for what these records name
    /// ([`Index::narrow_cold_lookups`], as an open through the backlog
    /// index file does).
    pub(super) fn extend_after<'s>(
        &mut self,
        dir: &Path,
        sealed: impl IntoIterator<Item = &'s SegmentRef>,
        active: Option<(&SegmentRef, &[FooterEntry])>,
    ) -> bool {
        let mut loaded = Vec::new();
        for seg in sealed {
            match load_clean(dir, seg) {
                Some(l) => loaded.push((seg, l)),
                None => return false,
            }
        }
        let active_refs = || {
            active.into_iter().map(|(_, e)| -> Box<dyn Iterator<Item = FooterEntryRef<'_>> + '_> {
                Box::new(e.iter().map(FooterEntry::as_ref))
            })
        };
        let segments = loaded.iter().map(|(_, l)| l.entry_refs()).chain(active_refs());
        if let Some(named) = names_of(segments, self.feed.row_hashes()) {
            self.index.narrow_cold_lookups(named);
        }
        // Read again one at a time by the replay.
        for (_, l) in &loaded {
            l.map.release_pages();
        }
        for (seg, l) in &loaded {
            self.extend_refs(seg, l.entry_refs(), None);
            l.map.release_pages();
        }
        if let Some((seg, entries)) = active {
            self.extend_refs(seg, entries.iter().map(FooterEntry::as_ref), None);
        }
        self.index.widen_cold_lookups();
        true
    }

    /// Replay the sealed segments `segs` (the first records replayed, in
    /// log order), surveyed first as an open surveys the whole log
    /// (cold.rs): the calls of sessions no other record among them names
    /// go to the cold layer instead of the maps. Records replayed later
    /// ([`Rebuilt::extend_after`]) that name a cold session thaw it, as a
    /// read-only refresh does. `false` as [`Rebuilt::extend_after`].
    pub(super) fn extend_base<'s>(&mut self, dir: &Path, segs: impl IntoIterator<Item = &'s SegmentRef>) -> bool {
        let mut loaded = Vec::new();
        for seg in segs {
            match load_clean(dir, seg) {
                Some(l) => {
                    // Read again one at a time by the survey and the replay.
                    l.map.release_pages();
                    loaded.push((seg, l));
                }
                None => return false,
            }
        }
        let surveyed = loaded.iter().map(|(_, l)| (l.id, true, l.entry_refs()));
        let mut release = |id: u64| release_footer(&loaded, id, |(_, l)| l);
        let mut cold =
            super::cold::ColdPlan::survey(surveyed, &self.index, self.feed.row_hashes(), &|_| false, &mut release);
        for (seg, l) in &loaded {
            self.extend_refs(seg, l.entry_refs(), cold.as_mut());
            l.map.release_pages();
        }
        if let Some(cold) = cold {
            // As an open does before it builds the layer.
            self.index.frozen().release_pages();
            cold.finish(&mut self.index);
        }
        true
    }

    fn extend_refs<'e>(
        &mut self,
        seg: &SegmentRef,
        entries: impl IntoIterator<Item = FooterEntryRef<'e>>,
        cold: Option<&mut super::cold::ColdPlan<'e>>,
    ) {
        let (mut damage, mut rewards) = (Vec::new(), Vec::new());
        // Damage was found and reported by the open that first replayed
        // these records; the rewards side table is the writer's own.
        self.feed.replay_segment(
            &mut self.index,
            &self.shards,
            seg,
            entries,
            &mut damage,
            &mut rewards,
            &|_| false,
            cold,
        );
    }

    /// The index, once every record was replayed.
    pub(super) fn finish(mut self) -> Index {
        self.feed.apply(&mut self.index, |_| true);
        self.index.record_thaws(false);
        self.index
    }
}

/// Give back the mapped pages of segment `id` of `loaded` (`seg` reaches
/// each one's segment) once the survey read its footer (read in place; one
/// decoded into `entries` has none to give back that matter).
fn release_footer<T>(loaded: &[T], id: u64, seg: impl Fn(&T) -> &LoadedSegment) {
    // In log order (the manifest's), so in id order.
    if let Some(s) = loaded.binary_search_by_key(&id, |t| seg(t).id).ok().and_then(|i| loaded.get(i)).map(&seg) {
        if s.in_footer.is_some() {
            s.map.release_pages();
        }
    }
}

/// Sealed segment `seg` loaded again from disk, its footer read in place;
/// `None` unless it reads cleanly (no damage an open confined, no footer
/// it rebuilt).
fn load_clean(dir: &Path, seg: &SegmentRef) -> Option<LoadedSegment> {
    crate::segment::recovery::load_segment_in_place(dir, seg.id, true, OnDamage::Refuse)
        .ok()
        .filter(|l| l.events.is_empty() && l.applied_from_footer.is_empty())
}

/// [`RecoveryMode::SkipCorrupted`], writable: an active segment whose damaged
/// regions were skipped is sealed now, its torn tail (if any) cut first: its
/// footer indexes the valid frames and leaves the damaged bytes out, in place
/// (format-spec/segment.md §4, §6). The manifest, updated by the caller with
/// the next active segment, then lists it as sealed; until then a crash
/// leaves a sealed segment listed as active, which the next open fixes.
pub(super) fn seal_skipped_active(loaded: &mut Loaded, options: &Options) -> Result<()> {
    if !loaded.active_skipped {
        return Ok(());
    }
    let Some((id, path, valid_end, entries)) = loaded.active.take() else { return Ok(()) };
    loaded.segments.remove(&id); // drop its mapping before the file changes length
    let segment = ActiveSegment::reopen(path, id, valid_end, valid_end, entries, options.faults.clone())?;
    let sealed = segment.seal()?;
    loaded.segments.insert(id, SegmentRef::new(id, sealed.path, sealed.map, sealed.data_end, true));
    for ms in &mut loaded.manifest.segments {
        if ms.id == id {
            ms.state = SegmentState::Sealed;
        }
    }
    loaded.active_skipped = false;
    Ok(())
}

/// [`RecoveryMode::AbsoluteConsistency`]: refuse unless `trajlog verify` finds
/// the store intact (and, for a writable open, without a torn tail). Reads
/// every byte; writes nothing.
pub(super) fn check_absolute(dir: &Path, writable: bool) -> Result<()> {
    let found = crate::verify::verify_dir(dir)?;
    let refuse = |p: &Problem, what: String| {
        let message = format!(
            "recovery mode absolute refused the open (nothing was changed): {} at offset {}: {what}; `trajlog verify` lists every problem",
            p.path.display(),
            p.offset
        );
        Error::new(ErrorKind::Corrupt { path: p.path.clone(), offset: p.offset }, message)
    };
    if let Some(p) = found.problems.first() {
        let later = later_valid_frames(&p.path, p.offset);
        let later =
            if later > 0 { format!("; {later} valid records follow it in this segment") } else { String::new() };
        let n = found.problems.len();
        return Err(refuse(
            p,
            format!(
                "{}{later} ({n} problems in all). To open anyway, copy the store aside and use recovery mode skip-corrupted (or the default, tolerate-torn-tail, which cuts a torn tail and refuses damage in the log)",
                p.what
            ),
        ));
    }
    if let Some(t) = found.torn_tail.as_ref().filter(|_| writable) {
        return Err(refuse(
            t,
            format!(
                "torn tail: {}. Absolute consistency refuses a torn tail too; the default recovery mode (tolerate-torn-tail) cuts it",
                t.what
            ),
        ));
    }
    Ok(())
}

/// How many valid frames follow `offset` in the segment file at `path` (0 if
/// it is not a readable segment).
fn later_valid_frames(path: &Path, offset: u64) -> usize {
    let Ok(bytes) = fs::read(path) else { return 0 };
    let frames = match crate::format::segment::read_trailer(&bytes) {
        Some(t) => bytes.get(..t.footer_offset as usize).unwrap_or(&bytes),
        None => &bytes,
    };
    // `fs::read` gives no alignment guarantee: scan an 8-aligned copy.
    let mut words = vec![0u64; frames.len().div_ceil(8)];
    let aligned: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
    let Some(aligned) = aligned.get_mut(..frames.len()) else { return 0 };
    aligned.copy_from_slice(frames);
    let scan = crate::segment::recovery::scan_frames_past_damage(aligned);
    scan.entries.iter().filter(|e| e.frame_offset > offset).count()
}

/// Finish a shard publication that was decided (listed as pending in the
/// manifest) but maybe not completed: rename what is still staged, then list
/// the shards as published.
pub(super) fn finish_pending(
    dir: &Path,
    manifest: &mut Manifest,
    faults: &crate::storage::fault::Faults,
) -> Result<()> {
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

/// Delete the shard files a collection took out of the published set
/// (the manifest's obsolete list) that still exist, then clear the list.
/// Only a writer does this: readers never read an obsolete file.
pub(super) fn finish_obsolete(
    dir: &Path,
    manifest: &mut Manifest,
    faults: &crate::storage::fault::Faults,
) -> Result<()> {
    if manifest.obsolete.is_empty() {
        return Ok(());
    }
    let shards = dir.join(SHARDS_DIR);
    for o in &manifest.obsolete {
        let path = shards.join(o);
        remove_if_present(&path).map_err(|e| Error::io(format!("delete obsolete shard {}", path.display()), e))?;
    }
    sync_shard_dirs(&shards, faults)?;
    manifest.obsolete.clear();
    crate::storage::write_atomic(dir, MANIFEST_NAME, &encode_manifest(manifest), faults)
}

/// Delete a file; one already gone is not an error.
pub(super) fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// fsync the shard table directories that exist under `shards`.
pub(super) fn sync_shard_dirs(shards: &Path, faults: &crate::storage::fault::Faults) -> Result<()> {
    for table in SHARD_TABLES {
        let tdir = shards.join(table);
        if tdir.exists() {
            crate::storage::sync_dir(&tdir, faults)?;
        }
    }
    Ok(())
}

/// Take the single-writer lock of a store directory (its `LOCK` file).
pub(crate) fn lock_dir(dir: &Path) -> Result<crate::storage::lock::HeldLock> {
    let lock_path = dir.join(LOCK_NAME);
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| Error::io(format!("open {}", lock_path.display()), e))?;
    match lock_file.try_lock() {
        Ok(()) => Ok(crate::storage::lock::HeldLock::new(lock_file)),
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
///
/// Loaded read-only as recovery mode skip-corrupted would (every frame
/// checked, damage skipped and listed): repair rebuilds the manifest, and
/// each later open decides about the damage by its own mode.
pub(crate) fn load_for_repair(dir: &Path, manifest: Manifest) -> Result<(usize, Vec<Problem>)> {
    let loaded = load_dir(dir, manifest, RecoveryMode::SkipCorrupted, false, &|_| false, false)?;
    Ok((loaded.index.call_count(), loaded.damage))
}

/// A read-only load in `recovery` mode: nothing is written; a torn tail is
/// left out of the view (and not reported: it may be a write in progress).
/// Also returns the manifest the view reflects (for [`super::refresh`]).
/// With `lazy`, the shard index file's tables are checked a block at a time
/// as lookups read them ([`load_dir`]); without, whole (a view whose
/// lookups met a damaged block is loaded again so: the file is then done
/// without).
pub(super) fn load_read_only(
    dir: &Path,
    recovery: RecoveryMode,
    lazy: bool,
) -> Result<(View, RecoveryReport, Manifest)> {
    // The writer may replace the manifest (and, later, retire segments) while we
    // read; retry a few times on a vanished file.
    let mut last_err = None;
    for _ in 0..5 {
        let manifest = match read_manifest(dir)? {
            Some(m) => m,
            None => {
                let inv = crate::inventory::inventory(dir).unwrap_or_default();
                if inv.holds_data().unwrap_or(true) {
                    return Err(crate::inventory::no_manifest_error(dir, &inv));
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
        if recovery == RecoveryMode::AbsoluteConsistency {
            check_absolute(dir, false)?;
        }
        match load_dir(dir, manifest, recovery, false, &|_| false, lazy) {
            Ok(loaded) => {
                let view = View {
                    index: loaded.index,
                    segments: loaded.segments,
                    shards: Arc::new(loaded.shards),
                    damage: Arc::new(loaded.damage),
                };
                return Ok((view, loaded.report, loaded.manifest));
            }
            Err(e) if e.kind() == &ErrorKind::NotFound => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| Error::new(ErrorKind::Io, "store changed too often while opening")))
}
