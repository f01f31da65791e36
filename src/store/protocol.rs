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
    /// The backlog index file's refresh (store/backlog_refresh.rs) is done:
    /// take what it built, if the writer still can.
    BacklogRefreshed,
    /// Test hook (`Store::wait_backlog_refresh`): wait for a refresh under
    /// way and take what it built; replies with the refreshes started, the
    /// indexes taken, the files written from the one before and the
    /// deltas taken since the open.
    #[cfg(any(test, feature = "internals"))]
    WaitBacklogRefresh {
        reply: Sender<(u64, u64, u64, u64)>,
    },
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
    /// The epoch at which the compacting thread is to judge the base view's
    /// sealed segments for retirement (store/retire.rs `prejudge`), when
    /// the writer keeps no verdict.
    pub(super) prejudge: Option<u64>,
}

/// Which ids (trace ids, or sessions) shard rows carry, live or not: what
/// retirement asks ("does a shard row of this id exist?"). A multiset, so
/// that a collection can take the rows of the files it replaces away
/// exactly.
///
/// Kept as the sorted 64-bit hashes of the ids, one per row (8 bytes a
/// row), shared by the views and the writer and rebuilt by a publication
/// (O(rows), no copy of the ids). Two ids of one hash make `contains`
/// answer yes for both: the answer is then only conservative (a segment
/// kept, a session's reward rewritten in the side table), never a loss.
/// Before, a hash map of the ids (~50 MB at a million rows, ~24 bytes per
/// bucket at most 7/8 full) was copied by each compaction to be changed.
/// The sorted hashes live in three tables: `base` (in memory, or in the
/// shard index file, which stores them for a writable open), `extra`, the
/// rows of files added since, and `removed`, the rows of files taken away
/// since (each a row counted in `base` or `extra`), so that a publication
/// changes them in O(its rows), without copying the others: a count is
/// `base`'s plus `extra`'s minus `removed`'s. (A merge that took rows
/// away copied every hash of the store: at 11M rows, ~0.5 GB of a
/// compaction's peak.) A publication that writes the shard index file
/// starts again from the file's tables.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowCounts {
    base: Arc<crate::storage::table::Table<u64>>,
    extra: Arc<Vec<u64>>,
    removed: Arc<Vec<u64>>,
}

/// How many times `h` is in sorted `s`.
fn occurrences(s: &[u64], h: u64) -> usize {
    s.partition_point(|x| *x <= h) - s.partition_point(|x| *x < h)
}

/// The sorted merge of two sorted multisets.
fn merged(a: impl IntoIterator<Item = u64>, b: Vec<u64>) -> Vec<u64> {
    let mut out = Vec::with_capacity(b.len());
    let mut b = b.into_iter().peekable();
    for h in a {
        while let Some(x) = b.next_if(|x| *x < h) {
            out.push(x);
        }
        out.push(h);
    }
    out.extend(b);
    out
}

impl RowCounts {
    /// The hash an id is kept under (XXH3-64, seed 0: the shard index
    /// file's, `index::frozen::id_hash`).
    pub(crate) fn hash(id: &str) -> u64 {
        crate::index::frozen::id_hash(id)
    }

    /// The multiset of these hashes.
    pub(crate) fn from_hashes(mut hashes: Vec<u64>) -> RowCounts {
        hashes.sort_unstable();
        Self::from_sorted(hashes.into())
    }

    /// The multiset of these hashes, sorted already.
    pub(crate) fn from_sorted(hashes: crate::storage::table::Table<u64>) -> RowCounts {
        RowCounts { base: Arc::new(hashes), extra: Arc::default(), removed: Arc::default() }
    }

    /// The rows per trace id and per session a shard index file stores.
    pub(crate) fn of_index(ix: &crate::shard::index_file::ShardIndex) -> (RowCounts, RowCounts) {
        (Self::from_sorted(ix.trace_hashes()), Self::from_sorted(ix.session_hashes()))
    }

    /// These counts with `hashes` (any order) counted too, in `extra`.
    pub(crate) fn with(&self, mut hashes: Vec<u64>) -> RowCounts {
        hashes.sort_unstable();
        RowCounts {
            base: self.base.clone(),
            extra: Arc::new(merged(self.extra.iter().copied(), hashes)),
            removed: self.removed.clone(),
        }
    }

    /// The sorted hashes, when they are one table (as an open builds them).
    pub(crate) fn base(&self) -> &[u64] {
        debug_assert!(self.extra.is_empty() && self.removed.is_empty(), "not one table");
        self.base.as_slice()
    }

    /// How many rows carry hash `h`. The base table's blocks are checked
    /// as read (a lazily checked shard index file's): one that fails counts
    /// as a row, and is recorded ([`RowCounts::damage`]).
    fn count_hash(&self, h: u64) -> usize {
        let base = match (self.base.partition_point(|x| *x < h), self.base.partition_point(|x| *x <= h)) {
            (Some(lo), Some(hi)) => hi - lo,
            _ => 1,
        };
        (base + occurrences(&self.extra, h)).saturating_sub(occurrences(&self.removed, h))
    }

    /// What failed of the base table's blocks, once one did (a table of a
    /// lazily checked shard index file).
    pub(crate) fn damage(&self) -> Option<Error> {
        self.base.damage()
    }

    /// How many rows carry `id` (or another id of its hash: conservative).
    pub(crate) fn count(&self, id: &str) -> usize {
        self.count_hash(Self::hash(id))
    }

    /// Whether a row of `id` exists (or of an id of the same hash).
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.count(id) > 0
    }

    /// These counts with one row of each hash of `removed` taken away (a
    /// hash not counted is ignored) and `added` counted: O((removed + added)
    /// × log rows), the tables of these counts shared.
    pub(crate) fn changed(&self, mut removed: Vec<u64>, added: Vec<u64>) -> RowCounts {
        if removed.is_empty() {
            return self.with(added);
        }
        removed.sort_unstable();
        // Only what is counted is taken away, as many times as it is.
        let mut taken = Vec::with_capacity(removed.len());
        for run in removed.chunk_by(|a, b| a == b) {
            let Some(h) = run.first().copied() else { continue };
            taken.extend(std::iter::repeat_n(h, run.len().min(self.count_hash(h))));
        }
        let with = self.with(added);
        RowCounts { removed: Arc::new(merged(self.removed.iter().copied(), taken)), ..with }
    }
}

/// A publication's index changes, prepared by the compacting thread from
/// the compaction's base view (store/publish.rs); the writer thread applies
/// them, re-checking only the trace ids it changed since that view.
pub(super) struct Prepared {
    pub(super) token: u64,
    /// The shards after the publication: the base view's, the obsolete
    /// files taken out, the new `steps` shards (opened and checked, at
    /// their final paths) added, with the placement of every row.
    pub(super) shards: crate::snapshot::ShardSlots,
    /// When the publication wrote the shard index file: the index an open
    /// would build over it, replayed through the base view's sealed
    /// segments, and the last of them (the writer replays the later ones
    /// and takes it).
    pub(super) rebuilt: Option<(super::recovery::Rebuilt, u64)>,
    /// The base view's shards: a publication applies only to them.
    pub(super) base_shards: crate::snapshot::ShardSlots,
    /// The obsolete files taken out, for the writer to pin before it
    /// deletes them (snapshots may still read them).
    pub(super) emptied: Vec<Arc<ShardFile>>,
    /// The base view's index (an O(1) copy), for re-counting
    /// `in_segments` of the trace ids changed since.
    pub(super) base_index: crate::index::Index,
    /// Shard rows per trace id and per session, the new files' included
    /// and the obsolete files' taken away.
    pub(super) shard_traces: RowCounts,
    pub(super) shard_sessions: RowCounts,
    /// What a collection replaces.
    pub(super) obsolete: super::Obsolete,
    /// For retirement: live calls of `base_index` still served from segments,
    /// counted by primary session (sessions with none are absent).
    pub(super) in_segments: std::collections::HashMap<Arc<str>, u64>,
    /// [`crate::CompactOptions::copy_forward`].
    pub(super) copy_forward: Option<f64>,
    /// Retirement's verdicts on the base view's sealed segments, judged by
    /// the compacting thread when [`CompactionBase::prejudge`] asked.
    pub(super) prejudged: Option<super::retire::Prejudged>,
}

/// What publishing a compaction did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PublishOutcome {
    pub retired_segments: Vec<u64>,
    /// What the copy-forward collector copied (shard.md §6.3).
    pub copied_forward: super::retire::CopiedForward,
    /// Shard files the deletions side table could not look into (path under
    /// `shards/`, the error): their rows dead since are not listed.
    pub deletions_skipped: Vec<(String, String)>,
}

#[cfg(test)]
mod tests {
    use super::RowCounts;

    #[test]
    fn row_counts_are_a_multiset_of_ids() {
        let h = RowCounts::hash;
        let counts = RowCounts::from_hashes(vec![h("a"), h("b"), h("a"), h("c")]);
        assert!(counts.contains("a") && counts.contains("b") && counts.contains("c"));
        assert!(!counts.contains("d"));
        // One row of "a" and the only row of "b" go, a row of "d" comes; a
        // removal of an id with no row ("e") is ignored.
        let next = counts.changed(vec![h("a"), h("b"), h("e")], vec![h("d")]);
        assert!(next.contains("a") && !next.contains("b") && next.contains("c") && next.contains("d"));
        assert_eq!((next.count("a"), next.count("e")), (1, 0));
        // The tables are shared, not copied: the change is in `extra` and
        // `removed` (the ignored "e" not among them).
        assert!(std::sync::Arc::ptr_eq(&next.base, &counts.base));
        assert_eq!((next.extra.len(), next.removed.len()), (1, 2));
        // "e" added afterwards counts: the earlier removal was ignored.
        assert_eq!(next.changed(vec![h("c")], vec![h("e")]).count("e"), 1);
        // The second row of "a" goes too.
        assert!(!next.changed(vec![h("a")], Vec::new()).contains("a"));
        // The counts it was made from are unchanged.
        assert_eq!(counts.base().len(), 4);
        assert_eq!(counts.count("a"), 2);
    }

    /// Any sequence of changes counts what a plain multiset counts.
    #[test]
    fn row_counts_match_a_multiset_through_any_changes() {
        use std::collections::HashMap;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..50 {
            let first: Vec<u64> = (0..next(40)).map(|_| next(12)).collect();
            let mut want: HashMap<u64, usize> = HashMap::new();
            for x in &first {
                *want.entry(*x).or_default() += 1;
            }
            let mut counts = RowCounts::from_hashes(first);
            for _ in 0..10 {
                let removed: Vec<u64> = (0..next(8)).map(|_| next(12)).collect();
                let added: Vec<u64> = (0..next(8)).map(|_| next(12)).collect();
                for r in &removed {
                    if let Some(n) = want.get_mut(r).filter(|n| **n > 0) {
                        *n -= 1;
                    }
                }
                for a in &added {
                    *want.entry(*a).or_default() += 1;
                }
                counts = counts.changed(removed, added);
                for x in 0..12 {
                    assert_eq!(counts.count_hash(x), want.get(&x).copied().unwrap_or(0), "hash {x}");
                }
            }
        }
    }
}
