//! Read-side subcommands: `export`, `ls`, `show`, `space`. They open the store
//! read-only, so they work beside a running writer.

use std::io::Write;
use std::path::Path;
use trajlog::Snapshot;

fn open(dir: &Path, cmd: &str) -> trajlog::Result<Snapshot> {
    Ok(super::open_read_only(dir, cmd)?.snapshot())
}

pub fn export(dir: &Path, session: Option<&str>) -> trajlog::Result<i32> {
    let mut snap = open(dir, "export")?;
    snap.decode_whole_row_groups();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let sessions: Vec<String> = match session {
        Some(s) => vec![s.to_owned()],
        None => snap.sessions().into_iter().map(|s| s.session_id).collect(),
    };
    // A damaged block of the shard index file may have left sessions out.
    snap.check_index()?;
    // A damaged record is reported on stderr and skipped; every other call is
    // exported (damage stays confined to the records it touches).
    let mut damaged = 0u64;
    // On a terminal, a bar on stderr (stdout is the export).
    let bar = crate::progress::bar(sessions.len() as u64, "exporting", "sessions");
    for id in sessions {
        if let Some(bar) = &bar {
            bar.inc(1);
        }
        // Memory stays bounded whatever the store's size: the shard row
        // groups decoded for earlier sessions are dropped as they pile up.
        snap.bound_decoded(trajlog::limits::SCAN_DECODED_BYTES_MAX);
        for call in snap.session_each(&id, None, None) {
            let call = match call.and_then(|c| Ok((c.session_id() == id, c.to_call()?))) {
                Ok((own, call)) => {
                    // Exporting everything: a call is printed under its own
                    // session only (not again under each of its extra uids).
                    if session.is_none() && !own {
                        continue;
                    }
                    call
                }
                Err(e) => {
                    damaged += 1;
                    eprintln!("trajlog export: session {id:?}: a call was not exported: {e}");
                    continue;
                }
            };
            let line = trajlog::trace_json::export_call(&call);
            if let Err(e) = writeln!(out, "{line}") {
                return Ok(crate::stdout_failed(&e));
            }
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    // The last buffered lines are written here: a failure is an error too.
    if let Err(e) = out.flush() {
        return Ok(crate::stdout_failed(&e));
    }
    if damaged > 0 {
        eprintln!(
            "trajlog export: {damaged} damaged calls not exported (see above; `trajlog verify` lists the damage)"
        );
        return Ok(1);
    }
    Ok(0)
}

pub fn ls(dir: &Path) -> trajlog::Result<i32> {
    let snap = open(dir, "ls")?;
    let sessions = snap.sessions();
    // A damaged block of the shard index file may have left sessions out.
    snap.check_index()?;
    println!("{:<40} {:>6} {:>18} {:>18} {:>7} {:>8}", "SESSION", "CALLS", "FIRST", "LAST", "SEALED", "REWARD");
    for s in &sessions {
        let reward = s.reward.map_or("-".to_owned(), |r| format!("{r}"));
        println!(
            "{:<40} {:>6} {:>18.3} {:>18.3} {:>7} {:>8}",
            s.session_id,
            s.calls,
            s.first_timestamp,
            s.last_timestamp,
            if s.sealed { "yes" } else { "no" },
            reward
        );
    }
    let bytes: u64 = snap.segments().iter().map(|s| s.data_bytes).sum();
    println!(
        "{} sessions, {} calls, {} segments, {}",
        sessions.len(),
        snap.call_count(),
        snap.segments().len(),
        super::human_bytes(bytes)
    );
    Ok(0)
}

pub fn space(dir: &Path, json: bool) -> trajlog::Result<i32> {
    let snap = open(dir, "space")?;
    let r = trajlog::space::space(&snap)?;
    let hb = super::human_bytes;
    let (segments, shards, live) = (r.segment_bytes(), r.shard_bytes(), r.live_bytes());
    let ratio = if live == 0 { None } else { Some((segments + shards) as f64 / live as f64) };
    let layers = snap.index_layers();
    if json {
        println!("{}", r.to_json(&layers));
        return Ok(0);
    }
    println!(
        "{:>8} {:<7} {:>10} {:>20} {:>20} {:>18} {:>10}  KEPT BY (records here)",
        "SEGMENT", "STATE", "FILE", "LIVE (calls)", "COMPACTED (calls)", "DEAD (calls)", "ANNOT."
    );
    let pair = |b: u64, n: u64| format!("{} ({n})", hb(b));
    for s in &r.segments {
        let mut kept: Vec<String> = s
            .kept_by
            .iter()
            .take(3)
            .map(|k| format!("{} ({}, {}{})", k.session_id, k.calls, hb(k.bytes), if k.sealed { "" } else { ", open" }))
            .collect();
        if s.kept_by_sessions > 3 {
            kept.push(format!("+{} more", s.kept_by_sessions - 3));
        }
        if s.unreadable_bytes > 0 {
            kept.push(format!("{} unreadable", hb(s.unreadable_bytes)));
        }
        println!(
            "{:>8} {:<7} {:>10} {:>20} {:>20} {:>18} {:>10}  {}",
            s.id,
            if s.sealed { "sealed" } else { "active" },
            hb(s.file_bytes),
            pair(s.live_bytes, s.live_calls),
            pair(s.compacted_bytes, s.compacted_calls),
            pair(s.dead_bytes, s.dead_calls),
            hb(s.annotation_bytes),
            kept.join(", ")
        );
    }
    let sum = |f: fn(&trajlog::space::SegmentSpace) -> u64| r.segments.iter().map(f).sum::<u64>();
    println!(
        "segments: {} files, {}: live calls {}, compacted calls waiting for retirement {}, dead calls {}, annotations {}",
        r.segments.len(),
        hb(segments),
        hb(sum(|s| s.live_bytes)),
        hb(sum(|s| s.compacted_bytes)),
        hb(sum(|s| s.dead_bytes)),
        hb(sum(|s| s.annotation_bytes))
    );
    let rows: u64 = r.shards.iter().map(|s| s.rows).sum();
    let live_rows: u64 = r.shards.iter().map(|s| s.live_rows).sum();
    println!("steps shards: {} files, {}, {rows} rows ({live_rows} live)", r.shards.len(), hb(shards));
    match ratio {
        Some(x) => println!(
            "live data {}; segments and steps shards {}: {x:.2}× the live data",
            hb(live),
            hb(segments + shards)
        ),
        None => println!("live data 0 B; segments and steps shards {}", hb(segments + shards)),
    }
    let total = r.total_bytes();
    println!(
        "everything in the directory {}{}: trajectories shards {}, index files (shards/index.tsi, shards/index.tsa, backlog.tbi) {}, other files {}",
        hb(total),
        if live == 0 { String::new() } else { format!(" ({:.2}× the live data)", total as f64 / live as f64) },
        hb(r.other.trajectories_bytes),
        hb(r.other.index_file_bytes),
        hb(r.other.other_bytes)
    );
    let file = match (layers.index_file_bytes, r.shards.is_empty()) {
        (0, true) => "no shards".to_owned(),
        (0, false) => "no shard index file: the open decoded the shards".to_owned(),
        (n, _) => format!("shard index file {}, mapped", hb(n)),
    };
    let file = match layers.cached_annotation_segments {
        0 => file,
        n => format!("{file}; the seals and rewards of {n} annotation segments from its cache (shards/index.tsa)"),
    };
    let file = match layers.backlog_segments {
        0 => file,
        n => format!(
            "{file}; the footers of {n} sealed segments and the cold layer from the backlog index file (backlog.tbi)"
        ),
    };
    let cold = match layers.cold_calls {
        0 => String::new(),
        n => format!(
            ", {n} in {} ({} of heap; sessions in sealed segments nothing else names)",
            match layers.cold_layers {
                1 => "the cold layer".to_owned(),
                k => format!("{k} cold layers"),
            },
            hb(layers.cold_bytes as u64)
        ),
    };
    println!(
        "index: {} live calls, {} of them in the frozen layer ({} of heap; compacted sessions untouched since the open){cold}; {file}",
        layers.calls,
        layers.frozen_calls,
        hb(layers.frozen_bytes as u64)
    );
    // What an operator can do about the segments open sessions keep.
    let open: Vec<&trajlog::space::SegmentSpace> =
        r.segments.iter().filter(|s| s.sealed && s.kept_only_by_open_sessions).collect();
    if !open.is_empty() {
        let mut names: Vec<&str> = open.iter().flat_map(|s| s.kept_by.iter().map(|k| k.session_id.as_str())).collect();
        names.sort_unstable();
        names.dedup();
        let shown: Vec<&str> = names.iter().take(5).copied().collect();
        let held: u64 = open.iter().map(|s| s.file_bytes).sum();
        println!(
            "{} sealed segments ({}) are kept only by the live calls of sessions not finished ({}{}): seal those sessions (or delete them), or compact with --older-than SECONDS; the next compaction then frees these segments",
            open.len(),
            hb(held),
            shown.join(", "),
            if names.len() > shown.len() { format!(", +{} more", names.len() - shown.len()) } else { String::new() }
        );
    }
    Ok(0)
}

pub fn show(dir: &Path, session: &str) -> trajlog::Result<i32> {
    let snap = open(dir, "show")?;
    let info = snap.session_info(session);
    snap.check_index()?;
    let Some(info) = info else {
        eprintln!("trajlog show: no session {session:?} in {}", dir.display());
        return Ok(1);
    };
    println!("session {}: {} calls, sealed: {}, reward: {:?}", info.session_id, info.calls, info.sealed, info.reward);
    println!("{:>4} {:<28} {:>9} {:>9} {:>9} {:>10}  RELATION", "#", "TRACE", "PROMPT", "STORED", "COMPL", "MIN LOGP");
    for (i, call) in snap.session(session, None, None)?.iter().enumerate() {
        let min_lp = call
            .logprobs()
            .and_then(|l| l.iter().copied().reduce(f32::min))
            .map_or("-".to_owned(), |v| format!("{v:.3}"));
        let relation = match call.divergence_position() {
            Some(pos) => {
                let prompt = call.prompt()?;
                let around = &prompt[pos.saturating_sub(2)..(pos + 3).min(prompt.len())];
                format!("{} at {pos} (ids around it: {around:?})", call.relation().name())
            }
            None => call.relation().name().to_owned(),
        };
        println!(
            "{:>4} {:<28} {:>9} {:>9} {:>9} {:>10}  {}",
            i,
            call.trace_id(),
            call.prompt_len(),
            call.prompt_suffix().len(),
            call.completion_token_ids().len(),
            min_lp,
            relation
        );
    }
    Ok(0)
}
