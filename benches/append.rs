//! Append throughput (payload size × appends per flush × durability) and
//! session-read latency. Run: `cargo bench --bench append`.
//!
//! Throughput is reported in bytes of *offered token payload* (every prompt in
//! full + completion, as u32, + logprobs as f32) and in calls. Workloads come
//! from the fixed-seed simulator; setup (generating and renaming calls) stays
//! outside the timed loop.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::time::Duration;
use trajlog::{Call, Durability, Options, Store};
use trajlog_sim::{simulate, SimConfig};

fn payload_bytes(calls: &[Call]) -> u64 {
    calls.iter().map(|c| 4 * (c.prompt_token_ids.len() + 2 * c.completion_token_ids.len()) as u64).sum()
}

/// Calls of `sessions` rollouts in arrival order (turn by turn across sessions).
fn workload(sessions: usize, system_tokens: usize, completion: (usize, usize)) -> Vec<Call> {
    let cfg = SimConfig {
        sessions,
        steps: 8,
        system_tokens,
        completion_tokens: completion,
        tool_tokens: (completion.0 / 2, completion.1 / 2),
        ..SimConfig::default()
    };
    let batch = simulate(&cfg);
    (0..cfg.steps).flat_map(|step| batch.iter().filter_map(move |s| s.calls.get(step).cloned())).collect()
}

/// Copies of `calls` in sessions and traces of their own (setup, untimed), so
/// every iteration appends new sessions rather than replacing old calls.
fn renamed(calls: &[Call], round: u64) -> Vec<Call> {
    calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c.session_id = format!("{}#{round}", c.session_id);
            c.trace_id = format!("{}#{round}", c.trace_id);
            c
        })
        .collect()
}

fn bench_append(c: &mut Criterion) {
    let mut group = c.benchmark_group("append");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    // (name, system prompt tokens, completion tokens range): ~2k and ~8k-token prompts.
    let sizes = [("prompt~2k", 1000, (100, 300)), ("prompt~8k", 4000, (400, 1200))];
    for (size_name, system, completion) in sizes {
        let calls = workload(16, system, completion);
        for durability in [Durability::Buffered, Durability::Group, Durability::Sync] {
            for per_flush in [1usize, 128] {
                let dir = tempfile::tempdir().expect("tempdir");
                let store = Store::open(dir.path(), Options::default().durability(durability)).expect("open");
                let chunk: Vec<Call> = calls.iter().take(per_flush).cloned().collect();
                group.throughput(Throughput::Bytes(payload_bytes(&chunk)));
                let mut round = 0u64;
                let id = format!("{size_name}/{durability:?}/per_flush={per_flush}");
                group.bench_function(id, |b| {
                    b.iter_batched(
                        || {
                            round += 1;
                            renamed(&chunk, round)
                        },
                        |batch| {
                            for call in batch {
                                let _ = store.append(call).expect("append");
                            }
                            store.flush().expect("flush");
                        },
                        BatchSize::SmallInput,
                    )
                });
                drop(store);
            }
        }
    }
    group.finish();

    let mut calls_group = c.benchmark_group("append_calls");
    calls_group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let calls = workload(64, 1500, (200, 600));
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    calls_group.throughput(Throughput::Elements(calls.len() as u64));
    let mut round = 0u64;
    calls_group.bench_function("demo_batch_512_calls/group", |b| {
        b.iter_batched(
            || {
                round += 1;
                renamed(&calls, round)
            },
            |batch| {
                for call in batch {
                    let _ = store.append(call).expect("append");
                }
                store.flush().expect("flush");
            },
            BatchSize::SmallInput,
        )
    });
    calls_group.finish();
}

fn bench_read(c: &mut Criterion) {
    let mut group = c.benchmark_group("session_read");
    group.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let calls = workload(64, 1500, (200, 600));
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path(), Options::default()).expect("open");
    for call in calls.iter().cloned() {
        let _ = store.append(call).expect("append");
    }
    store.flush().expect("flush");
    let session = calls[0].session_id.clone();
    let one: Vec<&Call> = calls.iter().filter(|c| c.session_id == session).collect();
    let bytes: u64 = one.iter().map(|c| 4 * (c.prompt_token_ids.len() + 2 * c.completion_token_ids.len()) as u64).sum();
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("views (snapshot + index lookup + zero-copy slices)", |b| {
        b.iter(|| {
            let snap = store.snapshot();
            let views = snap.session(&session, None, None).expect("read");
            views.iter().map(|v| v.completion_token_ids().len() + v.prompt_suffix().len()).sum::<usize>()
        })
    });
    group.bench_function("views + materialized full prompts", |b| {
        b.iter(|| {
            let snap = store.snapshot();
            let views = snap.session(&session, None, None).expect("read");
            views.iter().map(|v| v.prompt().expect("prompt").len()).sum::<usize>()
        })
    });
    group.finish();

    // Every call of the store, in log order, as zero-copy views.
    let mut scan = c.benchmark_group("full_scan");
    scan.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let all: u64 = calls.iter().map(|c| 4 * (c.prompt_token_ids.len() + 2 * c.completion_token_ids.len()) as u64).sum();
    scan.throughput(Throughput::Bytes(all));
    scan.bench_function(format!("{} calls, zero-copy views", calls.len()), |b| {
        b.iter(|| {
            let snap = store.snapshot();
            let mut n = 0usize;
            snap.for_each_call(|v| {
                n += v.completion_token_ids().len() + v.prompt_suffix().len() + v.logprobs().map_or(0, <[f32]>::len);
                Ok(())
            })
            .expect("scan");
            n
        })
    });
    scan.finish();
}

criterion_group!(benches, bench_append, bench_read);
criterion_main!(benches);
