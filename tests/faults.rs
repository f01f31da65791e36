//! The store driven through the fault-injecting storage layer
//! (`trajlog::storage::fault`): EIO and ENOSPC on writes and fsyncs, short
//! (torn) writes, and a power cut at every sync point of a workload.
//!
//! The promises checked after every fault: an acknowledged record (its
//! `Receipt::wait` or a later `flush` returned Ok) is present and bit-exact
//! after reopening; nothing corrupt is served (every call decodes, `verify`
//! passes); a failed write or fsync poisons the store with an error that says
//! what failed (its kind `StorageFull` when the disk is full, its
//! `io::Error` as the source), and every later write is refused.
//!
//! Every test here counts disk operations ("fail the n-th fsync", "cut at the
//! k-th sync point"), so the sequence of operations must not depend on thread
//! timing. It would: the writer thread drains whatever the channel holds into
//! one batch, and under `sync` every batch is an fsync. [`Stepped`] fixes the
//! batching: each step of the workload appends its first call alone (the
//! writer is held at that batch's first disk operation while the rest of the
//! step is queued), then the rest of the step as one batch, then flushes. Two
//! runs of a workload then perform the same operations in the same order, on
//! any machine under any load.

mod common;

use common::{assert_same, tempdir};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;
use trajlog::storage::fault::{CrashAt, FailAt, Fault, FaultPlan, Op, OpKind, EIO, ENOSPC};
use trajlog::{Call, Durability, ErrorKind, Options, Store};
use trajlog_sim::{simulate_session, Shape, SimConfig};

/// A fault plan behind a gate that can hold the writer thread at its next disk
/// operation, so that a test decides which appends share a writer batch.
#[derive(Debug)]
struct Stepped<P> {
    plan: Arc<P>,
    gate: Mutex<Gate>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Gate {
    /// Hold the next disk operation until released.
    armed: bool,
    /// An operation is held.
    held: bool,
}

/// Not a timing assumption: a held writer answers in microseconds. This only
/// turns a bug that would hang the test (the writer never reached a disk
/// operation) into a failure that says so.
const HANG_GUARD: Duration = Duration::from_secs(300);

impl<P: FaultPlan> Stepped<P> {
    fn new(plan: Arc<P>) -> Arc<Self> {
        Arc::new(Self { plan, gate: Mutex::new(Gate::default()), changed: Condvar::new() })
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hold the writer at its next disk operation.
    fn arm(&self) {
        self.gate().armed = true;
    }

    /// Wait until the writer is held (it has taken its batch off the channel).
    fn wait_held(&self) {
        let gate = self.gate();
        let (gate, timeout) =
            self.changed.wait_timeout_while(gate, HANG_GUARD, |g| !g.held).unwrap_or_else(|e| e.into_inner());
        assert!(gate.held && !timeout.timed_out(), "the writer never reached a disk operation");
    }

    /// Let the held operation (if any) proceed, and hold nothing more.
    fn release(&self) {
        self.gate().armed = false;
        self.changed.notify_all();
    }
}

impl<P: FaultPlan> FaultPlan for Stepped<P> {
    fn check(&self, op: &Op<'_>) -> Fault {
        let mut gate = self.gate();
        if gate.armed {
            gate.held = true;
            self.changed.notify_all();
            gate = self.changed.wait_while(gate, |g| g.armed).unwrap_or_else(|e| e.into_inner());
            gate.held = false;
        }
        drop(gate);
        // The inner plan sees every operation, in the writer's order.
        self.plan.check(op)
    }
}

fn workload(sessions: usize, steps: usize) -> Vec<Call> {
    let cfg = SimConfig {
        sessions,
        steps,
        system_tokens: 300,
        completion_tokens: (100, 400),
        tool_tokens: (50, 200),
        // The sync points the README counts come from these sizes.
        shape: Shape::Lean,
        ..SimConfig::default()
    };
    (0..sessions).flat_map(|s| simulate_session(&cfg, s).calls).collect()
}

fn opts(durability: Durability, faults: Option<Arc<dyn FaultPlan>>) -> Options {
    // Small segments so that the workload seals and rolls (more sync points).
    // The group-commit timer is set out of reach so that every fsync comes
    // from a flush, a roll or the manifest: the sync points are then the same
    // in every run (with a short timer their count depends on timing).
    Options::default().durability(durability).segment_bytes(64 << 10).group_commit_ms(60_000).faults(faults)
}

/// Append `calls` in steps of `batch`, acknowledging each step with a flush;
/// returns the calls acknowledged before the first error, and that error.
///
/// The writer batches of a step are fixed (module doc): the step's first call
/// alone, then the rest of the step, then the flush (which commits nothing
/// more, or commits the rest if it reached the writer in the same batch: the
/// same disk operations either way).
fn drive<P: FaultPlan>(
    store: &Store,
    plan: &Stepped<P>,
    calls: &[Call],
    batch: usize,
) -> (Vec<Call>, Option<trajlog::Error>) {
    let mut acked = Vec::new();
    for chunk in calls.chunks(batch) {
        let Some((first, rest)) = chunk.split_first() else { continue };
        // The writer is idle here: the last flush returned, and nothing was
        // queued after it. The first append is alone in the channel when the
        // writer wakes, and the writer holds at that batch's first operation
        // (every batch writes its frames) while the rest is queued.
        plan.arm();
        if let Err(e) = store.append(first.clone()) {
            plan.release();
            return (acked, Some(e));
        }
        plan.wait_held();
        for c in rest {
            if let Err(e) = store.append(c.clone()) {
                plan.release();
                return (acked, Some(e));
            }
        }
        plan.release();
        match store.flush() {
            Ok(()) => acked.extend_from_slice(chunk),
            Err(e) => return (acked, Some(e)),
        }
    }
    (acked, None)
}

/// Open a store in `dir` through `plan`, behind a gate.
fn open<P: FaultPlan + 'static>(
    dir: &Path,
    durability: Durability,
    plan: &Arc<P>,
) -> (trajlog::Result<Store>, Arc<Stepped<P>>) {
    let stepped = Stepped::new(plan.clone());
    let store = Store::open(dir, opts(durability, Some(stepped.clone())));
    (store, stepped)
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

/// A full disk: the kind says so (also once the store is poisoned by it), and
/// the ENOSPC is the error's source.
fn full_disk(e: &trajlog::Error) {
    assert_eq!(e.kind(), &ErrorKind::StorageFull, "{e}");
    assert!(e.message().contains("No space left on device"), "{e}");
    assert_eq!(e.io_error().and_then(std::io::Error::raw_os_error), Some(ENOSPC), "{e}");
    let source = std::error::Error::source(e).and_then(|s| s.downcast_ref::<std::io::Error>());
    assert_eq!(source.and_then(std::io::Error::raw_os_error), Some(ENOSPC), "{e}: the source");
}

#[test]
fn eio_on_a_segment_write_poisons_and_loses_nothing_acknowledged() {
    let calls = workload(6, 6);
    // Write #0 is the first segment's header, at open.
    for nth in [1, 4, 10] {
        let dir = tempdir();
        let plan = FailAt::new(OpKind::Write, nth, Fault::Fail(EIO), false);
        let (store, stepped) = open(dir.path(), Durability::Group, &plan);
        let store = store.expect("open");
        let (acked, err) = drive(&store, &stepped, &calls, 4);
        assert!(plan.tripped(), "the workload reached write #{nth}");
        let err = err.expect("the failed write surfaces");
        fails_with(&err, "Input/output error");
        assert_eq!(err.io_error().and_then(std::io::Error::raw_os_error), Some(EIO), "{err}");
        // Poisoned: later writes are refused with the cause.
        let again = store.append(calls[0].clone()).and_then(|r| r.wait());
        assert!(
            again.is_err_and(|e| matches!(e.kind(), ErrorKind::Poisoned)
                && e.io_error().and_then(std::io::Error::raw_os_error) == Some(EIO)),
            "writes after a failure are refused, with the EIO"
        );
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
        let (store, stepped) = open(dir.path(), durability, &plan);
        let store = store.expect("open");
        let (acked, err) = drive(&store, &stepped, &calls, 3);
        assert!(plan.tripped(), "the workload reached fsync #{nth}");
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
        let (store, stepped) = open(dir.path(), Durability::Group, &plan);
        let store = store.expect("open");
        let (acked, err) = drive(&store, &stepped, &calls, 4);
        assert!(plan.tripped(), "the workload reached write #6");
        full_disk(&err.expect("disk full surfaces"));
        // Every later call says so too, not just "poisoned".
        let appended = store.append(calls[0].clone());
        full_disk(&appended.and_then(|r| r.wait()).expect_err("an append after a full disk"));
        full_disk(&store.flush().expect_err("a flush after a full disk"));
        full_disk(&store.seal_session("s0").expect_err("a seal after a full disk"));
        full_disk(&store.close().expect_err("close reports the full disk"));
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
    let (store, stepped) = open(dir.path(), Durability::Group, &plan);
    let store = store.expect("open");
    let (acked, err) = drive(&store, &stepped, &calls, 4);
    assert!(plan.tripped(), "the workload rolled a segment");
    fails_with(&err.expect("the failure surfaces"), "MANIFEST");
    let _ = store.close();
    check_reopened(dir.path(), &acked);
}

/// Calls per step of the power-cut workload.
const STEP_CALLS: usize = 5;

/// The sync points of the whole power-cut workload: (at open, in all).
fn count_sync_points(durability: Durability, calls: &[Call]) -> (u64, u64) {
    let dir = tempdir();
    let counter = CrashAt::new(u64::MAX);
    let (store, stepped) = open(dir.path(), durability, &counter);
    let store = store.expect("open");
    let at_open = counter.sync_points();
    let (acked, err) = drive(&store, &stepped, calls, STEP_CALLS);
    assert!(err.is_none() && acked.len() == calls.len(), "the workload runs clean without a crash: {err:?}");
    let points = counter.sync_points();
    store.close().expect("close");
    // A round cut past the workload's end would otherwise crash in `close`,
    // where no caller is told.
    assert_eq!(counter.sync_points(), points, "closing a flushed store has no sync point");
    (at_open, points)
}

/// How a power-cut round went.
struct Round {
    crashed: bool,
    /// The store opened before the cut (the cut hit the workload, not `open`).
    opened: bool,
    acked: usize,
}

/// A power cut at sync point `k`: everything not fsynced is lost (or torn).
fn crash_round(durability: Durability, calls: &[Call], k: u64, torn: usize) -> Round {
    let dir = tempdir();
    let plan = CrashAt::new(k);
    let (store, stepped) = open(dir.path(), durability, &plan);
    let store = match store {
        Ok(s) => s,
        Err(e) => {
            assert!(plan.crashed(), "open fails only because of the crash: {e}");
            // The crash hit while the store was being created.
            plan.drop_unsynced(torn, k).expect("drop unsynced");
            check_reopened(dir.path(), &[]);
            return Round { crashed: true, opened: false, acked: 0 };
        }
    };
    let (acked, err) = drive(&store, &stepped, calls, STEP_CALLS);
    assert_eq!(err.is_some(), plan.crashed(), "an error exactly when the crash happened: {err:?}");
    let _ = store.close();
    plan.drop_unsynced(torn, k).expect("drop unsynced");
    check_reopened(dir.path(), &acked);
    Round { crashed: plan.crashed(), opened: true, acked: acked.len() }
}

#[test]
fn power_cut_at_every_sync_point_keeps_every_acknowledged_record() {
    let calls = workload(12, 8);
    for durability in [Durability::Group, Durability::Sync] {
        // Count the sync points of the whole workload, then cut at each. The
        // driver fixes the writer's batches, so every run of the workload
        // has the same sync points: counted twice to show it, and every cut
        // short of the count must land.
        let (at_open, points) = count_sync_points(durability, &calls);
        assert_eq!(count_sync_points(durability, &calls), (at_open, points), "{durability:?}: the sync points repeat");
        assert!(
            points - at_open > 20,
            "{durability:?}: the workload has many sync points of its own ({at_open} at open, {points} in all)"
        );
        let (mut rounds, mut mid_workload, mut last_acked) = (0, 0, 0);
        // One cut past the end: a run that reaches no cut is not an error.
        for k in 0..=points {
            for torn in [0, 300] {
                let round = crash_round(durability, &calls, k, torn);
                assert_eq!(round.crashed, k < points, "{durability:?}: cut at sync point {k} of {points}");
                // Same operations in every run: a later cut never acknowledges less.
                assert!(
                    round.acked >= last_acked,
                    "{durability:?}: cut at {k} acknowledged {} < {last_acked}",
                    round.acked
                );
                last_acked = round.acked;
                rounds += usize::from(round.crashed);
                mid_workload += usize::from(round.crashed && round.opened);
            }
        }
        assert_eq!(last_acked, calls.len(), "with no cut, everything is acknowledged");
        assert_eq!(mid_workload as u64, 2 * (points - at_open), "every sync point of the workload was cut");
        eprintln!("{durability:?}: {rounds} power-cut rounds over {points} sync points ({at_open} at open)");
    }
}
