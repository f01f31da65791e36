//! Recovery: cut the active segment at every byte offset of its last records and
//! flip random bits in them. The reopened store must hold exactly a prefix of
//! what was appended, serve nothing corrupt, accept new appends without
//! resurrecting old bytes, and never panic.

mod common;

use common::*;
use std::fs;
use std::path::Path;
use trajlog::{Call, Durability, ErrorKind, Options, Store};
use trajlog_sim::Rng;

fn opts() -> Options {
    Options::default().durability(Durability::Buffered)
}

fn calls(n: usize) -> Vec<Call> {
    let mut rng = Rng::new(9);
    let mut ctx = rng.tokens(20);
    (0..n)
        .map(|i| {
            let completion = rng.tokens(6);
            let c = Call {
                trace_id: format!("t{i}"),
                session_id: "s".into(),
                timestamp: i as f64,
                prompt_token_ids: ctx.clone(),
                logprobs: Some(rng.logprobs(6)),
                completion_token_ids: completion.clone(),
                messages: Some(format!(r#"[{{"turn":{i}}}]"#).into_bytes()),
                ..Default::default()
            };
            ctx.extend_from_slice(&completion);
            ctx.extend(rng.tokens(3));
            c
        })
        .collect()
}

fn build(dir: &Path, calls: &[Call]) -> Vec<u64> {
    let store = Store::open(dir, opts()).unwrap();
    let mut ends = Vec::new();
    for c in calls {
        store.append_durable(c.clone()).unwrap();
        let snap = store.snapshot();
        ends.push(snap.segments().last().unwrap().data_bytes);
    }
    store.close().unwrap();
    ends
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Open `dir` and check it holds exactly `calls[..n]` for some n; returns n.
fn check_prefix(dir: &Path, calls: &[Call]) -> usize {
    let store = Store::open(dir, opts()).unwrap();
    let snap = store.snapshot();
    let n = snap.call_count();
    for (i, c) in calls.iter().enumerate() {
        match snap.get(&c.trace_id).unwrap() {
            Some(v) => {
                assert!(i < n, "call {i} present but only {n} calls: not a prefix");
                assert_same(&v, c);
            }
            None => assert!(i >= n, "call {i} missing from a store of {n}: not a prefix"),
        }
    }
    drop(snap);
    store.close().unwrap();
    n
}

#[test]
fn cut_at_every_offset_of_the_last_records() {
    let src = tempdir();
    let all = calls(8);
    let ends = build(src.path(), &all);
    let seg = "seg-0000000001.tlog";
    let full = fs::read(src.path().join(seg)).unwrap();
    let from = ends[4] as usize; // cut anywhere inside the last three records
    for cut in from..=full.len() {
        let work = tempdir();
        copy_dir(src.path(), work.path());
        let f = fs::OpenOptions::new().write(true).open(work.path().join(seg)).unwrap();
        f.set_len(cut as u64).unwrap();
        drop(f);
        let n = check_prefix(work.path(), &all);
        let expect = ends.iter().filter(|&&e| e as usize <= cut).count();
        assert_eq!(n, expect, "cut at {cut}");
        // New appends go after the good prefix, and nothing old comes back.
        let store = Store::open(work.path(), opts()).unwrap();
        let mut extra = all[7].clone();
        extra.trace_id = "new".into();
        extra.timestamp = 100.0;
        store.append_durable(extra.clone()).unwrap();
        store.close().unwrap();
        let mut expect_calls = all[..n].to_vec();
        expect_calls.push(extra);
        let store = Store::open_read_only(work.path()).unwrap();
        let snap = store.snapshot();
        assert_eq!(snap.call_count(), n + 1, "cut at {cut}: old bytes resurrected or lost");
        for c in &expect_calls {
            assert_same(&snap.get(&c.trace_id).unwrap().unwrap(), c);
        }
        assert!(trajlog::verify::verify_dir(work.path()).unwrap().problems.is_empty());
    }
}

#[test]
fn flipped_bits_in_the_tail_never_serve_corrupt_records() {
    let src = tempdir();
    let all = calls(8);
    let ends = build(src.path(), &all);
    let seg = "seg-0000000001.tlog";
    let full = fs::read(src.path().join(seg)).unwrap();
    let from = ends[3] as usize;
    let mut rng = Rng::new(77);
    for _ in 0..300 {
        let pos = rng.range(from, full.len() - 1);
        let bit = rng.range(0, 7);
        let work = tempdir();
        copy_dir(src.path(), work.path());
        let mut bytes = full.clone();
        bytes[pos] ^= 1 << bit;
        fs::write(work.path().join(seg), &bytes).unwrap();
        let damaged = ends.iter().position(|&e| e as usize > pos).unwrap();
        let start = ends[damaged - 1] as usize;
        let body_len = u32::from_le_bytes(full[start..start + 4].try_into().unwrap()) as usize;
        // Damage before the last record: valid records follow it, so it is
        // not a torn tail — open refuses (cutting there would drop them) and
        // leaves the file as it was. (A flip that makes the frame look longer
        // can hide the records after it: then it reads as a torn tail.)
        if let Err(e) = Store::open(work.path(), opts()) {
            assert!(e.message().contains("valid records follow"), "flip at {pos}: {e}");
            assert!(damaged < all.len() - 1, "flip at {pos} in the last record refused: {e}");
            assert_eq!(fs::read(work.path().join(seg)).unwrap(), bytes, "a refused open changed the segment");
            continue;
        }
        let n = check_prefix(work.path(), &all);
        // Everything before the damaged record survives. A flip in a frame's
        // zero padding (not covered by the CRC) damages no data.
        if pos >= start + 8 + body_len {
            assert_eq!(n, all.len(), "flip in padding at {pos} lost records");
            continue;
        }
        // Recovery keeps exactly the records before the damaged one: none lost
        // before it, the damaged one never served.
        assert_eq!(n, damaged, "flip at {pos} (bit {bit}): kept {n} records, damaged record is #{damaged}");
    }
}

#[test]
fn corrupt_frame_in_a_sealed_segment_is_an_error_never_data() {
    let dir = tempdir();
    let all = calls(6);
    let store = Store::open(dir.path(), opts()).unwrap();
    for c in &all {
        store.append(c.clone()).unwrap();
    }
    store.roll().unwrap();
    store.close().unwrap();
    let path = dir.path().join("seg-0000000001.tlog");
    let mut bytes = fs::read(&path).unwrap();
    // Flip a bit inside the completion column of the third record.
    let snap = Store::open_read_only(dir.path()).unwrap().snapshot();
    let loc = snap.get("t2").unwrap().unwrap().loc;
    drop(snap);
    bytes[loc.offset as usize + 8 + 104 + 4] ^= 0x10;
    fs::write(&path, &bytes).unwrap();
    let store = Store::open_read_only(dir.path()).unwrap();
    let snap = store.snapshot();
    let Err(err) = snap.get("t2") else { panic!("a corrupt record must be an error") };
    assert!(matches!(err.kind(), ErrorKind::Corrupt { offset, .. } if *offset == loc.offset), "{err}");
    // Reading t4 needs t2 as its prefix-delta ancestor: also an error, not wrong data.
    assert!(snap.get("t4").unwrap().unwrap().prompt().is_err());
    assert_same(&snap.get("t1").unwrap().unwrap(), &all[1]);
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.iter().any(|p| p.offset == loc.offset && p.what.contains("crc")), "{report:?}");
}

#[test]
fn garbage_directory_contents_are_errors_not_panics() {
    let mut rng = Rng::new(5);
    for len in [0usize, 1, 7, 24, 40, 64, 100, 500] {
        let dir = tempdir();
        let garbage: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        fs::write(dir.path().join("MANIFEST"), &garbage).unwrap();
        let err = Store::open(dir.path(), opts()).err().expect("garbage manifest");
        assert!(matches!(err.kind(), ErrorKind::Corrupt { .. }), "{err}");
    }
    // A valid manifest pointing at a garbage segment.
    let src = tempdir();
    build(src.path(), &calls(2));
    for len in [0usize, 10, 63, 64, 65, 200] {
        let work = tempdir();
        copy_dir(src.path(), work.path());
        let garbage: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        fs::write(work.path().join("seg-0000000001.tlog"), &garbage).unwrap();
        assert!(Store::open(work.path(), opts()).is_err());
        assert!(Store::open_read_only(work.path()).is_err());
    }
}

#[test]
fn crash_between_seal_and_manifest_update_recovers() {
    for keep_orphan in [false, true] {
        let dir = tempdir();
        let all = calls(6);
        let store = Store::open(dir.path(), opts()).unwrap();
        for c in &all[..3] {
            store.append_durable(c.clone()).unwrap();
        }
        let old_manifest = fs::read(dir.path().join("MANIFEST")).unwrap();
        store.roll().unwrap();
        store.close().unwrap();
        // The disk as a crash after sealing segment 1 (and maybe creating
        // segment 2) but before the manifest was replaced would leave it.
        fs::write(dir.path().join("MANIFEST"), &old_manifest).unwrap();
        if !keep_orphan {
            fs::remove_file(dir.path().join("seg-0000000002.tlog")).unwrap();
        }
        let store = Store::open(dir.path(), opts()).unwrap();
        for c in &all[3..] {
            store.append_durable(c.clone()).unwrap();
        }
        store.close().unwrap();
        assert_eq!(check_prefix(dir.path(), &all), all.len(), "keep_orphan={keep_orphan}");
        assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
    }
}

/// A file system may store written zero blocks as holes (ZFS with
/// compression). An active segment whose last record ends in zeros stored as
/// a hole is read whole, not cut where its data seems to end: a writable open
/// keeps the record.
#[test]
fn a_record_ending_in_a_hole_is_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = calls(3);
    last.push(Call {
        trace_id: "zeros".into(),
        session_id: "z".into(),
        timestamp: 9.0,
        prompt_token_ids: vec![1, 2],
        completion_token_ids: vec![3],
        // The last field of the record: opaque bytes, here all zero.
        routing_matrices: Some(vec![0; 16384]),
        ..Default::default()
    });
    build(dir.path(), &last);
    let seg = dir.path().join("seg-0000000001.tlog");
    let end = fs::metadata(&seg).unwrap().len();
    let bytes = fs::read(&seg).unwrap();
    let zeros_from = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1) as u64;
    let hole_from = zeros_from.div_ceil(4096) * 4096;
    assert!(hole_from + 4096 <= end, "the last record does not end in zero blocks: {zeros_from} of {end}");
    // Preallocated room after it, then the zero blocks and the room punched
    // out: the file's last data region now ends inside the record.
    let file = fs::OpenOptions::new().write(true).open(&seg).unwrap();
    file.set_len(end + (1 << 20)).unwrap();
    use std::os::fd::AsRawFd;
    let len = (end + (1 << 20) - hole_from) as libc::off_t;
    // SAFETY: fallocate on an open descriptor, within the file.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            hole_from as libc::off_t,
            len,
        )
    };
    if rc != 0 {
        eprintln!("skipped: this file system cannot punch holes");
        return;
    }
    drop(file);
    assert_eq!(fs::read(&seg).unwrap()[..end as usize], bytes[..], "punching changed no byte");
    let store = Store::open(dir.path(), opts()).unwrap();
    assert!(store.recovery_report().events.is_empty(), "{:?}", store.recovery_report().events);
    for c in &last {
        assert_eq!(&store.snapshot().get(&c.trace_id).unwrap().unwrap().to_call().unwrap(), c);
    }
    store.close().unwrap();
}
