//! Model-based test: random sequences of append / replace / seal / delete /
//! reward / roll / compact / reopen / read against a plain in-memory model,
//! read by the writer and by a read-only store refreshed beside it. A
//! compaction also runs a few of those operations while it is under way
//! (between staging its shards and publishing them).

mod common;

use common::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use trajlog::{Call, CompactOptions, Durability, ErrorKind, Options, Selection, Store, Target};

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
    /// Compact sealed sessions (false) or every session (true), collecting
    /// earlier shards with any dead row (0), a quarter dead (1), or never (2),
    /// merging or not; the operations (appends, seals, deletes, rewards,
    /// rolls) run while it is under way.
    Compact(bool, u8, bool, Vec<Op>),
    Reopen,
    Read,
}

/// The operations that change the store without compacting or reopening
/// it, appends, deletions and rolls weighted as given (the others 1 each).
fn change(append: u32, delete: u32, roll: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        append => (
            0u8..4,
            0u8..24,
            any::<bool>(),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u8>(),
            prop::option::weighted(0.2, 0u8..4),
        )
            .prop_map(|(s, t, extend, completion, ts, uid)| Op::Append { s, t, extend, completion, ts, uid }),
        1 => (0u8..4).prop_map(Op::Seal),
        delete => (0u8..4).prop_map(Op::Delete),
        1 => (0u8..4, any::<i8>()).prop_map(|(s, r)| Op::Reward(s, r)),
        1 => (0u8..24, any::<i8>()).prop_map(|(t, r)| Op::TraceReward(t, r)),
        roll => Just(Op::Roll),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        15 => change(10, 1, 1),
        // While a compaction runs, deletions and rolls are likelier: what
        // its publication retires then may hold records written meanwhile.
        1 => (any::<bool>(), 0u8..3, any::<bool>(), prop::collection::vec(change(3, 2, 2), 0..5))
            .prop_map(|(all, collect, merge, meanwhile)| Op::Compact(all, collect, merge, meanwhile)),
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

fn check(store: &Store, model: &Model) {
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), model.calls.len());
    for (_, c) in model.calls.values() {
        assert_same(&snap.get(&c.trace_id).unwrap().expect("model call present"), c);
    }
    for s in 0..4 {
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
    for t in 0..24 {
        let tid = format!("t{t}");
        assert_eq!(snap.trace_reward(&tid), model.trace_rewards.get(&tid).copied(), "trace {tid}");
    }
    // A call is listed in each of its sessions.
    let listed: usize = snap.sessions().iter().map(|s| s.calls).sum();
    assert_eq!(listed, (0..4).map(|s| model.session(&format!("s{s}")).len()).sum::<usize>());
    let mut scanned: Vec<String> = Vec::new();
    snap.for_each_call(|c| {
        scanned.push(c.trace_id().to_owned());
        Ok(())
    })
    .unwrap();
    scanned.sort();
    assert_eq!(scanned, model.calls.keys().cloned().collect::<Vec<_>>());
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
                    result.err().expect("append to a sealed session or of a trace id of another session is refused");
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..60), durability in prop_oneof![Just(Durability::Buffered), Just(Durability::Group), Just(Durability::Sync)]) {
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
                Op::Compact(all, collect, merge, meanwhile) => {
                    let selection = if all { Selection::OlderThan(0.0) } else { Selection::SealedOnly };
                    let fraction = [Some(0.0), Some(0.25), None][usize::from(collect)];
                    let fanout = merge.then_some(2);
                    let opts = CompactOptions::default().selection(selection).steps_row_group_rows(3).merge_fanout(fanout);
                    let opts = opts.collect_dead_fraction(fraction);
                    store.compact_with_meanwhile(&opts, &mut || meanwhile.iter().for_each(|o| apply(&store, &mut model, o))).unwrap();
                    // The writer answers as before (a publication that wrote
                    // the shard index file handed it an index rebuilt over
                    // it), and the file, rewritten as a streamed merge, is
                    // what the shards' rows make of it.
                    store.flush().unwrap();
                    check(&store, &model);
                    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
                    prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
                    if merge {
                        // After a merging compaction no size tier holds more
                        // than the fanout: the ones that reached it were
                        // merged, and the new generation adds one.
                        let tiers = generations_per_tier(dir.path(), 2);
                        prop_assert!(tiers.iter().all(|(t, n)| t.is_none() || *n <= 2), "{:?}", tiers);
                    }
                    if fraction == Some(0.0) && meanwhile.is_empty() {
                        // Every dead row was dropped: the published `steps`
                        // rows are exactly the live compacted calls (unless
                        // some died during this compaction, in its own files).
                        let m = trajlog::format::manifest::decode_manifest(&std::fs::read(dir.path().join("MANIFEST")).unwrap()).unwrap();
                        let rows: u64 = m.shards.iter().filter(|s| s.path.starts_with("steps/")).map(|s| s.rows).sum();
                        let snap = store.snapshot();
                        let compacted = model.calls.keys().filter(|t| snap.get(t).unwrap().unwrap().is_compacted()).count();
                        prop_assert_eq!(rows as usize, compacted);
                    }
                }
                Op::Reopen => {
                    store.close().unwrap();
                    store = Store::open(dir.path(), opts(durability)).unwrap();
                    check(&Store::open_read_only(dir.path()).unwrap(), &model);
                }
                Op::Read => {
                    store.flush().unwrap();
                    check(&store, &model);
                    reader.refresh().unwrap();
                    check(&reader, &model);
                }
            }
        }
        store.flush().unwrap();
        check(&store, &model);
        store.close().unwrap();
        check(&Store::open(dir.path(), opts(durability)).unwrap(), &model);
    }
}
