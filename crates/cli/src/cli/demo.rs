//! `trajlog demo`: the main job on an embedded default.

use super::human_bytes;
use std::path::PathBuf;
use std::time::Instant;
use trajlog::{Call, CallView, CompactOptions, Durability, Options, Relation, Store};
use trajlog_sim::{simulate, Shape, SimConfig};

/// Whether `view` holds every non-token field of `want` exactly (documents byte for byte).
fn same_documents(view: &CallView<'_>, want: &Call) -> trajlog::Result<bool> {
    let got = view.to_call_without_tokens()?;
    Ok(got.trace_id == want.trace_id
        && got.session_id == want.session_id
        && got.timestamp.to_bits() == want.timestamp.to_bits()
        && got.model == want.model
        && got.weight_version == want.weight_version
        && got.finish_reason == want.finish_reason
        && got.latency_ms.map(f64::to_bits) == want.latency_ms.map(f64::to_bits)
        && got.messages == want.messages
        && got.response_message == want.response_message
        && got.metadata == want.metadata
        && got.extra == want.extra)
}

pub fn run(dir: Option<PathBuf>, sessions: usize, steps: usize, shape: Shape) -> trajlog::Result<i32> {
    let dir = match dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!(
            "trajlog-demo-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
        )),
    };
    if dir.exists() && std::fs::read_dir(&dir).map(|mut d| d.next().is_some()).unwrap_or(false) {
        eprintln!("trajlog demo: {} is not empty; give --dir a new or empty directory", dir.display());
        return Ok(2);
    }
    if sessions == 0 || steps == 0 {
        eprintln!("trajlog demo: --sessions and --steps must be at least 1");
        return Ok(2);
    }
    let cfg = SimConfig { sessions, steps, shape, ..SimConfig::default() };
    println!("trajlog demo: {sessions} simulated agent rollouts × {steps} calls (growing prompts, some with a retokenization break)");
    println!("shape: {shape} ({})", shape.describe());
    println!("store: {}", dir.display());
    let batch = simulate(&cfg);
    let calls: usize = batch.iter().map(|s| s.calls.len()).sum();
    let prompt_tokens: usize = batch.iter().flat_map(|s| &s.calls).map(|c| c.prompt_token_ids.len()).sum();
    let completion_tokens: usize = batch.iter().flat_map(|s| &s.calls).map(|c| c.completion_token_ids.len()).sum();
    // Logical size of the token payload: ids as u32 and logprobs as f32, every prompt in full.
    let logical = 4 * (prompt_tokens + 2 * completion_tokens) as u64;
    let json_bytes: u64 = batch.iter().flat_map(|s| &s.calls).map(|c| shape.trace_json(c).len() as u64).sum();

    let store = Store::open(&dir, Options::default().durability(Durability::Group))?;
    // Interleave sessions turn by turn, as concurrent rollouts arrive.
    let started = Instant::now();
    let mut last = None;
    for step in 0..steps {
        for s in &batch {
            if let Some(call) = s.calls.get(step) {
                last = Some(store.append(call.clone())?);
            }
        }
    }
    if let Some(r) = last {
        r.wait()?;
    }
    store.flush()?;
    let ingest_s = started.elapsed().as_secs_f64();
    for s in &batch {
        store.seal_session(&s.session_id)?;
    }
    store.flush()?;

    let snap = store.snapshot();
    let on_disk: u64 = snap.segments().iter().map(|s| s.data_bytes).sum();
    let read_started = Instant::now();
    let mut exact = 0usize;
    let mut mismatches = Vec::new();
    let mut breaks_found = Vec::new();
    for s in &batch {
        let got = snap.session(&s.session_id, None, None)?;
        for (i, (want, view)) in s.calls.iter().zip(&got).enumerate() {
            let same = view.trace_id() == want.trace_id
                && view.prompt()? == want.prompt_token_ids
                && view.completion_token_ids() == want.completion_token_ids.as_slice()
                && view.logprobs().map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                    == want.logprobs.as_ref().map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            if same {
                exact += 1;
            } else {
                mismatches.push(want.trace_id.clone());
            }
            if view.relation() == Relation::TitoBreak {
                breaks_found.push((s.session_id.clone(), i, view.divergence_position().unwrap_or(0)));
            }
        }
        if got.len() != s.calls.len() {
            mismatches.push(format!("{}: {} calls read, {} appended", s.session_id, got.len(), s.calls.len()));
        }
    }
    let read_s = read_started.elapsed().as_secs_f64();
    // Everything else, byte for byte (untimed: the figure above is the token read).
    let mut documents_exact = 0usize;
    for s in &batch {
        for (want, view) in s.calls.iter().zip(snap.session(&s.session_id, None, None)?) {
            if same_documents(&view, want)? {
                documents_exact += 1;
            } else {
                mismatches.push(format!("{}: documents", want.trace_id));
            }
        }
    }
    let injected: Vec<(String, usize, usize)> =
        batch.iter().filter_map(|s| s.injected_break.map(|(i, p)| (s.session_id.clone(), i, p))).collect();

    let mb = |b: u64| b as f64 / 1e6;
    println!();
    println!(
        "captured   {} sessions, {calls} calls, {:.2} M tokens ({:.2} M prompt, {:.2} M completion)",
        batch.len(),
        (prompt_tokens + completion_tokens) as f64 / 1e6,
        prompt_tokens as f64 / 1e6,
        completion_tokens as f64 / 1e6
    );
    println!(
        "ingest     {:.3} s: {:.0} calls/s, {:.0} MB/s of token payload (durability=group, acknowledged after fsync)",
        ingest_s,
        calls as f64 / ingest_s,
        mb(logical) / ingest_s
    );
    println!("logical    {} of token payload (u32 ids + f32 logprobs, every prompt in full)", human_bytes(logical));
    println!(
        "           {} as {} (one JSON blob per call)",
        human_bytes(json_bytes),
        if shape == Shape::Lean { "rLLM-style JSON text" } else { "the rLLM gateway's JSON text" }
    );
    println!(
        "on disk    {} in {} segment(s): {:.2}× the logical payload, {:.3}× the JSON (prefix-delta stores only new tokens)",
        human_bytes(on_disk),
        snap.segments().len(),
        on_disk as f64 / logical as f64,
        on_disk as f64 / json_bytes as f64
    );
    println!(
        "read back  {exact}/{calls} calls exact (prompts, completions, logprobs bit-for-bit) in {:.3} s ({:.0} MB/s of token payload)",
        read_s,
        mb(logical) / read_s
    );
    println!("           {documents_exact}/{calls} calls with every other field exact (messages, raw bodies, … byte-for-byte)");
    println!("TI/TO      {} breaks found, {} injected", breaks_found.len(), injected.len());
    for (session, call, pos) in breaks_found.iter().take(5) {
        let expected = injected.iter().any(|(s, c, p)| s == session && c == call && p == pos);
        println!(
            "           {session} call {call}: prompt diverges inside the previous completion at token {pos}{}",
            if expected { " (as injected)" } else { " (NOT injected!)" }
        );
    }

    // Compact the (sealed) sessions into Parquet shards, read everything back
    // again — now from the shards — and audit.
    drop(snap);
    let report = store.compact(&crate::progress::compact_progress(CompactOptions::default()))?;
    let snap = store.snapshot();
    let mut exact_after = 0usize;
    for s in &batch {
        for (want, view) in s.calls.iter().zip(snap.session(&s.session_id, None, None)?) {
            if view.is_compacted()
                && view.prompt()? == want.prompt_token_ids
                && view.completion_token_ids() == want.completion_token_ids.as_slice()
                && view.logprobs().map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                    == want.logprobs.as_ref().map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                && same_documents(&view, want)?
            {
                exact_after += 1;
            }
        }
    }
    let audit = trajlog::audit::audit(&snap)?;
    drop(snap);
    let secs = report.elapsed.as_secs_f64().max(1e-9);
    println!(
        "compacted  {} sessions into {} Parquet shards ({}) in {:.3} s ({:.0} MB/s of token payload); {} segment(s) retired",
        report.sessions,
        report.shards.len(),
        human_bytes(report.shard_bytes),
        secs,
        report.token_bytes as f64 / 1e6 / secs,
        report.retired_segments
    );
    println!("           {exact_after}/{calls} calls read back exact from the shards (tokens and every other field)");
    println!(
        "audit      {} sessions: {} TI/TO breaks in {} sessions, {} generated tokens a re-tokenizing trainer would have trained on wrongly",
        audit.sessions_checked, audit.breaks, audit.sessions_with_breaks, audit.tokens_wrong
    );
    let shards = dir.join("shards");
    println!();
    println!("shards:     {}/steps/part-*.parquet        (one row per call)", shards.display());
    println!(
        "            {}/trajectories/part-*.parquet (one row per TI/TO-consistent chain: token_ids, loss_mask, logprobs)",
        shards.display()
    );
    println!("read them:  python -c \"import pyarrow.dataset as ds; print(ds.dataset('{}/trajectories').to_table().num_rows)\"", shards.display());
    println!("            duckdb -c \"SELECT group_id, count(*), avg(len(token_ids)) FROM '{}/trajectories/part-*.parquet' GROUP BY 1\"", shards.display());
    println!();
    println!("look closer:  trajlog ls --store {0}\n              trajlog show --store {0} {1}\n              trajlog audit --store {0}\n              trajlog export --store {0} --session {1} | head -c 600\n              trajlog verify --store {0}", dir.display(), injected.first().map_or("task-0:0", |b| b.0.as_str()));
    store.close()?;
    let ok = mismatches.is_empty()
        && exact == calls
        && documents_exact == calls
        && exact_after == calls
        && breaks_found.len() == injected.len()
        && audit.breaks == injected.len();
    if !ok {
        eprintln!("trajlog demo: read-back check FAILED: {mismatches:?}");
        return Ok(1);
    }
    Ok(0)
}

/// What `trajlog generate` makes each session of.
pub struct GenerateShape {
    pub steps: usize,
    pub prompt_tokens: usize,
    /// Mean completion tokens (drawn from half to 1.5 times it); the
    /// simulator's default when `None`.
    pub completion_tokens: Option<usize>,
    /// Mean tokens added to the next prompt per turn; likewise.
    pub tool_tokens: Option<usize>,
    pub shape: Shape,
    /// Set a session reward on each session before sealing it.
    pub rewards: bool,
}

/// Half to 1.5 times `mean`, at least one token.
fn around(mean: usize) -> (usize, usize) {
    ((mean / 2).max(1), (mean + mean / 2).max(1))
}

/// `trajlog generate`: stream simulated sessions into a store.
pub fn generate(
    dir: &std::path::Path,
    range: std::ops::Range<usize>,
    g: GenerateShape,
    seed: u64,
) -> trajlog::Result<i32> {
    let sessions = range.len();
    let defaults = SimConfig::default();
    let cfg = SimConfig {
        sessions: range.end,
        steps: g.steps,
        system_tokens: g.prompt_tokens,
        completion_tokens: g.completion_tokens.map_or(defaults.completion_tokens, around),
        tool_tokens: g.tool_tokens.map_or(defaults.tool_tokens, around),
        seed,
        shape: g.shape,
        ..defaults
    };
    let shape = g.shape;
    let store = super::open_store(dir, Options::default().durability(Durability::Buffered), "generate")?;
    let started = Instant::now();
    let mut reported = Instant::now();
    let (mut calls, mut tokens) = (0u64, 0u64);
    for (done, s) in range.enumerate() {
        // Long runs say where they are (stderr, every 10 s).
        if reported.elapsed().as_secs() >= 10 {
            eprintln!(
                "generate: {done} of {sessions} sessions, {calls} calls, {:.0} s",
                started.elapsed().as_secs_f64()
            );
            reported = Instant::now();
        }
        let session = trajlog_sim::simulate_session(&cfg, s);
        if store.snapshot().is_sealed(&session.session_id) {
            return Err(trajlog::Error::invalid(
                "first_session",
                format!(
                    "session {:?} is already in {} and sealed; pass --first-session past the store's last generated session",
                    session.session_id,
                    dir.display()
                ),
            ));
        }
        for c in session.calls {
            tokens += (c.prompt_token_ids.len() + c.completion_token_ids.len()) as u64;
            calls += 1;
            store.append(c)?;
        }
        if g.rewards {
            // As a trainer scores each rollout: 1 for every other session.
            store.set_reward(trajlog::Target::Session(session.session_id.clone()), (s % 2) as f64)?;
        }
        store.seal_session(&session.session_id)?;
    }
    store.sync()?;
    let on_disk: u64 = store.snapshot().segments().iter().map(|s| s.data_bytes).sum();
    store.close()?;
    println!(
        "generated {sessions} sessions, {calls} calls ({shape} shape), {:.1} M tokens into {} ({} on disk) in {:.1} s",
        tokens as f64 / 1e6,
        dir.display(),
        human_bytes(on_disk),
        started.elapsed().as_secs_f64()
    );
    Ok(0)
}
