//! `trajlog serve` and `trajlog mock-vllm` as real processes: a SIGKILL of
//! the gateway under concurrent load loses no acknowledged trace
//! (`--durability sync`), SIGTERM drains and flushes (`--durability async`),
//! and rLLM's ways of configuring and launching its gateway (a YAML config,
//! `RLLM_GATEWAY_*` variables, `GatewayManager`'s command line) work unchanged.

#[path = "../../../tests/common/mod.rs"]
mod common;

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// rLLM's variables, which `trajlog serve` reads: set only where a test says so.
const RLLM_ENV: &[&str] =
    &["RLLM_GATEWAY_HOST", "RLLM_GATEWAY_PORT", "RLLM_GATEWAY_DB_PATH", "RLLM_GATEWAY_LOG_LEVEL", "RLLM_GATEWAY_STORE"];

/// `trajlog <args>` with `env` as the only `RLLM_GATEWAY_*` variables.
fn trajlog(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trajlog"));
    cmd.args(args);
    for k in RLLM_ENV {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied());
    cmd
}

/// Spawn `trajlog <args>` and read its `listening on http://ADDR` line.
fn spawn(args: &[&str]) -> (Child, String) {
    spawn_with(args, &[], Stdio::null())
}

fn spawn_with(args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> (Child, String) {
    let mut child = trajlog(args, env).stdout(Stdio::piped()).stderr(stderr).spawn().expect("spawn trajlog");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read the listening line");
    let addr = line.trim().rsplit("http://").next().expect("address").to_owned();
    assert!(line.contains("listening on http://"), "{line:?}");
    (child, addr)
}

/// One HTTP/1.1 call on a fresh connection; (status, body), or None if the
/// connection failed (the server is gone).
fn http(addr: &str, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    let len: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned()))?
        .parse()
        .ok()?;
    (body.len() == len).then(|| (status, body.to_owned()))
}

/// A session id and its requests that got a 200, in order.
type Acked = (String, Vec<Value>);

fn chat(sid_turn: &str, max_tokens: u64) -> Value {
    serde_json::json!({"model": "mock-model", "messages": [{"role": "user", "content": sid_turn}], "max_tokens": max_tokens})
}

#[test]
fn sigkill_under_load_loses_no_acknowledged_trace() {
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    let worker = format!("http://{mock_addr}/v1");
    let (mut gw, addr) = spawn(&[
        "serve",
        "--store",
        store.to_str().expect("utf-8"),
        "--port",
        "0",
        "--worker",
        &worker,
        "--durability",
        "sync",
        "--log-level",
        "error",
    ]);
    const THREADS: usize = 8;
    const ACKED_BEFORE_KILL: usize = 120;
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Per session: the requests that got a 200, in order.
    let done: Arc<Mutex<Vec<Acked>>> = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for t in 0..THREADS {
        let (addr, acked, stop, done) = (addr.clone(), acked.clone(), stop.clone(), done.clone());
        threads.push(std::thread::spawn(move || {
            let sid = format!("kill-{t}");
            let mut ok = Vec::new();
            for turn in 0.. {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                let req = chat(&format!("{sid} turn {turn}"), 1 + turn % 7);
                match http(&addr, "POST", &format!("/sessions/{sid}/v1/chat/completions"), &req.to_string()) {
                    Some((200, _)) => {
                        ok.push(req);
                        acked.fetch_add(1, Ordering::AcqRel);
                    }
                    _ => break,
                }
            }
            done.lock().expect("lock").push((sid, ok));
        }));
    }
    // Kill once enough calls were acknowledged, while the threads still send.
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while acked.load(Ordering::Acquire) < ACKED_BEFORE_KILL {
        assert!(std::time::Instant::now() < deadline, "hang guard: the gateway stopped answering");
        std::thread::yield_now();
    }
    gw.kill().expect("SIGKILL the gateway");
    gw.wait().expect("reap");
    stop.store(true, Ordering::Release);
    for t in threads {
        t.join().expect("client thread");
    }
    let _ = mock.kill();
    let _ = mock.wait();

    let store = trajlog::Store::open_read_only(&store).expect("reopen after SIGKILL");
    let snap = store.snapshot();
    let done = done.lock().expect("lock");
    let mut checked = 0;
    for (sid, reqs) in done.iter() {
        let calls = snap.session(sid, None, None).expect("read session");
        assert!(calls.len() >= reqs.len(), "{sid}: {} acknowledged, {} stored", reqs.len(), calls.len());
        for (view, req) in calls.iter().zip(reqs) {
            let call = view.to_call().expect("call");
            let mut fwd = req.clone();
            fwd["logprobs"] = Value::Bool(true);
            fwd["return_token_ids"] = Value::Bool(true);
            let plan = trajlog_serve::mock::plan(&fwd, "");
            assert_eq!(call.prompt_token_ids, plan.prompt_token_ids);
            assert_eq!(call.completion_token_ids, plan.completion_token_ids);
            let want: Vec<u32> = plan.logprobs.iter().map(|t| t.parse::<f32>().expect("f32").to_bits()).collect();
            let got: Vec<u32> = call.logprobs.as_deref().expect("logprobs").iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{sid}");
            checked += 1;
        }
    }
    assert!(checked >= ACKED_BEFORE_KILL, "{checked} checked");
}

#[test]
fn sigterm_drains_and_flushes() {
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    let worker = format!("http://{mock_addr}");
    let (mut gw, addr) = spawn(&[
        "serve",
        "--store",
        store.to_str().expect("utf-8"),
        "--port",
        "0",
        "--worker",
        &worker,
        "--durability",
        "async",
    ]);
    for i in 0..5 {
        let (s, body) =
            http(&addr, "POST", "/sessions/term/v1/chat/completions", &chat(&format!("{i}"), 3).to_string())
                .expect("gateway answers");
        assert_eq!(s, 200, "{body}");
    }
    let (s, info) = http(&addr, "GET", "/sessions/term", "").expect("get");
    assert_eq!(s, 200, "{info}");
    let term = Command::new("kill").args(["-TERM", &gw.id().to_string()]).status().expect("run kill");
    assert!(term.success());
    let status = gw.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "a clean exit after SIGTERM");
    let _ = mock.kill();
    let _ = mock.wait();
    let store = trajlog::Store::open_read_only(&store).expect("reopen");
    assert_eq!(store.snapshot().session("term", None, None).expect("read").len(), 5);
}

fn sigterm(child: &mut Child) -> Option<i32> {
    let term = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("run kill");
    assert!(term.success());
    child.wait().expect("wait").code()
}

#[test]
fn rllm_yaml_config_then_env_then_flags() {
    let dir = common::tempdir();
    let store = dir.path().join("traces");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    // rLLM's GatewayConfig keys as rLLM writes them; the port and host are overridden below.
    let yaml = format!(
        "host: 0.0.0.0\nport: 9\ndb_path: {}\nstore_worker: sqlite\nlog_level: WARNING\nsync_traces: true\n\
         health_check_interval: 10.0\nadd_logprobs: true\nadd_return_token_ids: true\nstrip_vllm_fields: true\n\
         model: null\nrouting_policy: null\ncumulative_token_mode: false\nrenderer_family: auto\n\
         workers:\n  - url: http://{mock_addr}/v1\n    model_name: mock-model\n    worker_id: ''\n",
        store.display()
    );
    let config = dir.path().join("gateway.yaml");
    std::fs::write(&config, yaml).expect("write config");
    let (mut gw, addr) = spawn_with(
        &["serve", "--config", config.to_str().expect("utf-8"), "--host", "127.0.0.1"],
        &[("RLLM_GATEWAY_PORT", "0"), ("RLLM_GATEWAY_LOG_LEVEL", "ERROR")],
        Stdio::null(),
    );
    assert!(addr.starts_with("127.0.0.1:"), "the flag's host over the file's: {addr}");
    assert!(!addr.ends_with(":9"), "the variable's port over the file's: {addr}");
    let (s, body) =
        http(&addr, "POST", "/sessions/yaml/v1/chat/completions", &chat("from yaml", 3).to_string()).expect("answers");
    assert_eq!(s, 200, "{body}");
    let (s, workers) = http(&addr, "GET", "/admin/workers", "").expect("answers");
    assert_eq!(s, 200);
    let workers: Value = serde_json::from_str(&workers).expect("json");
    assert_eq!(workers[0]["worker_id"], "0", "an empty worker_id is the index, as in rLLM");
    assert_eq!(workers[0]["api_path"], "/v1");
    assert_eq!(sigterm(&mut gw), Some(0));
    let _ = mock.kill();
    let _ = mock.wait();
    let store = trajlog::Store::open_read_only(&store).expect("db_path is the store directory");
    assert_eq!(store.snapshot().session("yaml", None, None).expect("read").len(), 1);
}

#[test]
fn rllm_gateway_manager_command_line_runs_on_a_temporary_store() {
    // rLLM's GatewayManager starts its gateway as `--host H --port P --store memory --model M`
    // and registers workers afterwards through POST /admin/workers.
    let dir = common::tempdir();
    let log = dir.path().join("serve.log");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    let (mut gw, addr) = spawn_with(
        &["serve", "--host", "127.0.0.1", "--port", "0", "--store", "memory", "--model", "mock-model"],
        &[],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    let worker = serde_json::json!({"url": format!("http://{mock_addr}/v1")}).to_string();
    assert_eq!(http(&addr, "POST", "/admin/workers", &worker).map(|r| r.0), Some(200));
    let (s, body) =
        http(&addr, "POST", "/sessions/mem/v1/chat/completions", &chat("memory", 2).to_string()).expect("answers");
    assert_eq!(s, 200, "{body}");
    let (s, traces) = http(&addr, "GET", "/sessions/mem/traces", "").expect("answers");
    assert_eq!(s, 200);
    assert_eq!(serde_json::from_str::<Value>(&traces).expect("json").as_array().map(Vec::len), Some(1));
    assert_eq!(sigterm(&mut gw), Some(0));
    let _ = mock.kill();
    let _ = mock.wait();
    let log = std::fs::read_to_string(&log).expect("read log");
    let temp = log
        .split_whitespace()
        .find(|w| w.contains("trajlog-serve-"))
        .map(|w| w.trim_end_matches(','))
        .unwrap_or_else(|| panic!("the log names the temporary store: {log}"));
    assert!(!std::path::Path::new(temp).exists(), "the temporary store {temp} is removed on exit");
}

#[test]
fn config_errors_name_the_key_and_exit_2() {
    let dir = common::tempdir();
    let path = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.to_string_lossy().into_owned()
    };
    /// Arguments after `serve`, `RLLM_GATEWAY_*` variables, what stderr must contain.
    type Case<'a> = (Vec<String>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--config".into(), path("ctm.yaml", "store: /tmp/x\ncumulative_token_mode: true\n")],
            vec![],
            "cumulative_token_mode (config ",
        ),
        (vec!["--config".into(), path("unknown.yml", "store: /tmp/x\nbogus_key: 1\n")], vec![], "`bogus_key`"),
        (vec!["--config".into(), path("bad.toml", "stor = \"/tmp/x\"\n")], vec![], "`stor`"),
        (vec!["--config".into(), path("gw.json", "{}")], vec![], "name the file .yaml or .yml"),
        (vec!["--store".into(), "memory".into()], vec![("RLLM_GATEWAY_PORT", "http")], "RLLM_GATEWAY_PORT: \"http\""),
        (vec!["--db-path".into(), "/tmp/x".into()], vec![("RLLM_GATEWAY_STORE", "redis")], "RLLM_GATEWAY_STORE"),
        (
            vec!["--store".into(), "memory".into(), "--cumulative-token-mode".into()],
            vec![],
            "--cumulative-token-mode: ",
        ),
        (vec![], vec![], "a store directory is required"),
    ];
    for (args, env, want) in cases {
        let mut argv = vec!["serve"];
        argv.extend(args.iter().map(String::as_str));
        let out = trajlog(&argv, &env).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{argv:?}: {err}");
        assert!(err.contains(want), "{argv:?}: {err}");
    }
}

/// A gateway that may write files of at most 1 MiB (`ulimit -f`; SIGXFSZ
/// ignored, so the write returns EFBIG), with 256 KiB segments, in front of
/// the mock at `mock_addr`; its address.
fn limited_gateway(dir: &Path, store: &Path, mock_addr: &str, durability: &str) -> (Child, String) {
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, "store_segment_bytes: 262144\nstore_zero_ahead_bytes: 0\n").expect("write config");
    let script = format!(
        "trap '' XFSZ; ulimit -f 1024; exec '{}' serve --store '{}' --config '{}' --port 0 --worker http://{mock_addr}/v1 --durability {durability} --log-level error",
        env!("CARGO_BIN_EXE_trajlog"),
        store.display(),
        config.display()
    );
    let mut gw = Command::new("bash")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the gateway");
    let mut line = String::new();
    BufReader::new(gw.stdout.take().expect("stdout")).read_line(&mut line).expect("listening line");
    assert!(line.contains("listening on http://"), "{line:?}");
    let addr = line.trim().rsplit("http://").next().expect("address").to_owned();
    (gw, addr)
}

/// A completions call with a 1.6 MB prompt: its trace passes the 1 MiB limit.
fn big_call() -> String {
    let prompt: Vec<u32> = (0..400_000u32).map(|i| i.wrapping_mul(2_654_435_761) % 50_000).collect();
    serde_json::json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2}).to_string()
}

/// The reopen runs in the background: until it is done, `/health` answers a
/// 503 saying so. Wait for it (a hang guard, not a timing verdict).
fn wait_for_reopen(addr: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let (s, body) = http(addr, "GET", "/health", "").expect("answers");
        if s == 200 {
            return;
        }
        assert_eq!(s, 503, "{body}");
        assert!(body.contains("reopened") || body.contains("refuses writes"), "{body}");
        assert!(std::time::Instant::now() < deadline, "hang guard: the store was not reopened: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait until `/health` finds the poisoned store (a write that failed after
/// its call was answered), then for the reopen (hang guards, not verdicts).
fn wait_for_failure_then_reopen(addr: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while http(addr, "GET", "/health", "").expect("answers").0 == 200 {
        assert!(std::time::Instant::now() < deadline, "hang guard: the write never failed");
        std::thread::sleep(Duration::from_millis(10));
    }
    wait_for_reopen(addr);
}

/// A small chat call (turn `turn`) of session "small" through the gateway
/// at `addr`: its status and body.
fn small_call(addr: &str, turn: u32) -> (u16, String) {
    let body = chat(&format!("small turn {turn}"), 3).to_string();
    http(addr, "POST", "/sessions/small/v1/chat/completions", &body).expect("answers")
}

#[test]
fn a_failed_write_poisons_the_store_and_the_gateway_reopens_it() {
    // A real write failure, as in tests/process.rs: the gateway may write
    // files of at most 1 MiB (`ulimit -f`; SIGXFSZ ignored, so the write
    // returns EFBIG), its segments are 256 KiB, and one call carries a
    // 1.6 MB prompt. That call poisons the store; the gateway closes it and
    // opens it again by itself, and later calls are captured as before.
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    let (mut gw, addr) = limited_gateway(dir.path(), &store, &mock_addr, "sync");

    let (s, body) = small_call(&addr, 0);
    assert_eq!(s, 200, "{body}");
    let (s, body) = http(&addr, "POST", "/sessions/big/v1/completions", &big_call()).expect("answers");
    assert_eq!(s, 503, "the trace could not be written: {body}");
    assert!(body.contains("trace was not stored"), "{body}");
    wait_for_reopen(&addr);
    for turn in 1..4 {
        let (s, body) = small_call(&addr, turn);
        assert_eq!(s, 200, "captured again after the reopen: {body}");
    }
    let (s, metrics) = http(&addr, "GET", "/metrics", "").expect("answers");
    assert_eq!(s, 200);
    assert!(metrics.contains("trajlog_serve_store_reopens_total 1"), "{metrics}");
    assert!(metrics.contains("trajlog_serve_store_available 1"), "{metrics}");
    assert_eq!(sigterm(&mut gw), Some(0));
    let _ = mock.kill();
    let _ = mock.wait();

    let store = trajlog::Store::open_read_only(&store).expect("reopen");
    let snap = store.snapshot();
    assert_eq!(snap.session("small", None, None).expect("read").len(), 4, "every acknowledged call");
    assert!(snap.session("big", None, None).expect("read").is_empty(), "nothing of the failed call");
    assert!(trajlog::verify::verify_dir(store.dir()).expect("verify").problems.is_empty());
}

#[test]
fn with_async_durability_the_first_flush_after_a_failed_write_reports_the_lost_traces() {
    // `--durability async` answers once the store has the trace, before it
    // is durable; `POST /admin/flush` is the trainer's barrier. A write that
    // fails meanwhile loses what was not yet durable: the gateway reopens
    // the store by itself, and the next flush must not answer "flushed" as
    // if every answered trace were stored.
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let (mut mock, mock_addr) = spawn(&["mock-vllm", "--port", "0"]);
    let (mut gw, addr) = limited_gateway(dir.path(), &store, &mock_addr, "async");
    let (s, body) = small_call(&addr, 0);
    assert_eq!(s, 200, "{body}");
    assert_eq!(http(&addr, "POST", "/admin/flush", "").expect("answers").0, 200);
    // Answered at once; its write fails in the writer afterwards.
    let (s, body) = http(&addr, "POST", "/sessions/big/v1/completions", &big_call()).expect("answers");
    assert_eq!(s, 200, "answered before it is durable: {body}");
    // The failure found before the trainer's flush (here by `/health`; a
    // capture would do the same), and the store reopened by then: the flush
    // still reports the loss (it answered "flushed" before).
    wait_for_failure_then_reopen(&addr);
    let (s, body) = http(&addr, "POST", "/admin/flush", "").expect("answers");
    assert_eq!(s, 500, "{body}");
    assert!(body.contains("may have been lost"), "{body}");
    let (s, body) = small_call(&addr, 1);
    assert_eq!(s, 200, "captured again after the reopen: {body}");
    let (s, body) = http(&addr, "POST", "/admin/flush", "").expect("answers");
    assert_eq!((s, body.as_str()), (200, "{\"status\":\"flushed\"}"), "reported once");
    assert_eq!(sigterm(&mut gw), Some(0));
    let snap = trajlog::Store::open_read_only(&store).expect("reopen").snapshot();
    assert_eq!(snap.session("small", None, None).expect("read").len(), 2);
    assert!(snap.session("big", None, None).expect("read").is_empty(), "the lost trace");
    // No flush after the failure before a shutdown: the shutdown reports it
    // (a failed exit) instead of the flush.
    let store = dir.path().join("store2");
    let (mut gw, addr) = limited_gateway(dir.path(), &store, &mock_addr, "async");
    assert_eq!(http(&addr, "POST", "/sessions/big/v1/completions", &big_call()).expect("answers").0, 200);
    wait_for_failure_then_reopen(&addr);
    assert_ne!(sigterm(&mut gw), Some(0), "the shutdown reports the lost trace");
    let _ = mock.kill();
    let _ = mock.wait();
}
