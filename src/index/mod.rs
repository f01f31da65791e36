//! In-memory indexes: trace id → latest call, session → calls ordered by
//! (timestamp, append position), rewards, seals.
//!
//! Built from persistent (structurally shared) B-tree maps, so a snapshot is an O(1)
//! clone that stays consistent while the writer keeps applying records. Records
//! are applied in log order; the same `apply` runs at recovery (from footers and
//! the scanned tail) and in the writer thread, so both always agree.

use crate::format::record::Loc;
use cold::ColdLayers;
use frozen::{Frozen, FrozenRow};
use imbl::OrdMap;
use std::cmp::Ordering;
use std::sync::Arc;

pub(crate) mod cold;
pub(crate) mod frozen;

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

/// What an open's survey of the log (store/cold.rs) found of the frozen
/// layer: the hashes ([`frozen::id_hash`]) of the trace ids and of the
/// session names (uids included) of the surveyed call records that are in
/// it. While those records are replayed, a call whose hashes are not here
/// is in no frozen session: its replay skips the two lookups of the
/// layer's mapped tables (a binary search each, ~13% of an open with 130k
/// calls in the maps over 4M compacted).
#[derive(Debug, Default)]
pub(crate) struct FrozenHits {
    pub traces: std::collections::HashSet<u64>,
    pub sessions: std::collections::HashSet<u64>,
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
    /// Boxed: inline, the persistent vector made every [`SessionEntry`]
    /// 128 bytes instead of 80 (a session entry per session with calls in
    /// segments, in the writer's maps).
    Large(Box<imbl::Vector<CallKey>>),
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
            CallList::Large(v) => CallList::Large(Box::new(v.skip(start.min(v.len())))),
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
                *self = CallList::Large(Box::new(large));
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
    /// Oldest first: by timestamp, then by append position. Empty for a
    /// frozen session (its calls are in the frozen layer), whose entry
    /// holds its reward, or a seal set after the open.
    pub calls: CallList,
    pub sealed: bool,
    pub reward: Option<f64>,
    /// The position of the session's last session-moved record (the
    /// copy-forward collector, format-spec/shard.md §6.3): no record of the
    /// session after it has a prefix-delta parent before it.
    pub floor: Option<Loc>,
    /// The session list of a call in this session alone, shared by every
    /// such call (see [`Index::sessions_of`]).
    solo: Option<Arc<[Arc<str>]>>,
}

/// A live call as the index knows it.
#[derive(Debug, Clone, Copy)]
pub enum LiveCall<'a> {
    /// A call of the in-memory maps.
    Hot(&'a CallMeta),
    /// A call of the frozen layer (a compacted call of one session) or of
    /// the cold layer (a call in a sealed segment of a session nothing
    /// else names).
    Frozen { loc: Loc, session: &'a str },
}

impl<'a> LiveCall<'a> {
    pub fn loc(&self) -> Loc {
        match self {
            LiveCall::Hot(m) => m.loc,
            LiveCall::Frozen { loc, .. } => *loc,
        }
    }
    /// Its `session_id`.
    pub fn primary_session(&self) -> Option<&'a str> {
        match self {
            LiveCall::Hot(m) => m.sessions.first().map(|s| &**s),
            LiveCall::Frozen { session, .. } => Some(session),
        }
    }
    /// `session_id` first, then the extra session uids.
    pub fn sessions(&self) -> Arc<[Arc<str>]> {
        match self {
            LiveCall::Hot(m) => m.sessions.clone(),
            LiveCall::Frozen { session, .. } => Arc::from([Arc::from(*session)]),
        }
    }
}

/// A session's summary, from the index alone.
#[derive(Debug, Clone, Copy)]
pub struct SessionSummary {
    pub calls: usize,
    pub first_timestamp: f64,
    pub last_timestamp: f64,
    pub sealed: bool,
    pub reward: Option<f64>,
}

/// The indexes of a whole store at one point of its log, in two layers: the
/// in-memory maps (persistent B-trees: every call in segments, every call
/// written or changed since the open, seals and rewards), and the frozen
/// layer (`frozen.rs`: compacted sessions nothing touched since, in flat
/// arrays). A session or trace id is in one layer only; a write that names
/// a frozen one thaws it into the maps first.
#[derive(Debug, Clone, Default)]
pub struct Index {
    /// Values behind an `Arc`: a snapshot's path copies move 8-byte pointers,
    /// not whole entries.
    traces: OrdMap<Arc<str>, Arc<CallMeta>>,
    sessions: OrdMap<Arc<str>, SessionEntry>,
    trace_rewards: OrdMap<Arc<str>, f64>,
    frozen: Arc<Frozen>,
    /// Frozen sessions whose calls moved into the maps.
    thawed: imbl::OrdSet<u32>,
    /// Their calls, in all.
    thawed_rows: usize,
    /// Segments whose seals and rewards the open took from the annotation
    /// cache (store/annotation_cache.rs) instead of replaying them.
    cached_segments: usize,
    /// While an open replays the log over a mapped frozen layer: each thaw
    /// (session, the position of the record that thawed it), for the open
    /// to apply the session's later rows as the replay reaches them.
    thaw_log: Option<Vec<(u32, Loc)>>,
    /// The cold layers (cold.rs): sessions whose every call is in a sealed
    /// segment and that no other record names but their seals and session
    /// rewards, in the frozen layer's flat arrays (built by an open,
    /// store/cold.rs `ColdPlan`, or mapped from the backlog index file). A
    /// record that names one of them or one of their trace ids (a
    /// writer's, or one a read-only refresh applies) thaws it whole into
    /// the maps first.
    cold: ColdLayers,
    /// Cold sessions (numbered across the layers) whose calls moved into
    /// the maps.
    cold_thawed: imbl::OrdSet<u32>,
    /// Their calls, in all.
    cold_thawed_rows: usize,
    /// Sealed segments whose footers the open took from the backlog index
    /// file (its cold layer is that file's).
    backlog_segments: usize,
    /// While a replay applies records whose names it surveyed first
    /// ([`Index::narrow_cold_lookups`]): the hashes of those names that
    /// the cold layer holds. A lookup of any other name skips the layer's
    /// mapped tables.
    cold_hits: Option<Arc<FrozenHits>>,
    /// The cold layers `cold_hits` is of (the first ones): a layer added
    /// since is looked up for every name.
    cold_narrowed: usize,
}

/// What a count of live calls per shard file reads of an [`Index`] (its
/// trace map, frozen layer and thawed sessions), held as O(1) clones: two
/// keys of the same trees count the same (`ShardSet`'s liveness memo).
pub(crate) struct LivenessKey {
    traces: OrdMap<Arc<str>, Arc<CallMeta>>,
    frozen: Arc<Frozen>,
    thawed: imbl::OrdSet<u32>,
    cold: ColdLayers,
    cold_thawed: imbl::OrdSet<u32>,
}

impl LivenessKey {
    /// Whether `other` was taken from the same trees (not merely equal
    /// ones: a tree changed since is another one).
    pub(crate) fn same(&self, other: &LivenessKey) -> bool {
        self.traces.ptr_eq(&other.traces)
            && Arc::ptr_eq(&self.frozen, &other.frozen)
            && self.thawed.ptr_eq(&other.thawed)
            && self.cold.ptr_eq(&other.cold)
            && self.cold_thawed.ptr_eq(&other.cold_thawed)
    }
}

fn remove_key(calls: &mut CallList, key: &CallKey) {
    if let Ok(i) = calls.binary_search_by(|k| k.cmp_order(key)) {
        calls.remove(i);
    }
}

impl Index {
    /// An index whose frozen layer is `frozen` and whose maps are empty.
    pub(crate) fn with_frozen(frozen: Frozen) -> Index {
        Index { frozen: Arc::new(frozen), ..Index::default() }
    }

    /// Record thaws from now on, for [`Index::take_thaws`] (an open that
    /// does not meet every frozen row in its replay).
    pub(crate) fn record_thaws(&mut self, on: bool) {
        self.thaw_log = on.then(Vec::new);
    }

    /// The thaws recorded since the last call: (frozen session, position of
    /// the record that thawed it); its rows from that position on are not
    /// in the maps yet.
    pub(crate) fn take_thaws(&mut self) -> Vec<(u32, Loc)> {
        self.thaw_log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// What a count of live calls per shard file reads of it.
    pub(crate) fn liveness_key(&self) -> LivenessKey {
        LivenessKey {
            traces: self.traces.clone(),
            frozen: self.frozen.clone(),
            thawed: self.thawed.clone(),
            cold: self.cold.clone(),
            cold_thawed: self.cold_thawed.clone(),
        }
    }

    /// The frozen layer.
    pub(crate) fn frozen(&self) -> &Frozen {
        &self.frozen
    }

    /// The cold layers (built by an open's survey, or mapped from the
    /// backlog index file), thawed sessions included.
    pub(crate) fn cold(&self) -> &ColdLayers {
        &self.cold
    }

    /// The frozen session `name`, unless thawed.
    fn frozen_session(&self, name: &str) -> Option<u32> {
        self.frozen.session(name).filter(|i| !self.thawed.contains(i))
    }

    /// The frozen call of `trace_id`, unless its session is thawed.
    fn frozen_trace(&self, trace_id: &str) -> Option<&FrozenRow> {
        self.frozen.trace(trace_id).filter(|r| !self.thawed.contains(&r.session))
    }

    /// Whether frozen session `session` (a [`FrozenRow`]'s) is not thawed.
    pub(crate) fn is_frozen(&self, session: u32) -> bool {
        !self.thawed.contains(&session)
    }

    /// Move a frozen session's calls before `before` into the maps, and
    /// mark it thawed: its later calls (an open replaying the log meets
    /// them later) are applied to the maps as they come.
    fn thaw(&mut self, session: u32, before: Loc) {
        if self.thawed.insert(session).is_some() {
            return;
        }
        if let Some(log) = &mut self.thaw_log {
            log.push((session, before));
        }
        let frozen = self.frozen.clone();
        self.thawed_rows += self.move_into_maps(&frozen, session, before);
    }

    /// Move session `session` of `layer` (frozen or cold) into the maps:
    /// its seal and reward, and its calls before `before`. Returns its
    /// number of calls.
    fn move_into_maps(&mut self, layer: &Frozen, session: u32, before: Loc) -> usize {
        let rows = layer.session_rows(session);
        let name = layer.session_name(session);
        let (sealed, reward) = (layer.is_sealed(session), layer.reward(session));
        if sealed || reward.is_some() {
            // The maps hold a thawed session's seal and reward (a reward
            // set since the open is newer).
            let entry = self.sessions.entry(Arc::from(name)).or_default();
            entry.sealed |= sealed;
            entry.reward = entry.reward.or(reward);
        }
        let sessions = self.sessions_of::<&str>(name, &[]);
        for r in rows.iter().filter(|r| r.loc() < before) {
            let meta = CallMeta { loc: r.loc(), timestamp: r.timestamp, sessions: sessions.clone() };
            // Its trace id is in no other layer (a record naming it thaws
            // the session first): nothing to thaw, nothing replaced.
            self.apply_call_to_maps(Arc::from(layer.trace_id(r)), meta);
        }
        rows.len()
    }

    /// Add a cold layer (an open, or a rebuilt index, after its replay
    /// surveyed the records the layers before do not hold). Its sessions
    /// and trace ids must be in no other layer, and no record applied so
    /// far may name them. `false` (nothing added) past `u32` sessions in
    /// all.
    pub(crate) fn push_cold(&mut self, cold: Frozen) -> bool {
        self.cold.push(cold)
    }

    /// [`Index::push_cold`] of the backlog index file's layer, the first,
    /// which stands for `segments` sealed segments' footers.
    pub(crate) fn set_cold_from_backlog(&mut self, cold: Frozen, segments: usize) {
        self.cold = ColdLayers::default();
        self.cold_thawed = imbl::OrdSet::new();
        self.cold_thawed_rows = 0;
        self.cold.push(cold);
        self.backlog_segments = segments;
    }

    /// The hashes [`Index::narrow_cold_lookups`] found in the cold layers,
    /// while the lookups are narrowed.
    pub(crate) fn cold_hits(&self) -> Option<&FrozenHits> {
        self.cold_hits.as_deref()
    }

    /// Note that the open took `segments` sealed segments' footers from the
    /// backlog index file and its delta.
    pub(crate) fn set_backlog_segments(&mut self, segments: usize) {
        self.backlog_segments = segments;
    }

    /// Sealed segments whose footers the open took from the backlog index
    /// file (and its delta).
    pub(crate) fn backlog_segments(&self) -> usize {
        self.backlog_segments
    }

    /// Until [`Index::widen_cold_lookups`], look up in the cold layer only
    /// the names (trace ids and session names) whose hashes are among
    /// `named` and in the layer, found by one walk forward through each of
    /// its two hash tables (their pages given back behind it). For a
    /// replay of records that name nothing else: an open through the
    /// backlog index file replays the segments the file does not list
    /// (~200k records at 10M calls), and a lookup of each record's trace
    /// id and session in the mapped tables, at random, was half of that
    /// open.
    pub(crate) fn narrow_cold_lookups(&mut self, mut named: Vec<u64>) {
        if self.cold.is_empty() {
            return;
        }
        named.sort_unstable();
        named.dedup();
        let mut hits = FrozenHits::default();
        for (layer, _) in self.cold.iter() {
            let (mut trace_at, mut session_at) = (0, 0);
            for &h in &named {
                if layer.has_trace_hash_from(&mut trace_at, h) {
                    hits.traces.insert(h);
                }
                if layer.has_session_hash_from(&mut session_at, h) {
                    hits.sessions.insert(h);
                }
            }
        }
        self.cold_hits = Some(Arc::new(hits));
        self.cold_narrowed = self.cold.count();
    }

    /// Look up every name in the cold layer again (after
    /// [`Index::narrow_cold_lookups`]).
    pub(crate) fn widen_cold_lookups(&mut self) {
        self.cold_hits = None;
    }

    /// The first cold layer a lookup of `name` reads: past the narrowed
    /// ones when the lookups are narrowed and `hashes` (the hits' sessions
    /// or traces) does not hold it.
    fn cold_lookup_from(&self, hashes: impl Fn(&FrozenHits) -> &std::collections::HashSet<u64>, name: &str) -> usize {
        match &self.cold_hits {
            Some(h) if !hashes(h).contains(&frozen::id_hash(name)) => self.cold_narrowed,
            _ => 0,
        }
    }

    /// The cold session `name`, unless thawed.
    fn cold_session(&self, name: &str) -> Option<u32> {
        if self.cold.is_empty() {
            return None;
        }
        let from = self.cold_lookup_from(|h| &h.sessions, name);
        self.cold.session(name, from).filter(|i| !self.cold_thawed.contains(i))
    }

    /// The cold call of `trace_id` with its session, unless thawed.
    fn cold_trace(&self, trace_id: &str) -> Option<(u32, &FrozenRow)> {
        if self.cold.is_empty() {
            return None;
        }
        let from = self.cold_lookup_from(|h| &h.traces, trace_id);
        self.cold.trace(trace_id, from).filter(|(s, _)| !self.cold_thawed.contains(s))
    }

    /// Move cold session `session`'s calls, seal and reward into the maps.
    /// All its calls are older than any record that can thaw it (the open
    /// built the layer from the whole log).
    fn thaw_cold(&mut self, session: u32) {
        if self.cold_thawed.insert(session).is_some() {
            return;
        }
        let Some((layer, local)) = self.cold.locate(session).map(|(l, i)| (l.clone(), i)) else { return };
        self.cold_thawed_rows += self.move_into_maps(&layer, local, Loc { segment: u64::MAX, offset: u64::MAX });
    }

    /// Thaw the cold session named `name`, if there is one.
    fn thaw_cold_named(&mut self, name: &str) {
        if let Some(i) = self.cold_session(name) {
            self.thaw_cold(i);
        }
    }

    /// Thaw what a record at `at` naming `trace_id` or `sessions` concerns.
    /// `hits`: the survey's, when the record is one it surveyed.
    fn thaw_for(&mut self, trace_id: Option<&str>, sessions: &[Arc<str>], at: Loc, hits: Option<&FrozenHits>) {
        if !self.cold.is_empty() {
            if let Some(s) = trace_id.and_then(|t| self.cold_trace(t)).map(|(s, _)| s) {
                self.thaw_cold(s);
            }
            for s in sessions {
                self.thaw_cold_named(s);
            }
        }
        if self.frozen.is_empty() {
            return;
        }
        // Without the survey's hashes, any name may be a frozen one.
        let may_be_frozen = |found: Option<&std::collections::HashSet<u64>>, name: &str| {
            found.is_none_or(|found| found.contains(&frozen::id_hash(name)))
        };
        let (traces, names) = (hits.map(|h| &h.traces), hits.map(|h| &h.sessions));
        if let Some(r) = trace_id.filter(|t| may_be_frozen(traces, t)).and_then(|t| self.frozen_trace(t)) {
            let s = r.session;
            self.thaw(s, at);
        }
        for s in sessions.iter().filter(|s| may_be_frozen(names, s)) {
            if let Some(i) = self.frozen_session(s) {
                self.thaw(i, at);
            }
        }
    }

    /// Apply a call record of `trace_id`; returns the call it replaced (same
    /// trace id), if any.
    pub fn apply_call(&mut self, trace_id: Arc<str>, meta: CallMeta) -> Option<Arc<CallMeta>> {
        self.apply_surveyed_call(trace_id, meta, None)
    }

    /// [`Index::apply_call`] of a call record an open's survey found
    /// `hits` for ([`FrozenHits`]).
    pub(crate) fn apply_surveyed_call(
        &mut self,
        trace_id: Arc<str>,
        meta: CallMeta,
        hits: Option<&FrozenHits>,
    ) -> Option<Arc<CallMeta>> {
        let sessions = meta.sessions.clone();
        self.thaw_for(Some(&trace_id), &sessions, meta.loc, hits);
        self.apply_call_to_maps(trace_id, meta)
    }

    fn apply_call_to_maps(&mut self, trace_id: Arc<str>, meta: CallMeta) -> Option<Arc<CallMeta>> {
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

    /// Delete every call that belongs to `session` (a deletion record at
    /// `at`); returns how many.
    pub fn delete_session(&mut self, session: &str, at: Loc) -> u64 {
        self.thaw_for(None, &[Arc::from(session)], at, None);
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
    ///
    /// While an open builds the index (the frozen layer not yet shared), a
    /// frozen session's seal is a flag of the layer: at a million sessions,
    /// a map entry each cost ~0.2 KB and a fifth of the open.
    pub fn seal(&mut self, session: &str) {
        if self.sessions.get(session).is_some_and(|e| e.sealed) {
            return;
        }
        // A cold session's seal carried forward by a retirement (most of
        // them: the writer compacts sealed sessions) changes nothing.
        if let Some(i) = self.cold_session(session) {
            if self.cold.is_sealed(i) {
                return;
            }
            self.thaw_cold(i);
        }
        // One lookup in the layer (an open replays a seal per session).
        if let Some(i) = self.frozen_session(session) {
            if self.frozen.is_sealed(i) {
                return;
            }
            if let Some(frozen) = Arc::get_mut(&mut self.frozen) {
                frozen.seal(i);
                return;
            }
        }
        self.sessions.entry(Arc::from(session)).or_default().sealed = true;
    }

    /// Set `session`'s reward; setting the value it has (bit for bit)
    /// changes nothing, as [`Index::seal`].
    /// While an open builds the index, a frozen session's reward is a value
    /// of the frozen layer, as its seal ([`Index::seal`]).
    pub fn set_session_reward(&mut self, session: &str, value: f64) {
        let same = |r: Option<f64>| r.is_some_and(|r| r.to_bits() == value.to_bits());
        if let Some(i) = self.cold_session(session) {
            if same(self.cold.reward(i)) {
                return;
            }
            self.thaw_cold(i);
        }
        match self.sessions.get(session).and_then(|e| e.reward) {
            Some(r) if same(Some(r)) => return,
            Some(_) => {}
            // One lookup in the layer (an open replays a reward per session).
            None => {
                if let Some(i) = self.frozen_session(session) {
                    if same(self.frozen.reward(i)) {
                        return;
                    }
                    if let Some(frozen) = Arc::get_mut(&mut self.frozen) {
                        frozen.set_reward(i, value);
                        return;
                    }
                }
            }
        }
        self.sessions.entry(Arc::from(session)).or_default().reward = Some(value);
    }

    /// Set the frozen sessions' seals and session rewards (`marks`, read in
    /// place: nothing is set per session) and the trace rewards of frozen
    /// rows (row, value bits), as an open's replay of the records they come
    /// from would (the annotation cache, store/annotation_cache.rs), before
    /// that replay. `false` (nothing set) when the layer is shared or has
    /// another number of sessions.
    pub(crate) fn apply_cached(
        &mut self,
        segments: usize,
        sessions: u32,
        marks: crate::index::frozen::CachedMarks,
        trace_rewards: &[(u32, u64)],
    ) -> bool {
        let Some(frozen) = Arc::get_mut(&mut self.frozen) else { return false };
        if frozen.session_count() != sessions || !frozen.set_cached(marks) {
            return false;
        }
        for (row, bits) in trace_rewards {
            if let Some(r) = self.frozen.row(*row) {
                self.trace_rewards.insert(Arc::from(self.frozen.trace_id(r)), f64::from_bits(*bits));
            }
        }
        self.cached_segments = segments;
        true
    }

    /// Set the reward of `trace`'s live call, by a record at `at`; a trace
    /// id with no live call there (never appended, or deleted with its
    /// session) takes none, so a reward never outlives its call
    /// (format-spec/record.md §6). Returns whether it was set.
    pub fn set_trace_reward(&mut self, trace: &str, value: f64, at: Loc) -> bool {
        if let Some(s) = self.cold_trace(trace).map(|(s, _)| s) {
            self.thaw_cold(s);
        }
        let key = match self.traces.get_key_value(trace) {
            Some((key, _)) => key.clone(),
            // A frozen call is live from its position on.
            None => match self.frozen_trace(trace) {
                Some(r) if r.loc() < at => Arc::from(trace),
                _ => return false,
            },
        };
        if self.trace_rewards.get(trace).is_some_and(|r| r.to_bits() == value.to_bits()) {
            return true;
        }
        self.trace_rewards.insert(key, value);
        true
    }

    /// Number of live calls.
    pub fn call_count(&self) -> usize {
        self.traces.len()
            + self.frozen.len().saturating_sub(self.thawed_rows)
            + self.cold.len().saturating_sub(self.cold_thawed_rows)
    }

    /// The live call of `trace_id`.
    pub fn live(&self, trace_id: &str) -> Option<LiveCall<'_>> {
        match self.traces.get(trace_id) {
            Some(m) => Some(LiveCall::Hot(m)),
            // The cold layer first: it is small and in memory, and no trace id
            // is in both (the open's survey kept the frozen ones out).
            None => match self.cold_trace(trace_id) {
                Some((s, r)) => Some(LiveCall::Frozen { loc: r.loc(), session: self.cold.session_name(s) }),
                None => self
                    .frozen_trace(trace_id)
                    .map(|r| LiveCall::Frozen { loc: r.loc(), session: self.frozen.session_name(r.session) }),
            },
        }
    }

    /// Whether `trace_id`'s live call is the record at `loc`.
    pub fn is_live_at(&self, trace_id: &str, loc: Loc) -> bool {
        self.live(trace_id).is_some_and(|c| c.loc() == loc)
    }

    /// [`Index::is_live_at`] for a record at `loc` whose placement names
    /// frozen row `row` of this index's frozen layer (the placements being
    /// the same shard index file's), with `thawed` =
    /// [`Index::thawed_rows`]: a frozen row is the row of the record at its
    /// placement, with its trace id, and a row of a session not thawed, with
    /// no call of that trace id in the maps, is its trace's live call (the
    /// frozen rows' trace ids are distinct, and a record naming one thaws
    /// its session). Reads neither the row nor the trace table: judging the
    /// 500k records of one kept segment by trace id touched ~1 GB of a
    /// 14.5M-row file, at random. Otherwise the lookup decides.
    pub(crate) fn is_live_at_frozen(
        &self,
        trace_id: &str,
        loc: Loc,
        row: u32,
        thawed: &[std::ops::Range<u32>],
    ) -> bool {
        let i = thawed.partition_point(|r| r.end <= row);
        let is_thawed = thawed.get(i).is_some_and(|r| r.contains(&row));
        let frozen_live = !is_thawed && !self.traces.contains_key(trace_id);
        // The shortcut never says live where the lookup would not (every
        // test build checks it).
        debug_assert!(!frozen_live || self.is_live_at(trace_id, loc), "{trace_id} at {loc:?}");
        frozen_live || self.is_live_at(trace_id, loc)
    }

    /// Every live call: the maps' (by trace id), then the frozen layer's,
    /// then the cold layer's.
    pub fn live_calls(&self) -> impl Iterator<Item = LiveCall<'_>> + '_ {
        let hot = self.traces.values().map(|m| LiveCall::Hot(m));
        let frozen = self
            .frozen
            .rows()
            .iter()
            .filter(|r| self.is_frozen(r.session))
            .map(|r| LiveCall::Frozen { loc: r.loc(), session: self.frozen.session_name(r.session) });
        hot.chain(frozen).chain(self.cold_calls().map(|(loc, session)| LiveCall::Frozen { loc, session }))
    }

    /// The live calls of the cold layer, with their session: in segments,
    /// or (a writer's) compacted since its open, as the maps' may be.
    pub(crate) fn cold_calls(&self) -> impl Iterator<Item = (Loc, &str)> + '_ {
        self.cold.calls().filter(|(s, _, _)| !self.cold_thawed.contains(s)).map(|(_, loc, session)| (loc, session))
    }

    /// The frozen rows of thawed sessions (their calls are in the maps
    /// now), as sorted ranges of row numbers.
    pub(crate) fn thawed_rows(&self) -> Vec<std::ops::Range<u32>> {
        let mut ranges: Vec<std::ops::Range<u32>> = self.thawed.iter().map(|s| self.frozen.row_range(*s)).collect();
        ranges.sort_unstable_by_key(|r| r.start);
        ranges
    }

    /// The calls in the maps (the frozen layer's are all compacted; the
    /// cold layer's: [`Index::cold_calls`]).
    pub(crate) fn hot_calls(&self) -> &OrdMap<Arc<str>, Arc<CallMeta>> {
        &self.traces
    }

    /// A session's calls, oldest first; empty for a session with none.
    /// O(1) from the maps; a frozen session's list is built (O(its calls)).
    pub fn session_calls(&self, session: &str) -> CallList {
        if let Some(e) = self.sessions.get(session) {
            if e.calls.len() > 0 {
                return e.calls.clone();
            }
        }
        let (layer, i) = match self.cold_session(session).and_then(|i| self.cold.locate(i)) {
            Some((layer, i)) => (layer, i),
            None => match self.frozen_session(session) {
                Some(i) => (&self.frozen, i),
                None => return CallList::default(),
            },
        };
        let keys: Vec<CallKey> = layer
            .session_rows(i)
            .iter()
            .map(|r| CallKey { timestamp: r.timestamp, loc: r.loc(), trace_id: Arc::from(layer.trace_id(r)) })
            .collect();
        CallList::Small(Arc::new(keys))
    }

    /// Whether `session` is frozen (all its calls compacted).
    pub fn is_frozen_session(&self, session: &str) -> bool {
        !self.frozen.is_empty() && self.frozen_session(session).is_some()
    }

    /// A session's summary; `None` for one with no live call.
    pub fn session_summary(&self, session: &str) -> Option<SessionSummary> {
        let entry = self.sessions.get(session);
        match entry.and_then(Self::mapped_summary) {
            Some(s) => Some(s),
            None => match self.cold_session(session) {
                Some(i) => self.cold.locate(i).and_then(|(layer, i)| Self::layer_summary(layer, i, None)),
                None => self.frozen_summary(self.frozen_session(session)?, entry),
            },
        }
    }

    /// The summary of a session with calls in the maps. Such a session is
    /// not frozen (a call reaches the maps only after thawing what it
    /// names), so its entry holds its seal and reward.
    fn mapped_summary(e: &SessionEntry) -> Option<SessionSummary> {
        let (first, last) = (e.calls.front()?, e.calls.last()?);
        Some(SessionSummary {
            calls: e.calls.len(),
            first_timestamp: first.timestamp,
            last_timestamp: last.timestamp,
            sealed: e.sealed,
            reward: e.reward,
        })
    }

    /// The summary of frozen session `i`; `entry` is its entry in the maps,
    /// if any (a seal or reward set since the open).
    fn frozen_summary(&self, i: u32, entry: Option<&SessionEntry>) -> Option<SessionSummary> {
        Self::layer_summary(&self.frozen, i, entry)
    }

    /// The summary of session `i` of `layer` (frozen or cold).
    fn layer_summary(layer: &Frozen, i: u32, entry: Option<&SessionEntry>) -> Option<SessionSummary> {
        let rows = layer.session_rows(i);
        let (first, last) = (rows.first()?, rows.last()?);
        Some(SessionSummary {
            calls: rows.len(),
            first_timestamp: first.timestamp,
            last_timestamp: last.timestamp,
            sealed: entry.is_some_and(|e| e.sealed) || layer.is_sealed(i),
            reward: entry.and_then(|e| e.reward).or(layer.reward(i)),
        })
    }

    /// Every session of the maps with a live call (by name), with its
    /// summary; not the frozen ones.
    pub fn for_each_session_in_maps(&self, mut f: impl FnMut(&str, SessionSummary)) {
        for (name, e) in self.sessions.iter() {
            if let Some(s) = Self::mapped_summary(e) {
                f(name, s);
            }
        }
    }

    /// Every cold session (not thawed), with its summary: its calls are
    /// all in segments (or compacted since the open, as the maps' may be).
    pub fn for_each_cold_session(&self, mut f: impl FnMut(&str, SessionSummary)) {
        for (layer, first) in self.cold.iter() {
            for i in (0..layer.session_count()).filter(|i| !self.cold_thawed.contains(&(first + i))) {
                if let Some(s) = Self::layer_summary(layer, i, None) {
                    f(layer.session_name(i), s);
                }
            }
        }
    }

    /// Every session with a live call, with its summary: the maps' (by
    /// name), then the frozen ones, then the cold ones.
    pub fn for_each_session(&self, mut f: impl FnMut(&str, SessionSummary)) {
        self.for_each_session_in_maps(&mut f);
        for i in (0..self.frozen.session_count()).filter(|i| self.is_frozen(*i)) {
            // A name in a damaged block of the shard index file is left
            // out (`Snapshot::check_index` says so).
            let Some(name) = self.frozen.session_name_checked(i) else { continue };
            if let Some(s) = self.frozen_summary(i, self.sessions.get(name)) {
                f(name, s);
            }
        }
        self.for_each_cold_session(f);
    }

    /// Note a session-moved record of `session` at `at`. A session the maps
    /// do not hold (a frozen one: all compacted) has no record in segments
    /// a floor could free, and gets none.
    pub fn set_floor(&mut self, session: &str, at: Loc) {
        self.thaw_cold_named(session);
        if let Some(e) = self.sessions.get_mut(session) {
            e.floor = Some(at);
        }
    }

    /// The position of `session`'s last session-moved record, if the maps
    /// hold one.
    pub fn session_floor(&self, session: &str) -> Option<Loc> {
        self.sessions.get(session).and_then(|e| e.floor)
    }

    /// Whether `session` is sealed.
    pub fn is_sealed(&self, session: &str) -> bool {
        self.sessions.get(session).is_some_and(|e| e.sealed)
            || self.frozen_session(session).is_some_and(|i| self.frozen.is_sealed(i))
            || self.cold_session(session).is_some_and(|i| self.cold.is_sealed(i))
    }

    /// A reward set in the maps (after the open) wins over the frozen
    /// layer's (replayed at the open).
    pub fn session_reward(&self, session: &str) -> Option<f64> {
        self.sessions
            .get(session)
            .and_then(|e| e.reward)
            .or_else(|| self.frozen_session(session).and_then(|i| self.frozen.reward(i)))
            .or_else(|| self.cold_session(session).and_then(|i| self.cold.reward(i)))
    }

    pub fn trace_reward(&self, trace: &str) -> Option<f64> {
        self.trace_rewards.get(trace).copied()
    }

    /// How many segments' seals and rewards the open took from the
    /// annotation cache.
    pub(crate) fn cached_segments(&self) -> usize {
        self.cached_segments
    }

    /// The frozen layer's calls and heap bytes (0, 0 without one).
    pub fn frozen_stats(&self) -> (usize, usize) {
        (self.frozen.len().saturating_sub(self.thawed_rows), self.frozen.heap_bytes())
    }

    /// The cold layer's calls and heap bytes (0, 0 without one).
    pub fn cold_stats(&self) -> (usize, usize) {
        (self.cold.len().saturating_sub(self.cold_thawed_rows), self.cold.heap_bytes())
    }

    /// [`sessions_of`], sharing what the index already holds: a session's
    /// name, and the whole list of a call in one session alone (most calls).
    /// A call's index entry then costs no allocation for its sessions.
    pub fn sessions_of<U: AsRef<str>>(&self, session_id: &str, uids: &[U]) -> Arc<[Arc<str>]> {
        let known = self.sessions.get_key_value(session_id);
        if uids.is_empty() || uids.iter().all(|u| u.as_ref() == session_id) {
            if let Some(solo) = known.and_then(|(_, e)| e.solo.clone()) {
                return solo;
            }
        }
        let name = |s: &str| self.sessions.get_key_value(s).map_or_else(|| Arc::from(s), |(k, _)| k.clone());
        let mut out: Vec<Arc<str>> = Vec::with_capacity(1 + uids.len());
        out.push(known.map_or_else(|| Arc::from(session_id), |(k, _)| k.clone()));
        for u in uids.iter().map(AsRef::as_ref) {
            if !out.iter().any(|s| &**s == u) {
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

#[cfg(test)]
mod size_tests {
    /// A session entry is one per session in the writer's maps: its size
    /// is a budget (the persistent vector of a long session is boxed).
    #[test]
    fn a_session_entry_stays_small() {
        assert!(std::mem::size_of::<super::CallList>() <= 16);
        assert!(std::mem::size_of::<super::SessionEntry>() <= 80, "{}", std::mem::size_of::<super::SessionEntry>());
    }
}
