//! Docs blocks (format-spec/record.md §7) round-trip byte for byte: random
//! gateway-shaped traces from the simulator, then randomly edited so that
//! their raw bodies disagree with the columns in every way a reference could
//! get wrong (a changed id or logprob digit, spaced lists, a token's bytes
//! that are not its UTF-8, a moved key, a `raw_request.messages` that differs
//! from `messages`, logprobs that are not `f32`). Each document must come back
//! exactly; references are an optimization, never a rewrite.

use proptest::prelude::*;
use trajlog::format::docs::{encode, encode_for, open, Allow, Columns, Parent};
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
        // vLLM's content list written as Python's json.dumps writes it
        // (reference 8's spaced style), `pick` choosing whether the bytes
        // lists are spaced too.
        6 => {
            for (from, to) in [
                (r#"{"token":"#, r#"{"token": "#),
                (r#","logprob":"#, r#", "logprob": "#),
                (r#","bytes":"#, r#", "bytes": "#),
                (r#","top_logprobs":[]}"#, r#", "top_logprobs": []}"#),
                (r#"]},{"token""#, r#"]}, {"token""#),
                (r#"[]},{"token""#, r#"[]}, {"token""#),
            ] {
                out = out.replace(from, to);
            }
            if pick.is_multiple_of(2) {
                let mut spaced = String::with_capacity(out.len());
                let mut rest = out.as_str();
                while let Some(i) = rest.find(r#""bytes": ["#) {
                    let start = i + r#""bytes": ["#.len();
                    let len = rest[start..].find(']').unwrap_or(0);
                    spaced.push_str(&rest[..start]);
                    spaced.push_str(&rest[start..start + len].replace(',', ", "));
                    rest = &rest[start + len..];
                }
                spaced.push_str(rest);
                out = spaced;
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

fn resolve(call: &Call, block: &[u8], parent: Option<Parent<'_>>) -> trajlog::Docs {
    let present =
        [call.messages.is_some(), call.response_message.is_some(), call.metadata.is_some(), call.extra.is_some()];
    let cols = Columns {
        prompt: Some(&call.prompt_token_ids),
        completion: &call.completion_token_ids,
        logprobs: call.logprobs.as_deref(),
        parent,
    };
    open(block, present).and_then(|b| b.resolve(&cols)).expect("a block this build wrote resolves")
}

/// The parent documents a call's messages delta is made against.
fn parent_of(prev: &Call) -> Option<Parent<'_>> {
    Some(Parent { messages: prev.messages.as_deref()?, response_message: prev.response_message.as_deref() })
}

/// Encode `call` (against `parent` when given), resolve it back, compare
/// every document byte for byte. Returns whether a messages delta was used.
fn check(call: &Call, parent: Option<Parent<'_>>) -> bool {
    let encoded = encode(call, parent);
    let uses_parent = encoded.as_ref().is_some_and(|e| e.uses_parent);
    if let Some(block) = encoded.map(|e| e.block) {
        // Without the parent a block that refers to it does not resolve.
        let docs = resolve(call, &block, parent.filter(|_| uses_parent));
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
    // A block for a segment of format 5 (no reference 8) comes back too.
    let allow = Allow::format(5);
    if let Some(e) = encode_for(call, parent, allow) {
        assert!(e.min_format <= 5, "{}: a block for format 5 needs format {}", call.trace_id, e.min_format);
        let docs = resolve(call, &e.block, parent.filter(|_| e.uses_parent));
        assert_eq!(docs.extra, call.extra, "{}: extra (format 5)", call.trace_id);
        assert_eq!(docs.messages, call.messages, "{}: messages (format 5)", call.trace_id);
    }
    uses_parent
}

/// A completions-API call (token in, token out) as rLLM's gateway stores it:
/// `raw_request.prompt` the prompt as ids, `raw_response` with
/// `token_logprobs`, `token_ids` and `prompt_token_ids`, lists in `style`
/// (`","` or `", "`).
fn completions_call(prompt: Vec<u32>, completion: Vec<u32>, logprobs: Vec<f32>, sep: &str) -> Call {
    let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(sep);
    let floats = logprobs.iter().map(|v| trajlog::trace_json::py_float(f64::from(*v))).collect::<Vec<_>>().join(sep);
    let tokens = completion.iter().map(|t| format!("\"t{t}\"")).collect::<Vec<_>>().join(sep);
    let extra = format!(
        r#"{{"raw_request":{{"model":"m","prompt":[{}],"logprobs":1}},"raw_response":{{"choices":[{{"index":0,"logprobs":{{"text_offset":[],"token_logprobs":[{floats}],"tokens":[{tokens}],"top_logprobs":[]}},"token_ids":[{}],"prompt_token_ids":[{}]}}]}}}}"#,
        ids(&prompt),
        ids(&completion),
        ids(&prompt)
    );
    Call {
        trace_id: "c".into(),
        session_id: "s".into(),
        prompt_token_ids: prompt,
        completion_token_ids: completion,
        logprobs: Some(logprobs),
        extra: Some(extra.into_bytes()),
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Completions-API traces, edited like the chat ones (a digit, a
    /// spacing, a logprob's digits, whitespace) and with columns that may
    /// disagree: every document comes back exactly, as a format 6 block and
    /// as a format 5 one.
    #[test]
    fn edited_completions_traces_round_trip(
        prompt in prop::collection::vec(any::<u32>(), 0..300),
        completion in prop::collection::vec(0u32..200_000, 1..80),
        seed in any::<u32>(),
        spaced in any::<bool>(),
        edits in prop::collection::vec((prop::sample::select(vec![0u8, 1, 3, 5]), any::<usize>()), 0..3),
        column_edit in 0u8..3,
    ) {
        let logprobs: Vec<f32> =
            completion.iter().map(|&t| -f32::from_bits((t ^ seed) % 0x4100_0000)).collect();
        let mut call = completions_call(prompt, completion, logprobs, if spaced { ", " } else { "," });
        for &(kind, pick) in &edits {
            let text = String::from_utf8(call.extra.clone().unwrap_or_default()).expect("utf-8");
            call.extra = Some(edit(&text, kind, pick).into_bytes());
        }
        match column_edit {
            1 => if let Some(p) = call.prompt_token_ids.first_mut() { *p ^= 1 },
            2 => if let Some(lp) = call.logprobs.as_mut().and_then(|l| l.last_mut()) {
                *lp = f32::from_bits(lp.to_bits() ^ 1)
            },
            _ => {}
        }
        check(&call, None);
        // Unedited, with columns as sent and enough tokens for a block to
        // pay off, the logprob list is one reference (format 6).
        if edits.is_empty() && column_edit == 0 && call.completion_token_ids.len() >= 40 {
            let e = encode(&call, None).expect("a block");
            prop_assert_eq!(e.min_format, trajlog::format::FORMAT_CONTENT_REF);
        }
    }

    #[test]
    fn edited_gateway_traces_round_trip(
        seed in any::<u64>(),
        streaming in any::<bool>(),
        edits in prop::collection::vec((0u8..7, any::<usize>(), 0usize..4), 0..6),
        column_edit in 0u8..3,
    ) {
        let shape = if streaming { Shape::GatewayStreaming } else { Shape::Gateway };
        let mut previous = std::collections::HashMap::new();
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
            check(&call, None);
            // The same call as a delta against the session's previous call
            // (edited too: an edited or re-rendered history stays verbatim).
            if let Some(prev) = previous.get(&call.session_id) {
                check(&call, parent_of(prev));
            }
            previous.insert(call.session_id.clone(), call);
        }
    }
}

#[test]
fn realistic_traces_shrink_and_come_back_exactly() {
    let calls = sample_calls(7, Shape::Gateway);
    let (mut plain, mut blocks) = (0usize, 0usize);
    for call in &calls {
        check(call, None);
        plain += [&call.messages, &call.response_message, &call.metadata, &call.extra]
            .iter()
            .map(|d| d.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        blocks += encode(call, None).map_or(0, |b| b.block.len());
    }
    // Every call of this shape carries its columns again in raw_response,
    // its content list as one splice (reference 8, format 6): the block is
    // smaller than the same call's block for format 5.
    assert!(calls.iter().all(|c| encode(c, None).is_some()));
    for call in calls.iter().filter(|c| c.logprobs.as_ref().is_some_and(|lp| !lp.is_empty())) {
        let e = encode(call, None).expect("a block");
        assert_eq!(e.min_format, trajlog::format::FORMAT_CONTENT_REF, "{}", call.trace_id);
        let old = encode_for(call, None, Allow::format(5)).expect("a block");
        assert!(
            e.block.len() < old.block.len(),
            "{}: {} B, {} B for format 5",
            call.trace_id,
            e.block.len(),
            old.block.len()
        );
        // So is the list as Python's json.dumps writes it (pick 0); with
        // its bytes lists compact (pick 1) it is no style of reference 8,
        // and its entries are cut one by one.
        for pick in [0, 1] {
            let mut spaced = call.clone();
            let text = String::from_utf8(call.extra.clone().expect("extra")).expect("utf-8");
            spaced.extra = Some(edit(&text, 6, pick).into_bytes());
            assert_ne!(spaced.extra, call.extra);
            let e = encode(&spaced, None).expect("a block");
            let want = if pick == 0 { trajlog::format::FORMAT_CONTENT_REF } else { 2 };
            assert_eq!(e.min_format, want, "{} pick {pick}", call.trace_id);
            check(&spaced, None);
        }
    }
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
    seal_all_and_compact(&store, &calls);
    check_store(&store);
}

/// Seal the sessions of `calls` and compact them.
fn seal_all_and_compact(store: &Store, calls: &[Call]) {
    let sessions: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
    for sid in sessions {
        store.seal_session(sid).expect("seal");
    }
    let report = store.compact(&trajlog::CompactOptions::default()).expect("compact");
    assert!(report.calls > 0, "{report:?}");
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
    let plain: usize = calls.iter().map(|c| c.extra.as_ref().map_or(0, Vec::len)).sum();
    println!("{} calls, {:.0} KB extra per call", calls.len(), plain as f64 / calls.len() as f64 / 1e3);
    // Alternated, so that both formats see the same machine.
    for round in 0..4 {
        for version in [5, trajlog::format::FORMAT_VERSION] {
            let allow = Allow::format(version);
            let t = std::time::Instant::now();
            for _ in 1..rounds {
                std::hint::black_box(calls.iter().filter_map(|c| encode_for(c, None, allow)).count());
            }
            let blocks: Vec<Vec<u8>> =
                calls.iter().filter_map(|c| encode_for(c, None, allow).map(|e| e.block)).collect();
            let enc = t.elapsed().as_secs_f64() / (rounds * calls.len()) as f64;
            let t = std::time::Instant::now();
            for _ in 0..rounds {
                for (call, block) in calls.iter().zip(&blocks) {
                    std::hint::black_box(resolve(call, block, None));
                }
            }
            let dec = t.elapsed().as_secs_f64() / (rounds * calls.len()) as f64;
            let bytes: usize = blocks.iter().map(Vec::len).sum();
            println!(
                "round {round}, segment format {version}: encode {:.0} µs, resolve {:.0} µs, block {:.0} B per call",
                enc * 1e6,
                dec * 1e6,
                bytes as f64 / calls.len() as f64
            );
        }
    }
}

/// A growing chat history is stored as a delta against the previous call:
/// on unedited gateway sessions every call after the first uses one.
#[test]
fn unedited_histories_are_stored_as_deltas() {
    for shape in [Shape::Gateway, Shape::GatewayStreaming] {
        let calls = sample_calls(11, shape);
        let mut previous: std::collections::HashMap<String, &Call> = std::collections::HashMap::new();
        let (mut deltas, mut followers) = (0, 0);
        for call in &calls {
            if let Some(prev) = previous.get(&call.session_id) {
                followers += 1;
                deltas += usize::from(check(call, parent_of(prev)));
            }
            previous.insert(call.session_id.clone(), call);
        }
        assert!(followers > 0);
        if shape == Shape::Gateway {
            assert_eq!(deltas, followers, "every later call of a non-streaming session is a delta");
        } else {
            assert!(deltas > 0, "streaming sessions: some deltas");
        }
    }
}

fn long_sessions(sessions: usize, steps: usize) -> Vec<Call> {
    let cfg = SimConfig {
        sessions,
        steps,
        system_tokens: 40,
        completion_tokens: (1, 30),
        tool_tokens: (1, 20),
        seed: 5,
        shape: Shape::Gateway,
        ..SimConfig::default()
    };
    simulate(&cfg).into_iter().flat_map(|s| s.calls).collect()
}

/// Sessions longer than the delta chain bound read back exactly call by call
/// (each read resolving its chain alone), whole, after a reopen and after
/// compaction; and the deltas make the documents smaller than a store that
/// keeps no recent history (`delta_cache_bytes(0)`).
#[test]
fn messages_deltas_read_back_exactly_and_save_bytes() {
    let calls = long_sessions(3, 3 * trajlog::limits::MESSAGES_DELTA_DEPTH_MAX as usize);
    let dir = tempfile::tempdir().expect("tempdir");
    let plain_dir = tempfile::tempdir().expect("tempdir");
    let check_store = |store: &Store| {
        let snap = store.snapshot();
        for want in &calls {
            let got = snap.get(&want.trace_id).expect("read").expect("present").to_call().expect("call");
            assert_eq!(&got, want, "{}", want.trace_id);
        }
        let sessions: std::collections::BTreeSet<&str> = calls.iter().map(|c| c.session_id.as_str()).collect();
        for sid in sessions {
            let want: Vec<&Call> = calls.iter().filter(|c| c.session_id == sid).collect();
            let got = snap.session_calls(sid, None, None).expect("session");
            assert_eq!(got.iter().collect::<Vec<_>>(), want, "{sid}");
            // A window that starts mid-chain resolves its first call alone.
            let since = want.get(5).map(|c| c.timestamp);
            let window: Vec<&Call> = want.iter().copied().filter(|c| Some(c.timestamp) > since).take(4).collect();
            let got = snap.session_calls(sid, since, Some(4)).expect("window");
            assert_eq!(got.iter().collect::<Vec<_>>(), window, "{sid}");
        }
    };
    for (path, options) in
        [(dir.path(), Options::default()), (plain_dir.path(), Options::default().delta_cache_bytes(0))]
    {
        let store = Store::open(path, options).expect("open");
        for c in &calls {
            store.append(c.clone()).expect("append");
        }
        store.flush().expect("flush");
        check_store(&store);
    }
    let with = trajlog::verify::verify_dir(dir.path()).expect("verify");
    let without = trajlog::verify::verify_dir(plain_dir.path()).expect("verify");
    assert!(with.problems.is_empty() && without.problems.is_empty(), "{:?} {:?}", with.problems, without.problems);
    assert!(
        with.split.docs_block_bytes * 4 < without.split.docs_block_bytes * 3,
        "docs blocks with deltas {} B, without {} B",
        with.split.docs_block_bytes,
        without.split.docs_block_bytes
    );
    let store = Store::open(dir.path(), Options::default()).expect("reopen");
    check_store(&store);
    // Appends after a reopen (the chat documents are not kept across it).
    let cfg = SimConfig { steps: 4, seed: 9, shape: Shape::Gateway, ..SimConfig::default() };
    let more = trajlog_sim::simulate_session(&cfg, 100).calls;
    for c in &more {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    check_store(&store);
    let snap = store.snapshot();
    for want in &more {
        assert_eq!(&snap.get(&want.trace_id).expect("read").expect("present").to_call().expect("call"), want);
    }
    seal_all_and_compact(&store, &calls);
    check_store(&store);
}

/// The writer keeps a messages delta only when the parent it chooses is the
/// call the delta was made against. Here the third call's tokens extend the
/// first call's context (so that is its parent) while its messages extend the
/// second's: the delta is dropped and the call still reads back exactly.
#[test]
fn a_delta_against_a_call_that_is_not_the_parent_is_dropped() {
    let calls = long_sessions(1, 2);
    let first = &calls[0];
    // The second call's prompt shares nothing with the first's context.
    let mut second = calls[1].clone();
    second.prompt_token_ids = vec![7; 50];
    let second = &second;
    let mut third = second.clone();
    third.trace_id = "branch".into();
    third.timestamp = second.timestamp + 1.0;
    let mut prompt = first.prompt_token_ids.clone();
    prompt.extend_from_slice(&first.completion_token_ids);
    prompt.push(424_242);
    third.prompt_token_ids = prompt;
    let mut history = second.messages.clone().expect("messages");
    history.pop();
    history.extend_from_slice(b", ");
    history.extend_from_slice(second.response_message.as_deref().expect("response"));
    history.extend_from_slice(br#", {"role": "user", "content": "again"}]"#);
    third.messages = Some(history);
    assert!(encode(&third, parent_of(second)).is_some_and(|e| e.uses_parent), "the appender makes a delta");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for c in [first, second, &third] {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    let snap = store.snapshot();
    let view = snap.get("branch").expect("read").expect("present");
    assert_eq!(view.parent(), snap.get(&first.trace_id).expect("read").map(|v| v.loc));
    assert_eq!(view.to_call().expect("call"), third);
    assert!(trajlog::verify::verify_dir(dir.path()).expect("verify").problems.is_empty());
}
