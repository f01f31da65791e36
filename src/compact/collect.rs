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
//!
//! Merging uses the same rewrite: small generations (one per compaction of
//! a few sessions) are written again together once `merge_fanout` of them
//! are in one size tier, so the number of shard files grows with the log
//! of the rows, not with the number of compactions.

use crate::shard::generation_of;
use crate::snapshot::Snapshot;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// What a compaction collects.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// The generations replaced, ascending.
    pub generations: Vec<u64>,
    /// Those of `generations` replaced for their size (merged), not for
    /// their dead rows.
    pub merged: Vec<u64>,
    /// Their `steps` files' shard ids.
    pub shard_ids: HashSet<u32>,
    pub generation_of_shard: HashMap<u32, u64>,
    /// Primary session → the shard ids (of `shard_ids`) it has live calls in.
    pub moved: BTreeMap<String, Vec<u32>>,
    /// Dead rows in the generations replaced.
    pub dead_rows: u64,
    /// Live rows in the generations replaced: what the compaction writes
    /// again.
    pub moved_rows: u64,
    /// The `steps` files (of every generation) with a dead row.
    pub with_dead_rows: HashSet<u32>,
    /// Generations left alone because a `steps` file's footer could not be
    /// decoded (the file, why).
    pub unreadable: Vec<(u64, String)>,
}

/// Generations of at least this many `steps` rows are never merged: their
/// files are large already, and a merge would rewrite them for nothing.
pub const MERGE_MAX_ROWS: u64 = 1 << 20;

/// A generation's merge tier (format-spec/shard.md §6.2): ⌊log_F(rows)⌋ —
/// tier t holds F^t ≤ rows < F^(t+1) (an empty generation is in tier 0) —
/// and `None` from `MERGE_MAX_ROWS` rows on.
pub fn merge_tier(rows: u64, fanout: u32) -> Option<u32> {
    if rows >= MERGE_MAX_ROWS {
        return None;
    }
    let fanout = u64::from(fanout.max(2));
    let (mut tier, mut bound) = (0, fanout);
    while rows >= bound {
        tier += 1;
        bound = bound.saturating_mul(fanout);
    }
    Some(tier)
}

/// Choose the generations to rewrite: those whose dead rows are at least
/// `fraction` of their rows (any with a dead row when `fraction` is 0), any
/// with no live row left, and, with `merge_fanout` F, the generations of a
/// merge tier that holds F or more; never one in `excluded`. The live rows
/// written again stay within `budget` (format-spec/shard.md §6.4):
/// generations to collect are taken oldest first while they
/// fit (the first whatever its size, so that collection always
/// progresses), then each full tier's oldest generations while they fit,
/// at least two or none. O(live calls).
pub(super) fn plan(
    snap: &Snapshot,
    fraction: Option<f64>,
    merge_fanout: Option<u32>,
    excluded: &HashSet<u64>,
    budget: u64,
) -> Plan {
    if fraction.is_none() && merge_fanout.is_none() {
        return Plan::default();
    }
    // generation → (rows, live rows, its steps shard ids)
    let mut per_generation: BTreeMap<u64, (u64, u64, Vec<u32>)> = BTreeMap::new();
    let mut with_dead_rows = HashSet::new();
    // A generation with a file whose footer cannot be decoded is not
    // rewritten (its rows could not be read): the files stay as they are.
    let mut unreadable = HashSet::new();
    let mut unreadable_why = Vec::new();
    for (id, path, rows, live) in snap.shard_liveness() {
        let Some(g) = path.file_name().and_then(|n| n.to_str()).and_then(generation_of) else { continue };
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                if unreadable.insert(g) {
                    unreadable_why.push((g, e.message().to_owned()));
                }
                continue;
            }
        };
        if live < rows {
            with_dead_rows.insert(id);
        }
        let e = per_generation.entry(g).or_default();
        e.0 += rows;
        e.1 += live.min(rows);
        e.2.push(id);
    }
    let mut plan = Plan { with_dead_rows, unreadable: unreadable_why, ..Plan::default() };
    // merge tier → the generations in it not collected for dead rows
    let mut tiers: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for (&g, (rows, live, _)) in &per_generation {
        if excluded.contains(&g) || unreadable.contains(&g) {
            continue;
        }
        let dead = rows - live;
        let collect = fraction.is_some_and(|f| dead > 0 && (*live == 0 || dead as f64 >= f * *rows as f64));
        let fits = plan.moved_rows.saturating_add(*live) <= budget;
        if collect && (fits || plan.moved_rows == 0) {
            plan.generations.push(g);
            plan.moved_rows = plan.moved_rows.saturating_add(*live);
        } else if collect {
            // Past the budget: collected by a later compaction.
        } else if let Some(tier) = merge_fanout.and_then(|f| merge_tier(*rows, f)) {
            tiers.entry(tier).or_default().push(g);
        }
    }
    if let Some(fanout) = merge_fanout {
        for generations in tiers.into_values().filter(|gs| gs.len() >= fanout as usize) {
            // Oldest first (the map's order), while the budget holds them.
            let mut taken = Vec::new();
            let mut rows = 0u64;
            for g in generations {
                let live = per_generation.get(&g).map_or(0, |e| e.1);
                if plan.moved_rows.saturating_add(rows).saturating_add(live) > budget {
                    break;
                }
                rows = rows.saturating_add(live);
                taken.push(g);
            }
            if taken.len() >= 2 {
                plan.moved_rows = plan.moved_rows.saturating_add(rows);
                plan.merged.extend(&taken);
                plan.generations.extend(taken);
            }
        }
    }
    plan.generations.sort_unstable();
    plan.merged.sort_unstable();
    for &g in &plan.generations {
        let Some((rows, live, ids)) = per_generation.get(&g) else { continue };
        plan.dead_rows += rows - live;
        for &id in ids {
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
