//! A long-lived writer's memory: what a process that keeps one store open
//! for writing (`trajlog serve`, the Python backend of a trainer) holds as
//! it appends and compacts, round after round (issue "The engine at
//! production scale": memory must not grow with history).
//!
//! ```text
//! cargo run --release --example long_writer -- DIR [--rounds 40] [--sessions 12500]
//! ```
//!
//! DIR must not exist (or be empty). Each round appends `--sessions`
//! sessions of 8 tiny calls (16-token first prompts, 8-token completions
//! and turns, as `benches/scale.sh` with `TINY=1`), seals them, flushes and
//! compacts. After each round it prints the round, the calls written so
//! far, the compaction's time, the index's layers (live calls, how many of
//! them are in the frozen layer) and this process's `RssAnon` (the heap and
//! other anonymous memory, from /proc/self/status; Linux).

use std::time::Instant;
use trajlog::{Call, CompactOptions, Options, Store};

/// A field of /proc/self/status in kB (0 where there is none).
fn status_kb(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() -> trajlog::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().cloned() else {
        eprintln!("usage: long_writer DIR [--rounds N] [--sessions N]");
        std::process::exit(2);
    };
    let value = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (rounds, sessions) = (value("--rounds", 40), value("--sessions", 12_500));
    let store = Store::open(&dir, Options::default())?;
    println!("| round | calls written | compaction s | live calls | frozen calls | RssAnon MB |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut written = 0u64;
    for round in 0..rounds {
        for s in 0..sessions {
            let session = format!("round-{round}/task-{s}:0");
            let mut prompt: Vec<u32> = (0..16).map(|t| (s * 16 + t) as u32 % 50_000).collect();
            for step in 0..8u32 {
                let completion: Vec<u32> = (0..8).map(|t| 1000 + step * 8 + t).collect();
                store.append(Call {
                    trace_id: format!("{session}/{step}"),
                    session_id: session.clone(),
                    timestamp: (round * sessions * 8 + s * 8) as f64 + f64::from(step),
                    prompt_token_ids: prompt.clone(),
                    logprobs: Some(vec![-0.5; completion.len()]),
                    completion_token_ids: completion.clone(),
                    ..Default::default()
                })?;
                // The next turn extends this one: the completion and an
                // 8-token tool result.
                prompt.extend(&completion);
                prompt.extend((0..8).map(|t| 2000 + step * 8 + t));
                written += 1;
            }
            store.seal_session(&session)?;
        }
        store.flush()?;
        let t = Instant::now();
        store.compact(&CompactOptions::default())?;
        let compact_s = t.elapsed().as_secs_f64();
        let layers = store.snapshot().index_layers();
        println!(
            "| {} | {written} | {compact_s:.2} | {} | {} | {} |",
            round + 1,
            layers.calls,
            layers.frozen_calls,
            status_kb("RssAnon") / 1024
        );
    }
    store.close()
}
