//! `trajlog verify`: a full scan of every segment the manifest lists — header,
//! every frame's CRC, every record's decoding, footer against frames, and every
//! prefix-delta parent link — plus the files around them: a missing MANIFEST,
//! listed files that are gone, data files the manifest does not list.
//! Read-only; safe beside a running writer (whose active tail may then show as
//! a torn tail).
//!
//! A torn tail (non-zero bytes after the last valid frame of the active
//! segment with no valid frame among them: an interrupted write, cut off by
//! the next writable open, format-spec/segment.md §6) is reported apart from
//! damage. A zeroed region with valid frames after it is damage, not the end
//! of the data.

use crate::error::{Error, Result};
use crate::format::manifest::{decode_manifest, SegmentState};
use crate::format::record::{decode_call, Loc, KIND_CALL};
use crate::format::segment::{decode_footer, decode_header, read_trailer};
use crate::segment::recovery::{footer_entry_matches, footer_gaps, scan_active, scan_frames, scan_frames_past_damage};
use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use crate::error::Problem;

/// What `verify_dir` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub segments: usize,
    pub records: u64,
    pub bytes: u64,
    /// How the call records' bytes split: token columns (u32 ids, f32
    /// logprobs, as stored after prefix-delta), JSON documents (plain, or
    /// their docs blocks), and the rest (headers, ids, framing is not counted).
    pub split: ByteSplit,
    /// Damage: bytes that fail validation, missing or unexplained files.
    pub problems: Vec<Problem>,
    /// An interrupted write at the end of the active segment (not damage).
    pub torn_tail: Option<Problem>,
    /// Sessions the rewards side table lists (None: there is none).
    pub rewards_sessions: Option<usize>,
    /// The deletions side table (format-spec/shard.md §9), if there is one
    /// and it checked out: the dead rows it lists, and those it does not list
    /// yet (dead since the last compaction, which lists them).
    pub deletions: Option<DeletionsCheck>,
    /// Files an interrupted operation left that the next writable open
    /// disposes of (not damage: they hold nothing live), each with what it
    /// will do.
    pub leftovers: Vec<(PathBuf, &'static str)>,
    /// Checks that could not be made, and why (not damage): the file and
    /// what was left unchecked of it.
    pub not_checked: Vec<(PathBuf, String)>,
}

/// Bytes of call records by what they hold.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteSplit {
    pub calls: u64,
    pub token_bytes: u64,
    /// Documents stored plain.
    pub plain_doc_bytes: u64,
    /// Documents stored in docs blocks (format-spec/record.md §7).
    pub docs_block_bytes: u64,
    /// Calls whose documents are in a docs block.
    pub docs_blocks: u64,
    /// Docs blocks whose `messages` is a delta against the parent's
    /// (format-spec/record.md §7.2, references 6 and 7).
    pub messages_deltas: u64,
    /// Docs blocks whose `extra` holds vLLM's logprobs as one reference: the
    /// chat API's `logprobs.content` list or the completions API's
    /// `token_logprobs` (format-spec/record.md §7.2, references 8 and 9).
    pub content_lists: u64,
    /// Bytes of the docs blocks' templates before compression, per document:
    /// messages, response_message, metadata, extra (what is left of each
    /// after its references are cut out).
    pub template_bytes: [u64; 4],
    pub other_bytes: u64,
}

/// What `trajlog verify` found of the side table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeletionsCheck {
    /// Rows it lists (of shards still published).
    pub listed: u64,
    /// Dead rows of the published shards it does not list yet (deleted or
    /// replaced since the last publication; the next compaction lists them).
    pub not_yet_listed: u64,
}

/// The call records a read can reach: the live calls still in segments and
/// their prefix-delta ancestors (`parents`: each record's position and its
/// parent's). Retirement may drop the parent of a record nothing reads — a
/// call deleted or replaced, whose record a kept segment still holds
/// (format-spec/shard.md §6) — so only these must find their parents.
/// Which calls are live comes from a read-only open; `None` (check every
/// record) when the store does not open.
/// `parents` is sorted by position (the scan's order).
fn records_a_read_reaches(dir: &Path, parents: &[(Loc, Loc)]) -> Option<HashSet<Loc>> {
    let store = crate::Store::open_read_only_with(dir, crate::RecoveryMode::SkipCorrupted).ok()?;
    let snap = store.snapshot();
    let parent_of =
        |loc: &Loc| parents.binary_search_by_key(loc, |(l, _)| *l).ok().and_then(|i| parents.get(i)).map(|p| p.1);
    let mut needed = HashSet::new();
    let index = &snap.view.index;
    let calls = index.hot_calls().values().map(|m| m.loc).chain(index.cold_calls().map(|(loc, _)| loc));
    for loc in calls.filter(|loc| !snap.view.shards.is_compacted(*loc)) {
        let mut at = Some(loc);
        while let Some(loc) = at {
            if !needed.insert(loc) {
                break;
            }
            at = parent_of(&loc);
        }
    }
    Some(needed)
}

/// Verify the store in `dir`.
///
/// A store a writer changes meanwhile (a roll or a compaction rewrites the
/// manifest; a collection or retirement deletes files) can make a run
/// report files gone or tables out of step that are only the store moving
/// on: a run that found problems (or failed) while the manifest changed is
/// made again. After a few such runs the report keeps the problems found in
/// every run (real damage stays where it is) and says that the others were
/// left out. (A run can still meet a segment a writer created but has not
/// yet listed: verify a store no writer is changing for a verdict.)
pub fn verify_dir(dir: &Path) -> Result<VerifyReport> {
    const TRIES: usize = 4;
    let manifest = || std::fs::read(dir.join("MANIFEST")).ok();
    let mut last: Option<VerifyReport> = None;
    // The problems of every run so far.
    let mut common: Option<Vec<Problem>> = None;
    for _ in 0..TRIES {
        let before = manifest();
        let report = match verify_once(dir) {
            Ok(r) => r,
            // A file read while the writer rolled or retired it.
            Err(_) if manifest() != before => continue,
            Err(e) => return Err(e),
        };
        if report.problems.is_empty() || manifest() == before {
            return Ok(report);
        }
        common = Some(match common {
            None => report.problems.clone(),
            Some(c) => c.into_iter().filter(|p| report.problems.contains(p)).collect(),
        });
        last = Some(report);
    }
    let mut report = last.unwrap_or_default();
    report.problems = common.unwrap_or_default();
    report.problems.push(Problem {
        path: dir.join("MANIFEST"),
        offset: 0,
        what: format!(
            "the store changed during each of {TRIES} runs (a writer rolled, compacted or retired): only the problems every run found are listed; run it again while no writer changes the store for a verdict"
        ),
    });
    Ok(report)
}

/// One run of [`verify_dir`].
fn verify_once(dir: &Path) -> Result<VerifyReport> {
    let manifest_path = dir.join("MANIFEST");
    let mut report = VerifyReport::default();
    let bytes = match std::fs::read(&manifest_path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let inv = crate::inventory::inventory(dir)?;
            if inv.is_empty() {
                return Err(Error::new(
                    crate::error::ErrorKind::NotFound,
                    format!("no trajlog store at {} (no MANIFEST, no data files)", dir.display()),
                ));
            }
            let e = crate::inventory::no_manifest_error(dir, &inv);
            report.problems.push(Problem { path: manifest_path, offset: 0, what: e.message().to_owned() });
            return Ok(report);
        }
        Err(e) => return Err(Error::io(format!("read {}", manifest_path.display()), e)),
    };
    let manifest = match decode_manifest(&bytes) {
        Ok(m) => m,
        Err(e) => {
            report.problems.push(Problem { path: manifest_path, offset: e.offset, what: e.what });
            return Ok(report);
        }
    };
    match crate::inventory::inventory(dir).and_then(|inv| crate::inventory::leftovers(dir, &manifest, &inv)) {
        Ok(found) => report.leftovers = found.iter().map(crate::inventory::Leftover::describe).collect(),
        Err(e) => {
            let path = match e.kind() {
                crate::error::ErrorKind::Corrupt { path, .. } => path.clone(),
                _ => dir.to_path_buf(),
            };
            report.problems.push(Problem { path, offset: 0, what: e.message().to_owned() });
        }
    }
    let last = manifest.segments.last().map(|s| s.id);
    // Each segment's frame offsets, sorted; every record's parent link, in
    // log order (32 bytes a record; a set of every frame and a path per
    // link, with a read-only open's maps of every parent beside them,
    // peaked at 4.56 GB for 10M calls); the links whose parent is not
    // there, judged as they come (a parent precedes its record).
    let mut frames: std::collections::HashMap<u64, Vec<u64>> = std::collections::HashMap::new();
    let mut parents: Vec<(Loc, Loc)> = Vec::new();
    let mut missing: Vec<(Loc, Loc)> = Vec::new();
    for ms in &manifest.segments {
        let path = crate::storage::segment_path(dir, ms.id);
        let mut problem =
            |offset: u64, what: String| report.problems.push(Problem { path: path.clone(), offset, what });
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                problem(0, format!("listed in the MANIFEST but cannot be opened: {e}"));
                continue;
            }
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        // Read, not mapped: a live writer may cut its active segment's tail.
        let buf = crate::segment::recovery::read_aligned(&file, len, &path)?;
        let all: &[u8] = bytemuck::cast_slice(&buf);
        let data = all.get(..len as usize).unwrap_or(all);
        report.segments += 1;
        report.bytes += len;
        if let Err(e) = decode_header(data) {
            problem(e.offset, e.what);
            continue;
        }
        let trailer = read_trailer(data);
        let (limit, footer) = match trailer {
            Some(t) => match decode_footer(data, &t) {
                Ok(entries) => (t.footer_offset as usize, Some(entries)),
                Err(e) => {
                    problem(e.offset, format!("{} (the footer is rebuilt from the frames at open)", e.what));
                    (t.footer_offset as usize, None)
                }
            },
            None if ms.state == SegmentState::Sealed => {
                problem(
                    len,
                    "sealed segment has no valid trailer (its index is rebuilt from the frames at open)".into(),
                );
                (data.len(), None)
            }
            None => (data.len(), None),
        };
        let frames_bytes = data.get(..limit).unwrap_or(data);
        let active = ms.state == SegmentState::Active && Some(ms.id) == last && trailer.is_none();
        let scan = if active {
            let scan = scan_active(frames_bytes);
            if let Some(t) = &scan.torn {
                report.torn_tail = Some(Problem {
                    path: path.clone(),
                    offset: t.offset,
                    what: format!(
                        "{} ({} bytes; an interrupted write; the next writable open cuts it off)",
                        t.what, t.len
                    ),
                });
            }
            for d in &scan.damaged {
                report.problems.push(Problem { path: path.clone(), offset: d.offset, what: d.what.clone() });
            }
            scan.entries
        } else {
            let scan = scan_frames(frames_bytes);
            let clean = scan.stopped_by.is_none();
            // Report every damaged frame, not only the first.
            let scan = if clean { scan } else { scan_frames_past_damage(frames_bytes) };
            let gaps = footer.as_deref().map(footer_gaps).unwrap_or_default();
            let note = |offset: u64| {
                let skipped = gaps.iter().any(|&(at, len)| at <= offset && offset < at + len);
                if skipped {
                    " (left out of the footer by a skip-corrupted open; the bytes are kept)"
                } else {
                    ""
                }
            };
            // Without a trailer the footer's bytes end the frames (as the
            // open reads them, format-spec/segment.md §6): a scan that stops
            // at a footer's magic met no damage.
            let no_trailer = trailer.is_none() && ms.state == SegmentState::Sealed;
            let stopped = scan.stopped_by.as_ref().and_then(|d| {
                let what = if no_trailer {
                    match crate::segment::recovery::footer_start(frames_bytes, d.offset) {
                        Some(at) if at == d.offset => return None,
                        Some(at) => format!("{} (damaged frames up to the footer at offset {at})", d.what),
                        None => format!("{} (no footer follows: where the frames end cannot be told)", d.what),
                    }
                } else {
                    d.what.clone()
                };
                Some((d.offset, what))
            });
            let skipped = scan.skipped.iter().map(|d| (d.offset, d.what.clone()));
            for (offset, what) in skipped.chain(stopped) {
                report.problems.push(Problem { path: path.clone(), offset, what: format!("{what}{}", note(offset)) });
            }
            if let Some(entries) = &footer {
                if clean
                    && (scan.valid_end != limit as u64
                        || !(entries.len() == scan.entries.len()
                            && entries.iter().zip(&scan.entries).all(|(f, s)| footer_entry_matches(f, s))))
                {
                    report.problems.push(Problem {
                        path: path.clone(),
                        offset: limit as u64,
                        what: "footer index does not match the frames".into(),
                    });
                }
            }
            scan.entries
        };
        report.records += scan.len() as u64;
        let mut offsets: Vec<u64> = scan.iter().map(|e| e.frame_offset).collect();
        offsets.sort_unstable();
        frames.insert(ms.id, offsets);
        for e in &scan {
            let loc = Loc { segment: ms.id, offset: e.frame_offset };
            if e.kind == KIND_CALL {
                let body = crate::format::frame::read_frame(data, e.frame_offset);
                if let Ok(crate::format::frame::FrameRead::Frame { body, .. }) = body {
                    if let Ok(rec) = decode_call(body) {
                        if let Some(p) = rec.parent {
                            parents.push((loc, p));
                            let there = frames.get(&p.segment).is_some_and(|o| o.binary_search(&p.offset).is_ok());
                            if p >= loc || !there {
                                missing.push((loc, p));
                            }
                        }
                        let s = &mut report.split;
                        let tokens =
                            4 * (rec.prompt_suffix.len() + rec.completion.len() + rec.logprobs.map_or(0, <[f32]>::len));
                        let plain = [rec.messages, rec.response_message, rec.metadata, rec.extra]
                            .iter()
                            .flatten()
                            .map(|d| d.len())
                            .sum::<usize>();
                        let block = rec.docs.map_or(0, |d| d.block.len());
                        s.calls += 1;
                        s.token_bytes += tokens as u64;
                        s.plain_doc_bytes += plain as u64;
                        s.docs_block_bytes += block as u64;
                        s.other_bytes += (body.len() - tokens - plain - block) as u64;
                        if let Some(d) = rec.docs {
                            s.docs_blocks += 1;
                            // The block decompresses, its table fits and every
                            // splice resolves against the record's columns (the
                            // prompt's values do not matter to that, only its
                            // length: zeros stand in for a delta-encoded one).
                            // A messages delta's parent documents: stand-ins (the
                            // parent's own block is checked where it is).
                            let checked = crate::format::docs::open(d.block, d.present).and_then(|b| {
                                let zeros =
                                    if b.needs_prompt() { vec![0u32; rec.prompt_len as usize] } else { Vec::new() };
                                for (sum, n) in s.template_bytes.iter_mut().zip(b.template_bytes()) {
                                    *sum += n;
                                }
                                if b.has_content_list() {
                                    s.content_lists += 1;
                                }
                                if b.needs_parent() {
                                    if rec.parent.is_none() {
                                        return Err(crate::format::DecodeError::new(
                                            0,
                                            "a messages delta without a parent",
                                        ));
                                    }
                                    s.messages_deltas += 1;
                                }
                                let cols = crate::format::docs::Columns {
                                    prompt: Some(&zeros),
                                    completion: rec.completion,
                                    logprobs: rec.logprobs,
                                    parent: Some(crate::format::docs::Parent {
                                        messages: b"[]",
                                        response_message: Some(b"{}"),
                                    }),
                                };
                                b.resolve(&cols).map(drop)
                            });
                            if let Err(e) = checked {
                                report.problems.push(Problem {
                                    path: path.clone(),
                                    offset: loc.offset,
                                    what: format!("docs block of the call at offset {}: {}", loc.offset, e.what),
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    // The links are needed again only to judge a missing parent (below):
    // not held through the checks of the other files when none is.
    drop(frames);
    if missing.is_empty() {
        parents = Vec::new();
    }
    // Shards: every byte checked against its checksums; the calls they hold
    // no longer need their prefix-delta parents in the log (only those of
    // the records in segments are kept: memory O(the log), not O(the
    // shards)).
    let in_log: HashSet<Loc> = missing.iter().map(|(loc, _)| *loc).collect();
    let mut compacted: HashSet<Loc> = HashSet::new();
    let shards_dir = dir.join(crate::storage::SHARDS_DIR);
    // The shard index file, checked against the `steps` rows shard by shard
    // (shard/index_check.rs), when every `steps` shard reads cleanly.
    let mut index_check =
        if manifest.pending.is_empty() { crate::shard::index_check::IndexCheck::open(&shards_dir) } else { None };
    let mut all_steps_read = true;
    let mut steps = 0u32;
    for shard in &manifest.shards {
        let path = shards_dir.join(&shard.path);
        report.bytes += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let found = crate::shard::reader::verify_shard(&path, shard.checksum);
        let clean = found.is_empty();
        report.problems.extend(found);
        if !shard.path.starts_with("steps/") {
            continue;
        }
        all_steps_read &= clean;
        let number = steps;
        steps += 1;
        if !clean {
            continue;
        }
        let mut rows = Vec::new();
        let read = crate::shard::reader::ShardFile::open(&path, number, shard.checksum).and_then(|f| {
            let key = crate::shard::index_file::ShardKey::of(&f, &shards_dir);
            f.index_rows(&mut rows).map(|()| key)
        });
        match read {
            Ok(key) => {
                compacted.extend(rows.iter().map(|r| r.loc).filter(|l| in_log.contains(l)));
                if all_steps_read {
                    if let Some(check) = index_check.as_mut() {
                        check.add(key, rows);
                    }
                }
            }
            Err(e) => {
                all_steps_read = false;
                report.problems.push(Problem { path: path.clone(), offset: 0, what: e.message().to_owned() });
            }
        }
    }
    drop(in_log);
    if manifest.pending.is_empty() && all_steps_read {
        use crate::shard::index_check::Verdict;
        let path = shards_dir.join(crate::shard::index_file::INDEX_FILE_NAME);
        // No file (or a stale one): nothing to check but the cache.
        match index_check.map_or(Verdict::Same, |c| c.finish()) {
            Verdict::Differs(what) => report.problems.push(Problem {
                path,
                offset: 0,
                what: format!("shard index file: {what}; delete it (it holds nothing the shards do not) and the next writable open writes it anew"),
            }),
            verdict => {
                if let Verdict::NotChecked(why) = verdict {
                    report.not_checked.push((path, format!("shard index file not checked: {why}")));
                }
                // The annotation cache over it (format-spec/shard-index.md §7),
                // against what its listed segments hold.
                if let Some(what) = crate::store::check_annotation_cache(dir, &manifest) {
                    report.problems.push(Problem {
                        path: shards_dir.join(crate::store::ANNOTATION_CACHE_FILE),
                        offset: 0,
                        what: format!("annotation cache: {what}; delete it (it holds nothing the segments do not) and the next writable open writes it anew"),
                    });
                }
            }
        }
    }
    // The backlog index file (format-spec/backlog-index.md), if current.
    if let Some(what) = crate::store::check_backlog_file(dir, &manifest) {
        report.problems.push(Problem {
            path: dir.join(crate::store::BACKLOG_FILE),
            offset: 0,
            what: format!("backlog index file: {what}; delete it (it holds nothing the segments do not) and the next writable open (or the writer, as it rolls) writes it anew"),
        });
    }
    // The rewards side table (format-spec/shard.md §8), if there is one.
    let rewards = shards_dir.join(crate::store::REWARDS_FILE);
    if rewards.exists() {
        match crate::store::check_rewards_file(&rewards) {
            Ok(n) => report.rewards_sessions = Some(n),
            Err(what) => report.problems.push(Problem {
                path: rewards,
                offset: 0,
                what: format!("rewards side table: {what} (a writable compaction rewrites it from the log)"),
            }),
        }
    }
    // The deletions side table (format-spec/shard.md §9), if there is one.
    let deletions = shards_dir.join(crate::store::DELETIONS_FILE);
    if deletions.exists() {
        match crate::store::check_deletions(dir, &manifest) {
            Ok(c) => report.deletions = Some(c),
            Err(what) => report.problems.push(Problem {
                path: deletions,
                offset: 0,
                what: format!("deletions side table: {what}"),
            }),
        }
    }
    missing.retain(|(loc, _)| !compacted.contains(loc));
    if missing.is_empty() {
        return Ok(report);
    }
    // Only a record a read reaches must find its parent: that takes an
    // open of the store, made only when some parent is not there.
    parents.sort_unstable();
    let needed = records_a_read_reaches(dir, &parents);
    drop(parents);
    for (loc, parent) in missing {
        if needed.as_ref().is_some_and(|n| !n.contains(&loc)) {
            continue;
        }
        report.problems.push(Problem {
            path: crate::storage::segment_path(dir, loc.segment),
            offset: loc.offset,
            what: format!("prefix-delta parent (segment {}, offset {}) is missing", parent.segment, parent.offset),
        });
    }
    Ok(report)
}
