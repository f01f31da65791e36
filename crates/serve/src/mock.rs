//! A deterministic mock of a vLLM OpenAI server, for tests and benchmarks
//! (`trajlog mock-vllm`).
//!
//! It answers `POST /v1/chat/completions` and `POST /v1/completions`
//! (streaming and not) the way vLLM 0.11 does with `return_token_ids` and
//! `logprobs`: root `prompt_token_ids` (chat) or `choices[0].prompt_token_ids`
//! (completions), `choices[0].token_ids`, `choices[0].logprobs.content[]`
//! (`{token, logprob, bytes, top_logprobs}`) or `token_logprobs`, `usage`;
//! plus `GET /v1/models` and `GET /health`. Everything is a pure function of
//! the request ([`plan`]), so a test can compute exactly what the mock sent.
//! No generation delay.
//!
//! Logprobs are `f32` values printed as Python prints the widened `f64`
//! (vLLM's output), unless the mode is `nonf32` (doubles that are not `f32`).
//!
//! Modes, from the `x-mock-mode` header or else a model name `mock-<mode>`:
//! - `error-500`: `500 {"error": "simulated backend failure"}`;
//! - `hang`: never answers;
//! - `gated`: a stream waits for [`Mock::release`] before each chunk after the first;
//! - `cut`: a stream breaks the connection after two chunks;
//! - `nonf32`: logprobs that are not `f32` values.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::{oneshot, Semaphore};

/// Request bodies [`Mock::requests`] keeps (the most recent).
pub const REQUEST_LOG_MAX: usize = 256;
/// Completion tokens when the request gives no `max_tokens`.
pub const DEFAULT_COMPLETION_TOKENS: usize = 8;
/// Most completion tokens the mock generates.
pub const COMPLETION_TOKENS_MAX: usize = 65_536;

/// What the mock answers to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub prompt_token_ids: Vec<u32>,
    pub completion_token_ids: Vec<u32>,
    /// Each logprob as the JSON number text the mock writes.
    pub logprobs: Vec<String>,
    /// Each token's text.
    pub pieces: Vec<String>,
}

fn fnv(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Token id of one word: `t<id>` (how the mock writes a completion token's
/// text) is that id again, so a history that carries earlier answers has
/// their exact ids in its prompt; any other word hashes to an id.
fn word_id(word: &str) -> u32 {
    match word.strip_prefix('t').and_then(|d| d.parse::<u32>().ok()) {
        Some(id) if id < VOCAB => id,
        _ => (mix(fnv(word)) % u64::from(VOCAB)) as u32,
    }
}

const VOCAB: u32 = 151_000;

fn push_words(out: &mut Vec<u32>, text: &str) {
    out.extend(text.split_whitespace().map(word_id));
}

/// A stand-in tokenizer: a chat prompt is, message by message, a role token
/// and the words of its content and tool calls, so a growing history gives a
/// growing prompt whose earlier part is the previous prompt plus the previous
/// answer (as a real chat template does). A text prompt is its words.
fn tokenize(input: &Value) -> Vec<u32> {
    let mut out = Vec::new();
    match input {
        Value::Array(messages) => {
            for m in messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                out.push(word_id(&format!("<|{role}|>")));
                match m.get("content") {
                    Some(Value::String(text)) => push_words(&mut out, text),
                    Some(Value::Array(parts)) => {
                        for text in parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)) {
                            push_words(&mut out, text);
                        }
                    }
                    _ => {}
                }
                for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let f = call.get("function");
                    for key in ["name", "arguments"] {
                        if let Some(text) = f.and_then(|f| f.get(key)).and_then(Value::as_str) {
                            push_words(&mut out, text);
                        }
                    }
                }
            }
        }
        Value::String(text) => push_words(&mut out, text),
        _ => {}
    }
    if out.is_empty() {
        out.push(word_id("<|empty|>"));
    }
    out
}

/// The mock's answer to a request body, a pure function of its `messages`
/// (or `prompt`), `max_tokens` and the mode.
pub fn plan(body: &Value, mode: &str) -> Plan {
    let input = body.get("messages").or_else(|| body.get("prompt")).cloned().unwrap_or(Value::Null);
    let h = fnv(&input.to_string());
    let n = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .map(|n| (n as usize).clamp(1, COMPLETION_TOKENS_MAX))
        .unwrap_or(DEFAULT_COMPLETION_TOKENS);
    // A completions prompt given as token ids is used as sent (token-in).
    let prompt_token_ids: Vec<u32> = match body.get("prompt").and_then(Value::as_array) {
        Some(ids) if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
            ids.iter().filter_map(Value::as_u64).map(|v| v as u32).collect()
        }
        _ => tokenize(&input),
    };
    let completion_token_ids: Vec<u32> =
        (0..n).map(|i| (mix(h.rotate_left(17) ^ (i as u64 + 7)) % u64::from(VOCAB)) as u32).collect();
    let logprobs = (0..n)
        .map(|i| {
            let r = mix(h ^ 0xabcdef ^ (i as u64));
            if mode == "nonf32" {
                // Decimal doubles that are not f32 values (like rLLM's mock's -0.3).
                trajlog::trace_json::py_float(-((r % 1000) as f64 + 1.0) / 10.0)
            } else {
                // As vLLM's server writes it: Python's `repr` of the f32
                // widened to f64 (Rust's `{:?}` breaks some ties the other way).
                let v = -((r % 1_000_000) as f32) / 65_537.0_f32;
                trajlog::trace_json::py_float(f64::from(v))
            }
        })
        .collect();
    let pieces = completion_token_ids.iter().map(|id| format!("t{id} ")).collect();
    Plan { prompt_token_ids, completion_token_ids, logprobs, pieces }
}

fn ids_json(ids: &[u32]) -> String {
    serde_json::to_string(ids).unwrap_or_else(|_| "[]".into())
}

fn s(text: &str) -> String {
    crate::json::string(text)
}

fn entry(piece: &str, lp: &str) -> String {
    format!(
        "{{\"token\":{},\"logprob\":{lp},\"bytes\":{},\"top_logprobs\":[]}}",
        s(piece),
        ids_json(&piece.bytes().map(u32::from).collect::<Vec<_>>())
    )
}

fn usage(p: &Plan) -> String {
    let (pt, ct) = (p.prompt_token_ids.len(), p.completion_token_ids.len());
    format!(
        "{{\"prompt_tokens\":{pt},\"total_tokens\":{},\"completion_tokens\":{ct},\"prompt_tokens_details\":null}}",
        pt + ct
    )
}

struct Req {
    chat: bool,
    model: String,
    want_logprobs: bool,
    want_ids: bool,
    include_usage: bool,
}

fn chat_response(r: &Req, p: &Plan) -> String {
    let lp = if r.want_logprobs {
        let entries: Vec<String> = p.pieces.iter().zip(&p.logprobs).map(|(t, l)| entry(t, l)).collect();
        format!("{{\"content\":[{}]}}", entries.join(","))
    } else {
        "null".into()
    };
    let ids = if r.want_ids { format!(",\"token_ids\":{}", ids_json(&p.completion_token_ids)) } else { String::new() };
    let pids = if r.want_ids { ids_json(&p.prompt_token_ids) } else { "null".into() };
    format!(
        "{{\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion\",\"created\":1755251234,\"model\":{},\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":{},\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"tool_calls\":[],\"reasoning_content\":null}},\"logprobs\":{lp},\"finish_reason\":\"length\",\"stop_reason\":null{ids}}}],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":{},\"prompt_logprobs\":null,\"prompt_token_ids\":{pids},\"kv_transfer_params\":null}}",
        s(&r.model),
        s(&p.pieces.concat()),
        usage(p)
    )
}

fn completion_logprobs(pieces: &[String], lps: &[String]) -> String {
    format!(
        "{{\"text_offset\":[],\"token_logprobs\":[{}],\"tokens\":[{}],\"top_logprobs\":[]}}",
        lps.join(","),
        pieces.iter().map(|t| s(t)).collect::<Vec<_>>().join(",")
    )
}

fn completion_response(r: &Req, p: &Plan) -> String {
    let lp = if r.want_logprobs { completion_logprobs(&p.pieces, &p.logprobs) } else { "null".into() };
    let ids = if r.want_ids {
        format!(
            ",\"prompt_token_ids\":{},\"token_ids\":{}",
            ids_json(&p.prompt_token_ids),
            ids_json(&p.completion_token_ids)
        )
    } else {
        String::new()
    };
    format!(
        "{{\"id\":\"cmpl-mock\",\"object\":\"text_completion\",\"created\":1755251234,\"model\":{},\"choices\":[{{\"index\":0,\"text\":{},\"logprobs\":{lp},\"finish_reason\":\"length\",\"stop_reason\":null,\"prompt_logprobs\":null{ids}}}],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":{},\"kv_transfer_params\":null}}",
        s(&r.model),
        s(&p.pieces.concat()),
        usage(p)
    )
}

/// The `data:` payloads of a streamed answer (without `[DONE]`).
fn stream_chunks(r: &Req, p: &Plan) -> Vec<String> {
    let head = |obj: &str| {
        format!("{{\"id\":\"mock-stream\",\"object\":\"{obj}\",\"created\":1755251234,\"model\":{}", s(&r.model))
    };
    let mut out = Vec::new();
    let n = p.completion_token_ids.len();
    if r.chat {
        let pids =
            if r.want_ids { format!(",\"prompt_token_ids\":{}", ids_json(&p.prompt_token_ids)) } else { String::new() };
        out.push(format!(
            "{},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]{pids}}}",
            head("chat.completion.chunk")
        ));
        for i in 0..n {
            let lp = if r.want_logprobs {
                format!("{{\"content\":[{}]}}", entry(&p.pieces[i], &p.logprobs[i]))
            } else {
                "null".into()
            };
            let fin = if i + 1 == n { "\"length\",\"stop_reason\":null" } else { "null" };
            let ids =
                if r.want_ids { format!(",\"token_ids\":[{}]", p.completion_token_ids[i]) } else { String::new() };
            out.push(format!(
                "{},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":{lp},\"finish_reason\":{fin}{ids}}}]}}",
                head("chat.completion.chunk"),
                s(&p.pieces[i])
            ));
        }
    } else {
        for i in 0..n {
            let lp =
                if r.want_logprobs { completion_logprobs(&p.pieces[i..=i], &p.logprobs[i..=i]) } else { "null".into() };
            let fin = if i + 1 == n { "\"length\",\"stop_reason\":null" } else { "null" };
            let mut ids = String::new();
            if r.want_ids {
                if i == 0 {
                    ids.push_str(&format!(",\"prompt_token_ids\":{}", ids_json(&p.prompt_token_ids)));
                }
                ids.push_str(&format!(",\"token_ids\":[{}]", p.completion_token_ids[i]));
            }
            out.push(format!(
                "{},\"choices\":[{{\"index\":0,\"text\":{},\"logprobs\":{lp},\"finish_reason\":{fin}{ids}}}]}}",
                head("text_completion"),
                s(&p.pieces[i])
            ));
        }
    }
    if r.include_usage {
        out.push(format!(
            "{},\"choices\":[],\"usage\":{}}}",
            head(if r.chat { "chat.completion.chunk" } else { "text_completion" }),
            usage(p)
        ));
    }
    out
}

struct MockState {
    gate: Arc<Semaphore>,
    requests: Mutex<Vec<String>>,
}

/// A running mock server.
pub struct Mock {
    pub addr: SocketAddr,
    state: Arc<MockState>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Mock {
    /// Let `n` more chunks of `gated` streams go.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }

    /// The most recent request bodies received ([`REQUEST_LOG_MAX`]), as sent by the gateway.
    pub fn requests(&self) -> Vec<String> {
        self.state.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Start the mock on `host:port` (0 = a free port).
pub async fn start_mock(host: &str, port: u16) -> std::io::Result<Mock> {
    let listener = tokio::net::TcpListener::bind((host, port)).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(MockState { gate: Arc::new(Semaphore::new(0)), requests: Mutex::new(Vec::new()) });
    let app = axum::Router::new().fallback(handle).with_state(state.clone());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    Ok(Mock { addr, state, shutdown: Some(tx) })
}

fn reply(status: StatusCode, ct: &'static str, body: impl Into<Body>) -> Response {
    let mut r = Response::new(body.into());
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    r
}

async fn handle(State(st): State<Arc<MockState>>, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    let header_mode = req.headers().get("x-mock-mode").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = axum::body::to_bytes(req.into_body(), 256 << 20).await.unwrap_or_default();
    match path.as_str() {
        "/health" => return reply(StatusCode::OK, "application/json", "{}"),
        "/v1/models" => {
            return reply(
                StatusCode::OK,
                "application/json",
                "{\"object\":\"list\",\"data\":[{\"id\":\"mock-model\",\"object\":\"model\",\"created\":1755251234,\"owned_by\":\"vllm\",\"max_model_len\":32768}]}",
            )
        }
        "/v1/chat/completions" | "/v1/completions" => {}
        _ => return reply(StatusCode::NOT_FOUND, "application/json", "{\"detail\":\"Not Found\"}"),
    }
    if let Ok(mut r) = st.requests.lock() {
        // The most recent requests only: a benchmark sends many large ones.
        if r.len() >= REQUEST_LOG_MAX {
            r.remove(0);
        }
        r.push(String::from_utf8_lossy(&body).into_owned());
    }
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return reply(StatusCode::BAD_REQUEST, "application/json", "{\"error\":\"invalid JSON body\"}");
    };
    let model = v.get("model").and_then(Value::as_str).unwrap_or("mock-model").to_owned();
    let mode = header_mode.unwrap_or_else(|| model.strip_prefix("mock-").unwrap_or("").to_owned());
    match mode.as_str() {
        "error-500" => {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "application/json",
                "{\"error\": \"simulated backend failure\"}",
            )
        }
        "hang" => std::future::pending::<()>().await,
        _ => {}
    }
    let truthy = |k: &str| match v.get(k) {
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        _ => false,
    };
    let r = Req {
        chat: path == "/v1/chat/completions",
        model,
        want_logprobs: truthy("logprobs"),
        want_ids: truthy("return_token_ids"),
        include_usage: v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false),
    };
    let p = plan(&v, &mode);
    if !truthy("stream") {
        let text = if r.chat { chat_response(&r, &p) } else { completion_response(&r, &p) };
        return reply(StatusCode::OK, "application/json", text);
    }
    let chunks = stream_chunks(&r, &p);
    let gate = st.gate.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        for (i, c) in chunks.iter().enumerate() {
            if i > 0 && mode == "gated" {
                match gate.acquire().await {
                    Ok(p) => p.forget(),
                    Err(_) => return,
                }
            }
            if i == 2 && mode == "cut" {
                let _ = tx.send(Err(std::io::Error::other("mock: connection cut"))).await;
                return;
            }
            if tx.send(Ok(Bytes::from(format!("data: {c}\n\n")))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|i| (i, rx)) });
    reply(StatusCode::OK, "text/event-stream", Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logprobs are written as vLLM's server writes them (Python's `repr`
    /// of the widened `f32`), ties included: Rust's `{:?}` breaks some ties
    /// the other way (`-12.969863891601563` for Python's
    /// `-12.969863891601562`), which no vLLM response holds.
    #[test]
    fn logprobs_are_written_as_python_writes_them() {
        let mut ties = 0;
        for seed in 0..8 {
            let body = serde_json::json!({"messages": [{"role": "user", "content": format!("seed {seed}")}], "max_tokens": 4000});
            let p = plan(&body, "");
            assert_eq!(p.logprobs.len(), 4000);
            for text in &p.logprobs {
                let v: f32 = text.parse().expect("a float");
                assert_eq!(*text, trajlog::trace_json::py_float(f64::from(v)));
                ties += usize::from(*text != format!("{:?}", f64::from(v)));
            }
        }
        // The case this guards is there to be guarded.
        assert!(ties > 0, "no logprob whose Rust and Python spellings differ");
    }
}
