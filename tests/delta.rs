//! Prefix-delta encoding: size on disk, classification, break positions,
//! interleaved conversations, and parents found again after a reopen.

mod common;

use common::*;
use trajlog::{Call, Options, Relation, Store};
use trajlog_sim::{simulate, Rng, SimConfig};

fn segment_data_bytes(store: &Store) -> u64 {
    // Header (64 bytes per segment) excluded: it is per segment, not per session.
    store.snapshot().segments().iter().map(|s| s.data_bytes - 64).sum()
}

#[test]
fn fifty_turn_session_costs_at_most_1_3x_its_new_tokens() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let mut rng = Rng::new(50);
    let mut prompt = rng.tokens(1500);
    let mut new_tokens = prompt.len();
    for turn in 0..50 {
        let n = rng.range(200, 600);
        let completion = rng.tokens(n);
        new_tokens += completion.len();
        store
            .append(Call {
                trace_id: format!("t{turn}"),
                session_id: "long".into(),
                timestamp: turn as f64,
                prompt_token_ids: prompt.clone(),
                completion_token_ids: completion.clone(),
                ..Default::default()
            })
            .unwrap();
        prompt.extend_from_slice(&completion);
        let tool_len = rng.range(100, 400);
        let tool = rng.tokens(tool_len);
        new_tokens += tool.len();
        prompt.extend_from_slice(&tool);
    }
    store.flush().unwrap();
    // The last tool output is never sent in a prompt.
    let new_bytes = 4 * new_tokens as u64;
    let on_disk = segment_data_bytes(&store);
    let full_prompts: u64 =
        store.snapshot().session("long", None, None).unwrap().iter().map(|c| 4 * c.prompt_len() as u64).sum();
    let ratio = on_disk as f64 / new_bytes as f64;
    eprintln!("50 turns: {on_disk} bytes on disk for {new_bytes} bytes of new tokens ({ratio:.3}×); full prompts would be {full_prompts} bytes");
    assert!(ratio <= 1.3, "prefix-delta ratio {ratio:.3} > 1.3");
    assert!(on_disk * 10 < full_prompts, "delta must beat storing every prompt by far");
    let snap = store.snapshot();
    for (i, c) in snap.session("long", None, None).unwrap().iter().enumerate() {
        assert_eq!(c.relation(), if i == 0 { Relation::Root } else { Relation::Extends });
    }
}

#[test]
fn injected_breaks_are_reported_at_their_position() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let batch = simulate(&SimConfig { sessions: 20, steps: 6, ..SimConfig::default() });
    for s in &batch {
        for c in &s.calls {
            store.append(c.clone()).unwrap();
        }
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    let mut breaks = 0;
    for s in &batch {
        let got = snap.session(&s.session_id, None, None).unwrap();
        for (i, (v, want)) in got.iter().zip(&s.calls).enumerate() {
            assert_same(v, want);
            match s.injected_break {
                Some((at, pos)) if at == i => {
                    assert_eq!(v.relation(), Relation::TitoBreak, "{} call {i}", s.session_id);
                    assert_eq!(v.divergence_position(), Some(pos));
                    breaks += 1;
                }
                _ if i == 0 => assert_eq!(v.relation(), Relation::Root),
                _ => assert_eq!(v.relation(), Relation::Extends, "{} call {i}", s.session_id),
            }
        }
    }
    assert_eq!(breaks, batch.iter().filter(|s| s.injected_break.is_some()).count());
    assert!(breaks > 0);
}

#[test]
fn interleaved_conversations_find_their_own_parents_and_early_divergence_is_classified() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let mut rng = Rng::new(7);
    let mut solver = rng.tokens(300);
    let mut judge = rng.tokens(300);
    let mut i = 0;
    let mut push = |ctx: &mut Vec<u32>, rng: &mut Rng| {
        let completion = rng.tokens(50);
        store
            .append(Call {
                trace_id: format!("c{i}"),
                session_id: "s".into(),
                timestamp: i as f64,
                prompt_token_ids: ctx.clone(),
                completion_token_ids: completion.clone(),
                ..Default::default()
            })
            .unwrap();
        i += 1;
        ctx.extend_from_slice(&completion);
        ctx.extend(rng.tokens(20));
    };
    for _ in 0..5 {
        push(&mut solver, &mut rng);
        push(&mut judge, &mut rng);
    }
    // A re-rendered history: the prompt drops the middle of the solver's history.
    let mut rerendered: Vec<u32> = solver[..100].to_vec();
    rerendered.extend(rng.tokens(10));
    push(&mut rerendered, &mut rng);
    store.flush().unwrap();
    let snap = store.snapshot();
    let calls = snap.session("s", None, None).unwrap();
    assert_eq!(calls[0].relation(), Relation::Root);
    // The judge's first call shares nothing with the solver: a new branch at 0.
    assert_eq!(calls[1].relation(), Relation::DivergesEarlier);
    assert_eq!(calls[1].divergence_position(), Some(0));
    for c in &calls[2..10] {
        assert_eq!(c.relation(), Relation::Extends, "{}", c.trace_id());
        assert!(c.prompt_suffix().len() <= 20, "{} stored {} prompt tokens", c.trace_id(), c.prompt_suffix().len());
    }
    assert_eq!(calls[10].relation(), Relation::DivergesEarlier);
    assert_eq!(calls[10].divergence_position(), Some(100));
    assert_eq!(calls[10].prompt().unwrap(), rerendered[..110].to_vec());
}

#[test]
fn parents_are_found_again_after_a_reopen() {
    let dir = tempdir();
    let batch = simulate(&SimConfig { sessions: 2, steps: 10, break_every: 0, ..SimConfig::default() });
    {
        let store = Store::open(dir.path(), Options::default()).unwrap();
        for c in &batch[0].calls[..5] {
            store.append(c.clone()).unwrap();
        }
        store.close().unwrap();
    }
    let store = Store::open(dir.path(), Options::default()).unwrap();
    for c in &batch[0].calls[5..] {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    let calls = snap.session(&batch[0].session_id, None, None).unwrap();
    let first_after = &calls[5];
    assert_eq!(first_after.relation(), Relation::Extends);
    assert!(first_after.prompt_suffix().len() < 500, "stored {} prompt tokens", first_after.prompt_suffix().len());
    for (v, want) in calls.iter().zip(&batch[0].calls) {
        assert_same(v, want);
    }
}

/// Records read to rebuild `v`'s prompt besides its own: its parents up to
/// one that stores its prompt whole.
fn chain_depth(snap: &trajlog::Snapshot, v: &trajlog::CallView<'_>) -> usize {
    let mut depth = 0;
    let mut cur = snap.call_at(v.loc).unwrap();
    while cur.prompt_prefix_len() > 0 {
        cur = snap.call_at(cur.parent().expect("a prefix has a parent")).unwrap();
        depth += 1;
    }
    depth
}

/// A session longer than the chain bound stores a checkpoint (its whole
/// prompt, its relation still `extends`) at least every PROMPT_CHAIN_MAX
/// records, before and after a reopen, and every prompt reads back exactly.
#[test]
fn long_chains_are_cut_by_checkpoints() {
    let max = trajlog::limits::PROMPT_CHAIN_MAX as usize;
    let calls = simulate(&SimConfig {
        sessions: 1,
        steps: 3 * max + 10,
        system_tokens: 30,
        completion_tokens: (1, 8),
        tool_tokens: (1, 4),
        break_every: 0,
        ..SimConfig::default()
    })
    .remove(0)
    .calls;
    let dir = tempdir();
    let half = calls.len() / 2;
    {
        let store = Store::open(dir.path(), Options::default()).unwrap();
        for c in &calls[..half] {
            store.append(c.clone()).unwrap();
        }
        store.close().unwrap();
    }
    let store = Store::open(dir.path(), Options::default()).unwrap();
    for c in &calls[half..] {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    let views = snap.session(&calls[0].session_id, None, None).unwrap();
    let mut checkpoints = 0;
    for (v, want) in views.iter().zip(&calls) {
        assert_same(v, want);
        assert!(chain_depth(&snap, v) < max, "{} reads {} parents", v.trace_id(), chain_depth(&snap, v));
        if v.parent().is_some() && v.prompt_prefix_len() == 0 {
            assert_eq!(v.relation(), Relation::Extends, "a checkpoint keeps its relation");
            checkpoints += 1;
        }
    }
    assert!(checkpoints >= calls.len() / max, "{checkpoints} checkpoints in {} calls", calls.len());
    assert!(checkpoints <= calls.len() / max + 2, "{checkpoints} checkpoints in {} calls", calls.len());
    assert_eq!(snap.session_calls(&calls[0].session_id, None, None).unwrap(), calls);
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
}

/// The audit's report keeps the details of at most `AUDIT_DETAILS_MAX`
/// divergences (and lists at most `AUDIT_SESSIONS_LISTED_MAX` sessions),
/// whatever the store's size, and still counts every one: lean calls carry
/// a one-line `messages` each, so every call after a session's first
/// "rewrites its history".
#[test]
fn the_audit_report_keeps_bounded_details_and_complete_counts() {
    use trajlog::limits::AUDIT_DETAILS_MAX;
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default().durability(trajlog::Durability::Buffered)).unwrap();
    let sessions = AUDIT_DETAILS_MAX / 4 + 100;
    let batch = simulate(&SimConfig { sessions, steps: 5, shape: trajlog_sim::Shape::Lean, ..SimConfig::default() });
    for s in &batch {
        for c in &s.calls {
            store.append(c.clone()).unwrap();
        }
    }
    store.flush().unwrap();
    let report = trajlog::audit::audit(&store.snapshot()).unwrap();
    assert_eq!(report.sessions_checked, sessions);
    assert_eq!(report.sessions.len(), sessions, "fewer sessions than AUDIT_SESSIONS_LISTED_MAX: all listed");
    assert_eq!(report.sessions_not_listed, 0);
    let found = report.breaks + report.diverges_earlier + report.histories_rewritten;
    assert!(found > AUDIT_DETAILS_MAX, "the test needs more divergences than the bound: {found}");
    let kept: usize = report.sessions.iter().map(|s| s.divergences.len() + s.history_divergences.len()).sum();
    assert_eq!(kept, AUDIT_DETAILS_MAX);
    assert_eq!(kept + report.details_not_kept, found);
    // Per session, the counts stay whole.
    let rewritten: usize = report.sessions.iter().map(|s| s.histories_rewritten).sum();
    assert_eq!(rewritten, report.histories_rewritten);
}

/// A call of `session` (uid: one more session it belongs to).
fn dead_parent_call(trace: &str, session: &str, uid: Option<&str>, prompt: &[u32]) -> Call {
    Call {
        trace_id: trace.into(),
        session_id: session.into(),
        session_uids: uid.map(str::to_owned).into_iter().collect(),
        prompt_token_ids: prompt.to_vec(),
        completion_token_ids: vec![1],
        logprobs: Some(vec![-0.5]),
        ..Default::default()
    }
}

/// A dead call is never a parent: its ancestors may be retired (retirement
/// keeps only what live records need), and a call chained to it could then
/// not be read. Found by the model test: `t` is replaced in session `a` by a
/// call that also lists `b` (chained to the first), `b` is deleted (the
/// replacement dies with it), a compaction retires the first call's
/// segment, and a new call of `a` extending the dead replacement's prompt
/// was chained to it: "segment 1 is not part of this snapshot". (The last
/// call extends the deleted replacement, or the replaced call: the writer
/// forgets both, and neither is a parent.)
#[test]
fn a_dead_call_is_never_taken_as_a_parent() {
    use trajlog::{CompactOptions, Durability, Selection};
    // The last call extends the deleted replacement, or the replaced call.
    for last in [vec![7, 7, 8, 8, 9], vec![7, 7, 7, 2]] {
        let dir = tempdir();
        let opts = Options::default().durability(Durability::Buffered).segment_bytes(64 * 1024);
        let store = Store::open(dir.path(), opts).unwrap();
        let none_sealed = CompactOptions::default().selection(Selection::SealedOnly).copy_forward(None);
        // During a compaction (its publication then retires what is dead).
        let report = store
            .compact_with_meanwhile(&none_sealed, &mut || {
                store.append(dead_parent_call("t", "a", None, &[7, 7, 7])).unwrap();
                store.roll().unwrap();
                store.append(dead_parent_call("t", "a", Some("b"), &[7, 7, 8, 8])).unwrap();
                store.delete_session("b").unwrap();
            })
            .unwrap();
        assert_eq!(report.retired_segments, 1, "the first segment holds only a dead record");
        store
            .compact_with_meanwhile(&none_sealed, &mut || {
                store.append(dead_parent_call("v", "a", None, &last)).unwrap();
            })
            .unwrap();
        store.flush().unwrap();
        for s in [store.snapshot(), Store::open_read_only(dir.path()).unwrap().snapshot()] {
            let calls = s.session("a", None, None).unwrap();
            let got: Vec<(String, Vec<u32>)> =
                calls.iter().map(|c| (c.trace_id().to_owned(), c.prompt().unwrap())).collect();
            assert_eq!(got, vec![("v".to_owned(), last.clone())]);
        }
    }
}
