//! The shard index file, `DIR/shards/index.tsi` (format-spec/shard-index.md):
//! what an open would otherwise decode from every `steps` shard's index
//! columns and sort — the placement of every shard row, the frozen layer
//! (`index/frozen.rs`), the rows that are not frozen, and the id hashes a
//! writer counts — written once per publication and mapped at the next
//! open, which then reads no shard row.
//!
//! The file is a cache of a pure function of the `steps` shards it lists
//! (their paths, lengths and footer checksums): an open uses it only when
//! that list is the manifest's, and otherwise (no file, another list, a
//! failed check) decodes the shards as before; a writable open then writes
//! it anew. So losing or damaging it costs time, never data, and a crash at
//! any point of its replacement leaves either file, both consistent.

use super::reader::{ShardFile, ShardPos, ShardRow};
use super::set::Placement;
use crate::error::{Error, Result};
use crate::format::record::Loc;
use crate::index::frozen::{cold_rows, id_hash, AsRow, Frozen, FrozenRow, FrozenSession, FrozenTables, RowRef, TraceEntry};
use crate::storage::fault::{self, Faults, Op};
use crate::storage::mmap::Mapping;
use crate::storage::WritebackFile;
use crate::storage::table::{BlockCheck, Table, CHECK_BLOCK};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

/// Its name in `DIR/shards/`.
pub(crate) const INDEX_FILE_NAME: &str = "index.tsi";
/// The name it is written under before the rename.
pub(crate) const TMP_NAME: &str = "index.tsi.tmp";
const MAGIC: [u8; 8] = *b"TRJLSIX1";
/// The version this build writes and reads.
pub(crate) const INDEX_FILE_VERSION: u32 = 1;
const HEADER_LEN: usize = 24;
const DIR_ENTRY_LEN: usize = 32;

/// Section kinds, in the order written (format-spec/shard-index.md §2).
pub(crate) const SHARDS: u32 = 1;
pub(crate) const PLACEMENTS: u32 = 2;
pub(crate) const FROZEN_ROWS: u32 = 3;
pub(crate) const FROZEN_SESSIONS: u32 = 4;
pub(crate) const TRACE_TABLE: u32 = 5;
pub(crate) const TEXT: u32 = 6;
pub(crate) const HOT_ROWS: u32 = 7;
pub(crate) const TRACE_HASHES: u32 = 8;
pub(crate) const SESSION_HASHES: u32 = 9;
const SECTIONS: [u32; 9] =
    [SHARDS, PLACEMENTS, FROZEN_ROWS, FROZEN_SESSIONS, TRACE_TABLE, TEXT, HOT_ROWS, TRACE_HASHES, SESSION_HASHES];
/// The block checksums: a crc32 per [`CHECK_BLOCK`] bytes of each section
/// before it (format-spec/shard-index.md §2), written after [`SECTIONS`].
/// A reader without it checks every section whole; one with it checks the
/// tables a block at a time, as lookups read them.
pub(crate) const BLOCK_CRCS: u32 = 10;
/// The sections a read-only open checks a block at a time (the others,
/// small, whole at the open).
const LAZY: [u32; 7] = [PLACEMENTS, FROZEN_ROWS, FROZEN_SESSIONS, TRACE_TABLE, TEXT, TRACE_HASHES, SESSION_HASHES];
/// "Not a frozen row", in a placement's `frozen_row`.
pub(crate) const NOT_FROZEN: u32 = u32::MAX;

/// A `steps` shard as the file names it: its path under `DIR/shards/`,
/// its length and the crc32 of its footer (as the manifest's checksum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardKey {
    pub path: String,
    pub len: u64,
    pub footer_crc32: u32,
}

impl ShardKey {
    /// The key of an open shard file under `shards_dir`.
    pub(crate) fn of(f: &ShardFile, shards_dir: &Path) -> ShardKey {
        let path = f.path.strip_prefix(shards_dir).unwrap_or(&f.path).to_string_lossy().into_owned();
        let c = f.checksum();
        ShardKey { path, len: c.len, footer_crc32: c.footer_crc32 }
    }
}

/// What the file holds, built from every shard row (sorted by log
/// position): also what an open without the file uses in memory.
pub(crate) struct Built {
    pub frozen: Frozen,
    /// Per input row, its frozen row, if frozen.
    pub frozen_row: Vec<Option<u32>>,
    /// Sorted by log position, one per position (of two rows at one
    /// position the later shard's, as a replay would keep).
    pub placements: Vec<Placement>,
    /// The input rows not frozen, by their index in the input.
    pub hot: Vec<u32>,
    /// Every row's trace id hash, sorted.
    pub trace_hashes: Vec<u64>,
    /// Every row's session hashes (`session_id` and uids), sorted.
    pub session_hashes: Vec<u64>,
}

/// Build the file's contents from every shard row, sorted by log position.
/// `None` past the 32-bit row numbers of the frozen layer.
pub(crate) fn build<R: AsRow>(rows: &[R], with_hashes: bool) -> Option<Built> {
    let cold = cold_rows(rows);
    let (frozen, frozen_row) = Frozen::build(rows, &cold)?;
    drop(cold);
    let mut placements: Vec<Placement> = rows
        .iter()
        .zip(&frozen_row)
        .map(|(r, f)| Placement::new(r.row().loc, r.row().pos, f.unwrap_or(NOT_FROZEN)))
        .collect();
    placements.sort_by(|a, b| a.loc().cmp(&b.loc()).then(a.pos().shard.cmp(&b.pos().shard)));
    placements.reverse();
    placements.dedup_by_key(|p| p.loc());
    placements.reverse();
    let hot = frozen_row.iter().enumerate().filter(|(_, f)| f.is_none()).map(|(i, _)| i as u32).collect();
    let (mut trace_hashes, mut session_hashes) = (Vec::new(), Vec::new());
    if with_hashes {
        trace_hashes = rows.iter().map(|r| id_hash(r.row().trace_id)).collect();
        session_hashes = rows.iter().flat_map(|r| r.row().sessions.iter().map(id_hash)).collect();
        trace_hashes.sort_unstable();
        session_hashes.sort_unstable();
    }
    Some(Built { frozen, frozen_row, placements, hot, trace_hashes, session_hashes })
}

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

pub(crate) fn encode_shards(shards: &[ShardKey]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in shards {
        out.extend_from_slice(&s.len.to_le_bytes());
        out.extend_from_slice(&s.footer_crc32.to_le_bytes());
        out.extend_from_slice(&(s.path.len() as u32).to_le_bytes());
        out.extend_from_slice(s.path.as_bytes());
        out.resize(pad8(out.len()), 0);
    }
    out
}

pub(crate) fn encode_hot(hot: &[RowRef<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in hot {
        for v in [r.loc.segment, r.loc.offset, r.timestamp.to_bits()] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [r.pos.shard, r.pos.row_group, r.pos.row, r.trace_id.len() as u32, r.sessions.len() as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(r.trace_id.as_bytes());
        for s in r.sessions.iter() {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        out.resize(pad8(out.len()), 0);
    }
    out
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", path.display()), e)
}

/// What the file holds, borrowed from where it was built.
pub(crate) struct Contents<'a> {
    pub frozen: FrozenTables<'a>,
    /// Sorted by log position, one per position.
    pub placements: &'a [Placement],
    /// The rows not frozen, sorted by log position.
    pub hot: &'a [RowRef<'a>],
    pub trace_hashes: &'a [u64],
    pub session_hashes: &'a [u64],
}

impl Built {
    /// What the file holds: this, with `hot`, the rows not frozen
    /// ([`Built::hot_rows`]).
    pub(crate) fn contents<'a>(&'a self, hot: &'a [RowRef<'a>]) -> Contents<'a> {
        Contents {
            frozen: self.frozen.tables(),
            placements: &self.placements,
            hot,
            trace_hashes: &self.trace_hashes,
            session_hashes: &self.session_hashes,
        }
    }

    /// The hot rows of `rows` (the rows this was built from).
    pub(crate) fn hot_rows<'a, R: AsRow>(&self, rows: &'a [R]) -> Vec<RowRef<'a>> {
        self.hot.iter().filter_map(|i| rows.get(*i as usize).map(AsRow::row)).collect()
    }
}

/// The sections of a file (kind, bytes, entries), in the order written.
fn sections<'a>(
    shards: &[ShardKey],
    c: &'a Contents<'a>,
    shards_bytes: &'a [u8],
    hot_bytes: &'a [u8],
) -> [(u32, &'a [u8], u64); 9] {
    let f = &c.frozen;
    [
        (SHARDS, shards_bytes, shards.len() as u64),
        (PLACEMENTS, bytemuck::cast_slice(c.placements), c.placements.len() as u64),
        (FROZEN_ROWS, bytemuck::cast_slice(f.rows), f.rows.len() as u64),
        (FROZEN_SESSIONS, bytemuck::cast_slice(f.sessions), f.sessions.len() as u64),
        (TRACE_TABLE, bytemuck::cast_slice(f.by_trace), f.by_trace.len() as u64),
        (TEXT, f.text, f.text.len() as u64),
        (HOT_ROWS, hot_bytes, c.hot.len() as u64),
        (TRACE_HASHES, bytemuck::cast_slice(c.trace_hashes), c.trace_hashes.len() as u64),
        (SESSION_HASHES, bytemuck::cast_slice(c.session_hashes), c.session_hashes.len() as u64),
    ]
}

/// Write the file for `shards` (the manifest's `steps` shards, in order:
/// a placement's shard number indexes this list) into `shards_dir`,
/// replacing any: a temporary file, fsynced, renamed, the directory
/// fsynced. Returns its size.
pub(crate) fn write(shards_dir: &Path, shards: &[ShardKey], c: &Contents<'_>, faults: &Faults) -> Result<u64> {
    write_with(FileWriter::create(shards_dir, faults)?, shards_dir, shards, c, faults)
}

/// [`write`] into a scratch directory (`trajlog verify`'s own copy): not
/// fsynced.
pub(crate) fn write_scratch(dir: &Path, shards: &[ShardKey], c: &Contents<'_>) -> Result<u64> {
    write_with(FileWriter::create_scratch(dir)?, dir, shards, c, &None)
}

fn write_with(
    mut w: FileWriter,
    shards_dir: &Path,
    shards: &[ShardKey],
    c: &Contents<'_>,
    faults: &Faults,
) -> Result<u64> {
    let (shards_bytes, hot_bytes) = (encode_shards(shards), encode_hot(c.hot));
    for (kind, bytes, count) in sections(shards, c, &shards_bytes, &hot_bytes) {
        w.section(kind, |out| {
            out.put(bytes)?;
            Ok(count)
        })?;
    }
    w.finish(shards_dir, faults)
}

/// A section being written: its bytes go to the file through a running
/// crc32.
pub(crate) struct SectionSink<'a> {
    w: &'a mut BufWriter<WritebackFile>,
    crc: crc32fast::Hasher,
    len: u64,
    /// The crc32 of each full [`CHECK_BLOCK`] so far, and of the block
    /// being written.
    blocks: &'a mut Vec<u32>,
    block: crc32fast::Hasher,
}

impl SectionSink<'_> {
    pub(crate) fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc.update(bytes);
        let mut rest = bytes;
        while !rest.is_empty() {
            let room = CHECK_BLOCK - (self.len as usize % CHECK_BLOCK);
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.block.update(now);
            self.len += now.len() as u64;
            if (self.len as usize).is_multiple_of(CHECK_BLOCK) {
                let full = std::mem::replace(&mut self.block, crc32fast::Hasher::new());
                self.blocks.push(full.finalize());
            }
            rest = later;
        }
        self.w.write_all(bytes)
    }

    /// Fixed-width entries, as their bytes.
    pub(crate) fn put_all<T: bytemuck::Pod>(&mut self, entries: &[T]) -> std::io::Result<()> {
        self.put(bytemuck::cast_slice(entries))
    }
}

/// Writes the file (format-spec/shard-index.md §2) section after section
/// in the order of [`SECTIONS`], each streamed through a [`SectionSink`],
/// so that no section needs to be in memory whole; the header and the
/// directory, which come first, are written last, once every section's
/// place, length and crc32 are known. Into a temporary file that
/// [`FileWriter::finish`] fsyncs and renames over the file.
pub(crate) struct FileWriter {
    w: BufWriter<WritebackFile>,
    tmp: std::path::PathBuf,
    directory: Vec<u8>,
    sections: u32,
    at: u64,
    /// Every section's block crc32s so far ([`BLOCK_CRCS`]).
    blocks: Vec<u32>,
    /// Fsync the file and the directory (not for a scratch copy).
    durable: bool,
}

impl FileWriter {
    pub(crate) fn create(shards_dir: &Path, faults: &Faults) -> Result<FileWriter> {
        let dst = shards_dir.join(INDEX_FILE_NAME);
        fault::check(faults, Op::Replace { path: &dst }).map_err(|e| io(&dst, "replace", e))?;
        Self::create_in(shards_dir, true)
    }

    /// A file in a scratch directory, written without fsyncs (`trajlog
    /// verify` builds its own copy of the file there to compare).
    pub(crate) fn create_scratch(dir: &Path) -> Result<FileWriter> {
        Self::create_in(dir, false)
    }

    fn create_in(shards_dir: &Path, durable: bool) -> Result<FileWriter> {
        let tmp = shards_dir.join(TMP_NAME);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| io(&tmp, "create", e))?;
        let mut w = BufWriter::with_capacity(1 << 20, WritebackFile::new(file, durable));
        // Room for the header and the directory, written at the end.
        let at = HEADER_LEN + (SECTIONS.len() + 1) * DIR_ENTRY_LEN;
        w.write_all(&vec![0u8; at]).map_err(|e| io(&tmp, "write", e))?;
        Ok(FileWriter {
            w,
            tmp,
            directory: Vec::with_capacity((SECTIONS.len() + 1) * DIR_ENTRY_LEN),
            sections: 0,
            at: at as u64,
            blocks: Vec::new(),
            durable,
        })
    }

    /// Write section `kind` (the next of [`SECTIONS`]): `body` puts its
    /// bytes and returns its entry count.
    pub(crate) fn section(
        &mut self,
        kind: u32,
        body: impl FnOnce(&mut SectionSink<'_>) -> std::io::Result<u64>,
    ) -> Result<()> {
        if SECTIONS.get(self.sections as usize) != Some(&kind) {
            return Err(Error::new(crate::ErrorKind::Io, format!("internal: shard index section {kind} out of order")));
        }
        self.write_section(kind, body)?;
        self.sections += 1;
        Ok(())
    }

    fn write_section(
        &mut self,
        kind: u32,
        body: impl FnOnce(&mut SectionSink<'_>) -> std::io::Result<u64>,
    ) -> Result<()> {
        let mut sink = SectionSink {
            w: &mut self.w,
            crc: crc32fast::Hasher::new(),
            len: 0,
            blocks: &mut self.blocks,
            block: crc32fast::Hasher::new(),
        };
        let written = body(&mut sink).and_then(|count| {
            if !(sink.len as usize).is_multiple_of(CHECK_BLOCK) {
                let last = std::mem::replace(&mut sink.block, crc32fast::Hasher::new());
                sink.blocks.push(last.finalize());
            }
            let pad = (pad8(sink.len as usize) as u64 - sink.len) as usize;
            sink.w.write_all([0u8; 8].get(..pad).unwrap_or_default())?;
            Ok(count)
        });
        let count = written.map_err(|e| io(&self.tmp, "write", e))?;
        let (crc, len) = (sink.crc.finalize(), sink.len);
        self.directory.extend_from_slice(&kind.to_le_bytes());
        self.directory.extend_from_slice(&crc.to_le_bytes());
        self.directory.extend_from_slice(&self.at.to_le_bytes());
        self.directory.extend_from_slice(&len.to_le_bytes());
        self.directory.extend_from_slice(&count.to_le_bytes());
        self.at = pad8((self.at + len) as usize) as u64;
        Ok(())
    }

    /// Write the header and the directory, fsync, rename over the file,
    /// fsync the directory (no fsync for a scratch file); the file's size.
    pub(crate) fn finish(mut self, shards_dir: &Path, faults: &Faults) -> Result<u64> {
        if self.sections as usize != SECTIONS.len() {
            return Err(Error::new(crate::ErrorKind::Io, "internal: a shard index section was not written"));
        }
        let blocks = std::mem::take(&mut self.blocks);
        self.write_section(BLOCK_CRCS, |s| {
            for c in &blocks {
                s.put(&c.to_le_bytes())?;
            }
            Ok(blocks.len() as u64)
        })?;
        let sections = self.sections + 1;
        let FileWriter { w, tmp, directory, at, durable, .. } = self;
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&INDEX_FILE_VERSION.to_le_bytes());
        header.extend_from_slice(&sections.to_le_bytes());
        header.extend_from_slice(&crc32fast::hash(&directory).to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        let mut file = w.into_inner().map_err(|e| io(&tmp, "write", e.into_error()))?.into_inner();
        let written = (|| -> std::io::Result<()> {
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&header)?;
            file.write_all(&directory)?;
            if durable {
                file.sync_all()?;
            }
            Ok(())
        })();
        written.map_err(|e| io(&tmp, "write", e))?;
        drop(file);
        let dst = shards_dir.join(INDEX_FILE_NAME);
        std::fs::rename(&tmp, &dst).map_err(|e| io(&dst, "rename over", e))?;
        if durable {
            crate::storage::sync_dir(shards_dir, faults)?;
        }
        Ok(at)
    }
}

/// [`write`] the file, then open it back: `None` unless it now describes
/// exactly `shards` (best effort: the caller does without it).
pub(crate) fn write_and_open(
    shards_dir: &Path,
    shards: &[ShardKey],
    c: &Contents<'_>,
    faults: &Faults,
) -> Option<ShardIndex> {
    write(shards_dir, shards, c, faults).ok()?;
    ShardIndex::open(shards_dir).ok().flatten().filter(|ix| ix.shards() == shards)
}

/// The block check of a lazy open: the sections of [`LAZY`] (at `ranges`,
/// `kinds` in directory order) checked against the block checksums of
/// section [`BLOCK_CRCS`], whose own crc32 is checked here. `None` (check
/// every section whole) when the file has none or they do not fit.
fn block_check(
    map: &Arc<Mapping>,
    path: &Path,
    kinds: &[u32],
    ranges: &[std::ops::Range<usize>],
    note: &'static str,
) -> Option<BlockCheck> {
    let at = kinds.iter().position(|k| *k == BLOCK_CRCS)?;
    let r = ranges.get(at)?.clone();
    let directory = map.bytes().get(HEADER_LEN + at * DIR_ENTRY_LEN..HEADER_LEN + (at + 1) * DIR_ENTRY_LEN)?;
    let (crc, n) = (le_u32(directory, 4)?, usize::try_from(le_u64(directory, 24)?).ok()?);
    if r.len() != n.checked_mul(4)? || map.crc32_transient(r.clone()) != Some(crc) {
        return None;
    }
    let crcs = Table::<u32>::mapped(map, r.start, n)?;
    // The blocks of every section before it, in directory order.
    let mut sections: Vec<Option<(usize, usize, usize)>> = vec![None; 11];
    let mut first = 0usize;
    for (k, range) in kinds.iter().zip(ranges).take(at) {
        if LAZY.contains(k) {
            if let Some(s) = sections.get_mut(*k as usize) {
                *s = Some((range.start, range.len(), first));
            }
        }
        first = first.checked_add(range.len().div_ceil(CHECK_BLOCK))?;
    }
    // Every table checked lazily must be one the checksums cover (they are
    // written last); else the file is checked whole.
    if first != n || LAZY.iter().any(|k| sections.get(*k as usize).is_none_or(Option::is_none)) {
        return None;
    }
    BlockCheck::new(map.clone(), path, sections, crcs, note)
}

/// A section's place in the file.
#[derive(Debug, Clone, Copy, Default)]
struct Section {
    offset: usize,
    len: usize,
    count: usize,
}

/// An open, checked shard index file.
#[derive(Debug)]
pub(crate) struct ShardIndex {
    map: Arc<Mapping>,
    shards: Vec<ShardKey>,
    sections: [Section; 11],
    /// Checks the tables' blocks as they are read (a read-only open of a
    /// file with block checksums); `None`: every section was checked whole
    /// at the open.
    check: Option<Arc<BlockCheck>>,
    /// The rows not frozen, decoded (few: rows of several sessions, and
    /// replacements not yet collected), sorted by log position.
    hot: Vec<ShardRow>,
    len: u64,
    /// Per shard (the file's numbering), its frozen rows: counted once, by
    /// the first compaction that asks ([`ShardIndex::frozen_rows_per_shard`]).
    frozen_per_shard: std::sync::OnceLock<Vec<u64>>,
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)?.try_into().ok().map(u32::from_le_bytes)
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8)?.try_into().ok().map(u64::from_le_bytes)
}

impl ShardIndex {
    /// Give back this process's resident pages of the file (see
    /// [`Mapping::release_pages`]): what an open touched while it replayed
    /// the log over the frozen tables. Lookups fault pages in again.
    pub(crate) fn release_pages(&self) {
        self.map.release_pages();
    }

    /// Open and check the file in `shards_dir`: `Ok(None)` when there is
    /// none, `Err(what)` when it is damaged or of another version (the
    /// caller then does without it).
    pub(crate) fn open(shards_dir: &Path) -> std::result::Result<Option<ShardIndex>, String> {
        Self::open_with(shards_dir, None)
    }

    /// [`ShardIndex::open`], but with block checksums (section 10) the
    /// tables are not checked at the open: each block is checked when a
    /// lookup first reads it, and what fails is recorded
    /// ([`ShardIndex::damage`]). For a read-only open: a writer checks the
    /// whole file, whose tables its publications copy.
    pub(crate) fn open_lazy(shards_dir: &Path) -> std::result::Result<Option<ShardIndex>, String> {
        Self::open_with(shards_dir, Some(crate::storage::table::INDEX_FILE_NOTE))
    }

    /// [`ShardIndex::open_lazy`] for a writer: its lookups check the blocks
    /// they read as a reader's do, and whatever reads the tables whole (a
    /// publication, a retirement) calls [`ShardIndex::check_whole`] first.
    /// A failed block's error says what the writer does about it.
    pub(crate) fn open_lazy_for_writer(shards_dir: &Path) -> std::result::Result<Option<ShardIndex>, String> {
        Self::open_with(shards_dir, Some(crate::storage::table::WRITER_INDEX_FILE_NOTE))
    }

    /// `lazy`: the note of the block check's errors, or `None` to check
    /// the whole file here.
    fn open_with(shards_dir: &Path, lazy: Option<&'static str>) -> std::result::Result<Option<ShardIndex>, String> {
        let path = shards_dir.join(INDEX_FILE_NAME);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("open {}: {e}", path.display())),
        };
        if !cfg!(target_endian = "little") {
            return Err("the shard index file is little-endian; this machine is not".into());
        }
        let len = file.metadata().map_err(|e| format!("stat {}: {e}", path.display()))?.len();
        let map = Arc::new(Mapping::map(&file, len, &path).map_err(|e| e.to_string())?);
        let b = map.bytes();
        if b.get(..8) != Some(&MAGIC[..]) {
            return Err("not a shard index file (bad magic)".into());
        }
        let version = le_u32(b, 8).unwrap_or(0);
        if version != INDEX_FILE_VERSION {
            return Err(format!("shard index file version {version}, this build reads {INDEX_FILE_VERSION}"));
        }
        let count = le_u32(b, 12).unwrap_or(0) as usize;
        let dir_end = HEADER_LEN + count.saturating_mul(DIR_ENTRY_LEN);
        let directory = b.get(HEADER_LEN..dir_end).ok_or("the directory runs past the end of the file")?;
        if Some(crc32fast::hash(directory)) != le_u32(b, 16) {
            return Err("the directory fails its crc32".into());
        }
        let mut sections = [Section::default(); 11];
        let mut seen = [false; 11];
        let mut ranges = Vec::with_capacity(count);
        for e in directory.chunks_exact(DIR_ENTRY_LEN) {
            let kind = le_u32(e, 0).unwrap_or(0);
            let (offset, slen) = (le_u64(e, 8).unwrap_or(0), le_u64(e, 16).unwrap_or(0));
            if offset % 8 != 0 || offset.checked_add(slen).is_none_or(|end| end > len) {
                return Err(format!("section {kind} ({slen} bytes at {offset}) is misaligned or past the end"));
            }
            let range = usize::try_from(offset).ok().zip(usize::try_from(slen).ok()).map(|(o, l)| o..o + l);
            ranges.push(range.ok_or("a section does not fit in memory")?);
        }
        // Lazily: the tables' blocks, per the block checksums (when the
        // file has them), are checked as they are read, not here.
        let kinds: Vec<u32> = directory.chunks_exact(DIR_ENTRY_LEN).map(|e| le_u32(e, 0).unwrap_or(0)).collect();
        let check = lazy.and_then(|note| block_check(&map, &path, &kinds, &ranges, note));
        let whole: Vec<std::ops::Range<usize>> = kinds
            .iter()
            .zip(&ranges)
            .map(|(k, r)| if check.is_some() && LAZY.contains(k) { 0..0 } else { r.clone() })
            .collect();
        // Every other section's crc32 (two threads on a large file).
        let crcs = map.crc32s_transient(&whole);
        for ((e, got), r) in directory.chunks_exact(DIR_ENTRY_LEN).zip(crcs).zip(&whole) {
            let (kind, crc) = (le_u32(e, 0).unwrap_or(0), le_u32(e, 4).unwrap_or(0));
            let (offset, slen, n) = (le_u64(e, 8).unwrap_or(0), le_u64(e, 16).unwrap_or(0), le_u64(e, 24).unwrap_or(0));
            if got != Some(crc) && !r.is_empty() {
                return Err(format!("section {kind} ({slen} bytes at {offset}) fails its crc32"));
            }
            let (Ok(offset), Ok(slen), Ok(n)) = (usize::try_from(offset), usize::try_from(slen), usize::try_from(n))
            else {
                return Err("a section does not fit in memory".into());
            };
            if let (Some(s), Some(seen)) = (sections.get_mut(kind as usize), seen.get_mut(kind as usize)) {
                *s = Section { offset, len: slen, count: n };
                *seen = true;
            }
        }
        if let Some(k) = SECTIONS.iter().find(|k| !seen.get(**k as usize).copied().unwrap_or(false)) {
            return Err(format!("section {k} is missing"));
        }
        let mut ix = ShardIndex {
            map,
            shards: Vec::new(),
            sections,
            check: check.map(Arc::new),
            hot: Vec::new(),
            len,
            frozen_per_shard: std::sync::OnceLock::new(),
        };
        ix.shards = ix.parse_shards().ok_or("the shard list is malformed")?;
        ix.hot = ix.parse_hot().ok_or("the rows not frozen are malformed")?;
        // Every fixed-width table must fit its section.
        let widths: [(u32, usize); 7] = [
            (PLACEMENTS, std::mem::size_of::<Placement>()),
            (FROZEN_ROWS, std::mem::size_of::<FrozenRow>()),
            (FROZEN_SESSIONS, std::mem::size_of::<FrozenSession>()),
            (TRACE_TABLE, std::mem::size_of::<TraceEntry>()),
            (TRACE_HASHES, 8),
            (SESSION_HASHES, 8),
            (TEXT, 1),
        ];
        for (kind, width) in widths {
            let s = ix.section(kind);
            if s.count.checked_mul(width) != Some(s.len) {
                return Err(format!("section {kind}: {} entries of {width} bytes are not {} bytes", s.count, s.len));
            }
        }
        // Mapped at 8-aligned offsets of a page-aligned mapping: aligned.
        ix.frozen_tables()?;
        ix.table::<Placement>(PLACEMENTS)?;
        ix.table::<u64>(TRACE_HASHES)?;
        ix.table::<u64>(SESSION_HASHES)?;
        Ok(Some(ix))
    }

    fn section(&self, kind: u32) -> Section {
        self.sections.get(kind as usize).copied().unwrap_or_default()
    }

    fn bytes_of(&self, kind: u32) -> &[u8] {
        let s = self.section(kind);
        self.map.bytes().get(s.offset..s.offset + s.len).unwrap_or_default()
    }

    fn parse_shards(&self) -> Option<Vec<ShardKey>> {
        let b = self.bytes_of(SHARDS);
        let mut at = 0;
        let mut out = Vec::new();
        for _ in 0..self.section(SHARDS).count {
            let len = le_u64(b, at)?;
            let footer_crc32 = le_u32(b, at + 8)?;
            let n = le_u32(b, at + 12)? as usize;
            let path = std::str::from_utf8(b.get(at + 16..at + 16 + n)?).ok()?.to_owned();
            out.push(ShardKey { path, len, footer_crc32 });
            at = pad8(at + 16 + n);
        }
        (at == b.len()).then_some(out)
    }

    fn parse_hot(&self) -> Option<Vec<ShardRow>> {
        let b = self.bytes_of(HOT_ROWS);
        let mut at = 0;
        let mut out: Vec<ShardRow> = Vec::new();
        let text = |at: usize, n: usize| b.get(at..at.checked_add(n)?).and_then(|t| std::str::from_utf8(t).ok());
        for _ in 0..self.section(HOT_ROWS).count {
            let loc = Loc { segment: le_u64(b, at)?, offset: le_u64(b, at + 8)? };
            let timestamp = f64::from_bits(le_u64(b, at + 16)?);
            let pos = ShardPos { shard: le_u32(b, at + 24)?, row_group: le_u32(b, at + 28)?, row: le_u32(b, at + 32)? };
            let (tlen, nsessions) = (le_u32(b, at + 36)? as usize, le_u32(b, at + 40)? as usize);
            let trace_id: Arc<str> = Arc::from(text(at + 44, tlen)?);
            at += 44 + tlen;
            let mut sessions: Vec<Arc<str>> = Vec::with_capacity(nsessions.min(1024));
            for _ in 0..nsessions {
                let n = le_u32(b, at)? as usize;
                sessions.push(Arc::from(text(at + 4, n)?));
                at += 4 + n;
            }
            at = pad8(at);
            // Consecutive rows of one session list share it, as decoded rows do.
            let sessions: Arc<[Arc<str>]> = match out.last() {
                Some(prev) if *prev.sessions == *sessions => prev.sessions.clone(),
                _ => sessions.into(),
            };
            out.push(ShardRow { loc, trace_id, sessions, timestamp, pos });
        }
        (at == b.len() && out.windows(2).all(|w| w.first().map(|r| r.loc) <= w.get(1).map(|r| r.loc))).then_some(out)
    }

    fn table<T: bytemuck::Pod>(&self, kind: u32) -> std::result::Result<Table<T>, String> {
        let s = self.section(kind);
        let table = Table::mapped(&self.map, s.offset, s.count).ok_or_else(|| format!("section {kind} is misaligned"))?;
        Ok(match &self.check {
            Some(c) => table.checked_by(c, kind as usize),
            None => table,
        })
    }

    /// What failed of the blocks checked so far (a read-only open's lazy
    /// checks, [`ShardIndex::open_lazy`]), as the error a read reports.
    pub(crate) fn damage(&self) -> Option<Error> {
        self.check.as_ref()?.damage()
    }

    /// Check every block of the tables not checked yet (a lazy open's;
    /// nothing to do for a file checked whole at its open): what reads them
    /// whole — a publication's merge, a retirement — must not read a
    /// damaged table as an empty one. The pages read are given back after.
    pub(crate) fn check_whole(&self) -> Result<()> {
        let Some(check) = &self.check else { return Ok(()) };
        let ok = check.ok_all();
        self.release_pages();
        match (ok, check.damage()) {
            (true, None) => Ok(()),
            (_, Some(e)) => Err(e),
            (false, None) => Err(Error::corrupt(check.path(), 0, "a block fails its crc32")),
        }
    }

    /// The lazy block check, for tests.
    #[cfg(test)]
    pub(crate) fn block_check(&self) -> Option<&Arc<BlockCheck>> {
        self.check.as_ref()
    }

    /// Where section `kind` starts in the file, for tests.
    #[cfg(test)]
    pub(crate) fn section_offset(&self, kind: u32) -> usize {
        self.section(kind).offset
    }

    fn frozen_tables(&self) -> std::result::Result<Frozen, String> {
        Ok(Frozen::from_tables(
            self.table(TEXT)?,
            self.table(FROZEN_ROWS)?,
            self.table(FROZEN_SESSIONS)?,
            self.table(TRACE_TABLE)?,
        ))
    }

    /// A frozen layer over the file's tables (their checksums and sizes
    /// checked at [`ShardIndex::open`]).
    pub(crate) fn frozen(&self) -> Frozen {
        self.frozen_tables().unwrap_or_default()
    }

    /// The file's mapping (to tell whether a table comes from this file).
    pub(crate) fn mapping(&self) -> &Arc<Mapping> {
        &self.map
    }

    /// The `steps` shards the file was written for, in order.
    pub(crate) fn shards(&self) -> &[ShardKey] {
        &self.shards
    }

    /// Every shard row's placement, sorted by log position.
    pub(crate) fn placements(&self) -> Table<Placement> {
        self.table(PLACEMENTS).unwrap_or_default()
    }

    /// The rows not frozen, sorted by log position.
    pub(crate) fn hot_rows(&self) -> &[ShardRow] {
        &self.hot
    }

    /// How many frozen rows each shard of the file holds (indexed by the
    /// file's shard numbers): one pass over the placements the first time,
    /// whose pages are then given back; the same answer after. A
    /// compaction's collection plan asks it (`Snapshot::shard_liveness`),
    /// so that a long-lived writer's compactions do not each read every
    /// placement.
    pub(crate) fn frozen_rows_per_shard(&self) -> &[u64] {
        self.frozen_per_shard.get_or_init(|| {
            let mut counts = vec![0u64; self.shards.len()];
            // 16 MiB of placements at a time, each step's pages given back
            // once counted: the walk reads the whole table (464 MB at 14.5M
            // rows), which stayed resident until the end, at the peak of
            // the compaction that asked.
            const STEP: usize = (16 << 20) / std::mem::size_of::<Placement>();
            let (placements, start) = (self.placements(), self.section(PLACEMENTS).offset);
            // A chunk at a time (a lazily checked table: each chunk's blocks
            // checked as it is read; one that fails is left out, and the
            // damage is recorded for the caller's `Snapshot::check_index`).
            let chunks = (0..placements.len()).step_by(STEP).filter_map(|at| {
                placements.span(at..(at + STEP).min(placements.len())).map(|c| (at / STEP, c))
            });
            for (k, chunk) in chunks {
                for p in chunk.iter().filter(|p| p.frozen_row != NOT_FROZEN) {
                    if let Some(n) = counts.get_mut(p.shard as usize) {
                        *n += 1;
                    }
                }
                let at = start + k * STEP * std::mem::size_of::<Placement>();
                self.map.release_range(at..at + std::mem::size_of_val(chunk));
            }
            counts
        })
    }

    /// Every row's trace id hash, sorted.
    pub(crate) fn trace_hashes(&self) -> Table<u64> {
        self.table(TRACE_HASHES).unwrap_or_default()
    }

    /// Every row's session hashes, sorted.
    pub(crate) fn session_hashes(&self) -> Table<u64> {
        self.table(SESSION_HASHES).unwrap_or_default()
    }

    /// The first section (in [`SECTIONS`] order, then the block checksums
    /// when this file has them) whose bytes or count differ from `other`'s,
    /// if any: compared 64 MiB at a time, both files' pages given back
    /// behind (`trajlog verify` compares ~1.4 GB at 11M rows).
    pub(crate) fn differs_from(&self, other: &ShardIndex) -> Option<u32> {
        const STEP: usize = 64 << 20;
        let has_blocks = self.sections.get(BLOCK_CRCS as usize).is_some_and(|s| s.offset != 0);
        for kind in SECTIONS.iter().copied().chain(has_blocks.then_some(BLOCK_CRCS)) {
            let (a, b) = (self.section(kind), other.section(kind));
            if a.count != b.count || a.len != b.len {
                return Some(kind);
            }
            let mut at = 0;
            while at < a.len {
                let n = STEP.min(a.len - at);
                let (x, y) = (a.offset + at..a.offset + at + n, b.offset + at..b.offset + at + n);
                let same = self.map.bytes().get(x.clone()).is_some_and(|x| other.map.bytes().get(y.clone()) == Some(x));
                self.map.release_range(x);
                other.map.release_range(y);
                if !same {
                    return Some(kind);
                }
                at += n;
            }
        }
        None
    }

    /// The first section whose bytes or count differ from `other`'s, if any.
    #[cfg(test)]
    pub(crate) fn first_difference(&self, other: &ShardIndex) -> Option<u32> {
        SECTIONS
            .iter()
            .copied()
            .find(|k| self.bytes_of(*k) != other.bytes_of(*k) || self.section(*k).count != other.section(*k).count)
    }

    /// The file's size in bytes.
    pub(crate) fn file_len(&self) -> u64 {
        self.len
    }

    /// Every shard row, from the file alone: the frozen rows (through
    /// their placements) and the others, with the shard numbers `renumber`
    /// gives (`None` drops the row), sorted by log position.
    pub(crate) fn rows<'a>(&'a self, frozen: &'a Frozen, renumber: impl Fn(u32) -> Option<u32>) -> Vec<RowRef<'a>> {
        let rows = frozen.rows();
        let placements = self.placements();
        let mut out = Vec::with_capacity(placements.len());
        for p in placements.iter().filter(|p| p.frozen_row != NOT_FROZEN) {
            let (Some(r), Some(shard)) = (rows.get(p.frozen_row as usize), renumber(p.shard)) else { continue };
            out.push(RowRef {
                loc: r.loc(),
                timestamp: r.timestamp,
                pos: ShardPos { shard, ..p.pos() },
                trace_id: frozen.trace_id(r),
                sessions: crate::index::frozen::RowSessions::One(frozen.session_name(r.session)),
            });
        }
        for h in &self.hot {
            let Some(shard) = renumber(h.pos.shard) else { continue };
            let mut r = RowRef::from(h);
            r.pos.shard = shard;
            out.push(r);
        }
        out.sort_by_key(|r| r.loc);
        out
    }
}
