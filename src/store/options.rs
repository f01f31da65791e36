//! How a store is opened: durability levels, recovery modes and options.

use super::*;

/// When an append counts as done (see README "Durability").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Written to the OS page cache in the writer's batch: survives a crash of
    /// this process, not a power loss.
    Buffered,
    /// fsync every `group_commit_ms` while records wait for one, and at once
    /// when a caller waits for durability (callers waiting together share one
    /// fsync); acknowledged after that fsync: survives power loss once
    /// acknowledged.
    Group,
    /// fsync before each acknowledgement (concurrent appends share one fsync).
    Sync,
}

impl std::str::FromStr for Durability {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "buffered" => Ok(Durability::Buffered),
            "group" => Ok(Durability::Group),
            "sync" => Ok(Durability::Sync),
            _ => Err(Error::invalid("durability", format!("{s:?} is not one of buffered, group, sync"))),
        }
    }
}

/// What an open does about damage in the log (format-spec/segment.md §6,
/// README "When files are damaged or missing"). Modelled on RocksDB's WAL
/// recovery modes. Whatever the mode, nothing is dropped silently: every cut
/// and every skip is in [`Store::recovery_report`] (and, for damage, in
/// `Snapshot::damage`), and a refusal is a `Corrupt` error naming the
/// segment file and the offset (and, for damage, how many valid records
/// follow it) that changed nothing on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// The default; RocksDB's `kTolerateCorruptedTailRecords`. A torn tail
    /// (bytes after the last valid frame of the active segment that hold no
    /// valid frame: an interrupted write) is cut off and reported. Damage — an
    /// invalid frame, or a zeroed region, with valid frames after it — refuses
    /// the open. Sealed segments are read through their CRC-checked footers
    /// without reading their frames (open reads footers and the active
    /// segment only): a damaged record there is found when it is read (an
    /// error naming segment and offset), by `trajlog verify`, or at open by
    /// the other two modes. A damaged footer is rebuilt from the frames (it is
    /// only an index); if that rebuild meets a damaged frame, the open refuses.
    #[default]
    TolerateTornTail,
    /// RocksDB's `kAbsoluteConsistency`. The open goes on only if the store is
    /// intact as `trajlog verify` sees it: every byte of every segment (header,
    /// every frame's CRC and decoding, footer against frames, prefix-delta
    /// parent links) and of every shard (checksums, every row group), no torn
    /// tail, no footer to rebuild. Anything else refuses the open, and nothing
    /// on disk is changed. Cost: a full read of the store before opening —
    /// open time grows with the store's size (`trajlog verify`'s cost), where
    /// the default reads footers and the active segment only. A read-only
    /// open does not refuse a torn tail (beside a live writer it may be a
    /// write in progress); it leaves it out of its view, as every read-only
    /// open does.
    AbsoluteConsistency,
    /// RocksDB's `kSkipAnyCorruptedRecords`. Damaged records are left out of
    /// the index and every valid record is kept. Cost: every frame of every
    /// sealed segment is read and checked against its footer at open (a full
    /// read of the segments). In the active segment, a writable open cuts a
    /// torn tail after the last valid frame, then — if it skipped damage —
    /// seals the segment at once with the damaged bytes left in place and
    /// left out of its footer, and appends to a new segment: later opens, in
    /// any mode, read that footer and report the region as
    /// [`RecoveryEventKind::SkippedEarlier`] (absolute consistency refuses it:
    /// the bytes are still damaged). In a sealed segment nothing is written:
    /// a damaged record is skipped by every skip-corrupted open (reported each
    /// time) and, in the default mode, is again an error when read. A damaged
    /// seal or session deletion whose footer entry is intact is applied from
    /// the entry, as in every mode. Calls whose prompt builds on a skipped
    /// call (its prefix-delta descendants) stay indexed and are refused when
    /// their prompt is read, never served wrong.
    SkipCorrupted,
}

impl RecoveryMode {
    /// The name `FromStr` takes (and the CLI's `--recovery`).
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryMode::TolerateTornTail => "tolerate-torn-tail",
            RecoveryMode::AbsoluteConsistency => "absolute",
            RecoveryMode::SkipCorrupted => "skip-corrupted",
        }
    }
}

impl std::fmt::Display for RecoveryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RecoveryMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tolerate-torn-tail" => Ok(RecoveryMode::TolerateTornTail),
            "absolute" => Ok(RecoveryMode::AbsoluteConsistency),
            "skip-corrupted" => Ok(RecoveryMode::SkipCorrupted),
            _ => Err(Error::invalid(
                "recovery",
                format!("{s:?} is not one of tolerate-torn-tail, absolute, skip-corrupted"),
            )),
        }
    }
}

/// How to open a store. Start from `Options::default()` and change what you
/// need with the same-named setters:
///
/// ```
/// use trajlog::{Durability, Options};
/// let opts = Options::default().durability(Durability::Sync).segment_bytes(16 << 20);
/// assert_eq!(opts.durability, Durability::Sync);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Options {
    /// When an append counts as done.
    pub durability: Durability,
    /// Group-commit interval for [`Durability::Group`].
    pub group_commit_ms: u64,
    /// Seal and roll to a new segment when the active one reaches this size.
    pub segment_bytes: u64,
    /// Records (calls and annotations) in flight between appenders and the
    /// writer thread. Past it, appenders wait (back-pressure, never a drop).
    pub queue_depth: usize,
    /// Bytes of records in flight between appenders and the writer thread
    /// (token columns, documents, blobs: what the queued calls hold in
    /// memory). Past it, appenders wait. A record larger than this is taken
    /// alone, once nothing else is in flight, so it never waits for ever.
    pub queue_bytes: u64,
    /// Memory for prefix-delta contexts, and as much again for the chat
    /// documents (`messages`, `response_message`) of each session's last
    /// append, against which the next append's `messages` is stored as a
    /// delta (a session past the budget stores its next `messages` in full).
    pub delta_cache_bytes: u64,
    /// Records a prompt's rebuild may read besides its own before the writer
    /// stores a prompt whole (a checkpoint, format-spec/record.md §4);
    /// default [`crate::limits::PROMPT_CHAIN_MAX`]. Larger saves bytes on
    /// long sessions, smaller makes one call's read cheaper. 0 = never
    /// (chains as long as the session, as store formats before 6 wrote).
    pub prompt_chain_max: u32,
    /// What opening does about damage in the log ([`RecoveryMode`]).
    pub recovery: RecoveryMode,
    /// After each fsync, keep this many bytes past the last record of the
    /// active segment written with zeros, so that the next records
    /// overwrite blocks the file system has allocated and their fdatasync
    /// writes data alone (no block allocation, no journal commit). Default
    /// 1 MiB: on ext4 a 12 kB write + fdatasync took half the time and 40%
    /// less CPU (src/segment/writer.rs). 0 turns it off: for a
    /// copy-on-write file system (btrfs, ZFS), where an overwrite allocates
    /// anyway and the zeros are extra writes.
    pub zero_ahead_bytes: u64,
    /// Write the backlog index file (`DIR/backlog.tbi`,
    /// format-spec/backlog-index.md) at a writable open that finds at least
    /// this many calls of finished sessions in sealed segments and no file
    /// it could use: later opens then map it instead of reading every
    /// sealed segment's footer. A writer also writes it anew in a helper
    /// thread once it sealed this many calls more and its sealed segments
    /// grew by an eighth, and takes the index mapped from it instead of
    /// its maps (a store without shards). Default 65,536; 0 never writes one.
    pub backlog_index_min_calls: u64,
    /// Fault injection for the test suite; None in use.
    pub(crate) faults: crate::storage::fault::Faults,
}

impl Options {
    /// When an append counts as done.
    #[must_use]
    pub fn durability(mut self, v: Durability) -> Self {
        self.durability = v;
        self
    }
    /// Group-commit interval for [`Durability::Group`], in milliseconds.
    #[must_use]
    pub fn group_commit_ms(mut self, v: u64) -> Self {
        self.group_commit_ms = v;
        self
    }
    /// Seal and roll to a new segment when the active one reaches this size.
    #[must_use]
    pub fn segment_bytes(mut self, v: u64) -> Self {
        self.segment_bytes = v;
        self
    }
    /// Records in flight between appenders and the writer thread.
    #[must_use]
    pub fn queue_depth(mut self, v: usize) -> Self {
        self.queue_depth = v;
        self
    }
    /// Memory for prefix-delta contexts.
    #[must_use]
    pub fn delta_cache_bytes(mut self, v: u64) -> Self {
        self.delta_cache_bytes = v;
        self
    }
    /// Set [`Options::prompt_chain_max`].
    #[must_use]
    pub fn prompt_chain_max(mut self, v: u32) -> Self {
        self.prompt_chain_max = v;
        self
    }
    /// What opening does about damage in the log.
    #[must_use]
    pub fn recovery(mut self, v: RecoveryMode) -> Self {
        self.recovery = v;
        self
    }
    /// Set [`Options::zero_ahead_bytes`].
    #[must_use]
    pub fn zero_ahead_bytes(mut self, v: u64) -> Self {
        self.zero_ahead_bytes = v;
        self
    }
    /// Set [`Options::backlog_index_min_calls`].
    #[must_use]
    pub fn backlog_index_min_calls(mut self, v: u64) -> Self {
        self.backlog_index_min_calls = v;
        self
    }
    /// Fault injection (test suite only).
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    #[must_use]
    pub fn faults(mut self, v: crate::storage::fault::Faults) -> Self {
        self.faults = v;
        self
    }
}

/// Default for [`Options::backlog_index_min_calls`].
pub const DEFAULT_BACKLOG_INDEX_MIN_CALLS: u64 = 1 << 16;

impl Default for Options {
    fn default() -> Self {
        Self {
            durability: Durability::Group,
            group_commit_ms: DEFAULT_GROUP_COMMIT_MS,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            delta_cache_bytes: DEFAULT_DELTA_CACHE_BYTES,
            prompt_chain_max: crate::limits::PROMPT_CHAIN_MAX,
            faults: None,
            recovery: RecoveryMode::TolerateTornTail,
            zero_ahead_bytes: crate::segment::writer::ZERO_AHEAD_DEFAULT,
            backlog_index_min_calls: DEFAULT_BACKLOG_INDEX_MIN_CALLS,
        }
    }
}

impl Options {
    /// Set [`Options::queue_bytes`].
    pub fn queue_bytes(mut self, v: u64) -> Self {
        self.queue_bytes = v;
        self
    }

    pub(super) fn validate(&self) -> Result<()> {
        if self.segment_bytes < SEGMENT_BYTES_MIN {
            return Err(Error::limit(
                "SEGMENT_BYTES_MIN",
                "segment_bytes (too small)",
                self.segment_bytes,
                SEGMENT_BYTES_MIN,
            ));
        }
        if self.queue_depth == 0 {
            return Err(Error::invalid("queue_depth", "must be at least 1"));
        }
        if self.queue_bytes == 0 {
            return Err(Error::invalid("queue_bytes", "must be at least 1 (a larger record is still taken, alone)"));
        }
        Ok(())
    }
}
