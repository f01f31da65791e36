//! The TI/TO audit: for every session, did each prompt extend an earlier call's
//! context exactly, and where and how badly did it not?
//!
//! The audit recomputes relations from the full prompts (independently of how
//! they are stored, so segments and shards are audited alike): each call is
//! compared with the contexts (`prompt ++ completion`) of the session's recent
//! calls, and the one sharing the longest prefix is its parent — the rule the
//! writer uses (format-spec/record.md §4).
//!
//! The same parent's chat documents are the reference for the call's
//! `messages`: an agent's history should start with the parent's `messages`
//! and `response_message`. A history that does not start with the parent's
//! `messages` was re-rendered or edited (a divergence of the conversation,
//! reported like a TI/TO break); one that keeps the history but not the
//! parent's `response_message` byte for byte re-serialized the answer
//! (counted only: clients commonly do).

use crate::delta::{classify, common_prefix_len};
use crate::error::Result;
use crate::format::docs::{continuation, Continuation, Parent};
use crate::format::record::{Loc, Relation};
use crate::limits::DELTA_LOOKBACK_CALLS;
use crate::snapshot::{Contexts, Snapshot};
use serde::Serialize;
use std::collections::VecDeque;

/// A recent call: trace id, where it is, prompt length, context (`prompt ++
/// completion`); its chat documents are in the session's `Contexts`.
struct Recent {
    trace_id: String,
    loc: Loc,
    prompt_len: usize,
    context: Vec<u32>,
}

/// Bytes of JSON text shown on each side of a history divergence.
const AROUND_BYTES: usize = 40;

/// One call whose `messages` does not start with its parent's (the parent by
/// the token rule): the history was re-rendered or edited.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryDivergence {
    pub trace_id: String,
    pub call_index: usize,
    pub parent_trace_id: String,
    /// First byte of `messages` that differs from the parent's `messages`.
    pub byte: usize,
    /// `messages` text around that byte (lossy UTF-8).
    pub text_around: String,
    /// The parent's `messages` text around the same byte.
    pub parent_around: String,
}

/// Ids shown on each side of a divergence.
const AROUND: usize = 3;

/// One call whose prompt did not extend its parent's context.
#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    pub trace_id: String,
    pub call_index: usize,
    /// `tito_break` (inside the parent's completion: retokenization) or
    /// `diverges_earlier` (re-rendered history or a new branch).
    pub relation: &'static str,
    pub parent_trace_id: String,
    /// First prompt position that differs from the parent's context.
    pub position: usize,
    /// Prompt ids from `position - 3` to `position + 3`.
    pub prompt_ids_around: Vec<u32>,
    /// The parent's context ids over the same positions.
    pub parent_ids_around: Vec<u32>,
    /// Generated tokens (the tail of the parent's completion from `position`)
    /// that the prompt replaced: what a re-tokenizing trainer would have got
    /// wrong for this call.
    pub tokens_wrong: u64,
}

/// One session's audit.
#[derive(Debug, Clone, Serialize)]
pub struct SessionAudit {
    pub session_id: String,
    pub calls: usize,
    /// Per call: did the prompt start with the previous call's whole context?
    pub extends_previous: Vec<bool>,
    pub breaks: usize,
    pub diverges_earlier: usize,
    pub tokens_wrong: u64,
    pub divergences: Vec<Divergence>,
    /// Calls whose `messages` does not start with the parent's.
    pub histories_rewritten: usize,
    /// Calls whose history starts with the parent's `messages` but does not
    /// continue with its `response_message` byte for byte.
    pub responses_reserialized: usize,
    pub history_divergences: Vec<HistoryDivergence>,
}

/// The whole audit.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditReport {
    pub sessions_checked: usize,
    pub calls_checked: usize,
    pub sessions_with_breaks: usize,
    pub breaks: usize,
    pub diverges_earlier: usize,
    /// Sum over breaks of the generated tokens a re-tokenizing trainer would
    /// have trained on wrongly.
    pub tokens_wrong: u64,
    /// Calls whose chat history does not start with their parent's.
    pub histories_rewritten: usize,
    /// Calls whose history keeps the parent's but not its response byte for byte.
    pub responses_reserialized: usize,
    /// The first sessions audited, at most
    /// [`crate::limits::AUDIT_SESSIONS_LISTED_MAX`]; the counts above cover
    /// every session.
    pub sessions: Vec<SessionAudit>,
    /// Sessions audited but not listed in `sessions` (past its bound).
    pub sessions_not_listed: usize,
    /// Divergences counted above whose details were not kept in `sessions`
    /// (past [`crate::limits::AUDIT_DETAILS_MAX`] in all, or of a session
    /// not listed).
    pub details_not_kept: usize,
    /// Sessions that could not be audited because a call of theirs is damaged
    /// (session id, the error naming file and offset); the others were.
    pub sessions_damaged: Vec<(String, String)>,
}

fn around(ids: &[u32], pos: usize) -> Vec<u32> {
    let end = pos.saturating_add(AROUND).min(ids.len());
    ids.get(pos.saturating_sub(AROUND).min(end)..end).unwrap_or_default().to_vec()
}

/// Audit every session of `snapshot` (by primary session id).
pub fn audit(snapshot: &Snapshot) -> Result<AuditReport> {
    audit_with_progress(snapshot, &mut |_, _| {})
}

/// [`audit`], calling `progress(done, total)` after each session (for a
/// progress bar: an audit reads every call of the store).
pub fn audit_with_progress(snapshot: &Snapshot, progress: &mut dyn FnMut(u64, u64)) -> Result<AuditReport> {
    let mut report = AuditReport::default();
    // A copy whose decoded shard row groups are dropped as they pile up: the
    // audit reads every session, its memory must not grow with the store.
    let mut snap = snapshot.clone();
    snap.decode_whole_row_groups();
    let sessions = snapshot.sessions();
    let total = sessions.len() as u64;
    // Details kept so far, against AUDIT_DETAILS_MAX.
    let mut details = 0usize;
    for (done, info) in sessions.into_iter().enumerate() {
        snap.bound_decoded(crate::limits::SCAN_DECODED_BYTES_MAX);
        if done % 4096 == 4095 {
            // The mapped pages the reads touched (segments, the shard
            // index file's tables) need not stay resident either.
            snap.release_pages();
        }
        match audit_session(&snap, &info.session_id) {
            Ok(None) => {}
            Ok(Some(mut s)) => {
                report.sessions_checked += 1;
                report.calls_checked += s.calls;
                report.breaks += s.breaks;
                report.diverges_earlier += s.diverges_earlier;
                report.tokens_wrong += s.tokens_wrong;
                report.histories_rewritten += s.histories_rewritten;
                report.responses_reserialized += s.responses_reserialized;
                if s.breaks > 0 {
                    report.sessions_with_breaks += 1;
                }
                let found = s.divergences.len() + s.history_divergences.len();
                if report.sessions.len() < crate::limits::AUDIT_SESSIONS_LISTED_MAX {
                    let room = crate::limits::AUDIT_DETAILS_MAX.saturating_sub(details);
                    s.divergences.truncate(room);
                    s.history_divergences.truncate(room - s.divergences.len());
                    let kept = s.divergences.len() + s.history_divergences.len();
                    details += kept;
                    report.details_not_kept += found - kept;
                    report.sessions.push(s);
                } else {
                    report.sessions_not_listed += 1;
                    report.details_not_kept += found;
                }
            }
            // Damage stays confined to the session it touches.
            Err(e) => report.sessions_damaged.push((info.session_id.clone(), e.to_string())),
        }
        progress(done as u64 + 1, total);
    }
    Ok(report)
}

/// Audit one session (None if it has no call of its own).
fn audit_session(snapshot: &Snapshot, session_id: &str) -> Result<Option<SessionAudit>> {
    let calls = snapshot.session(session_id, None, None)?;
    let own: Vec<_> = calls.iter().filter(|c| c.session_id() == session_id).collect();
    if own.is_empty() {
        return Ok(None);
    }
    let mut s = SessionAudit {
        session_id: session_id.to_owned(),
        calls: own.len(),
        extends_previous: Vec::with_capacity(own.len()),
        breaks: 0,
        diverges_earlier: 0,
        tokens_wrong: 0,
        divergences: Vec::new(),
        histories_rewritten: 0,
        responses_reserialized: 0,
        history_divergences: Vec::new(),
    };
    let mut chat = Contexts::default();
    // Recent calls, newest last.
    let mut recent: VecDeque<Recent> = VecDeque::new();
    for (i, c) in own.iter().enumerate() {
        let prompt = c.prompt()?;
        let docs = c.docs_in(Some(&prompt), &chat)?;
        s.extends_previous.push(recent.back().is_none_or(|r| prompt.starts_with(&r.context)));
        let mut best: Option<(&Recent, usize)> = None;
        for r in recent.iter().rev() {
            let shared = common_prefix_len(&prompt, &r.context);
            if best.is_none_or(|(_, b)| shared > b) {
                best = Some((r, shared));
            }
        }
        if let Some((parent, shared)) = best {
            let before = chat.chat(parent.loc).and_then(|d| {
                Some(Parent { messages: d.messages.as_deref()?, response_message: d.response_message.as_deref() })
            });
            match docs.messages.as_deref().zip(before).map(|(text, before)| continuation(text, before)) {
                None | Some(Continuation::NotAList) => {}
                Some(Continuation::History { response_at: Some(_), .. }) => {}
                Some(Continuation::History { response_at: None, .. }) => s.responses_reserialized += 1,
                Some(Continuation::LeavesAt(byte)) => {
                    s.histories_rewritten += 1;
                    let text = docs.messages.as_deref().unwrap_or_default();
                    let before = before.map_or(&b""[..], |p| p.messages);
                    s.history_divergences.push(HistoryDivergence {
                        trace_id: c.trace_id().to_owned(),
                        call_index: i,
                        parent_trace_id: parent.trace_id.clone(),
                        byte,
                        text_around: around_text(text, byte),
                        parent_around: around_text(before, byte),
                    });
                }
            }
            let ctx = &parent.context;
            let relation = classify(shared, parent.prompt_len, ctx.len());
            if relation != Relation::Extends {
                let tokens_wrong = if relation == Relation::TitoBreak { (ctx.len() - shared) as u64 } else { 0 };
                if relation == Relation::TitoBreak {
                    s.breaks += 1;
                    s.tokens_wrong += tokens_wrong;
                } else {
                    s.diverges_earlier += 1;
                }
                s.divergences.push(Divergence {
                    trace_id: c.trace_id().to_owned(),
                    call_index: i,
                    relation: relation.name(),
                    parent_trace_id: parent.trace_id.clone(),
                    position: shared,
                    prompt_ids_around: around(&prompt, shared),
                    parent_ids_around: around(ctx, shared),
                    tokens_wrong,
                });
            }
        }
        let mut ctx = prompt;
        let prompt_len = ctx.len();
        ctx.extend_from_slice(c.completion_token_ids());
        chat.remember_chat(c.loc, &docs.messages, &docs.response_message);
        recent.push_back(Recent { trace_id: c.trace_id().to_owned(), loc: c.loc, prompt_len, context: ctx });
        if recent.len() > DELTA_LOOKBACK_CALLS {
            recent.pop_front();
        }
    }
    Ok(Some(s))
}

fn around_text(text: &[u8], byte: usize) -> String {
    let end = byte.saturating_add(AROUND_BYTES).min(text.len());
    String::from_utf8_lossy(text.get(byte.saturating_sub(AROUND_BYTES).min(end)..end).unwrap_or_default()).into_owned()
}
