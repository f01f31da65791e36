//! Compatibility fixtures: stores written by earlier builds, committed and never
//! rewritten. Every later build must read them exactly.
//!
//! `tests/fixtures/store-v1` was written by format version 1,
//! `tests/fixtures/store-v2` by store format 2 (manifest 2, shard format 1) and
//! `tests/fixtures/store-v3` by store format 3 (manifest 3 with shard
//! checksums, shard format 2) and `tests/fixtures/store-v4` by store format 4
//! (segment format 2 with docs blocks, shard format 3 with raw bodies and key
//! order in `steps` columns), and so on to `store-v7` (rewards in footer
//! entries), each with
//! `TRAJLOG_WRITE_FIXTURE=1 cargo test --test compat` (which refuses to
//! overwrite an existing fixture).

mod common;

use common::copy_dir;
use std::path::PathBuf;
use trajlog::{Call, Options, Relation, Store, Target};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v1")
}

/// The calls the fixture holds (deterministic).
fn fixture_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    let mut prompt: Vec<u32> = (0..40).collect();
    for step in 0..4u32 {
        let completion: Vec<u32> = (0..10).map(|i| 1000 * (step + 1) + i).collect();
        calls.push(Call {
            trace_id: format!("a/{step}"),
            session_id: "task-1:0".into(),
            session_uids: if step == 0 { vec!["outer".into()] } else { vec![] },
            timestamp: 100.0 + f64::from(step),
            model: Some("m".into()),
            weight_version: Some(i64::from(step)),
            logprobs: Some(completion.iter().map(|&t| -(t as f32) / 3000.0).chain([]).collect()),
            prompt_token_ids: prompt.clone(),
            completion_token_ids: completion.clone(),
            finish_reason: Some("stop".into()),
            latency_ms: Some(12.5),
            messages: Some(format!(r#"[{{"role":"user","content":"step {step}"}}]"#).into_bytes()),
            metadata: Some(br#"{"group_id":"task-1"}"#.to_vec()),
            extra: Some(br#"{"token_counts":{"prompt":1}}"#.to_vec()),
            ..Default::default()
        });
        // Step 2's prompt retokenizes the middle of step 1's completion.
        if step == 1 {
            prompt.extend_from_slice(&completion[..5]);
            prompt.push(77);
            prompt.extend_from_slice(&completion[7..]);
        } else {
            prompt.extend_from_slice(&completion);
        }
        prompt.extend([5, 5, 5]);
    }
    calls.push(Call {
        trace_id: "b/0".into(),
        session_id: "task-2:0".into(),
        timestamp: 50.0,
        prompt_token_ids: vec![9, 9],
        completion_token_ids: vec![8],
        logprobs: Some(vec![f32::from_bits(0x7fc0_0001)]),
        ..Default::default()
    });
    calls
}

/// A call read from a fixture equals the call that was written, bit for bit.
fn assert_exact(v: &trajlog::CallView<'_>, c: &Call) {
    let got = v.to_call().unwrap();
    assert_eq!(got.prompt_token_ids, c.prompt_token_ids);
    assert_eq!(got.completion_token_ids, c.completion_token_ids);
    assert_eq!(
        got.logprobs.map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
        c.logprobs.as_ref().map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    );
    assert_eq!((got.messages, got.metadata, got.extra), (c.messages.clone(), c.metadata.clone(), c.extra.clone()));
    assert_eq!(
        (got.weight_version, got.latency_ms, got.session_uids),
        (c.weight_version, c.latency_ms, c.session_uids.clone())
    );
}

fn write_fixture() {
    let dir = fixture_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    let calls = fixture_calls();
    for c in &calls[..2] {
        store.append(c.clone()).unwrap();
    }
    store.roll().unwrap();
    for c in &calls[2..] {
        store.append(c.clone()).unwrap();
    }
    // A replaced and a deleted call.
    store.append(Call { trace_id: "gone".into(), session_id: "task-3:0".into(), ..Default::default() }).unwrap();
    store.delete_session("task-3:0").unwrap();
    let mut old = calls[4].clone();
    old.trace_id = "b/1".into();
    store.append(old).unwrap();
    store
        .append(Call { trace_id: "b/1".into(), session_id: "task-2:0".into(), timestamp: 51.0, ..Default::default() })
        .unwrap();
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.set_reward(Target::Trace("a/3".into()), 0.5).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v1_fixture_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_dir().exists() {
        write_fixture();
    }
    let store = Store::open_read_only(fixture_dir()).expect("fixture opens");
    let snap = store.snapshot();
    let calls = fixture_calls();
    assert_eq!(snap.call_count(), 6);
    assert_eq!(snap.segments().len(), 2);
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_exact(&v, c);
    }
    let a: Vec<Relation> = snap.session("task-1:0", None, None).unwrap().iter().map(|c| c.relation()).collect();
    assert_eq!(a, [Relation::Root, Relation::Extends, Relation::TitoBreak, Relation::Extends]);
    assert_eq!(snap.get("a/2").unwrap().unwrap().divergence_position(), Some(40 + 10 + 3 + 5));
    assert!(snap.is_sealed("task-1:0"));
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    assert_eq!(snap.trace_reward("a/3"), Some(0.5));
    assert!(snap.get("gone").unwrap().is_none());
    let b1 = snap.get("b/1").unwrap().unwrap();
    assert!(b1.completion_token_ids().is_empty(), "the replacement wins");
    assert_eq!(snap.session("outer", None, None).unwrap().len(), 1);
    assert!(trajlog::verify::verify_dir(&fixture_dir()).unwrap().problems.is_empty());
}

fn fixture_v2_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v2")
}

/// Store format 2: the v1 content, with the sealed session compacted into shards.
fn write_fixture_v2() {
    let dir = fixture_v2_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let calls = fixture_calls();
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in &calls {
        store.append(c.clone()).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.compact(&trajlog::CompactOptions::default()).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

/// Open a fixture with shards (v2 and later) read-only and check every call,
/// the TI/TO break, the seal and the reward; returns its snapshot.
fn check_shard_fixture(dir: &std::path::Path) -> trajlog::Snapshot {
    let store = Store::open_read_only(dir).expect("fixture opens");
    let snap = store.snapshot();
    let calls = fixture_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id == "task-1:0", "{}", c.trace_id);
        assert_exact(&v, c);
    }
    assert_eq!(snap.get("a/2").unwrap().unwrap().relation(), Relation::TitoBreak);
    assert_eq!(snap.get("a/2").unwrap().unwrap().divergence_position(), Some(40 + 10 + 3 + 5));
    assert!(snap.is_sealed("task-1:0"));
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    assert_eq!(snap.shard_paths().len(), 1);
    snap
}

#[test]
fn reads_the_v2_fixture_with_shards_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v2_dir().exists() {
        write_fixture_v2();
    }
    let snap = check_shard_fixture(&fixture_v2_dir());
    // Manifest 2 and shard format 1: no checksums, decoded unchecked, intact.
    let manifest = read_manifest(&fixture_v2_dir());
    assert_eq!(manifest.0, 2);
    assert!(manifest.1.shards.iter().all(|s| s.checksum.is_none()));
    for s in &manifest.1.shards {
        let path = fixture_v2_dir().join("shards").join(&s.path);
        assert!(trajlog::shard::reader::verify_shard(&path, None).is_empty(), "{}", s.path);
    }
    let shard = trajlog::shard::reader::ShardFile::open(&snap.shard_paths()[0], 0, None).unwrap();
    assert!(!shard.has_checksums().unwrap());
}

/// The manifest's version field and its decoded content.
fn read_manifest(dir: &std::path::Path) -> (u32, trajlog::format::manifest::Manifest) {
    let bytes = std::fs::read(dir.join("MANIFEST")).unwrap();
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    (version, trajlog::format::manifest::decode_manifest(&bytes).unwrap())
}

fn fixture_v3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v3")
}

/// Store format 3: the v2 content, with shard checksums (shard format 2 files,
/// manifest 3 entries with length and footer crc32).
fn write_fixture_v3() {
    let dir = fixture_v3_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let calls = fixture_calls();
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in &calls {
        store.append(c.clone()).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    // Two row groups in the steps shard.
    store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(2)).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v3_fixture_with_shard_checksums_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v3_dir().exists() {
        write_fixture_v3();
    }
    let snap = check_shard_fixture(&fixture_v3_dir());
    let (version, manifest) = read_manifest(&fixture_v3_dir());
    assert_eq!(version, 3);
    assert_eq!(manifest.shards.len(), 2, "a steps and a trajectories shard");
    for s in &manifest.shards {
        let path = fixture_v3_dir().join("shards").join(&s.path);
        let checksum = s.checksum.expect("manifest 3 records every shard's checksum");
        assert_eq!(checksum.len, std::fs::metadata(&path).unwrap().len());
        assert!(trajlog::shard::reader::verify_shard(&path, Some(checksum)).is_empty(), "{}", s.path);
    }
    let shard = trajlog::shard::reader::ShardFile::open(&snap.shard_paths()[0], 0, None).unwrap();
    assert!(shard.has_checksums().unwrap());
    assert_eq!(shard.row_groups().unwrap(), 2);
}

fn fixture_v4_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v4")
}

/// A gateway-shaped `extra` for `call` (rLLM's `raw_request` and vLLM's
/// `raw_response` repeating its messages and columns), so that the call is
/// stored with a docs block (format-spec/record.md §7).
fn gateway_extra(call: &Call) -> Vec<u8> {
    let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let content: Vec<String> = call
        .completion_token_ids
        .iter()
        .zip(call.logprobs.as_deref().unwrap_or_default())
        .map(|(id, lp)| {
            let token = format!("t{id}");
            let bytes = token.bytes().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
            format!(
                r#"{{"token":"{token}","logprob":{},"bytes":[{bytes}],"top_logprobs":[]}}"#,
                trajlog::trace_json::py_float(f64::from(*lp))
            )
        })
        .collect();
    let messages = String::from_utf8_lossy(call.messages.as_deref().unwrap_or(b"[]")).into_owned();
    format!(
        r#"{{"token_counts":{{"prompt":{}}},"raw_request":{{"model":"m","messages":{messages},"logprobs":true}},"raw_response":{{"id":"chatcmpl-1","choices":[{{"index":0,"logprobs":{{"content":[{}]}},"finish_reason":"stop","token_ids":[{}]}}],"prompt_token_ids":[{}]}}}}"#,
        call.prompt_token_ids.len(),
        content.join(","),
        ids(&call.completion_token_ids),
        ids(&call.prompt_token_ids),
    )
    .into_bytes()
}

/// The v1 calls with gateway-shaped documents (docs blocks), plus a sealed
/// session of calls whose `extra` carries what shard format 3 moves into
/// columns (format-spec/shard.md §2.1), and cases it keeps in `extra`.
fn fixture_v4_calls() -> Vec<Call> {
    let mut calls = fixture_calls();
    for c in calls.iter_mut().filter(|c| c.session_id == "task-1:0") {
        c.extra = Some(gateway_extra(c));
    }
    // An open session, left in the log: its records keep their docs blocks.
    let mut prompt: Vec<u32> = (100..160).collect();
    for step in 0..3u32 {
        let completion: Vec<u32> = (0..24).map(|i| 500 + 30 * step + i).collect();
        let mut call = Call {
            trace_id: format!("o/{step}"),
            session_id: "task-4:0".into(),
            timestamp: 400.0 + f64::from(step),
            logprobs: Some(completion.iter().map(|&t| -(t as f32) / 7000.0).collect()),
            prompt_token_ids: prompt.clone(),
            completion_token_ids: completion.clone(),
            messages: Some(format!(r#"[{{"role":"user","content":"open step {step}"}}]"#).into_bytes()),
            ..Default::default()
        };
        call.extra = Some(gateway_extra(&call));
        calls.push(call);
        prompt.extend_from_slice(&completion);
        prompt.extend([7, 7]);
    }
    let extras = [
        r#"{"raw_request":{"model":"m","messages":[{"role":"user","content":"hi"}]},"raw_response":{"id":"c1","usage":{"prompt_tokens":2}},"token_counts":{"prompt":2}}"#,
        r#"{"raw_request":{"model":"m"},"raw_response":null,"token_counts":{}}"#,
        r#"{"z":1,"raw_response":{"é":"😀"},"a":[],"raw_request":"last"}"#,
        "{ \"raw_request\" : {\"kept\": true}, \"raw_response\":{\"moved\":1}}",
        r#"{"raw_request":1,"raw_request":2}"#,
    ];
    for (i, e) in extras.iter().enumerate() {
        calls.push(Call {
            trace_id: format!("g/{i}"),
            session_id: "task-3:0".into(),
            timestamp: 200.0 + i as f64,
            prompt_token_ids: vec![3, 1, 4, i as u32],
            completion_token_ids: vec![1, 5],
            logprobs: Some(vec![-0.5, -1.25]),
            extra: Some(e.as_bytes().to_vec()),
            ..Default::default()
        });
    }
    // A parsed trace in an odd key order: its key order moves to `key_order`.
    let trace = r#"{"raw_response":{"choices":[]},"session_id":"task-3:0","trace_id":"g/p","prompt_token_ids":[9],"completion_token_ids":[8],"raw_request":{"messages":[]},"timestamp":300.5}"#;
    calls.push(trajlog::trace_json::parse_trace(trace, 0.0).unwrap());
    calls
}

/// Store format 4: segment format 2 (docs blocks) and shard format 3
/// (`raw_request`, `raw_response`, `key_order` and `extra_splice` columns in
/// `steps`).
fn write_fixture_v4() {
    let store = new_fixture_with_v4_calls(&fixture_v4_dir());
    store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(3)).unwrap();
    store.close().unwrap();
    std::fs::remove_file(fixture_v4_dir().join("LOCK")).unwrap();
}

/// A new fixture store at `dir` with the v4 calls appended, task-1:0
/// rewarded, and task-1:0 and task-3:0 sealed.
fn new_fixture_with_v4_calls(dir: &std::path::Path) -> Store {
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_v4_calls() {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.seal_session("task-3:0").unwrap();
    store
}

#[test]
fn reads_the_v4_fixture_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v4_dir().exists() {
        write_fixture_v4();
    }
    let dir = fixture_v4_dir();
    let store = Store::open_read_only(&dir).expect("fixture opens");
    let snap = store.snapshot();
    let calls = fixture_v4_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        let open = ["task-2:0", "task-4:0"].contains(&c.session_id.as_str());
        assert_eq!(v.is_compacted(), !open, "{}", c.trace_id);
        assert_exact(&v, c);
        // Whole-Call equality where no NaN logprob stands in the way.
        if c.session_id != "task-2:0" {
            assert_eq!(&v.to_call().unwrap(), c, "{}", c.trace_id);
        }
    }
    assert_eq!(snap.get("a/2").unwrap().unwrap().relation(), Relation::TitoBreak);
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    let (_, manifest) = read_manifest(&dir);
    for s in &manifest.shards {
        let path = dir.join("shards").join(&s.path);
        assert!(trajlog::shard::reader::verify_shard(&path, s.checksum).is_empty(), "{}", s.path);
    }
    let steps = snap.shard_paths()[0].clone();
    let reader = parquet::file::serialized_reader::SerializedFileReader::new(std::fs::File::open(&steps).unwrap());
    let meta = parquet::file::reader::FileReader::metadata(&reader.unwrap()).file_metadata().clone();
    let kv = meta.key_value_metadata().unwrap();
    let version = kv.iter().find(|k| k.key == "trajlog.shard_format_version").unwrap();
    assert_eq!(version.value.as_deref(), Some("3"));
    // The open session's records are segment format 2 with docs blocks
    let report = trajlog::verify::verify_dir(&dir).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    // (and the compacted task-1:0's, whose segment still holds task-2:0).
    assert_eq!(report.split.docs_blocks, 7, "{:?}", report.split);
}

fn fixture_v5_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v5")
}

/// Store format 5: the v4 store, compacted, then rewards set after the
/// compaction and published in the rewards side table
/// (format-spec/shard.md §8) by a second compaction.
fn write_fixture_v5() {
    let dir = fixture_v5_dir();
    let store = new_fixture_with_v4_calls(&dir);
    store.compact(&trajlog::CompactOptions::default()).unwrap();
    store.set_reward(Target::Session("task-1:0".into()), 2.5).unwrap();
    store.set_reward(Target::Trace("g/1".into()), 0.75).unwrap();
    store.compact(&trajlog::CompactOptions::default()).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

/// A rewards side table row: (session id, trace id, reward).
type SideRow = (String, Option<String>, Option<f64>);

/// The rows of a rewards side table, and its key-value metadata.
fn side_table(path: &std::path::Path) -> (Vec<SideRow>, Vec<(String, String)>) {
    use arrow_array::cast::AsArray;
    use arrow_array::Array;
    let builder =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
            .unwrap();
    let kv = builder.metadata().file_metadata().key_value_metadata().cloned().unwrap_or_default();
    let kv = kv.into_iter().map(|e| (e.key, e.value.unwrap_or_default())).collect();
    let mut rows = Vec::new();
    for batch in builder.build().unwrap() {
        let batch = batch.unwrap();
        let (s, t) = (batch.column(0).as_string::<i32>(), batch.column(1).as_string::<i32>());
        let r = batch.column(2).as_primitive::<arrow_array::types::Float64Type>();
        for i in 0..batch.num_rows() {
            rows.push((
                s.value(i).to_owned(),
                (!t.is_null(i)).then(|| t.value(i).to_owned()),
                (!r.is_null(i)).then(|| r.value(i)),
            ));
        }
    }
    (rows, kv)
}

#[test]
fn reads_the_v5_fixture_with_its_rewards_side_table() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v5_dir().exists() {
        write_fixture_v5();
    }
    let dir = fixture_v5_dir();
    {
        let store = Store::open_read_only(&dir).expect("fixture opens");
        let snap = store.snapshot();
        for c in &fixture_v4_calls() {
            assert_exact(&snap.get(&c.trace_id).unwrap().unwrap(), c);
        }
        assert_eq!(snap.session_reward("task-1:0"), Some(2.5));
        assert_eq!(snap.trace_reward("g/1"), Some(0.75));
    }
    let path = dir.join("shards").join("_rewards.parquet");
    let (rows, kv) = side_table(&path);
    let want = vec![
        ("task-1:0".to_owned(), None, Some(2.5)),
        ("task-3:0".to_owned(), None, None),
        ("task-3:0".to_owned(), Some("g/1".to_owned()), Some(0.75)),
    ];
    assert_eq!(rows, want);
    assert!(kv.contains(&("trajlog.rewards_format_version".to_owned(), "1".to_owned())), "{kv:?}");
    assert!(kv.iter().any(|(k, v)| k == "trajlog.rewards_through" && v.split_once(':').is_some()), "{kv:?}");
    let report = trajlog::verify::verify_dir(&dir).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.rewards_sessions, Some(2));
    // A writer opening a copy reads `through`: nothing is noted again, and a
    // compaction keeps the same rows.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let store = Store::open(copy.path(), Options::default()).unwrap();
    store.compact(&trajlog::CompactOptions::default()).unwrap();
    store.close().unwrap();
    assert_eq!(side_table(&copy.path().join("shards").join("_rewards.parquet")).0, want);
}

fn fixture_v6_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v6")
}

/// Chat sessions whose `messages` grow call after call (the history, the
/// previous `response_message`, a tool result), in Python's `json.dumps`
/// spacing, with gateway-shaped `extra`: stored as messages deltas (segment
/// format 3, record.md §7.2). `chat-1:0` is longer than the delta chain bound
/// and has an edited history at step 5; `chat-2:0` is compacted.
fn fixture_v6_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    for (sid, turns) in [("chat-1:0", 12u32), ("chat-2:0", 3)] {
        let mut prompt: Vec<u32> = (0..30).map(|i| i + turns * 1000).collect();
        let mut history = vec![
            r#"{"role": "system", "content": "You are a careful agent with tools."}"#.to_owned(),
            format!(r#"{{"role": "user", "content": "Solve task {sid}, please, step by step."}}"#),
        ];
        for step in 0..turns {
            let completion: Vec<u32> = (0..16).map(|i| 50_000 + 100 * step + i).collect();
            let response = format!(
                r#"{{"role": "assistant", "content": "Step {step}: I call the tool with an argument.", "tool_calls": [{{"id": "call_{step}", "type": "function", "function": {{"name": "search", "arguments": "{{\"q\": \"item {step}\"}}"}}}}]}}"#
            );
            let mut messages = format!("[{}]", history.join(", "));
            if sid == "chat-1:0" && step == 5 {
                messages = messages.replacen("careful", "careless", 1); // a re-rendered history
            }
            let mut call = Call {
                trace_id: format!("{sid}/{step}"),
                session_id: sid.into(),
                timestamp: 600.0 + f64::from(step),
                logprobs: Some(completion.iter().map(|&t| -(t as f32) / 90_000.0).collect()),
                prompt_token_ids: prompt.clone(),
                completion_token_ids: completion.clone(),
                messages: Some(messages.into_bytes()),
                response_message: Some(response.clone().into_bytes()),
                ..Default::default()
            };
            call.extra = Some(gateway_extra(&call));
            calls.push(call);
            history.push(response);
            history.push(format!(
                r#"{{"role": "tool", "tool_call_id": "call_{step}", "content": "result {step}: found"}}"#
            ));
            prompt.extend_from_slice(&completion);
            prompt.extend([9, 9, step]);
        }
    }
    calls
}

/// Store format 6: segment format 3 (messages deltas in docs blocks).
fn write_fixture_v6() {
    let dir = fixture_v6_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_v6_calls() {
        store.append(c).unwrap();
    }
    store.seal_session("chat-2:0").unwrap();
    store.compact(&trajlog::CompactOptions::default()).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v6_fixture_with_messages_deltas_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v6_dir().exists() {
        write_fixture_v6();
    }
    let dir = fixture_v6_dir();
    let store = Store::open_read_only(&dir).expect("fixture opens");
    let snap = store.snapshot();
    let calls = fixture_v6_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id == "chat-2:0", "{}", c.trace_id);
        assert_eq!(&v.to_call().unwrap(), c, "{}", c.trace_id);
    }
    for sid in ["chat-1:0", "chat-2:0"] {
        let want: Vec<Call> = calls.iter().filter(|c| c.session_id == sid).cloned().collect();
        assert_eq!(snap.session_calls(sid, None, None).unwrap(), want, "{sid}");
    }
    // Segment format 3 on disk, and the open session's later calls are
    // deltas: all but its first, the edited step 5 and the step after it
    // (its history no longer extends step 5's), and the chain bound's
    // restarts.
    let segment = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "tlog"))
        .unwrap();
    assert_eq!(std::fs::read(&segment).unwrap()[8..12], 3u32.to_le_bytes());
    let report = trajlog::verify::verify_dir(&dir).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert!(report.split.messages_deltas >= 7, "{:?}", report.split);
    assert!(report.split.messages_deltas < 12, "{:?}", report.split);
    // The audit names the two calls whose history does not extend their
    // parent's (the edited step 5, and step 6 against it), at the byte.
    let audit = trajlog::audit::audit(&snap).expect("audit");
    assert_eq!((audit.histories_rewritten, audit.responses_reserialized), (2, 0));
    let chat = audit.sessions.iter().find(|s| s.session_id == "chat-1:0").unwrap();
    let found: Vec<(&str, &str, usize)> =
        chat.history_divergences.iter().map(|d| (d.trace_id.as_str(), d.parent_trace_id.as_str(), d.byte)).collect();
    let at = br#"[{"role": "system", "content": "You are a care"#.len();
    assert_eq!(found, [("chat-1:0/5", "chat-1:0/4", at), ("chat-1:0/6", "chat-1:0/5", at)]);
}

/// A writer appending to a reopened store-format-4 store continues its
/// active segment of format 2, which has no prompt checkpoints (flag bit 12
/// is segment format 3): it writes none there, however long the chain, so
/// the builds that wrote the store still read it.
#[test]
fn appends_to_a_format_2_segment_make_no_checkpoints() {
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&fixture_v4_dir(), copy.path());
    let last = fixture_v4_calls().into_iter().rfind(|c| c.session_id == "task-4:0").unwrap();
    let mut prompt = last.prompt_token_ids.clone();
    prompt.extend_from_slice(&last.completion_token_ids);
    let mut more = Vec::new();
    for step in 0..6u32 {
        prompt.extend([8, step]);
        let completion = vec![900 + step, 901];
        more.push(Call {
            trace_id: format!("o/more/{step}"),
            session_id: "task-4:0".into(),
            timestamp: 500.0 + f64::from(step),
            prompt_token_ids: prompt.clone(),
            completion_token_ids: completion.clone(),
            ..Default::default()
        });
        prompt.extend_from_slice(&completion);
    }
    let store = Store::open(copy.path(), Options::default().prompt_chain_max(2)).unwrap();
    for c in &more {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    for c in &more {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(&v.to_call().unwrap(), c);
        assert_eq!(v.relation(), Relation::Extends, "{}", c.trace_id);
        assert!(v.prompt_prefix_len() > 0, "{} is a checkpoint in a format-2 segment", c.trace_id);
    }
    let segments: Vec<u32> = std::fs::read_dir(copy.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tlog"))
        .map(|p| u32::from_le_bytes(std::fs::read(p).unwrap()[8..12].try_into().unwrap()))
        .collect();
    assert!(segments.iter().all(|&v| v == 2), "segment formats {segments:?}");
}

fn fixture_v7_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v7")
}

/// The reward entries of the footers of a store's sealed segments:
/// (reward target byte, value bits, id), in log order.
fn footer_rewards(dir: &std::path::Path) -> Vec<(u8, u64, String)> {
    use trajlog::format::segment::{decode_footer, read_trailer};
    let mut out = Vec::new();
    for path in common::segment_paths(dir) {
        let bytes = std::fs::read(&path).unwrap();
        let Some(trailer) = read_trailer(&bytes) else { continue };
        for e in decode_footer(&bytes, &trailer).unwrap() {
            if e.kind == trajlog::format::record::KIND_REWARD {
                out.push((e.reward_target, e.timestamp.to_bits(), e.id));
            }
        }
    }
    out
}

/// Store format 7: rewards in sealed segments have their target and value in
/// their footer entries (format-spec/segment.md §4). A reward of `-0.0` and
/// one of `+inf` (bits kept); one more reward in the active segment.
fn write_fixture_v7() {
    let dir = fixture_v7_dir();
    let store = new_fixture_with_v4_calls(&dir);
    store.set_reward(Target::Trace("g/1".into()), -0.0).unwrap();
    store.set_reward(Target::Session("task-1:0".into()), f64::INFINITY).unwrap();
    store.roll().unwrap();
    store.set_reward(Target::Session("task-3:0".into()), 0.5).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v7_fixture_with_rewards_in_footers() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v7_dir().exists() {
        write_fixture_v7();
    }
    let dir = fixture_v7_dir();
    let check = |store: &Store| {
        let snap = store.snapshot();
        for c in &fixture_v4_calls() {
            assert_exact(&snap.get(&c.trace_id).unwrap().unwrap(), c);
        }
        assert_eq!(snap.trace_reward("g/1").map(f64::to_bits), Some((-0.0f64).to_bits()));
        assert_eq!(snap.session_reward("task-1:0"), Some(f64::INFINITY));
        assert_eq!(snap.session_reward("task-3:0"), Some(0.5));
    };
    check(&Store::open_read_only(&dir).expect("fixture opens"));
    assert_eq!(
        footer_rewards(&dir),
        vec![
            (2, 1.0f64.to_bits(), "task-1:0".to_owned()),
            (1, (-0.0f64).to_bits(), "g/1".to_owned()),
            (2, f64::INFINITY.to_bits(), "task-1:0".to_owned())
        ]
    );
    let report = trajlog::verify::verify_dir(&dir).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // An open reads rewards from the footer, not from their records: with a
    // reward's record damaged, the store still opens with its value (only
    // `verify`, which reads every frame, finds the damage).
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let (seg, mut bytes, reward) = (1..)
        .map(|id| copy.path().join(format!("seg-{id:010}.tlog")))
        .take_while(|p| p.exists())
        .find_map(|seg| {
            let bytes = std::fs::read(&seg).unwrap();
            let trailer = trajlog::format::segment::read_trailer(&bytes)?;
            let entries = trajlog::format::segment::decode_footer(&bytes, &trailer).unwrap();
            let reward = entries.into_iter().find(|e| e.kind == trajlog::format::record::KIND_REWARD)?;
            Some((seg, bytes, reward))
        })
        .expect("a sealed segment holds a reward");
    // The frame's body starts after its 8-byte header; flip a byte of the id.
    let at = reward.frame_offset as usize + 8 + 16;
    bytes[at] ^= 0x20;
    std::fs::write(&seg, &bytes).unwrap();
    let store = Store::open_read_only(copy.path()).expect("opens without reading reward records");
    check(&store);
    assert!(store.snapshot().damage().is_empty(), "{:?}", store.snapshot().damage());
    let report = trajlog::verify::verify_dir(copy.path()).expect("verify");
    assert!(report.problems.iter().any(|p| p.offset == reward.frame_offset), "{:?}", report.problems);
    // A skip-corrupted open checks every frame: the same reward, applied from
    // its entry, and the damage named.
    let store = Store::open_read_only_with(copy.path(), trajlog::RecoveryMode::SkipCorrupted).unwrap();
    check(&store);
    let damage = store.snapshot().damage().to_vec();
    assert!(
        damage.iter().any(|p| p.offset == reward.frame_offset && p.what.contains("applied from its footer entry")),
        "{damage:?}"
    );
}

/// Footers written before store format 7 carry no reward values: an open
/// reads those rewards from their records, and `verify` accepts them.
#[test]
fn rewards_in_footers_before_format_7_are_read_from_their_records() {
    let rewards = footer_rewards(&fixture_v5_dir());
    assert!(!rewards.is_empty() && rewards.iter().all(|r| r.0 == 0 && r.1 == 0), "{rewards:?}");
    let store = Store::open_read_only(fixture_v5_dir()).unwrap();
    assert_eq!(store.snapshot().session_reward("task-1:0"), Some(2.5));
    assert_eq!(store.snapshot().trace_reward("g/1"), Some(0.75));
    assert!(trajlog::verify::verify_dir(&fixture_v5_dir()).unwrap().problems.is_empty());
}

/// A segment of an older format keeps its format when a newer writer appends
/// to it: its footer gets no reward targets or values (the builds that wrote
/// it read them as a disagreement), and its rewards still read back. A format
/// 3 footer that has one is not trusted: its index is rebuilt from the frames.
#[test]
fn older_segments_get_no_rewards_in_their_footers() {
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&fixture_v4_dir(), copy.path());
    let store = Store::open(copy.path(), Options::default()).unwrap();
    store.set_reward(Target::Session("task-4:0".into()), 7.25).unwrap();
    store.roll().unwrap();
    store.close().unwrap();
    let version = |p: &std::path::Path| u32::from_le_bytes(std::fs::read(p).unwrap()[8..12].try_into().unwrap());
    let old: Vec<PathBuf> = (1..)
        .map(|id| copy.path().join(format!("seg-{id:010}.tlog")))
        .take_while(|p| p.exists())
        .filter(|p| version(p) == 2)
        .collect();
    assert!(!old.is_empty());
    let rewards = footer_rewards(copy.path());
    assert!(rewards.iter().any(|r| r.2 == "task-4:0"), "{rewards:?}");
    assert!(rewards.iter().all(|r| r.0 == 0 && r.1 == 0), "{rewards:?}");
    assert!(trajlog::verify::verify_dir(copy.path()).unwrap().problems.is_empty());
    let store = Store::open_read_only(copy.path()).unwrap();
    assert_eq!(store.snapshot().session_reward("task-4:0"), Some(7.25));
    drop(store);

    // The v7 fixture's sealed segment, relabelled format 3 (header CRC
    // recomputed): its footer's reward targets are refused, the index rebuilt.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&fixture_v7_dir(), copy.path());
    let seg = copy.path().join("seg-0000000001.tlog");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&seg, &bytes).unwrap();
    let store = Store::open_read_only(copy.path()).unwrap();
    assert!(
        store.recovery_report().events.iter().any(|e| e.what.contains("has a target")),
        "{:?}",
        store.recovery_report().events
    );
    assert_eq!(store.snapshot().session_reward("task-1:0"), Some(f64::INFINITY));
    assert_eq!(store.snapshot().trace_reward("g/1").map(f64::to_bits), Some((-0.0f64).to_bits()));
}

fn fixture_v8_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v8")
}

/// Store format 8 (manifest version 4): the v3 content plus session
/// `task-9:0`, both compacted; `task-9:0` deleted and its generation
/// collected (its live rows written again). The manifest lists one obsolete
/// file that is gone, as a crash after deleting it would leave it.
fn write_fixture_v8() {
    let dir = fixture_v8_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in &fixture_calls() {
        store.append(c.clone()).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store
        .append(Call { trace_id: "gone/0".into(), session_id: "task-9:0".into(), ..fixture_calls()[0].clone() })
        .unwrap();
    store.seal_session("task-9:0").unwrap();
    store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(2)).unwrap();
    store.delete_session("task-9:0").unwrap();
    let r = store.compact(&trajlog::CompactOptions::default().collect_dead_fraction(Some(0.0))).unwrap();
    assert_eq!(r.collected_generations, [1]);
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    let (_, mut m) = read_manifest(&dir);
    m.obsolete = vec!["steps/part-000001-0000.parquet".into()];
    std::fs::write(dir.join("MANIFEST"), trajlog::format::manifest::encode_manifest(&m)).unwrap();
}

#[test]
fn reads_the_v8_fixture_with_a_collected_generation() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v8_dir().exists() {
        write_fixture_v8();
    }
    let dir = fixture_v8_dir();
    let (version, manifest) = read_manifest(&dir);
    assert_eq!(version, 4);
    assert_eq!(manifest.obsolete, ["steps/part-000001-0000.parquet"]);
    assert!(manifest.shards.iter().all(|s| trajlog::shard::generation_of(&s.path) == Some(2)), "{manifest:?}");
    // A reader ignores the obsolete list; the collected rows read exactly.
    let snap = check_shard_fixture(&dir);
    assert!(snap.get("gone/0").unwrap().is_none() && snap.session("task-9:0", None, None).unwrap().is_empty());
    drop(snap);
    assert!(trajlog::verify::verify_dir(&dir).unwrap().problems.is_empty());
    // A writer finishes the collection: the list is cleared.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    Store::open(copy.path(), Options::default()).unwrap().close().unwrap();
    let (_, manifest) = read_manifest(copy.path());
    assert!(manifest.obsolete.is_empty());
    check_shard_fixture(copy.path());
}

fn fixture_v9_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v9")
}

/// Store format 9: the v3 content, with the unsealed sessions (stragglers)
/// alone in segment 1, `task-1:0` in segment 2, compacted. Segment 2 was
/// retired though segment 1 is kept (not a prefix); its file is back in the
/// directory, as a crash between the manifest write and the deletion leaves
/// it.
fn write_fixture_v9() {
    let dir = fixture_v9_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    let (compacted, stragglers): (Vec<Call>, Vec<Call>) =
        fixture_calls().into_iter().partition(|c| c.session_id == "task-1:0");
    for c in stragglers {
        store.append(c).unwrap();
    }
    store.roll().unwrap();
    for c in compacted {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.roll().unwrap();
    let segment_2 = std::fs::read(dir.join("seg-0000000002.tlog")).unwrap();
    let r = store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(2)).unwrap();
    assert_eq!(r.retired_segments, 1, "{r:?}");
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    let (_, m) = read_manifest(&dir);
    assert_eq!(m.segments.first().map(|s| s.id), Some(1));
    assert!(m.segments.iter().all(|s| s.id != 2));
    std::fs::write(dir.join("seg-0000000002.tlog"), segment_2).unwrap();
}

#[test]
fn reads_the_v9_fixture_with_a_segment_retired_after_a_kept_one() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v9_dir().exists() {
        write_fixture_v9();
    }
    let dir = fixture_v9_dir();
    let (version, manifest) = read_manifest(&dir);
    assert_eq!(version, 4);
    let listed: Vec<u64> = manifest.segments.iter().map(|s| s.id).collect();
    assert_eq!(listed.first(), Some(&1));
    assert!(!listed.contains(&2) && dir.join("seg-0000000002.tlog").exists(), "{listed:?}");
    drop(check_shard_fixture(&dir));
    // `verify` names the leftover, not as damage.
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.leftovers.len(), 1, "{:?}", report.leftovers);
    assert!(report.leftovers[0].0.ends_with("seg-0000000002.tlog"), "{:?}", report.leftovers);
    assert!(report.leftovers[0].1.contains("deleted"), "{:?}", report.leftovers);
    // A writer deletes the retired segment left behind, and reads the same.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    Store::open(copy.path(), Options::default()).unwrap().close().unwrap();
    assert!(!copy.path().join("seg-0000000002.tlog").exists());
    assert!(copy.path().join("seg-0000000001.tlog").exists());
    drop(check_shard_fixture(copy.path()));
    let report = trajlog::verify::verify_dir(copy.path()).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
}

fn fixture_v11_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v11")
}

/// Store format 11: the v3 content, `task-1:0` compacted (sealed, with a
/// session reward), the other sessions in segments; the compaction wrote the
/// shard index file `shards/index.tsi` (format-spec/shard-index.md).
fn write_fixture_v11() {
    write_compacted_fixture(&fixture_v11_dir());
    assert!(fixture_v11_dir().join("shards/index.tsi").exists());
}

/// The v3 content, `task-1:0` compacted (sealed, with a session reward),
/// the other sessions in segments, written into `dir` (fixtures v11, v15).
fn write_compacted_fixture(dir: &std::path::Path) {
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_calls() {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    let r = store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(2)).unwrap();
    assert_eq!(r.sessions, 1, "{r:?}");
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v11_fixture_through_its_shard_index_file() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v11_dir().exists() {
        write_fixture_v11();
    }
    let dir = fixture_v11_dir();
    let index = std::fs::read(dir.join("shards/index.tsi")).expect("the fixture has a shard index file");
    let snap = check_shard_fixture(&dir);
    let layers = snap.index_layers();
    assert_eq!(layers.index_file_bytes, index.len() as u64, "read through the file: {layers:?}");
    drop(snap);
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    // Without the file the same answers; a writer writes it back as it was.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    std::fs::remove_file(copy.path().join("shards/index.tsi")).unwrap();
    let snap = check_shard_fixture(copy.path());
    assert_eq!(snap.index_layers().index_file_bytes, 0);
    drop(snap);
    Store::open(copy.path(), Options::default()).unwrap().close().unwrap();
    assert_same_index_file(&std::fs::read(copy.path().join("shards/index.tsi")).unwrap(), &index);
}

/// Each section of a shard index file, by kind (format-spec/shard-index.md
/// §2: a 24-byte header, then 32-byte directory entries of kind, crc32,
/// offset, length, count).
fn index_sections(file: &[u8]) -> std::collections::BTreeMap<u32, (u32, Vec<u8>, u64)> {
    let u32_at = |at: usize| u32::from_le_bytes(file[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap());
    (0..u32_at(12) as usize)
        .map(|i| 24 + i * 32)
        .map(|e| {
            let (offset, len) = (u64_at(e + 8) as usize, u64_at(e + 16) as usize);
            (u32_at(e), (u32_at(e + 4), file[offset..offset + len].to_vec(), u64_at(e + 24)))
        })
        .collect()
}

/// A shard index file this build wrote for the shards an older build's
/// `old` describes: the same nine sections, byte for byte, and (since store
/// format 15) the block checksums of each (section 10).
fn assert_same_index_file(new: &[u8], old: &[u8]) {
    let (mut new, old) = (index_sections(new), index_sections(old));
    let (_, blocks, count) = new.remove(&10).expect("block checksums");
    let want = block_crcs(&old);
    assert_eq!((blocks, count as usize), (want.clone(), want.len() / 4));
    assert_eq!(new, old);
}

/// Section 10 as it should be: the crc32 of each 16 KiB block of each
/// section, in order.
fn block_crcs(sections: &std::collections::BTreeMap<u32, (u32, Vec<u8>, u64)>) -> Vec<u8> {
    sections
        .values()
        .flat_map(|(_, bytes, _)| bytes.chunks(16384).flat_map(|b| crc32fast::hash(b).to_le_bytes()))
        .collect()
}

fn fixture_v15_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v15")
}

/// Store format 15: the v11 content written by a build whose shard index
/// file carries block checksums (section 10, format-spec/shard-index.md §2),
/// which a read-only open checks a block at a time.
fn write_fixture_v15() {
    write_compacted_fixture(&fixture_v15_dir());
}

#[test]
fn reads_the_v15_fixture_checking_its_index_file_a_block_at_a_time() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v15_dir().exists() {
        write_fixture_v15();
    }
    let dir = fixture_v15_dir();
    let index = std::fs::read(dir.join("shards/index.tsi")).expect("the fixture has a shard index file");
    // Section 10: the crc32 of each 16 KiB block of sections 1 to 9.
    let mut sections = index_sections(&index);
    let (_, blocks, count) = sections.remove(&10).expect("block checksums");
    let want = block_crcs(&sections);
    assert_eq!((blocks.as_slice(), count as usize), (want.as_slice(), want.len() / 4));
    // Read-only (lazy checks) and writable (whole checks): the same calls.
    let snap = check_shard_fixture(&dir);
    assert_eq!(snap.index_layers().index_file_bytes, index.len() as u64);
    snap.check_index().unwrap();
    drop(snap);
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    std::fs::remove_file(copy.path().join("shards/index.tsi")).unwrap();
    Store::open(copy.path(), Options::default()).unwrap().close().unwrap();
    assert_eq!(std::fs::read(copy.path().join("shards/index.tsi")).unwrap(), index, "written again as it was");
    drop(check_shard_fixture(copy.path()));
}

fn fixture_v12_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v12")
}

/// The call of session `z` the v12 fixture adds to the v3 content.
fn fixture_v12_z() -> Call {
    Call {
        trace_id: "z/0".into(),
        session_id: "z".into(),
        timestamp: 300.0,
        prompt_token_ids: vec![1, 2, 3],
        completion_token_ids: vec![4, 5],
        logprobs: Some(vec![-0.5, f32::NEG_INFINITY]),
        ..Default::default()
    }
}

/// Store format 12: the v11 content and a session `z` of one call, both
/// compacted (`z` frozen: no uid); then, in a segment of their own
/// (sealed), a trace reward on `z/0` and a new session reward of `z`. A
/// writable open (the compaction's cache removed) wrote the annotation
/// cache `shards/index.tsa`
/// (format-spec/shard-index.md §7), which lists that segment.
fn write_fixture_v12() {
    write_fixture_v12_in(&fixture_v12_dir());
}

/// The v12 fixture's content written into `dir`.
fn write_fixture_v12_in(dir: &std::path::Path) {
    let dir = dir.to_path_buf();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_calls().into_iter().chain([fixture_v12_z()]) {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.set_reward(Target::Session("z".into()), 2.5).unwrap();
    store.seal_session("z").unwrap();
    let r = store.compact(&trajlog::CompactOptions::default().steps_row_group_rows(2)).unwrap();
    assert_eq!(r.sessions, 2, "{r:?}");
    store.set_reward(Target::Trace("z/0".into()), -0.25).unwrap();
    store.set_reward(Target::Session("z".into()), 3.5).unwrap();
    store.roll().unwrap();
    store.close().unwrap();
    // The compaction's cache lists nothing (the segment came after it): a
    // writable open without one writes it.
    std::fs::remove_file(dir.join("shards/index.tsa")).unwrap();
    Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap().close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    assert!(dir.join("shards/index.tsa").exists());
}

/// What the v12 fixture reads as, with or without its cache.
fn check_fixture_v12(dir: &std::path::Path) -> trajlog::Snapshot {
    let snap = Store::open_read_only(dir).expect("fixture opens").snapshot();
    let calls: Vec<Call> = fixture_calls().into_iter().chain([fixture_v12_z()]).collect();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id == "task-1:0" || c.session_id == "z", "{}", c.trace_id);
        assert_exact(&v, c);
    }
    assert!(snap.is_sealed("task-1:0") && snap.is_sealed("z"));
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    assert_eq!(snap.session_reward("z"), Some(3.5));
    assert_eq!(snap.trace_reward("z/0").map(f64::to_bits), Some((-0.25f64).to_bits()));
    snap
}

/// [`check_fixture_v12`] read through the cache, which `trajlog verify`
/// finds sound; the cache's bytes.
fn check_fixture_v12_cached(dir: &std::path::Path) -> Vec<u8> {
    let cache = std::fs::read(dir.join("shards/index.tsa")).expect("the fixture has an annotation cache");
    let snap = check_fixture_v12(dir);
    assert_eq!(snap.index_layers().cached_annotation_segments, 1, "{:?}", snap.index_layers());
    drop(snap);
    let report = trajlog::verify::verify_dir(dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    cache
}

#[test]
fn reads_the_v12_fixture_through_its_annotation_cache() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v12_dir().exists() {
        write_fixture_v12();
    }
    let dir = fixture_v12_dir();
    let cache = check_fixture_v12_cached(&dir);
    // Without the cache the same answers; a writer writes it back as it was.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    std::fs::remove_file(copy.path().join("shards/index.tsa")).unwrap();
    let snap = check_fixture_v12(copy.path());
    assert_eq!(snap.index_layers().cached_annotation_segments, 0);
    drop(snap);
    Store::open(copy.path(), Options::default()).unwrap().close().unwrap();
    // Written back as version 2 (store format 17): the same header after
    // the version, tables and trace rewards, then block checksums.
    let written = std::fs::read(copy.path().join("shards/index.tsa")).unwrap();
    assert_eq!(written[8..12], 2u32.to_le_bytes());
    assert_eq!(written[..8], cache[..8]);
    assert_eq!(written[12..cache.len() - 8], cache[12..cache.len() - 8]);
    let snap = check_fixture_v12(copy.path());
    assert_eq!(snap.index_layers().cached_annotation_segments, 1);
}

fn fixture_v17_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v17")
}

/// Where the per-session reward table of annotation cache `b` starts
/// (format-spec/shard-index.md §7).
fn cache_rewards_at(b: &[u8]) -> usize {
    let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    let (listed, sessions) = (word(12), word(20));
    40 + 24 * listed + 2 * (sessions.div_ceil(2) * 8) + 2 * (sessions.div_ceil(64) * 8)
}

/// Store format 17: the v12 fixture's content, its annotation cache
/// written as version 2 (block checksums of its per-session tables, which
/// a read-only open checks as lookups read them).
#[test]
fn reads_the_v17_fixture_through_its_block_checked_annotation_cache() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v17_dir().exists() {
        write_fixture_v12_in(&fixture_v17_dir());
    }
    let dir = fixture_v17_dir();
    let cache = check_fixture_v12_cached(&dir);
    assert_eq!(cache[8..12], 2u32.to_le_bytes(), "version 2");

    // A flipped bit in the rewards table: the read-only open reads no
    // table, so it opens through the cache; the lookup of a reward misses,
    // and every read that returns a Result reports the damage, naming the
    // file, until a refresh loads the view without the cache.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let path = copy.path().join("shards/index.tsa");
    let mut bad = cache.clone();
    bad[cache_rewards_at(&cache)] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    let store = Store::open_read_only(copy.path()).unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.index_layers().cached_annotation_segments, 1);
    assert_eq!(snap.session_reward("z"), None, "the lookup read the bad block");
    let err = snap.session("z", None, None).unwrap_err();
    assert!(matches!(err.kind(), trajlog::ErrorKind::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("index.tsa"), "{err}");
    assert!(snap.get("z/0").is_err(), "every Result read reports it");
    drop(snap);
    store.refresh().unwrap();
    let snap = store.snapshot();
    assert_eq!(snap.index_layers().cached_annotation_segments, 0);
    assert_eq!(snap.session_reward("z"), Some(3.5));
    assert_eq!(snap.session("z", None, None).unwrap().len(), 1);
    drop((snap, store));
    let report = trajlog::verify::verify_dir(copy.path()).unwrap();
    assert!(report.problems.iter().any(|p| format!("{p:?}").contains("annotation cache")), "{report:?}");
    // A writer that sets the cache aside (here: the fixture's reward is
    // newer than the rewards side table) checks it whole, and writes it
    // anew when a block fails (tests/annotation_cache.rs: one that uses it).
    let store = Store::open(copy.path(), Options::default()).unwrap();
    assert_eq!(store.snapshot().index_layers().cached_annotation_segments, 0);
    assert_eq!(store.snapshot().session_reward("z"), Some(3.5));
    store.close().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), cache);
    let snap = check_fixture_v12(copy.path());
    assert_eq!(snap.index_layers().cached_annotation_segments, 1);
}

fn fixture_v13_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v13")
}

/// Store format 13: the v12 calls, `task-1:0` and `z` compacted (two-row
/// row groups), then `z` deleted and a compaction that collects nothing:
/// the deletions side table `shards/_deleted.parquet` (format-spec/shard.md
/// §9) lists `z`'s `steps` row and its `trajectories` row.
fn write_fixture_v13() {
    let dir = fixture_v13_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_calls().into_iter().chain([fixture_v12_z()]) {
        store.append(c).unwrap();
    }
    store.seal_session("task-1:0").unwrap();
    store.seal_session("z").unwrap();
    let opts = trajlog::CompactOptions::default().steps_row_group_rows(2).collect_dead_fraction(None);
    assert_eq!(store.compact(&opts).unwrap().sessions, 2);
    store.delete_session("z").unwrap();
    store.compact(&opts).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    assert!(dir.join("shards/_deleted.parquet").exists());
}

#[test]
fn reads_the_v13_fixture_and_its_deletions_side_table() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v13_dir().exists() {
        write_fixture_v13();
    }
    let dir = fixture_v13_dir();
    let table = std::fs::read(dir.join("shards/_deleted.parquet")).expect("the fixture has a deletions table");
    let snap = Store::open_read_only(&dir).expect("fixture opens").snapshot();
    assert!(snap.get("z/0").unwrap().is_none(), "z was deleted");
    for c in fixture_calls().iter().filter(|c| c.session_id == "task-1:0") {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert!(v.is_compacted());
        assert_exact(&v, c);
    }
    drop(snap);
    // Its rows, as format-spec/shard.md §9 lays them out: task-1:0's four
    // calls come first in the steps file (rows 0-3), z's is row 4; z's
    // trajectory follows task-1:0's.
    let rows: Vec<(String, i64, String, Option<String>)> = {
        use arrow_array::cast::AsArray;
        use arrow_array::Array;
        let r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(dir.join("shards/_deleted.parquet")).unwrap(),
        )
        .unwrap()
        .build()
        .unwrap();
        let mut out = Vec::new();
        for b in r {
            let b = b.unwrap();
            let (p, n, s, t) = (
                b.column(0).as_string::<i32>(),
                b.column(1).as_primitive::<arrow_array::types::Int64Type>(),
                b.column(2).as_string::<i32>(),
                b.column(3).as_string::<i32>(),
            );
            for i in 0..b.num_rows() {
                out.push((
                    p.value(i).into(),
                    n.value(i),
                    s.value(i).into(),
                    (!t.is_null(i)).then(|| t.value(i).into()),
                ));
            }
        }
        out
    };
    let traj_rows = rows.iter().filter(|r| r.0.starts_with("trajectories/")).count();
    assert_eq!(rows[0], ("steps/part-000001-0000.parquet".into(), 4, "z".into(), Some("z/0".into())));
    assert_eq!((rows.len(), traj_rows), (2, 1), "{rows:?}");
    assert_eq!(rows[1].2, "z");
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    let d = report.deletions.expect("checked");
    assert_eq!((d.listed, d.not_yet_listed), (2, 0));
    // Without it, a compaction writes the same bytes again.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    std::fs::remove_file(copy.path().join("shards/_deleted.parquet")).unwrap();
    let store = Store::open(copy.path(), Options::default()).unwrap();
    store.compact(&trajlog::CompactOptions::default().collect_dead_fraction(None)).unwrap();
    store.close().unwrap();
    assert_eq!(std::fs::read(copy.path().join("shards/_deleted.parquet")).unwrap(), table);
}

fn fixture_v14_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v14")
}

/// The straggler's second call in the v14 fixture: its prompt extends
/// `b/0`'s context, so its prefix-delta parent is `b/0`'s copy.
fn fixture_v14_b1() -> Call {
    Call {
        trace_id: "b/1".into(),
        session_id: "task-2:0".into(),
        timestamp: 51.0,
        prompt_token_ids: vec![9, 9, 8, 4, 4],
        completion_token_ids: vec![3, 2],
        logprobs: Some(vec![-0.0, f32::NEG_INFINITY]),
        ..Default::default()
    }
}

/// Store format 14: the v1 calls in segment 1 (`task-2:0` unsealed, a
/// straggler), `task-1:0` sealed with a reward and compacted, the
/// straggler copied forward (format-spec/shard.md §6.3: a session-moved
/// record, then `b/0` again), segment 1 retired; then `b/1` appended.
fn write_fixture_v14() {
    let dir = fixture_v14_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_calls() {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    let opts = trajlog::CompactOptions::default().steps_row_group_rows(2).copy_forward(Some(0.5));
    let r = store.compact(&opts).unwrap();
    assert_eq!((r.sessions, r.copied_sessions, r.copied_calls), (1, 1, 1), "{r:?}");
    store.append(fixture_v14_b1()).unwrap();
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

fn check_fixture_v14(dir: &std::path::Path) {
    let store = Store::open_read_only(dir).expect("fixture opens");
    let snap = store.snapshot();
    let calls: Vec<Call> = fixture_calls().into_iter().chain([fixture_v14_b1()]).collect();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id == "task-1:0", "{}", c.trace_id);
        assert_exact(&v, c);
    }
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    let b: Vec<String> = snap.session_calls("task-2:0", None, None).unwrap().into_iter().map(|c| c.trace_id).collect();
    assert_eq!(b, ["b/0", "b/1"]);
}

#[test]
fn reads_the_v14_fixture_with_a_straggler_copied_forward() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v14_dir().exists() {
        write_fixture_v14();
    }
    let dir = fixture_v14_dir();
    // Segment 1 is gone; a session-moved record (kind 5) and the copy of
    // `b/0` (kind 1) are in the segments left, with `b/1` after them.
    let (_, manifest) = read_manifest(&dir);
    assert!(manifest.segments.iter().all(|s| s.id != 1), "{:?}", manifest.segments);
    let kinds: Vec<u8> =
        common::segment_paths(&dir).iter().flat_map(|p| common::segment_frames(p)).map(|f| f.1).collect();
    let moved = kinds.iter().position(|&k| k == 5).expect("a session-moved record");
    assert_eq!(kinds[moved..].iter().filter(|&&k| k == 1).count(), 2, "{kinds:?}");
    check_fixture_v14(&dir);
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    // A writer reads the same, and the straggler finished is compacted exactly.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let store = Store::open(copy.path(), Options::default()).unwrap();
    store.seal_session("task-2:0").unwrap();
    assert_eq!(store.compact(&trajlog::CompactOptions::default()).unwrap().sessions, 1);
    store.close().unwrap();
    let store = Store::open_read_only(copy.path()).unwrap();
    let snap = store.snapshot();
    for c in fixture_calls().into_iter().chain([fixture_v14_b1()]) {
        assert_exact(&snap.get(&c.trace_id).unwrap().unwrap(), &c);
    }
}

/// (format version, record kinds) of each segment file of `dir`.
fn segment_versions_and_kinds(dir: &std::path::Path) -> Vec<(u32, Vec<u8>)> {
    common::segment_paths(dir)
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p).unwrap();
            let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
            (version, common::segment_frames(p).into_iter().map(|f| f.1).collect())
        })
        .collect()
}

#[test]
fn copy_forward_never_writes_a_session_moved_record_into_an_older_segment() {
    // Every fixture of an older format, opened by this build: a compaction
    // with nothing new (the active segment an older build left, often empty
    // and of its format), then one after an append (the active segment then
    // rolls to one of this build's format), each copying forward whatever
    // straggler it may.
    let opts = trajlog::CompactOptions::default().copy_forward(Some(trajlog::COPY_FORWARD_MAX));
    let mut copied = 0;
    for version in [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13] {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/store-v{version}")),
            copy.path(),
        );
        let (calls, ids): (usize, Vec<String>) = {
            let store = Store::open_read_only(copy.path()).unwrap();
            let snap = store.snapshot();
            let mut ids = Vec::new();
            snap.for_each_call(|c| {
                ids.push(c.trace_id().to_owned());
                Ok(())
            })
            .unwrap();
            (snap.call_count(), ids)
        };
        for round in 0..2 {
            let store = Store::open(copy.path(), Options::default()).unwrap();
            if round == 1 {
                store
                    .append(Call {
                        trace_id: "new/0".into(),
                        session_id: "new".into(),
                        prompt_token_ids: (0..2000).collect(),
                        completion_token_ids: vec![3],
                        ..Default::default()
                    })
                    .unwrap();
                store.seal_session("new").unwrap();
            }
            copied += store.compact(&opts).unwrap().copied_sessions;
            store.close().unwrap();
            for (v, kinds) in segment_versions_and_kinds(copy.path()) {
                assert!(
                    v >= 5 || !kinds.contains(&5),
                    "store-v{version}: a session-moved record in a format-{v} segment"
                );
            }
        }
        let store = Store::open_read_only(copy.path()).unwrap();
        let snap = store.snapshot();
        assert_eq!(snap.call_count(), calls + 1, "store-v{version}");
        for id in &ids {
            snap.get(id).unwrap().unwrap().to_call().unwrap();
        }
        drop(snap);
        let report = trajlog::verify::verify_dir(copy.path()).unwrap();
        assert!(report.problems.is_empty(), "store-v{version}: {report:?}");
    }
    assert!(copied > 0, "some fixture's straggler was copied forward");
}

fn fixture_v16_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v16")
}

/// The calls of session `many:0` the v16 fixture adds: enough rows for two
/// data pages per `steps` column chunk.
fn fixture_v16_many() -> Vec<Call> {
    (0..300u32)
        .map(|i| Call {
            trace_id: format!("many/{i}"),
            session_id: "many:0".into(),
            timestamp: 200.0 + f64::from(i),
            prompt_token_ids: vec![i, i + 1, i + 2],
            completion_token_ids: vec![7, i],
            logprobs: Some(vec![-(i as f32) / 7.0, f32::NEG_INFINITY]),
            ..Default::default()
        })
        .collect()
}

/// Store format 16: the v2 content and the 300 calls of `many:0`, compacted
/// by a build that writes shard format 4 (data pages v2 of at most 256 rows,
/// format-spec/shard.md §1).
fn write_fixture_v16() {
    let dir = fixture_v16_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_calls().into_iter().chain(fixture_v16_many()) {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("task-1:0".into()), 1.0).unwrap();
    store.seal_session("task-1:0").unwrap();
    store.seal_session("many:0").unwrap();
    let r = store.compact(&trajlog::CompactOptions::default()).unwrap();
    assert_eq!(r.sessions, 2, "{r:?}");
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v16_fixture_from_v2_pages_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v16_dir().exists() {
        write_fixture_v16();
    }
    let dir = fixture_v16_dir();
    let snap = Store::open_read_only(&dir).expect("fixture opens").snapshot();
    let many = fixture_v16_many();
    let calls: Vec<Call> = fixture_calls().into_iter().chain(many.iter().cloned()).collect();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id != "task-2:0", "{}", c.trace_id);
        assert_exact(&v, c);
    }
    // A session read from the middle of the row group, across its pages.
    let got = snap.session("many:0", Some(399.5), Some(100)).unwrap();
    assert_eq!(got.len(), 100);
    for (v, c) in got.iter().zip(&many[200..]) {
        assert_eq!(v.trace_id(), c.trace_id);
        assert_exact(v, c);
    }
    assert!(snap.is_sealed("task-1:0") && snap.is_sealed("many:0"));
    assert_eq!(snap.session_reward("task-1:0"), Some(1.0));
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");
    // Shard format 4: every data page a v2 page, at most 256 rows each.
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let steps = snap.shard_paths()[0].clone();
    let reader = SerializedFileReader::new(std::fs::File::open(&steps).unwrap()).unwrap();
    let kv = reader.metadata().file_metadata().key_value_metadata().unwrap().clone();
    let version = kv.iter().find(|k| k.key == "trajlog.shard_format_version").unwrap();
    assert_eq!(version.value.as_deref(), Some("4"));
    let group = reader.get_row_group(0).unwrap();
    let pages: Vec<u32> = group
        .get_column_page_reader(0)
        .unwrap()
        .map(|p| match p.unwrap() {
            parquet::column::page::Page::DataPageV2 { num_rows, .. } => num_rows,
            other => panic!("not a v2 data page: {:?}", other.page_type()),
        })
        .collect();
    assert_eq!(pages, [256, 304 - 256], "trace_id's pages");
}

fn fixture_v18_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v18")
}

/// Token literals of the v18 fixture's completions: plain, escaped,
/// non-ASCII raw, a quote, an empty one.
const V18_TOKENS: [&str; 6] = [r#"" the""#, r#""\u00e9t\u00e9""#, r#""ü""#, r#""\"q""#, r#""""#, r#""\n""#];

/// vLLM's response and rLLM's request for `call`, with its `logprobs.content`
/// written compact (vLLM's server) or `spaced` (Python's `json.dumps`), and
/// optionally with `top_logprobs` entries (then no reference 8 applies).
fn vllm_extra(call: &Call, spaced: bool, top: bool) -> Vec<u8> {
    let (colon, comma) = if spaced { (": ", ", ") } else { (":", ",") };
    let lps = call.logprobs.as_deref().unwrap_or_default();
    let content: Vec<String> = lps
        .iter()
        .enumerate()
        .map(|(i, lp)| {
            let literal = V18_TOKENS[i % V18_TOKENS.len()];
            let token: String = serde_json::from_str(literal).unwrap();
            let bytes = token.bytes().map(|b| b.to_string()).collect::<Vec<_>>().join(comma);
            let top = if top { format!(r#"{{"token"{colon}{literal}{comma}"logprob"{colon}-0.25}}"#) } else { String::new() };
            format!(
                r#"{{"token"{colon}{literal}{comma}"logprob"{colon}{}{comma}"bytes"{colon}[{bytes}]{comma}"top_logprobs"{colon}[{top}]}}"#,
                trajlog::trace_json::py_float(f64::from(*lp))
            )
        })
        .collect();
    let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(comma);
    let messages = String::from_utf8_lossy(call.messages.as_deref().unwrap_or(b"[]")).into_owned();
    format!(
        r#"{{"raw_request"{colon}{{"model"{colon}"m"{comma}"messages"{colon}{messages}{comma}"logprobs"{colon}true}}{comma}"raw_response"{colon}{{"id"{colon}"chatcmpl-{}"{comma}"choices"{colon}[{{"index"{colon}0{comma}"logprobs"{colon}{{"content"{colon}[{}]}}{comma}"token_ids"{colon}[{}]}}]{comma}"prompt_token_ids"{colon}[{}]}}}}"#,
        call.trace_id,
        content.join(comma),
        ids(&call.completion_token_ids),
        ids(&call.prompt_token_ids),
    )
    .into_bytes()
}

/// vLLM's completions-API response for `call`: its logprobs as
/// `token_logprobs` (reference 9), `spaced` as `json.dumps` writes it.
fn vllm_completions_extra(call: &Call, spaced: bool) -> Vec<u8> {
    let comma = if spaced { ", " } else { "," };
    let lps = call.logprobs.as_deref().unwrap_or_default();
    let floats: Vec<String> = lps.iter().map(|v| trajlog::trace_json::py_float(f64::from(*v))).collect();
    let tokens: Vec<&str> = (0..lps.len()).map(|i| V18_TOKENS[i % V18_TOKENS.len()]).collect();
    let ids = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(comma);
    format!(
        r#"{{"raw_request":{{"model":"m","prompt":[{}],"logprobs":1}},"raw_response":{{"id":"cmpl-{}","object":"text_completion","choices":[{{"index":0,"text":"x","logprobs":{{"text_offset":[],"token_logprobs":[{}],"tokens":[{}],"top_logprobs":[]}},"token_ids":[{}],"prompt_token_ids":[{}]}}]}}}}"#,
        ids(&call.prompt_token_ids),
        call.trace_id,
        floats.join(comma),
        tokens.join(comma),
        ids(&call.completion_token_ids),
        ids(&call.prompt_token_ids),
    )
    .into_bytes()
}

/// Chat sessions whose `extra` repeats vLLM's `logprobs.content`: `vllm-1:0`
/// (open) compact, `vllm-2:0` (compacted) spaced, `vllm-3:0` (open) one call
/// with `top_logprobs`, one with an empty completion, one whose logprobs
/// are not those of its content list; and `cmpl-1:0` (open), completions-API
/// calls whose `token_logprobs` is the column (compact, then spaced).
fn fixture_v18_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    for (sid, turns) in [("vllm-1:0", 4u32), ("vllm-2:0", 3), ("vllm-3:0", 3)] {
        let mut prompt: Vec<u32> = (0..20).map(|i| i + turns * 100).collect();
        for step in 0..turns {
            let n = if sid == "vllm-3:0" && step == 1 { 0 } else { 13 + step };
            let completion: Vec<u32> = (0..n).map(|i| 70_000 + 50 * step + i).collect();
            let mut call = Call {
                trace_id: format!("{sid}/{step}"),
                session_id: sid.into(),
                timestamp: 800.0 + f64::from(step),
                logprobs: Some(completion.iter().map(|&t| -((t % 997) as f32) / 331.0).collect()),
                prompt_token_ids: prompt.clone(),
                completion_token_ids: completion.clone(),
                messages: Some(format!(r#"[{{"role":"user","content":"{sid} step {step}"}}]"#).into_bytes()),
                response_message: Some(br#"{"role":"assistant","content":"ok"}"#.to_vec()),
                ..Default::default()
            };
            call.extra = Some(vllm_extra(&call, sid == "vllm-2:0", sid == "vllm-3:0" && step == 0));
            if sid == "vllm-3:0" && step == 2 {
                if let Some(lp) = call.logprobs.as_mut().and_then(|l| l.last_mut()) {
                    *lp = f32::from_bits(lp.to_bits() ^ 1);
                }
            }
            calls.push(call);
            prompt.extend_from_slice(&completion);
            prompt.extend([4, step]);
        }
    }
    let mut prompt: Vec<u32> = (0..12).collect();
    for step in 0..2u32 {
        let completion: Vec<u32> = (0..9 + step).map(|i| 80_000 + i).collect();
        let mut call = Call {
            trace_id: format!("cmpl-1:0/{step}"),
            session_id: "cmpl-1:0".into(),
            timestamp: 900.0 + f64::from(step),
            logprobs: Some(completion.iter().map(|&t| -((t % 991) as f32) / 17.0).collect()),
            prompt_token_ids: prompt.clone(),
            completion_token_ids: completion.clone(),
            ..Default::default()
        };
        call.extra = Some(vllm_completions_extra(&call, step == 1));
        calls.push(call);
        prompt.extend_from_slice(&completion);
    }
    calls
}

/// Store format 18: segment format 6 (reference 8 in docs blocks).
fn write_fixture_v18() {
    let dir = fixture_v18_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_v18_calls() {
        store.append(c).unwrap();
    }
    store.seal_session("vllm-2:0").unwrap();
    let r = store.compact(&trajlog::CompactOptions::default()).unwrap();
    assert_eq!(r.sessions, 1, "{r:?}");
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
}

#[test]
fn reads_the_v18_fixture_with_content_lists_exactly() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v18_dir().exists() {
        write_fixture_v18();
    }
    let dir = fixture_v18_dir();
    let snap = Store::open_read_only(&dir).expect("fixture opens").snapshot();
    let calls = fixture_v18_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        let v = snap.get(&c.trace_id).unwrap().unwrap();
        assert_eq!(v.is_compacted(), c.session_id == "vllm-2:0", "{}", c.trace_id);
        assert_exact(&v, c);
        assert_eq!(&v.to_call().unwrap(), c, "{}", c.trace_id);
    }
    for sid in ["vllm-1:0", "vllm-2:0", "vllm-3:0", "cmpl-1:0"] {
        let want: Vec<Call> = calls.iter().filter(|c| c.session_id == sid).cloned().collect();
        assert_eq!(snap.session_calls(sid, None, None).unwrap(), want, "{sid}");
    }
    // Segment format 6 on disk. vllm-1:0's and vllm-2:0's records hold
    // their content lists as one reference, cmpl-1:0's their
    // `token_logprobs`; vllm-3:0's do not (top logprobs, no logprobs, a
    // logprob that is not the list's).
    let formats: Vec<u32> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tlog"))
        .map(|p| u32::from_le_bytes(std::fs::read(p).unwrap()[8..12].try_into().unwrap()))
        .collect();
    assert!(!formats.is_empty() && formats.iter().all(|&v| v == 6), "segment formats {formats:?}");
    let report = trajlog::verify::verify_dir(&dir).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    // vllm-2:0's records stay in the segment beside the open sessions'.
    assert_eq!((report.split.docs_blocks, report.split.content_lists), (12, 9), "{:?}", report.split);
}

/// A writer appending to a reopened store whose active segment is of
/// format 5 keeps that format: its docs blocks cut a content list entry by
/// entry (no reference 8), so the builds that wrote the store still read it.
#[test]
fn appends_to_a_format_5_segment_make_no_content_references() {
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&fixture_v17_dir(), copy.path());
    let calls: Vec<Call> = fixture_v18_calls().into_iter().filter(|c| c.session_id == "vllm-1:0").collect();
    let store = Store::open(copy.path(), Options::default()).unwrap();
    for c in &calls {
        store.append(c.clone()).unwrap();
    }
    store.flush().unwrap();
    let snap = store.snapshot();
    for c in &calls {
        assert_eq!(&snap.get(&c.trace_id).unwrap().unwrap().to_call().unwrap(), c);
    }
    drop(snap);
    store.close().unwrap();
    let formats: Vec<u32> = std::fs::read_dir(copy.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tlog"))
        .map(|p| u32::from_le_bytes(std::fs::read(p).unwrap()[8..12].try_into().unwrap()))
        .collect();
    assert!(formats.iter().all(|&v| v == 5), "segment formats {formats:?}");
    let report = trajlog::verify::verify_dir(copy.path()).expect("verify");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.split.content_lists, 0, "{:?}", report.split);
    assert!(report.split.docs_blocks >= calls.len() as u64, "{:?}", report.split);
}

fn fixture_v19_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v19")
}

/// The v19 fixture's calls: the v1 calls, `z/0`, and four sessions
/// `c:0` … `c:3` of two calls each.
fn fixture_v19_calls() -> Vec<Call> {
    let mut calls: Vec<Call> = fixture_calls().into_iter().chain([fixture_v12_z()]).collect();
    for s in 0..4u32 {
        for step in 0..2u32 {
            calls.push(Call {
                trace_id: format!("c{s}/{step}"),
                session_id: format!("c:{s}"),
                timestamp: 400.0 + f64::from(s * 2 + step),
                prompt_token_ids: (0..8 + step * 4).map(|i| s * 100 + i).collect(),
                completion_token_ids: vec![900 + s, 901],
                logprobs: Some(vec![-0.125 * s as f32, -0.0]),
                ..Default::default()
            });
        }
    }
    calls
}

/// Store format 19: the v19 calls in 64 KiB segments; `z` and `c:0` …
/// `c:3` sealed (`c:1` with a session reward, `c2/1` with a
/// trace reward), `task-1:0` sealed, `task-2:0` open; a roll; then a
/// writable open with `backlog_index_min_calls(1)` wrote the backlog index
/// file `backlog.tbi` (format-spec/backlog-index.md): its cold layer holds
/// the sessions in sealed segments that nothing but their own calls, seals
/// and session rewards names (`z`, `c:0`, `c:1`, `c:3` and the open
/// `task-2:0`; `task-1:0` has a session uid, `c:2` a trace reward), and
/// the rest of the footers' entries are its warm
/// entries.
fn write_fixture_v19() {
    let dir = fixture_v19_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024)).unwrap();
    for c in fixture_v19_calls() {
        store.append(c).unwrap();
    }
    store.set_reward(Target::Session("c:1".into()), 0.75).unwrap();
    store.set_reward(Target::Trace("c2/1".into()), -2.0).unwrap();
    for s in ["task-1:0", "z", "c:0", "c:1", "c:2", "c:3"] {
        store.seal_session(s).unwrap();
    }
    store.roll().unwrap();
    store.close().unwrap();
    let store = Store::open(&dir, Options::default().segment_bytes(64 * 1024).backlog_index_min_calls(1)).unwrap();
    assert_eq!(store.snapshot().index_layers().cold_calls, 8, "{:?}", store.snapshot().index_layers());
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    assert!(dir.join("backlog.tbi").exists());
}

/// What the v19 fixture reads as, with or without its backlog file.
fn check_fixture_v19(dir: &std::path::Path) -> trajlog::Snapshot {
    let snap = Store::open_read_only(dir).expect("fixture opens").snapshot();
    let calls = fixture_v19_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        assert_exact(&snap.get(&c.trace_id).unwrap().unwrap(), c);
    }
    for s in ["task-1:0", "z", "c:0", "c:1", "c:2", "c:3"] {
        assert!(snap.is_sealed(s), "{s}");
        let want: Vec<Call> = calls.iter().filter(|c| c.session_id == s).cloned().collect();
        assert_eq!(snap.session_calls(s, None, None).unwrap(), want, "{s}");
    }
    assert!(!snap.is_sealed("task-2:0"));
    assert_eq!(snap.session_reward("c:1"), Some(0.75));
    assert_eq!(snap.session_reward("c:0"), None);
    assert_eq!(snap.trace_reward("c2/1").map(f64::to_bits), Some((-2.0f64).to_bits()));
    snap
}

/// Where each table of backlog index file `b` starts, and its length
/// (format-spec/backlog-index.md §2: rows, sessions, trace table, text,
/// the sealed and has-reward bit sets, the rewards; each 8-aligned; then
/// the block checksums, the file's last bytes).
fn backlog_tables(b: &[u8]) -> [(usize, usize); 7] {
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let (rows, by_trace, text) = (u64_at(32), u64_at(40), u64_at(48));
    let sessions = u32::from_le_bytes(b[56..60].try_into().unwrap()) as usize;
    let pad8 = |n: usize| n.div_ceil(8) * 8;
    let words = sessions.div_ceil(64) * 8;
    let lens = [rows * 40, sessions * 24, by_trace * 16, text, words, words, sessions * 8];
    let blocks: usize = lens.iter().map(|t| t.div_ceil(16 << 10)).sum();
    let mut at = b.len() - pad8(blocks * 4) - lens.iter().map(|t| pad8(*t)).sum::<usize>();
    lens.map(|len| {
        let t = (at, len);
        at += pad8(len);
        t
    })
}

/// Store format 19: an open maps the backlog index file (reading none of
/// the listed segments' footers) and answers as an open without it; a
/// writable open uses it too and a writer that rewrites it writes the
/// same bytes; `trajlog verify` finds it sound, and names it when a
/// block of its tables is damaged.
#[test]
fn reads_the_v19_fixture_through_its_backlog_index_file() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v19_dir().exists() {
        write_fixture_v19();
    }
    let dir = fixture_v19_dir();
    let file = std::fs::read(dir.join("backlog.tbi")).expect("the fixture has a backlog index file");
    assert_eq!(&file[..8], b"TRJLBLX1");
    assert_eq!(file[8..12], 1u32.to_le_bytes(), "version 1");
    let snap = check_fixture_v19(&dir);
    let layers = snap.index_layers();
    assert!(layers.backlog_segments > 0, "{layers:?}");
    assert_eq!(layers.cold_calls, 8, "{layers:?}");
    drop(snap);
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");

    // Without it: the same answers, from the footers.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let path = copy.path().join("backlog.tbi");
    std::fs::remove_file(&path).unwrap();
    let snap = check_fixture_v19(copy.path());
    assert_eq!(snap.index_layers().backlog_segments, 0);
    drop(snap);
    // A writable open with the option writes the same bytes again, and
    // the next one uses them.
    let opts = Options::default().backlog_index_min_calls(1);
    Store::open(copy.path(), opts.clone()).unwrap().close().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), file);
    let store = Store::open(copy.path(), opts).unwrap();
    assert!(store.snapshot().index_layers().backlog_segments > 0);
    store.close().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), file);

    // A flipped bit in the last table (the session rewards): verify names
    // the file (reads that meet such a block fail: tests/cold.rs).
    let mut bad = file.clone();
    let rewards_at = backlog_tables(&file)[6].0;
    bad[rewards_at] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    let report = trajlog::verify::verify_dir(copy.path()).unwrap();
    assert!(report.problems.iter().any(|p| format!("{p:?}").contains("backlog")), "{report:?}");

    // A file whose checksums pass but whose content is not what the
    // listed segments make of it (here: c:1's session reward 0.75 made
    // 0.5, the block checksums recomputed): an open would answer from it;
    // verify compares it with the footers and names what differs.
    let mut bad = file.clone();
    let tables = backlog_tables(&file);
    let (rewards_at, rewards_len) = tables[6];
    let slot = (rewards_at..rewards_at + rewards_len)
        .step_by(8)
        .find(|&at| bad[at..at + 8] == 0.75f64.to_bits().to_le_bytes())
        .expect("c:1's reward");
    bad[slot..slot + 8].copy_from_slice(&0.5f64.to_bits().to_le_bytes());
    let crcs_at = tables[6].0 + tables[6].1.div_ceil(8) * 8;
    let blocks: usize = tables.iter().map(|t| t.1.div_ceil(16 << 10)).sum();
    let rewards_block = crcs_at + 4 * (blocks - 1);
    let crc = crc32fast::hash(&bad[rewards_at..rewards_at + rewards_len]);
    bad[rewards_block..rewards_block + 4].copy_from_slice(&crc.to_le_bytes());
    let crcs_crc = crc32fast::hash(&bad[crcs_at..crcs_at + 4 * blocks]);
    bad[68..72].copy_from_slice(&crcs_crc.to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    let snap = Store::open_read_only(copy.path()).unwrap().snapshot();
    assert!(snap.index_layers().backlog_segments > 0, "its checks pass");
    assert_eq!(snap.session_reward("c:1"), Some(0.5));
    drop(snap);
    let report = trajlog::verify::verify_dir(copy.path()).unwrap();
    let found: Vec<&str> = report.problems.iter().map(|p| p.what.as_str()).collect();
    assert!(found.iter().any(|p| p.contains("backlog") && p.contains("\"c:1\"")), "{found:?}");
}

fn fixture_v20_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v20")
}

/// The v20 fixture's calls: sessions `d:0` … `d:9` and `e:0`, `e:1` of
/// two calls each.
fn fixture_v20_calls() -> Vec<Call> {
    let sessions = (0..10u32).map(|s| format!("d:{s}")).chain(["e:0".to_owned(), "e:1".to_owned()]);
    let mut calls = Vec::new();
    for (n, session) in sessions.enumerate() {
        let n = n as u32;
        for step in 0..2u32 {
            calls.push(Call {
                trace_id: format!("{}/{step}", session.replace(':', "")),
                session_id: session.clone(),
                timestamp: 500.0 + f64::from(n * 2 + step),
                prompt_token_ids: (0..6 + step * 3).map(|i| n * 100 + i).collect(),
                completion_token_ids: vec![700 + n, 701],
                logprobs: Some(vec![-0.25 * n as f32, -0.0]),
                ..Default::default()
            });
        }
    }
    calls
}

/// Store format 20: `d:0` … `d:9` each sealed in a segment of its own (ten
/// rolls); a writable open with `backlog_index_min_calls(1)` wrote
/// `backlog.tbi` over those ten (every session cold); then `e:0` (sealed,
/// session reward 0.5) and `e:1` (a trace reward on `e1/0`), a session
/// reward 1.25 on `d:3`, and a roll, after which the writer wrote the
/// delta `backlog-delta.tbi` over the eleventh segment (format-spec/
/// backlog-index.md §4): its layer holds `e:0`; `e:1`'s records and
/// `d:3`'s reward are its warm entries.
fn write_fixture_v20() {
    let dir = fixture_v20_dir();
    assert!(!dir.exists(), "fixtures are never rewritten: {} exists", dir.display());
    let calls = fixture_v20_calls();
    let store = Store::open(&dir, Options::default()).unwrap();
    for pair in calls[..20].chunks(2) {
        for c in pair {
            store.append(c.clone()).unwrap();
        }
        store.seal_session(&pair[0].session_id).unwrap();
        store.roll().unwrap();
    }
    store.close().unwrap();
    let store = Store::open(&dir, Options::default().backlog_index_min_calls(1)).unwrap();
    store.wait_backlog_refresh().unwrap();
    for c in &calls[20..] {
        store.append(c.clone()).unwrap();
    }
    store.seal_session("e:0").unwrap();
    store.set_reward(Target::Session("e:0".into()), 0.5).unwrap();
    store.set_reward(Target::Trace("e1/0".into()), -1.5).unwrap();
    store.set_reward(Target::Session("d:3".into()), 1.25).unwrap();
    store.roll().unwrap();
    let (_, taken, _, deltas) = store.wait_backlog_refresh_counts().unwrap();
    assert!(taken >= 2 && deltas == 1, "({taken}, {deltas})");
    store.close().unwrap();
    std::fs::remove_file(dir.join("LOCK")).unwrap();
    assert!(dir.join("backlog.tbi").exists() && dir.join("backlog-delta.tbi").exists());
}

/// What the v20 fixture reads as, with or without its backlog files.
fn check_fixture_v20(dir: &std::path::Path) -> trajlog::Snapshot {
    let snap = Store::open_read_only(dir).expect("fixture opens").snapshot();
    let calls = fixture_v20_calls();
    assert_eq!(snap.call_count(), calls.len());
    for c in &calls {
        assert_exact(&snap.get(&c.trace_id).unwrap().unwrap(), c);
    }
    for s in (0..10).map(|s| format!("d:{s}")).chain(["e:0".to_owned(), "e:1".to_owned()]) {
        assert_eq!(snap.is_sealed(&s), s != "e:1", "{s}");
        let want: Vec<Call> = calls.iter().filter(|c| c.session_id == s).cloned().collect();
        assert_eq!(snap.session_calls(&s, None, None).unwrap(), want, "{s}");
    }
    assert_eq!(snap.session_reward("e:0"), Some(0.5));
    assert_eq!(snap.session_reward("d:3"), Some(1.25));
    assert_eq!(snap.session_reward("d:4"), None);
    assert_eq!(snap.trace_reward("e1/0").map(f64::to_bits), Some((-1.5f64).to_bits()));
    snap
}

/// Store format 20: an open maps the backlog index file and its delta
/// (two cold layers, reading none of the eleven listed footers) and
/// answers as an open with the file alone and as one without either; a
/// delta that fails its checks, or whose base is not the file there, is
/// not used (and `verify` names a damaged one).
#[test]
fn reads_the_v20_fixture_through_the_delta_over_its_backlog_file() {
    if std::env::var_os("TRAJLOG_WRITE_FIXTURE").is_some() && !fixture_v20_dir().exists() {
        write_fixture_v20();
    }
    let dir = fixture_v20_dir();
    let delta = std::fs::read(dir.join("backlog-delta.tbi")).expect("the fixture has a delta");
    assert_eq!(&delta[..8], b"TRJLBLX1");
    assert_eq!(delta[12..16], 2u32.to_le_bytes(), "flag bit 1: a delta");
    let snap = check_fixture_v20(&dir);
    let layers = snap.index_layers();
    assert_eq!((layers.backlog_segments, layers.cold_layers), (11, 2), "{layers:?}");
    // d:3 thawed by its reward; e:0 in the delta's layer.
    assert_eq!(layers.cold_calls, 20, "{layers:?}");
    drop(snap);
    let report = trajlog::verify::verify_dir(&dir).unwrap();
    assert!(report.problems.is_empty() && report.leftovers.is_empty(), "{report:?}");

    // Without the delta, then without either: the same answers.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let path = copy.path().join("backlog-delta.tbi");
    std::fs::remove_file(&path).unwrap();
    assert_eq!(check_fixture_v20(copy.path()).index_layers().backlog_segments, 10);
    std::fs::remove_file(copy.path().join("backlog.tbi")).unwrap();
    assert_eq!(check_fixture_v20(copy.path()).index_layers().backlog_segments, 0);

    // A delta with a flipped bit in its head: not used, named by verify.
    let copy = tempfile::tempdir().unwrap();
    copy_dir(&dir, copy.path());
    let path = copy.path().join("backlog-delta.tbi");
    let mut bad = delta.clone();
    bad[80] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    assert_eq!(check_fixture_v20(copy.path()).index_layers().backlog_segments, 10);
    let report = trajlog::verify::verify_dir(copy.path()).unwrap();
    assert!(report.problems.iter().any(|p| p.what.contains("its delta")), "{report:?}");

    // A delta over another base (its key names the file it was written
    // over): not used.
    // The head crc32 (§2: header bytes 0..64, the listed table, the warm
    // entries) recomputed, so that only the key differs.
    let head_crc = |b: &[u8]| {
        let listed = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
        let warm_len = |i: usize| u64::from_le_bytes(b[72 + 40 * i + 32..72 + 40 * i + 40].try_into().unwrap());
        let warm: usize = (0..listed).map(|i| (warm_len(i) as usize).div_ceil(8) * 8).sum();
        let mut h = crc32fast::Hasher::new();
        h.update(&b[..64]);
        h.update(&b[72..72 + 40 * listed + warm]);
        h.finalize().to_le_bytes()
    };
    assert_eq!(head_crc(&delta), delta[64..68], "the recomputation is the file's");
    let mut other = delta.clone();
    other[16] ^= 0x01;
    let crc = head_crc(&other);
    other[64..68].copy_from_slice(&crc);
    std::fs::write(&path, &other).unwrap();
    assert_eq!(check_fixture_v20(copy.path()).index_layers().backlog_segments, 10);
}
