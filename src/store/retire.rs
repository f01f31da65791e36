//! Retiring segments nothing needs any more (format-spec/shard.md §6), in
//! the writer thread, as the last step of a publication.

use super::*;

impl Writer {
    /// Retire the longest prefix of sealed segments whose every record is no
    /// longer needed (format-spec/shard.md §6): each call record belongs to a
    /// session with no live call left in segments (so it is compacted, dead, and
    /// no live call can use it as a prefix-delta parent), and no session deletion
    /// in it concerns compacted rows. Rewards and seals in them are re-appended
    /// with their current values first, so that they outlive their segment.
    ///
    /// `in_segments` counts the live calls still served from segments by
    /// primary session (prepared off this thread, see publish.rs). The work
    /// here is proportional to the segments walked, not to the store.
    pub(super) fn retire(&mut self, in_segments: &std::collections::HashMap<Arc<str>, u64>) -> Result<Vec<u64>> {
        let in_segments = |session: &str| in_segments.get(session).is_some_and(|n| *n > 0);
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
                    if in_segments(e.session_id.as_str()) {
                        break 'segments;
                    }
                    // A dead call whose trace has a shard row: this record (or
                    // the deletion after it) is what keeps that row dead.
                    let loc = Loc { segment: ms.id, offset: e.frame_offset };
                    let live = self.index.traces.get(e.id.as_str()).is_some_and(|m| m.loc == loc);
                    if !live && self.shard_traces.contains_key(e.id.as_str()) {
                        break 'segments;
                    }
                } else if e.kind == KIND_DELETE_SESSION {
                    if self.shard_sessions.contains_key(e.id.as_str()) {
                        break 'segments;
                    }
                } else if let Some(ann) = crate::segment::recovery::annotation_of_entry(e) {
                    // Seals and (since segment format 4) rewards come from the
                    // footer: retiring reads no record body.
                    anns.push(ann);
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
}
