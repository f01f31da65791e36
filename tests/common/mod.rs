//! Helpers shared by the integration tests.
#![allow(dead_code)]

use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use trajlog::{Call, CallView, CompactOptions, Store, Target};

/// Bits of a logprob column, so NaN payloads and -0.0 compare exactly.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Assert a stored call equals the appended one, field by field, bit for bit.
pub fn assert_same(view: &CallView<'_>, want: &Call) {
    let got = view.to_call().expect("read back");
    assert_eq!(got.trace_id, want.trace_id);
    assert_eq!(got.session_id, want.session_id);
    assert_eq!(got.session_uids, want.session_uids);
    assert_eq!(got.timestamp.to_bits(), want.timestamp.to_bits(), "timestamp of {}", want.trace_id);
    assert_eq!(got.model, want.model);
    assert_eq!(got.weight_version, want.weight_version);
    assert_eq!(got.prompt_token_ids, want.prompt_token_ids, "prompt of {}", want.trace_id);
    assert_eq!(got.completion_token_ids, want.completion_token_ids);
    assert_eq!(got.logprobs.as_deref().map(bits), want.logprobs.as_deref().map(bits), "logprobs of {}", want.trace_id);
    assert_eq!(got.routing_matrices, want.routing_matrices);
    assert_eq!(got.finish_reason, want.finish_reason);
    assert_eq!(got.latency_ms.map(f64::to_bits), want.latency_ms.map(f64::to_bits));
    assert_eq!(got.messages, want.messages);
    assert_eq!(got.response_message, want.response_message);
    assert_eq!(got.metadata, want.metadata);
    assert_eq!(got.extra, want.extra);
}

/// Any f32 bit pattern, with the special values made likely.
pub fn any_logprob() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => any::<u32>().prop_map(f32::from_bits),
        1 => Just(-0.0f32),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::INFINITY),
        1 => Just(f32::from_bits(0x7fc0_0001)),
        1 => Just(f32::from_bits(0xffa0_beef)),
        1 => Just(f32::MIN_POSITIVE / 2.0),
    ]
}

fn json_doc() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        "[a-z ]{0,20}".prop_map(|s| Some(format!(r#"[{{"role":"user","content":"{s}"}}]"#).into_bytes())),
        Just(Some(b"{\"k\": [1, 2.50, null, true]}".to_vec())),
    ]
}

/// A random valid call of `session` with a random prompt.
pub fn any_call(session: &'static str) -> impl Strategy<Value = Call> {
    (
        "[a-z0-9]{1,12}",
        prop::collection::vec(any::<u32>(), 0..200),
        prop::collection::vec(any::<u32>(), 0..100),
        any::<bool>(),
        prop::collection::vec(any_logprob(), 100),
        (any::<Option<i64>>(), any::<f64>().prop_filter("finite, not negative", |t| t.is_finite() && *t >= 0.0)),
        (json_doc(), json_doc(), json_doc()),
        (prop::option::of(prop::collection::vec(any::<u8>(), 0..64)), prop::collection::vec("[a-z]{1,4}", 0..3)),
        (prop::option::of("[a-zA-Z/0-9-]{0,20}"), prop::option::of("stop|length"), prop::option::of(0.0f64..1e6)),
    )
        .prop_map(
            move |(
                trace,
                prompt,
                completion,
                with_lp,
                lp,
                (wv, ts),
                (m, r, md),
                (routing, uids),
                (model, fin, lat),
            )| {
                let n = completion.len();
                Call {
                    trace_id: trace,
                    session_id: session.to_owned(),
                    session_uids: uids,
                    timestamp: ts,
                    model,
                    weight_version: wv,
                    prompt_token_ids: prompt,
                    completion_token_ids: completion,
                    logprobs: with_lp.then(|| lp[..n].to_vec()),
                    routing_matrices: routing,
                    finish_reason: fin,
                    latency_ms: lat,
                    messages: m,
                    response_message: r,
                    metadata: md,
                    extra: Some(br#"{"token_counts":{"prompt":3},"unknown":[1]}"#.to_vec()),
                }
            },
        )
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// `sessions` sessions of `steps` calls, each prompt extending the previous
/// context (prefix-delta chains), logprobs with special values.
pub fn chained_calls(sessions: usize, steps: usize) -> Vec<Call> {
    let mut out = Vec::new();
    for s in 0..sessions {
        let mut context: Vec<u32> = (0..200).map(|i| (s * 1000 + i) as u32).collect();
        for k in 0..steps {
            let completion: Vec<u32> = (0..300).map(|i| (s * 7 + k * 13 + i) as u32 + 50_000).collect();
            let mut lp: Vec<f32> = (0..300).map(|i| -(i as f32) / 7.0).collect();
            lp[0] = -0.0;
            lp[1] = f32::NEG_INFINITY;
            lp[2] = f32::from_bits(0x7fc0_0123);
            out.push(Call {
                trace_id: format!("t{s}-{k}"),
                session_id: format!("s{s}"),
                timestamp: (s * 100 + k) as f64,
                prompt_token_ids: context.clone(),
                completion_token_ids: completion.clone(),
                logprobs: Some(lp),
                messages: Some(format!(r#"[{{"role":"user","content":"turn {k}"}}]"#).into_bytes()),
                ..Default::default()
            });
            context.extend_from_slice(&completion);
            context.extend((0..300).map(|i| (900 + i) as u32));
        }
    }
    out
}

/// Every file under `dir` (recursively, but for the `LOCK` file) with its bytes.
pub fn files(dir: &std::path::Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("list") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n != "LOCK") {
                out.insert(p.clone(), std::fs::read(&p).expect("read"));
            }
        }
    }
    out
}

/// Options with small segments, so a few calls make several.
pub fn small_segments() -> trajlog::Options {
    trajlog::Options::default().segment_bytes(64 * 1024)
}

/// A store with sealed segments, shards (half the sessions compacted) and an
/// active segment; returns the calls appended.
pub fn build(dir: &Path) -> Vec<Call> {
    let all = chained_calls(12, 6);
    let store = Store::open(dir, small_segments()).expect("open");
    for c in &all {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    for s in 0..6 {
        store.seal_session(&format!("s{s}")).expect("seal");
        store.set_reward(Target::Session(format!("s{s}")), s as f64).expect("reward");
    }
    let report = store.compact(&CompactOptions::default()).expect("compact");
    assert_eq!(report.sessions, 6);
    store.close().expect("close");
    all
}

pub fn data_files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    files(dir)
        .into_iter()
        .filter(|(p, _)| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            n.ends_with(".tlog") || n.ends_with(".parquet")
        })
        .collect()
}

pub fn assert_all(store: &Store, all: &[Call]) {
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), all.len());
    for c in all {
        let v = snap.get(&c.trace_id).expect("read").expect("present");
        assert_same(&v, c);
    }
}

/// `steps` rows of each published shard generation (`part-GGGGGG-*`), from
/// the manifest.
pub fn generation_rows(dir: &std::path::Path) -> std::collections::BTreeMap<u64, u64> {
    let m = trajlog::format::manifest::decode_manifest(&std::fs::read(dir.join("MANIFEST")).unwrap()).unwrap();
    let mut rows = std::collections::BTreeMap::new();
    for s in m.shards.iter().filter(|s| s.path.starts_with("steps/")) {
        *rows.entry(trajlog::shard::generation_of(&s.path).unwrap()).or_default() += s.rows;
    }
    rows
}

/// How many generations each merge tier holds at `fanout`.
pub fn generations_per_tier(dir: &std::path::Path, fanout: u32) -> std::collections::BTreeMap<Option<u32>, usize> {
    let mut tiers = std::collections::BTreeMap::new();
    for rows in generation_rows(dir).values() {
        *tiers.entry(trajlog::merge_tier(*rows, fanout)).or_default() += 1;
    }
    tiers
}

/// Copy the directory tree `from` to `to`, every file included.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dst);
        } else {
            std::fs::copy(&p, &dst).unwrap();
        }
    }
}

/// The segment files of `dir`, in log order.
pub fn segment_paths(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tlog"))
        .collect();
    out.sort();
    out
}

/// The frames of segment file `path` from its header on, up to the end of
/// data: (offset, record kind, frame bytes).
pub fn segment_frames(path: &Path) -> Vec<(u64, u8, u64)> {
    let bytes = std::fs::read(path).unwrap();
    let (mut at, mut out) = (64usize, Vec::new());
    while at + 9 <= bytes.len() {
        let body_len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let len = trajlog::format::frame::frame_bytes(u64::from(body_len)) as usize;
        if body_len == 0 || at + len > bytes.len() {
            break;
        }
        out.push((at as u64, bytes[at + 8], len as u64));
        at += len;
    }
    out
}

/// Append `calls` to a new store in `dir`, seal every session and compact
/// them all with `opts` (every call compacted).
pub fn compact_sealed(dir: &Path, calls: &[Call], opts: &CompactOptions) -> Store {
    let store = Store::open(dir, trajlog::Options::default()).unwrap();
    for c in calls {
        store.append(c.clone()).unwrap();
    }
    let sessions: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
    for s in &sessions {
        store.seal_session(s).unwrap();
    }
    let report = store.compact(opts).unwrap();
    assert_eq!(report.calls as usize, calls.len());
    store
}
