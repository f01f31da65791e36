//! What appenders and the store API send the writer thread, and what it answers.
//!
//! The channel is unbounded: back-pressure is taken before a command is sent
//! (records carry a [`Permit`] of the queue's budget, see `queue.rs`), so a
//! send never blocks and no lock is held across one. Appends and annotations
//! are sent under the append lock, right after their sequence number is
//! assigned, so the writer sees them in sequence order (log order ==
//! sequence order). Other commands need no lock.

use super::*;

pub(super) enum Cmd {
    Append {
        seq: u64,
        call: Box<Call>,
        /// Its documents as a docs block (format-spec/record.md §7), made by
        /// the appender's thread; `None` stores them plain.
        docs: Option<crate::format::docs::Encoded>,
        /// When the block's `messages` refers to a parent's documents: the
        /// sequence number of the append whose documents it used (the
        /// session's previous append). The writer keeps the block only if
        /// that call is the parent it chooses.
        docs_parent_seq: Option<u64>,
        /// Its room in the queue; the writer drops it once the call is handled.
        permit: Permit,
    },
    Annotate {
        seq: u64,
        ann: Annotation,
        reply: Option<Sender<u64>>,
        permit: Permit,
    },
    Flush {
        fsync: bool,
        reply: Sender<Result<()>>,
    },
    /// A caller waits for durability (group commit): fsync after this batch
    /// instead of at the timer.
    SyncSoon,
    Roll {
        reply: Sender<Result<()>>,
    },
    /// Start a compaction: seal the active segment, make everything durable,
    /// reserve a shard generation, and from here on note which trace ids the
    /// writer changes, until the compaction publishes or ends.
    BeginCompaction {
        reply: Sender<Result<CompactionBase>>,
    },
    /// A compaction begun with this token ends without publishing.
    EndCompaction {
        token: u64,
    },
    /// Test hook (`Store::inject_writer_panic`, feature `internals`): the
    /// writer thread panics.
    #[cfg(any(test, feature = "internals"))]
    Panic,
    /// Publish staged shards, apply the prepared index changes (re-checking
    /// what changed since the compaction began), retire segments.
    Publish {
        staged: Vec<PendingRename>,
        sessions: Vec<String>,
        prepared: Box<Prepared>,
        reply: Sender<(Result<PublishOutcome>, Box<Prepared>)>,
    },
    /// The store is closing (it flushed first): commit and stop.
    Close,
}

/// What a compaction starts from: the state the writer published when it
/// began (everything durable, the active segment sealed), and what the
/// compacting thread needs to prepare the publication's index changes.
pub(super) struct CompactionBase {
    pub(super) token: u64,
    pub(super) generation: u64,
    pub(super) view: Arc<View>,
    pub(super) shard_traces: RowCounts,
    pub(super) shard_sessions: RowCounts,
}

/// How many shard rows (live or not) carry each trace id, or each session:
/// what retirement asks ("does a shard row of this id exist?"). Counts, not
/// a set, so that a collection can take the rows of the files it replaces
/// away exactly.
///
/// A plain hash map shared copy-on-write: the writer keeps one, a
/// compaction's preparation changes a copy (one O(rows) clone per
/// compaction). A persistent map (`imbl::HashMap`) made the clone O(1) but
/// cost ~300 MB more at a million shard rows: a writable open of 1M tiny
/// compacted calls peaked at 872 MB with it, 573 MB with this.
pub(crate) type RowCounts = Arc<std::collections::HashMap<Arc<str>, u32>>;

/// Count one more row of `id`.
pub(crate) fn count_row(counts: &mut RowCounts, id: &Arc<str>) {
    *Arc::make_mut(counts).entry(id.clone()).or_default() += 1;
}

/// Count one row of `id` fewer (dropping ids with none left).
pub(crate) fn uncount_row(counts: &mut RowCounts, id: &str) {
    if !counts.contains_key(id) {
        return;
    }
    let counts = Arc::make_mut(counts);
    if let Some(n) = counts.get_mut(id) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(id);
        }
    }
}

/// A publication's index changes, prepared by the compacting thread from
/// the compaction's base view (store/publish.rs); the writer thread applies
/// them, re-checking only the trace ids it changed since that view.
pub(super) struct Prepared {
    pub(super) token: u64,
    /// The shard id of `files[0]` (the base view's shard count).
    pub(super) first_shard_id: u32,
    /// The new `steps` shards, opened and checked, at their final paths.
    pub(super) files: Vec<ShardFile>,
    /// The base view's trace map with the compacted calls switched to their
    /// shard rows.
    pub(super) traces: imbl::OrdMap<Arc<str>, Arc<CallMeta>>,
    /// Shard rows per trace id and per session, the new files' included
    /// and the obsolete files' taken away.
    pub(super) shard_traces: RowCounts,
    pub(super) shard_sessions: RowCounts,
    /// What a collection replaces.
    pub(super) obsolete: super::Obsolete,
    /// For retirement: live calls of `traces` still served from segments,
    /// counted by primary session (sessions with none are absent).
    pub(super) in_segments: std::collections::HashMap<Arc<str>, u64>,
}

/// What publishing a compaction did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishOutcome {
    pub retired_segments: Vec<u64>,
}
