//! JSON traces in and out: the rLLM gateway trace shape and the older rLLM SDK
//! shape are parsed into a [`Call`]; calls are exported in the gateway shape.
//!
//! Exactness: token ids must be integers in `0..=u32::MAX`; logprobs are parsed
//! from their decimal text straight to `f32` (no detour through `f64`, so no
//! double rounding) and printed as the shortest decimal that parses back to the
//! same `f32`. JSON documents (`messages`, `response_message`, `metadata`, and
//! every field trajlog has no column for) are kept as their verbatim JSON text.
//! A known field whose value is `null` is kept verbatim in `extra`, so the
//! exported dict has the same keys and values as the one ingested.

use crate::error::{Error, Result};
use crate::record::Call;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::fmt::Write as _;

type RawMap<'a> = BTreeMap<String, &'a RawValue>;

fn is_null(v: &RawValue) -> bool {
    v.get() == "null"
}

fn parse_ids(field: &str, raw: &RawValue) -> Result<Vec<u32>> {
    let items: Vec<&RawValue> = serde_json::from_str(raw.get())
        .map_err(|e| Error::invalid(field, format!("must be a list of token ids ({e})")))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let text = item.get();
        let id: u32 = text.parse().map_err(|_| {
            Error::invalid(format!("{field}[{i}]"), format!("{text} is not a token id (an integer in 0..=4294967295)"))
        })?;
        out.push(id);
    }
    Ok(out)
}

fn parse_logprobs(field: &str, raw: &RawValue) -> Result<Vec<f32>> {
    let items: Vec<&RawValue> = serde_json::from_str(raw.get())
        .map_err(|e| Error::invalid(field, format!("must be a list of numbers ({e})")))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let text = item.get();
        let is_number = text.starts_with(|c: char| c == '-' || c.is_ascii_digit());
        let v: f32 = if is_number { text.parse().map_err(|_| ()) } else { Err(()) }.map_err(|_| {
            Error::invalid(
                format!("{field}[{i}]"),
                format!("{text} is not a number; NaN, null and strings are refused"),
            )
        })?;
        if !v.is_finite() {
            return Err(Error::invalid(format!("{field}[{i}]"), format!("{text} does not fit in f32")));
        }
        out.push(v);
    }
    Ok(out)
}

fn parse_string(field: &str, raw: &RawValue) -> Result<String> {
    serde_json::from_str(raw.get()).map_err(|e| Error::invalid(field, format!("must be a string ({e})")))
}

fn parse_f64(field: &str, raw: &RawValue) -> Result<f64> {
    let v: f64 =
        serde_json::from_str(raw.get()).map_err(|e| Error::invalid(field, format!("must be a number ({e})")))?;
    Ok(v)
}

fn parse_i64(field: &str, raw: &RawValue) -> Result<i64> {
    serde_json::from_str(raw.get()).map_err(|e| Error::invalid(field, format!("must be an integer ({e})")))
}

/// Serialize `(key, verbatim JSON)` pairs as a JSON object.
pub(crate) fn write_object<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_json_str(&mut out, k);
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
    out
}

/// [`write_object`] as bytes, None when there are no pairs.
fn object_of<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<Vec<u8>> {
    let mut pairs = pairs.into_iter().peekable();
    pairs.peek()?;
    Some(write_object(pairs).into_bytes())
}

fn raw_pairs<'a>(map: &'a RawMap<'_>) -> impl Iterator<Item = (&'a str, &'a str)> {
    map.iter().map(|(k, v)| (k.as_str(), v.get()))
}

/// Parse one JSON trace (gateway or SDK shape). `now` fills a missing timestamp.
pub fn parse_trace(line: &str, now: f64) -> Result<Call> {
    let map: RawMap<'_> =
        serde_json::from_str(line).map_err(|e| Error::invalid("trace", format!("not a JSON object ({e})")))?;
    // Top-level token lists mean the gateway shape (also for an exported SDK
    // trace, whose leftover `input` object is kept as an extra field).
    let gateway = map.contains_key("prompt_token_ids") || map.contains_key("completion_token_ids");
    if !gateway && (map.contains_key("session_name") || map.get("input").is_some_and(|v| v.get().starts_with('{'))) {
        return parse_sdk(map, now);
    }
    parse_gateway(map, now, false)
}

/// Parse one gateway-shaped trace for an exact migration: `logprobs` go to the
/// column only when each is a float literal whose value is an `f32` (then
/// widening gives Python the same floats back); otherwise they are kept
/// verbatim with the other fields. Never takes the SDK shape.
pub fn parse_gateway_exact(text: &str, now: f64) -> Result<Call> {
    let map: RawMap<'_> =
        serde_json::from_str(text).map_err(|e| Error::invalid("trace", format!("not a JSON object ({e})")))?;
    parse_gateway(map, now, true)
}

fn parse_gateway(mut map: RawMap<'_>, now: f64, exact_logprobs: bool) -> Result<Call> {
    let mut call = Call { timestamp: now, ..Default::default() };
    let mut extra = RawMap::new();
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        let Some(v) = map.remove(&key) else { continue };
        if is_null(v) && key != "trace_id" && key != "session_id" {
            extra.insert(key, v);
            continue;
        }
        match key.as_str() {
            "trace_id" => call.trace_id = parse_string("trace_id", v)?,
            "session_id" => call.session_id = parse_string("session_id", v)?,
            "session_uids" => {
                call.session_uids = serde_json::from_str(v.get())
                    .map_err(|e| Error::invalid("session_uids", format!("must be a list of strings ({e})")))?
            }
            "timestamp" => call.timestamp = parse_f64("timestamp", v)?,
            "model" => call.model = Some(parse_string("model", v)?),
            "weight_version" => call.weight_version = Some(parse_i64("weight_version", v)?),
            "prompt_token_ids" => call.prompt_token_ids = parse_ids("prompt_token_ids", v)?,
            "completion_token_ids" => call.completion_token_ids = parse_ids("completion_token_ids", v)?,
            "logprobs" if exact_logprobs => match crate::rllm::exact_logprobs(v.get()) {
                Some(lp) => call.logprobs = Some(lp),
                None => {
                    extra.insert(key, v);
                }
            },
            "logprobs" => call.logprobs = Some(parse_logprobs("logprobs", v)?),
            "finish_reason" => call.finish_reason = Some(parse_string("finish_reason", v)?),
            "latency_ms" => call.latency_ms = Some(parse_f64("latency_ms", v)?),
            "routing_matrices" => call.routing_matrices = Some(v.get().as_bytes().to_vec()),
            "messages" => call.messages = Some(v.get().as_bytes().to_vec()),
            "response_message" => call.response_message = Some(v.get().as_bytes().to_vec()),
            "metadata" => call.metadata = Some(v.get().as_bytes().to_vec()),
            _ => {
                extra.insert(key, v);
            }
        }
    }
    if call.trace_id.is_empty() {
        return Err(Error::invalid("trace_id", "missing; every trace needs a trace_id string"));
    }
    if call.session_id.is_empty() {
        return Err(Error::invalid("session_id", "missing; every trace needs a session_id string"));
    }
    call.extra = object_of(raw_pairs(&extra));
    call.validate()?;
    Ok(call)
}

/// The fields of the gateway shape that have columns.
const GATEWAY_FIELDS: &[&str] = &[
    "trace_id",
    "session_id",
    "session_uids",
    "timestamp",
    "model",
    "weight_version",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "finish_reason",
    "latency_ms",
    "routing_matrices",
    "messages",
    "response_message",
    "metadata",
];

/// The older rLLM SDK shape: `session_name`, `input.{messages,prompt_token_ids}`,
/// `output.{output_token_ids,rollout_logprobs,message,finish_reason}`.
fn parse_sdk(mut map: RawMap<'_>, now: f64) -> Result<Call> {
    let mut call = Call { timestamp: now, ..Default::default() };
    let take_obj = |map: &mut RawMap<'_>, key: &str| -> Result<BTreeMap<String, Box<RawValue>>> {
        match map.remove(key) {
            None => Ok(BTreeMap::new()),
            Some(v) if is_null(v) => Ok(BTreeMap::new()),
            Some(v) => {
                serde_json::from_str(v.get()).map_err(|e| Error::invalid(key, format!("must be an object ({e})")))
            }
        }
    };
    let mut input = take_obj(&mut map, "input")?;
    let mut output = take_obj(&mut map, "output")?;
    let id = map
        .remove("trace_id")
        .or_else(|| map.remove("id"))
        .ok_or_else(|| Error::invalid("trace_id", "missing (SDK traces carry `trace_id` or `id`)"))?;
    call.trace_id = parse_string("trace_id", id)?;
    let session = map
        .remove("session_name")
        .or_else(|| map.remove("session_id"))
        .ok_or_else(|| Error::invalid("session_name", "missing"))?;
    call.session_id = parse_string("session_name", session)?;
    if let Some(v) = map.remove("session_uids") {
        call.session_uids = serde_json::from_str(v.get())
            .map_err(|e| Error::invalid("session_uids", format!("must be a list of strings ({e})")))?;
    }
    if let Some(v) = map.remove("timestamp").or_else(|| map.remove("start_time")).filter(|v| !is_null(v)) {
        call.timestamp = parse_f64("timestamp", v)?;
    }
    if let Some(v) = map.remove("model").filter(|v| !is_null(v)) {
        call.model = Some(parse_string("model", v)?);
    }
    if let Some(v) = map.remove("latency_ms").filter(|v| !is_null(v)) {
        call.latency_ms = Some(parse_f64("latency_ms", v)?);
    }
    if let Some(v) = map.remove("weight_version").filter(|v| !is_null(v)) {
        call.weight_version = Some(parse_i64("weight_version", v)?);
    }
    if let Some(v) = map.remove("metadata").filter(|v| !is_null(v)) {
        call.metadata = Some(v.get().as_bytes().to_vec());
    }
    if let Some(v) = input.remove("prompt_token_ids").filter(|v| !is_null(v)) {
        call.prompt_token_ids = parse_ids("input.prompt_token_ids", &v)?;
    }
    if let Some(v) = input.remove("messages").filter(|v| !is_null(v)) {
        call.messages = Some(v.get().as_bytes().to_vec());
    }
    if let Some(v) =
        output.remove("output_token_ids").or_else(|| output.remove("completion_token_ids")).filter(|v| !is_null(v))
    {
        call.completion_token_ids = parse_ids("output.output_token_ids", &v)?;
    }
    if let Some(v) = output.remove("rollout_logprobs").or_else(|| output.remove("logprobs")).filter(|v| !is_null(v)) {
        call.logprobs = Some(parse_logprobs("output.rollout_logprobs", &v)?);
    }
    if let Some(v) = output.remove("message").filter(|v| !is_null(v)) {
        call.response_message = Some(v.get().as_bytes().to_vec());
    }
    if let Some(v) = output.remove("finish_reason").filter(|v| !is_null(v)) {
        call.finish_reason = Some(parse_string("output.finish_reason", &v)?);
    }
    // What is left goes to `extra`, which exports beside the gateway fields:
    // a leftover key with a gateway field's name would be written twice.
    if let Some(key) = map.keys().find(|k| GATEWAY_FIELDS.contains(&k.as_str())) {
        return Err(Error::invalid(
            key.as_str(),
            "an SDK-shaped trace (session_name, input, output) must not also carry this gateway field at the top level; send one shape or the other",
        ));
    }
    let mut extra: BTreeMap<String, String> = map.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect();
    for (key, rest) in [("input", &input), ("output", &output)] {
        if let Some(obj) = object_of(rest.iter().map(|(k, v)| (k.as_str(), v.get()))) {
            extra.insert(key.to_owned(), String::from_utf8_lossy(&obj).into_owned());
        }
    }
    call.extra = object_of(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    call.validate()?;
    Ok(call)
}

/// Write `v` as the shortest decimal that parses back to the same `f32`.
/// Non-finite values are written as Python's `json` module does.
pub fn write_f32(out: &mut String, v: f32) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        let _ = write!(out, "{v:?}");
    }
}

fn write_f64(out: &mut String, v: f64) {
    if v.is_finite() {
        let _ = write!(out, "{v:?}");
    } else {
        out.push_str("null");
    }
}

/// Write `s` as a JSON string literal.
pub fn write_json_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
}

/// `s` as a JSON string literal.
pub(crate) fn json_string(s: &str) -> String {
    let mut out = String::new();
    write_json_str(&mut out, s);
    out
}

/// Write token ids as a JSON list of integers.
pub(crate) fn write_ids(out: &mut String, ids: &[u32]) {
    out.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{id}");
    }
    out.push(']');
}

/// Export a call as one JSON line in the rLLM gateway trace shape.
pub fn export_call(call: &Call) -> String {
    let mut out = String::with_capacity(64 + 8 * (call.prompt_token_ids.len() + call.completion_token_ids.len()));
    out.push_str("{\"trace_id\":");
    write_json_str(&mut out, &call.trace_id);
    out.push_str(",\"session_id\":");
    write_json_str(&mut out, &call.session_id);
    if !call.session_uids.is_empty() {
        out.push_str(",\"session_uids\":[");
        for (i, u) in call.session_uids.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_json_str(&mut out, u);
        }
        out.push(']');
    }
    out.push_str(",\"timestamp\":");
    write_f64(&mut out, call.timestamp);
    if let Some(m) = &call.model {
        out.push_str(",\"model\":");
        write_json_str(&mut out, m);
    }
    if let Some(w) = call.weight_version {
        let _ = write!(out, ",\"weight_version\":{w}");
    }
    out.push_str(",\"prompt_token_ids\":");
    write_ids(&mut out, &call.prompt_token_ids);
    out.push_str(",\"completion_token_ids\":");
    write_ids(&mut out, &call.completion_token_ids);
    if let Some(lp) = &call.logprobs {
        out.push_str(",\"logprobs\":[");
        for (i, v) in lp.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_f32(&mut out, *v);
        }
        out.push(']');
    }
    if let Some(f) = &call.finish_reason {
        out.push_str(",\"finish_reason\":");
        write_json_str(&mut out, f);
    }
    if let Some(l) = call.latency_ms {
        out.push_str(",\"latency_ms\":");
        write_f64(&mut out, l);
    }
    for (name, doc) in
        [("messages", &call.messages), ("response_message", &call.response_message), ("metadata", &call.metadata)]
    {
        if let Some(doc) = doc {
            let _ = write!(out, ",\"{name}\":{}", String::from_utf8_lossy(doc));
        }
    }
    if let Some(r) = &call.routing_matrices {
        out.push_str(",\"routing_matrices\":");
        match std::str::from_utf8(r).ok().filter(|s| serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok()) {
            Some(json) => out.push_str(json),
            None => write_ids(&mut out, &r.iter().map(|&b| u32::from(b)).collect::<Vec<_>>()),
        }
    }
    if let Some(extra) = &call.extra {
        if let Ok(map) = serde_json::from_slice::<RawMap<'_>>(extra) {
            for (k, v) in map {
                out.push(',');
                write_json_str(&mut out, &k);
                out.push(':');
                out.push_str(v.get());
            }
        }
    }
    out.push('}');
    out
}
