//! The simulator's promises: gateway-shaped traces repeat the call's columns
//! exactly, their chat history grows as the prompt does, every shape has the
//! same tokens, and a trace survives trajlog's export and parse unchanged.

use crate::pyjson::py_float;
use crate::{gateway_json, simulate, Shape, SimConfig, SimSession, TRACE_KEYS};
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;
use trajlog::trace_json::{export_call, object_keys, parse_trace};
use trajlog::Call;

/// The keys of a JSON object in the order written.
fn keys(text: &str) -> Vec<String> {
    object_keys(text).expect("a JSON object")
}

fn text(doc: &Option<Vec<u8>>) -> &str {
    std::str::from_utf8(doc.as_deref().expect("document present")).expect("UTF-8")
}

/// The elements of a JSON array, as their text.
fn elements(array: &str) -> Vec<String> {
    let items: Vec<&RawValue> = serde_json::from_str(array).expect("a JSON array");
    items.iter().map(|v| v.get().to_owned()).collect()
}

/// The keys of `extra`, each value as its text.
fn extra(call: &Call) -> BTreeMap<String, String> {
    let map: BTreeMap<String, &RawValue> = serde_json::from_str(text(&call.extra)).expect("extra is an object");
    map.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect()
}

fn value(text: &str) -> Value {
    serde_json::from_str(text).expect("JSON")
}

/// Small and default-sized batches, with breaks, empty completions and tool
/// results among them.
fn configs(shape: Shape) -> Vec<SimConfig> {
    vec![
        SimConfig { shape, sessions: 10, steps: 6, ..SimConfig::default() },
        SimConfig {
            shape,
            sessions: 12,
            steps: 5,
            system_tokens: 40,
            completion_tokens: (0, 30),
            tool_tokens: (0, 10),
            break_every: 2,
            seed: 7,
            ..SimConfig::default()
        },
    ]
}

fn all_calls(batch: &[SimSession]) -> impl Iterator<Item = &Call> {
    batch.iter().flat_map(|s| &s.calls)
}

#[test]
fn shapes_have_names() {
    for shape in Shape::ALL {
        assert_eq!(shape.name().parse::<Shape>(), Ok(shape));
        assert_eq!(shape.to_string(), shape.name());
    }
    assert_eq!(Shape::default(), Shape::Gateway);
    assert!("grpc".parse::<Shape>().unwrap_err().contains("gateway, gateway-streaming or lean"));
}

#[test]
fn every_shape_has_the_same_tokens_and_breaks() {
    for (i, lean) in configs(Shape::Lean).into_iter().enumerate() {
        let want = simulate(&lean);
        for shape in [Shape::Gateway, Shape::GatewayStreaming] {
            let got = simulate(&configs(shape).swap_remove(i));
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!((&g.session_id, g.injected_break), (&w.session_id, w.injected_break));
                for (gc, wc) in g.calls.iter().zip(&w.calls) {
                    assert_eq!(gc.prompt_token_ids, wc.prompt_token_ids);
                    assert_eq!(gc.completion_token_ids, wc.completion_token_ids);
                    // The gateway stores an empty logprob list as null.
                    let lean_logprobs = wc.logprobs.as_deref().filter(|l| !l.is_empty());
                    let bits = |l: Option<&[f32]>| l.map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                    assert_eq!(bits(gc.logprobs.as_deref()), bits(lean_logprobs));
                    assert_eq!(gc.timestamp.to_bits(), wc.timestamp.to_bits());
                    assert_eq!((gc.session_id.as_str(), &gc.model), (wc.session_id.as_str(), &wc.model));
                }
            }
        }
    }
}

#[test]
fn lean_calls_are_the_earlier_workload() {
    let batch = simulate(&SimConfig { shape: Shape::Lean, sessions: 1, steps: 2, ..SimConfig::default() });
    let call = &batch[0].calls[1];
    assert_eq!(call.trace_id, "task-0:0/1");
    assert_eq!(text(&call.messages), r#"[{"role":"user","content":"solve task 0, turn 1"}]"#);
    assert_eq!(text(&call.response_message), r#"{"role":"assistant","content":"..."}"#);
    assert_eq!(text(&call.metadata), r#"{"group_id":"task-0","step":1}"#);
    assert_eq!(call.extra, None);
    assert_eq!(call.finish_reason.as_deref(), Some("stop"));
}

#[test]
fn simulation_is_deterministic_per_seed() {
    for shape in Shape::ALL {
        for cfg in configs(shape) {
            let a: Vec<_> = simulate(&cfg).into_iter().map(|s| s.calls).collect();
            let b: Vec<_> = simulate(&cfg).into_iter().map(|s| s.calls).collect();
            assert_eq!(a, b, "{shape}");
            let other: Vec<_> =
                simulate(&SimConfig { seed: cfg.seed + 1, ..cfg.clone() }).into_iter().map(|s| s.calls).collect();
            assert_ne!(a, other, "{shape}");
        }
    }
}

#[test]
fn prompts_extend_the_previous_context_except_at_the_injected_break() {
    for shape in Shape::ALL {
        for cfg in configs(shape) {
            let batch = simulate(&cfg);
            assert!(batch.iter().any(|s| s.injected_break.is_some()), "some sessions have a break");
            for s in &batch {
                for (k, pair) in s.calls.windows(2).enumerate() {
                    let context: Vec<u32> =
                        pair[0].prompt_token_ids.iter().chain(&pair[0].completion_token_ids).copied().collect();
                    let next = &pair[1].prompt_token_ids;
                    match s.injected_break {
                        Some((call, pos)) if call == k + 1 => {
                            assert_eq!(next[..pos], context[..pos]);
                            assert_ne!(next[pos], context[pos]);
                        }
                        _ => assert_eq!(next[..context.len()], context[..], "{shape} {} call {}", s.session_id, k + 1),
                    }
                }
            }
        }
    }
}

/// The line a simulated call was parsed from, and what it says.
#[test]
fn gateway_traces_have_the_gateways_keys_in_its_order() {
    for shape in [Shape::Gateway, Shape::GatewayStreaming] {
        for cfg in configs(shape) {
            for call in all_calls(&simulate(&cfg)) {
                let line = gateway_json(call);
                assert_eq!(keys(&line), TRACE_KEYS, "{shape}");
                let v = value(&line);
                assert_eq!(v["metadata"], serde_json::json!({}));
                assert_eq!(v["routing_matrices"], Value::Null);
                assert_eq!(v["weight_version"], 3);
                let id = v["trace_id"].as_str().expect("a string");
                assert_eq!((id.len(), &id[14..15]), (36, "4"), "a UUID v4: {id}");
                // Every float is written as Python writes it.
                for (name, f) in [("latency_ms", call.latency_ms.expect("latency")), ("timestamp", call.timestamp)] {
                    assert!(line.contains(&format!("\"{name}\":{}", py_float(f))), "{name}");
                }
                let extra = extra(call);
                assert_eq!(keys(&extra["raw_request"])[0], "messages");
                // The gateway's keys without a column (and a null logprobs: an empty completion's).
                let mut want = vec!["raw_request", "raw_response", "routing_matrices", "token_counts"];
                if call.completion_token_ids.is_empty() {
                    assert_eq!(call.logprobs, None);
                    want.insert(0, "logprobs");
                }
                assert_eq!(extra.keys().map(String::as_str).collect::<Vec<_>>(), want);
                if shape == Shape::GatewayStreaming {
                    assert_eq!(extra["raw_response"], "null");
                    assert_eq!(extra["token_counts"], "{}");
                    assert_eq!(value(&extra["raw_request"])["stream"], true);
                    let message = value(text(&call.response_message));
                    assert_eq!(message["role"], "assistant");
                    assert!(message.get("refusal").is_none(), "assembled from deltas, not vLLM's message");
                } else {
                    assert_ne!(extra["raw_response"], "null");
                }
            }
        }
    }
}

#[test]
fn raw_response_repeats_the_columns_bit_for_bit() {
    let mut calls = 0;
    for cfg in configs(Shape::Gateway) {
        for call in all_calls(&simulate(&cfg)) {
            calls += 1;
            let extra = extra(call);
            let raw_request = value(&extra["raw_request"]);
            let raw_response = value(&extra["raw_response"]);
            // raw_request carries the same messages, byte for byte, and the injections.
            let request_messages: BTreeMap<String, &RawValue> =
                serde_json::from_str(&extra["raw_request"]).expect("an object");
            assert_eq!(request_messages["messages"].get(), text(&call.messages));
            assert_eq!(raw_request["logprobs"], true);
            assert_eq!(raw_request["return_token_ids"], true);
            assert_eq!(raw_request["model"], crate::MODEL);
            assert!(raw_request["tools"].as_array().is_some_and(|t| !t.is_empty()));
            // The ids.
            let ids = |v: &Value| -> Vec<u32> {
                v.as_array().expect("a list").iter().map(|i| i.as_u64().expect("an id") as u32).collect()
            };
            assert_eq!(ids(&raw_response["prompt_token_ids"]), call.prompt_token_ids);
            let choice = &raw_response["choices"][0];
            assert_eq!(ids(&choice["token_ids"]), call.completion_token_ids);
            // The logprobs: each entry's text is the column's f32 widened, as Python writes it.
            let response: BTreeMap<String, &RawValue> =
                serde_json::from_str(&extra["raw_response"]).expect("an object");
            let choices: Vec<BTreeMap<String, &RawValue>> =
                serde_json::from_str(response["choices"].get()).expect("a list");
            let choice_text = &choices[0];
            let logprobs: BTreeMap<String, &RawValue> =
                serde_json::from_str(choice_text["logprobs"].get()).expect("an object");
            let entries: Vec<BTreeMap<String, &RawValue>> =
                serde_json::from_str(logprobs["content"].get()).expect("a list");
            let column = call.logprobs.as_deref().unwrap_or_default();
            assert_eq!(entries.len(), column.len());
            assert_eq!(entries.len(), call.completion_token_ids.len());
            for (entry, &lp) in entries.iter().zip(column) {
                assert_eq!(entry["logprob"].get(), py_float(f64::from(lp)));
                let parsed: f64 = entry["logprob"].get().parse().expect("a number");
                assert_eq!(parsed.to_bits(), f64::from(lp).to_bits());
                let token: String = serde_json::from_str(entry["token"].get()).expect("a string");
                let bytes: Vec<u8> = serde_json::from_str(entry["bytes"].get()).expect("bytes");
                assert_eq!(token.as_bytes(), bytes.as_slice());
                assert_eq!(entry["top_logprobs"].get(), "[]");
            }
            // The top-level logprobs of the line, likewise.
            let line = gateway_json(call);
            let top: BTreeMap<String, &RawValue> = serde_json::from_str(&line).expect("an object");
            if column.is_empty() {
                assert_eq!(top["logprobs"].get(), "null");
            } else {
                let texts = elements(top["logprobs"].get());
                let want: Vec<String> = column.iter().map(|&v| py_float(f64::from(v))).collect();
                assert_eq!(texts, want);
            }
            // The message, the finish reason and the usage.
            assert_eq!(choice["message"], value(text(&call.response_message)));
            assert_eq!(choice["finish_reason"].as_str(), call.finish_reason.as_deref());
            let (p, c) = (call.prompt_token_ids.len(), call.completion_token_ids.len());
            assert_eq!(raw_response["usage"]["prompt_tokens"], p);
            assert_eq!(raw_response["usage"]["completion_tokens"], c);
            assert_eq!(raw_response["usage"]["total_tokens"], p + c);
            assert_eq!(value(&extra["token_counts"]), serde_json::json!({"prompt": p, "completion": c}));
            assert_eq!(
                keys(&extra["raw_response"]),
                [
                    "id",
                    "object",
                    "created",
                    "model",
                    "choices",
                    "service_tier",
                    "system_fingerprint",
                    "usage",
                    "prompt_logprobs",
                    "prompt_token_ids",
                    "kv_transfer_params"
                ]
            );
        }
    }
    assert!(calls > 100);
}

/// Each call's `messages` is the previous call's, then the assistant's
/// message (non-streaming: `response_message` itself), then the tool's result.
#[test]
fn messages_grow_turn_by_turn() {
    for shape in [Shape::Gateway, Shape::GatewayStreaming] {
        for cfg in configs(shape) {
            for s in simulate(&cfg) {
                let first = elements(text(&s.calls[0].messages));
                assert_eq!(first.len(), 2);
                assert_eq!(value(&first[0])["role"], "system");
                assert_eq!(value(&first[1])["role"], "user");
                for (k, pair) in s.calls.windows(2).enumerate() {
                    let (before, after) = (elements(text(&pair[0].messages)), elements(text(&pair[1].messages)));
                    assert_eq!(after.len(), before.len() + 2, "{shape} {} call {}", s.session_id, k + 1);
                    assert_eq!(after[..before.len()], before[..], "the history is kept, also at a break");
                    let (assistant, tool) = (value(&after[before.len()]), value(&after[before.len() + 1]));
                    let recorded = text(&pair[0].response_message);
                    let call_id = if shape == Shape::Gateway {
                        assert_eq!(after[before.len()], recorded, "the response message itself");
                        assistant["tool_calls"][0]["id"].clone()
                    } else {
                        // The agent merged the deltas the gateway recorded as fragments.
                        let fragments = value(recorded)["tool_calls"].as_array().expect("fragments").clone();
                        let arguments: String = fragments[1..]
                            .iter()
                            .map(|f| f["function"]["arguments"].as_str().expect("a fragment"))
                            .collect();
                        let merged = &assistant["tool_calls"][0];
                        assert_eq!(merged["id"], fragments[0]["id"]);
                        assert_eq!(merged["function"]["name"], fragments[0]["function"]["name"]);
                        assert_eq!(merged["function"]["arguments"], arguments.as_str());
                        assert_eq!(
                            assistant["content"],
                            value(recorded).get("content").cloned().unwrap_or(Value::Null)
                        );
                        merged["id"].clone()
                    };
                    assert_eq!(pair[0].finish_reason.as_deref(), Some("tool_calls"));
                    let arguments = assistant["tool_calls"][0]["function"]["arguments"].as_str().expect("arguments");
                    assert!(value(arguments).is_object(), "arguments are a JSON object: {arguments}");
                    assert_eq!(tool["role"], "tool");
                    assert_eq!(tool["tool_call_id"], call_id);
                }
                let last = s.calls.last().expect("calls");
                assert_eq!(last.finish_reason.as_deref(), Some("stop"));
                assert!(value(text(&last.response_message))
                    .get("tool_calls")
                    .is_none_or(|t| t == &serde_json::json!([])));
            }
        }
    }
}

#[test]
fn traces_survive_export_and_parse() {
    for shape in Shape::ALL {
        for cfg in configs(shape) {
            for call in all_calls(&simulate(&cfg)) {
                let exported = export_call(call);
                assert_eq!(&parse_trace(&exported, 0.0).expect("export parses"), call, "{shape}");
                if shape != Shape::Lean {
                    let line = gateway_json(call);
                    let again = parse_trace(&line, 0.0).expect("the gateway line parses");
                    assert_eq!(&again, call, "{shape}");
                    assert_eq!(gateway_json(&again), line);
                    // The same keys and values; export_call writes logprobs as the shortest f32 decimals.
                    let (mut exported, mut line) = (value(&exported), value(&line));
                    let as_f32 = |v: Value| -> Vec<f32> {
                        v.as_array()
                            .map_or(vec![], |l| l.iter().map(|x| x.as_f64().expect("a number") as f32).collect())
                    };
                    let (a, b) = (exported["logprobs"].take(), line["logprobs"].take());
                    assert_eq!(as_f32(a), as_f32(b));
                    assert_eq!(exported, line);
                }
            }
        }
    }
}
