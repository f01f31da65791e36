//! Writing one table's shards: files are staged under a hidden `_tmp-` name
//! (invisible to `pyarrow.dataset`, DuckDB globs of `*.parquet` files named
//! `part-*`, and HF datasets), fsynced, and renamed by the publisher.

use super::schema::{META_FORMAT_VERSION, META_SCHEMA_DOC, META_TABLE, SHARD_FORMAT_VERSION};
use crate::error::{Error, ErrorKind, Result};
use crate::format::manifest::{ManifestShard, PendingRename};
use arrow_array::RecordBatch;
use arrow_schema::Schema;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use std::fs::File;
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

struct OpenFile {
    writer: ArrowWriter<File>,
    staged: String,
    final_name: String,
    path: PathBuf,
    rows: u64,
    bytes: usize,
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
            // Row groups are cut explicitly by the caller (one flush per group).
            .set_max_row_group_row_count(None)
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
            let writer = ArrowWriter::try_new(file, self.schema.clone(), Some(self.props.clone()))
                .map_err(|e| parquet_err("start a parquet shard", e))?;
            self.current = Some(OpenFile { writer, staged, final_name, path, rows: 0, bytes: 0 });
        }
        let Some(cur) = self.current.as_mut() else { return Err(Error::closed()) };
        cur.writer.write(batch).map_err(|e| parquet_err("write a parquet row group", e))?;
        cur.writer.flush().map_err(|e| parquet_err("flush a parquet row group", e))?;
        cur.rows += batch.num_rows() as u64;
        cur.bytes += approx_bytes;
        if cur.bytes >= self.shard_bytes {
            self.close_current()?;
        }
        Ok(())
    }

    fn close_current(&mut self) -> Result<()> {
        let Some(cur) = self.current.take() else { return Ok(()) };
        let file = cur.writer.into_inner().map_err(|e| parquet_err("finish a parquet shard", e))?;
        file.sync_all().map_err(|e| Error::io(format!("fsync {}", cur.path.display()), e))?;
        self.finished
            .push(PendingRename { staged: cur.staged, shard: ManifestShard { path: cur.final_name, rows: cur.rows } });
        Ok(())
    }

    /// Close the open file; returns everything written.
    pub fn finish(mut self) -> Result<Vec<PendingRename>> {
        self.close_current()?;
        Ok(self.finished)
    }
}
