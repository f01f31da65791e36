//! The published `steps` shards a view reads, and where each compacted call
//! is served from.
//!
//! A compacted call keeps its index entry (trace id, sessions, timestamp,
//! log position); whether and where it is in a shard is looked up here by
//! that log position, not stored in the entry. A publication then builds a
//! new placement table (one 32-byte entry per shard row) and leaves the
//! trace map alone: storing the position in each entry made a publication
//! copy the entry and the map's path to it for every call it compacted,
//! while the published view still shared the old ones (the trace map held
//! twice at the compaction's peak).

use super::index_file::{ShardIndex, NOT_FROZEN};
use super::reader::{ShardFile, ShardPos};
use crate::format::record::Loc;
use crate::storage::table::Table;
use bytemuck::{Pod, Zeroable};
use std::sync::Arc;

/// One shard row: the log position of the call record it was compacted
/// from, and the row (32 bytes, the layout of format-spec/shard-index.md
/// §4). `shard` numbers the set's files as the shard index file does (see
/// [`ShardSet::position`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct Placement {
    segment: u64,
    offset: u64,
    pub shard: u32,
    row_group: u32,
    row: u32,
    /// The row's frozen row in the shard index file, or `u32::MAX`.
    pub frozen_row: u32,
}

impl Placement {
    pub(crate) fn new(loc: Loc, pos: ShardPos, frozen_row: u32) -> Placement {
        Placement {
            segment: loc.segment,
            offset: loc.offset,
            shard: pos.shard,
            row_group: pos.row_group,
            row: pos.row,
            frozen_row,
        }
    }

    pub(crate) fn loc(&self) -> Loc {
        Loc { segment: self.segment, offset: self.offset }
    }

    pub(crate) fn pos(&self) -> ShardPos {
        ShardPos { shard: self.shard, row_group: self.row_group, row: self.row }
    }
}

/// The `steps` shards of a view by shard id, and the placement of their
/// rows. A slot is emptied, not removed, when a collection replaces its
/// file, so that shard ids stay stable while the store is open; they are
/// renumbered from the manifest at the next open.
///
/// Every row of the files present is placed, sorted by log position, one
/// per position: a call record is compacted into one row of the published
/// files (a collection that moves rows drops the old file's in the same
/// publication). Dead rows (replaced or deleted after compaction) are there
/// too; they are never asked for, since lookups go by the log position of a
/// live index entry. The placements are in two tables: `base` (built in
/// memory, or mapped from the shard index file) and `extra`, the rows of
/// files added since (publications that did not rewrite the file), so that
/// a publication adds its rows without copying the others.
#[derive(Debug, Default)]
pub struct ShardSet {
    files: Vec<Option<Arc<ShardFile>>>,
    base: Arc<Table<Placement>>,
    /// The slot of each shard number `base` uses, when it numbers the files
    /// present in order (a mapped table after a collection emptied slots);
    /// `None`: shard number = slot.
    slot_of: Option<Arc<Vec<u32>>>,
    /// Sorted by log position, shard numbers = slots.
    extra: Arc<Vec<Placement>>,
    /// The shard index file `base` comes from, if any: it describes the
    /// files of `base`; the next publication writes its file from it.
    index: Option<Arc<ShardIndex>>,
    /// The last count of live rows per file over this set.
    liveness: LivenessMemo,
}

/// The last count of live rows per file (`Snapshot::shard_liveness`) over
/// a shard set, with the index it counted from: a count over the same
/// index trees is the same count. A batched compaction counted twice per
/// batch over the same set and index — after a publication (its deletions
/// side table) and at the next batch's start (its collection plan) — ~17%
/// of such a compaction of 1.5M calls on 10M.
#[derive(Default)]
pub(crate) struct LivenessMemo(std::sync::Mutex<Option<(crate::index::LivenessKey, Arc<LiveRows>)>>);

/// Live rows per shard id.
pub(crate) type LiveRows = std::collections::HashMap<u32, u64>;

impl std::fmt::Debug for LivenessMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LivenessMemo")
    }
}

impl LivenessMemo {
    /// The count made over an index of the same trees as `key`'s, if any.
    pub(crate) fn get(&self, key: &crate::index::LivenessKey) -> Option<Arc<LiveRows>> {
        let memo = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        memo.as_ref().filter(|(k, _)| k.same(key)).map(|(_, live)| live.clone())
    }

    /// Keep `live`, counted over `key`'s index (the previous count goes).
    pub(crate) fn put(&self, key: crate::index::LivenessKey, live: Arc<LiveRows>) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((key, live));
    }

    /// Forget the count, and the index trees it holds (a publication drops
    /// its base view's: the writer's maps change under it, and the held
    /// trees would outlive them; +40 MB at the peak of a batched
    /// compaction of 1.5M calls on 10M).
    pub(crate) fn clear(&self) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Sort by log position; of two rows of one position (which a consistent
/// store never has) the later shard's wins, as it would in a replay.
fn sorted(mut placements: Vec<Placement>) -> Vec<Placement> {
    placements.sort_unstable_by(|a, b| a.loc().cmp(&b.loc()).then(a.shard.cmp(&b.shard)));
    placements.reverse();
    placements.dedup_by_key(|p| p.loc());
    placements.reverse();
    placements.shrink_to_fit();
    placements
}

impl ShardSet {
    /// The shards of an open (ids `0..files.len()`), with every row's
    /// (log position, row).
    pub fn new(files: Vec<Arc<ShardFile>>, rows: impl IntoIterator<Item = (Loc, ShardPos)>) -> ShardSet {
        let placements = sorted(rows.into_iter().map(|(loc, pos)| Placement::new(loc, pos, NOT_FROZEN)).collect());
        Self::from_placements(files, placements)
    }

    /// The shards of an open (ids `0..files.len()`), with the placements of
    /// their rows, sorted by log position, one per position.
    pub(crate) fn from_placements(files: Vec<Arc<ShardFile>>, placements: Vec<Placement>) -> ShardSet {
        ShardSet {
            files: files.into_iter().map(Some).collect(),
            base: Arc::new(placements.into()),
            ..ShardSet::default()
        }
    }

    /// The last count of live rows per file over this set.
    pub(crate) fn liveness_memo(&self) -> &LivenessMemo {
        &self.liveness
    }

    /// A set of no files placed by `base`, for tests of the lookups.
    #[cfg(test)]
    pub(crate) fn with_table(base: Table<Placement>) -> ShardSet {
        ShardSet { base: Arc::new(base), ..ShardSet::default() }
    }

    /// Its placements, when they are one table (an open that built them;
    /// shard numbers = slots).
    pub(crate) fn placements(&self) -> &[Placement] {
        &self.base
    }

    /// The shards of an open (ids `0..files.len()`) whose first files a
    /// shard index file describes; `rows` place the rows of the others.
    pub(crate) fn from_index(
        files: Vec<Arc<ShardFile>>,
        index: Arc<ShardIndex>,
        rows: impl IntoIterator<Item = (Loc, ShardPos)>,
    ) -> ShardSet {
        ShardSet {
            files: files.into_iter().map(Some).collect(),
            base: Arc::new(index.placements()),
            slot_of: None,
            extra: Arc::new(sorted(rows.into_iter().map(|(loc, pos)| Placement::new(loc, pos, NOT_FROZEN)).collect())),
            index: Some(index),
            liveness: LivenessMemo::default(),
        }
    }

    /// This set placed by `index`, a shard index file written for its files
    /// present, in slot order.
    pub(crate) fn with_index(&self, index: Arc<ShardIndex>) -> ShardSet {
        let slots: Vec<u32> = self.present_slots().collect();
        let identity = slots.iter().enumerate().all(|(i, s)| i as u32 == *s);
        ShardSet {
            files: self.files.clone(),
            base: Arc::new(index.placements()),
            slot_of: (!identity).then(|| Arc::new(slots)),
            extra: Arc::default(),
            index: Some(index),
            liveness: LivenessMemo::default(),
        }
    }

    /// The slots that hold a file, in order (the order of the manifest).
    pub(crate) fn present_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.files.iter().enumerate().filter(|(_, f)| f.is_some()).map(|(i, _)| i as u32)
    }

    /// The slot of a shard number of the base table.
    pub(crate) fn slot(&self, shard: u32) -> Option<u32> {
        match &self.slot_of {
            None => Some(shard),
            Some(slots) => slots.get(shard as usize).copied(),
        }
    }

    /// The shard index file describing this set's first files, if any.
    pub(crate) fn index_file(&self) -> Option<&Arc<ShardIndex>> {
        self.index.as_ref()
    }

    /// Rows of files the shard index file does not describe.
    pub(crate) fn undescribed_rows(&self) -> usize {
        self.extra.len()
    }

    /// Rows of files the shard index file does not describe, but those of
    /// the slots `gone`.
    pub(crate) fn undescribed_rows_but(&self, gone: &std::collections::HashSet<u32>) -> usize {
        self.extra.iter().filter(|p| !gone.contains(&p.shard)).count()
    }

    /// The slots the shard index file describes (its shard numbers').
    pub(crate) fn described_slots(&self) -> Vec<u32> {
        let n = self.index.as_ref().map_or(0, |ix| ix.shards().len()) as u32;
        (0..n).filter_map(|k| self.slot(k)).collect()
    }

    /// This set after a publication: the slots `obsolete` emptied (their
    /// rows dropped) and `added` appended, with their rows. The files are
    /// given back emptied, for the caller to pin while snapshots read them.
    /// When no obsolete file has rows in the base table, the base table
    /// (and the shard index file describing it) is kept and the new rows
    /// join `extra`; else every row is copied into one table, described by
    /// no file. (A publication places its files after writing their shard
    /// index file, when it does: `store/publish.rs`.)
    #[cfg(test)]
    pub fn published(
        &self,
        obsolete: &[u32],
        added: Vec<ShardFile>,
        rows: impl IntoIterator<Item = (Loc, ShardPos)>,
    ) -> (ShardSet, Vec<Arc<ShardFile>>) {
        let (files, emptied) = self.published_files(obsolete, added);
        (self.place(files, obsolete, rows), emptied)
    }

    /// Whether [`ShardSet::published`] with these obsolete files keeps the
    /// base table and its shard index file (no obsolete file has rows in
    /// it: a merge of files added since the file was written).
    pub(crate) fn keeps_base(&self, obsolete: &[u32]) -> bool {
        let described = self.described_slots();
        obsolete.is_empty() || (self.index.is_some() && !obsolete.iter().any(|s| described.contains(s)))
    }

    /// The files of [`ShardSet::published`], no row placed, and the files
    /// emptied: for a publication that writes their shard index file first
    /// ([`ShardSet::with_index`] then places them) or places them
    /// ([`ShardSet::place`]).
    pub(crate) fn published_files(&self, obsolete: &[u32], added: Vec<ShardFile>) -> (ShardSet, Vec<Arc<ShardFile>>) {
        let mut files = self.files.clone();
        let mut emptied = Vec::new();
        for id in obsolete {
            if let Some(f) = files.get_mut(*id as usize).and_then(Option::take) {
                emptied.push(f);
            }
        }
        files.extend(added.into_iter().map(|f| Some(Arc::new(f))));
        (ShardSet { files, ..ShardSet::default() }, emptied)
    }

    /// `published` (the files of [`ShardSet::published_files`] of this set
    /// and `obsolete`) with every row placed: this set's rows but those of
    /// the obsolete files, and `rows`, the added files'.
    pub(crate) fn place(
        &self,
        published: ShardSet,
        obsolete: &[u32],
        rows: impl IntoIterator<Item = (Loc, ShardPos)>,
    ) -> ShardSet {
        let files = published.files;
        let new = rows.into_iter().map(|(loc, pos)| Placement::new(loc, pos, NOT_FROZEN));
        if self.keeps_base(obsolete) {
            let gone: std::collections::HashSet<u32> = obsolete.iter().copied().collect();
            let kept = self.extra.iter().filter(|p| !gone.contains(&p.shard)).copied();
            let extra = sorted(kept.chain(new).collect());
            return ShardSet {
                files,
                base: self.base.clone(),
                slot_of: self.slot_of.clone(),
                extra: Arc::new(extra),
                index: self.index.clone(),
                liveness: LivenessMemo::default(),
            };
        }
        let obsolete: std::collections::HashSet<u32> = obsolete.iter().copied().collect();
        let kept = self.base.iter().filter_map(|p| {
            let slot = self.slot(p.shard)?;
            (!obsolete.contains(&slot)).then_some(Placement { shard: slot, frozen_row: NOT_FROZEN, ..*p })
        });
        let kept_extra = self.extra.iter().filter(|p| !obsolete.contains(&p.shard)).copied();
        let placements = sorted(kept.chain(kept_extra).chain(new).collect());
        ShardSet { files, base: Arc::new(placements.into()), ..ShardSet::default() }
    }

    /// The file of shard `id`, if this set still has it.
    pub fn file(&self, id: u32) -> Option<&Arc<ShardFile>> {
        self.files.get(id as usize).and_then(Option::as_ref)
    }

    /// The files present, by shard id.
    pub fn files(&self) -> impl Iterator<Item = &Arc<ShardFile>> {
        self.files.iter().flatten()
    }

    /// Number of shard ids given out (emptied slots included): the next
    /// file gets this id.
    pub fn slots(&self) -> usize {
        self.files.len()
    }

    /// Where the call record at `loc` is served from, if it was compacted
    /// into a file of this set. O(log rows).
    pub fn position(&self, loc: Loc) -> Option<ShardPos> {
        if let Ok(i) = self.extra.binary_search_by(|p| p.loc().cmp(&loc)) {
            return self.extra.get(i).map(Placement::pos);
        }
        let p = self.base_at(loc)?;
        Some(ShardPos { shard: self.slot(p.shard)?, ..p.pos() })
    }

    /// [`ShardSet::position`] of each of `locs`, which are sorted: one walk
    /// forward through the placements (a gallop from each to the next)
    /// instead of a binary search each, so the table's pages are read in
    /// order, at most once, and given back behind the walk every 1M rows.
    /// A million lookups in random order read pages all over the table
    /// (32 bytes a row: 0.35 GB at 11M rows) and, given back under a
    /// budget, read them again and again.
    pub(crate) fn positions_sorted(&self, locs: &[Loc], mut f: impl FnMut(Option<ShardPos>)) {
        let mut at = 0usize;
        for &loc in locs {
            if let Ok(i) = self.extra.binary_search_by(|p| p.loc().cmp(&loc)) {
                f(self.extra.get(i).map(Placement::pos));
                continue;
            }
            // A block that does not check: the lookup misses, as in
            // `base_at`, and the walk stays where it was.
            let found = self.base.walk_to(&mut at, |p| p.loc() < loc).filter(|p| p.loc() == loc);
            f(found.and_then(|p| Some(ShardPos { shard: self.slot(p.shard)?, ..p.pos() })));
        }
        self.base.release_before(at);
    }

    /// The placement of `loc` in the base table, if any: a binary search
    /// that checks the blocks it reads of a mapped table (a failed block
    /// misses; the shard index file records the damage).
    fn base_at(&self, loc: Loc) -> Option<&Placement> {
        let i = self.base.partition_point(|p| p.loc() < loc)?;
        self.base.at(i).filter(|p| p.loc() == loc)
    }

    /// The shard index file's frozen row that the record at `loc` was
    /// compacted into, when the placement serving `loc` is one of the file's
    /// (not of a file added since) and names a frozen row. O(log rows).
    pub(crate) fn frozen_row_at(&self, loc: Loc) -> Option<u32> {
        if self.extra.binary_search_by(|p| p.loc().cmp(&loc)).is_ok() {
            return None;
        }
        let p = self.base_at(loc)?;
        (p.frozen_row != NOT_FROZEN && self.slot(p.shard).is_some()).then_some(p.frozen_row)
    }

    /// Whether the placements described by the shard index file are the
    /// table of the mapped file `map`.
    pub(crate) fn base_is_in(&self, map: &Arc<crate::storage::mmap::Mapping>) -> bool {
        self.base.is_in(map)
    }

    /// Whether the call record at `loc` is served from a shard.
    pub fn is_compacted(&self, loc: Loc) -> bool {
        self.position(loc).is_some()
    }

    /// [`ShardSet::is_compacted`] for positions asked in increasing order:
    /// a gallop forward from `at` (where the last one was found; start at
    /// 0) through the placements, as [`ShardSet::positions_sorted`] walks.
    pub(crate) fn is_compacted_from(&self, at: &mut usize, loc: Loc) -> bool {
        if self.extra.binary_search_by(|p| p.loc().cmp(&loc)).is_ok() {
            return true;
        }
        // A block that does not check: the lookup misses, as in `base_at`.
        self.base.walk_to(at, |p| p.loc() < loc).is_some_and(|p| p.loc() == loc && self.slot(p.shard).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(segment: u64, offset: u64) -> Loc {
        Loc { segment, offset }
    }
    fn pos(shard: u32, row: u32) -> ShardPos {
        ShardPos { shard, row_group: 0, row }
    }

    #[test]
    fn positions_by_log_position_and_publication_replaces_obsolete_rows() {
        let set = ShardSet::new(Vec::new(), [(loc(2, 8), pos(0, 1)), (loc(1, 8), pos(0, 0)), (loc(3, 8), pos(1, 0))]);
        assert_eq!(set.position(loc(1, 8)), Some(pos(0, 0)));
        assert_eq!(set.position(loc(2, 8)), Some(pos(0, 1)));
        assert_eq!(set.position(loc(3, 8)), Some(pos(1, 0)));
        assert_eq!(set.position(loc(2, 9)), None);
        // Shard 0 collected: its live row moves to shard 2, its dead one is gone.
        let (next, emptied) = set.published(&[0], Vec::new(), [(loc(1, 8), pos(2, 0))]);
        assert!(emptied.is_empty(), "the set had no files to give back");
        assert_eq!(next.position(loc(1, 8)), Some(pos(2, 0)));
        assert_eq!(next.position(loc(2, 8)), None);
        assert_eq!(next.position(loc(3, 8)), Some(pos(1, 0)));
        // The old set is unchanged (a snapshot may still read it).
        assert_eq!(set.position(loc(2, 8)), Some(pos(0, 1)));
    }

    #[test]
    fn a_publication_without_obsolete_files_adds_its_rows_beside_the_base() {
        let set = ShardSet::new(Vec::new(), [(loc(1, 8), pos(0, 0)), (loc(2, 8), pos(0, 1))]);
        let (next, _) = set.published(&[], Vec::new(), [(loc(3, 8), pos(1, 0)), (loc(1, 16), pos(1, 1))]);
        assert!(Arc::ptr_eq(&set.base, &next.base), "the base table is shared, not copied");
        assert_eq!((next.base.len(), next.undescribed_rows()), (2, 2));
        for (l, p) in [(loc(1, 8), pos(0, 0)), (loc(2, 8), pos(0, 1)), (loc(3, 8), pos(1, 0)), (loc(1, 16), pos(1, 1))] {
            assert_eq!(next.position(l), Some(p));
        }
        // A collection of shard 0 then makes one table of what is left.
        let (last, _) = next.published(&[0], Vec::new(), [(loc(1, 8), pos(2, 0))]);
        assert_eq!((last.base.len(), last.undescribed_rows()), (3, 0));
        assert_eq!(last.position(loc(1, 8)), Some(pos(2, 0)));
        assert_eq!(last.position(loc(2, 8)), None);
        assert_eq!(last.position(loc(1, 16)), Some(pos(1, 1)));
    }

    #[test]
    fn of_two_rows_at_one_position_the_later_shard_wins() {
        let set = ShardSet::new(Vec::new(), [(loc(1, 8), pos(3, 0)), (loc(1, 8), pos(1, 5)), (loc(1, 16), pos(1, 6))]);
        assert_eq!(set.position(loc(1, 8)), Some(pos(3, 0)));
        assert_eq!(set.position(loc(1, 16)), Some(pos(1, 6)));
        assert_eq!(set.base.len(), 2);
    }

    /// A walk in log order answers what a lookup of each position does:
    /// base rows, rows of files added since, positions no file serves.
    #[test]
    fn positions_walked_in_order_are_those_looked_up_one_by_one() {
        let base: Vec<(Loc, ShardPos)> = (0..5_000u32).map(|i| (loc(1 + u64::from(i / 700), u64::from(i % 700) * 16), pos(i % 3, i))).collect();
        let set = ShardSet::new(Vec::new(), base);
        let (set, _) = set.published(&[], Vec::new(), [(loc(4, 8), pos(3, 0)), (loc(9, 0), pos(3, 1))]);
        let mut state = 7u64;
        let mut locs: Vec<Loc> = (0..3_000)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let r = state >> 33;
                loc(r % 10, (r >> 8) % 720 * 8)
            })
            .collect();
        locs.extend([loc(4, 8), loc(9, 0), loc(0, 0), loc(20, 0)]);
        locs.sort_unstable();
        let mut walked = Vec::new();
        set.positions_sorted(&locs, |p| walked.push(p));
        let looked_up: Vec<Option<ShardPos>> = locs.iter().map(|l| set.position(*l)).collect();
        assert_eq!(walked, looked_up);
        assert!(looked_up.iter().filter(|p| p.is_some()).count() > 100, "the test finds rows");
        assert!(looked_up.iter().any(Option::is_none), "and misses some");
    }
}

