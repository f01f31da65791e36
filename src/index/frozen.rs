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
use crate::shard::reader::ShardRow;
use std::cmp::Ordering;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

/// The 64-bit hash the layer sorts ids by, and the store's row counts keep
/// (`store/protocol.rs`): SipHash-1-3 with zero keys (the standard
/// library's `DefaultHasher::new()`), in memory only.
pub(crate) fn id_hash(id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}

/// A frozen call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrozenRow {
    pub loc: Loc,
    pub timestamp: f64,
    /// Its trace id: `text[trace..trace + trace_len]`.
    trace: u64,
    trace_len: u32,
    /// Its session, an index into [`Frozen::sessions`].
    pub session: u32,
}

/// A frozen session: its calls are `rows[first_row..]` up to the next
/// session's first row.
#[derive(Debug, Clone, Copy)]
struct FrozenSession {
    hash: u64,
    name: u64,
    name_len: u32,
    first_row: u32,
}

/// A row's `session_id` (a frozen row has no other session).
fn session_of(r: &ShardRow) -> &str {
    r.sessions.first().map_or("", |s| s)
}

/// The frozen sessions of a view: built at an open, whose replay also sets
/// their seals and rewards here, then shared by every snapshot unchanged.
#[derive(Debug, Default)]
pub(crate) struct Frozen {
    /// Trace ids and session names, back to back.
    text: Vec<u8>,
    /// Grouped by session (in `sessions` order), each session's calls by
    /// (timestamp, log position), as a session lists them.
    rows: Vec<FrozenRow>,
    /// Sorted by (name hash, name).
    sessions: Vec<FrozenSession>,
    /// (trace id hash, row), sorted.
    by_trace: Vec<(u64, u32)>,
    /// Per session, whether a seal record was replayed for it while the
    /// open built the index (a seal after that goes to the maps).
    sealed: Vec<bool>,
    /// Per session, the session reward the open's replay left it with
    /// (likewise).
    rewards: Vec<Option<f64>>,
}

impl Frozen {
    fn str_at(&self, at: u64, len: u32) -> &str {
        let (Ok(at), Ok(len)) = (usize::try_from(at), usize::try_from(len)) else { return "" };
        // Built from `&str`s: always valid UTF-8 at these bounds.
        self.text.get(at..at.saturating_add(len)).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or("")
    }

    /// A row's trace id.
    pub fn trace_id(&self, row: &FrozenRow) -> &str {
        self.str_at(row.trace, row.trace_len)
    }

    /// A session's name.
    pub fn session_name(&self, session: u32) -> &str {
        self.sessions.get(session as usize).map_or("", |s| self.str_at(s.name, s.name_len))
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

    pub fn rows(&self) -> &[FrozenRow] {
        &self.rows
    }

    /// The frozen session named `name`.
    pub fn session(&self, name: &str) -> Option<u32> {
        let h = id_hash(name);
        let at = self.sessions.partition_point(|s| s.hash < h);
        let same = self.sessions.get(at..)?.iter().take_while(|s| s.hash == h);
        for (i, s) in same.enumerate() {
            if self.str_at(s.name, s.name_len) == name {
                return Some((at + i) as u32);
            }
        }
        None
    }

    /// Whether the open's replay sealed frozen session `session`.
    pub fn is_sealed(&self, session: u32) -> bool {
        self.sealed.get(session as usize).copied().unwrap_or(false)
    }

    /// Seal frozen session `session` (an open's replay).
    pub fn seal(&mut self, session: u32) {
        if let Some(s) = self.sealed.get_mut(session as usize) {
            *s = true;
        }
    }

    /// The session reward the open's replay set on frozen session `session`.
    pub fn reward(&self, session: u32) -> Option<f64> {
        self.rewards.get(session as usize).copied().flatten()
    }

    /// Set frozen session `session`'s reward (an open's replay).
    pub fn set_reward(&mut self, session: u32, value: f64) {
        if let Some(r) = self.rewards.get_mut(session as usize) {
            *r = Some(value);
        }
    }

    /// Every sealed frozen session.
    pub fn sealed_sessions(&self) -> impl Iterator<Item = u32> + '_ {
        self.sealed.iter().enumerate().filter(|(_, s)| **s).map(|(i, _)| i as u32)
    }

    /// A frozen session's calls, oldest first.
    pub fn session_rows(&self, session: u32) -> &[FrozenRow] {
        let i = session as usize;
        let (Some(s), end) =
            (self.sessions.get(i), self.sessions.get(i + 1).map_or(self.rows.len(), |n| n.first_row as usize))
        else {
            return &[];
        };
        self.rows.get(s.first_row as usize..end).unwrap_or(&[])
    }

    /// The frozen call with trace id `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Option<&FrozenRow> {
        let h = id_hash(trace_id);
        let at = self.by_trace.partition_point(|(x, _)| *x < h);
        self.by_trace
            .get(at..)?
            .iter()
            .take_while(|(x, _)| *x == h)
            .filter_map(|(_, r)| self.rows.get(*r as usize))
            .find(|r| self.trace_id(r) == trace_id)
    }

    /// Freeze `rows` (each of one session alone, no two with one trace id;
    /// see [`cold_rows`]), with the frozen session of each. `None` past what
    /// the layer's 32-bit numbers address: the caller keeps every call in
    /// the maps then.
    pub fn build(rows: &[&ShardRow]) -> Option<(Frozen, Vec<u32>)> {
        if u32::try_from(rows.len()).is_err() {
            return None;
        }
        let mut order: Vec<(u64, u32)> =
            rows.iter().enumerate().map(|(i, r)| (id_hash(session_of(r)), i as u32)).collect();
        let row = |i: u32| rows.get(i as usize).copied();
        order.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0).then_with(|| match (row(a.1), row(b.1)) {
                (Some(x), Some(y)) => {
                    session_of(x).cmp(session_of(y)).then(x.timestamp.total_cmp(&y.timestamp)).then(x.loc.cmp(&y.loc))
                }
                _ => Ordering::Equal,
            })
        });
        let mut f = Frozen {
            text: Vec::new(),
            rows: Vec::with_capacity(rows.len()),
            sessions: Vec::new(),
            by_trace: Vec::with_capacity(rows.len()),
            sealed: Vec::new(),
            rewards: Vec::new(),
        };
        let mut session_of_input = vec![0u32; rows.len()];
        for (hash, i) in order {
            let Some(r) = row(i) else { continue };
            let name = session_of(r);
            let new_session = f.sessions.last().is_none_or(|s| s.hash != hash || f.str_at(s.name, s.name_len) != name);
            if new_session {
                let at = f.text.len() as u64;
                f.text.extend_from_slice(name.as_bytes());
                f.sessions.push(FrozenSession {
                    hash,
                    name: at,
                    name_len: u32::try_from(name.len()).ok()?,
                    first_row: f.rows.len() as u32,
                });
            }
            let at = f.text.len() as u64;
            f.text.extend_from_slice(r.trace_id.as_bytes());
            f.by_trace.push((id_hash(&r.trace_id), f.rows.len() as u32));
            f.rows.push(FrozenRow {
                loc: r.loc,
                timestamp: r.timestamp,
                trace: at,
                trace_len: u32::try_from(r.trace_id.len()).ok()?,
                session: (f.sessions.len() - 1) as u32,
            });
            if let Some(s) = session_of_input.get_mut(i as usize) {
                *s = (f.sessions.len() - 1) as u32;
            }
        }
        f.by_trace.sort_unstable();
        f.text.shrink_to_fit();
        f.sealed = vec![false; f.sessions.len()];
        f.rewards = vec![None; f.sessions.len()];
        Some((f, session_of_input))
    }

    /// Bytes this layer holds.
    pub fn heap_bytes(&self) -> usize {
        self.text.capacity()
            + self.rows.capacity() * std::mem::size_of::<FrozenRow>()
            + self.sessions.capacity() * std::mem::size_of::<FrozenSession>()
            + self.by_trace.capacity() * std::mem::size_of::<(u64, u32)>()
            + self.sealed.capacity()
            + self.rewards.capacity() * std::mem::size_of::<Option<f64>>()
    }
}

/// Which shard rows (sorted by log position, as an open loads them) may be
/// frozen: those of a session whose every row is of it alone and whose
/// trace ids have no other shard row (a replacement not yet collected).
/// What the log's records do to them is left to thawing.
pub(crate) fn cold_rows(rows: &[ShardRow]) -> Vec<bool> {
    let mut hot_sessions: HashSet<u64> = HashSet::new();
    let mut traces: Vec<(u64, u32)> = rows.iter().enumerate().map(|(i, r)| (id_hash(&r.trace_id), i as u32)).collect();
    traces.sort_unstable();
    let mut heat = |r: Option<&ShardRow>| {
        for s in r.iter().flat_map(|r| r.sessions.iter()) {
            hot_sessions.insert(id_hash(s));
        }
    };
    // Same hash, same id or not: hotter than needed is always correct.
    for w in traces.windows(2) {
        if let [(a, i), (b, j)] = w {
            if a == b {
                heat(rows.get(*i as usize));
                heat(rows.get(*j as usize));
            }
        }
    }
    drop(traces);
    for r in rows.iter().filter(|r| r.sessions.len() != 1) {
        heat(Some(r));
    }
    // Consecutive rows share their session list: hash each list once.
    let mut last: Option<(*const [std::sync::Arc<str>], bool)> = None;
    rows.iter()
        .map(|r| {
            let ptr: *const [std::sync::Arc<str>] = &*r.sessions;
            match last {
                Some((p, cold)) if std::ptr::eq(p, ptr) => cold,
                _ => {
                    let cold = r.sessions.len() == 1 && r.sessions.iter().all(|s| !hot_sessions.contains(&id_hash(s)));
                    last = Some((ptr, cold));
                    cold
                }
            }
        })
        .collect()
}
