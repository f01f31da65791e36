//! JSON trace ingestion (gateway, SDK, exact migration, SDK records). The body is `trajlog::fuzzing::trace_json`, which
//! `cargo test` also runs over the committed corpus (tests/fuzz_replay.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| trajlog::fuzzing::trace_json(data));
