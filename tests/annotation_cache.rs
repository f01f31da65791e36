//! The annotation cache, `DIR/shards/index.tsa` (format-spec/shard-index.md
//! §7): an open that takes the carried seals and rewards from it sees what
//! an open that replays them sees; a record that would not commute with it
//! makes the open replay without it; a damaged or stale cache costs time,
//! never data, and `trajlog verify` reports a damaged one.

mod common;

use common::*;
use std::path::Path;
use trajlog::{Call, CompactOptions, Snapshot, Store, Target};

/// Everything a reader can ask about sessions and rewards, as text.
fn fingerprint(snap: &Snapshot, trace_ids: &[String]) -> Vec<String> {
    let mut out = vec![format!("calls {}", snap.call_count())];
    for s in snap.sessions() {
        let ids: Vec<String> =
            snap.session(&s.session_id, None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
        let reward = snap.session_reward(&s.session_id).map(f64::to_bits);
        out.push(format!("{s:?} {ids:?} sealed {} reward {reward:?}", snap.is_sealed(&s.session_id)));
    }
    for t in trace_ids {
        let live = snap.get(t).unwrap().map(|c| c.session_id().to_owned());
        out.push(format!("{t}: {live:?} reward {:?}", snap.trace_reward(t).map(f64::to_bits)));
    }
    out
}

/// [`fingerprint`], or the error the view reports once a lookup met a
/// damaged block (a read-only open checks the cache's tables a block at a
/// time: the lookup missed, so the answers before the error may be wrong).
fn fingerprint_checked(snap: &Snapshot, trace_ids: &[String]) -> trajlog::Result<Vec<String>> {
    let mut out = vec![format!("calls {}", snap.call_count())];
    for s in snap.sessions() {
        let ids: Vec<String> =
            snap.session(&s.session_id, None, None)?.iter().map(|c| c.trace_id().to_owned()).collect();
        let reward = snap.session_reward(&s.session_id).map(f64::to_bits);
        out.push(format!("{s:?} {ids:?} sealed {} reward {reward:?}", snap.is_sealed(&s.session_id)));
    }
    for t in trace_ids {
        let live = snap.get(t)?.map(|c| c.session_id().to_owned());
        out.push(format!("{t}: {live:?} reward {:?}", snap.trace_reward(t).map(f64::to_bits)));
    }
    snap.check_index()?;
    Ok(out)
}

fn cache_path(dir: &Path) -> std::path::PathBuf {
    dir.join("shards").join("index.tsa")
}

/// A read-only open's fingerprint and how many segments it took from the
/// cache; then the same with the cache taken away (in a copy).
fn open_both_ways(dir: &Path, ids: &[String]) -> (Vec<String>, usize, Vec<String>) {
    let ro = Store::open_read_only(dir).unwrap();
    let snap = ro.snapshot();
    let with = fingerprint(&snap, ids);
    let cached = snap.index_layers().cached_annotation_segments;
    drop((snap, ro));
    let copy = tempdir();
    for (path, bytes) in files(dir) {
        let to = copy.path().join(path.strip_prefix(dir).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, bytes).unwrap();
    }
    let _ = std::fs::remove_file(cache_path(copy.path()));
    let without = fingerprint(&Store::open_read_only(copy.path()).unwrap().snapshot(), ids);
    (with, cached, without)
}

fn call(trace: &str, session: &str, t: f64) -> Call {
    Call {
        trace_id: trace.into(),
        session_id: session.into(),
        timestamp: t,
        prompt_token_ids: vec![1, 2, 3],
        completion_token_ids: vec![4, 5],
        logprobs: Some(vec![-0.5, f32::NEG_INFINITY]),
        ..Default::default()
    }
}

/// Sessions s0..s{n-1} of one call x0..x{n-1} each, given a session reward
/// where `reward` says and sealed; returns the trace ids.
fn sealed_sessions(store: &Store, n: usize, reward: impl Fn(usize) -> Option<f64>) -> Vec<String> {
    for s in 0..n {
        store.append(call(&format!("x{s}"), &format!("s{s}"), s as f64)).unwrap();
        if let Some(r) = reward(s) {
            store.set_reward(Target::Session(format!("s{s}")), r).unwrap();
        }
        store.seal_session(&format!("s{s}")).unwrap();
    }
    (0..n).map(|s| format!("x{s}")).collect()
}

/// Sessions compacted twice over, with seals, session rewards (one changed
/// after compaction) and trace rewards: the retirements carry them into
/// annotation-only segments, which the cache lists.
#[test]
fn an_open_from_the_cache_sees_what_a_replay_sees() {
    let dir = tempdir();
    let all = chained_calls(24, 3);
    let ids: Vec<String> = all.iter().map(|c| c.trace_id.clone()).collect();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    for half in [0..12, 12..24] {
        for s in half.clone() {
            for c in all.iter().filter(|c| c.session_id == format!("s{s}")) {
                store.append(c.clone()).unwrap();
            }
            store.set_reward(Target::Trace(format!("t{s}-1")), s as f64 + 0.25).unwrap();
            store.set_reward(Target::Session(format!("s{s}")), -(s as f64)).unwrap();
            store.seal_session(&format!("s{s}")).unwrap();
        }
        store.compact(&CompactOptions::default()).unwrap();
    }
    // After compaction: a new reward, a reward changed, a trace reward.
    store.set_reward(Target::Session("s3".into()), f64::from_bits(0x0000_0000_0000_0123)).unwrap();
    store.set_reward(Target::Trace("t5-2".into()), -0.0).unwrap();
    store.roll().unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let writer = fingerprint(&store.snapshot(), &ids);
    store.close().unwrap();
    assert!(cache_path(dir.path()).exists(), "the publications wrote the cache");

    let (with, cached, without) = open_both_ways(dir.path(), &ids);
    assert!(cached > 0, "the open took the carried annotations from the cache");
    assert_eq!(with, without);
    assert_eq!(with, writer);
    assert!(with.iter().any(|l| l.contains("\"s3\"") && l.contains("reward Some(291)")), "{with:?}");
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());

    // A writable open uses it too, and sees the same.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert!(store.snapshot().index_layers().cached_annotation_segments > 0);
    assert_eq!(fingerprint(&store.snapshot(), &ids), writer);
}

/// A compacted session deleted after its seal was carried: the deletion
/// comes after every listed record of it, so the cache is used.
#[test]
fn a_deletion_after_the_carried_seal_keeps_the_cache_in_use() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let ids = sealed_sessions(&store, 4, |s| Some(s as f64));
    store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(store.delete_session("s1").unwrap(), 1);
    store.roll().unwrap();
    let writer = fingerprint(&store.snapshot(), &ids);
    store.close().unwrap();
    let (with, cached, without) = open_both_ways(dir.path(), &ids);
    assert!(cached > 0);
    assert_eq!(with, without);
    assert_eq!(with, writer);
    assert!(with.iter().any(|l| l.starts_with("x1: None")), "{with:?}");
}

/// A compacted session deleted, written to again, sealed and compacted,
/// its new seal carried into a segment after the deletion: replayed after
/// the cache's values, the deletion would clear that seal. The open sees
/// the conflict and replays without the cache.
#[test]
fn a_deletion_before_a_later_carried_seal_makes_the_open_replay() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    sealed_sessions(&store, 4, |_| None);
    store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(store.delete_session("s1").unwrap(), 1);
    store.roll().unwrap();
    store.append(call("y1", "s1", 10.0)).unwrap();
    store.set_reward(Target::Session("s1".into()), 7.0).unwrap();
    store.seal_session("s1").unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let ids: Vec<String> = ["x0", "x1", "x2", "x3", "y1"].map(String::from).to_vec();
    let writer = fingerprint(&store.snapshot(), &ids);
    store.close().unwrap();
    assert!(cache_path(dir.path()).exists());
    let (with, cached, without) = open_both_ways(dir.path(), &ids);
    assert_eq!(with, without);
    assert_eq!(with, writer);
    let s1 = with.iter().find(|l| l.contains("session_id: \"s1\"")).expect("s1 listed");
    assert!(s1.contains("[\"y1\"] sealed true reward Some(4619567317775286272)"), "{s1}");
    // The seal of s1 was carried after the deletion: the cache was set
    // aside (taken, s1 would have come out unsealed, with no reward).
    assert_eq!(cached, 0);
}

/// A damaged cache is not used (the open replays), or, where the damage is
/// in a per-session table that a read-only open checks a block at a time,
/// the view's reads report it once a lookup met it and a refresh loads the
/// view without it; never another answer. `trajlog verify` names it.
#[test]
fn a_damaged_cache_costs_time_not_data() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let ids = sealed_sessions(&store, 6, |s| Some(s as f64 / 3.0));
    store.compact(&CompactOptions::default()).unwrap();
    let writer = fingerprint(&store.snapshot(), &ids);
    store.close().unwrap();
    let path = cache_path(dir.path());
    let good = std::fs::read(&path).unwrap();
    // Every byte flipped in turn: never a panic, never another answer.
    let (mut not_used, mut reported) = (0, 0);
    for at in (0..good.len()).step_by(good.len().div_ceil(64)) {
        let mut bad = good.clone();
        bad[at] ^= 0x5a;
        std::fs::write(&path, &bad).unwrap();
        let ro = Store::open_read_only(dir.path()).unwrap();
        let snap = ro.snapshot();
        if snap.index_layers().cached_annotation_segments == 0 {
            not_used += 1;
        }
        match fingerprint_checked(&snap, &ids) {
            Ok(f) => assert_eq!(f, writer, "byte {at}"),
            Err(e) => {
                assert!(e.to_string().contains("index.tsa"), "byte {at}: {e}");
                reported += 1;
                drop(snap);
                ro.refresh().unwrap();
                assert_eq!(ro.snapshot().index_layers().cached_annotation_segments, 0, "byte {at}");
                assert_eq!(fingerprint(&ro.snapshot(), &ids), writer, "byte {at}");
            }
        }
        let problems = trajlog::verify::verify_dir(dir.path()).unwrap().problems;
        assert!(problems.iter().any(|p| p.what.contains("annotation cache")), "byte {at}: {problems:?}");
    }
    assert!(not_used > 0 && reported > 0, "both outcomes met: {not_used} not used, {reported} reported");
    // A writer checks it a block at a time too: it does without it (and
    // writes it anew), or its views' reads that meet a bad block report it,
    // its next flush refuses further writes and removes the file, and the
    // next open writes it anew. Never another answer.
    let mut writer_reported = 0;
    for at in (0..good.len()).step_by(good.len().div_ceil(24)) {
        let mut bad = good.clone();
        bad[at] ^= 0x5a;
        std::fs::write(&path, &bad).unwrap();
        let store = Store::open(dir.path(), small_segments()).unwrap();
        match fingerprint_checked(&store.snapshot(), &ids) {
            Ok(f) => {
                assert_eq!(f, writer, "byte {at}, writer");
                store.close().unwrap();
            }
            Err(e) => {
                assert!(e.to_string().contains("index.tsa"), "byte {at}: {e}");
                assert_eq!(store.flush().unwrap_err().kind(), &trajlog::ErrorKind::Poisoned, "byte {at}");
                assert!(!path.exists(), "byte {at}: removed");
                drop(store);
                drop(Store::open(dir.path(), small_segments()).unwrap());
                assert_eq!(std::fs::read(&path).unwrap(), good, "byte {at}: written anew");
                writer_reported += 1;
            }
        }
    }
    assert!(writer_reported > 0, "a writer's read met a bad block");
    // Cut short: the same.
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    assert_eq!(fingerprint(&Store::open_read_only(dir.path()).unwrap().snapshot(), &ids), writer);
    // A writable open that could not use it writes it anew.
    drop(Store::open(dir.path(), small_segments()).unwrap());
    assert_eq!(std::fs::read(&path).unwrap(), good);
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
}

/// Every shard collected: the old index file and cache stay on disk but
/// describe nothing; opens answer right, and a writable open deletes the
/// cache it can key to no index file.
#[test]
fn a_cache_left_by_collected_shards_is_deleted_by_a_writable_open() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let ids = sealed_sessions(&store, 3, |_| Some(1.0));
    store.compact(&CompactOptions::default()).unwrap();
    store.roll().unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    for s in 0..3 {
        store.delete_session(&format!("s{s}")).unwrap();
    }
    let r = store.compact(&CompactOptions::default().collect_dead_fraction(Some(0.0))).unwrap();
    assert!(!r.collected_generations.is_empty(), "{r:?}");
    store.close().unwrap();
    let (with, _, without) = open_both_ways(dir.path(), &ids);
    assert_eq!(with, without);
    assert_eq!(with, vec!["calls 0", "x0: None reward None", "x1: None reward None", "x2: None reward None"]);
    drop(Store::open(dir.path(), small_segments()).unwrap());
    assert!(Store::open_read_only(dir.path()).unwrap().snapshot().shard_paths().is_empty());
    assert!(!cache_path(dir.path()).exists());
}

/// A listed segment's footer damaged (its trailer intact): `trajlog verify`
/// says so by name, rather than that the segment holds other records.
#[test]
fn verify_names_a_listed_segment_whose_footer_is_damaged() {
    use trajlog::format::segment::{decode_trailer, TRAILER_BYTES};
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    sealed_sessions(&store, 6, |s| Some(s as f64 / 3.0));
    store.compact(&CompactOptions::default()).unwrap();
    store.close().unwrap();
    assert!(cache_path(dir.path()).exists());
    let mut segments: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tlog"))
        .collect();
    segments.sort();
    let mut named = 0;
    for path in segments {
        let good = std::fs::read(&path).unwrap();
        let len = good.len() as u64;
        let Some(t) = decode_trailer(&good[(len - TRAILER_BYTES) as usize..], len) else { continue };
        let mut bad = good.clone();
        bad[(t.footer_offset + t.footer_len / 2) as usize] ^= 0x5a;
        std::fs::write(&path, &bad).unwrap();
        let problems = trajlog::verify::verify_dir(dir.path()).unwrap().problems;
        std::fs::write(&path, &good).unwrap();
        let cache: Vec<_> = problems.iter().filter(|p| p.what.contains("annotation cache")).collect();
        assert!(cache.iter().all(|p| !p.what.contains("holds a record other than")), "{}: {cache:?}", path.display());
        if cache.iter().any(|p| p.what.contains("is damaged") && p.what.contains(&*path.to_string_lossy())) {
            named += 1;
        }
    }
    assert!(named > 0, "a listed segment's damaged footer was named");
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
}
