//! `trajlog serve` and the hidden `trajlog mock-vllm`: thin adapters over
//! `trajlog-serve` (the gateway and its vLLM mock).

use std::path::PathBuf;
use trajlog_serve::config::{self, Settings, Source};
use trajlog_serve::{DurabilityMode, WorkerConfig};

pub(crate) struct ServeArgs {
    pub store: Option<String>,
    pub db_path: Option<String>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub workers: Vec<String>,
    pub config: Option<PathBuf>,
    pub durability: Option<String>,
    pub model: Option<String>,
    pub upstream_timeout_s: Option<f64>,
    pub upstream_connect_retries: Option<u32>,
    pub compact_every_s: Option<f64>,
    pub compact_older_than_s: Option<f64>,
    pub log_level: Option<String>,
    pub cumulative_token_mode: bool,
    pub renderer_family: Option<String>,
}

/// The config file, then rLLM's `RLLM_GATEWAY_*` variables, then the flags
/// (`--worker` replaces the file's workers, as in rLLM).
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

fn flag_settings(a: ServeArgs) -> Result<Settings, String> {
    let workers = (!a.workers.is_empty()).then(|| {
        a.workers
            .into_iter()
            .enumerate()
            .map(|(i, url)| WorkerConfig {
                url,
                worker_id: Some(i.to_string()),
                api_path: None,
                model_name: None,
                weight: None,
            })
            .collect()
    });
    let durability = a.durability.map(|d| d.parse::<DurabilityMode>().map_err(|e| format!("--durability: {e}")));
    Ok(Settings {
        store: a.store,
        db_path: a.db_path,
        host: a.host,
        port: a.port,
        workers,
        durability: durability.transpose()?,
        model: a.model,
        upstream_timeout_s: a.upstream_timeout_s,
        upstream_connect_retries: a.upstream_connect_retries,
        compact_every_s: a.compact_every_s,
        compact_older_than_s: a.compact_older_than_s,
        log_level: a.log_level,
        cumulative_token_mode: a.cumulative_token_mode.then_some(true),
        renderer_family: a.renderer_family,
        ..Settings::default()
    })
}

fn run_inner(a: ServeArgs) -> Result<(), String> {
    let mut layers = Vec::new();
    if let Some(path) = &a.config {
        layers.push((Source::File(path.clone()), Settings::from_file(path)?));
    }
    // A value that is not UTF-8 is passed on lossily, so that it is refused by name rather than ignored.
    let env = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
    layers.push((Source::Env, Settings::from_env(env)?));
    layers.push((Source::Flags, flag_settings(a)?));
    trajlog_serve::run_resolved(config::resolve(&layers)?)
}

pub(crate) fn mock(host: &str, port: u16) -> trajlog::Result<i32> {
    Ok(report("mock-vllm", trajlog_serve::run_mock_blocking(host, port)))
}
