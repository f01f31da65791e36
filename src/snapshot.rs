//! Snapshot reads: by trace id, by session, session listing, full scans — all
//! served as views into the mapped segment files (zero-copy).
//!
//! A [`Snapshot`] is an `Arc` of a published [`View`]: the indexes at one point
//! of the log plus `Arc`s of the segment mappings it needs. Holding it keeps
//! those mappings alive; it never changes, whatever the writer does meanwhile.

use crate::error::{Error, Result};
pub use crate::format::docs::Docs;
use crate::format::docs::{self, Columns, Spliced};
use crate::format::record::{decode_call, CallRecord, Loc, Relation};
use crate::index::Index;
use crate::limits::MESSAGES_DELTA_DEPTH_MAX;
use crate::record::Call;
use crate::segment::SegmentRef;
use crate::shard::reader::{call_from_row, ShardFile, ShardPos};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

/// What a snapshot sees.
#[derive(Debug, Clone)]
pub struct View {
    pub(crate) index: Index,
    pub(crate) segments: imbl::OrdMap<u64, SegmentRef>,
    /// Published `steps` shards, by shard id, and where each compacted call
    /// is served from.
    pub(crate) shards: ShardSlots,
    /// Damage found and confined when the store was opened.
    pub(crate) damage: Arc<Vec<crate::error::Problem>>,
}

/// The `steps` shards of a view (see [`ShardSet`]), shared by the views
/// published between two publications.
pub(crate) type ShardSlots = Arc<crate::shard::set::ShardSet>;

/// Decoded shard rows, kept so that views into them can borrow from the
/// snapshot (an append-only map: entries never move while it is borrowed).
/// An entry is a run of rows of one row group, keyed by (shard, row group,
/// first row, end row); `ranges` lists the runs decoded per row group, to find the
/// one holding a row. [`Snapshot::bound_decoded`] evicts from both, which
/// needs `&mut`: no view can be alive then. `bytes` is their memory, `clock`
/// the use counter that orders evictions (least recently used first).
#[derive(Default)]
struct RowGroupCache {
    batches: elsa::sync::FrozenMap<(u32, u32, u32, u32), Box<Decoded>>,
    ranges: std::sync::Mutex<HashMap<(u32, u32), Runs>>,
    bytes: AtomicUsize,
    clock: AtomicU64,
}

/// The runs of rows of one row group decoded so far.
type Runs = Vec<std::ops::Range<u32>>;

/// Decoded rows of a row group, from row `first` on, with their memory and
/// when they were last read.
struct Decoded {
    batch: arrow_array::RecordBatch,
    first: u32,
    bytes: usize,
    used: AtomicU64,
}

impl std::fmt::Debug for RowGroupCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowGroupCache").field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

/// A consistent read view of a store: cheap to take, safe to hold while the
/// writer appends, seals, rolls and compacts.
#[derive(Debug)]
pub struct Snapshot {
    pub(crate) view: Arc<View>,
    row_groups: std::sync::OnceLock<RowGroupCache>,
    /// Decode whole row groups (scans: each is read once for all its
    /// sessions), not only the rows a read needs (point reads).
    whole_row_groups: bool,
}

/// A clone shares the view, not the decoded rows: it starts with none, and
/// in point-read mode (scans call [`Snapshot::decode_whole_row_groups`] on
/// their clone).
impl Clone for Snapshot {
    fn clone(&self) -> Self {
        Snapshot::new(self.view.clone())
    }
}

/// See [`Snapshot::index_layers`]. Serialized as `trajlog space --json`'s
/// and Python `Store.space()`'s `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct IndexLayers {
    /// Live calls in all.
    #[serde(rename = "live_calls")]
    pub calls: usize,
    /// Of them, in the frozen layer.
    pub frozen_calls: usize,
    /// The frozen layer's heap bytes (its tables are in the shard index
    /// file when the open found one: then only its seal and reward flags).
    pub frozen_bytes: usize,
    /// Of the live calls, in the cold layers: calls in sealed segments of
    /// sessions nothing else names, held in flat arrays (ARCHITECTURE.md,
    /// "Two index layers").
    pub cold_calls: usize,
    /// The cold layers' heap bytes.
    pub cold_bytes: usize,
    /// How many cold layers hold them: the backlog index file's, and one an
    /// open through it built over the records the file does not hold
    /// (format-spec/backlog-index.md §1); 0: none.
    pub cold_layers: usize,
    /// Size of the shard index file the view reads its compacted calls'
    /// placements and frozen layer from, mapped (0: none; the open decoded
    /// the shards). format-spec/shard-index.md.
    pub index_file_bytes: u64,
    /// Annotation-only segments whose seals and rewards the open took from
    /// the annotation cache instead of replaying their records
    /// (format-spec/shard-index.md §7); 0: none.
    pub cached_annotation_segments: usize,
    /// Sealed segments whose footers the open took from the backlog index
    /// file (its cold layer then mapped from it, format-spec/backlog-index.md)
    /// instead of reading them; 0: none.
    pub backlog_segments: usize,
}

/// Summary of one session.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionInfo {
    pub session_id: String,
    pub calls: usize,
    pub first_timestamp: f64,
    pub last_timestamp: f64,
    pub sealed: bool,
    pub reward: Option<f64>,
}

/// Segment facts for diagnostics and statistics.
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    pub id: u64,
    pub path: std::path::PathBuf,
    pub sealed: bool,
    /// Bytes of header + committed frames.
    pub data_bytes: u64,
    /// Address range of the mapping (zero-copy checks).
    pub mapped: std::ops::Range<usize>,
}

/// One call, viewed in place: its token slices point into the mapped segment,
/// or, for a compacted call, into the snapshot's decoded shard row group.
#[derive(Debug, Clone)]
pub struct CallView<'a> {
    /// The call record's position in the log.
    pub loc: Loc,
    pub record: CallRecord<'a>,
    /// Where it is served from, when compacted.
    pub shard: Option<ShardPos>,
    divergence: Option<usize>,
    snapshot: &'a Snapshot,
}

impl<'a> CallView<'a> {
    pub fn trace_id(&self) -> &'a str {
        self.record.trace_id
    }
    pub fn session_id(&self) -> &'a str {
        self.record.session_id
    }
    pub fn timestamp(&self) -> f64 {
        self.record.timestamp
    }
    /// Completion token ids, in place.
    pub fn completion_token_ids(&self) -> &'a [u32] {
        self.record.completion
    }
    /// Logprobs, in place.
    pub fn logprobs(&self) -> Option<&'a [f32]> {
        self.record.logprobs
    }
    /// The stored part of the prompt, in place: `prompt[prompt_prefix_len()..]`.
    pub fn prompt_suffix(&self) -> &'a [u32] {
        self.record.prompt_suffix
    }
    /// Leading prompt tokens shared with the parent's context (not stored here).
    pub fn prompt_prefix_len(&self) -> usize {
        self.record.prefix_len as usize
    }
    pub fn prompt_len(&self) -> usize {
        self.record.prompt_len as usize
    }
    pub fn parent(&self) -> Option<Loc> {
        self.record.parent
    }
    pub fn relation(&self) -> Relation {
        self.record.relation
    }
    /// For a TI/TO break or an earlier divergence: the first prompt position
    /// that differs from the parent's context.
    pub fn divergence_position(&self) -> Option<usize> {
        self.divergence
    }
    /// Whether the call is served from a Parquet shard (compacted).
    pub fn is_compacted(&self) -> bool {
        self.shard.is_some()
    }
    /// The full prompt, materialized from the parent chain.
    pub fn prompt(&self) -> Result<Vec<u32>> {
        self.snapshot.materialize_prompt(self)
    }
    /// An owned copy of the call as it was appended.
    pub fn to_call(&self) -> Result<Call> {
        self.to_call_with_prompt(self.prompt()?)
    }

    /// [`CallView::to_call`], with `extra` left as a checked template
    /// ([`Spliced`]) when the call keeps it in a docs block (the call's
    /// `extra` is then `None`); see [`Snapshot::session_calls_spliced`].
    pub fn to_call_spliced(&self) -> Result<(Call, Option<Spliced>)> {
        let prompt = self.prompt()?;
        let (docs, spliced) = self.resolve_docs(Some(&prompt), &Contexts::default(), Resolve::ButExtra, 0)?;
        Ok((self.call_with_columns(docs, prompt), spliced))
    }

    /// [`CallView::to_call`] with the full prompt already materialized.
    pub(crate) fn to_call_with_prompt(&self, prompt: Vec<u32>) -> Result<Call> {
        let (docs, _) = self.resolve_docs(Some(&prompt), &Contexts::default(), Resolve::All, 0)?;
        Ok(self.call_with_columns(docs, prompt))
    }

    /// The call with its documents and its columns (`prompt` materialized).
    fn call_with_columns(&self, docs: Docs, prompt: Vec<u32>) -> Call {
        let mut call = self.call_with_docs(docs);
        call.prompt_token_ids = prompt;
        call.completion_token_ids = self.record.completion.to_vec();
        call.logprobs = self.record.logprobs.map(<[f32]>::to_vec);
        call
    }

    /// The call's four JSON documents (`messages`, `response_message`,
    /// `metadata`, `extra`) as appended. A record of format version 2 may
    /// keep them in a docs block whose references to the token columns are
    /// put back here (format-spec/record.md §7); a reference to the prompt
    /// materializes it.
    pub fn docs(&self) -> Result<Docs> {
        self.docs_in(None, &Contexts::default())
    }

    /// [`CallView::docs`] with the full prompt when the caller has it, and a
    /// messages-delta parent's documents from `ctx` when it has them.
    pub(crate) fn docs_in(&self, prompt: Option<&[u32]>, ctx: &Contexts) -> Result<Docs> {
        Ok(self.resolve_docs(prompt, ctx, Resolve::All, 0)?.0)
    }

    /// The documents (see [`Resolve`]), `depth` ancestors below the call
    /// being read.
    fn resolve_docs(
        &self,
        prompt: Option<&[u32]>,
        ctx: &Contexts,
        mode: Resolve,
        depth: u32,
    ) -> Result<(Docs, Option<Spliced>)> {
        let r = &self.record;
        let chat_only = mode == Resolve::Chat;
        let Some(d) = r.docs else {
            let docs = Docs {
                messages: r.messages.map(<[u8]>::to_vec),
                response_message: r.response_message.map(<[u8]>::to_vec),
                metadata: r.metadata.map(<[u8]>::to_vec),
                extra: r.extra.map(<[u8]>::to_vec),
            };
            return Ok((docs, None));
        };
        let corrupt = |e: crate::format::DecodeError| match self.snapshot.segment(self.loc.segment) {
            Ok(seg) => Error::corrupt(seg.path.as_path(), self.loc.offset, format!("docs block: {}", e.what)),
            Err(other) => other,
        };
        let block = docs::open(d.block, d.present).map_err(corrupt)?;
        let materialized;
        let needs_prompt = if chat_only { block.chat_needs_prompt() } else { block.needs_prompt() };
        let prompt = match prompt {
            Some(p) => Some(p),
            None if needs_prompt => {
                materialized = self.prompt()?;
                Some(materialized.as_slice())
            }
            None => None,
        };
        // A messages delta (record.md §7.2): the parent's rebuilt messages and
        // response, from the caller's contexts or resolved here.
        let resolved;
        let parent = match r.parent.filter(|_| block.needs_parent()) {
            None => None,
            Some(loc) => match ctx.chat(loc) {
                Some(known) => Some(known),
                None => {
                    if depth >= MESSAGES_DELTA_DEPTH_MAX {
                        return Err(self.snapshot.corrupt(
                            self,
                            &format!("messages delta chain deeper than {MESSAGES_DELTA_DEPTH_MAX} calls"),
                        ));
                    }
                    if loc >= self.loc {
                        return Err(self.snapshot.corrupt(self, "parent is not an earlier record"));
                    }
                    let parent = self.snapshot.call_at(loc)?;
                    resolved = parent.resolve_docs(None, ctx, Resolve::Chat, depth + 1)?.0;
                    Some(&resolved)
                }
            },
        };
        let parent = parent.and_then(|p| {
            Some(docs::Parent { messages: p.messages.as_deref()?, response_message: p.response_message.as_deref() })
        });
        let cols = Columns { prompt, completion: r.completion, logprobs: r.logprobs, parent };
        match mode {
            Resolve::All => block.resolve(&cols).map(|d| (d, None)),
            Resolve::Chat => block.resolve_chat(&cols).map(|d| (d, None)),
            Resolve::ButExtra => block.resolve_but_extra(&cols),
        }
        .map_err(corrupt)
    }

    /// An owned copy of everything but the token ids and logprobs (empty;
    /// `logprobs` is `Some(empty)` when the call has them), for callers that
    /// take those from the zero-copy slices.
    pub fn to_call_without_tokens(&self) -> Result<Call> {
        Ok(self.call_with_docs(self.docs()?))
    }

    fn call_with_docs(&self, docs: Docs) -> Call {
        let r = &self.record;
        Call {
            trace_id: r.trace_id.to_owned(),
            session_id: r.session_id.to_owned(),
            session_uids: r.session_uids.iter().map(|s| (*s).to_owned()).collect(),
            timestamp: r.timestamp,
            model: r.model.map(str::to_owned),
            weight_version: r.weight_version,
            prompt_token_ids: Vec::new(),
            completion_token_ids: Vec::new(),
            logprobs: r.logprobs.map(|_| Vec::new()),
            routing_matrices: r.routing_matrices.map(<[u8]>::to_vec),
            finish_reason: r.finish_reason.map(str::to_owned),
            latency_ms: r.latency_ms,
            messages: docs.messages,
            response_message: docs.response_message,
            metadata: docs.metadata,
            extra: docs.extra,
        }
    }
}

impl Snapshot {
    pub(crate) fn new(view: Arc<View>) -> Self {
        Self { view, row_groups: std::sync::OnceLock::new(), whole_row_groups: false }
    }

    /// Memory held by the shard row groups this snapshot has decoded and
    /// kept. A read of a compacted call decodes its row group once and keeps
    /// it for the views it hands out, so a snapshot that reads many sessions
    /// grows by what it read until [`Snapshot::bound_decoded`] or
    /// [`Snapshot::release_decoded`].
    pub fn decoded_bytes(&self) -> usize {
        self.row_groups.get().map_or(0, |c| c.bytes.load(Relaxed))
    }

    /// Drop every decoded shard row group (the next read of a compacted call
    /// decodes its row group again). Taking `&mut self` proves that no view
    /// into them is alive.
    pub fn release_decoded(&mut self) {
        self.row_groups = std::sync::OnceLock::new();
    }

    /// When the decoded row groups hold more than `budget` bytes, drop the
    /// least recently read ones until half the budget is left: what a loop
    /// over many sessions calls between two of them, so that its memory
    /// stays bounded whatever the store's size while the row groups it is
    /// still reading (a collection reads several generations side by side)
    /// stay decoded.
    pub fn bound_decoded(&mut self, budget: usize) {
        let Some(cache) = self.row_groups.get_mut() else { return };
        if *cache.bytes.get_mut() <= budget {
            return;
        }
        let map: &mut HashMap<(u32, u32, u32, u32), Box<Decoded>> = cache.batches.as_mut();
        let ranges = cache.ranges.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut by_use: Vec<((u32, u32, u32, u32), u64)> =
            map.iter().map(|(k, d)| (*k, d.used.load(Relaxed))).collect();
        by_use.sort_unstable_by_key(|&(_, used)| used);
        let bytes = cache.bytes.get_mut();
        for (key, _) in by_use {
            if *bytes <= budget / 2 {
                break;
            }
            if let Some(d) = map.remove(&key) {
                *bytes -= d.bytes;
            }
            let (shard, rg, start, end) = key;
            if let Some(runs) = ranges.get_mut(&(shard, rg)) {
                runs.retain(|r| (r.start, r.end) != (start, end));
            }
        }
    }

    /// Decode whole shard row groups from now on, not only the rows each
    /// read needs: for a loop over many sessions, which reads every row of a
    /// row group sooner or later (each row group is then decompressed once,
    /// not once per session). Point reads (the default) decode only the
    /// rows they serve, so holding a session's views costs its own rows.
    pub fn decode_whole_row_groups(&mut self) {
        self.whole_row_groups = true;
    }

    /// The decoded rows of (`shard`, `rg`) that hold `want`, decoding them
    /// (or the whole row group, see [`Snapshot::decode_whole_row_groups`])
    /// if no decoded run holds them.
    fn decoded_rows(&self, file: &ShardFile, shard: u32, rg: u32, want: std::ops::Range<u32>) -> Result<&Decoded> {
        let cache = self.row_groups.get_or_init(RowGroupCache::default);
        let now = cache.clock.fetch_add(1, Relaxed);
        let mut ranges = cache.ranges.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let runs = ranges.entry((shard, rg)).or_default();
        if let Some(run) = runs.iter().find(|r| r.start <= want.start && want.end <= r.end) {
            if let Some(d) = cache.batches.get(&(shard, rg, run.start, run.end)) {
                d.used.store(now, Relaxed);
                return Ok(d);
            }
        }
        let run = if self.whole_row_groups { 0..file.rows_in(rg)?.unwrap_or(0) } else { want };
        let batch = file.read_rows(rg, (!self.whole_row_groups).then(|| run.clone()))?;
        let bytes = batch.get_array_memory_size();
        cache.bytes.fetch_add(bytes, Relaxed);
        let d = Decoded { batch, first: run.start, bytes, used: AtomicU64::new(now) };
        let key = (shard, rg, run.start, run.end);
        runs.push(run);
        Ok(cache.batches.insert(key, Box::new(d)))
    }

    /// Give the resident pages of every segment mapping and of the shard
    /// index file back (long reads of whole segments or of every session
    /// call it now and then; see `Mapping::release_pages`).
    pub(crate) fn release_pages(&self) {
        for seg in self.view.segments.values() {
            seg.release_pages();
        }
        if let Some(ix) = self.view.shards.index_file() {
            ix.release_pages();
        }
        // An older shard index file's, when a publication replaced the file
        // and the writer's frozen layer still reads the old one.
        self.view.index.frozen().release_pages();
        // The backlog index file's, when the cold layer is mapped from it.
        self.view.index.cold().release_pages();
    }

    fn segment(&self, id: u64) -> Result<&SegmentRef> {
        self.view.segments.get(&id).ok_or_else(|| {
            Error::new(crate::error::ErrorKind::NotFound, format!("segment {id} is not part of this snapshot"))
        })
    }

    /// An error when a block of the shard index file that this view's
    /// lookups read failed its crc32 (a read-only open checks the file's
    /// tables a block at a time, as lookups first read them): a lookup may
    /// have missed. The reads that return a `Result` check it; those that
    /// cannot ([`Snapshot::sessions`], [`Snapshot::session_info`], the
    /// annotations) may have missed what the damaged block held until this
    /// says so. Reopening the store does without the file.
    pub fn check_index(&self) -> Result<()> {
        match crate::store::lazy_damage(&self.view.shards, &self.view.index) {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// The call stored at `loc` (CRC-checked), live or not.
    pub fn call_at(&self, loc: Loc) -> Result<CallView<'_>> {
        let seg = self.segment(loc.segment)?;
        let body = seg.body_at(loc.offset)?;
        let record = decode_call(body).map_err(|e| Error::corrupt(seg.path.as_path(), loc.offset, e.what))?;
        Ok(self.segment_view(loc, record))
    }

    fn segment_view<'a>(&'a self, loc: Loc, record: CallRecord<'a>) -> CallView<'a> {
        let divergence = matches!(record.relation, Relation::TitoBreak | Relation::DivergesEarlier)
            .then_some(record.shared_len as usize);
        CallView { loc, record, shard: None, divergence, snapshot: self }
    }

    /// A compacted call, from its shard row group (decoded once per snapshot).
    fn shard_call(&self, loc: Loc, pos: ShardPos) -> Result<CallView<'_>> {
        let file = self.view.shards.file(pos.shard).ok_or_else(|| {
            Error::new(crate::error::ErrorKind::NotFound, format!("shard {} is not part of this snapshot", pos.shard))
        })?;
        let decoded = self.decoded_rows(file, pos.shard, pos.row_group, pos.row..pos.row.saturating_add(1))?;
        let batch = &decoded.batch;
        let (record, divergence) = call_from_row(batch, (pos.row - decoded.first) as usize, &file.path)?;
        Ok(CallView { loc, record, shard: Some(pos), divergence: divergence.map(|d| d as usize), snapshot: self })
    }

    /// The call record at `loc`: from its shard row if it was compacted,
    /// else from its segment.
    fn read(&self, loc: Loc) -> Result<CallView<'_>> {
        match self.view.shards.position(loc) {
            None => {
                self.check_index()?;
                self.call_at(loc)
            }
            Some(pos) => self.shard_call(loc, pos),
        }
    }

    /// The live call with this trace id.
    pub fn get(&self, trace_id: &str) -> Result<Option<CallView<'_>>> {
        let live = self.view.index.live(trace_id);
        self.check_index()?;
        match live {
            None => Ok(None),
            Some(call) => self.read(call.loc()).map(Some),
        }
    }

    /// A session's calls, oldest first (by timestamp, then append order), with
    /// timestamp strictly greater than `since`, at most `limit` of them. A
    /// damaged call makes the whole read fail; see [`Snapshot::session_each`].
    pub fn session(&self, session_id: &str, since: Option<f64>, limit: Option<usize>) -> Result<Vec<CallView<'_>>> {
        self.session_each(session_id, since, limit).into_iter().collect()
    }

    /// A session's calls as owned [`Call`]s, as [`Snapshot::session`] lists
    /// them. Each prompt is rebuilt from its parent's context, read just
    /// before (a window's first call walks its chain once): O(session tokens),
    /// where `to_call` on each view walks every call's chain.
    pub fn session_calls(&self, session_id: &str, since: Option<f64>, limit: Option<usize>) -> Result<Vec<Call>> {
        Ok(self.session_calls_in(session_id, since, limit, Resolve::All)?.into_iter().map(|(c, _)| c).collect())
    }

    /// [`Snapshot::session_calls`], each call with its `extra` left as a
    /// checked template ([`Spliced`]) when the call keeps it in a docs block
    /// (the call's `extra` is then `None`): for a reader that builds the
    /// values of `extra`'s copies of the columns straight from the columns
    /// (the Python binding's dicts) instead of parsing their text.
    pub fn session_calls_spliced(
        &self,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
    ) -> Result<Vec<(Call, Option<Spliced>)>> {
        self.session_calls_in(session_id, since, limit, Resolve::ButExtra)
    }

    fn session_calls_in(
        &self,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
        mode: Resolve,
    ) -> Result<Vec<(Call, Option<Spliced>)>> {
        let mut ctx = Contexts::default();
        self.session(session_id, since, limit)?
            .iter()
            .map(|v| {
                let prompt = ctx.prompt(v)?;
                ctx.remember(v.loc, &prompt, v.completion_token_ids());
                let (docs, spliced) = v.resolve_docs(Some(&prompt), &ctx, mode, 0)?;
                let call = v.call_with_columns(docs, prompt);
                ctx.remember_chat(v.loc, &call.messages, &call.response_message);
                Ok((call, spliced))
            })
            .collect()
    }

    /// Like [`Snapshot::session`], one result per call: a damaged call (or one
    /// whose prefix-delta parent is damaged) is an error naming the file and
    /// offset, and the session's other calls still read.
    pub fn session_each(
        &self,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
    ) -> Vec<Result<CallView<'_>>> {
        let calls = self.view.index.session_calls(session_id);
        if let Err(e) = self.check_index() {
            return vec![Err(e)];
        }
        let start = match since {
            None => 0,
            Some(t) => calls
                .binary_search_by(
                    |k| if k.timestamp > t { std::cmp::Ordering::Greater } else { std::cmp::Ordering::Less },
                )
                .unwrap_or_else(|i| i),
        };
        let limit = limit.unwrap_or(usize::MAX);
        // `skip` on the persistent vector: O(log n), not a walk from the start.
        let calls = if start == 0 { calls } else { calls.skip(start.min(calls.len())) };
        if !self.whole_row_groups {
            self.decode_session_rows(&calls, limit);
        }
        calls.iter().take(limit).map(|k| self.read(k.loc)).collect()
    }

    /// Point reads of a session: decode, per shard row group, the one run of
    /// rows from its first to its last compacted call read (a session's rows
    /// are contiguous in its shard), instead of one run per call. Errors are
    /// left to the reads of the calls, which report them one by one.
    fn decode_session_rows(&self, calls: &crate::index::CallList, limit: usize) {
        let mut runs: std::collections::BTreeMap<(u32, u32), std::ops::Range<u32>> = Default::default();
        for k in calls.iter().take(limit) {
            let Some(pos) = self.view.shards.position(k.loc) else { continue };
            let end = pos.row.saturating_add(1);
            runs.entry((pos.shard, pos.row_group))
                .and_modify(|r| *r = r.start.min(pos.row)..r.end.max(end))
                .or_insert(pos.row..end);
        }
        for ((shard, rg), rows) in runs {
            if let Some(file) = self.view.shards.file(shard) {
                let _ = self.decoded_rows(file, shard, rg, rows);
            }
        }
    }

    fn info(id: &str, s: crate::index::SessionSummary) -> SessionInfo {
        SessionInfo {
            session_id: id.to_owned(),
            calls: s.calls,
            first_timestamp: s.first_timestamp,
            last_timestamp: s.last_timestamp,
            sealed: s.sealed,
            reward: s.reward,
        }
    }

    /// One session's summary (None if it has no live call).
    pub fn session_info(&self, session_id: &str) -> Option<SessionInfo> {
        self.view.index.session_summary(session_id).map(|s| Self::info(session_id, s))
    }

    /// Every session of the index's maps and cold layer with at least one
    /// live call, with its summary: every session with a call in segments
    /// is there (a frozen session's calls are all compacted). O(sessions in
    /// the maps and cold layer), not O(every session), for a compaction's
    /// selection.
    pub(crate) fn for_each_session_in_maps(&self, mut f: impl FnMut(SessionInfo)) {
        self.view.index.for_each_session_in_maps(|id, s| f(Self::info(id, s)));
        self.view.index.for_each_cold_session(|id, s| f(Self::info(id, s)));
    }

    /// Whether a live call whose primary session is `session_id` is still
    /// served from segments (not compacted). From the index alone: nothing is
    /// read or decoded.
    pub(crate) fn has_calls_in_segments(&self, session_id: &str) -> bool {
        let index = &self.view.index;
        if index.is_frozen_session(session_id) {
            return false;
        }
        index.session_calls(session_id).iter().any(|k| {
            index.live(k.trace_id.as_ref()).is_some_and(|m| {
                m.loc() == k.loc && !self.view.shards.is_compacted(k.loc) && m.primary_session() == Some(session_id)
            })
        })
    }

    /// Every session with at least one live call, by first call time then id.
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let mut out: Vec<SessionInfo> = Vec::new();
        self.view.index.for_each_session(|id, s| out.push(Self::info(id, s)));
        out.sort_by(|a, b| {
            a.first_timestamp.total_cmp(&b.first_timestamp).then_with(|| a.session_id.cmp(&b.session_id))
        });
        out
    }

    /// Damage found when the store was opened and confined to the records it
    /// touches (a sealed segment's footer rebuilt from its frames, damaged
    /// regions skipped by recovery mode skip-corrupted now or earlier, a
    /// damaged annotation). Empty for an intact store; `Store::recovery_report`
    /// says what the open did (torn tails cut included), `trajlog verify`
    /// gives the full picture.
    pub fn damage(&self) -> &[crate::error::Problem] {
        &self.view.damage
    }

    /// Whether a session is sealed.
    pub fn is_sealed(&self, session_id: &str) -> bool {
        self.view.index.is_sealed(session_id)
    }

    pub fn trace_reward(&self, trace_id: &str) -> Option<f64> {
        self.view.index.trace_reward(trace_id)
    }

    pub fn session_reward(&self, session_id: &str) -> Option<f64> {
        self.view.index.session_reward(session_id)
    }

    /// Number of live calls.
    pub fn call_count(&self) -> usize {
        self.view.index.call_count()
    }

    /// How the index holds this snapshot's live calls: how many are in the
    /// frozen layer (compacted sessions untouched since the open, in flat
    /// arrays) and the bytes that layer takes; the others are in the
    /// in-memory maps (ARCHITECTURE.md, "Two index layers").
    pub fn index_layers(&self) -> IndexLayers {
        let (frozen_calls, frozen_bytes) = self.view.index.frozen_stats();
        let (cold_calls, cold_bytes) = self.view.index.cold_stats();
        let index_file_bytes = self.view.shards.index_file().map_or(0, |ix| ix.file_len());
        IndexLayers {
            calls: self.call_count(),
            frozen_calls,
            frozen_bytes,
            cold_calls,
            cold_bytes,
            cold_layers: self.view.index.cold().count(),
            index_file_bytes,
            cached_annotation_segments: self.view.index.cached_segments(),
            backlog_segments: self.view.index.backlog_segments(),
        }
    }

    /// Segments of this snapshot, oldest first.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.view
            .segments
            .values()
            .map(|s| SegmentInfo {
                id: s.id,
                path: s.path.as_path().to_path_buf(),
                sealed: s.sealed,
                data_bytes: s.visible_len,
                mapped: s.mapped_range(),
            })
            .collect()
    }

    /// For a collection (compact/collect.rs): each published `steps` shard's
    /// id, path, rows (from its footer: an error when it cannot be decoded),
    /// and rows that are the live call of their trace id. O(live calls),
    /// or the count the shard set keeps for the same index trees.
    pub(crate) fn shard_liveness(&self) -> Vec<(u32, std::path::PathBuf, Result<u64>, u64)> {
        self.shard_liveness_keeping(false)
    }

    /// [`Snapshot::shard_liveness`], the count kept by the shard set with
    /// `keep` (for the next batch of a batched compaction: kept longer, the
    /// index trees it holds would outlive the writer's maps).
    pub(crate) fn shard_liveness_keeping(&self, keep: bool) -> Vec<(u32, std::path::PathBuf, Result<u64>, u64)> {
        let key = self.view.index.liveness_key();
        let memo = self.view.shards.liveness_memo();
        let live = match memo.get(&key) {
            Some(live) => live,
            None => {
                let live = Arc::new(self.count_live_rows());
                if keep {
                    memo.put(key, live.clone());
                }
                live
            }
        };
        self.view
            .shards
            .files()
            .map(|f| (f.id, f.path.clone(), f.rows(), live.get(&f.id).copied().unwrap_or(0)))
            .collect()
    }

    /// Live rows per shard id: [`Snapshot::shard_liveness`] counted.
    pub(crate) fn count_live_rows(&self) -> HashMap<u32, u64> {
        let (shards, index) = (&self.view.shards, &self.view.index);
        let mut live: HashMap<u32, u64> = HashMap::new();
        let same_file =
            shards.index_file().is_some_and(|ix| index.frozen().is_in(ix.mapping()) && shards.base_is_in(ix.mapping()));
        if same_file {
            // The frozen layer and the placements are the same file's: a
            // frozen row not thawed is a live call, its placement names its
            // file. One pass over the placements instead of a binary
            // search per call (10M compacted calls: ~3 s of a compaction).
            // The file's frozen rows per shard (counted once per file),
            // less the rows of the sessions thawed since the open.
            let mut per_slot = vec![0u64; shards.slots()];
            if let Some(ix) = shards.index_file() {
                for (shard, n) in ix.frozen_rows_per_shard().iter().enumerate() {
                    if let Some(c) = shards.slot(shard as u32).and_then(|s| per_slot.get_mut(s as usize)) {
                        *c += n;
                    }
                }
            }
            let frozen = index.frozen();
            let thawed = index.thawed_rows().into_iter().flatten().filter_map(|r| frozen.row(r)).map(|r| r.loc());
            positions_in_order(
                shards,
                thawed,
                || (),
                |shard| {
                    if let Some(c) = per_slot.get_mut(shard as usize) {
                        *c = c.saturating_sub(1);
                    }
                },
            );
            live.extend(per_slot.into_iter().enumerate().filter(|(_, n)| *n > 0).map(|(s, n)| (s as u32, n)));
            // The maps' calls and the cold layer's (a writer's cold calls
            // stay in the layer once compacted, as its maps' do).
            let hot = index.hot_calls().values().map(|m| m.loc).chain(index.cold_calls().map(|(loc, _)| loc));
            positions_in_order(
                shards,
                hot,
                || index.cold().release_pages(),
                |shard| *live.entry(shard).or_default() += 1,
            );
        } else {
            // Every call, the frozen ones of an older file's rows too (a
            // writer's, until it reopens or rebuilds its index: read in
            // order, its pages given back after each chunk).
            let locs = index.live_calls().map(|c| c.loc());
            positions_in_order(
                shards,
                locs,
                || index.frozen().release_pages(),
                |shard| {
                    *live.entry(shard).or_default() += 1;
                },
            );
        }
        // The lookups of every call in segments read pages all over the
        // placements (a merge of 1M rows on 10M: ~0.7 GB resident, at the
        // peak of the compaction that asked): given back.
        self.release_pages();
        live
    }

    /// The dead rows of `steps` shard `id` (format-spec/shard.md §9): row
    /// number in the file, `session_id`, trace id, ascending. A row is dead
    /// when its trace id's live call is not the record it was compacted
    /// from. Reads the file's index columns.
    pub(crate) fn dead_steps_rows(&self, id: u32) -> Result<Vec<(u64, String, Option<String>)>> {
        let Some(f) = self.view.shards.files().find(|f| f.id == id) else { return Ok(Vec::new()) };
        let mut rows = Vec::new();
        f.index_rows(&mut rows)?;
        let index = &self.view.index;
        Ok(rows
            .into_iter()
            .enumerate()
            .filter(|(_, r)| !index.is_live_at(&r.trace_id, r.loc))
            .map(|(n, r)| {
                (n as u64, r.sessions.first().map(|s| s.to_string()).unwrap_or_default(), Some(r.trace_id.to_string()))
            })
            .collect())
    }

    /// For collection (format-spec/shard.md §6.1): the shards among `ids`
    /// (`steps` files a collection or merge would rewrite, dropping their
    /// dead rows) holding a dead row that must not be dropped yet. Such a
    /// row's trace id has no live call, and another record of it stays
    /// once the row is gone — a row outside `ids` (`rows_of_trace` counts
    /// the store's rows of a trace id; another id of its hash counts too),
    /// or a call record at another position in a sealed segment that does
    /// not name every session of the row. Dropping the row would let the
    /// next open replay that other record as live when the record that
    /// killed the row does not also kill it (a call
    /// replaced by one naming other sessions, one of those deleted). A
    /// later live call of the trace id supersedes every record, so its
    /// replaced rows are dropped unless such a record would come back and
    /// a sealed segment holds a trace reward record of the trace id: a
    /// trace reward stays with the trace id through a replacement, so it
    /// would pass from that record to the live call (shard.md §6.1).
    /// Conservative: a damaged footer
    /// holds every such row back. A shard whose index columns cannot be
    /// read is returned apart, with the error: it cannot be rewritten.
    pub(crate) fn shards_holding_undroppable_dead_rows(
        &self,
        ids: &std::collections::HashSet<u32>,
        rows_of_trace: &dyn Fn(&str) -> usize,
    ) -> (std::collections::HashSet<u32>, Vec<(u32, String)>) {
        let index = &self.view.index;
        let mut held = std::collections::HashSet::new();
        let mut unreadable = Vec::new();
        // The dead rows of `ids`, by trace id: (position, shard, sessions),
        // with the trace id's live call if it has one. For a trace id with
        // none, every row of it in `ids` is one, so a list's length is the
        // files' rows of it.
        type Rows = Vec<(Loc, u32, Arc<[Arc<str>]>)>;
        let mut by_trace: HashMap<Arc<str>, (Rows, Option<Loc>)> = HashMap::new();
        for f in self.view.shards.files().filter(|f| ids.contains(&f.id)) {
            let mut rows = Vec::new();
            if let Err(e) = f.index_rows(&mut rows) {
                unreadable.push((f.id, e.message().to_owned()));
                continue;
            }
            for r in rows {
                let live = index.live(&r.trace_id).map(|l| l.loc());
                if live != Some(r.loc) {
                    let entry = by_trace.entry(r.trace_id).or_insert_with(|| (Vec::new(), live));
                    entry.0.push((r.loc, f.id, r.sessions));
                }
            }
        }
        // Trace ids with a live call: the row can be dropped unless another
        // record of the trace id comes back with it gone (as below) *and* a
        // trace reward record of it could attach to that record, to stay
        // with the trace id through the live call's replacement (a deleted
        // call's reward would come back). Noted per trace id.
        let mut other_record: std::collections::HashSet<Arc<str>> = std::collections::HashSet::new();
        let mut rewarded: std::collections::HashSet<Arc<str>> = std::collections::HashSet::new();
        let mut any_reward_unknown = false;
        // A row of the trace id outside `ids` holds them all back (a trace
        // id with a live call: counts as another record).
        by_trace.retain(|trace, (rows, live)| {
            let live_row = live.is_some_and(|l| self.view.shards.position(l).is_some());
            let outside = rows_of_trace(trace) > rows.len() + usize::from(live_row);
            match live {
                None if outside => {
                    held.extend(rows.iter().map(|(_, shard, _)| *shard));
                    false
                }
                Some(_) if outside => {
                    other_record.insert(trace.clone());
                    true
                }
                _ => true,
            }
        });
        if by_trace.is_empty() {
            return (held, unreadable);
        }
        for seg in self.view.segments.values().filter(|s| s.sealed) {
            let bytes = seg.mapped_bytes();
            let footer = crate::format::segment::read_trailer(bytes)
                .and_then(|t| crate::format::segment::check_footer(bytes, &t).ok());
            let Some(footer) = footer else {
                // Its records are unknown: hold every candidate back.
                held.extend(by_trace.values().flat_map(|(rows, _)| rows).map(|(_, shard, _)| *shard));
                return (held, unreadable);
            };
            for e in footer.iter() {
                if e.kind == crate::format::record::KIND_REWARD {
                    match e.reward_target {
                        1 => {
                            if let Some((key, _)) = by_trace.get_key_value(e.id) {
                                rewarded.insert(key.clone());
                            }
                        }
                        // A reward whose target is only in its record
                        // (segment format < 4): it could be of any.
                        0 => any_reward_unknown = true,
                        _ => {}
                    }
                    continue;
                }
                if e.kind != crate::format::record::KIND_CALL {
                    continue;
                }
                let Some((key, (rows, live))) = by_trace.get_key_value(e.id) else { continue };
                let at = Loc { segment: seg.id, offset: e.frame_offset };
                // A record naming every session of the row dies with it: the
                // deletion that killed the row names one of them, and
                // retirement keeps it while a kept segment holds a record
                // of that session (§6).
                let names = |s: &str| e.session_id == s || e.session_uids.iter().any(|u| u == s);
                let comes_back = |(loc, _, sessions): &&(Loc, u32, Arc<[Arc<str>]>)| {
                    *loc != at && !sessions.iter().all(|s| names(s))
                };
                match live {
                    None => held.extend(rows.iter().filter(comes_back).map(|(_, shard, _)| *shard)),
                    Some(l) if *l != at && rows.iter().any(|r| comes_back(&r)) => {
                        other_record.insert(key.clone());
                    }
                    Some(_) => {}
                }
            }
        }
        for (trace, (rows, live)) in &by_trace {
            if live.is_some() && other_record.contains(trace) && (any_reward_unknown || rewarded.contains(trace)) {
                held.extend(rows.iter().map(|(_, shard, _)| *shard));
            }
        }
        (held, unreadable)
    }

    /// The primary sessions of the live calls served from the shards `ids`,
    /// each with the shard ids it has live calls in (ascending). Reads the
    /// index columns of those files and looks each row up: O(their rows ×
    /// log rows), not O(live calls) (a merge of 1M rows on 10M compacted
    /// calls looked up every call: seconds, and ~0.7 GB of the index file's
    /// pages resident at the compaction's peak).
    pub(crate) fn sessions_in_shards(
        &self,
        ids: &std::collections::HashSet<u32>,
    ) -> std::collections::BTreeMap<String, Vec<u32>> {
        let mut out: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
        let mut ids_sorted: Vec<u32> = ids.iter().copied().collect();
        ids_sorted.sort_unstable();
        let (shards, index) = (&self.view.shards, &self.view.index);
        let mut rows = Vec::new();
        // Each row is looked up in the index files (a merge of 1M rows on
        // 10M calls: ~0.8 GB of their pages before they were given back).
        let mut budget = crate::storage::mmap::PageBudget::compaction();
        for id in ids_sorted {
            let Some(f) = shards.file(id) else { continue };
            rows.clear();
            if f.index_rows(&mut rows).is_err() {
                // Its rows unknown: every live call looked up instead.
                return self.sessions_in_shards_by_calls(ids);
            }
            for r in &rows {
                // Served from this file (one placement per position) and
                // the live call of its trace id.
                budget.tick(|| self.release_pages());
                let served = shards.position(r.loc).is_some_and(|p| p.shard == id);
                if let Some(s) = r.sessions.first().filter(|_| served && index.is_live_at(&r.trace_id, r.loc)) {
                    let shards = out.entry(s.to_string()).or_default();
                    if shards.last() != Some(&id) {
                        shards.push(id);
                    }
                }
            }
        }
        debug_assert_eq!(out, self.sessions_in_shards_by_calls(ids), "the rows' answer is the calls'");
        out
    }

    /// [`Snapshot::sessions_in_shards`] by a look-up of every live call.
    fn sessions_in_shards_by_calls(
        &self,
        ids: &std::collections::HashSet<u32>,
    ) -> std::collections::BTreeMap<String, Vec<u32>> {
        let mut out: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
        for call in self.view.index.live_calls() {
            let (Some(pos), Some(s)) = (self.view.shards.position(call.loc()), call.primary_session()) else {
                continue;
            };
            if ids.contains(&pos.shard) {
                let shards = out.entry(s.to_string()).or_default();
                if !shards.contains(&pos.shard) {
                    shards.push(pos.shard);
                }
            }
        }
        for shards in out.values_mut() {
            shards.sort_unstable();
        }
        out
    }

    /// Published `steps` shards (paths), by shard id.
    pub fn shard_paths(&self) -> Vec<std::path::PathBuf> {
        self.view.shards.files().map(|s| s.path.clone()).collect()
    }

    /// Visit every live call: first those still in segments, in log order, then
    /// the compacted ones, in shard order. Shard row groups are decoded one at a
    /// time and dropped after their calls were visited, so memory stays bounded.
    /// Stops at the first damaged call; see [`Snapshot::for_each_call_each`].
    pub fn for_each_call(&self, mut f: impl FnMut(&CallView<'_>) -> Result<()>) -> Result<()> {
        self.for_each_call_each(|call| f(&call?))
    }

    /// Like [`Snapshot::for_each_call`], but damage stays confined: a damaged
    /// call (or shard row group) is handed to `f` as an error naming the file
    /// and offset, and the scan goes on; `f` decides whether to stop.
    pub fn for_each_call_each(&self, mut f: impl FnMut(Result<CallView<'_>>) -> Result<()>) -> Result<()> {
        // Live calls still in segments, in log order, from the index (not by
        // scanning frames: a damaged frame must not hide the ones after it);
        // the frozen layer's calls are all compacted, the maps' and the cold
        // layer's may be (a writer's, since its open).
        let shards = &self.view.shards;
        let index = &self.view.index;
        let mut locs: Vec<Loc> = index.hot_calls().values().map(|m| m.loc).collect();
        locs.extend(index.cold_calls().map(|(loc, _)| loc));
        locs.retain(|loc| !shards.is_compacted(*loc));
        locs.sort_unstable();
        for loc in locs {
            // A call that looks uncompacted because a placement lookup met
            // a damaged block: the damage is the error to report.
            f(self.call_at(loc).map_err(|e| self.check_index().err().unwrap_or(e)))?;
        }
        for file in shards.files() {
            let row_groups = match file.row_groups() {
                Ok(n) => n as u32,
                Err(e) => {
                    f(Err(e))?;
                    continue;
                }
            };
            for rg in 0..row_groups {
                let batch = match file.read_row_group(rg) {
                    Ok(b) => b,
                    Err(e) => {
                        f(Err(e))?;
                        continue;
                    }
                };
                for row in 0..batch.num_rows() {
                    let (record, divergence) = match call_from_row(&batch, row, &file.path) {
                        Ok(r) => r,
                        Err(e) => {
                            f(Err(e))?;
                            continue;
                        }
                    };
                    let pos = ShardPos { shard: file.id, row_group: rg, row: row as u32 };
                    let Some(loc) = self.view.index.live(record.trace_id).map(|c| c.loc()) else { continue };
                    if shards.position(loc) != Some(pos) {
                        continue;
                    }
                    let divergence = divergence.map(|d| d as usize);
                    f(Ok(CallView { loc, record, shard: Some(pos), divergence, snapshot: self }))?;
                }
            }
        }
        // A damaged block of the shard index file made lookups miss: the
        // calls they skipped are not named, the damage is.
        if let Err(e) = self.check_index() {
            f(Err(e))?;
        }
        Ok(())
    }

    /// How many records rebuilding `call`'s prompt reads besides its own
    /// (its parents up to one that stores its prompt whole), counting up to
    /// `cap`: `cap` when the chain is that long or a parent cannot be read.
    pub(crate) fn prompt_chain_depth(&self, call: &CallView<'_>, cap: u32) -> u32 {
        let mut depth = 0;
        let mut cur = call.clone();
        while cur.record.prefix_len > 0 && depth < cap {
            let Some(parent) = cur.record.parent.and_then(|p| self.call_at(p).ok()) else { return cap };
            depth += 1;
            cur = parent;
        }
        depth
    }

    /// Materialize a call's full prompt by walking its parent chain.
    ///
    /// `prompt(X)[..n]` for `n <= prefix_len(X)` is `context(parent(X))[..n]`,
    /// and `context(P)[..n]` is `prompt(P)[..n]` when `n <= prompt_len(P)`,
    /// else `prompt(P) ++ completion(P)[..n - prompt_len(P)]`. Pieces are
    /// collected walking towards the root, then concatenated in reverse.
    pub fn materialize_prompt(&self, call: &CallView<'_>) -> Result<Vec<u32>> {
        let mut pieces: Vec<&[u32]> = Vec::new();
        let mut cur = call.clone();
        // How many leading tokens of `cur`'s prompt are still needed.
        let mut need = cur.record.prompt_len as usize;
        loop {
            let prefix = cur.record.prefix_len as usize;
            if need > prefix {
                let take = need - prefix;
                let suffix = cur
                    .record
                    .prompt_suffix
                    .get(..take)
                    .ok_or_else(|| self.corrupt(&cur, "prompt suffix shorter than needed"))?;
                pieces.push(suffix);
                need = prefix;
            }
            if need == 0 {
                break;
            }
            let parent_loc = cur.record.parent.ok_or_else(|| self.corrupt(&cur, "prefix without a parent"))?;
            if parent_loc >= cur.loc {
                return Err(self.corrupt(&cur, "parent is not an earlier record"));
            }
            let parent = self.call_at(parent_loc)?;
            let plen = parent.record.prompt_len as usize;
            if need > plen {
                let from_completion = need - plen;
                let part = parent
                    .record
                    .completion
                    .get(..from_completion)
                    .ok_or_else(|| self.corrupt(&parent, "prefix reaches past the parent's context"))?;
                pieces.push(part);
                need = plen;
            }
            cur = parent;
        }
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        if total != call.record.prompt_len as usize {
            return Err(self.corrupt(call, "materialized prompt has the wrong length"));
        }
        let mut out = Vec::with_capacity(total);
        for p in pieces.iter().rev() {
            out.extend_from_slice(p);
        }
        Ok(out)
    }

    fn corrupt(&self, call: &CallView<'_>, what: &str) -> Error {
        let path =
            self.view.segments.get(&call.loc.segment).map(|s| s.path.as_path().to_path_buf()).unwrap_or_default();
        Error::corrupt(path, call.loc.offset, what)
    }
}

/// Which documents [`CallView`] renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolve {
    /// All four.
    All,
    /// `messages` and `response_message` (what a child's messages delta needs).
    Chat,
    /// All but `extra`, left as a [`Spliced`] template when it is in a docs block.
    ButExtra,
}

/// Recent contexts (`prompt ++ completion`) of a session being read in order,
/// so that each prompt is rebuilt from its parent's context instead of walking
/// the whole chain for every call: O(session tokens) for a whole session.
#[derive(Default)]
pub(crate) struct Contexts {
    map: HashMap<Loc, Arc<Vec<u32>>>,
    order: VecDeque<Loc>,
    /// Rebuilt `messages` and `response_message` of recent calls: what a
    /// child's messages delta refers to.
    chat: HashMap<Loc, Docs>,
    chat_order: VecDeque<Loc>,
}

impl Contexts {
    const KEEP: usize = 16;

    pub(crate) fn prompt(&self, view: &CallView<'_>) -> Result<Vec<u32>> {
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

    /// A remembered call's `messages` and `response_message`.
    pub(crate) fn chat(&self, loc: Loc) -> Option<&Docs> {
        self.chat.get(&loc)
    }

    pub(crate) fn remember_chat(&mut self, loc: Loc, messages: &Option<Vec<u8>>, response_message: &Option<Vec<u8>>) {
        if messages.is_none() {
            return;
        }
        let docs = Docs { messages: messages.clone(), response_message: response_message.clone(), ..Docs::default() };
        keep_recent(&mut self.chat, &mut self.chat_order, loc, docs);
    }

    pub(crate) fn remember(&mut self, loc: Loc, prompt: &[u32], completion: &[u32]) {
        let mut ctx = Vec::with_capacity(prompt.len() + completion.len());
        ctx.extend_from_slice(prompt);
        ctx.extend_from_slice(completion);
        keep_recent(&mut self.map, &mut self.order, loc, Arc::new(ctx));
    }
}

/// Insert `value` at `loc`, keeping the last [`Contexts::KEEP`] inserted.
fn keep_recent<V>(map: &mut HashMap<Loc, V>, order: &mut VecDeque<Loc>, loc: Loc, value: V) {
    map.insert(loc, value);
    order.push_back(loc);
    while order.len() > Contexts::KEEP {
        if let Some(old) = order.pop_front() {
            map.remove(&old);
        }
    }
}

/// The shard (slot) of each of `locs` that a file of `shards` serves, to
/// `each`: looked up a chunk of 2^20 at a time, sorted, in one walk of the
/// placements ([`crate::shard::set::ShardSet::positions_sorted`]), with
/// `after_chunk` run after each (16 MB of positions at a time, whatever
/// the history).
fn positions_in_order(
    shards: &crate::shard::set::ShardSet,
    locs: impl Iterator<Item = Loc>,
    after_chunk: impl Fn(),
    mut each: impl FnMut(u32),
) {
    const CHUNK: usize = 1 << 20;
    // Its whole capacity at once (16 MiB): grown by doubling it reached
    // 32 MiB.
    let mut chunk: Vec<Loc> = Vec::with_capacity(CHUNK);
    let mut locs = locs.peekable();
    while locs.peek().is_some() {
        chunk.clear();
        chunk.extend(locs.by_ref().take(CHUNK));
        chunk.sort_unstable();
        shards.positions_sorted(&chunk, |pos| {
            if let Some(p) = pos {
                each(p.shard);
            }
        });
        after_chunk();
    }
}
