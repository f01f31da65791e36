//! Compaction: finished sessions → Parquet trajectory shards
//! (format-spec/shard.md), published atomically, then the segments nothing needs
//! any more are retired.
//!
//! Streaming: one session is materialized at a time, rows are flushed a row
//! group at a time, so memory is bounded by the largest session plus one row
//! group, however large the store. The heavy work runs in the caller's thread on
//! a snapshot — building the shards, and preparing the index changes of their
//! publication; only committing the publication and applying those changes
//! goes through the writer thread, which owns the manifest and the indexes
//! (store/publish.rs).

mod build;
mod collect;

use crate::error::{Error, Result};
use crate::limits::{
    DEFAULT_ROW_GROUP_BYTES, DEFAULT_SHARD_BYTES, DEFAULT_STEPS_ROW_GROUP_ROWS,
    DEFAULT_TRAJECTORIES_ROW_GROUP_MIN_BYTES, DEFAULT_TRAJECTORIES_ROW_GROUP_ROWS, RELEASE_PAGES_EVERY_BYTES,
    SCAN_DECODED_BYTES_MAX, TRAJECTORIES_ROW_GROUP_ROWS_MAX,
};
use crate::shard::schema::{steps_schema, trajectories_schema};
pub use crate::shard::writer::ShardCompression;
use crate::shard::writer::TableWriter;
use crate::snapshot::{CallView, Contexts};
use crate::storage::SHARDS_DIR;
use crate::store::Store;
use build::{chains, group_id, StepInput, StepsBuilder, TrajectoriesBuilder};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sessions the compaction's selection walks between two givebacks of
/// the mapped pages it read.
const SELECTION_RELEASE_EVERY: u64 = 1 << 16;

/// Which sessions a compaction takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Selection {
    /// Sessions marked sealed (all their calls are in).
    SealedOnly,
    /// Sessions whose last call's timestamp is older than this many seconds.
    OlderThan(f64),
}

/// How a compaction reports progress: called with (sessions done, sessions
/// selected, calls compacted so far) after each session.
pub type CompactProgress = Arc<dyn Fn(u64, u64, u64) + Send + Sync>;

/// Options of [`Store::compact`]. Start from `CompactOptions::default()` and
/// change what you need with the same-named setters:
///
/// ```
/// use trajlog::{CompactOptions, Selection};
/// let opts = CompactOptions::default().selection(Selection::OlderThan(600.0)).shard_bytes(64 << 20);
/// assert_eq!(opts.shard_bytes, 64 << 20);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct CompactOptions {
    /// Which sessions are taken (default: sealed ones).
    pub selection: Selection,
    /// Rows per `steps` row group, at most.
    pub steps_row_group_rows: usize,
    /// Rows at which a `trajectories` row group is closed once it holds
    /// [`CompactOptions::trajectories_row_group_min_bytes`]; a group is
    /// closed at [`TRAJECTORIES_ROW_GROUP_ROWS_MAX`] rows (or this many, if
    /// more) whatever its bytes.
    pub trajectories_row_group_rows: usize,
    /// Size (uncompressed estimate) a `trajectories` row group reaches
    /// before its rows close it: groups of trajectories of tiny calls are
    /// not closed at a few kilobytes (each costs the file's footer a record
    /// per column, which every reader parses). 0: rows alone close it.
    pub trajectories_row_group_min_bytes: usize,
    /// Size (uncompressed estimate) at which a row group of either table
    /// is closed, whatever its rows.
    pub row_group_bytes: usize,
    /// Size (uncompressed estimate) at which a shard file is closed.
    pub shard_bytes: usize,
    /// Page compression of the shards.
    pub compression: ShardCompression,
    /// Called after each session (the CLI draws a progress bar with it).
    pub progress: Option<CompactProgress>,
    /// Collection (format-spec/shard.md §6.1): rewrite the shards of every
    /// earlier compaction (generation) whose dead rows — calls deleted or
    /// replaced since — are at least this fraction of its rows, keeping
    /// only the live ones, so that their space is freed and the segments
    /// holding the deletions can be retired. A generation with no live
    /// row left is dropped whatever the fraction. `None`: no collection.
    /// Default `Some(0.2)`: at most ~1.25× the live rows on disk, each row
    /// rewritten at most ~5 times.
    pub collect_dead_fraction: Option<f64>,
    /// Merging (format-spec/shard.md §6.2): once this many earlier
    /// generations are in one size tier (tier t: F^t ≤ `steps` rows <
    /// F^(t+1); none from 2^20 rows on), they are
    /// written again together into this compaction's files, so the number
    /// of shard files grows with the log of the rows compacted, not with
    /// the number of compactions. `None`: never merge. Default `Some(8)`:
    /// at most 8 generations per tier, each row rewritten about once per
    /// tier it climbs (measured in `benches/small_compactions.sh`: 64
    /// compactions of 400 rows leave 16 files instead of 128 for 1.9 rows
    /// written per row compacted; fanout 4 leaves 8 for 2.7).
    pub merge_fanout: Option<u32>,
    /// At most about this many calls per compaction: whole sessions, oldest
    /// first (by their first call's timestamp), until the next one would
    /// pass the limit (a session larger than the limit goes alone). What is
    /// left is reported ([`CompactReport::sessions_left`]) for the next
    /// compaction. A compaction's own memory (the rows it builds, what its
    /// publication adds to the index) grows with what it compacts, so a
    /// large backlog compacted in several of these peaks lower than in one
    /// (`trajlog compact --batch-calls`). `None` (the default): no limit.
    pub max_calls: Option<u64>,
    /// The largest publication: with `Some(n)` a compaction writes its
    /// shards and publishes them in steps of at most about `n` calls — the
    /// new calls of whole sessions (oldest first) and the live calls that
    /// collection and merging write again, together — one after another
    /// until every session chosen when it began is compacted (or
    /// `max_calls` is reached). What a publication builds (the rows it
    /// writes, the shard index file's changes) grows with its calls, about
    /// 0.3 KB each, so this bounds that part of a compaction's memory by
    /// configuration (format-spec/shard.md §6.4); each step also rewrites
    /// the shard index file, so a large backlog takes longer (4M tiny
    /// calls in segments: 0.95 GB and 102 s in steps of 2^20 against 1.75
    /// GB and 74 s in one). A session larger than `n` goes alone. Default
    /// [`DEFAULT_BATCH_CALLS`]: a compaction of fewer calls is one
    /// publication, as before. `None`: one publication of every new call
    /// chosen, whatever its size; collection and merging still write at
    /// most [`DEFAULT_BATCH_CALLS`] live calls again in it.
    pub batch_calls: Option<u64>,
    /// The copy-forward collector (format-spec/shard.md §6.3): after the
    /// publication, a sealed segment kept only by unfinished sessions
    /// (stragglers) whose live calls in segments take at most this fraction
    /// of its bytes has those sessions copied forward (appended again
    /// behind a session-moved record), so that it retires. At most a
    /// quarter segment of copies per compaction (the writer thread copies,
    /// and appends wait meanwhile). `None`: never. Default
    /// `Some(0.25)`: a segment is rewritten only when that frees at least
    /// 4× what it copies. At most [`COPY_FORWARD_MAX`].
    pub copy_forward: Option<f64>,
}

impl std::fmt::Debug for CompactOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompactOptions")
            .field("selection", &self.selection)
            .field("steps_row_group_rows", &self.steps_row_group_rows)
            .field("trajectories_row_group_rows", &self.trajectories_row_group_rows)
            .field("trajectories_row_group_min_bytes", &self.trajectories_row_group_min_bytes)
            .field("row_group_bytes", &self.row_group_bytes)
            .field("shard_bytes", &self.shard_bytes)
            .field("compression", &self.compression)
            .field("progress", &self.progress.is_some())
            .field("collect_dead_fraction", &self.collect_dead_fraction)
            .field("merge_fanout", &self.merge_fanout)
            .field("max_calls", &self.max_calls)
            .field("batch_calls", &self.batch_calls)
            .field("copy_forward", &self.copy_forward)
            .finish()
    }
}

impl Default for CompactOptions {
    fn default() -> Self {
        Self {
            selection: Selection::SealedOnly,
            steps_row_group_rows: DEFAULT_STEPS_ROW_GROUP_ROWS,
            trajectories_row_group_rows: DEFAULT_TRAJECTORIES_ROW_GROUP_ROWS,
            trajectories_row_group_min_bytes: DEFAULT_TRAJECTORIES_ROW_GROUP_MIN_BYTES,
            row_group_bytes: DEFAULT_ROW_GROUP_BYTES,
            shard_bytes: DEFAULT_SHARD_BYTES,
            compression: ShardCompression::default(),
            progress: None,
            collect_dead_fraction: Some(DEFAULT_COLLECT_DEAD_FRACTION),
            merge_fanout: Some(DEFAULT_MERGE_FANOUT),
            max_calls: None,
            batch_calls: Some(DEFAULT_BATCH_CALLS),
            copy_forward: Some(DEFAULT_COPY_FORWARD),
        }
    }
}

/// [`CompactOptions::copy_forward`]'s largest value: copies that fill a
/// segment of their own (as they do after a copy-forward) are then never
/// copied again.
pub const COPY_FORWARD_MAX: f64 = 0.5;

/// [`CompactOptions::copy_forward`]'s default.
pub const DEFAULT_COPY_FORWARD: f64 = 0.25;

/// [`CompactOptions::batch_calls`]'s default, and the live calls
/// collection and merging write again in one publication when it is
/// `None`: 2^20, ~0.35 GB of what a publication builds. Before this bound a
/// merge took a whole tier: eight generations of ~1M rows made one
/// publication of 8M rows.
pub const DEFAULT_BATCH_CALLS: u64 = 1 << 20;

/// [`CompactOptions::collect_dead_fraction`]'s default.
pub const DEFAULT_COLLECT_DEAD_FRACTION: f64 = 0.2;

/// [`CompactOptions::merge_fanout`]'s default.
pub const DEFAULT_MERGE_FANOUT: u32 = 8;

pub use collect::{merge_tier, MERGE_MAX_ROWS};

impl CompactOptions {
    /// Which sessions are taken.
    #[must_use]
    pub fn selection(mut self, v: Selection) -> Self {
        self.selection = v;
        self
    }
    /// Rows per `steps` row group, at most.
    #[must_use]
    pub fn steps_row_group_rows(mut self, v: usize) -> Self {
        self.steps_row_group_rows = v;
        self
    }
    /// Rows at which a `trajectories` row group is closed once it holds
    /// [`CompactOptions::trajectories_row_group_min_bytes`].
    #[must_use]
    pub fn trajectories_row_group_rows(mut self, v: usize) -> Self {
        self.trajectories_row_group_rows = v;
        self
    }
    /// Size (uncompressed estimate) a `trajectories` row group reaches
    /// before its rows close it; 0: rows alone close it.
    #[must_use]
    pub fn trajectories_row_group_min_bytes(mut self, v: usize) -> Self {
        self.trajectories_row_group_min_bytes = v;
        self
    }
    /// Size (uncompressed estimate) at which a row group of either table
    /// is closed, whatever its rows.
    #[must_use]
    pub fn row_group_bytes(mut self, v: usize) -> Self {
        self.row_group_bytes = v;
        self
    }
    /// Size (uncompressed estimate) at which a shard file is closed.
    #[must_use]
    pub fn shard_bytes(mut self, v: usize) -> Self {
        self.shard_bytes = v;
        self
    }
    /// Page compression of the shards.
    #[must_use]
    pub fn compression(mut self, v: ShardCompression) -> Self {
        self.compression = v;
        self
    }
    /// Collect generations whose dead rows reach this fraction of their rows
    /// (`None`: never; see [`CompactOptions::collect_dead_fraction`]).
    #[must_use]
    pub fn collect_dead_fraction(mut self, v: Option<f64>) -> Self {
        self.collect_dead_fraction = v;
        self
    }
    /// Merge earlier generations once this many share a size tier (`None`:
    /// never; see [`CompactOptions::merge_fanout`]).
    #[must_use]
    pub fn merge_fanout(mut self, v: Option<u32>) -> Self {
        self.merge_fanout = v;
        self
    }
    /// Copy stragglers forward out of segments they keep alone (`None`:
    /// never; see [`CompactOptions::copy_forward`]).
    #[must_use]
    pub fn copy_forward(mut self, v: Option<f64>) -> Self {
        self.copy_forward = v;
        self
    }
    /// At most about this many calls per compaction (whole sessions, oldest
    /// first); `None`: no limit.
    #[must_use]
    pub fn max_calls(mut self, v: Option<u64>) -> Self {
        self.max_calls = v;
        self
    }
    /// Publish in steps of at most about this many calls, new and moved
    /// together (default [`DEFAULT_BATCH_CALLS`]; `None`: one publication;
    /// see [`CompactOptions::batch_calls`]).
    #[must_use]
    pub fn batch_calls(mut self, v: Option<u64>) -> Self {
        self.batch_calls = v;
        self
    }

    /// Called after each session with (sessions done, sessions selected, calls).
    #[must_use]
    pub fn progress(mut self, f: impl Fn(u64, u64, u64) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }
}

/// What a compaction did.
#[derive(Debug, Clone, Default)]
pub struct CompactReport {
    pub sessions: usize,
    pub calls: u64,
    pub trajectories: u64,
    /// Logical token payload compacted: full prompts and completions as u32,
    /// logprobs as f32.
    pub token_bytes: u64,
    /// Shard files published (absolute paths).
    pub shards: Vec<PathBuf>,
    /// Bytes of the published shard files.
    pub shard_bytes: u64,
    pub retired_segments: usize,
    pub elapsed: Duration,
    /// Sessions left in the log because a call of theirs is damaged (session
    /// id, the error naming file and offset).
    pub sessions_damaged: Vec<(String, String)>,
    /// Collection: the earlier generations whose files were replaced for
    /// their dead rows.
    pub collected_generations: Vec<u64>,
    /// Merging: the earlier generations whose files were replaced for their
    /// size (small ones, written again together).
    pub merged_generations: Vec<u64>,
    /// The live calls of both, written again into this compaction's shards.
    pub moved_calls: u64,
    /// Their dead rows, dropped.
    pub dropped_rows: u64,
    /// Bytes of the files of both (freed once no reader holds them).
    pub collected_bytes: u64,
    /// Generations that could not be collected because a row of theirs is
    /// damaged (generation, the error); their files stay.
    pub collect_skipped: Vec<(u64, String)>,
    /// Sessions the selection chose that [`CompactOptions::max_calls`] left
    /// for a later compaction (0 without a limit).
    pub sessions_left: usize,
    /// Generations a collection or merge would have rewritten but left for
    /// later: a dead row of theirs is what keeps another record of its
    /// trace id dead (format-spec/shard.md §6.1). They are rewritten once
    /// that record is gone.
    pub collect_deferred: Vec<u64>,
    /// Shard files the deletions side table (format-spec/shard.md §9) could
    /// not read (path under `shards/`, the error: damage `trajlog verify`
    /// names): the rows of theirs that died since the table last read them
    /// are not listed; it keeps the rows it listed before.
    pub deletions_skipped: Vec<(String, String)>,
    /// The copy-forward collector ([`CompactOptions::copy_forward`]): the
    /// unfinished sessions it copied forward, their calls, and the bytes
    /// the copies take in segments.
    pub copied_sessions: u64,
    pub copied_calls: u64,
    pub copied_bytes: u64,
    /// Publications made ([`CompactOptions::batch_calls`]): 1 for a
    /// compaction that fit one.
    pub publications: usize,
}

impl CompactReport {
    /// Add what the next publication of the same compaction did.
    fn absorb(&mut self, r: CompactReport) {
        self.sessions += r.sessions;
        self.calls += r.calls;
        self.trajectories += r.trajectories;
        self.token_bytes += r.token_bytes;
        self.shards.extend(r.shards);
        self.shard_bytes += r.shard_bytes;
        self.retired_segments += r.retired_segments;
        self.elapsed += r.elapsed;
        // A session with a damaged call is chosen again by each: once.
        extend_new_keys(&mut self.sessions_damaged, r.sessions_damaged);
        self.collected_generations.extend(r.collected_generations);
        self.merged_generations.extend(r.merged_generations);
        self.moved_calls += r.moved_calls;
        self.dropped_rows += r.dropped_rows;
        self.collected_bytes += r.collected_bytes;
        extend_new_keys(&mut self.collect_skipped, r.collect_skipped);
        self.sessions_left = r.sessions_left;
        // What the last one left for later is what is left.
        self.collect_deferred = r.collect_deferred;
        self.deletions_skipped = r.deletions_skipped;
        self.copied_sessions += r.copied_sessions;
        self.copied_calls += r.copied_calls;
        self.copied_bytes += r.copied_bytes;
        self.publications += r.publications;
    }
}

/// Append the pairs of `more` whose key `to` does not hold yet.
fn extend_new_keys<K: PartialEq, V>(to: &mut Vec<(K, V)>, more: Vec<(K, V)>) {
    for (k, v) in more {
        if !to.iter().any(|(have, _)| *have == k) {
            to.push((k, v));
        }
    }
}

fn text(field: &str, bytes: Option<Vec<u8>>) -> Result<Option<String>> {
    bytes.map(|b| String::from_utf8(b).map_err(|_| Error::invalid(field, "JSON text is not UTF-8"))).transpose()
}

/// The steps of the calls of one session (its own, not those it shares as
/// an extra uid) that `take` accepts: its calls not yet compacted, and the
/// live calls a collection moves (None if there are none).
fn session_inputs(
    snap: &crate::Snapshot,
    sid: &str,
    take: &dyn Fn(&CallView<'_>) -> bool,
    token_bytes: &mut u64,
) -> Result<Option<(Vec<StepInput>, u64)>> {
    let calls = snap.session(sid, None, None)?;
    let own: Vec<&CallView<'_>> = calls.iter().filter(|c| c.session_id() == sid).collect();
    if !own.iter().any(|c| take(c)) {
        return Ok(None);
    }
    let mut ctx = Contexts::default();
    let mut inputs = Vec::with_capacity(own.len());
    let mut bytes = 0;
    let mut moved = 0;
    for (i, c) in own.iter().enumerate() {
        if !take(c) {
            continue;
        }
        moved += u64::from(c.is_compacted());
        let prompt = ctx.prompt(c)?;
        ctx.remember(c.loc, &prompt, c.completion_token_ids());
        let r = &c.record;
        let docs = c.docs_in(Some(&prompt), &ctx)?;
        ctx.remember_chat(c.loc, &docs.messages, &docs.response_message);
        bytes += 4 * (prompt.len() + r.completion.len() + r.logprobs.map_or(0, <[f32]>::len)) as u64;
        inputs.push(StepInput {
            loc: c.loc,
            parent: r.parent,
            relation: r.relation,
            divergence_position: c.divergence_position().map(|d| d as u32),
            call_index: i as u32,
            trace_id: r.trace_id.to_owned(),
            session_id: r.session_id.to_owned(),
            session_uids: r.session_uids.iter().map(|s| (*s).to_owned()).collect(),
            timestamp: r.timestamp,
            model: r.model.map(str::to_owned),
            weight_version: r.weight_version,
            prompt,
            completion: r.completion.to_vec(),
            logprobs: r.logprobs.map(<[f32]>::to_vec),
            finish_reason: r.finish_reason.map(str::to_owned),
            reward: snap.trace_reward(r.trace_id),
            messages: text("messages", docs.messages)?,
            response_message: text("response_message", docs.response_message)?,
            metadata: text("metadata", docs.metadata)?,
            latency_ms: r.latency_ms,
            routing_matrices: r.routing_matrices.map(<[u8]>::to_vec),
            extra: text("extra", docs.extra)?,
        });
    }
    *token_bytes += bytes;
    Ok(Some((inputs, moved)))
}

impl Store {
    /// Compact finished sessions into Parquet shards under `DIR/shards/`
    /// (format-spec/shard.md), then retire the segments nothing needs any more.
    /// Reads keep answering for compacted calls, now from the shards.
    pub fn compact(&self, options: &CompactOptions) -> Result<CompactReport> {
        let _one_at_a_time = self.compaction_guard();
        run(self, options)
    }
}

impl Store {
    /// [`Store::compact`], calling `meanwhile` once the shards are staged,
    /// before they are published: what the store is given then is what a
    /// compaction meets from other threads (the model test, tests/model.rs,
    /// appends, seals, deletes, rewards and rolls there). Not part of the API.
    #[doc(hidden)]
    pub fn compact_with_meanwhile(
        &self,
        options: &CompactOptions,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<CompactReport> {
        let _one_at_a_time = self.compaction_guard();
        run_with(self, options, meanwhile)
    }
}

fn run(store: &Store, opts: &CompactOptions) -> Result<CompactReport> {
    run_with(store, opts, &mut || {})
}

/// What writing a compaction's shards came to.
enum Written {
    /// Staged (not yet published), with the sessions compacted.
    Done { compacted: Vec<String>, staged: Vec<crate::format::manifest::PendingRename> },
    /// A damaged row of a generation being collected: nothing was staged;
    /// write again without these generations.
    Retry { generations: Vec<u64>, error: String },
}

/// Write the shards of a compaction: the selected sessions' calls not yet
/// compacted, and the live calls of the generations `plan` collects.
fn write_shards(
    snap: &crate::Snapshot,
    opts: &CompactOptions,
    generation: u64,
    shards_dir: &std::path::Path,
    selected: &[String],
    plan: &collect::Plan,
    report: &mut CompactReport,
) -> Result<Written> {
    let mut steps_w =
        TableWriter::new(shards_dir, "steps", generation, steps_schema(), opts.compression, opts.shard_bytes)?;
    let mut traj_w = TableWriter::new(
        shards_dir,
        "trajectories",
        generation,
        trajectories_schema(),
        opts.compression,
        opts.shard_bytes,
    )?;
    // Sessions with new calls, and sessions with live calls to move, in
    // session order; each once.
    let fresh: std::collections::HashSet<&str> = selected.iter().map(String::as_str).collect();
    let mut order: Vec<&str> = fresh.iter().copied().chain(plan.moved.keys().map(String::as_str)).collect();
    order.sort_unstable();
    order.dedup();
    let mut retry = None;
    // Reads go through a copy of the snapshot whose decoded shard row groups
    // are dropped as they pile up (a collection reads whole generations).
    let mut snap = snap.clone();
    snap.decode_whole_row_groups();
    let result = (|| -> Result<Vec<String>> {
        let mut steps = StepsBuilder::default();
        let mut trajs = TrajectoriesBuilder::default();
        let mut compacted = Vec::new();
        let mut released_at = 0;
        let mut index_pages = crate::storage::mmap::PageBudget::compaction();
        for (done, sid) in order.iter().enumerate() {
            let is_fresh = fresh.contains(sid);
            let take = |c: &CallView<'_>| match c.shard {
                None => is_fresh,
                Some(pos) => plan.shard_ids.contains(&pos.shard),
            };
            // A session with a damaged call stays in the log, whole, and is
            // reported; the others are compacted.
            let (inputs, moved) = match session_inputs(&snap, sid, &take, &mut report.token_bytes) {
                Ok(Some(found)) => found,
                Ok(None) => continue,
                Err(e) => {
                    if let Some(shards) = plan.moved.get(*sid) {
                        // Rows of it would be lost with its generation's files.
                        let generations = shards.iter().filter_map(|id| plan.generation_of_shard.get(id)).copied();
                        retry = Some((generations.collect(), e.to_string()));
                        return Ok(Vec::new());
                    }
                    report.sessions_damaged.push(((*sid).to_owned(), e.to_string()));
                    continue;
                }
            };
            for s in &inputs {
                steps.push(s);
                if steps.rows >= opts.steps_row_group_rows || steps.bytes >= opts.row_group_bytes {
                    let bytes = steps.bytes;
                    steps_w.write_row_group(&steps.finish()?, bytes)?;
                }
            }
            let group = group_id(sid, inputs.first().and_then(|s| s.metadata.as_deref()));
            let session_reward = snap.session_reward(sid);
            for (k, t) in chains(&inputs).iter().enumerate() {
                trajs.push(sid, k as u32, &group, t, session_reward);
                report.trajectories += 1;
                if trajectories_group_full(opts, trajs.rows, trajs.bytes) {
                    let bytes = trajs.bytes;
                    traj_w.write_row_group(&trajs.finish()?, bytes)?;
                }
            }
            report.moved_calls += moved;
            report.calls += inputs.len() as u64 - moved;
            if inputs.len() as u64 > moved {
                report.sessions += 1;
            }
            // The segments' pages read so far are given back now and then,
            // so that a compaction's resident set does not grow with the
            // store it reads (limits.rs RELEASE_PAGES_EVERY_BYTES).
            if report.token_bytes >= released_at + RELEASE_PAGES_EVERY_BYTES {
                snap.release_pages();
                released_at = report.token_bytes;
            }
            snap.bound_decoded(SCAN_DECODED_BYTES_MAX);
            // The index lookups of each session's calls (its frozen rows,
            // their placements) read pages all over the shard index file
            // (a merge of 1M rows on 10M: ~0.8 GB resident).
            index_pages.ticks_n(inputs.len() as u64, || snap.release_pages());
            compacted.push((*sid).to_owned());
            if let Some(progress) = &opts.progress {
                progress(done as u64 + 1, order.len() as u64, report.calls + report.moved_calls);
            }
        }
        if steps.rows > 0 {
            let bytes = steps.bytes;
            steps_w.write_row_group(&steps.finish()?, bytes)?;
        }
        if trajs.rows > 0 {
            let bytes = trajs.bytes;
            traj_w.write_row_group(&trajs.finish()?, bytes)?;
        }
        Ok(compacted)
    })();
    // The publication needs the index next, not the pages read: they are
    // given back before it, and the decoded row groups with the copy.
    snap.release_pages();
    drop(snap);
    let staged_steps = steps_w.finish();
    let staged_traj = traj_w.finish();
    match (result, staged_steps, staged_traj) {
        (Ok(compacted), Ok(mut a), Ok(b)) if retry.is_none() => {
            a.extend(b);
            Ok(Written::Done { compacted, staged: a })
        }
        (r, a, b) => {
            // Nothing was published: remove what was staged.
            for p in a.into_iter().chain(b).flatten() {
                let _ = std::fs::remove_file(shards_dir.join(&p.staged));
            }
            match (r, retry) {
                (Ok(_), Some((generations, error))) => Ok(Written::Retry { generations, error }),
                (r, _) => Err(r.err().unwrap_or_else(|| Error::new(crate::ErrorKind::Io, "writing shards failed"))),
            }
        }
    }
}

/// The sessions one compaction takes of those chosen ((first timestamp,
/// calls, session)) and how many it leaves: all without a limit, else
/// whole sessions oldest first (ties by id) until the next would pass
/// `max_calls`, at least one; returned by id.
fn take_up_to(chosen: &[(f64, u64, String)], max_calls: Option<u64>) -> (Vec<String>, usize) {
    let Some(max) = max_calls else {
        return (chosen.iter().map(|(_, _, s)| s.clone()).collect(), 0);
    };
    let mut oldest: Vec<&(f64, u64, String)> = chosen.iter().collect();
    oldest.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.2.cmp(&b.2)));
    let mut calls = 0u64;
    let mut taken = 0;
    for (_, n, _) in &oldest {
        if taken > 0 && calls.saturating_add(*n) > max {
            break;
        }
        calls = calls.saturating_add(*n);
        taken += 1;
    }
    // In the order an unlimited compaction takes them (the maps' order).
    let mut ids: Vec<String> = oldest.iter().take(taken).map(|(_, _, s)| s.clone()).collect();
    ids.sort_unstable();
    (ids, chosen.len() - taken)
}

/// [`run`], calling `before_publish` once the shards of each publication
/// are staged, before they are published (tests use it to change the store
/// meanwhile). Publishes in steps of at most about
/// [`CompactOptions::batch_calls`] calls until every selected session is
/// compacted (or `max_calls` is reached).
pub(crate) fn run_with(
    store: &Store,
    opts: &CompactOptions,
    before_publish: &mut dyn FnMut(),
) -> Result<CompactReport> {
    check_options(opts)?;
    let mut total = CompactReport::default();
    let mut budget = opts.batch_calls;
    // The sessions this compaction takes, chosen by its first publication
    // (`max_calls` applied): sessions sealed meanwhile wait for the next
    // compaction, so that a steady flow of them cannot keep this one going.
    let mut taking: Option<std::collections::HashSet<String>> = None;
    let mut left_by_max = 0;
    loop {
        let done = (total.sessions as u64, total.calls + total.moved_calls);
        let (r, left) = publish_one(store, opts, &mut taking, budget, done, before_publish)?;
        left_by_max += left;
        let compacted_nothing = r.sessions == 0;
        total.absorb(r);
        if opts.batch_calls.is_none() || total.sessions_left == 0 {
            total.sessions_left += left_by_max;
            return Ok(total);
        }
        // Sessions with damaged calls are never compacted and stay chosen,
        // oldest first: a publication that took only those compacted
        // nothing. The next takes twice as many calls, until one compacts
        // something or takes every session left.
        budget = if compacted_nothing { budget.map(|n| n.saturating_mul(2)) } else { opts.batch_calls };
    }
}

/// Whether a `trajectories` row group of `rows` rows and `bytes` bytes
/// (uncompressed estimate) is closed.
fn trajectories_group_full(opts: &CompactOptions, rows: usize, bytes: usize) -> bool {
    bytes >= opts.row_group_bytes
        || (rows >= opts.trajectories_row_group_rows && bytes >= opts.trajectories_row_group_min_bytes)
        || rows >= opts.trajectories_row_group_rows.max(TRAJECTORIES_ROW_GROUP_ROWS_MAX)
}

/// Refuse options out of their ranges, naming the option.
fn check_options(opts: &CompactOptions) -> Result<()> {
    if opts.steps_row_group_rows == 0 || opts.trajectories_row_group_rows == 0 {
        return Err(Error::invalid("row_group_rows", "must be at least 1"));
    }
    if opts.row_group_bytes == 0 {
        return Err(Error::invalid("row_group_bytes", "must be at least 1"));
    }
    if let Some(f) = opts.collect_dead_fraction {
        if !(0.0..=1.0).contains(&f) {
            return Err(Error::invalid("collect_dead_fraction", format!("{f} is not a fraction between 0 and 1")));
        }
    }
    if let Some(f) = opts.copy_forward {
        if !(0.0..=COPY_FORWARD_MAX).contains(&f) {
            return Err(Error::invalid(
                "copy_forward",
                format!("{f} is not a fraction between 0 and {COPY_FORWARD_MAX} (a segment must be at least twice what copying frees it costs, or copies alone in a segment would be copied again at every compaction)"),
            ));
        }
    }
    if let Some(f) = opts.merge_fanout {
        if f < 2 {
            return Err(Error::invalid("merge_fanout", format!("{f} is under 2 (a merge needs two generations)")));
        }
    }
    if opts.max_calls == Some(0) {
        return Err(Error::invalid("max_calls", "must be at least 1 (None: no limit)"));
    }
    if opts.batch_calls == Some(0) {
        return Err(Error::invalid("batch_calls", "must be at least 1 (None: one publication)"));
    }
    if let Selection::OlderThan(s) = opts.selection {
        if !s.is_finite() || s < 0.0 {
            return Err(Error::invalid("older_than", format!("{s} is not a finite, non-negative number of seconds")));
        }
    }
    Ok(())
}

/// One publication: what collection and merging write again, then the new
/// calls of the sessions in `taking` (whole sessions, oldest first, at
/// least one) within what that leaves of `budget` calls
/// ([`CompactOptions::batch_calls`]; without one, collection and merging
/// within [`DEFAULT_BATCH_CALLS`] and the new calls unbounded). The first
/// publication of a compaction (`taking` is `None`) sets `taking` to the
/// sessions chosen then, up to `max_calls`, and returns how many that
/// left (0 for the later ones) besides its report (`sessions_left`: those of `taking` left for
/// the next publication). `done`: the sessions and calls of the earlier
/// publications, for the progress.
fn publish_one(
    store: &Store,
    opts: &CompactOptions,
    taking: &mut Option<std::collections::HashSet<String>>,
    budget: Option<u64>,
    done: (u64, u64),
    before_publish: &mut dyn FnMut(),
) -> Result<(CompactReport, usize)> {
    let started = Instant::now();
    // Seal the active segment so that what gets compacted can be retired, and
    // compact what is durable then.
    let compaction = store.begin_compaction()?;
    let snap = compaction.snapshot()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    // Only sessions of the index's maps can have calls in segments: those
    // compacted before (frozen, or not written to since) are left out from
    // the index alone, so a compaction's work is what is new and nothing
    // already compacted is listed, read or decoded again.
    // (first call's timestamp, live calls, session)
    let mut chosen_sessions: Vec<(f64, u64, String)> = Vec::new();
    // The walk reads the cold layer whole (mapped from the backlog index
    // file, 0.76 GB at 10M calls in segments): its pages are given back
    // as it goes.
    let mut walked = 0u64;
    snap.for_each_session_in_maps(|s| {
        let chosen = match opts.selection {
            Selection::SealedOnly => s.sealed,
            Selection::OlderThan(secs) => s.last_timestamp < now - secs,
        };
        if chosen && snap.has_calls_in_segments(&s.session_id) {
            chosen_sessions.push((s.first_timestamp, s.calls as u64, s.session_id));
        }
        walked += 1;
        if walked.is_multiple_of(SELECTION_RELEASE_EVERY) {
            snap.release_pages();
        }
    });
    snap.release_pages();
    let mut left_by_max = 0;
    let taking = taking.get_or_insert_with(|| {
        let (taken, left) = take_up_to(&chosen_sessions, opts.max_calls);
        left_by_max = left;
        taken.into_iter().collect()
    });
    chosen_sessions.retain(|(_, _, s)| taking.contains(s));
    let generation = compaction.generation();
    let shards_dir = store.dir().join(SHARDS_DIR);
    // A generation a damaged row keeps from being collected is left out and
    // the shards are written again without it (rare: it costs what was
    // written up to the damage).
    let mut excluded = std::collections::HashSet::new();
    let mut skipped = Vec::new();
    // Generations a dead row of which must stay for now (see
    // `Snapshot::shards_holding_undroppable_dead_rows`).
    let mut deferred = std::collections::BTreeSet::new();
    // What collection and merging may write again (format-spec/shard.md §6.4).
    let moves = budget.unwrap_or(DEFAULT_BATCH_CALLS);
    let (mut report, plan, compacted, mut staged, sessions_left) = loop {
        let plan = loop {
            let not_now: std::collections::HashSet<u64> = excluded.iter().chain(&deferred).copied().collect();
            let plan = collect::plan(&snap, opts.collect_dead_fraction, opts.merge_fanout, &not_now, moves);
            // Only files with a dead row can hold one back (a merge of
            // live rows reads nothing here).
            let dead: std::collections::HashSet<u32> =
                plan.shard_ids.intersection(&plan.with_dead_rows).copied().collect();
            let (held, unreadable) =
                snap.shards_holding_undroppable_dead_rows(&dead, &|t| compaction.shard_rows_of_trace(t));
            let (held_before, excluded_before) = (deferred.len(), excluded.len());
            deferred.extend(held.iter().filter_map(|s| plan.generation_of_shard.get(s).copied()));
            // A file whose rows cannot be read cannot be rewritten either:
            // its generation is skipped, with the error, as a damaged row's.
            for (shard, error) in unreadable {
                if let Some(g) = plan.generation_of_shard.get(&shard).copied() {
                    if excluded.insert(g) {
                        skipped.push((g, error));
                    }
                }
            }
            if deferred.len() == held_before && excluded.len() == excluded_before {
                break plan;
            }
        };
        // New calls fill what the calls written again leave of the budget.
        let room = budget.map(|b| b.saturating_sub(plan.moved_rows));
        let (selected, sessions_left) = take_up_to(&chosen_sessions, room);
        // Progress over the whole compaction: this publication's sessions
        // after the earlier ones', and those left for the next.
        let mut opts = opts.clone();
        if let Some(progress) = opts.progress.take() {
            let (sessions_before, calls_before) = done;
            let left = sessions_left as u64;
            opts.progress = Some(Arc::new(move |d, n, calls| {
                progress(sessions_before + d, sessions_before + n + left, calls_before + calls)
            }));
        }
        let mut report = CompactReport::default();
        match write_shards(&snap, &opts, generation, &shards_dir, &selected, &plan, &mut report)? {
            Written::Done { compacted, staged } => break (report, plan, compacted, staged, sessions_left),
            Written::Retry { generations, error } => {
                for g in generations {
                    if excluded.insert(g) {
                        skipped.push((g, error.clone()));
                    }
                }
            }
        }
    };
    // A generation with a file whose footer could not be decoded is left
    // alone too, and said so.
    for (g, why) in &plan.unreadable {
        if !skipped.iter().any(|(s, _)| s == g) {
            skipped.push((*g, why.clone()));
        }
    }
    report.collect_skipped = skipped;
    report.collect_deferred = deferred.into_iter().collect();
    report.sessions_left = sessions_left;
    report.collected_generations = plan.generations.iter().filter(|g| !plan.merged.contains(g)).copied().collect();
    report.merged_generations = plan.merged.clone();
    report.dropped_rows = plan.dead_rows;
    report.collected_bytes = collect::bytes_of(&shards_dir, &plan.generations);
    drop(snap);
    // The rows decoded for the shards were freed in small blocks that glibc
    // keeps resident: given back before the publication allocates its own
    // (a 1M-row merge on a 10M-call store: ~0.15 GB of the peak).
    crate::storage::mmap::trim_heap();
    staged.retain(|p| p.shard.rows > 0);
    before_publish();
    let obsolete =
        crate::store::Obsolete { generations: plan.generations, shard_ids: plan.shard_ids.into_iter().collect() };
    // A batched compaction (this call's next publication, or the next call
    // of `trajlog compact --batch-calls`, which bounds each by `max_calls`):
    // the live rows counted after this publication are kept for the next
    // batch's collection plan. (Until the next publication forgets them,
    // the count holds the index trees of after this one: those of the
    // calls not compacted yet.) A compaction's last publication keeps
    // nothing: the next compaction may come much later.
    let keep_liveness = (opts.batch_calls.is_some() && sessions_left > 0) || opts.max_calls.is_some();
    let outcome =
        store.publish_compaction(compaction, staged.clone(), compacted, &obsolete, opts.copy_forward, keep_liveness)?;
    report.retired_segments = outcome.retired_segments.len();
    report.copied_sessions = outcome.copied_forward.sessions;
    report.copied_calls = outcome.copied_forward.calls;
    report.copied_bytes = outcome.copied_forward.bytes;
    report.deletions_skipped = outcome.deletions_skipped;
    for p in &staged {
        let path = shards_dir.join(&p.shard.path);
        report.shard_bytes += std::fs::metadata(&path).map_or(0, |m| m.len());
        report.shards.push(path);
    }
    // What the compaction decoded and built (and, after a publication that
    // wrote the shard index file, the writer's index it replaced) is freed
    // by now, in small blocks glibc keeps resident on its own: a long-lived
    // writer that merged 800k rows kept ~300 MB more heap without this.
    crate::storage::mmap::trim_heap();
    report.elapsed = started.elapsed();
    report.publications = 1;
    Ok((report, left_by_max))
}
