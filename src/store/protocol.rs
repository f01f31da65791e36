//! What appenders and the store API send the writer thread, and what it answers.

use super::*;

pub(super) enum Cmd {
    Append {
        seq: u64,
        call: Box<Call>,
    },
    Annotate {
        seq: u64,
        ann: Annotation,
        reply: Option<Sender<u64>>,
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
    /// Reserve a shard generation number for a compaction.
    ReserveGeneration {
        reply: Sender<u64>,
    },
    /// Test hook ([`Store::inject_writer_panic`]): the writer thread panics.
    Panic,
    /// Publish staged shards, switch compacted calls to them, retire segments.
    Publish {
        staged: Vec<PendingRename>,
        sessions: Vec<String>,
        reply: Sender<Result<PublishOutcome>>,
    },
}

/// What publishing a compaction did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishOutcome {
    pub calls_placed: u64,
    pub retired_segments: Vec<u64>,
}
