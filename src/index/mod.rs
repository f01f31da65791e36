//! In-memory indexes: trace id → latest call, session → calls ordered by
//! (timestamp, append position), rewards, seals.
//!
//! Built from persistent (structurally shared) maps, so a snapshot is an O(1)
//! clone that stays consistent while the writer keeps applying records. Records
//! are applied in log order; the same `apply` runs at recovery (from footers and
//! the scanned tail) and in the writer thread, so both always agree.

use crate::format::record::Loc;
use crate::shard::reader::ShardPos;
use imbl::HashMap;
use std::cmp::Ordering;
use std::sync::Arc;

/// What the index keeps per live call.
#[derive(Debug, Clone)]
pub struct CallMeta {
    /// The call record's position in the log (its frame, until the segment is
    /// retired after compaction).
    pub loc: Loc,
    /// Where the call is served from once compacted.
    pub shard: Option<ShardPos>,
    pub timestamp: f64,
    pub trace_id: Arc<str>,
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

/// Per-session index entry.
#[derive(Debug, Clone, Default)]
pub struct SessionEntry {
    /// Oldest first: by timestamp, then by append position. A persistent
    /// vector: a published snapshot's copy is O(1) and never sees it change,
    /// and an append is amortized O(1) however long the session (a copied
    /// `Vec` made each append O(session length)).
    pub calls: imbl::Vector<CallKey>,
    pub sealed: bool,
    pub reward: Option<f64>,
}

/// The indexes of a whole store at one point of its log.
#[derive(Debug, Clone, Default)]
pub struct Index {
    pub traces: HashMap<Arc<str>, CallMeta>,
    pub sessions: HashMap<Arc<str>, SessionEntry>,
    pub trace_rewards: HashMap<Arc<str>, f64>,
}

fn remove_key(calls: &mut imbl::Vector<CallKey>, key: &CallKey) {
    if let Ok(i) = calls.binary_search_by(|k| k.cmp_order(key)) {
        calls.remove(i);
    }
}

impl Index {
    /// Apply a call record; returns the call it replaced (same trace id), if any.
    pub fn apply_call(&mut self, meta: CallMeta) -> Option<CallMeta> {
        let replaced = self.traces.insert(meta.trace_id.clone(), meta.clone());
        if let Some(old) = &replaced {
            let old_key = CallKey { timestamp: old.timestamp, loc: old.loc, trace_id: old.trace_id.clone() };
            for s in old.sessions.iter() {
                if let Some(entry) = self.sessions.get_mut(s) {
                    remove_key(&mut entry.calls, &old_key);
                }
            }
        }
        let key = CallKey { timestamp: meta.timestamp, loc: meta.loc, trace_id: meta.trace_id.clone() };
        for s in meta.sessions.iter() {
            let entry = self.sessions.entry(s.clone()).or_default();
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

    /// Serve the call compacted from `loc` from `pos` — if it is still the live
    /// call of `trace_id` (it may have been replaced or deleted meanwhile).
    pub fn place_in_shard(&mut self, trace_id: &str, loc: Loc, pos: ShardPos) -> bool {
        match self.traces.get_mut(trace_id) {
            Some(meta) if meta.loc == loc => {
                meta.shard = Some(pos);
                true
            }
            _ => false,
        }
    }

    pub fn seal(&mut self, session: &str) {
        self.sessions.entry(Arc::from(session)).or_default().sealed = true;
    }

    pub fn set_session_reward(&mut self, session: &str, value: f64) {
        self.sessions.entry(Arc::from(session)).or_default().reward = Some(value);
    }

    pub fn set_trace_reward(&mut self, trace: &str, value: f64) {
        self.trace_rewards.insert(Arc::from(trace), value);
    }

    /// Number of live calls.
    pub fn call_count(&self) -> usize {
        self.traces.len()
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
