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
//! - [`config`] — [`Config`] and its sources (YAML/TOML file, `RLLM_GATEWAY_*`, flags).
//! - [`json`] — JSON objects kept in key order with verbatim values.
//! - [`capture`] — request injection, response sanitizing, trace records (pure).
//! - [`workers`] — the worker set and routing.
//! - `routes` (private) — the route table, its classifier and the OpenAPI document.
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
pub mod config;
pub mod json;
pub mod metrics;
pub mod mock;
mod routes;
mod server;
mod store_slot;
pub mod workers;

pub use config::{Config, DurabilityMode, Resolved, Settings, Source, WorkerConfig};
pub use server::{start, Server};

use std::path::PathBuf;

/// Log to stderr at `level` (error, warn, info, debug, trace, in any case;
/// Python's `WARNING` and `CRITICAL` too); once per process.
pub fn init_logging(level: &str) -> Result<(), String> {
    let level: tracing::Level = config::normalize_log_level(level)
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| format!("log level {level:?} is not one of error, warn, info, debug, trace"))?;
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

/// Removes a temporary store ([`Config::store_is_temporary`]) however the
/// gateway ends.
struct TemporaryStore(Option<PathBuf>);

impl Drop for TemporaryStore {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => tracing::info!(store = %dir.display(), "temporary store removed"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(store = %dir.display(), error = %e, "cannot remove the temporary store"),
            }
        }
    }
}

/// Run the gateway until SIGTERM or Ctrl-C, then drain in-flight calls and
/// flush the store (and remove it if it is temporary). Prints
/// `trajlog serve: listening on http://HOST:PORT` on stdout once it accepts
/// connections.
pub fn run_blocking(config: Config) -> Result<(), String> {
    let _temporary = TemporaryStore(config.store_is_temporary.then(|| config.store.clone()));
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

/// [`run_blocking`] for a configuration built by [`config::resolve`]: start
/// logging at its level, log its warnings, run.
pub fn run_resolved(resolved: Resolved) -> Result<(), String> {
    init_logging(&resolved.config.log_level)?;
    for w in &resolved.warnings {
        tracing::warn!("{w}");
    }
    run_blocking(resolved.config)
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
