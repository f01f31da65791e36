//! Footer and trailer decoding must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(t) = trajlog::format::segment::read_trailer(data) {
        let _ = trajlog::format::segment::decode_footer(data, &t);
    }
});
