//! The writer protocol, tested from inside the store: sequence and durable
//! numbers, receipts, back-pressure, poisoning, `SyncSoon`, and a publication
//! racing with replacements and deletions.
//!
//! No verdict depends on timing: the writer is held at a gate on its next
//! disk operation (a fault plan), back-pressure is observed through the
//! queue's count of waiting appenders, and every wait is for an event the test
//! itself causes (the timeouts are hang guards only).

use super::*;
use crate::storage::fault::{Fault, FaultPlan, Op, EIO, ENOSPC};
use std::sync::mpsc;

const NEVER: Duration = Duration::from_secs(120);

/// Holds the writer thread at its next disk operation; on release, lets it
/// (and every later operation) proceed, or fail with an errno.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    armed: bool,
    held: bool,
    fail: Option<i32>,
}

impl Gate {
    fn arm(&self) {
        lock(&self.state).armed = true;
    }

    /// Wait until the writer is held at a disk operation.
    fn wait_held(&self) {
        let s = lock(&self.state);
        let (s, timeout) = self.changed.wait_timeout_while(s, NEVER, |s| !s.held).unwrap_or_else(|e| e.into_inner());
        assert!(s.held && !timeout.timed_out(), "the writer never reached a disk operation");
    }

    /// Let the held operation go on, failing it and every later one with
    /// `fail` if given.
    fn release(&self, fail: Option<i32>) {
        let mut s = lock(&self.state);
        s.armed = false;
        s.fail = s.fail.or(fail);
        self.changed.notify_all();
    }
}

impl FaultPlan for Gate {
    fn check(&self, _op: &Op<'_>) -> Fault {
        let mut s = lock(&self.state);
        if s.armed {
            s.held = true;
            self.changed.notify_all();
            s = self.changed.wait_while(s, |s| s.armed).unwrap_or_else(|e| e.into_inner());
            s.held = false;
        }
        s.fail.map_or(Fault::Proceed, Fault::Fail)
    }
}

fn call(session: &str, n: usize) -> Call {
    Call {
        trace_id: format!("{session}/{n}"),
        session_id: session.to_owned(),
        timestamp: n as f64,
        prompt_token_ids: (0..32 + 8 * n as u32).collect(),
        completion_token_ids: vec![n as u32; 8],
        logprobs: Some(vec![-0.25; 8]),
        ..Default::default()
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// A store whose writer can be held at a gate; a queue of one record.
fn gated(dir: &Path, durability: Durability) -> (Store, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let options = Options {
        durability,
        queue_depth: 1,
        // Out of reach: every fsync in these tests is one a test asked for.
        group_commit_ms: 600_000,
        faults: Some(gate.clone()),
        ..Options::default()
    };
    (Store::open(dir, options).expect("open"), gate)
}

/// An appender on its own thread.
struct Appender {
    done: mpsc::Receiver<Result<()>>,
    thread: std::thread::JoinHandle<()>,
}

impl Appender {
    fn start(store: &Arc<Store>, call: Call) -> Self {
        let (tx, done) = mpsc::channel();
        let store = store.clone();
        let thread = std::thread::spawn(move || {
            let _ = tx.send(store.append_durable(call));
        });
        Self { done, thread }
    }

    /// Whether it returned (it must not while back-pressure holds it).
    fn returned(&self) -> bool {
        self.done.try_recv().is_ok()
    }

    /// Its result, once its thread (and its handle on the store) is gone.
    fn result(self) -> Result<()> {
        let result = self.done.recv_timeout(NEVER).expect("the appender returned");
        self.thread.join().expect("appender thread");
        result
    }
}

/// Hold the writer inside the commit of a batch holding `s/0` alone, then
/// queue `s/1` behind it (filling the queue of one), and start a third
/// appender, which waits for room. Returns the receipts and that appender.
fn back_pressure(store: &Arc<Store>, gate: &Gate) -> (Receipt, Receipt, Appender) {
    gate.arm();
    let r1 = store.append(call("s", 0)).expect("append");
    gate.wait_held();
    // The writer handled `s/0` (its room is back) and is held writing it.
    let r2 = store.append(call("s", 1)).expect("append");
    let third = Appender::start(store, call("s", 2));
    store.inner.queue.wait_for_waiters(1);
    (r1, r2, third)
}

#[test]
fn sequence_numbers_are_log_order_and_one_wait_covers_every_earlier_append() {
    let dir = tempdir();
    let store = Arc::new(Store::open(dir.path(), Options { queue_depth: 4, ..Options::default() }).expect("open"));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                (0..50)
                    .map(|n| (store.append(call(&format!("t{t}"), n)).expect("append"), format!("t{t}/{n}")))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut receipts: Vec<(Receipt, String)> = threads.into_iter().flat_map(|t| t.join().expect("appender")).collect();
    receipts.sort_by_key(|(r, _)| r.seq());
    let seqs: Vec<u64> = receipts.iter().map(|(r, _)| r.seq()).collect();
    assert_eq!(seqs, (1..=200).collect::<Vec<u64>>(), "one sequence number per append, none skipped");
    // Waiting for the last covers every earlier append.
    receipts.last().expect("appended").0.wait().expect("durable");
    assert!(store.inner.durable_seq.load(Ordering::Acquire) >= 200);
    let snap = store.snapshot();
    for (r, id) in &receipts {
        r.wait().expect("already durable");
        assert!(snap.get(id).expect("read").is_some(), "{id} durable but not visible");
    }
    // The log holds the calls in sequence order.
    let mut logged = Vec::new();
    snap.for_each_call(|c| {
        logged.push((c.loc, c.trace_id().to_owned()));
        Ok(())
    })
    .expect("scan");
    logged.sort_by_key(|(loc, _)| *loc);
    let by_seq: Vec<&str> = receipts.iter().map(|(_, id)| id.as_str()).collect();
    let by_log: Vec<&str> = logged.iter().map(|(_, id)| id.as_str()).collect();
    assert_eq!(by_log, by_seq);
}

#[test]
fn back_pressure_holds_an_appender_until_the_writer_takes_a_record() {
    let dir = tempdir();
    let (store, gate) = gated(dir.path(), Durability::Buffered);
    let store = Arc::new(store);
    let (r1, r2, third) = back_pressure(&store, &gate);
    assert!(!third.returned(), "the queue of one is full: the third append waits");
    assert_eq!(store.inner.queue.in_flight().0, 1);
    gate.release(None);
    third.result().expect("appended");
    r1.wait().expect("durable");
    r2.wait().expect("durable");
    let snap = store.snapshot();
    for n in 0..3 {
        assert!(snap.get(&format!("s/{n}")).expect("read").is_some());
    }
    assert_eq!(store.inner.queue.in_flight(), (0, 0), "all room given back");
}

#[test]
fn a_durability_wait_is_not_queued_behind_appenders() {
    let dir = tempdir();
    let (store, gate) = gated(dir.path(), Durability::Group);
    let store = Arc::new(store);
    let (_r1, r2, third) = back_pressure(&store, &gate);
    // Even with the append lock taken (as an appender stuck in a blocking
    // send under it would), a durability wait asks for its sync at once.
    let (locked_tx, locked_rx) = mpsc::channel();
    let (unlock_tx, unlock_rx) = mpsc::channel::<()>();
    let holder = {
        let store = store.clone();
        std::thread::spawn(move || {
            let _s = lock(&store.inner.send);
            let _ = locked_tx.send(());
            let _ = unlock_rx.recv();
        })
    };
    locked_rx.recv_timeout(NEVER).expect("lock taken");
    let (asked_tx, asked_rx) = mpsc::channel();
    let waiter = r2.clone();
    std::thread::spawn(move || {
        waiter.request_sync();
        let _ = asked_tx.send(());
    });
    asked_rx.recv_timeout(NEVER).expect("a durability wait's sync request waited for the append lock");
    let tx = store.inner.tx.as_ref().expect("writable");
    assert_eq!(tx.len(), 2, "the channel holds s/1 and the SyncSoon behind it");
    let _ = unlock_tx.send(());
    holder.join().expect("lock holder");
    gate.release(None);
    r2.wait().expect("durable");
    third.result().expect("appended");
}

#[test]
fn a_failed_write_wakes_every_waiter_with_the_failure_s_kind() {
    for (errno, kind) in [(ENOSPC, ErrorKind::StorageFull), (EIO, ErrorKind::Poisoned)] {
        let dir = tempdir();
        let (store, gate) = gated(dir.path(), Durability::Group);
        let store = Arc::new(store);
        let (r1, r2, third) = back_pressure(&store, &gate);
        let (wait_tx, wait_rx) = mpsc::channel();
        let waiter = r1.clone();
        std::thread::spawn(move || {
            let _ = wait_tx.send(waiter.wait());
        });
        // The held write of s/0 fails, and so does every later disk operation.
        gate.release(Some(errno));
        let check = |what: &str, result: Result<()>| {
            let err = result.err().unwrap_or_else(|| panic!("{what} succeeded after a failed write"));
            assert_eq!(err.kind(), &kind, "{what}: {err}");
            assert_eq!(err.io_error().and_then(std::io::Error::raw_os_error), Some(errno), "{what}: {err}");
            let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<std::io::Error>());
            assert_eq!(source.and_then(std::io::Error::raw_os_error), Some(errno), "{what}: the source chain");
        };
        // Pending: the appender waiting for room, durability waits.
        check("the appender held by back-pressure", third.result());
        check("a waiter asleep before the failure", wait_rx.recv_timeout(NEVER).expect("woken"));
        check("the receipt of the failed write", r1.wait());
        check("a receipt queued behind it", r2.wait());
        // Later calls.
        check("append", store.append(call("s", 9)).map(drop));
        check("flush", store.flush());
        check("sync", store.sync());
        check("roll", store.roll());
        check("seal", store.seal_session("s"));
        check("delete", store.delete_session("s").map(drop));
        check("reward", store.set_reward(Target::Session("s".into()), 1.0));
        check("compact", store.compact(&crate::compact::CompactOptions::default()).map(drop));
        let store = Arc::try_unwrap(store).ok().expect("sole owner");
        check("close", store.close());
    }
}

/// A durability listener that counts its calls and wakes a test waiting for the next.
fn listen(store: &Store) -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    store.on_durable(move || {
        let _ = lock(&tx).send(());
    });
    rx
}

/// Wait for wake-ups until `receipt` polls as done; its verdict.
fn polled(receipt: &Receipt, woken: &mpsc::Receiver<()>) -> Result<()> {
    loop {
        match receipt.poll() {
            Ok(true) => return Ok(()),
            Ok(false) => woken.recv_timeout(NEVER).expect("the listener was called"),
            Err(e) => return Err(e),
        }
    }
}

/// A listening store whose writer is held writing `s/0`; its receipt.
fn held_listening(dir: &Path) -> (Store, Arc<Gate>, mpsc::Receiver<()>, Receipt) {
    let (store, gate) = gated(dir, Durability::Group);
    let woken = listen(&store);
    gate.arm();
    let r1 = store.append(call("s", 0)).expect("append");
    gate.wait_held();
    (store, gate, woken, r1)
}

#[test]
fn try_append_gives_the_call_back_when_full_and_a_listener_wakes_a_poller() {
    let dir = tempdir();
    let (store, gate, woken, r1) = held_listening(dir.path());
    let r2 = store.append(call("s", 1)).expect("append");
    // The queue of one holds s/1: a third append would wait.
    let valid = ValidCall::new(call("s", 2)).expect("valid");
    let back = match store.try_append_valid(valid.clone()).expect("not refused") {
        TryAppend::Full(back) => back,
        TryAppend::Appended(r) => panic!("appended as {r:?} into a full queue"),
    };
    assert_eq!(*back, valid, "the call comes back untouched");
    assert!(!r1.poll().expect("no failure"), "s/0 is held before its commit");
    r2.sync_soon();
    gate.release(None);
    polled(&r1, &woken).expect("durable");
    polled(&r2, &woken).expect("durable");
    let r3 = match store.try_append_valid(*back).expect("not refused") {
        TryAppend::Appended(r) => r,
        TryAppend::Full(_) => panic!("the queue is empty now"),
    };
    assert_eq!(r3.seq(), 3);
    r3.sync_soon();
    polled(&r3, &woken).expect("durable");
    assert!(store.snapshot().get("s/2").expect("read").is_some(), "s/2 durable but not visible");
    // Closing wakes the listener; a receipt made durable before still polls as done.
    woken.try_iter().for_each(drop);
    store.close().expect("closed");
    assert!(woken.try_recv().is_ok(), "closing called the listener");
    assert!(r3.poll().expect("durable before the close"));
}

#[test]
fn a_failed_write_wakes_the_listener_and_polls_as_the_failure() {
    let dir = tempdir();
    let (store, gate, woken, r1) = held_listening(dir.path());
    r1.sync_soon();
    gate.release(Some(EIO));
    let err = polled(&r1, &woken).expect_err("the write failed");
    assert_eq!(err.kind(), &ErrorKind::Poisoned, "{err}");
    let err = store.try_append_valid(ValidCall::new(call("s", 1)).expect("valid")).expect_err("refused");
    assert_eq!(err.kind(), &ErrorKind::Poisoned, "{err}");
}

#[test]
fn the_writer_keeps_zeros_written_ahead_of_the_active_segment_s_data_and_trims_them_on_close() {
    use std::os::unix::fs::MetadataExt;
    for ahead in [crate::segment::writer::ZERO_AHEAD_DEFAULT, 0] {
        let dir = tempdir();
        let store = Store::open(dir.path(), Options::default().zero_ahead_bytes(ahead)).expect("open");
        for n in 0..20 {
            store.append_durable(call("s", n)).expect("durable");
        }
        let (path, data_end) = {
            let view = lock(&store.inner.view).clone();
            let active = view.segments.get(&1).expect("the active segment");
            (active.path.to_path_buf(), active.visible_len)
        };
        let allocated = std::fs::metadata(&path).expect("stat").blocks() * 512;
        if ahead > 0 {
            assert!(
                allocated >= data_end + ahead,
                "{allocated} bytes allocated for {data_end} of data and {ahead} ahead"
            );
        } else {
            assert!(
                allocated < data_end + (256 << 10),
                "{allocated} bytes allocated for {data_end} of data, none ahead"
            );
        }
        let mapped = std::fs::read(&path).expect("read");
        assert!(mapped[data_end as usize..].iter().all(|b| *b == 0), "past the data: zeros");
        store.close().expect("close");
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), data_end, "trimmed to the data on close");
        let store = Store::open(dir.path(), Options::default()).expect("reopen");
        assert_eq!(store.recovery_report().events.len(), 0, "nothing to cut: {:?}", store.recovery_report().events);
        let snap = store.snapshot();
        for n in 0..20 {
            let id = format!("s/{n}");
            assert_eq!(snap.get(&id).expect("read").expect("present").to_call().expect("decode"), call("s", n));
        }
    }
}

#[test]
fn a_writer_panic_wakes_an_appender_waiting_for_room() {
    let dir = tempdir();
    let (store, gate) = gated(dir.path(), Durability::Group);
    let store = Arc::new(store);
    let (r1, _r2, third) = back_pressure(&store, &gate);
    store.inject_writer_panic().expect("sent");
    gate.release(None);
    let err = third.result().expect_err("refused");
    assert_eq!(err.kind(), &ErrorKind::Poisoned, "{err}");
    // s/0 was written before the panic; its receipt answers either way.
    let _ = r1.wait();
    assert!(store.append(call("s", 9)).is_err_and(|e| e.kind() == &ErrorKind::Poisoned));
    let why = store.poisoned().expect("Store::poisoned says so");
    assert_eq!(why.kind(), &ErrorKind::Poisoned, "{why}");
}

#[test]
fn a_store_that_takes_writes_is_not_poisoned() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    store.append(call("s", 0)).expect("append").wait().expect("durable");
    assert!(store.poisoned().is_none());
}

#[test]
fn replacements_and_deletions_made_during_a_compaction_still_win() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    // c alone in the first segment: retirable, unless a live call of c is
    // still in segments (c/3 below, which extends c/2's context).
    for s in ["c", "a", "b"] {
        for n in 0..3 {
            store.append(call(s, n)).expect("append");
        }
        if s == "c" {
            store.roll().expect("roll");
        }
    }
    store.flush().expect("flush");
    let c2 = call("c", 2);
    let mut c3 = call("c", 3);
    c3.prompt_token_ids = [c2.prompt_token_ids.as_slice(), &c2.completion_token_ids, &[5, 6, 7]].concat();
    let mut replacement = call("a", 1);
    replacement.completion_token_ids = vec![7; 5];
    replacement.logprobs = Some(vec![-1.5; 5]);
    // Every session is older than now: all three are compacted from the
    // snapshot; meanwhile a/1 is replaced, b deleted, c gets a fourth call
    // (whose prefix-delta parent c/2 is in a segment the compaction sealed).
    // (Without copy-forward, which would copy c/3 out and free segment 1:
    // this checks that c/3's parent keeps it.)
    let opts = crate::compact::CompactOptions {
        selection: crate::compact::Selection::OlderThan(0.0),
        copy_forward: None,
        ..Default::default()
    };
    let report = crate::compact::run_with(&store, &opts, &mut || {
        store.append_durable(replacement.clone()).expect("replace");
        assert_eq!(store.delete_session("b").expect("delete"), 3);
        store.append_durable(c3.clone()).expect("append");
    })
    .expect("compact");
    assert_eq!((report.sessions, report.calls), (3, 9));
    // `first`: right after the compaction that raced with the changes.
    let check = |store: &Store, first: bool| {
        let snap = store.snapshot();
        let get = |id: &str| snap.get(id).expect("read");
        for id in ["a/0", "a/2", "c/0", "c/1", "c/2"] {
            let v = get(id).unwrap_or_else(|| panic!("{id} lost"));
            assert!(v.is_compacted(), "{id} is served from its shard row");
            let (s, n) = id.split_once('/').expect("id");
            assert_eq!(v.to_call().expect("read"), call(s, n.parse().expect("n")), "{id}");
        }
        let a1 = get("a/1").expect("the replacement");
        assert_eq!(a1.to_call().expect("read"), replacement, "the replacement wins over the compacted a/1");
        let c3_view = get("c/3").expect("c/3");
        assert_eq!(c3_view.to_call().expect("c/3 and its parent read back"), c3);
        if first {
            assert!(!a1.is_compacted() && !c3_view.is_compacted(), "written after the snapshot, served from segments");
            assert!(c3_view.parent().is_some_and(|p| p.segment == 1), "c/3 is stored as a delta on c/2");
        }
        for n in 0..3 {
            assert!(get(&format!("b/{n}")).is_none(), "b/{n}: the deletion wins");
        }
        assert_eq!(snap.session("a", None, None).expect("read").len(), 3);
        assert!(snap.session("b", None, None).expect("read").is_empty());
        assert_eq!(snap.session("c", None, None).expect("read").len(), 4);
        assert_eq!(snap.call_count(), 7);
    };
    check(&store, true);
    store.close().expect("close");
    let store = Store::open(dir.path(), Options::default()).expect("reopen");
    check(&store, true);
    // Compacting again takes what changed and keeps every answer.
    store.compact(&opts).expect("compact again");
    check(&store, false);
    store.close().expect("close");
    check(&Store::open(dir.path(), Options::default()).expect("reopen"), false);
}

#[test]
fn queue_bytes_is_validated_and_has_a_setter() {
    let options = Options::default().queue_bytes(1 << 20);
    assert_eq!(options.queue_bytes, 1 << 20);
    assert_eq!(Options::default().queue_bytes, DEFAULT_QUEUE_BYTES);
    let dir = tempdir();
    let err = Store::open(dir.path(), Options::default().queue_bytes(0)).err().expect("refused");
    assert!(matches!(err.kind(), ErrorKind::InvalidInput { field } if field == "queue_bytes"), "{err}");
}

#[test]
fn a_reward_set_while_its_session_is_compacted_reaches_the_side_table() {
    // The compaction freezes the reward the session had when it began; one
    // set meanwhile must reach the side table (format-spec/shard.md §8).
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for n in 0..3 {
        store.append(call("a", n)).expect("append");
    }
    store.set_reward(Target::Session("a".into()), 1.0).expect("reward");
    store.seal_session("a").expect("seal");
    let report = crate::compact::run_with(&store, &crate::compact::CompactOptions::default(), &mut || {
        store.set_reward(Target::Session("a".into()), 2.0).expect("reward meanwhile");
    })
    .expect("compact");
    assert_eq!(report.sessions, 1);
    let table = super::rewards::RewardsTable::open(dir.path()).expect("side table");
    assert!(table.listed.contains("a"), "the session is listed: {table:?}");
    assert!(table.through.is_some());
    assert_eq!(store.snapshot().session_reward("a"), Some(2.0));
    store.close().expect("close");
}

#[test]
fn a_forked_child_does_not_keep_the_store_locked() {
    // A child forked while the store is open (a DataLoader worker, say) must
    // not hold its LOCK once the parent closed it (storage/lock.rs).
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    store.append_durable(call("a", 0)).expect("append");
    let (mut fds, mut ready) = ([0i32; 2], [0i32; 2]);
    // SAFETY: each array has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    // SAFETY: the child makes only async-signal-safe calls (write, read, _exit).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let mut b = [0u8; 1];
        // SAFETY: writes and reads one byte from/into live buffers; _exit
        // skips every destructor. By the time the child writes, its fork
        // handler has run (it runs before fork returns here).
        unsafe {
            libc::write(ready[1], [1u8].as_ptr().cast(), 1);
            libc::read(fds[0], b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    // The handler runs in the child when the child first runs, which on a
    // busy machine can be after the parent's next steps: wait for it (a
    // child that has not run yet still holds the lock's description).
    let mut b = [0u8; 1];
    // SAFETY: reads one byte into a live buffer from our own pipe.
    assert_eq!(unsafe { libc::read(ready[0], b.as_mut_ptr().cast(), 1) }, 1, "the child started");
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default());
    // Release and reap the child before judging, so it never outlives the test.
    // SAFETY: writes one byte from a live buffer, waits for our own child,
    // closes the pipes' own descriptors.
    unsafe {
        libc::write(fds[1], [1u8].as_ptr().cast(), 1);
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        for fd in fds.into_iter().chain(ready) {
            libc::close(fd);
        }
    }
    let reopened = reopened.expect("the child does not hold the lock");
    assert!(reopened.snapshot().get("a/0").expect("read").is_some());
    reopened.close().expect("close");
}

/// Giving a snapshot's resident pages back changes no byte it serves, not
/// even through slices borrowed before (compaction does it as it reads).
#[test]
fn released_pages_read_back_the_same_bytes() {
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let calls: Vec<Call> = (0..64).map(|i| call(&format!("s{}", i % 4), i)).collect();
    for c in &calls {
        store.append(c.clone()).unwrap();
    }
    store.roll().unwrap();
    let snap = store.snapshot();
    let views: Vec<_> = calls.iter().map(|c| snap.get(&c.trace_id).unwrap().unwrap()).collect();
    let before: Vec<(Vec<u32>, Vec<u32>)> =
        views.iter().map(|v| (v.completion_token_ids().to_vec(), v.prompt().unwrap())).collect();
    snap.release_pages();
    for ((v, c), (completion, prompt)) in views.iter().zip(&calls).zip(&before) {
        assert_eq!(v.completion_token_ids(), completion.as_slice());
        assert_eq!(v.completion_token_ids(), c.completion_token_ids.as_slice());
        assert_eq!(&v.prompt().unwrap(), prompt);
        assert_eq!(&v.to_call().unwrap(), c);
    }
    store.close().unwrap();
}

/// Everything a reader can ask of `store`, as text to compare: sessions
/// (calls, seal, reward), every call's ids, tokens, logprob bits and reward,
/// and each of `trace_ids`' live call.
fn answers(store: &Store, trace_ids: &[String]) -> Vec<String> {
    let snap = store.snapshot();
    let mut out: Vec<String> = snap
        .sessions()
        .iter()
        .map(|s| {
            let ids: Vec<String> = snap
                .session(&s.session_id, None, None)
                .expect("read")
                .iter()
                .map(|c| c.trace_id().to_owned())
                .collect();
            format!("session {} {} {} {:?} {ids:?}", s.session_id, s.calls, s.sealed, s.reward.map(f64::to_bits))
        })
        .collect();
    snap.for_each_call(|c| {
        let lp: Vec<u32> = c.logprobs().unwrap_or_default().iter().map(|x| x.to_bits()).collect();
        let reward = snap.trace_reward(c.trace_id()).map(f64::to_bits);
        out.push(format!(
            "call {} {} {:?} {:?} {lp:?} {reward:?}",
            c.trace_id(),
            c.session_id(),
            c.prompt()?,
            c.completion_token_ids()
        ));
        Ok(())
    })
    .expect("every call reads");
    for t in trace_ids {
        let live = snap.get(t).expect("read").map(|c| (c.session_id().to_owned(), c.is_compacted()));
        out.push(format!("{t}: {live:?}"));
    }
    out.sort();
    out.push(format!("count {}", snap.call_count()));
    out
}

#[test]
fn a_publication_that_writes_the_shard_index_file_freezes_what_the_writer_compacted() {
    // A long-lived writer kept every call it compacted in its maps (~0.4 KB
    // each) until it reopened. A publication that writes the shard index
    // file hands it an index replayed over the file, as an open builds it
    // (store/recovery.rs `Rebuilt`), with the records written meanwhile.
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default().segment_bytes(64 << 10)).expect("open");
    let sessions = ["a", "b", "c", "d", "e", "f"];
    for s in sessions {
        for n in 0..4 {
            store.append(call(s, n)).expect("append");
        }
    }
    store.set_reward(Target::Session("a".into()), 1.0).expect("reward");
    store.set_reward(Target::Trace("b/1".into()), -2.0).expect("reward");
    for s in ["a", "b", "c", "d", "e"] {
        store.seal_session(s).expect("seal");
    }
    let mut ids: Vec<String> = sessions.iter().flat_map(|s| (0..6).map(move |n| format!("{s}/{n}"))).collect();
    ids.push("x/0".into());
    // The first compaction writes the file (the store had no shards).
    // Meanwhile: a reward and a seal on sessions being compacted, a
    // deletion of one, a new session, a call of f (not compacted) and a
    // replacement of e/2 (out of its sealed session: refused).
    let opts = crate::compact::CompactOptions::default();
    let report = crate::compact::run_with(&store, &opts, &mut || {
        store.set_reward(Target::Session("c".into()), 3.5).expect("reward meanwhile");
        store.set_reward(Target::Trace("d/3".into()), 0.5).expect("reward meanwhile");
        assert_eq!(store.delete_session("e").expect("delete meanwhile"), 4);
        store.append(call("x", 0)).expect("append meanwhile");
        store.append(call("f", 4)).expect("append meanwhile");
        store.flush().expect("flush");
    })
    .expect("compact");
    assert_eq!(report.sessions, 5);
    let layers = store.snapshot().index_layers();
    assert!(layers.index_file_bytes > 0, "{layers:?}");
    // a, b, c, d: 16 calls in the frozen layer. e was deleted (its rows are
    // dead), f and x are in segments.
    assert_eq!((layers.calls, layers.frozen_calls), (16 + 5 + 1, 16), "{layers:?}");
    let want = answers(&store, &ids);
    assert!(want
        .iter()
        .any(|l| l.starts_with("session c 4 true") && l.contains(&format!("{:?}", Some(3.5f64.to_bits())))));
    let fresh = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(answers(&fresh, &ids), want, "the writer answers as a fresh open");
    // Writes naming a frozen session thaw it, as after an open.
    store.set_reward(Target::Session("a".into()), 9.0).expect("reward");
    assert_eq!(store.delete_session("b").expect("delete"), 4);
    assert!(store.append(call("a", 9)).is_err(), "a is sealed");
    store.seal_session("f").expect("seal");
    store.flush().expect("flush");
    let want = answers(&store, &ids);
    fresh.refresh().expect("refresh");
    assert_eq!(answers(&fresh, &ids), want);
    // A second compaction adds files the file does not describe (kept):
    // the writer's index is its own; the answers stay those of an open.
    store.compact(&opts).expect("compact again");
    let want = answers(&store, &ids);
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default()).expect("reopen");
    assert_eq!(answers(&reopened, &ids), want);
    reopened.close().expect("close");
}

#[test]
fn the_index_a_publication_rebuilds_holds_the_backlog_cold() {
    // The rebuilt index (store/recovery.rs `Rebuilt`) surveys the sealed
    // segments it replays as an open does (store/cold.rs): the calls of
    // sessions nothing else names go to the cold layer, not the maps; a
    // record written during the compaction thaws what it names.
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for s in 0..12 {
        for n in 0..4 {
            store.append(call(&format!("s{s}"), n)).expect("append");
        }
    }
    for s in 0..10 {
        store.seal_session(&format!("s{s}")).expect("seal");
    }
    for n in 0..4 {
        store.append(call("u", n)).expect("append");
    }
    store.set_reward(Target::Session("u".into()), 0.75).expect("reward");
    store.roll().expect("roll");
    let mut ids: Vec<String> = (0..12).flat_map(|s| (0..6).map(move |n| format!("s{s}/{n}"))).collect();
    ids.extend((0..6).map(|n| format!("u/{n}")));
    // s10, s11 and u (12 calls) stay in sealed segments: 12 * 4 <= 52,
    // so the publication rebuilds the writer's index. (No copy-forward:
    // it would move s10 and u out of the first segment, and thaw them.)
    let opts = crate::compact::CompactOptions::default().copy_forward(None);
    let report = crate::compact::run_with(&store, &opts, &mut || {
        store.append(call("s11", 4)).expect("append meanwhile");
        store.flush().expect("flush");
    })
    .expect("compact");
    assert_eq!(report.calls, 40);
    let layers = store.snapshot().index_layers();
    assert_eq!(
        (layers.frozen_calls, layers.cold_calls, layers.calls),
        (40, 8, 40 + 8 + 5),
        "s10 and u are cold, s11 thawed by its call written meanwhile: {layers:?}"
    );
    let want = answers(&store, &ids);
    assert!(want.iter().any(|l| l.starts_with("session u 4 false") && l.contains(&format!("{:?}", 0.75f64.to_bits()))));
    let fresh = Store::open_read_only(dir.path()).expect("open read-only");
    assert_eq!(answers(&fresh, &ids), want, "the writer answers as a fresh open");
    // The writer's records naming a cold session thaw it.
    store.append(call("u", 4)).expect("append");
    assert!(store.append(call("s10", 1)).is_ok(), "a replacement of a cold call");
    store.seal_session("u").expect("seal");
    store.flush().expect("flush");
    assert_eq!(store.snapshot().index_layers().cold_calls, 0);
    let want = answers(&store, &ids);
    fresh.refresh().expect("refresh");
    assert_eq!(answers(&fresh, &ids), want);
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default()).expect("reopen");
    assert_eq!(answers(&reopened, &ids), want);
    reopened.close().expect("close");
}

#[test]
fn seals_and_deletions_since_a_rebased_view_still_refuse_and_admit_appends() {
    // The append boundary's sealed set forgets, past 1024 entries, the seals
    // and deletions a published view reflects (admission.rs `Sealed`).
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for i in 0..3000 {
        let s = format!("s{i}");
        store.append(call(&s, 0)).expect("append");
        store.seal_session(&s).expect("seal");
        if i % 3 == 0 {
            store.delete_session(&s).expect("delete");
        }
        if i % 500 == 0 {
            store.flush().expect("flush");
        }
    }
    assert!(lock(&store.inner.send).sealed.since_len() < 3000, "rebased at least once");
    for i in 0..3000 {
        let s = format!("s{i}");
        let result = store.append(call(&s, 1));
        assert_eq!(result.is_ok(), i % 3 == 0, "{s}: sealed unless deleted after");
    }
    store.flush().expect("flush");
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), 2000 + 1000);
    store.close().expect("close");
}

#[test]
fn a_publication_that_compacts_little_of_a_large_backlog_keeps_the_writers_index() {
    // The rebuilt index would copy the calls that stay in segments while
    // the writer's own still holds them: not done when they are more than
    // a quarter of the maps' calls (publish.rs `REBUILD_STAYING_DIVISOR`).
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for s in 0..10 {
        for n in 0..4 {
            store.append(call(&format!("s{s}"), n)).expect("append");
        }
    }
    store.seal_session("s0").expect("seal");
    let report = store.compact(&crate::compact::CompactOptions::default()).expect("compact");
    assert_eq!(report.calls, 4);
    let layers = store.snapshot().index_layers();
    assert!(layers.index_file_bytes > 0, "the first shards' file was written: {layers:?}");
    assert_eq!((layers.calls, layers.frozen_calls), (40, 0), "36 of 40 calls stay: not rebuilt");
    let ids: Vec<String> = (0..10).flat_map(|s| (0..4).map(move |n| format!("s{s}/{n}"))).collect();
    let want = answers(&store, &ids);
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default()).expect("reopen");
    assert_eq!(reopened.snapshot().index_layers().frozen_calls, 4, "an open freezes them");
    assert_eq!(answers(&reopened, &ids), want);
    reopened.close().expect("close");
}

#[test]
fn a_deletion_retired_by_the_publication_stays_deleted_in_the_rebuilt_index() {
    // S's only call is in segment 1 with A's; S is deleted while A's
    // compaction runs, and the deletion's segment is sealed before the
    // publication, which retires both segments (nothing in them is live).
    // The rebuilt index replayed segment 1 (the base view) but would never
    // see the deletion: the writer keeps its own index then (found in
    // review: S was listed again, its call pointing into a retired segment).
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for n in 0..8 {
        store.append(call("a", n)).expect("append");
    }
    store.append(call("s", 0)).expect("append");
    store.seal_session("a").expect("seal");
    store.flush().expect("flush");
    let opts = crate::compact::CompactOptions::default();
    let report = crate::compact::run_with(&store, &opts, &mut || {
        assert_eq!(store.delete_session("s").expect("delete meanwhile"), 1);
        store.roll().expect("roll");
        store.flush().expect("flush");
    })
    .expect("compact");
    assert_eq!(report.calls, 8);
    assert!(report.retired_segments >= 2, "segment 1 and the deletion's segment retire: {report:?}");
    let snap = store.snapshot();
    assert!(snap.session_info("s").is_none(), "a deleted session is visible again in the writer");
    assert_eq!(snap.call_count(), 8);
    assert!(snap.get("s/0").expect("get").is_none());
    // Its trace id is free again, as after an open.
    let mut c = call("t", 0);
    c.trace_id = "s/0".into();
    store.append(c).expect("the deleted call's id is free");
    drop(snap);
    let fresh = Store::open_read_only(dir.path()).expect("open read-only");
    assert!(fresh.snapshot().session_info("s").is_none());
    drop(fresh);
    store.close().expect("close");
    let reopened = Store::open(dir.path(), Options::default()).expect("reopen");
    let ids: Vec<String> = (0..8).map(|n| format!("a/{n}")).chain(["s/0".to_owned()]).collect();
    let got = answers(&reopened, &ids);
    assert!(got.iter().any(|l| l.starts_with("session t 1")), "{got:?}");
    assert!(got.iter().all(|l| !l.starts_with("session s ")), "{got:?}");
    reopened.close().expect("close");
}

/// The writer's answers, checked against a fresh read-only open's.
fn same_as_fresh(store: &Store, dir: &Path, ids: &[String], what: &str) -> Vec<String> {
    store.flush().expect("flush");
    let want = answers(store, ids);
    let fresh = Store::open_read_only(dir).expect("open read-only");
    assert_eq!(answers(&fresh, ids), want, "{what}: the writer answers as a fresh open");
    want
}

#[test]
fn a_collection_that_retires_a_replaced_calls_segment_does_not_revive_it_in_the_writer() {
    // t is appended to a (segment 1), then replaced in a by a call that is
    // also in session b (segment 2). The compaction of a moves the
    // replacement into a shard row and retires segment 2; segment 1 stays
    // (its dead record of t is kept while t has a shard row). b is then
    // deleted: t is gone. A compaction that collects the dead row retires
    // segment 1 too — but the index it hands the writer replayed segment 1
    // (the base view's) over the new shards, which no longer hold the
    // replacement: t was live again in a, in a retired segment (found in
    // review); the writer keeps its own index then. Since 2026-11-26 the
    // collection does not drop that row at all: it is what keeps segment
    // 1's record of t dead (a fresh open would have found t live in a once
    // the row was gone, had segment 1 been kept), so the generation is
    // deferred (format-spec/shard.md §6.1) and the answers stay the same.
    use crate::compact::{CompactOptions, Selection};
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    let ids = vec!["t".to_owned()];
    let mut c1 = call("a", 0);
    c1.trace_id = "t".into();
    store.append(c1.clone()).expect("append");
    store.roll().expect("roll");
    let mut c2 = call("a", 1);
    c2.trace_id = "t".into();
    c2.session_uids = vec!["b".into()];
    store.append(c2).expect("replace t, now also in b");
    let opts = CompactOptions::default().selection(Selection::OlderThan(0.0)).collect_dead_fraction(Some(0.0));
    let report = store.compact(&opts).expect("compact a");
    assert_eq!((report.calls, report.retired_segments), (1, 1), "{report:?}");
    assert_eq!(store.delete_session("b").expect("delete b"), 1);
    same_as_fresh(&store, dir.path(), &ids, "b deleted");
    let report = store.compact(&opts).expect("collect");
    assert_eq!((report.dropped_rows, report.collect_deferred.len()), (0, 1), "{report:?}");
    let snap = store.snapshot();
    assert!(matches!(snap.get("t"), Ok(None)), "t was deleted with b: {:?}", snap.get("t").map(|c| c.map(|c| c.loc)));
    assert_eq!(snap.call_count(), 0);
    assert!(snap.sessions().is_empty(), "{:?}", snap.sessions());
    drop(snap);
    same_as_fresh(&store, dir.path(), &ids, "collected");
    let mut other = call("c", 0);
    other.trace_id = "t".into();
    store.append(other).expect("t is free again, as after an open");
    store.close().expect("close");
}

#[test]
fn a_uid_session_deleted_during_a_compaction_then_a_collection_right_after() {
    // The same through compact_with_meanwhile: b is deleted while a
    // compaction (of nothing) runs, and the next compaction, right after,
    // collects the dead row (merge fanout 2, collect 0.0).
    use crate::compact::{CompactOptions, Selection};
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    let ids = vec!["t".to_owned()];
    let mut c = call("a", 0);
    c.trace_id = "t".into();
    store.append(c.clone()).expect("append");
    let all = CompactOptions::default().selection(Selection::OlderThan(0.0)).collect_dead_fraction(Some(0.0));
    let sealed = CompactOptions::default().selection(Selection::SealedOnly).collect_dead_fraction(Some(0.0));
    store.compact(&sealed).expect("compact nothing (rolls the segment)");
    let mut c2 = c.clone();
    c2.session_uids = vec!["b".into()];
    store.append(c2).expect("replace t, now also in b");
    store.compact(&all).expect("compact a");
    same_as_fresh(&store, dir.path(), &ids, "after compacting a");
    store
        .compact_with_meanwhile(&sealed, &mut || {
            assert_eq!(store.delete_session("b").expect("delete meanwhile"), 1);
        })
        .expect("compact");
    same_as_fresh(&store, dir.path(), &ids, "b deleted meanwhile");
    store.compact(&all.clone().merge_fanout(Some(2))).expect("compact right after");
    assert_eq!(store.snapshot().call_count(), 0, "t was deleted with b");
    same_as_fresh(&store, dir.path(), &ids, "collected");
    store.close().expect("close");
}

/// Retirement keeps its verdict on a segment of current annotations only
/// (store/retire.rs `AnnotationVerdicts`) while nothing it holds changes,
/// and judges it again once a target of its changes: a session reward set
/// again, a trace reward, a session deleted. (Debug builds also check every
/// kept verdict against the segment's records.)
#[test]
fn kept_annotation_verdicts_are_judged_again_when_a_target_changes() {
    use crate::compact::CompactOptions;
    use std::sync::atomic::Ordering;
    let dir = tempdir();
    let options = Options::default().segment_bytes(64 * 1024);
    let store = Store::open(dir.path(), options.clone()).expect("open");
    let reused = |store: &Store| store.inner.verdicts_reused.load(Ordering::Relaxed);
    // One session at a time, sealed and compacted: retirement carries the
    // seals (and the rewards) into segments of annotations only.
    let round = |store: &Store, s: usize| {
        let id = format!("s{s}");
        for n in 0..2 {
            store.append(call(&id, n)).expect("append");
        }
        store.seal_session(&id).expect("seal");
        let r = store.compact(&CompactOptions::default()).expect("compact");
        assert_eq!(r.calls, 2, "{id}: {r:?}");
    };
    store.set_reward(Target::Session("s0".into()), 0.5).expect("reward");
    round(&store, 0);
    store.set_reward(Target::Trace("s0/1".into()), 0.25).expect("trace reward");
    for s in 1..30 {
        round(&store, s);
    }
    assert!(reused(&store) > 0, "verdicts are kept from one compaction to the next");
    // Each change below makes an annotation of a kept segment stale: the
    // next plan must judge that segment again (a kept stale verdict fails
    // the debug check; in release it would keep the segment's sessions out
    // of what later deletions must not uncover).
    store.set_reward(Target::Session("s0".into()), 0.75).expect("reward again");
    round(&store, 30);
    store.set_reward(Target::Trace("s0/1".into()), 0.125).expect("trace reward again");
    round(&store, 31);
    // (s20's seal sits in a kept segment then.)
    assert_eq!(store.delete_session("s20").expect("delete"), 2);
    let adopted = |store: &Store| store.inner.verdicts_adopted.load(Ordering::Relaxed);
    let (voided, adopted_before) = (reused(&store), adopted(&store));
    round(&store, 32);
    // Every verdict reused then was judged again, by the compacting thread
    // (store/retire.rs `prejudge`: no verdict was kept).
    assert!(adopted(&store) > adopted_before, "the compacting thread judged the segments again");
    assert_eq!(reused(&store) - voided, adopted(&store) - adopted_before, "a deletion voids every kept verdict");
    let before = reused(&store);
    round(&store, 33);
    assert!(reused(&store) > before, "verdicts are kept again after a deletion voided them");
    check_reopen_verify(store, dir.path(), options, |snap| {
        assert!(!snap.is_sealed("s20") && snap.session_info("s20").is_none(), "s20 stays deleted");
        assert!((1..34).filter(|s| *s != 20).all(|s| snap.is_sealed(&format!("s{s}"))));
    });
}

/// After an open the writer keeps no retirement verdict: the first
/// compaction's thread judges the segments of carried seals and rewards
/// against its base view (store/retire.rs `prejudge`), and the writer takes
/// those verdicts unless a target of theirs changed since the compaction
/// began, which makes the writer judge that segment again. (Debug builds
/// check every verdict taken against the segment's records: one judged
/// stale would fail there.)
#[test]
fn verdicts_judged_by_the_compacting_thread_are_judged_again_when_a_target_changes_meanwhile() {
    use crate::compact::CompactOptions;
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempdir();
    let options = Options::default().segment_bytes(64 * 1024);
    let round = |store: &Store, s: usize| {
        let id = format!("s{s}");
        for n in 0..2 {
            store.append(call(&id, n)).expect("append");
        }
        store.seal_session(&id).expect("seal");
    };
    let store = Store::open(dir.path(), options.clone()).expect("open");
    store.set_reward(Target::Session("s0".into()), 0.5).expect("reward");
    round(&store, 0);
    store.compact(&CompactOptions::default()).expect("compact");
    store.set_reward(Target::Trace("s0/1".into()), 0.25).expect("trace reward");
    for s in 1..30 {
        round(&store, s);
        store.compact(&CompactOptions::default()).expect("compact");
    }
    let mut store = store;
    let adopted = |store: &Store| store.inner.verdicts_adopted.load(Ordering::Relaxed);
    let reused = |store: &Store| store.inner.verdicts_reused.load(Ordering::Relaxed);
    // Three compactions, each with a change between its start and its
    // publication: after a reopen, s0's session and trace rewards (carried
    // in a segment of annotations) set again; then nothing; after another
    // reopen, s7 (its seal carried) deleted.
    for (s, change) in [(30, "rewards"), (31, "nothing"), (32, "deletion")] {
        if change != "nothing" {
            store.close().expect("close");
            store = Store::open(dir.path(), options.clone()).expect("reopen");
        }
        round(&store, s);
        let (to_main, from_compactor) = crossbeam_channel::bounded::<()>(1);
        let (to_compactor, from_main) = crossbeam_channel::bounded::<()>(1);
        let first = Arc::new(AtomicBool::new(true));
        let opts = CompactOptions::default().progress(move |_, _, _| {
            if first.swap(false, Ordering::SeqCst) {
                let _ = to_main.send(());
                let _ = from_main.recv();
            }
        });
        let before = (adopted(&store), reused(&store));
        std::thread::scope(|scope| {
            let compaction = scope.spawn(|| store.compact(&opts));
            from_compactor.recv().expect("the compaction began");
            match change {
                "rewards" => {
                    store.set_reward(Target::Session("s0".into()), 0.75).expect("reward again");
                    store.set_reward(Target::Trace("s0/1".into()), 0.125).expect("trace reward again");
                }
                "deletion" => assert_eq!(store.delete_session("s7").expect("delete"), 2),
                _ => {}
            }
            to_compactor.send(()).expect("go on");
            let report = compaction.join().expect("no panic").expect("compact");
            assert_eq!(report.calls, 2, "{change}: {report:?}");
        });
        let (now_adopted, now_reused) = (adopted(&store), reused(&store));
        match change {
            // The first after the open: every verdict taken from its thread
            // but those on s0's targets, judged again here.
            "rewards" => assert!(now_adopted > before.0 && now_reused > before.1, "{change}"),
            // Kept by the writer now: nothing judged off its thread.
            "nothing" => assert!(now_adopted == before.0 && now_reused > before.1, "{change}"),
            // The first after the reopen: the deletion voided what its
            // thread judged (it also takes its calls' trace rewards, which
            // the verdicts' targets do not name).
            _ => assert_eq!(now_adopted, before.0, "{change}"),
        }
    }
    check_reopen_verify(store, dir.path(), options, |snap| {
        assert!(snap.session_info("s7").is_none(), "s7 stays deleted");
        assert!((0..33).filter(|s| *s != 7).all(|s| snap.is_sealed(&format!("s{s}"))));
    });
}

/// The verdict tests' last step: s0's rewards of 0.75 (session) and 0.125
/// (trace `s0/1`) and `check` hold in `store`, and again after a reopen;
/// then the closed store verifies clean.
fn check_reopen_verify(
    store: Store,
    dir: &std::path::Path,
    options: Options,
    check: impl Fn(&crate::snapshot::Snapshot),
) {
    let check_all = |store: &Store| {
        let snap = store.snapshot();
        assert_eq!(snap.session_reward("s0"), Some(0.75));
        assert_eq!(snap.trace_reward("s0/1"), Some(0.125));
        check(&snap);
    };
    check_all(&store);
    store.close().expect("close");
    let reopened = Store::open(dir, options).expect("reopen");
    check_all(&reopened);
    reopened.close().expect("close");
    assert!(crate::verify::verify_dir(dir).expect("verify").problems.is_empty());
}

/// The annotation cache a publication writes continues the last
/// publication's build (only the segments sealed since are read) while the
/// shard index file and the segments it lists stay, and starts from
/// scratch when either goes; its bytes are a build's from scratch either
/// way (debug builds compare the two at every continued build), and an
/// open that uses it reads every seal and reward as they are.
#[test]
fn the_annotation_cache_continues_the_last_publications_build() {
    use crate::compact::CompactOptions;
    let dir = tempdir();
    let options = Options::default().segment_bytes(64 * 1024);
    let store = Store::open(dir.path(), options.clone()).expect("open");
    let continued = |store: &Store| lock(&store.inner.annotation_built).as_ref().map(|b| b.continued);
    let (mut went_on, mut started_over) = (0, 0);
    for s in 0..40 {
        let id = format!("s{s}");
        for n in 0..2 {
            store.append(call(&id, n)).expect("append");
        }
        store.seal_session(&id).expect("seal");
        if s % 3 == 0 {
            store.set_reward(Target::Session(id.clone()), f64::from(s)).expect("reward");
        }
        if s % 7 == 0 {
            store.set_reward(Target::Trace(format!("{id}/0")), 0.5).expect("trace reward");
        }
        store.compact(&CompactOptions::default()).expect("compact");
        match continued(&store) {
            Some(true) => went_on += 1,
            Some(false) => started_over += 1,
            None => {}
        }
    }
    assert!(went_on > 0 && started_over > 0, "continued {went_on}, from scratch {started_over}");
    store.close().expect("close");
    let reopened = Store::open_read_only(dir.path()).expect("open");
    let snap = reopened.snapshot();
    for s in 0..40 {
        let id = format!("s{s}");
        assert!(snap.is_sealed(&id), "{id}");
        assert_eq!(snap.session_reward(&id), (s % 3 == 0).then_some(f64::from(s)), "{id}");
        assert_eq!(snap.trace_reward(&format!("{id}/0")), (s % 7 == 0).then_some(0.5), "{id}");
    }
    let layers = snap.index_layers();
    assert!(layers.cached_annotation_segments > 0, "the open used the cache: {layers:?}");
}

/// A shard set keeps its last count of live rows per file, when asked to,
/// with the index trees it counted from (`ShardSet::liveness_memo`):
/// another snapshot of the same view gets that count, and once the index
/// changes (a compacted call replaced) the count is made again, equal to
/// one from scratch.
#[test]
fn the_live_row_count_is_kept_for_the_same_index_and_made_again_after_a_change() {
    use crate::compact::CompactOptions;
    let dir = tempdir();
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for s in 0..6 {
        let id = format!("s{s}");
        for n in 0..3 {
            store.append(call(&id, n)).expect("append");
        }
        if s < 5 {
            store.seal_session(&id).expect("seal");
        }
    }
    // Every session, s5 unsealed too.
    store.compact(&CompactOptions::default().selection(crate::compact::Selection::OlderThan(0.0))).expect("compact");
    let counts = |l: Vec<(u32, std::path::PathBuf, Result<u64>, u64)>| -> Vec<(u32, u64)> {
        l.into_iter().map(|(id, _, _, live)| (id, live)).collect()
    };
    let fresh = |snap: &Snapshot| -> Vec<(u32, u64)> {
        let live = snap.count_live_rows();
        snap.view.shards.files().map(|f| (f.id, live.get(&f.id).copied().unwrap_or(0))).collect()
    };
    let snap = store.snapshot();
    let key = snap.view.index.liveness_key();
    // Counted without keeping (what a publication with no batch after it
    // does), then kept.
    let first = counts(snap.shard_liveness());
    assert!(snap.view.shards.liveness_memo().get(&key).is_none(), "not kept");
    assert_eq!(counts(snap.shard_liveness_keeping(true)), first);
    assert!(snap.view.shards.liveness_memo().get(&key).is_some(), "kept");
    assert_eq!(first.iter().map(|(_, n)| n).sum::<u64>(), 18);
    assert_eq!(first, fresh(&snap));
    let other = store.snapshot();
    assert!(other.view.shards.liveness_memo().get(&other.view.index.liveness_key()).is_some(), "the same trees");
    assert_eq!(counts(other.shard_liveness()), first);
    // A compacted call of unsealed s5 appended again (a replacement): its
    // row is dead, and the kept count is not this index's.
    store.append(call("s5", 1)).expect("append");
    store.flush().expect("flush");
    let after = store.snapshot();
    assert!(after.view.shards.liveness_memo().get(&after.view.index.liveness_key()).is_none(), "another index");
    let now = counts(after.shard_liveness_keeping(true));
    assert_eq!(now.iter().map(|(_, n)| n).sum::<u64>(), 17);
    assert_eq!(now, fresh(&after));
    drop((snap, other, after));
    store.close().expect("close");
}
