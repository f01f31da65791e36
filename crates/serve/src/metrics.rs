//! Counters for `GET /metrics`, in the Prometheus text format (0.0.4).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Upper bounds (ms) of the upstream latency histogram buckets.
pub const LATENCY_BUCKETS_MS: &[f64] =
    &[1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0];

#[derive(Default)]
pub struct Metrics {
    /// Proxied calls by outcome.
    pub calls_ok: AtomicU64,
    pub calls_upstream_status_error: AtomicU64,
    pub calls_upstream_failed: AtomicU64,
    pub calls_no_worker: AtomicU64,
    pub calls_client_gone: AtomicU64,
    /// Calls answered 503 without being forwarded: the store was being
    /// reopened after a failed write, so their traces could not be stored.
    pub calls_store_unavailable: AtomicU64,
    pub traces_stored: AtomicU64,
    pub traces_failed: AtomicU64,
    pub request_bytes: AtomicU64,
    pub response_bytes: AtomicU64,
    /// Calls sent again after a connection to a worker failed (nothing sent).
    pub upstream_connect_retries: AtomicU64,
    /// Traces handed to the store and not yet acknowledged.
    pub queue_depth: AtomicI64,
    /// Compactions run (periodic or asked for), by result; calls compacted.
    pub compactions_ok: AtomicU64,
    pub compactions_failed: AtomicU64,
    pub compacted_calls: AtomicU64,
    latency_buckets: [AtomicU64; 14],
    latency_count: AtomicU64,
    latency_sum_us: AtomicU64,
}

impl Metrics {
    pub fn observe_latency_ms(&self, ms: f64) {
        for (i, b) in LATENCY_BUCKETS_MS.iter().enumerate() {
            if ms <= *b {
                self.latency_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us.fetch_add((ms * 1000.0).max(0.0) as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let _ = writeln!(out, "# HELP trajlog_serve_calls_total Proxied agent calls by outcome.");
        let _ = writeln!(out, "# TYPE trajlog_serve_calls_total counter");
        for (outcome, v) in [
            ("ok", &self.calls_ok),
            ("upstream_status_error", &self.calls_upstream_status_error),
            ("upstream_failed", &self.calls_upstream_failed),
            ("no_worker", &self.calls_no_worker),
            ("client_gone", &self.calls_client_gone),
            ("store_unavailable", &self.calls_store_unavailable),
        ] {
            let _ = writeln!(out, "trajlog_serve_calls_total{{outcome=\"{outcome}\"}} {}", g(v));
        }
        let _ = writeln!(out, "# HELP trajlog_serve_traces_total Traces captured into the store, by result.");
        let _ = writeln!(out, "# TYPE trajlog_serve_traces_total counter");
        let _ = writeln!(out, "trajlog_serve_traces_total{{result=\"stored\"}} {}", g(&self.traces_stored));
        let _ = writeln!(out, "trajlog_serve_traces_total{{result=\"failed\"}} {}", g(&self.traces_failed));
        let _ = writeln!(out, "# HELP trajlog_serve_bytes_total Bytes forwarded upstream (request) and received from upstream (response).");
        let _ = writeln!(out, "# TYPE trajlog_serve_bytes_total counter");
        let _ = writeln!(out, "trajlog_serve_bytes_total{{direction=\"request\"}} {}", g(&self.request_bytes));
        let _ = writeln!(out, "trajlog_serve_bytes_total{{direction=\"response\"}} {}", g(&self.response_bytes));
        let _ = writeln!(
            out,
            "# HELP trajlog_serve_upstream_connect_retries_total Calls sent again after connecting to a worker failed."
        );
        let _ = writeln!(out, "# TYPE trajlog_serve_upstream_connect_retries_total counter");
        let _ = writeln!(out, "trajlog_serve_upstream_connect_retries_total {}", g(&self.upstream_connect_retries));
        let _ = writeln!(
            out,
            "# HELP trajlog_serve_compactions_total Compactions of the store (periodic or asked for), by result."
        );
        let _ = writeln!(out, "# TYPE trajlog_serve_compactions_total counter");
        let _ = writeln!(out, "trajlog_serve_compactions_total{{result=\"ok\"}} {}", g(&self.compactions_ok));
        let _ = writeln!(out, "trajlog_serve_compactions_total{{result=\"failed\"}} {}", g(&self.compactions_failed));
        let _ =
            writeln!(out, "# HELP trajlog_serve_compacted_calls_total Calls moved from the log into Parquet shards.");
        let _ = writeln!(out, "# TYPE trajlog_serve_compacted_calls_total counter");
        let _ = writeln!(out, "trajlog_serve_compacted_calls_total {}", g(&self.compacted_calls));
        let _ = writeln!(out, "# HELP trajlog_serve_queue_depth Traces handed to the store and not yet acknowledged.");
        let _ = writeln!(out, "# TYPE trajlog_serve_queue_depth gauge");
        let _ = writeln!(out, "trajlog_serve_queue_depth {}", self.queue_depth.load(Ordering::Relaxed));
        let _ =
            writeln!(out, "# HELP trajlog_serve_upstream_latency_ms Latency of proxied calls, routing to last byte.");
        let _ = writeln!(out, "# TYPE trajlog_serve_upstream_latency_ms histogram");
        for (i, b) in LATENCY_BUCKETS_MS.iter().enumerate() {
            let _ =
                writeln!(out, "trajlog_serve_upstream_latency_ms_bucket{{le=\"{b}\"}} {}", g(&self.latency_buckets[i]));
        }
        let count = g(&self.latency_count);
        let _ = writeln!(out, "trajlog_serve_upstream_latency_ms_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "trajlog_serve_upstream_latency_ms_sum {}", g(&self.latency_sum_us) as f64 / 1000.0);
        let _ = writeln!(out, "trajlog_serve_upstream_latency_ms_count {count}");
        out
    }
}

/// The store's lines of `GET /metrics`: whether it takes calls now (0 while
/// it is reopened after a failed write poisoned it) and how many reopens
/// succeeded.
pub fn store_lines(available: bool, reopens: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP trajlog_serve_store_available 1 while the store takes calls, 0 while it is reopened after a failed write.");
    let _ = writeln!(out, "# TYPE trajlog_serve_store_available gauge");
    let _ = writeln!(out, "trajlog_serve_store_available {}", u8::from(available));
    let _ = writeln!(
        out,
        "# HELP trajlog_serve_store_reopens_total Reopens of the store after a failed write poisoned it."
    );
    let _ = writeln!(out, "# TYPE trajlog_serve_store_reopens_total counter");
    let _ = writeln!(out, "trajlog_serve_store_reopens_total {reopens}");
    out
}
