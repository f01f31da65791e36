//! Snapshot reads: by trace id, by session, session listing, full scans — all
//! served as views into the mapped segment files (zero-copy).
//!
//! A [`Snapshot`] is an `Arc` of a published [`View`]: the indexes at one point
//! of the log plus `Arc`s of the segment mappings it needs. Holding it keeps
//! those mappings alive; it never changes, whatever the writer does meanwhile.

use crate::error::{Error, Result};
use crate::format::frame::{read_frame, FrameRead};
use crate::format::record::{body_kind, decode_call, CallRecord, Loc, Relation, KIND_CALL};
use crate::format::segment::HEADER_BYTES;
use crate::index::Index;
use crate::record::Call;
use crate::segment::SegmentRef;
use std::sync::Arc;

/// What a snapshot sees.
#[derive(Debug, Clone)]
pub struct View {
    pub(crate) index: Index,
    pub(crate) segments: imbl::OrdMap<u64, SegmentRef>,
}

/// A consistent, cheap-to-clone read view of a store.
#[derive(Debug, Clone)]
pub struct Snapshot {
    view: Arc<View>,
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

/// One call, viewed in place: its token slices point into the mapped segment.
#[derive(Debug, Clone)]
pub struct CallView<'a> {
    pub loc: Loc,
    pub record: CallRecord<'a>,
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
        matches!(self.record.relation, Relation::TitoBreak | Relation::DivergesEarlier)
            .then_some(self.record.prefix_len as usize)
    }
    /// The full prompt, materialized from the parent chain.
    pub fn prompt(&self) -> Result<Vec<u32>> {
        self.snapshot.materialize_prompt(self)
    }
    /// An owned copy of the call as it was appended.
    pub fn to_call(&self) -> Result<Call> {
        let r = &self.record;
        Ok(Call {
            trace_id: r.trace_id.to_owned(),
            session_id: r.session_id.to_owned(),
            session_uids: r.session_uids.iter().map(|s| (*s).to_owned()).collect(),
            timestamp: r.timestamp,
            model: r.model.map(str::to_owned),
            weight_version: r.weight_version,
            prompt_token_ids: self.prompt()?,
            completion_token_ids: r.completion.to_vec(),
            logprobs: r.logprobs.map(<[f32]>::to_vec),
            routing_matrices: r.routing_matrices.map(<[u8]>::to_vec),
            finish_reason: r.finish_reason.map(str::to_owned),
            latency_ms: r.latency_ms,
            messages: r.messages.map(<[u8]>::to_vec),
            response_message: r.response_message.map(<[u8]>::to_vec),
            metadata: r.metadata.map(<[u8]>::to_vec),
            extra: r.extra.map(<[u8]>::to_vec),
        })
    }
}

impl Snapshot {
    pub(crate) fn new(view: Arc<View>) -> Self {
        Self { view }
    }

    fn segment(&self, id: u64) -> Result<&SegmentRef> {
        self.view.segments.get(&id).ok_or_else(|| {
            Error::new(crate::error::ErrorKind::NotFound, format!("segment {id} is not part of this snapshot"))
        })
    }

    /// The call stored at `loc` (CRC-checked), live or not.
    pub fn call_at(&self, loc: Loc) -> Result<CallView<'_>> {
        let seg = self.segment(loc.segment)?;
        let body = seg.body_at(loc.offset)?;
        let record = decode_call(body).map_err(|e| Error::corrupt(seg.path.as_path(), loc.offset, e.what))?;
        Ok(CallView { loc, record, snapshot: self })
    }

    /// The live call with this trace id.
    pub fn get(&self, trace_id: &str) -> Result<Option<CallView<'_>>> {
        match self.view.index.traces.get(trace_id) {
            None => Ok(None),
            Some(meta) => self.call_at(meta.loc).map(Some),
        }
    }

    /// A session's calls, oldest first (by timestamp, then append order), with
    /// timestamp strictly greater than `since`, at most `limit` of them.
    pub fn session(&self, session_id: &str, since: Option<f64>, limit: Option<usize>) -> Result<Vec<CallView<'_>>> {
        let Some(entry) = self.view.index.sessions.get(session_id) else { return Ok(Vec::new()) };
        let start = match since {
            None => 0,
            Some(t) => entry
                .calls
                .binary_search_by(
                    |k| if k.timestamp > t { std::cmp::Ordering::Greater } else { std::cmp::Ordering::Less },
                )
                .unwrap_or_else(|i| i),
        };
        let limit = limit.unwrap_or(usize::MAX);
        entry.calls.iter().skip(start).take(limit).map(|k| self.call_at(k.loc)).collect()
    }

    fn info(&self, id: &str, e: &crate::index::SessionEntry) -> Option<SessionInfo> {
        let (first, last) = (e.calls.front()?, e.calls.back()?);
        Some(SessionInfo {
            session_id: id.to_owned(),
            calls: e.calls.len(),
            first_timestamp: first.timestamp,
            last_timestamp: last.timestamp,
            sealed: e.sealed,
            reward: e.reward,
        })
    }

    /// One session's summary (None if it has no live call).
    pub fn session_info(&self, session_id: &str) -> Option<SessionInfo> {
        self.view.index.sessions.get(session_id).and_then(|e| self.info(session_id, e))
    }

    /// Every session with at least one live call, by first call time then id.
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let mut out: Vec<SessionInfo> =
            self.view.index.sessions.iter().filter_map(|(id, e)| self.info(id, e)).collect();
        out.sort_by(|a, b| {
            a.first_timestamp.total_cmp(&b.first_timestamp).then_with(|| a.session_id.cmp(&b.session_id))
        });
        out
    }

    /// Whether a session is sealed.
    pub fn is_sealed(&self, session_id: &str) -> bool {
        self.view.index.sessions.get(session_id).is_some_and(|e| e.sealed)
    }

    pub fn trace_reward(&self, trace_id: &str) -> Option<f64> {
        self.view.index.trace_rewards.get(trace_id).copied()
    }

    pub fn session_reward(&self, session_id: &str) -> Option<f64> {
        self.view.index.sessions.get(session_id).and_then(|e| e.reward)
    }

    /// Number of live calls.
    pub fn call_count(&self) -> usize {
        self.view.index.call_count()
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

    /// Every live call, in log order (oldest append first).
    pub fn iter_calls(&self) -> impl Iterator<Item = Result<CallView<'_>>> + '_ {
        self.view.segments.values().flat_map(move |seg| LiveCalls {
            snapshot: self,
            seg,
            at: HEADER_BYTES,
            done: false,
        })
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

/// Live calls of one segment in log order.
struct LiveCalls<'a> {
    snapshot: &'a Snapshot,
    seg: &'a SegmentRef,
    at: u64,
    done: bool,
}

impl<'a> Iterator for LiveCalls<'a> {
    type Item = Result<CallView<'a>>;
    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let offset = self.at;
            match read_frame(self.seg.bytes(), offset) {
                Ok(FrameRead::End) => self.done = true,
                Err(e) => {
                    self.done = true;
                    return Some(Err(Error::corrupt(self.seg.path.as_path(), offset, e.what)));
                }
                Ok(FrameRead::Frame { body, next }) => {
                    self.at = next;
                    if body_kind(body) != Some(KIND_CALL) {
                        continue;
                    }
                    let loc = Loc { segment: self.seg.id, offset };
                    let record = match decode_call(body) {
                        Ok(r) => r,
                        Err(e) => return Some(Err(Error::corrupt(self.seg.path.as_path(), offset, e.what))),
                    };
                    let live = self.snapshot.view.index.traces.get(record.trace_id).is_some_and(|m| m.loc == loc);
                    if live {
                        return Some(Ok(CallView { loc, record, snapshot: self.snapshot }));
                    }
                }
            }
        }
        None
    }
}
