//! The `trajlog` binary run as a separate process against a store: exit codes
//! of `verify` and `repair`, and a real write failure (a file size limit)
//! poisoning `ingest`.

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::{assert_all, assert_same, build, chained_calls, data_files, small_segments, tempdir};
use std::fs;
use trajlog::{Call, Options, Store};

fn trajlog(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_trajlog")).args(args).output().expect("run trajlog")
}

#[test]
fn cli_verify_exit_codes_and_repair() {
    let dir = tempdir();
    let all = build(dir.path());
    let d = dir.path().to_str().expect("utf-8 path");
    let out = trajlog(&["verify", "--store", d]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));

    // A torn tail alone: exit 3, reported as such.
    let store = Store::open(dir.path(), small_segments()).expect("open");
    store
        .append(Call {
            trace_id: "tail".into(),
            session_id: "z".into(),
            prompt_token_ids: vec![1; 300],
            ..Default::default()
        })
        .expect("append");
    store.flush().expect("flush");
    let loc = store.snapshot().get("tail").expect("get").expect("present").loc;
    store.close().expect("close");
    let seg = trajlog::storage::segment_path(dir.path(), loc.segment);
    let f = fs::OpenOptions::new().write(true).open(&seg).expect("open");
    f.set_len(loc.offset + 64).expect("cut");
    drop(f);
    let out = trajlog(&["verify", "--store", d]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("TORN TAIL") && !text.contains("CORRUPT"), "{text}");

    // No manifest: verify says so (exit 1), ingest refuses, repair rebuilds.
    fs::remove_file(dir.path().join("MANIFEST")).expect("remove");
    let out = trajlog(&["verify", "--store", d]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no MANIFEST"));
    let ingest = std::process::Command::new(env!("CARGO_BIN_EXE_trajlog"))
        .args(["ingest", "--store", d])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run ingest");
    assert_eq!(ingest.status.code(), Some(2), "{}", String::from_utf8_lossy(&ingest.stderr));
    assert!(String::from_utf8_lossy(&ingest.stderr).contains("trajlog repair"));
    assert!(data_files(dir.path()).len() > 3, "ingest must not delete anything");
    let out = trajlog(&["repair", "--store", d, "--dry-run"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("dry run"));
    assert!(!dir.path().join("MANIFEST").exists());
    let out = trajlog(&["repair", "--store", d]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("MANIFEST rebuilt"), "{text}");
    let store = Store::open(dir.path(), small_segments()).expect("open after repair");
    assert_all(&store, &all);
}

#[test]
fn a_failed_write_poisons_the_store_with_a_clear_error() {
    // A real write failure: the child may write files of at most 200 KiB
    // (ulimit -f), and one trace needs more. SIGXFSZ is ignored so the write
    // returns EFBIG instead of killing the process.
    let dir = tempdir();
    let mut calls = chained_calls(1, 3).into_iter();
    // Finite logprobs only: the traces go through JSON.
    let mut next = |id: &str| Call { trace_id: id.into(), logprobs: None, ..calls.next().expect("three calls") };
    let small = next("small");
    let mut huge = next("huge");
    huge.prompt_token_ids = (0..100_000).collect();
    let after = next("after");
    let input: String = [&small, &huge, &after].iter().map(|c| trajlog::trace_json::export_call(c) + "\n").collect();
    let script = format!(
        "trap '' XFSZ; ulimit -f 200; exec '{}' ingest --store '{}' --durability sync --segment-bytes 65536",
        env!("CARGO_BIN_EXE_trajlog"),
        dir.path().display()
    );
    let mut child = std::process::Command::new("bash")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ingest must fail: {stderr}");
    assert!(stderr.contains("poisoned"), "stderr names the poisoning: {stderr}");
    assert!(
        !stdout.contains("huge") && !stdout.contains("after"),
        "nothing after the failure is acknowledged: {stdout}"
    );
    // Reopening recovers everything that was durable, and nothing torn.
    let store = Store::open(dir.path(), Options::default()).unwrap();
    let snap = store.snapshot();
    assert!(snap.get("huge").unwrap().is_none());
    if stdout.contains("small") {
        assert_same(&snap.get("small").unwrap().unwrap(), &small);
    }
    assert!(trajlog::verify::verify_dir(dir.path()).unwrap().problems.is_empty());
}

/// A store holding `calls` with one bit flipped inside the body of `damaged`;
/// returns its segment file and that file's bytes.
fn damaged_store(
    dir: &std::path::Path,
    calls: &[Call],
    options: Options,
    damaged: &str,
) -> (std::path::PathBuf, Vec<u8>) {
    let store = Store::open(dir, options).expect("open");
    for c in calls {
        store.append(c.clone()).expect("append");
    }
    store.flush().expect("flush");
    let loc = store.snapshot().get(damaged).expect("get").expect("present").loc;
    store.close().expect("close");
    let seg = trajlog::storage::segment_path(dir, loc.segment);
    let mut bytes = fs::read(&seg).expect("read");
    bytes[loc.offset as usize + 200] ^= 0x04;
    fs::write(&seg, &bytes).expect("write");
    (seg, bytes)
}

#[test]
fn export_and_audit_go_on_past_a_damaged_record_and_say_so() {
    let dir = tempdir();
    let all = chained_calls(6, 6);
    let (seg, _) = damaged_store(dir.path(), &all, small_segments(), "t0-2");

    let d = dir.path().to_str().expect("utf-8 path");
    let out = trajlog(&["export", "--store", d]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let exported = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!(exported >= all.len() - 4 && exported < all.len(), "{exported}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&seg.display().to_string()));
    let out = trajlog(&["audit", "--store", d]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"s0\" not audited"));
}

#[test]
fn recovery_mode_flag_opens_a_damaged_active_segment_and_prints_what_it_skipped() {
    let dir = tempdir();
    let all = chained_calls(2, 4);
    // t1-1 is in the active segment, with valid frames after it.
    let (seg, bytes) = damaged_store(dir.path(), &all, Options::default(), "t1-1");
    let d = dir.path().to_str().expect("utf-8 path");

    // The default refuses and names the way out; nothing changes on disk.
    let out = trajlog(&["export", "--store", d]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("skip-corrupted"), "{stderr}");
    assert_eq!(fs::read(&seg).expect("read"), bytes);

    // skip-corrupted: every valid record that does not build on the damaged
    // one is exported; the skip is printed on stderr.
    let out = trajlog(&["--recovery", "skip-corrupted", "export", "--store", d]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("trajlog export: recovery: skipped"), "{stderr}");
    let exported: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
    for c in all.iter().filter(|c| c.session_id == "s0" || c.trace_id == "t1-0") {
        assert!(exported.iter().any(|l| l.contains(&format!("\"{}\"", c.trace_id))), "{} missing", c.trace_id);
    }
    assert!(!exported.iter().any(|l| l.contains("\"t1-1\"")), "the damaged call is not exported");
    assert_eq!(out.status.code(), Some(1), "calls building on the damaged one are reported: {stderr}");

    let out = trajlog(&["--recovery", "bogus", "ls", "--store", d]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tolerate-torn-tail"));
}
