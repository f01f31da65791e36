//! How a store is opened: durability levels and options.

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

/// How to open a store. `Options::default()` is a sensible start.
#[derive(Debug, Clone)]
pub struct Options {
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
    /// Memory for prefix-delta contexts.
    pub delta_cache_bytes: u64,
    /// Fault injection for tests (see [`crate::storage::fault`]); None in use.
    pub faults: crate::storage::fault::Faults,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            durability: Durability::Group,
            group_commit_ms: DEFAULT_GROUP_COMMIT_MS,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            delta_cache_bytes: DEFAULT_DELTA_CACHE_BYTES,
            faults: None,
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
