//! Appends to one long session: is the last block of appends as fast as the
//! first? (issue "The engine at production scale": "appends to one
//! 10,000-call session: the last 1,000 appends no slower than the first
//! 1,000".) Run: `cargo bench --bench long_session [-- CALLS [BLOCK]]`.
//!
//! One session ("unscoped": every call of a process in one session id) gets
//! CALLS calls (default 10,000) of a fixed shape — a 200-token prompt that
//! does not extend the previous call's context and a 50-token completion with
//! logprobs — so that nothing but the session's length grows. Each append is
//! followed by a flush (Buffered durability: written, not fsynced), as a
//! gateway's call-at-a-time capture does, so every append meets a freshly
//! published snapshot (which holds the session's call list). Prints the time
//! of every block of BLOCK appends (default 1,000) and the last block's time
//! over the first's. Setup (building the calls) is outside the timing.

use std::time::Instant;
use trajlog::{Call, Durability, Options, Store};
use trajlog_sim::Rng;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let calls: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let block: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000).max(1);
    let mut rng = Rng::new(7);
    let all: Vec<Call> = (0..calls)
        .map(|i| Call {
            trace_id: format!("t{i}"),
            session_id: "unscoped".into(),
            timestamp: i as f64,
            prompt_token_ids: rng.tokens(200),
            completion_token_ids: rng.tokens(50),
            logprobs: Some(rng.logprobs(50)),
            ..Default::default()
        })
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default().durability(Durability::Buffered)).expect("open");
    let mut blocks = Vec::new();
    for chunk in all.chunks(block) {
        let started = Instant::now();
        for c in chunk {
            store.append(c.clone()).expect("append");
            store.flush().expect("flush");
        }
        blocks.push(started.elapsed().as_secs_f64());
    }
    let snap = store.snapshot();
    assert_eq!(snap.session_info("unscoped").map(|s| s.calls), Some(calls));
    println!("one session, {calls} appends (each flushed), in blocks of {block}:");
    println!("| block | appends | s | µs per append |");
    println!("|---|---|---|---|");
    for (i, s) in blocks.iter().enumerate() {
        let n = all.chunks(block).nth(i).map_or(0, <[Call]>::len);
        println!("| {} | {}–{} | {:.3} | {:.1} |", i + 1, i * block + 1, i * block + n, s, s * 1e6 / n as f64);
    }
    if let (Some(first), Some(last)) = (blocks.first(), blocks.last()) {
        println!("last block / first block: {:.2}", last / first);
    }
}
