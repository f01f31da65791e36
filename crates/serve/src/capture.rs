//! What the gateway does to a call, as pure functions on JSON text: the
//! request injection (contract §2.1), the response sanitizing (§2.3, §2.4) and
//! the trace record (§3), built as rLLM's `build_trace_record` /
//! `build_trace_record_from_chunks` build it — same 17 keys, same order, same
//! sources — then mapped into a [`trajlog::Call`] by
//! [`trajlog::trace_json::parse_gateway_exact`], the mapping the CLI's import
//! uses too. Token ids and logprobs are copied as the upstream's verbatim
//! number text, so the store sees exactly what vLLM printed.

use crate::json::{self, Obj};
use serde_json::value::RawValue;

/// Root keys of a vLLM response removed from what the agent receives.
pub const STRIP_ROOT: &[&str] = &["prompt_token_ids", "prompt_logprobs", "kv_transfer_params", "weight_version"];
/// Keys of each `choices[i]` removed from what the agent receives.
pub const STRIP_CHOICE: &[&str] = &["token_ids", "stop_reason", "routing_matrices"];

/// What the gateway injects into an agent's POST body.
#[derive(Debug, Clone)]
pub struct Injection<'a> {
    pub add_logprobs: bool,
    pub add_return_token_ids: bool,
    /// Pin `model` to this name.
    pub model: Option<&'a str>,
    /// The session's sampling params (applied last; they win).
    pub sampling_params: Option<&'a Obj>,
}

/// An agent request after injection.
#[derive(Debug)]
pub struct Prepared {
    /// The body forwarded upstream (and stored as `raw_request`).
    pub body: Obj,
    /// The client asked for logprobs itself (so they are not stripped).
    pub requested_logprobs: bool,
    /// `stream: true`.
    pub stream: bool,
}

/// Apply rLLM's request mutation (contract §2.1), keeping the key order it
/// produces: client keys in place, then new `logprobs`, `return_token_ids`,
/// `model`, then new sampling-param keys.
pub fn prepare(mut body: Obj, inj: &Injection<'_>) -> Prepared {
    let requested_logprobs = body.get("logprobs").is_some_and(json::truthy);
    if inj.add_logprobs && !body.contains("logprobs") {
        body.set("logprobs", json::raw("true".into()));
    }
    if inj.add_return_token_ids && !body.contains("return_token_ids") {
        body.set("return_token_ids", json::raw("true".into()));
    }
    if let Some(m) = inj.model {
        body.set("model", json::raw(json::string(m)));
    }
    if let Some(sp) = inj.sampling_params {
        for (k, v) in &sp.0 {
            body.set(k, v.clone());
        }
    }
    let stream = body.get("stream").is_some_and(|v| v.get() == "true");
    Prepared { body, requested_logprobs, stream }
}

/// Strip vLLM-only fields (and `logprobs` unless requested) from a response
/// object or a stream chunk. Returns whether anything changed.
pub fn sanitize(obj: &mut Obj, strip_vllm: bool, requested_logprobs: bool) -> bool {
    let mut changed = false;
    if strip_vllm {
        for k in STRIP_ROOT {
            changed |= obj.remove(k);
        }
    }
    let Some(choices) = obj.get("choices").and_then(json::list) else { return changed };
    let mut out: Vec<String> = Vec::with_capacity(choices.len());
    let mut choices_changed = false;
    for c in choices {
        match Obj::parse(c.get()) {
            Some(mut co) => {
                let mut this = false;
                if strip_vllm {
                    for k in STRIP_CHOICE {
                        this |= co.remove(k);
                    }
                }
                if !requested_logprobs {
                    this |= co.remove("logprobs");
                }
                choices_changed |= this;
                out.push(if this { co.to_json() } else { c.get().to_owned() });
            }
            None => out.push(c.get().to_owned()),
        }
    }
    if choices_changed {
        obj.set("choices", json::raw(json::join_list(out.iter().map(String::as_str))));
    }
    changed | choices_changed
}

/// The gateway-side facts of one call, for its trace record.
#[derive(Debug, Clone)]
pub struct CallFacts<'a> {
    pub trace_id: &'a str,
    pub session_id: &'a str,
    /// The weight version at dispatch.
    pub weight_version: Option<i64>,
    pub latency_ms: f64,
    /// Epoch seconds when the record is built.
    pub timestamp: f64,
}

fn first_choice(resp: &Obj) -> Option<Obj> {
    resp.get("choices").and_then(json::list).and_then(|l| l.first().and_then(|c| Obj::parse(c.get())))
}

fn text_or<'a>(v: Option<&'a RawValue>, default: &'a str) -> &'a str {
    v.map(RawValue::get).unwrap_or(default)
}

/// Logprob texts of a choice: `logprobs.content[].logprob`, else
/// `logprobs.token_logprobs[]`, nulls skipped.
fn choice_logprobs(choice: &Obj, out: &mut Vec<String>) {
    let Some(lp) = choice.get_some("logprobs").and_then(|v| Obj::parse(v.get())) else { return };
    if let Some(content) = lp.get_some("content").and_then(json::list) {
        for e in content {
            if let Some(v) = Obj::parse(e.get()).and_then(|o| o.get_some("logprob").map(|v| v.get().to_owned())) {
                out.push(v);
            }
        }
    } else if let Some(tl) = lp.get_some("token_logprobs").and_then(json::list) {
        out.extend(tl.iter().filter(|v| v.get() != "null").map(|v| v.get().to_owned()));
    }
}

fn logprobs_json(lps: &[String]) -> String {
    if lps.is_empty() {
        "null".to_owned()
    } else {
        json::join_list(lps.iter().map(String::as_str))
    }
}

fn token_counts(usage: Option<&RawValue>) -> String {
    let Some(u) = usage.and_then(|u| Obj::parse(u.get())) else { return "{}".into() };
    let mut out = Obj::default();
    if let Some(v) = u.get_some("prompt_tokens") {
        out.set("prompt", v.to_owned());
    }
    if let Some(v) = u.get_some("completion_tokens") {
        out.set("completion", v.to_owned());
    }
    out.to_json()
}

fn f64_json(v: f64) -> String {
    if v.is_finite() {
        format!("{v:?}")
    } else {
        "null".into()
    }
}

fn weight_json(resp_wv: Option<&RawValue>, dispatch: Option<i64>) -> String {
    if let Some(v) = resp_wv {
        // int(x) in rLLM; an integer literal is kept, anything else falls back.
        if v.get().parse::<i64>().is_ok() {
            return v.get().to_owned();
        }
        if let Ok(f) = v.get().parse::<f64>() {
            if f.is_finite() {
                return format!("{}", f.trunc() as i64);
            }
        }
    }
    dispatch.map(|w| w.to_string()).unwrap_or_else(|| "null".into())
}

/// Write the 17 keys of rLLM's `TraceRecord`, in order (contract §3.1).
#[allow(clippy::too_many_arguments)]
fn record(
    facts: &CallFacts<'_>,
    model: &str,
    messages: &str,
    prompt_ids: &str,
    response_message: &str,
    completion_ids: &str,
    logprobs: &str,
    routing_matrices: &str,
    finish_reason: &str,
    weight_version: &str,
    token_counts: &str,
    raw_request: &str,
    raw_response: &str,
) -> String {
    let pairs: [(&str, &str); 17] = [
        ("trace_id", &json::string(facts.trace_id)),
        ("session_id", &json::string(facts.session_id)),
        ("model", model),
        ("messages", messages),
        ("prompt_token_ids", prompt_ids),
        ("response_message", response_message),
        ("completion_token_ids", completion_ids),
        ("logprobs", logprobs),
        ("routing_matrices", routing_matrices),
        ("finish_reason", finish_reason),
        ("weight_version", weight_version),
        ("latency_ms", &f64_json(facts.latency_ms)),
        ("token_counts", token_counts),
        ("timestamp", &f64_json(facts.timestamp)),
        ("metadata", "{}"),
        ("raw_request", raw_request),
        ("raw_response", raw_response),
    ];
    let mut out = String::with_capacity(pairs.iter().map(|(k, v)| k.len() + v.len() + 4).sum::<usize>() + 2);
    out.push('{');
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&json::string(k));
        out.push(':');
        out.push_str(v);
    }
    out.push('}');
    out
}

fn model_of(request: &Obj, fallback: Option<&RawValue>) -> String {
    match request.get("model").filter(|m| m.get().starts_with('"')) {
        Some(m) => m.get().to_owned(),
        None => match fallback.filter(|m| m.get().starts_with('"')) {
            Some(m) => m.get().to_owned(),
            None => "\"\"".to_owned(),
        },
    }
}

/// The trace record of a non-streaming call (rLLM's `build_trace_record`).
/// `response_text` is the upstream body, which must be a JSON object.
pub fn record_from_response(facts: &CallFacts<'_>, request: &Obj, response: &Obj, response_text: &str) -> String {
    let choice = first_choice(response).unwrap_or_default();
    let prompt_ids = response
        .get_some("prompt_token_ids")
        .or_else(|| choice.get_some("prompt_token_ids"))
        .map(|v| v.get().to_owned())
        .unwrap_or_else(|| "[]".into());
    let response_message = text_or(choice.get_some("message").or_else(|| choice.get_some("delta")), "{}").to_owned();
    let completion_ids = text_or(choice.get_some("token_ids"), "[]").to_owned();
    let mut lps = Vec::new();
    choice_logprobs(&choice, &mut lps);
    let routing = choice.get("routing_matrices").filter(|v| json::truthy(v)).map(|v| v.get()).unwrap_or("null");
    record(
        facts,
        &model_of(request, response.get("model")),
        text_or(request.get("messages"), "[]"),
        &prompt_ids,
        &response_message,
        &completion_ids,
        &logprobs_json(&lps),
        routing,
        text_or(choice.get("finish_reason"), "null"),
        &weight_json(response.get_some("weight_version"), facts.weight_version),
        &token_counts(response.get_some("usage")),
        &request.to_json(),
        response_text,
    )
}

/// Assembles a streamed call's trace from its `data:` chunks
/// (rLLM's `build_trace_record_from_chunks`, contract §2.4).
#[derive(Debug, Default)]
pub struct StreamAssembly {
    chunks: usize,
    prompt_ids: Option<String>,
    model: Option<String>,
    completion_ids: Vec<String>,
    logprobs: Vec<String>,
    role: Option<String>,
    content: String,
    tool_calls: Vec<String>,
    finish_reason: Option<String>,
    usage: Option<String>,
}

impl StreamAssembly {
    /// Whether at least one JSON chunk arrived (else no trace).
    pub fn is_empty(&self) -> bool {
        self.chunks == 0
    }

    /// Take one parsed chunk.
    ///
    /// With `n > 1`, vLLM streams every choice as `choices[0]` with its own
    /// `index`; only choice 0 is assembled (rLLM interleaves them all into
    /// one trace, contract §7.3.2).
    pub fn push(&mut self, chunk: &Obj) {
        let choice = first_choice(chunk).filter(|c| c.get("index").is_none_or(|i| i.get() == "0")).unwrap_or_default();
        if self.chunks == 0 {
            self.prompt_ids = chunk
                .get_some("prompt_token_ids")
                .or_else(|| choice.get_some("prompt_token_ids"))
                .map(|v| v.get().to_owned());
            self.model = chunk.get("model").filter(|m| m.get().starts_with('"')).map(|m| m.get().to_owned());
        }
        self.chunks += 1;
        if let Some(ids) = choice.get_some("token_ids").and_then(json::list) {
            self.completion_ids.extend(ids.iter().map(|v| v.get().to_owned()));
        }
        choice_logprobs(&choice, &mut self.logprobs);
        if let Some(delta) = choice.get_some("delta").and_then(|d| Obj::parse(d.get())) {
            if let Some(role) = delta.get_some("role").filter(|r| json::truthy(r)) {
                self.role = Some(role.get().to_owned());
            }
            if let Some(c) = delta.get_some("content").and_then(|c| serde_json::from_str::<String>(c.get()).ok()) {
                self.content.push_str(&c);
            }
            if let Some(tc) = delta.get_some("tool_calls").and_then(json::list) {
                self.tool_calls.extend(tc.iter().map(|v| v.get().to_owned()));
            }
        }
        if let Some(f) = choice.get_some("finish_reason") {
            self.finish_reason = Some(f.get().to_owned());
        }
        if let Some(u) = chunk.get("usage").filter(|u| json::truthy(u)) {
            self.usage = Some(u.get().to_owned());
        }
    }

    /// The trace record once the stream ended.
    pub fn record(&self, facts: &CallFacts<'_>, request: &Obj) -> String {
        let mut msg = Obj::default();
        msg.set("role", json::raw(self.role.clone().unwrap_or_else(|| "\"assistant\"".into())));
        if !self.content.is_empty() {
            msg.set("content", json::raw(json::string(&self.content)));
        }
        if !self.tool_calls.is_empty() {
            msg.set("tool_calls", json::raw(json::join_list(self.tool_calls.iter().map(String::as_str))));
        }
        let model = match &self.model {
            Some(m) => m.clone(),
            None => model_of(request, None),
        };
        let usage = self.usage.as_deref().and_then(|u| RawValue::from_string(u.to_owned()).ok());
        record(
            facts,
            &model,
            text_or(request.get("messages"), "[]"),
            self.prompt_ids.as_deref().unwrap_or("[]"),
            &msg.to_json(),
            &json::join_list(self.completion_ids.iter().map(String::as_str)),
            &logprobs_json(&self.logprobs),
            "null",
            self.finish_reason.as_deref().unwrap_or("null"),
            &weight_json(None, facts.weight_version),
            &token_counts(usage.as_deref()),
            &request.to_json(),
            "null",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(t: &str) -> Obj {
        Obj::parse(t).unwrap_or_default()
    }

    #[test]
    fn injection_keeps_rllm_key_order() {
        let sp = obj(r#"{"temperature":1.0,"presence_penalty":0.5}"#);
        let p = prepare(
            obj(r#"{"model":"a","temperature":0.2,"messages":[]}"#),
            &Injection { add_logprobs: true, add_return_token_ids: true, model: Some("m"), sampling_params: Some(&sp) },
        );
        assert_eq!(
            p.body.to_json(),
            r#"{"model":"m","temperature":1.0,"messages":[],"logprobs":true,"return_token_ids":true,"presence_penalty":0.5}"#
        );
        assert!(!p.requested_logprobs && !p.stream);
        let p = prepare(
            obj(r#"{"logprobs":false,"stream":true}"#),
            &Injection { add_logprobs: true, add_return_token_ids: false, model: None, sampling_params: None },
        );
        assert_eq!(p.body.to_json(), r#"{"logprobs":false,"stream":true}"#, "an explicit false is kept");
        assert!(p.stream);
    }

    #[test]
    fn stream_assembly_takes_choice_zero_and_raw_tool_call_fragments() {
        let mut a = StreamAssembly::default();
        a.push(&obj(r#"{"model":"up","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[1,2]}"#));
        a.push(&obj(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]},"logprobs":{"content":[{"logprob":-0.5}]},"token_ids":[7]}]}"#));
        a.push(&obj(r#"{"choices":[{"index":1,"delta":{"content":"other choice"},"logprobs":{"content":[{"logprob":-9.0}]},"token_ids":[99]}]}"#));
        a.push(&obj(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]},"logprobs":{"content":[{"logprob":-0.25}]},"finish_reason":"tool_calls","token_ids":[8]}]}"#));
        let facts =
            CallFacts { trace_id: "t", session_id: "s", weight_version: Some(3), latency_ms: 1.5, timestamp: 10.0 };
        let rec = a.record(&facts, &obj(r#"{"model":"req","messages":[{"role":"user","content":"x"}]}"#));
        assert_eq!(
            rec,
            r#"{"trace_id":"t","session_id":"s","model":"up","messages":[{"role":"user","content":"x"}],"prompt_token_ids":[1,2],"response_message":{"role":"assistant","tool_calls":[{"index":0,"function":{"name":"f"}},{"index":0,"function":{"arguments":"{}"}}]},"completion_token_ids":[7,8],"logprobs":[-0.5,-0.25],"routing_matrices":null,"finish_reason":"tool_calls","weight_version":3,"latency_ms":1.5,"token_counts":{},"timestamp":10.0,"metadata":{},"raw_request":{"model":"req","messages":[{"role":"user","content":"x"}]},"raw_response":null}"#
        );
    }

    #[test]
    fn response_weight_version_wins_and_empty_logprobs_are_null() {
        let req = obj(r#"{"model":"m","messages":[]}"#);
        let text = r#"{"choices":[{"message":{"role":"assistant","content":"hi"},"finish_reason":"stop","token_ids":[5],"routing_matrices":["ab"]}],"weight_version":9,"usage":{"prompt_tokens":1}}"#;
        let facts =
            CallFacts { trace_id: "t", session_id: "s", weight_version: Some(3), latency_ms: 2.0, timestamp: 1.0 };
        let rec: serde_json::Value =
            serde_json::from_str(&record_from_response(&facts, &req, &obj(text), text)).unwrap_or_default();
        assert_eq!(rec["weight_version"], 9);
        assert_eq!(rec["logprobs"], serde_json::Value::Null);
        assert_eq!(rec["routing_matrices"], serde_json::json!(["ab"]));
        assert_eq!(rec["token_counts"], serde_json::json!({"prompt": 1}));
        assert_eq!(rec["prompt_token_ids"], serde_json::json!([]));
    }
}
