//! The record model: one captured LLM call ([`Call`]) and the annotations that
//! attach to calls or sessions later ([`Annotation`]).
//!
//! [`Call::validate`] is the boundary check: every limit from [`crate::limits`]
//! and every malformed value is refused here with an error that names the field,
//! before a single byte is written.

use crate::error::{Error, Result};
use crate::limits::*;

/// One captured LLM call. JSON documents are kept verbatim as bytes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Call {
    /// Unique id; appending a call with an existing id replaces the old one.
    pub trace_id: String,
    /// The rollout (session) this call belongs to.
    pub session_id: String,
    /// Extra (nested) sessions this call also belongs to.
    pub session_uids: Vec<String>,
    /// Seconds since the Unix epoch (finite, not negative).
    pub timestamp: f64,
    pub model: Option<String>,
    pub weight_version: Option<i64>,
    pub prompt_token_ids: Vec<u32>,
    pub completion_token_ids: Vec<u32>,
    /// Per completion token; same length as `completion_token_ids` when present.
    pub logprobs: Option<Vec<f32>>,
    /// Opaque per-call blob (MoE routing matrices), stored as given.
    pub routing_matrices: Option<Vec<u8>>,
    pub finish_reason: Option<String>,
    pub latency_ms: Option<f64>,
    /// JSON text, kept verbatim.
    pub messages: Option<Vec<u8>>,
    /// JSON text, kept verbatim.
    pub response_message: Option<Vec<u8>>,
    /// JSON text, kept verbatim.
    pub metadata: Option<Vec<u8>>,
    /// A JSON object holding every other field of the caller's trace
    /// (`token_counts`, `raw_request`, unknown keys), kept verbatim.
    pub extra: Option<Vec<u8>>,
}

/// What an annotation refers to.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Trace(String),
    Session(String),
}

/// A later record that attaches to a trace or a session.
#[derive(Debug, Clone, PartialEq)]
pub enum Annotation {
    /// A scalar reward on a trace or a whole session (last one wins).
    Reward { target: Target, value: f64 },
    /// All calls of the session are in: later appends to it are refused.
    Seal { session_id: String },
    /// Removes every call that belongs to the session (by `session_id` or
    /// `session_uids`) appended before this record.
    DeleteSession { session_id: String },
    /// The session's live calls still in segments follow as copies (the
    /// copy-forward collector, format-spec/shard.md §6.3): no record of the
    /// session after this one has a prefix-delta parent before it. Written
    /// by the store only; it changes no call.
    MoveSession { session_id: String },
}

pub(crate) fn check_id(field: &str, id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if id.len() as u64 > ID_BYTES_MAX {
        return Err(Error::limit("ID_BYTES_MAX", field, id.len() as u64, ID_BYTES_MAX));
    }
    Ok(())
}

fn check_short(field: &str, s: &Option<String>) -> Result<()> {
    if let Some(s) = s {
        if s.len() as u64 > SHORT_STRING_BYTES_MAX {
            return Err(Error::limit("SHORT_STRING_BYTES_MAX", field, s.len() as u64, SHORT_STRING_BYTES_MAX));
        }
    }
    Ok(())
}

/// The size of a JSON document; with `parse`, also checks it is valid JSON.
fn check_json(field: &str, doc: &Option<Vec<u8>>, parse: bool) -> Result<u64> {
    let Some(doc) = doc else { return Ok(0) };
    if parse {
        serde_json::from_slice::<serde::de::IgnoredAny>(doc)
            .map_err(|e| Error::invalid(field, format!("not valid JSON ({e})")))?;
    }
    Ok(doc.len() as u64)
}

/// A [`Call`] that passed the boundary check, which [`crate::Store::append_valid`]
/// takes without checking it again. Only trajlog builds one: [`ValidCall::new`]
/// runs [`Call::validate`]; the trace parsers ([`crate::trace_json`]) build
/// one from JSON they parsed themselves, whose documents are valid JSON by
/// construction, and check everything else (every limit) as `validate` does.
/// It gives the call out only by reference or by value, so it cannot be
/// changed after the check.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidCall(Call, Option<Box<crate::format::docs::ExtraCuts>>);

impl ValidCall {
    /// Check `call` ([`Call::validate`]).
    pub fn new(call: Call) -> Result<ValidCall> {
        call.validate()?;
        Ok(ValidCall(call, None))
    }

    /// Check `call` whose JSON documents (`messages`, `response_message`,
    /// `metadata`, `extra`) the caller built from values serde_json parsed:
    /// every check of [`Call::validate`] but re-parsing those documents.
    pub(crate) fn from_parsed_json(call: Call) -> Result<ValidCall> {
        call.check(false)?;
        Ok(ValidCall(call, None))
    }

    /// Check `call` whose JSON documents (`messages`, `response_message`,
    /// `metadata`, `extra`) the caller's own JSON writer
    /// made from in-memory values (the Python binding's trace dict walker):
    /// every check of [`Call::validate`] but parsing those documents again.
    /// A writer that could emit text that is not JSON must use
    /// [`ValidCall::new`]: a document that does not parse would fail its reads.
    pub fn from_serialized_json(call: Call) -> Result<ValidCall> {
        call.check(false)?;
        Ok(ValidCall(call, None))
    }

    pub fn call(&self) -> &Call {
        &self.0
    }

    pub fn into_inner(self) -> Call {
        self.0
    }

    /// The call, and the cuts of its `extra` found while writing it.
    pub(crate) fn into_parts(self) -> (Call, Option<Box<crate::format::docs::ExtraCuts>>) {
        (self.0, self.1)
    }

    /// The call with the cuts of its `extra` that the writer of that text
    /// found while writing it (none: the encoder searches) ([`crate::format::docs::ExtraCuts`]), which
    /// the encoder then takes instead of searching the text. The caller
    /// vouches that each cut holds exactly the text its reference renders
    /// from this call's columns (record.md §7.2): a wrong cut would store a
    /// document that reads back otherwise. For trajlog's own writers (the
    /// Python binding's trace walk); debug builds check every use.
    #[doc(hidden)]
    pub fn with_found_cuts(self, cuts: Option<crate::format::docs::ExtraCuts>) -> ValidCall {
        ValidCall(self.0, cuts.map(Box::new))
    }
}

impl Call {
    /// Check every field against the limits and the format's rules.
    pub fn validate(&self) -> Result<()> {
        self.check(true)
    }

    /// [`Call::validate`]; `parse_json`: also check the JSON documents parse
    /// (false only where they were built from parsed JSON, [`ValidCall`]).
    fn check(&self, parse_json: bool) -> Result<()> {
        check_id("trace_id", &self.trace_id)?;
        check_id("session_id", &self.session_id)?;
        if self.session_uids.len() as u64 > SESSION_UIDS_MAX {
            return Err(Error::limit(
                "SESSION_UIDS_MAX",
                "session_uids count",
                self.session_uids.len() as u64,
                SESSION_UIDS_MAX,
            ));
        }
        for (i, uid) in self.session_uids.iter().enumerate() {
            check_id(&format!("session_uids[{i}]"), uid)?;
        }
        if !self.timestamp.is_finite() || self.timestamp < 0.0 {
            return Err(Error::invalid(
                "timestamp",
                format!("{:?} is not a finite, non-negative number of seconds since the Unix epoch", self.timestamp),
            ));
        }
        if let Some(l) = self.latency_ms {
            if !l.is_finite() || l < 0.0 {
                return Err(Error::invalid("latency_ms", format!("{l} is not a finite, non-negative number")));
            }
        }
        check_short("model", &self.model)?;
        check_short("finish_reason", &self.finish_reason)?;
        let prompt = self.prompt_token_ids.len() as u64;
        if prompt > PROMPT_TOKENS_MAX {
            return Err(Error::limit("PROMPT_TOKENS_MAX", "prompt_token_ids length", prompt, PROMPT_TOKENS_MAX));
        }
        let completion = self.completion_token_ids.len() as u64;
        if completion > COMPLETION_TOKENS_MAX {
            return Err(Error::limit(
                "COMPLETION_TOKENS_MAX",
                "completion_token_ids length",
                completion,
                COMPLETION_TOKENS_MAX,
            ));
        }
        if let Some(lp) = &self.logprobs {
            if lp.len() != self.completion_token_ids.len() {
                return Err(Error::invalid(
                    "logprobs",
                    format!(
                        "has {} values but completion_token_ids has {}; they must be the same length",
                        lp.len(),
                        completion
                    ),
                ));
            }
        }
        if let Some(r) = &self.routing_matrices {
            if r.len() as u64 > ROUTING_BYTES_MAX {
                return Err(Error::limit(
                    "ROUTING_BYTES_MAX",
                    "routing_matrices bytes",
                    r.len() as u64,
                    ROUTING_BYTES_MAX,
                ));
            }
        }
        let mut json = 0;
        json += check_json("messages", &self.messages, parse_json)?;
        json += check_json("response_message", &self.response_message, parse_json)?;
        json += check_json("metadata", &self.metadata, parse_json)?;
        json += check_json("extra", &self.extra, parse_json)?;
        if let Some(extra) = &self.extra {
            if extra.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
                return Err(Error::invalid("extra", "must be a JSON object"));
            }
        }
        if json > JSON_BYTES_PER_CALL_MAX {
            return Err(Error::limit(
                "JSON_BYTES_PER_CALL_MAX",
                "JSON bytes of the call",
                json,
                JSON_BYTES_PER_CALL_MAX,
            ));
        }
        Ok(())
    }
}

impl Annotation {
    /// Check ids and values at the boundary.
    pub fn validate(&self) -> Result<()> {
        match self {
            Annotation::Reward { target, value } => {
                match target {
                    Target::Trace(id) => check_id("reward target trace_id", id)?,
                    Target::Session(id) => check_id("reward target session_id", id)?,
                }
                if value.is_nan() {
                    return Err(Error::invalid("reward", "NaN is not a reward; give a number"));
                }
                Ok(())
            }
            Annotation::Seal { session_id } | Annotation::DeleteSession { session_id } => {
                check_id("session_id", session_id)
            }
            Annotation::MoveSession { .. } => Err(Error::invalid(
                "annotation",
                "a session-moved record is written by the store's copy-forward collector only",
            )),
        }
    }
}
