//! Manifest decoding. The body is `trajlog::fuzzing::manifest_decode`, which
//! `cargo test` also runs over the committed corpus (tests/fuzz_replay.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| trajlog::fuzzing::manifest_decode(data));
