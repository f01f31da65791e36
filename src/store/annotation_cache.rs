//! The annotation cache, `DIR/shards/index.tsa` (format-spec/shard-index.md
//! §7): the seals and rewards that the annotation-only segments of the log
//! set on the frozen sessions of the shard index file, so that an open
//! takes them in one pass over a few flat tables instead of parsing and
//! looking up every carried record (a compacted store carries one seal and
//! one reward per compacted session forward at each retirement: at 14.5M
//! calls, most of an open's time).
//!
//! Like the index file, it is a cache of a pure function of what it names:
//! the index file (its directory crc32 and length) and the *listed*
//! segments (id, footer position and footer crc32), each holding only
//! seals and rewards of frozen targets. Its values are those a replay of
//! the listed segments alone, in log order, leaves on a fresh frozen layer.
//! Losing it, or finding it stale, costs time at the next open, never data:
//! the listed segments stay the truth and are replayed as before.
//!
//! An open that uses it skips the listed segments' footers and sets the
//! values before its replay. For a frozen session, that is the replay's
//! result unless a record outside the listed segments *changes* it (a
//! deletion, a session or trace reward, a call or shard row replacing one
//! of its trace ids) *before* the last listed record that concerns it: up
//! to that record only listed records (and seals, which commute with
//! them, and calls that merely thaw it, copying the cache's values) touch
//! it, so its state there is the cache's, and what comes after sees that
//! state either way. The cache keeps, per session, the last listed
//! segment that concerns it; the replay checks each record it applies
//! before the last listed segment, and on such a record stops: the open
//! then replays everything again without the cache. A session reward
//! before a listed one of the same session is skipped instead (the replay
//! would overwrite it). format-spec/shard-index.md §7 has the whole rule.

use super::*;
use crate::format::segment::{read_trailer, FooterEntryRef};
use crate::index::frozen::{set_bit, Frozen};
use crate::shard::index_file::ShardIndex;
use crate::storage::fault::Faults;
use crate::storage::mmap::Mapping;
use crate::storage::table::{BlockCheck, Table, CHECK_BLOCK};
use std::sync::Arc;

/// The cache's file name, in `DIR/shards/`.
pub(crate) const CACHE_FILE_NAME: &str = "index.tsa";
/// What [`crate::storage::write_atomic`] leaves behind on a crash.
pub(crate) const CACHE_TMP_NAME: &str = "index.tsa.tmp";
const MAGIC: &[u8; 8] = b"TRJLSAN1";
/// The version written here: 2, with block checksums of the per-session
/// tables. Version 1 (one crc32 of the whole file) is read too.
pub(crate) const CACHE_VERSION: u32 = 2;
const HEADER_LEN: usize = 40;
const LISTED_LEN: usize = 24;

/// [`BlockCheck`]'s note for the cache.
const CACHE_NOTE: &str = "a seal or reward this read-only view read from it may be missing (a read-only open \
     checks the annotation cache a block at a time, as lookups read it). The file is a cache of the log's \
     annotation segments: `Store::refresh` loads the view again without it, and a writable open (`trajlog \
     compact`, any writer) writes it anew";

/// [`BlockCheck`]'s note for the cache of a writer (a writable open checks
/// it a block at a time too).
const WRITER_CACHE_NOTE: &str = "a seal or reward the writer read from it may be missing (a writable open \
     checks the annotation cache a block at a time, as lookups read it): the store refuses further writes, and \
     removes the file, a cache of the log's annotation segments, at its next write, flush or close; the next \
     open replays those segments and writes it anew";

/// The (byte offset, length) of each per-session table, each padded to 8
/// bytes, in file order — `last`, `last_reward`, `sealed`, `has_reward`,
/// `rewards` — for `sessions` frozen sessions, the first at `at`.
fn table_spans(at: usize, sessions: usize) -> Option<[(usize, usize); 5]> {
    let segment_table = sessions.div_ceil(2).checked_mul(8)?;
    let words = sessions.div_ceil(64).checked_mul(8)?;
    let lens = [segment_table, segment_table, words, words, sessions.checked_mul(8)?];
    let mut out = [(0, 0); 5];
    let mut next = at;
    for (o, len) in out.iter_mut().zip(lens) {
        *o = (next, len);
        next = next.checked_add(len)?;
    }
    Some(out)
}

/// The block checksums (version 2) of tables `spans` of file bytes `b`:
/// per table in order, the crc32 of each CHECK_BLOCK bytes from its start.
fn table_block_crcs(b: &[u8], spans: &[(usize, usize); 5]) -> Vec<u32> {
    spans
        .iter()
        .flat_map(|(at, len)| b.get(*at..at + len).unwrap_or_default().chunks(CHECK_BLOCK).map(crc32fast::hash))
        .collect()
}

/// How many block checksums (version 2) cover tables `spans`.
fn block_count(spans: &[(usize, usize); 5]) -> usize {
    spans.iter().map(|(_, len)| len.div_ceil(CHECK_BLOCK)).sum()
}

/// The crc32 of a version-2 file's bytes before `end`, outside the
/// per-session tables `region` (which its block checksums cover).
fn crc_outside(b: &[u8], region: std::ops::Range<usize>, end: usize) -> Option<u32> {
    let mut h = crc32fast::Hasher::new();
    h.update(b.get(..region.start)?);
    h.update(b.get(region.end..end)?);
    Some(h.finalize())
}

/// A segment the cache reflects, as its trailer names its footer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Listed {
    pub id: u64,
    pub footer_offset: u64,
    pub footer_crc32: u32,
}

/// The identity of a shard index file: the crc32 of its directory (which
/// holds every section's crc32) and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexKey {
    pub dir_crc32: u32,
    pub len: u64,
}

/// The cache's contents.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AnnotationCache {
    pub index: IndexKey,
    pub listed: Vec<Listed>,
    /// Frozen sessions of the index file.
    pub sessions: u32,
    /// Per frozen session, 0 when no listed record concerns it (a seal, a
    /// session reward, a trace reward of one of its rows), else 1 + the
    /// index in `listed` of the last segment with one that does.
    /// (These tables are read in place from the file an open uses.)
    last: Table<u32>,
    /// Likewise for the last listed segment with a session reward of it.
    last_reward: Table<u32>,
    /// Bit sets over the frozen sessions: those sealed, those with a
    /// session reward.
    sealed: Table<u64>,
    has_reward: Table<u64>,
    /// Per frozen session, its reward's bits (0 where it has none).
    rewards: Table<u64>,
    /// (frozen row, reward bits) of the trace rewards set, sorted by row.
    pub trace_rewards: Vec<(u32, u64)>,
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes)
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes)
}

/// The key of the index file in `shards_dir`, from its header (24 bytes
/// read, nothing checked: the open checks the file it uses).
pub(crate) fn index_key_on_disk(shards_dir: &Path) -> Option<IndexKey> {
    use std::os::unix::fs::FileExt;
    let f = File::open(shards_dir.join(crate::shard::index_file::INDEX_FILE_NAME)).ok()?;
    let len = f.metadata().ok()?.len();
    let mut head = [0u8; 24];
    f.read_exact_at(&mut head, 0).ok()?;
    Some(IndexKey { dir_crc32: le_u32(&head, 16)?, len })
}

/// The key of an open index file.
pub(crate) fn key_of(ix: &ShardIndex) -> Option<IndexKey> {
    let b = ix.mapping().bytes();
    Some(IndexKey { dir_crc32: le_u32(b, 16)?, len: b.len() as u64 })
}

impl AnnotationCache {
    fn empty(index: IndexKey, sessions: u32) -> AnnotationCache {
        let words = (sessions as usize).div_ceil(64);
        AnnotationCache {
            index,
            listed: Vec::new(),
            sessions,
            last: vec![0; sessions as usize].into(),
            last_reward: vec![0; sessions as usize].into(),
            sealed: vec![0; words].into(),
            has_reward: vec![0; words].into(),
            rewards: vec![0; sessions as usize].into(),
            trace_rewards: Vec::new(),
        }
    }

    /// Check every block of its per-session tables (those a lazy open
    /// checks as lookups read them): whether all pass.
    pub fn check_whole(&self) -> bool {
        // A whole slice checks every block of its table first; the tables
        // share the file's one block check, whose damage any of them says.
        let _ = (self.last.as_slice(), self.last_reward.as_slice(), self.sealed.as_slice());
        let _ = (self.has_reward.as_slice(), self.rewards.as_slice());
        self.last.damage().is_none()
    }

    /// The last listed segment with a record that concerns frozen session
    /// `session`, if any.
    pub fn last_naming(&self, session: u32) -> Option<u64> {
        // A segment past the list (a table read in place is checked as it
        // is read), or an entry in a block that fails its check: the latest
        // possible, so that anything conflicts and the open replays without
        // the cache.
        let Some(entry) = self.last.at(session as usize) else { return Some(u64::MAX) };
        let i = entry.checked_sub(1)?;
        Some(self.listed.get(i as usize).map_or(u64::MAX, |l| l.id))
    }

    /// Whether a record at `loc`, outside the listed segments, that changes
    /// frozen session `session` (or thaws it) is replayed before one of its
    /// listed records: replaying it after the cache's values would not
    /// give what the replay gives.
    pub fn conflicts(&self, session: u32, loc: Loc) -> bool {
        self.last_naming(session).is_some_and(|last| loc.segment < last)
    }

    /// The seals and session rewards, for the frozen layer to read in place.
    pub fn marks(&self) -> crate::index::frozen::CachedMarks {
        crate::index::frozen::CachedMarks {
            sealed: self.sealed.clone(),
            has_reward: self.has_reward.clone(),
            rewards: self.rewards.clone(),
        }
    }

    /// Whether a session reward of frozen session `session` at `loc`,
    /// outside the listed segments, is followed by a listed one: the replay
    /// would overwrite its value, so an open from the cache skips it.
    pub fn reward_superseded(&self, session: u32, loc: Loc) -> bool {
        let last = self.last_reward.at(session as usize).and_then(|i| i.checked_sub(1));
        last.and_then(|i| self.listed.get(i as usize)).is_some_and(|l| loc.segment < l.id)
    }

    /// The id of the last listed segment (records before it are checked).
    pub fn last_listed(&self) -> Option<u64> {
        self.listed.last().map(|l| l.id)
    }

    /// Whether segment `id` is listed.
    pub fn lists(&self, id: u64) -> bool {
        self.listed.iter().any(|l| l.id == id)
    }

    /// The file's bytes (format-spec/shard-index.md §7).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            HEADER_LEN
                + self.listed.len() * LISTED_LEN
                + self.last.len() * 8
                + (self.sealed.len() * 2 + self.rewards.len()) * 8
                + self.trace_rewards.len() * 16
                + 8,
        );
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&CACHE_VERSION.to_le_bytes());
        b.extend_from_slice(&(self.listed.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.index.dir_crc32.to_le_bytes());
        b.extend_from_slice(&self.sessions.to_le_bytes());
        b.extend_from_slice(&self.index.len.to_le_bytes());
        b.extend_from_slice(&(self.trace_rewards.len() as u64).to_le_bytes());
        for l in &self.listed {
            b.extend_from_slice(&l.id.to_le_bytes());
            b.extend_from_slice(&l.footer_offset.to_le_bytes());
            b.extend_from_slice(&l.footer_crc32.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        for table in [&self.last, &self.last_reward] {
            for l in table.iter() {
                b.extend_from_slice(&l.to_le_bytes());
            }
            if table.len() % 2 == 1 {
                b.extend_from_slice(&0u32.to_le_bytes());
            }
        }
        for w in self.sealed.iter().chain(self.has_reward.iter()).chain(self.rewards.iter()) {
            b.extend_from_slice(&w.to_le_bytes());
        }
        for (row, bits) in &self.trace_rewards {
            b.extend_from_slice(&row.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&bits.to_le_bytes());
        }
        // The block checksums of the per-session tables (written in the
        // layout `table_spans` gives), then the crc32 of everything else.
        let spans =
            table_spans(HEADER_LEN + self.listed.len() * LISTED_LEN, self.sessions as usize).unwrap_or_default();
        let crcs = table_block_crcs(&b, &spans);
        for crc in &crcs {
            b.extend_from_slice(&crc.to_le_bytes());
        }
        if crcs.len() % 2 == 1 {
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        let region = spans[0].0..spans[4].0 + spans[4].1;
        let crc = crc_outside(&b, region, b.len()).unwrap_or_default();
        b.extend_from_slice(&crc.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }

    /// Decode and check a file's bytes (copied into tables of its own);
    /// what is wrong otherwise.
    pub fn decode(b: &[u8]) -> std::result::Result<AnnotationCache, String> {
        let l = Layout::of(b)?;
        if let Some((at, _)) = l.block_crcs {
            for (i, crc) in table_block_crcs(b, &l.spans).into_iter().enumerate() {
                if le_u32(b, at + 4 * i) != Some(crc) {
                    return Err(format!("block checksum {i} of the per-session tables fails"));
                }
            }
        }
        let words = |at: usize, n: usize| -> Table<u64> {
            (0..n).map(|i| le_u64(b, at + i * 8).unwrap_or(0)).collect::<Vec<u64>>().into()
        };
        let segments = |at: usize| -> std::result::Result<Table<u32>, String> {
            let t: Vec<u32> = (0..l.sessions as usize).map(|i| le_u32(b, at + i * 4).unwrap_or(0)).collect();
            if t.iter().any(|s| *s as usize > l.listed.len()) {
                return Err("a session names a segment the file does not list".into());
            }
            Ok(t.into())
        };
        let n = l.sessions as usize;
        Ok(AnnotationCache {
            last: segments(l.at(0))?,
            last_reward: segments(l.at(1))?,
            sealed: words(l.at(2), l.words),
            has_reward: words(l.at(3), l.words),
            rewards: words(l.at(4), n),
            index: l.index,
            listed: l.listed,
            sessions: l.sessions,
            trace_rewards: l.trace_rewards,
        })
    }

    /// Check the file `path` mapped in `map` and read its per-session
    /// tables in place (~16 bytes a frozen session: an open sets nothing
    /// per session). Its segment tables are checked as they are read
    /// ([`AnnotationCache::last_naming`]). With `lazy` (a read-only open)
    /// and block checksums (version 2), the tables' blocks are checked as
    /// lookups first read them, and one that fails is recorded
    /// ([`Table::damage`]): the lookup misses. Else every byte is checked
    /// here.
    #[cfg(test)]
    pub fn decode_mapped(map: &Arc<Mapping>, path: &Path, lazy: bool) -> std::result::Result<AnnotationCache, String> {
        Self::decode_mapped_as(map, path, lazy, false)
    }

    /// [`AnnotationCache::decode_mapped`]; `writer`: a failed block's error
    /// says what a writer does about it.
    fn decode_mapped_as(
        map: &Arc<Mapping>,
        path: &Path,
        lazy: bool,
        writer: bool,
    ) -> std::result::Result<AnnotationCache, String> {
        let l = Layout::of(map.bytes())?;
        let n = l.sessions as usize;
        let bad = || "a table is misaligned".to_owned();
        let check = match l.block_crcs {
            None => None,
            Some((at, blocks)) => {
                let crcs = Table::<u32>::mapped(map, at, blocks).ok_or_else(bad)?;
                let mut first = 0;
                let sections = l
                    .spans
                    .iter()
                    .map(|(start, len)| {
                        let s = Some((*start, *len, first));
                        first += len.div_ceil(CHECK_BLOCK);
                        s
                    })
                    .collect();
                let check = Arc::new(
                    BlockCheck::new(
                        map.clone(),
                        path,
                        sections,
                        crcs,
                        if writer { WRITER_CACHE_NOTE } else { CACHE_NOTE },
                    )
                    .ok_or("the block checksums do not cover the tables")?,
                );
                if !lazy && !(0..l.spans.len()).all(|k| check.ok_whole(k)) {
                    return Err(check.damage().map_or_else(|| "a block fails its crc32".into(), |e| e.to_string()));
                }
                Some(check)
            }
        };
        // Table `k` of `count` elements, checked by `check` if any.
        fn table<T: bytemuck::Pod>(
            map: &Arc<Mapping>,
            l: &Layout,
            check: Option<&Arc<BlockCheck>>,
            k: usize,
            count: usize,
        ) -> std::result::Result<Table<T>, String> {
            let t = Table::mapped(map, l.at(k), count).ok_or_else(|| "a table is misaligned".to_owned())?;
            Ok(match check {
                Some(c) => t.checked_by(c, k),
                None => t,
            })
        }
        let check = check.as_ref();
        Ok(AnnotationCache {
            last: table(map, &l, check, 0, n)?,
            last_reward: table(map, &l, check, 1, n)?,
            sealed: table(map, &l, check, 2, l.words)?,
            has_reward: table(map, &l, check, 3, l.words)?,
            rewards: table(map, &l, check, 4, n)?,
            index: l.index,
            listed: l.listed,
            sessions: l.sessions,
            trace_rewards: l.trace_rewards,
        })
    }
}

/// Where a file's parts are (format-spec/shard-index.md §7), checked: magic,
/// version, length, crc32 (version 1: of the whole file; version 2: of
/// what the block checksums do not cover), the listed segments' order and
/// the trace rewards' order.
struct Layout {
    index: IndexKey,
    listed: Vec<Listed>,
    sessions: u32,
    words: usize,
    /// The per-session tables' (byte offset, padded length), in file order:
    /// `last`, `last_reward`, `sealed`, `has_reward`, `rewards`.
    spans: [(usize, usize); 5],
    /// Version 2: where its block checksums are, and how many.
    block_crcs: Option<(usize, usize)>,
    trace_rewards: Vec<(u32, u64)>,
}

impl Layout {
    fn of(b: &[u8]) -> std::result::Result<Layout, String> {
        if b.get(..8) != Some(&MAGIC[..]) {
            return Err("not an annotation cache (bad magic)".into());
        }
        let version = le_u32(b, 8).unwrap_or(0);
        if version != 1 && version != CACHE_VERSION {
            return Err(format!("annotation cache version {version}, this build reads 1 and {CACHE_VERSION}"));
        }
        let short = || "the file is shorter than its header says".to_owned();
        let listed_n = le_u32(b, 12).ok_or_else(short)? as usize;
        let index = IndexKey { dir_crc32: le_u32(b, 16).ok_or_else(short)?, len: le_u64(b, 24).ok_or_else(short)? };
        let sessions = le_u32(b, 20).ok_or_else(short)?;
        let traces_n = usize::try_from(le_u64(b, 32).ok_or_else(short)?).map_err(|_| short())?;
        let words = (sessions as usize).div_ceil(64);
        let spans = listed_n
            .checked_mul(LISTED_LEN)
            .and_then(|l| l.checked_add(HEADER_LEN))
            .and_then(|at| table_spans(at, sessions as usize))
            .ok_or_else(short)?;
        let [(first, _), _, _, _, (rewards, rewards_len)] = spans;
        let region = first..rewards.checked_add(rewards_len).ok_or_else(short)?;
        let traces_at = region.end;
        let crcs_at = traces_n.checked_mul(16).and_then(|t| t.checked_add(traces_at)).ok_or_else(short)?;
        let blocks = if version == 1 { 0 } else { block_count(&spans) };
        let body = blocks.div_ceil(2).checked_mul(8).and_then(|c| c.checked_add(crcs_at)).ok_or_else(short)?;
        let Some(whole) = body.checked_add(8) else { return Err(short()) };
        if b.len() != whole {
            return Err(format!("{} bytes, its header says {whole}", b.len()));
        }
        let crc = if version == 1 {
            Some(crc32fast::hash(b.get(..body).unwrap_or_default()))
        } else {
            crc_outside(b, region, body)
        };
        if le_u32(b, body) != crc || le_u32(b, body + 4) != Some(0) {
            return Err("the file fails its crc32".into());
        }
        let mut at = HEADER_LEN;
        let mut listed = Vec::with_capacity(listed_n);
        for _ in 0..listed_n {
            listed.push(Listed {
                id: le_u64(b, at).ok_or_else(short)?,
                footer_offset: le_u64(b, at + 8).ok_or_else(short)?,
                footer_crc32: le_u32(b, at + 16).ok_or_else(short)?,
            });
            at += LISTED_LEN;
        }
        if !listed.windows(2).all(|w| matches!(w, [a, b] if a.id < b.id)) {
            return Err("the listed segments are not in increasing id order".into());
        }
        let mut trace_rewards = Vec::with_capacity(traces_n);
        for i in 0..traces_n {
            let p = traces_at + i * 16;
            trace_rewards.push((le_u32(b, p).ok_or_else(short)?, le_u64(b, p + 8).ok_or_else(short)?));
        }
        if !trace_rewards.windows(2).all(|w| matches!(w, [a, b] if a.0 < b.0)) {
            return Err("the trace rewards are not sorted by row".into());
        }
        // An odd count ends with a zero word (the crc32 covers it).
        let block_crcs = (version != 1).then_some((crcs_at, blocks));
        Ok(Layout { index, listed, sessions, words, spans, block_crcs, trace_rewards })
    }

    /// The byte offset of per-session table `k` (file order).
    fn at(&self, k: usize) -> usize {
        self.spans.get(k).map_or(0, |s| s.0)
    }
}

/// What one record of a listed segment does.
enum Op {
    Seal(u32),
    SessionReward(u32, f64),
    /// (row, its session, value, whether the row's call is before the
    /// record: a reward before its call sets nothing, as at a replay).
    TraceReward(u32, u32, f64, bool),
}

/// The ops of a segment's records, or `None` when one of them is not a seal
/// or reward of a frozen target (the segment is then not listed).
fn ops_of<'e>(
    frozen: &Frozen,
    id: u64,
    entries: impl Iterator<Item = FooterEntryRef<'e>>,
    release: &dyn Fn(),
) -> Option<Vec<Op>> {
    use crate::format::record::{KIND_REWARD, KIND_SEAL};
    let mut ops = Vec::new();
    // A lookup per seal and reward in the index file's hash tables: a
    // segment of the 1.25M carried seals of a 10M-call store reads pages
    // all over them, given back as the walk goes.
    let mut budget = crate::storage::mmap::PageBudget::compaction();
    for e in entries {
        budget.tick(release);
        ops.push(match (e.kind, e.reward_target) {
            (KIND_SEAL, _) => Op::Seal(frozen.session(e.id)?),
            (KIND_REWARD, 2) => Op::SessionReward(frozen.session(e.id)?, e.timestamp),
            (KIND_REWARD, 1) => {
                let row = frozen.trace_row(e.id)?;
                let r = frozen.rows().get(row as usize)?;
                Op::TraceReward(row, r.session, e.timestamp, r.loc() < Loc { segment: id, offset: e.frame_offset })
            }
            _ => return None,
        });
    }
    Some(ops)
}

/// Build the cache of the sealed segments of `manifest` over index file
/// `ix` (whose key is `key`): every segment that loads cleanly and holds
/// only seals and rewards of its frozen targets is listed. When none is,
/// the cache lists nothing and has no session tables (S = 0): an open
/// that finds it has nothing to do, and a writable open does not look for
/// segments to list again.
pub(crate) fn build(dir: &Path, manifest: &Manifest, ix: &ShardIndex, key: IndexKey) -> AnnotationCache {
    build_on(dir, manifest, ix, key, None).0
}

/// What a store keeps of the cache it last wrote, so that the next
/// publication's build reads only the segments sealed since
/// ([`write_after`]): the index file it was keyed to, the segments it
/// listed, and the highest sealed segment it judged (every sealed segment
/// up to it was listed or found not to qualify, which, for one index file,
/// never changes: sealed segments are immutable).
#[derive(Debug, Clone)]
pub(crate) struct Built {
    key: IndexKey,
    listed: Vec<Listed>,
    judged_through: u64,
    /// Every sealed segment up to `judged_through` read (one that did not
    /// load may list later: the next build starts from scratch).
    complete: bool,
    /// Whether this build continued the last one (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) continued: bool,
}

/// [`build`], continuing `from` (the cache written last, as decoded, and
/// what was kept of its build) when it is keyed to the same index file and
/// each segment it lists is still sealed: only the segments sealed after
/// those it judged are read. Its values are those of a build from scratch
/// (the listed segments stay in log order, the new ones after them).
fn build_on(
    dir: &Path,
    manifest: &Manifest,
    ix: &ShardIndex,
    key: IndexKey,
    from: Option<(AnnotationCache, &Built)>,
) -> (AnnotationCache, Built) {
    let frozen = ix.frozen();
    let n = frozen.session_count() as usize;
    let sealed_now = |id: u64| manifest.segments.iter().any(|s| s.id == id && s.state == SegmentState::Sealed);
    let from = from.filter(|(c, b)| {
        c.index == key
            && b.key == key
            && c.listed == b.listed
            && c.sessions as usize == n
            && b.complete
            && c.listed.iter().all(|l| sealed_now(l.id))
            && c.check_whole()
    });
    let judged_from = from.as_ref().map_or(0, |(_, b)| b.judged_through);
    let mut c = AnnotationCache::empty(key, frozen.session_count());
    let (mut last, mut last_reward, mut rewards) = (vec![0u32; n], vec![0u32; n], vec![0u64; n]);
    let (mut sealed, mut has_reward) = (vec![0u64; n.div_ceil(64)], vec![0u64; n.div_ceil(64)]);
    let mut traces: std::collections::BTreeMap<u32, u64> = Default::default();
    if let Some((prev, _)) = &from {
        c.listed.clone_from(&prev.listed);
        (last, last_reward, rewards) =
            (prev.last.as_slice().to_vec(), prev.last_reward.as_slice().to_vec(), prev.rewards.as_slice().to_vec());
        (sealed, has_reward) = (prev.sealed.as_slice().to_vec(), prev.has_reward.as_slice().to_vec());
        traces.extend(prev.trace_rewards.iter().copied());
    }
    let (mut judged_through, mut complete) = (judged_from, true);
    for ms in
        manifest.segments.iter().filter(|s| s.state == SegmentState::Sealed && (from.is_none() || s.id > judged_from))
    {
        judged_through = judged_through.max(ms.id);
        let Ok(seg) = crate::segment::recovery::load_segment_in_place(dir, ms.id, true, OnDamage::Refuse) else {
            complete = false;
            continue;
        };
        if seg.in_footer.is_none() || !seg.events.is_empty() || !seg.applied_from_footer.is_empty() {
            continue;
        }
        let Some(trailer) = read_trailer(seg.map.bytes()) else { continue };
        let release = || {
            seg.map.release_pages();
            frozen.release_pages();
        };
        let Some(ops) = ops_of(&frozen, ms.id, seg.entry_refs(), &release) else { continue };
        seg.map.release_pages();
        let n = c.listed.len() as u32 + 1;
        for op in ops {
            match op {
                Op::Seal(s) => {
                    if let Some(l) = last.get_mut(s as usize) {
                        *l = n;
                    }
                    set_bit(&mut sealed, s);
                }
                Op::SessionReward(s, v) => {
                    if let Some(l) = last.get_mut(s as usize) {
                        *l = n;
                    }
                    if let Some(l) = last_reward.get_mut(s as usize) {
                        *l = n;
                    }
                    set_bit(&mut has_reward, s);
                    if let Some(r) = rewards.get_mut(s as usize) {
                        *r = v.to_bits();
                    }
                }
                Op::TraceReward(row, s, v, after_call) => {
                    if let Some(l) = last.get_mut(s as usize) {
                        *l = n;
                    }
                    if after_call {
                        traces.insert(row, v.to_bits());
                    }
                }
            }
        }
        c.listed.push(Listed { id: ms.id, footer_offset: trailer.footer_offset, footer_crc32: trailer.footer_crc });
    }
    (c.last, c.last_reward, c.rewards) = (last.into(), last_reward.into(), rewards.into());
    (c.sealed, c.has_reward) = (sealed.into(), has_reward.into());
    c.trace_rewards = traces.into_iter().collect();
    let built = Built { key, listed: c.listed.clone(), judged_through, complete, continued: from.is_some() };
    if c.listed.is_empty() {
        return (AnnotationCache::empty(key, 0), built);
    }
    (c, built)
}

/// Build and write the cache for the store in `dir` as `manifest` and the
/// index file `ix` stand (best effort: on failure the next open replays
/// the segments, and a stale file is only not used).
pub(crate) fn write(dir: &Path, manifest: &Manifest, ix: &ShardIndex, faults: &Faults) {
    let _ = write_after(dir, manifest, ix, faults, None);
}

/// [`write`], reading only the segments sealed since `last` when the file
/// on disk is the one `last` describes (a publication after a publication,
/// in one process: a compaction on a 10M-call store read 1.25M carried
/// seals again every time, ~0.3 s). What to keep for the next one; `None`
/// when nothing was written.
pub(crate) fn write_after(
    dir: &Path,
    manifest: &Manifest,
    ix: &ShardIndex,
    faults: &Faults,
    last: Option<&Built>,
) -> Option<Built> {
    let key = key_of(ix)?;
    let path = dir.join(SHARDS_DIR).join(CACHE_FILE_NAME);
    // Mapped, checked whole, its tables read in place (copied once, into
    // the build), the pages given back after.
    let on_disk = last.filter(|b| b.key == key).and_then(|_| {
        let file = File::open(&path).ok()?;
        let len = file.metadata().ok()?.len();
        Mapping::map(&file, len, &path).ok().map(Arc::new)
    });
    let from =
        on_disk.as_ref().and_then(|map| AnnotationCache::decode_mapped_as(map, &path, false, true).ok()).zip(last);
    let incremental = from.is_some();
    let (c, built) = build_on(dir, manifest, ix, key, from);
    if let Some(map) = &on_disk {
        map.release_pages();
    }
    // Built from lookups of a lazily checked file: one that met a damaged
    // block may have missed (the writer's own check then refuses writes).
    if ix.damage().is_some() {
        return None;
    }
    let bytes = c.encode();
    if incremental && cfg!(debug_assertions) {
        let whole = build(dir, manifest, ix, key).encode();
        debug_assert!(whole == bytes, "an annotation cache built on the last one differs from a build from scratch");
    }
    crate::storage::write_atomic(&dir.join(SHARDS_DIR), CACHE_FILE_NAME, &bytes, faults).ok()?;
    Some(built)
}

/// The cache an open can use: read and checked (with `lazy`, a read-only
/// open's, the per-session tables of a version-2 file a block at a time as
/// lookups read them, [`AnnotationCache::decode_mapped`]), keyed to the
/// index file on disk, each listed segment listed sealed in `manifest` with
/// the footer the cache names. `None` otherwise.
pub(crate) fn usable(dir: &Path, manifest: &Manifest, lazy: bool, writer: bool) -> Option<AnnotationCache> {
    let shards_dir = dir.join(SHARDS_DIR);
    // Mapped, its per-session tables read in place (the open's frozen layer
    // keeps the mapping): the pages its crc32 check read are given back.
    let path = shards_dir.join(CACHE_FILE_NAME);
    let file = File::open(&path).ok()?;
    let len = file.metadata().ok()?.len();
    let map = Arc::new(Mapping::map(&file, len, &path).ok()?);
    let c = AnnotationCache::decode_mapped_as(&map, &path, lazy, writer);
    map.release_pages();
    let c = c.ok()?;
    if index_key_on_disk(&shards_dir)? != c.index {
        return None;
    }
    for l in &c.listed {
        let listed_sealed = manifest.segments.iter().any(|s| s.id == l.id && s.state == SegmentState::Sealed);
        if !listed_sealed {
            return None;
        }
        let t = crate::segment::recovery::trailer_on_disk(dir, l.id)?;
        if (t.footer_offset, t.footer_crc) != (l.footer_offset, l.footer_crc32) {
            return None;
        }
    }
    Some(c)
}

/// The file, checked for `trajlog verify`: `None` when there is none, or
/// one that is stale (keyed to another index file, or naming a segment the
/// manifest does not list sealed: an open does not use it); else what is
/// wrong with it, if anything: its own checks, or values other than those
/// the listed segments make.
pub(crate) fn check(dir: &Path, manifest: &Manifest) -> Option<String> {
    let shards_dir = dir.join(SHARDS_DIR);
    let bytes = fs::read(shards_dir.join(CACHE_FILE_NAME)).ok()?;
    let c = match AnnotationCache::decode(&bytes) {
        Ok(c) => c,
        Err(what) => return Some(what),
    };
    let c = usable(dir, manifest, false, false).filter(|u| *u == c)?;
    let ix = ShardIndex::open(&shards_dir).ok().flatten()?;
    let frozen = ix.frozen();
    if !c.listed.is_empty() && frozen.session_count() != c.sessions {
        return Some(format!("{} frozen sessions, the index file has {}", c.sessions, frozen.session_count()));
    }
    // The listed segments alone, as `build` reads them.
    let mut alone = manifest.clone();
    alone.segments.retain(|s| c.lists(s.id));
    let b = build(dir, &alone, &ix, c.index);
    if b == c {
        None
    } else if b.listed != c.listed {
        // A listed segment the build did not list again: its footer may be
        // damaged (the trailer, which the cache's key checks, still intact).
        let damaged = c.listed.iter().filter(|l| !b.listed.contains(l)).find(|l| !footer_checks(dir, l.id));
        Some(match damaged {
            Some(l) => format!(
                "the footer of listed segment {} is damaged (it fails its checks against its trailer), so the cache cannot be checked against it",
                crate::storage::segment_path(dir, l.id).display()
            ),
            None => "a listed segment holds a record other than a seal or reward of a frozen target".into(),
        })
    } else {
        Some("its seals and rewards are not those of the listed segments".into())
    }
}

/// Whether segment `id`'s footer passes its checks (`check_footer`: the
/// crc32 its trailer holds, every entry); a file that cannot be read, or
/// without a valid trailer, does not.
fn footer_checks(dir: &Path, id: u64) -> bool {
    use crate::format::segment::{check_footer, decode_trailer, TRAILER_BYTES};
    let Ok(bytes) = fs::read(crate::storage::segment_path(dir, id)) else { return false };
    let len = bytes.len() as u64;
    let tail = len.checked_sub(TRAILER_BYTES).and_then(|at| bytes.get(at as usize..));
    tail.and_then(|tail| decode_trailer(tail, len)).is_some_and(|t| check_footer(&bytes, &t).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of 67 sessions whose session 5 names listed segment `five`
    /// (1-based; 2 segments listed).
    fn sample_naming(five: u32) -> AnnotationCache {
        let mut c = AnnotationCache::empty(IndexKey { dir_crc32: 0xdead_beef, len: 1 << 33 }, 67);
        c.listed = vec![
            Listed { id: 3, footer_offset: 4096, footer_crc32: 7 },
            Listed { id: 9, footer_offset: 64, footer_crc32: 0xffff_ffff },
        ];
        let (mut sealed, mut has_reward) = (vec![0u64; 2], vec![0u64; 2]);
        let (mut last, mut last_reward, mut rewards) = (vec![0u32; 67], vec![0u32; 67], vec![0u64; 67]);
        for s in [0u32, 5, 63, 64, 66] {
            set_bit(&mut sealed, s);
            last[s as usize] = 1 + s % 2;
        }
        last[5] = five;
        set_bit(&mut has_reward, 64);
        last_reward[64] = 2;
        rewards[64] = (-0.0f64).to_bits();
        (c.sealed, c.has_reward) = (sealed.into(), has_reward.into());
        (c.last, c.last_reward, c.rewards) = (last.into(), last_reward.into(), rewards.into());
        c.trace_rewards = vec![(2, 1.5f64.to_bits()), (40, f64::MIN_POSITIVE.to_bits())];
        c
    }

    fn sample() -> AnnotationCache {
        sample_naming(2)
    }

    use crate::index::frozen::bit;

    impl AnnotationCache {
        /// A session's seal and reward, as the frozen layer reads them.
        fn session(&self, session: u32) -> (bool, Option<f64>) {
            let reward = bit(&self.has_reward, session)
                .then(|| self.rewards.get(session as usize).map(|b| f64::from_bits(*b)))
                .flatten();
            (bit(&self.sealed, session), reward)
        }
    }

    /// The file mapped and read in place (what an open uses) is the file
    /// decoded into tables of its own; a segment table naming a segment
    /// past the list, which only the copy refuses, makes every record of
    /// that session conflict (the open then replays without the cache).
    #[test]
    fn a_mapped_cache_reads_as_a_decoded_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        for five in [2u32, 3] {
            let b = sample_naming(five).encode();
            let path = dir.path().join(format!("c{five}"));
            std::fs::write(&path, &b).expect("write");
            let file = File::open(&path).expect("open");
            let map = Arc::new(Mapping::map(&file, b.len() as u64, &path).expect("map"));
            let mapped = AnnotationCache::decode_mapped(&map, &path, false).expect("decodes");
            assert_eq!(mapped.encode(), b);
            assert_eq!(mapped.session(64), (true, Some(-0.0)));
            if five == 2 {
                assert_eq!(AnnotationCache::decode(&b).expect("decodes"), mapped);
                assert!(!mapped.conflicts(5, Loc { segment: 10, offset: 0 }));
            } else {
                assert!(AnnotationCache::decode(&b).is_err());
                assert_eq!(mapped.last_naming(5), Some(u64::MAX));
                assert!(mapped.conflicts(5, Loc { segment: 10, offset: 0 }));
            }
        }
    }

    #[test]
    fn encode_decode_round_trips_bit_for_bit() {
        let c = sample();
        let b = c.encode();
        let d = AnnotationCache::decode(&b).expect("decodes");
        assert_eq!(d, c);
        assert_eq!(d.session(64), (true, Some(-0.0)));
        assert_eq!(d.session(64).1.map(f64::to_bits), Some((-0.0f64).to_bits()));
        assert_eq!(d.session(1), (false, None));
        assert_eq!((d.last_naming(5), d.last_naming(0), d.last_naming(1)), (Some(9), Some(3), None));
        assert!(d.conflicts(5, Loc { segment: 8, offset: 0 }));
        assert!(!d.conflicts(5, Loc { segment: 10, offset: 0 }));
        assert!(!d.conflicts(1, Loc { segment: 0, offset: 0 }));
        assert!(d.reward_superseded(64, Loc { segment: 8, offset: 0 }));
        assert!(!d.reward_superseded(64, Loc { segment: 9, offset: 0 }));
        assert!(!d.reward_superseded(5, Loc { segment: 0, offset: 0 }));
        assert_eq!(d.encode(), b);
    }

    #[test]
    fn every_truncation_and_flipped_byte_is_refused_without_a_panic() {
        let b = sample().encode();
        for n in 0..b.len() {
            assert!(AnnotationCache::decode(&b[..n]).is_err(), "cut at {n}");
        }
        for at in 0..b.len() {
            for mask in [0x01u8, 0x80] {
                let mut bad = b.clone();
                bad[at] ^= mask;
                assert!(AnnotationCache::decode(&bad).is_err(), "byte {at} ^ {mask:#x}");
            }
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(AnnotationCache::decode(&longer).is_err());
    }

    /// The version-1 file of the same contents as version-2 file `b`:
    /// version 1, no block checksums, one crc32 of the whole file.
    fn as_version_1(b: &[u8]) -> Vec<u8> {
        let l = Layout::of(b).expect("a valid file");
        let (crcs_at, _) = l.block_crcs.expect("version 2");
        let mut v1 = b[..crcs_at].to_vec();
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32fast::hash(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        v1.extend_from_slice(&0u32.to_le_bytes());
        v1
    }

    /// Files written by earlier builds (version 1, one crc32 for the whole
    /// file) read as before, mapped or copied, and refuse any flipped byte.
    #[test]
    fn a_version_1_file_reads_as_before() {
        let c = sample();
        let v1 = as_version_1(&c.encode());
        assert_eq!(AnnotationCache::decode(&v1).expect("decodes"), c);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v1");
        std::fs::write(&path, &v1).expect("write");
        let map = Arc::new(Mapping::map(&File::open(&path).expect("open"), v1.len() as u64, &path).expect("map"));
        for lazy in [false, true] {
            let mapped = AnnotationCache::decode_mapped(&map, &path, lazy).expect("decodes");
            assert_eq!(mapped, c);
            assert_eq!(mapped.encode(), c.encode(), "written back as version 2");
        }
        for at in 0..v1.len() {
            let mut bad = v1.clone();
            bad[at] ^= 0x10;
            assert!(AnnotationCache::decode(&bad).is_err(), "byte {at}");
        }
    }

    /// A read-only open maps a version-2 file without reading its tables:
    /// each lookup checks the blocks it reads, a block that fails makes the
    /// lookup miss (a segment-table lookup counts as naming the last
    /// segment, so the open replays without the cache) and is recorded as
    /// an error naming the file; a whole check (a writer's) refuses it.
    #[test]
    fn a_lazily_mapped_cache_checks_the_blocks_lookups_read() {
        let n = 5000u32;
        let mut c = AnnotationCache::empty(IndexKey { dir_crc32: 1, len: 2 }, n);
        c.listed = vec![Listed { id: 4, footer_offset: 10, footer_crc32: 11 }];
        let (mut last, mut has_reward, mut rewards) = (vec![0u32; n as usize], vec![0u64; 79], vec![0u64; n as usize]);
        for s in 0..n {
            last[s as usize] = 1;
            set_bit(&mut has_reward, s);
            rewards[s as usize] = f64::from(s).to_bits();
        }
        (c.last, c.has_reward, c.rewards) = (last.into(), has_reward.into(), rewards.into());
        let b = c.encode();
        let l = Layout::of(&b).expect("valid");
        let (rewards_at, rewards_len) = l.spans[4];
        assert_eq!(rewards_len.div_ceil(CHECK_BLOCK), 3, "the rewards table spans three blocks");
        let (last_at, _) = l.spans[0];
        let dir = tempfile::tempdir().expect("tempdir");
        let open = |bytes: &[u8], name: &str, lazy: bool| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).expect("write");
            let map =
                Arc::new(Mapping::map(&File::open(&path).expect("open"), bytes.len() as u64, &path).expect("map"));
            AnnotationCache::decode_mapped(&map, &path, lazy)
        };
        let reward = |c: &AnnotationCache, s: u32| c.rewards.at(s as usize).map(|b| f64::from_bits(*b));

        // Undamaged: lazily mapped, it reads as the copy does.
        let good = open(&b, "good", true).expect("decodes");
        assert_eq!(good, c);
        assert!(good.rewards.damage().is_none());

        // A flipped byte in the rewards table's third block, and one in the
        // segment table's first.
        let mut bad = b.clone();
        bad[rewards_at + 2 * CHECK_BLOCK + 5] ^= 0x40;
        bad[last_at + 3] ^= 0x01;
        assert!(AnnotationCache::decode(&bad).is_err());
        let err = open(&bad, "whole", false).expect_err("a whole check refuses it");
        assert!(err.contains("/whole") && err.contains("crc32"), "{err}");
        let lazy = open(&bad, "lazy", true).expect("a lazy open reads no table");
        assert_eq!(reward(&lazy, 7), Some(7.0));
        assert_eq!(reward(&lazy, 4000), Some(4000.0), "the second block is good");
        assert!(lazy.rewards.damage().is_none());
        assert_eq!(reward(&lazy, 4999), None, "the third block fails");
        let e = lazy.rewards.damage().expect("recorded").to_string();
        assert!(e.contains("/lazy") && e.contains("annotation cache") && e.contains("crc32"), "{e}");
        assert_eq!(lazy.last_naming(4999), Some(4), "a good block of the segment table");
        assert_eq!(lazy.last_naming(0), Some(u64::MAX), "a failed block names the latest segment");
        assert!(lazy.conflicts(0, Loc { segment: 1, offset: 0 }));
    }

    /// Counts whose sizes add up past `usize::MAX` (found by review: the
    /// length check overflowed in a debug build).
    #[test]
    fn a_header_whose_sizes_overflow_is_refused() {
        for (listed, sessions, traces) in
            [(0u32, 0u32, (1u64 << 60) - 3), (u32::MAX, u32::MAX, u64::MAX), (0, 0, u64::MAX)]
        {
            let mut b = Vec::new();
            b.extend_from_slice(MAGIC);
            b.extend_from_slice(&CACHE_VERSION.to_le_bytes());
            b.extend_from_slice(&listed.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&sessions.to_le_bytes());
            b.extend_from_slice(&0u64.to_le_bytes());
            b.extend_from_slice(&traces.to_le_bytes());
            b.extend_from_slice(&[0u8; 8]);
            assert!(AnnotationCache::decode(&b).is_err(), "{listed} {sessions} {traces}");
        }
    }
}
