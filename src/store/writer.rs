//! The writer thread: batches appends, chooses prefix-delta parents, frames
//! and writes records, group-commits (fsync per durability level), publishes
//! views, rolls segments.

use super::*;

/// The writer thread's state.
pub(super) struct Writer {
    pub(super) inner: Arc<Inner>,
    pub(super) dir: PathBuf,
    pub(super) options: Options,
    pub(super) manifest: Manifest,
    pub(super) sealed_segments: imbl::OrdMap<u64, SegmentRef>,
    pub(super) active: Option<ActiveSegment>,
    pub(super) index: Index,
    pub(super) shards: crate::snapshot::ShardSlots,
    /// Shard rows per session and per trace id (persistent maps: a
    /// compaction prepares the next ones from a copy, see publish.rs).
    pub(super) shard_sessions: RowCounts,
    pub(super) shard_traces: RowCounts,
    /// While a compaction is under way: the trace ids whose live call changed
    /// since it began.
    pub(super) journal: Option<Journal>,
    /// The rewards side table (store/rewards.rs).
    pub(super) rewards: super::rewards::RewardsTable,
    /// Compactions begun (their tokens).
    pub(super) compactions: u64,
    /// Damage confined at open (published with every view).
    pub(super) damage: Arc<Vec<Problem>>,
    /// Retired segment files, deleted once no snapshot maps them any more.
    pub(super) retiring: Vec<(PathBuf, Vec<Weak<crate::storage::mmap::Mapping>>)>,
    /// Mappings sealed segments had while they were active.
    pub(super) old_maps: std::collections::HashMap<u64, Vec<Weak<crate::storage::mmap::Mapping>>>,
    pub(super) delta: DeltaCache,
    /// Frames encoded but not yet written.
    pub(super) buf: Vec<u8>,
    /// Footer entries of the frames in `buf`.
    pub(super) pending: Vec<FooterEntry>,
    pub(super) written_seq: u64,
    /// Retirement's verdicts on segments of current annotations only, and
    /// what changed since (store/retire.rs).
    pub(super) annotation_verdicts: super::retire::AnnotationVerdicts,
    pub(super) unsynced_since: Option<Instant>,
    pub(super) last_sync: Instant,
    /// The refresh of the backlog index file (store/backlog_refresh.rs).
    pub(super) backlog: super::backlog_refresh::BacklogRefresh,
}

/// The trace ids whose live call the writer changed (appended, replaced,
/// deleted) since compaction `token` began.
pub(super) struct Journal {
    pub(super) token: u64,
    pub(super) touched: HashSet<Arc<str>>,
}

/// What [`Writer::append_call`] wrote: the frame's bytes, and whether the
/// documents are a delta against the parent's (record.md §7.2).
pub(super) struct Appended {
    pub(super) frame_bytes: u64,
    pub(super) docs_delta: bool,
}

const BATCH_RECORDS_MAX: usize = 1024;
pub(super) const BATCH_BYTES_MAX: usize = 16 << 20;

/// Poisons the store if the writer thread unwinds from a panic, so that every
/// waiter wakes with an error instead of waiting for ever (its `Drop` runs
/// during the unwinding, after the writer's locals are gone).
struct PanicGuard(Arc<Inner>);

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poison(&Error::new(
                ErrorKind::Io,
                "the writer thread panicked (a bug in trajlog: please report it with the panic message printed above); records not yet acknowledged were not written",
            ));
        }
    }
}

impl Writer {
    pub(super) fn run(mut self, rx: Receiver<Cmd>) {
        let _poison_on_panic = PanicGuard(self.inner.clone());
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
            let (mut sync_soon, mut closing) = (false, false);
            for cmd in batch {
                match cmd {
                    Cmd::SyncSoon => sync_soon = true,
                    Cmd::Close => closing = true,
                    cmd => self.handle(cmd),
                }
            }
            if closing {
                break;
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
        // The store is shutting down (it flushed first); a refresh under
        // way finishes its file for the next opens.
        self.commit(true);
        self.finish_backlog_refresh(false);
        self.check_index();
        if !self.poisoned() {
            if let Some(active) = self.active.as_mut() {
                if let Err(e) = active.trim() {
                    self.inner.poison(&e);
                }
            }
        }
    }

    /// When the group-commit timer fires, if records wait for an fsync.
    pub(super) fn group_deadline(&self) -> Option<Instant> {
        if self.options.durability != Durability::Group {
            return None;
        }
        self.unsynced_since.map(|_| self.last_sync + Duration::from_millis(self.options.group_commit_ms))
    }

    pub(super) fn poisoned(&self) -> bool {
        self.inner.poisoned.load(Ordering::Acquire)
    }

    pub(super) fn fail(&mut self, e: &Error) {
        self.inner.poison(e);
        self.buf.clear();
        self.pending.clear();
    }

    /// After a command's lookups: if one read a damaged block of the shard
    /// index file (a writable open checks it a block at a time) it may have
    /// missed, so nothing more is written ([`Inner::index_damaged`]).
    pub(super) fn check_index(&mut self) {
        if self.poisoned() {
            return;
        }
        let counts = [&self.shard_traces, &self.shard_sessions];
        if let Some(e) = super::recovery::writer_damage(&self.shards, &self.index, &counts) {
            self.inner.index_damaged(&e);
            self.buf.clear();
            self.pending.clear();
        }
    }

    pub(super) fn handle(&mut self, cmd: Cmd) {
        match cmd {
            // The permits are dropped at the end of their arm, giving the
            // record's room in the queue back.
            Cmd::Append { seq, call, docs, docs_parent_seq, permit: _permit } => {
                if !self.poisoned() {
                    if let Err(e) = self.append_call(*call, docs, docs_parent_seq, seq) {
                        self.fail(&e);
                    }
                    self.check_index();
                }
                self.written_seq = seq;
            }
            Cmd::Annotate { seq, ann, reply, permit: _permit } => {
                if !self.poisoned() {
                    match self.append_annotation(&ann) {
                        Ok(count) => {
                            if let (Annotation::Reward { target, .. }, 1..) = (&ann, count) {
                                self.note_reward(target);
                            }
                            // A count from lookups that met a damaged block
                            // is not sent: the caller gets the poison.
                            self.check_index();
                            if let (Some(reply), false) = (reply, self.poisoned()) {
                                let _ = reply.send(count);
                            }
                        }
                        Err(e) => self.fail(&e),
                    }
                }
                self.written_seq = seq;
            }
            Cmd::Flush { fsync, reply } => {
                // Damage a read of the writer's views met since (the blocks
                // are shared) is said by the flush.
                self.check_index();
                self.commit(fsync);
                let result = match self.inner.poisoned_error() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                let _ = reply.send(result);
            }
            // Taken by `run`, which decides when to commit and when to stop.
            Cmd::SyncSoon | Cmd::Close => {}
            Cmd::BacklogRefreshed => {
                self.finish_backlog_refresh(true);
            }
            #[cfg(any(test, feature = "internals"))]
            Cmd::WaitBacklogRefresh { reply } => {
                self.settle_backlog_refresh();
                let b = &self.backlog;
                let _ = reply.send((b.started, b.adopted, b.incremental, b.deltas));
            }
            #[cfg(any(test, feature = "internals"))]
            Cmd::Panic => panic!("writer thread panic injected by Store::inject_writer_panic (a test hook)"),
            Cmd::BeginCompaction { reply } => {
                let _ = reply.send(self.begin_compaction());
            }
            Cmd::EndCompaction { token } => {
                if self.journal.as_ref().is_some_and(|j| j.token == token) {
                    self.journal = None;
                    self.annotation_verdicts.end();
                }
            }
            Cmd::Publish { staged, sessions, mut prepared, reply } => {
                let result = match self.inner.poisoned_error() {
                    Some(e) => Err(e),
                    // Refused before the commit point: nothing done, no poison.
                    None => self.changed_since(&prepared).and_then(|touched| {
                        let published = self.publish(staged, &sessions, &mut prepared, &touched);
                        if let Err(e) = &published {
                            self.fail(e);
                        }
                        published
                    }),
                };
                self.commit(true);
                if let (Ok(outcome), Some((rebuilt, through))) = (&result, prepared.rebuilt.take()) {
                    if self.adopt_rebuilt(rebuilt, through, &outcome.retired_segments) {
                        // Published with the next view.
                        self.commit(true);
                    }
                }
                // The side table follows the publication, once the log is
                // durable: it never reflects a reward the log could lose. A
                // failure leaves the previous table and is reported, without
                // poisoning (the next publication writes it).
                let result = result.and_then(|outcome| match self.write_rewards() {
                    Ok(()) => Ok(outcome),
                    Err(e) => Err(Error::new(
                        e.kind().clone(),
                        format!(
                            "the shards were published, but the rewards side table (shards/{}) was not rewritten: {}; the next compaction rewrites it",
                            super::rewards::REWARDS_FILE,
                            e.message()
                        ),
                    )),
                });
                // What `prepared` still holds is freed by the caller.
                let _ = reply.send((result, prepared));
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

    pub(super) fn active(&mut self) -> Result<&mut ActiveSegment> {
        self.active
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Poisoned, "no active segment (an earlier roll failed)"))
    }

    /// Make room for a frame of `frame_len` bytes: roll if the active segment
    /// would pass its size (and already holds something).
    pub(super) fn reserve(&mut self, frame_len: u64) -> Result<Loc> {
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

    pub(super) fn append_call(
        &mut self,
        call: Call,
        docs: Option<crate::format::docs::Encoded>,
        docs_parent_seq: Option<u64>,
        seq: u64,
    ) -> Result<Appended> {
        if !self.delta.knows(&call.session_id) {
            self.load_contexts(&call.session_id)?;
        }
        let mut delta = self.delta.choose(&call.session_id, &call.prompt_token_ids);
        let format_version = self.active()?.format_version;
        // Prompt checkpoints are segment format 3 (record.md §4): a reopened
        // older active segment gets none.
        delta.checkpoint &= format_version >= 3;
        let parent = delta.parent.and_then(|p| self.delta.context(&call.session_id, p)).map(|c| (c.seq, c.depth));
        let depth = match parent {
            Some((_, d)) if !delta.checkpoint => d + 1,
            _ => 0,
        };
        let mut docs_delta = false;
        let docs = match docs {
            // A block goes into a segment whose format has its references
            // (record.md §7.2), and a messages delta holds only if the parent
            // chosen here is the call whose documents the appender used; else
            // the documents are encoded again without them.
            Some(e) if e.min_format <= format_version && !e.uses_parent => Some(e.block),
            Some(e)
                if e.min_format <= format_version
                    && parent.zip(docs_parent_seq).is_some_and(|((seq, _), want)| seq == want) =>
            {
                docs_delta = true;
                Some(e.block)
            }
            Some(_) => {
                let allow = crate::format::docs::Allow::format(format_version);
                crate::format::docs::encode_for(&call, None, allow).map(|e| e.block)
            }
            None => None,
        };
        // A segment of format version 1 (reopened) holds plain documents only.
        let docs = docs.filter(|_| format_version >= 2);
        let body_len = call_body_len(&call, &delta, docs.as_deref());
        if frame_bytes(body_len) > RECORD_BYTES_MAX {
            // Unreachable with validated input (the per-field limits sum below it).
            return Err(Error::limit("RECORD_BYTES_MAX", "record bytes", body_len, RECORD_BYTES_MAX));
        }
        let loc = self.reserve(frame_bytes(body_len))?;
        let mut body = Vec::with_capacity(body_len as usize);
        encode_call(&mut body, &call, &delta, docs.as_deref());
        write_frame(&mut self.buf, &body);
        self.pending.push(FooterEntry {
            frame_offset: loc.offset,
            body_len: body.len() as u32,
            kind: KIND_CALL,
            reward_target: 0,
            timestamp: call.timestamp,
            id: call.trace_id.clone(),
            session_id: call.session_id.clone(),
            session_uids: call.session_uids.clone(),
        });
        let session: Arc<str> = Arc::from(call.session_id.as_str());
        let trace_id: Arc<str> = Arc::from(call.trace_id.as_str());
        let sessions = self.index.sessions_of(&call.session_id, &call.session_uids);
        let replaced = self.index.apply_call(trace_id.clone(), CallMeta { loc, timestamp: call.timestamp, sessions });
        self.touch(&trace_id);
        for id in std::iter::once(&call.trace_id).chain(std::iter::once(&call.session_id)).chain(&call.session_uids) {
            self.annotation_verdicts.touch(id);
        }
        // A trace reward stays with its trace id when the call is replaced,
        // and is written again after the new call (format-spec/record.md §6):
        // the record that set it sits before the new call, and the replay
        // ignores it once the replaced call's record or shard row is gone
        // (retired, collected); the copy applies to the new call.
        let carried = replaced.as_ref().and_then(|_| self.index.trace_reward(&trace_id));
        let prompt_len = call.prompt_token_ids.len();
        let mut tokens = call.prompt_token_ids;
        tokens.extend_from_slice(&call.completion_token_ids);
        self.delta.remember(&session, Context { loc, prompt_len, tokens: Arc::new(tokens), seq, depth });
        if let Some(old) = &replaced {
            // The replaced record is dead: no later call takes it as parent.
            if let Some(primary) = old.sessions.first() {
                self.delta.forget_at(primary, old.loc);
            }
        }
        if let Some(value) = carried {
            let target = Target::Trace(trace_id.to_string());
            self.append_annotation(&Annotation::Reward { target: target.clone(), value })?;
            self.note_reward(&target);
        }
        if self.buf.len() >= BATCH_BYTES_MAX {
            // Bound the writer's memory: write now, make durable at batch end.
            self.write_buf()?;
        }
        Ok(Appended { frame_bytes: frame_bytes(body_len), docs_delta })
    }

    /// A session the delta cache does not know may still have calls on disk
    /// (after a reopen, or after eviction): load its most recent contexts.
    pub(super) fn load_contexts(&mut self, session: &str) -> Result<()> {
        if self.index.is_frozen_session(session) {
            // All compacted: none can be a parent.
            return Ok(());
        }
        let calls = self.index.session_calls(session);
        // None before the session's last session-moved record (record.md §4).
        let floor = self.index.session_floor(session);
        let keys: Vec<Loc> = {
            // Only calls still in segments can be parents (compacted ones may
            // have had their segment retired).
            let in_segments = |k: &&crate::index::CallKey| {
                self.index.is_live_at(&k.trace_id, k.loc)
                    && !self.shards.is_compacted(k.loc)
                    && floor.is_none_or(|f| k.loc > f)
            };
            let mut locs: Vec<Loc> = calls.iter().filter(in_segments).map(|k| k.loc).collect();
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
            let cap = self.inner.options.prompt_chain_max;
            let depth = if cap == 0 { 0 } else { snap.prompt_chain_depth(&call, cap) };
            self.delta.remember(&session_arc, Context { loc, prompt_len, tokens: Arc::new(tokens), seq: 0, depth });
        }
        Ok(())
    }

    pub(super) fn append_annotation(&mut self, ann: &Annotation) -> Result<u64> {
        self.append_annotation_noting(ann, true)
    }

    /// [`Writer::append_annotation`]; `note`: note its target against
    /// retirement's kept verdicts. Retirement's re-appends of the values in
    /// force change no target and are not noted (a tier of 1.25M carried
    /// seals would note every session).
    pub(super) fn append_annotation_noting(&mut self, ann: &Annotation, note: bool) -> Result<u64> {
        if let Annotation::Reward { target: Target::Trace(t), .. } = ann {
            if self.index.live(t.as_str()).is_none() {
                // Nothing to reward (`Store::set_reward` says so): no record.
                return Ok(0);
            }
        }
        let mut body = Vec::with_capacity(64);
        encode_annotation(&mut body, ann);
        let loc = self.reserve(frame_bytes(body.len() as u64))?;
        write_frame(&mut self.buf, &body);
        let entry = crate::segment::recovery::entry_of_body(loc.offset, &body)
            .map_err(|e| Error::new(ErrorKind::Io, format!("internal: annotation does not decode: {e}")))?;
        self.pending.push(entry);
        match ann {
            // After a session-moved record no call of the session may take a
            // parent before it (record.md §4): nothing remembered of it stays.
            Annotation::Seal { session_id }
            | Annotation::DeleteSession { session_id }
            | Annotation::MoveSession { session_id } => self.delta.forget(session_id),
            Annotation::Reward { .. } => {}
        }
        if let Annotation::DeleteSession { session_id } = ann {
            // The calls it deletes include calls of other sessions that list
            // it among their uids: remembered there, they must be forgotten
            // too (a dead record's ancestors may be retired; a call chained
            // to it would then not be readable). A frozen session's calls
            // are its own (forgotten above).
            if !self.index.is_frozen_session(session_id.as_str()) {
                let calls = self.index.session_calls(session_id.as_str());
                let gone: std::collections::HashSet<Loc> = calls
                    .iter()
                    .filter_map(|k| match self.index.live(&k.trace_id) {
                        Some(crate::index::LiveCall::Hot(m))
                            if m.loc == k.loc && m.sessions.first().is_some_and(|p| **p != **session_id) =>
                        {
                            Some(k.loc)
                        }
                        _ => None,
                    })
                    .collect();
                self.delta.forget_locs(&gone);
            }
        }
        if let (Annotation::DeleteSession { session_id }, Some(_)) = (ann, &self.journal) {
            // Every call the deletion can remove is in the session's list.
            let calls = self.index.session_calls(session_id.as_str());
            for key in calls.iter() {
                self.touch(&key.trace_id);
            }
        }
        match ann {
            _ if !note => {}
            // Its calls' trace rewards go with it, unnamed here.
            Annotation::DeleteSession { .. } => self.annotation_verdicts.void(),
            Annotation::Seal { session_id }
            | Annotation::MoveSession { session_id }
            | Annotation::Reward { target: Target::Session(session_id), .. } => {
                self.annotation_verdicts.touch(session_id.as_str())
            }
            Annotation::Reward { target: Target::Trace(t), .. } => self.annotation_verdicts.touch(t.as_str()),
        }
        Ok(apply_annotation(&mut self.index, ann, loc))
    }

    pub(super) fn write_buf(&mut self) -> Result<()> {
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

    pub(super) fn view(&mut self) -> Result<View> {
        let mut segments = self.sealed_segments.clone();
        let a = self.active()?;
        segments.insert(a.id, SegmentRef::new(a.id, a.path.clone(), a.map.clone(), a.len, false));
        Ok(View { index: self.index.clone(), segments, shards: self.shards.clone(), damage: self.damage.clone() })
    }

    /// Write what is buffered; fsync if `fsync` (or keep waiting for the group
    /// timer); publish what became durable.
    pub(super) fn commit(&mut self, fsync: bool) {
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
        let mut synced = false;
        if fsync && self.unsynced_since.is_some() {
            if let Err(e) = self.active().and_then(|a| a.sync()) {
                self.fail(&e);
                return;
            }
            self.unsynced_since = None;
            self.last_sync = Instant::now();
            synced = true;
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
        if synced && self.options.zero_ahead_bytes > 0 {
            // After the acknowledgement: off the waiters' latency.
            if let Some(active) = self.active.as_mut() {
                active.zero_ahead(self.options.zero_ahead_bytes);
            }
        }
    }

    /// Delete retired segment files no snapshot maps any more.
    pub(super) fn reap(&mut self) {
        self.retiring.retain(|(path, maps)| {
            if maps.iter().any(|m| m.strong_count() > 0) {
                return true;
            }
            // Best effort: a file left behind is removed as an orphan at the next open.
            let _ = fs::remove_file(path);
            false
        });
    }

    /// Seal the active segment, start the next one, publish both in the manifest.
    pub(super) fn roll(&mut self) -> Result<()> {
        self.write_buf()?;
        if self.active.as_ref().is_some_and(|a| a.entries.is_empty()) {
            return Ok(()); // nothing to seal
        }
        let old = self.active.take().ok_or_else(|| Error::new(ErrorKind::Poisoned, "no active segment"))?;
        let old_id = old.id;
        let calls = old.entries.iter().filter(|e| e.kind == crate::format::record::KIND_CALL).count() as u64;
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
        self.note_sealed(old_id, calls);
        Ok(())
    }
}
