//! Recovery of a store directory whose segment holds arbitrary bytes: opening
//! it must return an error or a store, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = trajlog::format::manifest::Manifest {
        next_segment_id: 2,
        segments: vec![trajlog::format::manifest::ManifestSegment {
            id: 1,
            state: trajlog::format::manifest::SegmentState::Active,
        }],
    };
    std::fs::write(dir.path().join("MANIFEST"), trajlog::format::manifest::encode_manifest(&m)).expect("write");
    // A valid header followed by the fuzz input keeps the fuzzer on the frames.
    let mut seg = trajlog::format::segment::encode_header(&trajlog::format::segment::new_header(1, 0)).to_vec();
    seg.extend_from_slice(data);
    std::fs::write(dir.path().join("seg-0000000001.tlog"), seg).expect("write");
    if let Ok(store) = trajlog::Store::open_read_only(dir.path()) {
        let snap = store.snapshot();
        let _ = snap.for_each_call(|call| {
            let _ = call.prompt();
            Ok(())
        });
    }
    let _ = trajlog::verify::verify_dir(dir.path());
});
