//! Bad input: every violation is an error that names the field (and the limit),
//! and nothing of the record is written.

mod common;

use common::*;
use trajlog::limits::*;
use trajlog::trace_json::parse_trace;
use trajlog::{Annotation, Call, ErrorKind, Options, Store, Target};

fn good() -> Call {
    Call {
        trace_id: "t".into(),
        session_id: "s".into(),
        timestamp: 1.0,
        prompt_token_ids: vec![1, 2],
        completion_token_ids: vec![3],
        logprobs: Some(vec![-0.5]),
        ..Default::default()
    }
}

/// A change that makes a good call bad.
type Mutation = Box<dyn Fn(&mut Call)>;

fn expect_invalid(store: &Store, call: Call, field: &str) {
    let err = store.append(call).err().unwrap_or_else(|| panic!("{field}: accepted"));
    match err.kind() {
        ErrorKind::InvalidInput { field: f } => assert!(f.contains(field), "{field} vs {f}: {err}"),
        ErrorKind::LimitExceeded { limit, .. } => assert!(err.to_string().contains(field), "{field} / {limit}: {err}"),
        other => panic!("{field}: unexpected kind {other:?}: {err}"),
    }
}

#[test]
fn each_violation_names_its_field_and_writes_nothing() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let cases: Vec<(&str, Mutation)> = vec![
        ("trace_id", Box::new(|c| c.trace_id.clear())),
        ("trace_id", Box::new(|c| c.trace_id = "x".repeat(ID_BYTES_MAX as usize + 1))),
        ("session_id", Box::new(|c| c.session_id.clear())),
        ("session_id", Box::new(|c| c.session_id = "x".repeat(ID_BYTES_MAX as usize + 1))),
        ("session_uids[1]", Box::new(|c| c.session_uids = vec!["a".into(), String::new()])),
        ("session_uids count", Box::new(|c| c.session_uids = (0..=SESSION_UIDS_MAX).map(|i| i.to_string()).collect())),
        ("timestamp", Box::new(|c| c.timestamp = f64::NAN)),
        ("timestamp", Box::new(|c| c.timestamp = f64::INFINITY)),
        ("timestamp", Box::new(|c| c.timestamp = -1.0)),
        ("timestamp", Box::new(|c| c.timestamp = -f64::MIN_POSITIVE)),
        ("timestamp", Box::new(|c| c.timestamp = f64::NEG_INFINITY)),
        ("latency_ms", Box::new(|c| c.latency_ms = Some(f64::NAN))),
        ("latency_ms", Box::new(|c| c.latency_ms = Some(-1.0))),
        ("logprobs", Box::new(|c| c.logprobs = Some(vec![-1.0, -2.0]))),
        ("logprobs", Box::new(|c| c.logprobs = Some(vec![]))),
        ("model", Box::new(|c| c.model = Some("m".repeat(SHORT_STRING_BYTES_MAX as usize + 1)))),
        ("finish_reason", Box::new(|c| c.finish_reason = Some("f".repeat(SHORT_STRING_BYTES_MAX as usize + 1)))),
        ("completion_token_ids", Box::new(|c| c.completion_token_ids = vec![0; COMPLETION_TOKENS_MAX as usize + 1])),
        ("messages", Box::new(|c| c.messages = Some(b"[{\"role\":".to_vec()))),
        ("response_message", Box::new(|c| c.response_message = Some(b"not json".to_vec()))),
        ("metadata", Box::new(|c| c.metadata = Some(vec![0xff, 0xfe]))),
        ("extra", Box::new(|c| c.extra = Some(b"[1,2]".to_vec()))),
        ("routing_matrices", Box::new(|c| c.routing_matrices = Some(vec![0; ROUTING_BYTES_MAX as usize + 1]))),
        (
            "JSON bytes",
            Box::new(|c| {
                let doc = format!("\"{}\"", "x".repeat(JSON_BYTES_PER_CALL_MAX as usize / 2));
                c.messages = Some(doc.clone().into_bytes());
                c.metadata = Some(doc.into_bytes());
            }),
        ),
    ];
    for (field, mutate) in &cases {
        let mut c = good();
        mutate(&mut c);
        expect_invalid(&store, c, field);
    }
    let err = store.set_reward(Target::Trace("t".into()), f64::NAN).err().unwrap();
    assert!(err.to_string().contains("reward"), "{err}");
    assert!(Annotation::Seal { session_id: String::new() }.validate().is_err());
    store.flush().unwrap();
    assert_eq!(store.snapshot().call_count(), 0);
    store.close().unwrap();
    // Nothing reached the disk either: only the segment header.
    let seg = std::fs::metadata(dir.path().join("seg-0000000001.tlog")).unwrap();
    assert_eq!(seg.len(), 64);
}

#[test]
fn sealed_sessions_refuse_appends_until_deleted() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    store.append(good()).unwrap();
    store.seal_session("s").unwrap();
    let err = store.append(Call { trace_id: "t2".into(), ..good() }).err().unwrap();
    assert!(err.to_string().contains("sealed"), "{err}");
    store.close().unwrap();
    // The seal survives a reopen.
    let store = Store::open(dir.path(), Options::default()).unwrap();
    assert!(store.append(Call { trace_id: "t2".into(), ..good() }).is_err());
    assert_eq!(store.delete_session("s").unwrap(), 1);
    store.append_durable(Call { trace_id: "t3".into(), ..good() }).unwrap();
    assert_eq!(store.snapshot().call_count(), 1);
}

#[test]
fn json_traces_with_bad_fields_are_refused_with_the_field_named() {
    let cases = [
        (r#"{"session_id":"s","prompt_token_ids":[1]}"#, "trace_id"),
        (r#"{"trace_id":"t","prompt_token_ids":[1]}"#, "session_id"),
        (r#"{"trace_id":"t","session_id":"s","prompt_token_ids":[1,-2]}"#, "prompt_token_ids[1]"),
        (r#"{"trace_id":"t","session_id":"s","prompt_token_ids":[4294967296]}"#, "prompt_token_ids[0]"),
        (r#"{"trace_id":"t","session_id":"s","prompt_token_ids":[1.5]}"#, "prompt_token_ids[0]"),
        (r#"{"trace_id":"t","session_id":"s","completion_token_ids":[1],"logprobs":[null]}"#, "logprobs[0]"),
        (r#"{"trace_id":"t","session_id":"s","completion_token_ids":[1],"logprobs":["x"]}"#, "logprobs[0]"),
        (r#"{"trace_id":"t","session_id":"s","completion_token_ids":[1],"logprobs":[1e39]}"#, "logprobs[0]"),
        (r#"{"trace_id":"t","session_id":"s","completion_token_ids":[1,2],"logprobs":[-1]}"#, "logprobs"),
        (r#"{"trace_id":"t","session_id":"s","timestamp":"now"}"#, "timestamp"),
        (r#"{"trace_id":"t","session_id":"s","timestamp":-1.5}"#, "timestamp"),
        (r#"{"id":"k","session_name":"s","input":{},"start_time":-3}"#, "timestamp"),
        (r#"{"trace_id":7,"session_id":"s"}"#, "trace_id"),
        (r#"[1,2]"#, "trace"),
        (r#"{"trace_id":"t","#, "trace"),
    ];
    for (line, field) in cases {
        let err = parse_trace(line, 0.0).err().unwrap_or_else(|| panic!("accepted {line}"));
        assert!(err.to_string().contains(field), "{line}: {err}");
    }
}

#[test]
fn gateway_and_sdk_shapes_parse() {
    let gw = r#"{"trace_id":"g1","session_id":"task:0","timestamp":5.5,"model":"m","prompt_token_ids":[1,2],
        "completion_token_ids":[3],"logprobs":[-0.25],"messages":[{"role":"user","content":"hi"}],
        "response_message":{"role":"assistant","content":"yo"},"finish_reason":"stop","latency_ms":12.0,
        "token_counts":{"prompt":2,"completion":1},"weight_version":null,"custom":{"a":[1,2]}}"#;
    let c = parse_trace(gw, 0.0).unwrap();
    assert_eq!((c.prompt_token_ids.as_slice(), c.completion_token_ids.as_slice()), (&[1, 2][..], &[3][..]));
    assert_eq!(c.weight_version, None);
    let mut extra: serde_json::Value = serde_json::from_slice(c.extra.as_ref().unwrap()).unwrap();
    // Not the gateway's key order: the trace's own is kept beside the values.
    let order = extra.as_object_mut().unwrap().remove(trajlog::trace_json::KEY_ORDER).unwrap();
    assert_eq!(order[0], "trace_id");
    assert_eq!(order[2], "timestamp");
    assert_eq!(
        extra,
        serde_json::json!({"token_counts":{"prompt":2,"completion":1},"weight_version":null,"custom":{"a":[1,2]}})
    );
    let line = trajlog::trace_json::export_call(&c);
    assert!(line.starts_with(r#"{"trace_id":"g1","session_id":"task:0","timestamp":5.5,"model":"m","#), "{line}");
    assert!(line.ends_with(r#""weight_version":null,"custom":{"a":[1,2]}}"#), "{line}");
    let sdk = r#"{"id":"k1","session_name":"task:1","session_uids":["outer","inner"],"model":"m",
        "input":{"messages":[{"role":"user","content":"q"}],"prompt_token_ids":[9,8]},
        "output":{"output_token_ids":[7],"rollout_logprobs":[-1.5],"message":{"role":"assistant"},"finish_reason":"length","usage":{"x":1}},
        "start_time":3.0}"#;
    let c = parse_trace(sdk, 0.0).unwrap();
    assert_eq!(c.trace_id, "k1");
    assert_eq!(c.session_id, "task:1");
    assert_eq!(c.session_uids, ["outer", "inner"]);
    assert_eq!(c.prompt_token_ids, [9, 8]);
    assert_eq!(c.completion_token_ids, [7]);
    assert_eq!(c.logprobs, Some(vec![-1.5]));
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    assert_eq!(c.timestamp, 3.0);
    let extra: serde_json::Value = serde_json::from_slice(c.extra.as_ref().unwrap()).unwrap();
    assert_eq!(extra, serde_json::json!({"output":{"usage":{"x":1}}}));
}

#[test]
fn timestamps_must_be_finite_and_not_negative() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    for ts in [-1.0, -1e-300, -f64::MAX, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = store.append(Call { timestamp: ts, ..good() }).err().unwrap_or_else(|| panic!("{ts}: accepted"));
        assert!(matches!(err.kind(), ErrorKind::InvalidInput { field } if field == "timestamp"), "{ts}: {err}");
        assert!(err.to_string().contains("non-negative"), "{err}");
    }
    // Zero (either sign), the smallest positive and large values are kept, bit for bit.
    for (i, ts) in [0.0, -0.0, f64::MIN_POSITIVE, 5e-324, 1.795356919117e9, 1e300].into_iter().enumerate() {
        let trace_id = format!("t{i}");
        store.append_durable(Call { trace_id: trace_id.clone(), timestamp: ts, ..good() }).unwrap();
        let snap = store.snapshot();
        let got = snap.get(&trace_id).unwrap().expect("stored").timestamp();
        assert_eq!(got.to_bits(), ts.to_bits(), "{ts}");
    }
}
