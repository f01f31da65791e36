//! `trajlog verify` and `trajlog repair`: what is wrong with a store's files,
//! and rebuilding its manifest from them.

use std::path::Path;

/// Exit code of `verify` for damage (bytes that fail validation, missing or
/// unexplained files).
pub const EXIT_DAMAGED: i32 = 1;
/// Exit code of `verify` when the only finding is a torn tail.
pub const EXIT_TORN_TAIL: i32 = 3;

pub fn verify(dir: &Path) -> trajlog::Result<i32> {
    let report = trajlog::verify::verify_dir(dir)?;
    for p in &report.problems {
        println!("CORRUPT {} at offset {}: {}", p.path.display(), p.offset, p.what);
    }
    if let Some(t) = &report.torn_tail {
        println!("TORN TAIL {} at offset {}: {}", t.path.display(), t.offset, t.what);
    }
    for (path, fate) in &report.leftovers {
        println!("LEFTOVER {}: left by an interrupted operation, holds nothing live; {fate}", path.display());
    }
    for (path, why) in &report.not_checked {
        println!("NOT CHECKED {}: {why}", path.display());
    }
    let unchecked = match report.not_checked.len() {
        0 => String::new(),
        n => format!(" ({n} check(s) could not be made: NOT CHECKED above)"),
    };
    let verdict = match (report.problems.len(), &report.torn_tail) {
        (0, None) => format!("ok{unchecked}"),
        (0, Some(_)) => "ok but for a torn tail (an interrupted write, no acknowledged record lost)".to_owned(),
        (n, _) => format!("{n} problems; see README \"When files are damaged or missing\""),
    };
    println!(
        "verified {} segments, {} records, {}: {verdict}",
        report.segments,
        report.records,
        super::human_bytes(report.bytes),
    );
    if let Some(n) = report.rewards_sessions {
        println!("rewards side table (shards/_rewards.parquet): {n} sessions with rewards set after compaction");
    }
    if let Some(d) = report.deletions {
        println!(
            "deletions side table (shards/_deleted.parquet): {} dead shard rows listed, {} dead since the last compaction (the next one lists them)",
            d.listed, d.not_yet_listed
        );
    }
    let s = &report.split;
    if s.calls > 0 {
        println!(
            "call records: {} calls, {} token columns, {} documents ({} in {} docs blocks, {} of them with messages as a delta, {} with vLLM's logprobs list as one reference, {} plain), {} other",
            s.calls,
            super::human_bytes(s.token_bytes),
            super::human_bytes(s.docs_block_bytes + s.plain_doc_bytes),
            super::human_bytes(s.docs_block_bytes),
            s.docs_blocks,
            s.messages_deltas,
            s.content_lists,
            super::human_bytes(s.plain_doc_bytes),
            super::human_bytes(s.other_bytes),
        );
        if s.docs_blocks > 0 {
            let [m, r, md, e] = s.template_bytes.map(super::human_bytes);
            println!("docs blocks before zstd, what is left after references: messages {m}, response_message {r}, metadata {md}, extra {e}");
        }
    }
    Ok(match (report.problems.is_empty(), report.torn_tail.is_some()) {
        (false, _) => EXIT_DAMAGED,
        (true, true) => EXIT_TORN_TAIL,
        (true, false) => 0,
    })
}

pub fn repair(dir: &Path, dry_run: bool) -> trajlog::Result<i32> {
    let r = trajlog::repair::repair(dir, dry_run)?;
    let would = if dry_run { "would " } else { "" };
    for (path, why) in &r.moved_aside {
        println!("{would}move aside {} to {}/: {why}", path.display(), trajlog::repair::LOST_AND_FOUND);
    }
    for id in &r.sealed_now {
        println!("{would}seal segment {id} (unsealed, but not the last)");
    }
    for e in &r.cut {
        println!("{would}{e}");
    }
    for p in &r.damage {
        println!("damaged {} at offset {}: {}", p.path.display(), p.offset, p.what);
    }
    let sealed = r.segments.iter().filter(|s| s.1).count();
    println!(
        "{}: {} segments ({sealed} sealed), {} shards, next segment id {}{}",
        if r.written { "MANIFEST rebuilt" } else { "MANIFEST not written (dry run)" },
        r.segments.len(),
        r.shards.len(),
        r.next_segment_id,
        if r.sealed_now.is_empty() || r.written { format!(", {} live calls", r.calls) } else { String::new() },
    );
    if let Some(prev) = &r.previous_manifest {
        println!("the MANIFEST found before is kept as {}", prev.display());
    }
    if r.written {
        println!("next: trajlog verify --store {}", dir.display());
    }
    Ok(0)
}
