//! `trajlog serve` and `trajlog mock-vllm` as real processes: a SIGKILL of
//! the gateway under concurrent load loses no acknowledged trace
//! (`--durability sync`), and SIGTERM drains and flushes (`--durability async`).

#[path = "../../../tests/common/mod.rs"]
mod common;

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Spawn `trajlog <args>` and read its `listening on http://ADDR` line.
fn spawn(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn trajlog");
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
