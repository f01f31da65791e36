//! Record bodies: decoding arbitrary bytes must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Bodies live 8-aligned in a mapping; copy to an aligned buffer.
    let mut buf = vec![0u64; data.len().div_ceil(8)];
    let bytes: &mut [u8] = &mut bytemuck_cast(&mut buf)[..data.len()];
    bytes.copy_from_slice(data);
    let _ = trajlog::format::record::decode_call(bytes);
    let _ = trajlog::format::record::decode_annotation(bytes);
});

fn bytemuck_cast(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * 8) }
}
