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
    /// Records in flight between appenders and the writer thread.
    pub queue_depth: usize,
    /// Memory for prefix-delta contexts.
    pub delta_cache_bytes: u64,
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
    /// Fault injection (test suite only).
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    #[must_use]
    pub fn faults(mut self, v: crate::storage::fault::Faults) -> Self {
        self.faults = v;
        self
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            durability: Durability::Group,
            group_commit_ms: DEFAULT_GROUP_COMMIT_MS,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            delta_cache_bytes: DEFAULT_DELTA_CACHE_BYTES,
            faults: None,
        }
    }
}

impl Options {
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
        Ok(())
    }
}
