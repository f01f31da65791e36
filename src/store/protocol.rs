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
    /// The store is closing (it flushed first): commit and stop.
    Close,
}

/// What publishing a compaction did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishOutcome {
    pub calls_placed: u64,
    pub retired_segments: Vec<u64>,
}
