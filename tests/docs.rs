//! Docs blocks (format-spec/record.md §7) round-trip byte for byte: random
//! gateway-shaped traces from the simulator, then randomly edited so that
//! their raw bodies disagree with the columns in every way a reference could
//! get wrong (a changed id or logprob digit, spaced lists, a token's bytes
//! that are not its UTF-8, a moved key, a `raw_request.messages` that differs
//! from `messages`, logprobs that are not `f32`). Each document must come back
//! exactly; references are an optimization, never a rewrite.

use proptest::prelude::*;
use trajlog::format::docs::{encode, open, Columns};
use trajlog::{Call, Options, Store};
use trajlog_sim::{simulate, Shape, SimConfig};

fn sample_calls(seed: u64, shape: Shape) -> Vec<Call> {
    let cfg = SimConfig {
        sessions: 2,
        steps: 3,
        system_tokens: 40,
        completion_tokens: (1, 30),
        tool_tokens: (1, 20),
        break_every: 2,
        seed,
        shape,
        ..SimConfig::default()
    };
    simulate(&cfg).into_iter().flat_map(|s| s.calls).collect()
}

/// One edit of a document's text, chosen by `pick` among the places it can apply.
fn edit(text: &str, kind: u8, pick: usize) -> String {
    let places = |pat: &str| text.match_indices(pat).map(|(i, _)| i).collect::<Vec<_>>();
    let at = |v: Vec<usize>| if v.is_empty() { None } else { Some(v[pick % v.len()]) };
    let mut out = text.to_owned();
    match kind {
        // A digit changed inside a list or a number.
        0 => {
            if let Some(i) = at(text.char_indices().filter(|(_, c)| c.is_ascii_digit()).map(|(i, _)| i).collect()) {
                let d = out.as_bytes()[i];
                out.replace_range(i..i + 1, &char::from(b'0' + (d - b'0' + 1) % 10).to_string());
            }
        }
        // A list written the way Python's json.dumps writes it.
        1 => {
            if let Some(i) = at(places("\"prompt_token_ids\":[")) {
                let start = i + "\"prompt_token_ids\":[".len();
                if let Some(len) = out[start..].find(']') {
                    let spaced = out[start..start + len].replace(',', ", ");
                    out.replace_range(start..start + len, &spaced);
                }
            }
        }
        // A token's bytes that are not its UTF-8.
        2 => {
            if let Some(i) = at(places("\"bytes\":[")) {
                out.insert_str(i + "\"bytes\":[".len(), "255,");
            }
        }
        // A logprob with more digits than the f32 needs (not an f32 rendering).
        3 => {
            if let Some(i) = at(places("\"logprob\":")) {
                let start = i + "\"logprob\":".len();
                if let Some(len) = out[start..].find([',', '}']) {
                    let v: f64 = out[start..start + len].parse().unwrap_or(0.0);
                    out.replace_range(start..start + len, &format!("{:?}", v + 1e-12));
                }
            }
        }
        // raw_request.messages no longer equal to messages.
        4 => {
            if let Some(i) = at(places("\"raw_request\":{\"messages\":[")) {
                out.insert_str(i + "\"raw_request\":{\"messages\":[".len(), "{\"role\":\"user\",\"content\":\"x\"},");
            }
        }
        // Whitespace after a comma.
        _ => {
            if let Some(i) = at(places(",\"")) {
                out.insert_str(i + 1, " \n");
            }
        }
    }
    out
}

fn resolve(call: &Call, block: &[u8]) -> trajlog::Docs {
    let present =
        [call.messages.is_some(), call.response_message.is_some(), call.metadata.is_some(), call.extra.is_some()];
    let cols = Columns {
        prompt: Some(&call.prompt_token_ids),
        completion: &call.completion_token_ids,
        logprobs: call.logprobs.as_deref(),
    };
    open(block, present).and_then(|b| b.resolve(&cols)).expect("a block this build wrote resolves")
}

fn check(call: &Call) {
    if let Some(block) = encode(call) {
        let docs = resolve(call, &block);
        assert_eq!(docs.messages, call.messages, "{}: messages", call.trace_id);
        assert_eq!(docs.response_message, call.response_message, "{}: response_message", call.trace_id);
        assert_eq!(docs.metadata, call.metadata, "{}: metadata", call.trace_id);
        assert_eq!(docs.extra, call.extra, "{}: extra", call.trace_id);
        let plain: usize = [&call.messages, &call.response_message, &call.metadata, &call.extra]
            .iter()
            .map(|d| d.as_ref().map_or(0, Vec::len))
            .sum();
        assert!(block.len() < plain, "a block is used only when it is smaller");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn edited_gateway_traces_round_trip(
        seed in any::<u64>(),
        streaming in any::<bool>(),
        edits in prop::collection::vec((0u8..6, any::<usize>(), 0usize..4), 0..6),
        column_edit in 0u8..3,
    ) {
        let shape = if streaming { Shape::GatewayStreaming } else { Shape::Gateway };
        for mut call in sample_calls(seed, shape) {
            for &(kind, pick, doc) in &edits {
                let slot = match doc {
                    0 => &mut call.messages,
                    1 => &mut call.response_message,
                    2 => &mut call.metadata,
                    _ => &mut call.extra,
                };
                if let Some(d) = slot {
                    let text = String::from_utf8(d.clone()).expect("utf-8");
                    *d = edit(&text, kind, pick).into_bytes();
                }
            }
            // The columns themselves may disagree with the raw bodies.
            match column_edit {
                1 => if let Some(p) = call.prompt_token_ids.first_mut() { *p ^= 1 },
                2 => if let Some(lp) = call.logprobs.as_mut().and_then(|l| l.first_mut()) {
                    *lp = f32::from_bits(lp.to_bits() ^ 1)
                },
                _ => {}
            }
            check(&call);
        }
    }
}

#[test]
fn realistic_traces_shrink_and_come_back_exactly() {
    let calls = sample_calls(7, Shape::Gateway);
    let (mut plain, mut blocks) = (0usize, 0usize);
    for call in &calls {
        check(call);
        plain += [&call.messages, &call.response_message, &call.metadata, &call.extra]
            .iter()
            .map(|d| d.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        blocks += encode(call).map_or(0, |b| b.len());
    }
    // Every call of this shape carries its columns again in raw_response.
    assert!(calls.iter().all(|c| encode(c).is_some()));
    assert!(blocks * 3 < plain, "docs blocks {blocks} B against {plain} B of plain documents");
}

#[test]
fn a_store_reads_docs_blocks_exactly_before_and_after_reopen_and_compaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let calls: Vec<Call> =
        [(3, Shape::Gateway), (4, Shape::GatewayStreaming)].iter().flat_map(|&(s, sh)| sample_calls(s, sh)).collect();
    let check_store = |store: &Store| {
        let snap = store.snapshot();
        for want in &calls {
            let got = snap.get(&want.trace_id).expect("read").expect("present").to_call().expect("call");
            assert_eq!(&got, want, "{}", want.trace_id);
        }
        // Whole sessions, prompts rebuilt call after call, and windows of them.
        let sessions: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
        for sid in sessions {
            let views = snap.session(sid, None, None).expect("session");
            let each: Vec<Call> = views.iter().map(|v| v.to_call().expect("call")).collect();
            assert_eq!(snap.session_calls(sid, None, None).expect("session calls"), each, "{sid}");
            let since = each.first().map(|c| c.timestamp);
            let window: Vec<Call> = each.iter().filter(|c| Some(c.timestamp) > since).take(2).cloned().collect();
            assert_eq!(snap.session_calls(sid, since, Some(2)).expect("window"), window, "{sid}");
        }
    };
    {
        let store = Store::open(dir.path(), Options::default()).expect("open");
        for c in &calls {
            store.append(c.clone()).expect("append");
        }
        store.flush().expect("flush");
        check_store(&store);
    }
    let store = Store::open(dir.path(), Options::default()).expect("reopen");
    check_store(&store);
    let sessions: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
    for sid in sessions {
        store.seal_session(sid).expect("seal");
    }
    let report = store.compact(&trajlog::CompactOptions::default()).expect("compact");
    assert!(report.calls > 0, "{report:?}");
    check_store(&store);
}

/// Timing of the docs codec on the realistic shape (not a test of speed:
/// run it by hand, in release, to see where a call's time goes):
/// `cargo test --release --test docs -- --ignored --nocapture`.
#[test]
#[ignore]
fn docs_codec_timing() {
    let cfg = SimConfig { sessions: 8, steps: 8, seed: 1, shape: Shape::Gateway, ..SimConfig::default() };
    let calls: Vec<Call> = simulate(&cfg).into_iter().flat_map(|s| s.calls).collect();
    let rounds = 10;
    let t = std::time::Instant::now();
    for _ in 1..rounds {
        std::hint::black_box(calls.iter().filter_map(encode).count());
    }
    let blocks: Vec<Vec<u8>> = calls.iter().filter_map(encode).collect();
    let enc = t.elapsed().as_secs_f64() / (rounds * calls.len()) as f64;
    let t = std::time::Instant::now();
    for (call, block) in calls.iter().zip(&blocks) {
        std::hint::black_box(resolve(call, block));
    }
    let dec = t.elapsed().as_secs_f64() / calls.len() as f64;
    let t = std::time::Instant::now();
    for call in &calls {
        call.validate().expect("valid");
    }
    let val = t.elapsed().as_secs_f64() / calls.len() as f64;
    let plain: usize = calls.iter().map(|c| c.extra.as_ref().map_or(0, Vec::len)).sum();
    println!(
        "{} calls, {:.0} KB extra per call: encode {:.0} µs, resolve {:.0} µs, validate {:.0} µs per call",
        calls.len(),
        plain as f64 / calls.len() as f64 / 1e3,
        enc * 1e6,
        dec * 1e6,
        val * 1e6
    );
}
