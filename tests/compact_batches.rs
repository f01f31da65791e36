//! A compaction publishes in steps of at most about `batch_calls` calls,
//! new and moved (collected, merged) together, so that what it builds is
//! bounded by configuration, not by the backlog (format-spec/shard.md
//! §6.1, §6.2; `CompactOptions::batch_calls`).

mod common;

use common::*;
use std::sync::{Arc, Mutex};
use trajlog::{Call, CompactOptions, Options, Store};

/// `n` sessions `{prefix}{i}` of `calls` small calls each, oldest first.
fn sessions(prefix: &str, n: usize, calls: usize, t0: f64) -> Vec<Call> {
    let mut out = Vec::new();
    for s in 0..n {
        for k in 0..calls {
            out.push(Call {
                trace_id: format!("{prefix}{s}/{k}"),
                session_id: format!("{prefix}{s}"),
                timestamp: t0 + (s * 100 + k) as f64,
                prompt_token_ids: (0..=k as u32).collect(),
                completion_token_ids: vec![7, s as u32],
                logprobs: Some(vec![-0.0, f32::from_bits(0x7fc0_0001)]),
                ..Default::default()
            });
        }
    }
    out
}

fn append_sealed(store: &Store, calls: &[Call]) {
    for c in calls {
        store.append(c.clone()).unwrap();
    }
    let ids: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
    for s in ids {
        store.seal_session(s).unwrap();
    }
}

/// 30 sessions of 4 calls with `batch_calls` 25: five publications of six
/// sessions each (a seventh would pass 25), one generation each, every
/// call read back exactly, before and after a reopen; the progress runs
/// over the whole compaction; with `max_calls`, the sessions up to it;
/// with the default (2^20) or no limit, one publication.
#[test]
fn a_backlog_is_published_in_steps_of_batch_calls() {
    let dir = tempdir();
    let calls = sessions("s", 30, 4, 0.0);
    let store = Store::open(dir.path(), Options::default()).unwrap();
    append_sealed(&store, &calls);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let opts = CompactOptions::default()
        .batch_calls(Some(25))
        .progress(move |done, total, calls| log.lock().unwrap().push((done, total, calls)));
    let r = store.compact(&opts).unwrap();
    assert_eq!((r.sessions, r.calls, r.sessions_left, r.publications), (30, 120, 0, 5), "{r:?}");
    assert_eq!(generation_rows(dir.path()).values().copied().collect::<Vec<_>>(), [24; 5]);
    let seen = seen.lock().unwrap().clone();
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].2 <= w[1].2), "{seen:?}");
    assert!(seen.iter().all(|&(done, total, _)| done <= total && total == 30), "{seen:?}");
    assert_eq!(seen.last().copied(), Some((30, 30, 120)));
    assert_all(&store, &calls);
    store.close().unwrap();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    assert_all(&store, &calls);
    // With `max_calls` too: the sessions up to it (12, 48 calls), in steps.
    let more = sessions("x", 30, 4, 5_000.0);
    append_sealed(&store, &more);
    let r = store.compact(&CompactOptions::default().batch_calls(Some(25)).max_calls(Some(50))).unwrap();
    assert_eq!((r.sessions, r.calls, r.publications, r.sessions_left), (12, 48, 2, 18), "{r:?}");
    let r = store.compact(&CompactOptions::default().batch_calls(Some(25)).max_calls(Some(25))).unwrap();
    assert_eq!((r.sessions, r.calls, r.publications, r.sessions_left), (6, 24, 1, 12), "{r:?}");
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!((r.sessions, r.publications, r.sessions_left), (12, 1, 0), "{r:?}");
    let more = sessions("m", 5, 4, 10_000.0);
    append_sealed(&store, &more);
    let r = store.compact(&CompactOptions::default().batch_calls(None)).unwrap();
    assert_eq!((r.sessions, r.publications), (5, 1));
    // By default, batches of 2^20 calls: a backlog under that is one
    // publication (above).
    assert_eq!(CompactOptions::default().batch_calls, Some(trajlog::DEFAULT_BATCH_CALLS));
    let bad = store.compact(&CompactOptions::default().batch_calls(Some(0))).unwrap_err();
    assert!(bad.to_string().contains("batch_calls"), "{bad}");
}

/// Eight generations of 12 rows in one merge tier (fanout 8): with
/// `batch_calls` 30 the merge takes the two oldest (24 rows; a third would
/// pass 30) and the new calls fill what is left (one session, at least
/// one); once the tier is full again, a compaction without a limit merges
/// all of it.
#[test]
fn a_merge_takes_the_generations_that_fit_the_batch() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let mut all = Vec::new();
    for g in 0..8 {
        let calls = sessions(&format!("g{g}-"), 3, 4, f64::from(g) * 1000.0);
        append_sealed(&store, &calls);
        let r = store.compact(&CompactOptions::default().merge_fanout(None)).unwrap();
        assert_eq!(r.calls, 12);
        all.extend(calls);
    }
    let before = generation_rows(dir.path());
    assert_eq!(before.len(), 8);
    let new = sessions("new", 2, 4, 50_000.0);
    append_sealed(&store, &new);
    all.extend(new);
    let r = store.compact(&CompactOptions::default().batch_calls(Some(30)).max_calls(Some(4))).unwrap();
    let oldest: Vec<u64> = before.keys().copied().take(2).collect();
    assert_eq!(r.merged_generations, oldest, "{r:?}");
    assert_eq!((r.moved_calls, r.calls, r.publications), (24, 4, 1), "{r:?}");
    assert_all(&store, &all);
    // The tier now holds the six left and the merged one (24 rows and the
    // 4 new calls); one more makes it full, and without a limit all eight
    // are merged.
    let more = sessions("more", 3, 4, 60_000.0);
    append_sealed(&store, &more);
    all.extend(more);
    let r = store.compact(&CompactOptions::default().merge_fanout(None)).unwrap();
    assert_eq!((r.calls, r.merged_generations.len()), (16, 0), "{r:?}");
    let r = store.compact(&CompactOptions::default().batch_calls(None)).unwrap();
    assert_eq!((r.calls, r.merged_generations.len(), r.moved_calls), (0, 8, 6 * 12 + (24 + 4) + 16), "{r:?}");
    assert_all(&store, &all);
}

/// Four generations of 12 rows, a third of each deleted: with
/// `batch_calls` 10 a compaction collects only the oldest (8 live rows; a
/// second would pass 10), and with 5 still one (the first whatever its
/// size, so that collection always progresses); then the rest.
#[test]
fn a_collection_takes_the_generations_that_fit_the_batch() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let mut live = Vec::new();
    for g in 0..4 {
        let calls = sessions(&format!("g{g}-"), 3, 4, f64::from(g) * 1000.0);
        append_sealed(&store, &calls);
        store.compact(&CompactOptions::default().merge_fanout(None).collect_dead_fraction(None)).unwrap();
        store.delete_session(&format!("g{g}-0")).unwrap();
        live.extend(calls.into_iter().filter(|c| c.session_id != format!("g{g}-0")));
    }
    let no_merge = CompactOptions::default().merge_fanout(None);
    let r = store.compact(&no_merge.clone().batch_calls(Some(10))).unwrap();
    assert_eq!((r.collected_generations.len(), r.moved_calls, r.dropped_rows), (1, 8, 4), "{r:?}");
    let r = store.compact(&no_merge.clone().batch_calls(Some(5))).unwrap();
    assert_eq!((r.collected_generations.len(), r.moved_calls), (1, 8), "{r:?}");
    let r = store.compact(&no_merge.batch_calls(None)).unwrap();
    assert_eq!((r.collected_generations.len(), r.moved_calls), (2, 16), "{r:?}");
    assert_all(&store, &live);
}

/// Sessions sealed while a compaction publishes its steps wait for the
/// next compaction (it takes those chosen when it began): a steady flow of
/// them cannot keep one going.
#[test]
fn sessions_sealed_meanwhile_wait_for_the_next_compaction() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let first = sessions("s", 10, 4, 0.0);
    append_sealed(&store, &first);
    let mut late = Vec::new();
    let r = store
        .compact_with_meanwhile(&CompactOptions::default().batch_calls(Some(8)), &mut || {
            let more = sessions(&format!("late{}-", late.len()), 1, 4, 100_000.0 + late.len() as f64);
            append_sealed(&store, &more);
            late.push(more);
        })
        .unwrap();
    assert_eq!((r.sessions, r.calls, r.publications, r.sessions_left), (10, 40, 5, 0), "{r:?}");
    let snap = store.snapshot();
    assert!(first.iter().all(|c| snap.get(&c.trace_id).unwrap().unwrap().is_compacted()));
    let r = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!((r.sessions, r.sessions_left), (5, 0), "{r:?}");
    let all: Vec<Call> = first.into_iter().chain(late.into_iter().flatten()).collect();
    assert_all(&store, &all);
}
