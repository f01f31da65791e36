//! Arrow schemas of the Parquet shards (format-spec/shard.md) and the key-value
//! metadata every shard carries.

use arrow_schema::{DataType, Field, Schema};
use std::sync::Arc;

/// Version of the shard format (format-spec/shard.md) this build writes; stored
/// in each file's key-value metadata under [`META_FORMAT_VERSION`]. Version 2
/// adds the column chunk checksums ([`META_CHUNK_CRC32`], shard.md §7);
/// version 3 the `raw_request`, `raw_response`, `key_order` and
/// `extra_splice` columns of `steps` (shard.md §2.1); version 4 writes
/// data pages v2 of at most [`crate::limits::SHARD_PAGE_ROWS`] rows (shard.md
/// §1), with the columns and checksums of version 3.
pub const SHARD_FORMAT_VERSION: u32 = 4;
/// The oldest shard format this build reads (version 1: no checksums).
pub const SHARD_FORMAT_VERSION_MIN: u32 = 1;
pub const META_FORMAT_VERSION: &str = "trajlog.shard_format_version";
/// Format 2: the byte range and crc32 of every column chunk (shard.md §7).
pub const META_CHUNK_CRC32: &str = "trajlog.chunk_crc32";
pub const META_TABLE: &str = "trajlog.table";
pub const META_SCHEMA_DOC: &str = "trajlog.schema";

fn list_of(item: DataType, nullable_items: bool) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, nullable_items)))
}

/// One row per call, as this build writes it (shard format 4).
pub fn steps_schema() -> Arc<Schema> {
    steps_schema_of(SHARD_FORMAT_VERSION)
}

/// The `steps` schema of shard format `version`: formats 1 and 2 lack the
/// columns format 3 moved out of `extra` (shard.md §2.1).
pub fn steps_schema_of(version: u32) -> Arc<Schema> {
    let moved = version >= 3;
    let fields = vec![
        Field::new("trace_id", DataType::Utf8, false),
        Field::new("session_id", DataType::Utf8, false),
        Field::new("call_index", DataType::UInt32, false),
        Field::new("timestamp", DataType::Float64, false),
        Field::new("model", DataType::Utf8, true),
        Field::new("weight_version", DataType::Int64, true),
        Field::new("prompt_ids", list_of(DataType::UInt32, false), false),
        Field::new("completion_ids", list_of(DataType::UInt32, false), false),
        Field::new("logprobs", list_of(DataType::Float32, false), true),
        Field::new("finish_reason", DataType::Utf8, true),
        Field::new("tito_break", DataType::Boolean, false),
        Field::new("relation", DataType::Utf8, false),
        Field::new("divergence_position", DataType::UInt32, true),
        Field::new("reward", DataType::Float64, true),
        Field::new("messages", DataType::Utf8, true),
        Field::new("response_message", DataType::Utf8, true),
        Field::new("metadata", DataType::Utf8, true),
        Field::new("raw_request", DataType::Utf8, true),
        Field::new("raw_response", DataType::Utf8, true),
        Field::new("session_uids", list_of(DataType::Utf8, false), false),
        Field::new("latency_ms", DataType::Float64, true),
        Field::new("routing_matrices", DataType::Binary, true),
        Field::new("extra", DataType::Utf8, true),
        Field::new("key_order", DataType::Utf8, true),
        Field::new("extra_splice", list_of(DataType::UInt32, false), true),
        Field::new("source_segment", DataType::UInt64, false),
        Field::new("source_offset", DataType::UInt64, false),
    ];
    let moved_only = ["raw_request", "raw_response", "key_order", "extra_splice"];
    Arc::new(Schema::new(
        fields.into_iter().filter(|f| moved || !moved_only.contains(&f.name().as_str())).collect::<Vec<_>>(),
    ))
}

/// One row per chain of calls linked by exact extension.
pub fn trajectories_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("session_id", DataType::Utf8, false),
        Field::new("segment_index", DataType::UInt32, false),
        Field::new("group_id", DataType::Utf8, false),
        Field::new("token_ids", list_of(DataType::UInt32, false), false),
        Field::new("loss_mask", list_of(DataType::UInt8, false), false),
        Field::new("logprobs", list_of(DataType::Float32, false), false),
        Field::new("call_starts", list_of(DataType::UInt32, false), false),
        Field::new("completion_lens", list_of(DataType::UInt32, false), false),
        Field::new("num_calls", DataType::UInt32, false),
        Field::new("trace_ids", list_of(DataType::Utf8, false), false),
        Field::new("reward", DataType::Float64, true),
        Field::new("weight_version_min", DataType::Int64, true),
        Field::new("weight_version_max", DataType::Int64, true),
    ]))
}

/// One column chunk's byte range and crc32 (format-spec/shard.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkCrc {
    pub offset: u64,
    pub len: u64,
    pub crc32: u32,
}

/// The value of [`META_CHUNK_CRC32`]: a JSON array with one element per row
/// group, each an array of `[offset, len, crc32]` per column chunk in leaf
/// column order, as decimal integers without spaces (shard.md §7).
pub fn encode_chunk_crcs(row_groups: &[Vec<ChunkCrc>]) -> String {
    let mut out = String::from("[");
    for (i, rg) in row_groups.iter().enumerate() {
        out.push_str(if i == 0 { "[" } else { ",[" });
        for (j, c) in rg.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            out.push_str(&format!("[{},{},{}]", c.offset, c.len, c.crc32));
        }
        out.push(']');
    }
    out.push(']');
    out
}

/// Parse [`encode_chunk_crcs`]'s text; `None` if it is not that shape.
pub fn decode_chunk_crcs(text: &str) -> Option<Vec<Vec<ChunkCrc>>> {
    let raw: Vec<Vec<(u64, u64, u32)>> = serde_json::from_str(text).ok()?;
    Some(
        raw.into_iter()
            .map(|rg| rg.into_iter().map(|(offset, len, crc32)| ChunkCrc { offset, len, crc32 }).collect())
            .collect(),
    )
}

/// A column chunk's byte range as its metadata gives it (the dictionary page
/// if any, else the first data page, and the compressed size); `None` if the
/// metadata holds negative numbers. (`ColumnChunkMetaData::byte_range` panics
/// on those; metadata read from disk must never make a reader panic.)
pub fn chunk_range(col: &parquet::file::metadata::ColumnChunkMetaData) -> Option<(u64, u64)> {
    let start = col.dictionary_page_offset().unwrap_or(col.data_page_offset());
    Some((u64::try_from(start).ok()?, u64::try_from(col.compressed_size()).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_crcs_golden_text_and_round_trip() {
        let rgs = vec![
            vec![ChunkCrc { offset: 4, len: 10, crc32: 0 }, ChunkCrc { offset: 14, len: 6, crc32: u32::MAX }],
            vec![ChunkCrc { offset: 20, len: 1, crc32: 7 }],
        ];
        let text = encode_chunk_crcs(&rgs);
        assert_eq!(text, "[[[4,10,0],[14,6,4294967295]],[[20,1,7]]]");
        assert_eq!(decode_chunk_crcs(&text), Some(rgs));
        assert_eq!(encode_chunk_crcs(&[]), "[]");
        for bad in ["", "[[[1,2]]]", "[[[1,2,4294967296]]]", "[[[-1,2,3]]]", "{}", "[[[1,2,3,4]]]", "[[[1,2,3]]"] {
            assert_eq!(decode_chunk_crcs(bad), None, "{bad}");
        }
    }
}
