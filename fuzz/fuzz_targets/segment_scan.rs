//! Segment header, frame scan and frame reads over arbitrary bytes. The body is `trajlog::fuzzing::segment_scan`, which
//! `cargo test` also runs over the committed corpus (tests/fuzz_replay.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| trajlog::fuzzing::segment_scan(data));
