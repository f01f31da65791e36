//! The deletions side table `shards/_deleted.parquet` (format-spec/shard.md
//! §9): a reader that skips the rows it lists sees in the shard files exactly
//! the compacted calls the store serves, whatever was deleted or replaced
//! since their compaction, across collections, merges and reopens; `trajlog
//! verify` checks it.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::Array;
use common::*;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use trajlog::{Call, CompactOptions, Selection, Store};

/// The table: listed (row, session_id, trace_id) by path under `shards/`.
type Listed = BTreeMap<String, Vec<(i64, String, Option<String>)>>;

fn read_table(dir: &Path) -> Option<Listed> {
    let file = std::fs::File::open(dir.join("shards").join("_deleted.parquet")).ok()?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).expect("side table parses");
    let kv = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    let version = kv.iter().find(|e| e.key == "trajlog.deletions_format_version").and_then(|e| e.value.clone());
    assert_eq!(version.as_deref(), Some("1"));
    let mut out = Listed::new();
    for batch in builder.build().expect("reader") {
        let batch = batch.expect("batch");
        let (p, r, s, t) = (
            batch.column(0).as_string::<i32>(),
            batch.column(1).as_primitive::<Int64Type>(),
            batch.column(2).as_string::<i32>(),
            batch.column(3).as_string::<i32>(),
        );
        for i in 0..batch.num_rows() {
            let trace = (!t.is_null(i)).then(|| t.value(i).to_owned());
            out.entry(p.value(i).to_owned()).or_default().push((r.value(i), s.value(i).to_owned(), trace));
        }
    }
    Some(out)
}

/// The published shard files, from the manifest.
fn published(dir: &Path) -> Vec<String> {
    let m = trajlog::format::manifest::decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    m.shards.into_iter().map(|s| s.path).collect()
}

/// What a reader applying the table sees: the `steps` rows (trace id,
/// session id) and the `trajectories` rows (session id, trace ids) it keeps.
/// Checks that every listed row names its file's row as it is.
#[allow(clippy::type_complexity)]
fn visible(dir: &Path) -> (Vec<(String, String)>, Vec<(String, Vec<String>)>) {
    let table = read_table(dir).unwrap_or_default();
    let (mut steps, mut trajectories) = (Vec::new(), Vec::new());
    for path in published(dir) {
        let listed: BTreeMap<i64, (String, Option<String>)> = table
            .get(&path)
            .map(|rows| rows.iter().map(|(r, s, t)| (*r, (s.clone(), t.clone()))).collect())
            .unwrap_or_default();
        let file = std::fs::File::open(dir.join("shards").join(&path)).unwrap();
        let mut row = 0i64;
        for batch in ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap() {
            let batch = batch.unwrap();
            let sid = batch.column_by_name("session_id").unwrap().as_string::<i32>().clone();
            for i in 0..batch.num_rows() {
                let (session, trace) = if path.starts_with("steps/") {
                    let t = batch.column_by_name("trace_id").unwrap().as_string::<i32>().value(i).to_owned();
                    (sid.value(i).to_owned(), Some(t))
                } else {
                    (sid.value(i).to_owned(), None)
                };
                match listed.get(&row) {
                    Some(l) => assert_eq!(l, &(session, trace), "{path} row {row}: the table names the row as it is"),
                    None if path.starts_with("steps/") => steps.push((trace.unwrap(), session)),
                    None => {
                        let ids = batch.column_by_name("trace_ids").unwrap().as_list::<i32>().value(i);
                        let ids = ids.as_string::<i32>().iter().map(|s| s.unwrap().to_owned()).collect();
                        trajectories.push((session, ids));
                    }
                }
                row += 1;
            }
        }
        assert!(listed.keys().all(|r| *r < row), "{path}: a listed row past the file's {row} rows");
    }
    (steps, trajectories)
}

/// The compacted calls the store serves: (trace id, session id).
fn served_compacted(store: &Store) -> Vec<(String, String)> {
    let mut out = Vec::new();
    store
        .snapshot()
        .for_each_call(|c| {
            if c.is_compacted() {
                out.push((c.trace_id().to_owned(), c.session_id().to_owned()));
            }
            Ok(())
        })
        .unwrap();
    out.sort();
    out
}

/// The reader's view equals the store's: each compacted call served once,
/// no other `steps` row; every kept trajectory of a live session, made of
/// served calls. With `whole`, every served call is in a kept trajectory
/// (no call was replaced inside a compacted trajectory).
fn assert_reader_sees_the_store(dir: &Path, store: &Store, whole: bool) {
    let (mut steps, trajectories) = visible(dir);
    steps.sort();
    let served = served_compacted(store);
    assert_eq!(steps, served, "the steps rows a reader keeps are the compacted calls served");
    let served: BTreeSet<&str> = served.iter().map(|(t, _)| t.as_str()).collect();
    let mut in_trajectories = BTreeSet::new();
    for (session, ids) in &trajectories {
        for t in ids {
            assert!(served.contains(t.as_str()), "kept trajectory of {session} holds {t}, which is not served");
            assert!(in_trajectories.insert(t.as_str()), "{t} in two kept trajectories");
        }
    }
    if whole {
        assert_eq!(in_trajectories, served, "every served call is in a kept trajectory");
    }
}

fn call(session: &str, k: usize, variant: u32) -> Call {
    Call {
        trace_id: format!("{session}/{k}"),
        session_id: session.to_owned(),
        timestamp: k as f64,
        prompt_token_ids: vec![1, 2, 3, k as u32],
        completion_token_ids: vec![10 + variant, 11, k as u32],
        logprobs: Some(vec![-0.5, -0.25, -(variant as f32)]),
        ..Default::default()
    }
}

fn no_collect() -> CompactOptions {
    CompactOptions::default().collect_dead_fraction(None).merge_fanout(None)
}

/// A store of sessions a, b and c of `calls` calls each, sealed and
/// compacted without collection.
fn abc_compacted(dir: &Path, calls: usize) -> Store {
    let store = Store::open(dir, small_segments()).unwrap();
    for s in ["a", "b", "c"] {
        for k in 0..calls {
            store.append(call(s, k, 0)).unwrap();
        }
        store.seal_session(s).unwrap();
    }
    store.compact(&no_collect()).unwrap();
    store
}

#[test]
fn deleted_sessions_rows_are_listed_until_collected() {
    let dir = tempdir();
    let store = abc_compacted(dir.path(), 3);
    assert_eq!(read_table(dir.path()), Some(Listed::new()), "written empty with the first shards");
    assert_reader_sees_the_store(dir.path(), &store, true);

    store.delete_session("b").unwrap();
    // Not published yet: verify counts the rows dead since.
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let d = report.deletions.expect("checked");
    // b's three steps rows and its three trajectories (each call is a chain
    // of its own: no prompt extends the one before).
    assert_eq!((d.listed, d.not_yet_listed), (0, 6));

    store.compact(&no_collect()).unwrap();
    let table = read_table(dir.path()).unwrap();
    let steps = "steps/part-000001-0000.parquet".to_owned();
    let trajectories = "trajectories/part-000001-0000.parquet".to_owned();
    // Sessions in order a, b, c: b's calls are rows 3..6 of both tables.
    let want: Listed = [
        (steps.clone(), (3..6).map(|k| (k, "b".to_owned(), Some(format!("b/{}", k - 3)))).collect()),
        (trajectories.clone(), (3..6).map(|k| (k, "b".to_owned(), None)).collect()),
    ]
    .into_iter()
    .collect();
    assert_eq!(table, want);
    assert_reader_sees_the_store(dir.path(), &store, true);
    let d = trajlog::verify::verify_dir(dir.path()).unwrap().deletions.expect("checked");
    assert_eq!((d.listed, d.not_yet_listed), (6, 0));

    // A compaction with nothing new leaves the file as it is.
    let before = std::fs::metadata(dir.path().join("shards/_deleted.parquet")).unwrap();
    store.compact(&no_collect()).unwrap();
    let after = std::fs::metadata(dir.path().join("shards/_deleted.parquet")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(before.ino(), after.ino(), "an unchanged table is not rewritten");

    // A second deletion in the same file: listed with the first.
    store.delete_session("a").unwrap();
    store.compact(&no_collect()).unwrap();
    let table = read_table(dir.path()).unwrap();
    assert_eq!(table[&steps].len(), 6);
    assert_eq!(table[&trajectories].iter().map(|r| r.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    assert_reader_sees_the_store(dir.path(), &store, true);

    // Across a reopen, and after a collection drops the dead rows.
    drop(store);
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_reader_sees_the_store(dir.path(), &store, true);
    store.compact(&CompactOptions::default().collect_dead_fraction(Some(0.0))).unwrap();
    assert_eq!(read_table(dir.path()), Some(Listed::new()), "nothing dead after the collection");
    assert_reader_sees_the_store(dir.path(), &store, true);
    assert_eq!(served_compacted(&store).len(), 3);
}

#[test]
fn a_replaced_calls_row_and_its_trajectory_are_listed() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    for k in 0..3 {
        store.append(call("open", k, 0)).unwrap();
    }
    let older = CompactOptions::default().selection(Selection::OlderThan(0.0)).collect_dead_fraction(None);
    store.compact(&older).unwrap();
    // The session is not sealed: its call 1 can be replaced.
    store.append(call("open", 1, 7)).unwrap();
    store.compact(&older).unwrap();
    let table = read_table(dir.path()).unwrap();
    assert_eq!(table["steps/part-000001-0000.parquet"], vec![(1, "open".to_owned(), Some("open/1".to_owned()))]);
    assert_eq!(table["trajectories/part-000001-0000.parquet"].len(), 1, "its trajectory is stale: listed");
    assert_reader_sees_the_store(dir.path(), &store, false);
    let got = store.snapshot().get("open/1").unwrap().unwrap().to_call().unwrap();
    assert_eq!(got.completion_token_ids, vec![17, 11, 1], "the replacement is what is served");
}

#[test]
fn verify_refuses_a_table_that_lists_a_live_row_or_is_damaged() {
    // Two stores whose files have the same names: the table of one, which
    // deleted b, lists rows that are live in the other, which deleted a.
    let (x, y) = (tempdir(), tempdir());
    for (dir, gone) in [(x.path(), "a"), (y.path(), "b")] {
        let store = Store::open(dir, small_segments()).unwrap();
        for s in ["a", "b"] {
            store.append(call(s, 0, 0)).unwrap();
            store.seal_session(s).unwrap();
        }
        store.compact(&no_collect()).unwrap();
        store.delete_session(gone).unwrap();
        store.compact(&no_collect()).unwrap();
    }
    std::fs::copy(y.path().join("shards/_deleted.parquet"), x.path().join("shards/_deleted.parquet")).unwrap();
    let report = trajlog::verify::verify_dir(x.path()).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].what.contains("holds a live call"), "{}", report.problems[0].what);

    std::fs::write(x.path().join("shards/_deleted.parquet"), b"PAR1 not a table").unwrap();
    let report = trajlog::verify::verify_dir(x.path()).unwrap();
    assert!(report.problems.iter().any(|p| p.what.starts_with("deletions side table:")), "{:?}", report.problems);
    // The next compaction writes it anew.
    let store = Store::open(x.path(), small_segments()).unwrap();
    store.compact(&no_collect()).unwrap();
    assert_reader_sees_the_store(x.path(), &store, true);
    drop(store);
    let report = trajlog::verify::verify_dir(x.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[derive(Debug, Clone)]
enum Op {
    /// A new session of this many calls (sealed or not), its first call
    /// also in an earlier session (a uid) or not.
    Session(usize, bool, Option<usize>),
    Delete(usize),
    /// Replace call 0 of a session (refused when it is sealed).
    Replace(usize),
    /// Compact: sealed only or every session; dead fraction collected.
    Compact(bool, Option<f64>),
    /// Compact every session while, meanwhile (shards staged, not yet
    /// published), a session is deleted and a call replaced.
    CompactMeanwhile(usize, usize),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..4, any::<bool>(), proptest::option::weighted(0.25, 0usize..16))
            .prop_map(|(n, sealed, uid)| Op::Session(n, sealed, uid)),
        2 => (0usize..16).prop_map(Op::Delete),
        1 => (0usize..16).prop_map(Op::Replace),
        3 => (any::<bool>(), prop_oneof![Just(None), Just(Some(0.0)), Just(Some(0.5))]).prop_map(|(all, f)| Op::Compact(all, f)),
        1 => (0usize..16, 0usize..16).prop_map(|(d, r)| Op::CompactMeanwhile(d, r)),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn a_reader_applying_the_table_sees_what_the_store_serves(ops in proptest::collection::vec(op(), 1..24)) {
        let dir = tempdir();
        let mut store = Store::open(dir.path(), small_segments()).unwrap();
        let mut sessions = 0usize;
        let mut variant = 0u32;
        for op in ops {
            match op {
                Op::Session(n, sealed, uid) => {
                    let s = format!("s{sessions}");
                    let uid = uid.filter(|_| sessions > 0).map(|u| format!("s{}", u % sessions));
                    sessions += 1;
                    for k in 0..n {
                        let mut c = call(&s, k, 0);
                        if k == 0 {
                            c.session_uids = uid.iter().cloned().collect();
                        }
                        // Refused when the uid names a sealed session.
                        let _ = store.append(c);
                    }
                    if sealed {
                        store.seal_session(&s).unwrap();
                    }
                }
                Op::Delete(i) if sessions > 0 => {
                    store.delete_session(&format!("s{}", i % sessions)).unwrap();
                }
                Op::Replace(i) if sessions > 0 => {
                    let s = format!("s{}", i % sessions);
                    variant += 1;
                    // Refused for a sealed or deleted session: nothing to check.
                    let _ = store.append(call(&s, 0, variant));
                }
                Op::Compact(all, fraction) => {
                    let selection = if all { Selection::OlderThan(0.0) } else { Selection::SealedOnly };
                    let opts = CompactOptions::default().selection(selection).collect_dead_fraction(fraction);
                    store.compact(&opts).unwrap();
                    assert_reader_sees_the_store(dir.path(), &store, false);
                }
                Op::CompactMeanwhile(d, r) => {
                    let opts = CompactOptions::default().selection(Selection::OlderThan(0.0)).collect_dead_fraction(Some(0.5));
                    variant += 1;
                    let n = sessions.max(1);
                    let st = &store;
                    st.compact_with_meanwhile(&opts, &mut || {
                        let _ = st.delete_session(&format!("s{}", d % n));
                        let _ = st.append(call(&format!("s{}", r % n), 0, variant));
                    })
                    .unwrap();
                    assert_reader_sees_the_store(dir.path(), &store, false);
                }
                Op::Reopen => {
                    drop(store);
                    store = Store::open(dir.path(), small_segments()).unwrap();
                }
                _ => {}
            }
        }
        store.compact(&CompactOptions::default().collect_dead_fraction(None)).unwrap();
        assert_reader_sees_the_store(dir.path(), &store, false);
        drop(store);
        let report = trajlog::verify::verify_dir(dir.path()).unwrap();
        prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
        if let Some(d) = report.deletions {
            prop_assert_eq!(d.not_yet_listed, 0);
        }
    }
}

#[test]
fn trajectories_row_groups_without_a_dead_session_are_skipped_exactly() {
    // 120 sessions of one call each in 4-row trajectories row groups: the
    // deleted sessions' rows are found through the row groups' session_id
    // bounds, the others not read.
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    for s in 0..120 {
        let s = format!("s{s}");
        store.append(call(&s, 0, 0)).unwrap();
        store.seal_session(&s).unwrap();
    }
    let opts = no_collect().steps_row_group_rows(3).trajectories_row_group_rows(4);
    store.compact(&opts).unwrap();
    for s in ["s0", "s57", "s58", "s119", "s99"] {
        store.delete_session(s).unwrap();
    }
    store.compact(&opts).unwrap();
    let table = read_table(dir.path()).unwrap();
    let listed: BTreeSet<&str> = table.values().flatten().map(|(_, s, _)| s.as_str()).collect();
    assert_eq!(listed, BTreeSet::from(["s0", "s119", "s57", "s58", "s99"]));
    assert_eq!(table.values().map(Vec::len).sum::<usize>(), 10, "{table:?}");
    assert_reader_sees_the_store(dir.path(), &store, true);
}

#[test]
fn a_file_the_table_could_not_read_is_read_again_at_the_next_compaction() {
    // Found by review: a trajectories file unreadable at one compaction kept
    // its old rows, and later compactions reused them for good.
    let dir = tempdir();
    let store = abc_compacted(dir.path(), 2);
    store.delete_session("a").unwrap();
    store.compact(&no_collect()).unwrap();
    let t = dir.path().join("shards/trajectories/part-000001-0000.parquet");
    let away = dir.path().join("away.parquet");
    store.delete_session("b").unwrap();
    std::fs::rename(&t, &away).unwrap();
    let r = store.compact(&no_collect()).unwrap();
    assert_eq!(r.deletions_skipped.len(), 1, "{r:?}");
    assert_eq!(r.deletions_skipped[0].0, "trajectories/part-000001-0000.parquet");
    std::fs::rename(&away, &t).unwrap();
    let r = store.compact(&no_collect()).unwrap();
    assert!(r.deletions_skipped.is_empty(), "{r:?}");
    assert_reader_sees_the_store(dir.path(), &store, true);
    drop(store);
    let d = trajlog::verify::verify_dir(dir.path()).unwrap().deletions.expect("checked");
    assert_eq!(d.not_yet_listed, 0);
}
