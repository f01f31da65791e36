//! Model-based test: random sequences of append / replace / seal / delete /
//! reward / roll / compact / reopen / read against a plain in-memory model,
//! read by the writer and by a read-only store refreshed beside it. A
//! compaction also runs a few of those operations while it is under way
//! (between staging its shards and publishing them); after each, the writer
//! must answer as a fresh read-only open does, and the rewards side table
//! applied to the shards must give the store's rewards. Compactions copy
//! unfinished sessions forward (never, by default, or always). One runner, two
//! shapes of operations ([`Shape`]): the default one, and an aggressive one
//! with more sessions, more work during a compaction and compactions back
//! to back.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt64Type};
use arrow_array::{Array, Float64Array, RecordBatch, StringArray};
use common::*;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use trajlog::format::record::Loc;
use trajlog::{Call, CompactOptions, Durability, ErrorKind, Options, Selection, Store, Target};

/// The size knob of the generator: how many sessions and trace ids the
/// operations draw from, how many operations a compaction runs meanwhile,
/// and how often a compaction is followed at once by a second one.
#[derive(Debug, Clone, Copy)]
struct Shape {
    sessions: u8,
    trace_ids: u8,
    /// Operations run while a compaction is under way, at most.
    meanwhile_ops_max: usize,
    /// Probability that a compaction is followed by a second one, back to
    /// back: no flush, read or check between them.
    back_to_back: f64,
}

/// The shape the model test ran before there were shapes.
const DEFAULT: Shape = Shape { sessions: 4, trace_ids: 24, meanwhile_ops_max: 4, back_to_back: 0.0 };

/// More sessions, longer stretches of work during a compaction, and
/// compactions back to back: bugs that need several sessions and a busy
/// compaction come up in a few hundred cases here where the default shape
/// missed them.
const AGGRESSIVE: Shape = Shape { sessions: 6, trace_ids: 24, meanwhile_ops_max: 12, back_to_back: 0.5 };

#[derive(Debug, Clone)]
enum Op {
    /// Append to session `s` a call with trace id `t`; its prompt extends the
    /// session's previous context when `extend`; `uid`: a second session of
    /// the call (`session_uids`).
    Append {
        s: u8,
        t: u8,
        extend: bool,
        completion: Vec<u32>,
        ts: u8,
        uid: Option<u8>,
    },
    Seal(u8),
    Delete(u8),
    Reward(u8, i8),
    /// A reward on trace id `t`: refused unless it is live.
    TraceReward(u8, i8),
    Roll,
    /// One compaction, or two back to back; checked after the last.
    Compact(Vec<Compaction>),
    Reopen,
    Read,
}

/// Compact sealed sessions (`all` false) or every session (true), collecting
/// earlier shards with any dead row (`collect` 0), a quarter dead (1), or
/// never (2), merging or not; the operations `meanwhile` (appends, seals,
/// deletes, rewards, rolls) run while it is under way.
#[derive(Debug, Clone)]
struct Compaction {
    all: bool,
    collect: u8,
    merge: bool,
    /// Copy-forward (format-spec/shard.md §6.3): never (0), the default
    /// fraction (1), or the largest (2).
    copy: u8,
    meanwhile: Vec<Op>,
}

impl Compaction {
    fn collect_dead_fraction(&self) -> Option<f64> {
        [Some(0.0), Some(0.25), None][usize::from(self.collect)]
    }

    fn options(&self) -> CompactOptions {
        let selection = if self.all { Selection::OlderThan(0.0) } else { Selection::SealedOnly };
        CompactOptions::default()
            .selection(selection)
            .steps_row_group_rows(3)
            .merge_fanout(self.merge.then_some(2))
            .collect_dead_fraction(self.collect_dead_fraction())
            .copy_forward(
                [None, Some(trajlog::DEFAULT_COPY_FORWARD), Some(trajlog::COPY_FORWARD_MAX)][usize::from(self.copy)],
            )
    }
}

/// The operations that change the store without compacting or reopening
/// it, appends, deletions and rolls weighted as given (the others 1 each).
fn change(shape: Shape, append: u32, delete: u32, roll: u32) -> impl Strategy<Value = Op> {
    let (sessions, trace_ids) = (shape.sessions, shape.trace_ids);
    prop_oneof![
        append => (
            0..sessions,
            0..trace_ids,
            any::<bool>(),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u8>(),
            prop::option::weighted(0.2, 0..sessions),
        )
            .prop_map(|(s, t, extend, completion, ts, uid)| Op::Append { s, t, extend, completion, ts, uid }),
        1 => (0..sessions).prop_map(Op::Seal),
        delete => (0..sessions).prop_map(Op::Delete),
        1 => (0..sessions, any::<i8>()).prop_map(|(s, r)| Op::Reward(s, r)),
        1 => (0..trace_ids, any::<i8>()).prop_map(|(t, r)| Op::TraceReward(t, r)),
        roll => Just(Op::Roll),
    ]
}

fn compaction(shape: Shape) -> impl Strategy<Value = Compaction> {
    // While a compaction runs, deletions and rolls are likelier: what its
    // publication retires then may hold records written meanwhile.
    let meanwhile = prop::collection::vec(change(shape, 3, 2, 2), 0..=shape.meanwhile_ops_max);
    (any::<bool>(), 0u8..3, any::<bool>(), 0u8..3, meanwhile)
        .prop_map(|(all, collect, merge, copy, meanwhile)| Compaction { all, collect, merge, copy, meanwhile })
}

fn op(shape: Shape) -> impl Strategy<Value = Op> {
    prop_oneof![
        15 => change(shape, 10, 1, 1),
        // (prop::option::weighted refuses a probability of 0.)
        1 => (compaction(shape), prop::bool::weighted(shape.back_to_back), compaction(shape))
            .prop_map(|(first, twice, second)| Op::Compact(if twice { vec![first, second] } else { vec![first] })),
        1 => Just(Op::Reopen),
        2 => Just(Op::Read),
    ]
}

#[derive(Default)]
struct Model {
    /// trace id → (append order, call)
    calls: BTreeMap<String, (u64, Call)>,
    sealed: BTreeSet<String>,
    rewards: BTreeMap<String, f64>,
    trace_rewards: BTreeMap<String, f64>,
    contexts: BTreeMap<String, Vec<u32>>,
    order: u64,
}

impl Model {
    fn session(&self, s: &str) -> Vec<&Call> {
        let mut v: Vec<&(u64, Call)> =
            self.calls.values().filter(|(_, c)| c.session_id == s || c.session_uids.iter().any(|u| u == s)).collect();
        v.sort_by(|a, b| a.1.timestamp.total_cmp(&b.1.timestamp).then(a.0.cmp(&b.0)));
        v.into_iter().map(|(_, c)| c).collect()
    }
}

fn check(store: &Store, model: &Model, shape: Shape) {
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), model.calls.len());
    for (_, c) in model.calls.values() {
        assert_same(&snap.get(&c.trace_id).unwrap().expect("model call present"), c);
    }
    for s in 0..shape.sessions {
        let sid = format!("s{s}");
        let want = model.session(&sid);
        let got = snap.session(&sid, None, None).unwrap();
        assert_eq!(got.len(), want.len(), "session {sid}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.trace_id(), w.trace_id);
        }
        assert_eq!(snap.is_sealed(&sid), model.sealed.contains(&sid));
        assert_eq!(snap.session_reward(&sid), model.rewards.get(&sid).copied());
        // since / limit
        if let Some(mid) = want.get(want.len() / 2) {
            let since = snap.session(&sid, Some(mid.timestamp), Some(2)).unwrap();
            let expect: Vec<&str> =
                want.iter().filter(|c| c.timestamp > mid.timestamp).take(2).map(|c| c.trace_id.as_str()).collect();
            assert_eq!(since.iter().map(|c| c.trace_id()).collect::<Vec<_>>(), expect);
        }
    }
    for t in 0..shape.trace_ids {
        let tid = format!("t{t}");
        assert_eq!(snap.trace_reward(&tid), model.trace_rewards.get(&tid).copied(), "trace {tid}");
    }
    // A call is listed in each of its sessions.
    let listed: usize = snap.sessions().iter().map(|s| s.calls).sum();
    assert_eq!(listed, (0..shape.sessions).map(|s| model.session(&format!("s{s}")).len()).sum::<usize>());
    let mut scanned: Vec<String> = Vec::new();
    snap.for_each_call(|c| {
        scanned.push(c.trace_id().to_owned());
        Ok(())
    })
    .unwrap();
    scanned.sort();
    assert_eq!(scanned, model.calls.keys().cloned().collect::<Vec<_>>());
}

/// The writer, flushed, answers as a fresh read-only open of its directory:
/// the same sessions (calls, timestamps, seals, rewards), the same calls bit
/// for bit, the same trace rewards; and the fresh open matches the model.
fn check_same_as_fresh(store: &Store, dir: &Path, model: &Model, shape: Shape) {
    store.flush().unwrap();
    let fresh = Store::open_read_only(dir).unwrap();
    let (writer, reader) = (store.snapshot(), fresh.snapshot());
    let by_id = |mut v: Vec<trajlog::SessionInfo>| {
        v.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        v
    };
    assert_eq!(by_id(writer.sessions()), by_id(reader.sessions()), "sessions: writer, fresh open");
    assert_eq!(writer.call_count(), reader.call_count());
    writer
        .for_each_call(|c| {
            let want = c.to_call()?;
            assert_same(&reader.get(c.trace_id())?.expect("the fresh open has the writer's call"), &want);
            assert_eq!(reader.trace_reward(c.trace_id()), writer.trace_reward(c.trace_id()), "{}", c.trace_id());
            Ok(())
        })
        .unwrap();
    for s in 0..shape.sessions {
        let sid = format!("s{s}");
        assert_eq!(reader.is_sealed(&sid), writer.is_sealed(&sid), "sealed {sid}");
        assert_eq!(reader.session_reward(&sid), writer.session_reward(&sid), "reward {sid}");
    }
    check(&fresh, model, shape);
}

/// The rewards side table (format-spec/shard.md §8): each listed session's
/// row and its trace rows, in file order.
#[derive(Debug, Default)]
struct SideTable {
    sessions: BTreeMap<String, (Option<f64>, BTreeMap<String, f64>)>,
}

impl SideTable {
    /// `DIR/shards/_rewards.parquet`, or `None` where there is none.
    fn read(dir: &Path) -> Option<SideTable> {
        let file = std::fs::File::open(dir.join("shards").join("_rewards.parquet")).ok()?;
        let mut table = SideTable::default();
        let mut last: Option<String> = None;
        for batch in parquet_batches(file) {
            let (sid, tid, reward) =
                (strings(&batch, "session_id"), strings(&batch, "trace_id"), floats(&batch, "reward"));
            for i in 0..batch.num_rows() {
                let sid = sid.value(i).to_owned();
                let r = (!reward.is_null(i)).then(|| reward.value(i));
                if tid.is_null(i) {
                    assert!(last.as_ref().is_none_or(|l| *l < sid), "sessions in byte order, once each: {sid}");
                    table.sessions.insert(sid.clone(), (r, BTreeMap::new()));
                    last = Some(sid);
                } else {
                    assert_eq!(last.as_ref(), Some(&sid), "a trace row follows its session's row");
                    let r = r.expect("a trace row has a reward");
                    table.sessions.get_mut(&sid).unwrap().1.insert(tid.value(i).to_owned(), r);
                }
            }
        }
        Some(table)
    }

    /// The trace row of `trace_id` under any listed session.
    fn trace(&self, trace_id: &str) -> Option<f64> {
        self.sessions.values().find_map(|(_, traces)| traces.get(trace_id).copied())
    }
}

fn parquet_batches(file: std::fs::File) -> Vec<RecordBatch> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet").build().expect("reader");
    reader.map(|b| b.expect("batch")).collect()
}

fn strings<'a>(batch: &'a RecordBatch, name: &str) -> &'a StringArray {
    batch.column_by_name(name).expect(name).as_string::<i32>()
}

fn floats<'a>(batch: &'a RecordBatch, name: &str) -> &'a Float64Array {
    batch.column_by_name(name).expect(name).as_primitive::<Float64Type>()
}

/// A store just compacted: its rewards side table holds every listed
/// session's current rewards, and a reader applying it to the published
/// shards (shard.md §8) sees every live row's reward as the store has it.
/// A row is live when it holds the compacted call the store serves (same
/// trace id, same log position); a `trajectories` row when each of its calls
/// is live in the same generation and in the row's session.
fn check_rewards_side_table(dir: &Path, store: &Store) {
    let manifest = trajlog::format::manifest::decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    let Some(side) = SideTable::read(dir) else {
        assert!(manifest.shards.is_empty(), "a publication with shards writes the side table");
        return;
    };
    let snap = store.snapshot();
    let bits = |r: Option<f64>| r.map(f64::to_bits);
    for (sid, (reward, traces)) in &side.sessions {
        assert_eq!(bits(*reward), bits(snap.session_reward(sid)), "side table: session {sid}");
        for (tid, r) in traces {
            assert_eq!(Some(r.to_bits()), bits(snap.trace_reward(tid)), "side table: trace {tid} of {sid}");
        }
    }
    // trace id → (log position, sessions) of each compacted call.
    let mut compacted: BTreeMap<String, (Loc, Vec<String>)> = BTreeMap::new();
    snap.for_each_call(|c| {
        if c.is_compacted() {
            let sessions = [c.session_id()].into_iter().chain(c.record.session_uids.iter().copied());
            compacted.insert(c.trace_id().to_owned(), (c.loc, sessions.map(str::to_owned).collect()));
        }
        Ok(())
    })
    .unwrap();
    // trace id → generation of its live `steps` row.
    let mut live: BTreeMap<String, u64> = BTreeMap::new();
    let shards = |table: &str| {
        let files = manifest.shards.iter().filter(|s| s.path.starts_with(table));
        files
            .map(|s| (trajlog::shard::generation_of(&s.path).unwrap(), dir.join("shards").join(&s.path)))
            .collect::<Vec<_>>()
    };
    for (generation, path) in shards("steps/") {
        for batch in parquet_batches(std::fs::File::open(path).unwrap()) {
            let (tid, reward) = (strings(&batch, "trace_id"), floats(&batch, "reward"));
            let segment = batch.column_by_name("source_segment").unwrap().as_primitive::<UInt64Type>();
            let offset = batch.column_by_name("source_offset").unwrap().as_primitive::<UInt64Type>();
            for i in 0..batch.num_rows() {
                let t = tid.value(i);
                let at = Loc { segment: segment.value(i), offset: offset.value(i) };
                if compacted.get(t).is_none_or(|(loc, _)| *loc != at) {
                    continue; // dead: deleted or replaced since
                }
                assert!(live.insert(t.to_owned(), generation).is_none(), "two live steps rows of {t}");
                let shard = (!reward.is_null(i)).then(|| reward.value(i));
                assert_eq!(bits(side.trace(t).or(shard)), bits(snap.trace_reward(t)), "steps row of {t}");
            }
        }
    }
    assert_eq!(live.len(), compacted.len(), "every compacted call is served from a steps row");
    for (generation, path) in shards("trajectories/") {
        for batch in parquet_batches(std::fs::File::open(path).unwrap()) {
            let (sid, reward) = (strings(&batch, "session_id"), floats(&batch, "reward"));
            let tids = batch.column_by_name("trace_ids").unwrap().as_list::<i32>();
            for i in 0..batch.num_rows() {
                let sid = sid.value(i);
                let ids = tids.value(i);
                let ids: Vec<&str> = ids.as_string::<i32>().iter().map(|t| t.expect("trace id")).collect();
                let row_live =
                    ids.iter().all(|t| live.get(*t) == Some(&generation) && compacted[*t].1.iter().any(|s| s == sid));
                if !row_live {
                    continue;
                }
                let last = ids.last().expect("a chain has a call");
                let shard = (!reward.is_null(i)).then(|| reward.value(i));
                let got = match side.sessions.get(sid) {
                    Some((Some(r), _)) => Some(*r),
                    Some((None, traces)) => traces.get(*last).copied().or(shard),
                    None => shard,
                };
                let want = snap.session_reward(sid).or_else(|| snap.trace_reward(last));
                assert_eq!(bits(got), bits(want), "trajectories row of {sid}: {ids:?}");
            }
        }
    }
}

fn opts(durability: Durability) -> Options {
    Options::default().durability(durability).segment_bytes(64 * 1024).queue_depth(8)
}

/// Apply a change (`change()`) to the store and the model, checking the
/// store's answer against the model's.
fn apply(store: &Store, model: &mut Model, op: &Op) {
    match op.clone() {
        Op::Append { s, t, extend, completion, ts, uid } => {
            let sid = format!("s{s}");
            let uids: Vec<String> = uid.filter(|u| *u != s).map(|u| format!("s{u}")).into_iter().collect();
            let ctx = model.contexts.get(&sid).cloned().unwrap_or_default();
            let mut prompt = if extend { ctx } else { ctx.iter().take(ctx.len() / 2).copied().chain([7, 7]).collect() };
            prompt.push(u32::from(t));
            let call = Call {
                trace_id: format!("t{t}"),
                session_id: sid.clone(),
                timestamp: f64::from(ts),
                prompt_token_ids: prompt.clone(),
                logprobs: Some(completion.iter().map(|&x| f32::from_bits(x)).collect()),
                completion_token_ids: completion.clone(),
                session_uids: uids.clone(),
                ..Default::default()
            };
            let result = store.append(call.clone());
            // Trace ids are unique per store: one live in another
            // session is refused, like an append to a sealed session (its
            // own or one of its uids), or a replacement that takes the call
            // out of a sealed session among the old call's uids.
            let elsewhere = model.calls.get(&call.trace_id).is_some_and(|(_, c)| c.session_id != sid);
            let out_of_sealed = model
                .calls
                .get(&call.trace_id)
                .is_some_and(|(_, c)| c.session_uids.iter().any(|u| model.sealed.contains(u) && !uids.contains(u)));
            let sealed = model.sealed.contains(&sid) || uids.iter().any(|u| model.sealed.contains(u));
            if sealed || elsewhere || out_of_sealed {
                let err =
                    result.expect_err("append to a sealed session or of a trace id of another session is refused");
                let invalid = matches!(err.kind(), ErrorKind::InvalidInput { .. });
                assert!(invalid, "{}", err);
            } else {
                result.unwrap();
                model.order += 1;
                model.calls.insert(call.trace_id.clone(), (model.order, call));
                prompt.extend_from_slice(&completion);
                model.contexts.insert(sid, prompt);
            }
        }
        Op::Seal(s) => {
            store.seal_session(&format!("s{s}")).unwrap();
            model.sealed.insert(format!("s{s}"));
        }
        Op::Delete(s) => {
            let sid = format!("s{s}");
            let n = store.delete_session(&sid).unwrap();
            let before = model.calls.len();
            model.calls.retain(|_, (_, c)| c.session_id != sid && !c.session_uids.contains(&sid));
            assert_eq!(n as usize, before - model.calls.len());
            model.trace_rewards.retain(|t, _| model.calls.contains_key(t));
            model.sealed.remove(&sid);
            model.rewards.remove(&sid);
            model.contexts.remove(&sid);
        }
        Op::Reward(s, r) => {
            store.set_reward(Target::Session(format!("s{s}")), f64::from(r)).unwrap();
            model.rewards.insert(format!("s{s}"), f64::from(r));
        }
        Op::TraceReward(t, r) => {
            let tid = format!("t{t}");
            let result = store.set_reward(Target::Trace(tid.clone()), f64::from(r));
            if model.calls.contains_key(&tid) {
                result.unwrap();
                model.trace_rewards.insert(tid, f64::from(r));
            } else {
                let err = result.expect_err("a reward on a trace id with no live call is refused");
                assert!(matches!(err.kind(), ErrorKind::NotFound), "{}", err);
            }
        }
        Op::Roll => store.roll().unwrap(),
        Op::Compact(..) | Op::Reopen | Op::Read => unreachable!("not a change: {op:?}"),
    }
}

/// Run `ops` against a store in a fresh directory and the model.
fn run(shape: Shape, ops: Vec<Op>, durability: Durability) -> Result<(), TestCaseError> {
    let dir = tempdir();
    let mut store = Store::open(dir.path(), opts(durability)).unwrap();
    // A reader beside the writer for the whole run, refreshed at each
    // read: incremental after appends, a whole load after compactions.
    let reader = Store::open_read_only(dir.path()).unwrap();
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Append { .. } | Op::Seal(_) | Op::Delete(_) | Op::Reward(..) | Op::TraceReward(..) | Op::Roll => {
                apply(&store, &mut model, &op);
            }
            Op::Compact(compactions) => {
                let mut deferred = false;
                for c in &compactions {
                    let r = store
                        .compact_with_meanwhile(&c.options(), &mut || {
                            c.meanwhile.iter().for_each(|o| apply(&store, &mut model, o))
                        })
                        .unwrap();
                    // A generation left for later (its dead row keeps
                    // another record of its trace id dead, shard.md §6.1)
                    // is neither collected nor merged.
                    deferred = !r.collect_deferred.is_empty();
                }
                let last = compactions.last().expect("a compaction at least");
                // The writer answers as before (a publication that wrote
                // the shard index file handed it an index rebuilt over
                // it), as a fresh open does, and the file, rewritten as a
                // streamed merge, is what the shards' rows make of it.
                store.flush().unwrap();
                check(&store, &model, shape);
                check_same_as_fresh(&store, dir.path(), &model, shape);
                check_rewards_side_table(dir.path(), &store);
                let report = trajlog::verify::verify_dir(dir.path()).unwrap();
                prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
                if last.merge && !deferred {
                    // After a merging compaction no size tier holds more
                    // than the fanout: the ones that reached it were
                    // merged, and the new generation adds one.
                    let tiers = generations_per_tier(dir.path(), 2);
                    prop_assert!(tiers.iter().all(|(t, n)| t.is_none() || *n <= 2), "{:?}", tiers);
                }
                if last.collect_dead_fraction() == Some(0.0) && last.meanwhile.is_empty() && !deferred {
                    // Every dead row was dropped: the published `steps`
                    // rows are exactly the live compacted calls (unless
                    // some died during this compaction, in its own files).
                    let m = trajlog::format::manifest::decode_manifest(
                        &std::fs::read(dir.path().join("MANIFEST")).unwrap(),
                    )
                    .unwrap();
                    let rows: u64 = m.shards.iter().filter(|s| s.path.starts_with("steps/")).map(|s| s.rows).sum();
                    let snap = store.snapshot();
                    let compacted = model.calls.keys().filter(|t| snap.get(t).unwrap().unwrap().is_compacted()).count();
                    prop_assert_eq!(rows as usize, compacted);
                }
            }
            Op::Reopen => {
                store.close().unwrap();
                store = Store::open(dir.path(), opts(durability)).unwrap();
                check(&Store::open_read_only(dir.path()).unwrap(), &model, shape);
            }
            Op::Read => {
                store.flush().unwrap();
                check(&store, &model, shape);
                reader.refresh().unwrap();
                check(&reader, &model, shape);
            }
        }
    }
    store.flush().unwrap();
    check(&store, &model, shape);
    store.close().unwrap();
    check(&Store::open(dir.path(), opts(durability)).unwrap(), &model, shape);
    Ok(())
}

fn durability() -> impl Strategy<Value = Durability> {
    prop_oneof![Just(Durability::Buffered), Just(Durability::Group), Just(Durability::Sync)]
}

// Both shapes run proptest's case count: PROPTEST_CASES, else 256.
proptest! {
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(DEFAULT), 1..60), durability in durability()) {
        run(DEFAULT, ops, durability)?;
    }

    #[test]
    fn store_matches_model_aggressive(ops in prop::collection::vec(op(AGGRESSIVE), 1..60), durability in durability()) {
        run(AGGRESSIVE, ops, durability)?;
    }
}
