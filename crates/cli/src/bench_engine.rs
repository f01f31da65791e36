//! `trajlog bench`: one realistic multi-turn agent workload, run in the same
//! invocation against trajlog and two SQLite baselines.
//!
//! The calls come from `trajlog-sim` in the chosen [`Shape`]: by default the
//! record rLLM's gateway stores per call (chat history with tool calls, raw
//! request, vLLM's raw response); `lean` for calls that carry little besides
//! their tokens.
//!
//! * **trajlog**: `Store::append` per call at the chosen durability (at
//!   `group`, the writer fsyncs every 5 ms while records wait), one `flush` at
//!   the end — the barrier a trainer calls after a batch of rollouts.
//! * **sqlite-rllm** — SQLite the way rLLM's gateway stores traces: one JSON
//!   text blob per trace (the gateway dict), a `trace_sessions` junction
//!   table, WAL, `synchronous=NORMAL`, a commit per trace. The JSON is written
//!   in Rust (faster than Python's `json.dumps`), so this baseline is kinder
//!   to SQLite than rLLM in Python is: for the gateway shapes the gateway's
//!   record as it stores it (`trajlog_sim::gateway_json`: its key order,
//!   floats as Python writes them), for the lean shape trajlog's export.
//! * **sqlite-blob** — SQLite at its best: ids and logprobs as little-endian
//!   BLOBs, the call's documents (messages, response message, metadata, raw
//!   bodies, …) as one JSON text, an index on (session, time), WAL,
//!   `synchronous=NORMAL`, one transaction per session.
//!
//! Every backend gets the same calls, built before any timing. Append latency
//! is the time of one append (for SQLite: encoding, statements and — for
//! sqlite-rllm — the commit); throughput includes the flushes/commits.
//! "Offered" MB/s counts the logical token payload (every prompt in full,
//! completion and logprobs, 4 bytes each); "written" MB/s counts the bytes the
//! backend left on disk. Session read reads every session back, oldest first,
//! into full prompt, completion and logprob vectors.

use rusqlite::{params, Connection};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;
use trajlog::{Call, Durability, Error, Options, Result, Store};
use trajlog_sim::{simulate_session, Shape, SimConfig};

/// The workload and where to run it.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub sessions: usize,
    pub steps: usize,
    /// Tokens of each task's first prompt (later prompts grow turn by turn).
    pub prompt_tokens: usize,
    /// Mean completion length (uniform in [C/2, 3C/2)).
    pub completion_tokens: usize,
    pub durability: Durability,
    pub seed: u64,
    /// What each call carries besides its tokens.
    pub shape: Shape,
    /// Parent of the three stores (a fresh subdirectory is made in it).
    pub dir: PathBuf,
}

/// One backend's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BackendResult {
    pub backend: String,
    pub durability: String,
    pub calls: u64,
    pub seconds: f64,
    pub calls_per_s: f64,
    pub offered_mb_per_s: f64,
    pub written_mb_per_s: f64,
    pub append_p50_us: f64,
    pub append_p99_us: f64,
    pub bytes_on_disk: u64,
    pub read_seconds: f64,
    /// Every session read back into full prompt, completion and logprob vectors.
    pub read_mb_per_s: f64,
    /// trajlog only: the session read as zero-copy views of the stored tokens
    /// (prompt suffixes, completions, logprobs), credited with the same payload.
    pub view_read_mb_per_s: Option<f64>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The simulator's shape (`gateway`, `gateway-streaming`, `lean`).
    pub shape: String,
    /// What the calls weigh as the JSON text rLLM stores, one blob per call.
    pub json_bytes: u64,
    pub sessions: usize,
    pub steps: usize,
    pub calls: u64,
    pub token_bytes: u64,
    pub backends: Vec<BackendResult>,
}

fn sql(e: rusqlite::Error) -> Error {
    Error::invalid("sqlite baseline", e.to_string())
}

fn token_bytes(c: &Call) -> u64 {
    4 * (c.prompt_token_ids.len() + c.completion_token_ids.len() + c.logprobs.as_ref().map_or(0, Vec::len)) as u64
}

fn percentile(sorted_ns: &[u64], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() - 1) as f64 * p).round() as usize;
    sorted_ns[i.min(sorted_ns.len() - 1)] as f64 / 1000.0
}

fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Progress hooks: `(phase, done, total)`.
pub type Progress<'a> = &'a mut dyn FnMut(&str, u64, u64);

struct Timing {
    lat_ns: Vec<u64>,
    started: Instant,
}

impl Timing {
    fn new(n: usize) -> Self {
        Self { lat_ns: Vec::with_capacity(n), started: Instant::now() }
    }
    fn time<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = f()?;
        self.lat_ns.push(t.elapsed().as_nanos() as u64);
        Ok(out)
    }
    /// `seconds`: the appends with their flushes or commits (not the read).
    fn finish(
        mut self,
        backend: &str,
        durability: &str,
        seconds: f64,
        token_bytes: u64,
        disk: u64,
        read_seconds: f64,
    ) -> BackendResult {
        self.lat_ns.sort_unstable();
        let calls = self.lat_ns.len() as u64;
        BackendResult {
            backend: backend.to_owned(),
            durability: durability.to_owned(),
            calls,
            seconds,
            calls_per_s: calls as f64 / seconds,
            offered_mb_per_s: token_bytes as f64 / seconds / 1e6,
            written_mb_per_s: disk as f64 / seconds / 1e6,
            append_p50_us: percentile(&self.lat_ns, 0.50),
            append_p99_us: percentile(&self.lat_ns, 0.99),
            bytes_on_disk: disk,
            read_seconds,
            read_mb_per_s: token_bytes as f64 / read_seconds / 1e6,
            view_read_mb_per_s: None,
        }
    }
}

/// Run the workload against the three backends.
pub fn run(cfg: &BenchConfig, progress: Progress<'_>) -> Result<BenchReport> {
    if cfg.sessions == 0 || cfg.steps == 0 {
        return Err(Error::invalid("sessions/steps", "must be at least 1"));
    }
    let sim = SimConfig {
        sessions: cfg.sessions,
        steps: cfg.steps,
        system_tokens: cfg.prompt_tokens,
        completion_tokens: (
            cfg.completion_tokens / 2,
            (cfg.completion_tokens * 3 / 2).max(cfg.completion_tokens / 2 + 1),
        ),
        seed: cfg.seed,
        shape: cfg.shape,
        ..SimConfig::default()
    };
    let sessions: Vec<(String, Vec<Call>)> = (0..cfg.sessions)
        .map(|s| {
            let ss = simulate_session(&sim, s);
            (ss.session_id, ss.calls)
        })
        .collect();
    let calls: u64 = sessions.iter().map(|s| s.1.len() as u64).sum();
    let payload: u64 = sessions.iter().flat_map(|s| &s.1).map(token_bytes).sum();
    let json_bytes: u64 = sessions.iter().flat_map(|s| &s.1).map(|c| cfg.shape.trace_json(c).len() as u64).sum();
    let root = cfg.dir.join(format!("trajlog-bench-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| Error::io(format!("create {}", root.display()), e))?;
    let result = (|| {
        let t = run_trajlog(&root.join("trajlog"), cfg.durability, &sessions, calls, payload, progress)?;
        let a = run_sqlite_rllm(&root.join("rllm.db"), cfg.shape, &sessions, calls, payload, progress)?;
        let b = run_sqlite_blob(&root.join("blob.db"), &sessions, calls, payload, progress)?;
        Ok(BenchReport {
            shape: cfg.shape.name().to_owned(),
            json_bytes,
            sessions: cfg.sessions,
            steps: cfg.steps,
            calls,
            token_bytes: payload,
            backends: vec![t, a, b],
        })
    })();
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn run_trajlog(
    dir: &Path,
    durability: Durability,
    sessions: &[(String, Vec<Call>)],
    calls: u64,
    payload: u64,
    progress: Progress<'_>,
) -> Result<BackendResult> {
    let store = Store::open(dir, Options::default().durability(durability))?;
    // `append` takes calls by value: copy them before the clock starts (the
    // SQLite baselines encode from a borrow).
    let owned: Vec<Vec<Call>> = sessions.iter().map(|s| s.1.clone()).collect();
    let mut timing = Timing::new(calls as usize);
    let mut done = 0;
    for session in owned {
        for call in session {
            timing.time(|| store.append(call))?;
            done += 1;
        }
        progress("trajlog append", done, calls);
    }
    // The trainer's barrier after a batch of rollouts; meanwhile group commit
    // has fsynced every few milliseconds.
    store.flush()?;
    let appended = timing.started.elapsed().as_secs_f64();
    let t = Instant::now();
    let snap = store.snapshot();
    let mut check = 0u64;
    for (i, (sid, _)) in sessions.iter().enumerate() {
        for c in snap.session(sid, None, None)? {
            check += c.prompt()?.len() as u64 + c.completion_token_ids().len() as u64;
            check += c.logprobs().map_or(0, |l| l.len() as u64);
        }
        progress("trajlog read", i as u64 + 1, sessions.len() as u64);
    }
    verify_count(check, payload)?;
    let read = t.elapsed().as_secs_f64();
    // The zero-copy read a trainer that merges turns does: every call's
    // stored prompt suffix, completion and logprobs as slices of the mapping
    // (a full prompt is its parent's context plus its suffix).
    let t = Instant::now();
    let mut touched = 0u64;
    for (sid, _) in sessions {
        for c in snap.session(sid, None, None)? {
            touched += (c.prompt_prefix_len() + c.prompt_suffix().len() + c.completion_token_ids().len()) as u64;
            touched += c.logprobs().map_or(0, |l| l.len() as u64);
        }
    }
    verify_count(touched, payload)?;
    let view_read = t.elapsed().as_secs_f64();
    drop(snap);
    store.close()?;
    let disk = dir_bytes(dir);
    let mut r = timing.finish("trajlog", durability_name(durability), appended, payload, disk, read);
    r.view_read_mb_per_s = Some(payload as f64 / view_read / 1e6);
    Ok(r)
}

fn durability_name(d: Durability) -> &'static str {
    match d {
        Durability::Buffered => "buffered",
        Durability::Group => "group",
        Durability::Sync => "sync",
    }
}

fn verify_count(tokens_read: u64, payload: u64) -> Result<()> {
    if tokens_read * 4 != payload {
        return Err(Error::invalid("bench", format!("read back {} token bytes, wrote {payload}", tokens_read * 4)));
    }
    Ok(())
}

fn open_sqlite(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path).map_err(sql)?;
    conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0)).map_err(sql)?;
    conn.execute_batch("PRAGMA synchronous=NORMAL; PRAGMA temp_store=MEMORY; PRAGMA foreign_keys=ON;").map_err(sql)?;
    Ok(conn)
}

fn sqlite_disk(path: &Path) -> u64 {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let Some(parent) = path.parent() else { return 0 };
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// The fields a trainer takes from a trace dict.
#[derive(serde::Deserialize)]
struct TraceTokens {
    prompt_token_ids: Vec<u32>,
    completion_token_ids: Vec<u32>,
    #[serde(default)]
    logprobs: Option<Vec<f32>>,
}

fn run_sqlite_rllm(
    path: &Path,
    shape: Shape,
    sessions: &[(String, Vec<Call>)],
    calls: u64,
    payload: u64,
    progress: Progress<'_>,
) -> Result<BackendResult> {
    let conn = open_sqlite(path)?;
    conn.execute_batch(
        "CREATE TABLE traces (trace_id TEXT PRIMARY KEY, data TEXT NOT NULL, created_at REAL NOT NULL);
         CREATE TABLE trace_sessions (trace_id TEXT NOT NULL, session_id TEXT NOT NULL, run_id TEXT NOT NULL DEFAULT '',
           created_at REAL NOT NULL, PRIMARY KEY (trace_id, session_id),
           FOREIGN KEY (trace_id) REFERENCES traces(trace_id) ON DELETE CASCADE);
         CREATE INDEX idx_ts_session_time ON trace_sessions(session_id, created_at ASC);
         CREATE INDEX idx_traces_time ON traces(created_at);",
    )
    .map_err(sql)?;
    let mut timing = Timing::new(calls as usize);
    let mut done = 0;
    for (_, session) in sessions {
        for call in session {
            timing.time(|| {
                // What rLLM's store_trace does: encode the dict, two statements, one commit.
                let data = shape.trace_json(call);
                let now = call.timestamp;
                let tx = conn.unchecked_transaction().map_err(sql)?;
                tx.prepare_cached(
                    "INSERT OR REPLACE INTO traces (trace_id, data, created_at) VALUES (?1, ?2, \
                     COALESCE((SELECT created_at FROM traces WHERE trace_id = ?1), ?3))",
                )
                .and_then(|mut st| st.execute(params![call.trace_id, data, now]))
                .map_err(sql)?;
                tx.prepare_cached(
                    "INSERT OR IGNORE INTO trace_sessions (trace_id, session_id, run_id, created_at) VALUES (?1, ?2, '', \
                     COALESCE((SELECT created_at FROM traces WHERE trace_id = ?1), ?3))",
                )
                .and_then(|mut st| st.execute(params![call.trace_id, call.session_id, now]))
                .map_err(sql)?;
                tx.commit().map_err(sql)
            })?;
            done += 1;
        }
        progress("sqlite-rllm append", done, calls);
    }
    let appended = timing.started.elapsed().as_secs_f64();
    let query = "SELECT t.data FROM traces t INNER JOIN trace_sessions ts ON t.trace_id = ts.trace_id \
                 WHERE ts.session_id = ?1 ORDER BY ts.created_at ASC";
    let read = read_sqlite(&conn, query, sessions, payload, "sqlite-rllm read", progress, |row| {
        let text: String = row.get(0).map_err(sql)?;
        let tr: TraceTokens = serde_json::from_str(&text).map_err(|e| Error::invalid("sqlite data", e))?;
        Ok((tr.prompt_token_ids.len() + tr.completion_token_ids.len() + tr.logprobs.map_or(0, |l| l.len())) as u64)
    })?;
    conn.close().map_err(|(_, e)| sql(e))?;
    let disk = sqlite_disk(path);
    Ok(timing.finish("sqlite-rllm", "WAL NORMAL, commit per trace", appended, payload, disk, read))
}

/// Read every session back through `query` (its calls, oldest first);
/// `decode` turns a row into vectors and returns its token count. Returns the
/// seconds taken; fails unless the whole payload came back.
fn read_sqlite(
    conn: &Connection,
    query: &str,
    sessions: &[(String, Vec<Call>)],
    payload: u64,
    phase: &str,
    progress: Progress<'_>,
    mut decode: impl FnMut(&rusqlite::Row<'_>) -> Result<u64>,
) -> Result<f64> {
    let t = Instant::now();
    let mut st = conn.prepare(query).map_err(sql)?;
    let mut check = 0u64;
    for (i, (sid, _)) in sessions.iter().enumerate() {
        let mut rows = st.query(params![sid]).map_err(sql)?;
        while let Some(row) = rows.next().map_err(sql)? {
            check += decode(row)?;
        }
        progress(phase, i as u64 + 1, sessions.len() as u64);
    }
    verify_count(check, payload)?;
    Ok(t.elapsed().as_secs_f64())
}

/// A call's documents (messages, response message, metadata and the fields
/// without a column, such as the raw bodies) verbatim, as one JSON object;
/// None when it has none.
fn documents(call: &Call) -> Option<String> {
    let mut out = String::new();
    for (name, doc) in [
        ("messages", &call.messages),
        ("response_message", &call.response_message),
        ("metadata", &call.metadata),
        ("extra", &call.extra),
    ] {
        if let Some(doc) = doc {
            out.push(if out.is_empty() { '{' } else { ',' });
            out.push_str(&format!("\"{name}\":"));
            out.push_str(&String::from_utf8_lossy(doc));
        }
    }
    (!out.is_empty()).then(|| out + "}")
}

fn le_bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn run_sqlite_blob(
    path: &Path,
    sessions: &[(String, Vec<Call>)],
    calls: u64,
    payload: u64,
    progress: Progress<'_>,
) -> Result<BackendResult> {
    let mut conn = open_sqlite(path)?;
    conn.execute_batch(
        "CREATE TABLE calls (trace_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, ts REAL NOT NULL,
           prompt BLOB NOT NULL, completion BLOB NOT NULL, logprobs BLOB, meta TEXT);
         CREATE INDEX idx_calls_session ON calls(session_id, ts);",
    )
    .map_err(sql)?;
    let mut timing = Timing::new(calls as usize);
    let mut done = 0;
    for (_, session) in sessions {
        let tx = conn.transaction().map_err(sql)?;
        for call in session {
            timing.time(|| {
                let mut st = tx
                    .prepare_cached(
                        "INSERT OR REPLACE INTO calls (trace_id, session_id, ts, prompt, completion, logprobs, meta) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                    )
                    .map_err(sql)?;
                let meta = documents(call);
                st.execute(params![
                    call.trace_id,
                    call.session_id,
                    call.timestamp,
                    le_bytes_u32(&call.prompt_token_ids),
                    le_bytes_u32(&call.completion_token_ids),
                    call.logprobs.as_deref().map(le_bytes_f32),
                    meta,
                ])
                .map_err(sql)?;
                Ok(())
            })?;
            done += 1;
        }
        tx.commit().map_err(sql)?;
        progress("sqlite-blob append", done, calls);
    }
    let appended = timing.started.elapsed().as_secs_f64();
    let query = "SELECT prompt, completion, logprobs FROM calls WHERE session_id = ?1 ORDER BY ts ASC";
    let read = read_sqlite(&conn, query, sessions, payload, "sqlite-blob read", progress, |row| {
        let blob = |i: usize| -> Result<Option<&[u8]>> {
            row.get_ref(i).map_err(sql)?.as_blob_or_null().map_err(|e| sql(e.into()))
        };
        let to_u32 = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let ids = |i: usize| blob(i)?.map(to_u32).ok_or_else(|| Error::invalid("sqlite data", "NULL token ids"));
        let (prompt, completion) = (ids(0)?, ids(1)?);
        let logprobs: Option<Vec<f32>> =
            blob(2)?.map(|b| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
        Ok((prompt.len() + completion.len()) as u64 + logprobs.map_or(0, |l| l.len() as u64))
    })?;
    conn.close().map_err(|(_, e)| sql(e))?;
    let disk = sqlite_disk(path);
    Ok(timing.finish("sqlite-blob", "WAL NORMAL, commit per session", appended, payload, disk, read))
}
