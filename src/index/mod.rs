//! In-memory indexes: trace id → latest call, session → calls ordered by
//! (timestamp, append position), rewards, seals.
//!
//! Built from persistent (structurally shared) B-tree maps, so a snapshot is an O(1)
//! clone that stays consistent while the writer keeps applying records. Records
//! are applied in log order; the same `apply` runs at recovery (from footers and
//! the scanned tail) and in the writer thread, so both always agree.

use crate::format::record::Loc;
use imbl::OrdMap;
use std::cmp::Ordering;
use std::sync::Arc;

/// What the index keeps per live call (its trace id is the map's key).
#[derive(Debug, Clone)]
pub struct CallMeta {
    /// The call record's position in the log (its frame, until the segment is
    /// retired after compaction). A compacted call keeps it: its shard row
    /// is looked up by it (`ShardSet::position`).
    pub loc: Loc,
    pub timestamp: f64,
    /// `session_id` first, then the extra session uids (deduplicated).
    pub sessions: Arc<[Arc<str>]>,
}

/// A position in a session's ordered call list.
#[derive(Debug, Clone)]
pub struct CallKey {
    pub timestamp: f64,
    pub loc: Loc,
    pub trace_id: Arc<str>,
}

impl CallKey {
    fn cmp_order(&self, other: &CallKey) -> Ordering {
        self.timestamp.total_cmp(&other.timestamp).then(self.loc.cmp(&other.loc))
    }
}

/// Sessions up to this many calls keep them in a shared `Vec`.
const SMALL_SESSION_CALLS: usize = 32;

/// A session's calls, oldest first: by timestamp, then by append position.
///
/// A published snapshot's copy is O(1) and never sees the list change, and a
/// change costs O(1) amortized however long the session: a short list (most
/// sessions) is a shared `Vec` copied on change, at most
/// `SMALL_SESSION_CALLS` keys; past that it becomes a persistent vector. (A
/// persistent vector for every session cost 2.5 KB each, its first 64-key
/// chunk, half the index of a store of short sessions; a copied `Vec` for
/// every session made each append O(session length).)
#[derive(Debug, Clone)]
pub enum CallList {
    Small(Arc<Vec<CallKey>>),
    Large(imbl::Vector<CallKey>),
}

impl Default for CallList {
    fn default() -> Self {
        CallList::Small(Arc::default())
    }
}

/// An iterator over a [`CallList`].
pub enum CallIter<'a> {
    Small(std::slice::Iter<'a, CallKey>),
    Large(imbl::vector::Iter<'a, CallKey, imbl::shared_ptr::DefaultSharedPtr>),
}

impl<'a> Iterator for CallIter<'a> {
    type Item = &'a CallKey;
    fn next(&mut self) -> Option<&'a CallKey> {
        match self {
            CallIter::Small(i) => i.next(),
            CallIter::Large(i) => i.next(),
        }
    }
}

impl CallList {
    pub fn len(&self) -> usize {
        match self {
            CallList::Small(v) => v.len(),
            CallList::Large(v) => v.len(),
        }
    }
    pub fn front(&self) -> Option<&CallKey> {
        match self {
            CallList::Small(v) => v.first(),
            CallList::Large(v) => v.front(),
        }
    }
    pub fn last(&self) -> Option<&CallKey> {
        match self {
            CallList::Small(v) => v.last(),
            CallList::Large(v) => v.last(),
        }
    }
    pub fn iter(&self) -> CallIter<'_> {
        match self {
            CallList::Small(v) => CallIter::Small(v.iter()),
            CallList::Large(v) => CallIter::Large(v.iter()),
        }
    }
    /// The list from position `start` on: O(`SMALL_SESSION_CALLS`) or
    /// O(log n), never a walk of a long list.
    pub fn skip(&self, start: usize) -> CallList {
        match self {
            CallList::Small(v) => CallList::Small(Arc::new(v.get(start..).unwrap_or_default().to_vec())),
            CallList::Large(v) => CallList::Large(v.skip(start.min(v.len()))),
        }
    }
    pub fn binary_search_by(&self, f: impl FnMut(&CallKey) -> Ordering) -> Result<usize, usize> {
        match self {
            CallList::Small(v) => v.binary_search_by(f),
            CallList::Large(v) => v.binary_search_by(f),
        }
    }
    fn insert(&mut self, at: usize, key: CallKey) {
        match self {
            CallList::Small(v) if v.len() < SMALL_SESSION_CALLS => Arc::make_mut(v).insert(at, key),
            CallList::Small(v) => {
                let mut large: imbl::Vector<CallKey> = v.iter().cloned().collect();
                large.insert(at, key);
                *self = CallList::Large(large);
            }
            CallList::Large(v) => v.insert(at, key),
        }
    }
    fn push_back(&mut self, key: CallKey) {
        let at = self.len();
        self.insert(at, key);
    }
    fn remove(&mut self, at: usize) {
        match self {
            CallList::Small(v) => {
                if at < v.len() {
                    Arc::make_mut(v).remove(at);
                }
            }
            CallList::Large(v) => {
                if at < v.len() {
                    v.remove(at);
                }
            }
        }
    }
}

/// Per-session index entry.
#[derive(Debug, Clone, Default)]
pub struct SessionEntry {
    /// Oldest first: by timestamp, then by append position.
    pub calls: CallList,
    pub sealed: bool,
    pub reward: Option<f64>,
    /// The session list of a call in this session alone, shared by every
    /// such call (see [`Index::sessions_of`]).
    solo: Option<Arc<[Arc<str>]>>,
}

/// The indexes of a whole store at one point of its log.
#[derive(Debug, Clone, Default)]
pub struct Index {
    /// Values behind an `Arc`: a snapshot's path copies move 8-byte pointers,
    /// not whole entries.
    pub traces: OrdMap<Arc<str>, Arc<CallMeta>>,
    pub sessions: OrdMap<Arc<str>, SessionEntry>,
    pub trace_rewards: OrdMap<Arc<str>, f64>,
}

fn remove_key(calls: &mut CallList, key: &CallKey) {
    if let Ok(i) = calls.binary_search_by(|k| k.cmp_order(key)) {
        calls.remove(i);
    }
}

impl Index {
    /// Apply a call record of `trace_id`; returns the call it replaced (same
    /// trace id), if any.
    pub fn apply_call(&mut self, trace_id: Arc<str>, meta: CallMeta) -> Option<Arc<CallMeta>> {
        let key = CallKey { timestamp: meta.timestamp, loc: meta.loc, trace_id };
        let meta = Arc::new(meta);
        let replaced = self.traces.insert(key.trace_id.clone(), meta.clone());
        if let Some(old) = &replaced {
            let old_key = CallKey { timestamp: old.timestamp, loc: old.loc, trace_id: key.trace_id.clone() };
            for s in old.sessions.iter() {
                if let Some(entry) = self.sessions.get_mut(s) {
                    remove_key(&mut entry.calls, &old_key);
                }
            }
        }
        for s in meta.sessions.iter() {
            let entry = self.sessions.entry(s.clone()).or_default();
            if entry.solo.is_none() && meta.sessions.len() == 1 {
                entry.solo = Some(meta.sessions.clone());
            }
            let calls = &mut entry.calls;
            match calls.last() {
                Some(last) if last.cmp_order(&key) == Ordering::Greater => {
                    let at = calls.binary_search_by(|k| k.cmp_order(&key)).unwrap_or_else(|i| i);
                    calls.insert(at, key.clone());
                }
                _ => calls.push_back(key.clone()),
            }
        }
        replaced
    }

    /// Delete every call that belongs to `session`; returns how many.
    pub fn delete_session(&mut self, session: &str) -> u64 {
        let Some(entry) = self.sessions.remove(session) else { return 0 };
        let mut count = 0;
        for key in entry.calls.iter() {
            let Some(meta) = self.traces.get(&key.trace_id) else { continue };
            if meta.loc != key.loc {
                continue;
            }
            let meta = meta.clone();
            self.traces.remove(&key.trace_id);
            self.trace_rewards.remove(&key.trace_id);
            count += 1;
            for s in meta.sessions.iter().filter(|s| &***s != session) {
                if let Some(other) = self.sessions.get_mut(s) {
                    remove_key(&mut other.calls, key);
                }
            }
        }
        count
    }

    /// Seal `session`. Sealing a sealed session changes nothing, not even
    /// the map's nodes (a retirement re-appends every current seal it
    /// carries forward: with the path copies, 49 MB at 125,000 sessions).
    pub fn seal(&mut self, session: &str) {
        if self.sessions.get(session).is_some_and(|e| e.sealed) {
            return;
        }
        self.sessions.entry(Arc::from(session)).or_default().sealed = true;
    }

    /// Set `session`'s reward; setting the value it has (bit for bit)
    /// changes nothing, as [`Index::seal`].
    pub fn set_session_reward(&mut self, session: &str, value: f64) {
        if self.sessions.get(session).and_then(|e| e.reward).is_some_and(|r| r.to_bits() == value.to_bits()) {
            return;
        }
        self.sessions.entry(Arc::from(session)).or_default().reward = Some(value);
    }

    /// Set the reward of `trace`'s live call; a trace id with no live call
    /// (never appended, or deleted with its session) takes none, so a
    /// reward never outlives its call (format-spec/record.md §6). Returns
    /// whether it was set.
    pub fn set_trace_reward(&mut self, trace: &str, value: f64) -> bool {
        match self.traces.get_key_value(trace) {
            Some((key, _)) => {
                if self.trace_rewards.get(trace).is_some_and(|r| r.to_bits() == value.to_bits()) {
                    return true;
                }
                let key = key.clone();
                self.trace_rewards.insert(key, value);
                true
            }
            None => false,
        }
    }

    /// Number of live calls.
    pub fn call_count(&self) -> usize {
        self.traces.len()
    }

    /// [`sessions_of`], sharing what the index already holds: a session's
    /// name, and the whole list of a call in one session alone (most calls).
    /// A call's index entry then costs no allocation for its sessions.
    pub fn sessions_of(&self, session_id: &str, uids: &[String]) -> Arc<[Arc<str>]> {
        let known = self.sessions.get_key_value(session_id);
        if uids.is_empty() || uids.iter().all(|u| u == session_id) {
            if let Some(solo) = known.and_then(|(_, e)| e.solo.clone()) {
                return solo;
            }
        }
        let name = |s: &str| self.sessions.get_key_value(s).map_or_else(|| Arc::from(s), |(k, _)| k.clone());
        let mut out: Vec<Arc<str>> = Vec::with_capacity(1 + uids.len());
        out.push(known.map_or_else(|| Arc::from(session_id), |(k, _)| k.clone()));
        for u in uids {
            if !out.iter().any(|s| &**s == u.as_str()) {
                out.push(name(u));
            }
        }
        out.into()
    }
}

/// Build the session list of a call: `session_id` then uids, without repeats.
pub fn sessions_of(session_id: &str, uids: &[String]) -> Arc<[Arc<str>]> {
    let mut out: Vec<Arc<str>> = Vec::with_capacity(1 + uids.len());
    out.push(Arc::from(session_id));
    for u in uids {
        if !out.iter().any(|s| &**s == u.as_str()) {
            out.push(Arc::from(u.as_str()));
        }
    }
    out.into()
}
