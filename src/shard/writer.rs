//! Writing one table's shards: files are staged under a hidden `_tmp-` name
//! (invisible to `pyarrow.dataset`, DuckDB globs of `*.parquet` files named
//! `part-*`, and HF datasets), fsynced, and renamed by the publisher.
//!
//! Checksums (format-spec/shard.md §7): the file under the `ArrowWriter` sees
//! every byte written; once a row group is flushed its column chunks' ranges are
//! known, and their crc32s go into the key-value metadata when the file is
//! closed. The footer's own crc32 and the file length go into the manifest entry
//! ([`ShardChecksum`]). No page index and no bloom filters are written, so the
//! file is exactly `"PAR1"`, the column chunks back to back, and the footer:
//! every byte after the leading magic is under a checksum.

use crate::shard::schema::{
    chunk_range, encode_chunk_crcs, ChunkCrc, META_CHUNK_CRC32, META_FORMAT_VERSION, META_SCHEMA_DOC, META_TABLE,
    SHARD_FORMAT_VERSION,
};
use crate::error::{Error, ErrorKind, Result};
use crate::limits::SHARD_PAGE_ROWS;
use crate::format::manifest::{ManifestShard, PendingRename, ShardChecksum};
use arrow_array::RecordBatch;
use arrow_schema::Schema;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterVersion};
use parquet::schema::types::ColumnPath;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Compression of shard pages; set explicitly (parquet's default is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardCompression {
    Zstd(i32),
    Uncompressed,
}

/// zstd level 1: on simulated rollouts, 2% larger than level 3 and 35% faster
/// (`scripts/compact_memory.sh`, `cargo bench --bench compact`).
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

impl Default for ShardCompression {
    fn default() -> Self {
        ShardCompression::Zstd(DEFAULT_ZSTD_LEVEL)
    }
}

impl std::str::FromStr for ShardCompression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" | "uncompressed" => Ok(ShardCompression::Uncompressed),
            "zstd" => Ok(ShardCompression::Zstd(DEFAULT_ZSTD_LEVEL)),
            _ => match s.strip_prefix("zstd:").and_then(|l| l.parse().ok()) {
                Some(level) if (1..=22).contains(&level) => Ok(ShardCompression::Zstd(level)),
                _ => Err(Error::invalid("compression", format!("{s:?} is not one of zstd, zstd:LEVEL (1..=22), none"))),
            },
        }
    }
}

pub(crate) fn parquet_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("{what}: {e}"))
}

/// Parquet files start and end with this magic.
const PARQUET_MAGIC: &[u8; 4] = b"PAR1";

/// The file under an `ArrowWriter`: counts the bytes written and holds those
/// not yet checksummed (at most one row group's compressed column chunks,
/// which the `ArrowWriter` held in memory anyway just before).
struct HashingFile {
    file: File,
    /// Bytes written so far: the offset of the next byte.
    pos: u64,
    /// The bytes `pos - held.len() .. pos`.
    held: Vec<u8>,
}

impl Write for HashingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.held.extend_from_slice(buf.get(..n).unwrap_or(buf));
        self.pos += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

fn internal(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("writing shard {}: {what} (a bug in trajlog's shard writer)", path.display()))
}

struct OpenFile {
    writer: ArrowWriter<HashingFile>,
    staged: String,
    final_name: String,
    path: PathBuf,
    rows: u64,
    bytes: usize,
    /// Per flushed row group, its column chunks' ranges and crc32s.
    chunks: Vec<Vec<ChunkCrc>>,
}

impl OpenFile {
    /// Checksum the column chunks of the row group just flushed: they are the
    /// held bytes, back to back, in leaf column order.
    fn checksum_last_row_group(&mut self) -> Result<()> {
        self.writer.sync().map_err(|e| Error::io(format!("write {}", self.path.display()), e))?;
        let Some(rg) = self.writer.flushed_row_groups().last() else {
            return Err(internal(&self.path, "no flushed row group"));
        };
        let ranges: Vec<Option<(u64, u64)>> = rg.columns().iter().map(chunk_range).collect();
        let w = self.writer.inner_mut();
        let start = w.pos - w.held.len() as u64;
        let mut at = start;
        let mut crcs = Vec::with_capacity(ranges.len());
        for (i, range) in ranges.into_iter().enumerate() {
            let Some((offset, len)) = range.filter(|&(o, _)| o == at) else {
                return Err(internal(&self.path, format!("column chunk {i} does not start at byte {at}")));
            };
            let bytes = w.held.get((offset - start) as usize..(offset - start + len) as usize);
            let Some(bytes) = bytes else {
                return Err(internal(&self.path, format!("column chunk {i} ends past byte {}", w.pos)));
            };
            crcs.push(ChunkCrc { offset, len, crc32: crc32fast::hash(bytes) });
            at = offset + len;
        }
        if at != w.pos {
            return Err(internal(&self.path, format!("{} bytes after the row group's column chunks", w.pos - at)));
        }
        w.held.clear();
        self.chunks.push(crcs);
        Ok(())
    }
}

/// Writes row groups of one table, rolling to a new file past `shard_bytes`.
pub struct TableWriter {
    shards_dir: PathBuf,
    table: &'static str,
    generation: u64,
    schema: Arc<Schema>,
    props: WriterProperties,
    shard_bytes: usize,
    part: u32,
    current: Option<OpenFile>,
    /// Files written and closed (fsynced), to be renamed at publication.
    pub finished: Vec<PendingRename>,
}

impl TableWriter {
    pub fn new(
        shards_dir: &Path,
        table: &'static str,
        generation: u64,
        schema: Arc<Schema>,
        compression: ShardCompression,
        shard_bytes: usize,
    ) -> Result<Self> {
        let dir = shards_dir.join(table);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let compression = match compression {
            ShardCompression::Zstd(level) => {
                Compression::ZSTD(ZstdLevel::try_new(level).map_err(|e| Error::invalid("compression", e))?)
            }
            ShardCompression::Uncompressed => Compression::UNCOMPRESSED,
        };
        // Dictionary encoding only where values repeat (ids of sessions, models,
        // …): on token-id and logprob lists it costs most of the write time
        // and then falls back to plain anyway.
        let mut builder = WriterProperties::builder().set_dictionary_enabled(false);
        for column in ["session_id", "model", "finish_reason", "relation", "group_id"] {
            builder = builder.set_column_dictionary_enabled(ColumnPath::from(column), true);
        }
        let props = builder
            .set_compression(compression)
            // No page index and no bloom filters between the row groups and the
            // footer: the checksums then cover every byte (module docs).
            .set_statistics_enabled(EnabledStatistics::Chunk)
            .set_offset_index_disabled(true)
            .set_bloom_filter_enabled(false)
            // Row groups are cut explicitly by the caller (one flush per group).
            .set_max_row_group_row_count(None)
            // Format 4 (shard.md §1): data pages v2 of at most
            // `SHARD_PAGE_ROWS` rows, their values plain as in format 3
            // (the v2 writer would otherwise pick delta encodings), so a
            // read of a few rows skips the pages before them undecoded.
            .set_writer_version(WriterVersion::PARQUET_2_0)
            .set_encoding(Encoding::PLAIN)
            .set_data_page_row_count_limit(SHARD_PAGE_ROWS)
            .set_write_batch_size(SHARD_PAGE_ROWS)
            .set_key_value_metadata(Some(vec![
                KeyValue::new(META_FORMAT_VERSION.to_owned(), SHARD_FORMAT_VERSION.to_string()),
                KeyValue::new(META_TABLE.to_owned(), table.to_owned()),
                KeyValue::new(META_SCHEMA_DOC.to_owned(), "trajlog format-spec/shard.md".to_owned()),
            ]))
            .build();
        Ok(Self {
            shards_dir: shards_dir.to_path_buf(),
            table,
            generation,
            schema,
            props,
            shard_bytes: shard_bytes.max(1),
            part: 0,
            current: None,
            finished: Vec::new(),
        })
    }

    /// Write `batch` as one row group.
    pub fn write_row_group(&mut self, batch: &RecordBatch, approx_bytes: usize) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if self.current.is_none() {
            let staged = format!("{}/_tmp-{:06}-{:04}.parquet", self.table, self.generation, self.part);
            let final_name = format!("{}/part-{:06}-{:04}.parquet", self.table, self.generation, self.part);
            self.part += 1;
            let path = self.shards_dir.join(&staged);
            let file = File::create(&path).map_err(|e| Error::io(format!("create {}", path.display()), e))?;
            let file = HashingFile { file, pos: 0, held: Vec::new() };
            let mut writer = ArrowWriter::try_new(file, self.schema.clone(), Some(self.props.clone()))
                .map_err(|e| parquet_err("start a parquet shard", e))?;
            writer.sync().map_err(|e| Error::io(format!("write {}", path.display()), e))?;
            let w = writer.inner_mut();
            if w.held != PARQUET_MAGIC {
                return Err(internal(&path, "the file does not start with PAR1"));
            }
            w.held.clear();
            self.current = Some(OpenFile { writer, staged, final_name, path, rows: 0, bytes: 0, chunks: Vec::new() });
        }
        let Some(cur) = self.current.as_mut() else { return Err(Error::closed()) };
        cur.writer.write(batch).map_err(|e| parquet_err("write a parquet row group", e))?;
        cur.writer.flush().map_err(|e| parquet_err("flush a parquet row group", e))?;
        cur.checksum_last_row_group()?;
        cur.rows += batch.num_rows() as u64;
        cur.bytes += approx_bytes;
        if cur.bytes >= self.shard_bytes {
            self.close_current()?;
        }
        Ok(())
    }

    fn close_current(&mut self) -> Result<()> {
        let Some(mut cur) = self.current.take() else { return Ok(()) };
        cur.writer
            .append_key_value_metadata(KeyValue::new(META_CHUNK_CRC32.to_owned(), encode_chunk_crcs(&cur.chunks)));
        let w = cur.writer.into_inner().map_err(|e| parquet_err("finish a parquet shard", e))?;
        // What is left is the footer, its length and the closing magic (§7).
        let n = w.held.len();
        let footer_len = w.held.get(n.wrapping_sub(8)..n.wrapping_sub(4)).and_then(|b| b.try_into().ok());
        let footer_len = footer_len.map(u32::from_le_bytes);
        if footer_len.map(|l| l as usize + 8) != Some(n) || !w.held.ends_with(PARQUET_MAGIC) {
            return Err(internal(
                &cur.path,
                format!("the {n} bytes after the last row group are not exactly the footer"),
            ));
        }
        let checksum = ShardChecksum { len: w.pos, footer_crc32: crc32fast::hash(&w.held) };
        w.file.sync_all().map_err(|e| Error::io(format!("fsync {}", cur.path.display()), e))?;
        self.finished.push(PendingRename {
            staged: cur.staged,
            shard: ManifestShard { path: cur.final_name, rows: cur.rows, checksum: Some(checksum) },
        });
        Ok(())
    }

    /// Close the open file; returns everything written.
    pub fn finish(mut self) -> Result<Vec<PendingRename>> {
        self.close_current()?;
        Ok(self.finished)
    }
}
