//! The backlog index file, `DIR/backlog.tbi` (format-spec/backlog-index.md):
//! what an open of a store with many calls in sealed segments would
//! otherwise rebuild from every footer — the cold layer (store/cold.rs:
//! the sessions nothing but their own records names, in flat tables) and
//! the footer entries of the same segments that the layer does not take
//! (the *warm* entries, replayed into the maps) — written by a writable
//! open that built a cold layer of at least
//! [`Options::backlog_index_min_calls`] calls, and mapped by the next opens,
//! which then read none of those segments' footers.
//!
//! Like the shard index file and the annotation cache, it is a cache of a
//! pure function of what it names: the *listed* sealed segments (id and
//! their trailer's footer offset, length and crc32) and the shard index
//! file the survey ran against (its key, or none for a store without
//! shards). An open uses it only when every listed segment is still
//! sealed in the manifest with the same trailer, the shards are the ones
//! it was keyed to, and nothing else (the annotation cache, a
//! skip-corrupted recovery) reads those segments; otherwise it surveys the
//! log as before. So losing or damaging it costs time, never data, and a
//! crash at any point of its replacement leaves either file, both
//! consistent.
//!
//! Why an open with it answers as one without it: the survey that built
//! it put a session in the layer only when no record of the whole log then
//! named it or its trace ids except its own calls, seals and session
//! rewards, and no shard row did; the listed segments' other entries are
//! kept verbatim, in log order. Records written after it (in segments it
//! does not list) that name a cold session thaw it into the maps before
//! they apply, as a read-only refresh does, so the replay rules
//! (format-spec/record.md §6) run on the calls they ran on before.
//!
//! The writer also keeps a *delta* over it, `DIR/backlog-delta.tbi`
//! ([`write_delta`], backlog-index.md §4): the same layout over the sealed
//! segments after the file's, keyed to the file, whose layer an open maps
//! as a second cold layer. It never takes a record the file holds or names
//! (the file's layer and its warm entries' names stand for the log before
//! it), so the file's warm entries stay valid beside it.

use super::*;
use crate::format::record::Loc;
use crate::format::record::{KIND_CALL, KIND_REWARD, KIND_SEAL};
use crate::format::segment::Trailer;
use crate::format::segment::{CheckedFooter, FooterEntryRef};
use crate::index::frozen::{id_hash, CachedMarks, Frozen, FrozenRow, FrozenSession, RowRef, RowSessions, TraceEntry};
use crate::storage::mmap::Mapping;
use crate::storage::table::{BlockCheck, Table, CHECK_BLOCK};
use annotation_cache::IndexKey;
use std::collections::HashSet;
use std::io::{BufWriter, Write};
use std::sync::Arc;

/// The file's name, in the store directory.
pub(crate) const BACKLOG_FILE_NAME: &str = "backlog.tbi";
/// What a crash during its replacement may leave behind.
pub(crate) const BACKLOG_TMP_NAME: &str = "backlog.tbi.tmp";
/// The delta over it (format-spec/backlog-index.md §4): the same layout,
/// listing the sealed segments after the ones it lists, keyed to it.
pub(crate) const DELTA_FILE_NAME: &str = "backlog-delta.tbi";
/// What a crash during the delta's replacement may leave behind.
pub(crate) const DELTA_TMP_NAME: &str = "backlog-delta.tbi.tmp";
/// Header flag: the file is a delta (bytes 16..20 and 24..32 then hold
/// its base's key).
const FLAG_DELTA: u32 = 2;
const MAGIC: [u8; 8] = *b"TRJLBLX1";
/// The version written and read.
pub(crate) const BACKLOG_VERSION: u32 = 1;
const HEADER_LEN: usize = 72;
const LISTED_LEN: usize = 40;
/// The tables, in file order: frozen rows, sessions, trace table, text,
/// the sealed and has-reward bit sets, the rewards.
const TABLES: usize = 7;

/// [`BlockCheck`]'s note for the file.
const NOTE: &str = "a lookup of this view may have missed a call of the backlog (an open checks the backlog index \
     file a block at a time, as lookups read it). The file is a cache of the sealed segments' footers: \
     `Store::refresh` loads the view again without it, and a writable open writes it anew";

/// A sealed segment the file covers, as its trailer names its footer, and
/// where its warm entries are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Listed {
    pub id: u64,
    pub footer_offset: u64,
    pub footer_len: u64,
    pub footer_crc32: u32,
    /// How many of its footer entries the file keeps (the warm ones).
    pub warm_count: u32,
    /// Their bytes (segment.md §4 encoding, rewards in the entry).
    pub warm_len: u64,
}

/// What names a base file to its delta: the base's head crc32 (its bytes
/// 64..68) and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BaseKey {
    head_crc32: u32,
    len: u64,
}

/// An open, checked backlog index file.
#[derive(Debug, Clone)]
pub(crate) struct BacklogFile {
    map: Arc<Mapping>,
    /// The shard index file it was built against; `None`: a store without
    /// shards.
    pub shard_key: Option<IndexKey>,
    /// For a delta: the key of the base file it extends.
    base_key: Option<BaseKey>,
    /// For a base file an open uses: its delta, when one extends it and
    /// matches the manifest ([`usable`]).
    delta: Option<Arc<BacklogFile>>,
    pub listed: Vec<Listed>,
    /// Byte offset of each listed segment's warm entries.
    warm_at: Vec<usize>,
    /// (byte offset, length) of each table, in file order.
    tables: [(usize, usize); TABLES],
    rows: usize,
    sessions: usize,
    by_trace: usize,
    /// Checks the tables' blocks as lookups read them; `None` when every
    /// table was checked whole at the open (a writer's).
    check: Option<Arc<BlockCheck>>,
}

/// `n` rounded up to a multiple of 8; `None` past `usize::MAX`.
fn pad8(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(8)
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// The (offset, length) of each table for these counts, the first at `at`,
/// and where the block checksums start.
fn table_spans(
    at: usize,
    rows: usize,
    sessions: usize,
    by_trace: usize,
    text: usize,
) -> Option<([(usize, usize); TABLES], usize)> {
    let words = sessions.div_ceil(64).checked_mul(8)?;
    let lens = [
        rows.checked_mul(std::mem::size_of::<FrozenRow>())?,
        sessions.checked_mul(std::mem::size_of::<FrozenSession>())?,
        by_trace.checked_mul(std::mem::size_of::<TraceEntry>())?,
        text,
        words,
        words,
        sessions.checked_mul(8)?,
    ];
    let mut out = [(0, 0); TABLES];
    let mut next = at;
    for (o, len) in out.iter_mut().zip(lens) {
        *o = (next, len);
        next = pad8(next.checked_add(len)?)?;
    }
    Some((out, next))
}

/// Whether footer entry `e` is a record of a session in `cold` (by name
/// hash) that the cold layer takes (cold.rs, `ColdPlan::take`): a call of
/// that session alone, its seal, its session reward. The survey keeps out
/// of the layer every session a reward the open keeps names, so a taken
/// reward is never one of those.
pub(super) fn taken(cold: &HashSet<u64>, e: &FooterEntryRef<'_>) -> bool {
    match (e.kind, e.reward_target) {
        (KIND_CALL, _) => e.session_uids.is_empty() && cold.contains(&id_hash(e.session_id)),
        (KIND_SEAL, _) | (KIND_REWARD, 2) => cold.contains(&id_hash(e.id)),
        _ => false,
    }
}

/// A section's bytes, its block checksums appended to `crcs`.
fn block_crcs(bytes: &[u8], crcs: &mut Vec<u32>) {
    crcs.extend(bytes.chunks(CHECK_BLOCK).map(crc32fast::hash));
}

/// Writes through a running crc32 of the head (header excepted).
struct Out {
    w: BufWriter<File>,
    at: usize,
    path: PathBuf,
}

impl Out {
    fn put(&mut self, bytes: &[u8], head: Option<&mut crc32fast::Hasher>) -> Result<()> {
        if let Some(h) = head {
            h.update(bytes);
        }
        self.at += bytes.len();
        self.w.write_all(bytes).map_err(|e| Error::io(format!("write {}", self.path.display()), e))
    }

    fn pad(&mut self, head: Option<&mut crc32fast::Hasher>) -> Result<()> {
        let n = self.at.next_multiple_of(8) - self.at;
        self.put([0u8; 8].get(..n).unwrap_or_default(), head)
    }
}

/// What a writable open hands [`write`]: the sealed segments it replayed
/// (in log order, mapped), the cold layer it built and the sessions it
/// took (by name hash), the key of its shard index file.
pub(super) struct ToWrite<'a> {
    pub segments: Vec<&'a SegmentRef>,
    pub cold: &'a Frozen,
    pub taken: &'a HashSet<u64>,
    pub shard_key: Option<IndexKey>,
}

/// Write the file into `dir`, replacing any: a temporary file, fsynced,
/// renamed, the directory fsynced. Returns its size; `Ok(0)` (nothing
/// written, any old file removed) when a segment's footer does not read
/// cleanly (a damaged or gapped footer: such segments are surveyed at
/// every open, which reports them).
pub(super) fn write(dir: &Path, w: &ToWrite<'_>, faults: &crate::storage::fault::Faults) -> Result<u64> {
    tmp_removed_on_error(dir, BACKLOG_TMP_NAME, write_through_tmp(dir, w, faults))
}

/// `written`, the temporary file a failed write left removed (the next
/// writable open would remove it too).
fn tmp_removed_on_error(dir: &Path, tmp: &str, written: Result<u64>) -> Result<u64> {
    if written.is_err() {
        let _ = recovery::remove_if_present(&dir.join(tmp));
    }
    written
}

/// A listed segment of a file to write: its trailer, and its warm entries
/// (how many, their bytes).
struct ListedPart {
    id: u64,
    trailer: Trailer,
    count: u32,
    bytes: Vec<u8>,
}

/// The seals and session rewards the listed segments set for the layer's
/// sessions (by name), in log order.
type Marks<'a> = std::collections::HashMap<&'a str, (bool, Option<f64>)>;

/// Take in footer entry `e`, which the layer takes: a seal or session
/// reward sets its session's mark.
fn mark<'a>(marks: &mut Marks<'a>, e: &FooterEntryRef<'a>) {
    match (e.kind, e.reward_target) {
        (KIND_SEAL, _) => marks.entry(e.id).or_default().0 = true,
        (KIND_REWARD, 2) => marks.entry(e.id).or_default().1 = Some(e.timestamp),
        _ => {}
    }
}

/// The calls a layer being written takes: (position, timestamp, trace id,
/// session).
type TakenCalls<'a> = Vec<(Loc, f64, &'a str, &'a str)>;

/// Listed segment `id` (with `trailer`) of a file to write, from its
/// entries: those of the sessions in `cold` go to the layer (calls to
/// `calls`, seals and session rewards to `marks`), the others are its warm
/// entries.
fn split_entries<'a>(
    id: u64,
    trailer: Trailer,
    entries: impl IntoIterator<Item = FooterEntryRef<'a>>,
    cold: &HashSet<u64>,
    calls: &mut TakenCalls<'a>,
    marks: &mut Marks<'a>,
) -> ListedPart {
    let (mut bytes, mut count) = (Vec::new(), 0u32);
    for e in entries {
        if !taken(cold, &e) {
            crate::format::segment::encode_entry(&mut bytes, &e, true);
            count += 1;
        } else if e.kind == KIND_CALL {
            calls.push((Loc { segment: id, offset: e.frame_offset }, e.timestamp, e.id, e.session_id));
        } else {
            mark(marks, &e);
        }
    }
    ListedPart { id, trailer, count, bytes }
}

/// A sealed segment's footer as a file may list it: read cleanly, with no
/// gap, its rewards' targets in its entries.
fn listable<'a>(bytes: &'a [u8]) -> Option<(Trailer, CheckedFooter<'a>)> {
    crate::format::segment::read_trailer(bytes).and_then(|t| {
        let f = crate::format::segment::check_footer(bytes, &t).ok()?;
        (f.gaps.is_empty() && (f.has_reward_targets || !f.iter().any(|e| e.kind == KIND_REWARD))).then_some((t, f))
    })
}

fn write_through_tmp(dir: &Path, w: &ToWrite<'_>, faults: &crate::storage::fault::Faults) -> Result<u64> {
    let dst = dir.join(BACKLOG_FILE_NAME);
    // Each listed segment's checked footer.
    let mut footers = Vec::with_capacity(w.segments.len());
    for seg in &w.segments {
        match listable(seg.mapped_bytes()) {
            Some(f) => footers.push((seg.id, f)),
            None => {
                recovery::remove_if_present(&dst).map_err(|e| Error::io("remove a stale backlog index file", e))?;
                return Ok(0);
            }
        }
    }
    // The warm entries of each segment, encoded once to learn their
    // lengths (for the listed table that precedes them), then written.
    // The seals and session rewards are what the listed segments' taken
    // entries set, in log order: not the layer's, which holds those of
    // the unlisted (active) segment too.
    let mut parts = Vec::with_capacity(footers.len());
    let mut marks = Marks::new();
    for (seg, (id, (trailer, f))) in w.segments.iter().zip(&footers) {
        let mut bytes = Vec::new();
        let mut count = 0u32;
        for e in f.iter() {
            if taken(w.taken, &e) {
                mark(&mut marks, &e);
            } else {
                crate::format::segment::encode_entry(&mut bytes, &e, true);
                count += 1;
            }
        }
        parts.push(ListedPart { id: *id, trailer: *trailer, count, bytes });
        // Its footer was read twice (checked, encoded): not again.
        seg.release_pages();
    }
    write_parts(dir, Target::Base, w.cold, w.shard_key, parts, marks, faults)
}

/// Which file [`write_parts`] writes.
#[derive(Clone, Copy)]
enum Target {
    /// `backlog.tbi` (its delta, if any, is removed once it is replaced).
    Base,
    /// `backlog-delta.tbi`, over the base file of this key.
    Delta(BaseKey),
}

/// Write a file of layer `cold` (with `marks`), listing `parts` in order,
/// through a temporary file; its size.
fn write_parts(
    dir: &Path,
    target: Target,
    cold: &Frozen,
    shard_key: Option<IndexKey>,
    parts: Vec<ListedPart>,
    marks: Marks<'_>,
    faults: &crate::storage::fault::Faults,
) -> Result<u64> {
    let (name, tmp_name) = match target {
        Target::Base => (BACKLOG_FILE_NAME, BACKLOG_TMP_NAME),
        Target::Delta(_) => (DELTA_FILE_NAME, DELTA_TMP_NAME),
    };
    let dst = dir.join(name);
    crate::storage::fault::check(faults, crate::storage::fault::Op::Replace { path: &dst })
        .map_err(|e| Error::io(format!("replace {}", dst.display()), e))?;
    let tmp = dir.join(tmp_name);
    let file = File::create(&tmp).map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
    let mut out = Out { w: BufWriter::with_capacity(1 << 20, file), at: 0, path: tmp.clone() };
    let t = cold.tables();
    let sessions = t.sessions.len();
    let mut marks: Vec<_> = marks.into_iter().map(|(name, m)| (id_hash(name), name, m)).collect();
    marks.sort_unstable_by_key(|m| m.0);
    let words = sessions.div_ceil(64);
    let (mut sealed, mut has_reward, mut rewards) = (vec![0u64; words], vec![0u64; words], vec![0u64; sessions]);
    let mut at = 0;
    for (_, name, (seal, reward)) in marks {
        let Some(i) = cold.session_from(&mut at, name) else { continue };
        if seal {
            crate::index::frozen::set_bit(&mut sealed, i);
        }
        if let Some(r) = reward {
            crate::index::frozen::set_bit(&mut has_reward, i);
            if let Some(slot) = rewards.get_mut(i as usize) {
                *slot = r.to_bits();
            }
        }
    }
    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&BACKLOG_VERSION.to_le_bytes());
    // A delta is written for a store without shards only.
    let (flags, key_crc, key_len) = match (target, shard_key) {
        (Target::Delta(base), _) => (FLAG_DELTA, base.head_crc32, base.len),
        (Target::Base, Some(k)) => (1, k.dir_crc32, k.len),
        (Target::Base, None) => (0, 0, 0),
    };
    header.extend_from_slice(&flags.to_le_bytes());
    header.extend_from_slice(&key_crc.to_le_bytes());
    header.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    header.extend_from_slice(&key_len.to_le_bytes());
    header.extend_from_slice(&(t.rows.len() as u64).to_le_bytes());
    header.extend_from_slice(&(t.by_trace.len() as u64).to_le_bytes());
    header.extend_from_slice(&(t.text.len() as u64).to_le_bytes());
    header.extend_from_slice(&(sessions as u32).to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    let mut listed = Vec::with_capacity(parts.len() * LISTED_LEN);
    for p in &parts {
        listed.extend_from_slice(&p.id.to_le_bytes());
        listed.extend_from_slice(&p.trailer.footer_offset.to_le_bytes());
        listed.extend_from_slice(&p.trailer.footer_len.to_le_bytes());
        listed.extend_from_slice(&p.trailer.footer_crc.to_le_bytes());
        listed.extend_from_slice(&p.count.to_le_bytes());
        listed.extend_from_slice(&(p.bytes.len() as u64).to_le_bytes());
    }
    let mut head = crc32fast::Hasher::new();
    head.update(&header);
    // The header's two checksums are written last, in place.
    out.put(&header, None)?;
    out.put(&[0u8; 8], None)?;
    out.put(&listed, Some(&mut head))?;
    for p in &parts {
        out.put(&p.bytes, Some(&mut head))?;
        out.pad(Some(&mut head))?;
    }
    drop(parts);
    let mut crcs = Vec::new();
    let tables: [&[u8]; TABLES] = [
        bytemuck::cast_slice(t.rows),
        bytemuck::cast_slice(t.sessions),
        bytemuck::cast_slice(t.by_trace),
        t.text,
        bytemuck::cast_slice(&sealed),
        bytemuck::cast_slice(&has_reward),
        bytemuck::cast_slice(&rewards),
    ];
    for bytes in tables {
        block_crcs(bytes, &mut crcs);
        out.put(bytes, None)?;
        out.pad(None)?;
    }
    let crc_bytes: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
    out.put(&crc_bytes, None)?;
    out.pad(None)?;
    let len = out.at as u64;
    let mut sums = Vec::with_capacity(8);
    sums.extend_from_slice(&head.finalize().to_le_bytes());
    sums.extend_from_slice(&crc32fast::hash(&crc_bytes).to_le_bytes());
    let mut file = out.w.into_inner().map_err(|e| Error::io(format!("write {}", tmp.display()), e.into_error()))?;
    let written = (|| -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom};
        file.seek(SeekFrom::Start((HEADER_LEN - 8) as u64))?;
        file.write_all(&sums)?;
        crate::storage::fault::sync(faults, &file, &tmp, true)
    })();
    written.map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
    drop(file);
    std::fs::rename(&tmp, &dst).map_err(|e| Error::io(format!("rename over {}", dst.display()), e))?;
    if matches!(target, Target::Base) {
        // A delta over the file replaced extends it no more.
        let _ = recovery::remove_if_present(&dir.join(DELTA_FILE_NAME));
    }
    crate::storage::sync_dir(dir, faults)?;
    Ok(len)
}

/// Write the file anew over the sealed segments of `manifest` (all of its
/// segments, none of them active; no shards) from the file there now and
/// the footers of the segments it does not list, instead of from every
/// footer: its layer's sessions stay (with the calls, seals and session
/// rewards of them that the new segments hold), its warm entries and the
/// new footers' entries are surveyed against it
/// ([`cold::survey_increment`]), and the sessions that qualify join the
/// layer. The file written is the one a survey of every footer could
/// have written (`verify` compares it with the footers the same way).
/// Returns its size; `Ok(None)` (nothing written) when there is no file
/// to start from, it does not check, a new segment's footer is not
/// listable, the survey needs records of the old layer back, or the
/// layer would hold fewer than `backlog_index_min_calls` calls: the
/// caller then surveys the whole log.
pub(super) fn write_incremental(dir: &Path, manifest: &Manifest, options: &Options) -> Result<Option<u64>> {
    let Some(f) = BacklogFile::open(dir, true) else { return Ok(None) };
    if f.shard_key.is_some() || !manifest.shards.is_empty() || !f.matches(dir, manifest) || !f.check_whole() {
        return Ok(None);
    }
    // The check read the whole file: the build below reads it again in
    // its own order.
    f.map.release_pages();
    let Some(old) = f.frozen() else { return Ok(None) };
    let Some(maps) = map_unlisted(dir, manifest, &f) else { return Ok(None) };
    let Some(new_footers) = listable_footers(&maps) else { return Ok(None) };
    type Entries<'e> = Box<dyn Iterator<Item = FooterEntryRef<'e>> + 'e>;
    let entries = || {
        let warm = f.listed.iter().map(|l| -> Entries<'_> { Box::new(f.warm(l.id)) });
        warm.chain(new_footers.iter().map(|(_, _, footer)| -> Entries<'_> { Box::new(footer.iter()) }))
    };
    let Some(mut taken_now) = super::cold::survey_increment(entries(), &old) else { return Ok(None) };
    taken_now.extend((0..old.session_count()).map(|i| old.session_hash(i)));
    // The old layer's marks, then what the entries the layer takes set.
    let mut marks = Marks::new();
    for i in 0..old.session_count() {
        let (sealed, reward) = (old.is_sealed(i), old.reward(i));
        if sealed || reward.is_some() {
            marks.insert(old.session_name(i), (sealed, reward));
        }
    }
    let trailers = f
        .listed
        .iter()
        .map(|l| {
            (l.id, Trailer { footer_offset: l.footer_offset, footer_len: l.footer_len, footer_crc: l.footer_crc32 })
        })
        .chain(new_footers.iter().map(|(id, t, _)| (*id, *t)));
    let mut parts = Vec::new();
    // The new layer's calls after the old one's.
    let mut calls = TakenCalls::new();
    for ((id, trailer), entries) in trailers.zip(entries()) {
        parts.push(split_entries(id, trailer, entries, &taken_now, &mut calls, &mut marks));
    }
    let n_old = old.len();
    let row = |i: u32| {
        let i = i as usize;
        let (loc, timestamp, trace_id, session) = match i.checked_sub(n_old) {
            None => {
                let r = old.row(i as u32)?;
                (r.loc(), r.timestamp, old.trace_id(r), old.session_name_checked(r.session)?)
            }
            Some(j) => *calls.get(j)?,
        };
        let pos = crate::shard::reader::ShardPos { shard: 0, row_group: 0, row: 0 };
        Some(RowRef { loc, timestamp, pos, trace_id, sessions: RowSessions::One(session) })
    };
    let Some(layer) = Frozen::build_from(n_old + calls.len(), row) else { return Ok(None) };
    // A row of the old layer did not read; or a layer too small to write
    // (an old file written under a lower minimum): as the survey's.
    let min = options.backlog_index_min_calls;
    if layer.len() != n_old + calls.len() || min == 0 || (layer.len() as u64) < min {
        return Ok(None);
    }
    drop(calls);
    // What the build copied need not stay resident beside the write.
    f.map.release_pages();
    for (_, map) in &maps {
        map.release_pages();
    }
    tmp_removed_on_error(
        dir,
        BACKLOG_TMP_NAME,
        write_parts(dir, Target::Base, &layer, None, parts, marks, &options.faults),
    )
    .map(Some)
}

/// The segments of `manifest` that `f` does not list, mapped; `None` when
/// one is not sealed or does not map.
fn map_unlisted(dir: &Path, manifest: &Manifest, f: &BacklogFile) -> Option<Vec<(u64, Mapping)>> {
    let mut maps = Vec::new();
    for ms in manifest.segments.iter().filter(|s| !f.lists(s.id)) {
        if ms.state != SegmentState::Sealed {
            return None;
        }
        let path = crate::storage::segment_path(dir, ms.id);
        let file = File::open(&path).ok()?;
        let len = file.metadata().ok()?.len();
        maps.push((ms.id, Mapping::map(&file, len, &path).ok()?));
    }
    Some(maps)
}

/// Each segment's footer as a file may list it ([`listable`]); `None` when
/// one is not.
fn listable_footers(maps: &[(u64, Mapping)]) -> Option<Vec<(u64, Trailer, CheckedFooter<'_>)>> {
    maps.iter().map(|(id, map)| listable(map.bytes()).map(|(t, f)| (*id, t, f))).collect()
}

/// Write the delta over the file there (format-spec/backlog-index.md §4)
/// listing the sealed segments of `manifest` after the ones the file lists
/// (all of `manifest`'s segments are sealed; no shards): their footers
/// surveyed with the file standing for the log before them
/// ([`cold::survey_delta`]), the sessions that qualify in its layer, their
/// other entries as its warm entries. It replaces any delta there.
/// Returns its size; `Ok(None)` (nothing written) when there is no usable
/// file, no segment after it, or a footer that is not listable.
pub(super) fn write_delta(dir: &Path, manifest: &Manifest, options: &Options) -> Result<Option<u64>> {
    let Some(base) = BacklogFile::open(dir, true) else { return Ok(None) };
    if base.shard_key.is_some() || !manifest.shards.is_empty() || !base.matches(dir, manifest) {
        return Ok(None);
    }
    let (Some(key), Some(layer)) = (base.key(), base.frozen()) else { return Ok(None) };
    let Some(maps) = map_unlisted(dir, manifest, &base) else { return Ok(None) };
    let Some(footers) = listable_footers(&maps) else { return Ok(None) };
    if footers.is_empty() {
        return Ok(None);
    }
    type Entries<'e> = Box<dyn Iterator<Item = FooterEntryRef<'e>> + 'e>;
    let warm = base.listed.iter().map(|l| -> Entries<'_> { Box::new(base.own_warm(l.id)) });
    let Some(warm_names) = recovery::names_of(warm, std::iter::empty()) else { return Ok(None) };
    let warm_names: HashSet<u64> = warm_names.into_iter().collect();
    let entries = || footers.iter().map(|(_, _, f)| -> Entries<'_> { Box::new(f.iter()) });
    let Some(taken_now) = super::cold::survey_delta(entries(), &warm_names, &layer) else { return Ok(None) };
    drop(warm_names);
    let (mut parts, mut marks, mut calls) = (Vec::with_capacity(footers.len()), Marks::new(), TakenCalls::new());
    for (id, trailer, footer) in &footers {
        parts.push(split_entries(*id, *trailer, footer.iter(), &taken_now, &mut calls, &mut marks));
    }
    let row = |i: u32| {
        let (loc, timestamp, trace_id, session) = *calls.get(i as usize)?;
        let pos = crate::shard::reader::ShardPos { shard: 0, row_group: 0, row: 0 };
        Some(RowRef { loc, timestamp, pos, trace_id, sessions: RowSessions::One(session) })
    };
    let delta = match calls.is_empty() {
        true => Frozen::default(),
        false => match Frozen::build_from(calls.len(), row) {
            Some(d) if d.len() == calls.len() => d,
            _ => return Ok(None),
        },
    };
    drop(calls);
    base.map.release_pages();
    let written = write_parts(dir, Target::Delta(key), &delta, None, parts, marks, &options.faults);
    tmp_removed_on_error(dir, DELTA_TMP_NAME, written).map(Some)
}

impl BacklogFile {
    /// The file in `dir`, mapped and checked: its head (header, listed
    /// segments, warm entries) whole, its tables a block at a time as
    /// lookups read them (`lazy`) or whole now. `None` when there is none
    /// or it does not pass (an open then surveys the log).
    pub(crate) fn open(dir: &Path, lazy: bool) -> Option<BacklogFile> {
        Self::open_named(dir, BACKLOG_FILE_NAME, lazy).filter(|f| f.base_key.is_none())
    }

    /// The delta file in `dir` ([`BacklogFile::open`]'s checks).
    fn open_delta(dir: &Path, lazy: bool) -> Option<BacklogFile> {
        Self::open_named(dir, DELTA_FILE_NAME, lazy).filter(|f| f.base_key.is_some())
    }

    fn open_named(dir: &Path, name: &str, lazy: bool) -> Option<BacklogFile> {
        let path = dir.join(name);
        let file = File::open(&path).ok()?;
        let len = file.metadata().ok()?.len();
        let map = Arc::new(Mapping::map(&file, len, &path).ok()?);
        let f = Self::decode(map, &path, lazy);
        if let Some(f) = &f {
            // Its tables are read in place as lookups need them.
            f.map.release_pages();
        }
        f
    }

    fn decode(map: Arc<Mapping>, path: &Path, lazy: bool) -> Option<BacklogFile> {
        let b = map.bytes();
        if b.get(..8)? != MAGIC || le_u32(b, 8)? != BACKLOG_VERSION {
            return None;
        }
        let flags = le_u32(b, 12)?;
        if !matches!(flags, 0 | 1 | FLAG_DELTA) || le_u32(b, 60)? != 0 {
            return None;
        }
        let (key_crc, key_len) = (le_u32(b, 16)?, le_u64(b, 24)?);
        let shard_key = (flags == 1).then_some(IndexKey { dir_crc32: key_crc, len: key_len });
        let base_key = (flags == FLAG_DELTA).then_some(BaseKey { head_crc32: key_crc, len: key_len });
        let n_listed = le_u32(b, 20)? as usize;
        let rows = usize::try_from(le_u64(b, 32)?).ok()?;
        let by_trace = usize::try_from(le_u64(b, 40)?).ok()?;
        let text = usize::try_from(le_u64(b, 48)?).ok()?;
        let sessions = le_u32(b, 56)? as usize;
        let (head_crc, crcs_crc) = (le_u32(b, 64)?, le_u32(b, 68)?);
        let listed_end = HEADER_LEN.checked_add(n_listed.checked_mul(LISTED_LEN)?)?;
        // The count is not checked yet: the table must be in the file
        // before anything is sized by it.
        b.get(HEADER_LEN..listed_end)?;
        let mut listed = Vec::with_capacity(n_listed);
        let mut warm_at = Vec::with_capacity(n_listed);
        let mut at = listed_end;
        for i in 0..n_listed {
            let e = HEADER_LEN + i * LISTED_LEN;
            let l = Listed {
                id: le_u64(b, e)?,
                footer_offset: le_u64(b, e + 8)?,
                footer_len: le_u64(b, e + 16)?,
                footer_crc32: le_u32(b, e + 24)?,
                warm_count: le_u32(b, e + 28)?,
                warm_len: le_u64(b, e + 32)?,
            };
            if listed.last().is_some_and(|p: &Listed| p.id >= l.id) {
                return None;
            }
            warm_at.push(at);
            at = pad8(at.checked_add(usize::try_from(l.warm_len).ok()?)?)?;
            listed.push(l);
        }
        let head_end = at;
        let mut h = crc32fast::Hasher::new();
        h.update(b.get(..HEADER_LEN - 8)?);
        h.update(b.get(HEADER_LEN..head_end)?);
        if h.finalize() != head_crc {
            return None;
        }
        let (tables, crcs_at) = table_spans(head_end, rows, sessions, by_trace, text)?;
        let blocks: usize = tables.iter().map(|(_, len)| len.div_ceil(CHECK_BLOCK)).sum();
        let crcs_end = crcs_at.checked_add(blocks.checked_mul(4)?)?;
        if pad8(crcs_end)? != b.len() || crc32fast::hash(b.get(crcs_at..crcs_end)?) != crcs_crc {
            return None;
        }
        // The warm entries parse (they are replayed from the mapping).
        for (l, at) in listed.iter().zip(&warm_at) {
            let end = at.checked_add(usize::try_from(l.warm_len).ok()?)?;
            let f = CheckedFooter::checked_before(b, *at..end, l.warm_count);
            if f.iter().count() != l.warm_count as usize {
                return None;
            }
        }
        let crcs = Table::<u32>::mapped(&map, crcs_at, blocks)?;
        let mut sections = Vec::with_capacity(TABLES);
        let mut first = 0;
        for (offset, len) in tables {
            sections.push(Some((offset, len, first)));
            first += len.div_ceil(CHECK_BLOCK);
        }
        let check = Arc::new(BlockCheck::new(map.clone(), path, sections, crcs, NOTE)?);
        if !lazy && !check.ok_all() {
            return None;
        }
        Some(BacklogFile {
            map,
            shard_key,
            base_key,
            delta: None,
            listed,
            warm_at,
            tables,
            rows,
            sessions,
            by_trace,
            check: lazy.then_some(check),
        })
    }

    /// Whether it (or its delta) lists segment `id`.
    pub(crate) fn lists(&self, id: u64) -> bool {
        self.listed(id).is_some()
    }

    /// The listed segment `id`, its own or its delta's.
    pub(crate) fn listed(&self, id: u64) -> Option<&Listed> {
        match self.listed.binary_search_by_key(&id, |l| l.id).ok().and_then(|i| self.listed.get(i)) {
            Some(l) => Some(l),
            None => self.delta.as_ref().and_then(|d| d.listed(id)),
        }
    }

    /// Whether its delta lists segment `id`.
    pub(crate) fn delta_lists(&self, id: u64) -> bool {
        self.delta.as_ref().is_some_and(|d| d.lists(id))
    }

    /// The segments it and its delta list.
    pub(crate) fn listed_count(&self) -> usize {
        self.listed.len() + self.delta.as_ref().map_or(0, |d| d.listed.len())
    }

    /// The last segment its delta lists, if it has one.
    pub(crate) fn delta_through(&self) -> Option<u64> {
        self.delta.as_ref().and_then(|d| d.listed.last()).map(|l| l.id)
    }

    /// Its delta's cold layer ([`BacklogFile::frozen`]), if it has one.
    pub(crate) fn delta_frozen(&self) -> Option<Frozen> {
        self.delta.as_ref().and_then(|d| d.frozen())
    }

    /// The file without its delta.
    pub(crate) fn without_delta(&self) -> BacklogFile {
        BacklogFile { delta: None, ..self.clone() }
    }

    /// Its key, as a delta over it names it.
    fn key(&self) -> Option<BaseKey> {
        Some(BaseKey { head_crc32: le_u32(self.map.bytes(), 64)?, len: self.map.bytes().len() as u64 })
    }

    /// The warm entries of listed segment `id` (its own or its delta's), in
    /// log order.
    pub(crate) fn warm(&self, id: u64) -> Box<dyn Iterator<Item = FooterEntryRef<'_>> + '_> {
        match &self.delta {
            Some(d) if self.listed.binary_search_by_key(&id, |l| l.id).is_err() && d.lists(id) => d.warm(id),
            _ => Box::new(self.own_warm(id)),
        }
    }

    /// The warm entries of its own listed segment `id`, in log order.
    fn own_warm(&self, id: u64) -> impl Iterator<Item = FooterEntryRef<'_>> + '_ {
        let i = self.listed.binary_search_by_key(&id, |l| l.id).ok();
        let f = i.and_then(|i| {
            let (l, at) = (self.listed.get(i)?, *self.warm_at.get(i)?);
            let end = at.checked_add(usize::try_from(l.warm_len).ok()?)?;
            Some(CheckedFooter::checked_before(self.map.bytes(), at..end, l.warm_count))
        });
        f.into_iter().flat_map(|f| f.iter())
    }

    /// Its cold layer, read in place, with its seals and session rewards.
    pub(crate) fn frozen(&self) -> Option<Frozen> {
        let t = |k: usize| self.tables.get(k).copied().unwrap_or_default();
        let checked = |table: Option<Table<u64>>, k: usize| match &self.check {
            Some(c) => table.map(|x| x.checked_by(c, k)),
            None => table,
        };
        let rows = Table::<FrozenRow>::mapped(&self.map, t(0).0, self.rows)?;
        let sessions = Table::<FrozenSession>::mapped(&self.map, t(1).0, self.sessions)?;
        let by_trace = Table::<TraceEntry>::mapped(&self.map, t(2).0, self.by_trace)?;
        let text = Table::<u8>::mapped(&self.map, t(3).0, t(3).1)?;
        let words = self.sessions.div_ceil(64);
        let sealed = checked(Table::<u64>::mapped(&self.map, t(4).0, words), 4)?;
        let has_reward = checked(Table::<u64>::mapped(&self.map, t(5).0, words), 5)?;
        let rewards = checked(Table::<u64>::mapped(&self.map, t(6).0, self.sessions), 6)?;
        let (rows, sessions, by_trace, text) = match &self.check {
            Some(c) => {
                (rows.checked_by(c, 0), sessions.checked_by(c, 1), by_trace.checked_by(c, 2), text.checked_by(c, 3))
            }
            None => (rows, sessions, by_trace, text),
        };
        let mut frozen = Frozen::from_tables(text, rows, sessions, by_trace);
        frozen.set_cached(CachedMarks { sealed, has_reward, rewards }).then_some(frozen)
    }

    /// Whether every listed segment is sealed in `manifest` with the
    /// trailer the file names (read from the file's last bytes), and they
    /// are the manifest's first segments.
    pub(crate) fn matches(&self, dir: &Path, manifest: &Manifest) -> bool {
        // The listed segments come first in the log, none between them
        // unlisted: an open replays the others after the file's layer
        // (a record there thaws what it names, as a later record would).
        let last = self.listed.last().map_or(0, |l| l.id);
        if manifest.segments.iter().filter(|s| s.id <= last).count() != self.listed.len() {
            return false;
        }
        self.trailers_match(dir, manifest)
    }

    /// Whether every listed segment is sealed in `manifest` with the
    /// trailer the file names (read from the file's last bytes).
    fn trailers_match(&self, dir: &Path, manifest: &Manifest) -> bool {
        let sealed: HashSet<u64> =
            manifest.segments.iter().filter(|s| s.state == SegmentState::Sealed).map(|s| s.id).collect();
        self.listed.iter().all(|l| {
            sealed.contains(&l.id)
                && crate::segment::recovery::trailer_on_disk(dir, l.id).is_some_and(|t| {
                    (t.footer_offset, t.footer_len, t.footer_crc) == (l.footer_offset, l.footer_len, l.footer_crc32)
                })
        })
    }

    /// Check every table block; whether all pass.
    pub(crate) fn check_whole(&self) -> bool {
        self.check.as_ref().is_none_or(|c| c.ok_all())
    }
}

/// The file in `dir` when an open of `manifest` may use it: it passes its
/// checks and every listed segment is sealed there with the same trailer
/// (the shard key is checked by the open, once the shards are loaded);
/// with its delta when that one passes the same and extends it.
pub(crate) fn usable(dir: &Path, manifest: &Manifest, lazy: bool) -> Option<BacklogFile> {
    let mut f = BacklogFile::open(dir, lazy)?;
    if !f.matches(dir, manifest) {
        return None;
    }
    f.delta = usable_delta(dir, manifest, &f, lazy).map(Arc::new);
    Some(f)
}

/// The delta in `dir` over `base` (a usable base file) when an open of
/// `manifest` may use it: it passes its checks, names `base`'s key, and
/// lists sealed segments of `manifest`, with the same trailers, that are
/// the ones right after `base`'s (none between unlisted); `base` is over
/// a store without shards.
fn usable_delta(dir: &Path, manifest: &Manifest, base: &BacklogFile, lazy: bool) -> Option<BacklogFile> {
    if base.shard_key.is_some() || !manifest.shards.is_empty() {
        return None;
    }
    let d = BacklogFile::open_delta(dir, lazy)?;
    let after = base.listed.last()?.id;
    let (first, last) = (d.listed.first()?.id, d.listed.last()?.id);
    let between = manifest.segments.iter().filter(|s| s.id > after && s.id <= last).count();
    let ok = d.base_key == base.key() && first > after && between == d.listed.len() && d.trailers_match(dir, manifest);
    ok.then_some(d)
}

/// Remove the file in `dir` (and its delta with it) if it lists one of
/// `ids` (segments retired: it is stale then), else the delta alone if it
/// does, reading only their headers and listed tables. Best effort: a file left
/// is one no open uses, removed by the next writable open.
pub(super) fn remove_if_listing(dir: &Path, ids: &[u64], faults: &crate::storage::fault::Faults) {
    use std::os::unix::fs::FileExt;
    if ids.is_empty() {
        return;
    }
    let lists = |path: &Path| {
        let f = File::open(path).ok()?;
        let mut header = [0u8; HEADER_LEN];
        f.read_exact_at(&mut header, 0).ok()?;
        let n = le_u32(&header, 20)? as u64;
        let len = f.metadata().ok()?.len();
        let table = n.checked_mul(LISTED_LEN as u64).filter(|t| t.saturating_add(HEADER_LEN as u64) <= len)?;
        let mut listed = vec![0u8; usize::try_from(table).ok()?];
        f.read_exact_at(&mut listed, HEADER_LEN as u64).ok()?;
        Some(listed.chunks_exact(LISTED_LEN).any(|l| le_u64(l, 0).is_some_and(|id| ids.contains(&id))))
    };
    let (base, delta) = (dir.join(BACKLOG_FILE_NAME), dir.join(DELTA_FILE_NAME));
    // One that does not read is left to the next writable open.
    let base_gone = lists(&base) == Some(true) && recovery::remove_if_present(&base).is_ok();
    let delta_gone = (base_gone || lists(&delta) == Some(true)) && recovery::remove_if_present(&delta).is_ok();
    if base_gone || delta_gone {
        let _ = crate::storage::sync_dir(dir, faults);
    }
}

/// Whether the sealed segments of `manifest` that `file` does not list are
/// more than an eighth of those it lists (a writable open then writes it
/// anew from a survey of them all).
pub(crate) fn outgrown(file: &BacklogFile, manifest: &Manifest) -> bool {
    let sealed = manifest.segments.iter().filter(|s| s.state == SegmentState::Sealed).count();
    let unlisted = sealed.saturating_sub(file.listed.len());
    unlisted.saturating_mul(8) > file.listed.len()
}

/// The file, checked for `trajlog verify`: `None` when there is none or it
/// is stale (an open does not use it); else what is wrong with it.
pub(crate) fn check(dir: &Path, manifest: &Manifest) -> Option<String> {
    if !dir.join(BACKLOG_FILE_NAME).exists() {
        return None;
    }
    let fails = "fails its checks (header, listed segments, warm entries or block checksums)";
    let Some(f) = BacklogFile::open(dir, true) else { return Some(format!("it {fails}")) };
    if !f.matches(dir, manifest) {
        return None;
    }
    let delta = match (dir.join(DELTA_FILE_NAME).exists(), BacklogFile::open_delta(dir, true)) {
        (false, _) => None,
        (true, None) => return Some(format!("its delta ({DELTA_FILE_NAME}) {fails}")),
        (true, Some(d)) => usable_delta(dir, manifest, &f, true).map(|_| d),
    };
    for (what, file) in [("", Some(&f)), ("its delta: ", delta.as_ref())] {
        let Some(file) = file else { continue };
        if !file.check_whole() {
            return Some(format!("{what}a block of its tables fails its crc32"));
        }
        // The check read the whole file (761 MB at 10M calls): its pages
        // need not stay resident beside what the comparison holds.
        file.map.release_pages();
        if let Some(problem) = file.content_problem(dir) {
            return Some(format!("{what}{problem}"));
        }
    }
    None
}

impl BacklogFile {
    /// What the file holds that the listed segments' footers do not make
    /// of it: for its cold sessions, the warm entries (every other entry,
    /// byte for byte), the rows' locations and the seals and session
    /// rewards; `None` when it agrees. (Which sessions went cold is the
    /// survey's choice over the whole log, not checked here.)
    fn content_problem(&self, dir: &Path) -> Option<String> {
        let Some(frozen) = self.frozen() else { return Some("its tables do not read".into()) };
        let cold: HashSet<u64> = (0..frozen.session_count()).map(|i| frozen.session_hash(i)).collect();
        let mut locs: Vec<(u64, u64)> = Vec::with_capacity(self.rows);
        let mut marks: std::collections::HashMap<String, (bool, Option<u64>)> = std::collections::HashMap::new();
        for (i, l) in self.listed.iter().enumerate() {
            let path = crate::storage::segment_path(dir, l.id);
            let what = |w: &str| Some(format!("listed segment {} ({}): {w}", l.id, path.display()));
            let Ok(file) = File::open(&path) else { return what("cannot be opened") };
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let Ok(map) = Mapping::map(&file, len, &path) else { return what("cannot be mapped") };
            let bytes = map.bytes();
            let footer = crate::format::segment::read_trailer(bytes)
                .and_then(|t| crate::format::segment::check_footer(bytes, &t).ok());
            let Some(footer) = footer else { return what("its footer does not read") };
            let (mut warm, mut count) = (Vec::new(), 0u32);
            for e in footer.iter() {
                if !taken(&cold, &e) {
                    crate::format::segment::encode_entry(&mut warm, &e, true);
                    count += 1;
                    continue;
                }
                match (e.kind, e.reward_target) {
                    (KIND_CALL, _) => locs.push((l.id, e.frame_offset)),
                    (KIND_SEAL, _) => marks.entry(e.id.to_owned()).or_default().0 = true,
                    (KIND_REWARD, _) => marks.entry(e.id.to_owned()).or_default().1 = Some(e.timestamp.to_bits()),
                    _ => {}
                }
            }
            let kept = self.warm_at.get(i).and_then(|&at| {
                let end = at.checked_add(usize::try_from(l.warm_len).ok()?)?;
                self.map.bytes().get(at..end)
            });
            if count != l.warm_count || kept != Some(warm.as_slice()) {
                return what("its footer entries of sessions not in the cold layer differ from the file's");
            }
            map.release_pages();
        }
        let mut rows: Vec<(u64, u64)> = frozen.rows().iter().map(|r| (r.loc().segment, r.loc().offset)).collect();
        self.map.release_pages();
        rows.sort_unstable();
        locs.sort_unstable();
        if rows != locs {
            return Some(format!(
                "its {} cold rows are not the {} calls of its cold sessions in the listed segments",
                rows.len(),
                locs.len()
            ));
        }
        for i in 0..frozen.session_count() {
            let name = frozen.session_name(i);
            let (sealed, reward) = marks.get(name).copied().unwrap_or_default();
            if (frozen.is_sealed(i), frozen.reward(i).map(f64::to_bits)) != (sealed, reward) {
                return Some(format!("cold session {name:?}: its seal or session reward differs from its records'"));
            }
        }
        None
    }
}
