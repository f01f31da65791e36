//! The frozen layer of the index: compacted sessions that nothing in the
//! log touches, held in flat sorted arrays instead of one B-tree entry per
//! call.
//!
//! At an open, a session goes here when every one of its calls is a shard
//! row of that session alone, and no other shard row has the trace id of
//! any of them (see [`cold_rows`]). Such a session is a pure function of its
//! shard rows: no record in the log can change it except one that names it
//! or one of its trace ids, and such a record *thaws* the session (its calls
//! move into the in-memory maps, [`super::Index`]) before it is applied, so
//! the replay rules (format-spec/record.md §6) run on exactly the calls they
//! ran on before. Seals and session rewards do not thaw: while the open's
//! replay builds the layer they are values of it, later ones go to the
//! maps. A row costs 56 bytes here plus its trace id's bytes (~75 in all
//! for short ids), where the maps cost about 370 bytes a call.

use crate::format::record::Loc;
use crate::shard::reader::{ShardPos, ShardRow};
use crate::storage::table::Table;
use bytemuck::{Pod, Zeroable};
use std::cmp::Ordering;
use std::collections::HashSet;
use std::sync::Arc;

/// The 64-bit hash the layer sorts ids by, the shard index file stores
/// (format-spec/shard-index.md §3) and the store's row counts keep
/// (`store/protocol.rs`): XXH3-64 with seed 0 of the id's UTF-8 bytes.
pub(crate) fn id_hash(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

/// A frozen call (40 bytes, the layout of format-spec/shard-index.md §4).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct FrozenRow {
    segment: u64,
    offset: u64,
    pub timestamp: f64,
    /// Its trace id: `text[trace..trace + trace_len]`.
    trace: u64,
    trace_len: u32,
    /// Its session, an index into [`Frozen::sessions`].
    pub session: u32,
}

impl FrozenRow {
    /// The log position of the call record it was compacted from.
    pub fn loc(&self) -> Loc {
        Loc { segment: self.segment, offset: self.offset }
    }

    /// A row of session `session` whose trace id is `text[trace..trace + trace_len]`.
    pub(crate) fn new(loc: Loc, timestamp: f64, trace: u64, trace_len: u32, session: u32) -> FrozenRow {
        FrozenRow { segment: loc.segment, offset: loc.offset, timestamp, trace, trace_len, session }
    }
}

impl FrozenSession {
    /// A session whose name hashes to `hash`, is `text[name..name + name_len]`
    /// and whose rows start at `first_row`.
    pub(crate) fn new(hash: u64, name: u64, name_len: u32, first_row: u32) -> FrozenSession {
        FrozenSession { hash, name, name_len, first_row }
    }
}

impl TraceEntry {
    pub(crate) fn new(hash: u64, row: u32) -> TraceEntry {
        TraceEntry { hash, row, reserved: 0 }
    }

    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    pub(crate) fn row(&self) -> u32 {
        self.row
    }
}

/// A frozen session: its calls are `rows[first_row..]` up to the next
/// session's first row (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct FrozenSession {
    hash: u64,
    name: u64,
    name_len: u32,
    first_row: u32,
}

/// A trace id's frozen row, in the table sorted by (hash, row) (16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Pod, Zeroable)]
pub(crate) struct TraceEntry {
    hash: u64,
    row: u32,
    reserved: u32,
}

/// The sessions of a shard row: `session_id` first, then the extra
/// session uids.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowSessions<'a> {
    /// A row of one session (every frozen row).
    One(&'a str),
    /// As a decoded shard row holds them (shared by consecutive rows).
    List(&'a [Arc<str>]),
}

impl<'a> RowSessions<'a> {
    pub fn len(&self) -> usize {
        match self {
            RowSessions::One(_) => 1,
            RowSessions::List(l) => l.len(),
        }
    }

    /// Its `session_id` ("" for none, which no row has).
    pub fn first(&self) -> &'a str {
        match self {
            RowSessions::One(s) => s,
            RowSessions::List(l) => l.first().map_or("", |s| s),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &'a str> + 'a {
        let (one, list) = match *self {
            RowSessions::One(s) => (Some(s), &[][..]),
            RowSessions::List(l) => (None, l),
        };
        one.into_iter().chain(list.iter().map(|s| &**s))
    }

    /// Whether both are the same list object (a cheap "same sessions" for
    /// consecutive decoded rows; `false` says nothing).
    fn same_list(&self, other: &RowSessions<'_>) -> bool {
        match (self, other) {
            (RowSessions::List(a), RowSessions::List(b)) => std::ptr::eq(*a, *b),
            _ => false,
        }
    }
}

/// A shard row as the index layers take it, borrowed from a decoded shard
/// row or from a mapped shard index.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowRef<'a> {
    pub loc: Loc,
    pub timestamp: f64,
    pub pos: ShardPos,
    pub trace_id: &'a str,
    pub sessions: RowSessions<'a>,
}

/// A shard row, decoded or borrowed: what the builders of the frozen layer
/// and of the shard index file take (so that decoded rows need no second
/// copy as [`RowRef`]s).
pub(crate) trait AsRow {
    fn row(&self) -> RowRef<'_>;
}

impl AsRow for ShardRow {
    fn row(&self) -> RowRef<'_> {
        RowRef::from(self)
    }
}

impl AsRow for RowRef<'_> {
    fn row(&self) -> RowRef<'_> {
        *self
    }
}

impl<'a> From<&'a ShardRow> for RowRef<'a> {
    fn from(r: &'a ShardRow) -> Self {
        RowRef {
            loc: r.loc,
            timestamp: r.timestamp,
            pos: r.pos,
            trace_id: &r.trace_id,
            sessions: RowSessions::List(&r.sessions),
        }
    }
}

/// The frozen sessions of a view: built at an open from the shard rows, or
/// mapped from the shard index file; the open's replay also sets their
/// seals and rewards here, then every snapshot shares the layer unchanged.
#[derive(Debug, Default)]
pub(crate) struct Frozen {
    /// Trace ids and session names, back to back.
    text: Table<u8>,
    /// Grouped by session (in `sessions` order), each session's calls by
    /// (timestamp, log position), as a session lists them.
    rows: Table<FrozenRow>,
    /// Sorted by (name hash, name).
    sessions: Table<FrozenSession>,
    /// (trace id hash, row), sorted.
    by_trace: Table<TraceEntry>,
    /// The seals and session rewards the annotation cache holds for the
    /// sessions (store/annotation_cache.rs), read in place: an open sets
    /// nothing per session for them.
    cached: Option<CachedMarks>,
    /// Bit set over the sessions: those a seal record was replayed for
    /// while the open built the index (a seal after that goes to the maps).
    /// Allocated at the first.
    sealed: Vec<u64>,
    /// The session rewards the open's replay set (likewise); they win over
    /// the cached ones.
    rewards: std::collections::HashMap<u32, f64>,
}

/// The annotation cache's seals and session rewards of a layer's sessions
/// (format-spec/shard-index.md §7): bit sets of the sealed sessions and of
/// those with a session reward (`ceil(sessions / 64)` words each), and each
/// session's reward bits.
#[derive(Debug)]
pub(crate) struct CachedMarks {
    pub sealed: Table<u64>,
    pub has_reward: Table<u64>,
    pub rewards: Table<u64>,
}

/// Bit `i` of a bit set of 64-bit words.
pub(crate) fn bit(set: &[u64], i: u32) -> bool {
    set.get((i / 64) as usize).is_some_and(|w| w >> (i % 64) & 1 == 1)
}

/// Bit `i` of a bit set of 64-bit words in a table (an element read, not
/// the whole table).
fn table_bit(set: &Table<u64>, i: u32) -> bool {
    set.at((i / 64) as usize).is_some_and(|w| w >> (i % 64) & 1 == 1)
}

/// Set bit `i` of a bit set of 64-bit words (none past its end).
pub(crate) fn set_bit(set: &mut [u64], i: u32) {
    if let Some(w) = set.get_mut((i / 64) as usize) {
        *w |= 1 << (i % 64);
    }
}

/// The four tables of a frozen layer, for the shard index file to write.
pub(crate) struct FrozenTables<'a> {
    pub text: &'a [u8],
    pub rows: &'a [FrozenRow],
    pub sessions: &'a [FrozenSession],
    pub by_trace: &'a [TraceEntry],
}

/// The first element of `table` (sorted by `hash`, whose values are
/// uniform: xxh3 of ids) whose hash is at least `h`: a few steps of
/// interpolation (each narrows n elements to about √n), then a binary
/// search; every element read has its block checked (`None` when one
/// fails). A plain binary search of a 10M-row table reads ~23 elements
/// on as many pages; this reads ~4 to 6 (a replay that looks up every
/// record of the segments a backlog file does not list spent 40% of a 10M
/// open in the binary search).
fn hash_search<T: Pod>(table: &Table<T>, h: u64, hash: impl Fn(&T) -> u64) -> Option<usize> {
    let (mut lo, mut hi) = (0usize, table.len());
    // Hashes of the elements at lo - 1 and at hi, or the bounds.
    let (mut below, mut above) = (0u64, u64::MAX);
    for _ in 0..4 {
        if hi - lo <= 64 {
            break;
        }
        let ahead = u128::from(h.saturating_sub(below)) * (hi - lo) as u128 / (u128::from(above - below) + 1);
        let at = lo + usize::try_from(ahead).unwrap_or(usize::MAX).min(hi - lo - 1);
        let v = hash(table.at(at)?);
        if v < h {
            (lo, below) = (at + 1, v);
        } else {
            (hi, above) = (at, v);
        }
    }
    table.partition_point_in(lo..hi, |e| hash(e) < h)
}

/// Whether `table` (sorted by `hash`) has an element hashing to `h`, or a
/// block read for it fails its check; `at`: where the last hash asked (a
/// smaller one) was found, moved by a gallop forward, the pages passed
/// given back as `Table::walk_to` does.
fn walk_has<T: Pod>(table: &Table<T>, at: &mut usize, h: u64, hash: impl Fn(&T) -> u64) -> bool {
    let before = *at;
    let Some(p) = table.partition_point_from(before, |e| hash(e) < h) else { return true };
    *at = p;
    if before >> 20 != p >> 20 {
        table.release_before(p);
    }
    table.at(p).map_or(p < table.len(), |e| hash(e) == h)
}

impl Frozen {
    fn bytes_at(&self, at: u64, len: u32) -> &[u8] {
        self.bytes_checked(at, len).unwrap_or(&[])
    }

    /// Text bytes `at..at + len`; `None` out of bounds or in a block that
    /// fails its check.
    fn bytes_checked(&self, at: u64, len: u32) -> Option<&[u8]> {
        let (Ok(at), Ok(len)) = (usize::try_from(at), usize::try_from(len)) else { return None };
        self.text.span(at..at.saturating_add(len))
    }

    fn str_at(&self, at: u64, len: u32) -> &str {
        std::str::from_utf8(self.bytes_at(at, len)).unwrap_or("")
    }

    /// A layer over tables read from a shard index file (whose checksums
    /// passed, or whose blocks are checked as they are read: see
    /// [`Table`]). Nothing here is checked row by row, which would touch the
    /// whole file at every open: every access is bounds-checked instead, so
    /// a malformed table makes lookups miss or names read empty, never a
    /// panic. The lookups read a few rows each and check only their
    /// blocks; what hands out a whole table checks all of it first.
    pub fn from_tables(
        text: Table<u8>,
        rows: Table<FrozenRow>,
        sessions: Table<FrozenSession>,
        by_trace: Table<TraceEntry>,
    ) -> Frozen {
        Frozen { text, rows, sessions, by_trace, cached: None, sealed: Vec::new(), rewards: Default::default() }
    }

    /// Where session `i`'s rows end: the next session's first row, or the
    /// end of the rows for the last; `None` when the next session's entry
    /// is in a block that fails its check (not "the end": that would hand
    /// out every later session's rows).
    fn rows_end(&self, i: usize) -> Option<usize> {
        if i + 1 < self.sessions.len() {
            self.sessions.at(i + 1).map(|n| n.first_row as usize)
        } else {
            Some(self.rows.len())
        }
    }

    /// The first session whose name hash is at least `h` ([`hash_search`]).
    fn sessions_from(&self, h: u64) -> Option<usize> {
        hash_search(&self.sessions, h, |s| s.hash)
    }

    /// Its tables, to write.
    pub fn tables(&self) -> FrozenTables<'_> {
        FrozenTables {
            text: self.text.as_slice(),
            rows: self.rows.as_slice(),
            sessions: self.sessions.as_slice(),
            by_trace: self.by_trace.as_slice(),
        }
    }

    /// A row's trace id.
    pub fn trace_id(&self, row: &FrozenRow) -> &str {
        self.str_at(row.trace, row.trace_len)
    }

    /// A session's name.
    pub fn session_name(&self, session: u32) -> &str {
        self.session_name_checked(session).unwrap_or("")
    }

    /// A session's name; `None` past the end, or when a block it is read
    /// from fails its check.
    pub fn session_name_checked(&self, session: u32) -> Option<&str> {
        let s = self.sessions.at(session as usize)?;
        std::str::from_utf8(self.bytes_checked(s.name, s.name_len)?).ok()
    }

    /// Number of frozen calls.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Number of frozen sessions.
    pub fn session_count(&self) -> u32 {
        self.sessions.len() as u32
    }

    /// Every frozen row (all of them checked first; empty when a block of
    /// them fails).
    pub fn rows(&self) -> &[FrozenRow] {
        self.rows.as_slice()
    }

    /// Frozen row `row`.
    pub fn row(&self, row: u32) -> Option<&FrozenRow> {
        self.rows.at(row as usize)
    }

    /// Give back this process's resident pages of the file its tables are
    /// mapped from, if they are (see `Mapping::release_pages`).
    pub fn release_pages(&self) {
        self.rows.release_mapping();
    }

    /// Whether its tables are the ones of the mapped file `map`.
    pub fn is_in(&self, map: &Arc<crate::storage::mmap::Mapping>) -> bool {
        self.rows.is_in(map)
    }

    /// The range of frozen rows of session `session` (empty past the end).
    pub fn row_range(&self, session: u32) -> std::ops::Range<u32> {
        let i = session as usize;
        match (self.sessions.at(i), self.rows_end(i)) {
            (Some(s), Some(end)) => s.first_row..end as u32,
            _ => 0..0,
        }
    }

    /// The hash of frozen session `session`'s name ([`id_hash`]).
    pub fn session_hash(&self, session: u32) -> u64 {
        self.sessions.at(session as usize).map_or(0, |s| s.hash)
    }

    /// The (trace id hash, row) table, sorted.
    pub fn by_trace(&self) -> &[TraceEntry] {
        self.by_trace.as_slice()
    }

    /// The rows whose trace id hashes to `hash`.
    pub fn rows_with_trace_hash(&self, hash: u64) -> impl Iterator<Item = u32> + '_ {
        let at = hash_search(&self.by_trace, hash, |e| e.hash);
        let run = at.and_then(|at| self.by_trace.run_from(at, |e| e.hash == hash));
        run.unwrap_or_default().iter().map(|e| e.row)
    }

    /// Whether a session name of the layer hashes to `h` (or a block read
    /// for it fails its check: "maybe", as a caller keeping things out of
    /// the layer wants), for hashes asked in increasing order: a gallop
    /// forward from `at` (where the last one was found; start at 0), as
    /// [`Frozen::has_trace_hash_from`].
    pub fn has_session_hash_from(&self, at: &mut usize, h: u64) -> bool {
        walk_has(&self.sessions, at, h, |s| s.hash)
    }

    /// Whether a trace id of the layer hashes to `h` (or a block read for it
    /// fails its check), for hashes asked in increasing order: a gallop
    /// forward from `at` (where the last one was found; start at 0)
    /// instead of a binary search of the whole table each (1.5M calls in
    /// segments surveyed against 10M compacted: ~15% of an open), the
    /// pages passed given back as `Table::walk_to` does.
    pub fn has_trace_hash_from(&self, at: &mut usize, h: u64) -> bool {
        walk_has(&self.by_trace, at, h, |e| e.hash)
    }

    /// The frozen session named `name`.
    pub fn session(&self, name: &str) -> Option<u32> {
        let h = id_hash(name);
        let at = self.sessions_from(h)?;
        let same = self.sessions.run_from(at, |s| s.hash == h)?;
        for (i, s) in same.iter().enumerate() {
            if self.bytes_at(s.name, s.name_len) == name.as_bytes() {
                return Some((at + i) as u32);
            }
        }
        None
    }

    /// [`Frozen::session`] for names asked in increasing order of their
    /// hash: a gallop forward from `at` (where the last one was found;
    /// start at 0) instead of a search of the whole table each.
    pub fn session_from(&self, at: &mut usize, name: &str) -> Option<u32> {
        let h = id_hash(name);
        let p = self.sessions.partition_point_from(*at, |s| s.hash < h)?;
        *at = p;
        let same = self.sessions.run_from(p, |s| s.hash == h)?;
        let i = same.iter().position(|s| self.bytes_at(s.name, s.name_len) == name.as_bytes())?;
        u32::try_from(p + i).ok()
    }

    /// Whether the open sealed frozen session `session` (the annotation
    /// cache, or a seal record its replay applied).
    pub fn is_sealed(&self, session: u32) -> bool {
        bit(&self.sealed, session) || self.cached.as_ref().is_some_and(|c| table_bit(&c.sealed, session))
    }

    /// Seal frozen session `session` (an open's replay).
    pub fn seal(&mut self, session: u32) {
        if session >= self.session_count() {
            return;
        }
        if self.sealed.is_empty() {
            self.sealed = vec![0; self.sessions.len().div_ceil(64)];
        }
        set_bit(&mut self.sealed, session);
    }

    /// The session reward the open set on frozen session `session` (its
    /// replay's, else the annotation cache's).
    pub fn reward(&self, session: u32) -> Option<f64> {
        if let Some(r) = self.rewards.get(&session) {
            return Some(*r);
        }
        let c = self.cached.as_ref()?;
        table_bit(&c.has_reward, session).then(|| c.rewards.at(session as usize).map(|b| f64::from_bits(*b))).flatten()
    }

    /// Set frozen session `session`'s reward (an open's replay).
    pub fn set_reward(&mut self, session: u32, value: f64) {
        if session < self.session_count() {
            self.rewards.insert(session, value);
        }
    }

    /// Take the annotation cache's seals and session rewards (before the
    /// open's replay sets any). `false` when they are not over this layer's
    /// sessions.
    pub fn set_cached(&mut self, marks: CachedMarks) -> bool {
        let words = self.sessions.len().div_ceil(64);
        if marks.sealed.len() != words || marks.has_reward.len() != words || marks.rewards.len() != self.sessions.len()
        {
            return false;
        }
        self.cached = Some(marks);
        true
    }

    /// What failed of the annotation cache's blocks that its seals and
    /// rewards are read from (a read-only open checks them as lookups read
    /// them), once one did.
    pub fn cache_damage(&self) -> Option<crate::error::Error> {
        self.cached.as_ref().and_then(|c| c.sealed.damage())
    }

    /// What failed of the lazily checked blocks of its own tables (the
    /// shard index file's, when a lazy open mapped them), once one did.
    pub fn table_damage(&self) -> Option<crate::error::Error> {
        self.text
            .damage()
            .or_else(|| self.rows.damage())
            .or_else(|| self.sessions.damage())
            .or_else(|| self.by_trace.damage())
    }

    /// The index of a frozen session's first row.
    pub fn first_row(&self, session: u32) -> Option<u32> {
        self.sessions.at(session as usize).map(|s| s.first_row)
    }

    /// A frozen session's calls, oldest first.
    pub fn session_rows(&self, session: u32) -> &[FrozenRow] {
        let i = session as usize;
        let (Some(s), Some(end)) = (self.sessions.at(i), self.rows_end(i)) else { return &[] };
        self.rows.span(s.first_row as usize..end).unwrap_or(&[])
    }

    /// The frozen call with trace id `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Option<&FrozenRow> {
        self.trace_row(trace_id).and_then(|i| self.rows.at(i as usize))
    }

    /// The row number of the frozen call with trace id `trace_id`.
    pub fn trace_row(&self, trace_id: &str) -> Option<u32> {
        let h = id_hash(trace_id);
        let at = hash_search(&self.by_trace, h, |e| e.hash)?;
        self.by_trace.run_from(at, |e| e.hash == h)?.iter().map(|e| e.row).find(|i| {
            self.rows.at(*i as usize).is_some_and(|r| self.bytes_at(r.trace, r.trace_len) == trace_id.as_bytes())
        })
    }

    /// Freeze the rows `cold` marks of `rows` (each of one session alone, no
    /// two with one trace id; see [`cold_rows`]); with each row's frozen
    /// row (`None` for a row not frozen). `None` past what the layer's
    /// 32-bit numbers address: the caller keeps every call in the maps then.
    pub fn build<R: AsRow>(rows: &[R], cold: &[bool]) -> Option<(Frozen, Vec<Option<u32>>)> {
        Self::build_with(rows, cold, true)
    }

    /// [`Frozen::build`]; without `row_map`, the second value is empty (an
    /// open's cold layer has no use for it: 8 bytes a call).
    pub fn build_with<R: AsRow>(rows: &[R], cold: &[bool], row_map: bool) -> Option<(Frozen, Vec<Option<u32>>)> {
        if u32::try_from(rows.len()).is_err() {
            return None;
        }
        let order: Vec<(u64, u32)> = rows
            .iter()
            .zip(cold)
            .enumerate()
            .filter(|(_, (_, c))| **c)
            .map(|(i, (r, _))| (id_hash(r.row().sessions.first()), i as u32))
            .collect();
        Self::build_ordered(rows.len(), order, |i: u32| rows.get(i as usize).map(AsRow::row), row_map)
    }

    /// [`Frozen::build`] of every one of `n` rows that `row` gives (rows of
    /// one session alone, no two with one trace id), none kept out, with no
    /// row map: for rows that are not in one slice (an old layer's and new
    /// ones). `None` as [`Frozen::build`].
    pub fn build_from<'r>(n: usize, row: impl Fn(u32) -> Option<RowRef<'r>>) -> Option<Frozen> {
        let n32 = u32::try_from(n).ok()?;
        let order: Vec<(u64, u32)> =
            (0..n32).filter_map(|i| row(i).map(|r| (id_hash(r.sessions.first()), i))).collect();
        Self::build_ordered(n, order, row, false).map(|(f, _)| f)
    }

    /// The build of [`Frozen::build_with`] over `order` (session name hash,
    /// row number) of `n` rows read through `row`.
    fn build_ordered<'r>(
        n: usize,
        mut order: Vec<(u64, u32)>,
        row: impl Fn(u32) -> Option<RowRef<'r>>,
        row_map: bool,
    ) -> Option<(Frozen, Vec<Option<u32>>)> {
        order.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0).then_with(|| match (row(a.1), row(b.1)) {
                (Some(x), Some(y)) => x
                    .sessions
                    .first()
                    .cmp(y.sessions.first())
                    .then(x.timestamp.total_cmp(&y.timestamp))
                    .then(x.loc.cmp(&y.loc)),
                _ => Ordering::Equal,
            })
        });
        // The session names first, then the trace ids: the lookups of an
        // open's replay (seals, rewards) touch the names' pages only.
        let (mut names, mut ids) = (Vec::new(), Vec::new());
        let (mut frows, mut sessions) = (Vec::with_capacity(order.len()), Vec::<FrozenSession>::new());
        let mut by_trace = Vec::with_capacity(order.len());
        let mut frozen_row_of_input = if row_map { vec![None; n] } else { Vec::new() };
        let mut last_name: Option<&str> = None;
        for (hash, i) in order {
            let Some(r) = row(i) else { continue };
            let name = r.sessions.first();
            if last_name != Some(name) {
                let at = names.len() as u64;
                names.extend_from_slice(name.as_bytes());
                sessions.push(FrozenSession {
                    hash,
                    name: at,
                    name_len: u32::try_from(name.len()).ok()?,
                    first_row: frows.len() as u32,
                });
                last_name = Some(name);
            }
            let at = ids.len() as u64;
            ids.extend_from_slice(r.trace_id.as_bytes());
            by_trace.push(TraceEntry { hash: id_hash(r.trace_id), row: frows.len() as u32, reserved: 0 });
            let session = (sessions.len() - 1) as u32;
            if let Some(s) = frozen_row_of_input.get_mut(i as usize) {
                *s = Some(frows.len() as u32);
            }
            frows.push(FrozenRow {
                segment: r.loc.segment,
                offset: r.loc.offset,
                timestamp: r.timestamp,
                trace: at,
                trace_len: u32::try_from(r.trace_id.len()).ok()?,
                session,
            });
        }
        let shift = names.len() as u64;
        for r in &mut frows {
            r.trace += shift;
        }
        let mut text = names;
        text.append(&mut ids);
        drop(ids);
        by_trace.sort_unstable();
        text.shrink_to_fit();
        let f = Frozen {
            text: text.into(),
            rows: frows.into(),
            sessions: sessions.into(),
            by_trace: by_trace.into(),
            cached: None,
            sealed: Vec::new(),
            rewards: Default::default(),
        };
        Some((f, frozen_row_of_input))
    }

    /// Bytes of heap this layer holds.
    pub fn heap_bytes(&self) -> usize {
        self.text.heap_bytes()
            + self.rows.heap_bytes()
            + self.sessions.heap_bytes()
            + self.by_trace.heap_bytes()
            + self.sealed.capacity() * 8
            + self.rewards.capacity() * (std::mem::size_of::<(u32, f64)>() + 1)
    }
}

/// Which shard rows (sorted by log position, as an open loads them) may be
/// frozen: those of a session whose every row is of it alone and whose
/// trace ids have no other shard row (a replacement not yet collected).
/// What the log's records do to them is left to thawing.
pub(crate) fn cold_rows<R: AsRow>(rows: &[R]) -> Vec<bool> {
    let mut hot_sessions: HashSet<u64> = HashSet::new();
    let mut traces: Vec<(u64, u32)> =
        rows.iter().enumerate().map(|(i, r)| (id_hash(r.row().trace_id), i as u32)).collect();
    traces.sort_unstable();
    let mut heat = |r: Option<RowRef<'_>>| {
        for s in r.iter().flat_map(|r| r.sessions.iter()) {
            hot_sessions.insert(id_hash(s));
        }
    };
    // Same hash, same id or not: hotter than needed is always correct.
    for w in traces.windows(2) {
        if let [(a, i), (b, j)] = w {
            if a == b {
                heat(rows.get(*i as usize).map(AsRow::row));
                heat(rows.get(*j as usize).map(AsRow::row));
            }
        }
    }
    drop(traces);
    for r in rows.iter().map(AsRow::row).filter(|r| r.sessions.len() != 1) {
        heat(Some(r));
    }
    // Consecutive decoded rows share their session list: hash each list once.
    let mut last: Option<(RowSessions<'_>, bool)> = None;
    rows.iter()
        .map(AsRow::row)
        .map(|r| match last {
            Some((l, cold)) if l.same_list(&r.sessions) => cold,
            _ => {
                let cold = r.sessions.len() == 1 && !hot_sessions.contains(&id_hash(r.sessions.first()));
                last = Some((r.sessions, cold));
                cold
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every session and trace id is found through the session directory,
    /// whatever the layer's size (the directory's bucket count follows it).
    #[test]
    fn every_session_and_trace_is_found_at_any_size() {
        for sessions in [0usize, 1, 7, 8, 9, 100, 5000] {
            let names: Vec<String> = (0..sessions).map(|s| format!("task-{s}:0")).collect();
            let ids: Vec<String> = (0..sessions * 2).map(|i| format!("t{i}")).collect();
            let lists: Vec<Vec<Arc<str>>> = names.iter().map(|n| vec![Arc::from(n.as_str())]).collect();
            let rows: Vec<RowRef<'_>> = (0..sessions * 2)
                .map(|i| RowRef {
                    loc: Loc { segment: 1, offset: i as u64 * 8 },
                    timestamp: i as f64,
                    pos: ShardPos { shard: 0, row_group: 0, row: i as u32 },
                    trace_id: &ids[i],
                    sessions: RowSessions::List(&lists[i / 2]),
                })
                .collect();
            let cold = cold_rows(&rows);
            assert!(cold.iter().all(|c| *c));
            let (f, frozen_row) = Frozen::build(&rows, &cold).unwrap();
            assert_eq!(f.session_count() as usize, sessions);
            for (s, name) in names.iter().enumerate() {
                let i = f.session(name).unwrap_or_else(|| panic!("{name} of {sessions}"));
                assert_eq!(f.session_name(i), name);
                let got: Vec<&str> = f.session_rows(i).iter().map(|r| f.trace_id(r)).collect();
                assert_eq!(got, [ids[2 * s].as_str(), ids[2 * s + 1].as_str()]);
            }
            for (i, id) in ids.iter().enumerate() {
                let r = f.trace(id).unwrap();
                assert_eq!(r.loc().offset, i as u64 * 8);
                assert_eq!(frozen_row[i].and_then(|k| f.rows().get(k as usize)).map(|r| r.loc()), Some(r.loc()));
            }
            assert_eq!(f.session("task-x:0"), None);
            assert!(f.trace("t-none").is_none());
        }
    }
}
