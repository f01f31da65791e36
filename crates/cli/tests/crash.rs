//! Crash tests with real processes: `trajlog ingest` writers are killed with
//! SIGKILL at random moments, round after round on the same store, for each
//! durability level. After every round, every acknowledged record must be
//! present and exact, and every record present must be one that was sent.

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::*;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use trajlog::trace_json::{export_call, parse_trace};
use trajlog::{Call, Store};
use trajlog_sim::Rng;

const ROUNDS: usize = 25;

/// The signal `Child::kill` sends.
const SIGKILL: i32 = 9;

/// Sessions whose prompts keep growing across rounds (exercising prefix-delta
/// parents that live in earlier, recovered segments).
struct Workload {
    rng: Rng,
    contexts: Vec<Vec<u32>>,
    next: usize,
}

impl Workload {
    fn next_call(&mut self, round: usize) -> Call {
        let s = self.rng.range(0, self.contexts.len() - 1);
        let n = self.rng.range(1, 40);
        let completion = self.rng.tokens(n);
        let ctx = &mut self.contexts[s];
        let call = Call {
            trace_id: format!("r{round}-{}", self.next),
            session_id: format!("s{s}"),
            timestamp: self.next as f64,
            prompt_token_ids: ctx.clone(),
            logprobs: Some(self.rng.logprobs(completion.len())),
            completion_token_ids: completion.clone(),
            messages: Some(br#"[{"role":"user","content":"x"}]"#.to_vec()),
            ..Default::default()
        };
        ctx.extend_from_slice(&completion);
        let tool = self.rng.range(1, 20);
        ctx.extend(self.rng.tokens(tool));
        if ctx.len() > 4000 {
            ctx.drain(..2000); // a re-rendered (truncated) history: diverges early
        }
        self.next += 1;
        call
    }
}

fn run_level(durability: &str, seed: u64) {
    let dir = tempdir();
    let mut rng = Rng::new(seed);
    let mut work = Workload { rng: Rng::new(seed + 1), contexts: vec![Vec::new(); 6], next: 0 };
    let mut sent: HashMap<String, Call> = HashMap::new();
    let mut acked_total: HashSet<String> = HashSet::new();
    for round in 0..ROUNDS {
        let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
            .args(["ingest", "--store"])
            .arg(dir.path())
            .args(["--durability", durability, "--segment-bytes", "131072"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn trajlog ingest");
        let calls: Vec<Call> = (0..400).map(|_| work.next_call(round)).collect();
        for c in &calls {
            sent.insert(c.trace_id.clone(), c.clone());
        }
        let mut stdin = child.stdin.take().unwrap();
        let feeder = std::thread::spawn(move || {
            for c in calls {
                if stdin.write_all(format!("{}\n", export_call(&c)).as_bytes()).is_err() {
                    return;
                }
            }
        });
        let (ack_tx, ack_rx) = mpsc::channel::<String>();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let v: serde_json::Value = serde_json::from_str(&line).expect("ack line is JSON");
                let _ = ack_tx.send(v["ack"].as_str().expect("ack id").to_owned());
            }
        });
        // The kill moment. Even rounds kill right after a random number of
        // acknowledgements (the writer is then mid-stream), so some records
        // are acknowledged however slow or loaded the machine is. Odd rounds
        // kill after a random delay alone, which can land anywhere, open and
        // recovery of the last round's tail included. The delay only picks a
        // moment: no verdict waits on it, since every moment must keep the
        // promises.
        let mut acked = Vec::new();
        if round % 2 == 0 {
            for _ in 0..rng.range(1, 300) {
                match ack_rx.recv() {
                    Ok(id) => acked.push(id),
                    Err(_) => break, // the writer ended (it refused or acknowledged everything)
                }
            }
        } else {
            std::thread::sleep(Duration::from_millis(rng.range(5, 120) as u64));
        }
        child.kill().expect("SIGKILL the writer");
        let _ = child.wait();
        let _ = feeder.join();
        reader.join().unwrap();
        acked.extend(ack_rx.try_iter());
        acked_total.extend(acked);
        check(dir.path(), &sent, &acked_total, durability, round);
    }
    // Guaranteed by the even rounds on any machine: if this fails, the writer
    // acknowledged nothing at all.
    assert!(!acked_total.is_empty(), "{durability}: no record was ever acknowledged; the test proves nothing");
    eprintln!(
        "{durability}: {ROUNDS} SIGKILL rounds, {} records acknowledged, all present and exact",
        acked_total.len()
    );
}

/// How long an open waits out a `LOCK` held by a stranger (see [`open_writer`]).
const LOCK_RETRIES: usize = 250;

/// Open `dir` for writing in this process. The tests of this file run in
/// parallel threads and spawn children: a child holds copies of this
/// process's file descriptors between its fork and its exec (where
/// close-on-exec drops them), and a `flock` lives as long as any copy of its
/// descriptor. So right after this process closed a store, a sibling test's
/// child can still hold that store's `LOCK` for a moment. Such an open is
/// retried (up to ~5 s); any other error is returned at once.
fn open_writer(dir: &Path) -> trajlog::Result<Store> {
    let mut tries = 0;
    loop {
        match Store::open(dir, trajlog::Options::default()) {
            Err(e) if matches!(e.kind(), trajlog::ErrorKind::Locked) && tries < LOCK_RETRIES => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Start `trajlog compact` on `dir`; a child that could not take the `LOCK`
/// for the reason [`open_writer`] gives is started again. Returns the child
/// once it got past the lock or was killed, and its stderr so far.
fn spawn_compact(dir: &Path, extra: &[&str], kill_after: Option<Duration>) -> std::process::Output {
    for _ in 0..LOCK_RETRIES {
        let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
            .args(["compact", "--store"])
            .arg(dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn trajlog compact");
        if let Some(delay) = kill_after {
            // A random moment (no verdict waits on it); the exit status then
            // says exactly whether the kill landed or the compaction had finished.
            std::thread::sleep(delay);
            let _ = child.kill(); // an error only if it already exited
        }
        let out = child.wait_with_output().expect("wait for trajlog compact");
        let locked = out.status.code() == Some(2)
            && String::from_utf8_lossy(&out.stderr).contains("is locked by another writer");
        if !locked {
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("trajlog compact: the store stayed locked");
}

fn check(dir: &Path, sent: &HashMap<String, Call>, acked: &HashSet<String>, level: &str, round: usize) {
    // A writable open runs recovery exactly as the next writer would.
    let store = match open_writer(dir) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), trajlog::ErrorKind::NotFound) => return,
        Err(e) => panic!("{level} round {round}: reopen failed: {e}"),
    };
    let snap = store.snapshot();
    for id in acked {
        let view = snap.get(id).unwrap().unwrap_or_else(|| panic!("{level} round {round}: acknowledged {id} lost"));
        assert_same(&view, &sent[id]);
    }
    snap.for_each_call(|call| {
        let want = sent.get(call.trace_id()).expect("only sent records are present");
        assert_same(call, want);
        Ok(())
    })
    .expect("no corrupt record served");
    drop(snap);
    store.close().unwrap();
    let report = trajlog::verify::verify_dir(dir).unwrap();
    assert!(report.problems.is_empty(), "{level} round {round}: {:?}", report.problems);
}

#[test]
fn sigkill_buffered() {
    run_level("buffered", 1);
}

#[test]
fn sigkill_group() {
    run_level("group", 2);
}

#[test]
fn sigkill_sync() {
    run_level("sync", 3);
}

#[test]
fn traces_round_trip_through_export_text() {
    let mut work = Workload { rng: Rng::new(3), contexts: vec![Vec::new(); 2], next: 0 };
    for _ in 0..50 {
        let c = work.next_call(0);
        let back = parse_trace(&export_call(&c), 0.0).unwrap();
        assert_eq!(back.prompt_token_ids, c.prompt_token_ids);
        assert_eq!(back.logprobs.as_deref().map(bits), c.logprobs.as_deref().map(bits));
        assert_eq!(back.messages, c.messages);
        assert_eq!(back.timestamp.to_bits(), c.timestamp.to_bits());
    }
}

/// SIGKILL of `trajlog compact` at random moments: each round adds sealed
/// sessions, starts a compaction and kills it. After every round the store
/// reopens, every call is present exactly once and exact (served from the log
/// or from the shards), and `verify` finds nothing wrong.
#[test]
fn sigkill_during_compaction() {
    use trajlog_sim::{simulate_session, Shape, SimConfig};
    let dir = tempdir();
    // Lean calls: many sessions per round, a compaction that runs long enough to be killed mid-run.
    let cfg = SimConfig { sessions: 10_000, steps: 5, system_tokens: 800, shape: Shape::Lean, ..SimConfig::default() };
    let mut rng = Rng::new(11);
    let mut sent: HashMap<String, Call> = HashMap::new();
    let (mut killed_mid_run, mut finished) = (0, 0);
    let per_round = 40;
    for round in 0..ROUNDS {
        {
            let store = open_writer(dir.path()).expect("open");
            for s in round * per_round..(round + 1) * per_round {
                let session = simulate_session(&cfg, s);
                for c in session.calls {
                    sent.insert(c.trace_id.clone(), c.clone());
                    store.append(c).expect("append");
                }
                store.seal_session(&session.session_id).expect("seal");
            }
            store.close().expect("close");
        }
        let delay = Duration::from_millis(rng.range(1, 150) as u64);
        let out = spawn_compact(dir.path(), &["--row-group-rows", "16"], Some(delay));
        let status = out.status;
        if status.signal() == Some(SIGKILL) {
            killed_mid_run += 1;
        } else {
            assert!(
                status.success(),
                "round {round}: an uninterrupted compaction failed: {status}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            finished += 1;
        }
        check(dir.path(), &sent, &sent.keys().cloned().collect(), "compaction", round);
    }
    // A last, uninterrupted compaction finishes the job.
    let out = spawn_compact(dir.path(), &[], None);
    assert!(out.status.success(), "the last compaction failed: {}", String::from_utf8_lossy(&out.stderr));
    check(dir.path(), &sent, &sent.keys().cloned().collect(), "compaction", ROUNDS);
    let store = Store::open_read_only(dir.path()).expect("open");
    let snap = store.snapshot();
    let mut compacted = 0;
    snap.for_each_call(|c| {
        compacted += usize::from(c.is_compacted());
        Ok(())
    })
    .expect("scan");
    assert_eq!(compacted, sent.len(), "everything ends up in shards");
    assert!(killed_mid_run > 0, "at least one kill landed while compacting");
    eprintln!(
        "compaction: {ROUNDS} SIGKILL rounds ({killed_mid_run} mid-run, {finished} after it finished), {} calls exact",
        sent.len()
    );
}
