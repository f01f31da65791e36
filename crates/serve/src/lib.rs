//! `trajlog serve`: a capture gateway in front of OpenAI-compatible inference
//! servers (vLLM), API-compatible with rLLM's `rllm-model-gateway`
//! (`docs/serve-contract.md` is the study of that contract; `docs/serve.md`
//! the user page).
//!
//! Agents call `/sessions/{sid}/v1/chat/completions` (or `/completions`) as
//! they would call vLLM; the gateway injects `logprobs` and
//! `return_token_ids`, forwards the call to a worker (session-sticky,
//! least-loaded), strips vLLM-only fields from what the agent receives, and
//! captures the call — prompt and completion token ids, logprobs, messages,
//! the raw request and response — as one trace of rLLM's gateway shape in a
//! [`trajlog::Store`]. A trainer reads the traces back through the same HTTP
//! API as rLLM's gateway (`GatewayClient` works unchanged).
//!
//! # Modules
//! - [`json`] — JSON objects kept in key order with verbatim values.
//! - [`capture`] — request injection, response sanitizing, trace records (pure).
//! - [`workers`] — the worker set and routing.
//! - `server` (private) — the HTTP handlers, the store bridge, streaming.
//! - [`metrics`] — `/metrics`.
//! - [`mock`] — a deterministic vLLM-shaped mock server for tests and benchmarks.
//!
//! # Invariants
//! - The store's blocking calls never run on a tokio worker thread: they go
//!   through `spawn_blocking`.
//! - A call is acknowledged to the agent (response sent, or the final
//!   `data: [DONE]` of a stream) only after its trace was handed to the store,
//!   and, with [`DurabilityMode::Sync`], after it is durable. So a
//!   `POST /admin/flush` issued after a response covers that response's trace.
//! - A call whose upstream failed (transport error, timeout, non-2xx status,
//!   a stream cut short, a client that went away) records nothing.

pub mod capture;
pub mod json;
pub mod metrics;
pub mod mock;
mod server;
pub mod workers;

pub use server::{start, Server};

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// When the agent gets its answer, relative to the trace's durability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityMode {
    /// The response returns after the trace is durable (group commit shared
    /// by concurrent calls). rLLM's `sync_traces: true`, for streams too.
    #[default]
    Sync,
    /// The response returns once the store has the trace (back-pressure when
    /// its queue is full); it is durable after the next `POST /admin/flush`
    /// or group commit.
    Async,
}

impl std::str::FromStr for DurabilityMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sync" => Ok(Self::Sync),
            "async" => Ok(Self::Async),
            _ => Err(format!("durability {s:?} is not one of sync, async")),
        }
    }
}

/// A worker as configured (`[[workers]]` in the config file).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub url: String,
    pub worker_id: Option<String>,
    pub api_path: Option<String>,
    pub model_name: Option<String>,
    pub weight: Option<i64>,
}

/// Everything `trajlog serve` is configured with. Field names follow rLLM's
/// `GatewayConfig` where they mean the same thing.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The trajlog store directory (created if absent).
    pub store: PathBuf,
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    pub workers: Vec<WorkerConfig>,
    pub durability: DurabilityMode,
    /// Inject `logprobs: true` when the agent did not send the key.
    pub add_logprobs: bool,
    /// Inject `return_token_ids: true` when absent (off for non-vLLM upstreams).
    pub add_return_token_ids: bool,
    /// Remove vLLM-only fields from what the agent receives.
    pub strip_vllm_fields: bool,
    /// Pin `model` on every agent POST.
    pub model: Option<String>,
    /// Seconds between worker health checks.
    pub health_check_interval_s: f64,
    /// Upstream timeout in seconds: for the response headers and then for
    /// each read of the body (a stream may run longer in total). None = wait forever, as rLLM.
    pub upstream_timeout_s: Option<f64>,
    /// Largest agent request body accepted, in bytes.
    pub request_bytes_max: usize,
    /// Largest upstream (non-streaming) response body accepted, in bytes.
    pub response_bytes_max: usize,
    /// The store's queue budget (back-pressure beyond it), in bytes.
    pub store_queue_bytes: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            store: PathBuf::new(),
            host: "127.0.0.1".into(),
            port: 9090,
            workers: Vec::new(),
            durability: DurabilityMode::Sync,
            add_logprobs: true,
            add_return_token_ids: true,
            strip_vllm_fields: true,
            model: None,
            health_check_interval_s: 10.0,
            upstream_timeout_s: None,
            request_bytes_max: 64 << 20,
            response_bytes_max: 256 << 20,
            store_queue_bytes: None,
        }
    }
}

impl Config {
    /// Read a TOML config file (keys: the fields of [`Config`]; unknown keys are refused).
    pub fn from_toml_file(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read config {}: {e}", path.display()))?;
        Config::from_toml(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    pub fn from_toml(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    pub(crate) fn upstream_timeout(&self) -> Option<Duration> {
        self.upstream_timeout_s.filter(|s| s.is_finite() && *s > 0.0).map(Duration::from_secs_f64)
    }
}

/// Log to stderr at `level` (error, warn, info, debug, trace); once per process.
pub fn init_logging(level: &str) -> Result<(), String> {
    let level: tracing::Level =
        level.parse().map_err(|_| format!("log level {level:?} is not one of error, warn, info, debug, trace"))?;
    let _ = tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(level).with_ansi(false).try_init();
    Ok(())
}

async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

fn announce(addr: std::net::SocketAddr, what: &str) -> Result<(), String> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{what}: listening on http://{addr}").and_then(|()| out.flush()).map_err(|e| format!("stdout: {e}"))
}

/// Run the gateway until SIGTERM or Ctrl-C, then drain in-flight calls and
/// flush the store. Prints `trajlog serve: listening on http://HOST:PORT`
/// on stdout once it accepts connections.
pub fn run_blocking(config: Config) -> Result<(), String> {
    runtime()?.block_on(async move {
        let mut server = start(config).await?;
        announce(server.addr, "trajlog serve")?;
        let trigger = server.shutdown_trigger();
        tokio::select! {
            r = server_wait(&mut server) => return r,
            _ = terminated() => {}
        }
        tracing::info!("shutting down: draining in-flight calls");
        if let Some(t) = trigger {
            let _ = t.send(());
        }
        server.wait().await
    })
}

async fn server_wait(server: &mut Server) -> Result<(), String> {
    server.wait_ref().await
}

/// Run the mock vLLM server until SIGTERM or Ctrl-C (`trajlog mock-vllm`).
pub fn run_mock_blocking(host: &str, port: u16) -> Result<(), String> {
    runtime()?.block_on(async move {
        let m = mock::start_mock(host, port).await.map_err(|e| format!("cannot listen on {host}:{port}: {e}"))?;
        announce(m.addr, "trajlog mock-vllm")?;
        terminated().await;
        Ok(())
    })
}
