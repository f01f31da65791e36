//! Parquet trajectory shards (format-spec/shard.md): the schemas, the staged
//! file writer with its column chunk checksums, and the reader behind the
//! indexes and reads. Below the indexes and the store; compaction
//! (`crate::compact`) builds its rows and drives the writer.

pub mod extra;
pub mod reader;
pub mod schema;
pub mod writer;
