//! Where a store's bytes are, and what keeps them: live-bytes accounting
//! per segment and per shard (`trajlog space`).
//!
//! A segment is freed (retired) only once nothing needs its records
//! (format-spec/shard.md §6): its calls compacted or dead, none of them a
//! parent of a call still in segments. So what keeps a segment on disk is,
//! first of all, the live calls it still serves — most often those of a
//! session that never finished (a straggler), which is never compacted.
//! This report counts, per segment, the frames of live calls served from
//! it, of live calls now served from shards, of dead calls (replaced or
//! deleted) and of annotations, and names the sessions that keep it (those
//! with a live call still in segments), most bytes first. It reads the footers (a sealed segment) or the
//! frames (the active one) and the index; no record body is decoded.

use crate::error::Result;
use crate::format::frame::{frame_bytes, read_frame, FrameRead};
use crate::format::record::{Loc, KIND_CALL};
use crate::format::segment::{FooterEntry, HEADER_BYTES};
use crate::segment::SegmentRef;
use crate::snapshot::Snapshot;
use std::collections::HashMap;

/// One segment's bytes, by what its frames hold.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SegmentSpace {
    pub id: u64,
    pub path: std::path::PathBuf,
    pub sealed: bool,
    /// The file's length (a sealed segment: header, frames, footer,
    /// trailer); the active segment: its written part (the rest is
    /// preallocated, sparse).
    pub file_bytes: u64,
    /// Frames of live calls served from this segment (not compacted).
    pub live_bytes: u64,
    pub live_calls: u64,
    /// Frames of live calls now served from shards: freed when the segment
    /// is retired.
    pub compacted_bytes: u64,
    pub compacted_calls: u64,
    /// Frames of calls replaced or deleted since (kept while they may be a
    /// live call's prefix-delta parent, or keep a shard row dead).
    pub dead_bytes: u64,
    pub dead_calls: u64,
    /// Frames of seals, rewards and session deletions.
    pub annotation_bytes: u64,
    pub annotations: u64,
    /// Bytes whose frames could not be read (damage the store was opened
    /// past, or a footer that does not decode and frames after a bad one).
    pub unreadable_bytes: u64,
    /// The sessions that keep this segment on disk, most bytes first (at
    /// most 16): those with records here and a live call still served from
    /// segments (here or elsewhere). Retirement keeps every record of such
    /// a session, since any may be a prefix-delta parent. A segment can
    /// also be kept, until a collection, by a dead call whose trace has a
    /// shard row or by a deletion of compacted rows.
    pub kept_by: Vec<SessionBytes>,
    /// How many sessions keep it (`kept_by` lists the first 16).
    pub kept_by_sessions: u64,
    /// Whether every session that keeps it is unfinished (not sealed).
    pub kept_only_by_open_sessions: bool,
}

/// A session's records in one segment (its calls, live or not).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SessionBytes {
    pub session_id: String,
    pub calls: u64,
    pub bytes: u64,
    /// Whether the session is sealed (finished): a sealed session is
    /// compacted by the next `trajlog compact`; an open one waits for its
    /// seal (or for `--older-than`).
    pub sealed: bool,
}

/// One published `steps` shard: its rows, and how many are still live.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardSpace {
    pub path: std::path::PathBuf,
    pub file_bytes: u64,
    pub rows: u64,
    /// Rows that are the live call of their trace id; the others (replaced
    /// or deleted after compaction) go when a collection rewrites the file.
    pub live_rows: u64,
}

/// The store directory's other files: derived from the shards or
/// bookkeeping, not live data.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OtherFiles {
    /// `shards/trajectories/*.parquet`: one row per chain, with the chain's
    /// tokens again, for the trainer (format-spec/shard.md §3).
    pub trajectories_bytes: u64,
    /// `shards/index.tsi`, the shard index file (a cache of the `steps`
    /// shards' index columns, format-spec/shard-index.md), and
    /// `shards/index.tsa`, its annotation cache (§7), and `backlog.tbi`,
    /// the backlog index file, with its delta `backlog-delta.tbi`
    /// (format-spec/backlog-index.md).
    pub index_file_bytes: u64,
    /// Everything else: the manifest, the rewards side table, the lock,
    /// files a crash left (staged shards, temporary files), segments
    /// retired but not deleted yet.
    pub other_bytes: u64,
}

/// A store's bytes: per segment, per `steps` shard, the other files, and
/// in total.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpaceReport {
    pub segments: Vec<SegmentSpace>,
    pub shards: Vec<ShardSpace>,
    pub other: OtherFiles,
}

impl SpaceReport {
    /// Bytes of every segment file.
    pub fn segment_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.file_bytes).sum()
    }

    /// Bytes of every `steps` shard file.
    pub fn shard_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_bytes).sum()
    }

    /// Bytes of every file in the store directory (the active segment
    /// counted up to its written part, as in [`SegmentSpace::file_bytes`]).
    pub fn total_bytes(&self) -> u64 {
        self.segment_bytes()
            + self.shard_bytes()
            + self.other.trajectories_bytes
            + self.other.index_file_bytes
            + self.other.other_bytes
    }

    /// What `trajlog space --json` and Python's `Store.space()` report:
    /// the totals, the two ratios to the live data, the segments, shards
    /// and other files, and the index's layers.
    pub fn to_json(&self, index: &crate::snapshot::IndexLayers) -> serde_json::Value {
        let (live, logged, total) = (self.live_bytes(), self.segment_bytes() + self.shard_bytes(), self.total_bytes());
        let over_live = |bytes: u64| (live > 0).then(|| bytes as f64 / live as f64);
        serde_json::json!({
            "segment_bytes": self.segment_bytes(),
            "shard_bytes": self.shard_bytes(),
            "live_bytes": live,
            "disk_over_live": over_live(logged),
            "total_bytes": total,
            "total_over_live": over_live(total),
            "other": self.other,
            "segments": self.segments,
            "shards": self.shards,
            "index": index,
        })
    }

    /// The live data: frames of live calls still in segments, the live
    /// fraction of each shard (by rows), and the annotations of segments
    /// that hold nothing else (the current seals and rewards carried
    /// forward), which the store needs.
    pub fn live_bytes(&self) -> u64 {
        let in_segments: u64 = self.segments.iter().map(|s| s.live_bytes).sum();
        let carried: u64 = self
            .segments
            .iter()
            .filter(|s| s.live_calls + s.compacted_calls + s.dead_calls == 0)
            .map(|s| s.annotation_bytes)
            .sum();
        let in_shards: u64 = self
            .shards
            .iter()
            .map(|s| if s.rows == 0 { 0 } else { (s.file_bytes as u128 * s.live_rows as u128 / s.rows as u128) as u64 })
            .sum();
        in_segments + carried + in_shards
    }
}

/// The entries of a segment's frames: its footer's (sealed), else read
/// from the frames; a frame that does not read is counted as unreadable
/// and the scan goes on at the next valid frame (as a skip-corrupted open
/// does), so the calls after damage are still accounted.
fn entries_of(seg: &SegmentRef) -> (Vec<FooterEntry>, u64) {
    if seg.sealed {
        let trailer = crate::format::segment::read_trailer(seg.mapped_bytes());
        if let Some(Ok(entries)) = trailer.map(|t| crate::format::segment::decode_footer(seg.mapped_bytes(), &t)) {
            return (entries, 0);
        }
    }
    let bytes = seg.bytes();
    let end = bytes.len() as u64;
    let mut entries = Vec::new();
    let mut unreadable = 0;
    let mut offset = HEADER_BYTES;
    loop {
        let read = match read_frame(bytes, offset) {
            Ok(FrameRead::Frame { body, next }) => {
                crate::segment::recovery::entry_of_body(offset, body).ok().map(|e| (e, next))
            }
            Ok(FrameRead::End) => return (entries, unreadable),
            Err(_) => None,
        };
        match read {
            Some((e, next)) => {
                entries.push(e);
                offset = next;
            }
            None => {
                let resume = crate::segment::recovery::next_valid_frame(bytes, offset).unwrap_or(end);
                unreadable += resume.saturating_sub(offset);
                if resume >= end {
                    return (entries, unreadable);
                }
                offset = resume;
            }
        }
    }
}

/// How many sessions a segment's `kept_by` names at most.
const KEPT_BY_MAX: usize = 16;

/// Account every segment and `steps` shard of `snap`. O(frames in
/// segments + live calls); reads footers and, for the active segment, its
/// frames.
pub fn space(snap: &Snapshot) -> Result<SpaceReport> {
    let view = &snap.view;
    let mut report = SpaceReport::default();
    // Retirement keeps every record of a session that still has a live
    // call served from segments (any of them may be its prefix-delta
    // parent): those sessions keep the segments that hold their records.
    let in_segments: std::collections::HashSet<&str> = view
        .index
        .hot_calls()
        .values()
        .filter(|m| !view.shards.is_compacted(m.loc))
        .filter_map(|m| m.sessions.first().map(|s| &**s))
        .chain(view.index.cold_calls().filter(|(loc, _)| !view.shards.is_compacted(*loc)).map(|(_, session)| session))
        .collect();
    for seg in view.segments.values() {
        let file_bytes = if seg.sealed {
            std::fs::metadata(seg.path.as_path()).map_or(seg.visible_len, |m| m.len())
        } else {
            seg.visible_len
        };
        let (entries, unreadable_bytes) = entries_of(seg);
        let mut s = SegmentSpace {
            id: seg.id,
            path: seg.path.as_path().to_path_buf(),
            sealed: seg.sealed,
            file_bytes,
            unreadable_bytes,
            ..SegmentSpace::default()
        };
        let mut keepers: HashMap<&str, (u64, u64)> = HashMap::new();
        for e in &entries {
            let bytes = frame_bytes(u64::from(e.body_len));
            if e.kind != KIND_CALL {
                s.annotation_bytes += bytes;
                s.annotations += 1;
                continue;
            }
            let loc = Loc { segment: seg.id, offset: e.frame_offset };
            let live = view.index.is_live_at(e.id.as_str(), loc);
            if !live {
                s.dead_bytes += bytes;
                s.dead_calls += 1;
            } else if view.shards.is_compacted(loc) {
                s.compacted_bytes += bytes;
                s.compacted_calls += 1;
            } else {
                s.live_bytes += bytes;
                s.live_calls += 1;
            }
            if in_segments.contains(e.session_id.as_str()) {
                let k = keepers.entry(e.session_id.as_str()).or_default();
                k.0 += 1;
                k.1 += bytes;
            }
        }
        let mut kept_by: Vec<SessionBytes> = keepers
            .into_iter()
            .map(|(id, (calls, bytes))| SessionBytes {
                session_id: id.to_owned(),
                calls,
                bytes,
                sealed: snap.is_sealed(id),
            })
            .collect();
        s.kept_by_sessions = kept_by.len() as u64;
        s.kept_only_by_open_sessions = !kept_by.is_empty() && kept_by.iter().all(|k| !k.sealed);
        kept_by.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.session_id.cmp(&b.session_id)));
        kept_by.truncate(KEPT_BY_MAX);
        s.kept_by = kept_by;
        report.segments.push(s);
    }
    for (_, path, rows, live_rows) in snap.shard_liveness() {
        // A footer that cannot be decoded counts no rows (its bytes still count).
        let rows = rows.unwrap_or(0);
        let file_bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        report.shards.push(ShardSpace { path, file_bytes, rows, live_rows });
    }
    if let Some(dir) = view.segments.values().next().and_then(|s| s.path.parent().map(std::path::Path::to_path_buf)) {
        report.other = other_files(&dir, &report);
    }
    // Lookups that met a damaged block of the shard index file (a
    // read-only view) may have miscounted: an error, not wrong figures.
    snap.check_index()?;
    Ok(report)
}

/// The bytes of every file under `dir`, recursively, except the segments
/// and `steps` shards `report` counts; a file that cannot be read as it
/// is listed (one removed meanwhile) counts 0.
fn other_files(dir: &std::path::Path, report: &SpaceReport) -> OtherFiles {
    let counted: std::collections::HashSet<&std::path::Path> = report
        .segments
        .iter()
        .map(|s| s.path.as_path())
        .chain(report.shards.iter().map(|s| s.path.as_path()))
        .collect();
    let shards = dir.join(crate::storage::SHARDS_DIR);
    let index_file = shards.join(crate::shard::index_file::INDEX_FILE_NAME);
    let annotation_cache = shards.join(crate::store::ANNOTATION_CACHE_FILE);
    let backlog_file = dir.join(crate::store::BACKLOG_FILE);
    let backlog_delta = dir.join(crate::store::BACKLOG_DELTA_FILE);
    let trajectories = shards.join("trajectories");
    let mut other = OtherFiles::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(path);
            } else if !counted.contains(path.as_path()) {
                if [&index_file, &annotation_cache, &backlog_file, &backlog_delta].contains(&&path) {
                    other.index_file_bytes += meta.len();
                } else if path.starts_with(&trajectories) {
                    other.trajectories_bytes += meta.len();
                } else {
                    other.other_bytes += meta.len();
                }
            }
        }
    }
    other
}
