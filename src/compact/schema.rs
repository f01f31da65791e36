//! Arrow schemas of the Parquet shards (format-spec/shard.md) and the key-value
//! metadata every shard carries.

use arrow_schema::{DataType, Field, Schema};
use std::sync::Arc;

/// Version of the shard schema (format-spec/shard.md); stored in each file's
/// key-value metadata under [`META_FORMAT_VERSION`].
pub const SHARD_FORMAT_VERSION: u32 = 1;
pub const META_FORMAT_VERSION: &str = "trajlog.shard_format_version";
pub const META_TABLE: &str = "trajlog.table";
pub const META_SCHEMA_DOC: &str = "trajlog.schema";

fn list_of(item: DataType, nullable_items: bool) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, nullable_items)))
}

/// One row per call.
pub fn steps_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
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
        Field::new("session_uids", list_of(DataType::Utf8, false), false),
        Field::new("latency_ms", DataType::Float64, true),
        Field::new("routing_matrices", DataType::Binary, true),
        Field::new("extra", DataType::Utf8, true),
        Field::new("source_segment", DataType::UInt64, false),
        Field::new("source_offset", DataType::UInt64, false),
    ]))
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
