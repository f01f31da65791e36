//! rLLM's trace records, kept exactly: the older SDK's store records
//! (`SdkTrace`) mapped to and from calls, and the migration of existing rLLM
//! SQLite trace databases (`sqlite`, with the feature of that name).
//!
//! An SDK trace is `(id, data, namespace, context_type, metadata, created_at,
//! updated_at)` plus the session uids it was logged under. Its token ids and
//! logprobs live somewhere inside `data` (which nests them differently for
//! the SDK's `Trace` model and for the tracer's raw OpenAI responses).
//! [`sdk_to_call`] moves the first list found at each of the known places
//! into the typed columns — only when every element is stored exactly (ids:
//! integers in `0..=u32::MAX`; logprobs: float literals whose value is an
//! `f32`) — records where it came from, and keeps the rest of `data` as its
//! JSON text under the call's `extra["rllm_sdk"]`. [`call_to_sdk`] puts the
//! columns back at the same places, so the data comes back equal to what went
//! in (key order inside a changed object aside). Logprobs that are not all
//! `f32` are copied to the column as the nearest `f32` values and left in
//! `data` as written, so the column is filled whenever the data has logprobs
//! for the completion; a logprob list of another length than the completion,
//! or a value beyond the `f32` range, refuses the trace.

#[cfg(feature = "sqlite")]
pub mod sqlite;

use crate::error::{Error, Result};
use crate::record::Call;
use crate::trace_json::{elements, exact_logprobs, json_string, write_ids, write_object};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::fmt;

/// The key of `Call::extra` holding an SDK trace's remaining fields.
pub const SDK_KEY: &str = "rllm_sdk";

/// The session id of a trace stored outside any session (the SDK, and a
/// gateway database without a session link, keep such traces with no session
/// at all; trajlog needs one).
pub const UNSCOPED_SESSION: &str = "rllm:unscoped";

/// Places of the prompt ids inside SDK `data`, tried in order.
const PROMPT_PATHS: &[&[&str]] =
    &[&["input", "prompt_token_ids"], &["output", "prompt_token_ids"], &["prompt_token_ids"]];
/// Places of the completion ids inside SDK `data`, tried in order.
const COMPLETION_PATHS: &[&[&str]] = &[
    &["output", "output_token_ids"],
    &["output", "choices", "0", "provider_specific_fields", "token_ids"],
    &["output", "choices", "0", "token_ids"],
    &["completion_token_ids"],
];
/// Places of a plain logprob list inside SDK `data`, tried in order.
const LOGPROB_PATHS: &[&[&str]] = &[&["output", "rollout_logprobs"], &["logprobs"]];
/// An OpenAI `logprobs.content` list: its `logprob` values are copied (not
/// moved) into the column when no plain list was found.
const LOGPROB_CONTENT_PATH: &[&str] = &["output", "choices", "0", "logprobs", "content"];

/// One record of the older rLLM SDK's trace store.
#[derive(Debug, Clone, PartialEq)]
pub struct SdkTrace {
    pub trace_id: String,
    /// JSON object text.
    pub data: String,
    pub namespace: String,
    pub context_type: String,
    /// JSON text (the SDK writes `json.dumps(metadata)`, so `null` is possible).
    pub metadata: String,
    pub created_at: f64,
    pub updated_at: f64,
    /// Outer → inner.
    pub session_uids: Vec<String>,
}

// ---- JSON text helpers (order-preserving, numbers kept as written) ----

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Vec<(String, &'de RawValue)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
            out.push((k, v));
        }
        Ok(out)
    }
}

/// The entries of a JSON object, in order; None when `text` is not an object.
fn entries(text: &str) -> Option<Vec<(String, &RawValue)>> {
    let mut de = serde_json::Deserializer::from_str(text);
    let out = de.deserialize_map(EntriesVisitor).ok()?;
    // Trailing characters make the whole text invalid, not a shorter object.
    de.end().ok()?;
    Some(out)
}

/// The JSON text at `path` (object keys; a decimal segment indexes an array).
fn get_path<'a>(text: &'a str, path: &[&str]) -> Option<&'a str> {
    let Some((head, rest)) = path.split_first() else { return Some(text) };
    let value: &'a RawValue = match head.parse::<usize>() {
        Ok(i) if text.trim_start().starts_with('[') => elements(text)?.get(i)?,
        // The last of duplicate keys wins, as in Python's `json` and serde_json.
        _ => entries(text)?.into_iter().rev().find(|(k, _)| k == head)?.1,
    };
    get_path(value.get(), rest)
}

/// `text` without the value at `path`, and that value; None when absent.
/// Duplicate keys on the way are resolved as readers do (the last wins) and
/// the shadowed ones dropped, so `put_path` restores an equal document.
fn take_path(text: &str, path: &[&str]) -> Option<(String, String)> {
    let (head, rest) = path.split_first()?;
    if let (Ok(i), true) = (head.parse::<usize>(), text.trim_start().starts_with('[')) {
        let items = elements(text)?;
        let (inner, taken) = take_path(items.get(i)?.get(), rest)?;
        let texts: Vec<&str> =
            items.iter().enumerate().map(|(j, v)| if j == i { inner.as_str() } else { v.get() }).collect();
        return Some((crate::trace_json::join_list(texts), taken));
    }
    let items = entries(text)?;
    let at = items.iter().rposition(|(k, _)| k == head)?;
    let (_, found) = items.get(at)?;
    let shadowed = |j: usize| j != at && items.get(j).is_some_and(|(k, _)| k == head);
    if rest.is_empty() {
        let taken = found.get().to_owned();
        let kept = items.iter().enumerate().filter(|(j, _)| *j != at && !shadowed(*j));
        return Some((write_object(kept.map(|(_, (k, v))| (k.as_str(), v.get()))), taken));
    }
    let (inner, taken) = take_path(found.get(), rest)?;
    let pairs = items
        .iter()
        .enumerate()
        .filter(|(j, _)| !shadowed(*j))
        .map(|(j, (k, v))| (k.as_str(), if j == at { inner.as_str() } else { v.get() }));
    Some((write_object(pairs), taken))
}

/// `text` with `value` placed at `path` (the containers on the way exist).
fn put_path(text: &str, path: &[&str], value: &str) -> Option<String> {
    let (head, rest) = path.split_first()?;
    if let (Ok(i), true) = (head.parse::<usize>(), text.trim_start().starts_with('[')) {
        let items = elements(text)?;
        let inner = put_path(items.get(i)?.get(), rest, value)?;
        let texts: Vec<&str> =
            items.iter().enumerate().map(|(j, v)| if j == i { inner.as_str() } else { v.get() }).collect();
        return Some(crate::trace_json::join_list(texts));
    }
    let items = entries(text)?;
    if rest.is_empty() {
        let pairs = items.iter().map(|(k, v)| (k.as_str(), v.get())).chain([(*head, value)]);
        return Some(write_object(pairs));
    }
    let at = items.iter().rposition(|(k, _)| k == head)?;
    let inner = put_path(items.get(at)?.1.get(), rest, value)?;
    let pairs =
        items.iter().enumerate().map(|(j, (k, v))| (k.as_str(), if j == at { inner.as_str() } else { v.get() }));
    Some(write_object(pairs))
}

/// Token ids, if every element is an integer literal in `0..=u32::MAX`.
pub(crate) fn exact_ids(text: &str) -> Option<Vec<u32>> {
    elements(text)?.iter().map(|v| v.get().parse::<u32>().ok()).collect()
}

/// One JSON number literal as an `f64` (as Python reads it); None for
/// anything else.
fn number(text: &str) -> Option<f64> {
    text.starts_with(|c: char| c == '-' || c.is_ascii_digit()).then(|| text.parse::<f64>().ok()).flatten()
}

/// The values of a JSON list of numbers; None when `text` is not a list or
/// holds anything else (then it is not a logprob list: it stays data).
fn numbers(text: &str) -> Option<Vec<f64>> {
    elements(text)?.iter().map(|v| number(v.get())).collect()
}

/// Logprobs for the column: each value as the nearest `f32`. A value beyond
/// the `f32` range cannot be stored as a logprob and is refused, naming
/// `field[index]`.
fn nearest_logprobs(field: &str, values: &[f64]) -> Result<Vec<f32>> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let narrow = v as f32;
            if narrow.is_finite() {
                Ok(narrow)
            } else {
                Err(Error::invalid(
                    format!("{field}[{i}]"),
                    format!("{v:e} is outside the float32 range (magnitude at most 3.4028235e38); a logprob is stored as a float32"),
                ))
            }
        })
        .collect()
}

fn logprob_count_error(field: &str, got: usize, n: usize) -> Error {
    Error::invalid(
        field,
        format!("has {got} logprobs but the completion has {n} token ids; they must be the same length"),
    )
}

/// JSON equality where numbers compare by value (Python's `==` on the
/// decoded dicts: `12 == 12.0`).
#[cfg(any(feature = "sqlite", feature = "internals"))]
pub(crate) fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => x == y || (x.as_f64().is_some() && x.as_f64() == y.as_f64()),
        (V::Array(x), V::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_json(a, b)),
        (V::Object(x), V::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

fn check_json(field: &str, text: &str) -> Result<()> {
    serde_json::from_str::<&RawValue>(text)
        .map(drop)
        .map_err(|e| Error::invalid(field, format!("not valid JSON ({e}); NaN and Infinity are not JSON")))
}

/// Take the first list at `paths` that `parse` accepts out of `data`; returns
/// it and its dotted path.
fn move_first<T>(data: &mut String, paths: &[&[&str]], parse: impl Fn(&str) -> Option<T>) -> Option<(T, String)> {
    for path in paths {
        if let Some(value) = get_path(data, path).and_then(&parse) {
            if let Some((rest, _)) = take_path(data, path) {
                *data = rest;
            }
            return Some((value, path.join(".")));
        }
    }
    None
}

/// The call that stores an SDK trace exactly (see the module docs).
pub fn sdk_to_call(t: &SdkTrace) -> Result<Call> {
    check_json("data", &t.data)?;
    if entries(&t.data).is_none() {
        return Err(Error::invalid("data", "must be a JSON object"));
    }
    check_json("metadata", &t.metadata)?;
    let mut data = t.data.clone();
    let mut moved: Vec<(&str, String)> = Vec::new();
    let mut call = Call {
        trace_id: t.trace_id.clone(),
        session_id: t.session_uids.last().cloned().unwrap_or_else(|| UNSCOPED_SESSION.to_owned()),
        session_uids: t.session_uids.clone(),
        timestamp: t.created_at,
        ..Default::default()
    };
    if let Some((ids, path)) = move_first(&mut data, PROMPT_PATHS, exact_ids) {
        call.prompt_token_ids = ids;
        moved.push(("prompt_token_ids", path));
    }
    if let Some((ids, path)) = move_first(&mut data, COMPLETION_PATHS, exact_ids) {
        call.completion_token_ids = ids;
        moved.push(("completion_token_ids", path));
    }
    // Logprobs always reach the column when the data has them for the
    // completion: moved when every value is a float32 float literal (put
    // back on read), else copied as the nearest float32 values, the data
    // keeping them as written. A list for a different number of tokens, or
    // a value beyond the float32 range, refuses the trace.
    let n = call.completion_token_ids.len();
    if let Some((path, values)) = LOGPROB_PATHS.iter().find_map(|p| Some((*p, numbers(get_path(&data, p)?)?))) {
        let dotted = path.join(".");
        let lp = nearest_logprobs(&dotted, &values)?;
        if lp.len() == n {
            match move_first(&mut data, &[path], exact_logprobs) {
                Some((exact, _)) => {
                    call.logprobs = Some(exact);
                    moved.push(("logprobs", dotted));
                }
                None => call.logprobs = Some(lp),
            }
        } else if n > 0 && !lp.is_empty() {
            return Err(logprob_count_error(&dotted, lp.len(), n));
        }
    }
    if call.logprobs.is_none() {
        // Copied, not moved: the content list stays in `data` as written.
        let values = get_path(&data, LOGPROB_CONTENT_PATH).and_then(elements).and_then(|items| {
            items.iter().map(|item| get_path(item.get(), &["logprob"]).and_then(number)).collect::<Option<Vec<f64>>>()
        });
        if let Some(values) = values.filter(|v| !v.is_empty()) {
            let dotted = LOGPROB_CONTENT_PATH.join(".");
            let lp = nearest_logprobs(&dotted, &values)?;
            if lp.len() == n {
                call.logprobs = Some(lp);
            } else if n > 0 {
                return Err(logprob_count_error(&dotted, lp.len(), n));
            }
        }
    }
    call.model = get_path(&data, &["model"]).and_then(|m| serde_json::from_str::<String>(m).ok());
    call.latency_ms = get_path(&data, &["latency_ms"]).and_then(|v| v.parse::<f64>().ok()).filter(|v| v.is_finite());

    let quoted: Vec<(&str, String)> = moved.iter().map(|(k, p)| (*k, json_string(p))).collect();
    let moved_obj = write_object(quoted.iter().map(|(k, v)| (*k, v.as_str())));
    let namespace = json_string(&t.namespace);
    let context_type = json_string(&t.context_type);
    let updated_at = format!("{:?}", t.updated_at);
    let record = write_object([
        ("data", data.as_str()),
        ("moved", moved_obj.as_str()),
        ("namespace", namespace.as_str()),
        ("context_type", context_type.as_str()),
        ("metadata", t.metadata.as_str()),
        ("updated_at", updated_at.as_str()),
    ]);
    call.extra = Some(write_object([(SDK_KEY, record.as_str())]).into_bytes());
    call.validate()?;
    Ok(call)
}

/// The SDK trace a call stores, or None when it was not stored from one.
pub fn call_to_sdk(call: &Call) -> Result<Option<SdkTrace>> {
    let Some(extra) = call.extra.as_deref() else { return Ok(None) };
    let extra = std::str::from_utf8(extra).map_err(|_| Error::invalid("extra", "not UTF-8"))?;
    let Some(record) = get_path(extra, &[SDK_KEY]) else { return Ok(None) };
    let field = |name: &str| {
        get_path(record, &[name]).ok_or_else(|| Error::invalid("extra.rllm_sdk", format!("missing {name}")))
    };
    let string = |name: &str| -> Result<String> {
        serde_json::from_str(field(name)?).map_err(|e| Error::invalid("extra.rllm_sdk", format!("{name}: {e}")))
    };
    let mut data = field("data")?.to_owned();
    for (column, path) in entries(field("moved")?).unwrap_or_default() {
        let path: String = serde_json::from_str(path.get()).map_err(|e| Error::invalid("extra.rllm_sdk.moved", e))?;
        let segments: Vec<&str> = path.split('.').collect();
        let mut text = String::new();
        match column.as_str() {
            "prompt_token_ids" => write_ids(&mut text, &call.prompt_token_ids),
            "completion_token_ids" => write_ids(&mut text, &call.completion_token_ids),
            "logprobs" => crate::trace_json::write_logprobs(&mut text, call.logprobs.as_deref().unwrap_or_default()),
            other => return Err(Error::invalid("extra.rllm_sdk.moved", format!("unknown column {other}"))),
        }
        data = put_path(&data, &segments, &text)
            .ok_or_else(|| Error::invalid("extra.rllm_sdk.moved", format!("{path} has no place in data")))?;
    }
    Ok(Some(SdkTrace {
        trace_id: call.trace_id.clone(),
        data,
        namespace: string("namespace")?,
        context_type: string("context_type")?,
        metadata: field("metadata")?.to_owned(),
        created_at: call.timestamp,
        updated_at: serde_json::from_str(field("updated_at")?).map_err(|e| Error::invalid("extra.rllm_sdk", e))?,
        session_uids: call.session_uids.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str) -> serde_json::Value {
        serde_json::from_str(text).expect("valid JSON")
    }

    #[test]
    fn paths_take_and_put_back() {
        let text = r#"{"a":1,"output":{"choices":[{"x":2,"provider_specific_fields":{"token_ids":[5,6]}}],"z":[1]}}"#;
        let path = ["output", "choices", "0", "provider_specific_fields", "token_ids"];
        assert_eq!(get_path(text, &path), Some("[5,6]"));
        let (rest, taken) = take_path(text, &path).expect("present");
        assert_eq!(taken, "[5,6]");
        assert_eq!(get_path(&rest, &path), None);
        let back = put_path(&rest, &path, &taken).expect("container exists");
        assert_eq!(value(&back), value(text));
    }

    #[test]
    fn exactness_rules() {
        assert_eq!(exact_ids("[0,4294967295]"), Some(vec![0, u32::MAX]));
        assert_eq!(exact_ids("[4294967296]"), None);
        assert_eq!(exact_ids("[1.0]"), None);
        assert_eq!(exact_ids("[-1]"), None);
        assert_eq!(exact_logprobs("[-0.10000000149011612,-0.5]"), Some(vec![-0.1, -0.5]));
        assert_eq!(exact_logprobs("[-0.1]"), None, "an f64 that is not an f32 stays verbatim");
        assert_eq!(exact_logprobs("[-1]"), None, "an int literal stays verbatim");
        let mut s = String::new();
        crate::trace_json::write_logprobs(&mut s, &[-0.1, -0.5]);
        assert_eq!(s, "[-0.10000000149011612,-0.5]");
    }

    #[test]
    fn sdk_trace_round_trips_exactly() {
        let t = SdkTrace {
            trace_id: "tr_1".into(),
            data: r#"{"name":"proxy/m","input":{"messages":[{"role":"user","content":"hi"}],"prompt_token_ids":[1,2,3]},"output":{"message":{"role":"assistant"},"finish_reason":"stop","output_token_ids":[4,5],"rollout_logprobs":[-0.5,-0.25]},"model":"m","latency_ms":12.5,"tokens":{"prompt":3},"timestamp":1700000000.25}"#.into(),
            namespace: "ns".into(),
            context_type: "llm_trace".into(),
            metadata: r#"{"job":"x"}"#.into(),
            created_at: 1700000000.5,
            updated_at: 1700000001.5,
            session_uids: vec!["outer".into(), "inner".into()],
        };
        let call = sdk_to_call(&t).expect("valid");
        assert_eq!(call.prompt_token_ids, [1, 2, 3]);
        assert_eq!(call.completion_token_ids, [4, 5]);
        assert_eq!(call.logprobs.as_deref(), Some(&[-0.5f32, -0.25][..]));
        assert_eq!(call.session_id, "inner");
        assert_eq!(call.model.as_deref(), Some("m"));
        let back = call_to_sdk(&call).expect("decodes").expect("an SDK call");
        assert_eq!(value(&back.data), value(&t.data));
        assert_eq!(SdkTrace { data: t.data.clone(), ..back }, t);
    }

    #[test]
    fn openai_response_shape_and_inexact_values() {
        let t = SdkTrace {
            trace_id: "tr_2".into(),
            data: r#"{"output":{"prompt_token_ids":[9],"choices":[{"provider_specific_fields":{"token_ids":[7,8]},"logprobs":{"content":[{"token":"a","logprob":-0.5},{"token":"b","logprob":-1.5}]}}]},"extra":[-0.1]}"#.into(),
            namespace: "default".into(),
            context_type: "llm_trace".into(),
            metadata: "null".into(),
            created_at: 5.0,
            updated_at: 5.0,
            session_uids: vec![],
        };
        let call = sdk_to_call(&t).expect("valid");
        assert_eq!(call.session_id, UNSCOPED_SESSION);
        assert_eq!(call.prompt_token_ids, [9]);
        assert_eq!(call.completion_token_ids, [7, 8]);
        assert_eq!(call.logprobs.as_deref(), Some(&[-0.5f32, -1.5][..]), "copied from logprobs.content");
        let back = call_to_sdk(&call).expect("decodes").expect("an SDK call");
        assert_eq!(value(&back.data), value(&t.data));
        assert_eq!(back.metadata, "null");
    }

    /// A minimal SDK record holding `data`.
    fn sdk_trace(data: &str) -> SdkTrace {
        SdkTrace {
            trace_id: "t".into(),
            data: data.into(),
            namespace: "n".into(),
            context_type: "c".into(),
            metadata: "{}".into(),
            created_at: 1.0,
            updated_at: 1.0,
            session_uids: vec![],
        }
    }

    #[test]
    fn inexact_logprobs_fill_the_column_and_stay_in_the_data() {
        let t = sdk_trace;
        // Not float32 values: the nearest float32 in the column, the data as written.
        let data = r#"{"output":{"output_token_ids":[3,4],"rollout_logprobs":[-0.1,-2]}}"#;
        let call = sdk_to_call(&t(data)).expect("valid");
        assert_eq!(call.logprobs.as_deref(), Some(&[-0.1f32, -2.0][..]));
        let extra = String::from_utf8(call.extra.clone().expect("the SDK record")).expect("UTF-8");
        assert!(extra.contains(r#""rollout_logprobs":[-0.1,-2]"#), "kept as written: {extra}");
        assert!(!extra.contains(r#""logprobs":"output"#), "not moved: {extra}");
        let back = call_to_sdk(&call).expect("decodes").expect("an SDK call");
        assert_eq!(value(&back.data), value(data));
        // OpenAI `logprobs.content`, inexact: copied as the nearest float32.
        let data = r#"{"output":{"choices":[{"token_ids":[5],"logprobs":{"content":[{"logprob":-0.3}]}}]}}"#;
        assert_eq!(sdk_to_call(&t(data)).expect("valid").logprobs.as_deref(), Some(&[-0.3f32][..]));
        // No completion ids: nothing to align logprobs with; they stay data.
        let call = sdk_to_call(&t(r#"{"output":{"rollout_logprobs":[-0.5]}}"#)).expect("valid");
        assert_eq!(call.logprobs, None);
        // An empty list beside a completion means none were recorded.
        let call = sdk_to_call(&t(r#"{"output":{"output_token_ids":[3],"rollout_logprobs":[]}}"#)).expect("valid");
        assert_eq!(call.logprobs, None);
        for (data, field) in [
            (r#"{"output":{"output_token_ids":[3],"rollout_logprobs":[-0.5,-0.25]}}"#, "output.rollout_logprobs"),
            (r#"{"output":{"output_token_ids":[3,4],"rollout_logprobs":[-0.5,-1e39]}}"#, "output.rollout_logprobs[1]"),
            (r#"{"output":{"output_token_ids":[3],"rollout_logprobs":[1e400]}}"#, "output.rollout_logprobs[0]"),
            (r#"{"completion_token_ids":[3],"logprobs":[-0.5,-0.5]}"#, "logprobs"),
            (
                r#"{"output":{"choices":[{"token_ids":[5,6],"logprobs":{"content":[{"logprob":-0.5}]}}]}}"#,
                "output.choices.0.logprobs.content",
            ),
        ] {
            let e = sdk_to_call(&t(data)).expect_err(data);
            assert!(e.message().contains(&format!("invalid {field}")), "{data}: {e}");
        }
    }

    #[test]
    fn bad_data_is_refused_with_the_field() {
        let t = sdk_trace("[1]");
        let e = sdk_to_call(&t).expect_err("not an object");
        assert!(e.message().contains("invalid data"), "{e}");
        let e = sdk_to_call(&SdkTrace { data: r#"{"x":NaN}"#.into(), ..t.clone() }).expect_err("NaN");
        assert!(e.message().contains("invalid data"), "{e}");
        // Found by the trace_json fuzz target: trailing characters were ignored.
        let e = sdk_to_call(&SdkTrace { data: r#"{"x":1}.5]"#.into(), ..t }).expect_err("trailing characters");
        assert!(e.message().contains("invalid data"), "{e}");
    }
}
