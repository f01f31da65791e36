//! The store driven through the fault-injecting storage layer
//! (`trajlog::storage::fault`): EIO and ENOSPC on writes and fsyncs, short
//! (torn) writes, and a power cut at every sync point of a workload.
//!
//! The promises checked after every fault: an acknowledged record (its
//! `Receipt::wait` or a later `flush` returned Ok) is present and bit-exact
//! after reopening; nothing corrupt is served (every call decodes, `verify`
//! passes); a failed write or fsync poisons the store with an error that says
//! what failed, and every later write is refused.

mod common;

use common::{assert_same, tempdir};
use std::path::Path;
use std::sync::Arc;
use trajlog::sim::{simulate_session, SimConfig};
use trajlog::storage::fault::{CrashAt, FailAt, Fault, FaultPlan, OpKind, EIO, ENOSPC};
use trajlog::{Call, Durability, ErrorKind, Options, Store};

fn workload(sessions: usize, steps: usize) -> Vec<Call> {
    let cfg = SimConfig {
        sessions,
        steps,
        system_tokens: 300,
        completion_tokens: (100, 400),
        tool_tokens: (50, 200),
        ..SimConfig::default()
    };
    (0..sessions).flat_map(|s| simulate_session(&cfg, s).calls).collect()
}

fn opts(durability: Durability, faults: Option<Arc<dyn FaultPlan>>) -> Options {
    // Small segments so that the workload seals and rolls (more sync points).
    // The group-commit timer is set out of reach so that every fsync comes
    // from a flush, a roll or the manifest: the sync points are then the same
    // in every run (with a short timer their count depends on timing).
    Options { durability, segment_bytes: 64 << 10, group_commit_ms: 60_000, faults, ..Options::default() }
}

/// Append `calls`, acknowledging each batch of `batch` with a flush; returns
/// the calls acknowledged before the first error, and that error.
fn drive(store: &Store, calls: &[Call], batch: usize) -> (Vec<Call>, Option<trajlog::Error>) {
    let mut acked = Vec::new();
    for chunk in calls.chunks(batch) {
        for c in chunk {
            if let Err(e) = store.append(c.clone()) {
                return (acked, Some(e));
            }
        }
        match store.flush() {
            Ok(()) => acked.extend_from_slice(chunk),
            Err(e) => return (acked, Some(e)),
        }
    }
    (acked, None)
}

/// Reopen without faults and check the promises.
fn check_reopened(dir: &Path, acked: &[Call]) {
    let store = Store::open(dir, Options::default()).expect("the store reopens");
    let snap = store.snapshot();
    for want in acked {
        let got =
            snap.get(&want.trace_id).expect("read").unwrap_or_else(|| panic!("acknowledged {} lost", want.trace_id));
        assert_same(&got, want);
    }
    // Whatever else survived is whole: every call decodes with its prompt.
    snap.for_each_call(|c| c.prompt().map(drop)).expect("every surviving call reads back");
    drop(snap);
    store.close().expect("close");
    let report = trajlog::verify::verify_dir(dir).expect("verify runs");
    assert!(report.problems.is_empty(), "nothing corrupt after recovery: {:?}", report.problems);
}

fn fails_with(e: &trajlog::Error, what: &str) {
    assert!(matches!(e.kind(), ErrorKind::Io | ErrorKind::Poisoned), "{e}");
    assert!(e.message().contains(what), "error {e:?} should say {what:?}");
}

#[test]
fn eio_on_a_segment_write_poisons_and_loses_nothing_acknowledged() {
    let calls = workload(6, 6);
    // Write #0 is the first segment's header, at open.
    for nth in [1, 4, 10] {
        let dir = tempdir();
        let plan = FailAt::new(OpKind::Write, nth, Fault::Fail(EIO), false);
        let store = Store::open(dir.path(), opts(Durability::Group, Some(plan.clone()))).expect("open");
        let (acked, err) = drive(&store, &calls, 4);
        assert!(plan.tripped(), "the workload reached write #{nth}");
        let err = err.expect("the failed write surfaces");
        fails_with(&err, "Input/output error");
        // Poisoned: later writes are refused with the cause.
        let again = store.append(calls[0].clone()).and_then(|r| r.wait());
        assert!(again.is_err_and(|e| matches!(e.kind(), ErrorKind::Poisoned)), "writes after a failure are refused");
        let _ = store.close();
        check_reopened(dir.path(), &acked);
    }
}

#[test]
fn eio_on_fsync_poisons_with_a_clear_error() {
    let calls = workload(6, 6);
    for (durability, nth) in [(Durability::Group, 2), (Durability::Sync, 5), (Durability::Group, 7)] {
        let dir = tempdir();
        let plan = FailAt::new(OpKind::Sync, nth, Fault::Fail(EIO), false);
        let store = Store::open(dir.path(), opts(durability, Some(plan.clone()))).expect("open");
        let (acked, err) = drive(&store, &calls, 3);
        assert!(plan.tripped());
        let err = err.expect("the failed fsync surfaces");
        assert!(err.message().contains("fsync"), "the error names the fsync: {err}");
        assert!(store.flush().is_err_and(|e| matches!(e.kind(), ErrorKind::Poisoned)), "flush reports the poison");
        let _ = store.close();
        check_reopened(dir.path(), &acked);
    }
}

#[test]
fn disk_full_ends_with_a_clear_error_and_an_intact_store() {
    let calls = workload(8, 6);
    // ENOSPC on a data write, and a short write that filled the disk mid-frame.
    for fault in [Fault::Fail(ENOSPC), Fault::Short { written: 100, errno: ENOSPC }] {
        let dir = tempdir();
        let plan = FailAt::new(OpKind::Write, 6, fault, true);
        let store = Store::open(dir.path(), opts(Durability::Group, Some(plan.clone()))).expect("open");
        let (acked, err) = drive(&store, &calls, 4);
        assert!(plan.tripped());
        fails_with(&err.expect("disk full surfaces"), "No space left on device");
        let _ = store.close();
        check_reopened(dir.path(), &acked);
        // Space again: the reopened store takes more appends.
        let store = Store::open(dir.path(), Options::default()).expect("reopen");
        store.append(calls[calls.len() - 1].clone()).and_then(|r| r.wait()).expect("append after space is back");
        store.close().expect("close");
    }
}

#[test]
fn a_failed_manifest_replacement_poisons_and_recovers() {
    let calls = workload(12, 8);
    let dir = tempdir();
    // Replacements #0 and #1 happen at open (new manifest, first segment); #2 is the first roll.
    let plan = FailAt::new(OpKind::Replace, 2, Fault::Fail(EIO), false);
    let store = Store::open(dir.path(), opts(Durability::Group, Some(plan.clone()))).expect("open");
    let (acked, err) = drive(&store, &calls, 4);
    assert!(plan.tripped(), "the workload rolled a segment");
    fails_with(&err.expect("the failure surfaces"), "MANIFEST");
    let _ = store.close();
    check_reopened(dir.path(), &acked);
}

/// A power cut at sync point `k`: everything not fsynced is lost (or torn).
fn crash_round(durability: Durability, calls: &[Call], k: u64, torn: usize) -> bool {
    let dir = tempdir();
    let plan = CrashAt::new(k);
    let store = match Store::open(dir.path(), opts(durability, Some(plan.clone()))) {
        Ok(s) => s,
        Err(_) => {
            // The crash hit while the store was being created.
            plan.drop_unsynced(torn, k).expect("drop unsynced");
            check_reopened(dir.path(), &[]);
            return plan.crashed();
        }
    };
    let (acked, err) = drive(&store, calls, 5);
    assert_eq!(err.is_some(), plan.crashed(), "an error exactly when the crash happened");
    let _ = store.close();
    plan.drop_unsynced(torn, k).expect("drop unsynced");
    check_reopened(dir.path(), &acked);
    plan.crashed()
}

#[test]
fn power_cut_at_every_sync_point_keeps_every_acknowledged_record() {
    let calls = workload(12, 8);
    for durability in [Durability::Group, Durability::Sync] {
        // Count the sync points of the whole workload, then cut at each.
        let dir = tempdir();
        let counter = CrashAt::new(u64::MAX);
        let store = Store::open(dir.path(), opts(durability, Some(counter.clone()))).expect("open");
        let (acked, err) = drive(&store, &calls, 5);
        assert!(err.is_none() && acked.len() == calls.len());
        store.close().expect("close");
        let points = counter.sync_points();
        assert!(points > 10, "the workload has many sync points ({points})");
        // Under `sync` every writer batch fsyncs, and batch boundaries depend
        // on thread timing: a run may have a few sync points more or fewer
        // than the counting run. Sweep a little past the count; every point
        // short of the last few must be reached.
        let mut rounds = 0;
        for k in 0..points + 3 {
            for torn in [0, 300] {
                let crashed = crash_round(durability, &calls, k, torn);
                assert!(crashed || k + 3 >= points, "sync point {k} of {points} was reached");
                rounds += usize::from(crashed);
            }
        }
        eprintln!("{durability:?}: {rounds} power-cut rounds over {points} sync points");
    }
}
