//! `trajlog ingest`: JSON lines on stdin → store; an ack line per durable record.
//!
//! A line the store refuses (bad JSON, a field over a limit, a sealed session,
//! a trace id that belongs to another session: `InvalidInput` or
//! `LimitExceeded`) is reported on stderr with its line number and reason,
//! gets no ack, and ingest goes on; the exit code is then 1. A failure of the
//! store itself (I/O, poisoned, closed, corrupt) stops ingest with exit code
//! 2; every line acked before it is durable.

use std::io::{BufRead, Write};
use std::path::Path;
use trajlog::{Error, ErrorKind, Options, Store};

/// Exit code when some lines were refused and every other line was stored.
pub const EXIT_LINES_REFUSED: i32 = 1;
/// Exit code when the store failed (or stdin could not be read) and ingest stopped.
pub const EXIT_FAILED: i32 = 2;

/// Lines a reader thread hands over at most per batch (one durability wait each).
const BATCH_LINES_MAX: usize = 4096;

/// Whether `e` refuses one record (the rest of the input can go on) rather
/// than reporting a failure of the store.
fn refuses_record(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::InvalidInput { .. } | ErrorKind::LimitExceeded { .. })
}

#[derive(Default)]
struct Tally {
    stored: u64,
    refused: u64,
}

impl Tally {
    fn refuse(&mut self, line_no: usize, why: &dyn std::fmt::Display) {
        eprintln!("trajlog ingest: line {line_no} refused (not stored): {why}");
        self.refused += 1;
    }
}

/// Why the main loop stopped before the end of the input.
enum Stop {
    /// The store failed; its error.
    Store(Error),
    /// Stdin could not be read (other than a line that is not UTF-8).
    Stdin(usize, std::io::Error),
    /// Stdout (the acks) failed; a closed pipe when `is_broken_pipe`.
    Stdout(std::io::Error),
}

pub fn run(dir: &Path, durability: &str, segment_bytes: u64, zero_ahead_bytes: Option<u64>) -> trajlog::Result<i32> {
    let mut options = Options::default().durability(durability.parse()?).segment_bytes(segment_bytes);
    if let Some(z) = zero_ahead_bytes {
        options = options.zero_ahead_bytes(z);
    }
    let store = super::open_store(dir, options, "ingest")?;
    // A reader thread feeds lines so that the main loop can batch whatever has
    // arrived and ack it with one durability wait, without waiting for more input.
    let (tx, rx) = crossbeam_channel::bounded::<(usize, std::io::Result<String>)>(BATCH_LINES_MAX);
    std::thread::spawn(move || {
        for (i, line) in std::io::stdin().lock().lines().enumerate() {
            // A line that is not UTF-8 is consumed and refused; any other read
            // error ends the input (it would repeat forever).
            let fatal = line.as_ref().is_err_and(|e| e.kind() != std::io::ErrorKind::InvalidData);
            if tx.send((i + 1, line)).is_err() || fatal {
                break;
            }
        }
    });
    let mut tally = Tally::default();
    let stop = ingest(&store, &rx, &mut tally).err();
    drop(rx); // the reader thread stops at its next line
    let closed = store.close();
    let summary = format!(
        "trajlog ingest: ingested {}, refused {}{}",
        tally.stored,
        tally.refused,
        if tally.refused > 0 { " (see above)" } else { "" }
    );
    let done = if tally.refused > 0 { EXIT_LINES_REFUSED } else { 0 };
    let code = match stop {
        None => {
            eprintln!("{summary}");
            done
        }
        // Nobody reads the acks any more (`| head`): stop reading input, no error.
        Some(Stop::Stdout(e)) if crate::is_broken_pipe(&e) => {
            eprintln!("{summary}; stdout closed, later lines not read");
            done
        }
        Some(Stop::Stdout(e)) => {
            eprintln!("{summary}; stopped: cannot write acks");
            crate::stdout_failed(&e)
        }
        Some(Stop::Stdin(line_no, e)) => {
            eprintln!("{summary}; stopped: cannot read stdin at line {line_no}: {e}");
            EXIT_FAILED
        }
        Some(Stop::Store(e)) => {
            eprintln!("{summary}; stopped: the store failed, later lines not read");
            return Err(e);
        }
    };
    closed?;
    Ok(code)
}

/// Append every line of `rx` in batches, acking each batch once it is durable.
fn ingest(
    store: &Store,
    rx: &crossbeam_channel::Receiver<(usize, std::io::Result<String>)>,
    tally: &mut Tally,
) -> Result<(), Stop> {
    let stdout = std::io::stdout();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH_LINES_MAX {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut pending = Vec::with_capacity(batch.len());
        let mut last = None;
        let mut stop = None;
        for (line_no, line) in batch {
            let line = match line {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    tally.refuse(line_no, &format_args!("not UTF-8 text ({e})"));
                    continue;
                }
                Err(e) => {
                    stop = Some(Stop::Stdin(line_no, e));
                    break;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let call = match trajlog::trace_json::parse_trace(&line, now) {
                Ok(call) => call,
                Err(e) => {
                    tally.refuse(line_no, &e);
                    continue;
                }
            };
            let id = call.trace_id.clone();
            match store.append(call) {
                Ok(receipt) => {
                    last = Some(receipt);
                    pending.push(id);
                }
                Err(e) if refuses_record(&e) => tally.refuse(line_no, &e),
                Err(e) => {
                    stop = Some(Stop::Store(e));
                    break;
                }
            }
        }
        // Records become durable in append order: the last one covers the
        // batch. Lines appended before a stop are still acked once durable.
        if let Some(receipt) = last {
            receipt.wait().map_err(|e| stop.take().unwrap_or(Stop::Store(e)))?;
        }
        tally.stored += pending.len() as u64;
        let mut out = stdout.lock();
        for id in &pending {
            let mut line = String::from("{\"ack\":");
            trajlog::trace_json::write_json_str(&mut line, id);
            line.push('}');
            writeln!(out, "{line}").map_err(Stop::Stdout)?;
        }
        out.flush().map_err(Stop::Stdout)?;
        if let Some(stop) = stop {
            return Err(stop);
        }
    }
    Ok(())
}

/// `trajlog import-rllm-sqlite DB --store DIR`.
pub fn import_rllm_sqlite(db: &Path, dir: &Path, schema: Option<&str>, verify: bool) -> trajlog::Result<i32> {
    use trajlog::rllm::sqlite;
    let schema = schema.map(str::parse::<sqlite::Schema>).transpose()?;
    let store = super::open_store(dir, Options::default(), "import-rllm-sqlite")?;
    let started = std::time::Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |done: u64, total: u64| {
        let b = bar.get_or_insert_with(|| {
            crate::progress::bar(total, "importing", "traces").unwrap_or_else(indicatif::ProgressBar::hidden)
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
