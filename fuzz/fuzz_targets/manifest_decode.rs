//! Manifest decoding must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = trajlog::format::manifest::decode_manifest(data);
});
