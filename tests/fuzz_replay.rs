//! Replays every committed fuzz input — the seed corpora (`fuzz/corpus/<target>/`)
//! and the minimized crashes (`fuzz/regressions/<target>/`) — through the
//! exact bodies of the fuzz targets (`trajlog::fuzzing`), on the stable
//! toolchain. A crash found by `scripts/fuzz.sh` becomes a regression test by
//! copying its input into `fuzz/regressions/<target>/`.
//!
//! `TRAJLOG_WRITE_CORPUS=1 cargo test --test fuzz_replay` (re)writes the seed
//! corpora from the committed store fixtures and sample traces.

use std::path::{Path, PathBuf};
use trajlog::format::frame::{read_frame, FrameRead};
use trajlog::format::segment::HEADER_BYTES;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn every_committed_fuzz_input_runs_clean() {
    if std::env::var_os("TRAJLOG_WRITE_CORPUS").is_some() {
        write_corpus();
    }
    for (name, body) in trajlog::fuzzing::TARGETS {
        let corpus = inputs(&fuzz_dir().join("corpus").join(name));
        assert!(!corpus.is_empty(), "fuzz/corpus/{name} has no seed inputs");
        let regressions = inputs(&fuzz_dir().join("regressions").join(name));
        for path in corpus.iter().chain(&regressions) {
            let data = std::fs::read(path).expect("read fuzz input");
            let outcome = std::panic::catch_unwind(|| body(&data));
            assert!(outcome.is_ok(), "{name} panicked on {}", path.display());
        }
    }
}

fn put(target: &str, name: &str, bytes: &[u8]) {
    let dir = fuzz_dir().join("corpus").join(target);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join(name), bytes).expect("write seed");
}

/// Seeds cut from the committed store fixtures (real bytes of every format).
fn write_corpus() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for store in ["store-v1", "store-v2", "store-v3", "store-v6", "store-v18"] {
        let dir = fixtures.join(store);
        put("manifest_decode", &format!("{store}-MANIFEST"), &std::fs::read(dir.join("MANIFEST")).expect("manifest"));
        for seg in inputs(&dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "tlog")) {
            let bytes = std::fs::read(&seg).expect("segment");
            let stem =
                format!("{store}-{}", seg.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
            put("segment_scan", &stem, &bytes);
            put("footer_decode", &stem, &bytes);
            if bytes.len() as u64 > HEADER_BYTES {
                put("store_recovery", &stem, &bytes[HEADER_BYTES as usize..]);
            }
            let mut at = HEADER_BYTES;
            let mut i = 0;
            while let Ok(FrameRead::Frame { body, next }) = read_frame(&bytes, at) {
                put("record_decode", &format!("{stem}-frame{i}"), body);
                at = next;
                i += 1;
            }
        }
    }
    let traces = [
        r#"{"trace_id":"t1","session_id":"task:0","timestamp":1.5,"model":"m","prompt_token_ids":[1,2,3],"completion_token_ids":[4,5],"logprobs":[-0.5,-0.25],"messages":[{"role":"user","content":"hi"}],"finish_reason":"stop","latency_ms":3,"metadata":{"a":null}}"#,
        r#"{"trace_id":"t2","session_name":"task:1:0","input":{"messages":[],"prompt_token_ids":[7,8]},"output":{"output_token_ids":[9],"rollout_logprobs":[-0.10000000149011612],"finish_reason":"length","message":{}}}"#,
        r#"{"output":{"id":"c1","prompt_token_ids":[1],"choices":[{"provider_specific_fields":{"token_ids":[2,3]},"logprobs":{"content":[{"logprob":-1.5},{"logprob":-0.5}]}}]},"model":"m"}"#,
        r#"{"trace_id":"t3","session_id":"s","prompt_token_ids":[4294967295],"completion_token_ids":[],"logprobs":[-0.1]}"#,
    ];
    for (i, t) in traces.iter().enumerate() {
        put("trace_json", &format!("trace{i}.json"), t.as_bytes());
    }
}
