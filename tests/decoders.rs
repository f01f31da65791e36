//! Decoders never panic: arbitrary bytes and bit-flipped valid encodings into
//! every codec (the fuzz targets in `fuzz/` do the same, longer).

use proptest::prelude::*;
use trajlog::format::frame::{read_frame, write_frame};
use trajlog::format::manifest::{decode_manifest, encode_manifest, Manifest, ManifestSegment, SegmentState};
use trajlog::format::record::{decode_annotation, decode_call, encode_call, Delta, Loc, Relation};
use trajlog::format::segment::{decode_footer, encode_footer, read_trailer, FooterEntry};
use trajlog::segment::recovery::scan_frames;
use trajlog::Call;

/// Copy into an 8-aligned buffer, as bodies are in a mapped segment.
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
    v
}

fn view(v: &[u64], len: usize) -> &[u8] {
    &bytemuck::cast_slice::<u64, u8>(v)[..len]
}

fn sample_call_body() -> Vec<u8> {
    let call = Call {
        trace_id: "trace".into(),
        session_id: "sess".into(),
        session_uids: vec!["a".into(), "bb".into()],
        timestamp: 1.0,
        model: Some("m".into()),
        weight_version: Some(2),
        prompt_token_ids: vec![1, 2, 3, 4],
        completion_token_ids: vec![5, 6],
        logprobs: Some(vec![-0.5, -1.0]),
        routing_matrices: Some(vec![9; 5]),
        finish_reason: Some("stop".into()),
        latency_ms: Some(3.0),
        messages: Some(b"[]".to_vec()),
        response_message: Some(b"{}".to_vec()),
        metadata: Some(b"{\"a\":1}".to_vec()),
        extra: Some(b"{}".to_vec()),
    };
    let mut body = Vec::new();
    encode_call(
        &mut body,
        &call,
        &Delta {
            parent: Some(Loc { segment: 1, offset: 64 }),
            prefix_len: 2,
            relation: Relation::Extends,
            checkpoint: false,
        },
        None,
    );
    body
}

/// A call body whose documents are a docs block with every kind of reference.
fn sample_docs_body() -> Vec<u8> {
    let messages = r#"[{"role":"user","content":"hello there"}]"#;
    let extra = format!(
        r#"{{"raw_request":{{"messages":{messages}}},"raw_response":{{"choices":[{{"logprobs":{{"content":[{{"token":"ab","logprob":-0.5,"bytes":[97,98]}},{{"token":"c","logprob":-1.0,"bytes":[99]}}]}},"token_ids":[5,6]}}],"prompt_token_ids":[1,2,3,4]}},"pad":"{}"}}"#,
        "z".repeat(400)
    );
    let call = Call {
        trace_id: "trace".into(),
        session_id: "sess".into(),
        prompt_token_ids: vec![1, 2, 3, 4],
        completion_token_ids: vec![5, 6],
        logprobs: Some(vec![-0.5, -1.0]),
        messages: Some(messages.as_bytes().to_vec()),
        extra: Some(extra.into_bytes()),
        ..Default::default()
    };
    let docs = trajlog::format::docs::encode(&call, None).expect("a docs block pays off").block;
    let mut body = Vec::new();
    encode_call(&mut body, &call, &Delta::ROOT, Some(&docs));
    body
}

/// Decode a call body and, when it has a docs block, resolve it.
fn decode_all(body: &[u8]) {
    if let Ok(rec) = decode_call(body) {
        if let Some(d) = rec.docs {
            let cols = trajlog::format::docs::Columns {
                prompt: Some(&[1, 2, 3, 4]),
                completion: rec.completion,
                logprobs: rec.logprobs,
                parent: None,
            };
            let _ = trajlog::format::docs::open(d.block, d.present).and_then(|b| b.resolve(&cols));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let a = aligned(&bytes);
        let b = view(&a, bytes.len());
        decode_all(b);
        let _ = decode_annotation(b);
        let _ = decode_manifest(b);
        for off in [0u64, 8, 64] {
            let _ = read_frame(b, off);
        }
        let _ = scan_frames(b);
        if let Some(t) = read_trailer(b) {
            let _ = decode_footer(b, &t);
        }
        let _ = trajlog::trace_json::parse_trace(&String::from_utf8_lossy(&bytes), 0.0);
    }

    #[test]
    fn flipped_call_bodies_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..4)) {
        let mut body = sample_call_body();
        for (i, bit) in flips {
            let i = i.index(body.len());
            body[i] ^= 1 << bit;
        }
        let a = aligned(&body);
        decode_all(view(&a, body.len()));
        let mut framed = vec![0u8; 64];
        write_frame(&mut framed, &body);
        let a = aligned(&framed);
        let _ = scan_frames(view(&a, framed.len()));
    }

    #[test]
    fn flipped_footers_and_manifests_never_panic(i in any::<prop::sample::Index>(), bit in 0u8..8) {
        let entries = vec![FooterEntry { frame_offset: 64, body_len: 10, kind: 1, reward_target: 0, timestamp: 1.0, id: "t".into(), session_id: "s".into(), session_uids: vec!["u".into()] }];
        let mut file = vec![0u8; 88];
        encode_footer(&mut file, 88, &entries, trajlog::format::FORMAT_VERSION);
        let at = i.index(file.len());
        file[at] ^= 1 << bit;
        if let Some(t) = read_trailer(&file) {
            let _ = decode_footer(&file, &t);
        }
        let mut m = encode_manifest(&Manifest { next_segment_id: 9, segments: vec![ManifestSegment { id: 3, state: SegmentState::Sealed }], ..Manifest::default() });
        let at = i.index(m.len());
        m[at] ^= 1 << bit;
        prop_assert!(decode_manifest(&m).is_err());
    }
}

#[test]
fn a_sample_call_body_decodes() {
    let body = sample_call_body();
    let a = aligned(&body);
    let rec = decode_call(view(&a, body.len())).unwrap();
    assert_eq!(rec.prompt_suffix, &[3, 4]);
    assert_eq!(rec.session_uids, ["a", "bb"]);
    // Misaligned columns are an error, never undefined behaviour.
    let mut shifted = vec![0u8; 1];
    shifted.extend_from_slice(&body);
    let a = aligned(&shifted);
    let err = decode_call(&view(&a, shifted.len())[1..]).unwrap_err();
    assert!(err.what.contains("aligned"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn flipped_docs_blocks_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..4)) {
        let mut body = sample_docs_body();
        // Flip inside the docs block mostly (the record's tail), sometimes anywhere.
        let tail = body.len() - body.len() / 3;
        for (i, bit) in flips {
            let i = if bit % 2 == 0 { tail + i.index(body.len() - tail) } else { i.index(body.len()) };
            body[i] ^= 1 << bit;
        }
        let a = aligned(&body);
        decode_all(view(&a, body.len()));
    }
}

#[test]
fn the_docs_sample_resolves_exactly() {
    let body = sample_docs_body();
    let a = aligned(&body);
    let rec = decode_call(view(&a, body.len())).expect("decode");
    let d = rec.docs.expect("a docs block");
    let cols = trajlog::format::docs::Columns {
        prompt: Some(&[1, 2, 3, 4]),
        completion: rec.completion,
        logprobs: rec.logprobs,
        parent: None,
    };
    let docs = trajlog::format::docs::open(d.block, d.present).and_then(|b| b.resolve(&cols)).expect("resolve");
    let extra = String::from_utf8(docs.extra.expect("extra")).expect("utf-8");
    assert!(extra.contains(r#""logprob":-0.5,"bytes":[97,98]}"#), "{extra}");
    assert!(extra.contains(r#""prompt_token_ids":[1,2,3,4]"#), "{extra}");
}
