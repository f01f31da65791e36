//! Subcommands of the `trajlog` binary: thin adapters over the library.

mod bench;
mod demo;
mod ingest;
mod inspect;
mod repair;
mod serve;
mod shards;

use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use trajlog::{Options, RecoveryMode, Store};
use trajlog_sim::Shape;

#[derive(Parser)]
#[command(name = "trajlog", version, about = "Exact, append-only trace store for RL training of LLM agents")]
struct Cli {
    /// What opening a store does about damage in its log: tolerate-torn-tail
    /// (cut an interrupted write; refuse damage), absolute (refuse anything
    /// `verify` would report; reads the whole store) or skip-corrupted (keep
    /// every valid record, leave damaged ones out). Every cut and skip is
    /// printed on stderr.
    #[arg(long, global = true, value_name = "MODE", default_value = "tolerate-torn-tail")]
    recovery: String,
    #[command(subcommand)]
    command: Command,
}

/// The `--recovery` mode, set once by [`main`].
static RECOVERY: OnceLock<RecoveryMode> = OnceLock::new();

fn recovery_mode() -> RecoveryMode {
    RECOVERY.get().copied().unwrap_or_default()
}

/// Open `dir` for writing with the `--recovery` mode, printing what recovery
/// did on stderr (stdout carries data).
pub(crate) fn open_store(dir: &Path, options: Options, cmd: &str) -> trajlog::Result<Store> {
    let store = Store::open(dir, options.recovery(recovery_mode()))?;
    print_recovery(&store, cmd);
    Ok(store)
}

/// Open `dir` read-only with the `--recovery` mode, printing what recovery
/// found on stderr.
pub(crate) fn open_read_only(dir: &Path, cmd: &str) -> trajlog::Result<Store> {
    let store = Store::open_read_only_with(dir, recovery_mode())?;
    print_recovery(&store, cmd);
    Ok(store)
}

fn print_recovery(store: &Store, cmd: &str) {
    let report = store.recovery_report();
    for e in &report.events {
        eprintln!("trajlog {cmd}: recovery: {e}");
    }
    if !report.is_clean() {
        eprintln!("trajlog {cmd}: {report}");
    }
}

#[derive(Subcommand)]
enum Command {
    /// Simulate a batch of multi-turn agent rollouts, capture them, read them back exactly, report.
    Demo {
        /// Store directory (must be empty or absent); default: a new temporary directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Number of sessions (rollouts) to simulate.
        #[arg(long, default_value_t = 64)]
        sessions: usize,
        /// Calls (turns) per session.
        #[arg(long, default_value_t = 8)]
        steps: usize,
        /// What each call carries besides its tokens: gateway (the rLLM gateway's
        /// record of a non-streaming chat call: chat history with tool calls,
        /// raw request, vLLM's raw response), gateway-streaming (the same with
        /// raw_response null) or lean (one-line messages, no raw bodies).
        #[arg(long, default_value = "gateway", value_name = "SHAPE")]
        shape: Shape,
    },
    /// Read JSON traces (one per line) from stdin; print {"ack":"<trace_id>"} once each is durable.
    Ingest {
        #[arg(long)]
        store: PathBuf,
        /// buffered | group | sync
        #[arg(long, default_value = "group")]
        durability: String,
        /// Seal and roll segments at this size (bytes).
        #[arg(long, default_value_t = trajlog::limits::DEFAULT_SEGMENT_BYTES)]
        segment_bytes: u64,
        /// Keep this many bytes past the last record of the active segment
        /// written with zeros after each fsync, so the next records overwrite
        /// allocated blocks (default 1 MiB; 0 on a copy-on-write file system
        /// such as btrfs or ZFS).
        #[arg(long, value_name = "BYTES")]
        zero_ahead_bytes: Option<u64>,
    },
    /// Print calls as JSON lines in the rLLM gateway trace shape, oldest first per session.
    Export {
        #[arg(long)]
        store: PathBuf,
        /// Only this session.
        #[arg(long)]
        session: Option<String>,
    },
    /// List sessions with call counts and time range.
    Ls {
        #[arg(long)]
        store: PathBuf,
    },
    /// Where the store's bytes are and what keeps them: per segment, the
    /// frames of live calls, of compacted calls waiting for retirement, of
    /// dead calls and of annotations, and the sessions whose live calls keep
    /// it; per shard, live and dead rows; the live data against the disk.
    Space {
        #[arg(long)]
        store: PathBuf,
        /// One JSON document instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Show one session call by call: tokens, and how each prompt relates to its parent.
    Show {
        #[arg(long)]
        store: PathBuf,
        session: String,
    },
    /// Check every byte of the store: the MANIFEST, every segment frame's CRC,
    /// footers, parent links, shards, unlisted files. Exit 0 intact, 1 damaged,
    /// 3 only a torn tail (an interrupted write the next writable open cuts off).
    Verify {
        #[arg(long)]
        store: PathBuf,
    },
    /// Rebuild a lost, damaged or outdated MANIFEST from the segment and shard
    /// files in the directory (files that cannot belong move to DIR/lost+found/;
    /// no data is deleted, only the backlog index cache; the old MANIFEST is
    /// kept beside it).
    Repair {
        #[arg(long)]
        store: PathBuf,
        /// Only report what would be done.
        #[arg(long)]
        dry_run: bool,
    },
    /// Turn finished sessions into Parquet shards (DIR/shards/{steps,trajectories}) and retire their segments.
    Compact {
        #[arg(long)]
        store: PathBuf,
        /// Compact sealed sessions (the default).
        #[arg(long, conflicts_with = "older_than")]
        sealed_only: bool,
        /// Compact sessions whose last call is older than this many seconds.
        #[arg(long, value_name = "SECONDS")]
        older_than: Option<f64>,
        /// Close a shard file past this many bytes (uncompressed estimate).
        #[arg(long, default_value_t = trajlog::limits::DEFAULT_SHARD_BYTES)]
        shard_bytes: usize,
        /// Rows per `steps` row group, at most (trajectories get a 64th,
        /// at least 1).
        #[arg(long, default_value_t = trajlog::limits::DEFAULT_STEPS_ROW_GROUP_ROWS)]
        row_group_rows: usize,
        /// Close a row group of either table past this many bytes
        /// (uncompressed estimate), whatever its rows.
        #[arg(long, default_value_t = trajlog::limits::DEFAULT_ROW_GROUP_BYTES)]
        row_group_bytes: usize,
        /// A `trajectories` row group is closed at its rows only once it
        /// holds this many bytes (uncompressed estimate; at most 4096 rows
        /// whatever its bytes); 0: rows alone close it.
        #[arg(long, value_name = "BYTES", default_value_t = trajlog::limits::DEFAULT_TRAJECTORIES_ROW_GROUP_MIN_BYTES)]
        trajectories_min_group_bytes: usize,
        /// zstd | zstd:LEVEL | none
        #[arg(long, default_value = "zstd")]
        compression: String,
        /// Rewrite an earlier compaction's shards, keeping their live rows,
        /// once this fraction of its rows is dead (deleted or replaced
        /// calls); 0: any dead row. A compaction with no live row left is
        /// dropped whatever the fraction.
        #[arg(long, value_name = "FRACTION", default_value_t = trajlog::DEFAULT_COLLECT_DEAD_FRACTION, conflicts_with = "no_collect")]
        collect_dead: f64,
        /// Never rewrite earlier shards (dead rows keep their space).
        #[arg(long)]
        no_collect: bool,
        /// Merge earlier compactions' shards once this many are in one size
        /// tier (each tier ×N the rows of the one below), so the number of
        /// shard files grows with the log of the rows, not with the number
        /// of compactions. At least 2.
        #[arg(long, value_name = "N", default_value_t = trajlog::DEFAULT_MERGE_FANOUT, conflicts_with = "no_merge")]
        merge_fanout: u32,
        /// Never merge earlier shards (one more set of files per compaction).
        #[arg(long)]
        no_merge: bool,
        /// Copy unfinished sessions (stragglers) forward out of a segment
        /// they alone keep on disk, when their live calls there take at
        /// most this fraction of its bytes, so that it is freed (at most
        /// a quarter segment of copies per compaction). At most 0.5.
        #[arg(long, value_name = "FRACTION", default_value_t = trajlog::DEFAULT_COPY_FORWARD, conflicts_with = "no_copy_forward")]
        copy_forward: f64,
        /// Never copy sessions forward (a straggler keeps its segments).
        #[arg(long)]
        no_copy_forward: bool,
        /// Compact in batches of about this many calls (whole sessions,
        /// oldest first, with what collection and merging write again), one
        /// compaction after another until none is left, each printing its
        /// line: a large backlog then peaks lower in memory than in one
        /// compaction (what a compaction builds grows with what it writes),
        /// but takes longer (each batch rewrites the shard index file).
        /// A backlog under the default is one compaction.
        #[arg(long, value_name = "CALLS", default_value_t = trajlog::DEFAULT_BATCH_CALLS, value_parser = clap::value_parser!(u64).range(1..))]
        batch_calls: u64,
        /// Compact everything selected in one compaction, whatever its size
        /// (faster for a large backlog, and its peak memory grows with it;
        /// collection and merging still write at most 1,048,576 calls
        /// again).
        #[arg(long, conflicts_with = "batch_calls")]
        no_batches: bool,
    },
    /// Fill a store with simulated multi-turn rollouts (sealed), streaming one session at a time.
    Generate {
        #[arg(long)]
        store: PathBuf,
        #[arg(long, default_value_t = 1000)]
        sessions: usize,
        #[arg(long, default_value_t = 8)]
        steps: usize,
        /// Tokens of each task's first prompt.
        #[arg(long, default_value_t = 1500)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// What each call carries besides its tokens: gateway (the rLLM gateway's
        /// record of a non-streaming chat call: chat history with tool calls,
        /// raw request, vLLM's raw response), gateway-streaming (the same with
        /// raw_response null) or lean (one-line messages, no raw bodies).
        #[arg(long, default_value = "gateway", value_name = "SHAPE")]
        shape: Shape,
        /// Number of the first session (session ids follow from it): to add
        /// new sessions to a store generated before, start past its last one.
        #[arg(long, default_value_t = 0)]
        first_session: usize,
        /// Mean tokens of a completion (each is drawn from half to 1.5 times
        /// it; default 200 to 600). Small values make tiny calls, for stores
        /// of millions of calls where what grows is the index, not the payload.
        #[arg(long, value_name = "N")]
        completion_tokens: Option<usize>,
        /// Mean tokens of a tool result or user turn added to the next prompt
        /// (drawn from half to 1.5 times it; default 100 to 400).
        #[arg(long, value_name = "N")]
        tool_tokens: Option<usize>,
        /// Set a session reward on each session before sealing it, as a
        /// trainer scores each rollout (1 for odd session numbers, else 0).
        #[arg(long)]
        rewards: bool,
    },
    /// Run one multi-turn agent workload against trajlog and two SQLite baselines; print one table.
    Bench {
        #[arg(long, default_value_t = 256)]
        sessions: usize,
        #[arg(long, default_value_t = 8)]
        steps: usize,
        /// Tokens of each session's first prompt (later prompts grow turn by turn).
        #[arg(long, default_value_t = 1500)]
        prompt_tokens: usize,
        /// Mean completion length in tokens.
        #[arg(long, default_value_t = 400)]
        completion_tokens: usize,
        /// trajlog's durability: buffered | group | sync
        #[arg(long, default_value = "group")]
        durability: String,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Where to put the three stores (removed after); default: the temp directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
        /// What each call carries besides its tokens: gateway (the rLLM gateway's
        /// record of a non-streaming chat call: chat history with tool calls,
        /// raw request, vLLM's raw response), gateway-streaming (the same with
        /// raw_response null) or lean (one-line messages, no raw bodies).
        #[arg(long, default_value = "gateway", value_name = "SHAPE")]
        shape: Shape,
    },
    /// Measure the capture gateway: trajlog serve (and rLLM's gateway) in front of a mock inference server, beside calling the mock directly.
    BenchGateway(crate::bench_gateway::Args),
    /// Migrate an rLLM SQLite trace database (gateway or older SDK schema) into a store, exactly.
    ImportRllmSqlite {
        /// The rLLM database file (opened read-only).
        db: PathBuf,
        #[arg(long)]
        store: PathBuf,
        /// gateway | sdk; default: told from the `traces` table.
        #[arg(long)]
        schema: Option<String>,
        /// Skip reading every imported trace back and comparing it with its row.
        #[arg(long)]
        no_verify: bool,
    },
    /// Check every session for TI/TO breaks; --strict exits 1 if there is any.
    Audit {
        #[arg(long)]
        store: PathBuf,
        #[arg(long)]
        json: bool,
        #[arg(long)]
        strict: bool,
    },
    /// Run the capture gateway (rLLM model gateway compatible) in front of inference workers.
    ///
    /// Settings come from the config file, then rLLM's RLLM_GATEWAY_HOST, _PORT, _DB_PATH,
    /// _LOG_LEVEL and _STORE environment variables, then these flags (each overrides the one before).
    Serve {
        /// Store directory (created if absent); or rLLM's store kind: `memory` (a temporary store,
        /// deleted on exit, unless a directory is given) or `sqlite` (the store is --db-path).
        #[arg(long, value_name = "DIR|memory|sqlite")]
        store: Option<String>,
        /// The store directory when --store names none (rLLM's --db-path; here a directory, not a SQLite file).
        #[arg(long, value_name = "DIR")]
        db_path: Option<String>,
        /// Bind address [default: 127.0.0.1, or the config file's].
        #[arg(long)]
        host: Option<String>,
        /// Port; 0 picks a free one [default: 9090, or the config file's].
        #[arg(long)]
        port: Option<u16>,
        /// Inference worker URL, e.g. http://127.0.0.1:8000/v1 (repeatable; replaces the config file's workers).
        #[arg(long = "worker", value_name = "URL")]
        workers: Vec<String>,
        /// Config file: rLLM's YAML (.yaml, .yml) or TOML (.toml); see docs/serve.md.
        #[arg(long)]
        config: Option<PathBuf>,
        /// sync: answer after the trace is durable; async: answer at once, durable on the next flush [default: sync].
        #[arg(long, value_name = "sync|async")]
        durability: Option<String>,
        /// Pin the model name on every agent request.
        #[arg(long)]
        model: Option<String>,
        /// Upstream timeout in seconds (headers, then each body read); default: none.
        #[arg(long, value_name = "SECONDS")]
        upstream_timeout: Option<f64>,
        /// Retries of a call whose connection to a worker failed (nothing sent yet) [default: 2].
        #[arg(long, value_name = "N")]
        upstream_connect_retries: Option<u32>,
        /// Compact the store every SECONDS (sealed sessions, or those of --compact-older-than); default: only on POST /admin/compact.
        #[arg(long, value_name = "SECONDS")]
        compact_every: Option<f64>,
        /// With --compact-every: compact sessions whose last call is older than SECONDS, sealed or not [default: sealed sessions only].
        #[arg(long, value_name = "SECONDS")]
        compact_older_than: Option<f64>,
        /// error | warn | info | debug | trace, any case (logs go to stderr) [default: info].
        #[arg(long)]
        log_level: Option<String>,
        /// rLLM's cumulative-token mode: out of scope, refused with an explanation.
        #[arg(long, hide = true)]
        cumulative_token_mode: bool,
        /// rLLM's renderer family (cumulative-token mode only): accepted and ignored.
        #[arg(long, hide = true)]
        renderer_family: Option<String>,
    },
    /// A deterministic vLLM-shaped mock inference server (tests and benchmarks).
    #[command(hide = true)]
    MockVllm {
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
}

/// Run the CLI; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    match cli.recovery.parse::<RecoveryMode>() {
        Ok(mode) => {
            let _ = RECOVERY.set(mode);
        }
        Err(e) => {
            eprintln!("trajlog: error: --recovery: {e}");
            return 2;
        }
    }
    let result = match cli.command {
        Command::Demo { dir, sessions, steps, shape } => demo::run(dir, sessions, steps, shape),
        Command::Ingest { store, durability, segment_bytes, zero_ahead_bytes } => {
            ingest::run(&store, &durability, segment_bytes, zero_ahead_bytes)
        }
        Command::Export { store, session } => inspect::export(&store, session.as_deref()),
        Command::Ls { store } => inspect::ls(&store),
        Command::Show { store, session } => inspect::show(&store, &session),
        Command::Space { store, json } => inspect::space(&store, json),
        Command::Verify { store } => repair::verify(&store),
        Command::Repair { store, dry_run } => repair::repair(&store, dry_run),
        Command::Compact {
            store,
            sealed_only: _,
            older_than,
            shard_bytes,
            row_group_rows,
            row_group_bytes,
            trajectories_min_group_bytes,
            compression,
            collect_dead,
            no_collect,
            merge_fanout,
            no_merge,
            copy_forward,
            no_copy_forward,
            batch_calls,
            no_batches,
        } => shards::compact(
            &store,
            &shards::CompactArgs {
                older_than,
                shard_bytes,
                row_group_rows,
                row_group_bytes,
                trajectories_min_group_bytes,
                compression,
                collect_dead: (!no_collect).then_some(collect_dead),
                merge_fanout: (!no_merge).then_some(merge_fanout),
                copy_forward: (!no_copy_forward).then_some(copy_forward),
                batch_calls: (!no_batches).then_some(batch_calls),
            },
        ),
        Command::Bench { sessions, steps, prompt_tokens, completion_tokens, durability, seed, dir, json, shape } => {
            bench::run(&bench::BenchArgs {
                sessions,
                steps,
                prompt_tokens,
                completion_tokens,
                durability,
                seed,
                dir,
                json,
                shape,
            })
        }
        Command::ImportRllmSqlite { db, store, schema, no_verify } => {
            ingest::import_rllm_sqlite(&db, &store, schema.as_deref(), !no_verify)
        }
        Command::Audit { store, json, strict } => shards::audit(&store, json, strict),
        Command::Serve {
            store,
            db_path,
            host,
            port,
            workers,
            config,
            durability,
            model,
            upstream_timeout,
            upstream_connect_retries,
            compact_every,
            compact_older_than,
            log_level,
            cumulative_token_mode,
            renderer_family,
        } => serve::run(serve::ServeArgs {
            store,
            db_path,
            host,
            port,
            workers,
            config,
            durability,
            model,
            upstream_timeout_s: upstream_timeout,
            upstream_connect_retries,
            compact_every_s: compact_every,
            compact_older_than_s: compact_older_than,
            log_level,
            cumulative_token_mode,
            renderer_family,
        }),
        Command::BenchGateway(args) => crate::bench_gateway::run(&args),
        Command::MockVllm { host, port } => serve::mock(&host, port),
        Command::Generate {
            store,
            sessions,
            steps,
            prompt_tokens,
            seed,
            shape,
            first_session,
            completion_tokens,
            tool_tokens,
            rewards,
        } => demo::generate(
            &store,
            first_session..first_session.saturating_add(sessions),
            demo::GenerateShape { steps, prompt_tokens, completion_tokens, tool_tokens, shape, rewards },
            seed,
        ),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("trajlog: error: {e}");
            2
        }
    }
}

/// Human-readable byte count.
pub(crate) fn human_bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} MB", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1} kB", n / 1e3)
    } else {
        format!("{n} B")
    }
}
