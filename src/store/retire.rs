//! Retiring segments nothing needs any more (format-spec/shard.md §6), in
//! the writer thread, as the last step of a publication.

use super::*;

/// How many segments of current annotations only are kept per size tier
/// before they are retired together (see [`Writer::retire`]).
const ANNOTATION_SEGMENTS_FANOUT: u32 = 8;

/// The annotation a footer entry stands for: from the entry itself (seals,
/// and rewards since segment format 4), else from its record body; None
/// when the body is damaged.
fn annotation_at(seg: &SegmentRef, e: &crate::format::segment::FooterEntry) -> Option<Annotation> {
    crate::segment::recovery::annotation_of_entry(e)
        .or_else(|| seg.body_at(e.frame_offset).ok().and_then(|b| decode_annotation(b).ok()))
}

impl Writer {
    /// The annotation that states the current value of `ann`'s target (a
    /// seal of a session still sealed, the reward in force), or None when
    /// nothing is set for it any more.
    fn current(&self, ann: &Annotation) -> Option<Annotation> {
        match ann {
            Annotation::Seal { session_id } => self.index.is_sealed(session_id.as_str()).then(|| ann.clone()),
            Annotation::Reward { target: Target::Session(s), .. } => self
                .index
                .session_reward(s.as_str())
                .map(|value| Annotation::Reward { target: Target::Session(s.clone()), value }),
            Annotation::Reward { target: Target::Trace(t), .. } => self
                .index
                .trace_reward(t.as_str())
                .map(|value| Annotation::Reward { target: Target::Trace(t.clone()), value }),
            Annotation::DeleteSession { .. } => None,
        }
    }

    /// Whether replaying `ann` leaves the store as it is now: it states its
    /// target's current value (a reward bit for bit).
    fn is_current(&self, ann: &Annotation) -> bool {
        match (self.current(ann), ann) {
            (Some(Annotation::Reward { value: now, .. }), Annotation::Reward { value, .. }) => {
                now.to_bits() == value.to_bits()
            }
            (Some(Annotation::Seal { .. }), Annotation::Seal { .. }) => true,
            _ => false,
        }
    }

    /// Retire every sealed segment whose every record is no longer needed
    /// (format-spec/shard.md §6): each call record belongs to a session with
    /// no live call left in segments (so it is compacted, dead, and no live
    /// call can use it as a prefix-delta parent), no dead call record keeps
    /// a shard row dead, and no session deletion in it concerns compacted
    /// rows. A segment kept for these reasons does not keep the later ones:
    /// they retire too unless one of their records could bring back a
    /// record of the kept ones: a deletion whose session has a call, a seal
    /// or a reward in a kept segment before it, or a dead call record whose
    /// trace id has a call record there. So a straggler session — never
    /// finished, never compacted — keeps only the segments that hold its
    /// records. Rewards and seals of retired segments are re-appended with
    /// their current values first, so that they outlive their segment.
    ///
    /// `in_segments` counts the live calls still served from segments by
    /// primary session (prepared off this thread, see publish.rs). The work
    /// here is one footer per sealed segment.
    pub(super) fn retire(&mut self, in_segments: &std::collections::HashMap<Arc<str>, u64>) -> Result<Vec<u64>> {
        let in_segments = |session: &str| in_segments.get(session).is_some_and(|n| *n > 0);
        let mut retire = Vec::new();
        let mut annotations = Vec::new();
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
        let mut annotation_only: Vec<(u64, Vec<Annotation>)> = Vec::new();
        'segments: for ms in &self.manifest.segments {
            if ms.state != SegmentState::Sealed {
                break;
            }
            let Some(seg) = self.sealed_segments.get(&ms.id) else { break };
            let trailer = crate::format::segment::read_trailer(seg.mapped_bytes());
            let entries = match trailer.map(|t| crate::format::segment::decode_footer(seg.mapped_bytes(), &t)) {
                Some(Ok(entries)) => entries,
                // Its records are unknown: nothing after it can be judged.
                _ => break,
            };
            let mut anns = Vec::new();
            let mut needed = false;
            for e in &entries {
                if e.kind == KIND_CALL {
                    if in_segments(e.session_id.as_str()) {
                        needed = true;
                        break;
                    }
                    // A dead call whose trace has a shard row: this record (or
                    // the deletion after it) is what keeps that row dead.
                    let loc = Loc { segment: ms.id, offset: e.frame_offset };
                    let live = self.index.is_live_at(e.id.as_str(), loc);
                    if !live && self.shard_traces.contains(e.id.as_str()) {
                        needed = true;
                        break;
                    }
                    // A dead call record that replaced one of a kept segment:
                    // it (or what killed it, kept with it) keeps that one dead.
                    // (A live one here is compacted: its shard row stands at
                    // its position and supersedes the earlier record.)
                    if !live && kept_traces.contains(&crate::index::frozen::id_hash(&e.id)) {
                        needed = true;
                        break;
                    }
                } else if e.kind == KIND_DELETE_SESSION {
                    if self.shard_sessions.contains(e.id.as_str()) || kept_sessions.contains(e.id.as_str()) {
                        needed = true;
                        break;
                    }
                } else if let Some(ann) = annotation_at(seg, e) {
                    // Seals and (since segment format 4) rewards come from the
                    // footer: retiring reads no record body.
                    anns.push(ann);
                } else {
                    // A damaged annotation (the store was opened past it):
                    // its value cannot be carried forward, so it stays.
                    needed = true;
                    break;
                }
            }
            if !needed {
                if !entries.is_empty() && anns.len() == entries.len() && anns.iter().all(|a| self.is_current(a)) {
                    // Retiring it would append the same records again.
                    annotation_only.push((ms.id, anns));
                } else {
                    annotations.extend(anns);
                    retire.push(ms.id);
                }
                continue;
            }
            for e in &entries {
                if e.kind == KIND_CALL {
                    kept_sessions.insert(e.session_id.clone());
                    kept_sessions.extend(e.session_uids.iter().cloned());
                    kept_traces.insert(crate::index::frozen::id_hash(&e.id));
                    continue;
                }
                // A record of a kept segment that cannot be read (a damaged
                // one the store was opened past): what it names is unknown,
                // so nothing after it is judged.
                let Some(ann) = annotation_at(seg, e) else { break 'segments };
                if let Annotation::Seal { session_id }
                | Annotation::Reward { target: Target::Session(session_id), .. } = ann
                {
                    kept_sessions.insert(session_id);
                }
            }
        }
        let mut tiers: std::collections::BTreeMap<u32, Vec<(u64, Vec<Annotation>)>> = Default::default();
        for (id, anns) in annotation_only {
            if let Some(tier) = crate::compact::merge_tier(anns.len() as u64, ANNOTATION_SEGMENTS_FANOUT) {
                tiers.entry(tier).or_default().push((id, anns));
            }
        }
        for group in tiers.into_values().filter(|g| g.len() >= ANNOTATION_SEGMENTS_FANOUT as usize) {
            for (id, anns) in group {
                annotations.extend(anns);
                retire.push(id);
            }
        }
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
                Annotation::DeleteSession { .. } => continue,
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
        for ann in order.into_iter().filter_map(|(_, _, i)| annotations.get(i)) {
            if let Some(a) = self.current(ann) {
                self.append_annotation(&a)?;
                carried_count += 1;
                if self.buf.len() >= super::writer::BATCH_BYTES_MAX {
                    // Bound the writer's memory, as appends do.
                    self.write_buf()?;
                }
            }
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
