//! What opening a store costs, and what a read-only store's refresh costs
//! after a writer appended: the figures of the issue "The engine at
//! production scale" (README "Opening a large store").
//!
//! ```text
//! cargo run --release --example open_cost -- DIR                 # read-only open
//! cargo run --release --example open_cost -- DIR --writable      # writable open
//! cargo run --release --example open_cost -- DIR --session S     # + read session S
//! cargo run --release --example open_cost -- DIR --refresh 1000  # + refresh after 1,000 appends
//! ```
//!
//! Prints the open's wall time, the index's layers, and this process's
//! memory right after the open from /proc/self/status (Linux): `VmRSS`
//! (resident, heap and mapped files), `RssAnon` (the heap and other
//! anonymous memory) and `VmHWM` (the peak so far). `--refresh N` opens the
//! store for writing beside the read-only one (so DIR must not be open
//! elsewhere), appends N small calls in new sessions (`open-cost/...`,
//! which stay in the store), flushes, and times the read-only store's
//! `refresh()` against a second read-only open.

use std::time::Instant;
use trajlog::{Call, Options, Store};

/// A field of /proc/self/status in kB ("-" where there is none).
fn status_kb(key: &str) -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .map_or_else(|| "-".to_owned(), str::to_owned)
}

fn main() -> trajlog::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().cloned() else {
        eprintln!("usage: open_cost DIR [--writable] [--session S] [--refresh N]");
        std::process::exit(2);
    };
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let writable = args.iter().any(|a| a == "--writable");
    let t = Instant::now();
    let store = if writable { Store::open(&dir, Options::default())? } else { Store::open_read_only(&dir)? };
    let open_s = t.elapsed().as_secs_f64();
    let snap = store.snapshot();
    let layers = snap.index_layers();
    println!(
        "open ({}): {open_s:.6} s; {} live calls, {} in the frozen layer, {} in {} cold layer(s) ({} segments from the backlog index file); VmRSS {} kB, RssAnon {} kB, VmHWM {} kB",
        if writable { "writable" } else { "read-only" },
        layers.calls,
        layers.frozen_calls,
        layers.cold_calls,
        layers.cold_layers,
        layers.backlog_segments,
        status_kb("VmRSS"),
        status_kb("RssAnon"),
        status_kb("VmHWM"),
    );
    if let Some(session) = value("--session") {
        let t = Instant::now();
        let calls = snap.session(&session, None, None)?;
        let mut tokens = 0;
        for c in &calls {
            tokens += c.prompt()?.len() + c.completion_token_ids().len();
        }
        let ms = t.elapsed().as_secs_f64() * 1e3;
        println!("read session {session}: {} calls, {tokens} tokens (full prompts) in {ms:.3} ms", calls.len());
    }
    if let Some(n) = value("--refresh") {
        let n: usize = n.parse().unwrap_or(1000);
        if writable {
            eprintln!("--refresh measures a read-only store's refresh: leave out --writable");
            std::process::exit(2);
        }
        let writer = Store::open(&dir, Options::default())?;
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        for i in 0..n {
            writer.append(Call {
                trace_id: format!("open-cost/{stamp}/{i}"),
                session_id: format!("open-cost/{stamp}/{}", i / 8),
                timestamp: i as f64,
                prompt_token_ids: vec![1, 2, 3, i as u32],
                completion_token_ids: vec![4, 5],
                logprobs: Some(vec![-0.5, -0.25]),
                ..Default::default()
            })?;
        }
        writer.flush()?;
        let before = store.snapshot().call_count();
        let t = Instant::now();
        store.refresh()?;
        let refresh_s = t.elapsed().as_secs_f64();
        let after = store.snapshot().call_count();
        let t = Instant::now();
        let reopened = Store::open_read_only(&dir)?;
        let reopen_s = t.elapsed().as_secs_f64();
        println!(
            "refresh after {n} appends: {:.2} ms ({before} → {after} live calls); a read-only open instead: {:.3} s ({} live calls)",
            refresh_s * 1e3,
            reopen_s,
            reopened.snapshot().call_count()
        );
    }
    Ok(())
}
