//! Traces shaped as rLLM's model gateway stores them
//! (`rllm_model_gateway/data_process.py`, `build_trace_record` and
//! `build_trace_record_from_chunks`; studied in docs/serve-contract.md §3).
//!
//! A `Conversation` carries one session's chat history: a system and a user
//! message, then per call the assistant's message (text, and a tool call on
//! every call but the last) and the tool's result. Each call's `messages` is
//! the whole history sent with it, so it grows turn by turn exactly as the
//! prompt does: the prompt gains the completion and the tool result's tokens,
//! `messages` gains the assistant message and the tool message, whose texts
//! are those tokens decoded with a small synthetic vocabulary.
//!
//! Per call the gateway record is written with its 17 keys in the
//! `TraceRecord` field order ([`TRACE_KEYS`](trajlog::trace_json::TRACE_KEYS)), compact, numbers as Python
//! writes them ([`gateway_json`]), and mapped into a [`Call`] by
//! [`trajlog::trace_json::parse_trace`], as `trajlog ingest` maps the line.
//! Invariants, for the non-streaming shape: `raw_request.messages` is
//! `messages`; `raw_response.prompt_token_ids` is the prompt column,
//! `raw_response.choices[0].token_ids` the completion column, each
//! `choices[0].logprobs.content[i].logprob` the `f32` logprob widened to `f64`,
//! and `choices[0].message` is `response_message`; the next call's `messages`
//! is this call's plus `response_message` plus the tool message. In the
//! streaming shape `raw_response` is null, `token_counts` is `{}`, the
//! recorded `response_message` is assembled from the deltas (tool-call
//! fragments not merged, as the gateway does), and the agent's history holds
//! the message it merged itself, so the next `messages` does not repeat the
//! recorded `response_message`.
//!
//! Documents draw on a random stream of their own, so the token columns of a
//! session are the same in every shape.

use crate::pyjson::write_py_float;
use crate::Rng;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use trajlog::trace_json::{json_string, write_ids, write_json_str, write_str_list};
use trajlog::Call;

fn key(out: &mut String, name: &str) {
    out.push(if out.is_empty() { '{' } else { ',' });
    write_json_str(out, name);
    out.push(':');
}

/// Write a document: the column's JSON text, else `extra`'s value, else `default`.
fn doc(out: &mut String, column: Option<&[u8]>, from_extra: Option<&RawValue>, default: &str) {
    match (column, from_extra) {
        (Some(text), _) => out.push_str(&String::from_utf8_lossy(text)),
        (None, Some(v)) => out.push_str(v.get()),
        (None, None) => out.push_str(default),
    }
}

/// A call as rLLM's gateway stores it: the 17 [`TRACE_KEYS`](trajlog::trace_json::TRACE_KEYS) in order
/// (values from the columns, else from `extra`, else the gateway's defaults:
/// `""`, `[]`, `{}`, `0.0` or null), then `session_uids` if the call has any,
/// then the other keys of `extra`; compact, logprobs (`f32`) widened to `f64`
/// and every float written as Python's `json.dumps` writes it.
///
/// For a call the simulator made in a gateway shape this is, byte for byte,
/// the line it was parsed from. (`trajlog::trace_json::export_call` writes
/// the same keys and values in trajlog's own order, with logprobs as the
/// shortest `f32` decimals.)
pub fn gateway_json(call: &Call) -> String {
    let mut extra: BTreeMap<String, &RawValue> =
        call.extra.as_deref().and_then(|e| serde_json::from_slice(e).ok()).unwrap_or_default();
    let mut take = |name: &str| extra.remove(name);
    let is_null = |v: &Option<&RawValue>| v.is_some_and(|v| v.get() == "null");
    let payload = call.prompt_token_ids.len() + call.completion_token_ids.len();
    let mut out = String::with_capacity(1024 + 8 * payload + 24 * call.completion_token_ids.len());

    key(&mut out, "trace_id");
    write_json_str(&mut out, &call.trace_id);
    key(&mut out, "session_id");
    write_json_str(&mut out, &call.session_id);
    let from_extra = take("model");
    key(&mut out, "model");
    match &call.model {
        Some(m) => write_json_str(&mut out, m),
        None => doc(&mut out, None, from_extra, "\"\""),
    }
    let from_extra = take("messages");
    key(&mut out, "messages");
    doc(&mut out, call.messages.as_deref(), from_extra, "[]");
    let from_extra = take("prompt_token_ids");
    key(&mut out, "prompt_token_ids");
    if call.prompt_token_ids.is_empty() && is_null(&from_extra) {
        out.push_str("null");
    } else {
        write_ids(&mut out, &call.prompt_token_ids);
    }
    let from_extra = take("response_message");
    key(&mut out, "response_message");
    doc(&mut out, call.response_message.as_deref(), from_extra, "{}");
    let from_extra = take("completion_token_ids");
    key(&mut out, "completion_token_ids");
    if call.completion_token_ids.is_empty() && is_null(&from_extra) {
        out.push_str("null");
    } else {
        write_ids(&mut out, &call.completion_token_ids);
    }
    let from_extra = take("logprobs");
    key(&mut out, "logprobs");
    match &call.logprobs {
        Some(lp) => {
            out.push('[');
            for (i, &v) in lp.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_py_float(&mut out, f64::from(v));
            }
            out.push(']');
        }
        None => doc(&mut out, None, from_extra, "null"),
    }
    let from_extra = take("routing_matrices");
    key(&mut out, "routing_matrices");
    match &call.routing_matrices {
        // As `export_call` writes it: its JSON text, else its bytes as a list.
        Some(r) => match std::str::from_utf8(r).ok().filter(|s| serde_json::from_str::<&RawValue>(s).is_ok()) {
            Some(json) => out.push_str(json),
            None => write_ids(&mut out, &r.iter().map(|&b| u32::from(b)).collect::<Vec<_>>()),
        },
        None => doc(&mut out, None, from_extra, "null"),
    }
    let from_extra = take("finish_reason");
    key(&mut out, "finish_reason");
    match &call.finish_reason {
        Some(f) => write_json_str(&mut out, f),
        None => doc(&mut out, None, from_extra, "null"),
    }
    let from_extra = take("weight_version");
    key(&mut out, "weight_version");
    match call.weight_version {
        Some(w) => {
            let _ = write!(out, "{w}");
        }
        None => doc(&mut out, None, from_extra, "null"),
    }
    let from_extra = take("latency_ms");
    key(&mut out, "latency_ms");
    match call.latency_ms {
        Some(l) => write_py_float(&mut out, l),
        None => doc(&mut out, None, from_extra, "0.0"),
    }
    let from_extra = take("token_counts");
    key(&mut out, "token_counts");
    doc(&mut out, None, from_extra, "{}");
    let from_extra = take("timestamp");
    key(&mut out, "timestamp");
    if is_null(&from_extra) {
        out.push_str("null");
    } else {
        write_py_float(&mut out, call.timestamp);
    }
    let from_extra = take("metadata");
    key(&mut out, "metadata");
    doc(&mut out, call.metadata.as_deref(), from_extra, "{}");
    for name in ["raw_request", "raw_response"] {
        let from_extra = take(name);
        key(&mut out, name);
        doc(&mut out, None, from_extra, "null");
    }
    // Not gateway keys: what a call may carry besides.
    for name in ["trace_id", "session_id", "session_uids"] {
        take(name);
    }
    if !call.session_uids.is_empty() {
        key(&mut out, "session_uids");
        write_str_list(&mut out, &call.session_uids);
    }
    for (k, v) in &extra {
        key(&mut out, k);
        out.push_str(v.get());
    }
    out.push('}');
    out
}

/// Word pieces of the synthetic vocabulary (token text = a piece, most with a
/// leading space; some ids are a newline). About 4 bytes per token, as real
/// tokenizers average on English and code.
const PIECES: &[&str] = &[
    "the", "of", "to", "and", "a", "in", "is", "it", "that", "for", "file", "test", "def", "return", "self", "import",
    "from", "error", "value", "line", "we", "need", "check", "function", "print", "if", "else", "None", "True", "path",
    "(", ")", ":", ",", ".", "=", "_", "\"", "'", "[", "]", "{", "}", "->", "==", "#", "config", "data", "run",
    "output", "result", "fix", "bug", "call", "args", "list", "str", "int", "case", "module", "class", "let", "name",
    "step",
];

/// Append the text of token `id` (Qwen's special tokens by name).
fn push_token(out: &mut String, id: u32) {
    let special = match id {
        151643 => "<|endoftext|>",
        151644 => "<|im_start|>",
        151645 => "<|im_end|>",
        151657 => "<tool_call>",
        151658 => "</tool_call>",
        _ => "",
    };
    if !special.is_empty() {
        out.push_str(special);
    } else if id.is_multiple_of(29) {
        out.push('\n');
    } else {
        if !(id / 64).is_multiple_of(4) {
            out.push(' ');
        }
        out.push_str(PIECES[id as usize % PIECES.len()]);
    }
}

/// The text of `ids`.
fn decode(ids: &[u32]) -> String {
    let mut out = String::with_capacity(5 * ids.len());
    for &id in ids {
        push_token(&mut out, id);
    }
    out
}

/// A tool of the simulated agent: one string parameter.
struct Tool {
    name: &'static str,
    param: &'static str,
    description: &'static str,
    param_description: &'static str,
}

const TOOLS: &[Tool] = &[
    Tool {
        name: "bash",
        param: "command",
        description: "Run a bash command in the task's sandbox and return its exit code, stdout and stderr. Long outputs are cut to their last 200 lines.",
        param_description: "The command line to run, e.g. `pytest -x tests/test_io.py`.",
    },
    Tool {
        name: "read_file",
        param: "path",
        description: "Read a file of the repository and return its content with line numbers.",
        param_description: "Path of the file, relative to the repository root.",
    },
    Tool {
        name: "search",
        param: "pattern",
        description: "Search the repository for a regular expression and return each matching line with its file and line number.",
        param_description: "A Python regular expression.",
    },
    Tool {
        name: "submit",
        param: "answer",
        description: "Submit the final answer and end the episode.",
        param_description: "A summary of the change made.",
    },
];

/// The request's `tools` value, as the agent sends it (compact).
fn tools_json() -> String {
    let mut out = String::from("[");
    for (i, t) in TOOLS.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            r#"{{"type":"function","function":{{"name":{},"description":{},"parameters":{{"type":"object","properties":{{{}:{{"type":"string","description":{}}}}},"required":[{}]}}}}}}"#,
            json_string(t.name),
            json_string(t.description),
            json_string(t.param),
            json_string(t.param_description),
            json_string(t.param)
        );
    }
    out.push(']');
    out
}

/// 32 lowercase hex digits (vLLM's request and tool-call ids).
fn hex32(rng: &mut Rng) -> String {
    format!("{:016x}{:016x}", rng.next_u64(), rng.next_u64())
}

/// A version-4 UUID string (the gateway's `trace_id`).
fn uuid4(rng: &mut Rng) -> String {
    let a = (rng.next_u64() & !0xf000) | 0x4000;
    let b = (rng.next_u64() & !(0xc << 60)) | (0x8 << 60);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// The token columns and timing of one call, from the session's token stream.
pub(crate) struct Turn<'a> {
    pub session_id: &'a str,
    pub model: &'a str,
    pub weight_version: i64,
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
    pub logprobs: &'a [f32],
    pub timestamp: f64,
    /// Whole milliseconds from the token stream; the documents' stream adds the fraction.
    pub latency_ms: f64,
    /// The session's last call: a final answer, no tool call.
    pub last: bool,
}

/// One session's chat history and the documents of its calls.
pub(crate) struct Conversation {
    streaming: bool,
    rng: Rng,
    /// Each message's JSON text, in order.
    messages: Vec<String>,
    tools: String,
    max_tokens: usize,
    /// The id of the tool call whose result the next tool message carries.
    pending_tool_call: Option<String>,
}

impl Conversation {
    /// A session whose first prompt is `first_prompt` (the task's system
    /// prompt and question: its first three quarters are the system message,
    /// the rest the user message).
    pub fn new(streaming: bool, seed: u64, max_completion_tokens: usize, first_prompt: &[u32]) -> Self {
        let split = first_prompt.len() * 3 / 4;
        let (system, user) = first_prompt.split_at(split);
        let messages = vec![
            format!(r#"{{"role":"system","content":{}}}"#, json_string(&decode(system))),
            format!(r#"{{"role":"user","content":{}}}"#, json_string(&decode(user))),
        ];
        Self {
            streaming,
            rng: Rng::new(seed),
            messages,
            tools: tools_json(),
            max_tokens: max_completion_tokens.max(1).next_power_of_two().max(2048),
            pending_tool_call: None,
        }
    }

    /// The call of `turn`, as the gateway records it and `trajlog ingest` maps it.
    pub fn call(&mut self, turn: &Turn<'_>) -> Call {
        let trace_id = uuid4(&mut self.rng);
        let latency_ms = turn.latency_ms + (self.rng.next_u64() % 1_000_000) as f64 / 1e6;
        // Every call but the last ends in a tool call: the completion's last
        // quarter (at most 48 tokens) is its argument, the rest the text before it.
        let tool = (!turn.last).then(|| &TOOLS[self.rng.range(0, TOOLS.len() - 2)]);
        let n = turn.completion.len();
        let arg_len = if tool.is_some() { (n / 4).min(48) } else { 0 };
        let (text_ids, arg_ids) = turn.completion.split_at(n - arg_len);
        let text = decode(text_ids);
        let tool_call = tool.map(|t| (format!("chatcmpl-tool-{}", hex32(&mut self.rng)), t));
        let finish_reason = if tool.is_some() { "tool_calls" } else { "stop" };
        let content = if text.is_empty() && tool.is_some() { "null".to_owned() } else { json_string(&text) };
        // The argument as vLLM's hermes parser writes it: Python's `json.dumps`.
        let arguments = |t: &Tool| format!("{{{}: {}}}", json_string(t.param), json_string(&decode(arg_ids)));
        let full_tool_calls = |(id, t): &(String, &Tool)| {
            format!(
                r#"[{{"id":{},"type":"function","function":{{"name":{},"arguments":{}}}}}]"#,
                json_string(id),
                json_string(t.name),
                json_string(&arguments(t))
            )
        };

        let (response_message, history_message) = if self.streaming {
            // Assembled from the deltas (docs/serve-contract.md §2.4): role,
            // content only if non-empty, the tool-call fragments unmerged.
            let mut rm = String::from(r#"{"role":"assistant""#);
            if !text.is_empty() {
                let _ = write!(rm, r#","content":{}"#, json_string(&text));
            }
            if let Some((id, t)) = &tool_call {
                let _ = write!(
                    rm,
                    r#","tool_calls":[{{"id":{},"type":"function","index":0,"function":{{"name":{}}}}}"#,
                    json_string(id),
                    json_string(t.name)
                );
                // One fragment opens the argument, then one per generated
                // token, the last one closing it.
                let mut fragments = vec![format!("{{{}: \"", json_string(t.param))];
                for &id in arg_ids {
                    let mut piece = String::new();
                    push_token(&mut piece, id);
                    let lit = json_string(&piece);
                    fragments.push(lit[1..lit.len() - 1].to_owned());
                }
                if let Some(last) = fragments.last_mut() {
                    last.push_str("\"}");
                }
                for f in fragments {
                    let _ = write!(rm, r#",{{"index":0,"function":{{"arguments":{}}}}}"#, json_string(&f));
                }
                rm.push(']');
            }
            rm.push('}');
            // The agent merges the deltas into one message for its history.
            let mut hm = format!(r#"{{"role":"assistant","content":{content}"#);
            if let Some(tc) = &tool_call {
                let _ = write!(hm, r#","tool_calls":{}"#, full_tool_calls(tc));
            }
            hm.push('}');
            (rm, hm)
        } else {
            // vLLM 0.11's ChatMessage, with its null extras.
            let tool_calls = tool_call.as_ref().map_or_else(|| "[]".to_owned(), full_tool_calls);
            let rm = format!(
                r#"{{"role":"assistant","content":{content},"refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":{tool_calls},"reasoning_content":null}}"#
            );
            (rm.clone(), rm)
        };

        let mut messages = String::from("[");
        for (i, m) in self.messages.iter().enumerate() {
            if i > 0 {
                messages.push(',');
            }
            messages.push_str(m);
        }
        messages.push(']');
        // The client's keys (OpenAI SDK order), then what the gateway injects:
        // logprobs, return_token_ids, then the session's sampling params
        // (temperature overwritten in place).
        let raw_request = format!(
            r#"{{"messages":{messages},"model":{model},{stream}"temperature":1.0,"tools":{tools},"logprobs":true,"return_token_ids":true,"top_p":1.0,"max_tokens":{max}}}"#,
            model = json_string(turn.model),
            stream = if self.streaming { r#""stream":true,"# } else { "" },
            tools = self.tools,
            max = self.max_tokens,
        );
        let (p, c) = (turn.prompt.len(), n);
        let (raw_response, token_counts) = if self.streaming {
            // No usage chunk unless the client asks for one.
            ("null".to_owned(), "{}".to_owned())
        } else {
            (
                self.raw_response(turn, latency_ms, &response_message, finish_reason),
                format!(r#"{{"prompt":{p},"completion":{c}}}"#),
            )
        };
        // `extra` as `parse_trace` leaves it: the keys without a column, sorted.
        let extra = format!(
            r#"{{"raw_request":{raw_request},"raw_response":{raw_response},"routing_matrices":null,"token_counts":{token_counts}}}"#
        );
        let draft = Call {
            trace_id,
            session_id: turn.session_id.to_owned(),
            timestamp: turn.timestamp,
            model: Some(turn.model.to_owned()),
            weight_version: Some(turn.weight_version),
            prompt_token_ids: turn.prompt.to_vec(),
            completion_token_ids: turn.completion.to_vec(),
            // The gateway stores an empty logprob list as null.
            logprobs: (!turn.logprobs.is_empty()).then(|| turn.logprobs.to_vec()),
            finish_reason: Some(finish_reason.to_owned()),
            latency_ms: Some(latency_ms),
            messages: Some(messages.into_bytes()),
            response_message: Some(response_message.into_bytes()),
            metadata: Some(b"{}".to_vec()),
            extra: Some(extra.into_bytes()),
            ..Default::default()
        };
        // Map the gateway's line the way `trajlog ingest` does.
        let line = gateway_json(&draft);
        let call = match trajlog::trace_json::parse_trace(&line, turn.timestamp) {
            Ok(call) => call,
            Err(e) => unreachable!("the simulator wrote a trace trajlog refuses: {e}"),
        };
        self.messages.push(history_message);
        self.pending_tool_call = tool_call.map(|(id, _)| id);
        call
    }

    /// vLLM's whole chat-completion response (docs/serve-contract.md §3.2).
    fn raw_response(&mut self, turn: &Turn<'_>, latency_ms: f64, message: &str, finish_reason: &str) -> String {
        let (p, c) = (turn.prompt.len(), turn.completion.len());
        let mut out = String::with_capacity(256 + message.len() + 80 * c + 8 * (p + c));
        let created = (turn.timestamp - latency_ms / 1000.0).floor() as i64;
        let _ = write!(
            out,
            r#"{{"id":"chatcmpl-{}","object":"chat.completion","created":{created},"model":{},"choices":[{{"index":0,"message":{message},"logprobs":{{"content":["#,
            hex32(&mut self.rng),
            json_string(turn.model)
        );
        let mut token = String::new();
        for (i, (&id, &lp)) in turn.completion.iter().zip(turn.logprobs).enumerate() {
            if i > 0 {
                out.push(',');
            }
            token.clear();
            push_token(&mut token, id);
            out.push_str(r#"{"token":"#);
            write_json_str(&mut out, &token);
            out.push_str(r#","logprob":"#);
            write_py_float(&mut out, f64::from(lp));
            out.push_str(r#","bytes":"#);
            write_ids(&mut out, &token.bytes().map(u32::from).collect::<Vec<_>>());
            out.push_str(r#","top_logprobs":[]}"#);
        }
        let _ = write!(out, r#"]}},"finish_reason":{},"stop_reason":null,"token_ids":"#, json_string(finish_reason));
        write_ids(&mut out, turn.completion);
        let _ = write!(
            out,
            r#"}}],"service_tier":null,"system_fingerprint":null,"usage":{{"prompt_tokens":{p},"total_tokens":{},"completion_tokens":{c},"prompt_tokens_details":null}},"prompt_logprobs":null,"prompt_token_ids":"#,
            p + c
        );
        write_ids(&mut out, turn.prompt);
        out.push_str(r#","kv_transfer_params":null}"#);
        out
    }

    /// The tool's result (`tool_ids` decoded) joins the history: a `tool`
    /// message answering the pending tool call (a `user` message if none).
    pub fn tool_result(&mut self, tool_ids: &[u32]) {
        let content = json_string(&decode(tool_ids));
        let message = match self.pending_tool_call.take() {
            Some(id) => format!(r#"{{"role":"tool","tool_call_id":{},"content":{content}}}"#, json_string(&id)),
            None => format!(r#"{{"role":"user","content":{content}}}"#),
        };
        self.messages.push(message);
    }
}
