//! `trajlog verify`'s check of the shard index file
//! (format-spec/shard-index.md) against what the `steps` shards' rows make
//! of it, in memory bounded by configuration rather than by the store.
//!
//! The check builds its own copy of the file from the rows, in a scratch
//! directory, and compares the two section by section. A build from every
//! row at once holds every row and every table in memory (11M rows: 5.4 GB);
//! here the rows come a shard at a time and are folded into the copy
//! [`CHUNK_ROWS`] at a time — the first chunk by a build, each later one by
//! the publication's streamed merge ([`super::index_merge`]), whose bytes
//! are a build's from every row. Memory then holds one chunk of rows and
//! what a merge holds (~5 bytes per row of the copy, its pages given back as
//! it goes); the scratch directory holds up to two copies of the file (~130
//! bytes per row each), written without fsyncs and removed at the end.

use super::index_file::{self, ShardIndex, ShardKey};
use super::reader::ShardRow;
use std::path::{Path, PathBuf};

/// Rows folded into the copy at a time: ~150 MB of decoded rows.
pub(crate) const CHUNK_ROWS: usize = 1 << 20;

/// What the check found.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// The file is what the rows make (or there is no file, or it is a
    /// stale one for other shards, which an open only does not use).
    Same,
    /// The file differs or fails its own checks: what, for the report.
    Differs(String),
    /// The check could not be made (no room for the copy, …): why. Not
    /// damage.
    NotChecked(String),
}

/// A scratch directory, removed with what it holds when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn create() -> std::io::Result<Scratch> {
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!("trajlog-verify-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The check under way: fed each `steps` shard's key and rows in the
/// manifest's order ([`IndexCheck::add`]), then [`IndexCheck::finish`]ed.
pub(crate) struct IndexCheck {
    /// The file checked (`None` when it failed its own checks: `settled`
    /// says so).
    file: Option<ShardIndex>,
    /// Its shards' keys met so far (a prefix of the file's).
    keys: Vec<ShardKey>,
    chunk: Vec<ShardRow>,
    /// Rows folded at a time ([`CHUNK_ROWS`]; tests take fewer).
    chunk_rows: usize,
    /// The copy made of the chunks folded so far (the shards of
    /// `keys[..built_through]`).
    built: Option<ShardIndex>,
    scratch: Option<Scratch>,
    /// Set once the outcome is known before the end: a stale file, or a
    /// check that cannot be made.
    settled: Option<Verdict>,
}

impl IndexCheck {
    /// The check of the file in `shards_dir`: `None` when there is none.
    pub(crate) fn open(shards_dir: &Path) -> Option<IndexCheck> {
        let (file, settled) = match ShardIndex::open(shards_dir) {
            Ok(Some(ix)) => (Some(ix), None),
            Ok(None) => return None,
            // A file that fails its own checks.
            Err(what) => (None, Some(Verdict::Differs(what))),
        };
        Some(IndexCheck {
            file,
            keys: Vec::new(),
            chunk: Vec::new(),
            chunk_rows: CHUNK_ROWS,
            built: None,
            scratch: None,
            settled,
        })
    }

    /// The next `steps` shard (in the manifest's order): its key and rows
    /// (their shard number its place in that order).
    pub(crate) fn add(&mut self, key: ShardKey, rows: Vec<ShardRow>) {
        let Some(file) = self.file.as_ref().filter(|_| self.settled.is_none()) else { return };
        match file.shards().get(self.keys.len()) {
            // Shards published since the file was written: an open reads
            // their rows from them, and so does nothing here.
            None => return,
            // A file for other shards: not used by an open, not damage.
            Some(k) if *k != key => {
                self.settle(Verdict::Same);
                return;
            }
            Some(_) => {}
        }
        self.keys.push(key);
        self.chunk.extend(rows);
        if self.chunk.len() >= self.chunk_rows {
            self.fold();
        }
    }

    /// The verdict, once every `steps` shard was fed.
    pub(crate) fn finish(mut self) -> Verdict {
        if let Some(v) = self.settled.take() {
            return v;
        }
        let described = self.file.as_ref().map_or(0, |f| f.shards().len());
        if self.keys.len() < described {
            // Fewer shards than the file names: one it describes is gone.
            return Verdict::Same;
        }
        if !self.chunk.is_empty() || self.built.is_none() {
            self.fold();
        }
        if let Some(v) = self.settled.take() {
            return v;
        }
        match self.built.as_ref().zip(self.file.as_ref()).map(|(b, f)| f.differs_from(b)) {
            Some(None) => Verdict::Same,
            Some(Some(kind)) => Verdict::Differs(format!("section {kind} differs from what the shards' rows make")),
            None => Verdict::NotChecked("internal: no copy was built".into()),
        }
    }

    fn settle(&mut self, v: Verdict) {
        self.settled = Some(v);
        self.chunk = Vec::new();
        self.built = None;
        self.scratch = None;
    }

    /// Fold the chunk into the copy (the first by a build).
    fn fold(&mut self) {
        if let Err(v) = self.try_fold() {
            self.settle(v);
        }
    }

    fn try_fold(&mut self) -> Result<(), Verdict> {
        let not_checked = |what: String| Verdict::NotChecked(what);
        if self.scratch.is_none() {
            let s = Scratch::create().map_err(|e| {
                not_checked(format!("no scratch directory for its copy in {}: {e}", std::env::temp_dir().display()))
            })?;
            self.scratch = Some(s);
        }
        let dir = self.scratch.as_ref().map(|s| s.0.clone()).unwrap_or_default();
        let room = |e: crate::Error| {
            not_checked(format!(
                "writing its copy in {} failed ({e}); it needs about 2 × the file's size free there (TMPDIR)",
                dir.display()
            ))
        };
        let mut rows = std::mem::take(&mut self.chunk);
        match &self.built {
            None => {
                rows.sort_by_key(|r| r.loc);
                let built = index_file::build(&rows, true)
                    .ok_or_else(|| not_checked("more rows than its 32-bit row numbers hold".into()))?;
                let hot = built.hot_rows(&rows);
                index_file::write_scratch(&dir, &self.keys, &built.contents(&hot)).map_err(room)?;
            }
            Some(old) => {
                let merged = super::index_merge::write_merged(&dir, &self.keys, old, &|k| Some(k), &[&rows], super::index_merge::Dest::Scratch)
                    .map_err(room)?;
                if !merged {
                    return Err(not_checked(
                        "two shard rows share a log position (a consistent store has none), which only a build from every row at once handles".into(),
                    ));
                }
            }
        }
        drop(rows);
        self.built = None;
        let copy = ShardIndex::open(&dir)
            .map_err(|what| not_checked(format!("its copy does not read back: {what}")))?
            .ok_or_else(|| not_checked("its copy is gone".into()))?;
        self.built = Some(copy);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::index_merge::tests::{full, keys, rows, Rng};
    use super::super::reader::ShardRow;
    use super::*;

    /// The check of the file in `dir` fed `rows` (of `keys`' shards),
    /// folded `chunk` rows at a time.
    fn check(dir: &Path, keys: &[ShardKey], rows: &[ShardRow], chunk: usize) -> Verdict {
        let mut c = IndexCheck::open(dir).expect("a file");
        c.chunk_rows = chunk;
        for (k, key) in keys.iter().enumerate() {
            c.add(key.clone(), rows.iter().filter(|r| r.pos.shard == k as u32).cloned().collect());
        }
        c.finish()
    }

    /// Rows of 1 to 8 shards, some replacing the trace ids of earlier ones
    /// (hot sessions), some of two sessions.
    fn store_rows(rng: &mut Rng) -> (Vec<ShardKey>, Vec<ShardRow>) {
        let mut next_loc = 0;
        let first = 1 + rng.below(5) as u32;
        let mut all = rows(rng, &mut next_loc, 0, first, &[], &[]);
        let later = rng.below(4) as u32;
        let more = rows(rng, &mut next_loc, first, later, &all, &[]);
        all.extend(more);
        (keys((first + later) as usize, "a"), all)
    }

    /// Folded in chunks of any size — one row, part of a shard, several
    /// shards, everything — the copy is the file a build from every row
    /// writes: a file so written checks out.
    #[test]
    fn a_file_built_from_the_rows_checks_out_whatever_the_chunks() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let (keys, all) = store_rows(&mut rng);
            let dir = tempfile::tempdir().expect("tempdir");
            full(dir.path(), &keys, &all);
            for chunk in [1, 1 + rng.below(40) as usize, 1 + rng.below(200) as usize, usize::MAX] {
                let v = check(dir.path(), &keys, &all, chunk);
                assert!(matches!(v, Verdict::Same), "seed {seed}, chunks of {chunk}, {} rows: {v:?}", all.len());
            }
        }
    }

    /// A file whose checksums pass but whose tables are not what the rows
    /// make (a row it describes with another timestamp, a row it lacks)
    /// differs, however the rows are folded.
    #[test]
    fn a_file_of_other_rows_differs() {
        for seed in 1..=20u64 {
            let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03));
            let (keys, all) = store_rows(&mut rng);
            let mut other = all.clone();
            let i = rng.below(other.len() as u64) as usize;
            if seed % 2 == 0 {
                other[i].timestamp += 0.5;
            } else {
                other.remove(i);
            }
            let dir = tempfile::tempdir().expect("tempdir");
            full(dir.path(), &keys, &other);
            for chunk in [1 + rng.below(30) as usize, usize::MAX] {
                let v = check(dir.path(), &keys, &all, chunk);
                assert!(matches!(v, Verdict::Differs(ref w) if w.contains("differs")), "seed {seed}, chunks of {chunk}: {v:?}");
            }
        }
    }

    /// A file of other shards is only not used (no verdict against it);
    /// shards published after the file's are not its to describe; a file
    /// that fails its own checks differs.
    #[test]
    fn stale_files_later_shards_and_damaged_files() {
        let mut rng = Rng(99);
        let (keys, all) = store_rows(&mut rng);
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = full(dir.path(), &keys, &all);
        let mut renamed = keys.clone();
        renamed[0].len += 1;
        assert!(matches!(check(dir.path(), &renamed, &all, 7), Verdict::Same));
        // Described: the first shards; one more fed after them.
        let described = keys.len() - 1;
        let first: Vec<ShardRow> = all.iter().filter(|r| (r.pos.shard as usize) < described).cloned().collect();
        let dir2 = tempfile::tempdir().expect("tempdir");
        full(dir2.path(), &keys[..described], &first);
        assert!(matches!(check(dir2.path(), &keys, &all, 7), Verdict::Same));
        // A file of no shards (a store whose shards were all collected)
        // is what no rows make.
        let empty = tempfile::tempdir().expect("tempdir");
        full(empty.path(), &[], &[]);
        assert!(matches!(check(empty.path(), &[], &[], 7), Verdict::Same));
        // A byte flipped: the file fails its section checksums.
        let mut damaged = bytes;
        let at = damaged.len() / 2;
        damaged[at] ^= 1;
        std::fs::write(dir.path().join(index_file::INDEX_FILE_NAME), &damaged).expect("write");
        assert!(matches!(check(dir.path(), &keys, &all, 7), Verdict::Differs(_)));
    }
}
