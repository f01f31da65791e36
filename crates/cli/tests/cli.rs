//! The `trajlog` binary end to end: ingest → ack lines, export → the same
//! traces, ls / show / verify / demo.

#[path = "../../../tests/common/mod.rs"]
mod common;

use proptest::prelude::*;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn trajlog(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const TRACES: &str = r#"{"trace_id":"a1","session_id":"task-1:0","timestamp":1.5,"model":"Qwen/Qwen3-8B","prompt_token_ids":[1,2,3],"completion_token_ids":[4,5],"logprobs":[-0.125,-3.4028235e38],"messages":[{"role":"user","content":"hi \u00e9"}],"response_message":{"role":"assistant","content":"ok"},"finish_reason":"stop","latency_ms":250.5,"weight_version":7,"token_counts":{"prompt":3},"metadata":{"group_id":"g"}}
{"trace_id":"a2","session_id":"task-1:0","timestamp":2.5,"prompt_token_ids":[1,2,3,4,5,6],"completion_token_ids":[7],"logprobs":[-0.0],"raw_response":{"id":"x","choices":[]},"weight_version":null}
{"trace_id":"b1","session_id":"task-2:0","timestamp":0.5,"prompt_token_ids":[],"completion_token_ids":[],"session_uids":["outer"]}
"#;

#[test]
fn ingest_zero_ahead_bytes_reaches_the_store() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::MetadataExt;
    // Two durable appends, one at a time (the writer writes the zeros after
    // the first fsync, before it takes the second record), then the active
    // segment's allocated bytes while ingest still runs (a close cuts the
    // preallocated tail): past the data with the default (1 MiB ahead of
    // it), not with 0.
    for (flag, more_than_a_mib) in [(None, true), (Some("0"), false)] {
        let dir = common::tempdir();
        let store = dir.path().join("store");
        let mut args = vec!["ingest", "--store", s(&store), "--durability", "sync"];
        args.extend(flag.iter().flat_map(|v| ["--zero-ahead-bytes", *v]));
        let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ingest");
        let mut stdin = child.stdin.take().expect("stdin");
        let mut acks = BufReader::new(child.stdout.take().expect("stdout")).lines();
        for line in TRACES.lines().take(2) {
            writeln!(stdin, "{line}").expect("write a trace");
            stdin.flush().expect("flush");
            assert!(acks.next().expect("an ack").expect("read").contains("ack"));
        }
        let segment = store.join("seg-0000000001.tlog");
        let allocated = std::fs::metadata(&segment).expect("the active segment").blocks() * 512;
        drop(stdin);
        assert!(child.wait().expect("ingest ends").success());
        assert_eq!(allocated > 1 << 20, more_than_a_mib, "{allocated} bytes allocated with {flag:?}");
    }
}

#[test]
fn ingest_acks_and_export_gives_back_the_same_traces() {
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let out = trajlog(&["ingest", "--store", s(&store), "--durability", "sync"], TRACES);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let acks: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(acks, [r#"{"ack":"a1"}"#, r#"{"ack":"a2"}"#, r#"{"ack":"b1"}"#]);
    let out = trajlog(&["export", "--store", s(&store)], "");
    assert!(out.status.success());
    let exported: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut want: Vec<serde_json::Value> = TRACES.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // Export order: sessions by first call time, calls oldest first.
    want.rotate_right(1);
    assert_eq!(exported, want);
    let one = trajlog(&["export", "--store", s(&store), "--session", "task-1:0"], "");
    assert_eq!(String::from_utf8(one.stdout).unwrap().lines().count(), 2);
    let outer = trajlog(&["export", "--store", s(&store), "--session", "outer"], "");
    assert!(String::from_utf8(outer.stdout).unwrap().contains("\"b1\""));
}

#[test]
fn bad_lines_are_reported_skipped_and_fail_the_command() {
    let dir = common::tempdir();
    let input = "{\"trace_id\":\"ok1\",\"session_id\":\"s\",\"prompt_token_ids\":[1]}\n\
                 {\"trace_id\":\"bad\",\"session_id\":\"s\",\"completion_token_ids\":[1,2],\"logprobs\":[-1]}\n\
                 not json\n\
                 {\"trace_id\":\"ok2\",\"session_id\":\"s\",\"prompt_token_ids\":[1,2]}\n";
    let out = trajlog(&["ingest", "--store", s(dir.path())], input);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 2") && stderr.contains("logprobs"), "{stderr}");
    assert!(stderr.contains("line 3"), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().collect::<Vec<_>>(), [r#"{"ack":"ok1"}"#, r#"{"ack":"ok2"}"#]);
    let ls = trajlog(&["ls", "--store", s(dir.path())], "");
    assert!(String::from_utf8_lossy(&ls.stdout).contains("1 sessions, 2 calls"));
}

#[test]
fn verify_names_the_corrupt_file_and_offset() {
    let dir = common::tempdir();
    let out = trajlog(&["ingest", "--store", s(dir.path())], TRACES);
    assert!(out.status.success());
    let ok = trajlog(&["verify", "--store", s(dir.path())], "");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stdout));
    let seg = dir.path().join("seg-0000000001.tlog");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[64 + 8 + 110] ^= 0x01; // inside the first record's body
    std::fs::write(&seg, bytes).unwrap();
    let bad = trajlog(&["verify", "--store", s(dir.path())], "");
    assert_eq!(bad.status.code(), Some(1));
    let text = String::from_utf8_lossy(&bad.stdout);
    assert!(text.contains("seg-0000000001.tlog at offset 64") && text.contains("crc"), "{text}");
}

#[test]
fn show_reports_breaks_and_demo_runs_clean() {
    let dir = common::tempdir();
    let store = dir.path().join("demo");
    let out = trajlog(&["demo", "--dir", s(&store), "--sessions", "10", "--steps", "4"], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("shape: gateway (rLLM gateway traces"), "{text}");
    assert!(text.contains("40/40 calls exact"), "{text}");
    assert!(text.contains("40/40 calls with every other field exact"), "{text}");
    assert!(text.contains("40/40 calls read back exact from the shards"), "{text}");
    assert!(text.contains("2 breaks found, 2 injected"), "{text}");
    let show = trajlog(&["show", "--store", s(&store), "task-1:0"], "");
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(text.contains("tito_break at"), "{text}");
    let again = trajlog(&["demo", "--dir", s(&store)], "");
    assert_eq!(again.status.code(), Some(2), "demo refuses a non-empty directory");
    let missing = trajlog(&["ls", "--store", s(&dir.path().join("nope"))], "");
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no trajlog store"));
}

proptest! {
    #[test]
    fn any_finite_logprob_survives_json_text_exactly(bits in prop::collection::vec(any::<u32>(), 1..64)) {
        let lp: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).filter(|v| v.is_finite()).collect();
        let call = trajlog::Call {
            trace_id: "t".into(),
            session_id: "s".into(),
            completion_token_ids: vec![1; lp.len()],
            logprobs: Some(lp.clone()),
            ..Default::default()
        };
        let line = trajlog::trace_json::export_call(&call);
        let back = trajlog::trace_json::parse_trace(&line, 0.0).unwrap();
        prop_assert_eq!(common::bits(back.logprobs.as_deref().unwrap()), common::bits(&lp));
    }
}

#[test]
fn compact_in_batches() {
    let dir = common::tempdir();
    let store = dir.path().join("s");
    // Three sessions of 2, 1 and 2 calls, oldest first: a, b, c.
    let input = r#"{"trace_id":"a0","session_id":"a","timestamp":1.0,"prompt_token_ids":[1],"completion_token_ids":[2]}
{"trace_id":"a1","session_id":"a","timestamp":2.0,"prompt_token_ids":[1,2,3],"completion_token_ids":[4]}
{"trace_id":"b0","session_id":"b","timestamp":3.0,"prompt_token_ids":[5],"completion_token_ids":[6]}
{"trace_id":"c0","session_id":"c","timestamp":4.0,"prompt_token_ids":[7],"completion_token_ids":[8]}
{"trace_id":"c1","session_id":"c","timestamp":5.0,"prompt_token_ids":[7,8,9],"completion_token_ids":[10]}
"#;
    assert!(trajlog(&["ingest", "--store", s(&store)], input).status.success());
    let zero = trajlog(&["compact", "--store", s(&store), "--older-than", "0", "--batch-calls", "0"], "");
    assert_eq!(zero.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&zero.stderr).contains("--batch-calls"),
        "{}",
        String::from_utf8_lossy(&zero.stderr)
    );
    let out = trajlog(&["compact", "--store", s(&store), "--older-than", "0", "--batch-calls", "3"], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("batch 1: compacted 2 sessions, 3 calls"), "{text}");
    assert!(text.contains("batch 2: compacted 1 sessions, 2 calls"), "{text}");
    assert!(!text.contains("batch 3"), "{text}");
    assert!(text.contains("compacted 3 sessions, 5 calls in 2 batches"), "{text}");
    let export = trajlog(&["export", "--store", s(&store)], "");
    assert_eq!(String::from_utf8_lossy(&export.stdout).lines().count(), 5);
    // By default, batches of 2^20 calls: a backlog under that is one
    // compaction, printed as one; `--no-batches` takes no batch size.
    let more =
        input.replace("\"session_id\":\"", "\"session_id\":\"more-").replace("\"trace_id\":\"", "\"trace_id\":\"more-");
    assert!(trajlog(&["ingest", "--store", s(&store)], &more).status.success());
    let out = trajlog(&["compact", "--store", s(&store), "--older-than", "0"], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.starts_with("compacted 3 sessions, 5 calls"), "{text}");
    assert!(!text.contains("batch"), "{text}");
    let both = trajlog(&["compact", "--store", s(&store), "--no-batches", "--batch-calls", "3"], "");
    assert_eq!(both.status.code(), Some(2));
    let one = trajlog(&["compact", "--store", s(&store), "--no-batches"], "");
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    let export = trajlog(&["export", "--store", s(&store)], "");
    assert_eq!(String::from_utf8_lossy(&export.stdout).lines().count(), 10);
}

/// A session whose call is damaged is never compacted and stays the oldest
/// selected one: the batches go on past it (a batch that took only it takes
/// more the next time), and the run says so with exit code 1.
#[test]
fn compact_in_batches_goes_past_a_damaged_oldest_session() {
    use trajlog::{Call, Options, Store};
    let dir = common::tempdir();
    let call = |s: &str, ts: f64| Call {
        trace_id: format!("{s}0"),
        session_id: s.into(),
        timestamp: ts,
        prompt_token_ids: (0..300).map(|i| i * 7 + 1).collect(),
        completion_token_ids: vec![3],
        ..Default::default()
    };
    let store = Store::open(dir.path(), Options::default()).unwrap();
    for (s, ts) in [("d", 1.0), ("e", 2.0), ("f", 3.0)] {
        store.append(call(s, ts)).unwrap();
        store.seal_session(s).unwrap();
    }
    store.flush().unwrap();
    let loc = store.snapshot().get("d0").unwrap().unwrap().loc;
    store.roll().unwrap();
    store.close().unwrap();
    // One bit of d0's tokens flipped in its sealed segment.
    let seg = trajlog::storage::segment_path(dir.path(), loc.segment);
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[loc.offset as usize + 200] ^= 0x04;
    std::fs::write(&seg, &bytes).unwrap();
    let out = trajlog(&["compact", "--store", s(dir.path()), "--batch-calls", "1"], "");
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{text}{err}");
    assert!(text.contains("compacted 2 sessions, 2 calls in"), "{text}");
    assert!(err.contains("1 sessions with damaged calls were not compacted"), "{err}");
    let store = Store::open_read_only(dir.path()).unwrap();
    let snap = store.snapshot();
    for t in ["e0", "f0"] {
        assert!(snap.get(t).unwrap().unwrap().is_compacted(), "{t}");
    }
    // d0 stays in its segment, and its read names the damage.
    assert!(snap.get("d0").is_err());
}

#[test]
fn compact_and_audit_commands() {
    let dir = common::tempdir();
    let store = dir.path().join("s");
    // Two calls of one session extend each other; the third re-tokenizes the
    // second's completion ([7, 8] comes back as [78]).
    let input = r#"{"trace_id":"c0","session_id":"t:0","timestamp":1.0,"prompt_token_ids":[1,2],"completion_token_ids":[3,4],"logprobs":[-1,-2]}
{"trace_id":"c1","session_id":"t:0","timestamp":2.0,"prompt_token_ids":[1,2,3,4,5],"completion_token_ids":[7,8,9],"logprobs":[-1,-2,-3]}
{"trace_id":"c2","session_id":"t:0","timestamp":3.0,"prompt_token_ids":[1,2,3,4,5,78,9,6],"completion_token_ids":[10]}
{"trace_id":"d0","session_id":"u:0","timestamp":1.5,"prompt_token_ids":[4],"completion_token_ids":[5]}
"#;
    assert!(trajlog(&["ingest", "--store", s(&store)], input).status.success());
    let audit = trajlog(&["audit", "--store", s(&store)], "");
    let text = String::from_utf8_lossy(&audit.stdout);
    assert!(audit.status.success());
    assert!(text.contains("1 TI/TO breaks in 1 sessions"), "{text}");
    assert!(text.contains("tito_break at token 5"), "{text}");
    let strict = trajlog(&["audit", "--store", s(&store), "--strict"], "");
    assert_eq!(strict.status.code(), Some(1));
    let json = trajlog(&["audit", "--store", s(&store), "--json"], "");
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["breaks"], 1);
    // The parent's context [1,2,3,4,5,7,8,9] diverges at 5: the generated
    // tokens 7, 8, 9 are what a re-tokenizing trainer would get wrong.
    assert_eq!(v["tokens_wrong"], 3);
    assert_eq!(v["sessions"][0]["divergences"][0]["prompt_ids_around"], serde_json::json!([3, 4, 5, 78, 9, 6]));
    let out = trajlog(&["compact", "--store", s(&store), "--older-than", "0"], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("compacted 2 sessions, 4 calls, 3 trajectories"), "{text}");
    assert!(text.contains("peak RSS"), "{text}");
    // Reads and the audit are unchanged after compaction.
    let again = trajlog(&["audit", "--store", s(&store), "--json"], "");
    let v2: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(v, v2);
    let export = trajlog(&["export", "--store", s(&store)], "");
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&export.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[2]["prompt_token_ids"], serde_json::json!([1, 2, 3, 4, 5, 78, 9, 6]));
    let bad = trajlog(&["compact", "--store", s(&store), "--compression", "lz5"], "");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("compression"));
    let bad = trajlog(&["compact", "--store", s(&store), "--merge-fanout", "1"], "");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("merge_fanout"), "{}", String::from_utf8_lossy(&bad.stderr));
    let both = trajlog(&["compact", "--store", s(&store), "--merge-fanout", "3", "--no-merge"], "");
    assert_eq!(both.status.code(), Some(2));
}

#[test]
fn bench_compares_three_backends_on_the_same_calls() {
    let dir = common::tempdir();
    let out = trajlog(
        &["bench", "--sessions", "4", "--steps", "3", "--prompt-tokens", "300", "--json", "--dir", s(dir.path())],
        "",
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["calls"], 12);
    assert_eq!(report["shape"], "gateway");
    let backends = report["backends"].as_array().expect("backends");
    let names: Vec<&str> = backends.iter().filter_map(|b| b["backend"].as_str()).collect();
    assert_eq!(names, ["trajlog", "sqlite-rllm", "sqlite-blob"]);
    for b in backends {
        assert_eq!(b["calls"], 12);
        for key in ["calls_per_s", "offered_mb_per_s", "written_mb_per_s", "read_mb_per_s", "append_p50_us"] {
            assert!(b[key].as_f64().is_some_and(|v| v > 0.0), "{key} of {}", b["backend"]);
        }
        assert!(b["bytes_on_disk"].as_u64().is_some_and(|v| v > 0));
    }
    // The stores are removed after the run.
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    let table = trajlog(&["bench", "--sessions", "2", "--steps", "2", "--shape", "lean", "--dir", s(dir.path())], "");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.starts_with("shape: lean ("), "{text}");
    assert!(text.contains("trajlog vs sqlite-rllm:") && text.contains("trajlog vs sqlite-blob:"), "{text}");
    let bad = trajlog(&["bench", "--shape", "grpc", "--dir", s(dir.path())], "");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("gateway, gateway-streaming or lean"));
}

/// `generate` writes the shape asked for; `export` gives the gateway's fields back.
#[test]
fn generate_writes_each_shape() {
    let dir = common::tempdir();
    for shape in ["gateway", "gateway-streaming", "lean"] {
        let store = dir.path().join(shape);
        let args = ["generate", "--store", s(&store), "--sessions", "3", "--steps", "2", "--prompt-tokens", "50"];
        let out = trajlog(&[&args[..], &["--shape", shape]].concat(), "");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("({shape} shape)")));
        let out = trajlog(&["export", "--store", s(&store)], "");
        let traces: Vec<serde_json::Value> =
            String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(traces.len(), 6);
        for t in &traces {
            let raw_response = t.get("raw_response");
            match shape {
                "gateway" => {
                    let raw_response = raw_response.expect("raw_response");
                    assert_eq!(raw_response["prompt_token_ids"], t["prompt_token_ids"]);
                    assert_eq!(raw_response["choices"][0]["token_ids"], t["completion_token_ids"]);
                    assert_eq!(t["raw_request"]["messages"], t["messages"]);
                }
                "gateway-streaming" => {
                    assert_eq!(raw_response, Some(&serde_json::Value::Null));
                    assert_eq!(t["raw_request"]["messages"], t["messages"]);
                }
                _ => assert_eq!(raw_response, None),
            }
        }
        // The default is the gateway shape.
        if shape == "gateway" {
            let default = dir.path().join("default");
            let out = trajlog(
                &["generate", "--store", s(&default), "--sessions", "3", "--steps", "2", "--prompt-tokens", "50"],
                "",
            );
            assert!(out.status.success());
            let export = |store: &Path| trajlog(&["export", "--store", s(store)], "").stdout;
            assert_eq!(export(&default), export(&store));
        }
    }
    // --rewards: each session rewarded (1 for odd session numbers) and sealed.
    let store = dir.path().join("rewarded");
    let args = ["generate", "--store", s(&store), "--sessions", "3", "--steps", "2", "--prompt-tokens", "50"];
    let out = trajlog(&[&args[..], &["--shape", "lean", "--rewards"]].concat(), "");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let db = trajlog::Store::open_read_only(&store).unwrap();
    let mut got: Vec<(String, Option<f64>, bool)> =
        db.snapshot().sessions().into_iter().map(|i| (i.session_id, i.reward, i.sealed)).collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let rewards: Vec<Option<f64>> = got.iter().map(|g| g.1).collect();
    assert_eq!(rewards.len(), 3);
    assert!(got.iter().all(|g| g.2), "{got:?}");
    assert_eq!(rewards.iter().filter(|r| **r == Some(1.0)).count(), 1, "{got:?}");
    assert_eq!(rewards.iter().filter(|r| **r == Some(0.0)).count(), 2, "{got:?}");
}

fn object_keys(line: &str) -> Vec<String> {
    trajlog::trace_json::object_keys(line).expect("a JSON object")
}

fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes).lines().map(str::to_owned).collect()
}

#[test]
fn ingest_refuses_a_line_the_store_refuses_and_stores_every_later_line() {
    let dir = common::tempdir();
    let store_dir = dir.path().join("s");
    {
        let store = trajlog::Store::open(&store_dir, trajlog::Options::default()).unwrap();
        let done = trajlog::Call {
            trace_id: "d0".into(),
            session_id: "done".into(),
            timestamp: 1.0,
            prompt_token_ids: vec![1],
            ..Default::default()
        };
        store.append(done).unwrap().wait().unwrap();
        store.seal_session("done").unwrap();
        store.close().unwrap();
    }
    let input = [
        r#"{"trace_id":"l1","session_id":"live","timestamp":1,"prompt_token_ids":[1]}"#,
        r#"{"trace_id":"d1","session_id":"done","timestamp":2,"prompt_token_ids":[2]}"#,
        r#"{"trace_id":"d0","session_id":"live","timestamp":3,"prompt_token_ids":[3]}"#,
        r#"{"trace_id":"l2","session_id":"live","timestamp":4,"prompt_token_ids":[4]}"#,
        r#"{"trace_id":"x","session_id":"live","prompt_token_ids":[1],"completion_token_ids":[1],"logprobs":[]}"#,
        r#"{"trace_id":"l3","session_id":"live","timestamp":5,"prompt_token_ids":[5]}"#,
    ]
    .join("\n");
    let out = trajlog(&["ingest", "--store", s(&store_dir)], &input);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "refused lines exit 1 at the end: {stderr}");
    assert_eq!(lines(&out.stdout), [r#"{"ack":"l1"}"#, r#"{"ack":"l2"}"#, r#"{"ack":"l3"}"#], "{stderr}");
    let refusals: Vec<&str> = stderr.lines().filter(|l| l.contains("refused (not stored)")).collect();
    assert_eq!(refusals.len(), 3, "{stderr}");
    assert!(refusals[0].contains("line 2 ") && refusals[0].contains("sealed"), "{stderr}");
    assert!(refusals[1].contains("line 3 ") && refusals[1].contains("trace_id"), "{stderr}");
    assert!(refusals[2].contains("line 5 ") && refusals[2].contains("logprobs"), "{stderr}");
    assert!(stderr.contains("ingested 3, refused 3 (see above)"), "{stderr}");
    // Every line after a refused one is stored; the refused ones are not.
    let snap = trajlog::Store::open_read_only(&store_dir).unwrap().snapshot();
    let live: Vec<String> = snap.session("live", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(live, ["l1", "l2", "l3"]);
    let done: Vec<String> = snap.session("done", None, None).unwrap().iter().map(|c| c.trace_id().to_owned()).collect();
    assert_eq!(done, ["d0"]);
    assert!(snap.get("d1").unwrap().is_none() && snap.get("x").unwrap().is_none());
}

#[test]
fn export_writes_each_key_once_and_reingests_to_the_same_records() {
    // Null column fields in the original traces: a call without logprobs and
    // every optional column null; the always-written lists null; a null timestamp.
    let traces = [
        r#"{"trace_id":"n1","session_id":"s","timestamp":1.0,"prompt_token_ids":[1,2],"completion_token_ids":[3],"logprobs":null,"model":null,"weight_version":null,"finish_reason":null,"latency_ms":null,"messages":null,"response_message":null,"metadata":null,"routing_matrices":null,"session_uids":null,"token_counts":null}"#,
        r#"{"trace_id":"n2","session_id":"s","timestamp":2.0,"prompt_token_ids":null,"completion_token_ids":null,"logprobs":null}"#,
        r#"{"trace_id":"n3","session_id":"s","timestamp":3.0,"prompt_token_ids":[1],"completion_token_ids":[4],"logprobs":[-0.5],"model":"m","raw_response":null}"#,
        r#"{"trace_id":"n4","session_id":"t","timestamp":null,"prompt_token_ids":[9],"completion_token_ids":[]}"#,
    ];
    let dir = common::tempdir();
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));
    let out = trajlog(&["ingest", "--store", s(&first)], &traces.join("\n"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let export = trajlog(&["export", "--store", s(&first)], "");
    assert!(export.status.success());
    let exported = lines(&export.stdout);
    assert_eq!(exported.len(), traces.len());
    for line in &exported {
        let keys = object_keys(line);
        let mut unique = keys.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), keys.len(), "a key is written twice: {line}");
    }
    // Each trace comes back as it went in.
    let mut got: Vec<serde_json::Value> = exported.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut want: Vec<serde_json::Value> = traces.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let by_id = |v: &serde_json::Value| v["trace_id"].as_str().unwrap_or_default().to_owned();
    got.sort_by_key(by_id);
    want.sort_by_key(by_id);
    assert_eq!(got, want);
    // Ingesting the export gives the same records, and the same export.
    let out = trajlog(&["ingest", "--store", s(&second)], &(exported.join("\n") + "\n"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again = trajlog(&["export", "--store", s(&second)], "");
    assert_eq!(lines(&again.stdout), exported);
    let (a, b) = (
        trajlog::Store::open_read_only(&first).unwrap().snapshot(),
        trajlog::Store::open_read_only(&second).unwrap().snapshot(),
    );
    for id in ["n1", "n2", "n3", "n4"] {
        let want = a.get(id).unwrap().unwrap().to_call().unwrap();
        let mut got = b.get(id).unwrap().unwrap().to_call().unwrap();
        if id == "n4" {
            // `"timestamp": null` is stamped with the time of each ingest.
            assert!(got.timestamp >= want.timestamp);
            got.timestamp = want.timestamp;
        }
        assert_eq!(got, want, "{id}");
    }
}

/// Run `trajlog ARGS` with stdout on a pipe that is read for one line and
/// then closed while the command still has far more than a pipe buffer
/// (64 KiB) to write, so its next write fails with EPIPE whatever the timing.
fn run_with_stdout_closed_early(args: &[&str], stdin: Option<String>) -> Output {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_trajlog"))
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Feed stdin from a thread: the child stops reading once its stdout is gone.
    let feeder = stdin.map(|text| {
        let mut pipe = child.stdin.take().unwrap();
        std::thread::spawn(move || drop(pipe.write_all(text.as_bytes())))
    });
    let mut first = String::new();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    reader.read_line(&mut first).unwrap();
    assert!(!first.is_empty(), "{args:?} printed nothing");
    drop(reader);
    let out = child.wait_with_output().unwrap();
    if let Some(feeder) = feeder {
        feeder.join().unwrap();
    }
    out
}

#[test]
fn every_command_exits_quietly_when_stdout_is_closed_early() {
    let dir = common::tempdir();
    let store = dir.path().join("s");
    // 5,000 one-call lean sessions: `ls` prints ~0.5 MB, `audit --json` ~1 MB, `export` ~30 MB.
    let out = trajlog(
        &[
            "generate",
            "--store",
            s(&store),
            "--sessions",
            "5000",
            "--steps",
            "1",
            "--prompt-tokens",
            "8",
            "--shape",
            "lean",
        ],
        "",
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let commands = [
        vec!["ls", "--store", s(&store)],
        vec!["audit", "--json", "--store", s(&store)],
        vec!["export", "--store", s(&store)],
    ];
    for args in commands {
        let out = run_with_stdout_closed_early(&args, None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "{args:?} exits 0 on a closed pipe: {stderr}");
    }
    // `ingest`: 30,000 acks (~0.5 MB) for a reader that stops after one.
    let input: String = (0..30_000)
        .map(|i| format!("{{\"trace_id\":\"p{i}\",\"session_id\":\"q{}\",\"prompt_token_ids\":[1]}}\n", i % 100))
        .collect();
    let ingest = dir.path().join("i");
    let out = run_with_stdout_closed_early(&["ingest", "--store", s(&ingest), "--durability", "buffered"], Some(input));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("stdout closed"), "{stderr}");
    // What it stored is intact, and the store opens again for writing.
    let store = trajlog::Store::open(&ingest, trajlog::Options::default()).unwrap();
    assert!(store.snapshot().call_count() >= 1);
    store.close().unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn a_failed_write_to_stdout_other_than_a_closed_pipe_is_an_error() {
    let dir = common::tempdir();
    let out = trajlog(&["ingest", "--store", s(dir.path())], TRACES);
    assert!(out.status.success());
    // /dev/full fails every write with ENOSPC, as a full disk behind `> file` does.
    for args in [["export", "--store", s(dir.path())], ["ls", "--store", s(dir.path())]] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_trajlog")).args(args).stdout(full).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("cannot write to standard output") && !stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn space_names_the_open_session_that_keeps_a_segment() {
    let dir = common::tempdir();
    let store = dir.path().join("store");
    let out = trajlog(&["ingest", "--store", s(&store)], TRACES);
    assert!(out.status.success());
    // Before any compaction: no shards, and nothing said to be decoded.
    let out = trajlog(&["space", "--store", s(&store)], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("; no shards") && !text.contains("decoded"), "{text}");
    // Seal every session but task-1:0, then compact: its segment stays.
    let db = trajlog::Store::open(&store, trajlog::Options::default()).unwrap();
    db.seal_session("task-2:0").unwrap();
    db.compact(&trajlog::CompactOptions::default()).unwrap();
    db.close().unwrap();
    let out = trajlog(&["space", "--store", s(&store)], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("task-1:0 (2, "), "{text}");
    assert!(text.contains("steps shards: 1 files") && text.contains("1 rows (1 live)"), "{text}");
    assert!(text.contains("kept only by the live calls of sessions not finished (task-1:0)"), "{text}");
    // task-2:0's compacted call is also in session "outer": a call of
    // several sessions stays in the index's maps, never frozen.
    assert!(text.contains("index: 3 live calls, 0 of them in the frozen layer"), "{text}");
    assert!(text.contains("everything in the directory") && text.contains("shard index file "), "{text}");
    let out = trajlog(&["space", "--store", s(&store), "--json"], "");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let segs = doc["segments"].as_array().unwrap();
    let live: u64 = segs.iter().map(|s| s["live_calls"].as_u64().unwrap()).sum();
    assert_eq!(live, 2);
    assert_eq!(doc["shards"][0]["live_rows"], 1);
    assert!(doc["disk_over_live"].as_f64().unwrap() > 1.0);
    // Everything in the directory: the trajectories, the index file, the manifest too.
    let (total, logged) = (
        doc["total_bytes"].as_u64().unwrap(),
        doc["segment_bytes"].as_u64().unwrap() + doc["shard_bytes"].as_u64().unwrap(),
    );
    assert!(total > logged && doc["other"]["trajectories_bytes"].as_u64().unwrap() > 0, "{doc}");
    assert!(doc["total_over_live"].as_f64().unwrap() > doc["disk_over_live"].as_f64().unwrap());
    assert_eq!((doc["index"]["live_calls"].as_u64(), doc["index"]["frozen_calls"].as_u64()), (Some(3), Some(0)));
}
