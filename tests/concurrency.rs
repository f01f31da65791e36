//! Readers beside the writer, zero-copy proofs, the writer lock, back-pressure,
//! and poisoning after a real write failure.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use trajlog::{Call, Durability, ErrorKind, Options, Store, Target};
use trajlog_sim::Rng;

/// Call `step` of session `s`: deterministic, so a reader can rebuild what it
/// should see from the trace id alone.
fn call(s: usize, step: usize) -> Call {
    let mut rng = Rng::new((s * 1000) as u64);
    let mut prompt = rng.tokens(50);
    let mut completion = Vec::new();
    for i in 0..=step {
        if i > 0 {
            prompt.extend_from_slice(&completion);
            prompt.extend(rng.tokens(5));
        }
        completion = rng.tokens(200);
    }
    Call {
        trace_id: format!("s{s}/{step}"),
        session_id: format!("s{s}"),
        timestamp: step as f64,
        logprobs: Some(completion.iter().map(|&t| -(t as f32) / 1e5).collect()),
        prompt_token_ids: prompt,
        completion_token_ids: completion,
        ..Default::default()
    }
}

#[test]
fn reader_thread_reads_exactly_while_the_writer_appends_seals_and_rolls() {
    let dir = tempdir();
    let opts = Options::default().durability(Durability::Group).segment_bytes(64 * 1024);
    let store = Arc::new(Store::open(dir.path(), opts).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let (sessions, steps) = (6, 60);
    let reader = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut reads = 0usize;
            let mut last_count = 0;
            let mut held = None;
            // Until the writer is done, and at least once after a snapshot was
            // held: a reader starved by the scheduler may first look when the
            // appender has finished (the held snapshot is then a late one; the
            // appending thread holds an early one of its own, below).
            while !done.load(Ordering::Acquire) || held.is_none() {
                let snap = store.snapshot();
                assert!(snap.call_count() >= last_count, "a snapshot went back in time");
                last_count = snap.call_count();
                for s in 0..sessions {
                    let calls = snap.session(&format!("s{s}"), None, None).unwrap();
                    for (step, v) in calls.iter().enumerate() {
                        // Each session is seen as a prefix of its calls, each exact.
                        assert_same(v, &call(s, step));
                    }
                    reads += calls.len();
                }
                if held.is_none() && snap.call_count() > 50 {
                    held = Some(snap); // keep an early snapshot across later rolls
                }
            }
            let held = held.expect("held a snapshot");
            held.for_each_call(|v| {
                let (s, step) = v.trace_id()[1..].split_once('/').unwrap();
                assert_same(v, &call(s.parse().unwrap(), step.parse().unwrap()));
                Ok(())
            })
            .unwrap();
            reads
        })
    };
    // An early snapshot taken at a known point, read after every later roll.
    let mut early = None;
    for step in 0..steps {
        for s in 0..sessions {
            store.append(call(s, step)).unwrap();
        }
        if step % 7 == 0 {
            store.flush().unwrap();
            if early.is_none() && step > 0 {
                early = Some(store.snapshot());
            }
        }
    }
    for s in 0..sessions {
        store.seal_session(&format!("s{s}")).unwrap();
    }
    store.flush().unwrap();
    done.store(true, Ordering::Release);
    let reads = reader.join().unwrap();
    assert!(reads > 0);
    let snap = store.snapshot();
    assert!(snap.segments().len() > 3, "the test must cross several rolls");
    assert_eq!(snap.call_count(), sessions * steps);
    let early = early.expect("an early snapshot");
    assert_eq!(early.call_count(), 8 * sessions, "the early snapshot holds what was flushed at step 7");
    assert!(early.segments().len() + 2 < snap.segments().len(), "segments rolled after the early snapshot");
    early
        .for_each_call(|v| {
            let (s, step) = v.trace_id()[1..].split_once('/').unwrap();
            assert_same(v, &call(s.parse().unwrap(), step.parse().unwrap()));
            Ok(())
        })
        .unwrap();
}

fn inside(range: &std::ops::Range<usize>, s: &[u32]) -> bool {
    let (start, end) = (s.as_ptr() as usize, s.as_ptr() as usize + std::mem::size_of_val(s));
    range.start <= start && end <= range.end
}

#[test]
fn slices_point_into_the_mapped_segments_active_and_sealed() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    store.append(call(0, 0)).unwrap();
    store.append(call(0, 1)).unwrap();
    store.flush().unwrap();
    let snap = store.snapshot();
    let active = snap.segments().last().unwrap().clone();
    assert!(!active.sealed);
    for id in ["s0/0", "s0/1"] {
        let v = snap.get(id).unwrap().unwrap();
        assert!(inside(&active.mapped, v.completion_token_ids()), "completion of {id} is not in the active mapping");
        assert!(inside(&active.mapped, v.prompt_suffix()), "prompt suffix of {id} is not in the active mapping");
        let lp = v.logprobs().unwrap();
        let (a, b) = (lp.as_ptr() as usize, lp.as_ptr() as usize + std::mem::size_of_val(lp));
        assert!(active.mapped.start <= a && b <= active.mapped.end);
    }
    // The second call stores only its new tokens; the prompt is materialized from both.
    let second = snap.get("s0/1").unwrap().unwrap();
    assert!(second.prompt_suffix().len() < second.prompt_len());
    assert_eq!(second.prompt().unwrap(), call(0, 1).prompt_token_ids);
    store.roll().unwrap();
    let snap2 = store.snapshot();
    let sealed = snap2.segments().into_iter().find(|s| s.sealed).unwrap();
    let v = snap2.get("s0/0").unwrap().unwrap();
    assert!(inside(&sealed.mapped, v.completion_token_ids()), "completion is not in the sealed mapping");
    // The old snapshot's views stay valid after the roll.
    assert_same(&snap.get("s0/1").unwrap().unwrap(), &call(0, 1));
}

#[test]
fn a_second_writer_is_refused_and_readers_are_not() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    store.append_durable(call(1, 0)).unwrap();
    let err = Store::open(dir.path(), Options::default()).err().expect("second writer");
    assert_eq!(err.kind(), &ErrorKind::Locked);
    assert!(err.to_string().contains("read-only"), "{err}");
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().call_count(), 1);
    assert_eq!(ro.append(call(1, 1)).err().unwrap().kind(), &ErrorKind::Closed);
    store.append_durable(call(1, 1)).unwrap();
    ro.refresh().unwrap();
    assert_eq!(ro.snapshot().call_count(), 2);
    drop(store);
    Store::open(dir.path(), Options::default()).expect("lock released on close");
}

#[test]
fn a_full_queue_makes_appenders_wait_and_nothing_is_dropped() {
    let dir = tempdir();
    let opts = Options::default().queue_depth(1).durability(Durability::Buffered);
    let store = Arc::new(Store::open(dir.path(), opts).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                for step in 0..250 {
                    store.append(call(t, step)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), 8 * 250);
    for t in 0..8 {
        assert_eq!(snap.session(&format!("s{t}"), None, None).unwrap().len(), 250);
    }
}

#[test]
fn deleting_a_session_removes_its_calls_from_nested_sessions_too() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let mut a = call(0, 0);
    a.session_uids = vec!["outer".into()];
    let mut b = call(1, 0);
    b.session_uids = vec!["outer".into()];
    store.append(a).unwrap();
    store.append(b).unwrap();
    store.set_reward(Target::Session("outer".into()), 1.0).unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.session("outer", None, None).unwrap().len(), 2);
    assert_eq!(snap.session_reward("outer"), Some(1.0));
    assert_eq!(store.delete_session("s0").unwrap(), 1);
    let snap = store.snapshot();
    let outer: Vec<String> =
        snap.session("outer", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(outer, ["s1/0"]);
    assert!(snap.get("s0/0").unwrap().is_none());
    assert_eq!(store.delete_session("nope").unwrap(), 0);
}
