//! Parquet trajectory shards (format-spec/shard.md): the schemas, the staged
//! file writer with its column chunk checksums, and the reader behind the
//! indexes and reads. Below the indexes and the store; compaction
//! (`crate::compact`) builds its rows and drives the writer.

pub mod extra;
pub(crate) mod index_check;
pub(crate) mod index_file;
pub(crate) mod index_merge;
pub mod reader;
pub mod schema;
pub mod set;
pub mod writer;

/// The compaction generation of a published shard file
/// (`TABLE/part-GGGGGG-PPPP.parquet`, format-spec/shard.md §1); `None` for a
/// name of any other form (never collected).
pub fn generation_of(path: &str) -> Option<u64> {
    let name = path.rsplit('/').next()?;
    let rest = name.strip_prefix("part-")?.strip_suffix(".parquet")?;
    let (generation, part) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(generation) || !digits(part) {
        return None;
    }
    generation.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn generation_of_reads_part_names_only() {
        use super::generation_of;
        assert_eq!(generation_of("steps/part-000012-0003.parquet"), Some(12));
        assert_eq!(generation_of("trajectories/part-1234567-0000.parquet"), Some(1_234_567));
        for other in ["steps/_tmp-000001-0000.parquet", "steps/part-x-0000.parquet", "steps/part-000001.parquet", "steps/a"] {
            assert_eq!(generation_of(other), None, "{other}");
        }
    }
}
