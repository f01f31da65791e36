//! Record bodies (format-spec/record.md): a call with its token columns, and the
//! three annotation kinds. A body starts 8-aligned in the file; the call header
//! is 104 bytes, so the u32/f32 columns that follow it are 4-aligned and are
//! viewed in place by readers.

use super::{Cursor, DecodeError, PutLe};
use crate::limits::*;
use crate::record::{Annotation, Call, Target};

pub const KIND_CALL: u8 = 1;
pub const KIND_REWARD: u8 = 2;
pub const KIND_SEAL: u8 = 3;
pub const KIND_DELETE_SESSION: u8 = 4;
/// A session moved forward by the copy-forward collector (segment format 5).
pub const KIND_MOVE_SESSION: u8 = 5;

/// Bytes of the fixed call header (record.md §2).
pub const CALL_HEADER_BYTES: usize = 104;

const F_LOGPROBS: u16 = 1 << 0;
const F_WEIGHT_VERSION: u16 = 1 << 1;
const F_LATENCY: u16 = 1 << 2;
const F_MODEL: u16 = 1 << 3;
const F_FINISH_REASON: u16 = 1 << 4;
const F_MESSAGES: u16 = 1 << 5;
const F_RESPONSE: u16 = 1 << 6;
const F_METADATA: u16 = 1 << 7;
const F_EXTRA: u16 = 1 << 8;
const F_ROUTING: u16 = 1 << 9;
const F_PARENT: u16 = 1 << 10;
/// The four JSON documents are in a docs block (format version 2, §7).
const F_DOCS: u16 = 1 << 11;
/// A checkpoint (format version 3, §4): the prompt column holds the whole
/// prompt although the record has a parent.
const F_CHECKPOINT: u16 = 1 << 12;
const F_KNOWN: u16 = (1 << 13) - 1;

/// Where a frame lives: segment id and the frame's byte offset in that segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc {
    pub segment: u64,
    pub offset: u64,
}

/// How a call's prompt relates to its parent's context (`prompt ++ completion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Relation {
    /// First call of its session (no earlier call to compare with).
    Root = 0,
    /// The prompt starts with the parent's whole context: TI/TO holds.
    Extends = 1,
    /// The prompt diverges inside the parent's completion: the retokenization
    /// signature, a TI/TO break at position `prefix_len`.
    TitoBreak = 2,
    /// The prompt diverges inside the parent's prompt (re-rendered history, or a
    /// new conversation in the same session) at position `prefix_len`.
    DivergesEarlier = 3,
}

impl Relation {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Relation::Root,
            1 => Relation::Extends,
            2 => Relation::TitoBreak,
            3 => Relation::DivergesEarlier,
            _ => return None,
        })
    }

    /// Short lowercase name, as printed by the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Relation::Root => "root",
            Relation::Extends => "extends",
            Relation::TitoBreak => "tito_break",
            Relation::DivergesEarlier => "diverges_earlier",
        }
    }
}

/// The prefix-delta part of a call record, chosen by the writer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Delta {
    pub parent: Option<Loc>,
    /// Leading prompt tokens equal to the parent's context; not stored again
    /// unless `checkpoint`.
    pub prefix_len: u32,
    pub relation: Relation,
    /// Store the whole prompt anyway (record.md §4 checkpoints), so that
    /// rebuilding it does not walk the parent chain.
    pub checkpoint: bool,
}

impl Delta {
    pub const ROOT: Delta = Delta { parent: None, prefix_len: 0, relation: Relation::Root, checkpoint: false };

    /// Prompt tokens taken from the parent (not stored in the record).
    pub fn tokens_from_parent(&self) -> u32 {
        if self.checkpoint {
            0
        } else {
            self.prefix_len
        }
    }
}

fn opt_len<T>(v: &Option<Vec<T>>) -> usize {
    v.as_ref().map_or(0, Vec::len)
}

/// Bytes the encoded body of `call` will take (before framing), its
/// documents stored plain or, with `docs`, as that docs block
/// ([`super::docs::encode`]).
pub fn call_body_len(call: &Call, delta: &Delta, docs: Option<&[u8]>) -> u64 {
    let suffix = call.prompt_token_ids.len() - delta.tokens_from_parent() as usize;
    let cols = suffix + call.completion_token_ids.len() + opt_len(&call.logprobs);
    let uids: usize = call.session_uids.iter().map(|u| 2 + u.len()).sum();
    let bytes = call.trace_id.len()
        + call.session_id.len()
        + uids
        + call.model.as_ref().map_or(0, String::len)
        + call.finish_reason.as_ref().map_or(0, String::len)
        + docs.map_or_else(|| plain_docs_len(call), <[u8]>::len)
        + opt_len(&call.routing_matrices);
    (CALL_HEADER_BYTES + cols * 4 + bytes) as u64
}

fn plain_docs_len(call: &Call) -> usize {
    opt_len(&call.messages) + opt_len(&call.response_message) + opt_len(&call.metadata) + opt_len(&call.extra)
}

/// Encode a validated call (see [`Call::validate`]) as a record body; with
/// `docs` (a segment of format version 2 only), its documents as that docs
/// block made by [`super::docs::encode`] from this call.
pub fn encode_call(out: &mut Vec<u8>, call: &Call, delta: &Delta, docs: Option<&[u8]>) {
    let start = out.len();
    let prefix = delta.tokens_from_parent() as usize;
    debug_assert!(prefix <= call.prompt_token_ids.len());
    let suffix = call.prompt_token_ids.get(prefix..).unwrap_or(&[]);
    let mut flags = 0u16;
    let mut set = |bit: u16, on: bool| {
        if on {
            flags |= bit
        }
    };
    set(F_LOGPROBS, call.logprobs.is_some());
    set(F_WEIGHT_VERSION, call.weight_version.is_some());
    set(F_LATENCY, call.latency_ms.is_some());
    set(F_MODEL, call.model.is_some());
    set(F_FINISH_REASON, call.finish_reason.is_some());
    set(F_MESSAGES, call.messages.is_some());
    set(F_RESPONSE, call.response_message.is_some());
    set(F_METADATA, call.metadata.is_some());
    set(F_EXTRA, call.extra.is_some());
    set(F_ROUTING, call.routing_matrices.is_some());
    set(F_PARENT, delta.parent.is_some());
    set(F_DOCS, docs.is_some());
    set(F_CHECKPOINT, delta.checkpoint && delta.parent.is_some());
    let plain = |d: &Option<Vec<u8>>| if docs.is_some() { 0 } else { opt_len(d) };
    let parent = delta.parent.unwrap_or(Loc { segment: 0, offset: 0 });
    let uids_len: usize = call.session_uids.iter().map(|u| 2 + u.len()).sum();

    out.put_u8(KIND_CALL);
    out.put_u8(delta.relation as u8);
    out.put_u16(flags);
    out.put_u32(call.session_uids.len() as u32);
    out.put_f64(call.timestamp);
    out.extend_from_slice(&call.weight_version.unwrap_or(0).to_le_bytes());
    out.put_f64(call.latency_ms.unwrap_or(0.0));
    out.put_u64(parent.segment);
    out.put_u64(parent.offset);
    out.put_u32(call.prompt_token_ids.len() as u32);
    out.put_u32(delta.prefix_len);
    out.put_u32(call.completion_token_ids.len() as u32);
    out.put_u32(docs.map_or(0, <[u8]>::len) as u32);
    for len in [
        call.trace_id.len(),
        call.session_id.len(),
        uids_len,
        call.model.as_ref().map_or(0, String::len),
        call.finish_reason.as_ref().map_or(0, String::len),
        plain(&call.messages),
        plain(&call.response_message),
        plain(&call.metadata),
        plain(&call.extra),
        opt_len(&call.routing_matrices),
    ] {
        out.put_u32(len as u32);
    }
    debug_assert_eq!(out.len() - start, CALL_HEADER_BYTES);
    // Columns: little-endian in memory on every supported target (see format/mod.rs).
    out.extend_from_slice(bytemuck::cast_slice(suffix));
    out.extend_from_slice(bytemuck::cast_slice(&call.completion_token_ids));
    if let Some(lp) = &call.logprobs {
        out.extend_from_slice(bytemuck::cast_slice(lp));
    }
    out.extend_from_slice(call.trace_id.as_bytes());
    out.extend_from_slice(call.session_id.as_bytes());
    for uid in &call.session_uids {
        out.put_str16(uid);
    }
    for s in [&call.model, &call.finish_reason].into_iter().flatten() {
        out.extend_from_slice(s.as_bytes());
    }
    if docs.is_none() {
        for b in [&call.messages, &call.response_message, &call.metadata, &call.extra].into_iter().flatten() {
            out.extend_from_slice(b);
        }
    }
    if let Some(r) = &call.routing_matrices {
        out.extend_from_slice(r);
    }
    if let Some(d) = docs {
        out.extend_from_slice(d);
    }
    debug_assert_eq!((out.len() - start) as u64, call_body_len(call, delta, docs));
}

/// A call record viewed in place: every slice borrows the buffer it was decoded from.
#[derive(Debug, Clone, PartialEq)]
pub struct CallRecord<'a> {
    pub relation: Relation,
    pub timestamp: f64,
    pub weight_version: Option<i64>,
    pub latency_ms: Option<f64>,
    pub parent: Option<Loc>,
    /// Length of the full prompt.
    pub prompt_len: u32,
    /// Leading prompt tokens taken from the parent's context (0 for a
    /// checkpoint, which stores its whole prompt).
    pub prefix_len: u32,
    /// Leading prompt tokens equal to the parent's context (`prefix_len` on
    /// disk, record.md §4): the first diverging position of a TI/TO break or
    /// an earlier divergence. Equals `prefix_len` but for a checkpoint.
    pub shared_len: u32,
    /// The stored prompt tokens (`prompt[prefix_len..]`).
    pub prompt_suffix: &'a [u32],
    pub completion: &'a [u32],
    pub logprobs: Option<&'a [f32]>,
    pub trace_id: &'a str,
    pub session_id: &'a str,
    pub session_uids: Vec<&'a str>,
    pub model: Option<&'a str>,
    pub finish_reason: Option<&'a str>,
    pub messages: Option<&'a [u8]>,
    pub response_message: Option<&'a [u8]>,
    pub metadata: Option<&'a [u8]>,
    pub extra: Option<&'a [u8]>,
    pub routing_matrices: Option<&'a [u8]>,
    /// Format version 2: the four documents above are `None` and stored in
    /// this docs block instead (format-spec/record.md §7); resolve it with
    /// [`super::docs::open`] and the call's columns.
    pub docs: Option<DocsRef<'a>>,
}

/// A call's docs block, in place, and which documents it holds (messages,
/// response_message, metadata, extra).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DocsRef<'a> {
    pub block: &'a [u8],
    pub present: [bool; 4],
}

fn limit_check(value: u64, max: u64, what: &str, at: usize) -> Result<(), DecodeError> {
    if value > max {
        return Err(DecodeError::new(at, format!("{what} {value} is over its limit {max}")));
    }
    Ok(())
}

/// Decode a call body. The body must be 4-byte aligned in memory for the token
/// columns to be viewed in place (bodies in mapped segments always are).
pub fn decode_call(body: &[u8]) -> Result<CallRecord<'_>, DecodeError> {
    let mut c = Cursor::new(body);
    let kind = c.u8("record kind")?;
    if kind != KIND_CALL {
        return Err(DecodeError::new(0, format!("record kind {kind} is not a call")));
    }
    let relation_byte = c.u8("relation")?;
    let relation = Relation::from_u8(relation_byte)
        .ok_or_else(|| DecodeError::new(1, format!("unknown relation {relation_byte}")))?;
    let flags = c.u16("flags")?;
    if flags & !F_KNOWN != 0 {
        return Err(DecodeError::new(2, format!("unknown flag bits {flags:#06x}")));
    }
    let has = |bit: u16| flags & bit != 0;
    let n_uids = c.u32("session uid count")?;
    limit_check(u64::from(n_uids), SESSION_UIDS_MAX, "session uid count", 4)?;
    let timestamp = c.f64("timestamp")?;
    let weight_version = c.i64("weight_version")?;
    let latency_ms = c.f64("latency_ms")?;
    let parent = Loc { segment: c.u64("parent segment")?, offset: c.u64("parent offset")? };
    let prompt_len = c.u32("prompt length")?;
    let prefix_len = c.u32("prefix length")?;
    let completion_len = c.u32("completion length")?;
    let docs_len = c.u32("docs length")? as usize;
    limit_check(u64::from(prompt_len), PROMPT_TOKENS_MAX, "prompt length", 48)?;
    limit_check(u64::from(completion_len), COMPLETION_TOKENS_MAX, "completion length", 56)?;
    if prefix_len > prompt_len {
        return Err(DecodeError::new(52, format!("prefix length {prefix_len} exceeds prompt length {prompt_len}")));
    }
    if !has(F_PARENT) && (prefix_len != 0 || relation != Relation::Root || has(F_CHECKPOINT)) {
        return Err(DecodeError::new(1, "a record without a parent must be a root with no prefix"));
    }
    let shared_len = prefix_len;
    let prefix_len = if has(F_CHECKPOINT) { 0 } else { prefix_len };
    let mut lens = [0usize; 10];
    for len in &mut lens {
        *len = c.u32("field length")? as usize;
    }
    let [trace_len, session_len, uids_len, model_len, finish_len, msg_len, resp_len, meta_len, extra_len, routing_len] =
        lens;
    if has(F_DOCS) {
        if msg_len + resp_len + meta_len + extra_len != 0 {
            return Err(DecodeError::new(84, "a record with a docs block has plain document lengths"));
        }
        if docs_len < super::docs::HEADER_BYTES {
            return Err(DecodeError::new(60, format!("docs length {docs_len} is shorter than its header")));
        }
    } else if docs_len != 0 {
        return Err(DecodeError::new(60, "docs length without the docs flag"));
    }
    let prompt_suffix = c.u32s((prompt_len - prefix_len) as usize, "prompt suffix column")?;
    let completion = c.u32s(completion_len as usize, "completion column")?;
    let logprobs = if has(F_LOGPROBS) { Some(c.f32s(completion_len as usize, "logprobs column")?) } else { None };
    let trace_id = c.str(trace_len, "trace_id")?;
    let session_id = c.str(session_len, "session_id")?;
    let uids_start = c.pos();
    let uids_raw = c.bytes(uids_len, "session_uids")?;
    let mut uc = Cursor::new(uids_raw);
    let mut session_uids = Vec::with_capacity(n_uids as usize);
    for _ in 0..n_uids {
        session_uids
            .push(uc.str16("session uid").map_err(|e| DecodeError::new(uids_start + e.offset as usize, e.what))?);
    }
    if uc.pos() != uids_raw.len() {
        return Err(DecodeError::new(uids_start, "session_uids bytes do not match their count"));
    }
    let mut opt_str = |bit: u16, len: usize, what: &str| -> Result<Option<&str>, DecodeError> {
        let s = c.str(len, what)?;
        Ok(if has(bit) { Some(s) } else { None })
    };
    let model = opt_str(F_MODEL, model_len, "model")?;
    let finish_reason = opt_str(F_FINISH_REASON, finish_len, "finish_reason")?;
    let mut opt_bytes = |bit: u16, len: usize, what: &str| -> Result<Option<&[u8]>, DecodeError> {
        let b = c.bytes(len, what)?;
        Ok(if has(bit) { Some(b) } else { None })
    };
    let messages = opt_bytes(F_MESSAGES, msg_len, "messages")?;
    let response_message = opt_bytes(F_RESPONSE, resp_len, "response_message")?;
    let metadata = opt_bytes(F_METADATA, meta_len, "metadata")?;
    let extra = opt_bytes(F_EXTRA, extra_len, "extra")?;
    let routing_matrices = opt_bytes(F_ROUTING, routing_len, "routing_matrices")?;
    let present = [has(F_MESSAGES), has(F_RESPONSE), has(F_METADATA), has(F_EXTRA)];
    let (messages, response_message, metadata, extra, docs) = if has(F_DOCS) {
        (None, None, None, None, Some(DocsRef { block: c.bytes(docs_len, "docs block")?, present }))
    } else {
        (messages, response_message, metadata, extra, None)
    };
    if c.pos() != body.len() {
        return Err(DecodeError::new(
            c.pos(),
            format!("{} trailing bytes after the call record", body.len() - c.pos()),
        ));
    }
    Ok(CallRecord {
        relation,
        timestamp,
        weight_version: has(F_WEIGHT_VERSION).then_some(weight_version),
        latency_ms: has(F_LATENCY).then_some(latency_ms),
        parent: has(F_PARENT).then_some(parent),
        prompt_len,
        prefix_len,
        shared_len,
        prompt_suffix,
        completion,
        logprobs,
        trace_id,
        session_id,
        session_uids,
        model,
        finish_reason,
        messages,
        response_message,
        metadata,
        extra,
        routing_matrices,
        docs,
    })
}

/// Encode an annotation body (record.md §3).
pub fn encode_annotation(out: &mut Vec<u8>, ann: &Annotation) {
    let (kind, target, value, id) = match ann {
        Annotation::Reward { target: Target::Trace(id), value } => (KIND_REWARD, 0u8, *value, id),
        Annotation::Reward { target: Target::Session(id), value } => (KIND_REWARD, 1u8, *value, id),
        Annotation::Seal { session_id } => (KIND_SEAL, 0, 0.0, session_id),
        Annotation::DeleteSession { session_id } => (KIND_DELETE_SESSION, 0, 0.0, session_id),
        Annotation::MoveSession { session_id } => (KIND_MOVE_SESSION, 0, 0.0, session_id),
    };
    out.put_u8(kind);
    out.put_u8(target);
    out.put_u16(0);
    out.put_u32(id.len() as u32);
    out.put_f64(value);
    out.extend_from_slice(id.as_bytes());
}

/// Decode an annotation body.
pub fn decode_annotation(body: &[u8]) -> Result<Annotation, DecodeError> {
    let mut c = Cursor::new(body);
    let kind = c.u8("record kind")?;
    let target = c.u8("annotation target")?;
    let _reserved = c.u16("reserved")?;
    let id_len = c.u32("annotation id length")?;
    limit_check(u64::from(id_len), ID_BYTES_MAX, "annotation id length", 4)?;
    let value = c.f64("annotation value")?;
    let id = c.str(id_len as usize, "annotation id")?.to_owned();
    if c.pos() != body.len() {
        return Err(DecodeError::new(c.pos(), "trailing bytes after the annotation"));
    }
    match (kind, target) {
        (KIND_REWARD, 0) => Ok(Annotation::Reward { target: Target::Trace(id), value }),
        (KIND_REWARD, 1) => Ok(Annotation::Reward { target: Target::Session(id), value }),
        (KIND_SEAL, 0) => Ok(Annotation::Seal { session_id: id }),
        (KIND_DELETE_SESSION, 0) => Ok(Annotation::DeleteSession { session_id: id }),
        (KIND_MOVE_SESSION, 0) => Ok(Annotation::MoveSession { session_id: id }),
        _ => Err(DecodeError::new(0, format!("unknown annotation kind {kind} / target {target}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 8-aligned copy of `bytes`, as bodies are in a mapped segment.
    pub(crate) fn aligned(bytes: &[u8]) -> Vec<u64> {
        let mut v = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
        v
    }

    #[test]
    fn golden_annotation_bytes() {
        let mut out = Vec::new();
        encode_annotation(&mut out, &Annotation::Reward { target: Target::Session("s".into()), value: 1.5 });
        assert_eq!(out, [2, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, b's']);
        assert_eq!(
            decode_annotation(&out).unwrap(),
            Annotation::Reward { target: Target::Session("s".into()), value: 1.5 }
        );
    }

    #[test]
    fn golden_call_header() {
        let call = Call {
            trace_id: "t".into(),
            session_id: "s".into(),
            timestamp: 2.0,
            prompt_token_ids: vec![7, 8, 9],
            completion_token_ids: vec![10],
            logprobs: Some(vec![-0.5]),
            ..Default::default()
        };
        let delta =
            Delta { parent: Some(Loc { segment: 1, offset: 64 }), prefix_len: 2, relation: Relation::Extends, checkpoint: false };
        let mut out = Vec::new();
        encode_call(&mut out, &call, &delta, None);
        assert_eq!(out.len(), CALL_HEADER_BYTES + 3 * 4 + 2);
        // kind=call, relation=extends, flags = logprobs | parent = 0x0401
        assert_eq!(&out[..4], &[1, 1, 0x01, 0x04]);
        assert_eq!(&out[CALL_HEADER_BYTES..CALL_HEADER_BYTES + 12], &[9, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0xbf]);
        let buf = aligned(&out);
        let bytes = &bytemuck::cast_slice::<u64, u8>(&buf)[..out.len()];
        let rec = decode_call(bytes).unwrap();
        assert_eq!(rec.prompt_suffix, &[9]);
        assert_eq!(rec.parent, delta.parent);
        assert_eq!(rec.logprobs, Some(&[-0.5f32][..]));
    }

    #[test]
    fn docs_block_replaces_the_plain_documents() {
        let messages = br#"[{"role":"user","content":"hi"}]"#.to_vec();
        let extra = format!(
            r#"{{"pad":"{}","raw_request":{{"messages":{}}},"raw_response":{{"prompt_token_ids":[7,8,9]}}}}"#,
            "y".repeat(300),
            String::from_utf8_lossy(&messages)
        );
        let call = Call {
            trace_id: "t".into(),
            session_id: "s".into(),
            prompt_token_ids: vec![7, 8, 9],
            messages: Some(messages),
            extra: Some(extra.into_bytes()),
            routing_matrices: Some(vec![1, 2]),
            ..Default::default()
        };
        let docs = super::super::docs::encode(&call, None).expect("a docs block pays off").block;
        let mut out = Vec::new();
        encode_call(&mut out, &call, &Delta::ROOT, Some(&docs));
        assert_eq!(out.len() as u64, call_body_len(&call, &Delta::ROOT, Some(&docs)));
        // flags: messages | extra | routing | docs
        assert_eq!(u16::from_le_bytes([out[2], out[3]]), (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11));
        assert_eq!(u32::from_le_bytes([out[60], out[61], out[62], out[63]]) as usize, docs.len());
        let buf = aligned(&out);
        let bytes = &bytemuck::cast_slice::<u64, u8>(&buf)[..out.len()];
        let rec = decode_call(bytes).expect("decode");
        assert_eq!((rec.messages, rec.extra), (None, None));
        assert_eq!(rec.routing_matrices, Some(&[1u8, 2][..]));
        let d = rec.docs.expect("docs");
        assert_eq!(d.present, [true, false, false, true]);
        let cols = super::super::docs::Columns { prompt: Some(&[7, 8, 9]), completion: &[], logprobs: None, parent: None };
        let got = super::super::docs::open(d.block, d.present).and_then(|b| b.resolve(&cols)).expect("resolve");
        assert_eq!((got.messages, got.extra), (call.messages.clone(), call.extra.clone()));
        for cut in 0..bytes.len() {
            assert!(decode_call(&bytes[..cut]).is_err());
        }
    }

    #[test]
    fn truncated_bodies_never_panic() {
        let call =
            Call { trace_id: "t".into(), session_id: "s".into(), prompt_token_ids: vec![1, 2], ..Default::default() };
        let mut out = Vec::new();
        encode_call(&mut out, &call, &Delta::ROOT, None);
        let buf = aligned(&out);
        let bytes = &bytemuck::cast_slice::<u64, u8>(&buf)[..out.len()];
        for cut in 0..bytes.len() {
            assert!(decode_call(&bytes[..cut]).is_err());
        }
        assert!(decode_call(bytes).is_ok());
    }
}
