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
    /// `body` as JSON text ([`Obj::to_raw`]), written once.
    pub raw: Box<RawValue>,
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
    let raw = body.to_raw();
    Prepared { body, raw, requested_logprobs, stream }
}

/// A response's (or a stream chunk's) `choices`, each read once as an
/// object (None: not an object), in one pass over the list. The trace and
/// the sanitizing both read them, so no choice is parsed twice.
pub type Choices = Vec<Option<Obj>>;

/// Parse `obj`'s `choices`; None when absent or not a list.
pub fn parse_choices(obj: &Obj) -> Option<Choices> {
    obj.get("choices").and_then(json::objects)
}

/// An upstream response body parsed once: its members, its parsed
/// `choices` ([`parse_choices`]), and, when known without more work, the
/// body as the raw value [`response_raw`] gives.
#[derive(Debug)]
pub struct Response {
    pub obj: Obj,
    pub choices: Option<Choices>,
    pub raw: Option<Box<RawValue>>,
}

/// Parse a response body: None when it is not a JSON object. A compact body
/// (vLLM's) is read in one pass, its `choices` with it
/// ([`Obj::parse_with_objects`]); any other is read as [`Obj::parse`] and
/// [`parse_choices`] read it, so every value keeps its text as it came.
pub fn parse_response(text: &str) -> Option<Response> {
    if let Some((obj, choices, raw)) = Obj::parse_with_objects(text, "choices") {
        return Some(Response { obj, choices, raw });
    }
    let obj = Obj::parse(text)?;
    let choices = parse_choices(&obj);
    Some(Response { obj, choices, raw: None })
}

/// The first choice as the trace reads it (rLLM's `choices[0]`); None when
/// there is none or it is not an object.
pub fn first_choice(choices: Option<&Choices>) -> Option<&Obj> {
    choices.and_then(|l| l.first()).and_then(Option::as_ref)
}

/// Strip vLLM-only fields (and `logprobs` unless requested) from a response
/// object or a stream chunk. Returns whether anything changed.
pub fn sanitize(obj: &mut Obj, strip_vllm: bool, requested_logprobs: bool) -> bool {
    let choices = parse_choices(obj);
    sanitize_parsed(obj, choices, strip_vllm, requested_logprobs)
}

/// [`sanitize`] with `obj`'s choices already parsed ([`parse_choices`]).
pub fn sanitize_parsed(obj: &mut Obj, choices: Option<Choices>, strip_vllm: bool, requested_logprobs: bool) -> bool {
    let mut changed = false;
    if strip_vllm {
        for k in STRIP_ROOT {
            changed |= obj.remove(k);
        }
    }
    let Some(mut choices) = choices else { return changed };
    // Which choices lose a key: those are written again, the others kept verbatim.
    let mut edited = vec![false; choices.len()];
    for (co, this) in choices.iter_mut().zip(edited.iter_mut()) {
        let Some(co) = co else { continue };
        if strip_vllm {
            for k in STRIP_CHOICE {
                *this |= co.remove(k);
            }
        }
        if !requested_logprobs {
            *this |= co.remove("logprobs");
        }
    }
    if !edited.contains(&true) {
        return changed;
    }
    // A choice kept as it came needs its verbatim text: the list is read again only then.
    let verbatim = if edited.contains(&false) { obj.get("choices").and_then(json::list) } else { None };
    let verbatim = verbatim.unwrap_or_default();
    let written: Vec<Option<Box<RawValue>>> =
        choices.iter().zip(&edited).map(|(co, this)| co.as_ref().filter(|_| *this).map(Obj::to_raw)).collect();
    let null = json::raw("null".into());
    let items: Vec<&RawValue> = written
        .iter()
        .enumerate()
        .map(|(i, w)| w.as_deref().or_else(|| verbatim.get(i).copied()).unwrap_or(&null))
        .collect();
    let list = json::raw_list(&items);
    obj.set("choices", list);
    true
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

/// One value of a trace record: borrowed from a body the gateway parsed, or
/// written here.
#[derive(Debug)]
pub enum Val<'a> {
    Ref(&'a RawValue),
    Own(Box<RawValue>),
}

impl Val<'_> {
    pub fn get(&self) -> &RawValue {
        match self {
            Val::Ref(v) => v,
            Val::Own(v) => v,
        }
    }
}

/// JSON text the gateway wrote itself (valid by construction).
fn own(text: String) -> Val<'static> {
    Val::Own(json::raw(text))
}

fn ref_or<'a>(v: Option<&'a RawValue>, default: &str) -> Val<'a> {
    match v {
        Some(v) => Val::Ref(v),
        None => own(default.to_owned()),
    }
}

/// A trace record: the 17 keys of rLLM's `TraceRecord`, in order (contract
/// §3.1), each with its value as JSON.
#[derive(Debug)]
pub struct Record<'a>(Vec<(&'static str, Val<'a>)>);

impl Record<'_> {
    /// The record as JSON text: what rLLM's gateway stores for the call.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&json::string(k));
            out.push(':');
            out.push_str(v.get().get());
        }
        out.push('}');
        out
    }

    /// The record as a checked [`trajlog::Call`]: the call
    /// [`trajlog::trace_json::parse_gateway_exact`] makes of
    /// [`Record::to_json`], built from the members without writing and
    /// parsing that text ([`trajlog::trace_json::gateway_members_exact`]).
    pub fn to_call(&self, now: f64) -> trajlog::Result<trajlog::ValidCall> {
        trajlog::trace_json::gateway_members_exact(self.0.iter().map(|(k, v)| (*k, v.get())), now)
    }
}

/// Logprobs of a choice, verbatim: `logprobs.content[].logprob`, else
/// `logprobs.token_logprobs[]`, nulls skipped (read in one pass, [`lp`]).
fn choice_logprobs<'a>(choice: &'a Obj, out: &mut Vec<&'a str>) {
    if let Some(v) = choice.get_some("logprobs") {
        lp::read(v.get(), out);
    }
}

/// The logprobs list, `null` when empty (rLLM's `logprobs or None`).
fn logprobs_val<'s>(lps: impl IntoIterator<Item = &'s str>) -> Val<'static> {
    let mut lps = lps.into_iter().peekable();
    if lps.peek().is_none() {
        own("null".to_owned())
    } else {
        // Each item is a JSON value's verbatim text ([`lp::read`]); the list
        // is checked once more as it becomes a raw value.
        own(json::join_list(lps))
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

/// The 17 keys of rLLM's `TraceRecord`, in order (contract §3.1).
#[allow(clippy::too_many_arguments)]
fn record<'a>(
    facts: &CallFacts<'_>,
    model: Val<'a>,
    messages: Val<'a>,
    prompt_ids: Val<'a>,
    response_message: Val<'a>,
    completion_ids: Val<'a>,
    logprobs: Val<'a>,
    routing_matrices: Val<'a>,
    finish_reason: Val<'a>,
    weight_version: Val<'a>,
    token_counts: Val<'a>,
    raw_request: Val<'a>,
    raw_response: Val<'a>,
) -> Record<'a> {
    Record(vec![
        ("trace_id", own(json::string(facts.trace_id))),
        ("session_id", own(json::string(facts.session_id))),
        ("model", model),
        ("messages", messages),
        ("prompt_token_ids", prompt_ids),
        ("response_message", response_message),
        ("completion_token_ids", completion_ids),
        ("logprobs", logprobs),
        ("routing_matrices", routing_matrices),
        ("finish_reason", finish_reason),
        ("weight_version", weight_version),
        ("latency_ms", own(f64_json(facts.latency_ms))),
        ("token_counts", token_counts),
        ("timestamp", own(f64_json(facts.timestamp))),
        ("metadata", own("{}".to_owned())),
        ("raw_request", raw_request),
        ("raw_response", raw_response),
    ])
}

fn model_of<'a>(request: &'a Obj, fallback: Option<&'a RawValue>) -> Val<'a> {
    let string = |m: &&RawValue| m.get().starts_with('"');
    ref_or(request.get("model").filter(string).or_else(|| fallback.filter(string)), "\"\"")
}

/// The upstream body `text`, which parsed as the object `obj`, as the raw
/// value rLLM stores as `raw_response` (the text without the whitespace
/// around it). An upstream that writes compact JSON without repeated keys
/// (vLLM does) wrote exactly what writing `obj` again gives: that is checked
/// byte for byte and taken without parsing the body a second time; any
/// other body is parsed.
pub fn response_raw(obj: &Obj, text: &str) -> trajlog::Result<Box<RawValue>> {
    let trimmed = text.trim_matches([' ', '\t', '\n', '\r']);
    let written = obj.to_raw();
    if written.get() == trimmed {
        return Ok(written);
    }
    serde_json::from_str(text).map_err(|e| trajlog::Error::invalid("raw_response", e.to_string()))
}

/// The trace record of a non-streaming call (rLLM's `build_trace_record`).
/// `raw_request` is `request` as forwarded ([`Prepared::raw`]); `response`
/// is the upstream body (`raw_response`, a JSON object), `response_obj` its
/// members and `choices` its parsed choices ([`parse_choices`]).
pub fn record_from_response<'a>(
    facts: &CallFacts<'_>,
    request: &'a Obj,
    raw_request: &'a RawValue,
    response_obj: &'a Obj,
    choices: Option<&'a Choices>,
    response: &'a RawValue,
) -> Record<'a> {
    let choice = first_choice(choices);
    let get_some = |k: &str| choice.and_then(|c| c.get_some(k));
    let mut lps = Vec::new();
    if let Some(c) = choice {
        choice_logprobs(c, &mut lps);
    }
    record(
        facts,
        model_of(request, response_obj.get("model")),
        ref_or(request.get("messages"), "[]"),
        ref_or(response_obj.get_some("prompt_token_ids").or_else(|| get_some("prompt_token_ids")), "[]"),
        ref_or(get_some("message").or_else(|| get_some("delta")), "{}"),
        ref_or(get_some("token_ids"), "[]"),
        logprobs_val(lps),
        ref_or(choice.and_then(|c| c.get("routing_matrices")).filter(|v| json::truthy(v)), "null"),
        ref_or(choice.and_then(|c| c.get("finish_reason")), "null"),
        own(weight_json(response_obj.get_some("weight_version"), facts.weight_version)),
        own(token_counts(response_obj.get_some("usage"))),
        Val::Ref(raw_request),
        Val::Ref(response),
    )
}

/// Assembles a streamed call's trace from its `data:` chunks
/// (rLLM's `build_trace_record_from_chunks`, contract §2.4).
#[derive(Debug, Default)]
pub struct StreamAssembly {
    chunks: usize,
    prompt_ids: Option<Box<RawValue>>,
    model: Option<Box<RawValue>>,
    completion_ids: Vec<String>,
    logprobs: Vec<String>,
    role: Option<Box<RawValue>>,
    content: String,
    tool_calls: Vec<String>,
    finish_reason: Option<Box<RawValue>>,
    usage: Option<Box<RawValue>>,
}

impl StreamAssembly {
    /// Whether at least one JSON chunk arrived (else no trace).
    pub fn is_empty(&self) -> bool {
        self.chunks == 0
    }

    /// Take one parsed chunk ([`StreamAssembly::push_parsed`]).
    pub fn push(&mut self, chunk: &Obj) {
        self.push_parsed(chunk, parse_choices(chunk).as_ref());
    }

    /// Take one parsed chunk with its parsed `choices`.
    ///
    /// With `n > 1`, vLLM streams every choice as `choices[0]` with its own
    /// `index`; only choice 0 is assembled (rLLM interleaves them all into
    /// one trace, contract §7.3.2).
    pub fn push_parsed(&mut self, chunk: &Obj, choices: Option<&Choices>) {
        let empty = Obj::default();
        let choice = first_choice(choices).filter(|c| c.get("index").is_none_or(|i| i.get() == "0")).unwrap_or(&empty);
        if self.chunks == 0 {
            self.prompt_ids = chunk
                .get_some("prompt_token_ids")
                .or_else(|| choice.get_some("prompt_token_ids"))
                .map(|v| v.to_owned());
            self.model = chunk.get("model").filter(|m| m.get().starts_with('"')).map(|m| m.to_owned());
        }
        self.chunks += 1;
        if let Some(ids) = choice.get_some("token_ids").and_then(json::list) {
            self.completion_ids.extend(ids.iter().map(|v| v.get().to_owned()));
        }
        let mut lps = Vec::new();
        choice_logprobs(choice, &mut lps);
        self.logprobs.extend(lps.into_iter().map(str::to_owned));
        if let Some(delta) = choice.get_some("delta").and_then(|d| Obj::parse(d.get())) {
            if let Some(role) = delta.get_some("role").filter(|r| json::truthy(r)) {
                self.role = Some(role.to_owned());
            }
            if let Some(c) = delta.get_some("content").and_then(|c| serde_json::from_str::<String>(c.get()).ok()) {
                self.content.push_str(&c);
            }
            if let Some(tc) = delta.get_some("tool_calls").and_then(json::list) {
                self.tool_calls.extend(tc.iter().map(|v| v.get().to_owned()));
            }
        }
        if let Some(f) = choice.get_some("finish_reason") {
            self.finish_reason = Some(f.to_owned());
        }
        if let Some(u) = chunk.get("usage").filter(|u| json::truthy(u)) {
            self.usage = Some(u.to_owned());
        }
    }

    /// The trace record once the stream ended; `raw_request` is `request`
    /// as forwarded ([`Prepared::raw`]).
    pub fn record<'a>(&'a self, facts: &CallFacts<'_>, request: &'a Obj, raw_request: &'a RawValue) -> Record<'a> {
        let mut msg = Obj::default();
        msg.set("role", self.role.clone().unwrap_or_else(|| json::raw("\"assistant\"".into())));
        if !self.content.is_empty() {
            msg.set("content", json::raw(json::string(&self.content)));
        }
        if !self.tool_calls.is_empty() {
            msg.set("tool_calls", json::raw(json::join_list(self.tool_calls.iter().map(String::as_str))));
        }
        let model = match &self.model {
            Some(m) => Val::Ref(m),
            None => model_of(request, None),
        };
        record(
            facts,
            model,
            ref_or(request.get("messages"), "[]"),
            ref_or(self.prompt_ids.as_deref(), "[]"),
            Val::Own(msg.to_raw()),
            own(json::join_list(self.completion_ids.iter().map(String::as_str))),
            logprobs_val(self.logprobs.iter().map(String::as_str)),
            own("null".into()),
            ref_or(self.finish_reason.as_deref(), "null"),
            own(weight_json(None, facts.weight_version)),
            own(token_counts(self.usage.as_deref())),
            Val::Ref(raw_request),
            own("null".into()),
        )
    }
}

/// The logprobs of a choice's `logprobs` object in one pass, read as the
/// gateway's [`Obj`] walk reads them: not an object, nothing; `content`
/// (the last one, unless `null` or not a list) wins over `token_logprobs`;
/// a `content` entry that is not an object, or whose (last) `logprob` is
/// missing or `null`, gives nothing. Keys are compared unescaped.
///
/// The text is a [`RawValue`]'s, which serde_json checked when it read the
/// response: this scan only finds where each value ends (a string at its
/// closing quote, a list or object at its matching bracket, anything else
/// at the next delimiter), so it skips the values it does not keep faster
/// than a parser that checks them again. Malformed text (which a
/// `RawValue` cannot hold) gives nothing rather than a panic.
mod lp {
    use std::borrow::Cow;
    use trajlog::json_scan::{skip_ws as ws, string_end, value_end};

    /// The logprobs of the `logprobs` value `t`, pushed onto `out` as the
    /// verbatim text of each value.
    pub fn read<'t>(t: &'t str, out: &mut Vec<&'t str>) {
        let b = t.as_bytes();
        let mut content: Option<Vec<Option<&'t str>>> = None;
        let mut token_logprobs: Option<Vec<&'t str>> = None;
        let walked = members(t, ws(b, 0), &mut |key, at| match key {
            "content" => {
                let (list, end) = list(t, at, &mut |at| {
                    if b.get(at) != Some(&b'{') {
                        return Some((None, value_end(b, at)?));
                    }
                    let mut logprob = None;
                    let end = members(t, at, &mut |key, at| {
                        if key != "logprob" {
                            return None;
                        }
                        let end = value_end(b, at)?;
                        logprob = t.get(at..end);
                        Some(end)
                    })?;
                    Some((logprob.filter(|v| *v != "null"), end))
                })?;
                content = list;
                Some(end)
            }
            "token_logprobs" => {
                let (list, end) = list(t, at, &mut |at| {
                    let end = value_end(b, at)?;
                    Some((t.get(at..end), end))
                })?;
                token_logprobs = list.map(|l| l.into_iter().flatten().collect());
                Some(end)
            }
            _ => None,
        });
        if walked.is_none() {
            return;
        }
        match (content, token_logprobs) {
            (Some(content), _) => out.extend(content.into_iter().flatten()),
            (None, Some(tl)) => out.extend(tl.into_iter().filter(|v| *v != "null")),
            (None, None) => {}
        }
    }

    /// The key literal at `i`, unescaped, and its end.
    fn key(t: &str, i: usize) -> Option<(Cow<'_, str>, usize)> {
        let end = string_end(t.as_bytes(), i)?;
        let inner = t.get(i + 1..end - 1)?;
        if inner.contains('\\') {
            let unescaped: String = serde_json::from_str(t.get(i..end)?).ok()?;
            return Some((Cow::Owned(unescaped), end));
        }
        Some((Cow::Borrowed(inner), end))
    }

    /// Walk the object at `i`: `visit(key, value_start)` returns the end of
    /// a value it read, None to have it skipped. The end of the object;
    /// None when there is no object at `i`.
    fn members(t: &str, i: usize, visit: &mut dyn FnMut(&str, usize) -> Option<usize>) -> Option<usize> {
        let b = t.as_bytes();
        if b.get(i) != Some(&b'{') {
            return None;
        }
        let mut j = ws(b, i + 1);
        if b.get(j) == Some(&b'}') {
            return Some(j + 1);
        }
        loop {
            let (k, key_end) = key(t, j)?;
            j = ws(b, key_end);
            if b.get(j) != Some(&b':') {
                return None;
            }
            let start = ws(b, j + 1);
            let end = match visit(&k, start) {
                Some(end) => end,
                None => value_end(b, start)?,
            };
            j = ws(b, end);
            match *b.get(j)? {
                b',' => j = ws(b, j + 1),
                b'}' => return Some(j + 1),
                _ => return None,
            }
        }
    }

    /// The items of the list at `i`, each read by `item(start)` (its value
    /// and end), and the list's end; the value at `i` skipped and None when
    /// it is not a list.
    fn list<T>(
        t: &str,
        i: usize,
        item: &mut dyn FnMut(usize) -> Option<(T, usize)>,
    ) -> Option<(Option<Vec<T>>, usize)> {
        let b = t.as_bytes();
        if b.get(i) != Some(&b'[') {
            return Some((None, value_end(b, i)?));
        }
        let mut out = Vec::new();
        let mut j = ws(b, i + 1);
        if b.get(j) == Some(&b']') {
            return Some((Some(out), j + 1));
        }
        loop {
            let (v, end) = item(j)?;
            out.push(v);
            j = ws(b, end);
            match *b.get(j)? {
                b',' => j = ws(b, j + 1),
                b']' => return Some((Some(out), j + 1)),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(t: &str) -> Obj {
        Obj::parse(t).unwrap_or_default()
    }

    /// The call built from the members is the one parsing the record's text gives.
    fn same_call(rec: &Record<'_>) {
        let direct = rec.to_call(5.0).map(trajlog::ValidCall::into_inner).map_err(|e| e.to_string());
        let parsed = trajlog::trace_json::parse_gateway_exact(&rec.to_json(), 5.0).map_err(|e| e.to_string());
        assert_eq!(direct, parsed);
        assert!(direct.is_ok());
    }

    /// The old walk of a choice's logprobs, one `Obj` parse per level.
    fn logprobs_by_obj(choice: &Obj) -> Vec<String> {
        let mut out = Vec::new();
        let Some(lp) = choice.get_some("logprobs").and_then(|v| Obj::parse(v.get())) else { return out };
        if let Some(content) = lp.get_some("content").and_then(json::list) {
            for e in content {
                if let Some(v) = Obj::parse(e.get()).and_then(|o| o.get_some("logprob").map(|v| v.get().to_owned())) {
                    out.push(v);
                }
            }
        } else if let Some(tl) = lp.get_some("token_logprobs").and_then(json::list) {
            out.extend(tl.iter().filter(|v| v.get() != "null").map(|v| v.get().to_owned()));
        }
        out
    }

    #[test]
    fn sanitize_rewrites_only_the_choices_it_changes() {
        let mut o = obj(
            r#"{"choices":[{"a":1,"token_ids":[1]}, 5 ,{"b" : [ 2 ]},{"c":3,"logprobs":null}],"prompt_token_ids":[1]}"#,
        );
        assert!(sanitize(&mut o, true, false));
        assert_eq!(o.to_json(), r#"{"choices":[{"a":1},5,{"b" : [ 2 ]},{"c":3}]}"#);
        let mut o = obj(r#"{"choices":[{"b" : 1}],"id":"x"}"#);
        assert!(!sanitize(&mut o, true, false));
        assert_eq!(o.to_json(), r#"{"choices":[{"b" : 1}],"id":"x"}"#);
        let mut o = obj(r#"{"choices":{"token_ids":[1]}}"#);
        assert!(!sanitize(&mut o, true, false));
    }

    #[test]
    fn raw_response_is_the_body_without_surrounding_whitespace() {
        for text in [
            r#"{"a":1,"b":[1, 2]}"#,
            "\n {\"a\":1,\"b\":[1,2]}\r\n",
            r#"{"a":1,"a":2}"#,
            r#"{"a":"\u00e9"}"#,
            r#"{"a":{}}"#,
        ] {
            let got = response_raw(&obj(text), text).map(|v| v.get().to_owned()).map_err(|e| e.to_string());
            let want = serde_json::from_str::<&RawValue>(text).map(|v| v.get().to_owned()).map_err(|e| e.to_string());
            assert_eq!(got, want, "{text}");
        }
    }

    /// The one-pass read of a response gives what the two passes give:
    /// the same members (each value's text), the same choices, and the
    /// body's raw value when it gives one.
    #[test]
    fn one_pass_response_reads_as_two_passes() {
        let text_of = |o: &Obj| o.0.iter().map(|(k, v)| format!("{k}={}", v.get())).collect::<Vec<_>>();
        let choices_of =
            |c: &Option<Choices>| c.as_ref().map(|l| l.iter().map(|o| o.as_ref().map(text_of)).collect::<Vec<_>>());
        for text in [
            r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"token_ids":[1,2]}],"prompt_token_ids":[3]}"#,
            "\n{\"choices\":[{\"a\":1},{\"b\":[]}],\"u\":null}\r\n",
            r#"{"choices":[{"a":1}, {"b":2}]}"#,
            r#"{"choices":[{"a":1,"a":2}]}"#,
            r#"{"choices":[{"a":1}],"choices":[{"b":2}]}"#,
            r#"{"choices":[{"a":1},null,3]}"#,
            r#"{"choices":{"a":1}}"#,
            r#"{"choices":"none","x":1}"#,
            r#"{"choices":[]}"#,
            r#"{"x":[1, 2],"y":{"choices":[]}}"#,
            r#"{"choices":[{"t":"\u00e9"}]}"#,
            r#"{"a":1,"a":2,"choices":[{}]}"#,
            r#"{}"#,
            r#"[1]"#,
            r#"{"choices":[{"a":1}]"#,
        ] {
            let two = Obj::parse(text).map(|o| {
                let c = parse_choices(&o);
                (text_of(&o), choices_of(&c))
            });
            let one = parse_response(text);
            assert_eq!(one.as_ref().map(|r| (text_of(&r.obj), choices_of(&r.choices))), two, "{text}");
            if let Some(raw) = one.and_then(|r| r.raw) {
                let want = response_raw(&obj(text), text).map(|v| v.get().to_owned()).map_err(|e| e.to_string());
                assert_eq!(Ok(raw.get().to_owned()), want, "{text}");
            }
        }
        let compact = r#"{"id":"x","choices":[{"index":0,"token_ids":[1,2]}],"usage":{"prompt_tokens":1}}"#;
        assert!(parse_response(compact).is_some_and(|r| r.raw.is_some()), "a compact body is read in one pass");
    }

    #[test]
    fn one_pass_logprobs_read_as_the_obj_walk() {
        let cases = [
            r#"{"logprobs":{"content":[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[{"logprob":-9}]},{"logprob":-1e-3}]}}"#,
            r#"{"logprobs":{"content":[1,"x",null,[],{"logprob":null},{"logprob":-1,"logprob":-2},{"token":"\"logprob\""}]}}"#,
            r#"{"logprobs":{"content":null,"token_logprobs":[-0.25,null,-1.5E2]}}"#,
            r#"{"logprobs":{"content":{"logprob":1},"token_logprobs":[-1]}}"#,
            r#"{"logprobs":{"content":[{"logprob":-1}],"content":"no"}}"#,
            r#"{"logprobs":{"token_logprobs":[-1],"token_logprobs":[-2,-3],"content":[]}}"#,
            r#"{"logprobs":{"token_logprobs":{"a":1}}}"#,
            r#"{"logprobs":[{"logprob":-1}]}"#,
            r#"{"logprobs":null}"#,
            r#"{"logprobs":"x"}"#,
            r#"{"logprobs":{"content":[{"logprob":-4.0}]}}"#,
            r#"{"logprobs":{"content":[{"token":"]}\"[{,","logprob":-2.5,"bytes":[93,125],"top_logprobs":[{"token":"x","logprob":-7}]}]}}"#,
            r#"{"logprobs":{"\u0063ontent":[{"log\u0070rob":-1},{"logprob":-2,"log\u0070rob":-3}],"token_logprobs":[-9]}}"#,
            r#"{"logprobs": { "content" : [ { "logprob" : -1.5 } , { "logprob" : null } , 7 ] , "x" : { "content" : [] } } }"#,
            r#"{"logprobs":{"token_logprobs":[ -1 , "a" , {"b":[1]} , null , [2] ]}}"#,
            r#"{}"#,
        ];
        for c in cases {
            let choice = obj(c);
            let mut fast = Vec::new();
            choice_logprobs(&choice, &mut fast);
            assert_eq!(fast, logprobs_by_obj(&choice), "{c}");
        }
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
        let req = obj(r#"{"model":"req","messages":[{"role":"user","content":"x"}]}"#);
        let raw_req = req.to_raw();
        let rec = a.record(&facts, &req, &raw_req);
        same_call(&rec);
        assert_eq!(
            rec.to_json(),
            r#"{"trace_id":"t","session_id":"s","model":"up","messages":[{"role":"user","content":"x"}],"prompt_token_ids":[1,2],"response_message":{"role":"assistant","tool_calls":[{"index":0,"function":{"name":"f"}},{"index":0,"function":{"arguments":"{}"}}]},"completion_token_ids":[7,8],"logprobs":[-0.5,-0.25],"routing_matrices":null,"finish_reason":"tool_calls","weight_version":3,"latency_ms":1.5,"token_counts":{},"timestamp":10.0,"metadata":{},"raw_request":{"model":"req","messages":[{"role":"user","content":"x"}]},"raw_response":null}"#
        );
    }

    #[test]
    fn response_weight_version_wins_and_empty_logprobs_are_null() {
        let req = obj(r#"{"model":"m","messages":[]}"#);
        let text = r#"{"choices":[{"message":{"role":"assistant","content":"hi"},"finish_reason":"stop","token_ids":[5],"routing_matrices":["ab"]}],"weight_version":9,"usage":{"prompt_tokens":1}}"#;
        let facts =
            CallFacts { trace_id: "t", session_id: "s", weight_version: Some(3), latency_ms: 2.0, timestamp: 1.0 };
        let (resp, raw_req) = (obj(text), req.to_raw());
        let choices = parse_choices(&resp);
        let raw_resp = json::raw(text.to_owned());
        let rec = record_from_response(&facts, &req, &raw_req, &resp, choices.as_ref(), &raw_resp);
        same_call(&rec);
        let rec: serde_json::Value = serde_json::from_str(&rec.to_json()).unwrap_or_default();
        assert_eq!(rec["weight_version"], 9);
        assert_eq!(rec["logprobs"], serde_json::Value::Null);
        assert_eq!(rec["routing_matrices"], serde_json::json!(["ab"]));
        assert_eq!(rec["token_counts"], serde_json::json!({"prompt": 1}));
        assert_eq!(rec["prompt_token_ids"], serde_json::json!([]));
    }
}
