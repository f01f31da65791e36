//! Fixed-width tables that live either in memory or in a mapped file (the
//! shard index, format-spec/shard-index.md): one type for both, so the
//! index layers read a table the same way whether an open built it or
//! mapped it.

use super::mmap::Mapping;
use bytemuck::Pod;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Bytes per checked block of a lazily checked file (the shard index
/// file's block checksums, format-spec/shard-index.md §2, kind 10).
pub(crate) const CHECK_BLOCK: usize = 16 << 10;

/// The crc32s of a mapped file's sections, per [`CHECK_BLOCK`]-byte block
/// of each, checked when an access first reads a block rather than all at
/// an open: an open of a read-only store then reads none of the shard
/// index file's tables (1.2 GB at 10M calls), and a lookup checks the few
/// blocks it reads. A block that fails is recorded ([`BlockCheck::damage`])
/// and the access reads nothing of it: lookups miss, and the read that
/// made them reports the damage (`Snapshot` checks it).
#[derive(Debug)]
pub(crate) struct BlockCheck {
    map: Arc<Mapping>,
    /// The file, for errors.
    path: std::path::PathBuf,
    /// Per section (by the caller's numbering): its byte offset, its length,
    /// the index of its first block in `crcs`.
    sections: Vec<Option<(usize, usize, usize)>>,
    crcs: Table<u32>,
    /// One bit per block: checked and good.
    good: Box<[AtomicU64]>,
    /// Per section: every block checked and good.
    whole: Box<[AtomicBool]>,
    /// The first block that failed: its offset in the file, and what.
    damage: OnceLock<(u64, String)>,
    /// What the file is and how a view does without it, for the error.
    note: &'static str,
}

/// [`BlockCheck`]'s note for the shard index file.
pub(crate) const INDEX_FILE_NOTE: &str = "a lookup of this read-only view may have missed (a read-only open checks \
     the shard index file a block at a time, as lookups read it). The file is a cache of the shards: \
     `Store::refresh` loads the view again without it, and a writable open (`trajlog compact`, any writer) writes \
     it anew";

/// [`BlockCheck`]'s note for the shard index file of a writer (a writable
/// open checks it a block at a time too).
pub(crate) const WRITER_INDEX_FILE_NOTE: &str = "a lookup of the writer may have missed (a writable open checks the \
     shard index file a block at a time, as lookups read it): the store refuses further writes, and removes the \
     file, a cache of the shards, at its next write, flush or close; the next open rebuilds it from the shards";

impl BlockCheck {
    /// `sections[k]`: section `k`'s (byte offset, length, first block in
    /// `crcs`), or `None` for one not checked here; `None` unless `crcs`
    /// has a crc for every block. `note` ends the error of a failed block:
    /// what a lookup that met it did, and how to do without the file.
    pub(crate) fn new(
        map: Arc<Mapping>,
        path: &std::path::Path,
        sections: Vec<Option<(usize, usize, usize)>>,
        crcs: Table<u32>,
        note: &'static str,
    ) -> Option<BlockCheck> {
        let blocks = crcs.len();
        for (offset, len, first) in sections.iter().flatten() {
            let end = offset.checked_add(*len)?;
            if end > map.bytes().len() || first.checked_add(len.div_ceil(CHECK_BLOCK))? > blocks {
                return None;
            }
        }
        let whole = sections.iter().map(|s| AtomicBool::new(s.is_none_or(|(_, len, _)| len == 0))).collect();
        Some(BlockCheck {
            map,
            path: path.to_path_buf(),
            sections,
            crcs,
            good: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            whole,
            damage: OnceLock::new(),
            note,
        })
    }

    /// Whether bytes `range` of section `section` (offsets within it) are
    /// in blocks that pass their crc32, checking those not checked yet.
    /// Bytes past the section's end are not this check's to refuse.
    pub(crate) fn ok(&self, section: usize, range: std::ops::Range<usize>) -> bool {
        let Some(Some((offset, len, first))) = self.sections.get(section) else { return true };
        let end = range.end.min(*len);
        if range.start >= end || self.whole.get(section).is_some_and(|w| w.load(Ordering::Acquire)) {
            return true;
        }
        // The first block that fails ends the check.
        (range.start / CHECK_BLOCK..=(end - 1) / CHECK_BLOCK).all(|b| {
            let bytes = offset + b * CHECK_BLOCK..offset + ((b + 1) * CHECK_BLOCK).min(*len);
            self.block(first + b, bytes)
        })
    }

    /// Check every block of section `section`; whether all pass.
    pub(crate) fn ok_whole(&self, section: usize) -> bool {
        let Some(Some((offset, len, _))) = self.sections.get(section) else { return true };
        if self.whole.get(section).is_some_and(|w| w.load(Ordering::Acquire)) {
            return true;
        }
        // 16 MiB at a time, each step's pages given back after it: a check
        // of a whole 1.2 GB file leaves nothing resident.
        const STEP: usize = 1024 * CHECK_BLOCK;
        let ok = (0..len.div_ceil(STEP)).all(|k| {
            let range = k * STEP..((k + 1) * STEP).min(*len);
            let ok = self.ok(section, range.clone());
            self.map.release_range(offset + range.start..offset + range.end);
            ok
        });
        if ok {
            if let Some(w) = self.whole.get(section) {
                w.store(true, Ordering::Release);
            }
        }
        ok
    }

    /// The file it checks.
    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Check every block of every section; whether all pass.
    pub(crate) fn ok_all(&self) -> bool {
        (0..self.sections.len()).all(|k| self.ok_whole(k))
    }

    fn block(&self, i: usize, bytes: std::ops::Range<usize>) -> bool {
        let (word, bit) = (self.good.get(i / 64), 1u64 << (i % 64));
        let Some(word) = word else { return false };
        if word.load(Ordering::Acquire) & bit != 0 {
            return true;
        }
        let at = bytes.start;
        let got = self.map.bytes().get(bytes).map(crc32fast::hash);
        if got.is_some() && got == self.crcs.get(i).copied() {
            word.fetch_or(bit, Ordering::Release);
            return true;
        }
        self.damage.get_or_init(|| (at as u64, format!("the {CHECK_BLOCK}-byte block at offset {at} fails its crc32")));
        false
    }

    /// What failed, once a block did, as the error a read reports.
    pub(crate) fn damage(&self) -> Option<crate::error::Error> {
        let (at, what) = self.damage.get()?;
        Some(crate::error::Error::corrupt(&self.path, *at, format!("{what}: {}", self.note)))
    }

    /// How many blocks were checked and passed (for tests).
    #[cfg(test)]
    pub(crate) fn good_blocks(&self) -> usize {
        self.good.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as usize).sum()
    }
}

/// A slice of `T`s, owned or in a mapping.
pub(crate) enum Table<T> {
    Owned(Vec<T>),
    /// `len` elements at byte `start` of `map`; checked when made
    /// ([`Table::mapped`]): in bounds and aligned for `T`. With `check`,
    /// its bytes are section `.1` of a lazily checked file: the accessors
    /// below check the blocks they read, and the whole slice (`Deref`,
    /// [`Table::as_slice`]) checks every block first, once (empty when one
    /// fails).
    Mapped { map: Arc<Mapping>, start: usize, len: usize, check: Option<(Arc<BlockCheck>, usize)> },
}

impl<T: Pod> Table<T> {
    /// `len` elements of `T` at byte `start` of `map`, if they lie in it
    /// and are aligned for `T`.
    pub(crate) fn mapped(map: &Arc<Mapping>, start: usize, len: usize) -> Option<Table<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        let slice = map.bytes().get(start..start.checked_add(bytes)?)?;
        bytemuck::try_cast_slice::<u8, T>(slice).ok()?;
        Some(Table::Mapped { map: map.clone(), start, len, check: None })
    }

    /// This table, its blocks checked lazily by `check` as section `section`.
    pub(crate) fn checked_by(self, check: &Arc<BlockCheck>, section: usize) -> Table<T> {
        match self {
            Table::Mapped { map, start, len, .. } => {
                Table::Mapped { map, start, len, check: Some((check.clone(), section)) }
            }
            owned => owned,
        }
    }

    /// Every element, unchecked.
    fn raw(&self) -> &[T] {
        match self {
            Table::Owned(v) => v,
            Table::Mapped { map, start, len, .. } => {
                let end = start.saturating_add(len.saturating_mul(std::mem::size_of::<T>()));
                // Checked in `mapped`: never empty for a non-empty table.
                map.bytes().get(*start..end).and_then(|b| bytemuck::try_cast_slice(b).ok()).unwrap_or(&[])
            }
        }
    }

    /// Whether elements `range` are in blocks that pass their check (a
    /// table not checked lazily: always).
    fn ok(&self, range: std::ops::Range<usize>) -> bool {
        match self {
            Table::Mapped { check: Some((c, section)), .. } => {
                let w = std::mem::size_of::<T>();
                c.ok(*section, range.start.saturating_mul(w)..range.end.saturating_mul(w))
            }
            _ => true,
        }
    }

    /// Every element, every block checked first (empty when one fails).
    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Table::Mapped { check: Some((c, section)), .. } if !c.ok_whole(*section) => &[],
            _ => self.raw(),
        }
    }

    /// Number of elements (no check: the length is the directory's).
    pub(crate) fn len(&self) -> usize {
        match self {
            Table::Owned(v) => v.len(),
            Table::Mapped { len, .. } => *len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i`, its block checked.
    pub(crate) fn at(&self, i: usize) -> Option<&T> {
        let v = self.raw().get(i)?;
        self.ok(i..i + 1).then_some(v)
    }

    /// Elements `range`, their blocks checked.
    pub(crate) fn span(&self, range: std::ops::Range<usize>) -> Option<&[T]> {
        let v = self.raw().get(range.clone())?;
        self.ok(range).then_some(v)
    }

    /// [`slice::partition_point`] of `pred` (true, then false), checking
    /// the block of each element it reads: `None` when one fails.
    pub(crate) fn partition_point(&self, pred: impl Fn(&T) -> bool) -> Option<usize> {
        self.partition_point_in(0..self.len(), pred)
    }

    /// [`Table::partition_point`] for a caller that knows every element
    /// before `from` holds `pred`: a gallop forward from `from` (probes at
    /// 1, 2, 4, … elements on, then a binary search between the last two),
    /// so a walk in order reads O(log distance) elements near where it is,
    /// never the elements it passes over.
    pub(crate) fn partition_point_from(&self, from: usize, pred: impl Fn(&T) -> bool) -> Option<usize> {
        let len = self.len();
        let (mut lo, mut step) = (from.min(len), 1usize);
        let hi = loop {
            let probe = from.saturating_add(step - 1);
            if probe >= len {
                break len;
            }
            if !pred(self.at(probe)?) {
                break probe;
            }
            lo = probe + 1;
            step = step.saturating_mul(2);
        };
        self.partition_point_in(lo..hi, pred)
    }

    /// One step of a walk in order: move `at` (every element before it
    /// holds `pred`) to the partition point by a gallop
    /// ([`Table::partition_point_from`]; unchanged when a block does not
    /// check), give back the pages passed each time the walk crosses a
    /// multiple of 2^20 elements, and return the element there.
    pub(crate) fn walk_to(&self, at: &mut usize, pred: impl Fn(&T) -> bool) -> Option<&T> {
        let before = *at;
        *at = self.partition_point_from(before, pred).unwrap_or(before);
        if before >> 20 != *at >> 20 {
            self.release_before(*at);
        }
        self.at(*at)
    }

    /// [`Table::partition_point`] within elements `range` (the caller
    /// knows that those before it hold `pred` and those after do not).
    pub(crate) fn partition_point_in(
        &self,
        range: std::ops::Range<usize>,
        pred: impl Fn(&T) -> bool,
    ) -> Option<usize> {
        let raw = self.raw();
        let (mut lo, mut hi) = (range.start, range.end.min(raw.len()));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let v = raw.get(mid)?;
            if !self.ok(mid..mid + 1) {
                return None;
            }
            if pred(v) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Some(lo)
    }

    /// The elements from `at` on, for as long as `pred` holds: `None` when
    /// a block of them, or of the element that ends the run, fails.
    pub(crate) fn run_from(&self, at: usize, pred: impl Fn(&T) -> bool) -> Option<&[T]> {
        let raw = self.raw().get(at..).unwrap_or_default();
        let n = raw.iter().take_while(|v| pred(v)).count();
        // The element that ended the run decided its length: checked too.
        let end = (at + n + 1).min(self.len());
        if !self.ok(at..end) {
            return None;
        }
        self.raw().get(at..at + n)
    }

    /// What failed of the blocks of the file it lies in, once one did (a
    /// lazily checked table's; `None` for any other).
    pub(crate) fn damage(&self) -> Option<crate::error::Error> {
        match self {
            Table::Mapped { check: Some((c, _)), .. } => c.damage(),
            _ => None,
        }
    }

    /// Give back this process's resident pages of elements `..end` (a
    /// mapped table's; an owned one holds none): a reader that walks the
    /// table once, forward, keeps only what it reads next resident.
    pub(crate) fn release_before(&self, end: usize) {
        if let Table::Mapped { map, start, len, .. } = self {
            let bytes = end.min(*len).saturating_mul(std::mem::size_of::<T>());
            map.release_range(*start..start.saturating_add(bytes));
        }
    }

    /// Give back this process's resident pages of the mapping this table
    /// lies in (all of it: the other tables of its file too).
    pub(crate) fn release_mapping(&self) {
        if let Table::Mapped { map, .. } = self {
            map.release_pages();
        }
    }

    /// Whether this table lies in `map` (the same mapping object).
    pub(crate) fn is_in(&self, map: &Arc<Mapping>) -> bool {
        matches!(self, Table::Mapped { map: m, .. } if Arc::ptr_eq(m, map))
    }

    /// Bytes of the heap this table holds (a mapped one holds none).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Table::Owned(v) => v.capacity() * std::mem::size_of::<T>(),
            Table::Mapped { .. } => 0,
        }
    }
}

impl<T: Pod> std::ops::Deref for Table<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Pod> Clone for Table<T> {
    /// An owned table's rows copied; a mapped one's mapping shared.
    fn clone(&self) -> Self {
        match self {
            Table::Owned(v) => Table::Owned(v.clone()),
            Table::Mapped { map, start, len, check } => {
                Table::Mapped { map: map.clone(), start: *start, len: *len, check: check.clone() }
            }
        }
    }
}

impl<T: Pod + PartialEq> PartialEq for Table<T> {
    /// Equal rows, wherever they are.
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table::Owned(Vec::new())
    }
}

impl<T: Pod> From<Vec<T>> for Table<T> {
    fn from(v: Vec<T>) -> Self {
        Table::Owned(v)
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Table::Owned(v) => write!(f, "Table::Owned({} rows)", v.len()),
            Table::Mapped { start, len, check, .. } => {
                let lazy = if check.is_some() { ", checked lazily" } else { "" };
                write!(f, "Table::Mapped({len} rows at byte {start}{lazy})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapped table of u64s over `words`, written to a file, checked a
    /// block at a time against the crc32s of the bytes as first written.
    fn checked(words: &[u64], damage_at: Option<usize>) -> (tempfile::TempDir, Table<u64>, Arc<BlockCheck>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t");
        let mut bytes: Vec<u8> = bytemuck::cast_slice(words).to_vec();
        let crcs: Vec<u32> = bytes.chunks(CHECK_BLOCK).map(crc32fast::hash).collect();
        if let Some(at) = damage_at {
            bytes[at] ^= 1;
        }
        std::fs::write(&path, &bytes).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        let map = Arc::new(Mapping::map(&file, bytes.len() as u64, &path).expect("map"));
        let check = BlockCheck::new(map.clone(), &path, vec![Some((0, bytes.len(), 0))], Table::from(crcs), "test")
            .expect("covers the table");
        let check = Arc::new(check);
        let table = Table::<u64>::mapped(&map, 0, words.len()).expect("aligned").checked_by(&check, 0);
        (dir, table, check)
    }

    /// Point reads check the blocks they read, once; a run checks the
    /// element that ended it; a whole read is all or nothing.
    #[test]
    fn accessors_check_the_blocks_they_read() {
        let per = CHECK_BLOCK / 8;
        let mut words: Vec<u64> = (0..4 * per as u64).collect();
        // A run of equal values across the first two blocks' border.
        words[per - 1] = 5;
        words[per] = 5;
        let (_d, t, check) = checked(&words, None);
        assert_eq!(t.at(3), Some(&3));
        assert_eq!(check.good_blocks(), 1);
        assert_eq!(t.partition_point(|w| *w < 3 * per as u64 + 7), Some(3 * per + 7));
        assert_eq!(t.run_from(per - 1, |w| *w == 5).map(<[u64]>::len), Some(2));
        assert_eq!(t.as_slice().len(), words.len());
        assert_eq!(check.good_blocks(), 4);
        assert!(check.damage().is_none());

        // Damage in the second block: reads of the first still answer, a
        // run that its end element leaves short is refused, and so are
        // reads that need the second block.
        let (_d, t, check) = checked(&words, Some(per * 8 + 8 + 3));
        assert_eq!(t.at(7), Some(&7));
        assert_eq!(t.run_from(per - 2, |w| *w == per as u64 - 2).map(<[u64]>::len), Some(1));
        assert!(check.damage().is_none());
        assert_eq!(t.run_from(per - 1, |w| *w == 5), None, "the run reaches the bad block");
        assert!(check.damage().is_some());
        assert_eq!(t.at(per + 1), None);
        assert_eq!(t.span(0..per), Some(&words[..per]));
        assert_eq!(t.partition_point(|w| *w < 3 * per as u64), Some(3 * per), "reads no element of the bad block");
        assert_eq!(t.partition_point(|w| *w < per as u64 + 5), None);
        assert!(t.as_slice().is_empty());
        assert_eq!(t.len(), words.len());
    }

    proptest::proptest! {
        /// A gallop from any point before which the predicate holds lands
        /// where a binary search of the whole table does, in an owned
        /// table and in a mapped, block-checked one.
        #[test]
        fn a_gallop_finds_the_partition_point_of_a_binary_search(
            mut words in proptest::collection::vec(0u64..5_000, 0..3_000),
            cut in 0u64..5_100,
            from_frac in 0.0f64..1.0,
        ) {
            words.sort_unstable();
            let pred = |w: &u64| *w < cut;
            let expected = words.partition_point(pred);
            let from = (expected as f64 * from_frac) as usize;
            let owned = Table::from(words.clone());
            proptest::prop_assert_eq!(owned.partition_point_from(from, pred), Some(expected));
            proptest::prop_assert_eq!(owned.partition_point_from(expected, pred), Some(expected));
            if !words.is_empty() {
                let (_d, mapped, _check) = checked(&words, None);
                proptest::prop_assert_eq!(mapped.partition_point_from(from, pred), Some(expected));
            }
        }
    }

    /// A gallop that meets a damaged block misses (`None`), as a binary
    /// search that reads it does.
    #[test]
    fn a_gallop_into_a_damaged_block_misses() {
        let per = CHECK_BLOCK / 8;
        let words: Vec<u64> = (0..4 * per as u64).collect();
        let (_d, t, check) = checked(&words, Some(2 * per * 8 + 16));
        assert_eq!(t.partition_point_from(0, |w| *w < 5), Some(5), "stays in the first block");
        assert_eq!(t.partition_point_from(5, |w| *w < 3 * per as u64 + 1), None);
        assert!(check.damage().is_some());
    }
}
