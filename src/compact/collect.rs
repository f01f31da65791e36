//! Collection (format-spec/shard.md §6.1): which earlier compactions'
//! shards a compaction writes again, keeping only their live rows.
//!
//! A row is dead when its call was deleted or replaced after compaction.
//! Dead rows take space, and the deletion or replacement records that keep
//! them dead pin their segments (§6). The unit rewritten is a generation
//! (all files of one earlier compaction): its `trajectories` rows cannot be
//! told apart by `steps` file, so its files are replaced together. Its live
//! calls are compacted again with this compaction's new calls, and its
//! files leave the published list in the same manifest write that adds the
//! new ones.

use crate::shard::generation_of;
use crate::snapshot::Snapshot;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// What a compaction collects.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// The generations replaced, ascending.
    pub generations: Vec<u64>,
    /// Their `steps` files' shard ids.
    pub shard_ids: HashSet<u32>,
    pub generation_of_shard: HashMap<u32, u64>,
    /// Primary session → the shard ids (of `shard_ids`) it has live calls in.
    pub moved: BTreeMap<String, Vec<u32>>,
    /// Dead rows in the generations replaced.
    pub dead_rows: u64,
}

/// Choose the generations to collect: those whose dead rows are at least
/// `fraction` of their rows (any with a dead row when `fraction` is 0),
/// and any with no live row left; never one in `excluded`. O(live calls).
pub(super) fn plan(snap: &Snapshot, fraction: Option<f64>, excluded: &HashSet<u64>) -> Plan {
    let Some(fraction) = fraction else { return Plan::default() };
    // generation → (rows, live rows, its steps shard ids)
    let mut per_generation: BTreeMap<u64, (u64, u64, Vec<u32>)> = BTreeMap::new();
    for (id, path, rows, live) in snap.shard_liveness() {
        let Some(g) = path.file_name().and_then(|n| n.to_str()).and_then(generation_of) else { continue };
        let e = per_generation.entry(g).or_default();
        e.0 += rows;
        e.1 += live.min(rows);
        e.2.push(id);
    }
    let mut plan = Plan::default();
    for (g, (rows, live, ids)) in per_generation {
        let dead = rows - live;
        let chosen = dead > 0 && (live == 0 || dead as f64 >= fraction * rows as f64);
        if !chosen || excluded.contains(&g) {
            continue;
        }
        plan.generations.push(g);
        plan.dead_rows += dead;
        for id in ids {
            plan.shard_ids.insert(id);
            plan.generation_of_shard.insert(id, g);
        }
    }
    if !plan.shard_ids.is_empty() {
        plan.moved = snap.sessions_in_shards(&plan.shard_ids);
    }
    plan
}

/// Bytes of the files (both tables) of `generations` under `shards_dir`.
pub(super) fn bytes_of(shards_dir: &Path, generations: &[u64]) -> u64 {
    if generations.is_empty() {
        return 0;
    }
    let mut total = 0;
    for table in crate::storage::SHARD_TABLES {
        let Ok(entries) = std::fs::read_dir(shards_dir.join(table)) else { continue };
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_str().and_then(generation_of).is_some_and(|g| generations.contains(&g)) {
                total += e.metadata().map_or(0, |m| m.len());
            }
        }
    }
    total
}
