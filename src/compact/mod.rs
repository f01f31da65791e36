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

pub mod build;
pub mod reader;
pub mod schema;
pub mod writer;

use crate::error::{Error, Result};
use crate::format::record::Loc;
use crate::snapshot::CallView;
use crate::store::{Store, SHARDS_DIR};
use build::{chains, group_id, StepInput, StepsBuilder, TrajectoriesBuilder};
use schema::{steps_schema, trajectories_schema};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
pub use writer::ShardCompression;
use writer::TableWriter;

/// Default rows per `steps` row group.
pub const DEFAULT_STEPS_ROW_GROUP_ROWS: usize = 256;
/// Default rows per `trajectories` row group (each row is a whole sequence).
pub const DEFAULT_TRAJECTORIES_ROW_GROUP_ROWS: usize = 64;
/// Default size (uncompressed estimate) at which a shard file is closed.
pub const DEFAULT_SHARD_BYTES: usize = 256 * 1024 * 1024;

/// Which sessions a compaction takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Selection {
    /// Sessions marked sealed (all their calls are in).
    SealedOnly,
    /// Sessions whose last call's timestamp is older than this many seconds.
    OlderThan(f64),
}

/// Options of [`Store::compact`].
#[derive(Debug, Clone)]
pub struct CompactOptions {
    pub selection: Selection,
    pub steps_row_group_rows: usize,
    pub trajectories_row_group_rows: usize,
    pub shard_bytes: usize,
    pub compression: ShardCompression,
    /// Draw a progress bar on stderr when it is a terminal.
    pub progress: bool,
}

impl Default for CompactOptions {
    fn default() -> Self {
        Self {
            selection: Selection::SealedOnly,
            steps_row_group_rows: DEFAULT_STEPS_ROW_GROUP_ROWS,
            trajectories_row_group_rows: DEFAULT_TRAJECTORIES_ROW_GROUP_ROWS,
            shard_bytes: DEFAULT_SHARD_BYTES,
            compression: ShardCompression::default(),
            progress: false,
        }
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
}

fn text(field: &str, bytes: Option<&[u8]>) -> Result<Option<String>> {
    bytes
        .map(|b| String::from_utf8(b.to_vec()).map_err(|_| Error::invalid(field, "JSON text is not UTF-8")))
        .transpose()
}

/// Recent contexts (`prompt ++ completion`) of the session being compacted, so
/// that prompts are rebuilt from the parent's context instead of walking the
/// whole chain for every call.
struct Contexts {
    map: HashMap<Loc, Arc<Vec<u32>>>,
    order: VecDeque<Loc>,
}

impl Contexts {
    const KEEP: usize = 16;

    fn prompt(&self, view: &CallView<'_>) -> Result<Vec<u32>> {
        if let Some(ctx) = view.parent().and_then(|p| self.map.get(&p)) {
            if let Some(prefix) = ctx.get(..view.prompt_prefix_len()) {
                let mut out = Vec::with_capacity(view.prompt_len());
                out.extend_from_slice(prefix);
                out.extend_from_slice(view.prompt_suffix());
                return Ok(out);
            }
        }
        view.prompt()
    }

    fn remember(&mut self, loc: Loc, prompt: &[u32], completion: &[u32]) {
        let mut ctx = Vec::with_capacity(prompt.len() + completion.len());
        ctx.extend_from_slice(prompt);
        ctx.extend_from_slice(completion);
        self.map.insert(loc, Arc::new(ctx));
        self.order.push_back(loc);
        while self.order.len() > Self::KEEP {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

/// The steps of one session's calls not yet compacted (None if there are none).
fn session_inputs(snap: &crate::Snapshot, sid: &str, token_bytes: &mut u64) -> Result<Option<Vec<StepInput>>> {
    let calls = snap.session(sid, None, None)?;
    let own: Vec<&CallView<'_>> = calls.iter().filter(|c| c.session_id() == sid).collect();
    if own.iter().all(|c| c.is_compacted()) {
        return Ok(None);
    }
    let mut ctx = Contexts { map: HashMap::new(), order: VecDeque::new() };
    let mut inputs = Vec::with_capacity(own.len());
    let mut bytes = 0;
    for (i, c) in own.iter().enumerate() {
        if c.is_compacted() {
            continue;
        }
        let prompt = ctx.prompt(c)?;
        ctx.remember(c.loc, &prompt, c.completion_token_ids());
        let r = &c.record;
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
            messages: text("messages", r.messages)?,
            response_message: text("response_message", r.response_message)?,
            metadata: text("metadata", r.metadata)?,
            latency_ms: r.latency_ms,
            routing_matrices: r.routing_matrices.map(<[u8]>::to_vec),
            extra: text("extra", r.extra)?,
        });
    }
    *token_bytes += bytes;
    Ok(Some(inputs))
}

fn progress_bar(n: usize, enabled: bool) -> Option<indicatif::ProgressBar> {
    if !enabled {
        return None;
    }
    crate::progress::bar(n as u64, "compacting", "sessions")
}

pub(crate) fn run(store: &Store, opts: &CompactOptions) -> Result<CompactReport> {
    run_with(store, opts, &mut || {})
}

/// [`run`], calling `before_publish` once the shards are staged, before they
/// are published (tests use it to change the store meanwhile).
pub(crate) fn run_with(
    store: &Store,
    opts: &CompactOptions,
    before_publish: &mut dyn FnMut(),
) -> Result<CompactReport> {
    if opts.steps_row_group_rows == 0 || opts.trajectories_row_group_rows == 0 {
        return Err(Error::invalid("row_group_rows", "must be at least 1"));
    }
    if let Selection::OlderThan(s) = opts.selection {
        if !s.is_finite() || s < 0.0 {
            return Err(Error::invalid("older_than", format!("{s} is not a finite, non-negative number of seconds")));
        }
    }
    let started = Instant::now();
    // Seal the active segment so that what gets compacted can be retired, and
    // compact what is durable then.
    let compaction = store.begin_compaction()?;
    let snap = compaction.snapshot()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let selected: Vec<String> = snap
        .sessions()
        .into_iter()
        .filter(|s| match opts.selection {
            Selection::SealedOnly => s.sealed,
            Selection::OlderThan(secs) => s.last_timestamp < now - secs,
        })
        .map(|s| s.session_id)
        .collect();
    let generation = compaction.generation();
    let shards_dir = store.dir().join(SHARDS_DIR);
    let mut steps_w =
        TableWriter::new(&shards_dir, "steps", generation, steps_schema(), opts.compression, opts.shard_bytes)?;
    let mut traj_w = TableWriter::new(
        &shards_dir,
        "trajectories",
        generation,
        trajectories_schema(),
        opts.compression,
        opts.shard_bytes,
    )?;
    let mut report = CompactReport::default();
    let result = (|| -> Result<Vec<String>> {
        let bar = progress_bar(selected.len(), opts.progress);
        let mut steps = StepsBuilder::default();
        let mut trajs = TrajectoriesBuilder::default();
        let mut compacted = Vec::new();
        for sid in &selected {
            if let Some(bar) = &bar {
                bar.inc(1);
            }
            // A session with a damaged call stays in the log, whole, and is
            // reported; the others are compacted.
            let inputs = match session_inputs(&snap, sid, &mut report.token_bytes) {
                Ok(Some(inputs)) => inputs,
                Ok(None) => continue,
                Err(e) => {
                    report.sessions_damaged.push((sid.clone(), e.to_string()));
                    continue;
                }
            };
            for s in &inputs {
                steps.push(s);
                if steps.rows >= opts.steps_row_group_rows {
                    let bytes = steps.bytes;
                    steps_w.write_row_group(&steps.finish()?, bytes)?;
                }
            }
            let group = group_id(sid, inputs.first().and_then(|s| s.metadata.as_deref()));
            let session_reward = snap.session_reward(sid);
            for (k, t) in chains(&inputs).iter().enumerate() {
                trajs.push(sid, k as u32, &group, t, session_reward);
                report.trajectories += 1;
                if trajs.rows >= opts.trajectories_row_group_rows {
                    let bytes = trajs.bytes;
                    traj_w.write_row_group(&trajs.finish()?, bytes)?;
                }
            }
            report.calls += inputs.len() as u64;
            report.sessions += 1;
            compacted.push(sid.clone());
            if let Some(bar) = &bar {
                bar.set_message(format!("{} calls", report.calls));
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
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        Ok(compacted)
    })();
    let staged_steps = steps_w.finish();
    let staged_traj = traj_w.finish();
    let (compacted, mut staged) = match (result, staged_steps, staged_traj) {
        (Ok(c), Ok(mut a), Ok(b)) => {
            a.extend(b);
            (c, a)
        }
        (r, a, b) => {
            // Nothing was published: remove what was staged.
            for p in a.into_iter().chain(b).flatten() {
                let _ = std::fs::remove_file(shards_dir.join(&p.staged));
            }
            return Err(r.err().unwrap_or_else(|| Error::new(crate::ErrorKind::Io, "writing shards failed")));
        }
    };
    drop(snap);
    staged.retain(|p| p.shard.rows > 0);
    before_publish();
    let outcome = store.publish_compaction(compaction, staged.clone(), compacted)?;
    report.retired_segments = outcome.retired_segments.len();
    for p in &staged {
        let path = shards_dir.join(&p.shard.path);
        report.shard_bytes += std::fs::metadata(&path).map_or(0, |m| m.len());
        report.shards.push(path);
    }
    report.elapsed = started.elapsed();
    Ok(report)
}
