//! Recovery modes, never silent (issue 12, item 1): a bit flipped in the
//! middle of the active segment and of a sealed one, a torn tail, a zeroed
//! region and a damaged footer, under each `RecoveryMode` — which records are
//! readable, what the `RecoveryReport` says, and what is on disk afterwards.

mod common;

use common::{assert_same, chained_calls, files, tempdir};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use trajlog::format::manifest::{decode_manifest, SegmentState};
use trajlog::format::segment::read_trailer;
use trajlog::{Call, ErrorKind, Loc, Options, RecoveryEvent, RecoveryEventKind, RecoveryMode, RecoveryReport, Store};

use RecoveryEventKind::{CorruptedRecordSkipped, FooterRebuilt, SkippedEarlier, TornTailCut};
use RecoveryMode::{AbsoluteConsistency as Absolute, SkipCorrupted as Skip, TolerateTornTail as Tolerate};

const MODES: [RecoveryMode; 3] = [Tolerate, Absolute, Skip];

fn opts(mode: RecoveryMode) -> Options {
    Options::default().recovery(mode)
}

/// Sessions s0 and s1 in segment 1 (sealed by a roll), s2 and s3 in segment 2
/// (active), four chained calls each (every call is the prefix-delta parent
/// of the next one of its session). Returns the calls and where each is.
fn build(dir: &Path) -> (Vec<Call>, HashMap<String, Loc>) {
    let all = chained_calls(4, 4);
    let store = Store::open(dir, Options::default()).expect("open");
    for c in &all[..8] {
        store.append(c.clone()).expect("append");
    }
    store.roll().expect("roll");
    for c in &all[8..] {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    let snap = store.snapshot();
    let locs = all.iter().map(|c| (c.trace_id.clone(), snap.get(&c.trace_id).expect("get").expect("present").loc));
    let locs = locs.collect();
    drop(snap);
    store.close().expect("close");
    (all, locs)
}

fn segment(dir: &Path, id: u64) -> PathBuf {
    trajlog::storage::segment_path(dir, id)
}

/// Flip one bit inside the body of the record at `loc`; returns the file's new bytes.
fn flip(dir: &Path, loc: Loc) -> Vec<u8> {
    let path = segment(dir, loc.segment);
    let mut bytes = fs::read(&path).expect("read");
    bytes[loc.offset as usize + 300] ^= 0x08;
    fs::write(&path, &bytes).expect("write");
    bytes
}

/// The store serves exactly this: the `absent` calls are not indexed, the
/// `refused` ones are an error naming a segment when read (themselves damaged
/// or built on a damaged parent), every other call reads back bit for bit.
fn check_reads(store: &Store, all: &[Call], absent: &[&str], refused: &[&str]) {
    let snap = store.snapshot();
    for c in all {
        let id = c.trace_id.as_str();
        match snap.get(id) {
            Ok(None) => assert!(absent.contains(&id), "{id} is missing"),
            Err(e) => {
                assert!(refused.contains(&id), "{id} refused: {e}");
                assert!(matches!(e.kind(), ErrorKind::Corrupt { .. }), "{e}");
            }
            Ok(Some(v)) => {
                assert!(!absent.contains(&id), "{id} should have been skipped");
                match v.to_call() {
                    Ok(_) => {
                        assert!(!refused.contains(&id), "{id} should be refused");
                        assert_same(&v, c);
                    }
                    Err(e) => {
                        assert!(refused.contains(&id), "{id} refused: {e}");
                        assert!(matches!(e.kind(), ErrorKind::Corrupt { .. }), "{e}");
                    }
                }
            }
        }
    }
    assert_eq!(snap.call_count(), all.len() - absent.len());
}

fn event(
    kind: RecoveryEventKind,
    dir: &Path,
    seg: u64,
    offset: u64,
    len: u64,
) -> (RecoveryEventKind, PathBuf, u64, u64, u64) {
    (kind, segment(dir, seg), seg, offset, len)
}

/// The report's events without their `what` text.
fn events(r: &RecoveryReport) -> Vec<(RecoveryEventKind, PathBuf, u64, u64, u64)> {
    r.events.iter().map(|e: &RecoveryEvent| (e.kind, e.path.clone(), e.segment, e.offset, e.len)).collect()
}

/// Every file but the lock, with its bytes.
fn data_files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    files(dir)
}

fn refused(result: trajlog::Result<Store>) -> trajlog::Error {
    match result {
        Ok(_) => panic!("the open must refuse"),
        Err(e) => e,
    }
}

fn assert_corrupt_at(e: &trajlog::Error, path: &Path, offset: u64) {
    match e.kind() {
        ErrorKind::Corrupt { path: p, offset: o } => assert_eq!((p.as_path(), *o), (path, offset), "{e}"),
        k => panic!("{k:?}: {e}"),
    }
}

fn manifest_states(dir: &Path) -> Vec<(u64, SegmentState)> {
    let m = decode_manifest(&fs::read(dir.join("MANIFEST")).expect("manifest")).expect("decode");
    m.segments.iter().map(|s| (s.id, s.state)).collect()
}

#[test]
fn a_flipped_bit_in_the_middle_of_the_active_segment_under_each_mode() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let (bad, child) = (locs["t2-2"], locs["t2-3"]);
        assert_eq!(bad.segment, 2);
        let damaged = flip(d, bad);
        let seg2 = segment(d, 2);
        let before = data_files(d);
        match mode {
            Tolerate => {
                for e in [refused(Store::open(d, opts(mode))), refused(Store::open_read_only(d))] {
                    assert_corrupt_at(&e, &seg2, bad.offset);
                    assert!(e.message().contains("5 valid records follow it in segment 2"), "{e}");
                    assert!(e.message().contains("skip-corrupted"), "{e}");
                }
                assert_eq!(data_files(d), before, "a refused open changed the files");
            }
            Absolute => {
                for e in [refused(Store::open(d, opts(mode))), refused(Store::open_read_only_with(d, mode))] {
                    assert_corrupt_at(&e, &seg2, bad.offset);
                    assert!(e.message().contains("recovery mode absolute refused"), "{e}");
                    assert!(e.message().contains("5 valid records follow"), "{e}");
                }
                assert_eq!(data_files(d), before, "a refused open changed the files");
            }
            Skip => {
                let skipped = vec![event(CorruptedRecordSkipped, d, 2, bad.offset, child.offset - bad.offset)];
                // Read-only: skipped in its view only; nothing written.
                let ro = Store::open_read_only_with(d, Skip).expect("read-only open");
                let report = ro.recovery_report();
                assert!(report.read_only && report.mode == Skip);
                assert_eq!(events(&report), skipped);
                check_reads(&ro, &all, &["t2-2"], &["t2-3"]);
                drop(ro);
                assert_eq!(data_files(d), before, "a read-only open changed the files");

                let store = Store::open(d, opts(Skip)).expect("skip-corrupted opens");
                let report = store.recovery_report();
                assert_eq!(events(&report), skipped);
                assert_eq!(report.count(CorruptedRecordSkipped), 1);
                // What the CLI prints: one line per event, then a summary.
                let line = report.events[0].to_string();
                assert!(
                    line.starts_with(&format!(
                        "skipped {} damaged bytes at offset {} of segment 2",
                        child.offset - bad.offset,
                        bad.offset
                    )),
                    "{line}"
                );
                assert!(report.to_string().contains("1 damaged regions skipped"), "{report}");
                assert!(store.snapshot().damage().iter().any(|p| p.path == seg2 && p.offset == bad.offset));
                check_reads(&store, &all, &["t2-2"], &["t2-3"]);
                // On disk: segment 2 sealed with the damaged bytes in place,
                // appends go to segment 3.
                let now = fs::read(&seg2).expect("read");
                let trailer = read_trailer(&now).expect("segment 2 is sealed");
                assert_eq!(trailer.footer_offset, damaged.len() as u64);
                assert_eq!(&now[..damaged.len()], &damaged[..], "the frames, damaged ones included, are untouched");
                assert_eq!(
                    manifest_states(d),
                    vec![(1, SegmentState::Sealed), (2, SegmentState::Sealed), (3, SegmentState::Active)]
                );
                let new = Call {
                    trace_id: "new".into(),
                    session_id: "s9".into(),
                    prompt_token_ids: vec![7; 40],
                    ..Default::default()
                };
                store.append_durable(new.clone()).expect("append");
                let loc = store.snapshot().get("new").expect("get").expect("present").loc;
                assert_eq!(loc.segment, 3);
                store.close().expect("close");
                let sealed = fs::read(&seg2).expect("read");

                // Reopens are stable in every mode that opens: the region is
                // reported as skipped earlier, never skipped again.
                let mut with_new = all.clone();
                with_new.push(new);
                for again in [Tolerate, Skip] {
                    let store = Store::open(d, opts(again)).expect("reopen");
                    assert_eq!(
                        events(&store.recovery_report()),
                        vec![event(SkippedEarlier, d, 2, bad.offset, child.offset - bad.offset)]
                    );
                    check_reads(&store, &with_new, &["t2-2"], &["t2-3"]);
                    store.close().expect("close");
                    let ro = Store::open_read_only(d).expect("read-only");
                    assert_eq!(ro.recovery_report().count(SkippedEarlier), 1);
                    assert_eq!(fs::read(&seg2).expect("read"), sealed);
                }
                // The damaged bytes are still there: absolute consistency
                // refuses, and verify names them.
                let e = refused(Store::open(d, opts(Absolute)));
                assert_corrupt_at(&e, &seg2, bad.offset);
                let v = trajlog::verify::verify_dir(d).expect("verify");
                assert!(
                    v.problems
                        .iter()
                        .any(|p| p.path == seg2 && p.offset == bad.offset && p.what.contains("skip-corrupted")),
                    "{:?}",
                    v.problems
                );
            }
        }
    }
}

#[test]
fn a_flipped_bit_in_the_middle_of_a_sealed_segment_under_each_mode() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let (bad, child) = (locs["t0-2"], locs["t0-3"]);
        assert_eq!(bad.segment, 1);
        flip(d, bad);
        let seg1 = segment(d, 1);
        let before = data_files(d);
        match mode {
            Tolerate => {
                // Footers are trusted at open: the damage is found on read.
                let store = Store::open(d, opts(mode)).expect("opens");
                assert!(store.recovery_report().is_clean(), "{:?}", store.recovery_report());
                check_reads(&store, &all, &[], &["t0-2", "t0-3"]);
                let e = store.snapshot().get("t0-2").map(|v| v.map(|v| v.loc)).expect_err("damaged");
                assert_corrupt_at(&e, &seg1, bad.offset);
                store.close().expect("close");
                assert_eq!(data_files(d), before);
            }
            Absolute => {
                for e in [refused(Store::open(d, opts(mode))), refused(Store::open_read_only_with(d, mode))] {
                    assert_corrupt_at(&e, &seg1, bad.offset);
                    assert!(e.message().contains("5 valid records follow"), "{e}");
                }
                assert_eq!(data_files(d), before, "a refused open changed the files");
            }
            Skip => {
                let skipped = vec![event(CorruptedRecordSkipped, d, 1, bad.offset, child.offset - bad.offset)];
                for _ in 0..2 {
                    // Sealed segments are never written: every skip-corrupted
                    // open finds and reports the damage again.
                    let store = Store::open(d, opts(Skip)).expect("opens");
                    assert_eq!(events(&store.recovery_report()), skipped);
                    check_reads(&store, &all, &["t0-2"], &["t0-3"]);
                    store.close().expect("close");
                    assert_eq!(data_files(d), before);
                    let ro = Store::open_read_only_with(d, Skip).expect("read-only");
                    assert_eq!(events(&ro.recovery_report()), skipped);
                }
                // The default mode reads the footer again: the record is back,
                // as an error on read.
                let store = Store::open(d, Options::default()).expect("opens");
                check_reads(&store, &all, &[], &["t0-2", "t0-3"]);
            }
        }
    }
}

#[test]
fn a_torn_tail_under_each_mode() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let last = locs["t3-3"];
        let seg2 = segment(d, 2);
        // Cut inside the last record, after a non-zero byte (the report
        // counts the torn bytes up to the last non-zero one).
        let full = fs::read(&seg2).expect("read");
        let cut = (last.offset as usize + 100..full.len()).find(|&i| full[i - 1] != 0).expect("a non-zero byte");
        let torn = cut as u64 - last.offset;
        let f = fs::OpenOptions::new().write(true).open(&seg2).expect("open");
        f.set_len(cut as u64).expect("cut");
        drop(f);
        let before = data_files(d);
        // Read-only opens in every mode leave the tail out, unreported.
        let ro = Store::open_read_only_with(d, mode).expect("read-only open");
        assert!(ro.recovery_report().is_clean(), "{:?}", ro.recovery_report());
        check_reads(&ro, &all[..15], &[], &[]);
        drop(ro);
        assert_eq!(data_files(d), before);
        match mode {
            Absolute => {
                let e = refused(Store::open(d, opts(mode)));
                assert_corrupt_at(&e, &seg2, last.offset);
                assert!(e.message().contains("torn tail"), "{e}");
                assert_eq!(data_files(d), before, "a refused open changed the files");
            }
            Tolerate | Skip => {
                let store = Store::open(d, opts(mode)).expect("opens");
                assert_eq!(events(&store.recovery_report()), vec![event(TornTailCut, d, 2, last.offset, torn)]);
                check_reads(&store, &all[..15], &[], &[]);
                assert!(store.snapshot().get("t3-3").expect("get").is_none());
                store.close().expect("close");
                assert_eq!(fs::metadata(&seg2).expect("stat").len(), last.offset, "cut at the last valid frame");
                let store = Store::open(d, opts(mode)).expect("reopen");
                assert!(store.recovery_report().is_clean(), "a cut is reported once");
            }
        }
    }
}

#[test]
fn a_zeroed_region_with_valid_frames_after_it_is_damage_not_the_end_of_the_data() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let (bad, child) = (locs["t2-2"], locs["t2-3"]);
        let seg2 = segment(d, 2);
        let mut bytes = fs::read(&seg2).expect("read");
        bytes[bad.offset as usize..child.offset as usize].fill(0);
        fs::write(&seg2, &bytes).expect("write");
        let before = data_files(d);
        if mode == Skip {
            let store = Store::open(d, opts(mode)).expect("opens");
            assert_eq!(
                events(&store.recovery_report()),
                vec![event(CorruptedRecordSkipped, d, 2, bad.offset, child.offset - bad.offset)]
            );
            check_reads(&store, &all, &["t2-2"], &["t2-3"]);
            continue;
        }
        // Before, the zero length word read as the end of the data and the
        // five records after it were cut off without a word.
        let e = refused(Store::open(d, opts(mode)));
        assert_corrupt_at(&e, &seg2, bad.offset);
        assert!(e.message().contains("5 valid records follow"), "{e}");
        assert_eq!(data_files(d), before, "a refused open changed the files");
    }
}

#[test]
fn a_damaged_footer_is_rebuilt_unless_a_frame_is_damaged_too() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let seg1 = segment(d, 1);
        let mut bytes = fs::read(&seg1).expect("read");
        let trailer = read_trailer(&bytes).expect("sealed");
        let footer_bytes = bytes.len() as u64 - trailer.footer_offset;
        bytes[trailer.footer_offset as usize + 40] ^= 0x10;
        fs::write(&seg1, &bytes).expect("write");
        let rebuilt = event(FooterRebuilt, d, 1, trailer.footer_offset, footer_bytes);
        if mode == Absolute {
            let e = refused(Store::open(d, opts(mode)));
            assert_corrupt_at(&e, &seg1, trailer.footer_offset);
        } else {
            let store = Store::open(d, opts(mode)).expect("opens");
            assert_eq!(events(&store.recovery_report()), vec![rebuilt.clone()]);
            check_reads(&store, &all, &[], &[]);
            store.close().expect("close");
        }
        // A damaged frame as well: the rebuilt index would lose it.
        let bad = locs["t0-2"];
        flip(d, bad);
        let before = data_files(d);
        if mode == Skip {
            let store = Store::open(d, opts(mode)).expect("opens");
            let skipped = event(CorruptedRecordSkipped, d, 1, bad.offset, locs["t0-3"].offset - bad.offset);
            assert_eq!(events(&store.recovery_report()), vec![rebuilt, skipped]);
            check_reads(&store, &all, &["t0-2"], &["t0-3"]);
        } else {
            let e = refused(Store::open(d, opts(mode)));
            assert_corrupt_at(&e, &seg1, if mode == Absolute { trailer.footer_offset } else { bad.offset });
            assert_eq!(data_files(d), before, "a refused open changed the files");
        }
    }
}

#[test]
fn recovery_modes_parse_and_print() {
    for mode in MODES {
        assert_eq!(mode.to_string().parse::<RecoveryMode>().expect("parse"), mode);
    }
    assert_eq!("absolute".parse::<RecoveryMode>().expect("parse"), Absolute);
    assert_eq!(RecoveryMode::default(), Tolerate);
    assert_eq!(Options::default().recovery, Tolerate);
    let e = "skip".parse::<RecoveryMode>().expect_err("unknown");
    assert!(matches!(e.kind(), ErrorKind::InvalidInput { .. }) && e.message().contains("skip-corrupted"), "{e}");
}

/// A sealed segment whose trailer is damaged has no footer to go by: its
/// index is rebuilt from the frames, and the footer's bytes right after the
/// last frame end the scan. Damage that also hits the last frame (or the
/// footer's first bytes, so that the frames' end cannot be told) must not
/// pass for that end: before, the last frame dropped out of the rebuilt
/// index unreported.
#[test]
fn a_damaged_trailer_never_hides_a_damaged_last_frame() {
    for mode in MODES {
        let dir = tempdir();
        let d = dir.path();
        let (all, locs) = build(d);
        let seg1 = segment(d, 1);
        let (last_id, last) = locs
            .iter()
            .filter(|(_, l)| l.segment == 1)
            .max_by_key(|(_, l)| l.offset)
            .map(|(id, l)| (id.clone(), *l))
            .expect("segment 1 holds calls");
        let mut bytes = fs::read(&seg1).expect("read");
        let (n, footer) = (bytes.len() as u64, read_trailer(&bytes).expect("sealed").footer_offset);
        // What `trajlog verify` says of segment 1: (offset, what).
        let verified = || -> Vec<(u64, String)> {
            let v = trajlog::verify::verify_dir(d).expect("verify");
            v.problems.into_iter().filter(|p| p.path == seg1).map(|p| (p.offset, p.what)).collect()
        };
        // The trailer alone: the footer's magic ends the frames, nothing is lost.
        bytes[n as usize - 10] ^= 0x01;
        fs::write(&seg1, &bytes).expect("write");
        let problems = verified();
        assert_eq!(problems.iter().map(|p| p.0).collect::<Vec<_>>(), [n], "{problems:?}");
        if mode == Absolute {
            assert!(matches!(refused(Store::open(d, opts(mode))).kind(), ErrorKind::Corrupt { .. }));
        } else {
            let store = Store::open(d, opts(mode)).expect("opens");
            assert_eq!(events(&store.recovery_report()), vec![event(FooterRebuilt, d, 1, footer, n - footer)]);
            check_reads(&store, &all, &[], &[]);
            store.close().expect("close");
        }
        // The last frame too: damage, not the footer.
        flip(d, last);
        let problems = verified();
        assert!(problems.iter().any(|p| p.0 == last.offset && p.1.contains("up to the footer")), "{problems:?}");
        let before = data_files(d);
        if mode == Skip {
            let store = Store::open(d, opts(mode)).expect("opens");
            let skipped = event(CorruptedRecordSkipped, d, 1, last.offset, footer - last.offset);
            assert_eq!(events(&store.recovery_report()), vec![event(FooterRebuilt, d, 1, footer, n - footer), skipped]);
            check_reads(&store, &all, &[last_id.as_str()], &[]);
            store.close().expect("close");
        } else {
            let e = refused(Store::open(d, opts(mode)));
            if mode == Tolerate {
                assert_corrupt_at(&e, &seg1, last.offset);
                assert!(e.message().contains("footer at offset"), "{e}");
            }
            assert_eq!(data_files(d), before, "a refused open changed the files");
        }
        // And the footer's magic: where the frames end cannot be told.
        let mut bytes = fs::read(&seg1).expect("read");
        bytes[footer as usize] ^= 0x01;
        fs::write(&seg1, &bytes).expect("write");
        let problems = verified();
        assert!(problems.iter().any(|p| p.0 == last.offset && p.1.contains("cannot be told")), "{problems:?}");
        if mode == Skip {
            let store = Store::open(d, opts(mode)).expect("opens");
            let rest = n - last.offset;
            assert_eq!(
                events(&store.recovery_report()),
                vec![
                    event(FooterRebuilt, d, 1, last.offset, rest),
                    event(CorruptedRecordSkipped, d, 1, last.offset, rest)
                ]
            );
            check_reads(&store, &all, &[last_id.as_str()], &[]);
        } else {
            let e = refused(Store::open(d, opts(mode)));
            if mode == Tolerate {
                assert_corrupt_at(&e, &seg1, last.offset);
                assert!(e.message().contains("cannot be told"), "{e}");
            }
        }
    }
}
