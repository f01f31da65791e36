//! JSON trace ingestion must never panic, and accepted traces export exactly.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(call) = trajlog::trace_json::parse_trace(text, 0.0) {
        let again = trajlog::trace_json::parse_trace(&trajlog::trace_json::export_call(&call), 0.0)
            .expect("an exported trace parses");
        assert_eq!(again.prompt_token_ids, call.prompt_token_ids);
        assert_eq!(again.completion_token_ids, call.completion_token_ids);
    }
});
