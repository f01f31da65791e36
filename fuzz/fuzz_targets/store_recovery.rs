//! Recovery of a store directory whose segment holds arbitrary bytes. The body is `trajlog::fuzzing::store_recovery`, which
//! `cargo test` also runs over the committed corpus (tests/fuzz_replay.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| trajlog::fuzzing::store_recovery(data));
