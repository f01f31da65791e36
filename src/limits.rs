//! Named limits. Every input is checked against these at the boundary, before
//! anything is written (TIGER_STYLE: put a limit on everything).
//!
//! They are part of the format contract (format-spec/record.md §5): a reader may
//! reject a record that exceeds them as corrupt.

/// Prompt tokens per call (`prompt_token_ids.len()`).
pub const PROMPT_TOKENS_MAX: u64 = 4 * 1024 * 1024;
/// Completion tokens per call (`completion_token_ids.len()`).
pub const COMPLETION_TOKENS_MAX: u64 = 1024 * 1024;
/// Bytes of JSON per call: `messages` + `response_message` + `metadata` + `extra`.
pub const JSON_BYTES_PER_CALL_MAX: u64 = 64 * 1024 * 1024;
/// Bytes of the opaque `routing_matrices` blob per call.
pub const ROUTING_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// Bytes of a trace id or a session id / session uid (UTF-8).
pub const ID_BYTES_MAX: u64 = 512;
/// Extra `session_uids` per call (besides `session_id`).
pub const SESSION_UIDS_MAX: u64 = 64;
/// Bytes of `model` and of `finish_reason`.
pub const SHORT_STRING_BYTES_MAX: u64 = 1024;
/// Bytes of one framed record on disk (everything above fits well inside it).
pub const RECORD_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// Recent calls of a session considered when choosing a prefix-delta parent.
pub const DELTA_LOOKBACK_CALLS: usize = 8;
/// The most ancestors a call's `messages` may reach through messages deltas
/// (references 6 and 7, format-spec/record.md §7.2): a writer stores a call's
/// messages in full when its parent's chain is this deep, and a reader
/// refuses a longer chain as corrupt. So reading one call's documents
/// resolves at most this many ancestors' messages.
pub const MESSAGES_DELTA_DEPTH_MAX: u32 = 8;
/// A prompt is stored whole (a checkpoint, format-spec/record.md §4) at
/// least every this many records of a prefix-delta chain, so rebuilding one
/// prompt reads at most this many records.
pub const PROMPT_CHAIN_MAX: u32 = 256;
/// Smallest allowed segment size.
pub const SEGMENT_BYTES_MIN: u64 = 64 * 1024;
/// Default segment size at which the writer seals and rolls to a new segment.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
/// Default number of records (calls and annotations) in flight between
/// appenders and the writer thread; past it, appenders wait (back-pressure).
pub const DEFAULT_QUEUE_DEPTH: usize = 4096;
/// Default bytes of records in flight between appenders and the writer thread
/// (their token columns, documents and blobs); past it, appenders wait. A
/// record larger than the budget is taken alone, when nothing else is in flight.
pub const DEFAULT_QUEUE_BYTES: u64 = 64 * 1024 * 1024;
/// Default group-commit interval for `Durability::Group`.
pub const DEFAULT_GROUP_COMMIT_MS: u64 = 5;
/// Default memory the writer spends remembering recent session contexts for
/// prefix-delta encoding; least recently used sessions are forgotten first.
pub const DEFAULT_DELTA_CACHE_BYTES: u64 = 256 * 1024 * 1024;
/// Default rows per `steps` row group of a shard, at most (a row group is
/// also closed at [`DEFAULT_ROW_GROUP_BYTES`]). Each row group costs the
/// reader a column-chunk record per column in the shard's footer, kept
/// decoded while the store is open, and a codec per column read: at 256
/// rows of small calls that was ~50 bytes a row held and a third of an
/// open's time (4096: `trajlog ls` of 1M compacted tiny calls 1.7 → 1.1 s,
/// 360 → 311 MB peak, shards 12% smaller).
pub const DEFAULT_STEPS_ROW_GROUP_ROWS: usize = 4096;
/// Rows per data page of a shard column, at most (shard format 4,
/// format-spec/shard.md §1): pages are Parquet data pages v2, whose headers
/// give their rows, so a read of a few rows of a row group (one session's)
/// skips the pages before them without decompressing them. One page per
/// column chunk (4096 rows) made a one-session read decompress the whole
/// row group. Measured on 10,001 compacted tiny calls (`trajlog generate
/// --shape lean`, 16-token prompts), one session's first read / the `steps`
/// bytes: one page 4.4 ms / 1.10 MB; 1024 rows 2.6 ms / 1.14 MB; 256 rows
/// 2.2 ms / 1.20 MB; 64 rows 2.7 ms / 1.42 MB. On the gateway shape a page
/// is closed at ~1 MiB before it reaches its rows, and the bytes grow 0.1%.
pub const SHARD_PAGE_ROWS: usize = 256;
/// Default size (uncompressed estimate) at which a row group of either
/// table is closed, whatever its rows: what a compaction buffers, and what
/// a scan decodes at once. ~270 `steps` rows of the gateway shape.
pub const DEFAULT_ROW_GROUP_BYTES: usize = 32 * 1024 * 1024;
/// Default rows per `trajectories` row group (each row is a whole sequence),
/// once the group holds [`DEFAULT_TRAJECTORIES_ROW_GROUP_MIN_BYTES`].
pub const DEFAULT_TRAJECTORIES_ROW_GROUP_ROWS: usize = 64;
/// Default size (uncompressed estimate) a `trajectories` row group reaches
/// before its rows close it. 64 trajectories of tiny calls are ~0.1 MB: on
/// 10M compacted tiny calls that made 3,523 row groups a file, 5.4 MB
/// footers and 82-104 ms for pyarrow to read one file's metadata. 64 rows
/// of the gateway shape are ~4.7 MB, so this leaves them as they were.
pub const DEFAULT_TRAJECTORIES_ROW_GROUP_MIN_BYTES: usize = 1 << 20;
/// Rows per `trajectories` row group, at most, whatever its bytes (unless
/// [`crate::CompactOptions::trajectories_row_group_rows`] is larger).
pub const TRAJECTORIES_ROW_GROUP_ROWS_MAX: usize = 4096;
/// Default size (uncompressed estimate) at which a shard file is closed.
pub const DEFAULT_SHARD_BYTES: usize = 256 * 1024 * 1024;
/// A compaction gives the segments' resident pages back after each this many
/// bytes of token columns it has decoded (full prompts counted), so that its
/// resident set stays bounded however large the store.
pub const RELEASE_PAGES_EVERY_BYTES: u64 = 64 * 1024 * 1024;
/// Scans over many sessions (compaction, `audit`, `trajlog export`) drop the
/// shard row groups they decoded once these hold more than this many bytes,
/// so that their memory does not grow with the store (`Snapshot::bound_decoded`).
pub const SCAN_DECODED_BYTES_MAX: usize = 256 * 1024 * 1024;
/// The audit's report lists at most this many sessions (the first audited,
/// each with its per-call results); the counts cover every session.
pub const AUDIT_SESSIONS_LISTED_MAX: usize = 100_000;
/// ... and keeps the details (ids or text around the divergence) of at most
/// this many divergences in all (TI/TO breaks, earlier divergences, chat
/// histories rewritten); the counts cover every one. Without these bounds a
/// store whose every call is flagged (10M calls: ~3 GB) made the audit's
/// memory grow with the store.
pub const AUDIT_DETAILS_MAX: usize = 10_000;

/// A publication writes the shard index file anew (format-spec/shard-index.md
/// §1) once the `steps` files it does not describe hold more than 1/this of
/// the rows it does: an open decodes at most that fraction of the rows from
/// the shards, and each row is written again O(1) times on average.
pub const INDEX_REWRITE_DIVISOR: usize = 8;

/// A publication also writes the shard index file anew once the `steps`
/// files it does not describe hold more than this many rows, whatever the
/// store's size: an open decodes them from the shards and keeps them in
/// its maps (~5 µs and ~350 bytes a row on this project's 2-core VM), so
/// this bounds that part of an open (~0.35 s) at any history. The rewrite
/// streams the old file (format-spec/shard-index.md §1).
pub const INDEX_UNDESCRIBED_MAX: usize = 65_536;
