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
use crate::record::{Call, ValidCall};
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::fmt::Write as _;

type RawMap<'a> = BTreeMap<String, &'a RawValue>;

fn is_null(v: &RawValue) -> bool {
    v.get() == "null"
}

/// Token ids written as a compact list of decimal integers (`[1,22,3]`, what
/// vLLM prints), read without a JSON parse; None for anything else, which
/// [`parse_ids`] then parses in full (and refuses with its error).
fn compact_ids(text: &str) -> Option<Vec<u32>> {
    let inner = text.as_bytes().strip_prefix(b"[")?.strip_suffix(b"]")?;
    if inner.is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::with_capacity(inner.len() / 6 + 1);
    // The id so far in a u64, which cannot overflow before it passes
    // u32::MAX: refused at the digit that takes it there, as checked u32
    // arithmetic would refuse it. `digits`: whether the id has one.
    let (mut cur, mut digits) = (0u64, false);
    for &c in inner {
        match c {
            b'0'..=b'9' => {
                cur = cur * 10 + u64::from(c - b'0');
                if cur > u64::from(u32::MAX) {
                    return None;
                }
                digits = true;
            }
            b',' if digits => {
                out.push(cur as u32);
                (cur, digits) = (0, false);
            }
            _ => return None,
        }
    }
    digits.then(|| {
        out.push(cur as u32);
        out
    })
}

/// The items of a list of numbers written without whitespace (`[-0.5,-1e-05]`,
/// what vLLM and the gateway write), split at its commas without a JSON
/// parse; None for anything else (spaces, `null`, strings, nesting), which
/// is then parsed in full. `text` is a [`RawValue`]'s, so valid JSON: a list
/// of only number characters and commas is a list of numbers.
fn compact_numbers(text: &str) -> Option<Vec<&str>> {
    let inner = text.strip_prefix('[')?.strip_suffix(']')?;
    if !inner.bytes().all(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E' | b',')) {
        return None;
    }
    if inner.is_empty() {
        return Some(Vec::new());
    }
    Some(inner.split(',').collect())
}

fn parse_ids(field: &str, raw: &RawValue) -> Result<Vec<u32>> {
    if let Some(ids) = compact_ids(raw.get()) {
        return Ok(ids);
    }
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

/// The logprob rule, the same for every way a trace comes in (a JSON line, a
/// gateway capture, an rLLM import, a Python dict): the column holds each
/// value's nearest `f32` (from the decimal text straight to `f32`), and
/// `exact` says whether every value *is* that `f32` (a float literal whose
/// value widening gives back, see [`exact_f32`]). When it is not, the caller
/// also keeps the list verbatim in `extra`, and exports and dicts give the
/// verbatim values back: the trainer gets float32 logprobs, the trace reads
/// back as it came.
fn parse_logprobs(field: &str, raw: &RawValue) -> Result<(Vec<f32>, bool)> {
    let items: Vec<&str> = match compact_numbers(raw.get()) {
        Some(items) => items,
        None => serde_json::from_str::<Vec<&RawValue>>(raw.get())
            .map_err(|e| Error::invalid(field, format!("must be a list of numbers ({e})")))?
            .into_iter()
            .map(RawValue::get)
            .collect(),
    };
    let mut out = Vec::with_capacity(items.len());
    let mut exact = true;
    for (i, &text) in items.iter().enumerate() {
        let is_number = text.starts_with(|c: char| c == '-' || c.is_ascii_digit());
        // An exact value is its own nearest `f32` (the decimal lies within
        // half an f64 ulp of that `f32`, far from any f32 rounding boundary),
        // so the one parse that proves it exact also gives the column value.
        let exact_value = if exact && is_number { exact_f32(text) } else { None };
        exact = exact_value.is_some();
        let parsed = match exact_value {
            Some(v) => Ok(v),
            None if is_number => text.parse().map_err(|_| ()),
            None => Err(()),
        };
        let v: f32 = parsed.map_err(|_| {
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
    Ok((out, exact))
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
    // Sized once: a gateway trace's `extra` holds both raw bodies (~100 KB),
    // which growing by doubling would copy again and again.
    let pairs: Vec<(&str, &str)> = pairs.into_iter().collect();
    let hint = 2 + pairs.iter().map(|(k, v)| k.len() + v.len() + 4).sum::<usize>();
    let mut out = String::with_capacity(hint);
    out.push('{');
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
/// Logprobs: the column holds each value's nearest `f32`; a list whose values
/// are not all exactly `f32`s (a float literal widening gives back) is also
/// kept verbatim, and exports give it back as it came.
pub fn parse_trace(line: &str, now: f64) -> Result<Call> {
    let (map, order) = object_in_order(line)?;
    // Top-level token lists mean the gateway shape (also for an exported SDK
    // trace, whose leftover `input` object is kept as an extra field).
    let gateway = map.contains_key("prompt_token_ids") || map.contains_key("completion_token_ids");
    if !gateway && (map.contains_key("session_name") || map.get("input").is_some_and(|v| v.get().starts_with('{'))) {
        return parse_sdk(map, now);
    }
    parse_gateway(map, &order, now).map(ValidCall::into_inner)
}

/// Parse one gateway-shaped trace (never the SDK shape; logprobs by the one
/// rule of [`parse_trace`]: the column holds their nearest `f32`s, and values
/// that are not exactly those stay verbatim in `extra` too).
pub fn parse_gateway_exact(text: &str, now: f64) -> Result<Call> {
    let (map, order) = object_in_order(text)?;
    parse_gateway(map, &order, now).map(ValidCall::into_inner)
}

/// [`parse_gateway_exact`] of a trace given as its members, in document
/// order (a repeated key: the last value, kept where it first came): the
/// same [`Call`] as parsing the JSON object those members make, without
/// writing that object and parsing it again. The gateway builds its trace
/// this way from the parts of a call it has already parsed. The values are
/// [`RawValue`]s, so valid JSON; the call is checked as [`Call::validate`]
/// checks it and comes back as a [`ValidCall`] for [`crate::Store::append_valid`].
pub fn gateway_members_exact<'a>(
    members: impl IntoIterator<Item = (&'a str, &'a RawValue)>,
    now: f64,
) -> Result<ValidCall> {
    let (map, order) = dedup_members(members.into_iter().map(|(k, v)| (k.to_owned(), v)));
    parse_gateway(map, &order, now)
}

/// Members in document order into a map (a repeated key: the last value)
/// and the keys in the order written (a repeated key: where it first came).
fn dedup_members<'a>(members: impl IntoIterator<Item = (String, &'a RawValue)>) -> (RawMap<'a>, Vec<String>) {
    let members = members.into_iter();
    let mut order = Vec::with_capacity(members.size_hint().0);
    let mut map = RawMap::new();
    for (k, v) in members {
        if map.insert(k.clone(), v).is_none() {
            order.push(k);
        }
    }
    (map, order)
}

/// A JSON object's members (a repeated key: the last value), and its keys
/// in the order written (a repeated key: where it first came).
fn object_in_order(text: &str) -> Result<(RawMap<'_>, Vec<String>)> {
    struct Members;
    impl<'de> serde::de::Visitor<'de> for Members {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(kv) = map.next_entry::<String, &'de RawValue>()? {
                out.push(kv);
            }
            Ok(out)
        }
    }
    let not_object = |e: serde_json::Error| Error::invalid("trace", format!("not a JSON object ({e})"));
    let mut de = serde_json::Deserializer::from_str(text);
    let members = serde::de::Deserializer::deserialize_map(&mut de, Members).map_err(not_object)?;
    de.end().map_err(not_object)?;
    Ok(dedup_members(members))
}

/// Every JSON document of the call (`messages`, `response_message`,
/// `metadata`, `extra`) is written from the parsed [`RawValue`]s, so the
/// check does not parse them again ([`ValidCall`]).
fn parse_gateway(mut map: RawMap<'_>, order: &[String], now: f64) -> Result<ValidCall> {
    let mut call = Call { timestamp: now, ..Default::default() };
    let mut extra = RawMap::new();
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        let Some(v) = map.remove(&key) else { continue };
        if key == KEY_ORDER {
            return Err(Error::invalid("trace", "a key named \"\\u0000key_order\" is reserved by trajlog"));
        }
        if is_null(v) && key != "trace_id" && key != "session_id" {
            extra.insert(key, v);
            continue;
        }
        match key.as_str() {
            "trace_id" => call.trace_id = parse_string("trace_id", v)?,
            "session_id" => call.session_id = parse_string("session_id", v)?,
            "session_uids" => {
                call.session_uids = serde_json::from_str(v.get())
                    .map_err(|e| Error::invalid("session_uids", format!("must be a list of strings ({e})")))?;
                if call.session_uids.is_empty() {
                    // No column value tells an empty list from none: kept verbatim.
                    extra.insert(key, v);
                }
            }
            "timestamp" => call.timestamp = parse_f64("timestamp", v)?,
            "model" => call.model = Some(parse_string("model", v)?),
            "weight_version" => call.weight_version = Some(parse_i64("weight_version", v)?),
            "prompt_token_ids" => call.prompt_token_ids = parse_ids("prompt_token_ids", v)?,
            "completion_token_ids" => call.completion_token_ids = parse_ids("completion_token_ids", v)?,
            "logprobs" => {
                let (column, exact) = parse_logprobs("logprobs", v)?;
                call.logprobs = Some(column);
                if !exact {
                    extra.insert(key, v);
                }
            }
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
    // The trace's key order, kept when the default export order would not
    // give it back. Verbatim logprobs (no column) come from `extra`.
    let keys: Vec<(&str, bool)> = extra.iter().map(|(k, v)| (k.as_str(), is_null(v))).collect();
    let order: Vec<&str> = order.iter().map(String::as_str).collect();
    let kept = key_order(&call, &keys, &order).map(RawValue::from_string).transpose();
    let kept = kept.map_err(|e| Error::invalid("trace", format!("key order ({e})")))?;
    let mut pairs: Vec<(&str, &str)> = raw_pairs(&extra).collect();
    if let Some(kept) = &kept {
        pairs.push((KEY_ORDER, kept.get()));
        pairs.sort_unstable_by_key(|&(k, _)| k);
    }
    call.extra = object_of(pairs);
    ValidCall::from_parsed_json(call)
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
    let found = match output.remove("rollout_logprobs") {
        Some(v) => Some(("rollout_logprobs", v)),
        None => output.remove("logprobs").map(|v| ("logprobs", v)),
    };
    if let Some((key, v)) = found.filter(|(_, v)| !is_null(v)) {
        let (column, exact) = parse_logprobs(&format!("output.{key}"), &v)?;
        call.logprobs = Some(column);
        if !exact {
            output.insert(key.to_owned(), v); // kept verbatim beside the column
        }
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

/// Write logprobs as Python writes the widened `f32` values (its float
/// `repr`), so they parse back to the same Python floats.
pub(crate) fn write_logprobs(out: &mut String, values: &[f32]) {
    out.push('[');
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_py_float(out, f64::from(*v));
    }
    out.push(']');
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
pub fn json_string(s: &str) -> String {
    let mut out = String::new();
    write_json_str(&mut out, s);
    out
}

/// Write token ids as a JSON list of integers.
pub fn write_ids(out: &mut String, ids: &[u32]) {
    out.push('[');
    for (i, &id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_u32(out, id);
    }
    out.push(']');
}

/// Append `v` in decimal (the hot loop of token lists: no formatter).
pub fn push_u32(out: &mut String, v: u32) {
    let mut buf = [0u8; 10];
    out.extend(decimal(v, &mut buf).iter().map(|&d| char::from(d)));
}

/// The decimal digits of `v`, written at the end of `buf`.
pub(crate) fn decimal(mut v: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut i = buf.len();
    while i > 0 {
        i -= 1;
        if let Some(slot) = buf.get_mut(i) {
            *slot = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 {
            break;
        }
    }
    buf.get(i..).unwrap_or_default()
}

/// Join verbatim JSON texts into a JSON list.
pub fn join_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::from("[");
    for (i, t) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(t);
    }
    out.push(']');
    out
}

/// Write strings as a JSON list of string literals.
pub fn write_str_list(out: &mut String, items: &[String]) {
    out.push('[');
    for (i, s) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_json_str(out, s);
    }
    out.push(']');
}

/// The keys of a JSON object in the order written, repeats included
/// (`serde_json::Value` keeps only the last of a repeated key): what a test
/// of key order compares.
pub fn object_keys(text: &str) -> Result<Vec<String>> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Vec<String>, A::Error> {
            let mut keys = Vec::new();
            while let Some((k, IgnoredAny)) = map.next_entry::<String, IgnoredAny>()? {
                keys.push(k);
            }
            Ok(keys)
        }
    }
    serde_json::Deserializer::from_str(text)
        .deserialize_map(Keys)
        .map_err(|e| Error::invalid("trace", format!("not a JSON object ({e})")))
}

/// The key of `extra` that keeps a trace's key order when it is not the
/// order [`export_call`] writes by default: a JSON list of the trace's keys.
/// Never exported; a trace that carries it as a key of its own is refused.
pub const KEY_ORDER: &str = "\u{0}key_order";

/// The keys of the rLLM gateway's `TraceRecord`, in its field order
/// (docs/serve-contract.md §3.1): the gateway stores every trace with all of
/// them, in this order.
pub const TRACE_KEYS: [&str; 17] = [
    "trace_id",
    "session_id",
    "model",
    "messages",
    "prompt_token_ids",
    "response_message",
    "completion_token_ids",
    "logprobs",
    "routing_matrices",
    "finish_reason",
    "weight_version",
    "latency_ms",
    "token_counts",
    "timestamp",
    "metadata",
    "raw_request",
    "raw_response",
];

/// The default key order of an export: [`TRACE_KEYS`], then `session_uids`;
/// other keys follow, sorted.
fn export_order() -> impl Iterator<Item = &'static str> {
    TRACE_KEYS.into_iter().chain(["session_uids"])
}

/// The keys [`export_call`] writes for `call`, in its default order: each
/// with whether its value comes from `extra` (else from a column). `extra`
/// lists the keys of the call's `extra` object, each with whether its value
/// is `null`, sorted; [`KEY_ORDER`] is left out.
pub fn export_plan<'a>(call: &Call, extra: &[(&'a str, bool)]) -> Vec<(&'a str, bool)> {
    let in_extra = |key: &str| extra.iter().find(|&&(k, _)| k == key).map(|&(_, null)| null);
    let null_in_extra = |key: &str| in_extra(key) == Some(true);
    let column = |name: &str| match name {
        "trace_id" | "session_id" => true,
        "session_uids" => !call.session_uids.is_empty(),
        "timestamp" => !null_in_extra("timestamp"),
        "model" => call.model.is_some(),
        "weight_version" => call.weight_version.is_some(),
        "prompt_token_ids" => !(call.prompt_token_ids.is_empty() && null_in_extra("prompt_token_ids")),
        "completion_token_ids" => !(call.completion_token_ids.is_empty() && null_in_extra("completion_token_ids")),
        // Verbatim values in `extra` (the logprob rule, [`parse_logprobs`])
        // are what the trace carried: they win over the column.
        "logprobs" => call.logprobs.is_some() && in_extra("logprobs") != Some(false),
        "finish_reason" => call.finish_reason.is_some(),
        "latency_ms" => call.latency_ms.is_some(),
        "messages" => call.messages.is_some(),
        "response_message" => call.response_message.is_some(),
        "metadata" => call.metadata.is_some(),
        "routing_matrices" => call.routing_matrices.is_some(),
        _ => false,
    };
    let mut plan: Vec<(&'a str, bool)> = Vec::with_capacity(TRACE_KEYS.len() + 1 + extra.len());
    for name in export_order() {
        if column(name) {
            plan.push((name, false));
        } else if let Some(&(k, _)) = extra.iter().find(|&&(k, _)| k == name) {
            plan.push((k, true));
        }
    }
    for &(k, _) in extra {
        if k != KEY_ORDER && !export_order().any(|name| name == k) {
            plan.push((k, true));
        }
    }
    plan
}

/// The [`KEY_ORDER`] value (a JSON list) to keep in `extra` for a call made
/// from a trace whose keys came in `order`; None when the default order of
/// [`export_plan`] gives them back as they came. The list ends with the keys
/// an export adds (a missing `timestamp`, token list), so that parsing the
/// export again keeps the same list.
pub fn key_order(call: &Call, extra: &[(&str, bool)], order: &[&str]) -> Option<String> {
    let plan = export_plan(call, extra);
    let in_trace = |k: &str| order.contains(&k);
    if plan.iter().map(|&(k, _)| k).filter(|&k| in_trace(k)).eq(order.iter().copied()) {
        return None;
    }
    let mut out = String::from("[");
    let added = plan.iter().map(|&(k, _)| k).filter(|&k| !in_trace(k));
    for (i, k) in order.iter().copied().chain(added).enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_json_str(&mut out, k);
    }
    out.push(']');
    Some(out)
}

/// Reorder `plan` by a [`KEY_ORDER`] list: its keys first, in its order;
/// the others after, in their default order.
pub fn reorder(plan: &mut [(&str, bool)], order: &[String]) {
    let position: std::collections::HashMap<&str, usize> =
        order.iter().enumerate().map(|(i, k)| (k.as_str(), i)).collect();
    plan.sort_by_key(|(k, _)| position.get(k).copied().unwrap_or(usize::MAX));
}

/// Export a call as one JSON line in the rLLM gateway trace shape.
///
/// Every key is written once. A column is written under its name unless
/// `extra` holds that key as `null` where the column only carries a default:
/// a trace ingested with `"timestamp": null` (stamped with the ingest time)
/// or `"prompt_token_ids": null` / `"completion_token_ids": null` (empty
/// lists) exports as it came in, with the `null`. A key of `extra` that a
/// column already wrote is left out (only a caller building a [`Call`] by
/// hand can put one there), so the column's value is what readers see.
/// The keys come in the order of [`export_plan`], or in the trace's own
/// order when `extra` keeps it ([`KEY_ORDER`]).
pub fn export_call(call: &Call) -> String {
    export_with(call, |plan, extra| {
        if let Some(order) = extra.get(KEY_ORDER).and_then(|v| serde_json::from_str::<Vec<String>>(v.get()).ok()) {
            reorder(plan, &order);
        }
    })
}

/// [`export_call`] with the keys in the rLLM gateway's order, whatever order
/// the trace came in: [`TRACE_KEYS`] first, in that order, then the others
/// sorted by name (byte order). What `trajlog serve` returns for a trace,
/// written in one pass (no parse of the export to reorder it).
pub fn export_call_gateway_order(call: &Call) -> String {
    let rank = |k: &str| TRACE_KEYS.iter().position(|t| *t == k).unwrap_or(TRACE_KEYS.len());
    export_with(call, |plan, _| plan.sort_by(|a, b| rank(a.0).cmp(&rank(b.0)).then_with(|| a.0.cmp(b.0))))
}

/// Export `call` with its keys in the order `order` leaves the plan in
/// ([`export_plan`]; `extra` parsed, for [`KEY_ORDER`]).
fn export_with(call: &Call, order: impl FnOnce(&mut Vec<(&str, bool)>, &RawMap<'_>)) -> String {
    let extra: RawMap<'_> = call.extra.as_deref().and_then(|e| serde_json::from_slice(e).ok()).unwrap_or_default();
    let keys: Vec<(&str, bool)> = extra.iter().map(|(k, v)| (k.as_str(), is_null(v))).collect();
    let mut plan = export_plan(call, &keys);
    order(&mut plan, &extra);
    let mut out = String::with_capacity(64 + 8 * (call.prompt_token_ids.len() + call.completion_token_ids.len()));
    for (i, &(name, from_extra)) in plan.iter().enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        write_json_str(&mut out, name);
        out.push(':');
        if from_extra {
            if let Some(v) = extra.get(name) {
                out.push_str(v.get());
            }
            continue;
        }
        write_column(&mut out, call, name);
    }
    out.push('}');
    out
}

/// Write the value of the column `name` of `call` (see [`export_plan`]).
fn write_column(out: &mut String, call: &Call, name: &str) {
    let doc = |out: &mut String, doc: &Option<Vec<u8>>| {
        if let Some(doc) = doc {
            out.push_str(&String::from_utf8_lossy(doc));
        }
    };
    match name {
        "trace_id" => write_json_str(out, &call.trace_id),
        "session_id" => write_json_str(out, &call.session_id),
        "session_uids" => write_str_list(out, &call.session_uids),
        "timestamp" => write_f64(out, call.timestamp),
        "model" => write_json_str(out, call.model.as_deref().unwrap_or_default()),
        "weight_version" => {
            let _ = write!(out, "{}", call.weight_version.unwrap_or_default());
        }
        "prompt_token_ids" => write_ids(out, &call.prompt_token_ids),
        "completion_token_ids" => write_ids(out, &call.completion_token_ids),
        "logprobs" => write_logprobs(out, call.logprobs.as_deref().unwrap_or_default()),
        "finish_reason" => write_json_str(out, call.finish_reason.as_deref().unwrap_or_default()),
        "latency_ms" => write_f64(out, call.latency_ms.unwrap_or_default()),
        "messages" => doc(out, &call.messages),
        "response_message" => doc(out, &call.response_message),
        "metadata" => doc(out, &call.metadata),
        "routing_matrices" => {
            let r = call.routing_matrices.as_deref().unwrap_or_default();
            match std::str::from_utf8(r).ok().filter(|s| serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok()) {
                Some(json) => out.push_str(json),
                None => write_ids(out, &r.iter().map(|&b| u32::from(b)).collect::<Vec<_>>()),
            }
        }
        _ => out.push_str("null"),
    }
}

/// The elements of a JSON array, unparsed; None when `text` is not one.
pub(crate) fn elements(text: &str) -> Option<Vec<&RawValue>> {
    if !text.trim_start().starts_with('[') {
        return None;
    }
    serde_json::from_str(text).ok()
}

/// Logprobs, if every element is a float literal (as Python's `json` writes
/// a float) whose value is exactly an `f32`; widening gives the same value back.
pub(crate) fn exact_logprobs(text: &str) -> Option<Vec<f32>> {
    elements(text)?.iter().map(|v| exact_f32(v.get())).collect()
}

/// One JSON float literal whose value is exactly an `f32` (widening gives it
/// back); None for an int literal, an inexact value or anything else.
pub(crate) fn exact_f32(text: &str) -> Option<f32> {
    if !text.contains(['.', 'e', 'E']) {
        return None;
    }
    let wide: f64 = text.parse().ok()?;
    let narrow = wide as f32;
    (wide.is_finite()
        && f64::from(narrow) == wide
        && (narrow != 0.0 || narrow.is_sign_negative() == wide.is_sign_negative()))
    .then_some(narrow)
}

// ---------------------------------------------------------------- Python's float repr

/// Write `v` as Python's `json.dumps` writes a float (`repr`, and `NaN`,
/// `Infinity`, `-Infinity` for the non-finite values).
pub fn write_py_float(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
        return;
    }
    if v.is_infinite() {
        out.push_str(if v > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    if v.is_sign_negative() {
        out.push('-');
    }
    if v == 0.0 {
        out.push_str("0.0");
        return;
    }
    // Ryu gives the shortest digits that round-trip and, of those, the
    // nearest to `v`, ties to even: exactly Python's repr digits (David Gay's
    // algorithm). Only its layout differs; take digits and exponent from it.
    let mut ryu_buf = ryu::Buffer::new();
    let text = ryu_buf.format_finite(v.abs());
    if (1e-4..1e16).contains(&v.abs()) {
        // Here both lay the digits out positionally, alike ("0.000123",
        // "12.5", "123.0"): Ryu's text is Python's (most logprobs).
        out.push_str(text);
        return;
    }
    let text = text.as_bytes();
    let (mantissa, exp_part) = match text.iter().position(|&c| c == b'e') {
        Some(i) => (text.get(..i).unwrap_or_default(), text.get(i + 1..).unwrap_or_default()),
        None => (text, &b""[..]),
    };
    let exp_part: i32 = std::str::from_utf8(exp_part).ok().and_then(|e| e.parse().ok()).unwrap_or(0);
    let mut digit_buf = [0u8; 40];
    let mut n_digits = 0;
    let mut int_digits = None;
    for &c in mantissa {
        if c == b'.' {
            int_digits = Some(n_digits);
        } else if let Some(slot) = digit_buf.get_mut(n_digits) {
            *slot = c;
            n_digits += 1;
        }
    }
    let all = digit_buf.get(..n_digits).unwrap_or_default();
    let first = all.iter().position(|&c| c != b'0').unwrap_or(0);
    let last = all.iter().rposition(|&c| c != b'0').map_or(first + 1, |i| i + 1);
    let exponent = int_digits.unwrap_or(n_digits) as i32 - 1 - first as i32 + exp_part;
    let digits = std::str::from_utf8(all.get(first..last).unwrap_or(b"0")).unwrap_or("0");
    layout(out, digits, exponent);
}

/// Python's layout of `digits` (d.ddd) times 10^`exponent`: positional from
/// 1e-4 up to 1e16, else exponent form with a signed two-digit exponent.
fn layout(out: &mut String, digits: &str, exponent: i32) {
    if !(-4..16).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "e{sign}{:02}", exponent.unsigned_abs());
    } else if exponent >= 0 {
        let int_len = exponent as usize + 1;
        if digits.len() <= int_len {
            out.push_str(digits);
            out.extend(std::iter::repeat_n('0', int_len - digits.len()));
            out.push_str(".0");
        } else {
            let (int, frac) = digits.split_at(int_len);
            out.push_str(int);
            out.push('.');
            out.push_str(frac);
        }
    } else {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', exponent.unsigned_abs() as usize - 1));
        out.push_str(digits);
    }
}

/// `v` as Python's `json.dumps` writes it.
pub fn py_float(v: f64) -> String {
    let mut out = String::new();
    write_py_float(&mut out, v);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The column value of an exact logprob comes from the parse that
    /// proves it exact: it must be the decimal's nearest `f32`, what
    /// parsing the text straight to `f32` gives, over the whole f32 range
    /// (normal, subnormal, the largest, both signs) and in both the repr
    /// and the spelled-out forms of the value.
    #[test]
    fn exact_logprob_is_its_nearest_f32() {
        let mut bits: u32 = 1;
        let mut checked = 0;
        while bits < 0x7f80_0000 {
            for v in [f32::from_bits(bits), -f32::from_bits(bits)] {
                let mut repr = String::new();
                write_py_float(&mut repr, f64::from(v));
                for text in [repr, format!("{:e}", f64::from(v)), format!("{}", f64::from(v))] {
                    if let Some(found) = exact_f32(&text) {
                        let direct: f32 = text.parse().unwrap_or(f32::NAN);
                        assert_eq!(found.to_bits(), direct.to_bits(), "{text}");
                        checked += 1;
                    }
                }
            }
            bits = bits.saturating_add(0x0000_7f31).max(bits + 1);
        }
        assert!(checked > 100_000, "{checked}");
        let raw = RawValue::from_string("[-0.5,-1.1920928955078125e-07,-3.4028234663852886e+38]".into());
        let (column, exact) =
            raw.as_deref().map_or((Vec::new(), false), |r| parse_logprobs("logprobs", r).unwrap_or_default());
        assert!(exact);
        assert_eq!(column, [-0.5, -1.192_092_9e-7, -f32::MAX]);
    }

    #[test]
    fn compact_ids_read_as_the_json_parse() {
        let slow = |t: &str| -> std::result::Result<Vec<u32>, ()> {
            let items: Vec<&RawValue> = serde_json::from_str(t).map_err(|_| ())?;
            items.iter().map(|v| v.get().parse::<u32>().map_err(|_| ())).collect()
        };
        for t in [
            "[]",
            "[0]",
            "[1,22,333]",
            "[4294967295]",
            "[4294967296]",
            "[42949672950]",
            "[4294967295,0,10]",
            "[10,4294967296]",
            "[99999999999999999999999]",
            "[1, 2]",
            "[-0]",
            "[1e3]",
            "[1.0]",
            "[null]",
            "[\"1\"]",
            "[[1]]",
        ] {
            let raw = RawValue::from_string(t.to_owned()).expect("valid JSON");
            let fast = compact_ids(t);
            if let Some(fast) = &fast {
                assert_eq!(Ok(fast.clone()), slow(t), "{t}");
            }
            assert_eq!(parse_ids("ids", &raw).map_err(|_| ()), slow(t), "{t}");
        }
        assert_eq!(compact_ids("[1,22,333]"), Some(vec![1, 22, 333]));
        assert_eq!(compact_ids("[4294967296]"), None);
    }

    fn keys(line: &str) -> Vec<String> {
        object_keys(line).expect("a JSON object")
    }

    fn assert_unique_keys(line: &str) {
        let mut keys = keys(line);
        let n = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n, "a key is repeated in {line}");
    }

    fn value(text: &str) -> serde_json::Value {
        serde_json::from_str(text).expect("JSON")
    }

    #[test]
    fn null_fields_export_once_and_parse_back_to_the_same_call() {
        let traces = [
            // No logprobs, every optional column null.
            r#"{"trace_id":"t1","session_id":"s","timestamp":1.5,"prompt_token_ids":[1,2],"completion_token_ids":[3],"logprobs":null,"model":null,"weight_version":null,"finish_reason":null,"latency_ms":null,"messages":null,"response_message":null,"metadata":null,"routing_matrices":null,"session_uids":null,"token_counts":null}"#,
            // Columns that are always written, null in the trace.
            r#"{"trace_id":"t2","session_id":"s","timestamp":null,"prompt_token_ids":null,"completion_token_ids":null,"logprobs":null}"#,
            r#"{"trace_id":"t3","session_id":"s","prompt_token_ids":null,"completion_token_ids":[5],"logprobs":[-0.5]}"#,
        ];
        for trace in traces {
            let call = parse_trace(trace, 7.25).expect("valid trace");
            let line = export_call(&call);
            assert_unique_keys(&line);
            let again = parse_trace(&line, 7.25).expect("the export parses");
            assert_eq!(again, call, "export of {trace} parses to another call: {line}");
            assert_eq!(export_call(&again), line);
        }
        // The trace comes back as it went in (a missing timestamp is filled in).
        let t1 = export_call(&parse_trace(traces[0], 0.0).expect("valid"));
        assert_eq!(value(&t1), value(traces[0]));
        let t2 = export_call(&parse_trace(traces[1], 0.0).expect("valid"));
        assert_eq!(value(&t2), value(traces[1]));
        let t3 = value(&export_call(&parse_trace(traces[2], 7.25).expect("valid")));
        assert_eq!(t3["prompt_token_ids"], serde_json::Value::Null);
        assert_eq!(t3["timestamp"], serde_json::json!(7.25));
    }

    #[test]
    fn key_order_is_kept_and_the_gateway_order_costs_nothing() {
        // The rLLM gateway's TraceRecord order: nothing kept beside the values.
        let gateway = r#"{"trace_id":"t","session_id":"s","model":"m","messages":[],"prompt_token_ids":[1],"response_message":{},"completion_token_ids":[2],"logprobs":[-0.5],"routing_matrices":null,"finish_reason":"stop","weight_version":null,"latency_ms":1.5,"token_counts":{},"timestamp":2.5,"metadata":{},"raw_request":{"b":1,"a":2},"raw_response":null}"#;
        let call = parse_trace(gateway, 0.0).expect("valid");
        assert!(!String::from_utf8_lossy(call.extra.as_deref().unwrap_or_default()).contains("key_order"));
        assert_eq!(export_call(&call), gateway);
        // Another order (a missing timestamp too): kept, and stable through export and parse.
        let shuffled =
            r#"{"zeta":1,"completion_token_ids":[2],"session_id":"s","alpha":null,"trace_id":"t","session_uids":[]}"#;
        let call = parse_trace(shuffled, 7.0).expect("valid");
        let line = export_call(&call);
        assert_eq!(
            keys(&line),
            [
                "zeta",
                "completion_token_ids",
                "session_id",
                "alpha",
                "trace_id",
                "session_uids",
                "prompt_token_ids",
                "timestamp"
            ]
        );
        assert_eq!(value(&line)["session_uids"], serde_json::json!([]));
        let again = parse_trace(&line, 0.0).expect("the export parses");
        assert_eq!(again, call);
        assert_eq!(export_call(&again), line);
        // The reserved key is refused.
        assert!(parse_trace(r#"{"trace_id":"t","session_id":"s","\u0000key_order":[]}"#, 0.0).is_err());
    }

    #[test]
    fn extra_never_repeats_a_key_a_column_wrote() {
        // A hand-built call whose `extra` shadows columns: the columns win.
        let call = Call {
            trace_id: "t".into(),
            session_id: "s".into(),
            timestamp: 2.0,
            model: Some("m".into()),
            prompt_token_ids: vec![1],
            completion_token_ids: vec![2],
            logprobs: Some(vec![-0.25]),
            extra: Some(
                br#"{"logprobs":null,"model":"other","trace_id":"x","prompt_token_ids":null,"timestamp":3,"k":1}"#
                    .to_vec(),
            ),
            ..Default::default()
        };
        let line = export_call(&call);
        assert_unique_keys(&line);
        let v = value(&line);
        assert_eq!(v["trace_id"], "t");
        assert_eq!(v["model"], "m");
        assert_eq!(v["logprobs"], serde_json::json!([-0.25]));
        assert_eq!(v["prompt_token_ids"], serde_json::json!([1]));
        assert_eq!(v["timestamp"], serde_json::json!(2.0));
        assert_eq!(v["k"], 1);
    }
}

#[cfg(test)]
mod py_float_tests {
    use super::*;

    /// The formatter before its fast path: both passes always.
    fn reference(v: f64) -> String {
        let shortest = format!("{:e}", v.abs());
        let len = shortest.split_once('e').map_or(0, |(m, _)| m.chars().filter(char::is_ascii_digit).count());
        let nearest = format!("{:.*e}", len.saturating_sub(1), v.abs());
        let sci = if nearest.parse::<f64>().is_ok_and(|x| x == v.abs()) { nearest } else { shortest };
        let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
        let mut out = String::new();
        if v.is_sign_negative() {
            out.push('-');
        }
        // Same layout code, fed the reference digits.
        let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let mut tail = String::new();
        layout(&mut tail, &digits, exponent);
        out.push_str(&tail);
        out
    }

    /// 200,000 xorshift values from `seed`, with their positions.
    fn xorshift(seed: u64) -> impl Iterator<Item = (u32, u64)> {
        (0..200_000u32).scan(seed, |x, i| {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            Some((i, *x))
        })
    }

    #[test]
    fn the_fast_path_writes_what_both_passes_write() {
        for (i, x) in xorshift(0x9e37_79b9_7f4a_7c15) {
            let v = if i % 2 == 0 { f64::from(f32::from_bits(x as u32)) } else { f64::from_bits(x) };
            if !v.is_finite() || v == 0.0 {
                continue;
            }
            assert_eq!(py_float(v), reference(v), "{v:?}");
        }
    }

    #[test]
    fn the_positional_range_writes_what_both_passes_write() {
        for (i, x) in xorshift(0x2545_f491_4f6c_dd1d) {
            // Logprob-like float32 values, and f64 values spread over the
            // positional range's 20 decades and just around its bounds.
            let unit = (x >> 11) as f64 / (1u64 << 53) as f64;
            let v = match i % 4 {
                0 => f64::from(-(unit as f32) * 20.0),
                1 => 10f64.powf(unit * 20.0 - 4.0),
                2 => 1e-4 * (1.0 + (unit - 0.5) * 1e-12),
                _ => 1e16 * (1.0 + (unit - 0.5) * 1e-12),
            };
            if v == 0.0 {
                continue;
            }
            assert_eq!(py_float(v), reference(v), "{v:?}");
            assert_eq!(py_float(-v), reference(-v), "{:?}", -v);
        }
        let below = |x: f64| f64::from_bits(x.to_bits() - 1);
        for v in [1e-4, below(1e-4), below(1e16), 1e16, 1e15, 123.0, 0.001, 2f64.powi(53), 5e15 + 1.0] {
            assert_eq!(py_float(v), reference(v), "{v:?}");
        }
    }

    #[test]
    fn floats_are_written_as_python_writes_them() {
        // Each right-hand side is Python 3's `json.dumps(x)`.
        let cases: &[(f64, &str)] = &[
            (f64::from(-0.0003f32), "-0.0003000000142492354"),
            (f64::from(-2.1e-5f32), "-2.099999983329326e-05"),
            (f64::from(-0.0071f32), "-0.0071000000461936"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.234e300, "1.234e+300"),
            (1234567890123456.0, "1234567890123456.0"),
            (123.0, "123.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1700000000.001, "1700000000.001"),
            (412.7384520000001, "412.7384520000001"),
            // A tie between two shortest strings: Python takes the even one.
            (f64::from(-142.34097f32), "-142.34097290039062"),
            (f64::from(630.294f32), "630.2940063476562"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for &(v, want) in cases {
            assert_eq!(py_float(v), want, "{v:?}");
            if v.is_finite() {
                assert_eq!(want.parse::<f64>().map(f64::to_bits), Ok(v.to_bits()), "{want} parses back");
            }
        }
    }
}
