//! A long-lived writer's memory: what a process that keeps one store open
//! for writing (`trajlog serve`, the Python backend of a trainer) holds as
//! it appends and compacts, round after round (issue "The engine at
//! production scale": memory must not grow with history).
//!
//! ```text
//! cargo run --release --example long_writer -- DIR [--rounds 40] [--sessions 12500] [--probe]
//! ```
//!
//! DIR is a new store, or an existing one (a store made by `trajlog
//! generate`, say: its sessions are left alone). Each round appends `--sessions`
//! sessions of 8 tiny calls (16-token first prompts, 8-token completions
//! and turns, as `benches/scale.sh` with `TINY=1`), seals them, flushes and
//! compacts. After each round it prints the round, the calls written so
//! far, the compaction's time, the index's layers (live calls, how many of
//! them are in the frozen layer) and this process's `RssAnon` (the heap and
//! other anonymous memory, from /proc/self/status; Linux).
//!
//! With `--probe`, a thread appends one tiny call every 2 ms during each
//! compaction and waits for it to be durable (`Receipt::wait`, group
//! commit): the slowest of those waits and their 99th percentile say how
//! long the compaction held appends up (the writer thread does a
//! publication's last steps, appends queued meanwhile). Its calls go to a
//! session of their own, sealed after the round.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
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
    let probe = args.iter().any(|a| a == "--probe");
    let store = Store::open(&dir, Options::default())?;
    if probe {
        println!("| round | calls written | compaction s | live calls | frozen calls | RssAnon MB | appends during it | slowest append ms | p99 append ms |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    } else {
        println!("| round | calls written | compaction s | live calls | frozen calls | RssAnon MB |");
        println!("|---:|---:|---:|---:|---:|---:|");
    }
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
        let stop = AtomicBool::new(false);
        let probe_session = format!("probe-{round}");
        let (compacted, mut waits) = std::thread::scope(|scope| {
            let prober = scope.spawn(|| probe_appends(&store, &probe_session, &stop, probe));
            let t = Instant::now();
            let compacted = store.compact(&CompactOptions::default()).map(|_| t.elapsed().as_secs_f64());
            stop.store(true, Ordering::Relaxed);
            (compacted, prober.join().unwrap_or_default())
        });
        let compact_s = compacted?;
        if probe {
            store.seal_session(&probe_session)?;
        }
        let layers = store.snapshot().index_layers();
        let row = format!(
            "| {} | {written} | {compact_s:.2} | {} | {} | {} |",
            round + 1,
            layers.calls,
            layers.frozen_calls,
            status_kb("RssAnon") / 1024
        );
        if probe {
            waits.sort_unstable();
            let ms = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
            let p99 = waits.get((waits.len() * 99 / 100).min(waits.len().saturating_sub(1)));
            println!("{row} {} | {:.1} | {:.1} |", waits.len(), ms(waits.last()), ms(p99));
        } else {
            println!("{row}");
        }
    }
    store.close()
}

/// With `on`: until `stop`, one tiny call of `session` every 2 ms, each
/// waited for until durable; the waits.
fn probe_appends(store: &Store, session: &str, stop: &AtomicBool, on: bool) -> Vec<Duration> {
    let mut waits = Vec::new();
    let mut n = 0u32;
    while on && !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let call = Call {
            trace_id: format!("{session}/{n}"),
            session_id: session.to_owned(),
            timestamp: f64::from(n),
            prompt_token_ids: vec![1, 2, 3, 4],
            completion_token_ids: vec![5, 6],
            logprobs: Some(vec![-0.5; 2]),
            ..Default::default()
        };
        if store.append(call).and_then(|r| r.wait()).is_err() {
            break;
        }
        waits.push(t.elapsed());
        n += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    waits
}
