//! Publishing a compaction (format-spec/shard.md §5), in the writer thread.

use super::*;

impl Writer {
    /// Publish a compaction (format-spec/shard.md §5): record the staged files as
    /// pending in the manifest (the commit point), rename them into place, list
    /// them as published, serve the compacted calls from them, and retire the
    /// segments nothing needs any more.
    pub(super) fn publish(&mut self, staged: Vec<PendingRename>, sessions: &[String]) -> Result<PublishOutcome> {
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
}
