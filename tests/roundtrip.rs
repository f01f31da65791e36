//! Bit-exact round trip of every field through the store: live, after a roll
//! (sealed segment), and after reopening (recovery path and footer path).

mod common;

use common::*;
use proptest::prelude::*;
use trajlog::limits::{COMPLETION_TOKENS_MAX, PROMPT_TOKENS_MAX};
use trajlog::{Call, Durability, Options, Store};

fn opts() -> Options {
    Options::default().durability(Durability::Buffered).segment_bytes(64 * 1024)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_field_round_trips_bit_exact(calls in prop::collection::vec(any_call("s"), 1..12), roll_at in 0usize..12) {
        let dir = tempdir();
        // Unique trace ids: replacement is covered by the model test.
        let calls: Vec<Call> = calls.into_iter().enumerate().map(|(i, mut c)| { c.trace_id = format!("{i}-{}", c.trace_id); c }).collect();
        {
            let store = Store::open(dir.path(), opts()).unwrap();
            for (i, c) in calls.iter().enumerate() {
                if i == roll_at {
                    store.roll().unwrap();
                }
                store.append(c.clone()).unwrap();
            }
            store.flush().unwrap();
            let snap = store.snapshot();
            for c in &calls {
                assert_same(&snap.get(&c.trace_id).unwrap().expect("present"), c);
            }
            store.close().unwrap();
        }
        for reopen_writable in [false, true] {
            let store = if reopen_writable { Store::open(dir.path(), opts()).unwrap() } else { Store::open_read_only(dir.path()).unwrap() };
            let snap = store.snapshot();
            prop_assert_eq!(snap.call_count(), calls.len());
            for c in &calls {
                assert_same(&snap.get(&c.trace_id).unwrap().expect("present after reopen"), c);
            }
        }
    }
}

#[test]
fn special_logprobs_and_empty_arrays_round_trip() {
    let dir = tempdir();
    let specials = vec![
        -0.0f32,
        0.0,
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::from_bits(0x7fc0_0001), // quiet NaN with payload
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::from_bits(0xffff_ffff),
        f32::MIN_POSITIVE / 4.0, // subnormal
        f32::MIN,
    ];
    let calls = vec![
        Call {
            trace_id: "special".into(),
            session_id: "s".into(),
            prompt_token_ids: vec![0, u32::MAX],
            completion_token_ids: (0..specials.len() as u32).collect(),
            logprobs: Some(specials.clone()),
            ..Default::default()
        },
        Call { trace_id: "empty".into(), session_id: "s".into(), timestamp: 1.0, ..Default::default() },
        Call {
            trace_id: "empty-lp".into(),
            session_id: "s".into(),
            timestamp: 2.0,
            logprobs: Some(vec![]),
            ..Default::default()
        },
    ];
    let store = Store::open(dir.path(), opts()).unwrap();
    for c in &calls {
        store.append_durable(c.clone()).unwrap();
    }
    let snap = store.snapshot();
    for c in &calls {
        assert_same(&snap.get(&c.trace_id).unwrap().unwrap(), c);
    }
    drop(snap);
    store.close().unwrap();
    let snap = Store::open_read_only(dir.path()).unwrap().snapshot();
    let got = snap.get("special").unwrap().unwrap();
    assert_eq!(bits(got.logprobs().unwrap()), bits(&specials));
    assert!(snap.get("empty").unwrap().unwrap().logprobs().is_none());
    assert_eq!(snap.get("empty-lp").unwrap().unwrap().logprobs(), Some(&[][..]));
}

#[test]
fn maximal_arrays_round_trip_and_one_more_is_refused() {
    let dir = tempdir();
    let store = Store::open(dir.path(), opts()).unwrap();
    let max = Call {
        trace_id: "max".into(),
        session_id: "s".into(),
        prompt_token_ids: (0..PROMPT_TOKENS_MAX as u32).collect(),
        completion_token_ids: (0..COMPLETION_TOKENS_MAX as u32).rev().collect(),
        logprobs: Some((0..COMPLETION_TOKENS_MAX).map(|i| -(i as f32) / 7.0).collect()),
        ..Default::default()
    };
    store.append_durable(max.clone()).unwrap();
    let mut over = max.clone();
    over.trace_id = "over".into();
    over.prompt_token_ids.push(1);
    let err = store.append(over).expect_err("over the limit");
    assert!(err.to_string().contains("PROMPT_TOKENS_MAX"), "{err}");
    store.close().unwrap();
    let snap = Store::open_read_only(dir.path()).unwrap().snapshot();
    assert_eq!(snap.call_count(), 1);
    assert_same(&snap.get("max").unwrap().unwrap(), &max);
}
