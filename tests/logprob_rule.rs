//! One logprob rule for every way a trace comes in (a `trajlog ingest` line,
//! an rLLM import or a gateway capture; the Python dict walker applies the
//! same rule, tested in python/tests): the column holds each value's nearest
//! `f32`, and a list whose values are not all exactly `f32`s is also kept
//! verbatim, so that the trace exports as it came.

use proptest::prelude::*;
use serde_json::value::RawValue;
use trajlog::trace_json::{export_call, gateway_members_exact, parse_gateway_exact, parse_trace};
use trajlog::Call;

/// A trace whose completion has as many ids as `logprobs` has values.
fn trace(logprobs: &str) -> String {
    let n = serde_json::from_str::<Vec<Box<RawValue>>>(logprobs).map_or(1, |v| v.len());
    let ids: Vec<String> = (0..n).map(|i| (i + 3).to_string()).collect();
    format!(
        r#"{{"trace_id":"t","session_id":"s","timestamp":1.5,"prompt_token_ids":[1,2],"completion_token_ids":[{}],"logprobs":{logprobs}}}"#,
        ids.join(",")
    )
}

/// The three parsers of a JSON trace, which must agree.
fn parsed(text: &str) -> [Call; 3] {
    let members: Vec<(String, Box<RawValue>)> = {
        let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text).expect("object");
        map.keys()
            .map(|k| {
                let v: std::collections::BTreeMap<String, Box<RawValue>> = serde_json::from_str(text).expect("raw");
                (k.clone(), v[k].clone())
            })
            .collect()
    };
    let by_members = gateway_members_exact(members.iter().map(|(k, v)| (k.as_str(), v.as_ref())), 0.0)
        .expect("members")
        .into_inner();
    [parse_trace(text, 0.0).expect("parse_trace"), parse_gateway_exact(text, 0.0).expect("exact"), by_members]
}

fn nearest(text: &str) -> Vec<u32> {
    let items: Vec<Box<RawValue>> = serde_json::from_str(text).expect("list");
    items.iter().map(|v| v.get().parse::<f32>().expect("number").to_bits()).collect()
}

#[test]
fn exact_f32_values_fill_the_column_alone_and_export_as_python_writes_them() {
    // vLLM's logprobs: float32 values that Python prints as its f64 repr.
    let lps = "[-0.30000001192092896,-2.099999983329326e-05,0.0,-1.5]";
    for call in parsed(&trace(lps)) {
        assert_eq!(call.logprobs.as_deref().map(|l| l.iter().map(|v| v.to_bits()).collect()), Some(nearest(lps)));
        let extra: serde_json::Map<String, serde_json::Value> =
            call.extra.as_deref().map_or_else(Default::default, |e| serde_json::from_slice(e).expect("extra"));
        assert!(!extra.contains_key("logprobs"), "no verbatim copy: {extra:?}");
        let out = export_call(&call);
        assert!(out.contains(&format!(r#""logprobs":{lps}"#)), "the same text back: {out}");
    }
}

#[test]
fn other_values_fill_the_column_with_their_nearest_f32_and_come_back_verbatim() {
    for lps in ["[-0.1,-0.5]", "[-1,-0.5]", "[-0.123456789012345,-3e-45]", "[1e-50]"] {
        let text = trace(lps);
        for call in parsed(&text) {
            let column: Vec<u32> = call.logprobs.as_deref().expect("a column").iter().map(|v| v.to_bits()).collect();
            assert_eq!(column, nearest(lps), "{lps}");
            let out = export_call(&call);
            assert!(out.contains(&format!(r#""logprobs":{lps}"#)), "{lps}: {out}");
            // Reading the export again gives the same call.
            assert_eq!(parse_trace(&out, 0.0).expect("again"), call, "{lps}");
        }
    }
}

#[test]
fn values_that_are_no_f32_are_refused_by_every_parser() {
    for lps in ["[1e39]", "[\"x\"]", "[null]", "{}"] {
        let text = trace(lps);
        assert!(parse_trace(&text, 0.0).is_err(), "{lps}");
        assert!(parse_gateway_exact(&text, 0.0).is_err(), "{lps}");
    }
}

proptest! {
    /// Any finite f64 list: column bits = nearest f32 of the decimal text,
    /// and the export gives the same text back.
    #[test]
    fn random_logprobs_round_trip(values in prop::collection::vec(prop_oneof![
        any::<f32>().prop_filter("finite", |v| v.is_finite()).prop_map(f64::from),
        (-100.0f64..0.0),
    ], 0..20)) {
        let lps = serde_json::to_string(&values).expect("json");
        let text = trace(&lps);
        for call in parsed(&text) {
            let column: Vec<u32> = call.logprobs.as_deref().expect("a column").iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(&column, &nearest(&lps));
            let out: serde_json::Value = serde_json::from_str(&export_call(&call)).expect("json");
            let back: Vec<u64> = out["logprobs"].as_array().expect("list").iter().map(|v| v.as_f64().expect("f64").to_bits()).collect();
            prop_assert_eq!(back, values.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }
}
