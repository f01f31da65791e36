//! `trajlog bench`: trajlog against two SQLite baselines, one workload, one table.

use crate::bench_engine::{BackendResult, BenchConfig, BenchReport};
use std::path::PathBuf;

pub struct BenchArgs {
    pub sessions: usize,
    pub steps: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub durability: String,
    pub seed: u64,
    pub dir: Option<PathBuf>,
    pub json: bool,
    pub shape: trajlog_sim::Shape,
}

pub fn run(args: &BenchArgs) -> trajlog::Result<i32> {
    let cfg = BenchConfig {
        sessions: args.sessions,
        steps: args.steps,
        prompt_tokens: args.prompt_tokens,
        completion_tokens: args.completion_tokens,
        durability: args.durability.parse()?,
        seed: args.seed,
        shape: args.shape,
        dir: args.dir.clone().unwrap_or_else(std::env::temp_dir),
    };
    let mut bar: Option<(String, indicatif::ProgressBar)> = None;
    let mut progress = |phase: &str, done: u64, total: u64| {
        if bar.as_ref().is_none_or(|(p, _)| p != phase) {
            if let Some((_, b)) = bar.take() {
                b.finish_and_clear();
            }
            if let Some(b) = crate::progress::bar(total, phase, "") {
                bar = Some((phase.to_owned(), b));
            }
        }
        if let Some((_, b)) = &bar {
            b.set_position(done);
        }
    };
    let report = crate::bench_engine::run(&cfg, &mut progress)?;
    if let Some((_, b)) = bar.take() {
        b.finish_and_clear();
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        print_table(&report, args);
    }
    Ok(0)
}

fn print_table(r: &BenchReport, args: &BenchArgs) {
    println!(
        "shape: {} ({}); {:.1} MB as the JSON text rLLM stores",
        args.shape,
        args.shape.describe(),
        r.json_bytes as f64 / 1e6
    );
    println!(
        "workload: {} sessions × {} steps = {} calls; first prompt {} tokens, growing each turn; completions ~{} tokens \
         with logprobs; {:.1} MB of token payload (every prompt in full)",
        r.sessions,
        r.steps,
        r.calls,
        args.prompt_tokens,
        args.completion_tokens,
        r.token_bytes as f64 / 1e6
    );
    println!();
    println!(
        "{:<12} {:<31} {:>9} {:>11} {:>11} {:>10} {:>10} {:>10} {:>10}",
        "backend", "durability", "calls/s", "offered MB/s", "written MB/s", "p50 µs", "p99 µs", "on disk", "read MB/s"
    );
    for b in &r.backends {
        println!(
            "{:<12} {:<31} {:>9.0} {:>12.1} {:>12.1} {:>10.1} {:>10.1} {:>10} {:>10.1}",
            b.backend,
            b.durability,
            b.calls_per_s,
            b.offered_mb_per_s,
            b.written_mb_per_s,
            b.append_p50_us,
            b.append_p99_us,
            crate::cli::human_bytes(b.bytes_on_disk),
            b.read_mb_per_s
        );
    }
    let Some(t) = r.backends.iter().find(|b| b.backend == "trajlog") else { return };
    if let Some(v) = t.view_read_mb_per_s {
        println!(
            "trajlog zero-copy session read (stored prompt suffixes, completions, logprobs as slices): {v:.1} MB/s of the same payload"
        );
    }
    println!();
    for base in r.backends.iter().filter(|b| b.backend != "trajlog") {
        println!("trajlog vs {}: {}", base.backend, ratios(t, base));
    }
}

fn ratios(t: &BackendResult, b: &BackendResult) -> String {
    format!(
        "{:.1}× calls/s, {:.1}× offered MB/s, {:.2}× bytes on disk, {:.1}× session read, p99 append {:.1}× lower",
        t.calls_per_s / b.calls_per_s,
        t.offered_mb_per_s / b.offered_mb_per_s,
        t.bytes_on_disk as f64 / b.bytes_on_disk as f64,
        t.read_mb_per_s / b.read_mb_per_s,
        b.append_p99_us / t.append_p99_us
    )
}
