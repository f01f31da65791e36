//! The rewards side table `shards/_rewards.parquet` (format-spec/shard.md §8):
//! a reader that applies it to the shards sees every reward as the store has
//! it now, whatever was set after compaction, across reopens; and it lists
//! only the sessions whose rewards changed after they were compacted.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::Float64Type;
use arrow_array::Array;
use common::*;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use trajlog::{Call, CompactOptions, Selection, Store, Target};

/// The side table: session rows (session id → its reward) and trace rows
/// (trace id → reward), and the sessions it lists.
#[derive(Debug, Default)]
struct Side {
    sessions: BTreeMap<String, Option<f64>>,
    traces: BTreeMap<String, f64>,
}

fn read_side(dir: &Path) -> Option<Side> {
    let path = dir.join("shards").join("_rewards.parquet");
    let file = std::fs::File::open(path).ok()?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).expect("side table parses");
    let kv = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    let get = |k: &str| kv.iter().find(|e| e.key == k).and_then(|e| e.value.clone());
    assert_eq!(get("trajlog.rewards_format_version").as_deref(), Some("1"));
    assert!(get("trajlog.rewards_through").is_some_and(|t| t.contains(':')));
    let mut side = Side::default();
    for batch in builder.build().expect("reader") {
        let batch = batch.expect("batch");
        let sid = batch.column(0).as_string::<i32>();
        let tid = batch.column(1).as_string::<i32>();
        let reward = batch.column(2).as_primitive::<Float64Type>();
        for i in 0..batch.num_rows() {
            let r = (!reward.is_null(i)).then(|| reward.value(i));
            if tid.is_null(i) {
                assert!(side.sessions.insert(sid.value(i).to_owned(), r).is_none(), "one session row per session");
            } else {
                assert!(side.sessions.contains_key(sid.value(i)), "a trace row follows its session row");
                side.traces.insert(tid.value(i).to_owned(), r.expect("a trace row has a reward"));
            }
        }
    }
    Some(side)
}

/// (session id, trace ids, reward) of every `trajectories` row.
fn trajectory_rows(dir: &Path) -> Vec<(String, Vec<String>, Option<f64>)> {
    let mut out = Vec::new();
    let tdir = dir.join("shards").join("trajectories");
    let Ok(entries) = std::fs::read_dir(&tdir) else { return out };
    for e in entries {
        let p = e.expect("entry").path();
        if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('_') || n.starts_with('.')) {
            continue;
        }
        let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&p).expect("open"))
            .expect("parse")
            .build()
            .expect("reader");
        for batch in reader {
            let batch = batch.expect("batch");
            let col = |n: &str| batch.column_by_name(n).expect(n).clone();
            let (sid, tids, reward) = (col("session_id"), col("trace_ids"), col("reward"));
            let (sid, tids, reward) =
                (sid.as_string::<i32>(), tids.as_list::<i32>(), reward.as_primitive::<Float64Type>());
            for i in 0..batch.num_rows() {
                let ids = tids.value(i);
                let ids = ids.as_string::<i32>().iter().map(|s| s.expect("trace id").to_owned()).collect();
                out.push((sid.value(i).to_owned(), ids, (!reward.is_null(i)).then(|| reward.value(i))));
            }
        }
    }
    out
}

/// The reader's rule (format-spec/shard.md §8) for a `trajectories` row.
fn current(side: &Side, sid: &str, trace_ids: &[String], shard: Option<f64>) -> Option<f64> {
    match side.sessions.get(sid) {
        Some(Some(r)) => Some(*r),
        Some(None) => trace_ids.last().and_then(|t| side.traces.get(t)).copied().or(shard),
        None => shard,
    }
}

/// Every trajectory row, with the side table applied, carries the reward the
/// store has now: the session's, else its last call's.
fn assert_current(dir: &Path, store: &Store) {
    let side = read_side(dir).unwrap_or_default();
    let snap = store.snapshot();
    let rows = trajectory_rows(dir);
    for (sid, tids, shard) in &rows {
        if snap.session(sid, None, None).map(|c| c.is_empty()).unwrap_or(true) {
            continue; // a deleted session's rows are dead
        }
        let want = snap.session_reward(sid).or_else(|| tids.last().and_then(|t| snap.trace_reward(t)));
        let got = current(&side, sid, tids, *shard);
        assert_eq!(got.map(f64::to_bits), want.map(f64::to_bits), "session {sid}, trace ids {tids:?}");
    }
}

fn calls(sessions: usize, steps: usize) -> Vec<Call> {
    chained_calls(sessions, steps)
}

/// A store of `sessions` sessions of `steps` calls, every one sealed and
/// compacted (no reward set yet).
fn compacted(dir: &Path, sessions: usize, steps: usize) -> Store {
    let store = Store::open(dir, small_segments()).unwrap();
    for c in calls(sessions, steps) {
        store.append(c).unwrap();
    }
    for s in 0..sessions {
        store.seal_session(&format!("s{s}")).unwrap();
    }
    store.compact(&CompactOptions::default()).unwrap();
    store
}

#[test]
fn rewards_set_after_compaction_reach_the_side_table_and_only_they() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    for c in calls(6, 3) {
        store.append(c).unwrap();
    }
    for s in 0..4 {
        store.seal_session(&format!("s{s}")).unwrap();
        store.set_reward(Target::Session(format!("s{s}")), s as f64).unwrap();
    }
    // Rewards set before compaction are in the shards: the table lists nothing.
    store.set_reward(Target::Trace("t1-2".into()), 0.5).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).expect("a compaction that published shards writes the table");
    assert!(side.sessions.is_empty() && side.traces.is_empty(), "{side:?}");
    assert_current(dir.path(), &store);

    // After compaction: a session reward, a trace reward on a session without
    // one, and a reward on a session not compacted yet.
    store.set_reward(Target::Session("s0".into()), 10.0).unwrap();
    store.set_reward(Target::Trace("t2-2".into()), -1.5).unwrap();
    store.set_reward(Target::Trace("t5-0".into()), 7.0).unwrap();
    // The table changes at the next publication, also one with nothing new.
    let report = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(report.sessions, 0);
    let side = read_side(dir.path()).unwrap();
    assert_eq!(side.sessions.keys().collect::<Vec<_>>(), ["s0", "s2"]);
    assert_eq!(side.sessions["s0"], Some(10.0));
    assert_eq!(side.sessions["s2"], Some(2.0), "a listed session's row holds its current session reward");
    assert_eq!(side.traces.get("t2-2"), Some(&-1.5));
    assert_current(dir.path(), &store);

    // s5 is compacted now with its reward in its shard row: still not listed.
    store.seal_session("s5").unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).unwrap();
    assert_eq!(side.sessions.keys().collect::<Vec<_>>(), ["s0", "s2"]);
    assert_current(dir.path(), &store);
    store.close().unwrap();
}

#[test]
fn a_reward_noted_before_a_crash_is_published_after_reopen() {
    let dir = tempdir();
    {
        let store = compacted(dir.path(), 3, 2);
        store.set_reward(Target::Session("s1".into()), 3.25).unwrap();
        // Gone without a publication (as a crash would be, once durable).
        drop(store);
    }
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).unwrap();
    assert_eq!(side.sessions.get("s1"), Some(&Some(3.25)));
    assert_eq!(side.sessions.len(), 1, "{side:?}");
    assert_current(dir.path(), &store);
    store.close().unwrap();

    // A reopen after the publication notes nothing again, and what the
    // table lists stays listed when other sessions join it.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.set_reward(Target::Trace("t0-1".into()), 1.0).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).unwrap();
    assert_eq!(side.sessions.keys().collect::<Vec<_>>(), ["s0", "s1"]);
    assert_current(dir.path(), &store);
    store.close().unwrap();
}

#[test]
fn rewards_carried_past_retired_segments_are_not_listed_again() {
    // Retirement appends the current rewards of compacted sessions again
    // (shard.md §6); those are not changes and must not fill the table.
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let all = calls(8, 3);
    for c in &all {
        store.append(c.clone()).unwrap();
    }
    for s in 0..8 {
        store.seal_session(&format!("s{s}")).unwrap();
        store.set_reward(Target::Session(format!("s{s}")), s as f64).unwrap();
    }
    let report = store.compact(&CompactOptions::default()).unwrap();
    assert!(report.retired_segments > 0, "the test needs retired segments");
    store.close().unwrap();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).unwrap();
    assert!(side.sessions.is_empty(), "{side:?}");
    assert_current(dir.path(), &store);
    store.close().unwrap();
}

#[test]
fn a_damaged_side_table_is_rebuilt_from_the_log() {
    let dir = tempdir();
    {
        let store = compacted(dir.path(), 4, 2);
        store.set_reward(Target::Session("s3".into()), 9.0).unwrap();
        store.compact(&CompactOptions::default()).unwrap();
        store.close().unwrap();
    }
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.rewards_sessions, Some(1));
    std::fs::write(dir.path().join("shards").join("_rewards.parquet"), b"not parquet").unwrap();
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].path.ends_with("shards/_rewards.parquet"));
    assert!(
        report.problems[0].what.starts_with("rewards side table: not a readable Parquet file"),
        "{:?}",
        report.problems
    );
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).expect("rewritten");
    assert_eq!(side.sessions.get("s3"), Some(&Some(9.0)));
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
    assert_current(dir.path(), &store);
    store.close().unwrap();
}

#[test]
fn a_deleted_session_leaves_the_side_table() {
    let dir = tempdir();
    let store = compacted(dir.path(), 3, 2);
    store.set_reward(Target::Session("s0".into()), 1.0).unwrap();
    store.set_reward(Target::Session("s1".into()), 2.0).unwrap();
    store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(read_side(dir.path()).unwrap().sessions.len(), 2);
    assert_eq!(store.delete_session("s0").unwrap(), 2);
    store.compact(&CompactOptions::default()).unwrap();
    let side = read_side(dir.path()).unwrap();
    assert_eq!(side.sessions.keys().collect::<Vec<_>>(), ["s1"]);
    store.close().unwrap();
}

/// A seeded random mix of appends, rewards (before and after compaction),
/// seals, compactions, deletions and reopens: after every compaction, the
/// shards with the side table applied carry every current reward, and the
/// table lists no session whose rewards all came before its compaction.
#[test]
fn random_histories_keep_every_trajectory_reward_current() {
    for seed in 1..=12u64 {
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let dir = tempdir();
        let mut store = Store::open(dir.path(), small_segments()).unwrap();
        let all = calls(10, 4);
        let mut appended = 0;
        let mut changed_after: BTreeSet<String> = BTreeSet::new();
        let mut sealed: BTreeSet<String> = BTreeSet::new();
        let mut compacted: BTreeSet<String> = BTreeSet::new();
        for _ in 0..60 {
            match next(10) {
                0..=3 if appended < all.len() => {
                    let c = &all[appended];
                    appended += 1;
                    if !sealed.contains(&c.session_id) {
                        store.append(c.clone()).unwrap();
                    }
                }
                4 | 5 => {
                    let done: Vec<&Call> = all[..appended].iter().collect();
                    if let Some(c) = done.get(next(done.len().max(1) as u64) as usize) {
                        let target = if next(2) == 0 {
                            Target::Session(c.session_id.clone())
                        } else {
                            Target::Trace(c.trace_id.clone())
                        };
                        let value = next(1000) as f64 / 8.0;
                        if store.set_reward(target, value).is_ok() && compacted.contains(&c.session_id) {
                            changed_after.insert(c.session_id.clone());
                        }
                    }
                }
                6 => {
                    let s = format!("s{}", next(10));
                    if all[..appended].iter().any(|c| c.session_id == s) {
                        store.seal_session(&s).unwrap();
                        sealed.insert(s);
                    }
                }
                7 | 8 => {
                    store.compact(&CompactOptions::default().selection(Selection::SealedOnly)).unwrap();
                    compacted.extend(sealed.iter().cloned());
                    assert_current(dir.path(), &store);
                    let side = read_side(dir.path()).unwrap_or_default();
                    for s in side.sessions.keys() {
                        assert!(
                            changed_after.contains(s),
                            "seed {seed}: {s} listed, but no reward changed after its compaction"
                        );
                    }
                }
                _ => {
                    store.close().unwrap();
                    store = Store::open(dir.path(), small_segments()).unwrap();
                }
            }
        }
        store.compact(&CompactOptions::default()).unwrap();
        assert_current(dir.path(), &store);
        store.close().unwrap();
    }
}

/// A trace reward goes to a live call; a trace id with none is refused,
/// with nothing written.
#[test]
fn a_reward_on_a_trace_with_no_live_call_is_refused() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let all = calls(2, 2);
    // Appended and not yet durable is live: the reward follows it in order.
    store.append(all[0].clone()).unwrap();
    store.set_reward(Target::Trace(all[0].trace_id.clone()), 0.5).unwrap();
    for c in &all[1..] {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    let bytes = |store: &Store| store.snapshot().segments().iter().map(|s| s.data_bytes).sum::<u64>();
    let before = bytes(&store);
    let err = store.set_reward(Target::Trace("never-appended".into()), 1.0).unwrap_err();
    assert!(matches!(err.kind(), trajlog::ErrorKind::NotFound), "{err}");
    assert!(err.to_string().contains("\"never-appended\""), "{err}");
    store.flush().unwrap();
    assert_eq!(bytes(&store), before, "a refused reward writes nothing");

    // A deleted session's calls take no reward.
    assert_eq!(store.delete_session(&all[0].session_id).unwrap(), 2);
    let err = store.set_reward(Target::Trace(all[0].trace_id.clone()), 1.0).unwrap_err();
    assert!(matches!(err.kind(), trajlog::ErrorKind::NotFound), "{err}");
    assert_eq!(store.snapshot().trace_reward(&all[0].trace_id), None);
    // A session reward needs no call.
    store.set_reward(Target::Session("no-calls-yet".into()), 2.0).unwrap();
    assert_eq!(store.snapshot().session_reward("no-calls-yet"), Some(2.0));
    store.close().unwrap();
    let store = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(store.snapshot().trace_reward(&all[0].trace_id), None);
    assert_eq!(store.snapshot().trace_reward(&all[2].trace_id), None);
    assert_eq!(store.snapshot().session_reward("no-calls-yet"), Some(2.0));
}

/// A deleted call's reward does not come back at a reopen once the call's
/// shard rows are collected and its deletion retired, while the reward's
/// record stays in a segment a straggler keeps.
#[test]
fn a_deleted_calls_reward_does_not_come_back() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let all = calls(2, 2);
    let (gone, straggler) = (&all[..2], &all[2..]);
    for c in gone {
        store.append(c.clone()).unwrap();
    }
    store.roll().unwrap();
    // The straggler's segment holds the reward's record.
    for c in straggler {
        store.append(c.clone()).unwrap();
    }
    store.set_reward(Target::Trace(gone[1].trace_id.clone()), 1.0).unwrap();
    store.roll().unwrap();
    store.seal_session(&gone[0].session_id).unwrap();
    assert_eq!(store.compact(&CompactOptions::default()).unwrap().calls, 2);
    assert_eq!(store.snapshot().trace_reward(&gone[1].trace_id), Some(1.0));
    assert_eq!(store.delete_session(&gone[0].session_id).unwrap(), 2);
    let r = store.compact(&CompactOptions::default().collect_dead_fraction(Some(0.0))).unwrap();
    assert_eq!(r.dropped_rows, 2, "{r:?}");
    assert_eq!(store.snapshot().trace_reward(&gone[1].trace_id), None);
    store.close().unwrap();

    for read_only in [true, false] {
        let store = if read_only {
            Store::open_read_only(dir.path()).unwrap()
        } else {
            Store::open(dir.path(), small_segments()).unwrap()
        };
        assert_eq!(store.snapshot().trace_reward(&gone[1].trace_id), None, "read-only: {read_only}");
        assert_eq!(store.snapshot().session(&straggler[0].session_id, None, None).unwrap().len(), 2);
    }
    // A call appended again under that trace id starts without a reward.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let mut again = gone[0].clone();
    again.trace_id = gone[1].trace_id.clone();
    again.session_id = "a-new-session".into();
    store.append_durable(again).unwrap();
    assert_eq!(store.snapshot().trace_reward(&gone[1].trace_id), None);
    store.close().unwrap();
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
}

/// Found by the model test: a trace reward on a compacted call, carried
/// forward by retirement, then the trace id appended again and the replaced
/// row collected. The reward stays with the trace id, through a reopen.
#[test]
fn a_trace_reward_survives_retirement_and_a_replacement() {
    let dir = tempdir();
    let store = Store::open(dir.path(), trajlog::Options::default()).unwrap();
    let call = |c: u32| Call {
        trace_id: "t15".into(),
        session_id: "s2".into(),
        prompt_token_ids: vec![1, 2],
        completion_token_ids: vec![c],
        ..Default::default()
    };
    let compact =
        |sel| CompactOptions::default().selection(sel).steps_row_group_rows(3).collect_dead_fraction(Some(0.0));
    let reward = |store: &Store| {
        store.flush().unwrap();
        store.snapshot().trace_reward("t15")
    };
    store.append(call(3)).unwrap();
    store.set_reward(Target::Trace("t15".into()), -67.0).unwrap();
    // Compacted, its segment retired: the reward's record is carried forward.
    store.compact(&compact(Selection::OlderThan(0.0))).unwrap();
    assert_eq!(reward(&store), Some(-67.0));
    // Appended again: the compacted row is dead, and the next compaction
    // collects it.
    store.append(call(4)).unwrap();
    assert_eq!(reward(&store), Some(-67.0));
    let report = store.compact(&compact(Selection::SealedOnly)).unwrap();
    assert_eq!(report.dropped_rows, 1, "the replaced row is collected");
    assert_eq!(reward(&store), Some(-67.0));
    store.close().unwrap();
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().trace_reward("t15"), Some(-67.0), "read-only reopen");
    drop(ro);
    let store = Store::open(dir.path(), trajlog::Options::default()).unwrap();
    assert_eq!(reward(&store), Some(-67.0), "writable reopen");
    let snap = store.snapshot();
    assert_eq!(snap.get("t15").unwrap().unwrap().completion_token_ids(), &[4], "the new call is the live one");
}
