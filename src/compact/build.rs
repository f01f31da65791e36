//! Turning one session's calls into `steps` rows and `trajectories` rows
//! (format-spec/shard.md §2, §3), accumulated column by column.

use crate::error::{Error, Result};
use crate::format::record::{Loc, Relation};
use crate::shard::schema::{steps_schema, trajectories_schema};
use arrow_array::builder::{
    BinaryBuilder, BooleanBuilder, Float32Builder, Float64Builder, Int64Builder, ListBuilder, StringBuilder,
    UInt32Builder, UInt64Builder, UInt8Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
use std::collections::HashMap;
use std::sync::Arc;

/// Everything compaction needs of one call, owned (the session being compacted
/// is the only thing held in memory).
#[derive(Debug, Clone)]
pub struct StepInput {
    pub loc: Loc,
    pub parent: Option<Loc>,
    pub relation: Relation,
    pub divergence_position: Option<u32>,
    pub call_index: u32,
    pub trace_id: String,
    pub session_id: String,
    pub session_uids: Vec<String>,
    pub timestamp: f64,
    pub model: Option<String>,
    pub weight_version: Option<i64>,
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    pub reward: Option<f64>,
    pub messages: Option<String>,
    pub response_message: Option<String>,
    pub metadata: Option<String>,
    pub latency_ms: Option<f64>,
    pub routing_matrices: Option<Vec<u8>>,
    pub extra: Option<String>,
}

impl StepInput {
    /// Bytes this step adds to a shard before compression (for sizing).
    pub fn approx_bytes(&self) -> usize {
        4 * (self.prompt.len() + 2 * self.completion.len())
            + self.messages.as_ref().map_or(0, String::len)
            + self.response_message.as_ref().map_or(0, String::len)
            + self.metadata.as_ref().map_or(0, String::len)
            + self.extra.as_ref().map_or(0, String::len)
            + 128
    }
}

/// Column builders of the `steps` table.
pub struct StepsBuilder {
    trace_id: StringBuilder,
    session_id: StringBuilder,
    call_index: UInt32Builder,
    timestamp: Float64Builder,
    model: StringBuilder,
    weight_version: Int64Builder,
    prompt_ids: ListBuilder<UInt32Builder>,
    completion_ids: ListBuilder<UInt32Builder>,
    logprobs: ListBuilder<Float32Builder>,
    finish_reason: StringBuilder,
    tito_break: BooleanBuilder,
    relation: StringBuilder,
    divergence_position: UInt32Builder,
    reward: Float64Builder,
    messages: StringBuilder,
    response_message: StringBuilder,
    metadata: StringBuilder,
    raw_request: StringBuilder,
    raw_response: StringBuilder,
    session_uids: ListBuilder<StringBuilder>,
    latency_ms: Float64Builder,
    routing_matrices: BinaryBuilder,
    extra: StringBuilder,
    key_order: StringBuilder,
    extra_splice: ListBuilder<UInt32Builder>,
    source_segment: UInt64Builder,
    source_offset: UInt64Builder,
    pub rows: usize,
    pub bytes: usize,
}

fn list_u32() -> ListBuilder<UInt32Builder> {
    ListBuilder::new(UInt32Builder::new()).with_field(Arc::new(arrow_schema::Field::new(
        "item",
        arrow_schema::DataType::UInt32,
        false,
    )))
}

fn list_f32() -> ListBuilder<Float32Builder> {
    ListBuilder::new(Float32Builder::new()).with_field(Arc::new(arrow_schema::Field::new(
        "item",
        arrow_schema::DataType::Float32,
        false,
    )))
}

fn list_u8() -> ListBuilder<UInt8Builder> {
    ListBuilder::new(UInt8Builder::new()).with_field(Arc::new(arrow_schema::Field::new(
        "item",
        arrow_schema::DataType::UInt8,
        false,
    )))
}

fn list_str() -> ListBuilder<StringBuilder> {
    ListBuilder::new(StringBuilder::new()).with_field(Arc::new(arrow_schema::Field::new(
        "item",
        arrow_schema::DataType::Utf8,
        false,
    )))
}

impl Default for StepsBuilder {
    fn default() -> Self {
        Self {
            trace_id: StringBuilder::new(),
            session_id: StringBuilder::new(),
            call_index: UInt32Builder::new(),
            timestamp: Float64Builder::new(),
            model: StringBuilder::new(),
            weight_version: Int64Builder::new(),
            prompt_ids: list_u32(),
            completion_ids: list_u32(),
            logprobs: list_f32(),
            finish_reason: StringBuilder::new(),
            tito_break: BooleanBuilder::new(),
            relation: StringBuilder::new(),
            divergence_position: UInt32Builder::new(),
            reward: Float64Builder::new(),
            messages: StringBuilder::new(),
            response_message: StringBuilder::new(),
            metadata: StringBuilder::new(),
            raw_request: StringBuilder::new(),
            raw_response: StringBuilder::new(),
            session_uids: list_str(),
            latency_ms: Float64Builder::new(),
            routing_matrices: BinaryBuilder::new(),
            extra: StringBuilder::new(),
            key_order: StringBuilder::new(),
            extra_splice: list_u32(),
            source_segment: UInt64Builder::new(),
            source_offset: UInt64Builder::new(),
            rows: 0,
            bytes: 0,
        }
    }
}

impl StepsBuilder {
    pub fn push(&mut self, s: &StepInput) {
        self.trace_id.append_value(&s.trace_id);
        self.session_id.append_value(&s.session_id);
        self.call_index.append_value(s.call_index);
        self.timestamp.append_value(s.timestamp);
        self.model.append_option(s.model.as_deref());
        self.weight_version.append_option(s.weight_version);
        self.prompt_ids.values().append_slice(&s.prompt);
        self.prompt_ids.append(true);
        self.completion_ids.values().append_slice(&s.completion);
        self.completion_ids.append(true);
        match &s.logprobs {
            Some(lp) => {
                self.logprobs.values().append_slice(lp);
                self.logprobs.append(true);
            }
            None => self.logprobs.append(false),
        }
        self.finish_reason.append_option(s.finish_reason.as_deref());
        self.tito_break.append_value(s.relation == Relation::TitoBreak);
        self.relation.append_value(s.relation.name());
        self.divergence_position.append_option(s.divergence_position);
        self.reward.append_option(s.reward);
        self.messages.append_option(s.messages.as_deref());
        self.response_message.append_option(s.response_message.as_deref());
        self.metadata.append_option(s.metadata.as_deref());
        // format-spec/shard.md §2.1: the raw bodies and the key order leave
        // `extra` for their own columns, and come back byte for byte on read.
        let split = crate::shard::extra::split(s.extra.as_deref());
        let [key_order, raw_request, raw_response] = &split.moved;
        self.raw_request.append_option(raw_request.as_deref());
        self.raw_response.append_option(raw_response.as_deref());
        for u in &s.session_uids {
            self.session_uids.values().append_value(u);
        }
        self.session_uids.append(true);
        self.latency_ms.append_option(s.latency_ms);
        self.routing_matrices.append_option(s.routing_matrices.as_deref());
        self.extra.append_option(split.extra.as_deref());
        self.key_order.append_option(key_order.as_deref());
        if split.splice.is_empty() {
            self.extra_splice.append(false);
        } else {
            self.extra_splice.values().append_slice(&split.splice);
            self.extra_splice.append(true);
        }
        self.source_segment.append_value(s.loc.segment);
        self.source_offset.append_value(s.loc.offset);
        self.rows += 1;
        self.bytes += s.approx_bytes();
    }

    /// Take the rows built so far as a record batch.
    pub fn finish(&mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.trace_id.finish()),
            Arc::new(self.session_id.finish()),
            Arc::new(self.call_index.finish()),
            Arc::new(self.timestamp.finish()),
            Arc::new(self.model.finish()),
            Arc::new(self.weight_version.finish()),
            Arc::new(self.prompt_ids.finish()),
            Arc::new(self.completion_ids.finish()),
            Arc::new(self.logprobs.finish()),
            Arc::new(self.finish_reason.finish()),
            Arc::new(self.tito_break.finish()),
            Arc::new(self.relation.finish()),
            Arc::new(self.divergence_position.finish()),
            Arc::new(self.reward.finish()),
            Arc::new(self.messages.finish()),
            Arc::new(self.response_message.finish()),
            Arc::new(self.metadata.finish()),
            Arc::new(self.raw_request.finish()),
            Arc::new(self.raw_response.finish()),
            Arc::new(self.session_uids.finish()),
            Arc::new(self.latency_ms.finish()),
            Arc::new(self.routing_matrices.finish()),
            Arc::new(self.extra.finish()),
            Arc::new(self.key_order.finish()),
            Arc::new(self.extra_splice.finish()),
            Arc::new(self.source_segment.finish()),
            Arc::new(self.source_offset.finish()),
        ];
        self.rows = 0;
        self.bytes = 0;
        RecordBatch::try_new(steps_schema(), columns).map_err(|e| {
            Error::new(crate::ErrorKind::Io, format!("internal: steps batch does not match its schema: {e}"))
        })
    }
}

/// One trajectory row being assembled.
#[derive(Debug, Clone, Default)]
pub struct Trajectory {
    pub token_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    pub logprobs: Vec<f32>,
    pub call_starts: Vec<u32>,
    pub completion_lens: Vec<u32>,
    pub trace_ids: Vec<String>,
    pub weight_version_min: Option<i64>,
    pub weight_version_max: Option<i64>,
    pub last_trace_reward: Option<f64>,
}

impl Trajectory {
    fn add_call(&mut self, s: &StepInput) {
        // The new part of the prompt (everything past what the row already holds).
        let have = self.token_ids.len();
        let suffix = s.prompt.get(have..).unwrap_or(&[]);
        self.token_ids.extend_from_slice(suffix);
        self.loss_mask.resize(self.token_ids.len(), 0);
        self.logprobs.resize(self.token_ids.len(), 0.0);
        self.call_starts.push(self.token_ids.len() as u32);
        self.completion_lens.push(s.completion.len() as u32);
        self.token_ids.extend_from_slice(&s.completion);
        self.loss_mask.resize(self.token_ids.len(), 1);
        match &s.logprobs {
            Some(lp) => self.logprobs.extend_from_slice(lp),
            None => self.logprobs.resize(self.token_ids.len(), 0.0),
        }
        self.trace_ids.push(s.trace_id.clone());
        if let Some(w) = s.weight_version {
            self.weight_version_min = Some(self.weight_version_min.map_or(w, |m| m.min(w)));
            self.weight_version_max = Some(self.weight_version_max.map_or(w, |m| m.max(w)));
        }
        self.last_trace_reward = s.reward;
    }
}

/// Split a session's calls (oldest first) into chains linked by exact
/// extension: a call continues the chain whose last call is its parent when it
/// extends that parent exactly; otherwise (a break, a divergence, a root, or a
/// second child of the same parent) it starts a new chain.
pub fn chains(steps: &[StepInput]) -> Vec<Trajectory> {
    let mut out: Vec<Trajectory> = Vec::new();
    let mut tails: HashMap<Loc, usize> = HashMap::new();
    for s in steps {
        let continues = match (s.relation, s.parent) {
            (Relation::Extends, Some(p)) => tails.remove(&p),
            _ => None,
        };
        // The chain holds prompt ++ completion of its last call: the new prompt
        // must start with it for the row to stay exact.
        let chain =
            continues.and_then(|i| Some(i).zip(out.get_mut(i))).filter(|(_, t)| s.prompt.starts_with(&t.token_ids));
        let idx = match chain {
            Some((i, t)) => {
                t.add_call(s);
                i
            }
            None => {
                let mut t = Trajectory::default();
                t.add_call(s);
                out.push(t);
                out.len() - 1
            }
        };
        tails.insert(s.loc, idx);
    }
    out
}

/// The GRPO group of a session: `metadata.group_id` of its first call if
/// present, else the session id up to its first `:`.
pub fn group_id(session_id: &str, first_metadata: Option<&str>) -> String {
    if let Some(meta) = first_metadata {
        if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(meta) {
            match map.get("group_id") {
                Some(serde_json::Value::String(s)) => return s.clone(),
                Some(v @ serde_json::Value::Number(_)) => return v.to_string(),
                _ => {}
            }
        }
    }
    session_id.split(':').next().unwrap_or(session_id).to_owned()
}

/// Column builders of the `trajectories` table.
pub struct TrajectoriesBuilder {
    session_id: StringBuilder,
    segment_index: UInt32Builder,
    group_id: StringBuilder,
    token_ids: ListBuilder<UInt32Builder>,
    loss_mask: ListBuilder<UInt8Builder>,
    logprobs: ListBuilder<Float32Builder>,
    call_starts: ListBuilder<UInt32Builder>,
    completion_lens: ListBuilder<UInt32Builder>,
    num_calls: UInt32Builder,
    trace_ids: ListBuilder<StringBuilder>,
    reward: Float64Builder,
    weight_version_min: Int64Builder,
    weight_version_max: Int64Builder,
    pub rows: usize,
    pub bytes: usize,
}

impl Default for TrajectoriesBuilder {
    fn default() -> Self {
        Self {
            session_id: StringBuilder::new(),
            segment_index: UInt32Builder::new(),
            group_id: StringBuilder::new(),
            token_ids: list_u32(),
            loss_mask: list_u8(),
            logprobs: list_f32(),
            call_starts: list_u32(),
            completion_lens: list_u32(),
            num_calls: UInt32Builder::new(),
            trace_ids: list_str(),
            reward: Float64Builder::new(),
            weight_version_min: Int64Builder::new(),
            weight_version_max: Int64Builder::new(),
            rows: 0,
            bytes: 0,
        }
    }
}

impl TrajectoriesBuilder {
    pub fn push(&mut self, session_id: &str, segment_index: u32, group: &str, t: &Trajectory, reward: Option<f64>) {
        self.session_id.append_value(session_id);
        self.segment_index.append_value(segment_index);
        self.group_id.append_value(group);
        self.token_ids.values().append_slice(&t.token_ids);
        self.token_ids.append(true);
        self.loss_mask.values().append_slice(&t.loss_mask);
        self.loss_mask.append(true);
        self.logprobs.values().append_slice(&t.logprobs);
        self.logprobs.append(true);
        self.call_starts.values().append_slice(&t.call_starts);
        self.call_starts.append(true);
        self.completion_lens.values().append_slice(&t.completion_lens);
        self.completion_lens.append(true);
        self.num_calls.append_value(t.call_starts.len() as u32);
        for id in &t.trace_ids {
            self.trace_ids.values().append_value(id);
        }
        self.trace_ids.append(true);
        self.reward.append_option(reward.or(t.last_trace_reward));
        self.weight_version_min.append_option(t.weight_version_min);
        self.weight_version_max.append_option(t.weight_version_max);
        self.rows += 1;
        self.bytes += 9 * t.token_ids.len() + 64;
    }

    pub fn finish(&mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.session_id.finish()),
            Arc::new(self.segment_index.finish()),
            Arc::new(self.group_id.finish()),
            Arc::new(self.token_ids.finish()),
            Arc::new(self.loss_mask.finish()),
            Arc::new(self.logprobs.finish()),
            Arc::new(self.call_starts.finish()),
            Arc::new(self.completion_lens.finish()),
            Arc::new(self.num_calls.finish()),
            Arc::new(self.trace_ids.finish()),
            Arc::new(self.reward.finish()),
            Arc::new(self.weight_version_min.finish()),
            Arc::new(self.weight_version_max.finish()),
        ];
        self.rows = 0;
        self.bytes = 0;
        RecordBatch::try_new(trajectories_schema(), columns).map_err(|e| {
            Error::new(crate::ErrorKind::Io, format!("internal: trajectories batch does not match its schema: {e}"))
        })
    }
}
