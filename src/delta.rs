//! Prefix-delta encoding (format-spec/record.md §4): choosing a call's parent
//! and classifying how its prompt relates to the parent's context.
//!
//! The writer remembers, per session, the contexts (`prompt ++ completion`) of
//! the last [`DELTA_LOOKBACK_CALLS`](crate::limits::DELTA_LOOKBACK_CALLS) calls.
//! A new call's parent is the remembered call whose context shares the longest
//! prefix with the new prompt (ties go to the most recent). Memory is bounded by
//! a byte budget; the least recently used sessions are forgotten first (a
//! forgotten session's next call is re-loaded from disk by the writer).

use crate::format::record::{Delta, Loc, Relation};
use crate::limits::DELTA_LOOKBACK_CALLS;
#[cfg(test)]
use crate::limits::PROMPT_CHAIN_MAX;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Length of the longest common prefix of `a` and `b`.
pub fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    // Compare in chunks first: the common case is a long shared prefix.
    let chunks = a.chunks_exact(16).zip(b.chunks_exact(16)).take_while(|(x, y)| x == y).count();
    let i = chunks * 16;
    let rest = a.get(i..).unwrap_or_default().iter().zip(b.get(i..).unwrap_or_default()).take_while(|(x, y)| x == y);
    i + rest.count()
}

/// Classify a prompt against a parent context of `context_len` tokens whose
/// prompt part is `parent_prompt_len` long, given `shared` common tokens.
pub fn classify(shared: usize, parent_prompt_len: usize, context_len: usize) -> Relation {
    if shared == context_len {
        Relation::Extends
    } else if shared >= parent_prompt_len {
        Relation::TitoBreak
    } else {
        Relation::DivergesEarlier
    }
}

/// One remembered call.
#[derive(Debug, Clone)]
pub struct Context {
    pub loc: Loc,
    pub prompt_len: usize,
    /// `prompt ++ completion`.
    pub tokens: Arc<Vec<u32>>,
    /// The append's sequence number; 0 for a call loaded from disk.
    pub seq: u64,
    /// Records a rebuild of its prompt reads, itself excluded: 0 when its
    /// prompt is stored whole (a root, a checkpoint), else its parent's + 1
    /// (for a call loaded from disk: counted by walking its chain, up to the
    /// chain bound).
    pub depth: u32,
}

impl Context {
    fn bytes(&self) -> u64 {
        self.tokens.len() as u64 * 4 + 64
    }
}

#[derive(Debug, Default)]
struct SessionContexts {
    tick: u64,
    recent: VecDeque<Context>,
}

impl SessionContexts {
    /// Drop the contexts at the positions `gone` accepts: the bytes freed,
    /// and whether that emptied the list.
    fn drop_where(&mut self, gone: impl Fn(Loc) -> bool) -> (u64, bool) {
        let before = self.recent.len();
        let mut freed = 0;
        self.recent.retain(|c| {
            let keep = !gone(c.loc);
            if !keep {
                freed += c.bytes();
            }
            keep
        });
        (freed, self.recent.is_empty() && before > 0)
    }
}

/// Per-session recent contexts under a byte budget.
#[derive(Debug)]
pub struct DeltaCache {
    budget_bytes: u64,
    /// See `Options::prompt_chain_max` (0: no checkpoints).
    chain_max: u32,
    bytes: u64,
    tick: u64,
    sessions: HashMap<Arc<str>, SessionContexts>,
    lru: BTreeMap<u64, Arc<str>>,
}

impl DeltaCache {
    #[cfg(test)]
    pub fn new(budget_bytes: u64) -> Self {
        Self::with_chain_max(budget_bytes, PROMPT_CHAIN_MAX)
    }

    /// A cache whose parents' chains get a checkpoint at `chain_max` records
    /// (0: never).
    pub fn with_chain_max(budget_bytes: u64, chain_max: u32) -> Self {
        Self { budget_bytes, chain_max, bytes: 0, tick: 0, sessions: HashMap::new(), lru: BTreeMap::new() }
    }

    pub fn knows(&self, session: &str) -> bool {
        self.sessions.contains_key(session)
    }

    fn touch(&mut self, session: &Arc<str>) {
        self.tick += 1;
        let tick = self.tick;
        let entry = self.sessions.entry(session.clone()).or_default();
        if entry.tick != 0 {
            self.lru.remove(&entry.tick);
        }
        entry.tick = tick;
        self.lru.insert(tick, session.clone());
    }

    /// Choose the parent of a new call of `session` with `prompt`.
    pub fn choose(&self, session: &str, prompt: &[u32]) -> Delta {
        let Some(entry) = self.sessions.get(session) else { return Delta::ROOT };
        let mut best: Option<(&Context, usize)> = None;
        for ctx in entry.recent.iter().rev() {
            let shared = common_prefix_len(prompt, &ctx.tokens);
            if best.is_none_or(|(_, b)| shared > b) {
                best = Some((ctx, shared));
            }
        }
        match best {
            None => Delta::ROOT,
            Some((ctx, shared)) => Delta {
                parent: Some(ctx.loc),
                prefix_len: shared as u32,
                relation: classify(shared, ctx.prompt_len, ctx.tokens.len()),
                // A checkpoint when the parent's chain is already as long as
                // a chain may be (record.md §4).
                checkpoint: self.chain_max > 0 && ctx.depth + 1 >= self.chain_max,
            },
        }
    }

    /// The remembered call of `session` at `loc`, if it is remembered.
    pub fn context(&self, session: &str, loc: Loc) -> Option<&Context> {
        self.sessions.get(session)?.recent.iter().find(|c| c.loc == loc)
    }

    /// Remember a call's context (newest last).
    pub fn remember(&mut self, session: &Arc<str>, ctx: Context) {
        self.touch(session);
        self.bytes += ctx.bytes();
        let mut freed = 0;
        if let Some(entry) = self.sessions.get_mut(session) {
            entry.recent.push_back(ctx);
            while entry.recent.len() > DELTA_LOOKBACK_CALLS {
                if let Some(old) = entry.recent.pop_front() {
                    freed += old.bytes();
                }
            }
        }
        self.bytes -= freed;
        self.evict(session);
    }

    /// Forget a session (sealed or deleted).
    pub fn forget(&mut self, session: &str) {
        if let Some(entry) = self.sessions.remove(session) {
            self.lru.remove(&entry.tick);
            self.bytes -= entry.recent.iter().map(Context::bytes).sum::<u64>();
        }
    }

    fn evict(&mut self, keep: &str) {
        while self.bytes > self.budget_bytes {
            let Some((_, victim)) = self.lru.iter().next().map(|(t, s)| (*t, s.clone())) else { break };
            if &*victim == keep {
                // Only the current session is left: trim its oldest contexts.
                let Some(entry) = self.sessions.get_mut(keep) else { break };
                if entry.recent.len() <= 1 {
                    break;
                }
                if let Some(old) = entry.recent.pop_front() {
                    self.bytes -= old.bytes();
                }
                continue;
            }
            self.forget(&victim);
        }
    }

    /// Forget every context stored in one of `segments` (they were retired:
    /// a new call must not name a parent there).
    pub fn forget_segments(&mut self, segments: &[u64]) {
        self.forget_where(|loc| segments.contains(&loc.segment));
    }

    /// Forget the contexts of the calls at `locs`, in every session: they
    /// died (their session deleted). A dead record keeps no ancestor on
    /// disk (retirement frees what only dead records need), so a new call
    /// must not take it as a parent.
    pub fn forget_locs(&mut self, locs: &std::collections::HashSet<Loc>) {
        if !locs.is_empty() {
            self.forget_where(|loc| locs.contains(&loc));
        }
    }

    /// Forget `session`'s context of the call at `loc` (a call replaced:
    /// dead, as for [`DeltaCache::forget_locs`]).
    pub fn forget_at(&mut self, session: &str, loc: Loc) {
        let Some(entry) = self.sessions.get_mut(session) else { return };
        let (freed, emptied) = entry.drop_where(|l| l == loc);
        self.bytes -= freed;
        if emptied {
            self.forget(session);
        }
    }

    fn forget_where(&mut self, gone: impl Fn(Loc) -> bool) {
        let mut emptied = Vec::new();
        for (session, entry) in self.sessions.iter_mut() {
            let (freed, now_empty) = entry.drop_where(&gone);
            self.bytes -= freed;
            if now_empty {
                emptied.push(session.clone());
            }
        }
        for s in emptied {
            self.forget(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(offset: u64, prompt: &[u32], completion: &[u32]) -> Context {
        let mut t = prompt.to_vec();
        t.extend_from_slice(completion);
        Context {
            loc: Loc { segment: 1, offset },
            prompt_len: prompt.len(),
            tokens: Arc::new(t),
            seq: offset + 1,
            depth: 0,
        }
    }

    #[test]
    fn classifies_extends_break_and_divergence() {
        let s: Arc<str> = Arc::from("s");
        let mut cache = DeltaCache::new(1 << 20);
        cache.remember(&s, ctx(64, &[1, 2, 3], &[4, 5]));
        let d = cache.choose("s", &[1, 2, 3, 4, 5, 6]);
        assert_eq!((d.prefix_len, d.relation), (5, Relation::Extends));
        let d = cache.choose("s", &[1, 2, 3, 4, 9, 6]);
        assert_eq!((d.prefix_len, d.relation), (4, Relation::TitoBreak));
        let d = cache.choose("s", &[1, 7]);
        assert_eq!((d.prefix_len, d.relation), (1, Relation::DivergesEarlier));
        assert_eq!(cache.choose("other", &[1]), Delta::ROOT);
    }

    #[test]
    fn picks_the_longest_shared_prefix_among_interleaved_conversations() {
        let s: Arc<str> = Arc::from("s");
        let mut cache = DeltaCache::new(1 << 20);
        cache.remember(&s, ctx(64, &[1, 1, 1], &[2]));
        cache.remember(&s, ctx(128, &[9, 9], &[8]));
        let d = cache.choose("s", &[1, 1, 1, 2, 3]);
        assert_eq!(d.parent, Some(Loc { segment: 1, offset: 64 }));
        assert_eq!(d.relation, Relation::Extends);
    }

    #[test]
    fn budget_evicts_least_recently_used_sessions() {
        let mut cache = DeltaCache::new(1000);
        for i in 0..20u64 {
            let s: Arc<str> = Arc::from(format!("s{i}").as_str());
            cache.remember(&s, ctx(64 * (i + 1), &[0; 50], &[1; 10]));
        }
        assert!(cache.bytes <= 1000);
        assert!(cache.knows("s19") && !cache.knows("s0"));
    }
}
