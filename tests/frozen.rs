//! The index's frozen layer (src/index/frozen.rs): compacted sessions open
//! into flat arrays, read exactly as from the maps, and any write that
//! names one thaws it first, so that every replay rule sees what it saw
//! before.

mod common;

use common::*;
use std::path::Path;
use trajlog::{Call, CompactOptions, ErrorKind, Selection, Snapshot, Store, Target};

/// Everything a reader can ask the index, as text to compare.
fn fingerprint(snap: &Snapshot, trace_ids: &[String]) -> Vec<String> {
    fingerprint_checked(snap, trace_ids).unwrap()
}

/// What every read of `snap` answers; the first error, or the shard index
/// file's damage a lookup met (`Snapshot::check_index`), instead.
fn fingerprint_checked(snap: &Snapshot, trace_ids: &[String]) -> trajlog::Result<Vec<String>> {
    let mut out = vec![format!("calls {}", snap.call_count())];
    for s in snap.sessions() {
        out.push(format!("{s:?}"));
        let ids: Vec<String> =
            snap.session(&s.session_id, None, None)?.iter().map(|c| c.trace_id().to_owned()).collect();
        out.push(format!("  {ids:?}"));
        out.push(format!("  sealed {} reward {:?}", snap.is_sealed(&s.session_id), snap.session_reward(&s.session_id)));
        if let Some(mid) = snap.session(&s.session_id, None, None)?.get(2) {
            let since = snap.session(&s.session_id, Some(mid.timestamp()), Some(2))?;
            out.push(format!("  since {:?}", since.iter().map(|c| c.trace_id()).collect::<Vec<_>>()));
        }
    }
    for t in trace_ids {
        let live = snap.get(t)?.map(|c| (c.session_id().to_owned(), c.timestamp().to_bits()));
        out.push(format!("{t}: {live:?} reward {:?}", snap.trace_reward(t)));
    }
    let mut scanned = Vec::new();
    snap.for_each_call(|c| {
        scanned.push(c.trace_id().to_owned());
        Ok(())
    })?;
    scanned.sort();
    out.push(format!("scan {scanned:?}"));
    snap.check_index()?;
    Ok(out)
}

fn ids(calls: &[Call]) -> Vec<String> {
    let mut v: Vec<String> = calls.iter().map(|c| c.trace_id.clone()).collect();
    v.push("new-0".into());
    v
}

/// Sessions s0..s7 compacted (s0..s2 sealed, with session rewards, and a
/// reward on s6), s8..s11 in segments; returns the calls appended.
fn build(dir: &Path) -> Vec<Call> {
    let all = chained_calls(12, 6);
    let store = Store::open(dir, small_segments()).unwrap();
    for c in &all[..48] {
        store.append(c.clone()).unwrap();
    }
    for s in 0..3 {
        store.seal_session(&format!("s{s}")).unwrap();
        store.set_reward(Target::Session(format!("s{s}")), s as f64).unwrap();
    }
    store.set_reward(Target::Session("s6".into()), 6.5).unwrap();
    let report = store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap();
    assert_eq!(report.sessions, 8);
    for c in &all[48..] {
        store.append(c.clone()).unwrap();
    }
    store.close().unwrap();
    all
}

/// Reopen read-only and writable and compare with `want`; when a shard
/// index file is there, also read-only without it and with it damaged or
/// stale (the open decodes the shards then): the same answers each time.
/// The writable open leaves a file that describes the shards.
fn reopen_matches(dir: &Path, want: &[String], trace_ids: &[String]) -> Store {
    let index = dir.join("shards").join("index.tsi");
    let ro = Store::open_read_only(dir).unwrap();
    let layers = ro.snapshot().index_layers();
    assert_eq!(fingerprint(&ro.snapshot(), trace_ids), want, "read-only reopen");
    drop(ro);
    // A file that describes the shards (a stale one is left for the
    // writable open to replace).
    if layers.index_file_bytes > 0 {
        let saved = std::fs::read(&index).unwrap();
        assert_eq!(layers.index_file_bytes, saved.len() as u64, "the open read the shard index file");
        std::fs::remove_file(&index).unwrap();
        let ro = Store::open_read_only(dir).unwrap();
        assert_eq!(ro.snapshot().index_layers().index_file_bytes, 0);
        assert_eq!(fingerprint(&ro.snapshot(), trace_ids), want, "read-only reopen without the shard index file");
        drop(ro);
        // A flipped byte anywhere (header, directory, any section) fails a
        // check: in what an open checks whole, the open does without the
        // file; in a table a read-only open checks a block at a time, the
        // reads that meet it fail naming the file (never a wrong answer),
        // and a refresh loads the view again without it.
        for at in [3, 30, saved.len() / 3, saved.len() / 2, saved.len() - 5] {
            let mut damaged = saved.clone();
            damaged[at] ^= 0x20;
            std::fs::write(&index, &damaged).unwrap();
            let ro = Store::open_read_only(dir).unwrap();
            match fingerprint_checked(&ro.snapshot(), trace_ids) {
                Ok(got) => assert_eq!(got, want, "read-only reopen, byte {at} of the file flipped"),
                Err(e) => {
                    let named = matches!(e.kind(), ErrorKind::Corrupt { path, .. } if path == &index);
                    assert!(named, "byte {at} flipped: {e}");
                    ro.refresh().unwrap();
                    assert_eq!(ro.snapshot().index_layers().index_file_bytes, 0, "byte {at}: refreshed without it");
                    assert_eq!(fingerprint(&ro.snapshot(), trace_ids), want, "byte {at} flipped, refreshed");
                }
            }
        }
        std::fs::write(&index, &saved).unwrap();
    }
    let store = Store::open(dir, small_segments()).unwrap();
    assert_eq!(fingerprint(&store.snapshot(), trace_ids), want, "writable reopen");
    let layers = store.snapshot().index_layers();
    if layers.frozen_calls > 0 {
        assert!(index.exists(), "a writable open of compacted sessions leaves a shard index file");
        assert_eq!(layers.index_file_bytes, std::fs::metadata(&index).unwrap().len());
    }
    store
}

#[test]
fn compacted_sessions_open_frozen_and_read_the_same() {
    let dir = tempdir();
    let all = build(dir.path());
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.set_reward(Target::Trace("t1-3".into()), 0.25).unwrap();
    store.flush().unwrap();
    let before = fingerprint(&store.snapshot(), &ids(&all));
    store.close().unwrap();

    let store = reopen_matches(dir.path(), &before, &ids(&all));
    let layers = store.snapshot().index_layers();
    assert!(layers.index_file_bytes > 0, "opened from the shard index file: {layers:?}");
    // The eight compacted sessions, 6 calls each; the others are in
    // segments.
    assert_eq!((layers.calls, layers.frozen_calls), (all.len(), 48), "{layers:?}");
    // Mapped from the file: its tables take no heap.
    assert_eq!(layers.frozen_bytes, 0, "{layers:?}");
    assert_all(&store, &all);
    assert_eq!(store.snapshot().trace_reward("t1-3"), Some(0.25));
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// (offset, length) of section `kind` of a shard index file's bytes
/// (format-spec/shard-index.md §2: a 24-byte header, then 32-byte
/// directory entries of kind, crc32, offset, length, count).
fn section_of(file: &[u8], kind: u32) -> (usize, usize) {
    let u32_at = |at: usize| u32::from_le_bytes(file[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize;
    (0..u32_at(12) as usize)
        .map(|i| 24 + i * 32)
        .find(|e| u32_at(*e) == kind)
        .map(|e| (u64_at(e + 8), u64_at(e + 16)))
        .unwrap_or_else(|| panic!("no section {kind}"))
}

#[test]
fn a_read_only_open_checks_the_shard_index_file_a_block_at_a_time() {
    let dir = tempdir();
    let all = build(dir.path());
    // A writable open writes the file (with its block checksums, kind 10).
    drop(Store::open(dir.path(), small_segments()).unwrap());
    let index = dir.path().join("shards").join("index.tsi");
    let saved = std::fs::read(&index).unwrap();
    let (blocks_at, blocks_len) = section_of(&saved, 10);
    assert!(blocks_at > 0 && blocks_len > 0 && blocks_len % 4 == 0);
    let want = fingerprint(&Store::open_read_only(dir.path()).unwrap().snapshot(), &ids(&all));

    // One bit of a trace id or session name (the text section, 6): the
    // open reads none of the tables and uses the file; the reads that meet
    // the block fail naming the file, never answer from it.
    let (text_at, text_len) = section_of(&saved, 6);
    let mut damaged = saved.clone();
    damaged[text_at + text_len / 2] ^= 0x01;
    std::fs::write(&index, &damaged).unwrap();
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().index_layers().index_file_bytes, saved.len() as u64, "the open used the file");
    let err = fingerprint_checked(&ro.snapshot(), &ids(&all)).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Corrupt { path, .. } if path == &index), "{err}");
    assert!(err.message().contains("fails its crc32"), "{err}");
    // A refresh loads the view again checking the file whole: without it.
    ro.refresh().unwrap();
    assert_eq!(ro.snapshot().index_layers().index_file_bytes, 0);
    assert_eq!(fingerprint(&ro.snapshot(), &ids(&all)), want);
    drop(ro);

    // A writable open checks it a block at a time too: the reads of its
    // views that meet the block fail alike, and its next flush refuses
    // further writes and removes the file (a cache of the shards).
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.snapshot().index_layers().index_file_bytes, saved.len() as u64, "the open used the file");
    let err = fingerprint_checked(&store.snapshot(), &ids(&all)).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Corrupt { path, .. } if path == &index), "{err}");
    assert_eq!(store.flush().unwrap_err().kind(), &ErrorKind::Poisoned);
    assert!(!index.exists());
    drop(store);
    // The next open does without it, answers the same, and writes it anew
    // (the same bytes: a function of the shards).
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(fingerprint(&store.snapshot(), &ids(&all)), want);
    drop(store);
    assert_eq!(std::fs::read(&index).unwrap(), saved, "rewritten as it was");

    // Undamaged, a read-only open reads the same through the file.
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().index_layers().index_file_bytes, saved.len() as u64);
    assert_eq!(fingerprint(&ro.snapshot(), &ids(&all)), want);
}

/// A read-only store whose refresh replays a new record that names a
/// frozen session whose entry is in a damaged block of the index file it
/// mapped (a block its open did not read): the step's lookup misses, so
/// the refresh loads the store again, checking the file whole (here, the
/// writer's new one), rather than keep a view with the miss in its maps.
#[test]
fn a_refresh_whose_replay_meets_a_damaged_block_loads_the_store_again() {
    let dir = tempdir();
    // 1,500 compacted sessions: their 24-byte entries take three blocks.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    for s in 0..1500 {
        store.append(tiny(s, 0)).unwrap();
    }
    store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap();
    store.close().unwrap();
    drop(Store::open(dir.path(), small_segments()).unwrap());
    let index = dir.path().join("shards").join("index.tsi");
    let saved = std::fs::read(&index).unwrap();
    // The session whose entry is the 1,000th (the second block), by name.
    let (sessions_at, sessions_len) = section_of(&saved, 4);
    let (text_at, _) = section_of(&saved, 6);
    assert!(sessions_len > 2 * 16_384, "{sessions_len}");
    let entry = sessions_at + 1000 * 24;
    let u64_at = |at: usize| u64::from_le_bytes(saved[at..at + 8].try_into().unwrap()) as usize;
    let (name_at, name_len) =
        (u64_at(entry + 8), u32::from_le_bytes(saved[entry + 16..entry + 20].try_into().unwrap()));
    let name =
        std::str::from_utf8(&saved[text_at + name_at..text_at + name_at + name_len as usize]).unwrap().to_owned();
    let s: usize = name[1..].parse().unwrap();
    // One bit of a neighbour's hash, in the same block: damage on disk
    // before the reader opens, in a block its open does not read.
    let mut damaged = saved.clone();
    damaged[entry + 5 * 24 + 2] ^= 0x08;
    std::fs::write(&index, &damaged).unwrap();
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().index_layers().index_file_bytes, saved.len() as u64, "used lazily");
    ro.snapshot().check_index().unwrap();
    // A writer's append to that session meets the block too: refused, and
    // the file removed; the writer's next open writes it anew, and the
    // append is taken.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.append(tiny(s, 1)).err().unwrap().kind(), &ErrorKind::Poisoned);
    drop(store);
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.append(tiny(s, 1)).unwrap();
    store.flush().unwrap();
    ro.refresh().unwrap();
    let snap = ro.snapshot();
    snap.check_index().unwrap();
    let got: Vec<String> = snap.session(&name, None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(got, [format!("x{s}-0"), format!("x{s}-1")]);
    assert_eq!(snap.call_count(), 1501);
    assert_eq!(snap.sessions().len(), 1500);
    assert_eq!(snap.index_layers().index_file_bytes, std::fs::metadata(&index).unwrap().len(), "the writer's file");
}

#[test]
fn a_write_naming_a_frozen_session_thaws_it_first() {
    let dir = tempdir();
    let all = build(dir.path());
    let trace_ids = ids(&all);
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.snapshot().index_layers().frozen_calls, 48);

    // A reward on a frozen trace, a session reward and a seal: annotations
    // only, nothing thaws.
    store.set_reward(Target::Trace("t3-0".into()), 1.5).unwrap();
    store.set_reward(Target::Session("s4".into()), -2.0).unwrap();
    store.seal_session("s5").unwrap();
    // s1's reward was set before the compaction (a value of the frozen
    // layer since the open); a new one wins over it, here and at reopens.
    store.set_reward(Target::Session("s1".into()), 7.0).unwrap();
    store.flush().unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.index_layers().frozen_calls, 48);
    assert_eq!((snap.trace_reward("t3-0"), snap.session_reward("s4")), (Some(1.5), Some(-2.0)));
    assert_eq!((snap.session_reward("s0"), snap.session_reward("s1")), (Some(0.0), Some(7.0)));

    // An append to frozen s6 (a timestamp between two of its calls): s6
    // thaws, the call takes its place in the session's order.
    let mut c = all[36].clone();
    c.trace_id = "new-0".into();
    c.timestamp = 602.5;
    store.append(c).unwrap();
    // A replacement of one of frozen s7's calls (a later timestamp).
    let mut r = all[42 + 2].clone();
    r.timestamp = 999.0;
    store.append(r).unwrap();
    // A deletion of frozen s2.
    assert_eq!(store.delete_session("s2").unwrap(), 6);
    store.flush().unwrap();

    let snap = store.snapshot();
    let layers = snap.index_layers();
    assert_eq!(layers.frozen_calls, 48 - 18, "s6, s7 and s2 thawed: {layers:?}");
    assert_eq!(snap.call_count(), all.len() + 1 - 6);
    let s6: Vec<String> = snap.session("s6", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(s6, ["t6-0", "t6-1", "t6-2", "new-0", "t6-3", "t6-4", "t6-5"]);
    assert_eq!(snap.session_reward("s6"), Some(6.5), "thawing keeps the reward");
    let s7: Vec<String> = snap.session("s7", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(s7, ["t7-0", "t7-1", "t7-3", "t7-4", "t7-5", "t7-2"]);
    assert_eq!(snap.get("t7-2").unwrap().unwrap().timestamp(), 999.0);
    assert!(snap.session_info("s2").is_none());
    assert!(snap.get("t2-0").unwrap().is_none());
    // Still frozen, still right.
    assert_eq!(snap.trace_reward("t3-0"), Some(1.5));
    assert_eq!(snap.session_info("s4").unwrap().reward, Some(-2.0));
    assert!(snap.is_sealed("s5"));
    // The shard rows that are live calls (what a collection and `space`
    // count, from the frozen rows not thawed and the calls in the maps):
    // the 48 compacted, less s2's 6 deleted and t7-2's replaced row.
    let space = trajlog::space::space(&snap).unwrap();
    let (rows, live) = space.shards.iter().fold((0, 0), |(r, l), s| (r + s.rows, l + s.live_rows));
    assert_eq!((rows, live), (48, 48 - 6 - 1), "{:?}", space.shards);
    let want = fingerprint(&snap, &trace_ids);
    drop(snap);
    store.close().unwrap();

    // The replay meets the same records in log order and thaws the same
    // sessions at the same points.
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    assert_eq!(store.snapshot().index_layers().frozen_calls, 48 - 18);

    // A compaction of everything that collects every dead row (t7-2's
    // replaced row and s2's would keep s7 and s2 in the maps), and a
    // reopen: what was thawed and compacted again is frozen again.
    let opts = CompactOptions::default().selection(Selection::OlderThan(0.0)).collect_dead_fraction(Some(0.0));
    store.compact(&opts).unwrap();
    let want = fingerprint(&store.snapshot(), &trace_ids);
    store.close().unwrap();
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    let layers = store.snapshot().index_layers();
    assert_eq!(layers.frozen_calls, layers.calls, "{layers:?}");
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn a_stale_or_missing_shard_index_file_is_rebuilt_and_answers_stay_the_same() {
    let dir = tempdir();
    let all = build(dir.path());
    let trace_ids = ids(&all);
    let index = dir.path().join("shards").join("index.tsi");
    assert!(index.exists(), "the compaction wrote the shard index file");
    let first = std::fs::read(&index).unwrap();

    // Compacting s8 (6 rows beside the file's 48) leaves the file as it is:
    // it describes the first shards, an open decodes the new one.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    store.seal_session("s8").unwrap();
    assert_eq!(store.compact(&CompactOptions::default()).unwrap().sessions, 1);
    assert_eq!(std::fs::read(&index).unwrap(), first, "not rewritten for 1/8 of its rows");
    let want = fingerprint(&store.snapshot(), &trace_ids);
    store.close().unwrap();
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    assert_eq!(store.snapshot().index_layers().index_file_bytes, first.len() as u64);
    assert_eq!(std::fs::read(&index).unwrap(), first, "an open leaves a file that describes the first shards");
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // s9 too: the undescribed rows pass 1/8, the publication writes it anew.
    store.seal_session("s9").unwrap();
    assert_eq!(store.compact(&CompactOptions::default()).unwrap().sessions, 1);
    let fresh = std::fs::read(&index).unwrap();
    assert_ne!(fresh, first);
    let want = fingerprint(&store.snapshot(), &trace_ids);
    store.close().unwrap();
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    let layers = store.snapshot().index_layers();
    assert_eq!((layers.frozen_calls, layers.index_file_bytes), (60, fresh.len() as u64), "{layers:?}");
    store.close().unwrap();
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // A file of other shards (another store's) is not used; a writable
    // open writes the right one, as the publication wrote it.
    let other = tempdir();
    let store = Store::open(other.path(), small_segments()).unwrap();
    for c in chained_calls(1, 3) {
        store.append(c).unwrap();
    }
    store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap();
    store.close().unwrap();
    let stale = std::fs::read(other.path().join("shards").join("index.tsi")).unwrap();
    std::fs::write(&index, &stale).unwrap();
    let ro = Store::open_read_only(dir.path()).unwrap();
    assert_eq!(ro.snapshot().index_layers().index_file_bytes, 0, "a stale file is not used");
    assert_eq!(fingerprint(&ro.snapshot(), &trace_ids), want);
    drop(ro);
    // A stale one is not a problem for `verify`: it is only not used.
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    drop(reopen_matches(dir.path(), &want, &trace_ids));
    assert_eq!(std::fs::read(&index).unwrap(), fresh, "rebuilt as the compaction wrote it");

    // Deleted: the same.
    std::fs::remove_file(&index).unwrap();
    drop(reopen_matches(dir.path(), &want, &trace_ids));
    assert_eq!(std::fs::read(&index).unwrap(), fresh);

    // `verify` checks the file against the shards: a damaged one is named.
    let mut damaged = fresh.clone();
    let at = damaged.len() / 2;
    damaged[at] ^= 1;
    std::fs::write(&index, &damaged).unwrap();
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].what.contains("shard index file"), "{:?}", report.problems);
}

/// A record in a kept segment that names a frozen session before some of
/// its compacted calls (here: the replaced first version of one of them)
/// thaws it at the open; the session's later rows are then applied at
/// their log positions, with or without the shard index file.
#[test]
fn a_thaw_at_the_open_applies_the_later_rows_in_log_order() {
    let dir = tempdir();
    let all = chained_calls(2, 4);
    let store = Store::open(dir.path(), trajlog::Options::default()).unwrap();
    // s1's first call, never sealed, keeps the segment.
    store.append(all[4].clone()).unwrap();
    for c in &all[..4] {
        store.append(c.clone()).unwrap();
    }
    // t0-1 replaced: its first record stays in the segment, dead.
    let mut r = all[1].clone();
    r.timestamp = 500.0;
    r.completion_token_ids.push(7);
    if let Some(lp) = &mut r.logprobs {
        lp.push(-0.5);
    }
    store.append(r.clone()).unwrap();
    store.seal_session("s0").unwrap();
    let report = store.compact(&CompactOptions::default()).unwrap();
    assert_eq!(report.sessions, 1);
    let trace_ids: Vec<String> = ["t0-0", "t0-1", "t0-2", "t0-3", "t1-0"].map(String::from).into();
    let want = fingerprint(&store.snapshot(), &trace_ids);
    store.close().unwrap();
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    let snap = store.snapshot();
    let s0: Vec<String> = snap.session("s0", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(s0, ["t0-0", "t0-2", "t0-3", "t0-1"]);
    assert_same(&snap.get("t0-1").unwrap().unwrap(), &r);
    assert_eq!(snap.index_layers().frozen_calls, 0, "s0 thawed at the open");
}

/// A merge of the small generations compacted since the shard index file
/// was written leaves the file as it is (it describes none of them); the
/// store reads the same, with and without it.
#[test]
fn a_merge_of_files_the_index_file_does_not_describe_keeps_it() {
    let dir = tempdir();
    let all = chained_calls(40, 6);
    let trace_ids: Vec<String> = all.iter().map(|c| c.trace_id.clone()).collect();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let opts = CompactOptions::default().merge_fanout(Some(2));
    for c in &all[..36 * 6] {
        store.append(c.clone()).unwrap();
    }
    for s in 0..36 {
        store.seal_session(&format!("s{s}")).unwrap();
    }
    store.compact(&opts).unwrap();
    let index = dir.path().join("shards").join("index.tsi");
    let first = std::fs::read(&index).unwrap();
    for s in 36..39 {
        for c in &all[s * 6..s * 6 + 6] {
            store.append(c.clone()).unwrap();
        }
        store.seal_session(&format!("s{s}")).unwrap();
        store.compact(&opts).unwrap();
        assert!(std::fs::read(&index).unwrap() == first, "kept after the compaction of s{s}");
        let report = trajlog::verify::verify_dir(dir.path()).unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
    }
    // The third small compaction merged the two before it with its own.
    let rows: Vec<u64> = generation_rows(dir.path()).into_values().collect();
    assert_eq!(rows, [216, 18], "{:?}", generation_rows(dir.path()));
    assert_all(&store, &all[..39 * 6]);
    let want = fingerprint(&store.snapshot(), &trace_ids);
    store.close().unwrap();
    let store = reopen_matches(dir.path(), &want, &trace_ids);
    assert_eq!(store.snapshot().index_layers().index_file_bytes, first.len() as u64);
    assert_all(&store, &all[..39 * 6]);
}

/// A session sealed and compacted is frozen at the next open and still
/// refuses appends (the append path asks the open's index, not a copied
/// set of names); a deletion then a new seal are seen in order.
#[test]
fn a_frozen_sealed_session_refuses_appends_until_deleted() {
    let dir = tempdir();
    let all = build(dir.path());
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.snapshot().index_layers().frozen_calls, 48, "s0..s7 frozen");
    let mut c = all[0].clone();
    c.trace_id = "new-0".into();
    let err = store.append(c.clone()).expect_err("s0 is sealed");
    assert!(err.to_string().contains("sealed"), "{err}");
    // s3 is frozen too, but not sealed.
    let mut d = all[18].clone();
    d.trace_id = "new-1".into();
    store.append(d).unwrap();
    assert_eq!(store.delete_session("s0").unwrap(), 6);
    store.append(c.clone()).unwrap();
    store.seal_session("s0").unwrap();
    c.trace_id = "new-2".into();
    assert!(store.append(c).is_err(), "sealed again");
    store.close().unwrap();
}

/// A tiny call `k` of session `s{s}`.
fn tiny(s: usize, k: usize) -> Call {
    Call {
        trace_id: format!("x{s}-{k}"),
        session_id: format!("s{s}"),
        timestamp: (s * 10 + k) as f64,
        prompt_token_ids: vec![1, 2, s as u32],
        completion_token_ids: vec![4, k as u32],
        logprobs: Some(vec![-0.5, f32::from_bits(0x8000_0001)]),
        ..Default::default()
    }
}

/// 1,500 sessions of one call each, every one sealed and compacted, the
/// shard index file written by a writable open; returns the file's bytes.
fn sealed_and_compacted(dir: &Path) -> Vec<u8> {
    let store = Store::open(dir, small_segments()).unwrap();
    for s in 0..1500 {
        store.append(tiny(s, 0)).unwrap();
        store.seal_session(&format!("s{s}")).unwrap();
    }
    store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap();
    store.close().unwrap();
    drop(Store::open(dir, small_segments()).unwrap());
    std::fs::read(dir.join("shards").join("index.tsi")).unwrap()
}

/// Every call of the 1,500 sessions, exactly (ids, tokens, logprob bits).
fn all_exact(store: &Store) {
    let snap = store.snapshot();
    assert!(snap.sessions().len() >= 1500);
    for s in (0..1500).step_by(37).chain([1499]) {
        let calls = snap.session(&format!("s{s}"), None, None).unwrap();
        let want = tiny(s, 0);
        assert_eq!(calls.len(), 1, "s{s}");
        let c = &calls[0];
        assert_eq!(c.trace_id(), want.trace_id);
        assert_eq!(c.prompt().unwrap(), want.prompt_token_ids);
        assert_eq!(c.completion_token_ids(), want.completion_token_ids.as_slice());
        let bits: Vec<u32> = c.logprobs().unwrap().iter().map(|l| l.to_bits()).collect();
        assert_eq!(bits, want.logprobs.unwrap().iter().map(|l| l.to_bits()).collect::<Vec<_>>());
        assert!(snap.is_sealed(&format!("s{s}")));
    }
    snap.check_index().unwrap();
}

/// A writable open checks the shard index file a block at a time too (at
/// 10M calls it is 1.2 GB): an append whose admission lookup reads a
/// damaged block — here, whether a compacted session is sealed — must not
/// act on a miss. The append is refused, the store refuses further writes,
/// and the file (a cache of the shards) is removed; the next open rebuilds
/// it, byte for byte, and the session refuses appends as sealed again.
#[test]
fn a_writer_whose_lookup_meets_a_damaged_block_refuses_the_write_and_the_next_open_rebuilds_the_file() {
    let dir = tempdir();
    let saved = sealed_and_compacted(dir.path());
    let index = dir.path().join("shards").join("index.tsi");
    // The session whose entry is the 1,000th (the second block), by name.
    let (sessions_at, sessions_len) = section_of(&saved, 4);
    let (text_at, _) = section_of(&saved, 6);
    assert!(sessions_len > 2 * 16_384, "{sessions_len}");
    let u64_at = |at: usize| u64::from_le_bytes(saved[at..at + 8].try_into().unwrap()) as usize;
    let session_at = |n: usize| {
        let entry = sessions_at + n * 24;
        let (name_at, name_len) = (u64_at(entry + 8), u64_at(entry + 16) & 0xffff_ffff);
        let name = std::str::from_utf8(&saved[text_at + name_at..text_at + name_at + name_len]).unwrap();
        name[1..].parse::<usize>().unwrap()
    };
    let (s, good) = (session_at(1000), session_at(100));
    let entry = sessions_at + 1000 * 24;
    // One bit of a neighbour's hash, in the same block (the second).
    let mut damaged = saved.clone();
    damaged[entry + 5 * 24 + 2] ^= 0x08;
    std::fs::write(&index, &damaged).unwrap();

    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.snapshot().index_layers().index_file_bytes, saved.len() as u64, "used lazily");
    // A session in a good block still refuses appends as sealed.
    let err = store.append(tiny(good, 1)).err().unwrap();
    assert!(err.message().contains("is sealed"), "{err}");
    // The sealed session in the damaged block: its lookup misses, and the
    // append is refused naming the file, never written.
    let err = store.append(tiny(s, 1)).err().unwrap();
    assert_eq!(err.kind(), &ErrorKind::Poisoned, "{err}");
    assert!(err.message().contains("index.tsi") && err.message().contains("crc32"), "{err}");
    assert!(!index.exists(), "the damaged file is removed");
    // No further write is taken.
    assert_eq!(store.append(tiny(2000, 0)).err().unwrap().kind(), &ErrorKind::Poisoned);
    drop(store);

    // The next open decodes the shards and writes the file anew.
    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(std::fs::read(&index).unwrap(), saved, "rewritten as it was");
    let err = store.append(tiny(s, 1)).err().unwrap();
    assert!(err.message().contains("is sealed"), "{err}");
    store.append(tiny(2000, 0)).unwrap();
    store.flush().unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), 1501, "nothing refused was written");
    assert!(snap.get(&tiny(s, 1).trace_id).unwrap().is_none());
    drop(snap);
    store.close().unwrap();
    let store = Store::open(dir.path(), small_segments()).unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), 1501);
    drop(snap);
    all_exact(&store);
}

/// A block no lookup of the writer reads (a session name) is found by the
/// compaction, which reads the file whole before it merges from it: the
/// compaction is refused and the file removed; after a reopen (which
/// rebuilds it) the compaction runs, and every call reads exactly.
#[test]
fn a_compaction_checks_the_whole_shard_index_file_before_it_reads_it() {
    let dir = tempdir();
    let saved = sealed_and_compacted(dir.path());
    let index = dir.path().join("shards").join("index.tsi");
    let (text_at, text_len) = section_of(&saved, 6);
    let mut damaged = saved.clone();
    damaged[text_at + text_len - 3] ^= 0x40;
    std::fs::write(&index, &damaged).unwrap();

    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(store.snapshot().index_layers().index_file_bytes, saved.len() as u64, "used lazily");
    // New sessions: their lookups read no damaged block.
    for s in 2000..2010 {
        store.append(tiny(s, 0)).unwrap();
    }
    store.flush().unwrap();
    let err = store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::Poisoned, "{err}");
    assert!(err.message().contains("index.tsi") && err.message().contains("crc32"), "{err}");
    assert!(!index.exists(), "the damaged file is removed");
    drop(store);

    let store = Store::open(dir.path(), small_segments()).unwrap();
    assert_eq!(std::fs::read(&index).unwrap(), saved, "rewritten as it was");
    assert_eq!(store.snapshot().call_count(), 1510, "the acknowledged appends are kept");
    let report = store.compact(&CompactOptions::default().selection(Selection::OlderThan(0.0))).unwrap();
    assert_eq!(report.sessions, 10);
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), 1510);
    for s in 2000..2010 {
        let calls = snap.session(&format!("s{s}"), None, None).unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].completion_token_ids(), tiny(s, 0).completion_token_ids.as_slice());
    }
    drop(snap);
    all_exact(&store);
}
