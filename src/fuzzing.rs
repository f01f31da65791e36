//! The bodies of the fuzz targets (`fuzz/fuzz_targets/*`), kept in the library
//! so that `cargo test` replays every committed corpus and regression input
//! through exactly the code the fuzzer runs (`tests/fuzz_replay.rs`), on the
//! stable toolchain. Each must return normally for any input: errors are
//! fine, panics are bugs.

use crate::format::manifest::{encode_manifest, Manifest, ManifestSegment, SegmentState};
use crate::format::{frame, manifest, record, segment};

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name: `fuzz/corpus/<name>/` holds each seed corpus.
pub const TARGETS: &[(&str, Target)] = &[
    ("record_decode", record_decode),
    ("segment_scan", segment_scan),
    ("footer_decode", footer_decode),
    ("manifest_decode", manifest_decode),
    ("store_recovery", store_recovery),
    ("trace_json", trace_json),
];

/// Call and annotation record bodies (they live 8-aligned in a mapping).
pub fn record_decode(data: &[u8]) {
    let mut buf = vec![0u64; data.len().div_ceil(8)];
    let Some(bytes) = bytemuck::cast_slice_mut::<u64, u8>(&mut buf).get_mut(..data.len()) else { return };
    bytes.copy_from_slice(data);
    if let Ok(rec) = record::decode_call(bytes) {
        if let Some(d) = rec.docs {
            let cols = crate::format::docs::Columns {
                prompt: Some(rec.prompt_suffix),
                completion: rec.completion,
                logprobs: rec.logprobs,
                parent: None,
            };
            let resolved = crate::format::docs::open(d.block, d.present).and_then(|b| b.resolve(&cols));
            // The template path checks what `resolve` checks, and renders
            // what it renders.
            let spliced = crate::format::docs::open(d.block, d.present).and_then(|b| b.resolve_but_extra(&cols));
            assert_eq!(resolved.is_ok(), spliced.is_ok(), "resolve and resolve_but_extra disagree");
            if let (Ok(docs), Ok((rest, Some(t)))) = (&resolved, &spliced) {
                let text = t.render(rec.prompt_suffix, rec.completion, rec.logprobs, rest.messages.as_deref());
                assert_eq!(text.ok().as_ref(), docs.extra.as_ref(), "a template renders other text");
            }
        }
    }
    let _ = record::decode_annotation(bytes);
}

/// Segment header, frame scan and single-frame reads over arbitrary bytes.
pub fn segment_scan(data: &[u8]) {
    let _ = segment::decode_header(data);
    let _ = crate::segment::recovery::scan_frames(data);
    let _ = crate::segment::recovery::scan_frames_past_damage(data);
    let _ = crate::segment::recovery::scan_active(data);
    let _ = frame::read_frame(data, 0);
}

/// Footer index and trailer decoding.
pub fn footer_decode(data: &[u8]) {
    if let Some(t) = segment::read_trailer(data) {
        if let Ok(entries) = segment::decode_footer(data, &t) {
            let _ = crate::segment::recovery::footer_gaps(&entries);
        }
    }
}

/// Manifest decoding (every version).
pub fn manifest_decode(data: &[u8]) {
    let _ = manifest::decode_manifest(data);
}

/// A store directory whose active segment holds a valid header followed by
/// arbitrary bytes: opening it, reading every call and verifying must not panic.
pub fn store_recovery(data: &[u8]) {
    let Ok(dir) = tempfile_dir() else { return };
    let m = Manifest {
        next_segment_id: 2,
        segments: vec![ManifestSegment { id: 1, state: SegmentState::Active }],
        ..Manifest::default()
    };
    if std::fs::write(dir.join("MANIFEST"), encode_manifest(&m)).is_err() {
        return;
    }
    let mut seg = segment::encode_header(&segment::new_header(1, 0)).to_vec();
    seg.extend_from_slice(data);
    if std::fs::write(dir.join("seg-0000000001.tlog"), seg).is_ok() {
        if let Ok(store) = crate::Store::open_read_only(&dir) {
            let snap = store.snapshot();
            let _ = snap.for_each_call(|call| {
                let _ = call.prompt();
                Ok(())
            });
        }
        let _ = crate::verify::verify_dir(&dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir =
        std::env::temp_dir().join(format!("trajlog-fuzz-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// JSON trace ingestion (gateway and SDK shapes, the exact-migration parser
/// and the SDK record mapping): a parsed trace exports and parses back to the
/// same tokens; an SDK record maps back to equal data.
pub fn trace_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(call) = crate::trace_json::parse_trace(text, 0.0) {
        let again = crate::trace_json::parse_trace(&crate::trace_json::export_call(&call), 0.0);
        match again {
            Ok(again) => {
                assert_eq!(again.prompt_token_ids, call.prompt_token_ids);
                assert_eq!(again.completion_token_ids, call.completion_token_ids);
            }
            Err(e) => panic!("an exported trace does not parse back: {e}"),
        }
    }
    let _ = crate::trace_json::parse_gateway_exact(text, 0.0);
    let t = crate::rllm::SdkTrace {
        trace_id: "t".into(),
        data: text.to_owned(),
        namespace: "n".into(),
        context_type: "llm_trace".into(),
        metadata: "{}".into(),
        created_at: 1.0,
        updated_at: 1.0,
        session_uids: vec![],
    };
    if let Ok(call) = crate::rllm::sdk_to_call(&t) {
        match crate::rllm::call_to_sdk(&call) {
            Ok(Some(back)) => {
                // Only where the input decodes as a whole (serde_json refuses
                // numbers beyond f64 that the stored text keeps verbatim).
                if let Ok(want) = serde_json::from_str::<serde_json::Value>(text) {
                    let got: serde_json::Value = serde_json::from_str(&back.data).unwrap_or_default();
                    assert!(crate::rllm::same_json(&got, &want), "an SDK record maps back to different data");
                }
            }
            other => panic!("an SDK call does not map back: {other:?}"),
        }
    }
}
