//! What trajlog does when files are damaged or missing, or ids are reused
//! (issue "No data lost, no bad value stored"): open refuses with a clear
//! error or serves every intact record exactly; nothing it did not create is
//! deleted; damage stays confined to the records it touches.

mod common;

use common::{assert_all, assert_same, build, chained_calls as calls, data_files, small_segments, tempdir};
use std::fs;
use std::path::{Path, PathBuf};
use trajlog::{Call, CompactOptions, ErrorKind, Options, Store, Target};

/// A store in `dir` holding `calls` (appended, not yet flushed).
fn filled(dir: &Path, calls: &[Call], options: Options) -> Store {
    let store = Store::open(dir, options).expect("open");
    for c in calls {
        store.append(c.clone()).expect("append");
    }
    store
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "tlog"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_missing_manifest_is_refused_and_repair_rebuilds_it() {
    let dir = tempdir();
    let all = build(dir.path());
    fs::remove_file(dir.path().join("MANIFEST")).expect("remove manifest");
    let before = data_files(dir.path());
    assert!(before.keys().any(|p| p.extension().is_some_and(|e| e == "parquet")));

    let err = Store::open(dir.path(), small_segments()).err().expect("writable open must refuse");
    assert!(matches!(err.kind(), ErrorKind::Corrupt { .. }), "{err}");
    assert!(err.message().contains("no MANIFEST") && err.message().contains("trajlog repair"), "{err}");
    let err = Store::open_read_only(dir.path()).err().expect("read-only open must refuse");
    assert!(err.message().contains("trajlog repair"), "{err}");
    assert_eq!(data_files(dir.path()), before, "a refused open changed the files");
    let report = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(!report.problems.is_empty());

    let dry = trajlog::repair::repair(dir.path(), true).expect("dry run");
    assert!(!dry.written);
    assert!(!dir.path().join("MANIFEST").exists());
    let r = trajlog::repair::repair(dir.path(), false).expect("repair");
    assert!(r.written && r.moved_aside.is_empty() && r.damage.is_empty(), "{r:?}");
    assert_eq!(r.calls, all.len());
    assert_eq!(data_files(dir.path()), before, "repair changed a data file");

    let store = Store::open(dir.path(), small_segments()).expect("open after repair");
    assert_all(&store, &all);
    let snap = store.snapshot();
    assert!(snap.is_sealed("s0") && snap.session_reward("s3") == Some(3.0));
    // New appends go to a new segment id, after every id the shards refer to.
    store.append(Call { trace_id: "new".into(), session_id: "s99".into(), ..Default::default() }).expect("append");
    store.close().expect("close");
    let store = Store::open(dir.path(), small_segments()).expect("reopen");
    assert_eq!(store.snapshot().call_count(), all.len() + 1);
    store.close().expect("close");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.is_empty(), "{:?}", v.problems);
}

#[test]
fn an_old_manifest_restored_over_newer_files_is_refused() {
    let dir = tempdir();
    let all = calls(4, 6);
    let store = Store::open(dir.path(), small_segments()).expect("open");
    for c in &all[..6] {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    let old = fs::read(dir.path().join("MANIFEST")).expect("manifest");
    for c in &all[6..] {
        store.append(c.clone()).expect("append");
    }
    store.roll().expect("roll");
    store.close().expect("close");
    fs::write(dir.path().join("MANIFEST"), &old).expect("restore old manifest");
    let before = data_files(dir.path());
    let err = Store::open(dir.path(), small_segments()).err().expect("must refuse");
    assert!(err.message().contains("not listed in the MANIFEST"), "{err}");
    assert_eq!(data_files(dir.path()), before, "nothing may be deleted or cut");
    let r = trajlog::repair::repair(dir.path(), false).expect("repair");
    assert!(r.previous_manifest.as_ref().is_some_and(|p| p.exists()));
    let store = Store::open(dir.path(), small_segments()).expect("open after repair");
    assert_all(&store, &all);
}

#[test]
fn a_missing_listed_segment_is_refused_not_forgotten() {
    let dir = tempdir();
    let all = calls(6, 6);
    let store = filled(dir.path(), &all, small_segments());
    store.close().expect("close");
    let segs = segment_files(dir.path());
    assert!(segs.len() >= 3, "{segs:?}");
    let gone = &segs[1];
    fs::rename(gone, dir.path().join("aside.bin")).expect("move");
    let err = Store::open(dir.path(), small_segments()).err().expect("must refuse");
    assert_eq!(err.kind(), &ErrorKind::NotFound, "{err}");
    assert!(err.message().contains("listed in the MANIFEST but missing"), "{err}");
    // Repair keeps what exists; calls whose prefix-delta parent was in the
    // missing segment are refused on read, the others read exactly.
    trajlog::repair::repair(dir.path(), false).expect("repair");
    let store = Store::open_read_only(dir.path()).expect("open");
    let snap = store.snapshot();
    let mut exact = 0;
    for c in &all {
        match snap.get(&c.trace_id) {
            Ok(Some(v)) => match v.to_call() {
                Ok(_) => {
                    assert_same(&v, c);
                    exact += 1;
                }
                Err(e) => assert!(matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Corrupt { .. }), "{e}"),
            },
            Ok(None) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert!(exact > 0 && exact < all.len(), "{exact}");
}

#[test]
fn a_trace_id_is_unique_per_store() {
    let dir = tempdir();
    let store = Store::open(dir.path(), small_segments()).expect("open");
    let call = |t: &str, s: &str, n: u32| Call {
        trace_id: t.into(),
        session_id: s.into(),
        prompt_token_ids: vec![n],
        ..Default::default()
    };
    store.append_durable(call("t", "a", 1)).expect("append");
    store.seal_session("a").expect("seal");
    store.set_reward(Target::Session("a".into()), 1.0).expect("reward");
    let err = store.append(call("t", "b", 2)).expect_err("reused in another session");
    assert!(matches!(err.kind(), ErrorKind::InvalidInput { .. }), "{err}");
    assert!(err.message().contains("\"a\"") && err.message().contains("\"b\""), "{err}");
    store.flush().expect("flush");
    let snap = store.snapshot();
    assert_eq!(snap.session("a", None, None).expect("read").len(), 1);
    assert_eq!(snap.get("t").expect("get").expect("present").session_id(), "a");

    // Within its own (open) session an id is replaced: last write wins.
    store.append(call("u", "c", 1)).expect("append");
    store.append(call("u", "c", 2)).expect("replace");
    // Not yet durable: the rule also holds against appends in flight.
    let err = store.append(call("u", "d", 3)).expect_err("in flight, other session");
    assert!(err.message().contains("\"c\""), "{err}");
    store.flush().expect("flush");
    assert_eq!(store.snapshot().get("u").expect("get").expect("present").record.prompt_suffix, &[2]);

    // Once its session is deleted, the id is free again — also in flight.
    store.append(call("v", "e", 1)).expect("append");
    store.delete_session("e").expect("delete");
    store.append(call("v", "f", 2)).expect("free after deletion");
    // A call of a sealed outer session cannot be replaced out of it.
    let mut nested = call("w", "g", 1);
    nested.session_uids = vec!["outer".into()];
    store.append_durable(nested).expect("append");
    store.seal_session("outer").expect("seal");
    let err = store.append(call("w", "g", 2)).expect_err("would leave a sealed session");
    assert!(err.message().contains("outer"), "{err}");
    store.close().expect("close");

    let store = Store::open(dir.path(), small_segments()).expect("reopen");
    let snap = store.snapshot();
    assert_eq!(snap.get("t").expect("get").expect("present").session_id(), "a");
    assert_eq!(snap.get("v").expect("get").expect("present").session_id(), "f");
    assert_eq!(snap.session("outer", None, None).expect("read").len(), 1);
    assert!(store.append(call("t", "b", 2)).is_err(), "the rule holds after reopen");
}

/// Byte offset of the footer of a sealed segment (from its trailer).
fn footer_offset(bytes: &[u8]) -> usize {
    let t = &bytes[bytes.len() - 32..];
    u64::from_le_bytes(t[..8].try_into().expect("8 bytes")) as usize
}

#[test]
fn a_flipped_footer_byte_is_rebuilt_from_the_frames() {
    let dir = tempdir();
    let all = calls(6, 6);
    let store = filled(dir.path(), &all, small_segments());
    store.close().expect("close");
    let seg = segment_files(dir.path())[0].clone();
    let mut bytes = fs::read(&seg).expect("read");
    let at = footer_offset(&bytes) + 40;
    bytes[at] ^= 0x10;
    fs::write(&seg, &bytes).expect("write");

    let store = Store::open(dir.path(), small_segments()).expect("open succeeds");
    assert_all(&store, &all);
    let damage = store.snapshot().damage().to_vec();
    assert!(damage.iter().any(|d| d.what.contains("rebuilt from the frames")), "{damage:?}");
    store.close().expect("close");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.iter().any(|p| p.path == seg), "{:?}", v.problems);
    // Trailer damaged too: the frames still carry the index.
    let mut bytes = fs::read(&seg).expect("read");
    let n = bytes.len();
    bytes[n - 10] ^= 0x01;
    fs::write(&seg, &bytes).expect("write");
    let store = Store::open_read_only(dir.path()).expect("open succeeds");
    assert_all(&store, &all);
}

#[test]
fn a_flipped_payload_byte_is_confined_to_its_records() {
    let dir = tempdir();
    let all = calls(6, 6);
    let store = filled(dir.path(), &all, small_segments());
    store.flush().expect("flush");
    let damaged = "t0-2";
    let loc = store.snapshot().get(damaged).expect("get").expect("present").loc;
    store.close().expect("close");
    let seg = trajlog::storage::segment_path(dir.path(), loc.segment);
    let mut bytes = fs::read(&seg).expect("read");
    bytes[loc.offset as usize + 200] ^= 0x04; // inside the body
    fs::write(&seg, &bytes).expect("write");
    let last = segment_files(dir.path()).last().cloned().expect("a segment");
    assert_ne!(last, seg, "the damaged record must be in a sealed segment for this test");

    let store = Store::open(dir.path(), small_segments()).expect("open succeeds");
    let snap = store.snapshot();
    let err = snap.get(damaged).map(|v| v.map(|v| v.loc)).expect_err("a damaged record is refused");
    match err.kind() {
        ErrorKind::Corrupt { path, offset } => assert_eq!((path, *offset), (&seg, loc.offset), "{err}"),
        k => panic!("{k:?}: {err}"),
    }
    // Calls of s0 after it have it as prefix-delta parent: refused too, never wrong.
    let mut exact = 0;
    for c in &all {
        let read = snap.get(&c.trace_id).and_then(|v| v.expect("present").to_call());
        match read {
            Ok(_) => {
                assert_same(&snap.get(&c.trace_id).expect("read").expect("present"), c);
                exact += 1;
            }
            Err(e) => {
                assert!(c.session_id == "s0", "{} refused: {e}", c.trace_id);
                assert!(matches!(e.kind(), ErrorKind::Corrupt { .. }));
            }
        }
    }
    assert!(exact >= all.len() - 4, "{exact}");
    // A full scan goes on past the damage.
    let (mut ok, mut bad) = (0, 0);
    snap.for_each_call_each(|r| {
        match r {
            Ok(_) => ok += 1,
            Err(_) => bad += 1,
        }
        Ok(())
    })
    .expect("scan");
    assert_eq!((ok, bad), (all.len() - 1, 1));
    // Audit and compaction skip s0 (reported) and handle the rest.
    let mut steps = Vec::new();
    let audit =
        trajlog::audit::audit_with_progress(&snap, &mut |done, total| steps.push((done, total))).expect("audit");
    assert_eq!(audit.sessions_damaged.len(), 1, "{:?}", audit.sessions_damaged);
    assert_eq!(audit.sessions_checked, 5);
    // Progress after every session, the damaged one included.
    assert_eq!(steps, (1..=6).map(|d| (d, 6)).collect::<Vec<_>>());
    // Appending to the damaged session works (the damaged call is no parent).
    let mut next = all[5].clone();
    next.trace_id = "t0-next".into();
    next.timestamp = 99.0;
    store.append_durable(next.clone()).expect("append after damage");
    store.flush().expect("the store is not poisoned");
    assert_same(&store.snapshot().get("t0-next").expect("read").expect("present"), &next);
    for s in 0..6 {
        store.seal_session(&format!("s{s}")).expect("seal");
    }
    let report = store.compact(&CompactOptions::default()).expect("compaction goes on");
    assert_eq!(report.sessions, 5);
    assert_eq!(report.sessions_damaged.len(), 1);
    assert_eq!(report.sessions_damaged[0].0, "s0");
    drop(snap);
    for c in all.iter().filter(|c| c.session_id != "s0") {
        assert_same(&store.snapshot().get(&c.trace_id).expect("read").expect("present"), c);
    }
    store.close().expect("close");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.iter().any(|p| p.path == seg && p.offset == loc.offset), "{:?}", v.problems);
}

#[test]
fn damage_in_the_middle_of_the_active_segment_is_refused_not_cut() {
    let dir = tempdir();
    let all = calls(2, 4);
    let store = filled(dir.path(), &all, Options::default());
    store.flush().expect("flush");
    let loc = store.snapshot().get("t0-1").expect("get").expect("present").loc;
    store.close().expect("close");
    let seg = trajlog::storage::segment_path(dir.path(), loc.segment);
    let mut bytes = fs::read(&seg).expect("read");
    bytes[loc.offset as usize + 300] ^= 0x80;
    fs::write(&seg, &bytes).expect("write");
    for open in [|d: &Path| Store::open(d, Options::default()).map(drop), |d: &Path| Store::open_read_only(d).map(drop)]
    {
        let err = open(dir.path()).expect_err("must refuse");
        assert!(matches!(err.kind(), ErrorKind::Corrupt { .. }), "{err}");
        assert!(err.message().contains("valid records follow"), "{err}");
    }
    assert_eq!(fs::read(&seg).expect("read"), bytes, "the segment must not be cut");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.torn_tail.is_none() && v.problems.iter().any(|p| p.offset == loc.offset), "{v:?}");
}

#[test]
fn verify_tells_a_torn_tail_from_damage() {
    let dir = tempdir();
    let all = calls(2, 4);
    let store = filled(dir.path(), &all, Options::default());
    store.flush().expect("flush");
    let loc = store.snapshot().get("t1-3").expect("get").expect("present").loc;
    store.close().expect("close");
    // An interrupted write of the last record: cut it in the middle.
    let seg = trajlog::storage::segment_path(dir.path(), loc.segment);
    let f = fs::OpenOptions::new().write(true).open(&seg).expect("open");
    f.set_len(loc.offset + 100).expect("cut");
    drop(f);
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert_eq!(v.torn_tail.as_ref().map(|t| t.offset), Some(loc.offset));
    let store = Store::open(dir.path(), Options::default()).expect("open cuts the torn tail");
    assert_eq!(store.snapshot().call_count(), all.len() - 1);
    store.close().expect("close");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.is_empty() && v.torn_tail.is_none(), "{v:?}");
}

/// `trajlog repair` seals a segment that is unsealed but not the last (here:
/// its footer and trailer lost with the manifest, an interrupted write after
/// its last frame). The seal's footer replaces that torn tail, and the report
/// says what it cut, in a dry run too; every call is still served.
#[test]
fn repair_reports_the_torn_tail_it_cuts_when_it_seals_a_segment() {
    use trajlog::RecoveryEventKind::TornTailCut;
    let dir = tempdir();
    let all = calls(6, 6);
    let store = filled(dir.path(), &all, small_segments());
    store.close().expect("close");
    let segs = segment_files(dir.path());
    assert!(segs.len() >= 2, "{segs:?}");
    let mut bytes = fs::read(&segs[0]).expect("read");
    let footer = footer_offset(&bytes);
    bytes.truncate(footer);
    bytes.extend_from_slice(&[0xab; 24]);
    fs::write(&segs[0], &bytes).expect("write");
    fs::remove_file(dir.path().join("MANIFEST")).expect("remove manifest");
    let cut = |r: &trajlog::repair::RepairReport| -> Vec<_> {
        r.cut.iter().map(|e| (e.kind, e.segment, e.path.clone(), e.offset, e.len)).collect()
    };
    let want = vec![(TornTailCut, 1, segs[0].clone(), footer as u64, 24)];
    let dry = trajlog::repair::repair(dir.path(), true).expect("dry run");
    assert_eq!((dry.sealed_now.clone(), cut(&dry)), (vec![1], want.clone()));
    assert_eq!(fs::read(&segs[0]).expect("read"), bytes, "a dry run changes nothing");
    let r = trajlog::repair::repair(dir.path(), false).expect("repair");
    assert_eq!((r.sealed_now.clone(), cut(&r)), (vec![1], want));
    assert!(r.written, "{r:?}");
    let store = Store::open(dir.path(), small_segments()).expect("open after repair");
    assert_all(&store, &all);
    store.close().expect("close");
    let v = trajlog::verify::verify_dir(dir.path()).expect("verify");
    assert!(v.problems.is_empty(), "{:?}", v.problems);
}
