//! Reading shards back: the per-row index entries the store needs at open
//! (`index_rows`), and whole row groups for serving compacted calls.
//!
//! Checked on use (format-spec/shard.md §7): `open` checks the file length and
//! the footer's crc32 against the manifest entry when it has them, before the
//! footer is parsed, and parses exactly the bytes it checked; a format 2 file's
//! column chunks are read into memory, checked against their crc32s, and decoded
//! from those same bytes. A damaged byte is an `ErrorKind::Corrupt` naming the
//! file, the offset and the row group, never a different value. Format 1 files
//! (and their manifests) carry no checksums and are decoded unchecked.

use crate::shard::schema::{
    chunk_range, decode_chunk_crcs, steps_schema_of, trajectories_schema, ChunkCrc, META_CHUNK_CRC32, META_FORMAT_VERSION,
    META_TABLE, SHARD_FORMAT_VERSION, SHARD_FORMAT_VERSION_MIN,
};
use crate::shard::writer::parquet_err;
use crate::error::{Error, ErrorKind, Result};
use crate::format::manifest::ShardChecksum;
use crate::format::record::{CallRecord, Loc, Relation};
use crate::error::Problem;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type, UInt32Type, UInt64Type};
use arrow_array::builder::StringBuilder;
use arrow_array::{Array, ArrayRef, RecordBatch};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataOptions, ParquetMetaDataReader, ParquetStatisticsPolicy};
use parquet::file::reader::ChunkReader;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Parquet files start and end with this magic.
const PARQUET_MAGIC: &[u8; 4] = b"PAR1";

/// An open shard (the store opens `steps` shards; [`verify_shard`] either table).
#[derive(Debug, Clone)]
pub struct ShardFile {
    pub id: u32,
    pub path: PathBuf,
    checksum: ShardChecksum,
    /// Where the footer starts: it runs to the file's last 8 bytes.
    footer_start: u64,
    /// The footer decoded and checked: at open, or at the first read of a
    /// file a store's open left undecoded ([`ShardFile::open_deferred`]).
    /// Shared by the clones of this file.
    decoded: Arc<std::sync::OnceLock<Decoded>>,
    /// What the decode checks and keeps: the steps schema (a `steps` file
    /// the store serves), the column statistics (kept when asked for).
    steps: bool,
    stats: bool,
    /// Set when a collection deletes the file while snapshots still read it
    /// ([`ShardFile::pin`]): reads go through this descriptor, not the path.
    pinned: Arc<std::sync::OnceLock<File>>,
}

/// A shard's footer, decoded and checked.
#[derive(Debug)]
struct Decoded {
    meta: ArrowReaderMetadata,
    /// Format 2: per row group, its column chunks' ranges and crc32s, checked
    /// when decoded to match the metadata and to cover the file from byte 4
    /// to the footer. `None` for format 1 files.
    chunks: Option<Vec<Vec<ChunkCrc>>>,
    /// Its `trajlog.shard_format_version` (format 3: documents moved out of
    /// `extra`, spliced back by [`ShardFile::read_row_group`]).
    version: u32,
}

/// A call's sessions as the index keeps them: `session_id`, then the uids.
type Sessions = Arc<[Arc<str>]>;

/// What the store's index needs of one `steps` row.
#[derive(Debug, Clone)]
pub struct ShardRow {
    /// The log position of the call record it was compacted from.
    pub loc: Loc,
    pub trace_id: Arc<str>,
    /// `session_id` first, then the extra session uids (deduplicated), as
    /// the index keeps them: shared by consecutive rows of one session.
    pub sessions: Arc<[Arc<str>]>,
    pub timestamp: f64,
    pub pos: ShardPos,
}

/// Where a compacted call lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardPos {
    pub shard: u32,
    pub row_group: u32,
    pub row: u32,
}

fn corrupt(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::corrupt(path, 0, format!("parquet shard: {what}"))
}

fn corrupt_at(path: &Path, offset: u64, what: impl std::fmt::Display) -> Error {
    Error::corrupt(path, offset, format!("parquet shard: {what}"))
}

fn read_at(file: &File, path: &Path, offset: u64, len: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0; usize::try_from(len).map_err(|_| corrupt_at(path, offset, "range too large"))?];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io(format!("read shard {} at offset {offset}", path.display()), e))?;
    Ok(buf)
}

/// One buffer of the parts' bytes, in order. (`B` is parquet's `bytes::Bytes`,
/// which it hands out but does not re-export: the type is inferred.)
fn concat<B: AsRef<[u8]> + From<Vec<u8>>>(mut parts: Vec<B>) -> B {
    if parts.len() == 1 {
        if let Some(one) = parts.pop() {
            return one;
        }
    }
    let mut all = Vec::with_capacity(parts.iter().map(|p| p.as_ref().len()).sum());
    for p in &parts {
        all.extend_from_slice(p.as_ref());
    }
    B::from(all)
}

/// The key-value metadata value of `key`, if any.
fn kv_value<'a>(meta: &'a ParquetMetaData, key: &str) -> Option<&'a str> {
    meta.file_metadata().key_value_metadata()?.iter().find(|k| k.key == key)?.value.as_deref()
}

/// Every column chunk lies between the leading magic and the footer (so that
/// no reader reads outside the file, and none panics on negative offsets).
fn check_chunk_bounds(meta: &ParquetMetaData, path: &Path, footer_start: u64) -> Result<()> {
    for (i, rg) in meta.row_groups().iter().enumerate() {
        for (j, col) in rg.columns().iter().enumerate() {
            let ok =
                chunk_range(col).and_then(|(o, l)| Some(o >= 4 && o.checked_add(l)? <= footer_start)).unwrap_or(false);
            if !ok {
                return Err(corrupt_at(
                    path,
                    footer_start,
                    format!("row group {i}, column chunk {j}: byte range outside the file's data"),
                ));
            }
        }
    }
    Ok(())
}

/// Format 2: the recorded chunk checksums, checked against the metadata: one
/// entry per column chunk, the same ranges, back to back from byte 4 to the
/// footer (format-spec/shard.md §7).
fn chunk_crcs(meta: &ParquetMetaData, path: &Path, footer_start: u64) -> Result<Vec<Vec<ChunkCrc>>> {
    let bad = |what: String| corrupt_at(path, footer_start, format!("{META_CHUNK_CRC32}: {what}"));
    let text = kv_value(meta, META_CHUNK_CRC32).ok_or_else(|| bad("missing (shard format 2 requires it)".into()))?;
    let rgs = decode_chunk_crcs(text)
        .ok_or_else(|| bad("not a JSON array of [offset, len, crc32] per column chunk per row group".into()))?;
    if rgs.len() != meta.num_row_groups() {
        return Err(bad(format!("{} row groups listed, the file has {}", rgs.len(), meta.num_row_groups())));
    }
    let mut at = PARQUET_MAGIC.len() as u64;
    for (i, (rg, crcs)) in meta.row_groups().iter().zip(&rgs).enumerate() {
        if crcs.len() != rg.columns().len() {
            return Err(bad(format!("row group {i}: {} chunks listed, it has {}", crcs.len(), rg.columns().len())));
        }
        for (j, (col, c)) in rg.columns().iter().zip(crcs).enumerate() {
            if chunk_range(col) != Some((c.offset, c.len)) || c.offset != at {
                return Err(bad(format!(
                    "row group {i}, column chunk {j}: listed at {}+{}, expected {at}+{:?}",
                    c.offset,
                    c.len,
                    chunk_range(col).map(|r| r.1)
                )));
            }
            at = c.offset.checked_add(c.len).ok_or_else(|| bad("range overflows".into()))?;
        }
    }
    if at != footer_start {
        return Err(bad(format!("column chunks end at byte {at}, the footer starts at {footer_start}")));
    }
    Ok(rgs)
}

/// How [`ShardFile::open_with`] opens a file.
#[derive(Debug, Clone, Copy)]
struct Open {
    /// Check the steps schema.
    steps: bool,
    /// Keep the column chunks' statistics (min and max).
    stats: bool,
    /// Decode the footer at the first read, not now.
    deferred: bool,
}

impl ShardFile {
    /// Open a `steps` shard and check its schema and format version; with
    /// `expected` (from the manifest entry), check the file's length and its
    /// footer's crc32 first.
    pub fn open(path: &Path, id: u32, expected: Option<ShardChecksum>) -> Result<Self> {
        Self::open_with(path, id, expected, Open { steps: true, stats: false, deferred: false })
    }

    /// [`ShardFile::open`] for a store's open: with `expected` (the
    /// manifest's checksum), the file's length and its last 8 bytes (the
    /// footer's length and the magic) are checked now, and the footer is
    /// read, checked against the manifest's crc32 and decoded at the file's
    /// first read (an open that maps the shard index file reads no shard:
    /// decoding every footer was ~15% of a 14.5M-call store's open, and
    /// reading and checking them, ~1 MB each, most of what was left of a
    /// 10M-call store's). Without `expected`, as [`ShardFile::open`].
    pub fn open_deferred(path: &Path, id: u32, expected: Option<ShardChecksum>) -> Result<Self> {
        let deferred = expected.is_some();
        Self::open_with(path, id, expected, Open { steps: true, stats: false, deferred })
    }

    /// Open a shard of either table (no schema check).
    fn open_any(path: &Path, id: u32, expected: Option<ShardChecksum>) -> Result<Self> {
        Self::open_with(path, id, expected, Open { steps: false, stats: false, deferred: false })
    }

    /// Open a shard; the footer decoded now unless `how.deferred`.
    fn open_with(path: &Path, id: u32, expected: Option<ShardChecksum>, how: Open) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(format!("open shard {}", path.display()), e))?;
        let len = file.metadata().map_err(|e| Error::io(format!("stat shard {}", path.display()), e))?.len();
        if let Some(want) = expected {
            if len != want.len {
                return Err(corrupt_at(
                    path,
                    len.min(want.len),
                    format!("the file is {len} bytes, the manifest says {}", want.len),
                ));
            }
        }
        // format-spec/shard.md §7: ... footer, u32 footer_len, "PAR1".
        if len < 12 {
            return Err(corrupt_at(path, 0, format!("{len} bytes is too short for a parquet file")));
        }
        let end = read_at(&file, path, len - 8, 8)?;
        let footer_len = end.get(..4).and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
        if end.get(4..) != Some(PARQUET_MAGIC.as_slice()) || u64::from(footer_len) + 12 > len {
            return Err(corrupt_at(path, len - 8, format!("no valid parquet footer (length {footer_len}) at the end")));
        }
        let footer_start = len - 8 - u64::from(footer_len);
        if let Some(want) = expected.filter(|_| how.deferred) {
            // Read, checked and decoded at the first read (`decoded`).
            return Ok(ShardFile {
                id,
                path: path.to_path_buf(),
                checksum: want,
                footer_start,
                decoded: Arc::default(),
                steps: how.steps,
                stats: how.stats,
                pinned: Arc::default(),
            });
        }
        let tail = read_at(&file, path, footer_start, u64::from(footer_len) + 8)?;
        let checksum = ShardChecksum { len, footer_crc32: crc32fast::hash(&tail) };
        if let Some(want) = expected {
            let got = checksum.footer_crc32;
            if got != want.footer_crc32 {
                return Err(corrupt_at(
                    path,
                    footer_start,
                    format!(
                        "the footer (bytes {footer_start}..{len}) fails its crc32: the manifest says {:08x}, the file has {got:08x}",
                        want.footer_crc32
                    ),
                ));
            }
        }
        let f = ShardFile {
            id,
            path: path.to_path_buf(),
            checksum,
            footer_start,
            decoded: Arc::default(),
            steps: how.steps,
            stats: how.stats,
            pinned: Arc::default(),
        };
        f.decode(&tail)?;
        Ok(f)
    }

    /// The footer, decoded and checked (at the first call of a file opened
    /// with [`ShardFile::open_deferred`]).
    fn decoded(&self) -> Result<&Decoded> {
        if let Some(d) = self.decoded.get() {
            return Ok(d);
        }
        let file = self.open_file()?;
        let (start, len) = (self.footer_start, self.checksum.len);
        let tail = read_at(&file, &self.path, start, len.saturating_sub(start))?;
        let got = crc32fast::hash(&tail);
        if got != self.checksum.footer_crc32 {
            return Err(corrupt_at(
                &self.path,
                start,
                format!(
                    "the footer (bytes {start}..{len}) fails its crc32: the manifest says {:08x}, the file has {got:08x}",
                    self.checksum.footer_crc32
                ),
            ));
        }
        self.decode(&tail)
    }

    /// Decode and check `tail` (the footer and the last 8 bytes), keep it.
    fn decode(&self, tail: &[u8]) -> Result<&Decoded> {
        let (path, footer_start) = (self.path.as_path(), self.footer_start);
        let footer = tail.get(..tail.len().saturating_sub(8)).unwrap_or_default();
        // Column statistics stay in the file for other readers (DuckDB prunes
        // with them); trajlog reads none, and decoded they held ~13 bytes a
        // row at 256-row row groups (1M compacted tiny calls, after open).
        let stats = self.stats;
        let skip = || ParquetStatisticsPolicy::SkipAll;
        let options = ParquetMetaDataOptions::new();
        let options = if stats { options } else { options.with_column_stats_policy(skip()) };
        let options = options
            .with_size_stats_policy(skip())
            .with_encoding_stats_policy(skip());
        let metadata = ParquetMetaDataReader::decode_metadata_with_options(footer, Some(&options))
            .map_err(|e| corrupt_at(path, footer_start, e))?;
        let version = kv_value(&metadata, META_FORMAT_VERSION).and_then(|v| v.parse::<u32>().ok());
        let version = match version {
            Some(v) if (SHARD_FORMAT_VERSION_MIN..=SHARD_FORMAT_VERSION).contains(&v) => v,
            Some(v) => {
                return Err(Error::new(
                    ErrorKind::Incompatible,
                    format!(
                        "{} has shard format {v}, this build reads {SHARD_FORMAT_VERSION_MIN} to {SHARD_FORMAT_VERSION}; use a matching trajlog",
                        path.display()
                    ),
                ))
            }
            None => return Err(corrupt_at(path, footer_start, "no trajlog shard format version in its metadata")),
        };
        check_chunk_bounds(&metadata, path, footer_start)?;
        let chunks = if version == 1 { None } else { Some(chunk_crcs(&metadata, path, footer_start)?) };
        let meta = ArrowReaderMetadata::try_new(Arc::new(metadata), ArrowReaderOptions::new())
            .map_err(|e| corrupt_at(path, footer_start, e))?;
        if self.steps && meta.schema().fields() != steps_schema_of(version).fields() {
            return Err(corrupt(path, "schema is not the steps schema of format-spec/shard.md"));
        }
        // A race with another thread's decode keeps the first: the same bytes.
        let _ = self.decoded.set(Decoded { meta, chunks, version });
        self.decoded.get().ok_or_else(|| corrupt(path, "the footer was not kept"))
    }

    /// Its length and footer crc32, as read at open (the manifest's
    /// checksum of it, format-spec/manifest.md).
    pub fn checksum(&self) -> ShardChecksum {
        self.checksum
    }

    /// Number of row groups.
    pub fn row_groups(&self) -> Result<usize> {
        Ok(self.decoded()?.meta.metadata().num_row_groups())
    }

    /// Rows in the file, from its footer.
    pub fn rows(&self) -> Result<u64> {
        Ok(u64::try_from(self.decoded()?.meta.metadata().file_metadata().num_rows()).unwrap_or(0))
    }

    /// Whether the footer has been decoded (a file opened with
    /// [`ShardFile::open_deferred`] is not until its first read).
    #[cfg(feature = "internals")]
    pub fn is_decoded(&self) -> bool {
        self.decoded.get().is_some()
    }

    /// Whether the file carries column chunk checksums (shard format 2).
    #[cfg(feature = "internals")]
    pub fn has_checksums(&self) -> Result<bool> {
        Ok(self.decoded()?.chunks.is_some())
    }

    fn open_file(&self) -> Result<File> {
        let open = |p: &Path| File::open(p).map_err(|e| Error::io(format!("open shard {}", self.path.display()), e));
        match self.pinned.get() {
            None => open(&self.path),
            // A descriptor of its own (its own offset, for the format 1
            // reader, which seeks), of the same (deleted) file.
            Some(f) => {
                use std::os::fd::AsRawFd;
                open(Path::new(&format!("/proc/self/fd/{}", f.as_raw_fd())))
            }
        }
    }

    /// Keep the file readable by whoever holds this shard after it is
    /// deleted (a collection replaced it): open it now and read through that
    /// descriptor from then on. Its space is freed when the last holder
    /// drops it.
    pub fn pin(&self) -> Result<()> {
        if self.pinned.get().is_none() {
            let _ = self.pinned.set(self.open_file()?);
        }
        Ok(())
    }

    /// A reader of row group `rg`, of the columns under `roots` (all if `None`).
    /// Format 2: the needed column chunks are read, checked against their
    /// crc32s, and decoded from those same bytes.
    fn row_group_reader(
        &self,
        rg: usize,
        roots: Option<&[usize]>,
        batch_size: usize,
    ) -> Result<ParquetRecordBatchReader> {
        self.row_group_reader_of(rg, roots, batch_size, None)
    }

    /// [`ShardFile::row_group_reader`] of the rows `rows` of the row group
    /// only (all if `None`): the pages are read and checked as for the whole
    /// row group, but only those rows are decoded into arrays.
    fn row_group_reader_of(
        &self,
        rg: usize,
        roots: Option<&[usize]>,
        batch_size: usize,
        rows: Option<std::ops::Range<usize>>,
    ) -> Result<ParquetRecordBatchReader> {
        let selection = rows.map(|r| {
            parquet::arrow::arrow_reader::RowSelection::from(vec![
                parquet::arrow::arrow_reader::RowSelector::skip(r.start),
                parquet::arrow::arrow_reader::RowSelector::select(r.end.saturating_sub(r.start)),
            ])
        });
        let d = self.decoded()?;
        let schema = d.meta.parquet_schema();
        let mask = match roots {
            Some(r) => ProjectionMask::roots(schema, r.iter().copied()),
            None => ProjectionMask::all(),
        };
        let Some(chunks) = &d.chunks else {
            let builder = ParquetRecordBatchReaderBuilder::new_with_metadata(self.open_file()?, d.meta.clone())
                .with_row_groups(vec![rg])
                .with_projection(mask)
                .with_batch_size(batch_size);
            let builder = match selection {
                Some(s) => builder.with_row_selection(s),
                None => builder,
            };
            return builder.build().map_err(|e| parquet_err("read a shard row group", e));
        };
        let no_rg = || corrupt(&self.path, format!("no row group {rg}"));
        let crcs = chunks.get(rg).ok_or_else(no_rg)?;
        let rg_meta = d.meta.metadata().row_groups().get(rg).ok_or_else(no_rg)?;
        let wanted = |leaf: usize| {
            leaf < schema.num_columns() && roots.is_none_or(|r| r.contains(&schema.get_column_root_idx(leaf)))
        };
        // Runs of wanted leaves: their chunks are contiguous (checked at open).
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for leaf in (0..crcs.len()).filter(|&l| wanted(l)) {
            match runs.last_mut() {
                Some((_, end)) if *end == leaf => *end = leaf + 1,
                _ => runs.push((leaf, leaf + 1)),
            }
        }
        let file = self.open_file()?;
        let mut parts = Vec::with_capacity(runs.len());
        // Where each wanted chunk starts in the concatenated buffer.
        let mut moved_to: Vec<Option<u64>> = vec![None; crcs.len()];
        let mut pos = 0u64;
        for &(first, end) in &runs {
            let (Some(a), Some(b)) = (crcs.get(first), crcs.get(end - 1)) else { return Err(no_rg()) };
            let run_len = b.offset + b.len - a.offset;
            let bytes = file
                .get_bytes(a.offset, usize::try_from(run_len).unwrap_or(usize::MAX))
                .map_err(|e| corrupt_at(&self.path, a.offset, format!("row group {rg}: {e}")))?;
            for (leaf, c) in crcs.iter().enumerate().take(end).skip(first) {
                let at = (c.offset - a.offset) as usize;
                let got = bytes.get(at..at + c.len as usize).map(crc32fast::hash);
                if got != Some(c.crc32) {
                    let column = schema.columns().get(leaf).map(|d| d.path().string()).unwrap_or_default();
                    return Err(corrupt_at(
                        &self.path,
                        c.offset,
                        format!(
                            "row group {rg}, column {column}: bytes {}..{} fail their crc32 (recorded {:08x}, read {:08x})",
                            c.offset,
                            c.offset + c.len,
                            c.crc32,
                            got.unwrap_or(0)
                        ),
                    ));
                }
                if let Some(m) = moved_to.get_mut(leaf) {
                    *m = Some(pos + (c.offset - a.offset));
                }
            }
            pos += run_len;
            parts.push(bytes);
        }
        let data = concat(parts);
        // The row group's metadata with the wanted chunks' offsets moved into `data`.
        let shifted = |col: &parquet::file::metadata::ColumnChunkMetaData, c: &ChunkCrc, to: u64| {
            let shift = |o: i64| o.checked_sub(c.offset as i64)?.checked_add(to as i64);
            let data_page = shift(col.data_page_offset())?;
            let dictionary_page = match col.dictionary_page_offset() {
                Some(d) => Some(shift(d)?),
                None => None,
            };
            col.clone()
                .into_builder()
                .set_data_page_offset(data_page)
                .set_dictionary_page_offset(dictionary_page)
                .set_index_page_offset(None)
                .set_column_index_offset(None)
                .set_offset_index_offset(None)
                .set_bloom_filter_offset(None)
                .build()
                .ok()
        };
        let mut columns = Vec::with_capacity(crcs.len());
        for (leaf, (col, c)) in rg_meta.columns().iter().zip(crcs).enumerate() {
            columns.push(match moved_to.get(leaf).copied().flatten() {
                Some(to) => shifted(col, c, to)
                    .ok_or_else(|| corrupt_at(&self.path, c.offset, format!("row group {rg}: bad page offsets")))?,
                None => col.clone(),
            });
        }
        let rg_meta = rg_meta
            .clone()
            .into_builder()
            .set_column_metadata(columns)
            .build()
            .map_err(|e| corrupt(&self.path, format!("row group {rg}: {e}")))?;
        // Without the file's key-value metadata (the per-row-group crc32
        // table and the embedded Arrow schema grow with the file): cloning and
        // parsing them again for each row group made an open of a store
        // O(row groups²) per shard. The Arrow schema decoded at open is
        // supplied instead, so batches come back with the same schema.
        let fm = d.meta.metadata().file_metadata();
        let file_meta = parquet::file::metadata::FileMetaData::new(
            fm.version(),
            fm.num_rows(),
            fm.created_by().map(str::to_owned),
            None,
            fm.schema_descr_ptr(),
            fm.column_orders().cloned(),
        );
        let metadata = ParquetMetaData::new(file_meta, vec![rg_meta]);
        let options = ArrowReaderOptions::new().with_schema(d.meta.schema().clone());
        let meta = ArrowReaderMetadata::try_new(Arc::new(metadata), options).map_err(|e| corrupt(&self.path, e))?;
        let builder = ParquetRecordBatchReaderBuilder::new_with_metadata(data, meta)
            .with_row_groups(vec![0])
            .with_projection(mask)
            .with_batch_size(batch_size);
        let builder = match selection {
            Some(s) => builder.with_row_selection(s),
            None => builder,
        };
        builder.build().map_err(|e| parquet_err("read a shard row group", e))
    }

    /// How many rows row group `rg` holds (None: no such row group).
    pub fn rows_in(&self, rg: u32) -> Result<Option<u32>> {
        let rgs = self.decoded()?.meta.metadata().row_groups();
        Ok(rgs.get(rg as usize).and_then(|g| u32::try_from(g.num_rows()).ok()))
    }

    /// Where row group `rg` starts, for error messages.
    fn row_group_offset(&self, rg: usize) -> u64 {
        let Ok(d) = self.decoded() else { return 0 };
        let rgs = d.meta.metadata().row_groups();
        rgs.get(rg).and_then(|g| g.columns().first()).and_then(chunk_range).map_or(0, |r| r.0)
    }

    /// The index entries of every row, in row order.
    pub fn index_rows(&self, out: &mut Vec<ShardRow>) -> Result<()> {
        // Column positions differ between formats: looked up in the file's schema.
        let schema = self.decoded()?.meta.schema();
        let names = ["trace_id", "session_id", "timestamp", "session_uids", "source_segment", "source_offset"];
        let idx: Vec<usize> = names.iter().filter_map(|n| schema.index_of(n).ok()).collect();
        for rg in 0..self.row_groups()? {
            let reader = self.row_group_reader(rg, Some(&idx), 1 << 16)?;
            let mut row = 0u32;
            for batch in reader {
                let batch = batch
                    .map_err(|e| corrupt_at(&self.path, self.row_group_offset(rg), format!("row group {rg}: {e}")))?;
                let col =
                    |name: &str| batch.column_by_name(name).ok_or_else(|| corrupt(&self.path, format!("no {name}")));
                let trace =
                    col("trace_id")?.as_string_opt::<i32>().ok_or_else(|| corrupt(&self.path, "trace_id type"))?;
                let session =
                    col("session_id")?.as_string_opt::<i32>().ok_or_else(|| corrupt(&self.path, "session_id type"))?;
                let ts = col("timestamp")?
                    .as_primitive_opt::<Float64Type>()
                    .ok_or_else(|| corrupt(&self.path, "timestamp type"))?;
                let uids = col("session_uids")?
                    .as_list_opt::<i32>()
                    .ok_or_else(|| corrupt(&self.path, "session_uids type"))?;
                let seg = col("source_segment")?
                    .as_primitive_opt::<UInt64Type>()
                    .ok_or_else(|| corrupt(&self.path, "source type"))?;
                let off = col("source_offset")?
                    .as_primitive_opt::<UInt64Type>()
                    .ok_or_else(|| corrupt(&self.path, "source type"))?;
                let mut sessions: Option<(Sessions, Vec<String>)> = None;
                for i in 0..batch.num_rows() {
                    let u = uids.value(i);
                    let u = u.as_string_opt::<i32>().ok_or_else(|| corrupt(&self.path, "session_uids items"))?;
                    let same = sessions.as_ref().is_some_and(|(list, prev)| {
                        list.first().is_some_and(|s| **s == *session.value(i))
                            && prev.len() == u.len()
                            && prev.iter().enumerate().all(|(j, p)| p == u.value(j))
                    });
                    if !same {
                        let uid_list: Vec<String> = (0..u.len()).map(|j| u.value(j).to_owned()).collect();
                        sessions = Some((crate::index::sessions_of(session.value(i), &uid_list), uid_list));
                    }
                    let Some((list, _)) = &sessions else { continue };
                    out.push(ShardRow {
                        loc: Loc { segment: seg.value(i), offset: off.value(i) },
                        trace_id: Arc::from(trace.value(i)),
                        sessions: list.clone(),
                        timestamp: ts.value(i),
                        pos: ShardPos { shard: self.id, row_group: rg as u32, row },
                    });
                    row += 1;
                }
            }
        }
        Ok(())
    }

    /// Decode one whole row group. A `steps` row group comes in the columns
    /// of shard format 2 whatever the file's format: a format 3 row group's documents moved out
    /// of `extra` are spliced back into it (shard.md §2.1) and their columns
    /// dropped, so that [`call_from_row`] sees each call's `extra` as appended.
    pub fn read_row_group(&self, rg: u32) -> Result<RecordBatch> {
        self.read_rows(rg, None)
    }

    /// The rows of row group `rg` in `rows` (all if `None`), decoded as
    /// [`ShardFile::read_row_group`] decodes them: row `i` of the batch is
    /// row `rows.start + i` of the row group. A range past the row group is
    /// an error.
    pub fn read_rows(&self, rg: u32, rows: Option<std::ops::Range<u32>>) -> Result<RecordBatch> {
        let rg = rg as usize;
        if let Some(r) = &rows {
            let n = self.rows_in(rg as u32)?.unwrap_or(0);
            if r.start >= r.end || r.end > n {
                return Err(corrupt(&self.path, format!("rows {r:?} are not in row group {rg} ({n} rows)")));
            }
        }
        let rows = rows.map(|r| r.start as usize..r.end as usize);
        let reader = self.row_group_reader_of(rg, None, usize::MAX >> 1, rows)?;
        let mut batches = Vec::new();
        for b in reader {
            batches.push(
                b.map_err(|e| corrupt_at(&self.path, self.row_group_offset(rg), format!("row group {rg}: {e}")))?,
            );
        }
        let d = self.decoded()?;
        let batch = arrow_select_concat(&batches, d.meta.schema(), &self.path)?;
        // By the schema, not the table name: a format 3 `steps` file has
        // `extra_splice` (checked at open), a `trajectories` file never.
        if d.version < 3 || batch.schema().column_with_name("extra_splice").is_none() {
            return Ok(batch);
        }
        self.rejoin_extra(&batch, rg)
    }

    /// format-spec/shard.md §2.1: `extra` rebuilt from `extra`, `key_order`,
    /// `raw_request`, `raw_response` and `extra_splice`, in a batch of the
    /// format 2 columns.
    fn rejoin_extra(&self, batch: &RecordBatch, rg: usize) -> Result<RecordBatch> {
        let at = self.row_group_offset(rg);
        let bad = |what: String| corrupt_at(&self.path, at, format!("row group {rg}: {what}"));
        let column = |name: &str| batch.column_by_name(name).ok_or_else(|| bad(format!("no column {name}")));
        let text = |name: &str| column(name)?.as_string_opt::<i32>().ok_or_else(|| bad(format!("{name} type")));
        let extra = text("extra")?;
        let moved = [text("key_order")?, text("raw_request")?, text("raw_response")?];
        let splice = column("extra_splice")?.as_list_opt::<i32>().ok_or_else(|| bad("extra_splice type".into()))?;
        let offsets =
            splice.values().as_primitive_opt::<UInt32Type>().ok_or_else(|| bad("extra_splice items".into()))?.values();
        let mut out = StringBuilder::with_capacity(batch.num_rows(), extra.value_data().len());
        for row in 0..batch.num_rows() {
            let docs = moved.map(|c| c.is_valid(row).then(|| c.value(row)));
            let at = if splice.is_null(row) {
                &[][..]
            } else {
                list_range(splice.value_offsets(), row)
                    .and_then(|r| offsets.get(r))
                    .ok_or_else(|| bad(format!("row {row}: extra_splice offsets")))?
            };
            match extra.is_valid(row).then(|| extra.value(row)) {
                Some(e) if at.is_empty() && docs.iter().all(Option::is_none) => out.append_value(e),
                None if at.is_empty() && docs.iter().all(Option::is_none) => out.append_null(),
                Some(e) => out.append_value(crate::shard::extra::join(e, docs, at).ok_or_else(|| {
                    bad(format!("row {row}: extra_splice {at:?} does not fit its extra and moved documents"))
                })?),
                None => return Err(bad(format!("row {row}: documents moved out of a null extra"))),
            }
        }
        let rebuilt: ArrayRef = Arc::new(out.finish());
        let schema = steps_schema_of(2);
        let mut columns = Vec::with_capacity(schema.fields().len());
        for f in schema.fields() {
            columns.push(if f.name() == "extra" { rebuilt.clone() } else { column(f.name())?.clone() });
        }
        RecordBatch::try_new(schema, columns).map_err(|e| bad(e.to_string()))
    }
}

/// The row number, `session_id` and `trace_ids` of the rows of a
/// `trajectories` shard whose session is one of `sessions`, in row order
/// (what the deletions side table needs, format-spec/shard.md §9). A row
/// group whose `session_id` statistics (min, max: bounds, exact or not)
/// leave out every one of `sessions` is not read: a compaction writes
/// sessions in order, so one session is in one or two row groups. With
/// `expected`, the file's length and footer crc32 are checked first; format
/// 2 and later: every column chunk read is checked against its crc32.
pub fn trajectory_trace_ids(
    path: &Path,
    expected: Option<ShardChecksum>,
    sessions: &std::collections::BTreeSet<String>,
) -> Result<Vec<(u64, String, Vec<String>)>> {
    let shard = ShardFile::open_with(path, 0, expected, Open { steps: false, stats: true, deferred: false })?;
    let d = shard.decoded()?;
    if kv_value(d.meta.metadata(), META_TABLE) != Some("trajectories") {
        return Err(corrupt(path, format!("{META_TABLE} is not \"trajectories\"")));
    }
    let schema = d.meta.schema();
    let roots: Vec<usize> = ["session_id", "trace_ids"].iter().filter_map(|n| schema.index_of(n).ok()).collect();
    if roots.len() != 2 {
        return Err(corrupt(path, "no session_id or trace_ids column"));
    }
    let session_leaf = d.meta.parquet_schema().columns().iter().position(|c| c.name() == "session_id");
    let mut out = Vec::new();
    let mut first_row = 0u64;
    for rg in 0..shard.row_groups()? {
        let meta = d.meta.metadata().row_group(rg);
        let start = first_row;
        first_row += u64::try_from(meta.num_rows()).unwrap_or(0);
        let bounds = session_leaf.and_then(|i| meta.columns().get(i)).and_then(|c| c.statistics());
        if let Some((lo, hi)) = bounds.and_then(|s| s.min_bytes_opt().zip(s.max_bytes_opt())) {
            let (lo, hi) = (String::from_utf8_lossy(lo), String::from_utf8_lossy(hi));
            // A lossy bound is still a bound for byte order unless a
            // replacement character changed it: then read the group.
            let exact = !lo.contains('\u{fffd}') && !hi.contains('\u{fffd}');
            if exact && lo <= hi && sessions.range(lo.into_owned()..=hi.into_owned()).next().is_none() {
                continue;
            }
        }
        let mut row = start;
        for batch in shard.row_group_reader(rg, Some(&roots), 1 << 14)? {
            let batch =
                batch.map_err(|e| corrupt_at(path, shard.row_group_offset(rg), format!("row group {rg}: {e}")))?;
            let (Some(session), Some(traces)) = (
                batch.column_by_name("session_id").and_then(|c| c.as_string_opt::<i32>()),
                batch.column_by_name("trace_ids").and_then(|c| c.as_list_opt::<i32>()),
            ) else {
                return Err(corrupt(path, "session_id or trace_ids of the wrong type"));
            };
            for i in 0..batch.num_rows() {
                if sessions.contains(session.value(i)) {
                    let ids = traces.value(i);
                    let ids = ids.as_string_opt::<i32>().ok_or_else(|| corrupt(path, "trace_ids items"))?;
                    let ids = (0..ids.len()).map(|j| ids.value(j).to_owned()).collect();
                    out.push((row, session.value(i).to_owned(), ids));
                }
                row += 1;
            }
        }
    }
    Ok(out)
}

/// Check a whole shard of either table (format-spec/shard.md §7): with
/// `expected` (the manifest entry's), its length and footer crc32; its format
/// version and schema; the leading magic; every column chunk's crc32 (format
/// 2); that every row group decodes, and for `steps`, that every row is a call.
/// Each problem names the file and the offset; an empty list means intact.
pub fn verify_shard(path: &Path, expected: Option<ShardChecksum>) -> Vec<Problem> {
    let problem = |e: Error| {
        let offset = match e.kind() {
            ErrorKind::Corrupt { offset, .. } => *offset,
            _ => 0,
        };
        Problem { path: path.to_path_buf(), offset, what: e.message().to_owned() }
    };
    let shard = match ShardFile::open_any(path, 0, expected) {
        Ok(f) => f,
        Err(e) => return vec![problem(e)],
    };
    let mut problems = Vec::new();
    match shard.open_file().and_then(|f| read_at(&f, path, 0, 4)) {
        Ok(magic) if magic == PARQUET_MAGIC => {}
        Ok(_) => problems.push(problem(corrupt_at(path, 0, "the file does not start with PAR1"))),
        Err(e) => problems.push(problem(e)),
    }
    let d = match shard.decoded() {
        Ok(d) => d,
        Err(e) => return vec![problem(e)],
    };
    let table = kv_value(d.meta.metadata(), META_TABLE).unwrap_or_default().to_owned();
    let schema = match table.as_str() {
        "steps" => steps_schema_of(d.version),
        "trajectories" => trajectories_schema(),
        other => {
            problems.push(problem(corrupt(path, format!("unknown table {other:?} in {META_TABLE}"))));
            return problems;
        }
    };
    if d.meta.schema().fields() != schema.fields() {
        problems.push(problem(corrupt(path, format!("schema is not the {table} schema of format-spec/shard.md"))));
        return problems;
    }
    for rg in 0..d.meta.metadata().num_row_groups() {
        let batch = match shard.read_row_group(rg as u32) {
            Ok(b) => b,
            Err(e) => {
                problems.push(problem(e));
                continue;
            }
        };
        if table == "steps" {
            for row in 0..batch.num_rows() {
                if let Err(e) = call_from_row(&batch, row, path) {
                    let at = shard.row_group_offset(rg);
                    problems.push(problem(corrupt_at(path, at, format!("row group {rg}: {}", e.message()))));
                    break;
                }
            }
        }
    }
    problems
}

fn arrow_select_concat(batches: &[RecordBatch], schema: &arrow_schema::SchemaRef, path: &Path) -> Result<RecordBatch> {
    match batches {
        [one] => Ok(one.clone()),
        [] => Ok(RecordBatch::new_empty(schema.clone())),
        _ => Err(corrupt(path, "a row group decoded into several batches")),
    }
}

fn relation_of(name: &str) -> Option<Relation> {
    Some(match name {
        "root" => Relation::Root,
        "extends" => Relation::Extends,
        "tito_break" => Relation::TitoBreak,
        "diverges_earlier" => Relation::DivergesEarlier,
        _ => return None,
    })
}

/// A compacted call viewed in a decoded row group: a [`CallRecord`] whose
/// prompt is stored whole (no parent, `prefix_len` 0), plus the divergence
/// position it had in the log.
pub fn call_from_row<'a>(batch: &'a RecordBatch, row: usize, path: &Path) -> Result<(CallRecord<'a>, Option<u32>)> {
    let bad = |what: &str| corrupt(path, format!("row {row}: {what}"));
    if row >= batch.num_rows() {
        return Err(bad("past the row group"));
    }
    let col = |name: &str| batch.column_by_name(name).ok_or_else(|| bad(&format!("no column {name}")));
    let str_col = |name: &str| -> Result<Option<&'a str>> {
        let c = batch.column_by_name(name).ok_or_else(|| bad(name))?.as_string_opt::<i32>().ok_or_else(|| bad(name))?;
        Ok(c.is_valid(row).then(|| c.value(row)))
    };
    let u32_list = |name: &str| -> Result<Option<&'a [u32]>> {
        let l = batch.column_by_name(name).ok_or_else(|| bad(name))?.as_list_opt::<i32>().ok_or_else(|| bad(name))?;
        if l.is_null(row) {
            return Ok(None);
        }
        let v = l.values().as_primitive_opt::<UInt32Type>().ok_or_else(|| bad(name))?.values();
        v.get(list_range(l.value_offsets(), row).ok_or_else(|| bad(name))?).map(Some).ok_or_else(|| bad(name))
    };
    let prompt = u32_list("prompt_ids")?.ok_or_else(|| bad("null prompt_ids"))?;
    let completion = u32_list("completion_ids")?.ok_or_else(|| bad("null completion_ids"))?;
    let lp = col("logprobs")?.as_list_opt::<i32>().ok_or_else(|| bad("logprobs"))?;
    let logprobs = if lp.is_null(row) {
        None
    } else {
        let v = lp.values().as_primitive_opt::<Float32Type>().ok_or_else(|| bad("logprobs"))?.values();
        Some(v.get(list_range(lp.value_offsets(), row).ok_or_else(|| bad("logprobs"))?).ok_or_else(|| bad("logprobs"))?)
    };
    let f64_opt = |name: &str| -> Result<Option<f64>> {
        let c = col(name)?.as_primitive_opt::<Float64Type>().ok_or_else(|| bad(name))?;
        Ok(c.is_valid(row).then(|| c.value(row)))
    };
    let wv = col("weight_version")?.as_primitive_opt::<Int64Type>().ok_or_else(|| bad("weight_version"))?;
    let uids = col("session_uids")?.as_list_opt::<i32>().ok_or_else(|| bad("session_uids"))?;
    let uv = uids.values().as_string_opt::<i32>().ok_or_else(|| bad("session_uids"))?;
    let uid_rows = list_range(uids.value_offsets(), row).filter(|r| r.end <= uv.len()).ok_or_else(|| bad("session_uids"))?;
    let session_uids: Vec<&'a str> = uid_rows.map(|j| uv.value(j)).collect();
    let routing = col("routing_matrices")?.as_binary_opt::<i32>().ok_or_else(|| bad("routing_matrices"))?;
    let dp = col("divergence_position")?.as_primitive_opt::<UInt32Type>().ok_or_else(|| bad("divergence_position"))?;
    let relation = relation_of(str_col("relation")?.unwrap_or("")).ok_or_else(|| bad("unknown relation"))?;
    let record = CallRecord {
        relation,
        timestamp: f64_opt("timestamp")?.ok_or_else(|| bad("null timestamp"))?,
        weight_version: wv.is_valid(row).then(|| wv.value(row)),
        latency_ms: f64_opt("latency_ms")?,
        parent: None,
        prompt_len: prompt.len() as u32,
        prefix_len: 0,
        shared_len: 0,
        prompt_suffix: prompt,
        completion,
        logprobs,
        trace_id: str_col("trace_id")?.ok_or_else(|| bad("null trace_id"))?,
        session_id: str_col("session_id")?.ok_or_else(|| bad("null session_id"))?,
        session_uids,
        model: str_col("model")?,
        finish_reason: str_col("finish_reason")?,
        messages: str_col("messages")?.map(str::as_bytes),
        response_message: str_col("response_message")?.map(str::as_bytes),
        metadata: str_col("metadata")?.map(str::as_bytes),
        extra: str_col("extra")?.map(str::as_bytes),
        routing_matrices: routing.is_valid(row).then(|| routing.value(row)),
        docs: None,
    };
    Ok((record, dp.is_valid(row).then(|| dp.value(row))))
}

/// The value range of list row `row` from its offsets; None when the offsets
/// do not cover it or run backwards (a damaged file).
fn list_range(offsets: &[i32], row: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(*offsets.get(row)?).ok()?;
    let end = usize::try_from(*offsets.get(row.checked_add(1)?)?).ok()?;
    (start <= end).then_some(start..end)
}
