//! `trajlog ingest`: JSON lines on stdin → store; an ack line per durable record.

use std::io::{BufRead, Write};
use std::path::Path;
use trajlog::{Options, Store};

pub fn run(dir: &Path, durability: &str, segment_bytes: u64) -> trajlog::Result<i32> {
    let options = Options { durability: durability.parse()?, segment_bytes, ..Options::default() };
    let store = Store::open(dir, options)?;
    // A reader thread feeds lines so that the main loop can batch whatever has
    // arrived and ack it with one durability wait, without waiting for more input.
    let (tx, rx) = crossbeam_channel::bounded::<(usize, std::io::Result<String>)>(4096);
    std::thread::spawn(move || {
        for (i, line) in std::io::stdin().lock().lines().enumerate() {
            if tx.send((i + 1, line)).is_err() {
                break;
            }
        }
    });
    let stdout = std::io::stdout();
    let mut failed_lines = 0u64;
    let mut acked = 0u64;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut pending = Vec::with_capacity(batch.len());
        let mut last = None;
        for (line_no, line) in batch {
            let line = match line {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("trajlog ingest: line {line_no}: cannot read stdin: {e}");
                    failed_lines += 1;
                    continue;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            match trajlog::trace_json::parse_trace(&line, now) {
                Ok(call) => {
                    let id = call.trace_id.clone();
                    last = Some(store.append(call)?);
                    pending.push(id);
                }
                Err(e) => {
                    eprintln!("trajlog ingest: line {line_no}: {e} (line skipped)");
                    failed_lines += 1;
                }
            }
        }
        if let Some(receipt) = last {
            // Records become durable in append order: the last one covers the batch.
            receipt.wait()?;
        }
        let mut out = stdout.lock();
        for id in pending {
            let _ = writeln!(out, "{{\"ack\":{}}}", serde_json::to_string(&id).unwrap_or_default());
            acked += 1;
        }
        let _ = out.flush();
    }
    store.close()?;
    eprintln!("trajlog ingest: {acked} traces stored, {failed_lines} lines refused");
    Ok(if failed_lines > 0 { 1 } else { 0 })
}

/// `trajlog import-rllm-sqlite DB --store DIR`.
pub fn import_rllm_sqlite(db: &Path, dir: &Path, schema: Option<&str>, verify: bool) -> trajlog::Result<i32> {
    use trajlog::rllm::sqlite;
    let schema = schema.map(str::parse::<sqlite::Schema>).transpose()?;
    let store = Store::open(dir, Options::default())?;
    let started = std::time::Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |done: u64, total: u64| {
        let b = bar.get_or_insert_with(|| {
            trajlog::progress::bar(total, "importing", "traces").unwrap_or_else(indicatif::ProgressBar::hidden)
        });
        b.set_position(done);
    };
    let report = sqlite::import(db, &store, schema, verify, &mut progress)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    store.close()?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "imported {} traces ({} session links, {} of token ids and logprobs) from {} ({} schema) into {} in {secs:.2} s",
        report.traces,
        report.session_links,
        crate::cli::human_bytes(report.token_bytes),
        db.display(),
        report.schema.name(),
        dir.display(),
    );
    if verify {
        println!("verified: {}/{} traces read back equal to their rows", report.verified, report.traces);
    }
    Ok(0)
}
