//! Retiring segments nothing needs any more (format-spec/shard.md §6), in
//! the writer thread, as the last step of a publication.

use super::*;

/// How many segments of current annotations only are kept per size tier
/// before they are retired together (see [`Writer::retire`]).
const ANNOTATION_SEGMENTS_FANOUT: u32 = 8;

/// The annotation a footer entry stands for: from the entry itself (seals,
/// and rewards since segment format 4), else from its record body; None
/// when the body is damaged.
fn annotation_at(seg: &SegmentRef, e: &crate::format::segment::FooterEntryRef<'_>) -> Option<Annotation> {
    crate::segment::recovery::annotation_of_entry_ref(e)
        .or_else(|| seg.body_at(e.frame_offset).ok().and_then(|b| decode_annotation(b).ok()))
}

/// Whether a footer entry stands for an annotation a retirement carries
/// forward (a seal or a reward): not a call, a session deletion or a
/// session-moved record.
fn carried_kind(kind: u8) -> bool {
    kind != KIND_CALL && kind != KIND_DELETE_SESSION && kind != crate::format::record::KIND_MOVE_SESSION
}

/// The footer of sealed segment `seg`, checked, its entries read in place
/// (a segment of carried annotations holds millions: decoded into owned
/// entries, ~0.2 GB at 10M calls); `None` when it does not read.
fn footer_of(seg: &SegmentRef) -> Option<crate::format::segment::CheckedFooter<'_>> {
    let trailer = crate::format::segment::read_trailer(seg.mapped_bytes())?;
    crate::format::segment::check_footer(seg.mapped_bytes(), &trailer).ok()
}

/// The annotations a retirement of `seg` carries forward, from its footer
/// (every entry of a carried kind read: `None` otherwise).
fn carried_annotations(seg: &SegmentRef) -> Option<Vec<Annotation>> {
    footer_of(seg)?.iter().filter(|e| carried_kind(e.kind)).map(|e| annotation_at(seg, &e)).collect()
}

/// Gives a segment's resident pages back when dropped.
struct ReleaseOnDrop<'a>(&'a SegmentRef);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.release_pages();
    }
}

/// What [`Writer::retire`] will do: retire these segments, carrying these
/// annotations; first copy these sessions forward (then plan again).
struct Plan {
    retire: Vec<u64>,
    annotations: Vec<Annotation>,
    moves: Vec<String>,
    /// The segments of current annotations only it keeps: id, annotation
    /// count, their targets' id hashes (`None`: as the earlier verdict).
    verdicts: Vec<(u64, u64, Option<Vec<u64>>)>,
}

/// Bytes of copies a publication's copy-forward writes at most (shard.md
/// §6.3): a quarter segment, since the writer thread copies and appends
/// wait meanwhile.
fn copy_budget(segment_bytes: u64) -> u64 {
    segment_bytes / 4
}

/// What the copy-forward collector copied (shard.md §6.3).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CopiedForward {
    pub sessions: u64,
    pub calls: u64,
    /// Bytes the copies take in segments.
    pub bytes: u64,
}

/// Retirement's verdicts on the sealed segments of current annotations
/// only (see [`Writer::plan_retirement`]), kept from one plan to the next
/// while none of their targets changes: judging one reads every seal and
/// reward it holds (1.25M sessions at 10M calls: ~0.5 s of the writer
/// thread, appends waiting, at every compaction).
#[derive(Debug, Default)]
pub(crate) struct AnnotationVerdicts {
    /// Segment id → its annotation count and the id hashes of their
    /// targets (sessions, trace ids), sorted.
    segments: std::collections::HashMap<u64, (u64, Vec<u64>)>,
    /// Id hashes of the sessions and trace ids whose calls, seal or reward
    /// the writer changed since the verdicts were made (or since the
    /// compaction under way began, [`AnnotationVerdicts::begin`]).
    touched: HashSet<u64>,
    /// Note changes even with no verdict kept: a compaction began whose
    /// thread judges the segments ([`prejudge`]).
    recording: bool,
    /// Counts the plans made and the voids: verdicts judged off this thread
    /// at one epoch are adopted at that epoch only (`touched` then holds
    /// every change since they were judged).
    epoch: u64,
}

/// Verdicts on the sealed segments of a compaction's base view, judged by
/// the compacting thread ([`prejudge`]) against that view's index, for the
/// writer's first plan after an open (it keeps none yet, and judging
/// 1.25M carried seals and rewards there held appends ~0.5 s).
pub(crate) struct Prejudged {
    epoch: u64,
    /// Segment id, annotation count, target id hashes (sorted, distinct).
    found: Vec<(u64, u64, Vec<u64>)>,
}

impl AnnotationVerdicts {
    /// Note that `id`'s calls, seal or reward changed (nothing to note
    /// while there is no verdict).
    pub(super) fn touch(&mut self, id: &str) {
        if self.recording || !self.segments.is_empty() {
            self.touched.insert(crate::index::frozen::id_hash(id));
        }
    }

    /// Forget every verdict: a change the hashes do not name (a session
    /// deletion also takes the rewards of its calls' trace ids).
    pub(super) fn void(&mut self) {
        self.segments.clear();
        self.touched.clear();
        self.epoch += 1;
    }

    /// A compaction begins (its base view is the writer's index as it is
    /// now): the epoch at which its thread is to judge the sealed segments,
    /// when no verdict is kept (the first compaction after an open, or
    /// after a void), with every change from here on noted.
    pub(super) fn begin(&mut self) -> Option<u64> {
        if !self.segments.is_empty() {
            return None;
        }
        self.recording = true;
        Some(self.epoch)
    }

    /// The compaction under way ended without publishing: with no verdict
    /// kept, changes are no longer noted (a writer whose compactions find
    /// nothing to publish would note every id it writes).
    pub(super) fn end(&mut self) {
        if self.segments.is_empty() {
            self.recording = false;
            self.touched.clear();
            self.epoch += 1;
        }
    }

    /// Take the verdicts `pre` judged off this thread, unless a plan or a
    /// void came between (then `touched` may lack a change since); a
    /// verdict kept here stays as it is. Returns how many it took.
    pub(super) fn adopt(&mut self, pre: Prejudged) -> u64 {
        if pre.epoch != self.epoch {
            return 0;
        }
        let mut taken = 0;
        for (id, count, targets) in pre.found {
            if let std::collections::hash_map::Entry::Vacant(e) = self.segments.entry(id) {
                e.insert((count, targets));
                taken += 1;
            }
        }
        taken
    }

    /// Segment `id`'s annotation count, when an earlier plan found it of
    /// current annotations only and none of their targets changed since.
    fn still_current(&self, id: u64) -> Option<u64> {
        let (count, targets) = self.segments.get(&id)?;
        let changed = if self.touched.len() < targets.len() {
            self.touched.iter().any(|h| targets.binary_search(h).is_ok())
        } else {
            targets.iter().any(|h| self.touched.contains(h))
        };
        (!changed).then_some(*count)
    }

    /// The verdicts of the plan just made (`None`: the earlier verdict,
    /// still current), made now.
    fn replace(&mut self, found: Vec<(u64, u64, Option<Vec<u64>>)>) {
        let mut old = std::mem::take(&mut self.segments);
        for (id, count, targets) in found {
            let targets = match targets {
                Some(mut t) => {
                    t.sort_unstable();
                    t.dedup();
                    t
                }
                None => match old.remove(&id) {
                    Some((_, t)) => t,
                    None => continue,
                },
            };
            self.segments.insert(id, (count, targets));
        }
        self.touched.clear();
        self.recording = false;
        self.epoch += 1;
    }
}

/// [`Prejudged`] verdicts on the sealed segments of `view` (a compaction's
/// base view, taken at `epoch` of [`AnnotationVerdicts::begin`]): those
/// of current annotations only, judged against `view`'s index as
/// [`Writer::plan_retirement`] judges them. Reads every sealed segment's
/// footer, giving its pages back after each.
pub(crate) fn prejudge(view: &crate::snapshot::View, epoch: u64) -> Prejudged {
    let release_index = || {
        if let Some(ix) = view.shards.index_file() {
            ix.release_pages();
        }
        view.index.frozen().release_pages();
    };
    let mut budget = crate::storage::mmap::PageBudget::compaction();
    let mut found = Vec::new();
    for (id, seg) in view.segments.iter().filter(|(_, s)| s.sealed) {
        let _release = ReleaseOnDrop(seg);
        if let Some((count, targets)) = annotation_only(&view.index, seg, &mut || budget.tick(release_index)) {
            found.push((*id, count, targets));
        }
    }
    Prejudged { epoch, found }
}

/// When sealed segment `seg` holds current annotations only (seals,
/// rewards; current by `index`): their count and their targets' id hashes,
/// sorted and distinct. `tick` runs once per entry read.
fn annotation_only(index: &Index, seg: &SegmentRef, tick: &mut dyn FnMut()) -> Option<(u64, Vec<u64>)> {
    let footer = footer_of(seg)?;
    let mut targets = Vec::new();
    for e in footer.iter() {
        tick();
        if !carried_kind(e.kind) {
            return None;
        }
        let ann = annotation_at(seg, &e)?;
        if !is_current(index, &ann) {
            return None;
        }
        targets.push(target_hash(&ann));
    }
    let count = targets.len() as u64;
    targets.sort_unstable();
    targets.dedup();
    // Kept until the publication (every such segment's at 10M calls: ~18
    // MB), so not with the slack of its growth.
    targets.shrink_to_fit();
    (count > 0).then_some((count, targets))
}

/// The annotation that states the current value (by `index`) of `ann`'s
/// target (a seal of a session still sealed, the reward in force), or None
/// when nothing is set for it any more.
fn current(index: &Index, ann: &Annotation) -> Option<Annotation> {
    match ann {
        Annotation::Seal { session_id } => index.is_sealed(session_id.as_str()).then(|| ann.clone()),
        Annotation::Reward { target: Target::Session(s), .. } => index
            .session_reward(s.as_str())
            .map(|value| Annotation::Reward { target: Target::Session(s.clone()), value }),
        Annotation::Reward { target: Target::Trace(t), .. } => {
            index.trace_reward(t.as_str()).map(|value| Annotation::Reward { target: Target::Trace(t.clone()), value })
        }
        Annotation::DeleteSession { .. } | Annotation::MoveSession { .. } => None,
    }
}

/// Whether replaying `ann` leaves a store whose index is `index` as it is:
/// it states its target's current value (a reward bit for bit).
fn is_current(index: &Index, ann: &Annotation) -> bool {
    match (current(index, ann), ann) {
        (Some(Annotation::Reward { value: now, .. }), Annotation::Reward { value, .. }) => {
            now.to_bits() == value.to_bits()
        }
        (Some(Annotation::Seal { .. }), Annotation::Seal { .. }) => true,
        _ => false,
    }
}

/// The id hash of what annotation `ann` sets.
fn target_hash(ann: &Annotation) -> u64 {
    let id = match ann {
        Annotation::Seal { session_id }
        | Annotation::DeleteSession { session_id }
        | Annotation::MoveSession { session_id }
        | Annotation::Reward { target: Target::Session(session_id), .. } => session_id.as_str(),
        Annotation::Reward { target: Target::Trace(t), .. } => t.as_str(),
    };
    crate::index::frozen::id_hash(id)
}

impl Writer {
    /// The annotation that states the current value of `ann`'s target
    /// ([`current`] by this writer's index).
    fn current(&self, ann: &Annotation) -> Option<Annotation> {
        current(&self.index, ann)
    }

    /// Whether replaying `ann` leaves the store as it is now ([`is_current`]).
    fn is_current(&self, ann: &Annotation) -> bool {
        is_current(&self.index, ann)
    }

    /// Retire every sealed segment whose every record is no longer needed
    /// (format-spec/shard.md §6): each call record belongs to a session with
    /// no live call left in segments (so it is compacted, dead, and no live
    /// call can use it as a prefix-delta parent) or lies before the
    /// session's floor (§6.3), no dead call record keeps
    /// a shard row dead, and no session deletion in it concerns compacted
    /// rows. A segment kept for these reasons does not keep the later ones:
    /// they retire too unless one of their records could bring back a
    /// record of the kept ones: a deletion whose session has a call, a seal
    /// or a reward in a kept segment before it, or a dead call record whose
    /// trace id has a call record there. So a straggler session — never
    /// finished, never compacted — keeps only the segments that hold its
    /// records, and with `copy_forward` (shard.md §6.3) not even those: a
    /// segment kept only by such sessions, whose live calls in segments are
    /// at most that fraction of its bytes, has those sessions copied
    /// forward first (their live calls appended again after a
    /// session-moved record), which frees it. Rewards and seals of retired
    /// segments are re-appended with their current values first, so that
    /// they outlive their segment.
    ///
    /// `in_segments` counts the live calls still served from segments by
    /// primary session (prepared off this thread, see publish.rs). The work
    /// here is one footer per sealed segment (twice when sessions are
    /// copied forward), and the copies.
    pub(super) fn retire(
        &mut self,
        in_segments: &std::collections::HashMap<Arc<str>, u64>,
        copy_forward: Option<f64>,
    ) -> Result<(Vec<u64>, CopiedForward)> {
        let mut plan = self.plan_retirement(in_segments, copy_forward)?;
        let mut copied = CopiedForward::default();
        if !plan.moves.is_empty() {
            copied = self.copy_forward(&plan.moves)?;
            if copied.sessions > 0 {
                plan = self.plan_retirement(in_segments, None)?;
            }
        }
        // Made now: what changes from here on (the annotations carried
        // below too) is noted against them.
        self.annotation_verdicts.replace(std::mem::take(&mut plan.verdicts));
        let retired = self.retire_planned(plan)?;
        // A backlog index file that lists a retired segment is stale (no
        // open uses it): its space is given back now, not at the next
        // writable open.
        super::backlog_file::remove_if_listing(&self.dir, &retired, &self.options.faults);
        Ok((retired, copied))
    }

    /// The position below which no record of `session` is needed as a
    /// prefix-delta parent (shard.md §6.3): its last session-moved record,
    /// when every live call of the session still in segments comes after
    /// it (else a move was cut short, and nothing of it is freed).
    fn effective_floor(&self, session: &str) -> Option<Loc> {
        let floor = self.index.session_floor(session)?;
        let calls = self.index.session_calls(session);
        calls
            .iter()
            .all(|k| k.loc > floor || self.shards.is_compacted(k.loc) || !self.index.is_live_at(&k.trace_id, k.loc))
            .then_some(floor)
    }

    /// Whether copying `session` forward can free its records: it is not
    /// sealed (a sealed one is compacted by the next compaction) and every
    /// live call in segments of its list has it as primary session (a call
    /// of another session, listing it among its uids, is not copied, and
    /// would keep the copied session's floor from taking effect).
    fn movable(&self, session: &str) -> bool {
        if self.index.is_sealed(session) {
            return false;
        }
        let calls = self.index.session_calls(session);
        calls.iter().all(|k| {
            self.shards.is_compacted(k.loc)
                || match self.index.live(&k.trace_id) {
                    Some(crate::index::LiveCall::Hot(m)) if m.loc == k.loc => {
                        m.sessions.first().is_some_and(|p| &**p == session)
                    }
                    _ => true,
                }
        })
    }

    /// Give back the resident pages of the shard index file and of the
    /// frozen layer's (an older file's, until the index is rebuilt).
    pub(super) fn release_index_pages(&self) {
        if let Some(ix) = self.shards.index_file() {
            ix.release_pages();
        }
        self.index.frozen().release_pages();
        // The cold layer's, when it is mapped from the backlog index file
        // (a retirement's lookups of 1M calls on a 10M backlog touched
        // ~0.8 GB of it).
        self.index.cold().release_pages();
    }

    /// Decide what [`Writer::retire`] retires and, with `copy_forward`,
    /// which sessions to copy forward first.
    fn plan_retirement(
        &self,
        in_segments: &std::collections::HashMap<Arc<str>, u64>,
        copy_forward: Option<f64>,
    ) -> Result<Plan> {
        let in_segments = |session: &str| in_segments.get(session).is_some_and(|n| *n > 0);
        let mut floors: std::collections::HashMap<String, Option<Loc>> = Default::default();
        let mut below_floor = |w: &Self, session: &str, loc: Loc| -> bool {
            if !floors.contains_key(session) {
                floors.insert(session.to_owned(), w.effective_floor(session));
            }
            floors.get(session).copied().flatten().is_some_and(|f| loc < f)
        };
        let mut retire = Vec::new();
        let mut annotations = Vec::new();
        // Each call's liveness and row counts are binary searches of the
        // index files: a walk of 1M calls in segments would keep most of a
        // 10M-call store's file resident.
        let mut budget = crate::storage::mmap::PageBudget::compaction();
        // Copy-forward candidates: sealed segments kept only by sessions
        // with live calls in segments (their id, frame bytes, those
        // sessions).
        let mut candidates: Vec<(u64, u64, Vec<String>)> = Vec::new();
        // The sessions the kept segments walked so far name (their call
        // records, seals and session rewards): a deletion after them that is
        // retired must not uncover any of it.
        let mut kept_sessions: HashSet<String> = HashSet::new();
        // The trace ids of the call records of the kept segments walked so
        // far: a dead call record after one of them must stay, or the
        // replay would find the earlier record live again (a call replaced
        // by one of another session, that session deleted since).
        // (Their id hashes: two ids of one hash only keep a segment more.)
        let mut kept_traces: HashSet<u64> = HashSet::new();
        // Sealed segments that hold only current annotations (most often the
        // seals and rewards an earlier retirement carried forward): retiring
        // one would only write its records again, so each compaction would
        // rewrite every seal of the store. They are kept, and retired together
        // once ANNOTATION_SEGMENTS_FANOUT of them share a size tier (their
        // annotations then carried into one segment), so they stay few and
        // each annotation is rewritten O(log) times. Replaying a current
        // annotation changes nothing, so they add nothing to `kept_sessions`.
        // By id, with its annotation count: their annotations are read again
        // for those retired (held for all, they were the larger part of a
        // compaction's peak at 10M calls: ~0.3 GB).
        let mut annotation_only: Vec<(u64, u64)> = Vec::new();
        // Those judged here, for the next plan ([`AnnotationVerdicts`]).
        let mut verdicts: Vec<(u64, u64, Option<Vec<u64>>)> = Vec::new();
        // The frozen layer and the placements are the same shard index
        // file's: a compacted record's liveness from its frozen row.
        let same_file = self
            .shards
            .index_file()
            .is_some_and(|ix| self.index.frozen().is_in(ix.mapping()) && self.shards.base_is_in(ix.mapping()));
        let thawed = if same_file { self.index.thawed_rows() } else { Vec::new() };
        let is_live_at = |trace: &str, loc: Loc| match same_file.then(|| self.shards.frozen_row_at(loc)).flatten() {
            Some(row) => self.index.is_live_at_frozen(trace, loc, row, &thawed),
            None => self.index.is_live_at(trace, loc),
        };
        'segments: for ms in &self.manifest.segments {
            if ms.state != SegmentState::Sealed {
                break;
            }
            let Some(seg) = self.sealed_segments.get(&ms.id) else { break };
            // Its footer's pages (~40 bytes an entry: 100 MB for 2.5M
            // carried seals and rewards) are given back once it is judged.
            let _release = ReleaseOnDrop(seg);
            // Of current annotations only at an earlier plan, none of
            // whose targets changed since: the same verdict, unread.
            if let Some(count) = self.annotation_verdicts.still_current(ms.id) {
                debug_assert_eq!(
                    self.current_annotations_only(seg),
                    Some(count),
                    "segment {}: a kept verdict is not what its records say now",
                    ms.id
                );
                annotation_only.push((ms.id, count));
                verdicts.push((ms.id, count, None));
                #[cfg(test)]
                self.inner.verdicts_reused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                continue;
            }
            // Its records are unknown: nothing after it can be judged.
            let Some(footer) = footer_of(seg) else { break };
            // Its entries, and of them the seals and rewards, all current.
            let (mut entries, mut anns, mut all_current) = (0usize, 0usize, true);
            // Its annotations' targets, while it may be of annotations only.
            let mut targets: Vec<u64> = Vec::new();
            // Kept for a reason copying forward does not lift.
            let mut needed = false;
            // Kept by these sessions' records (live calls in segments).
            let mut keepers: Vec<&str> = Vec::new();
            let mut keeper_set: HashSet<&str> = HashSet::new();
            for e in footer.iter() {
                entries += 1;
                budget.tick(|| {
                    seg.release_pages();
                    self.release_index_pages();
                });
                if e.kind == KIND_CALL {
                    let loc = Loc { segment: ms.id, offset: e.frame_offset };
                    if in_segments(e.session_id) && !below_floor(self, e.session_id, loc) {
                        // Copied forward, the record would be dead before the
                        // floor, and still kept if its trace has a shard row
                        // or a record in a kept segment before it (the rules
                        // below): copying would not free the segment.
                        if copy_forward.is_none()
                            || self.shard_traces.contains(e.id)
                            || kept_traces.contains(&crate::index::frozen::id_hash(e.id))
                        {
                            needed = true;
                            break;
                        }
                        if keeper_set.insert(e.session_id) {
                            keepers.push(e.session_id);
                        }
                        continue;
                    }
                    // A dead call whose trace has a shard row: this record (or
                    // the deletion after it) is what keeps that row dead.
                    let live = is_live_at(e.id, loc);
                    if !live && self.shard_traces.contains(e.id) {
                        needed = true;
                        break;
                    }
                    // A dead call record that replaced one of a kept segment:
                    // it (or what killed it, kept with it) keeps that one dead.
                    // (A live one here is compacted: its shard row stands at
                    // its position and supersedes the earlier record.)
                    if !live && kept_traces.contains(&crate::index::frozen::id_hash(e.id)) {
                        needed = true;
                        break;
                    }
                } else if e.kind == KIND_DELETE_SESSION {
                    if self.shard_sessions.contains(e.id) || kept_sessions.contains(e.id) {
                        needed = true;
                        break;
                    }
                } else if e.kind == crate::format::record::KIND_MOVE_SESSION {
                    // Changes no call, and is not carried: a floor lost
                    // with its segment only keeps more (shard.md §6.3).
                } else if let Some(ann) = annotation_at(seg, &e) {
                    // Seals and (since segment format 4) rewards come from the
                    // footer: retiring reads no record body.
                    anns += 1;
                    all_current = all_current && self.is_current(&ann);
                    if anns == entries && all_current {
                        targets.push(target_hash(&ann));
                    }
                } else {
                    // A damaged annotation (the store was opened past it):
                    // its value cannot be carried forward, so it stays.
                    needed = true;
                    break;
                }
            }
            if !needed && keepers.is_empty() {
                if entries > 0 && anns == entries && all_current {
                    // Retiring it would append the same records again.
                    annotation_only.push((ms.id, anns as u64));
                    verdicts.push((ms.id, anns as u64, Some(std::mem::take(&mut targets))));
                } else {
                    // Read again (each read above, so this does not fail).
                    let Some(carried) = carried_annotations(seg) else { break };
                    annotations.extend(carried);
                    retire.push(ms.id);
                }
                continue;
            }
            if !needed {
                // Its frames' bytes (a small segment's header and footer
                // would make copies alone in it look like a small part).
                let frames: u64 = footer.iter().map(|e| frame_bytes(u64::from(e.body_len))).sum();
                candidates.push((ms.id, frames, keepers.iter().map(|s| (*s).to_owned()).collect()));
            }
            for e in footer.iter() {
                if e.kind == KIND_CALL {
                    kept_sessions.insert(e.session_id.to_owned());
                    kept_sessions.extend(e.session_uids.iter().map(str::to_owned));
                    kept_traces.insert(crate::index::frozen::id_hash(e.id));
                    continue;
                }
                if e.kind == crate::format::record::KIND_MOVE_SESSION {
                    continue;
                }
                // A record of a kept segment that cannot be read (a damaged
                // one the store was opened past): what it names is unknown,
                // so nothing after it is judged.
                let Some(ann) = annotation_at(seg, &e) else { break 'segments };
                if let Annotation::Seal { session_id }
                | Annotation::Reward { target: Target::Session(session_id), .. } = ann
                {
                    kept_sessions.insert(session_id);
                }
            }
        }
        let mut tiers: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
        for (id, count) in annotation_only {
            if let Some(tier) = crate::compact::merge_tier(count, ANNOTATION_SEGMENTS_FANOUT) {
                tiers.entry(tier).or_default().push(id);
            }
        }
        for group in tiers.into_values().filter(|g| g.len() >= ANNOTATION_SEGMENTS_FANOUT as usize) {
            // Read as above; one that no longer reads is kept.
            for id in group {
                if let Some(anns) = self.annotations_of(id) {
                    annotations.extend(anns);
                    retire.push(id);
                }
            }
        }
        let moves = match copy_forward {
            Some(fraction) => self.choose_moves(fraction, &candidates),
            None => Vec::new(),
        };
        // Those retired now need none.
        let retired: HashSet<u64> = retire.iter().copied().collect();
        verdicts.retain(|(id, _, _)| !retired.contains(id));
        Ok(Plan { retire, annotations, moves, verdicts })
    }

    /// Its annotation count when sealed segment `seg` holds current
    /// annotations only (seals, rewards), as [`Writer::plan_retirement`]
    /// judges it; else `None`. (What a kept verdict is checked against in
    /// debug builds.)
    fn current_annotations_only(&self, seg: &SegmentRef) -> Option<u64> {
        annotation_only(&self.index, seg, &mut || {}).map(|(count, _)| count)
    }

    /// The annotations of sealed segment `id` (one of current annotations
    /// only), from its footer; `None` when it does not read.
    fn annotations_of(&self, id: u64) -> Option<Vec<Annotation>> {
        carried_annotations(self.sealed_segments.get(&id)?)
    }

    /// The sessions to copy forward (shard.md §6.3): for each candidate
    /// segment, oldest first, its keepers when all are movable and copying
    /// those not chosen yet costs at most `fraction` of its bytes, within
    /// [`copy_budget`] bytes of copies per publication.
    fn choose_moves(&self, fraction: f64, candidates: &[(u64, u64, Vec<String>)]) -> Vec<String> {
        let budget = copy_budget(self.options.segment_bytes);
        let mut chosen: Vec<String> = Vec::new();
        let mut chosen_set: HashSet<String> = HashSet::new();
        let mut total = 0u64;
        let mut cost_of: std::collections::HashMap<&str, Option<u64>> = Default::default();
        // The frame sizes of the active segment's records, by offset.
        let active: std::collections::HashMap<u64, u32> = match self.active.as_ref() {
            Some(a) => a.entries.iter().chain(&self.pending).map(|e| (e.frame_offset, e.body_len)).collect(),
            None => Default::default(),
        };
        for (_, frame_bytes, keepers) in candidates {
            let new: Vec<&String> = keepers.iter().filter(|s| !chosen_set.contains(s.as_str())).collect();
            // None: not movable.
            let costs: Option<Vec<u64>> = new
                .iter()
                .map(|s| {
                    *cost_of.entry(s.as_str()).or_insert_with(|| self.movable(s).then(|| self.copy_cost(s, &active)))
                })
                .collect();
            let Some(costs) = costs else { continue };
            let cost: u64 = costs.iter().sum();
            if cost as f64 > fraction * *frame_bytes as f64 || total + cost > budget {
                continue;
            }
            total += cost;
            for s in new {
                chosen_set.insert(s.clone());
                chosen.push(s.clone());
            }
        }
        chosen
    }

    /// What copying `session` forward costs: the frame bytes of its live
    /// calls still in segments, wherever they are (`active`: the body
    /// lengths of the active segment's records by offset).
    fn copy_cost(&self, session: &str, active: &std::collections::HashMap<u64, u32>) -> u64 {
        let active_id = self.active.as_ref().map(|a| a.id);
        let calls = self.index.session_calls(session);
        calls
            .iter()
            .filter(|k| !self.shards.is_compacted(k.loc) && self.index.is_live_at(&k.trace_id, k.loc))
            .map(|k| {
                let body_len = if Some(k.loc.segment) == active_id {
                    active.get(&k.loc.offset).copied()
                } else {
                    self.sealed_segments.get(&k.loc.segment).and_then(|seg| {
                        let at = usize::try_from(k.loc.offset).ok()?;
                        let b = seg.mapped_bytes().get(at..at.checked_add(4)?)?;
                        Some(u32::from_le_bytes(b.try_into().ok()?))
                    })
                };
                frame_bytes(u64::from(body_len.unwrap_or(0)))
            })
            .sum()
    }

    /// Copy `sessions` forward (shard.md §6.3): for each, a session-moved
    /// record, then each live call it still has in segments appended again
    /// as it reads (same trace id, timestamp, documents, tokens), oldest
    /// first. The copies replace the calls (record.md §6), with their
    /// trace rewards written again after them as for any replacement. A
    /// session with a call that does not read (damage the store was opened
    /// past) is not copied; a copy cut short (a crash) frees nothing of its
    /// session and is done again by a later publication. The sessions are
    /// read whole (their calls held in memory while they are copied).
    fn copy_forward(&mut self, sessions: &[String]) -> Result<CopiedForward> {
        let mut out = CopiedForward::default();
        if self.active()?.format_version < crate::format::FORMAT_MOVE_SESSION {
            // A reopened older active segment cannot hold the record; an
            // empty one is not rolled (the next publication copies).
            self.roll()?;
            if self.active()?.format_version < crate::format::FORMAT_MOVE_SESSION {
                return Ok(out);
            }
        }
        self.write_buf()?;
        let snap = Snapshot::new(Arc::new(self.view()?));
        let budget = copy_budget(self.options.segment_bytes);
        // Tags for the copies' delta contexts: no append sequence number
        // comes near them.
        let mut tag = u64::MAX;
        for session in sessions {
            if out.bytes >= budget {
                // The estimate fell short (a copy stores a whole prompt where
                // the original was a delta): the rest waits.
                break;
            }
            // The session read whole, each prompt rebuilt from the one before
            // (O(its tokens)); a call that does not read leaves it uncopied.
            // (Positions and calls both from the snapshot: the same list.)
            let Ok(keys) = snap.session(session, None, None).map(|v| v.iter().map(|v| v.loc).collect::<Vec<Loc>>())
            else {
                continue;
            };
            let Ok(calls) = snap.session_calls(session, None, None) else { continue };
            if calls.len() != keys.len() {
                continue;
            }
            let copies: Vec<Call> = keys
                .iter()
                .zip(calls)
                .filter(|(loc, c)| !self.shards.is_compacted(**loc) && self.index.is_live_at(&c.trace_id, **loc))
                .map(|(_, c)| c)
                .collect();
            if copies.is_empty() {
                continue;
            }
            self.append_annotation(&Annotation::MoveSession { session_id: session.clone() })?;
            out.sessions += 1;
            // The documents as a delta against the previous copy's, as an
            // appender makes them (the writer checks the parent it takes).
            let mut prev: Option<(Call, u64, u32)> = None;
            for call in copies {
                let parent = prev.as_ref().filter(|p| p.2 < crate::limits::MESSAGES_DELTA_DEPTH_MAX).and_then(|p| {
                    p.0.messages.as_deref().map(|messages| crate::format::docs::Parent {
                        messages,
                        response_message: p.0.response_message.as_deref(),
                    })
                });
                let docs = crate::format::docs::encode(&call, parent);
                let docs_parent = match (&docs, &prev) {
                    (Some(d), Some(p)) if d.uses_parent => Some((p.1, p.2 + 1)),
                    _ => None,
                };
                tag -= 1;
                let appended = self.append_call(call.clone(), docs, docs_parent.map(|d| d.0), tag)?;
                let depth = docs_parent.filter(|_| appended.docs_delta).map_or(0, |d| d.1);
                out.calls += 1;
                out.bytes += appended.frame_bytes;
                prev = Some((call, tag, depth));
            }
        }
        self.write_buf()?;
        self.active()?.sync()?;
        self.unsynced_since = None;
        self.last_sync = Instant::now();
        Ok(out)
    }

    /// Carry what `plan` retires forward, and retire it.
    fn retire_planned(&mut self, plan: Plan) -> Result<Vec<u64>> {
        let Plan { retire, annotations, .. } = plan;
        if retire.is_empty() {
            return Ok(retire);
        }
        // Carry current rewards and seals forward (deduplicated by target),
        // in the order of their targets' id hashes: the order of the frozen
        // layer's tables (index/frozen.rs), so that an open replaying them
        // looks its sessions and trace ids up in one sequential pass rather
        // than at random (10M calls in 1.25M sessions: ~0.7 s of an open's
        // ~1.3 s went to those lookups' cache misses). Annotations of
        // distinct targets commute, so the order changes no replay.
        let mut seen: HashSet<(u8, &str)> = HashSet::new();
        let mut order: Vec<(u64, u8, usize)> = Vec::new();
        for (i, ann) in annotations.iter().enumerate() {
            let target = match ann {
                Annotation::Reward { target: Target::Trace(t), .. } => (0, t.as_str()),
                Annotation::Reward { target: Target::Session(s), .. } => (1, s.as_str()),
                Annotation::Seal { session_id } => (2, session_id.as_str()),
                Annotation::DeleteSession { .. } | Annotation::MoveSession { .. } => continue,
            };
            if seen.insert(target) {
                order.push((crate::index::frozen::id_hash(target.1), target.0, i));
            }
        }
        drop(seen);
        order.sort_unstable();
        if !order.is_empty() {
            // The carried annotations go into segments of their own (sealed
            // below): in the active segment, behind calls, an open would
            // read them into memory (a writer also keeps their footer
            // entries: ~100 MB for a 64 MiB segment of them), and the next
            // retirement of those calls would carry them again.
            self.roll()?;
        }
        let mut carried_count = 0;
        // Each one's current value is a lookup of the index files.
        let mut budget = crate::storage::mmap::PageBudget::compaction();
        for ann in order.into_iter().filter_map(|(_, _, i)| annotations.get(i)) {
            if let Some(a) = self.current(ann) {
                // It states the value in force: nothing a kept verdict
                // rests on changes (not noted).
                self.append_annotation_noting(&a, false)?;
                carried_count += 1;
                if self.buf.len() >= super::writer::BATCH_BYTES_MAX {
                    // Bound the writer's memory, as appends do.
                    self.write_buf()?;
                }
            }
            budget.tick(|| self.release_index_pages());
        }
        drop(annotations);
        self.write_buf()?;
        self.active()?.sync()?;
        self.unsynced_since = None;
        self.last_sync = Instant::now();
        // Carried annotations alone in the active segment (it was sealed
        // before them, and no append comes in meanwhile: the writer thread
        // does this): seal it, so that they stay apart from later calls and
        // are not carried again when those are compacted. (A crash before
        // the manifest write below leaves them twice; replaying a copy of a
        // current annotation changes nothing.)
        if carried_count > 0 {
            self.roll()?;
        }
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
}
