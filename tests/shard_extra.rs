//! Shard format 3 (format-spec/shard.md §2.1): compaction moves `raw_request`,
//! `raw_response` and trajlog's key order out of `extra` into `steps` columns
//! of plain JSON text, and the store still reads every call back exactly.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use arrow_array::{Array, RecordBatch};
use common::*;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::path::Path;
use trajlog::{Call, CompactOptions, Options, Store};
use trajlog_sim::{simulate, Shape, SimConfig};

const KEY_ORDER: &str = "\u{0}key_order";

/// Hand-made calls whose `extra` covers the cases of §2.1: members first,
/// last, alone, absent, `null`, repeated, nested, with whitespace around them
/// or elsewhere, odd key orders (parsed traces), non-ASCII text.
fn edge_calls() -> Vec<Call> {
    let extras: Vec<Option<&str>> = vec![
        None,
        Some("{}"),
        Some(r#"{"token_counts":{"prompt":3}}"#),
        Some(r#"{"raw_request":{"model":"m","messages":[]},"raw_response":{"id":"x"},"token_counts":{}}"#),
        Some(r#"{"raw_response":{"id":"x"},"a":1,"raw_request":[1,2]}"#),
        Some(r#"{"raw_request":"only"}"#),
        Some(r#"{"raw_request":null,"raw_response":null}"#),
        Some(r#"{"raw_request":{"a":1},"raw_response":null}"#),
        Some(r#"{"raw_request":1,"raw_request":2,"raw_response":{"z":"é😀"}}"#),
        Some(r#"{"nested":{"raw_request":{"x":1}},"raw_response":true}"#),
        Some("{ \"raw_request\" : {\"a\": 1} , \"raw_response\":{\"b\" : [ 1 ]},\"c\":2 }"),
        Some("\n{\"raw_response\":{},\"raw_request\":{}}\t"),
        Some("{\n  \"raw_request\": {\n    \"a\": 1\n  },\n  \"raw_response\": 2\n}"),
        Some(r#"{"raw\u005frequest":{"escaped key":1},"raw_response":"\u00e9\n"}"#),
        Some(r#"{"z":1,"y":2,"raw_response":{"usage":{"prompt_tokens":2}},"b":[],"raw_request":{}}"#),
    ];
    let mut calls: Vec<Call> = extras
        .into_iter()
        .enumerate()
        .map(|(i, extra)| Call {
            trace_id: format!("edge/{i}"),
            session_id: "edge:0".into(),
            timestamp: 10.0 + i as f64,
            prompt_token_ids: vec![1, 2, 3, i as u32],
            completion_token_ids: vec![7, 8],
            extra: extra.map(|e| e.as_bytes().to_vec()),
            ..Default::default()
        })
        .collect();
    // Traces parsed as `trajlog ingest` does: odd key orders keep a KEY_ORDER
    // member in `extra`, which moves to the `key_order` column.
    let traces = [
        r#"{"raw_response":{"choices":[]},"session_id":"parsed:0","trace_id":"p/0","prompt_token_ids":[1],"completion_token_ids":[2],"raw_request":{"messages":[]},"zeta":1,"timestamp":1.5}"#,
        r#"{"trace_id":"p/1","session_id":"parsed:0","zeta":null,"prompt_token_ids":[1,2,3],"completion_token_ids":[4],"timestamp":2.5}"#,
        r#"{"trace_id":"p/2","session_id":"parsed:0","prompt_token_ids":[1],"completion_token_ids":[2],"raw_request":{},"raw_response":null,"timestamp":3.5}"#,
        r#"{"timestamp":4.5,"raw_request":{"a":"\u0000"},"trace_id":"p/3","session_id":"parsed:0","prompt_token_ids":[1],"completion_token_ids":[2]}"#,
    ];
    for t in traces {
        calls.push(trajlog::trace_json::parse_trace(t, 0.0).expect("a valid trace"));
    }
    assert!(
        calls
            .iter()
            .filter_map(|c| c.extra.as_deref())
            .any(|e| String::from_utf8_lossy(e).contains(r#""\u0000key_order""#)),
        "some parsed trace keeps its key order"
    );
    calls
}

fn gateway_calls() -> Vec<Call> {
    let mut calls = Vec::new();
    for (seed, shape) in [(1, Shape::Gateway), (2, Shape::GatewayStreaming), (3, Shape::Lean)] {
        let cfg = SimConfig {
            sessions: 4,
            steps: 4,
            rollouts_per_task: 2,
            system_tokens: 64,
            completion_tokens: (8, 40),
            tool_tokens: (4, 20),
            break_every: 3,
            seed,
            shape,
        };
        for s in simulate(&cfg) {
            for mut c in s.calls {
                c.session_id = format!("{}-{}", shape.name(), c.session_id);
                calls.push(c);
            }
        }
    }
    calls
}

/// Append `calls`, seal every session, compact everything; the calls by id.
fn compact_all(dir: &Path, calls: &[Call], opts: &CompactOptions) -> (Store, BTreeMap<String, Call>) {
    let store = compact_sealed(dir, calls, opts);
    (store, calls.iter().map(|c| (c.trace_id.clone(), c.clone())).collect())
}

/// Every call reads back equal to the one appended, through get, session
/// reads and the full scan, from the shards.
fn check_exact(store: &Store, calls: &BTreeMap<String, Call>) {
    let snap = store.snapshot();
    assert_eq!(snap.call_count(), calls.len());
    for c in calls.values() {
        let v = snap.get(&c.trace_id).unwrap().expect("present");
        assert!(v.is_compacted(), "{}", c.trace_id);
        assert_same(&v, c);
        assert_eq!(&v.to_call().unwrap(), c, "Call equality of {}", c.trace_id);
        assert_eq!(
            trajlog::trace_json::export_call(&v.to_call().unwrap()),
            trajlog::trace_json::export_call(c),
            "export of {}",
            c.trace_id
        );
    }
    let mut n = 0;
    snap.for_each_call(|v| {
        assert_same(v, &calls[v.trace_id()]);
        n += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(n, calls.len());
    let sessions: std::collections::BTreeSet<&str> = calls.values().map(|c| c.session_id.as_str()).collect();
    for s in sessions {
        for v in snap.session(s, None, None).unwrap() {
            assert_same(&v, &calls[v.trace_id()]);
        }
    }
}

fn steps_batches(dir: &Path) -> Vec<(RecordBatch, String)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir.join("shards/steps")).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for f in files {
        let b = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&f).unwrap()).unwrap();
        let kv = b.metadata().file_metadata().key_value_metadata().unwrap();
        let version = kv.iter().find(|k| k.key == "trajlog.shard_format_version").unwrap().value.clone().unwrap();
        for batch in b.build().unwrap() {
            out.push((batch.unwrap(), version.clone()));
        }
    }
    out
}

/// The members of a JSON object in order (repeats included), verbatim.
fn members(text: &str) -> Vec<(String, String)> {
    let mut de = serde_json::Deserializer::from_str(text);
    let map: Vec<(String, Box<RawValue>)> = {
        use serde::de::{Deserializer, MapAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<(String, Box<RawValue>)>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(kv) = m.next_entry()? {
                    out.push(kv);
                }
                Ok(out)
            }
        }
        (&mut de).deserialize_map(V).unwrap()
    };
    map.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect()
}

#[test]
fn gateway_and_edge_calls_read_back_exactly_after_compaction() {
    let dir = tempdir();
    let mut calls = gateway_calls();
    calls.extend(edge_calls());
    // Small row groups: several per shard, each rebuilt on its own.
    let (store, by_id) = compact_all(dir.path(), &calls, &CompactOptions::default().steps_row_group_rows(5));
    check_exact(&store, &by_id);
    let report = trajlog::verify::verify_dir(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    store.close().unwrap();
    // Reopened: the index is rebuilt from the format 3 shards.
    let store = Store::open(dir.path(), Options::default()).unwrap();
    check_exact(&store, &by_id);
}

#[test]
fn steps_hold_the_raw_bodies_as_plain_json() {
    let dir = tempdir();
    let mut calls = gateway_calls();
    calls.extend(edge_calls());
    let (_store, by_id) = compact_all(dir.path(), &calls, &CompactOptions::default());
    let (mut moved_raw, mut moved_order, mut gateway_rows) = (0, 0, 0);
    for (batch, version) in steps_batches(dir.path()) {
        assert_eq!(version, "4");
        let text = |name: &str| batch.column_by_name(name).unwrap().as_string::<i32>().clone();
        let (ids, extra, order) = (text("trace_id"), text("extra"), text("key_order"));
        let raw = [("raw_request", text("raw_request")), ("raw_response", text("raw_response"))];
        let splice = batch.column_by_name("extra_splice").unwrap().as_list::<i32>().clone();
        for row in 0..batch.num_rows() {
            let want = &by_id[ids.value(row)];
            let original = want.extra.as_deref().map(|e| std::str::from_utf8(e).unwrap());
            let original_members = original.filter(|e| e.trim_start().starts_with('{')).map(members);
            let kept = extra.is_valid(row).then(|| extra.value(row));
            assert_eq!(kept.is_some(), original.is_some());
            let kept_members = kept.map(members).unwrap_or_default();
            for (name, col) in &raw {
                if !col.is_valid(row) {
                    continue;
                }
                moved_raw += 1;
                // Plain JSON, equal to the member's verbatim text, gone from `extra`.
                let value = col.value(row);
                serde_json::from_str::<serde_json::Value>(value).expect("the column holds JSON");
                let from = original_members.as_ref().unwrap();
                assert!(from.iter().any(|(k, v)| k == name && v == value), "{name} of {}", want.trace_id);
                assert!(kept_members.iter().all(|(k, _)| k != name));
            }
            if order.is_valid(row) {
                moved_order += 1;
                let keys: Vec<String> = serde_json::from_str(order.value(row)).expect("a JSON list of keys");
                assert!(keys.contains(&"trace_id".to_owned()));
            }
            assert!(kept_members.iter().all(|(k, _)| k != KEY_ORDER), "{}: {kept:?}", want.trace_id);
            let n_moved = raw.iter().filter(|(_, c)| c.is_valid(row)).count() + usize::from(order.is_valid(row));
            let n_splice = if splice.is_null(row) { 0 } else { splice.value(row).as_primitive::<UInt32Type>().len() };
            assert_eq!(n_splice, n_moved, "{}", want.trace_id);
            if want.session_id.starts_with("gateway-") {
                gateway_rows += 1;
                // The gateway shapes keep no raw body in `extra`.
                assert!(kept_members.iter().all(|(k, v)| !k.starts_with("raw_") || v == "null"), "{kept:?}");
            }
        }
    }
    assert!(gateway_rows > 0 && moved_order > 0);
    // Every non-streaming gateway call moves both bodies, a streaming one its request.
    let gateway = calls.iter().filter(|c| c.session_id.starts_with("gateway-")).count();
    let streaming = calls.iter().filter(|c| c.session_id.starts_with("gateway-streaming-")).count();
    assert!(moved_raw >= 2 * gateway - streaming, "{moved_raw} moved of {gateway} gateway calls");
}

#[test]
fn the_moved_documents_leave_extra_small() {
    // The raw bodies are stored once, in their columns: `extra` keeps only
    // `token_counts`, `metadata`-like leftovers and unknown keys.
    let dir = tempdir();
    let calls = gateway_calls();
    let (_store, _) = compact_all(dir.path(), &calls, &CompactOptions::default());
    let (mut in_columns, mut in_extra) = (0usize, 0usize);
    for (batch, _) in steps_batches(dir.path()) {
        for name in ["raw_request", "raw_response", "key_order"] {
            in_columns += batch.column_by_name(name).unwrap().as_string::<i32>().value_data().len();
        }
        in_extra += batch.column_by_name("extra").unwrap().as_string::<i32>().value_data().len();
    }
    let appended: usize = calls.iter().map(|c| c.extra.as_ref().map_or(0, Vec::len)).sum();
    assert!(in_extra * 10 < appended, "extra keeps {in_extra} of {appended} bytes");
    assert!(in_columns + in_extra <= appended, "{in_columns} + {in_extra} > {appended}");
}

#[test]
fn a_splice_that_does_not_fit_is_corrupt_not_misread() {
    use trajlog::shard::reader::{verify_shard, ShardFile};
    use trajlog::shard::schema::steps_schema;
    use trajlog::shard::writer::TableWriter;
    let dir = tempdir();
    let calls: Vec<Call> = edge_calls().into_iter().filter(|c| c.session_id == "edge:0").collect();
    let (_store, _) = compact_all(dir.path(), &calls, &CompactOptions::default());
    let (batch, _) = steps_batches(dir.path()).remove(0);
    // Every offset moved past the end of its `extra`: a well-checksummed file
    // whose rows cannot be rebuilt.
    let splice = batch.column_by_name("extra_splice").unwrap().as_list::<i32>();
    let mut bad = arrow_array::builder::ListBuilder::new(arrow_array::builder::UInt32Builder::new())
        .with_field(std::sync::Arc::new(arrow_schema::Field::new("item", arrow_schema::DataType::UInt32, false)));
    for row in 0..batch.num_rows() {
        if splice.is_null(row) {
            bad.append(false);
        } else {
            for _ in 0..splice.value(row).len() {
                bad.values().append_value(1 << 20);
            }
            bad.append(true);
        }
    }
    let index = batch.schema().index_of("extra_splice").unwrap();
    let mut columns = batch.columns().to_vec();
    columns[index] = std::sync::Arc::new(bad.finish());
    let damaged = RecordBatch::try_new(steps_schema(), columns).unwrap();
    let out = tempdir();
    let mut w = TableWriter::new(out.path(), "steps", 1, steps_schema(), trajlog::ShardCompression::default(), 1 << 30)
        .unwrap();
    w.write_row_group(&damaged, 0).unwrap();
    let written = w.finish().unwrap();
    let path = out.path().join(&written[0].staged);
    let shard = ShardFile::open(&path, 0, written[0].shard.checksum).unwrap();
    let err = shard.read_row_group(0).unwrap_err();
    assert!(matches!(err.kind(), trajlog::ErrorKind::Corrupt { .. }), "{err}");
    assert!(err.message().contains("extra_splice"), "{err}");
    let problems = verify_shard(&path, written[0].shard.checksum);
    assert_eq!(problems.len(), 1, "{problems:?}");
}
