//! Rewriting the shard index file from the one it replaces
//! (format-spec/shard-index.md §5), streamed: the bytes a full build over
//! every shard row would write ([`super::index_file::build`]), made by
//! merging the old file's sorted tables with the rows a publication adds
//! and takes away, without holding every row in memory.
//!
//! A full build decodes or borrows every row (about 80 bytes each), sorts
//! them and builds the frozen tables, the placements and the hashes beside
//! them: at 11.3M rows, compacting 1.3M new calls on top of 10M peaked at
//! 4.2 GB, most of it that rewrite. Here memory holds the added rows, the
//! old file's hot rows, 4 bytes per old frozen row (its new number) and
//! ~16 bytes per session, and the old file is read through its mapping,
//! section by section, its pages given back as it goes.
//!
//! Why a merge gives the same bytes: the frozen rows of the old file have
//! distinct trace id hashes (two rows sharing one make their sessions hot,
//! [`crate::index::frozen::cold_rows`]), so every collision among the rows
//! of the new file involves a row that is not an old frozen row — an old
//! hot row or an added one — and the new file's hot sessions are found from
//! those alone, with one lookup each in the old trace table. Every other
//! table is a sorted merge of the old one (renumbered) and the added rows'.

use super::index_file::{
    encode_hot, encode_shards, FileWriter, ShardIndex, ShardKey, FROZEN_ROWS, FROZEN_SESSIONS, HOT_ROWS,
    NOT_FROZEN, PLACEMENTS, SESSION_HASHES, SHARDS, TEXT, TRACE_HASHES, TRACE_TABLE,
};
use super::reader::ShardRow;
use super::set::Placement;
use crate::error::Result;
use crate::format::record::Loc;
use crate::index::frozen::{id_hash, Frozen, FrozenRow, FrozenSession, RowRef, TraceEntry};
use crate::storage::fault::Faults;
use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Entries written between two releases of the old file's resident pages.
const RELEASE_EVERY: usize = 1 << 20;

/// A row of the new file's frozen layer: an old frozen row, or a loose one
/// (an old hot row or an added row).
#[derive(Debug, Clone, Copy)]
enum Src {
    Old(u32),
    Loose(u32),
}

/// A session of the new file's frozen layer: the old frozen session it
/// continues, if any, and its loose rows (a range of the sorted cold loose
/// rows). 24 bytes: one per session of the new file (1.4M at 10M calls),
/// held through the whole write.
struct Group {
    hash: u64,
    /// The old frozen session, or [`NO_SESSION`].
    old: u32,
    /// Its loose rows: `cold[loose_start..loose_start + loose_len]` (row
    /// numbers fit a `u32`: [`plan`] checks).
    loose_start: u32,
    loose_len: u32,
    /// Its rows in the new file.
    rows: u32,
}

/// [`Group::old`] of a session with no old frozen session.
const NO_SESSION: u32 = u32::MAX;

impl Group {
    fn old(&self) -> Option<u32> {
        (self.old != NO_SESSION).then_some(self.old)
    }

    fn loose(&self) -> std::ops::Range<usize> {
        let start = self.loose_start as usize;
        start..start + self.loose_len as usize
    }
}

/// Where [`write_merged`] writes.
#[derive(Clone, Copy)]
pub(crate) enum Dest<'a> {
    Store(&'a Faults),
    Scratch,
}

/// The rows of the new file that are not old frozen rows: the added rows
/// (their shard numbers the new file's), read in place from the caller's
/// decoded rows (a [`RowRef`] copy of each was 80 bytes a row, 120 MB of a
/// 1.5M-row publication's peak), then the old hot rows that stay.
struct Loose<'a> {
    added: Vec<&'a [ShardRow]>,
    added_len: usize,
    old_hot: Vec<RowRef<'a>>,
}

impl<'a> Loose<'a> {
    fn len(&self) -> usize {
        self.added_len + self.old_hot.len()
    }

    /// Row `i`: an added row's, then an old hot row's.
    fn get(&self, mut i: usize) -> Option<RowRef<'a>> {
        for part in &self.added {
            match part.get(i) {
                Some(r) => return Some(RowRef::from(r)),
                None => i -= part.len(),
            }
        }
        self.old_hot.get(i).copied()
    }

    fn iter(&self) -> impl Iterator<Item = RowRef<'a>> + '_ {
        self.added.iter().flat_map(|part| part.iter().map(RowRef::from)).chain(self.old_hot.iter().copied())
    }
}

/// Everything the merge works out before it writes.
struct Plan<'a> {
    frozen: &'a Frozen,
    loose: Loose<'a>,
    /// How many of `loose` are added rows (the others are old hot rows:
    /// they have placements and hashes in the old file already).
    added_rows: usize,
    /// Old frozen rows whose file is gone.
    removed: Vec<bool>,
    /// The loose rows that are frozen, sorted as a frozen layer lists them.
    cold: Vec<u32>,
    groups: Vec<Group>,
    /// Each old frozen row's number in the new file (`NOT_FROZEN`: gone, or
    /// hot now).
    remap: Vec<u32>,
    /// Each loose row's frozen row in the new file, or `NOT_FROZEN`.
    loose_frozen: Vec<u32>,
    /// The new file's rows that are not frozen, sorted by log position.
    hot: Vec<RowRef<'a>>,
    /// Trace id and session hashes of the rows whose file is gone, sorted.
    gone_traces: Vec<u64>,
    gone_sessions: Vec<u64>,
    names_len: u64,
}

/// Rewrite the shard index file from `old` for the shards `keys`: the old
/// file's rows whose shard `renumber` maps (to its number in `keys`) or
/// drops (`None`: the file is gone), plus the rows of `added` (slices read
/// in place), the rows of the shards `old` does not describe and of the
/// new ones (their shard numbers those of `keys` already). `Ok(false)` when
/// it cannot (two rows at one log position, or past the frozen layer's
/// 32-bit numbers): the caller builds the file from every row instead.
///
/// `dest`: the store's shards directory (fsynced, with its faults), or a
/// scratch one (`trajlog verify` builds its own copy of the file there,
/// shard after shard: no fsyncs).
pub(crate) fn write_merged(
    shards_dir: &Path,
    keys: &[ShardKey],
    old: &ShardIndex,
    renumber: &dyn Fn(u32) -> Option<u32>,
    added: &[&[ShardRow]],
    dest: Dest<'_>,
) -> Result<bool> {
    // A lazily checked file (a writable open maps it so) is read whole
    // here: never a damaged table read as an empty one.
    old.check_whole()?;
    let frozen = old.frozen();
    let Some(plan) = plan(old, &frozen, renumber, added) else { return Ok(false) };
    let (w, faults) = match dest {
        Dest::Store(faults) => (FileWriter::create(shards_dir, faults)?, faults),
        Dest::Scratch => (FileWriter::create_scratch(shards_dir)?, &None),
    };
    write(w, shards_dir, keys, old, renumber, &plan, faults)?;
    Ok(true)
}

fn plan<'a>(
    old: &'a ShardIndex,
    frozen: &'a Frozen,
    renumber: &dyn Fn(u32) -> Option<u32>,
    added: &[&'a [ShardRow]],
) -> Option<Plan<'a>> {
    // Checked whole by the caller ([`write_merged`]): a lazily checked
    // table that failed would read as an empty one.
    let table = old.placements();
    let placements = table.as_slice();
    let rows = frozen.rows();
    let added_len: usize = added.iter().map(|part| part.len()).sum();
    if u32::try_from(rows.len() + old.hot_rows().len() + added_len).is_err() {
        return None;
    }
    // No two rows at one log position (a full build keeps the later
    // shard's placement; leave that case to it).
    let mut locs: Vec<Loc> = added.iter().flat_map(|part| part.iter().map(|r| r.loc)).collect();
    locs.sort_unstable();
    if locs.windows(2).any(|w| w.first() == w.get(1)) {
        return None;
    }
    // One forward walk of the placements (0.35 GB at 10M, their pages given
    // back as it goes): the old frozen rows whose file is gone, and no
    // added row at a kept old one's position (both sorted by position).
    let mut removed = vec![false; rows.len()];
    let mut any_removed = false;
    let mut next = locs.iter().peekable();
    let mut walked = Releaser { old, at: 0 };
    for p in placements {
        walked.advance(1);
        let kept = renumber(p.shard).is_some();
        if p.frozen_row != NOT_FROZEN && !kept {
            if let Some(r) = removed.get_mut(p.frozen_row as usize) {
                *r = true;
                any_removed = true;
            }
        }
        while next.next_if(|l| **l < p.loc()).is_some() {}
        if kept && next.peek().is_some_and(|l| **l == p.loc()) {
            return None;
        }
    }
    drop(locs);
    old.release_pages();
    let (mut gone_traces, mut gone_sessions) = (Vec::new(), Vec::new());
    if any_removed {
        // Every frozen row is read (their table: 0.25 GB at 10M rows), and
        // the names of the gone ones: given back as the walk goes (a merge
        // of 1M rows on 10M held 0.33 GB of them at its peak before).
        let mut walked = Releaser { old, at: 0 };
        for (r, gone) in rows.iter().zip(&removed) {
            walked.advance(1);
            if *gone {
                gone_traces.push(id_hash(frozen.trace_id(r)));
                gone_sessions.push(frozen.session_hash(r.session));
            }
        }
        old.release_pages();
    }
    // The added rows are read in place, not copied, the old hot rows that
    // stay after them.
    let added_rows = added_len;
    let mut loose = Loose { added: added.to_vec(), added_len, old_hot: Vec::new() };
    for h in old.hot_rows() {
        match renumber(h.pos.shard) {
            Some(shard) => {
                let mut r = RowRef::from(h);
                r.pos.shard = shard;
                loose.old_hot.push(r);
            }
            None => {
                gone_traces.push(id_hash(&h.trace_id));
                gone_sessions.extend(h.sessions.iter().map(|s| id_hash(s)));
            }
        }
    }
    gone_traces.sort_unstable();
    gone_sessions.sort_unstable();
    let at_old = |loc: Loc| {
        let i = placements.partition_point(|p| p.loc() < loc);
        placements.get(i).filter(|p| p.loc() == loc && renumber(p.shard).is_some())
    };

    // The hot sessions, as `cold_rows` finds them over the new file's rows.
    let mut hot_sessions: HashSet<u64> = HashSet::new();
    for r in loose.iter().filter(|r| r.sessions.len() != 1) {
        hot_sessions.extend(r.sessions.iter().map(id_hash));
    }
    let mut by_hash: Vec<(u64, u32)> = loose.iter().enumerate().map(|(i, r)| (id_hash(r.trace_id), i as u32)).collect();
    by_hash.sort_unstable();
    // Each added row's trace id is looked up in the old frozen layer (its
    // pages given back as the lookups pile up).
    let mut budget = crate::storage::mmap::PageBudget::compaction();
    let mut i = 0;
    while i < by_hash.len() {
        budget.tick(|| old.release_pages());
        let h = by_hash.get(i).map_or(0, |e| e.0);
        let run = by_hash.get(i..).unwrap_or_default().iter().take_while(|e| e.0 == h).count();
        let old_rows: Vec<u32> =
            frozen.rows_with_trace_hash(h).filter(|r| !removed.get(*r as usize).copied().unwrap_or(true)).collect();
        if run + old_rows.len() >= 2 {
            for (_, j) in by_hash.get(i..i + run).unwrap_or_default() {
                if let Some(r) = loose.get(*j as usize) {
                    hot_sessions.extend(r.sessions.iter().map(id_hash));
                }
            }
            for r in old_rows.iter().filter_map(|r| rows.get(*r as usize)) {
                hot_sessions.insert(frozen.session_hash(r.session));
            }
        }
        i += run;
    }
    drop(by_hash);

    // The loose rows that are frozen, in the order of a frozen layer.
    let is_cold = |r: &RowRef<'_>| r.sessions.len() == 1 && !hot_sessions.contains(&id_hash(r.sessions.first()));
    let mut cold: Vec<(u64, u32)> = loose
        .iter()
        .enumerate()
        .filter(|(_, r)| is_cold(r))
        .map(|(i, r)| (id_hash(r.sessions.first()), i as u32))
        .collect();
    cold.sort_unstable_by(|a, b| {
        a.0.cmp(&b.0).then_with(|| match (loose.get(a.1 as usize), loose.get(b.1 as usize)) {
            (Some(x), Some(y)) => cmp_rows(&x, &y),
            _ => Ordering::Equal,
        })
    });
    let cold: Vec<u32> = cold.into_iter().map(|(_, i)| i).collect();

    // The sessions of the new file's frozen layer: the old ones not hot
    // now with a row left, merged with the loose cold rows' by (hash, name).
    let name_of_loose = |i: u32| loose.get(i as usize).map_or("", |r| r.sessions.first());
    // At most one group per old session and one per run of a loose name:
    // reserved, not doubled (1.4M groups at 10M calls).
    let loose_sessions = 1 + cold.iter().zip(cold.iter().skip(1)).filter(|(a, b)| name_of_loose(**a) != name_of_loose(**b)).count();
    let mut groups: Vec<Group> = Vec::with_capacity(frozen.session_count() as usize + loose_sessions);
    let mut hot: Vec<RowRef<'a>> = Vec::new();
    let (mut s, mut c) = (0u32, 0usize);
    loop {
        // The next old session that stays frozen (the rows of one that is
        // hot now join the hot rows).
        while s < frozen.session_count() {
            budget.tick(|| old.release_pages());
            let range = frozen.row_range(s);
            let alive = range.clone().any(|r| !removed.get(r as usize).copied().unwrap_or(true));
            if !alive {
                s += 1;
                continue;
            }
            if hot_sessions.contains(&frozen.session_hash(s)) {
                let name = frozen.session_name(s);
                for r in range.filter(|r| !removed.get(*r as usize).copied().unwrap_or(true)) {
                    let Some(row) = rows.get(r as usize) else { continue };
                    let p = at_old(row.loc())?;
                    hot.push(RowRef {
                        loc: row.loc(),
                        timestamp: row.timestamp,
                        pos: super::reader::ShardPos { shard: renumber(p.shard)?, ..p.pos() },
                        trace_id: frozen.trace_id(row),
                        sessions: crate::index::frozen::RowSessions::One(name),
                    });
                }
                s += 1;
                continue;
            }
            break;
        }
        let old_next = (s < frozen.session_count()).then(|| (frozen.session_hash(s), frozen.session_name(s)));
        let new_next = cold.get(c).map(|i| (id_hash(name_of_loose(*i)), name_of_loose(*i)));
        let order = match (old_next, new_next) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(a), Some(b)) => a.cmp(&b),
        };
        let mut group = Group { hash: 0, old: NO_SESSION, loose_start: c as u32, loose_len: 0, rows: 0 };
        if order != Ordering::Greater {
            group.hash = frozen.session_hash(s);
            group.old = s;
            s += 1;
        }
        if order != Ordering::Less {
            let name = cold.get(c).map_or("", |i| name_of_loose(*i));
            group.hash = id_hash(name);
            let n = cold.get(c..).unwrap_or_default().iter().take_while(|i| name_of_loose(**i) == name).count();
            group.loose_len = n as u32;
            c += n;
        }
        groups.push(group);
    }

    // Numbers: each frozen row's in the new file, in group order.
    let mut remap = vec![NOT_FROZEN; rows.len()];
    let mut loose_frozen = vec![NOT_FROZEN; loose.len()];
    let mut next = 0u32;
    let mut names_len = 0u64;
    let mut plan = Plan {
        frozen,
        loose,
        added_rows,
        removed,
        cold,
        groups: Vec::new(),
        remap: Vec::new(),
        loose_frozen: Vec::new(),
        hot: Vec::new(),
        gone_traces,
        gone_sessions,
        names_len: 0,
    };
    // (Reading every frozen row: their pages given back as it goes.)
    let mut rows_done = Releaser { old, at: 0 };
    for g in &mut groups {
        names_len += plan.group_name(g).len() as u64;
        let first = next;
        plan.for_each_row(g, |src| {
            match src {
                Src::Old(r) => remap.get_mut(r as usize).map(|x| *x = next),
                Src::Loose(i) => loose_frozen.get_mut(i as usize).map(|x| *x = next),
            };
            next += 1;
        });
        g.rows = next - first;
        rows_done.advance(g.rows as usize);
    }
    old.release_pages();
    hot.extend(plan.loose.iter().zip(&loose_frozen).filter(|(_, f)| **f == NOT_FROZEN).map(|(r, _)| r));
    hot.sort_by_key(|r| r.loc);
    plan.groups = groups;
    plan.remap = remap;
    plan.loose_frozen = loose_frozen;
    plan.hot = hot;
    plan.names_len = names_len;
    Some(plan)
}

/// A frozen layer's order of rows: by session name, then (timestamp, log
/// position), as `Frozen::build` sorts them (after the name's hash).
fn cmp_rows(x: &RowRef<'_>, y: &RowRef<'_>) -> Ordering {
    x.sessions.first().cmp(y.sessions.first()).then(x.timestamp.total_cmp(&y.timestamp)).then(x.loc.cmp(&y.loc))
}

impl Plan<'_> {
    fn group_name(&self, g: &Group) -> &str {
        match g.old() {
            Some(s) => self.frozen.session_name(s),
            None => self.loose_row(g.loose().start).map_or("", |r| r.sessions.first()),
        }
    }

    fn loose_row(&self, cold_at: usize) -> Option<RowRef<'_>> {
        self.cold.get(cold_at).and_then(|i| self.loose.get(*i as usize))
    }

    /// The rows of group `g` in order: its old session's rows left and its
    /// loose rows, merged by (timestamp, log position).
    fn for_each_row(&self, g: &Group, mut f: impl FnMut(Src)) {
        let rows = self.frozen.rows();
        let range = g.old().map_or(0..0, |s| self.frozen.row_range(s));
        let mut old = range.filter(|r| !self.removed.get(*r as usize).copied().unwrap_or(true)).peekable();
        let key_old = |r: u32| rows.get(r as usize).map(|x| (x.timestamp, x.loc()));
        let key_loose = |c: usize| self.loose_row(c).map(|x| (x.timestamp, x.loc));
        let loose = g.loose();
        let mut b = loose.start;
        loop {
            let ka = old.peek().and_then(|r| key_old(*r));
            let kb = (b < loose.end).then(|| key_loose(b)).flatten();
            let take_old = match (ka, kb) {
                (None, None) => break,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(x), Some(y)) => x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)) != Ordering::Greater,
            };
            if take_old {
                if let Some(r) = old.next() {
                    f(Src::Old(r));
                }
            } else {
                if let Some(i) = self.cold.get(b) {
                    f(Src::Loose(*i));
                }
                b += 1;
            }
        }
    }

    fn trace_of(&self, src: Src) -> (&str, Loc, f64) {
        match src {
            Src::Old(r) => self
                .frozen
                .rows()
                .get(r as usize)
                .map_or(("", Loc { segment: 0, offset: 0 }, 0.0), |x| (self.frozen.trace_id(x), x.loc(), x.timestamp)),
            Src::Loose(i) => self.loose.get(i as usize).map_or(("", Loc { segment: 0, offset: 0 }, 0.0), |x| (x.trace_id, x.loc, x.timestamp)),
        }
    }
}

/// Sorted `a` without one occurrence of each of sorted `gone`, merged with
/// sorted `b`, written through `put` in order.
fn merge_hashes(
    a: &[u64],
    gone: &[u64],
    b: &[u64],
    mut put: impl FnMut(u64) -> std::io::Result<()>,
) -> std::io::Result<u64> {
    let (mut i, mut g, mut j, mut n) = (0, 0, 0, 0u64);
    loop {
        // Skip the occurrences of `a` that are gone.
        while let (Some(x), Some(y)) = (a.get(i), gone.get(g)) {
            match x.cmp(y) {
                Ordering::Equal => {
                    i += 1;
                    g += 1;
                }
                Ordering::Greater => g += 1,
                Ordering::Less => break,
            }
        }
        let v = match (a.get(i), b.get(j)) {
            (None, None) => return Ok(n),
            (Some(x), Some(y)) if y < x => {
                j += 1;
                *y
            }
            (Some(x), _) => {
                i += 1;
                *x
            }
            (None, Some(y)) => {
                j += 1;
                *y
            }
        };
        put(v)?;
        n += 1;
    }
}

/// Buffers fixed-width entries and puts them a block at a time.
struct Batch<'s, 'w, T: bytemuck::Pod> {
    out: &'s mut super::index_file::SectionSink<'w>,
    buf: Vec<T>,
    count: u64,
}

impl<'s, 'w, T: bytemuck::Pod> Batch<'s, 'w, T> {
    fn new(out: &'s mut super::index_file::SectionSink<'w>) -> Self {
        Batch { out, buf: Vec::with_capacity(8192), count: 0 }
    }
    fn push(&mut self, v: T) -> std::io::Result<()> {
        self.buf.push(v);
        self.count += 1;
        if self.buf.len() == self.buf.capacity() {
            self.out.put_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
    fn finish(self) -> std::io::Result<u64> {
        self.out.put_all(&self.buf)?;
        Ok(self.count)
    }
}

/// Gives the old file's resident pages back each time the entries (rows,
/// sessions) a loop has read pass a multiple of [`RELEASE_EVERY`].
struct Releaser<'a> {
    old: &'a ShardIndex,
    at: usize,
}

impl Releaser<'_> {
    fn advance(&mut self, rows: usize) {
        let before = self.at;
        self.at = self.at.saturating_add(rows);
        if before / RELEASE_EVERY != self.at / RELEASE_EVERY {
            self.old.release_pages();
        }
    }
}

fn write(
    mut w: FileWriter,
    shards_dir: &Path,
    keys: &[ShardKey],
    old: &ShardIndex,
    renumber: &dyn Fn(u32) -> Option<u32>,
    plan: &Plan<'_>,
    faults: &Faults,
) -> Result<()> {
    w.section(SHARDS, |out| {
        out.put(&encode_shards(keys))?;
        Ok(keys.len() as u64)
    })?;
    // Placements: the old ones left (renumbered), merged with the added
    // rows' by log position.
    w.section(PLACEMENTS, |out| {
        let mut added: Vec<(Loc, usize)> =
            plan.loose.iter().enumerate().take(plan.added_rows).map(|(i, r)| (r.loc, i)).collect();
        added.sort_unstable();
        // Old hot rows that are frozen now, by log position.
        let thawed_out: HashMap<Loc, u32> = plan
            .loose
            .iter()
            .zip(&plan.loose_frozen)
            .skip(plan.added_rows)
            .filter(|(_, f)| **f != NOT_FROZEN)
            .map(|(r, f)| (r.loc, *f))
            .collect();
        let mut batch = Batch::new(out);
        let mut j = 0;
        let mut walked = Releaser { old, at: 0 };
        for p in old.placements().iter() {
            walked.advance(1);
            let Some(shard) = renumber(p.shard) else { continue };
            while let Some((loc, i)) = added.get(j).filter(|(loc, _)| *loc < p.loc()) {
                put_added(&mut batch, plan, *loc, *i)?;
                j += 1;
            }
            let frozen_row = match p.frozen_row {
                NOT_FROZEN => thawed_out.get(&p.loc()).copied().unwrap_or(NOT_FROZEN),
                r => plan.remap.get(r as usize).copied().unwrap_or(NOT_FROZEN),
            };
            batch.push(Placement::new(p.loc(), super::reader::ShardPos { shard, ..p.pos() }, frozen_row))?;
        }
        for (loc, i) in added.get(j..).unwrap_or_default() {
            put_added(&mut batch, plan, *loc, *i)?;
        }
        batch.finish()
    })?;
    old.release_pages();
    w.section(FROZEN_ROWS, |out| {
        // By rows, not sessions: 1M sessions of 8 rows read 0.3 GB of rows.
        let mut rows_done = Releaser { old, at: 0 };
        let mut batch = Batch::new(out);
        let mut ids_at = plan.names_len;
        for (gi, g) in plan.groups.iter().enumerate() {
            let mut result = Ok(());
            plan.for_each_row(g, |src| {
                let (trace, loc, timestamp) = plan.trace_of(src);
                let len = trace.len() as u32;
                if result.is_ok() {
                    result = batch.push(FrozenRow::new(loc, timestamp, ids_at, len, gi as u32));
                }
                ids_at += u64::from(len);
            });
            result?;
            rows_done.advance(g.rows as usize);
        }
        batch.finish()
    })?;
    old.release_pages();
    w.section(FROZEN_SESSIONS, |out| {
        let mut batch = Batch::new(out);
        let (mut name_at, mut first_row) = (0u64, 0u32);
        let mut walked = Releaser { old, at: 0 };
        for g in &plan.groups {
            let name_len = plan.group_name(g).len() as u32;
            batch.push(FrozenSession::new(g.hash, name_at, name_len, first_row))?;
            name_at += u64::from(name_len);
            first_row += g.rows;
            walked.advance(1);
        }
        batch.finish()
    })?;
    old.release_pages();
    // The trace table: the old entries left (renumbered) and the loose
    // frozen rows', by (hash, row); the hashes of frozen rows are distinct.
    w.section(TRACE_TABLE, |out| {
        let mut added: Vec<TraceEntry> = plan
            .loose
            .iter()
            .zip(&plan.loose_frozen)
            .filter(|(_, f)| **f != NOT_FROZEN)
            .map(|(r, f)| TraceEntry::new(id_hash(r.trace_id), *f))
            .collect();
        added.sort_unstable();
        let mut batch = Batch::new(out);
        let mut j = 0;
        let mut walked = Releaser { old, at: 0 };
        for e in plan.frozen.by_trace().iter() {
            walked.advance(1);
            let Some(row) = plan.remap.get(e.row() as usize).copied().filter(|r| *r != NOT_FROZEN) else { continue };
            let e = TraceEntry::new(e.hash(), row);
            while let Some(a) = added.get(j).filter(|a| **a < e) {
                batch.push(*a)?;
                j += 1;
            }
            batch.push(e)?;
        }
        for a in added.get(j..).unwrap_or_default() {
            batch.push(*a)?;
        }
        batch.finish()
    })?;
    old.release_pages();
    w.section(TEXT, |out| {
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        let mut n = 0u64;
        let flush = |buf: &mut Vec<u8>, out: &mut super::index_file::SectionSink<'_>| -> std::io::Result<()> {
            if buf.len() >= 1 << 16 {
                out.put(buf)?;
                buf.clear();
            }
            Ok(())
        };
        let mut walked = Releaser { old, at: 0 };
        for g in &plan.groups {
            let name = plan.group_name(g).as_bytes();
            buf.extend_from_slice(name);
            n += name.len() as u64;
            flush(&mut buf, out)?;
            walked.advance(1);
        }
        let mut rows_done = Releaser { old, at: 0 };
        for g in &plan.groups {
            plan.for_each_row(g, |src| {
                let id = plan.trace_of(src).0.as_bytes();
                buf.extend_from_slice(id);
                n += id.len() as u64;
            });
            flush(&mut buf, out)?;
            rows_done.advance(g.rows as usize);
        }
        out.put(&buf)?;
        Ok(n)
    })?;
    old.release_pages();
    w.section(HOT_ROWS, |out| {
        out.put(&encode_hot(&plan.hot))?;
        Ok(plan.hot.len() as u64)
    })?;
    // Every row's hashes: the old ones but those of rows whose file is
    // gone, merged with the added rows'.
    w.section(TRACE_HASHES, |out| {
        let mut added: Vec<u64> = plan.loose.iter().take(plan.added_rows).map(|r| id_hash(r.trace_id)).collect();
        added.sort_unstable();
        let mut batch = Batch::new(out);
        merge_hashes(&old.trace_hashes(), &plan.gone_traces, &added, |v| batch.push(v))?;
        batch.finish()
    })?;
    old.release_pages();
    w.section(SESSION_HASHES, |out| {
        let mut added: Vec<u64> =
            plan.loose.iter().take(plan.added_rows).flat_map(|r| r.sessions.iter().map(id_hash)).collect();
        added.sort_unstable();
        let mut batch = Batch::new(out);
        merge_hashes(&old.session_hashes(), &plan.gone_sessions, &added, |v| batch.push(v))?;
        batch.finish()
    })?;
    w.finish(shards_dir, faults)?;
    Ok(())
}

fn put_added(batch: &mut Batch<'_, '_, Placement>, plan: &Plan<'_>, loc: Loc, i: usize) -> std::io::Result<()> {
    let Some(r) = plan.loose.get(i) else { return Ok(()) };
    let frozen_row = plan.loose_frozen.get(i).copied().unwrap_or(NOT_FROZEN);
    batch.push(Placement::new(loc, r.pos, frozen_row))
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::index_file::{build, write};
    use super::super::reader::{ShardPos, ShardRow};
    use super::*;
    use std::sync::Arc;

    /// A small deterministic generator (xorshift).
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    pub(crate) fn keys(n: usize, tag: &str) -> Vec<ShardKey> {
        (0..n).map(|i| ShardKey { path: format!("steps/part-{tag}-{i}.parquet"), len: 100 + i as u64, footer_crc32: i as u32 }).collect()
    }

    /// The file a build from every row writes, and its bytes.
    pub(crate) fn full(dir: &Path, keys: &[ShardKey], rows: &[ShardRow]) -> Vec<u8> {
        let mut refs: Vec<RowRef<'_>> = rows.iter().map(RowRef::from).collect();
        refs.sort_by_key(|r| r.loc);
        let built = build(&refs, true).expect("build");
        let hot = built.hot_rows(&refs);
        write(dir, keys, &built.contents(&hot), &None).expect("write");
        std::fs::read(dir.join(super::super::index_file::INDEX_FILE_NAME)).expect("read")
    }

    /// Rows of `files` new shards numbered from `first_shard`: sessions from
    /// a small pool (so new rows continue old sessions), some rows of two
    /// sessions, some trace ids reused from `reuse` (replacements, whose
    /// sessions then are hot), some rows moved from `moved` (a collection's
    /// live rows: same log position and ids, a new place).
    pub(crate) fn rows(rng: &mut Rng, next_loc: &mut u64, first_shard: u32, files: u32, reuse: &[ShardRow], moved: &[ShardRow]) -> Vec<ShardRow> {
        let mut out = Vec::new();
        let sessions: Vec<Arc<[Arc<str>]>> = (0..40).map(|s| Arc::from(vec![Arc::<str>::from(format!("task-{s}:0"))])).collect();
        let mut moved = moved.iter();
        for shard in first_shard..first_shard + files {
            for row in 0..(20 + rng.below(60)) as u32 {
                let pos = ShardPos { shard, row_group: row / 16, row: row % 16 };
                if rng.below(4) == 0 {
                    if let Some(m) = moved.next() {
                        out.push(ShardRow { pos, ..m.clone() });
                        continue;
                    }
                }
                *next_loc += 1 + rng.below(3);
                let loc = Loc { segment: 1 + *next_loc / 50, offset: (*next_loc % 50) * 64 };
                let roll = rng.below(100);
                let trace_id: Arc<str> = match reuse.get(rng.below(reuse.len() as u64 + 1) as usize) {
                    Some(r) if roll < 6 => r.trace_id.clone(),
                    _ => Arc::from(format!("t{}", *next_loc)),
                };
                let sessions = if roll >= 96 {
                    Arc::from(vec![Arc::<str>::from(format!("task-{}:0", rng.below(40))), Arc::from(format!("u{}", rng.below(5)))])
                } else {
                    sessions[rng.below(40) as usize].clone()
                };
                out.push(ShardRow { loc, trace_id, sessions, timestamp: (rng.below(1000) as f64) / 4.0, pos });
            }
        }
        out
    }

    /// A merge writes exactly the bytes of a build from every row, whatever
    /// the old file held and whichever of its shards a publication takes
    /// away (a collection, whose live rows it adds again) or keeps.
    #[test]
    fn a_merge_writes_the_bytes_of_a_full_build() {
        for seed in 1..=60u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut next_loc = 0;
            let old_files = 1 + rng.below(4) as u32;
            let old_rows = rows(&mut rng, &mut next_loc, 0, old_files, &[], &[]);
            // The old file, as a full build wrote it.
            let old_dir = tempfile::tempdir().expect("tempdir");
            full(old_dir.path(), &keys(old_files as usize, "a"), &old_rows);
            let old = ShardIndex::open(old_dir.path()).expect("open").expect("present");
            // Some old files go (seed 1..20: none).
            let gone: Vec<u32> = (0..old_files).filter(|_| seed > 20 && rng.below(3) == 0).collect();
            let kept: Vec<u32> = (0..old_files).filter(|s| !gone.contains(s)).collect();
            let renumber = |k: u32| kept.binary_search(&k).ok().map(|i| i as u32);
            let moved: Vec<ShardRow> = old_rows.iter().filter(|r| gone.contains(&r.pos.shard) && rng.below(3) != 0).cloned().collect();
            let new_files = rng.below(3) as u32;
            let added = rows(&mut rng, &mut next_loc, kept.len() as u32, new_files, &old_rows, &moved);
            let new_keys: Vec<ShardKey> = kept.iter().map(|k| keys(old_files as usize, "a")[*k as usize].clone()).chain(keys(new_files as usize, "b")).collect();
            // Every row of the new file set, for the full build.
            let mut all: Vec<ShardRow> = old_rows
                .iter()
                .filter_map(|r| renumber(r.pos.shard).map(|shard| ShardRow { pos: ShardPos { shard, ..r.pos }, ..r.clone() }))
                .collect();
            all.extend(added.iter().cloned());
            let want_dir = tempfile::tempdir().expect("tempdir");
            let want = full(want_dir.path(), &new_keys, &all);
            let got_dir = tempfile::tempdir().expect("tempdir");
            // In two parts, as a publication passes them (the rows of files
            // the old one did not describe, the new files' rows), cut anywhere.
            let cut = rng.below(added.len() as u64 + 1) as usize;
            let (first, second) = added.split_at(cut);
            assert!(
                write_merged(got_dir.path(), &new_keys, &old, &renumber, &[first, second], Dest::Store(&None)).expect("merge"),
                "seed {seed}: merged"
            );
            let got = std::fs::read(got_dir.path().join(super::super::index_file::INDEX_FILE_NAME)).expect("read");
            if got != want {
                let a = ShardIndex::open(got_dir.path()).expect("open").expect("present");
                let b = ShardIndex::open(want_dir.path()).expect("open").expect("present");
                panic!("seed {seed} (gone {gone:?}, {} old rows, {} added): {:?}", old_rows.len(), added.len(), a.first_difference(&b));
            }
        }
    }

    /// Two rows at one log position: left to a full build.
    #[test]
    fn a_merge_leaves_rows_at_one_position_to_a_full_build() {
        let mut rng = Rng(7);
        let mut next_loc = 0;
        let old_rows = rows(&mut rng, &mut next_loc, 0, 1, &[], &[]);
        let dir = tempfile::tempdir().expect("tempdir");
        full(dir.path(), &keys(1, "a"), &old_rows);
        let old = ShardIndex::open(dir.path()).expect("open").expect("present");
        let again = ShardRow { pos: ShardPos { shard: 1, row_group: 0, row: 0 }, ..old_rows[3].clone() };
        let out = tempfile::tempdir().expect("tempdir");
        let keys2: Vec<ShardKey> = keys(1, "a").into_iter().chain(keys(1, "b")).collect();
        let merged = write_merged(out.path(), &keys2, &old, &|k| Some(k), &[std::slice::from_ref(&again)], Dest::Store(&None)).expect("merge");
        assert!(!merged);
        assert!(!out.path().join(super::super::index_file::INDEX_FILE_NAME).exists());
    }

    /// A read-only open of a file with block checksums checks no table;
    /// lookups check the blocks they read, answer as a whole check would,
    /// and a damaged block makes the lookups that read it miss and the file
    /// say so (format-spec/shard-index.md §2, kind 10).
    #[test]
    fn a_lazy_open_checks_the_blocks_lookups_read() {
        let n = 20_000u32;
        let rows: Vec<ShardRow> = (0..n)
            .map(|i| ShardRow {
                loc: Loc { segment: 1 + u64::from(i / 1000), offset: u64::from(i % 1000) * 64 },
                trace_id: Arc::from(format!("t{i}")),
                sessions: Arc::from(vec![Arc::<str>::from(format!("s{i}"))]),
                timestamp: f64::from(i),
                pos: ShardPos { shard: 0, row_group: i / 256, row: i % 256 },
            })
            .collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = full(dir.path(), &keys(1, "a"), &rows);
        let eager = ShardIndex::open(dir.path()).expect("open").expect("present");
        assert!(eager.block_check().is_none());
        let lazy = ShardIndex::open_lazy(dir.path()).expect("open").expect("present");
        let check = lazy.block_check().expect("a file with block checksums opens lazily").clone();
        assert_eq!(check.good_blocks(), 0, "the open checked no table");
        let (fe, fl) = (eager.frozen(), lazy.frozen());
        assert_eq!(fl.session_count(), n);
        for i in [0, 1, 777, 12_345, n - 1] {
            let (name, trace) = (format!("s{i}"), format!("t{i}"));
            let s = fl.session(&name).expect("found");
            assert_eq!(Some(s), fe.session(&name));
            let locs = |rows: &[FrozenRow]| rows.iter().map(|r| (r.loc(), r.timestamp.to_bits())).collect::<Vec<_>>();
            assert_eq!(locs(fl.session_rows(s)), locs(fe.session_rows(s)));
            assert_eq!(fl.trace_row(&trace), fe.trace_row(&trace));
            assert_eq!(fl.session_name(s), name);
        }
        assert_eq!(fl.session("nope"), None);
        let loc = rows[4321].loc;
        assert_eq!(lazy_set(&lazy).position(loc), eager_set(&eager).position(loc));
        let total = bytes.len().div_ceil(crate::storage::table::CHECK_BLOCK);
        let good = check.good_blocks();
        assert!(good > 0 && good * 4 < total, "{good} of {total} blocks checked");
        assert!(lazy.damage().is_none());

        // One bit of a frozen row in the middle of its table.
        let at = lazy.section_offset(super::super::index_file::FROZEN_ROWS) + 10_000 * 40 + 3;
        let victim = 10_000u32;
        let name = (0..n).find(|s| fe.row_range(*s).contains(&victim)).map(|s| fe.session_name(s).to_owned());
        let name = name.expect("its session");
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x04;
        std::fs::write(dir.path().join(super::super::index_file::INDEX_FILE_NAME), &damaged).expect("write");
        assert!(ShardIndex::open(dir.path()).is_err(), "a whole check refuses it");
        let lazy = ShardIndex::open_lazy(dir.path()).expect("a lazy open checks no table").expect("present");
        let fl = lazy.frozen();
        // Lookups elsewhere answer; the damaged rows read as none.
        assert_eq!(fl.session("s7").map(|s| fl.session_rows(s).len()), Some(1));
        assert!(lazy.damage().is_none());
        let s = fl.session(&name).expect("its session entry is intact");
        assert!(fl.session_rows(s).is_empty());
        let e = lazy.damage().expect("the damage is said");
        assert!(e.message().contains("fails its crc32") && e.message().contains("index.tsi"), "{e}");
        // A whole-table read is empty rather than partly unchecked.
        assert!(fl.rows().is_empty());

        // One bit of the second block of the sessions table (24-byte
        // entries): session 681's entry is whole in the first block, the
        // next one's (which ends its rows) reaches into the second. Its
        // rows read as none, not as every row to the end of the table.
        let at = lazy.section_offset(super::super::index_file::FROZEN_SESSIONS) + 16_384 + 5;
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x10;
        std::fs::write(dir.path().join(super::super::index_file::INDEX_FILE_NAME), &damaged).expect("write");
        let lazy = ShardIndex::open_lazy(dir.path()).expect("opens").expect("present");
        let fl = lazy.frozen();
        assert_eq!(fl.session_rows(10).len(), 1);
        assert!(lazy.damage().is_none());
        assert!(fl.session_rows(681).is_empty());
        assert_eq!(fl.row_range(681), 0..0);
        assert!(lazy.damage().is_some());
    }

    fn eager_set(ix: &ShardIndex) -> crate::shard::set::ShardSet {
        lazy_set(ix)
    }

    /// A shard set placed by the file (one shard file, not opened).
    fn lazy_set(ix: &ShardIndex) -> crate::shard::set::ShardSet {
        crate::shard::set::ShardSet::with_table(ix.placements())
    }
}
