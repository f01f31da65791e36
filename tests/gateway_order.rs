//! `trace_json::export_call_gateway_order` (what `trajlog serve` returns for
//! a trace) equals the export parsed again and reordered the way the gateway
//! did before it wrote the order in one pass: rLLM's keys first, in their
//! order, then the others sorted by name. The same keys in the same order
//! with the same values; the bytes differ only where a stored document has
//! JSON whitespace around it (the reparse dropped it), which gateway traces
//! never have (`gateway_shaped_traces_...` compares their bytes).

mod common;

use common::*;
use proptest::prelude::*;
use std::collections::BTreeMap;
use trajlog::trace_json::{export_call, export_call_gateway_order, json_string, KEY_ORDER, TRACE_KEYS};
use trajlog::Call;
use trajlog_sim::{simulate, Shape, SimConfig};

/// The gateway's former `trace_json`: parse the export, reorder.
fn reordered(call: &Call) -> String {
    let exported = export_call(call);
    let map: BTreeMap<String, &serde_json::value::RawValue> =
        serde_json::from_str(&exported).expect("an export parses");
    let mut parts = Vec::new();
    for k in TRACE_KEYS {
        if let Some(v) = map.get(k) {
            parts.push(format!("{}:{}", json_string(k), v.get()));
        }
    }
    for (k, v) in &map {
        if !TRACE_KEYS.contains(&k.as_str()) {
            parts.push(format!("{}:{}", json_string(k), v.get()));
        }
    }
    format!("{{{}}}", parts.join(","))
}

/// The top-level keys of a JSON object, in order, with their values.
fn pairs(text: &str) -> Vec<(String, serde_json::Value)> {
    use serde::de::{Deserializer, MapAccess, Visitor};
    struct Pairs;
    impl<'de> Visitor<'de> for Pairs {
        type Value = Vec<(String, serde_json::Value)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(pair) = map.next_entry()? {
                out.push(pair);
            }
            Ok(out)
        }
    }
    serde_json::Deserializer::from_str(text).deserialize_map(Pairs).expect("an object")
}

/// `extra` with keys the columns also have (some `null`, which an export
/// keeps), keys of its own, and a stored key order that the gateway order
/// must ignore.
fn any_extra() -> impl Strategy<Value = Option<Vec<u8>>> {
    let key = prop::sample::select(vec![
        "raw_request",
        "raw_response",
        "token_counts",
        "timestamp",
        "prompt_token_ids",
        "logprobs",
        "zeta",
        "Alpha",
        "é",
        "a\"b",
    ]);
    let value = prop::sample::select(vec!["null", "1", "[1,2]", "{\"x\":{\"y\":[]}}", "\"s\"", "-0.5"]);
    (prop::collection::btree_map(key, value, 0..7), any::<bool>(), any::<bool>()).prop_map(|(kv, order, none)| {
        if none {
            return None;
        }
        let mut parts: Vec<String> = kv.iter().map(|(k, v)| format!("{}:{v}", json_string(k))).collect();
        if order {
            let mut keys: Vec<&str> = kv.keys().copied().collect();
            keys.reverse();
            keys.push("trace_id");
            let list: Vec<String> = keys.iter().map(|k| json_string(k)).collect();
            parts.push(format!("{}:[{}]", json_string(KEY_ORDER), list.join(",")));
        }
        Some(format!("{{{}}}", parts.join(",")).into_bytes())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn gateway_order_in_one_pass_is_the_reordered_export(mut call in any_call("s"), extra in any_extra()) {
        call.extra = extra;
        // JSON has no NaN or infinity: an export of such a logprob (as
        // Python's json.dumps writes it) does not parse; see the next test.
        if let Some(lp) = call.logprobs.as_mut() {
            lp.iter_mut().filter(|v| !v.is_finite()).for_each(|v| *v = -1.0);
        }
        prop_assert_eq!(pairs(&export_call_gateway_order(&call)), pairs(&reordered(&call)));
    }
}

#[test]
fn a_non_finite_logprob_is_written_in_the_gateway_order_too() {
    // The gateway used to give such a trace back in its stored order (the
    // reparse failed); now the order is the gateway's whatever the values.
    let call = Call {
        trace_id: "t".into(),
        session_id: "s".into(),
        completion_token_ids: vec![1, 2],
        logprobs: Some(vec![f32::NAN, -0.5]),
        extra: Some(
            format!("{{\"zeta\":1,{}:[\"zeta\",\"logprobs\",\"trace_id\"]}}", json_string(KEY_ORDER)).into_bytes(),
        ),
        ..Call::default()
    };
    let out = export_call_gateway_order(&call);
    assert!(out.starts_with("{\"trace_id\":\"t\",\"session_id\":\"s\","), "{out}");
    assert!(out.contains("\"logprobs\":[NaN,-0.5]"), "{out}");
    assert!(out.ends_with(",\"zeta\":1}"), "{out}");
    assert!(export_call(&call).starts_with("{\"zeta\":1,"), "the plain export keeps the stored order");
}

#[test]
fn gateway_shaped_traces_come_out_in_the_gateway_order() {
    for shape in [Shape::Gateway, Shape::GatewayStreaming, Shape::Lean] {
        let cfg = SimConfig { sessions: 2, steps: 3, seed: 7, shape, ..SimConfig::default() };
        for call in simulate(&cfg).into_iter().flat_map(|s| s.calls) {
            assert_eq!(export_call_gateway_order(&call), reordered(&call), "{}", call.trace_id);
        }
    }
}

#[test]
fn whitespace_around_a_stored_document_is_kept_where_the_reparse_dropped_it() {
    // Found by the property test: routing bytes that happen to be JSON with
    // a trailing tab. The value and the order are the same either way.
    let call = Call {
        trace_id: "a".into(),
        session_id: "s".into(),
        routing_matrices: Some(b"1\t".to_vec()),
        ..Call::default()
    };
    let out = export_call_gateway_order(&call);
    assert!(out.contains("\"routing_matrices\":1\t,"), "{out}");
    assert_eq!(pairs(&out), pairs(&reordered(&call)));
}
