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
    pub(super) sealed: HashSet<String>,
    /// Appends not yet durable (so not yet in the published view), by trace id:
    /// their sequence number and sessions. Checked with the view for the trace
    /// id rule; pruned once durable.
    pub(super) calls_in_flight: std::collections::HashMap<String, InFlightCall>,
    /// Session deletions not yet durable: (sequence number, session).
    pub(super) deletes_in_flight: Vec<(u64, String)>,
    /// Prune `calls_in_flight` when it grows past this (amortized O(1)).
    pub(super) prune_at: usize,
}

impl SendState {
    pub(super) fn new(sealed: HashSet<String>) -> Self {
        Self {
            next_seq: 0,
            sealed,
            calls_in_flight: std::collections::HashMap::new(),
            deletes_in_flight: Vec::new(),
            prune_at: 1024,
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
pub(super) fn check_trace_id(call: &Call, current: &[Arc<str>], sealed: &HashSet<String>) -> Result<()> {
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
        if sealed.contains(&**s) && !call.session_uids.iter().any(|u| u == &**s) {
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
