//! The gateway end to end on loopback: the mock vLLM, the gateway and a
//! store in a temporary directory, driven over HTTP. No test waits on time:
//! streams are held by the mock's gate, and the one poll (the client-gone
//! counter) has a generous hang guard only.

use serde_json::Value;
use std::time::Duration;
use trajlog::trace_json::TRACE_KEYS;
use trajlog_serve::json::Obj;
use trajlog_serve::mock::{self, Mock};
use trajlog_serve::{Config, DurabilityMode, Server};

struct Env {
    dir: tempfile::TempDir,
    mock: Mock,
    server: Option<Server>,
    base: String,
    http: reqwest::Client,
}

async fn env_with(f: impl FnOnce(&mut Config)) -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    let mock = mock::start_mock("127.0.0.1", 0).await.expect("mock");
    let mut cfg = Config { store: dir.path().join("store"), port: 0, ..Config::default() };
    cfg.workers.push(trajlog_serve::WorkerConfig {
        url: mock.url(),
        worker_id: None,
        api_path: None,
        model_name: None,
        weight: None,
    });
    f(&mut cfg);
    let server = trajlog_serve::start(cfg).await.expect("gateway starts");
    let base = format!("http://{}", server.addr);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client");
    Env { dir, mock, server: Some(server), base, http }
}

async fn env() -> Env {
    env_with(|_| {}).await
}

impl Env {
    async fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("post");
        let status = r.status().as_u16();
        (status, r.text().await.expect("body"))
    }
    async fn get(&self, path: &str) -> (u16, String) {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.expect("get");
        let status = r.status().as_u16();
        (status, r.text().await.expect("body"))
    }
    async fn get_json(&self, path: &str) -> Value {
        let (s, t) = self.get(path).await;
        assert_eq!(s, 200, "GET {path}: {t}");
        serde_json::from_str(&t).expect("json")
    }
    async fn flush(&self) {
        let (s, t) = self.post("/admin/flush", &Value::Null).await;
        assert_eq!((s, t.as_str()), (200, "{\"status\":\"flushed\"}"));
    }
    async fn traces_text(&self, sid: &str) -> String {
        let (s, t) = self.get(&format!("/sessions/{sid}/traces")).await;
        assert_eq!(s, 200, "{t}");
        t
    }
    async fn shutdown(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().await.expect("clean shutdown");
        }
    }
}

fn chat(content: &str, max_tokens: u64) -> Value {
    serde_json::json!({"model": "mock-model", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
}

/// The trace's ids and logprobs are exactly the plan's (logprobs compared as f64 bits).
fn assert_exact(trace: &Value, plan: &mock::Plan) {
    let ids = |k: &str| -> Vec<u32> {
        trace[k].as_array().expect(k).iter().map(|v| v.as_u64().expect("id") as u32).collect()
    };
    assert_eq!(ids("prompt_token_ids"), plan.prompt_token_ids);
    assert_eq!(ids("completion_token_ids"), plan.completion_token_ids);
    let got: Vec<u64> =
        trace["logprobs"].as_array().expect("logprobs").iter().map(|v| v.as_f64().expect("f64").to_bits()).collect();
    let want: Vec<u64> = plan.logprobs.iter().map(|t| t.parse::<f64>().expect("plan logprob").to_bits()).collect();
    assert_eq!(got, want, "logprob bits");
}

fn keys_in_order(text: &str) -> Vec<String> {
    Obj::parse(text).expect("object").0.into_iter().map(|(k, _)| k).collect()
}

fn split_list(text: &str) -> Vec<String> {
    let items: Vec<Box<serde_json::value::RawValue>> = serde_json::from_str(text).expect("list");
    items.into_iter().map(|r| r.get().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_capture_is_exact_and_rllm_shaped() {
    let mut e = env().await;
    let (s, t) = e
        .post(
            "/sessions",
            &serde_json::json!({"session_id": "task-17:3", "sampling_params": {"temperature": 1.0, "max_tokens": 5}}),
        )
        .await;
    assert_eq!((s, t.as_str()), (200, "{\"session_id\":\"task-17:3\",\"url\":\"/sessions/task-17:3/v1\"}"));
    let (s, t) = e.post("/admin/weight_version", &serde_json::json!({"weight_version": "12"})).await;
    assert_eq!((s, t.as_str()), (200, "{\"weight_version\":12}"));
    let req =
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "model": "mock-model", "temperature": 0.7});
    let (s, body) = e.post("/sessions/task-17:3/v1/chat/completions", &req).await;
    assert_eq!(s, 200, "{body}");
    // The agent sees no vLLM-only fields and, not having asked, no logprobs.
    let resp: Value = serde_json::from_str(&body).expect("json");
    for k in ["prompt_token_ids", "prompt_logprobs", "kv_transfer_params"] {
        assert!(resp.get(k).is_none(), "{k} leaked to the agent");
    }
    let choice = &resp["choices"][0];
    for k in ["token_ids", "stop_reason", "logprobs"] {
        assert!(choice.get(k).is_none(), "choice {k} leaked to the agent");
    }
    assert!(choice["message"]["content"].as_str().is_some_and(|c| !c.is_empty()));
    // What the mock received: injected keys after the client's, session params winning.
    let sent = e.mock.requests().pop().expect("mock got the call");
    assert_eq!(
        keys_in_order(&sent),
        ["messages", "model", "temperature", "logprobs", "return_token_ids", "max_tokens"]
    );
    let sent_v: Value = serde_json::from_str(&sent).expect("json");
    assert_eq!(sent_v["temperature"], 1.0);
    assert_eq!(sent_v["max_tokens"], 5);
    let plan = mock::plan(&sent_v, "");
    assert_eq!(plan.completion_token_ids.len(), 5);

    // Sync durability: readable without a flush.
    let text = e.traces_text("task-17:3").await;
    let items = split_list(&text);
    assert_eq!(items.len(), 1);
    assert_eq!(keys_in_order(&items[0]), TRACE_KEYS);
    let trace: Value = serde_json::from_str(&items[0]).expect("json");
    assert_exact(&trace, &plan);
    assert_eq!(trace["session_id"], "task-17:3");
    assert_eq!(trace["model"], "mock-model");
    assert_eq!(trace["messages"], req["messages"]);
    assert_eq!(trace["weight_version"], 12);
    assert_eq!(trace["finish_reason"], "length");
    assert_eq!(trace["metadata"], serde_json::json!({}));
    assert_eq!(trace["routing_matrices"], Value::Null);
    assert_eq!(trace["token_counts"], serde_json::json!({"prompt": plan.prompt_token_ids.len(), "completion": 5}));
    assert_eq!(trace["raw_request"], sent_v);
    assert_eq!(trace["raw_response"]["choices"][0]["token_ids"], serde_json::json!(plan.completion_token_ids));
    assert_eq!(trace["response_message"], trace["raw_response"]["choices"][0]["message"]);
    let id = trace["trace_id"].as_str().expect("trace id").to_owned();
    let (s, one) = e.get(&format!("/traces/{id}")).await;
    assert_eq!((s, one.as_str()), (200, items[0].as_str()));
    let (s, _) = e.get("/traces/nope").await;
    assert_eq!(s, 404);
    let info = e.get_json("/sessions/task-17:3").await;
    assert_eq!(info["trace_count"], 1);
    // A long answer with logprobs, as vLLM sends it.
    let mut long_req = chat("a long answer", 400);
    long_req["logprobs"] = Value::Bool(true);
    let (s, body) = e.post("/sessions/task-17:3/v1/chat/completions", &long_req).await;
    assert_eq!(s, 200, "{body}");

    // In the store: logprobs in the f32 column, bit-equal to what the mock sent.
    e.shutdown().await;
    // vLLM's `logprobs.content` lists are one docs-block reference each
    // (format-spec/record.md §7.2, reference 8).
    let report = trajlog::verify::verify_dir(&e.dir.path().join("store")).expect("verify");
    assert_eq!((report.split.docs_blocks, report.split.content_lists), (2, 2), "{:?}", report.split);
    let store = trajlog::Store::open_read_only(e.dir.path().join("store")).expect("reopen");
    let snap = store.snapshot();
    let call = snap.get(&id).expect("read").expect("present").to_call().expect("call");
    let lp = call.logprobs.expect("logprobs in the column");
    let want: Vec<u32> = plan.logprobs.iter().map(|t| t.parse::<f32>().expect("f32").to_bits()).collect();
    assert_eq!(lp.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    assert_eq!(call.completion_token_ids, plan.completion_token_ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_f32_logprobs_come_back_verbatim() {
    let e = env().await;
    let req = chat("doubles", 6);
    let r = e
        .http
        .post(format!("{}/sessions/d/v1/chat/completions", e.base))
        .header("x-mock-mode", "nonf32")
        .header("content-type", "application/json")
        .body(req.to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    let sent: Value = serde_json::from_str(&e.mock.requests().pop().expect("sent")).expect("json");
    let plan = mock::plan(&sent, "nonf32");
    let traces: Value = serde_json::from_str(&e.traces_text("d").await).expect("json");
    assert_exact(&traces[0], &plan);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_forwarded_chunk_by_chunk_and_captured() {
    let e = env().await;
    let mut req = chat("stream me", 4);
    req["stream"] = Value::Bool(true);
    req["logprobs"] = Value::Bool(true);
    let mut r = e
        .http
        .post(format!("{}/sessions/harbor/hello-world:0/v1/chat/completions", e.base))
        .header("x-mock-mode", "gated")
        .header("content-type", "application/json")
        .body(req.to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().is_ok_and(|c| c.starts_with("text/event-stream")));
    // The mock holds every chunk after the first: this one came through unbuffered.
    let first = r.chunk().await.expect("read").expect("a first chunk");
    let first = String::from_utf8(first.to_vec()).expect("utf8");
    assert!(first.starts_with("data: ") && first.ends_with("\n\n"), "{first:?}");
    assert!(first.contains("\"role\":\"assistant\""));
    assert!(!first.contains("prompt_token_ids"), "vLLM fields stripped from chunks");
    e.mock.release(100);
    let mut rest = String::new();
    while let Some(c) = r.chunk().await.expect("read") {
        rest.push_str(std::str::from_utf8(&c).expect("utf8"));
    }
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
    assert!(!rest.contains("token_ids"));
    assert!(rest.contains("\"logprobs\":{\"content\""), "requested logprobs are kept");
    let sent: Value = serde_json::from_str(&e.mock.requests().pop().expect("sent")).expect("json");
    let plan = mock::plan(&sent, "gated");
    let text = e.traces_text("harbor/hello-world:0").await;
    let items = split_list(&text);
    assert_eq!(items.len(), 1);
    assert_eq!(keys_in_order(&items[0]), TRACE_KEYS);
    let t: Value = serde_json::from_str(&items[0]).expect("json");
    assert_exact(&t, &plan);
    assert_eq!(t["response_message"], serde_json::json!({"role": "assistant", "content": plan.pieces.concat()}));
    assert_eq!(t["raw_response"], Value::Null);
    assert_eq!(t["finish_reason"], "length");
    assert_eq!(t["token_counts"], serde_json::json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_api_streaming_and_not() {
    let mut e = env().await;
    let req = serde_json::json!({"model": "mock-model", "prompt": [1, 2, 3, 4294967295u64], "max_tokens": 3});
    let (s, body) = e.post("/sessions/c/v1/completions", &req).await;
    assert_eq!(s, 200, "{body}");
    let resp: Value = serde_json::from_str(&body).expect("json");
    assert!(resp["choices"][0].get("token_ids").is_none());
    let mut sreq = req.clone();
    sreq["stream"] = Value::Bool(true);
    sreq["stream_options"] = serde_json::json!({"include_usage": true});
    let (s, body) = e.post("/sessions/c/v1/completions", &sreq).await;
    assert_eq!(s, 200);
    assert!(body.ends_with("data: [DONE]\n\n"));
    let sent = e.mock.requests();
    let traces: Value = serde_json::from_str(&e.traces_text("c").await).expect("json");
    assert_eq!(traces.as_array().map(Vec::len), Some(2));
    for (i, t) in traces.as_array().expect("list").iter().enumerate() {
        let sent_v: Value = serde_json::from_str(&sent[i]).expect("json");
        let plan = mock::plan(&sent_v, "");
        assert_eq!(plan.prompt_token_ids, [1, 2, 3, 4294967295]);
        assert_exact(t, &plan);
        assert_eq!(t["messages"], serde_json::json!([]));
        assert_eq!(t["raw_request"]["prompt"], req["prompt"]);
    }
    let t = &traces[0];
    assert_eq!(t["response_message"], serde_json::json!({}));
    assert_eq!(traces[1]["response_message"], serde_json::json!({"role": "assistant"}));
    assert_eq!(traces[1]["token_counts"], serde_json::json!({"prompt": 4, "completion": 3}));
    // The non-streamed answer's `token_logprobs` is one docs-block reference
    // (format-spec/record.md §7.2, reference 9); the streamed one has no
    // raw response.
    e.shutdown().await;
    let report = trajlog::verify::verify_dir(&e.dir.path().join("store")).expect("verify");
    assert_eq!(report.split.content_lists, 1, "{:?}", report.split);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_pass_through_and_record_nothing() {
    let e = env().await;
    let m = e.get_json("/v1/models").await;
    assert_eq!(m["data"][0]["id"], "mock-model");
    let m = e.get_json("/sessions/s/v1/models").await;
    assert_eq!(m["object"], "list");
    assert_eq!(e.traces_text("s").await, "[]");
    assert_eq!(e.get_json("/health").await, serde_json::json!({"status": "ok"}));
    let w = e.get_json("/health/workers").await;
    assert_eq!((w["healthy"].clone(), w["total"].clone()), (1.into(), 1.into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_crud_and_trace_windows() {
    let e = env().await;
    assert_eq!(e.get_json("/sessions").await, serde_json::json!([]));
    let (_, t) = e.post("/sessions", &serde_json::json!({"metadata": {"task": 1}})).await;
    let created: Value = serde_json::from_str(&t).expect("json");
    let sid = created["session_id"].as_str().expect("uuid").to_owned();
    assert_eq!(sid.len(), 36);
    let info = e.get_json(&format!("/sessions/{sid}")).await;
    assert_eq!(info["trace_count"], 0);
    assert_eq!(info["metadata"], serde_json::json!({"task": 1}));
    assert_eq!(e.get("/sessions/unknown").await.0, 404);
    assert_eq!(e.get_json("/sessions").await, serde_json::json!([]), "listed only once it has traces");
    for i in 0..5 {
        let (s, _) = e.post("/sessions/a/b:1/v1/chat/completions", &chat(&format!("turn {i}"), 2)).await;
        assert_eq!(s, 200);
    }
    let (s, _) = e.post("/sessions/other/v1/chat/completions", &chat("x", 2)).await;
    assert_eq!(s, 200);
    let all: Value = e.get_json("/sessions/a/b:1/traces").await;
    let all = all.as_array().expect("list").clone();
    assert_eq!(all.len(), 5);
    let limited = e.get_json("/sessions/a/b:1/traces?limit=2").await;
    assert_eq!(limited.as_array().expect("list")[..], all[..2]);
    let ts = all[2]["timestamp"].as_f64().expect("ts");
    let since = e.get_json(&format!("/sessions/a/b:1/traces?since={ts:?}")).await;
    assert_eq!(since.as_array().expect("list")[..], all[2..], "since is inclusive");
    assert_eq!(e.get("/sessions/a/b:1/traces?since=abc").await.0, 422);
    let listed = e.get_json("/sessions").await;
    let ids: Vec<&str> = listed.as_array().expect("list").iter().filter_map(|s| s["session_id"].as_str()).collect();
    assert_eq!(ids, ["other", "a/b:1"], "newest first");
    let q = e.post("/traces/query", &serde_json::json!({"session_ids": ["other", "a/b:1"], "limit": 1})).await;
    assert_eq!(serde_json::from_str::<Value>(&q.1).expect("json").as_array().map(Vec::len), Some(2));
    let (s, t) = e
        .http
        .delete(format!("{}/sessions/a/b:1", e.base))
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .expect("delete");
    assert_eq!((s, t.text().await.expect("body")), (200, "{\"deleted\":5}".to_owned()));
    assert_eq!(e.get("/sessions/a/b:1").await.0, 404);
    assert_eq!(e.traces_text("a/b:1").await, "[]");
    let (s, t) = e.post("/sessions/batch_delete", &serde_json::json!({"session_ids": ["other", "nope"]})).await;
    assert_eq!((s, t.as_str()), (200, "{\"deleted\":1}"));
}

/// The `trajlog_serve_compactions_total{result="ok"}` count of `/metrics`.
async fn compactions_ok(e: &Env) -> u64 {
    let (_, text) = e.get("/metrics").await;
    let line = text.lines().find(|l| l.starts_with("trajlog_serve_compactions_total{result=\"ok\"}")).expect("metric");
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_compaction_moves_sealed_sessions_into_shards() {
    let mut e = env_with(|c| c.compact_every_s = Some(0.05)).await;
    for i in 0..3 {
        for sid in ["done", "open"] {
            let (s, _) = e.post(&format!("/sessions/{sid}/v1/chat/completions"), &chat(&format!("turn {i}"), 3)).await;
            assert_eq!(s, 200);
        }
    }
    let before = e.traces_text("done").await;
    let (s, t) = e.post("/sessions/done/seal", &Value::Null).await;
    assert_eq!(s, 200, "{t}");
    // Wait until a compaction has run after the seal was durable (each
    // compaction starts after the last one ended; the guard only stops a hang).
    let seen = compactions_ok(&e).await;
    let guard = std::time::Instant::now();
    while compactions_ok(&e).await < seen + 2 {
        assert!(guard.elapsed() < Duration::from_secs(120), "no periodic compaction ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.shutdown().await;
    let store = trajlog::Store::open_read_only(e.dir.path().join("store")).expect("open");
    let snap = store.snapshot();
    let done = snap.session("done", None, None).expect("read");
    let open = snap.session("open", None, None).expect("read");
    assert_eq!((done.len(), open.len()), (3, 3));
    assert!(done.iter().all(|c| c.is_compacted()), "the sealed session is in the shards");
    assert!(open.iter().all(|c| !c.is_compacted()), "the open one stays in the log");
    assert!(e.dir.path().join("store/shards/steps").read_dir().expect("steps").next().is_some());
    drop(snap);
    drop(store);
    // And the gateway reads it back the same from the shards.
    let mut e2 = env_with(|c| c.store = e.dir.path().join("store")).await;
    assert_eq!(e2.traces_text("done").await, before);
    e2.shutdown().await;
}

/// Fill `dir` with `sessions` sealed sessions of 20 calls each (named
/// `{tag}-N`) through the library, then close it.
fn fill_sealed(dir: &std::path::Path, tag: &str, sessions: usize) {
    let store = trajlog::Store::open(dir, trajlog::Options::default()).expect("open");
    for s in 0..sessions {
        let sid = format!("{tag}-{s}");
        for n in 0..20u32 {
            let call = trajlog::Call {
                trace_id: format!("{sid}/{n}"),
                session_id: sid.clone(),
                timestamp: f64::from(n),
                prompt_token_ids: (0..64 + 16 * n).collect(),
                completion_token_ids: vec![n; 16],
                logprobs: Some(vec![-0.5; 16]),
                ..Default::default()
            };
            store.append(call).expect("append");
        }
        store.seal_session(&sid).expect("seal");
    }
    store.close().expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_periodic_compaction_and_frees_the_store() {
    // A compaction under way holds the store: the shutdown waits for it
    // and closes the store, so the directory is free for a writer as soon
    // as shutdown() returns (before, the background task could still hold
    // it, and a writable open failed with "locked"). The pauses only vary
    // where the shutdown falls; the verdict does not depend on them.
    let dir = tempfile::tempdir().expect("tempdir");
    let store_dir = dir.path().join("store");
    for (round, pause_ms) in [0u64, 30, 120].into_iter().enumerate() {
        fill_sealed(&store_dir, &format!("r{round}"), 150);
        let mut e = env_with(|c| {
            c.store = store_dir.clone();
            c.compact_every_s = Some(0.05);
        })
        .await;
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        e.shutdown().await;
        let store = trajlog::Store::open(&store_dir, trajlog::Options::default())
            .expect("the store is free once shutdown returned");
        assert_eq!(store.snapshot().call_count(), 20 * 150 * (round + 1), "round {round}");
        store.close().expect("close");
    }
}

#[test]
fn compaction_settings_are_checked() {
    use trajlog_serve::config::{resolve, Settings, Source};
    let ok = |s: Settings| resolve(&[(Source::Flags, s)]);
    let base = || Settings { store: Some("/tmp/x".into()), ..Settings::default() };
    let r = ok(Settings { compact_every_s: Some(30.0), compact_older_than_s: Some(600.0), ..base() }).expect("valid");
    assert_eq!((r.config.compact_every_s, r.config.compact_older_than_s), (Some(30.0), Some(600.0)));
    let err = ok(Settings { compact_every_s: Some(0.0), ..base() }).expect_err("refused");
    assert!(err.contains("--compact-every") && err.contains("positive"), "{err}");
    let err = ok(Settings { compact_older_than_s: Some(f64::NAN), ..base() }).expect_err("refused");
    assert!(err.contains("--compact-older-than"), "{err}");
    let toml = "store = \"/tmp/x\"\ncompact_every_s = 60\n";
    let file = Settings::from_toml(toml).expect("toml");
    assert_eq!(resolve(&[(Source::Env, file)]).expect("valid").config.compact_every_s, Some(60.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_zero_ahead_bytes_reaches_the_store() {
    use std::os::unix::fs::MetadataExt;
    use trajlog_serve::config::{resolve, Settings, Source};
    let file = Settings::from_yaml("store: /tmp/x\nstore_zero_ahead_bytes: 0\n").expect("yaml");
    assert_eq!(resolve(&[(Source::Env, file)]).expect("valid").config.store_zero_ahead_bytes, Some(0));
    // Durable captures, then the active segment's allocated bytes: past the
    // data with the default (1 MiB ahead), not with 0.
    for (ahead, more_than_a_mib) in [(None, true), (Some(0), false)] {
        let e = env_with(|c| c.store_zero_ahead_bytes = ahead).await;
        for i in 0..3 {
            let (s, _) = e.post("/sessions/z/v1/chat/completions", &chat(&format!("{i}"), 3)).await;
            assert_eq!(s, 200);
        }
        let segment = e.dir.path().join("store").join("seg-0000000001.tlog");
        let allocated = std::fs::metadata(&segment).expect("the active segment").blocks() * 512;
        assert_eq!(allocated > 1 << 20, more_than_a_mib, "{allocated} bytes allocated with {ahead:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_segment_bytes_reaches_the_store() {
    use trajlog_serve::config::{resolve, Settings, Source};
    let file = Settings::from_yaml("store: /tmp/x\nstore_segment_bytes: 65536\n").expect("yaml");
    assert_eq!(resolve(&[(Source::Env, file)]).expect("valid").config.store_segment_bytes, Some(65536));
    let small = Settings::from_yaml("store: /tmp/x\nstore_segment_bytes: 4096\n").expect("yaml");
    let e = resolve(&[(Source::Env, small)]).map(|_| ()).expect_err("under the smallest segment");
    assert!(e.contains("store_segment_bytes") && e.contains("65536"), "{e}");
    // The active segment file is preallocated to the configured size.
    let e = env_with(|c| c.store_segment_bytes = Some(128 << 10)).await;
    let (s, _) = e.post("/sessions/z/v1/chat/completions", &chat("one", 3)).await;
    assert_eq!(s, 200);
    let segment = e.dir.path().join("store").join("seg-0000000001.tlog");
    assert_eq!(std::fs::metadata(&segment).expect("the active segment").len(), 128 << 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_durability_flush_is_a_barrier() {
    let e = env_with(|c| c.durability = DurabilityMode::Async).await;
    for i in 0..20 {
        let (s, _) = e.post("/sessions/f/v1/chat/completions", &chat(&format!("{i}"), 3)).await;
        assert_eq!(s, 200);
    }
    e.flush().await;
    let traces: Value = e.get_json("/sessions/f/traces").await;
    assert_eq!(traces.as_array().map(Vec::len), Some(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_error_passes_through_and_records_nothing() {
    let e = env().await;
    let r = e
        .http
        .post(format!("{}/sessions/err/v1/chat/completions", e.base))
        .header("x-mock-mode", "error-500")
        .header("content-type", "application/json")
        .body(chat("boom", 2).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 500);
    assert_eq!(r.text().await.expect("body"), "{\"error\": \"simulated backend failure\"}");
    let mut sreq = chat("boom", 2);
    sreq["stream"] = Value::Bool(true);
    let r = e
        .http
        .post(format!("{}/sessions/err/v1/chat/completions", e.base))
        .header("x-mock-mode", "error-500")
        .header("content-type", "application/json")
        .body(sreq.to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 500);
    // A stream cut by the upstream: the agent sees an error, nothing is recorded.
    let r = e
        .http
        .post(format!("{}/sessions/err/v1/chat/completions", e.base))
        .header("x-mock-mode", "cut")
        .header("content-type", "application/json")
        .body(sreq.to_string())
        .send()
        .await
        .expect("post");
    assert!(r.text().await.is_err(), "a cut stream must not look complete");
    e.flush().await;
    assert_eq!(e.traces_text("err").await, "[]");
    // The session exists (implicitly created), with no traces.
    assert_eq!(e.get_json("/sessions/err").await["trace_count"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeout_is_a_504_and_records_nothing() {
    let e = env_with(|c| c.upstream_timeout_s = Some(0.2)).await;
    let r = e
        .http
        .post(format!("{}/sessions/t/v1/chat/completions", e.base))
        .header("x-mock-mode", "hang")
        .header("content-type", "application/json")
        .body(chat("wait", 2).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 504);
    let body: Value = serde_json::from_str(&r.text().await.expect("body")).expect("json error");
    assert!(body["error"].as_str().is_some_and(|m| m.contains("timed out")));
    e.flush().await;
    assert_eq!(e.traces_text("t").await, "[]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_leaves_nothing_half_written() {
    let e = env().await;
    let mut req = chat("leave early", 6);
    req["stream"] = Value::Bool(true);
    let mut r = e
        .http
        .post(format!("{}/sessions/gone/v1/chat/completions", e.base))
        .header("x-mock-mode", "gated")
        .header("content-type", "application/json")
        .body(req.to_string())
        .send()
        .await
        .expect("post");
    let first = r.chunk().await.expect("read").expect("first chunk");
    assert!(!first.is_empty());
    drop(r);
    e.mock.release(100);
    // Hang guard only: wait until the gateway is done with the call. Either it
    // saw the client go (nothing recorded), or it had read the whole upstream
    // answer before the socket told it (a complete trace): never a partial one.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let gone = loop {
        let (_, m) = e.get("/metrics").await;
        if m.contains("trajlog_serve_calls_total{outcome=\"client_gone\"} 1") {
            break true;
        }
        if m.contains("trajlog_serve_traces_total{result=\"stored\"} 1") {
            break false;
        }
        assert!(tokio::time::Instant::now() < deadline, "the gateway never finished the call");
        tokio::task::yield_now().await;
    };
    e.flush().await;
    let traces = split_list(&e.traces_text("gone").await);
    if gone {
        assert!(traces.is_empty(), "{traces:?}");
    } else {
        assert_eq!(traces.len(), 1);
        let sent: Value = serde_json::from_str(&e.mock.requests().pop().expect("sent")).expect("json");
        let t: Value = serde_json::from_str(&traces[0]).expect("json");
        assert_exact(&t, &mock::plan(&sent, "gated"));
        assert_eq!(t["finish_reason"], "length", "complete, not partial");
    }
    let (s, _) = e.post("/sessions/gone/v1/chat/completions", &chat("again", 2)).await;
    assert_eq!(s, 200, "the gateway still serves");
    assert_eq!(split_list(&e.traces_text("gone").await).len(), traces.len() + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_all_present_and_exact() {
    let e = std::sync::Arc::new(env().await);
    const SESSIONS: usize = 16;
    const CALLS: usize = 6;
    let mut tasks = Vec::new();
    for s in 0..SESSIONS {
        let e = e.clone();
        tasks.push(tokio::spawn(async move {
            let mut plans = Vec::new();
            for c in 0..CALLS {
                let mut req = chat(&format!("session {s} call {c}"), 1 + (c as u64 % 4));
                let stream = c % 2 == 1;
                if stream {
                    req["stream"] = Value::Bool(true);
                }
                let (st, body) = e.post(&format!("/sessions/conc-{s}/v1/chat/completions"), &req).await;
                assert_eq!(st, 200, "{body}");
                // What the gateway forwarded: the request plus the injected keys.
                let mut fwd = req.clone();
                fwd["logprobs"] = Value::Bool(true);
                fwd["return_token_ids"] = Value::Bool(true);
                plans.push(mock::plan(&fwd, ""));
            }
            plans
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await.expect("task"));
    }
    e.flush().await;
    for (s, plans) in all.iter().enumerate() {
        let traces: Value = e.get_json(&format!("/sessions/conc-{s}/traces")).await;
        let traces = traces.as_array().expect("list");
        assert_eq!(traces.len(), CALLS);
        for (t, p) in traces.iter().zip(plans) {
            assert_exact(t, p);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_errors_workers_and_metrics() {
    let e = env().await;
    assert_eq!(e.get_json("/admin/weight_version").await, serde_json::json!({"weight_version": null}));
    let (s, t) = e.post("/admin/weight_version", &serde_json::json!({})).await;
    assert_eq!((s, t.as_str()), (400, "{\"error\":\"weight_version is required\"}"));
    assert_eq!(e.post("/admin/weight_version", &serde_json::json!({"weight_version": "abc"})).await.0, 400);
    assert_eq!(
        e.post("/admin/weight_version", &serde_json::json!({"weight_version": 7.9})).await.1,
        "{\"weight_version\":7}"
    );
    assert_eq!(e.post("/admin/workers", &serde_json::json!({})).await.0, 400);
    let (s, t) =
        e.post("/admin/workers", &serde_json::json!({"url": "http://127.0.0.1:9/v1", "worker_id": "w2"})).await;
    assert_eq!((s, t.as_str()), (200, "{\"worker_id\":\"w2\",\"url\":\"http://127.0.0.1:9\",\"api_path\":\"/v1\"}"));
    assert_eq!(e.get_json("/admin/workers").await.as_array().map(Vec::len), Some(2));
    let r = e.http.delete(format!("{}/admin/workers/w2", e.base)).send().await.expect("delete");
    assert_eq!(r.text().await.expect("body"), "{\"removed\":\"w2\"}");
    assert_eq!(e.http.delete(format!("{}/admin/workers/w2", e.base)).send().await.expect("delete").status(), 404);
    let (s, _) = e.post("/sessions/m/v1/chat/completions", &chat("count me", 2)).await;
    assert_eq!(s, 200);
    let (s, m) = e.get("/metrics").await;
    assert_eq!(s, 200);
    for name in [
        "trajlog_serve_calls_total{outcome=\"ok\"} 1",
        "trajlog_serve_traces_total{result=\"stored\"} 1",
        "trajlog_serve_queue_depth 0",
        "trajlog_serve_upstream_latency_ms_count 1",
    ] {
        assert!(m.contains(name), "missing {name} in\n{m}");
    }
    // trajlog's own: reward, seal, audit.
    assert_eq!(e.post("/sessions/m/reward", &serde_json::json!({"reward": 1.5})).await.0, 200);
    assert_eq!(e.post("/sessions/m/reward", &serde_json::json!({})).await.0, 400);
    let traces = e.get_json("/sessions/m/traces").await;
    let tid = traces[0]["trace_id"].as_str().expect("a captured trace").to_owned();
    assert_eq!(e.post(&format!("/traces/{tid}/reward"), &serde_json::json!({"reward": 0.5})).await.0, 200);
    let (s, t) = e.post("/traces/no-such-trace/reward", &serde_json::json!({"reward": 0.5})).await;
    assert_eq!(s, 404, "a trace id with no live call: {t}");
    assert!(t.contains("no-such-trace"), "{t}");
    assert_eq!(e.post("/sessions/m/seal", &Value::Null).await.0, 200);
    let (s, t) = e.post("/sessions/m/v1/chat/completions", &chat("after seal", 2)).await;
    assert_eq!(s, 503, "a sealed session refuses new traces: {t}");
    let audit = e.get_json("/admin/audit").await;
    assert_eq!(audit["sessions_checked"], 1);
    let (s, _) = e.post("/admin/compact", &Value::Null).await;
    assert_eq!(s, 200);
    assert_eq!(e.get("/nope").await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_is_a_clear_error() {
    let e = env_with(|c| c.workers.clear()).await;
    let (s, t) = e.post("/sessions/x/v1/chat/completions", &chat("nobody", 2)).await;
    assert_eq!((s, t.as_str()), (503, "{\"error\":\"no healthy workers available\"}"));
}

#[test]
fn config_toml() {
    let s = trajlog_serve::Settings::from_toml(
        "store = \"/tmp/s\"\nport = 0\ndurability = \"async\"\nmodel = \"m\"\n[[workers]]\nurl = \"http://h:8000/v1\"\n",
    )
    .expect("parses");
    let c =
        trajlog_serve::config::resolve(&[(trajlog_serve::Source::File("gw.toml".into()), s)]).expect("resolves").config;
    assert_eq!(c.durability, DurabilityMode::Async);
    assert_eq!(c.workers[0].url, "http://h:8000/v1");
    assert!(trajlog_serve::Settings::from_toml("bogus = 1").is_err_and(|e| e.contains("bogus")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_marked_unhealthy_and_routed_around() {
    let e = env_with(|c| {
        c.health_check_interval_s = 0.05;
        // Registered first, so least-loaded ties would pick it; nothing listens on port 1.
        c.workers.insert(
            0,
            trajlog_serve::WorkerConfig {
                url: "http://127.0.0.1:1".into(),
                worker_id: Some("dead".into()),
                api_path: None,
                model_name: None,
                weight: None,
            },
        );
    })
    .await;
    // Hang guard only: wait for three failed health checks.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let w = e.get_json("/health/workers").await;
        if w["healthy"] == 1 {
            assert_eq!(w["workers"][0]["worker_id"], "dead");
            assert_eq!(w["workers"][0]["healthy"], false);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the dead worker was never marked unhealthy");
        tokio::task::yield_now().await;
    }
    for s in 0..4 {
        let (st, body) = e.post(&format!("/sessions/h{s}/v1/chat/completions"), &chat("route me", 2)).await;
        assert_eq!(st, 200, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_are_not_duplicated() {
    // An agent that sends its own content-type and accept-encoding still gets a parsed, captured answer.
    let e = env().await;
    let r = e
        .http
        .post(format!("{}/sessions/hdr/v1/chat/completions", e.base))
        .header("content-type", "application/json")
        .header("accept-encoding", "gzip")
        .header("authorization", "Bearer x")
        .body(chat("headers", 2).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(r.status(), 200);
    assert_eq!(split_list(&e.traces_text("hdr").await).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_pass_the_body_limit_of_the_http_stack() {
    // A long agent history: well over axum's 2 MB default, under the gateway's 64 MiB.
    let e = env().await;
    let big = "x".repeat(5 << 20);
    let (s, body) = e.post("/sessions/big/v1/chat/completions", &chat(&big, 2)).await;
    assert_eq!(s, 200, "{}", &body[..body.len().min(200)]);
    let t: Value = serde_json::from_str(&e.traces_text("big").await).expect("json");
    assert_eq!(t[0]["messages"][0]["content"].as_str().map(str::len), Some(5 << 20));
}

fn dead_worker(id: &str, url: &str) -> trajlog_serve::WorkerConfig {
    trajlog_serve::WorkerConfig {
        url: url.into(),
        worker_id: Some(id.into()),
        api_path: None,
        model_name: None,
        weight: None,
    }
}

/// Nothing listens on port 1: connecting is refused before any byte is sent.
const DEAD: &str = "http://127.0.0.1:1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_another_worker_and_captured_once() {
    // The dead worker is registered first, so the new session is pinned to it
    // (least-loaded ties go to the first registered); health checks are far apart.
    let e = env_with(|c| c.workers.insert(0, dead_worker("dead", DEAD))).await;
    let w = e.get_json("/health/workers").await;
    assert_eq!((w["healthy"].as_u64(), w["workers"][0]["worker_id"].as_str()), (Some(2), Some("dead")));
    let req = chat("retry me", 3);
    let (s, body) = e.post("/sessions/retry/v1/chat/completions", &req).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(e.mock.requests().len(), 1, "the live worker got the call once");
    let traces: Value = serde_json::from_str(&e.traces_text("retry").await).expect("json");
    assert_eq!(traces.as_array().map(Vec::len), Some(1), "captured exactly once");
    let forwarded: Value = serde_json::from_str(&e.mock.requests()[0]).expect("json");
    assert_exact(&traces[0], &mock::plan(&forwarded, ""));
    let w = e.get_json("/health/workers").await;
    assert_eq!((w["workers"][0]["healthy"].as_bool(), w["healthy"].as_u64()), (Some(false), Some(1)), "{w}");
    let metrics = e.get("/metrics").await.1;
    assert!(metrics.contains("trajlog_serve_upstream_connect_retries_total 1\n"), "{metrics}");
    // The session now stays on the live worker: no more retries.
    let (s, body) = e.post("/sessions/retry/v1/chat/completions", &chat("again", 2)).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(e.mock.requests().len(), 2);
    assert_eq!(split_list(&e.traces_text("retry").await).len(), 2);
    assert!(e.get("/metrics").await.1.contains("trajlog_serve_upstream_connect_retries_total 1\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_retries_are_bounded_and_record_nothing() {
    // Two dead workers (two URLs of one closed port), one retry: the second
    // attempt goes to the other worker, then the call fails.
    let e = env_with(|c| {
        c.workers = vec![dead_worker("a", DEAD), dead_worker("b", "http://localhost:1")];
        c.upstream_connect_retries = 1;
    })
    .await;
    let (s, body) = e.post("/sessions/none/v1/chat/completions", &chat("nobody home", 2)).await;
    assert_eq!(s, 502, "{body}");
    assert!(body.contains("upstream request failed"), "{body}");
    assert!(e.get("/metrics").await.1.contains("trajlog_serve_upstream_connect_retries_total 1\n"));
    assert_eq!(e.get("/sessions/none/traces").await.1, "[]");
    let w = e.get_json("/health/workers").await;
    assert_eq!(w["healthy"], 0, "both tried, both marked unhealthy: {w}");
    // Later calls are refused at once, not sent.
    let (s, body) = e.post("/sessions/none/v1/chat/completions", &chat("nobody home", 2)).await;
    assert_eq!((s, body.as_str()), (503, "{\"error\":\"no healthy workers available\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_dead_worker_is_tried_again_after_a_pause_then_the_call_fails() {
    let e = env_with(|c| c.workers = vec![dead_worker("only", DEAD)]).await;
    let (s, body) = e.post("/sessions/lone/v1/chat/completions", &chat("anyone", 2)).await;
    assert_eq!(s, 502, "{body}");
    let retries = format!(
        "trajlog_serve_upstream_connect_retries_total {}\n",
        trajlog_serve::config::DEFAULT_UPSTREAM_CONNECT_RETRIES
    );
    assert!(e.get("/metrics").await.1.contains(&retries), "the default number of retries, on the same worker");
    assert_eq!(e.get("/sessions/lone/traces").await.1, "[]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_error_after_sending_is_not_retried() {
    // A 500 from the upstream came after it got the request: passed through, never sent again.
    let e = env().await;
    let mut req = chat("fail", 2);
    req["model"] = Value::from("mock-error-500");
    let (s, _) = e.post("/sessions/err/v1/chat/completions", &req).await;
    assert_eq!(s, 500);
    assert_eq!(e.mock.requests().len(), 1);
    assert!(e.get("/metrics").await.1.contains("trajlog_serve_upstream_connect_retries_total 0\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_and_docs_are_served() {
    let e = env().await;
    let doc = e.get_json("/openapi.json").await;
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    assert!(doc["paths"]["/sessions/{session_id}/v1/chat/completions"]["post"].is_object());
    let r = e.http.get(format!("{}/docs", e.base)).send().await.expect("get");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().is_ok_and(|t| t.starts_with("text/html")));
    let html = r.text().await.expect("body");
    assert!(html.contains("href=\"/openapi.json\""), "{html}");
    // Methods the proxy does not take are refused, as rLLM's FastAPI routes do.
    let r = e.http.put(format!("{}/v1/models", e.base)).send().await.expect("put");
    assert_eq!(r.status(), 405);
}
