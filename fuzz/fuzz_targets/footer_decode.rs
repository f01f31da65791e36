//! Footer index and trailer decoding. The body is `trajlog::fuzzing::footer_decode`, which
//! `cargo test` also runs over the committed corpus (tests/fuzz_replay.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| trajlog::fuzzing::footer_decode(data));
