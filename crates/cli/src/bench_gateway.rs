//! `trajlog bench-gateway`: the capture gateway's cost, side by side in one run.
//!
//! One mock inference server (`trajlog mock-vllm`, its own process, 0 ms
//! generation) and, in front of it, each gateway under test in its own
//! process: `trajlog serve` (durable on return) and, when its Python is
//! given, rLLM's `rllm-model-gateway` (from `compat/`) with its SQLite store
//! and with its memory store, both with `sync_traces: true`. The agents are
//! this process: `S` concurrent sessions, each a multi-turn chat whose history
//! grows every turn (the assistant's answer and a tool result appended), with
//! `max_tokens` completion tokens per call and `logprobs`.
//!
//! For every gateway and every concurrency it reports calls/s, the latency
//! p50/p99 seen by the agent, the latency the gateway adds over calling the
//! mock directly (same load, same run), and the gateway process's CPU time
//! per call (from `/proc/PID/stat`). After each run it flushes the gateway and
//! reads every session's traces back: each must be present, and its token ids
//! and logprobs must be those the mock sent (the mock is a pure function of
//! the request, [`trajlog_serve::mock::plan`]).

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = std::result::Result<T, String>;

/// `trajlog bench-gateway`'s options.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Concurrent sessions, one run each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub sessions: Vec<usize>,
    /// Calls per conversation; the history grows every turn.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// Calls per run (at least one conversation per session).
    #[arg(long, default_value_t = 2000)]
    pub calls: usize,
    /// Completion tokens per call (with logprobs).
    #[arg(long, default_value_t = 400)]
    pub completion_tokens: usize,
    /// A Python with rLLM's gateway dependencies (fastapi, uvicorn, httpx, aiosqlite, PyYAML):
    /// runs rLLM's gateway from compat/ beside trajlog serve, with its SQLite and memory stores.
    #[arg(long, value_name = "PYTHON")]
    pub rllm_python: Option<PathBuf>,
    /// Another trajlog binary (say, a build of an earlier commit): its `trajlog serve` runs
    /// beside this one's under the same load, as "trajlog serve, baseline".
    #[arg(long, value_name = "TRAJLOG")]
    pub baseline_serve: Option<PathBuf>,
    /// Also run `trajlog serve --durability async` beside, as "trajlog serve, async": it answers
    /// before the trace is durable (the next group commit makes it so; a flush waits for it).
    #[arg(long)]
    pub async_serve: bool,
    /// Scratch directory for the store and rLLM's database (removed after); default: the temp directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A child process, killed on drop.
struct Proc {
    child: Child,
    url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Start `cmd`, wait for its `... listening on URL` line on stdout.
fn spawn_listening(mut cmd: Command, what: &str) -> Res<Proc> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {what}: {e}"))?;
    let stdout = child.stdout.take().ok_or_else(|| format!("{what}: no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let url = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some((_, url)) = line.split_once("listening on ") {
                    break url.trim().trim_end_matches('/').to_owned();
                }
            }
            _ => {
                let _ = child.kill();
                return Err(format!("{what} exited before listening"));
            }
        }
    };
    // Keep draining its stdout so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Ok(Proc { child, url })
}

fn free_port() -> Res<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// Start rLLM's gateway from `compat/rllm-model-gateway` and wait for `/health`.
fn spawn_rllm(python: &Path, repo: &Path, dir: &Path, worker: &str, store: &str) -> Res<Proc> {
    let port = free_port()?;
    let config = dir.join(format!("rllm-{store}.json"));
    let mut cfg = json!({
        "host": "127.0.0.1",
        "port": port,
        "workers": [{"url": format!("{worker}/v1"), "worker_id": "w0"}],
        "store_worker": store,
        "sync_traces": true,
        "health_check_interval": 999,
        "log_level": "warning",
    });
    if store == "sqlite" {
        cfg["db_path"] = json!(dir.join("rllm-traces.db").display().to_string());
    }
    std::fs::write(&config, cfg.to_string()).map_err(|e| format!("{}: {e}", config.display()))?;
    let src = repo.join("compat/rllm-model-gateway/src");
    let child = Command::new(python)
        .args(["-m", "rllm_model_gateway", "--config"])
        .arg(&config)
        .env("PYTHONPATH", &src)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start rLLM's gateway with {}: {e}", python.display()))?;
    let proc = Proc { child, url: format!("http://127.0.0.1:{port}") };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if answers_200(port) {
            return Ok(proc);
        }
        if Instant::now() > deadline {
            return Err("rLLM's gateway did not answer /health within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether `GET /health` on the local port answers 200.
fn answers_200(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    if conn.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).is_ok() && head.ends_with(b" 200")
}

/// `utime + stime` of a process, in seconds.
fn cpu_seconds(pid: u32) -> Res<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or("bad /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).ok_or("bad /proc stat field");
    // utime and stime are fields 14 and 15 of stat: 12 and 13 after the ')'.
    Ok((ticks(11)? + ticks(12)?) / clock_ticks())
}

/// Clock ticks per second (`getconf CLK_TCK`), asked once.
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// A tool result or user turn appended after each answer: about 600 bytes.
fn tool_result(session: usize, turn: usize) -> String {
    let mut s = format!("Tool output for step {turn} of session {session}:\n");
    for i in 0..12 {
        s.push_str(&format!("line {i}: value={} status=ok path=/src/mod_{i}.rs\n", session * 131 + turn * 17 + i));
    }
    s
}

const SYSTEM: &str = "You are a careful software engineering agent. You work in a sandboxed repository, \
run tools one at a time, read their output, and finish with a short summary of the change you made. \
Think step by step; prefer small, verifiable edits; never invent file contents you have not read.";

/// What one target is called with.
#[derive(Clone)]
struct Target {
    name: &'static str,
    /// The chat endpoint for a session id.
    base: String,
    direct: bool,
}

impl Target {
    fn url(&self, sid: &str) -> String {
        if self.direct {
            format!("{}/v1/chat/completions", self.base)
        } else {
            format!("{}/sessions/{sid}/v1/chat/completions", self.base)
        }
    }
}

struct RunResult {
    calls: usize,
    wall_s: f64,
    latencies_ms: Vec<f64>,
    cpu_s: Option<f64>,
    sessions: Vec<(String, Vec<Value>)>,
}

async fn conversation(
    client: &reqwest::Client,
    target: &Target,
    sid: &str,
    session: usize,
    turns: usize,
    max_tokens: usize,
    latencies: &mut Vec<f64>,
) -> Res<Vec<Value>> {
    let mut messages = vec![
        json!({"role": "system", "content": SYSTEM}),
        json!({"role": "user", "content": format!("Fix the failing test in crate {session}; the CI log follows.\n{}", tool_result(session, 0))}),
    ];
    let mut bodies = Vec::with_capacity(turns);
    for turn in 0..turns {
        let mut body =
            json!({"model": "mock-model", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0});
        if target.direct {
            // What a gateway injects, so the mock does the same work.
            body["logprobs"] = json!(true);
            body["return_token_ids"] = json!(true);
        }
        let text = body.to_string();
        let started = Instant::now();
        let resp = client
            .post(target.url(sid))
            .header("content-type", "application/json")
            .body(text)
            .send()
            .await
            .map_err(|e| format!("{}: call failed: {e}", target.name))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| format!("{}: reading the answer: {e}", target.name))?;
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
        if !status.is_success() {
            return Err(format!("{}: HTTP {status}: {}", target.name, String::from_utf8_lossy(&bytes)));
        }
        let answer: Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: answer not JSON: {e}", target.name))?;
        let content = answer["choices"][0]["message"]["content"].as_str().unwrap_or("").to_owned();
        bodies.push(body);
        messages.push(json!({"role": "assistant", "content": content}));
        messages.push(json!({"role": "user", "content": tool_result(session, turn + 1)}));
    }
    Ok(bodies)
}

async fn run_load(target: &Target, sessions: usize, args: &Args, pid: Option<u32>, tag: &str) -> Res<RunResult> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(sessions * 2)
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    // Warm up: one conversation, not measured.
    let mut scratch = Vec::new();
    conversation(&client, target, &format!("warm-{tag}"), 0, 2, args.completion_tokens, &mut scratch).await?;
    let per_session = args.calls.div_ceil(sessions).div_ceil(args.turns).max(1);
    let next = Arc::new(AtomicUsize::new(0));
    let cpu0 = pid.map(cpu_seconds).transpose()?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let (client, target, next) = (client.clone(), target.clone(), next.clone());
        let (turns, max_tokens, tag) = (args.turns, args.completion_tokens, tag.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut convs = Vec::new();
            for _ in 0..per_session {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let sid = format!("bench-{tag}-{k}");
                let bodies = conversation(&client, &target, &sid, s, turns, max_tokens, &mut lat).await?;
                convs.push((sid, bodies));
            }
            Ok::<_, String>((lat, convs))
        }));
    }
    let mut latencies_ms = Vec::new();
    let mut all = Vec::new();
    for t in tasks {
        let (lat, convs) = t.await.map_err(|e| format!("load task failed: {e}"))??;
        latencies_ms.extend(lat);
        all.extend(convs);
    }
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = match (pid, cpu0) {
        (Some(pid), Some(c0)) => Some(cpu_seconds(pid)? - c0),
        _ => None,
    };
    Ok(RunResult { calls: latencies_ms.len(), wall_s, latencies_ms, cpu_s, sessions: all })
}

/// Flush, then read every session back and compare each trace's tokens with
/// what the mock sent for that request.
async fn verify(target: &Target, run: &RunResult) -> Res<()> {
    let client = reqwest::Client::new();
    let flushed = client.post(format!("{}/admin/flush", target.base)).send().await.map_err(|e| e.to_string())?;
    if !flushed.status().is_success() {
        return Err(format!("{}: flush answered {}", target.name, flushed.status()));
    }
    for (sid, bodies) in &run.sessions {
        let resp =
            client.get(format!("{}/sessions/{sid}/traces", target.base)).send().await.map_err(|e| e.to_string())?;
        let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
        let traces: Vec<Value> =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: traces of {sid}: {e}", target.name))?;
        if traces.len() != bodies.len() {
            return Err(format!(
                "{}: session {sid} has {} traces, {} calls were made",
                target.name,
                traces.len(),
                bodies.len()
            ));
        }
        for (i, (trace, body)) in traces.iter().zip(bodies).enumerate() {
            let plan = trajlog_serve::mock::plan(body, "");
            let ids: Vec<u32> =
                serde_json::from_value(trace["completion_token_ids"].clone()).map_err(|e| e.to_string())?;
            let lps: Vec<f64> = serde_json::from_value(trace["logprobs"].clone()).map_err(|e| e.to_string())?;
            let want: Vec<f64> = plan.logprobs.iter().filter_map(|t| t.parse().ok()).collect();
            let same_lps = lps.len() == want.len() && lps.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            if ids != plan.completion_token_ids || !same_lps {
                return Err(format!(
                    "{}: session {sid} call {i}: tokens or logprobs differ from what the mock sent",
                    target.name
                ));
            }
        }
    }
    Ok(())
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i.min(sorted.len() - 1)).copied().unwrap_or(f64::NAN)
}

struct Row {
    target: &'static str,
    sessions: usize,
    calls: usize,
    calls_per_s: f64,
    p50: f64,
    p99: f64,
    cpu_ms_per_call: Option<f64>,
    verified: bool,
}

pub(crate) fn run(args: &Args) -> trajlog::Result<i32> {
    match run_inner(args) {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("trajlog bench-gateway: error: {e}");
            Ok(2)
        }
    }
}

fn run_inner(args: &Args) -> Res<()> {
    if args.turns == 0 || args.calls == 0 || args.sessions.is_empty() || args.sessions.contains(&0) {
        return Err("--turns, --calls and every --sessions value must be at least 1".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the trajlog binary: {e}"))?;
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tmp = tempdir(args.dir.as_deref())?;
    let mut mock_cmd = Command::new(&exe);
    mock_cmd.args(["mock-vllm", "--port", "0"]);
    let mock = spawn_listening(mock_cmd, "trajlog mock-vllm")?;
    let serve_cmd = |exe: &Path, store: &str, durability: &str| {
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--port", "0", "--durability", durability, "--log-level", "warn", "--store"])
            .arg(tmp.join(store))
            .arg("--worker")
            .arg(format!("{}/v1", mock.url));
        cmd
    };
    let serve = spawn_listening(serve_cmd(&exe, "store", "sync"), "trajlog serve")?;
    let mut gateways: Vec<(Target, Proc)> =
        vec![(Target { name: "trajlog serve", base: serve.url.clone(), direct: false }, serve)];
    if let Some(other) = &args.baseline_serve {
        let p = spawn_listening(serve_cmd(other, "store-baseline", "sync"), "the baseline trajlog serve")?;
        gateways.push((Target { name: "trajlog serve, baseline", base: p.url.clone(), direct: false }, p));
    }
    if args.async_serve {
        let p = spawn_listening(serve_cmd(&exe, "store-async", "async"), "trajlog serve --durability async")?;
        gateways.push((Target { name: "trajlog serve, async", base: p.url.clone(), direct: false }, p));
    }
    if let Some(python) = &args.rllm_python {
        for (name, store) in [("rLLM gateway, SQLite", "sqlite"), ("rLLM gateway, memory", "memory")] {
            let p = spawn_rllm(python, &repo, &tmp, &mock.url, store)?;
            gateways.push((Target { name, base: p.url.clone(), direct: false }, p));
        }
    }
    let direct = Target { name: "mock, direct", base: mock.url.clone(), direct: true };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio: {e}"))?;
    let mut rows = Vec::new();
    for &sessions in &args.sessions {
        eprintln!("bench-gateway: {sessions} concurrent sessions ...");
        let run = rt.block_on(run_load(&direct, sessions, args, None, &format!("direct-{sessions}")))?;
        rows.push(row(&direct, sessions, &run, false));
        for (target, proc) in &gateways {
            let tag = format!("{}-{sessions}", target.name.replace([' ', ','], ""));
            let run = rt.block_on(run_load(target, sessions, args, Some(proc.pid()), &tag))?;
            rt.block_on(verify(target, &run))?;
            rows.push(row(target, sessions, &run, true));
        }
    }
    drop(gateways);
    drop(mock);
    let _ = std::fs::remove_dir_all(&tmp);
    print_rows(&rows, args);
    Ok(())
}

fn row(target: &Target, sessions: usize, run: &RunResult, verified: bool) -> Row {
    let mut lat = run.latencies_ms.clone();
    lat.sort_by(f64::total_cmp);
    Row {
        target: target.name,
        sessions,
        calls: run.calls,
        calls_per_s: run.calls as f64 / run.wall_s,
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
        cpu_ms_per_call: run.cpu_s.map(|c| c * 1e3 / run.calls as f64),
        verified,
    }
}

fn print_rows(rows: &[Row], args: &Args) {
    let direct = |s: usize| rows.iter().find(|r| r.sessions == s && r.target == "mock, direct");
    if args.json {
        let out: Vec<Value> = rows
            .iter()
            .map(|r| {
                let d = direct(r.sessions);
                json!({
                    "target": r.target, "sessions": r.sessions, "calls": r.calls,
                    "calls_per_s": r.calls_per_s, "p50_ms": r.p50, "p99_ms": r.p99,
                    "added_p50_ms": d.map(|d| r.p50 - d.p50), "added_p99_ms": d.map(|d| r.p99 - d.p99),
                    "gateway_cpu_ms_per_call": r.cpu_ms_per_call, "every_trace_exact": r.verified,
                })
            })
            .collect();
        println!("{}", Value::Array(out));
        return;
    }
    println!(
        "chat calls, {} turns per session, {} completion tokens with logprobs, growing history; durable capture{}",
        args.turns,
        args.completion_tokens,
        if args.async_serve { " (async: answered before durable, made durable by the next group commit)" } else { "" }
    );
    println!(
        "{:<24} {:>8} {:>7} {:>9} {:>8} {:>8} {:>10} {:>10} {:>10} {:>6}",
        "target", "sessions", "calls", "calls/s", "p50 ms", "p99 ms", "added p50", "added p99", "CPU ms/call", "exact"
    );
    for r in rows {
        let d = direct(r.sessions);
        let added =
            |f: fn(&Row) -> f64| d.filter(|_| r.target != "mock, direct").map(|d| format!("{:.3}", f(r) - f(d)));
        println!(
            "{:<24} {:>8} {:>7} {:>9.0} {:>8.3} {:>8.3} {:>10} {:>10} {:>10} {:>6}",
            r.target,
            r.sessions,
            r.calls,
            r.calls_per_s,
            r.p50,
            r.p99,
            added(|r| r.p50).unwrap_or_else(|| "-".into()),
            added(|r| r.p99).unwrap_or_else(|| "-".into()),
            r.cpu_ms_per_call.map(|c| format!("{c:.3}")).unwrap_or_else(|| "-".into()),
            if r.verified { "yes" } else { "-" }
        );
    }
}

fn tempdir(base: Option<&Path>) -> Res<PathBuf> {
    let base = base.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("trajlog-bench-gateway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}
