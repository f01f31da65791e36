//! The cold layer of an open: sessions whose calls are all in sealed
//! segments and that nothing else in the store names, held in the frozen
//! layer's flat arrays (`index/frozen.rs`, ~75 bytes a call) instead of the
//! in-memory maps (~200 bytes a call), so that the memory an open holds
//! for a backlog of uncompacted calls is a third of what it was.
//!
//! Which sessions qualify is decided before the replay, from every footer
//! entry of the log (a survey), because the replay rules (format-spec/
//! record.md §6) look at the calls a later record names: a session is cold
//! when
//! - every call record naming it is in a sealed segment and names it alone
//!   (no extra session uids);
//! - no other record names it but seals and session rewards (no deletion,
//!   no session-moved record), and no trace reward names one of its calls;
//! - none of its trace ids is the trace id of another call record, or of a
//!   shard row, and it has no shard row.
//!
//! Every test is by 64-bit hash ([`id_hash`]): a collision keeps a session
//! out of the layer, never puts one in wrongly. Replaying such a session's
//! records changes nothing but its own calls, seal and reward, so the
//! replay hands them to the plan instead of the maps ([`ColdPlan::take`])
//! and the layer answers as the maps would have. A record applied later
//! (a read-only refresh) that names a cold session or one of its trace ids
//! thaws it into the maps first (`Index::thaw_for`).
//!
//! A writer's compaction selection (`Snapshot::for_each_session_in_maps`),
//! publication (`in_segments`, the live rows per shard file) and
//! retirement (through `Index::live`) walk the layer beside the maps. Its
//! calls stay in it once compacted, as the maps' do, until a publication
//! hands the writer an index rebuilt over the new shard index file
//! (`Rebuilt`), whose replay of the sealed segments surveys them first
//! the same way; the writer's records replayed after them thaw what they
//! name. A seal or session reward a cold session already has (a
//! retirement carries the seals of the sessions it compacted forward)
//! changes nothing and thaws nothing. A writable open keeps the session
//! rewards the rewards side table may not reflect yet (`keep`): their
//! sessions are not cold.

use super::*;
use crate::format::record::{KIND_CALL, KIND_REWARD, KIND_SEAL};
use crate::format::segment::FooterEntryRef;
use crate::index::frozen::{id_hash, AsRow, Frozen, RowRef, RowSessions};
use crate::index::FrozenHits;
use crate::shard::reader::ShardPos;
use std::collections::{HashMap, HashSet};

/// A call the plan takes from the replay: borrowed from the footers the
/// open holds mapped (or decoded) until the layer is built.
struct ColdCall<'a> {
    loc: Loc,
    timestamp: f64,
    trace_id: &'a str,
    session: &'a str,
}

impl AsRow for ColdCall<'_> {
    fn row(&self) -> RowRef<'_> {
        RowRef {
            loc: self.loc,
            timestamp: self.timestamp,
            pos: ShardPos { shard: 0, row_group: 0, row: 0 },
            trace_id: self.trace_id,
            sessions: RowSessions::One(self.session),
        }
    }
}

/// What an open's replay (or a rebuilt index's, over its sealed
/// segments) diverts into the cold layer.
pub(super) struct ColdPlan<'a> {
    /// Hashes of the cold sessions' names.
    cold: HashSet<u64>,
    calls: Vec<ColdCall<'a>>,
    /// Seal and session reward per cold session, as the replay met them.
    marks: HashMap<&'a str, (bool, Option<f64>)>,
    /// The surveyed calls' hashes that are in the frozen layer: the
    /// replay of the calls the layer does not take skips the frozen
    /// lookups of the others.
    pub(super) hits: FrozenHits,
}

/// The sessions (by name hash) a survey keeps out of the layer, and those
/// it saw a call of in a sealed segment.
#[derive(Default)]
struct Survey {
    spoiled: HashSet<u64>,
    candidates: HashSet<u64>,
    /// (trace id hash, session hash) of every call record.
    calls: Vec<(u64, u64)>,
    /// Trace ids a trace reward names.
    rewarded: HashSet<u64>,
}

impl Survey {
    /// Take in one footer entry of a segment (`sealed` or not), at `loc`.
    /// `false` for a record whose kind the survey cannot judge from its
    /// entry (a reward in a footer older than segment format 4): no layer
    /// then. `kept`: the open keeps this record's reward for the rewards
    /// side table (a writer's), which the layer would not see.
    fn entry(&mut self, sealed: bool, e: &FooterEntryRef<'_>, kept: bool) -> bool {
        match (e.kind, e.reward_target) {
            (KIND_CALL, _) => {
                let session = id_hash(e.session_id);
                self.calls.push((id_hash(e.id), session));
                if !sealed || !e.session_uids.is_empty() {
                    self.spoiled.insert(session);
                    for u in e.session_uids.iter() {
                        self.spoiled.insert(id_hash(u));
                    }
                } else {
                    self.candidates.insert(session);
                }
            }
            (KIND_SEAL, _) => {}
            (KIND_REWARD, 2) => {
                if kept {
                    self.spoiled.insert(id_hash(e.id));
                }
            }
            (KIND_REWARD, 1) => {
                self.rewarded.insert(id_hash(e.id));
            }
            // Deletions and session-moved records: their session thaws.
            (crate::format::record::KIND_DELETE_SESSION | crate::format::record::KIND_MOVE_SESSION, _) => {
                self.spoiled.insert(id_hash(e.id));
            }
            _ => return false,
        }
        true
    }
}

/// Whether the call at `i` of `calls` ((trace id hash, session hash),
/// sorted) shares its trace id hash with a neighbour: a trace id with two
/// call records.
fn trace_repeats(calls: &[(u64, u64)], i: usize) -> bool {
    let Some(c) = calls.get(i) else { return false };
    let next_same = calls.get(i + 1).is_some_and(|n| n.0 == c.0);
    let prev_same = i.checked_sub(1).and_then(|p| calls.get(p)).is_some_and(|p| p.0 == c.0);
    next_same || prev_same
}

/// The sessions (by name hash) whose records among `segments` go to the
/// layer of a backlog index file written anew from the old one
/// (backlog_file.rs `write_incremental`), beside every session of `old`,
/// the old file's layer: `segments` are the old file's warm entries per
/// listed segment, then the footers of the segments sealed since (all
/// sealed, in log order); `old` stands for the rest of the log, which
/// names its sessions only by their own calls, seals and session rewards.
/// The rules are the survey's ([`ColdPlan::survey`], no shards); a session
/// of `old` stays in the layer when the entries only continue it (calls of
/// it alone), seal it or reward it. `None` (the caller surveys the whole
/// log instead) when an entry names a session of `old` otherwise, when a
/// call or trace reward has the trace id of one of its calls (its records
/// would go back to the warm entries, which takes their footers), or when
/// an entry cannot be judged from the footer.
pub(super) fn survey_increment<'s>(
    segments: impl IntoIterator<Item = Box<dyn Iterator<Item = FooterEntryRef<'s>> + 's>>,
    old: &Frozen,
) -> Option<HashSet<u64>> {
    let mut s = Survey::default();
    // The names each record gives as its own session's (a call of it
    // alone, its seal, its session reward), and those it names otherwise.
    let (mut own, mut other) = (Vec::new(), Vec::new());
    for e in segments.into_iter().flatten() {
        if !s.entry(true, &e, false) {
            return None;
        }
        match (e.kind, e.reward_target) {
            (KIND_CALL, _) if e.session_uids.is_empty() => own.push(id_hash(e.session_id)),
            (KIND_CALL, _) => {
                other.push(id_hash(e.session_id));
                other.extend(e.session_uids.iter().map(id_hash));
            }
            (KIND_SEAL, _) | (KIND_REWARD, 2) => own.push(id_hash(e.id)),
            (KIND_REWARD, _) => {}
            _ => other.push(id_hash(e.id)),
        }
    }
    // Each walk goes forward through one of the old layer's hash tables,
    // the hashes in increasing order.
    let mut traces: Vec<u64> = s.calls.iter().map(|c| c.0).chain(s.rewarded.iter().copied()).collect();
    traces.sort_unstable();
    traces.dedup();
    let mut at = 0;
    if traces.into_iter().any(|t| old.has_trace_hash_from(&mut at, t)) {
        return None;
    }
    other.sort_unstable();
    other.dedup();
    let mut at = 0;
    if other.into_iter().any(|h| old.has_session_hash_from(&mut at, h)) {
        return None;
    }
    // A trace id with two call records, or a trace reward: its calls'
    // sessions are not cold.
    s.calls.sort_unstable();
    for (i, c) in s.calls.iter().enumerate() {
        if trace_repeats(&s.calls, i) || s.rewarded.contains(&c.0) {
            s.spoiled.insert(c.1);
        }
    }
    // An old session these records continue must stay whole in the layer.
    own.sort_unstable();
    own.dedup();
    let mut at = 0;
    for h in own {
        if old.has_session_hash_from(&mut at, h) && s.spoiled.contains(&h) {
            return None;
        }
    }
    Some(s.candidates.into_iter().filter(|h| !s.spoiled.contains(h)).collect())
}

/// The sessions (by name hash) whose records among `segments` go to the
/// layer of a delta over a backlog index file (backlog_file.rs
/// `write_delta`): `segments` are the footers of the sealed segments right
/// after the ones the file lists, in log order, surveyed with the rules of
/// [`ColdPlan::survey`] (no shards), the file standing for the log before
/// them. A session of its layer (`base`), a name its warm entries carry
/// (`warm_names`: hashes of every trace id, session name and uid there),
/// or a call whose trace id is one of those or a call of its layer, is not
/// cold here: the delta never takes records the file holds. `None` when an
/// entry cannot be judged from the footer.
pub(super) fn survey_delta<'s>(
    segments: impl IntoIterator<Item = Box<dyn Iterator<Item = FooterEntryRef<'s>> + 's>>,
    warm_names: &HashSet<u64>,
    base: &Frozen,
) -> Option<HashSet<u64>> {
    let mut s = Survey::default();
    for e in segments.into_iter().flatten() {
        if !s.entry(true, &e, false) {
            return None;
        }
    }
    // In trace hash order: one walk forward through the base layer's
    // trace table.
    s.calls.sort_unstable();
    let mut at = 0;
    for (i, c) in s.calls.iter().enumerate() {
        let in_base = base.has_trace_hash_from(&mut at, c.0);
        if in_base || trace_repeats(&s.calls, i) || s.rewarded.contains(&c.0) || warm_names.contains(&c.0) {
            s.spoiled.insert(c.1);
        }
    }
    let mut cold: Vec<u64> =
        s.candidates.into_iter().filter(|h| !s.spoiled.contains(h) && !warm_names.contains(h)).collect();
    cold.sort_unstable();
    let mut at = 0;
    Some(cold.into_iter().filter(|h| !base.has_session_hash_from(&mut at, *h)).collect())
}

impl<'a> ColdPlan<'a> {
    /// Survey `segments` (each: id, sealed or not, its entries, in log
    /// order) against the shards: `index`'s frozen layer and the shard rows
    /// `rows` (trace id hash, session hashes) the replay will apply. When
    /// `index` has cold layers (an open through the backlog index file),
    /// they stand for the rest of the log, which names their sessions only
    /// by their own records: `segments` are then every record they do not
    /// hold (the file's warm entries, then the segments it does not list),
    /// the lookups narrowed to the names of the latter
    /// ([`Index::narrow_cold_lookups`]; the warm entries name nothing of
    /// the file's layer), and a session or trace id of a layer is not
    /// cold here (its records thaw it as the replay applies them).
    /// `keep`: the rewards the open keeps for the side table (their
    /// sessions are not cold). `surveyed` is called with each segment's id
    /// once its entries are read (its mapped pages can go). `None` when no
    /// session qualifies or the log holds a record the survey cannot judge.
    pub(super) fn survey<'s>(
        segments: impl IntoIterator<Item = (u64, bool, Box<dyn Iterator<Item = FooterEntryRef<'s>> + 's>)>,
        index: &Index,
        rows: impl IntoIterator<Item = (u64, Vec<u64>)>,
        keep: &dyn Fn(Loc) -> bool,
        surveyed: &mut dyn FnMut(u64),
    ) -> Option<ColdPlan<'a>> {
        // The layers' hashes of the names the records carry.
        let in_layers = match index.cold_hits() {
            _ if index.cold().is_empty() => None,
            Some(hits) => Some(hits),
            None => return None,
        };
        let mut s = Survey::default();
        for (id, sealed, entries) in segments {
            for e in entries {
                let kept = e.kind == KIND_REWARD && keep(Loc { segment: id, offset: e.frame_offset });
                if !s.entry(sealed, &e, kept) {
                    return None;
                }
            }
            surveyed(id);
        }
        if s.candidates.is_empty() {
            return None;
        }
        let mut shard_traces: HashSet<u64> = HashSet::new();
        for (trace, sessions) in rows {
            shard_traces.insert(trace);
            s.spoiled.extend(sessions);
        }
        // A trace id with two records (a replacement), a shard row or a
        // trace reward: its calls' sessions are not cold.
        s.calls.sort_unstable();
        let frozen = index.frozen();
        let mut hits = FrozenHits::default();
        // The calls in trace hash order: one walk forward through the
        // frozen layer's mapped trace table, its pages given back behind it.
        let mut at = 0;
        let mut spoil = |(trace, session): (u64, u64), s: &mut Survey| {
            // Asked of every call, for the hits.
            let in_frozen = frozen.has_trace_hash_from(&mut at, trace);
            if in_frozen {
                hits.traces.insert(trace);
            }
            let in_layer = in_layers.is_some_and(|h| h.traces.contains(&trace));
            if in_frozen || in_layer || s.rewarded.contains(&trace) || shard_traces.contains(&trace) {
                s.spoiled.insert(session);
            }
        };
        let calls = std::mem::take(&mut s.calls);
        for (i, c) in calls.iter().enumerate() {
            if trace_repeats(&calls, i) {
                s.spoiled.insert(c.1);
            }
            spoil(*c, &mut s);
        }
        drop(calls);
        // Every session a call names (candidates and spoiled ones, uids
        // included), in hash order: one walk forward through the frozen
        // sessions.
        let mut named: Vec<u64> = s.candidates.iter().chain(&s.spoiled).copied().collect();
        named.sort_unstable();
        named.dedup();
        let mut at = 0;
        hits.sessions = named.into_iter().filter(|h| frozen.has_session_hash_from(&mut at, *h)).collect();
        let in_layer = |h: &u64| in_layers.is_some_and(|l| l.sessions.contains(h));
        let cold: HashSet<u64> = s
            .candidates
            .into_iter()
            .filter(|h| !s.spoiled.contains(h) && !hits.sessions.contains(h) && !in_layer(h))
            .collect();
        if cold.is_empty() {
            return None;
        }
        Some(ColdPlan { cold, calls: Vec::new(), marks: HashMap::new(), hits })
    }

    fn is_cold(&self, name: &str) -> bool {
        self.cold.contains(&id_hash(name))
    }

    /// Take the record of entry `e` at `loc` if it is a cold session's call,
    /// seal or session reward (the replay then applies nothing of it).
    /// `keep`: the open keeps this reward's record (never taken).
    pub(super) fn take(&mut self, e: &FooterEntryRef<'a>, loc: Loc, keep: bool) -> bool {
        match (e.kind, e.reward_target) {
            (KIND_CALL, _) if e.session_uids.is_empty() && self.is_cold(e.session_id) => {
                self.calls.push(ColdCall { loc, timestamp: e.timestamp, trace_id: e.id, session: e.session_id });
                true
            }
            (KIND_SEAL, _) if self.is_cold(e.id) => {
                self.marks.entry(e.id).or_default().0 = true;
                true
            }
            (KIND_REWARD, 2) if !keep && self.is_cold(e.id) => {
                self.marks.entry(e.id).or_default().1 = Some(e.timestamp);
                true
            }
            _ => false,
        }
    }

    /// Add the layer of the calls taken, with their seals and rewards, to
    /// `index`'s cold layers (after the replay). Should the layer not hold
    /// them (past its 32-bit row numbers, or the layers' session numbers),
    /// they are applied to the maps instead, in
    /// the order the replay met them: no other record names a cold session
    /// or its trace ids, so that gives the maps a replay would have built.
    /// Returns the sessions the layer holds (by name hash), `None` when
    /// none went there.
    pub(super) fn finish(self, index: &mut Index) -> Option<HashSet<u64>> {
        if self.calls.is_empty() {
            return None;
        }
        // In hash order: one walk forward through the layer's sessions.
        let mut marks: Vec<_> = self.marks.into_iter().map(|(name, m)| (id_hash(name), name, m)).collect();
        marks.sort_unstable_by_key(|m| m.0);
        let all = vec![true; self.calls.len()];
        let built = Frozen::build_with(&self.calls, &all, false);
        drop(all);
        if let Some((mut frozen, _)) = built {
            let mut at = 0;
            for (_, name, (sealed, reward)) in &marks {
                // A cold session has a call (the survey saw one): it is in
                // the layer.
                let Some(i) = frozen.session_from(&mut at, name) else { continue };
                if *sealed {
                    frozen.seal(i);
                }
                if let Some(r) = reward {
                    frozen.set_reward(i, *r);
                }
            }
            if index.push_cold(frozen) {
                return Some(self.cold);
            }
        }
        for c in &self.calls {
            let sessions = index.sessions_of::<&str>(c.session, &[]);
            index.apply_call(Arc::from(c.trace_id), CallMeta { loc: c.loc, timestamp: c.timestamp, sessions });
        }
        for (_, name, (sealed, reward)) in marks {
            if sealed {
                index.seal(name);
            }
            if let Some(r) = reward {
                index.set_session_reward(name, r);
            }
        }
        None
    }
}
