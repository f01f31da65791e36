//! Reading shards back: the per-row index entries the store needs at open
//! (`index_rows`), and whole row groups for serving compacted calls.

use super::schema::{steps_schema, META_FORMAT_VERSION, SHARD_FORMAT_VERSION};
use super::writer::parquet_err;
use crate::error::{Error, ErrorKind, Result};
use crate::format::record::{CallRecord, Loc, Relation};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type, UInt32Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;
use std::fs::File;
use std::path::{Path, PathBuf};

/// An open `steps` shard.
#[derive(Debug, Clone)]
pub struct ShardFile {
    pub id: u32,
    pub path: PathBuf,
    meta: ArrowReaderMetadata,
}

/// What the store's index needs of one `steps` row.
#[derive(Debug, Clone)]
pub struct ShardRow {
    /// The log position of the call record it was compacted from.
    pub loc: Loc,
    pub trace_id: String,
    pub session_id: String,
    pub session_uids: Vec<String>,
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

impl ShardFile {
    /// Open a `steps` shard and check its schema and format version.
    pub fn open(path: &Path, id: u32) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(format!("open shard {}", path.display()), e))?;
        let meta = ArrowReaderMetadata::load(&file, ArrowReaderOptions::new()).map_err(|e| corrupt(path, e))?;
        let kv = meta.metadata().file_metadata().key_value_metadata();
        let version = kv
            .and_then(|kv| kv.iter().find(|k| k.key == META_FORMAT_VERSION))
            .and_then(|k| k.value.as_deref())
            .and_then(|v| v.parse::<u32>().ok());
        match version {
            Some(v) if v <= SHARD_FORMAT_VERSION => {}
            Some(v) => {
                return Err(Error::new(
                    ErrorKind::Incompatible,
                    format!("{} has shard format {v}, this build reads up to {SHARD_FORMAT_VERSION}", path.display()),
                ))
            }
            None => return Err(corrupt(path, "no trajlog shard format version in its metadata")),
        }
        if meta.schema().fields() != steps_schema().fields() {
            return Err(corrupt(path, "schema is not the steps schema of format-spec/shard.md"));
        }
        Ok(Self { id, path: path.to_path_buf(), meta })
    }

    /// Number of row groups.
    pub fn row_groups(&self) -> usize {
        self.meta.metadata().num_row_groups()
    }

    fn builder(&self) -> Result<ParquetRecordBatchReaderBuilder<File>> {
        let file = File::open(&self.path).map_err(|e| Error::io(format!("open shard {}", self.path.display()), e))?;
        Ok(ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.meta.clone()))
    }

    /// The index entries of every row, in row order.
    pub fn index_rows(&self, out: &mut Vec<ShardRow>) -> Result<()> {
        let schema = steps_schema();
        let names = ["trace_id", "session_id", "timestamp", "session_uids", "source_segment", "source_offset"];
        let idx: Vec<usize> = names.iter().filter_map(|n| schema.index_of(n).ok()).collect();
        let mask = ProjectionMask::roots(self.meta.parquet_schema(), idx);
        for rg in 0..self.row_groups() {
            let reader = self
                .builder()?
                .with_row_groups(vec![rg])
                .with_projection(mask.clone())
                .with_batch_size(1 << 16)
                .build()
                .map_err(|e| parquet_err("read a shard", e))?;
            let mut row = 0u32;
            for batch in reader {
                let batch = batch.map_err(|e| corrupt(&self.path, e))?;
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
                for i in 0..batch.num_rows() {
                    let u = uids.value(i);
                    let u = u.as_string_opt::<i32>().ok_or_else(|| corrupt(&self.path, "session_uids items"))?;
                    out.push(ShardRow {
                        loc: Loc { segment: seg.value(i), offset: off.value(i) },
                        trace_id: trace.value(i).to_owned(),
                        session_id: session.value(i).to_owned(),
                        session_uids: (0..u.len()).map(|j| u.value(j).to_owned()).collect(),
                        timestamp: ts.value(i),
                        pos: ShardPos { shard: self.id, row_group: rg as u32, row },
                    });
                    row += 1;
                }
            }
        }
        Ok(())
    }

    /// Decode one whole row group.
    pub fn read_row_group(&self, rg: u32) -> Result<RecordBatch> {
        let reader = self
            .builder()?
            .with_row_groups(vec![rg as usize])
            .with_batch_size(usize::MAX >> 1)
            .build()
            .map_err(|e| parquet_err("read a shard row group", e))?;
        let mut batches = Vec::new();
        for b in reader {
            batches.push(b.map_err(|e| corrupt(&self.path, e))?);
        }
        arrow_select_concat(&batches, &self.path)
    }
}

fn arrow_select_concat(batches: &[RecordBatch], path: &Path) -> Result<RecordBatch> {
    match batches {
        [one] => Ok(one.clone()),
        [] => Ok(RecordBatch::new_empty(steps_schema())),
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
        let o = l.value_offsets();
        let v = l.values().as_primitive_opt::<UInt32Type>().ok_or_else(|| bad(name))?.values();
        v.get(o[row] as usize..o[row + 1] as usize).map(Some).ok_or_else(|| bad(name))
    };
    let prompt = u32_list("prompt_ids")?.ok_or_else(|| bad("null prompt_ids"))?;
    let completion = u32_list("completion_ids")?.ok_or_else(|| bad("null completion_ids"))?;
    let lp = col("logprobs")?.as_list_opt::<i32>().ok_or_else(|| bad("logprobs"))?;
    let logprobs = if lp.is_null(row) {
        None
    } else {
        let o = lp.value_offsets();
        let v = lp.values().as_primitive_opt::<Float32Type>().ok_or_else(|| bad("logprobs"))?.values();
        Some(v.get(o[row] as usize..o[row + 1] as usize).ok_or_else(|| bad("logprobs"))?)
    };
    let f64_opt = |name: &str| -> Result<Option<f64>> {
        let c = col(name)?.as_primitive_opt::<Float64Type>().ok_or_else(|| bad(name))?;
        Ok(c.is_valid(row).then(|| c.value(row)))
    };
    let wv = col("weight_version")?.as_primitive_opt::<Int64Type>().ok_or_else(|| bad("weight_version"))?;
    let uids = col("session_uids")?.as_list_opt::<i32>().ok_or_else(|| bad("session_uids"))?;
    let uo = uids.value_offsets();
    let uv = uids.values().as_string_opt::<i32>().ok_or_else(|| bad("session_uids"))?;
    let session_uids: Vec<&'a str> = (uo[row] as usize..uo[row + 1] as usize).map(|j| uv.value(j)).collect();
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
    };
    Ok((record, dp.is_valid(row).then(|| dp.value(row))))
}
