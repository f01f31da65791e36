//! Prompt checkpoints (format-spec/record.md §4): what a checkpoint every K
//! records of a prefix-delta chain costs on disk and saves on a read of one
//! call. Run: `cargo bench --bench prompt_chain [-- CALLS]`.
//!
//! One agent session of CALLS calls (default 2,000): each prompt is the
//! previous call's context plus a 20-token tool result, each completion 50
//! tokens with logprobs; when the context would pass 32,768 tokens the agent
//! keeps its 512-token system prompt and the most recent half (a re-rendered
//! history: `diverges_earlier`, still a delta from the system prompt), as
//! agents with a bounded context window do. For each K (0 = no checkpoints,
//! the chains store formats before 6 wrote): the bytes of the token columns
//! on disk, and the median time to rebuild one call's prompt in a fresh
//! snapshot (`Snapshot::get(..).prompt()`) for the last call and the median
//! over 50 calls spread through the session. Setup is outside the timing.

use std::time::Instant;
use trajlog::{Call, Durability, Options, Store};
use trajlog_sim::Rng;

const WINDOW: usize = 32_768;
const SYSTEM: usize = 512;

fn session(calls: usize) -> Vec<Call> {
    let mut rng = Rng::new(11);
    let mut context = rng.tokens(SYSTEM);
    (0..calls)
        .map(|i| {
            context.extend(rng.tokens(20));
            if context.len() > WINDOW {
                let keep = context.split_off(context.len() - WINDOW / 2);
                context.truncate(SYSTEM);
                context.extend(keep);
            }
            let completion = rng.tokens(50);
            let call = Call {
                trace_id: format!("t{i}"),
                session_id: "agent".into(),
                timestamp: i as f64,
                prompt_token_ids: context.clone(),
                completion_token_ids: completion.clone(),
                logprobs: Some(rng.logprobs(50)),
                ..Default::default()
            };
            context.extend(completion);
            call
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2_000);
    let calls = session(n);
    let new_tokens: usize = calls.iter().map(|c| c.completion_token_ids.len() + 20).sum();
    println!("one session of {n} calls, context window {WINDOW} tokens; {new_tokens} new tokens in all");
    println!("{:>6} {:>14} {:>12} {:>14} {:>16}", "K", "token columns", "vs K=0", "last call µs", "spread calls µs");
    let mut base = 0u64;
    for k in [0u32, 256, 128, 64, 32, 16] {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = Options::default().durability(Durability::Buffered).prompt_chain_max(k);
        let store = Store::open(dir.path(), options).expect("open");
        for c in &calls {
            store.append(c.clone()).expect("append");
        }
        store.flush().expect("flush");
        let snap = store.snapshot();
        let mut bytes = 0u64;
        for c in &calls {
            let v = snap.get(&c.trace_id).expect("read").expect("present");
            bytes += 4 * (v.prompt_suffix().len() + v.completion_token_ids().len() * 2) as u64;
        }
        if k == 0 {
            base = bytes;
        }
        let time = |id: &str| {
            median(
                (0..7)
                    .map(|_| {
                        let snap = store.snapshot();
                        let started = Instant::now();
                        let p = snap.get(id).expect("read").expect("present").prompt().expect("prompt");
                        std::hint::black_box(p);
                        started.elapsed().as_secs_f64() * 1e6
                    })
                    .collect(),
            )
        };
        let last = time(&calls[n - 1].trace_id);
        let spread = median((0..50).map(|i| time(&calls[(i * n / 50 + n / 100).min(n - 1)].trace_id)).collect());
        println!(
            "{k:>6} {:>11.1} MB {:>11.2}× {last:>14.0} {spread:>16.0}",
            bytes as f64 / 1e6,
            bytes as f64 / base.max(1) as f64
        );
        store.close().expect("close");
    }
}
