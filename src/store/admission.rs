//! The append boundary: sequence numbers, sealed sessions, and the trace id
//! rule checked against the published index and the appends and deletions
//! still in flight (format-spec/record.md §6). Back-pressure is taken before
//! this boundary (queue.rs), never under its lock.

use super::*;

/// An append not yet durable: its sequence number and its sessions.
pub(super) type InFlightCall = (u64, Arc<[Arc<str>]>);

/// What the append lock guards. It is never held while waiting: room in the
/// queue is taken before it, and the channel sent on under it is unbounded.
pub(super) struct SendState {
    pub(super) next_seq: u64,
    /// Sealed sessions: appends to them are refused at the boundary.
    /// Which sessions are sealed, in sequence order (see [`Sealed`]).
    pub(super) sealed: Sealed,
    /// Appends not yet durable (so not yet in the published view), by trace id:
    /// their sequence number and sessions. Checked with the view for the trace
    /// id rule; pruned once durable.
    pub(super) calls_in_flight: std::collections::HashMap<String, InFlightCall>,
    /// Session deletions not yet durable: (sequence number, session).
    pub(super) deletes_in_flight: Vec<(u64, String)>,
    /// Prune `calls_in_flight` when it grows past this (amortized O(1)).
    pub(super) prune_at: usize,
    /// Each session's most recent append's documents, for the next append's
    /// messages delta.
    pub(super) chat: ChatCache,
}

/// The chat documents of a session's most recent append: what the next
/// append's `messages` may be stored as a delta against (format-spec/record.md
/// §7.2), if the writer makes that append its parent.
#[derive(Debug)]
pub(super) struct ChatPrev {
    /// The append's sequence number.
    pub(super) seq: u64,
    pub(super) messages: Vec<u8>,
    pub(super) response_message: Option<Vec<u8>>,
    /// Ancestors its `messages` reaches through deltas (0: stored in full).
    pub(super) depth: u32,
}

impl ChatPrev {
    fn bytes(&self) -> u64 {
        (self.messages.len() + self.response_message.as_ref().map_or(0, Vec::len) + 64) as u64
    }
}

/// [`ChatPrev`] per session under a byte budget; the sessions appended to
/// least recently are forgotten first (their next append stores its messages
/// in full).
#[derive(Debug)]
pub(super) struct ChatCache {
    budget: u64,
    bytes: u64,
    tick: u64,
    map: std::collections::HashMap<String, (u64, Arc<ChatPrev>)>,
    lru: std::collections::BTreeMap<u64, String>,
}

impl ChatCache {
    pub(super) fn new(budget: u64) -> Self {
        Self { budget, bytes: 0, tick: 0, map: Default::default(), lru: Default::default() }
    }

    pub(super) fn get(&self, session: &str) -> Option<Arc<ChatPrev>> {
        self.map.get(session).map(|(_, p)| p.clone())
    }

    pub(super) fn remove(&mut self, session: &str) {
        if let Some((tick, old)) = self.map.remove(session) {
            self.lru.remove(&tick);
            self.bytes -= old.bytes();
        }
    }

    /// Make `prev` the session's most recent append (`None`: one without
    /// messages).
    pub(super) fn put(&mut self, session: &str, prev: Option<ChatPrev>) {
        self.remove(session);
        let Some(prev) = prev else { return };
        let bytes = prev.bytes();
        if bytes > self.budget {
            return;
        }
        self.tick += 1;
        self.bytes += bytes;
        self.map.insert(session.to_owned(), (self.tick, Arc::new(prev)));
        self.lru.insert(self.tick, session.to_owned());
        while self.bytes > self.budget {
            let Some(oldest) = self.lru.values().next().cloned() else { break };
            self.remove(&oldest);
        }
    }
}

/// Which sessions are sealed, as appends in sequence order see them: the
/// seals of a published view (its index: the frozen layer's flags and the
/// maps' entries, shared with the index, not copied) and the seals and
/// deletions appended after it. Before, a set of every sealed session's
/// name was built at each writable open (~90 MB and a string per session
/// at 1.25M sealed sessions).
///
/// The view is the open's at first; once the seals and deletions appended
/// since pass `rebase_at`, it is a later published view, and those the view
/// reflects are forgotten ([`Sealed::rebase`]): a long-lived writer holds
/// neither every seal it appended nor its open's index for ever.
pub(super) struct Sealed {
    base: crate::index::Index,
    /// Session → (sealed, sequence number), for the seals and deletions
    /// appended after `base`: the last one of each session.
    since: std::collections::HashMap<String, (bool, u64)>,
    rebase_at: usize,
}

impl Default for Sealed {
    fn default() -> Self {
        Sealed::new(crate::index::Index::default())
    }
}

impl Sealed {
    pub(super) fn new(at_open: crate::index::Index) -> Self {
        Sealed { base: at_open, since: std::collections::HashMap::new(), rebase_at: 1024 }
    }

    pub(super) fn contains(&self, session: &str) -> bool {
        match self.since.get(session) {
            Some((sealed, _)) => *sealed,
            None => self.base.is_sealed(session),
        }
    }

    /// What failed of the lazily checked blocks its base's lookups read.
    pub(super) fn damage(&self) -> Option<crate::error::Error> {
        self.base.frozen().table_damage().or_else(|| self.base.frozen().cache_damage())
    }

    /// A seal appended, as record `seq`.
    pub(super) fn insert(&mut self, session: String, seq: u64) {
        self.since.insert(session, (true, seq));
    }

    /// A deletion appended, as record `seq`.
    pub(super) fn remove(&mut self, session: &str, seq: u64) {
        self.since.insert(session.to_owned(), (false, seq));
    }

    /// The seals and deletions held since the base.
    #[cfg(test)]
    pub(super) fn since_len(&self) -> usize {
        self.since.len()
    }

    /// Whether enough seals and deletions were appended since the base for
    /// a [`Sealed::rebase`] (amortized O(1) per seal).
    pub(super) fn wants_rebase(&self) -> bool {
        self.since.len() > self.rebase_at
    }

    /// Take `view` — the index of a published view that reflects every
    /// record up to `durable_seq` — as the base, and forget the seals and
    /// deletions it reflects: a session's last one at or before
    /// `durable_seq` is what `view` says of it.
    pub(super) fn rebase(&mut self, view: crate::index::Index, durable_seq: u64) {
        self.base = view;
        self.since.retain(|_, (_, seq)| *seq > durable_seq);
        self.rebase_at = (2 * self.since.len()).max(1024);
    }
}

impl SendState {
    pub(super) fn new(sealed: Sealed, chat_bytes: u64) -> Self {
        Self {
            next_seq: 0,
            sealed,
            calls_in_flight: std::collections::HashMap::new(),
            deletes_in_flight: Vec::new(),
            prune_at: 1024,
            chat: ChatCache::new(chat_bytes),
        }
    }

    /// Forget in-flight entries the published view now covers.
    pub(super) fn prune(&mut self, durable_seq: u64) {
        if self.calls_in_flight.len() > self.prune_at {
            self.calls_in_flight.retain(|_, (seq, _)| *seq > durable_seq);
            self.prune_at = (2 * self.calls_in_flight.len()).max(1024);
        }
        if self.deletes_in_flight.len() > 64 {
            self.deletes_in_flight.retain(|(seq, _)| *seq > durable_seq);
        }
    }

    /// Whether `session` is deleted by a deletion appended after `seq`.
    pub(super) fn deleted_after(&self, session: &str, seq: u64) -> bool {
        self.deletes_in_flight.iter().any(|(s, id)| *s > seq && id == session)
    }
}

/// The trace id rule (format-spec/record.md §6): trace ids are unique per store.
/// Re-appending a live trace id replaces that call only within the same session
/// (`session_id`), and never takes it out of a sealed session.
pub(super) fn check_trace_id(call: &Call, current: &[Arc<str>], sealed: &Sealed) -> Result<()> {
    let Some(primary) = current.first() else { return Ok(()) };
    if **primary != *call.session_id {
        return Err(Error::invalid(
            "trace_id",
            format!(
                "trace {:?} already belongs to session {:?}, so it cannot be appended to session {:?}: trace ids are unique per store (re-appending one replaces the call only within its own session); use a new trace id, or delete session {:?} first",
                call.trace_id, &**primary, call.session_id, &**primary
            ),
        ));
    }
    for s in current.iter().skip(1) {
        if sealed.contains(s) && !call.session_uids.iter().any(|u| u == &**s) {
            return Err(Error::invalid(
                "session_uids",
                format!(
                    "trace {:?} belongs to the sealed session {:?}; replacing it without that session uid would take it out of a sealed session",
                    call.trace_id, &**s
                ),
            ));
        }
    }
    Ok(())
}
