//! `trajlog compact` and `trajlog audit`.

use super::human_bytes;
use std::path::Path;
use trajlog::{CompactOptions, Options, Selection};

/// A memory figure of this process from `/proc/self/status` (Linux), in bytes:
/// `VmHWM` (peak resident), `RssAnon` (heap and other private memory now),
/// `RssFile` (mapped file pages now).
pub fn proc_status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub struct CompactArgs {
    pub older_than: Option<f64>,
    pub shard_bytes: usize,
    pub row_group_rows: usize,
    pub row_group_bytes: usize,
    /// `--trajectories-min-group-bytes`.
    pub trajectories_min_group_bytes: usize,
    pub compression: String,
    /// `--collect-dead` (`None`: `--no-collect`).
    pub collect_dead: Option<f64>,
    /// `--merge-fanout` (`None`: `--no-merge`).
    pub merge_fanout: Option<u32>,
    /// `--copy-forward` (`None`: `--no-copy-forward`).
    pub copy_forward: Option<f64>,
    /// `--batch-calls`: one compaction after another, each of about this
    /// many calls (what they write again included), a line each (`None`,
    /// `--no-batches`: one compaction of everything selected).
    pub batch_calls: Option<u64>,
}

pub fn compact(dir: &Path, args: &CompactArgs) -> trajlog::Result<i32> {
    let store = super::open_store(dir, Options::default(), "compact")?;
    let options = crate::progress::compact_progress(
        CompactOptions::default()
            .selection(args.older_than.map_or(Selection::SealedOnly, Selection::OlderThan))
            .steps_row_group_rows(args.row_group_rows)
            .trajectories_row_group_rows((args.row_group_rows / 64).max(1))
            .trajectories_row_group_min_bytes(args.trajectories_min_group_bytes)
            .row_group_bytes(args.row_group_bytes)
            .shard_bytes(args.shard_bytes)
            .compression(args.compression.parse()?)
            .collect_dead_fraction(args.collect_dead)
            .merge_fanout(args.merge_fanout)
            .copy_forward(args.copy_forward)
            .batch_calls(args.batch_calls),
    );
    // Sessions with damaged calls, each once (a later batch chooses them again).
    let mut damaged = std::collections::BTreeSet::new();
    let (mut batches, mut sessions, mut calls) = (0u64, 0u64, 0u64);
    let started = std::time::Instant::now();
    let mut limit = args.batch_calls;
    loop {
        let r = store.compact(&options.clone().max_calls(limit))?;
        batches += 1;
        sessions += r.sessions as u64;
        calls += r.calls;
        // A backlog the first batch took whole is one compaction, printed
        // as such.
        if batches > 1 || r.sessions_left > 0 {
            print!("batch {batches}: ");
        }
        print_report(&r);
        damaged.extend(r.sessions_damaged.iter().map(|(s, _)| s.clone()));
        if r.sessions_left == 0 {
            break;
        }
        // Sessions with damaged calls are never compacted and stay selected,
        // oldest first: a batch that took only those compacted nothing. The
        // next takes twice as many calls, until a batch compacts something
        // or takes every session left (then `sessions_left` is 0).
        limit = if r.sessions == 0 { limit.map(|n| n.saturating_mul(2)) } else { args.batch_calls };
    }
    store.close()?;
    if batches > 1 {
        println!(
            "compacted {sessions} sessions, {calls} calls in {batches} batches in {:.2} s; peak RSS {}",
            started.elapsed().as_secs_f64(),
            proc_status_bytes("VmHWM:").map_or("unknown".to_owned(), human_bytes),
        );
    }
    if !damaged.is_empty() {
        eprintln!(
            "trajlog compact: {} sessions with damaged calls were not compacted (`trajlog verify` lists the damage)",
            damaged.len()
        );
        return Ok(1);
    }
    Ok(0)
}

/// Print what one compaction did.
fn print_report(r: &trajlog::CompactReport) {
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    println!(
        "compacted {} sessions, {} calls, {} trajectories: {} of token payload into {} shard files ({}){} in {:.2} s ({:.0} MB/s); retired {} segments; peak RSS {}",
        r.sessions,
        r.calls,
        r.trajectories,
        human_bytes(r.token_bytes),
        r.shards.len(),
        human_bytes(r.shard_bytes),
        if r.publications > 1 { format!(", {} publications", r.publications) } else { String::new() },
        secs,
        r.token_bytes as f64 / 1e6 / secs,
        r.retired_segments,
        proc_status_bytes("VmHWM:").map_or("unknown".to_owned(), human_bytes),
    );
    if !r.collected_generations.is_empty() || !r.merged_generations.is_empty() {
        println!(
            "collected {} and merged {} earlier compactions: {} live calls written again, {} dead rows dropped, {} of files replaced",
            r.collected_generations.len(),
            r.merged_generations.len(),
            r.moved_calls,
            r.dropped_rows,
            human_bytes(r.collected_bytes),
        );
    }
    if r.copied_sessions > 0 {
        println!(
            "copied {} unfinished sessions forward ({} calls, {}) out of segments they alone kept",
            r.copied_sessions,
            r.copied_calls,
            human_bytes(r.copied_bytes),
        );
    }
    for s in &r.shards {
        println!("  {}", s.display());
    }
    if !r.collect_deferred.is_empty() {
        println!(
            "left {} earlier compactions for a later collection: a dead row of theirs keeps another record of its call dead (format-spec/shard.md §6.1)",
            r.collect_deferred.len()
        );
    }
    for (generation, why) in &r.collect_skipped {
        eprintln!(
            "trajlog compact: compaction {generation}'s shards were not rewritten, a row of them is damaged: {why}"
        );
    }
    for (path, why) in &r.deletions_skipped {
        eprintln!(
            "trajlog compact: shards/{path} could not be read for the deletions side table, its rows deleted since are not listed for shard readers: {why}"
        );
    }
    for (session, why) in &r.sessions_damaged {
        eprintln!("trajlog compact: session {session:?} left in the log, a call of it is damaged: {why}");
    }
}

/// History divergences printed per session (all of them are in `--json`).
const HISTORY_LINES: usize = 3;

pub fn audit(dir: &Path, json: bool, strict: bool) -> trajlog::Result<i32> {
    let snap = super::open_read_only(dir, "audit")?.snapshot();
    let bar = crate::progress::bar(0, "auditing", "sessions");
    let report = trajlog::audit::audit_with_progress(&snap, &mut |done, total| {
        if let Some(bar) = &bar {
            bar.set_length(total);
            bar.set_position(done);
            if done >= total {
                bar.finish_and_clear();
            }
        }
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        for s in report.sessions.iter().filter(|s| !s.divergences.is_empty()) {
            println!(
                "{}: {} calls, {} TI/TO breaks, {} earlier divergences, {} tokens a re-tokenizing trainer would get wrong",
                s.session_id, s.calls, s.breaks, s.diverges_earlier, s.tokens_wrong
            );
            for d in &s.divergences {
                println!(
                    "  call {} ({}): {} at token {} vs parent {}: prompt {:?} / generated {:?}",
                    d.call_index,
                    d.trace_id,
                    d.relation,
                    d.position,
                    d.parent_trace_id,
                    d.prompt_ids_around,
                    d.parent_ids_around
                );
            }
        }
        for s in report.sessions.iter().filter(|s| !s.history_divergences.is_empty()) {
            println!(
                "{}: {} calls whose messages do not start with their parent's (first {} shown)",
                s.session_id,
                s.histories_rewritten,
                s.history_divergences.len().min(HISTORY_LINES)
            );
            for d in s.history_divergences.iter().take(HISTORY_LINES) {
                println!(
                    "  call {} ({}): history differs from parent {} at byte {}: {:?} / parent {:?}",
                    d.call_index, d.trace_id, d.parent_trace_id, d.byte, d.text_around, d.parent_around
                );
            }
        }
        println!(
            "audit: {} sessions, {} calls checked; {} TI/TO breaks in {} sessions; {} earlier divergences; {} generated tokens would be mis-trained by a re-tokenizing trainer",
            report.sessions_checked,
            report.calls_checked,
            report.breaks,
            report.sessions_with_breaks,
            report.diverges_earlier,
            report.tokens_wrong
        );
        println!(
            "chat histories: {} calls whose messages do not start with their parent's (re-rendered, edited, or not a cumulative history); {} that keep it but re-serialize the parent's response_message",
            report.histories_rewritten, report.responses_reserialized
        );
        if report.details_not_kept > 0 || report.sessions_not_listed > 0 {
            println!(
                "(the counts cover every session; the details above cover the first {} sessions and at most {} divergences: {} more divergences in {} more sessions are counted, not shown)",
                trajlog::limits::AUDIT_SESSIONS_LISTED_MAX,
                trajlog::limits::AUDIT_DETAILS_MAX,
                report.details_not_kept,
                report.sessions_not_listed
            );
        }
    }
    for (session, why) in &report.sessions_damaged {
        eprintln!("trajlog audit: session {session:?} not audited, a call of it is damaged: {why}");
    }
    if !report.sessions_damaged.is_empty() {
        return Ok(1);
    }
    if strict && report.breaks > 0 {
        eprintln!("trajlog audit: --strict: {} TI/TO breaks found", report.breaks);
        return Ok(1);
    }
    Ok(0)
}
