//! A segment's frames: scanning arbitrary bytes must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = trajlog::format::segment::decode_header(data);
    let _ = trajlog::segment::recovery::scan_frames(data);
    let _ = trajlog::format::frame::read_frame(data, 0);
});
