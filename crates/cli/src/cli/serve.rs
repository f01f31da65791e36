//! `trajlog serve` and the hidden `trajlog mock-vllm`: thin adapters over
//! `trajlog-serve` (the gateway and its vLLM mock).

use std::path::PathBuf;
use trajlog_serve::{Config, DurabilityMode, WorkerConfig};

pub(crate) struct ServeArgs {
    pub store: Option<PathBuf>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub workers: Vec<String>,
    pub config: Option<PathBuf>,
    pub durability: Option<String>,
    pub model: Option<String>,
    pub upstream_timeout_s: Option<f64>,
    pub log_level: String,
}

/// Config file first, then the flags on top (`--worker` replaces the file's workers, as in rLLM).
pub(crate) fn run(a: ServeArgs) -> trajlog::Result<i32> {
    Ok(report("serve", run_inner(a)))
}

/// Errors of the gateway are text; print them like the other subcommands do (exit 2).
fn report(cmd: &str, r: Result<(), String>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("trajlog {cmd}: error: {e}");
            2
        }
    }
}

fn run_inner(a: ServeArgs) -> Result<(), String> {
    trajlog_serve::init_logging(&a.log_level)?;
    let mut c = match &a.config {
        Some(path) => Config::from_toml_file(path)?,
        None => Config::default(),
    };
    if let Some(s) = a.store {
        c.store = s;
    }
    if let Some(h) = a.host {
        c.host = h;
    }
    if let Some(p) = a.port {
        c.port = p;
    }
    if !a.workers.is_empty() {
        c.workers = a
            .workers
            .into_iter()
            .enumerate()
            .map(|(i, url)| WorkerConfig {
                url,
                worker_id: Some(i.to_string()),
                api_path: None,
                model_name: None,
                weight: None,
            })
            .collect();
    }
    if let Some(d) = a.durability {
        c.durability = d.parse::<DurabilityMode>()?;
    }
    if a.model.is_some() {
        c.model = a.model;
    }
    if a.upstream_timeout_s.is_some() {
        c.upstream_timeout_s = a.upstream_timeout_s;
    }
    trajlog_serve::run_blocking(c)
}

pub(crate) fn mock(host: &str, port: u16) -> trajlog::Result<i32> {
    Ok(report("mock-vllm", trajlog_serve::run_mock_blocking(host, port)))
}
