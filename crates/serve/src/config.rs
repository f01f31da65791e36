//! The gateway's configuration ([`Config`]) and the sources it is built from,
//! in rLLM's order of priority: a config file < the `RLLM_GATEWAY_*`
//! environment variables < command-line flags (rLLM's `_load_config`).
//!
//! Every source is a [`Settings`]: the same optional keys, which are
//! trajlog's own plus rLLM's `GatewayConfig` keys. A config file is YAML
//! (`.yaml`/`.yml`, rLLM's format) or TOML (`.toml`); unknown keys are
//! refused, naming the key. rLLM's keys are mapped where they mean the same
//! thing (`sync_traces` → [`DurabilityMode`], `health_check_interval` →
//! `health_check_interval_s`, `db_path` → the store directory), ignored with a
//! warning where ignoring is harmless (`store_worker`, `renderer_family`, a
//! `db_path` overridden by `store`), and refused where ignoring would mislead
//! (`cumulative_token_mode: true`, a `routing_policy`).
//!
//! # The store directory
//! trajlog always writes its own store, a directory. It is, by priority, the
//! `store` key/`--store DIR` or `db_path`/`--db-path`/`RLLM_GATEWAY_DB_PATH`
//! (two spellings of one setting: a higher source wins whichever it uses; in
//! one source `store` wins over `db_path`). rLLM's store kinds are accepted
//! where rLLM takes them (`--store`, `store_worker`, `RLLM_GATEWAY_STORE`; the
//! values `memory` and `sqlite`, so a directory literally named `memory` is
//! written `./memory`): with no directory given, `memory` runs on a temporary
//! store deleted when the gateway exits (rLLM's memory store keeps nothing
//! either), and `sqlite` on [`SQLITE_DEFAULT_STORE`] under the home directory
//! (rLLM's SQLite store defaults to `~/.rllm/gateway_traces.db`). With no
//! directory and no kind, starting is refused. A `db_path` that names an
//! existing file (an rLLM SQLite database) is refused.

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Connection attempts retried on another worker (or the same one after
/// [`UPSTREAM_RETRY_BACKOFF_MS`]) when connecting to a worker fails.
pub const DEFAULT_UPSTREAM_CONNECT_RETRIES: u32 = 2;
/// Most connection retries that can be configured.
pub const UPSTREAM_CONNECT_RETRIES_MAX: u32 = 16;
/// Pause before a connection retry goes back to the same worker (no other
/// healthy worker left), multiplied by the attempt number.
pub const UPSTREAM_RETRY_BACKOFF_MS: u64 = 50;
/// The store directory, under the home directory, for rLLM's `sqlite` store
/// kind when no directory is given.
pub const SQLITE_DEFAULT_STORE: &str = ".rllm/trajlog-gateway";

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
    /// or group commit. rLLM's `sync_traces: false`.
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

/// A worker as configured (`workers:` in the config file; rLLM's `WorkerConfig`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub url: String,
    /// Empty or absent: the worker's index in the list (as rLLM).
    pub worker_id: Option<String>,
    /// Absent: split from `url` (`http://h:8000/v1` → `http://h:8000` + `/v1`).
    pub api_path: Option<String>,
    pub model_name: Option<String>,
    pub weight: Option<i64>,
}

/// Everything `trajlog serve` is configured with. Field names follow rLLM's
/// `GatewayConfig` where they mean the same thing.
#[derive(Debug, Clone)]
pub struct Config {
    /// The trajlog store directory (created if absent).
    pub store: PathBuf,
    /// The store is a temporary one (rLLM's `memory` kind): removed when
    /// [`crate::run_blocking`] returns.
    pub store_is_temporary: bool,
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
    /// Retries of a call whose connection to a worker failed before any byte
    /// of the request was sent; never once the request may have reached it.
    pub upstream_connect_retries: u32,
    /// Largest agent request body accepted, in bytes.
    pub request_bytes_max: usize,
    /// Largest upstream (non-streaming) response body accepted, in bytes.
    pub response_bytes_max: usize,
    /// The store's queue budget (back-pressure beyond it), in bytes.
    pub store_queue_bytes: Option<u64>,
    /// `Options::zero_ahead_bytes` of the store (None: its default, 1 MiB;
    /// 0 on a copy-on-write file system).
    pub store_zero_ahead_bytes: Option<u64>,
    /// `Options::segment_bytes` of the store (None: its default, 64 MiB).
    pub store_segment_bytes: Option<u64>,
    /// Compact the store every this many seconds (None: only on `POST
    /// /admin/compact`). A gateway left running then keeps its disk and
    /// memory to what is not compacted yet.
    pub compact_every_s: Option<f64>,
    /// What the periodic compaction takes: None, sealed sessions; else
    /// sessions whose last call is older than this many seconds (sealed or
    /// not), as `trajlog compact --older-than`.
    pub compact_older_than_s: Option<f64>,
    /// error, warn, info, debug or trace.
    pub log_level: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            store: PathBuf::new(),
            store_is_temporary: false,
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
            upstream_connect_retries: DEFAULT_UPSTREAM_CONNECT_RETRIES,
            request_bytes_max: 64 << 20,
            response_bytes_max: 256 << 20,
            store_queue_bytes: None,
            store_zero_ahead_bytes: None,
            store_segment_bytes: None,
            compact_every_s: None,
            compact_older_than_s: None,
            log_level: "info".into(),
        }
    }
}

impl Config {
    pub(crate) fn upstream_timeout(&self) -> Option<Duration> {
        self.upstream_timeout_s.filter(|s| s.is_finite() && *s > 0.0).map(Duration::from_secs_f64)
    }
}

/// One source's settings: every key optional. The keys of a config file.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    // ---- keys of both trajlog and rLLM
    pub host: Option<String>,
    pub port: Option<u16>,
    pub workers: Option<Vec<WorkerConfig>>,
    pub model: Option<String>,
    pub add_logprobs: Option<bool>,
    pub add_return_token_ids: Option<bool>,
    pub strip_vllm_fields: Option<bool>,
    /// rLLM's `INFO`, `WARNING`, … are accepted too.
    pub log_level: Option<String>,
    // ---- trajlog's
    /// The store directory, or one of rLLM's store kinds (`memory`, `sqlite`).
    pub store: Option<String>,
    pub durability: Option<DurabilityMode>,
    pub health_check_interval_s: Option<f64>,
    pub upstream_timeout_s: Option<f64>,
    pub upstream_connect_retries: Option<u32>,
    pub request_bytes_max: Option<usize>,
    pub response_bytes_max: Option<usize>,
    pub store_queue_bytes: Option<u64>,
    pub store_zero_ahead_bytes: Option<u64>,
    pub store_segment_bytes: Option<u64>,
    pub compact_every_s: Option<f64>,
    pub compact_older_than_s: Option<f64>,
    // ---- rLLM's, mapped, ignored or refused (module docs)
    /// The store directory when `store` names none.
    pub db_path: Option<String>,
    /// `memory` or `sqlite`.
    pub store_worker: Option<String>,
    /// `durability`: true is sync, false async.
    pub sync_traces: Option<bool>,
    /// `health_check_interval_s`.
    pub health_check_interval: Option<f64>,
    /// Refused unless null or empty: custom routing is not supported.
    pub routing_policy: Option<String>,
    /// Refused when true: out of scope.
    pub cumulative_token_mode: Option<bool>,
    /// Ignored (only cumulative-token mode uses it), with a warning unless `auto`.
    pub renderer_family: Option<String>,
}

/// rLLM's environment variables and the key each sets.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("RLLM_GATEWAY_HOST", "host"),
    ("RLLM_GATEWAY_PORT", "port"),
    ("RLLM_GATEWAY_DB_PATH", "db_path"),
    ("RLLM_GATEWAY_LOG_LEVEL", "log_level"),
    ("RLLM_GATEWAY_STORE", "store_worker"),
];

impl Settings {
    /// Parse a config file's text as YAML; an empty document is no settings (PyYAML's `or {}`).
    pub fn from_yaml(text: &str) -> Result<Settings, String> {
        serde_norway::from_str::<Option<Settings>>(text).map(Option::unwrap_or_default).map_err(|e| e.to_string())
    }

    pub fn from_toml(text: &str) -> Result<Settings, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Read a config file: YAML for `.yaml`/`.yml`, TOML for `.toml`.
    pub fn from_file(path: &Path) -> Result<Settings, String> {
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        let parse: fn(&str) -> Result<Settings, String> = match ext.as_deref() {
            Some("yaml" | "yml") => Settings::from_yaml,
            Some("toml") => Settings::from_toml,
            _ => {
                return Err(format!(
                    "config {}: unknown format; name the file .yaml or .yml (rLLM's format) or .toml",
                    path.display()
                ))
            }
        };
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read config {}: {e}", path.display()))?;
        parse(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    /// rLLM's `RLLM_GATEWAY_*` variables ([`ENV_VARS`]), read through `var`.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        let port = match var("RLLM_GATEWAY_PORT") {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u16>()
                    .map_err(|_| format!("RLLM_GATEWAY_PORT: {v:?} is not a port number (0-65535)"))?,
            ),
        };
        Ok(Settings {
            host: var("RLLM_GATEWAY_HOST"),
            port,
            db_path: var("RLLM_GATEWAY_DB_PATH"),
            log_level: var("RLLM_GATEWAY_LOG_LEVEL"),
            store_worker: var("RLLM_GATEWAY_STORE"),
            ..Settings::default()
        })
    }
}

/// Where a [`Settings`] came from, to name a key in messages.
#[derive(Debug, Clone)]
pub enum Source {
    File(PathBuf),
    Env,
    Flags,
}

impl Source {
    /// How the user wrote `key` in this source.
    fn name(&self, key: &str) -> String {
        match self {
            Source::File(p) => format!("{key} (config {})", p.display()),
            Source::Env => {
                ENV_VARS.iter().find(|(_, k)| *k == key).map_or_else(|| key.to_owned(), |(v, _)| (*v).into())
            }
            Source::Flags => match key {
                "workers" => "--worker".into(),
                "upstream_timeout_s" => "--upstream-timeout".into(),
                "compact_every_s" => "--compact-every".into(),
                "compact_older_than_s" => "--compact-older-than".into(),
                _ => format!("--{}", key.replace('_', "-")),
            },
        }
    }
}

/// The configuration built from its sources, and what to warn about.
#[derive(Debug)]
pub struct Resolved {
    pub config: Config,
    /// Settings accepted and ignored, and defaults chosen for the user: log them.
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    Memory,
    Sqlite,
}

impl StoreKind {
    fn parse(s: &str) -> Option<StoreKind> {
        match s {
            "memory" => Some(StoreKind::Memory),
            "sqlite" => Some(StoreKind::Sqlite),
            _ => None,
        }
    }
}

/// A log level as trajlog takes it (`error`, `warn`, `info`, `debug`,
/// `trace`), from any case and Python's names (`WARNING`, `CRITICAL`).
pub fn normalize_log_level(level: &str) -> Option<&'static str> {
    match level.trim().to_ascii_lowercase().as_str() {
        "critical" | "fatal" | "error" => Some("error"),
        "warning" | "warn" => Some("warn"),
        "info" => Some("info"),
        "debug" => Some("debug"),
        "trace" => Some("trace"),
        _ => None,
    }
}

fn expand_home(p: &str) -> PathBuf {
    match (p.strip_prefix('~'), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => {
            PathBuf::from(home).join(rest.trim_start_matches('/'))
        }
        _ => PathBuf::from(p),
    }
}

fn positive_seconds(name: String, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{name}: {v} is not a positive number of seconds"))
    }
}

/// Build the configuration from `layers`, lowest priority first (file, env, flags).
pub fn resolve(layers: &[(Source, Settings)]) -> Result<Resolved, String> {
    let mut c = Config::default();
    let mut warnings = Vec::new();
    // (directory, how it was named) and (kind, how it was named), the highest source's.
    let mut dir: Option<(String, String)> = None;
    let mut kind: Option<(StoreKind, String)> = None;
    let mut db_paths: Vec<String> = Vec::new();
    for (src, s) in layers {
        let name = |k: &str| src.name(k);
        if s.cumulative_token_mode == Some(true) {
            return Err(format!(
                "{}: rLLM's cumulative-token mode (re-rendering prompts with chat-template renderers) is out of \
                 scope for trajlog serve, which records the token ids the inference server returned and flags \
                 TI/TO breaks (`trajlog audit`); remove it or set it to false",
                name("cumulative_token_mode")
            ));
        }
        if let Some(p) = s.routing_policy.as_deref().filter(|p| !p.is_empty()) {
            return Err(format!(
                "{}: custom routing policies ({p:?}, a Python class) are not supported; trajlog serve routes \
                 session-sticky and least-loaded; remove the key",
                name("routing_policy")
            ));
        }
        if let Some(r) = s.renderer_family.as_deref().filter(|r| *r != "auto") {
            warnings.push(format!("{}: {r:?} ignored (only cumulative-token mode uses it)", name("renderer_family")));
        }
        if let Some(v) = &s.host {
            c.host = v.clone();
        }
        if let Some(v) = s.port {
            c.port = v;
        }
        if let Some(ws) = &s.workers {
            if let Some(i) = ws.iter().position(|w| w.url.trim().is_empty()) {
                return Err(format!("{}: worker {i} has an empty url", name("workers")));
            }
            c.workers = ws.clone();
        }
        if let Some(v) = &s.model {
            c.model = Some(v.clone());
        }
        if let Some(v) = s.add_logprobs {
            c.add_logprobs = v;
        }
        if let Some(v) = s.add_return_token_ids {
            c.add_return_token_ids = v;
        }
        if let Some(v) = s.strip_vllm_fields {
            c.strip_vllm_fields = v;
        }
        if let Some(v) = &s.log_level {
            c.log_level = normalize_log_level(v)
                .ok_or_else(|| {
                    format!("{}: {v:?} is not one of error, warn(ing), info, debug, trace", name("log_level"))
                })?
                .to_owned();
        }
        match (s.durability, s.sync_traces) {
            (Some(d), Some(st)) if (d == DurabilityMode::Sync) != st => {
                let d = if d == DurabilityMode::Sync { "sync" } else { "async" };
                return Err(format!(
                    "{}: {st} contradicts {}: {d}; give one of them",
                    name("sync_traces"),
                    name("durability")
                ));
            }
            (Some(d), _) => c.durability = d,
            (None, Some(st)) => c.durability = if st { DurabilityMode::Sync } else { DurabilityMode::Async },
            (None, None) => {}
        }
        match (s.health_check_interval_s, s.health_check_interval) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!(
                    "{} and {} differ; give one of them",
                    name("health_check_interval_s"),
                    name("health_check_interval")
                ))
            }
            (Some(v), _) => c.health_check_interval_s = positive_seconds(name("health_check_interval_s"), v)?,
            (None, Some(v)) => c.health_check_interval_s = positive_seconds(name("health_check_interval"), v)?,
            (None, None) => {}
        }
        if let Some(v) = s.upstream_timeout_s {
            c.upstream_timeout_s = Some(positive_seconds(name("upstream_timeout_s"), v)?);
        }
        if let Some(v) = s.upstream_connect_retries {
            if v > UPSTREAM_CONNECT_RETRIES_MAX {
                return Err(format!(
                    "{}: {v} is over the limit of {UPSTREAM_CONNECT_RETRIES_MAX}",
                    name("upstream_connect_retries")
                ));
            }
            c.upstream_connect_retries = v;
        }
        for (key, v, slot) in [
            ("request_bytes_max", s.request_bytes_max, &mut c.request_bytes_max),
            ("response_bytes_max", s.response_bytes_max, &mut c.response_bytes_max),
        ] {
            if let Some(v) = v {
                if v == 0 {
                    return Err(format!("{}: must be at least 1 byte", name(key)));
                }
                *slot = v;
            }
        }
        if let Some(v) = s.store_queue_bytes {
            if v == 0 {
                return Err(format!("{}: must be at least 1 byte", name("store_queue_bytes")));
            }
            c.store_queue_bytes = Some(v);
        }
        if let Some(v) = s.store_zero_ahead_bytes {
            c.store_zero_ahead_bytes = Some(v);
        }
        if let Some(v) = s.store_segment_bytes {
            let min = trajlog::limits::SEGMENT_BYTES_MIN;
            if v < min {
                return Err(format!("{}: {v} is under the smallest segment, {min} bytes", name("store_segment_bytes")));
            }
            c.store_segment_bytes = Some(v);
        }
        if let Some(v) = s.compact_every_s {
            c.compact_every_s = Some(positive_seconds(name("compact_every_s"), v)?);
        }
        if let Some(v) = s.compact_older_than_s {
            if !v.is_finite() || v < 0.0 {
                return Err(format!(
                    "{}: {v} is not a finite, non-negative number of seconds",
                    name("compact_older_than_s")
                ));
            }
            c.compact_older_than_s = Some(v);
        }
        // The store: `store` is a directory or a kind; `store_worker` a kind; `db_path` a directory.
        let (store_dir, store_kind) = match s.store.as_deref() {
            None => (None, None),
            Some(v) => match StoreKind::parse(v) {
                Some(k) => (None, Some(k)),
                None if v.trim().is_empty() => return Err(format!("{}: an empty path", name("store"))),
                None => (Some(v.to_owned()), None),
            },
        };
        let worker_kind = match s.store_worker.as_deref() {
            None => None,
            Some(v) => Some(
                StoreKind::parse(v)
                    .ok_or_else(|| format!("{}: {v:?} is not one of memory, sqlite", name("store_worker")))?,
            ),
        };
        match (store_kind, worker_kind) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!("{} and {} disagree; give one of them", name("store"), name("store_worker")))
            }
            (Some(k), _) => kind = Some((k, name("store"))),
            (None, Some(k)) => kind = Some((k, name("store_worker"))),
            (None, None) => {}
        }
        if let Some(p) = &s.db_path {
            if p.trim().is_empty() {
                return Err(format!("{}: an empty path", name("db_path")));
            }
            db_paths.push(name("db_path"));
        }
        match (store_dir, &s.db_path) {
            (Some(d), _) => dir = Some((d, name("store"))),
            (None, Some(p)) => dir = Some((p.clone(), name("db_path"))),
            (None, None) => {}
        }
    }
    match dir {
        Some((d, from)) => {
            for n in db_paths.iter().filter(|n| **n != from) {
                warnings.push(format!("{n}: ignored; the store directory is {d} ({from})"));
            }
            let path = expand_home(&d);
            if path.is_file() {
                return Err(format!(
                    "{from}: {} is a file (an rLLM SQLite database?); a trajlog store is a directory: name a \
                     directory (created if absent), or migrate the database with `trajlog import-rllm-sqlite DB \
                     --store DIR`",
                    path.display()
                ));
            }
            if let Some((StoreKind::Memory, k)) = &kind {
                warnings.push(format!("{k}: memory ignored; the traces are kept in the store {}", path.display()));
            }
            c.store = path;
        }
        None => match kind {
            Some((StoreKind::Memory, k)) => {
                let nanos =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
                c.store = std::env::temp_dir().join(format!("trajlog-serve-{}-{nanos:x}", std::process::id()));
                c.store_is_temporary = true;
                warnings.push(format!(
                    "{k}: memory: the traces go to a temporary store {}, deleted when the gateway exits",
                    c.store.display()
                ));
            }
            Some((StoreKind::Sqlite, k)) => {
                let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).ok_or_else(|| {
                    format!("{k}: sqlite with no db_path stores under the home directory, and HOME is not set; give --db-path DIR")
                })?;
                c.store = PathBuf::from(home).join(SQLITE_DEFAULT_STORE);
                warnings.push(format!("{k}: sqlite with no db_path: the store defaults to {}", c.store.display()));
            }
            None => {
                return Err("store: a store directory is required: --store DIR (or --db-path DIR, `store` or \
                     `db_path` in the config file, RLLM_GATEWAY_DB_PATH); `--store memory` runs on a temporary \
                     store deleted on exit"
                    .into())
            }
        },
    }
    Ok(Resolved { config: c, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(f: impl FnOnce(&mut Settings)) -> (Source, Settings) {
        let mut s = Settings::default();
        f(&mut s);
        (Source::Flags, s)
    }

    fn yaml(text: &str) -> (Source, Settings) {
        (Source::File("gw.yaml".into()), Settings::from_yaml(text).expect("yaml parses"))
    }

    fn env(vars: &[(&str, &str)]) -> (Source, Settings) {
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned());
        (Source::Env, Settings::from_env(get).expect("env parses"))
    }

    /// rLLM's `GatewayConfig().model_dump()` with a worker, as `yaml.safe_dump` writes it.
    const RLLM_DUMP: &str = "add_logprobs: true
add_return_token_ids: true
cumulative_token_mode: false
db_path: /tmp/trajlog-config-test-store
health_check_interval: 2.5
host: 0.0.0.0
log_level: WARNING
model: null
port: 9191
renderer_family: auto
routing_policy: null
store_worker: sqlite
strip_vllm_fields: false
sync_traces: false
workers:
- api_path: /v1
  model_name: Qwen/Qwen2.5-7B-Instruct
  url: http://vllm-0:8000
  weight: 1
  worker_id: ''
";

    #[test]
    fn rllm_config_dump_maps_to_trajlog() {
        let r = resolve(&[yaml(RLLM_DUMP)]).expect("resolves");
        let c = &r.config;
        assert_eq!((c.host.as_str(), c.port), ("0.0.0.0", 9191));
        assert_eq!(c.store, PathBuf::from("/tmp/trajlog-config-test-store"));
        assert!(!c.store_is_temporary);
        assert_eq!(c.durability, DurabilityMode::Async, "sync_traces: false");
        assert_eq!(c.health_check_interval_s, 2.5);
        assert_eq!(c.log_level, "warn");
        assert!(!c.strip_vllm_fields);
        assert_eq!(c.workers.len(), 1);
        assert_eq!(c.workers[0].api_path.as_deref(), Some("/v1"));
        assert_eq!(c.workers[0].worker_id.as_deref(), Some(""));
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }

    #[test]
    fn rllm_readme_example() {
        let r = resolve(&[yaml(
            "host: \"0.0.0.0\"\nport: 9090\ndb_path: \"~/.rllm/gateway.db\"\n\nworkers:\n  - url: \"http://vllm-0:8000/v1\"\n    model_name: \"Qwen/Qwen2.5-7B-Instruct\"\n  - url: \"http://vllm-1:8000/v1\"\n",
        )])
        .expect("resolves");
        assert_eq!(r.config.workers.len(), 2);
        if let Some(home) = std::env::var_os("HOME") {
            assert_eq!(r.config.store, PathBuf::from(home).join(".rllm/gateway.db"), "~ expanded as rLLM does");
        }
    }

    #[test]
    fn priority_is_file_then_env_then_flags() {
        let file = yaml("port: 1000\nhost: a\nlog_level: debug\nstore: /s/file\n");
        let e = env(&[("RLLM_GATEWAY_PORT", "2000"), ("RLLM_GATEWAY_HOST", "b"), ("RLLM_GATEWAY_DB_PATH", "/s/env")]);
        let r = resolve(&[file.clone(), e.clone()]).expect("resolves");
        assert_eq!((r.config.port, r.config.host.as_str(), r.config.log_level.as_str()), (2000, "b", "debug"));
        assert_eq!(r.config.store, PathBuf::from("/s/env"), "env's db_path over the file's store");
        let r = resolve(&[
            file,
            e,
            flags(|s| {
                s.port = Some(3000);
                s.store = Some("/s/flag".into());
            }),
        ])
        .expect("resolves");
        assert_eq!((r.config.port, r.config.host.as_str()), (3000, "b"));
        assert_eq!(r.config.store, PathBuf::from("/s/flag"));
        assert!(
            r.warnings.iter().any(|w| w.contains("RLLM_GATEWAY_DB_PATH: ignored")),
            "an overridden db_path is reported: {:?}",
            r.warnings
        );
    }

    #[test]
    fn gateway_manager_flags() {
        // rLLM's GatewayManager: `--host 0.0.0.0 --port P --store memory [--db-path X] [--model M]`.
        let r = resolve(&[flags(|s| {
            s.store = Some("memory".into());
            s.model = Some("m".into());
        })])
        .expect("resolves");
        assert!(r.config.store_is_temporary);
        assert!(r.config.store.starts_with(std::env::temp_dir()));
        assert!(r.warnings.iter().any(|w| w.contains("temporary store")));
        let r = resolve(&[flags(|s| {
            s.store = Some("sqlite".into());
            s.db_path = Some("/data/traces".into());
        })])
        .expect("resolves");
        assert_eq!(r.config.store, PathBuf::from("/data/traces"));
        assert!(!r.config.store_is_temporary);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let r = resolve(&[flags(|s| s.store = Some("sqlite".into()))]);
        if std::env::var_os("HOME").is_some_and(|h| !h.is_empty()) {
            assert!(r.expect("resolves").config.store.ends_with(SQLITE_DEFAULT_STORE));
        }
    }

    #[test]
    fn a_store_is_required() {
        let e = resolve(&[yaml("port: 1\n")]).expect_err("no store");
        assert!(e.contains("--store DIR"), "{e}");
    }

    #[test]
    fn store_flag_wins_over_db_path_in_one_source() {
        let r = resolve(&[flags(|s| {
            s.store = Some("/a".into());
            s.db_path = Some("/b".into());
        })])
        .expect("resolves");
        assert_eq!(r.config.store, PathBuf::from("/a"));
        assert!(r.warnings.iter().any(|w| w.starts_with("--db-path: ignored")), "{:?}", r.warnings);
    }

    #[test]
    fn refusals_name_the_key() {
        let cases: &[(&str, &str)] = &[
            (
                "store: /s\ncumulative_token_mode: true\n",
                "cumulative_token_mode (config gw.yaml): rLLM's cumulative-token mode",
            ),
            ("store: /s\nrouting_policy: my.Policy\n", "routing_policy (config gw.yaml): custom routing"),
            ("store: /s\nlog_level: loud\n", "log_level (config gw.yaml): \"loud\""),
            ("store: /s\nstore_worker: redis\n", "store_worker (config gw.yaml): \"redis\""),
            ("store: /s\nsync_traces: true\ndurability: async\n", "contradicts"),
            ("store: /s\nhealth_check_interval: -1\n", "health_check_interval (config gw.yaml): -1"),
            ("store: /s\nupstream_connect_retries: 17\n", "over the limit of 16"),
            ("store: /s\nworkers:\n- url: ''\n", "worker 0 has an empty url"),
        ];
        for (text, want) in cases {
            let e = resolve(&[yaml(text)]).expect_err(text);
            assert!(e.contains(want), "{text:?}: {e}");
        }
        // Accepted: the values rLLM dumps by default.
        assert!(resolve(&[yaml("store: /s\ncumulative_token_mode: false\nrouting_policy: null\n")]).is_ok());
        let e = resolve(&[flags(|s| {
            s.store = Some("/s".into());
            s.cumulative_token_mode = Some(true);
        })])
        .expect_err("refused");
        assert!(e.starts_with("--cumulative-token-mode: "), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let e = Settings::from_yaml("store: /s\nbogus_key: 1\n").expect_err("unknown key");
        assert!(e.contains("bogus_key"), "{e}");
        let e = Settings::from_toml("store = \"/s\"\nbogus_key = 1\n").expect_err("unknown key");
        assert!(e.contains("bogus_key"), "{e}");
        let e = Settings::from_yaml("store: /s\nworkers:\n- url: http://h\n  colour: red\n").expect_err("unknown key");
        assert!(e.contains("colour"), "{e}");
        let e = Settings::from_yaml("port: 70000\n").expect_err("out of range");
        assert!(e.contains("port"), "{e}");
    }

    #[test]
    fn empty_yaml_is_no_settings() {
        assert!(Settings::from_yaml("").is_ok());
        assert!(Settings::from_yaml("# only a comment\n").is_ok());
    }

    #[test]
    fn env_errors_name_the_variable() {
        let e = Settings::from_env(|k| (k == "RLLM_GATEWAY_PORT").then(|| "nine".to_owned())).expect_err("bad port");
        assert!(e.starts_with("RLLM_GATEWAY_PORT: "), "{e}");
        let (src, s) = env(&[("RLLM_GATEWAY_STORE", "postgres"), ("RLLM_GATEWAY_DB_PATH", "/s")]);
        let e = resolve(&[(src, s)]).expect_err("bad store kind");
        assert!(e.starts_with("RLLM_GATEWAY_STORE: \"postgres\""), "{e}");
    }

    #[test]
    fn toml_keeps_working_and_takes_rllm_keys() {
        let s = Settings::from_toml(
            "store = \"/tmp/s\"\nport = 0\nsync_traces = true\nhealth_check_interval = 3.0\n[[workers]]\nurl = \"http://h:8000/v1\"\n",
        )
        .expect("parses");
        let c = resolve(&[(Source::File("gw.toml".into()), s)]).expect("resolves").config;
        assert_eq!(c.durability, DurabilityMode::Sync);
        assert_eq!(c.health_check_interval_s, 3.0);
        assert_eq!(c.workers[0].url, "http://h:8000/v1");
    }

    #[test]
    fn db_path_naming_a_file_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("gateway.db");
        std::fs::write(&db, b"SQLite format 3\0").expect("write");
        let e = resolve(&[flags(|s| s.db_path = Some(db.to_string_lossy().into_owned()))]).expect_err("a file");
        assert!(e.starts_with("--db-path: ") && e.contains("import-rllm-sqlite"), "{e}");
    }

    #[test]
    fn log_levels_like_python() {
        assert_eq!(normalize_log_level("INFO"), Some("info"));
        assert_eq!(normalize_log_level("WARNING"), Some("warn"));
        assert_eq!(normalize_log_level("critical"), Some("error"));
        assert_eq!(normalize_log_level("verbose"), None);
    }
}
