//! The cold layer (src/store/cold.rs): sessions whose calls are all in
//! sealed segments and that nothing else names are held in flat arrays. A
//! reader answers exactly as the writer's maps do, before and after
//! refreshes that name them (and thaw them); a writer that reopened, or
//! whose index a publication rebuilt, answers as one that did not and as
//! a fresh open. The backlog index file (src/store/backlog_file.rs), which
//! holds a writable open's cold layer for the next opens, changes no
//! answer: an open with it answers as one without it.

use proptest::prelude::*;
use std::path::Path;
use trajlog::{Call, CompactOptions, Options, Snapshot, Store, Target};

/// Everything a reader can ask the index, as text to compare.
fn fingerprint(snap: &Snapshot, trace_ids: &[String]) -> Vec<String> {
    let mut out = vec![format!("calls {}", snap.call_count())];
    for s in snap.sessions() {
        out.push(format!("{s:?}"));
        let calls = snap.session(&s.session_id, None, None).expect("session");
        let ids: Vec<String> = calls.iter().map(|c| format!("{}@{:?}", c.trace_id(), c.loc)).collect();
        out.push(format!("  {ids:?}"));
        out.push(format!("  sealed {} reward {:?}", snap.is_sealed(&s.session_id), snap.session_reward(&s.session_id)));
        for c in &calls {
            let lp: Vec<u32> = c.logprobs().unwrap_or_default().iter().map(|x| x.to_bits()).collect();
            out.push(format!(
                "  {} {:?} {:?} {lp:?}",
                c.trace_id(),
                c.prompt().expect("prompt"),
                c.completion_token_ids()
            ));
        }
    }
    for t in trace_ids {
        let live = snap.get(t).expect("get").map(|c| (c.session_id().to_owned(), c.loc, c.timestamp().to_bits()));
        out.push(format!("{t}: {live:?} reward {:?}", snap.trace_reward(t)));
    }
    let mut scanned = Vec::new();
    snap.for_each_call(|c| {
        scanned.push(format!("{}@{:?}", c.trace_id(), c.loc));
        Ok(())
    })
    .expect("scan");
    scanned.sort();
    out.push(format!("scan {scanned:?}"));
    out
}

#[derive(Debug, Clone)]
enum Op {
    /// A call of session `s` with trace id `t` (a trace id already used in
    /// `s` replaces its call; one of another session is refused and
    /// skipped), and an extra session uid `uid`.
    Append {
        s: u8,
        t: u8,
        uid: Option<u8>,
        ts: u8,
    },
    Seal(u8),
    Delete(u8),
    Reward(u8, i8),
    TraceReward(u8, i8),
    Roll,
    /// A compaction of the sealed sessions (`true`: every dead row
    /// collected, the copy-forward collector at its most eager).
    Compact(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0u8..10, 0u8..60, prop::option::weighted(0.1, 0u8..10), any::<u8>())
            .prop_map(|(s, t, uid, ts)| Op::Append { s, t, uid, ts }),
        1 => (0u8..10).prop_map(Op::Seal),
        1 => (0u8..10).prop_map(Op::Delete),
        1 => (0u8..10, any::<i8>()).prop_map(|(s, r)| Op::Reward(s, r)),
        1 => (0u8..60, any::<i8>()).prop_map(|(t, r)| Op::TraceReward(t, r)),
        3 => Just(Op::Roll),
    ]
}

/// [`op`], and compactions.
fn writer_op() -> impl Strategy<Value = Op> {
    prop_oneof![12 => op(), 1 => any::<bool>().prop_map(Op::Compact)]
}

fn session(s: u8) -> String {
    format!("s{s}")
}

fn trace(t: u8) -> String {
    format!("t{t}")
}

/// Apply `op` through the writer; refusals (a trace id of another session,
/// a deleted session's reward) change nothing and are skipped.
fn apply(store: &Store, op: &Op) {
    let _ = applied(store, op);
}

/// [`apply`], saying whether the writer took the operation.
fn applied(store: &Store, op: &Op) -> bool {
    let done = match op {
        Op::Append { s, t, uid, ts } => {
            let call = Call {
                trace_id: trace(*t),
                session_id: session(*s),
                session_uids: uid.map(session).into_iter().collect(),
                timestamp: f64::from(*ts),
                prompt_token_ids: vec![u32::from(*s), u32::from(*t), 7],
                completion_token_ids: vec![u32::from(*ts), 9],
                logprobs: Some(vec![-0.25 * f32::from(*ts), f32::from_bits(0x8000_0001)]),
                ..Default::default()
            };
            store.append(call).map(drop)
        }
        Op::Seal(s) => store.seal_session(&session(*s)),
        Op::Delete(s) => store.delete_session(&session(*s)).map(drop),
        Op::Reward(s, r) => store.set_reward(Target::Session(session(*s)), f64::from(*r) / 4.0),
        Op::TraceReward(t, r) => store.set_reward(Target::Trace(trace(*t)), f64::from(*r) / 8.0),
        Op::Roll => store.roll(),
        Op::Compact(eager) => {
            let opts = match eager {
                true => CompactOptions::default()
                    .collect_dead_fraction(Some(0.0))
                    .copy_forward(Some(trajlog::COPY_FORWARD_MAX)),
                false => CompactOptions::default(),
            };
            store.compact(&opts).map(drop).map_err(|e| panic!("compact: {e}"))
        }
    };
    done.is_ok()
}

/// What every read answers, without log positions (two stores written by
/// the same operations with a reopen in one of them place records apart).
fn logical(snap: &Snapshot, trace_ids: &[String]) -> Vec<String> {
    let mut out = vec![format!("calls {}", snap.call_count())];
    for s in snap.sessions() {
        out.push(format!("{s:?}"));
        for c in snap.session(&s.session_id, None, None).expect("session") {
            let lp: Vec<u32> = c.logprobs().unwrap_or_default().iter().map(|x| x.to_bits()).collect();
            out.push(format!(
                "  {} {} {:?} {:?} {lp:?} compacted {}",
                c.trace_id(),
                c.timestamp(),
                c.prompt().expect("prompt"),
                c.completion_token_ids(),
                c.is_compacted()
            ));
        }
        out.push(format!("  sealed {} reward {:?}", snap.is_sealed(&s.session_id), snap.session_reward(&s.session_id)));
    }
    for t in trace_ids {
        let live = snap.get(t).expect("get").map(|c| (c.session_id().to_owned(), c.timestamp().to_bits()));
        out.push(format!("{t}: {live:?} reward {:?}", snap.trace_reward(t)));
    }
    // A whole-store scan (segments, then shards) reads every live call once.
    let mut scanned = Vec::new();
    snap.for_each_call(|c| {
        scanned.push(format!("{} {}", c.trace_id(), c.is_compacted()));
        Ok(())
    })
    .expect("scan");
    scanned.sort();
    out.push(format!("scan {scanned:?}"));
    out
}

/// A writer reopened with a cold layer (`a`) and one that never reopens
/// (`b`, its maps only) take the same operations, compactions among them,
/// and answer every read alike; `a` verifies clean. Returns `a`'s cold
/// calls after its reopen.
fn run_writer(a: &Path, b: &Path, before: &[Op], after: &[Op]) -> Result<usize, TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let (sa, sb) =
        (Store::open(a, Options::default()).expect("open"), Store::open(b, Options::default()).expect("open"));
    for o in before {
        apply(&sa, o);
        apply(&sb, o);
    }
    sa.close().expect("close");
    sb.flush().expect("flush");
    let sa = Store::open(a, Options::default()).expect("reopen");
    let cold = sa.snapshot().index_layers().cold_calls;
    prop_assert_eq!(logical(&sa.snapshot(), &ids), logical(&sb.snapshot(), &ids));
    for o in after {
        apply(&sa, o);
        apply(&sb, o);
        // Readers see what is durable.
        sa.flush().expect("flush");
        sb.flush().expect("flush");
        prop_assert_eq!(logical(&sa.snapshot(), &ids), logical(&sb.snapshot(), &ids), "after {:?}", o);
    }
    sa.flush().expect("flush");
    let report = trajlog::verify::verify_dir(a).expect("verify");
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    sa.close().expect("close");
    let ro = Store::open_read_only(a).expect("open read-only");
    prop_assert_eq!(logical(&ro.snapshot(), &ids), logical(&sb.snapshot(), &ids));
    Ok(cold)
}

fn run(dir: &Path, before: &[Op], after: &[Op]) -> Result<usize, TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let store = Store::open(dir, Options::default()).expect("open");
    before.iter().for_each(|o| apply(&store, o));
    store.flush().expect("flush");
    let reader = Store::open_read_only(dir).expect("open read-only");
    let cold = reader.snapshot().index_layers().cold_calls;
    prop_assert_eq!(fingerprint(&reader.snapshot(), &ids), fingerprint(&store.snapshot(), &ids));
    after.iter().for_each(|o| apply(&store, o));
    store.flush().expect("flush");
    reader.refresh().expect("refresh");
    prop_assert_eq!(fingerprint(&reader.snapshot(), &ids), fingerprint(&store.snapshot(), &ids));
    let fresh = Store::open_read_only(dir).expect("open read-only");
    prop_assert_eq!(fingerprint(&fresh.snapshot(), &ids), fingerprint(&store.snapshot(), &ids));
    Ok(cold)
}

/// Append `sessions` sessions `{prefix}-{s}` of `calls` calls each, and
/// seal each.
fn sealed_sessions(store: &Store, prefix: &str, sessions: u32, calls: u32) {
    for s in 0..sessions {
        session_calls(store, prefix, s, calls);
        store.seal_session(&format!("{prefix}-{s}")).expect("seal");
    }
}

/// `calls` calls of session `{prefix}-{s}` (trace ids `{prefix}-{s}-{n}`).
fn session_calls(store: &Store, prefix: &str, s: u32, calls: u32) {
    for n in 0..calls {
        let call = Call {
            trace_id: format!("{prefix}-{s}-{n}"),
            session_id: format!("{prefix}-{s}"),
            timestamp: f64::from(n),
            prompt_token_ids: vec![s, n],
            completion_token_ids: vec![1],
            ..Default::default()
        };
        store.append(call).expect("append");
    }
}

/// A writer compacts 24 sealed sessions of 4 calls over the calls of
/// `before` (rolled into sealed segments): the publication writes the
/// first shard index file, and with at most a quarter of the calls left in
/// segments it hands the writer an index rebuilt over it
/// (store/recovery.rs `Rebuilt`), which surveys the sealed segments as an
/// open does. After it and after each operation of `after`, the writer
/// answers as a fresh read-only open; `verify` finds nothing. Returns the
/// writer's cold calls after the compaction.
fn run_rebuilt(dir: &Path, before: &[Op], after: &[Op], copy_forward: bool) -> Result<usize, TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let store = Store::open(dir, Options::default()).expect("open");
    sealed_sessions(&store, "big", 24, 4);
    before.iter().for_each(|o| apply(&store, o));
    store.roll().expect("roll");
    let opts = CompactOptions::default().copy_forward(copy_forward.then_some(trajlog::COPY_FORWARD_MAX));
    store.compact(&opts).expect("compact");
    store.flush().expect("flush");
    let cold = store.snapshot().index_layers().cold_calls;
    let fresh = Store::open_read_only(dir).expect("open read-only");
    prop_assert_eq!(fingerprint(&store.snapshot(), &ids), fingerprint(&fresh.snapshot(), &ids));
    for o in after {
        apply(&store, o);
        store.flush().expect("flush");
        let fresh = Store::open_read_only(dir).expect("open read-only");
        prop_assert_eq!(fingerprint(&store.snapshot(), &ids), fingerprint(&fresh.snapshot(), &ids), "after {:?}", o);
    }
    let report = trajlog::verify::verify_dir(dir).expect("verify");
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    Ok(cold)
}

/// The backlog index file's name in the store directory.
const BACKLOG: &str = "backlog.tbi";
/// Its delta's.
const BACKLOG_DELTA: &str = "backlog-delta.tbi";

fn backlog_options() -> Options {
    Options::default().backlog_index_min_calls(1)
}

/// A writer opened with `backlog_index_min_calls(1)` on an empty store
/// takes `ops`, waiting after each one for the refresh of the backlog
/// index file its rolls start, and taking the index the refresh built
/// (cold layer mapped from the file) in place of its own; it then goes on
/// appending, annotating and deleting over it (thawing cold sessions).
/// It answers as a read-only open with the file and one without it, and
/// as a writable reopen; `verify` finds nothing. So do read-only opens
/// with the file and without the delta over it (its rolls within the
/// eighth write one). Returns how many times it took a refreshed index,
/// how many of those wrote the file from the one before, and how many
/// were deltas.
fn run_refresh(dir: &Path, ops: &[Op]) -> Result<(usize, usize, usize), TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let file = dir.join(BACKLOG);
    let store = Store::open(dir, backlog_options()).expect("open");
    let (mut adopted, mut incremental, mut deltas, mut compacted) = (0, 0, 0, false);
    for o in ops {
        apply(&store, o);
        (_, adopted, incremental, deltas) = store.wait_backlog_refresh_counts().expect("wait");
        // Until a compaction (its publication rebuilds the index its own way).
        compacted |= matches!(o, Op::Compact(_));
        prop_assert!(compacted || adopted == 0 || store.snapshot().index_layers().backlog_segments > 0);
    }
    store.flush().expect("flush");
    let want = fingerprint(&store.snapshot(), &ids);
    let with = Store::open_read_only(dir).expect("open read-only");
    prop_assert_eq!(&fingerprint(&with.snapshot(), &ids), &want);
    // With shards the files are not used (the publications rebuild the
    // index); they may stay until a retirement makes them stale.
    let used = with.snapshot().index_layers().backlog_segments > 0;
    if file.exists() {
        // The file the writer wrote last (from the one before, or from
        // every footer) against every footer.
        let report = trajlog::verify::verify_dir(dir).expect("verify");
        prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
        let delta = dir.join(BACKLOG_DELTA);
        if delta.exists() {
            std::fs::rename(&delta, dir.join("delta-aside")).expect("move aside");
            let base_only = Store::open_read_only(dir).expect("open read-only");
            if used {
                prop_assert_eq!(base_only.snapshot().index_layers().backlog_segments as u32, listed(dir));
            }
            prop_assert_eq!(&fingerprint(&base_only.snapshot(), &ids), &want);
            std::fs::rename(dir.join("delta-aside"), &delta).expect("move back");
        }
        std::fs::rename(&file, dir.join("aside")).expect("move aside");
        let without = Store::open_read_only(dir).expect("open read-only");
        prop_assert_eq!(without.snapshot().index_layers().backlog_segments, 0);
        prop_assert_eq!(&fingerprint(&without.snapshot(), &ids), &want);
        std::fs::rename(dir.join("aside"), &file).expect("move back");
    }
    store.close().expect("close");
    let reopened = Store::open(dir, backlog_options()).expect("reopen");
    prop_assert_eq!(&fingerprint(&reopened.snapshot(), &ids), &want);
    reopened.wait_backlog_refresh().expect("wait");
    prop_assert_eq!(&fingerprint(&reopened.snapshot(), &ids), &want);
    drop(reopened);
    let report = trajlog::verify::verify_dir(dir).expect("verify");
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    Ok((adopted as usize, incremental as usize, deltas as usize))
}

/// A writer takes `before`, closes, and reopens with
/// `backlog_index_min_calls(1)`: the open writes the backlog index file
/// when its survey built a cold layer. The writer then takes `after`
/// (appends, annotations and deletions that name cold sessions, rolls,
/// compactions that retire listed segments). A read-only open with the
/// file answers as one with the file moved aside and as the writer; so
/// does a writable open after the writer closed, and `verify` finds
/// nothing. Returns the segments the read-only open took from the file.
fn run_backlog(dir: &Path, before: &[Op], after: &[Op]) -> Result<usize, TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let file = dir.join(BACKLOG);
    let aside = dir.join("backlog.aside");
    let store = Store::open(dir, Options::default()).expect("open");
    before.iter().for_each(|o| apply(&store, o));
    store.close().expect("close");
    let store = Store::open(dir, backlog_options()).expect("reopen");
    let cold = store.snapshot().index_layers().cold_calls;
    prop_assert_eq!(file.exists(), cold > 0, "a file iff the open's survey built a cold layer");
    for o in after {
        apply(&store, o);
    }
    store.flush().expect("flush");
    // The writer's own refresh of the file (its rolls start one) is done
    // before the file is moved aside below.
    store.wait_backlog_refresh().expect("wait");
    let with = Store::open_read_only(dir).expect("open read-only");
    let used = with.snapshot().index_layers().backlog_segments;
    let want = fingerprint(&store.snapshot(), &ids);
    prop_assert_eq!(&fingerprint(&with.snapshot(), &ids), &want);
    if file.exists() {
        std::fs::rename(&file, &aside).expect("move aside");
        let without = Store::open_read_only(dir).expect("open read-only");
        prop_assert_eq!(without.snapshot().index_layers().backlog_segments, 0);
        prop_assert_eq!(&fingerprint(&without.snapshot(), &ids), &want);
        std::fs::rename(&aside, &file).expect("move back");
    }
    store.close().expect("close");
    let reopened = Store::open(dir, backlog_options()).expect("reopen");
    prop_assert_eq!(&fingerprint(&reopened.snapshot(), &ids), &want);
    let report = trajlog::verify::verify_dir(dir).expect("verify");
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    Ok(used)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Opens with the backlog index file answer as opens without it, after
    /// any operations since it was written.
    #[test]
    fn an_open_with_the_backlog_file_answers_as_one_without(
        before in prop::collection::vec(op(), 1..80),
        after in prop::collection::vec(writer_op(), 0..30),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        run_backlog(dir.path(), &before, &after)?;
    }

    /// A writer that refreshes the backlog index file as it rolls, and
    /// takes the index mapped from it, answers as opens with and without
    /// the file through the writes that follow.
    #[test]
    fn a_writer_that_refreshes_the_backlog_file_answers_as_an_open(
        ops in prop::collection::vec(writer_op(), 1..80),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        run_refresh(dir.path(), &ops)?;
    }

    /// A writer that refreshes the file and takes its index (waiting
    /// after each operation) and one that never writes it, given the same
    /// operations, take and refuse the same ones and answer the same after
    /// each (log positions included).
    #[test]
    fn a_refreshing_writer_answers_as_one_that_never_refreshes(
        ops in prop::collection::vec(writer_op(), 1..80),
    ) {
        let ids: Vec<String> = (0..60).map(trace).collect();
        let (da, db) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
        let a = Store::open(da.path(), backlog_options()).expect("open");
        let b = Store::open(db.path(), Options::default().backlog_index_min_calls(0)).expect("open");
        for o in &ops {
            let (ra, rb) = (applied(&a, o), applied(&b, o));
            a.wait_backlog_refresh().expect("wait");
            prop_assert_eq!(ra, rb, "the verdict on {:?}", o);
            a.flush().expect("flush");
            b.flush().expect("flush");
            prop_assert_eq!(fingerprint(&a.snapshot(), &ids), fingerprint(&b.snapshot(), &ids), "after {:?}", o);
        }
    }

    /// A writer whose index a publication rebuilt with a cold layer
    /// answers as a fresh open through appends, annotations, deletions,
    /// rolls and compactions that thaw it.
    #[test]
    fn a_writer_with_a_rebuilt_cold_layer_answers_as_an_open(
        before in prop::collection::vec(op(), 1..30),
        after in prop::collection::vec(writer_op(), 1..24),
        copy_forward in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        run_rebuilt(dir.path(), &before, &after, copy_forward)?;
    }

    /// A read-only open, its incremental refresh after more writes and a
    /// fresh open answer every read as the writer does.
    #[test]
    fn a_reader_with_a_cold_layer_answers_as_the_writer(
        before in prop::collection::vec(op(), 1..80),
        after in prop::collection::vec(op(), 0..30),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        run(dir.path(), &before, &after)?;
    }

    /// A writer whose open built a cold layer appends, annotates, deletes
    /// and compacts as one that holds everything in its maps.
    #[test]
    fn a_writer_with_a_cold_layer_answers_and_compacts_as_one_without(
        before in prop::collection::vec(op(), 1..80),
        after in prop::collection::vec(writer_op(), 1..40),
    ) {
        let (a, b) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
        run_writer(a.path(), b.path(), &before, &after)?;
    }
}

/// The property test's cases build the layer often enough to mean
/// something: over fixed seeds of the same generator, most reads of a store
/// with rolled segments have cold calls.
#[test]
fn the_generated_cases_reach_the_cold_layer() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let (mut cases, mut with_cold) = (0, 0);
    for _ in 0..24 {
        let before = prop::collection::vec(op(), 40..80).new_tree(&mut runner).expect("case").current();
        let dir = tempfile::tempdir().expect("tempdir");
        let cold = run(dir.path(), &before, &[Op::Append { s: 3, t: 3, uid: None, ts: 1 }, Op::Seal(4)]).expect("case");
        cases += 1;
        with_cold += usize::from(cold > 0);
    }
    assert!(with_cold * 2 >= cases, "{with_cold} of {cases} cases had cold calls");
}

/// The rebuilt-index cases reach the cold layer: over fixed seeds of the
/// same generator, most of the writers have cold calls after the
/// compaction.
#[test]
fn the_rebuilt_cases_reach_the_cold_layer() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let (mut cases, mut with_cold) = (0, 0);
    for _ in 0..16 {
        let before = prop::collection::vec(op(), 1..30).new_tree(&mut runner).expect("case").current();
        let dir = tempfile::tempdir().expect("tempdir");
        let cold = run_rebuilt(dir.path(), &before, &[Op::Seal(4)], false).expect("case");
        cases += 1;
        with_cold += usize::from(cold > 0);
    }
    assert!(with_cold * 2 >= cases, "{with_cold} of {cases} cases had cold calls");
}

/// A writer's cold calls that a publication compacts stay in its cold layer
/// until its index is rebuilt: a publication that keeps the shard index
/// file (few new rows) leaves them there, and the next compaction, with an
/// eager collection, reads them as live rows of their shard file.
#[test]
fn compacted_cold_calls_count_as_live_rows_of_their_shard() {
    let (a, b) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    let ids: Vec<String> = (0..60).map(trace).collect();
    let big = |store: &Store| {
        sealed_sessions(store, "old", 100, 8);
        store.compact(&CompactOptions::default()).expect("compact");
        for t in 0..24u8 {
            apply(store, &Op::Append { s: t % 6, t, uid: None, ts: t });
        }
        for s in 0..6 {
            apply(store, &Op::Seal(s));
        }
        store.roll().expect("roll");
        store.flush().expect("flush");
    };
    let sb = Store::open(b.path(), Options::default()).expect("open");
    big(&sb);
    {
        let sa = Store::open(a.path(), Options::default()).expect("open");
        big(&sa);
    }
    let sa = Store::open(a.path(), Options::default()).expect("reopen");
    assert_eq!(sa.snapshot().index_layers().cold_calls, 24, "the six sessions are cold");
    let eager = CompactOptions::default().collect_dead_fraction(Some(0.0));
    for store in [&sa, &sb] {
        let r = store.compact(&CompactOptions::default()).expect("compact");
        assert_eq!(r.calls, 24);
        assert!(r.retired_segments > 0, "{r:?}");
        apply(store, &Op::Append { s: 7, t: 40, uid: None, ts: 1 });
        apply(store, &Op::Seal(7));
        if std::ptr::eq(store, &sa) {
            // The retirement carried the six sessions' seals forward: a
            // seal a cold session has changes nothing, thaws nothing.
            assert_eq!(sa.snapshot().index_layers().cold_calls, 24, "the compacted calls stay cold");
        }
        store.compact(&eager).expect("compact");
        store.flush().expect("flush");
    }
    assert_eq!(logical(&sa.snapshot(), &ids), logical(&sb.snapshot(), &ids));
    assert_eq!(sa.snapshot().call_count(), 800 + 24 + 1);
    let report = trajlog::verify::verify_dir(a.path()).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    drop(sa);
    let ro = Store::open_read_only(a.path()).expect("open read-only");
    assert_eq!(logical(&ro.snapshot(), &ids), logical(&sb.snapshot(), &ids));
}

/// A compacted session written again (compacted while idle, unsealed) has
/// its new calls in sealed segments and a trace id no other record has,
/// yet it is in the frozen layer: it is not cold, and an open reads its
/// compacted calls and its new one together.
#[test]
fn a_compacted_session_written_again_is_not_cold() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ids: Vec<String> = (0..60).map(trace).collect();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for t in 0..3 {
        apply(&store, &Op::Append { s: 1, t, uid: None, ts: t });
    }
    let idle = CompactOptions::default().selection(trajlog::Selection::OlderThan(60.0));
    assert_eq!(store.compact(&idle).expect("compact").calls, 3);
    apply(&store, &Op::Append { s: 1, t: 3, uid: None, ts: 9 });
    apply(&store, &Op::Append { s: 2, t: 4, uid: None, ts: 9 });
    store.roll().expect("roll");
    store.flush().expect("flush");
    let want = fingerprint(&store.snapshot(), &ids);
    drop(store);
    for writable in [false, true] {
        let reopened = match writable {
            false => Store::open_read_only(dir.path()).expect("open read-only"),
            true => Store::open(dir.path(), Options::default()).expect("open"),
        };
        let layers = reopened.snapshot().index_layers();
        // s1's new call thaws it out of the frozen layer; only s2 is cold.
        assert_eq!((layers.cold_calls, layers.frozen_calls), (1, 0), "{layers:?}");
        assert_eq!(reopened.snapshot().session(&session(1), None, None).expect("session").len(), 4);
        assert_eq!(fingerprint(&reopened.snapshot(), &ids), want);
    }
}

/// A trace id of a compacted session deleted since, appended again in
/// another session: the new session is not cold (its trace id has a
/// shard row), and every read agrees with the writer's.
#[test]
fn a_trace_id_with_a_shard_row_keeps_its_new_session_out_of_the_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ids: Vec<String> = (0..60).map(trace).collect();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for t in 0..3 {
        apply(&store, &Op::Append { s: 1, t, uid: None, ts: t });
    }
    apply(&store, &Op::Seal(1));
    assert_eq!(store.compact(&CompactOptions::default()).expect("compact").calls, 3);
    apply(&store, &Op::Delete(1));
    apply(&store, &Op::Append { s: 2, t: 1, uid: None, ts: 9 });
    apply(&store, &Op::Append { s: 3, t: 7, uid: None, ts: 9 });
    store.roll().expect("roll");
    store.flush().expect("flush");
    let want = fingerprint(&store.snapshot(), &ids);
    assert!(want.iter().any(|l| l.starts_with("t1: Some((\"s2\"")), "{want:?}");
    drop(store);
    for writable in [false, true] {
        let reopened = match writable {
            false => Store::open_read_only(dir.path()).expect("open read-only"),
            true => Store::open(dir.path(), Options::default()).expect("open"),
        };
        assert_eq!(reopened.snapshot().index_layers().cold_calls, 1, "only s3 is cold");
        assert_eq!(fingerprint(&reopened.snapshot(), &ids), want);
        let report = trajlog::verify::verify_dir(dir.path()).expect("verify");
        assert!(report.problems.is_empty(), "{:?}", report.problems);
    }
}

/// The backlog cases use the file: over fixed seeds of the same generator,
/// most read-only opens take segments from it (with no operation after it,
/// and with a few that thaw cold sessions).
#[test]
fn the_backlog_cases_use_the_file() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let (mut cases, mut used) = (0, 0);
    for i in 0..24 {
        let before = prop::collection::vec(op(), 40..80).new_tree(&mut runner).expect("case").current();
        let after = match i % 2 {
            0 => Vec::new(),
            _ => vec![Op::Append { s: 3, t: 3, uid: None, ts: 1 }, Op::Seal(4), Op::Delete(5), Op::Reward(6, 1)],
        };
        let dir = tempfile::tempdir().expect("tempdir");
        cases += 1;
        used += usize::from(run_backlog(dir.path(), &before, &after).expect("case") > 0);
    }
    assert!(used * 2 >= cases, "{used} of {cases} cases used the file");
}

/// The ids of the segments the backlog index file in `dir` lists.
fn listed_ids(dir: &Path) -> Vec<u64> {
    let b = std::fs::read(dir.join(BACKLOG)).expect("read");
    let id = |i: usize| b.get(72 + 40 * i..80 + 40 * i).map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes")));
    (0..listed(dir) as usize).map_while(id).collect()
}

/// Segment ids of the store in `dir`, ascending.
fn segment_ids(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| {
            let n = e.ok()?.file_name().into_string().ok()?;
            n.strip_prefix("seg-")?.strip_suffix(".tlog")?.parse().ok()
        })
        .collect();
    v.sort_unstable();
    v
}

/// `src` copied to `dst`, without the backlog index file and its delta.
fn copy_without_backlog(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("mkdir");
    for e in std::fs::read_dir(src).expect("read dir") {
        let e = e.expect("entry");
        let to = dst.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_without_backlog(&e.path(), &to);
        } else if !e.file_name().to_string_lossy().starts_with("backlog") {
            std::fs::copy(e.path(), to).expect("copy");
        }
    }
}

/// A writer takes `before` (no file), reopens with the option and takes
/// `after`, refreshing the file as it rolls (from the file before when it
/// can), then rolls and closes. An open with the file answers as the
/// writer did and `verify` finds nothing; when the file lists every
/// sealed segment, a writable open of a copy without it (which writes it
/// from a survey of every footer) answers the same and writes the same
/// bytes. Returns whether the bytes were compared, and whether the last
/// refresh wrote the file from the one before.
fn run_against_survey(before: &[Op], after: &[Op]) -> Result<(bool, bool), TestCaseError> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let da = tempfile::tempdir().expect("tempdir");
    let a = da.path();
    if !before.is_empty() {
        let s = Store::open(a, Options::default()).expect("open");
        before.iter().for_each(|o| apply(&s, o));
        s.close().expect("close");
    }
    let s = Store::open(a, backlog_options()).expect("open");
    let (mut last, mut incremental) = ((0, 0, 0, 0), false);
    for o in after.iter().chain(std::iter::once(&Op::Roll)) {
        apply(&s, o);
        let c = s.wait_backlog_refresh_counts().expect("wait");
        if c.0 > last.0 {
            incremental = c.2 > last.2;
        }
        last = c;
    }
    s.flush().expect("flush");
    let want = fingerprint(&s.snapshot(), &ids);
    s.close().expect("close");
    if !a.join(BACKLOG).exists() {
        return Ok((false, incremental));
    }
    let with = Store::open_read_only(a).expect("open read-only");
    prop_assert_eq!(&fingerprint(&with.snapshot(), &ids), &want);
    drop(with);
    let report = trajlog::verify::verify_dir(a).expect("verify");
    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    let segs = segment_ids(a);
    if listed_ids(a).as_slice() != segs.get(..segs.len().saturating_sub(1)).unwrap_or_default() {
        return Ok((false, incremental));
    }
    let db = tempfile::tempdir().expect("tempdir");
    let b = db.path();
    copy_without_backlog(a, b);
    let sb = Store::open(b, backlog_options()).expect("open");
    prop_assert_eq!(&fingerprint(&sb.snapshot(), &ids), &want);
    sb.wait_backlog_refresh().expect("wait");
    sb.close().expect("close");
    let surveyed = std::fs::read(b.join(BACKLOG)).ok();
    prop_assert!(surveyed.is_some(), "the survey wrote no file");
    prop_assert!(std::fs::read(a.join(BACKLOG)).ok() == surveyed, "the file differs from the survey's");
    Ok((true, incremental))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// A file the writer's refresh wrote (from the file before, or from
    /// every footer) is the file a survey of every footer writes.
    #[test]
    fn a_refreshed_backlog_file_is_the_one_a_survey_writes(
        before in prop::collection::vec(op(), 0..40),
        after in prop::collection::vec(op(), 1..100),
    ) {
        run_against_survey(&before, &after)?;
    }
}

/// The cases of the test above compare the bytes of files written from
/// the file before, over fixed seeds of the same generators.
#[test]
fn the_survey_cases_compare_files_written_from_the_one_before() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let (mut compared, mut incremental) = (0, 0);
    for _ in 0..16 {
        let before = prop::collection::vec(op(), 0..40).new_tree(&mut runner).expect("case").current();
        let after = prop::collection::vec(op(), 1..100).new_tree(&mut runner).expect("case").current();
        let (c, i) = run_against_survey(&before, &after).expect("case");
        compared += usize::from(c);
        incremental += usize::from(c && i);
    }
    assert!(incremental >= 3, "{compared} of 16 cases compared bytes, {incremental} of a file from the one before");
}

/// The refresh cases take a refreshed index often enough to mean
/// something: over fixed seeds of the same generator.
#[test]
fn the_refresh_cases_take_the_refreshed_index() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::deterministic_rng(Default::default()));
    let (mut cases, mut adopted, mut incremental, mut deltas) = (0, 0, 0, 0);
    for _ in 0..16 {
        let ops = prop::collection::vec(op(), 40..80).new_tree(&mut runner).expect("case").current();
        let dir = tempfile::tempdir().expect("tempdir");
        cases += 1;
        let (a, i, d) = run_refresh(dir.path(), &ops).expect("case");
        adopted += usize::from(a > 0);
        incremental += usize::from(i > 0);
        deltas += usize::from(d > 0);
    }
    // And deltas over it, taken by the writer.
    assert!(deltas * 4 >= cases, "{deltas} of {cases} cases took a delta");
    assert!(adopted * 2 >= cases, "{adopted} of {cases} cases took a refreshed index");
    // And a file written from the one before, not only from every footer.
    assert!(incremental * 4 >= cases, "{incremental} of {cases} cases wrote the file from the one before");
}

/// Sealed sessions in sealed segments, a writer reopened with the option:
/// the open writes the file; the next read-only open maps it (reading no
/// footer) and answers as before.
fn backlog_store(dir: &Path) -> Vec<String> {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let store = Store::open(dir, Options::default()).expect("open");
    sealed_sessions(&store, "b", 40, 5);
    store.roll().expect("roll");
    store.close().expect("close");
    let store = Store::open(dir, backlog_options()).expect("reopen");
    assert_eq!(store.snapshot().index_layers().cold_calls, 200);
    let want = fingerprint(&store.snapshot(), &ids);
    store.close().expect("close");
    assert!(dir.join(BACKLOG).exists());
    want
}

/// Writer `w` (over the store in `dir`, opened through its backlog index
/// file) answers as a read-only open with the file and as one without it,
/// for the trace ids `ids` besides every session.
fn agrees_with_and_without_the_backlog_file(dir: &Path, w: Store, ids: &[String]) {
    w.flush().expect("flush");
    let want = fingerprint(&w.snapshot(), ids);
    let with = Store::open_read_only(dir).expect("open read-only");
    assert!(with.snapshot().index_layers().backlog_segments > 0);
    assert_eq!(fingerprint(&with.snapshot(), ids), want);
    drop(with);
    w.close().expect("close");
    std::fs::rename(dir.join(BACKLOG), dir.join("aside")).expect("move aside");
    let without = Store::open_read_only(dir).expect("open read-only");
    assert_eq!(without.snapshot().index_layers().backlog_segments, 0);
    assert_eq!(fingerprint(&without.snapshot(), ids), want);
}

/// Records after the file, in a sealed segment it does not list and in
/// the active one, that name its cold sessions: by trace id alone (trace
/// rewards), a deletion, a session reward, a seal of a sealed session. An
/// open through the file looks up in its cold layer only what the records
/// it replays name (`Index::narrow_cold_lookups`) and must find those.
#[test]
fn records_after_the_backlog_file_reach_its_cold_sessions() {
    let dir = tempfile::tempdir().expect("tempdir");
    backlog_store(dir.path());
    let ids: Vec<String> = (0..40).flat_map(|s| (0..5).map(move |n| format!("b-{s}-{n}"))).collect();
    let w = Store::open(dir.path(), Options::default()).expect("open");
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    w.set_reward(Target::Trace("b-3-2".into()), 0.75).expect("trace reward");
    assert_eq!(w.delete_session("b-1").expect("delete"), 5);
    w.set_reward(Target::Session("b-2".into()), 4.0).expect("session reward");
    w.roll().expect("roll");
    w.set_reward(Target::Trace("b-39-1".into()), -2.5).expect("trace reward");
    let _ = w.seal_session("b-31");
    let want = fingerprint(&w.snapshot(), &ids);
    assert!(want.iter().any(|l| l.starts_with("b-3-2:") && l.ends_with("reward Some(0.75)")), "{want:?}");
    assert!(want.iter().any(|l| l.starts_with("b-39-1:") && l.ends_with("reward Some(-2.5)")), "{want:?}");
    agrees_with_and_without_the_backlog_file(dir.path(), w, &ids);
}

/// A call of session `session` with trace id `trace` and the extra
/// session uids `uids`.
fn call_with_uids(trace: &str, session: &str, uids: &[&str], timestamp: f64) -> Call {
    Call {
        trace_id: trace.into(),
        session_id: session.into(),
        session_uids: uids.iter().map(|u| (*u).to_owned()).collect(),
        timestamp,
        prompt_token_ids: vec![5],
        completion_token_ids: vec![6],
        ..Default::default()
    }
}

/// Sessions written after the backlog index file, in sealed segments it
/// does not list, that nothing else names go to a second cold layer the
/// open builds instead of to the maps; those named otherwise (by an extra
/// session uid, a trace reward, a call in the active segment) stay in the
/// maps, and records naming sessions of the file's layer (a session reward,
/// a trace reward) thaw them. Read-only and writable opens through the file
/// answer as opens without it; so does the writer over the two layers
/// through writes that name sessions of either, and a read-only store
/// refreshed after them.
#[test]
fn sessions_after_the_backlog_file_go_to_a_second_cold_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    sixteen_sealed_segments(dir.path());
    let store = Store::open(dir.path(), Options::default()).expect("open");
    session_calls(&store, "p", 0, 2);
    session_calls(&store, "q", 0, 2);
    store.roll().expect("roll");
    store.close().expect("close");
    let store = Store::open(dir.path(), backlog_options()).expect("reopen");
    assert_eq!(store.snapshot().index_layers().cold_calls, 68);
    store.close().expect("close");
    assert_eq!(listed(dir.path()), 17);
    let mut ids: Vec<String> = (0..16).flat_map(|i| (0..2).map(move |s| format!("a{i}-{s}-0"))).collect();
    for (prefix, sessions, calls) in
        [("c", 10, 3), ("u", 3, 2), ("d", 1, 3), ("e", 1, 2), ("g", 1, 6), ("f", 1, 1), ("p", 1, 3), ("q", 1, 2)]
    {
        ids.extend((0..sessions).flat_map(|s| (0..calls).map(move |n| format!("{prefix}-{s}-{n}"))));
    }
    ids.extend(["x-0", "x-1", "a4-1-1", "a9-0-1"].map(str::to_owned));
    // Two sealed segments the file does not list (a writer that writes no
    // file, so no delta over it either), then the active one.
    let no_refresh = || Options::default().backlog_index_min_calls(0);
    let w = Store::open(dir.path(), no_refresh()).expect("open");
    assert_eq!(w.snapshot().index_layers().cold_layers, 1);
    sealed_sessions(&w, "c", 10, 3);
    for s in 0..3 {
        session_calls(&w, "u", s, 2);
    }
    session_calls(&w, "d", 0, 2);
    session_calls(&w, "e", 0, 2);
    session_calls(&w, "g", 0, 5);
    // p-0 of the file's layer goes on with new trace ids; q-0 of it is
    // deleted and its trace id taken by r-0.
    w.append(call_with_uids("p-0-2", "p-0", &[], 2.0)).expect("p-0 goes on");
    assert_eq!(w.delete_session("q-0").expect("delete"), 2);
    w.append(call_with_uids("q-0-1", "r-0", &[], 3.0)).expect("a trace id of a deleted session");
    w.append(call_with_uids("x-0", "x", &["u-0"], 1.0)).expect("a uid naming u-0");
    w.set_reward(Target::Trace("c-2-1".into()), 0.5).expect("trace reward");
    w.set_reward(Target::Trace("u-2-0".into()), 0.25).expect("trace reward");
    w.set_reward(Target::Session("a3-0".into()), 1.5).expect("session reward");
    w.set_reward(Target::Trace("a4-1-1".into()), 1.0).expect("trace reward");
    w.roll().expect("roll");
    sealed_sessions(&w, "h", 2, 2);
    w.roll().expect("roll");
    session_calls(&w, "d", 0, 3);
    w.seal_session("e-0").expect("seal");
    session_calls(&w, "f", 0, 1);
    w.flush().expect("flush");
    let want = fingerprint(&w.snapshot(), &ids);
    w.close().expect("close");
    // The file's 68 calls less a3-0's, a4-1's, p-0's and q-0's; c-0, c-1
    // and c-3 to c-9 (27), u-1 (2), e-0 (2, sealed from the active
    // segment), g-0 (5) and h-0, h-1 (4); not c-2, u-0, u-2, d-0, x, f-0,
    // p-0 or r-0 (a trace id of the file's layer).
    let cold = |store: &Store| {
        let layers = store.snapshot().index_layers();
        (layers.cold_layers, layers.cold_calls)
    };
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(cold(&ro), (2, 60 + 27 + 2 + 2 + 5 + 4));
    assert_eq!(fingerprint(&ro.snapshot(), &ids), want);
    // Fewer than an eighth of the listed segments are not listed: a
    // writable open uses the file.
    let w = Store::open(dir.path(), no_refresh()).expect("open");
    assert_eq!(cold(&w), (2, 100));
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    assert_eq!(fingerprint(&w.snapshot(), &ids), want);
    // Writes naming sessions of both layers thaw them.
    w.append(call_with_uids("x-1", "x", &["u-1"], 2.0)).expect("a uid naming u-1");
    w.set_reward(Target::Trace("c-6-0".into()), -1.0).expect("trace reward");
    assert_eq!(w.delete_session("c-7").expect("delete"), 3);
    w.append(call_with_uids("g-0-5", "g-0", &[], 9.0)).expect("g-0 goes on");
    w.set_reward(Target::Session("h-1".into()), 3.0).expect("session reward");
    w.set_reward(Target::Session("a5-1".into()), 2.0).expect("session reward");
    w.set_reward(Target::Trace("a9-0-1".into()), 0.125).expect("trace reward");
    assert!(w.append(call_with_uids("h-0-9", "h-0", &[], 9.0)).is_err(), "h-0 is sealed");
    w.flush().expect("flush");
    ro.refresh().expect("refresh");
    assert_eq!(fingerprint(&ro.snapshot(), &ids), fingerprint(&w.snapshot(), &ids));
    assert_eq!(cold(&ro), (2, 100 - 2 - 3 - 3 - 5 - 2 - 2 - 2), "u-1, c-6, c-7, g-0, h-1, a5-1 and a9-0 thawed");
    assert_eq!(cold(&w), cold(&ro));
    drop(ro);
    agrees_with_and_without_the_backlog_file(dir.path(), w, &ids);
}

/// A call after the file (in the active segment) naming a cold session
/// only by an extra session uid thaws it, as without the file.
#[test]
fn a_session_uid_after_the_backlog_file_thaws_its_cold_session() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ids: Vec<String> = (0..10).flat_map(|s| (0..2).map(move |n| format!("u-{s}-{n}"))).collect();
    ids.push("x-0".into());
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for s in 0..10u32 {
        session_calls(&store, "u", s, 2);
    }
    store.roll().expect("roll");
    store.close().expect("close");
    let store = Store::open(dir.path(), backlog_options()).expect("reopen");
    assert_eq!(store.snapshot().index_layers().cold_calls, 20);
    store.close().expect("close");
    let w = Store::open(dir.path(), Options::default()).expect("open");
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    let call = Call {
        trace_id: "x-0".into(),
        session_id: "x".into(),
        session_uids: vec!["u-3".into()],
        timestamp: 9.0,
        prompt_token_ids: vec![5],
        completion_token_ids: vec![6],
        ..Default::default()
    };
    w.append(call).expect("append with uid");
    agrees_with_and_without_the_backlog_file(dir.path(), w, &ids);
}

/// Records written during a compaction whose publication hands the writer
/// a rebuilt index (`Rebuilt::extend_after` replays them with narrowed
/// cold lookups) that name cold sessions in every way: a trace reward, a
/// seal, a session reward, a deletion, a call naming one by uid, a
/// replacement of a cold call, a new call of a cold session, across a
/// roll. The writer answers as a fresh open and a reopen.
#[test]
fn records_during_a_rebuilding_compaction_reach_the_cold_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ids: Vec<String> = (0..8).flat_map(|s| (0..4).map(move |n| format!("c-{s}-{n}"))).collect();
    ids.push("n-0".into());
    let store = Store::open(dir.path(), Options::default()).expect("open");
    sealed_sessions(&store, "big", 24, 4);
    for s in 0..8u32 {
        session_calls(&store, "c", s, 2);
    }
    store.roll().expect("roll");
    let call = |t: &str, s: &str, uids: &[&str]| Call {
        trace_id: t.into(),
        session_id: s.into(),
        session_uids: uids.iter().map(|u| u.to_string()).collect(),
        timestamp: 5.0,
        prompt_token_ids: vec![3],
        completion_token_ids: vec![4],
        ..Default::default()
    };
    let opts = CompactOptions::default().copy_forward(None);
    store
        .compact_with_meanwhile(&opts, &mut || {
            store.set_reward(Target::Trace("c-0-1".into()), 0.5).expect("trace reward");
            store.seal_session("c-1").expect("seal");
            store.set_reward(Target::Session("c-2".into()), 1.5).expect("session reward");
            assert_eq!(store.delete_session("c-3").expect("delete"), 2);
            store.append(call("n-0", "new", &["c-4"])).expect("uid");
            store.roll().expect("roll");
            store.append(call("c-5-0", "c-5", &[])).expect("replacement");
            store.append(call("c-6-2", "c-6", &[])).expect("new call");
            store.flush().expect("flush");
        })
        .expect("compact");
    store.flush().expect("flush");
    let layers = store.snapshot().index_layers();
    assert_eq!((layers.frozen_calls, layers.cold_calls), (96, 2), "rebuilt; only c-7 stays cold: {layers:?}");
    let want = fingerprint(&store.snapshot(), &ids);
    let fresh = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(fingerprint(&fresh.snapshot(), &ids), want);
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default()).expect("reopen");
    assert_eq!(fingerprint(&reopened.snapshot(), &ids), want);
}

/// A stale, truncated or damaged file changes no answer: a stale or
/// truncated one is not used; a damaged table block makes the read that
/// meets it fail with an error naming the file (never a silent miss), a
/// writer that met it refuses to write on and removes the file, and the
/// next open without it answers as before. The default threshold writes no
/// file for a small store.
#[test]
fn a_damaged_or_stale_backlog_file_changes_no_answer() {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let want = backlog_store(dir.path());
    let file = dir.path().join(BACKLOG);
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert!(ro.snapshot().index_layers().backlog_segments > 0);
    assert_eq!(fingerprint(&ro.snapshot(), &ids), want);
    drop(ro);
    let bytes = std::fs::read(&file).expect("read");
    // Truncated: not used.
    std::fs::write(&file, &bytes[..bytes.len() - 8]).expect("write");
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(ro.snapshot().index_layers().backlog_segments, 0);
    assert_eq!(fingerprint(&ro.snapshot(), &ids), want);
    drop(ro);
    // A flipped bit in the first cold row (the tables follow the head, in
    // the order rows, sessions, trace table, text, two bit sets, rewards;
    // then the block checksums; format-spec/backlog-index.md): the open
    // maps it; the read that meets its block reports it.
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes")) as usize;
    let (rows, by_trace, text) = (u64_at(32), u64_at(40), u64_at(48));
    let sessions = u32::from_le_bytes(bytes[56..60].try_into().expect("4 bytes")) as usize;
    let pad8 = |n: usize| n.div_ceil(8) * 8;
    let words = sessions.div_ceil(64) * 8;
    let tables = [rows * 40, sessions * 24, by_trace * 16, text, words, words, sessions * 8];
    let blocks: usize = tables.iter().map(|t| t.div_ceil(16 << 10)).sum();
    let tables_at = bytes.len() - pad8(blocks * 4) - tables.iter().map(|t| pad8(*t)).sum::<usize>();
    let mut bad = bytes.clone();
    bad[tables_at + 3] ^= 0x40;
    std::fs::write(&file, &bad).expect("write");
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    let snap = ro.snapshot();
    let mut failed = false;
    for s in snap.sessions() {
        failed |= snap.session(&s.session_id, None, None).is_err();
    }
    let scan = snap.for_each_call(|_| Ok(()));
    assert!(failed || scan.is_err(), "a read met the damaged block");
    let e = scan.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.is_empty() || e.contains(BACKLOG), "{e}");
    drop(snap);
    drop(ro);
    // A writer's open reads no table block here (every footer entry went
    // to the layer: no warm entry to look up), so it maps the file as a
    // read-only open does. A read of its view that meets the block fails
    // naming the file; the writer then acts on nothing it read: its next
    // flush is refused (poisoned) and it removes the file. The next
    // writable open does without it and writes the same file anew.
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    let snap = w.snapshot();
    let mut failed = false;
    for s in snap.sessions() {
        failed |= snap.session(&s.session_id, None, None).is_err();
    }
    let scan = snap.for_each_call(|_| Ok(()));
    assert!(failed || scan.is_err(), "a read met the damaged block");
    drop(snap);
    let e = w.flush().expect_err("the writer is poisoned");
    assert!(matches!(e.kind(), trajlog::ErrorKind::Poisoned), "{e}");
    assert!(e.to_string().contains(BACKLOG), "{e}");
    assert!(!file.exists(), "the poisoned writer removed the file");
    drop(w);
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    assert_eq!(fingerprint(&w.snapshot(), &ids), want);
    // It takes the index mapped from the file it wrote.
    assert_eq!(w.wait_backlog_refresh().expect("wait"), (1, 1));
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    assert_eq!(fingerprint(&w.snapshot(), &ids), want);
    w.close().expect("close");
    assert_eq!(std::fs::read(&file).expect("read"), bytes, "the same file, written anew");
    // Stale: a listed segment retired by a compaction.
    let w = Store::open(dir.path(), Options::default().backlog_index_min_calls(0)).expect("open");
    let r = w.compact(&CompactOptions::default()).expect("compact");
    assert!(r.retired_segments > 0, "{r:?}");
    assert!(!file.exists(), "the retirement of a listed segment removed the stale file");
    std::fs::write(&file, &bytes).expect("put the stale file back");
    let want = fingerprint(&w.snapshot(), &ids);
    w.close().expect("close");
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(ro.snapshot().index_layers().backlog_segments, 0);
    assert_eq!(fingerprint(&ro.snapshot(), &ids), want);
    // The default threshold (65,536 calls) writes none for 200 calls, and
    // removes the stale one.
    drop(ro);
    let w = Store::open(dir.path(), Options::default()).expect("open");
    w.close().expect("close");
    assert!(!file.exists());
}

/// A writable open in skip-corrupted mode writes no file: its replay left
/// a damaged record out that the footer still names, so a file built from
/// it would lose that call for every later open (which, without the file,
/// finds the damage again).
#[test]
fn a_skip_corrupted_open_writes_no_backlog_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    sealed_sessions(&store, "b", 40, 5);
    store.roll().expect("roll");
    let loc = store.snapshot().get("b-3-2").expect("get").expect("live").loc;
    store.close().expect("close");
    let seg = dir.path().join(format!("seg-{:010}.tlog", loc.segment));
    let mut bytes = std::fs::read(&seg).expect("read");
    bytes[loc.offset as usize + 24] ^= 0x55;
    std::fs::write(&seg, &bytes).expect("write");
    let opts = backlog_options().recovery(trajlog::RecoveryMode::SkipCorrupted);
    let w = Store::open(dir.path(), opts).expect("a skip-corrupted open");
    assert_eq!(w.snapshot().call_count(), 199, "the damaged call left out");
    w.close().expect("close");
    assert!(!dir.path().join(BACKLOG).exists());
    // A default open meets the damage where it is, as without a file.
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(ro.snapshot().index_layers().backlog_segments, 0);
    let e = ro.snapshot().get("b-3-2").expect_err("the damaged frame");
    assert!(matches!(e.kind(), trajlog::ErrorKind::Corrupt { .. }), "{e}");
}

/// The file holds what its listed segments set: a seal and a session
/// reward in the active segment (unlisted) are not in it, so an open
/// whose log lost that segment (here: deleted, then `repair`) answers as
/// without the file.
#[test]
fn the_backlog_file_holds_only_what_its_segments_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    sealed_sessions(&store, "b", 4, 3);
    store.roll().expect("roll");
    store.seal_session("b-0").err(); // sealed already: refused or a no-op
    store.set_reward(trajlog::Target::Session("b-1".into()), 0.5).expect("reward");
    store.close().expect("close");
    let w = Store::open(dir.path(), backlog_options()).expect("reopen");
    assert_eq!(w.snapshot().session_reward("b-1"), Some(0.5));
    let active = w.snapshot().index_layers();
    assert!(active.cold_calls > 0, "{active:?}");
    w.close().expect("close");
    assert!(dir.path().join(BACKLOG).exists());
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert!(ro.snapshot().index_layers().backlog_segments > 0);
    assert_eq!(ro.snapshot().session_reward("b-1"), Some(0.5), "from the active segment's record");
    drop(ro);
    let mut segments: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .filter(|n| n.starts_with("seg-"))
        .collect();
    segments.sort();
    std::fs::remove_file(dir.path().join(segments.last().expect("the active segment"))).expect("remove");
    let file = std::fs::read(dir.path().join(BACKLOG)).expect("read");
    trajlog::repair::repair(dir.path(), false).expect("repair");
    assert!(!dir.path().join(BACKLOG).exists(), "repair removes the file");
    // Put back (as a build before that would have left it): still
    // consistent with the log it lists.
    std::fs::write(dir.path().join(BACKLOG), &file).expect("write");
    let with = Store::open_read_only(dir.path()).expect("open read-only");
    assert!(with.snapshot().index_layers().backlog_segments > 0);
    std::fs::rename(dir.path().join(BACKLOG), dir.path().join("aside")).expect("move aside");
    let without = Store::open_read_only(dir.path()).expect("open read-only");
    let ids: Vec<String> = (0..4).flat_map(|s| (0..3).map(move |n| format!("b-{s}-{n}"))).collect();
    assert_eq!(fingerprint(&with.snapshot(), &ids), fingerprint(&without.snapshot(), &ids));
    assert_eq!(with.snapshot().session_reward("b-1"), None);
    assert!(with.snapshot().is_sealed("b-0"));
}

/// Damage in the header's counts (before any checksum is checked) makes
/// the file unusable, never an abort or a panic: a huge listed-segment
/// count, a warm length at the edge of `u64`.
#[test]
fn a_backlog_file_with_absurd_counts_is_not_used() {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let want = backlog_store(dir.path());
    let file = dir.path().join(BACKLOG);
    let bytes = std::fs::read(&file).expect("read");
    let listed = u32::from_le_bytes(bytes[20..24].try_into().expect("4 bytes")) as u64;
    let warm_at = 72 + 40 * listed;
    let mut cases = Vec::new();
    let mut b = bytes.clone();
    b[20..24].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
    cases.push(b);
    let mut b = bytes.clone();
    b[72 + 32..72 + 40].copy_from_slice(&(u64::MAX - warm_at).to_le_bytes());
    cases.push(b);
    let mut b = bytes.clone();
    b[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(b);
    let mut b = bytes.clone();
    b[12] |= 2; // an unknown flag
    cases.push(b);
    for bad in cases {
        std::fs::write(&file, &bad).expect("write");
        let ro = Store::open_read_only(dir.path()).expect("open read-only");
        assert_eq!(ro.snapshot().index_layers().backlog_segments, 0);
        assert_eq!(fingerprint(&ro.snapshot(), &ids), want);
        let report = trajlog::verify::verify_dir(dir.path()).expect("verify");
        assert!(report.problems.iter().any(|p| format!("{p:?}").contains("backlog")), "{report:?}");
    }
}

/// The number of segments the backlog index file in `dir` lists (its
/// header, format-spec/backlog-index.md §2).
fn listed(dir: &Path) -> u32 {
    let b = std::fs::read(dir.join(BACKLOG)).expect("read");
    u32::from_le_bytes(b[20..24].try_into().expect("4 bytes"))
}

/// How many segments the delta over the backlog index file in `dir` lists
/// (0 without one).
fn delta_listed(dir: &Path) -> u32 {
    std::fs::read(dir.join(BACKLOG_DELTA)).map_or(0, |b| u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")))
}

/// A store in `dir` of 16 sealed segments of two sealed sessions each,
/// written without the option (no backlog index file).
fn sixteen_sealed_segments(dir: &Path) {
    let store = Store::open(dir, Options::default()).expect("open");
    for i in 0..16 {
        sealed_sessions(&store, &format!("a{i}"), 2, 2);
        store.roll().expect("roll");
    }
    store.close().expect("close");
}

/// A writable open does without the file once the sealed segments it does
/// not list are more than an eighth of those it lists, and writes it anew
/// over them all; with fewer, it uses it (and leaves it as it is). A
/// writer whose rolls pass that eighth refreshes the file itself (in a
/// helper thread) and takes the index mapped from it.
#[test]
fn a_writable_open_writes_the_backlog_file_anew_as_the_log_grows() {
    let ids: Vec<String> = (0..60).map(trace).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    sixteen_sealed_segments(dir.path());
    Store::open(dir.path(), backlog_options()).expect("open").close().expect("close");
    let first = listed(dir.path());
    assert!(first >= 16, "{first}");
    // Three more sealed segments, written without the option: past an
    // eighth; the next writable open surveys and writes it anew.
    let w = Store::open(dir.path(), Options::default()).expect("open");
    for i in 0..3 {
        sealed_sessions(&w, &format!("d{i}"), 2, 2);
        w.roll().expect("roll");
    }
    w.close().expect("close");
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    assert_eq!(w.wait_backlog_refresh().expect("wait"), (1, 1), "it takes the index mapped from the file it wrote");
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    w.close().expect("close");
    let second = listed(dir.path());
    assert!(second > first + 2, "{first} then {second}");
    // One more sealed segment with the option: an eighth or fewer, so
    // the file is used, and left as it is; the writer writes a delta over
    // it listing that segment, and takes the index mapped from both.
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    sealed_sessions(&w, "c", 2, 2);
    w.roll().expect("roll");
    assert_eq!(w.wait_backlog_refresh_counts().expect("wait"), (1, 1, 0, 1), "a delta under an eighth");
    assert_eq!(w.snapshot().index_layers().cold_layers, 2, "the file's layer and the delta's");
    w.close().expect("close");
    assert_eq!(listed(dir.path()), second);
    assert_eq!(delta_listed(dir.path()), 1);
    // Three more rolls of the writer: past an eighth, it refreshes the
    // file itself and takes the index built from it; its answers do not
    // change, and the next opens use the new file.
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    for i in 0..3 {
        sealed_sessions(&w, &format!("e{i}"), 2, 2);
        w.roll().expect("roll");
    }
    // Deltas as it rolls, and the whole file once past the eighth (how
    // many deltas depends on how fast each helper ends).
    let (started, taken, _, deltas) = w.wait_backlog_refresh_counts().expect("wait");
    assert!(
        started == taken && started > deltas,
        "({started}, {taken}, {deltas}): the writer refreshed the file and took its index"
    );
    let want = fingerprint(&w.snapshot(), &ids);
    // Writes after it that name cold sessions: a deletion, a session
    // reward, a trace reward, and a new session.
    w.delete_session("a3-1").expect("delete");
    w.set_reward(Target::Session("a5-0".into()), 0.25).expect("reward");
    w.set_reward(Target::Trace("a7-0-1".into()), -0.5).expect("reward");
    sealed_sessions(&w, "f", 1, 3);
    w.flush().expect("flush");
    let after = fingerprint(&w.snapshot(), &ids);
    w.close().expect("close");
    assert!(listed(dir.path()) > second + 2, "{second} then {}", listed(dir.path()));
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(ro.snapshot().index_layers().backlog_segments as u32, listed(dir.path()) + delta_listed(dir.path()));
    assert_eq!(fingerprint(&ro.snapshot(), &ids), after);
    std::fs::remove_file(dir.path().join(BACKLOG)).expect("remove");
    let ro = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(fingerprint(&ro.snapshot(), &ids), after);
    assert_ne!(want, after, "the writes after the refresh changed answers");
}

/// The roll that begins a compaction starts no refresh of the file (the
/// writer could not take its index while the compaction is under way, and
/// the file would be stale once the publication retires what it lists); a
/// retirement of listed segments removes the file, and nothing writes it
/// back.
#[test]
fn the_roll_that_begins_a_compaction_starts_no_backlog_refresh() {
    let dir = tempfile::tempdir().expect("tempdir");
    sixteen_sealed_segments(dir.path());
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    assert_eq!(w.wait_backlog_refresh().expect("wait"), (1, 1));
    let first = listed(dir.path());
    // Rolls up to an eighth of the listed segments: deltas only.
    for i in 0..first / 8 {
        sealed_sessions(&w, &format!("b{i}"), 2, 2);
        w.roll().expect("roll");
    }
    let (started, taken, _, deltas) = w.wait_backlog_refresh_counts().expect("wait");
    assert!(started == taken && started == deltas + 1 && deltas > 0, "({started}, {taken}, {deltas})");
    assert!(dir.path().join(BACKLOG_DELTA).exists());
    // One more sealed session in the active segment: the compaction's own
    // roll passes the eighth.
    sealed_sessions(&w, "c", 2, 2);
    let r = w.compact(&CompactOptions::default()).expect("compact");
    assert!(r.retired_segments > 0, "{r:?}");
    assert_eq!(w.wait_backlog_refresh().expect("wait"), (started, taken), "no refresh started");
    assert!(!dir.path().join(BACKLOG).exists(), "the retirement removed the stale file");
    assert!(!dir.path().join(BACKLOG_DELTA).exists(), "and its delta");
    w.close().expect("close");
    assert!(!dir.path().join(BACKLOG).exists());
}

/// Sessions sealed before the writer took a refreshed index stay sealed
/// for its admission (which rebased onto the index taken).
#[test]
fn a_session_sealed_before_a_refresh_stays_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = Store::open(dir.path(), backlog_options()).expect("open");
    for k in 0..3 {
        sealed_sessions(&w, &format!("x{k}"), 1, 3);
        w.roll().expect("roll");
        w.wait_backlog_refresh().expect("wait");
    }
    assert!(w.wait_backlog_refresh().expect("wait").1 > 0);
    assert!(w.snapshot().index_layers().backlog_segments > 0);
    let call = Call { trace_id: "y".into(), session_id: "x0-0".into(), ..Default::default() };
    let e = w.append(call).expect_err("a sealed session");
    assert!(e.to_string().contains("sealed"), "{e}");
}
