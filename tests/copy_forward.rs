//! The copy-forward collector (format-spec/shard.md §6.3): an unfinished
//! session (a straggler) whose calls are spread over many segments is
//! copied forward by a compaction, and the segments it alone kept are
//! freed; every call still reads bit for bit, with its rewards, before and
//! after a reopen, after more appends to the straggler, and after a power
//! cut at any sync point of the compaction that copies it.

mod common;

use common::{assert_same, copy_dir, segment_frames, tempdir};
use std::path::Path;
use std::sync::Arc;
use trajlog::storage::fault::{CrashAt, FaultPlan};
use trajlog::{Call, CompactOptions, Durability, Options, Store, Target};

const STRAGGLER: &str = "straggler:0";

/// A straggler's call `k`: its prompt extends the previous call's context
/// (a prefix-delta chain), its `messages` the previous history (a messages
/// delta), logprobs with special values.
fn straggler_call(k: usize) -> Call {
    let mut prompt: Vec<u32> = (0..64).collect();
    let mut history = String::from(r#"[{"role":"system","content":"you are an agent"}"#);
    for j in 0..k {
        prompt.extend((0..40).map(|i| (j * 1000 + i + 7) as u32));
        prompt.extend((0..20).map(|i| (j * 1000 + i + 500) as u32));
        history.push_str(&format!(
            r#",{{"role":"assistant","content":"step {j}"}},{{"role":"tool","content":"result {j}"}}"#
        ));
    }
    history.push(']');
    let mut logprobs: Vec<f32> = (0..40).map(|i| -(i as f32) / 3.0).collect();
    logprobs[0] = -0.0;
    logprobs[1] = f32::from_bits(0x7fc0_0042);
    Call {
        trace_id: format!("straggler/{k}"),
        session_id: STRAGGLER.to_owned(),
        timestamp: 10_000.0 + k as f64,
        prompt_token_ids: prompt,
        completion_token_ids: (0..40).map(|i| (k * 1000 + i + 7) as u32).collect(),
        logprobs: Some(logprobs),
        messages: Some(history.into_bytes()),
        response_message: Some(format!(r#"{{"role":"assistant","content":"step {k}"}}"#).into_bytes()),
        ..Default::default()
    }
}

fn options() -> Options {
    // Small segments so that the straggler spreads over many; the timer out
    // of reach so that every fsync comes from a flush, a roll or the
    // manifest (the power-cut test counts them).
    Options::default().segment_bytes(64 << 10).group_commit_ms(60_000)
}

/// 24 finished sessions, sealed, and the straggler's first 12 calls, one
/// after every 12 calls of the others; a trace reward on one straggler
/// call and a session reward. Returns every call appended.
fn build(dir: &Path) -> Vec<Call> {
    let all = build_calls();
    let store = Store::open(dir, options()).unwrap();
    for c in &all {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    store.set_reward(Target::Trace("straggler/3".into()), 0.5).unwrap();
    store.set_reward(Target::Session(STRAGGLER.into()), -1.0).unwrap();
    for s in 0..24 {
        store.seal_session(&format!("s{s}")).unwrap();
    }
    store.close().unwrap();
    all
}

/// The calls [`build`] appends, in order.
fn build_calls() -> Vec<Call> {
    let mut all = Vec::new();
    for (i, c) in common::chained_calls(24, 6).into_iter().enumerate() {
        all.push(c);
        if i % 12 == 11 {
            all.push(straggler_call(i / 12));
        }
    }
    all
}

fn segment_files(dir: &Path) -> Vec<String> {
    common::segment_paths(dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect()
}

fn segment_bytes(dir: &Path) -> u64 {
    segment_files(dir).iter().map(|n| std::fs::metadata(dir.join(n)).unwrap().len()).sum()
}

/// Every call reads back exactly, with the rewards; `verify` finds nothing.
fn check(dir: &Path, all: &[Call]) {
    let store = Store::open(dir, options()).unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), all.len());
    for c in all {
        let v = snap.get(&c.trace_id).unwrap().unwrap_or_else(|| panic!("{} lost", c.trace_id));
        assert_same(&v, c);
    }
    assert_eq!(snap.trace_reward("straggler/3"), Some(0.5));
    assert_eq!(snap.session_reward(STRAGGLER), Some(-1.0));
    let session = snap.session_calls(STRAGGLER, None, None).unwrap();
    let want: Vec<&Call> = all.iter().filter(|c| c.session_id == STRAGGLER).collect();
    assert_eq!(session.len(), want.len(), "the straggler's calls, once each");
    for (got, want) in session.iter().zip(&want) {
        assert_eq!(got.trace_id, want.trace_id, "in order");
        assert_eq!(got.prompt_token_ids, want.prompt_token_ids);
        assert_eq!(got.messages, want.messages);
    }
    drop(snap);
    store.close().unwrap();
    let report = trajlog::verify::verify_dir(dir).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn a_straggler_is_copied_forward_and_the_segments_it_kept_are_freed() {
    let root = tempdir();
    let (with, without) = (root.path().join("with"), root.path().join("without"));
    let mut all = build(&with);
    build(&without);
    let spread = segment_files(&with).len();
    assert!(spread >= 8, "the straggler spreads over many segments: {spread}");

    // Without the collector the straggler keeps every segment it has a call in.
    let store = Store::open(&without, options()).unwrap();
    let r = store.compact(&CompactOptions::default().copy_forward(None)).unwrap();
    assert_eq!((r.sessions, r.copied_sessions), (24, 0));
    store.close().unwrap();
    let kept_without = segment_files(&without).len();
    assert!(kept_without >= 8, "{kept_without} segments kept without copy-forward");

    let store = Store::open(&with, options()).unwrap();
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!((r.sessions, r.copied_sessions, r.copied_calls), (24, 1, 12), "{r:?}");
    assert!(r.copied_bytes > 0);
    store.close().unwrap();
    let kept = segment_files(&with).len();
    assert!(kept <= 3, "{kept} segments left after copying the straggler forward: {:?}", segment_files(&with));
    assert!(
        segment_bytes(&with) * 4 < segment_bytes(&without),
        "{} bytes of segments with copy-forward, {} without",
        segment_bytes(&with),
        segment_bytes(&without)
    );
    check(&with, &all);

    // More of the straggler after the move (its parents are the copies),
    // and compactions that find nothing to move again.
    let store = Store::open(&with, options()).unwrap();
    for k in 12..16 {
        let c = straggler_call(k);
        store.append(c.clone()).unwrap();
        all.push(c);
    }
    store.flush().unwrap();
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(r.sessions, 0);
    store.close().unwrap();
    check(&with, &all);

    // Finished at last: compacted with the rest, exactly.
    let store = Store::open(&with, options()).unwrap();
    store.seal_session(STRAGGLER).unwrap();
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(r.sessions, 1);
    store.close().unwrap();
    check(&with, &all);
}

#[test]
fn a_copied_straggler_moves_again_once_it_spreads_again() {
    let dir = tempdir();
    let mut all = build(dir.path());
    let store = Store::open(dir.path(), options()).unwrap();
    let first = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!((first.copied_sessions, first.copied_calls), (1, 12), "{first:?}");
    // The copies sit in a segment of their own, which the straggler fills
    // (more than a quarter live): it is not copied again for it.
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(r.copied_sessions, 0, "{r:?}");
    // A second wave of finished sessions, the straggler's next calls among
    // them, then their compaction: the straggler keeps the wave's segments
    // and its copies' one, and moves again (a second session-moved record).
    let wave: Vec<Call> = common::chained_calls(12, 6)
        .into_iter()
        .map(|mut c| {
            c.trace_id = format!("w-{}", c.trace_id);
            c.session_id = format!("w-{}", c.session_id);
            c
        })
        .collect();
    for (i, c) in wave.iter().enumerate() {
        store.append(c.clone()).unwrap();
        all.push(c.clone());
        if i % 18 == 17 {
            let s = straggler_call(12 + i / 18);
            store.append(s.clone()).unwrap();
            all.push(s);
        }
    }
    store.flush().unwrap();
    for s in 0..12 {
        store.seal_session(&format!("w-s{s}")).unwrap();
    }
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!((r.sessions, r.copied_sessions, r.copied_calls), (12, 1, 16), "{r:?}");
    store.close().unwrap();
    // Left: the copies, the seals and rewards carried forward (twice), and
    // the active segment.
    assert!(segment_files(dir.path()).len() <= 4, "{:?}", segment_files(dir.path()));
    check(dir.path(), &all);
}

#[test]
fn a_power_cut_at_any_sync_point_of_a_copy_forward_loses_nothing() {
    let root = tempdir();
    let base = root.path().join("base");
    let all = build(&base);
    let run = |dir: &Path, plan: &Arc<CrashAt>| -> (u64, trajlog::Result<trajlog::CompactReport>) {
        plan.assume_durable(dir).unwrap();
        let faults: Arc<dyn FaultPlan> = plan.clone();
        let store = Store::open(dir, options().durability(Durability::Group).faults(Some(faults))).unwrap();
        let at_open = plan.sync_points();
        let r = store.compact(&CompactOptions::default());
        let _ = store.close();
        (at_open, r)
    };
    // Count the compaction's sync points on a copy, without a cut.
    let counted = root.path().join("counted");
    copy_dir(&base, &counted);
    let counter = CrashAt::new(u64::MAX);
    let (at_open, r) = run(&counted, &counter);
    assert_eq!(r.unwrap().copied_sessions, 1);
    let points = counter.sync_points();
    assert!(points > at_open + 3, "the compaction has sync points of its own ({at_open} at open, {points} in all)");
    let mut partial_states = 0;
    for k in at_open..points {
        for torn in [0, 300] {
            let dir = root.path().join(format!("cut-{k}-{torn}"));
            copy_dir(&base, &dir);
            let plan = CrashAt::new(k);
            let (_, r) = run(&dir, &plan);
            assert!(plan.crashed() && r.is_err(), "cut at sync point {k} of {points}: {r:?}");
            plan.drop_unsynced(torn, k).unwrap();
            if torn == 0 && cut_mid_copy(&dir, &root.path().join(format!("partial-{k}"))) {
                partial_states += 1;
            }
            check(&dir, &all);
            // A later compaction finishes what the cut left.
            let store = Store::open(&dir, options()).unwrap();
            store.compact(&CompactOptions::default()).unwrap();
            store.close().unwrap();
            // (A cut after the copies leaves them beside the records the
            // later compaction carries forward: one segment more at most.)
            assert!(segment_files(&dir).len() <= 4, "cut at {k}: {:?}", segment_files(&dir));
            assert!(segment_bytes(&dir) * 4 < segment_bytes(&base), "cut at {k}: {} bytes left", segment_bytes(&dir));
            check(&dir, &all);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
    assert!(partial_states > 0, "some cut left the copies durable and the old segments listed");
}

/// When `dir` holds a durable session-moved record followed by its copies
/// while the segments before it are still listed (a cut after the copies,
/// before the retirement), build in `to` the state of a copy cut short
/// (a crash inside a batch larger than the writer's buffer): the same
/// store, its segment of copies cut after the session-moved record and
/// five copies. The straggler's other calls are then live before its
/// floor, which must not take effect: every call still reads, and a later
/// compaction copies the session again and frees its segments.
fn cut_mid_copy(dir: &Path, to: &Path) -> bool {
    let mut found = None;
    for name in segment_files(dir) {
        let fs = segment_frames(&dir.join(&name));
        if let Some(i) = fs.iter().position(|f| f.1 == 5) {
            let calls: Vec<&(u64, u8, u64)> = fs[i..].iter().filter(|f| f.1 == 1).collect();
            if calls.len() == 12 {
                found = Some((name, calls[4].0 + calls[4].2));
            }
        }
    }
    let Some((name, cut)) = found else { return false };
    // Only the active segment (which recovery scans) can be cut so: a
    // sealed one's footer lists every copy.
    let id: u64 = name.trim_start_matches("seg-").trim_end_matches(".tlog").parse().unwrap();
    let m = trajlog::format::manifest::decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    if !m.segments.iter().any(|s| s.id == id && s.state == trajlog::format::manifest::SegmentState::Active) {
        return false;
    }
    copy_dir(dir, to);
    let file = std::fs::OpenOptions::new().write(true).open(to.join(&name)).unwrap();
    file.set_len(cut).unwrap();
    drop(file);
    check_partial(to);
    true
}

/// [`check`] for a store whose calls are the build's, then a compaction
/// and the check again.
fn check_partial(dir: &Path) {
    let all = build_calls();
    check(dir, &all);
    let store = Store::open(dir, options()).unwrap();
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(r.copied_sessions, 1, "the cut-short copy is done again: {r:?}");
    store.close().unwrap();
    assert!(segment_files(dir).len() <= 4, "{:?}", segment_files(dir));
    check(dir, &all);
    std::fs::remove_dir_all(dir).unwrap();
}
