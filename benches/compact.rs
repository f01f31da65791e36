//! Compaction throughput in bytes of input token payload (full prompts and
//! completions as u32, logprobs as f32) and in calls. Each iteration compacts a
//! fresh copy of a template store (the copy is setup, outside the timing).
//! Run: `cargo bench --bench compact`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::path::Path;
use std::time::Duration;
use trajlog::{CompactOptions, Durability, Options, ShardCompression, Store};
use trajlog_sim::{simulate_session, SimConfig};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        if e.file_type().expect("type").is_file() && e.file_name() != "LOCK" {
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
        }
    }
}

fn bench_compact(c: &mut Criterion) {
    let template = tempfile::tempdir().expect("tempdir");
    let cfg = SimConfig { sessions: 300, ..SimConfig::default() };
    let (mut payload, mut calls) = (0u64, 0u64);
    {
        let store = Store::open(template.path(), Options::default().durability(Durability::Buffered)).expect("open");
        for s in 0..cfg.sessions {
            let session = simulate_session(&cfg, s);
            for call in session.calls {
                payload += 4 * (call.prompt_token_ids.len() + 2 * call.completion_token_ids.len()) as u64;
                calls += 1;
                let _ = store.append(call).expect("append");
            }
            store.seal_session(&session.session_id).expect("seal");
        }
        store.close().expect("close");
    }
    let mut group = c.benchmark_group("compact");
    group.sample_size(10).measurement_time(Duration::from_secs(8)).warm_up_time(Duration::from_secs(1));
    for (name, compression) in [
        ("zstd1 (default)", ShardCompression::Zstd(1)),
        ("zstd3", ShardCompression::Zstd(3)),
        ("uncompressed", ShardCompression::Uncompressed),
    ] {
        group.throughput(Throughput::Bytes(payload));
        group.bench_function(format!("300 sessions × 8 calls, {name}"), |b| {
            b.iter_batched(
                || {
                    let dir = tempfile::tempdir().expect("tempdir");
                    copy_dir(template.path(), dir.path());
                    dir
                },
                |dir| {
                    let store = Store::open(dir.path(), Options::default()).expect("open");
                    let report = store.compact(&CompactOptions::default().compression(compression)).expect("compact");
                    assert_eq!(report.calls, calls);
                    dir
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench_compact);
criterion_main!(benches);
