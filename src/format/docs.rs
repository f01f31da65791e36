//! The docs block of a call record (format-spec/record.md §7): a call's four
//! JSON documents stored together, structure-aware and compressed.
//!
//! Real rLLM gateway traces repeat their token columns as JSON text inside
//! `extra` (`raw_response.prompt_token_ids`, `choices[0].token_ids`, one
//! `logprobs.content[i]` object per generated token) and repeat `messages` in
//! `raw_request.messages`. The docs block cuts such values out of the text and
//! records a **splice** in their place: "insert the prompt column as a JSON
//! list here", "insert logprob 17 as Python writes a float here". A value is
//! cut only when rendering the reference gives back **the very bytes** that
//! were there; anything else stays in the text verbatim. Decoding is
//! therefore byte-exact by construction, never a guess.
//!
//! What remains (the templates and their splice tables) is compressed with
//! zstd as one frame. Token columns are untouched: they stay in the record,
//! uncompressed and viewed in place.

use super::{Cursor, DecodeError, PutLe};
use crate::json_scan::{skip_ws, string_end, value_end};
use crate::limits::JSON_BYTES_PER_CALL_MAX;
use crate::record::Call;
use crate::trace_json::{decimal, write_py_float};

/// Payload stored as is.
pub const CODEC_NONE: u8 = 0;
/// Payload compressed as one zstd frame.
pub const CODEC_ZSTD: u8 = 1;
const ZSTD_LEVEL: i32 = 1;
/// Payloads shorter than this are not worth a zstd frame.
const COMPRESS_MIN: usize = 256;

/// Bytes of the docs block header.
pub const HEADER_BYTES: usize = 8;
const DOC_ENTRY_BYTES: usize = 12;
/// The most a decompressed payload may hold (record.md §7.1).
const RAW_LEN_MAX: usize = JSON_BYTES_PER_CALL_MAX as usize + 4 * DOC_ENTRY_BYTES;
const SPLICE_BYTES: usize = 12;

/// Document names, in the order they are stored.
const DOC_NAMES: [u8; 4] = [1, 2, 3, 4];
const DOC_FIELDS: [&str; 4] = ["messages", "response_message", "metadata", "extra"];
const DOC_EXTRA: usize = 3;

fn field_name(i: usize) -> &'static str {
    DOC_FIELDS.get(i).copied().unwrap_or("?")
}

/// Splice references (record.md §7.2).
const REF_PROMPT: u8 = 1;
const REF_COMPLETION: u8 = 2;
const REF_LOGPROB: u8 = 3;
const REF_TOKEN_BYTES: u8 = 4;
const REF_MESSAGES: u8 = 5;
const REF_PARENT_MESSAGES: u8 = 6;
const REF_PARENT_RESPONSE: u8 = 7;
/// vLLM's whole `logprobs.content` list, rendered from the logprob column
/// and the token literals left in the template (segment format 6).
const REF_CONTENT: u8 = 8;
/// The completions API's `token_logprobs`: the logprob column as a JSON
/// list of floats (segment format 6).
const REF_LOGPROB_LIST: u8 = 9;

/// List styles: the separator between elements.
const LIST_COMPACT: u8 = 0;
const LIST_SPACED: u8 = 1;
/// The float style of a logprob: Python's `repr` of the `f32` widened to
/// `f64` (what vLLM, rLLM and `json.dumps` write), fully specified in
/// record.md §7.2. Formatters whose output a crate or toolchain may change
/// (Rust's `{:?}`) are deliberately not styles.
const FLOAT_PYTHON: u8 = 0;

/// The four documents of a call, owned (decoded from a docs block).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Docs {
    pub messages: Option<Vec<u8>>,
    pub response_message: Option<Vec<u8>>,
    pub metadata: Option<Vec<u8>>,
    pub extra: Option<Vec<u8>>,
}

impl Docs {
    fn slot(&mut self, i: usize) -> &mut Option<Vec<u8>> {
        match i {
            0 => &mut self.messages,
            1 => &mut self.response_message,
            2 => &mut self.metadata,
            _ => &mut self.extra,
        }
    }
}

/// The token columns a docs block may refer to. `prompt` is the full prompt
/// (materialized from the prefix-delta chain); it is needed only when
/// [`Block::needs_prompt`] says so. `parent`: the prefix-delta parent's
/// documents, needed only when [`Block::needs_parent`] says so.
#[derive(Debug, Clone, Copy)]
pub struct Columns<'a> {
    pub prompt: Option<&'a [u32]>,
    pub completion: &'a [u32],
    pub logprobs: Option<&'a [f32]>,
    pub parent: Option<Parent<'a>>,
}

/// The documents of a call's prefix-delta parent that its `messages` may
/// refer to (references 6 and 7, record.md §7.2): its rebuilt `messages` and
/// `response_message`.
#[derive(Debug, Clone, Copy)]
pub struct Parent<'a> {
    pub messages: &'a [u8],
    pub response_message: Option<&'a [u8]>,
}

// ---------------------------------------------------------------- encoding

#[derive(Debug, Clone, PartialEq)]
struct Cut {
    start: usize,
    end: usize,
    reference: u8,
    style: u8,
    arg: u32,
    /// For a token-bytes reference: where the token's string literal starts
    /// in the original text (turned into a distance in the template).
    token_at: usize,
    /// Text the template keeps in place of the cut value, which the splice
    /// consumes (reference 8: the token literals, back to back).
    kept: Vec<u8>,
}

/// A docs block made by [`encode`].
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub block: Vec<u8>,
    /// Whether `messages` refers to the parent's documents (references 6 and
    /// 7): the record must then name that call as its parent.
    pub uses_parent: bool,
    /// The oldest segment format that may hold this block: 2, 3 with
    /// references 6 and 7, 6 with reference 8.
    pub min_format: u32,
}

/// What an encoder may use: the references of the segment format the
/// block goes into (record.md §7.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allow {
    /// References 6 and 7 (segment format 3 and later), given a parent.
    pub parent: bool,
    /// Reference 8 (segment format 6 and later).
    pub content: bool,
}

impl Allow {
    /// Everything the segment format `version` has.
    pub fn format(version: u32) -> Self {
        Allow { parent: version >= 3, content: version >= super::FORMAT_CONTENT_REF }
    }
}

/// The cuts of `extra` that [`encode`] would find by searching its text
/// (record.md §7.2: references 1, 2, 5, 8 and 9 in `raw_request` and
/// `raw_response`), as the writer of that text found them while writing it
/// from values it compared with the call's columns: the Python binding's
/// trace walk, which saves the encoder a second reading of ~100 kB of
/// text per gateway call. Offsets are byte offsets into `extra`, lists and
/// objects in the compact style (no space after `,` and `:`).
///
/// A writer that meets anything it does not compare exactly as the search
/// would (per-entry logprob references, a tuple, an `int` subclass) gives
/// no cuts at all ([`crate::ValidCall::with_found_cuts`] then takes
/// `None`), and the encoder searches as before. Each cut must hold exactly
/// the text the reference renders: the search's own rule. The encoder
/// checks what is cheap to check (`plausible`); debug builds compare every
/// use with a search.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExtraCuts {
    cuts: Vec<Cut>,
}

impl ExtraCuts {
    /// `extra[start..end]` is the prompt column (`prompt`) or the
    /// completion column as a compact JSON list.
    pub fn ids(&mut self, start: usize, end: usize, prompt: bool) {
        let reference = if prompt { REF_PROMPT } else { REF_COMPLETION };
        self.cuts.push(Cut::plain(start, end, reference, LIST_COMPACT, 0));
    }

    /// `extra[start..end]` is the call's `messages` document, byte for byte.
    pub fn messages(&mut self, start: usize, end: usize) {
        self.cuts.push(Cut::plain(start, end, REF_MESSAGES, 0, 0));
    }

    /// `extra[start..end]` is vLLM's compact `logprobs.content` list of the
    /// logprob column (reference 8), whose token literals are `literals`,
    /// back to back. False (nothing added) when the run is too long for a
    /// splice's argument.
    pub fn content(&mut self, start: usize, end: usize, literals: Vec<u8>) -> bool {
        let Ok(arg) = u32::try_from(literals.len()) else { return false };
        self.cuts.push(Cut { start, end, reference: REF_CONTENT, style: LIST_COMPACT, arg, token_at: 0, kept: literals });
        true
    }

    /// `extra[start..end]` is the logprob column as a compact JSON list of
    /// floats (reference 9).
    pub fn logprob_list(&mut self, start: usize, end: usize) {
        self.cuts.push(Cut::plain(start, end, REF_LOGPROB_LIST, LIST_COMPACT, 0));
    }

    /// Take `other`'s cuts, found in a piece of text that starts at byte
    /// `at` of `extra`.
    pub fn extend_at(&mut self, other: ExtraCuts, at: usize) {
        self.cuts.extend(other.cuts.into_iter().map(|c| Cut { start: c.start + at, end: c.end + at, ..c }));
    }

    fn into_sorted(self) -> Vec<Cut> {
        let mut cuts = self.cuts;
        cuts.sort_by_key(|c| c.start);
        cuts
    }

}

/// What is cheap to check of cuts found while writing (sorted): they are
/// apart and inside `extra`; a list starts with `[` and ends with `]`;
/// `messages` is there byte for byte; a content run's literals fit in its
/// list; a logprobs reference has its column.
fn plausible(call: &Call, cuts: &[Cut]) -> bool {
    let Some(text) = call.extra.as_deref() else { return false };
    let mut pos = 0;
    cuts.iter().all(|c| {
        let ok = c.start >= pos
            && c.end <= text.len()
            && match c.reference {
                REF_MESSAGES => call.messages.as_deref().is_some_and(|m| text.get(c.start..c.end) == Some(m)),
                REF_PROMPT | REF_COMPLETION => list_bounds(text, c),
                REF_CONTENT | REF_LOGPROB_LIST => {
                    call.logprobs.as_ref().is_some_and(|l| !l.is_empty())
                        && list_bounds(text, c)
                        && c.kept.len() < c.end - c.start
                }
                _ => false,
            };
        pos = c.end;
        ok
    })
}

fn list_bounds(text: &[u8], c: &Cut) -> bool {
    c.end >= c.start + 2 && text.get(c.start) == Some(&b'[') && text.get(c.end - 1) == Some(&b']')
}

/// Whether `found` are exactly the cuts a search of `call.extra` finds,
/// and pass the encoder's checks (the Python binding's tests compare the
/// two on every shape of trace they write).
#[doc(hidden)]
pub fn found_cuts_agree(call: &Call, found: &ExtraCuts) -> bool {
    let mut searched = Vec::new();
    if let Some(extra) = &call.extra {
        extra_cuts(extra, call, &mut searched, &mut String::new(), true);
    }
    let found = found.clone().into_sorted();
    found == searched && (found.is_empty() || plausible(call, &found))
}

/// The docs block for `call`'s documents (a validated call), or `None` when
/// storing the documents as they are is at least as small. With `parent`
/// (the documents of the call that will be this call's prefix-delta parent),
/// `messages` is stored as a delta when it starts with the parent's history:
/// the parent's `messages` without its closing `]`, then, after a separator,
/// the parent's `response_message`.
pub fn encode(call: &Call, parent: Option<Parent<'_>>) -> Option<Encoded> {
    encode_for(call, parent, Allow::format(super::FORMAT_VERSION))
}

/// [`encode`] with only the references `allow` names (a block for an older
/// segment format).
pub fn encode_for(call: &Call, parent: Option<Parent<'_>>, allow: Allow) -> Option<Encoded> {
    encode_with(call, parent, allow, None)
}

/// [`encode`], taking `extra`'s cuts from `found` (the writer of the text
/// found them as it wrote it, [`ExtraCuts`]) instead of searching the text
/// for them, when `found` is usable in a segment of the current format and
/// passes the cheap checks (`plausible`).
pub(crate) fn encode_found(call: &Call, parent: Option<Parent<'_>>, found: Option<ExtraCuts>) -> Option<Encoded> {
    encode_with(call, parent, Allow::format(super::FORMAT_VERSION), found.map(ExtraCuts::into_sorted))
}

fn encode_with(call: &Call, parent: Option<Parent<'_>>, allow: Allow, found: Option<Vec<Cut>>) -> Option<Encoded> {
    let parent = parent.filter(|_| allow.parent);
    let docs = [&call.messages, &call.response_message, &call.metadata, &call.extra];
    let plain: usize = docs.iter().map(|d| d.as_ref().map_or(0, Vec::len)).sum();
    if plain == 0 {
        return None;
    }
    let mut cuts: [Vec<Cut>; 4] = Default::default();
    if let (Some(messages), Some(parent)) = (&call.messages, parent) {
        messages_cuts(messages, parent, &mut cuts[0]);
    }
    let uses_parent = !cuts[0].is_empty();
    if let Some(extra) = &call.extra {
        match found.filter(|f| allow.content && plausible(call, f)) {
            Some(found) => {
                #[cfg(debug_assertions)]
                {
                    let mut searched = Vec::new();
                    extra_cuts(extra, call, &mut searched, &mut String::new(), allow.content);
                    debug_assert_eq!(found, searched, "the cuts found while writing differ from a search");
                }
                cuts[DOC_EXTRA] = found;
            }
            None => {
                let mut scratch = String::new();
                extra_cuts(extra, call, &mut cuts[DOC_EXTRA], &mut scratch, allow.content);
            }
        }
    }
    let uses_content = cuts[DOC_EXTRA].iter().any(|c| matches!(c.reference, REF_CONTENT | REF_LOGPROB_LIST));
    let min_format = if uses_content {
        super::FORMAT_CONTENT_REF
    } else if uses_parent {
        3
    } else {
        2
    };
    let n_docs = docs.iter().filter(|d| d.is_some()).count();
    let mut payload = Vec::with_capacity(plain + 64);
    let mut templates: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(n_docs);
    for ((doc, cuts), name) in docs.iter().zip(&cuts).zip(DOC_NAMES) {
        let Some(doc) = doc else { continue };
        let (text, splices) = template(doc, cuts);
        payload.put_u8(name);
        payload.put_u8(0);
        payload.put_u16(0);
        payload.put_u32(text.len() as u32);
        payload.put_u32((splices.len() / SPLICE_BYTES) as u32);
        templates.push((text, splices));
    }
    for (text, splices) in &templates {
        payload.extend_from_slice(text);
        payload.extend_from_slice(splices);
    }
    let raw_len = payload.len();
    if raw_len > RAW_LEN_MAX {
        // Splice tables can outgrow what they cut (12 bytes for a `[97]`):
        // a block a reader would refuse is never written.
        return None;
    }
    let (codec, body) = if raw_len >= COMPRESS_MIN {
        match compress(&payload) {
            Ok(z) if z.len() < raw_len => (CODEC_ZSTD, z),
            _ => (CODEC_NONE, payload),
        }
    } else {
        (CODEC_NONE, payload)
    };
    if HEADER_BYTES + body.len() >= plain {
        return None;
    }
    let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
    out.put_u8(codec);
    out.put_u8(0);
    out.put_u16(n_docs as u16);
    out.put_u32(raw_len as u32);
    out.extend_from_slice(&body);
    Some(Encoded { block: out, uses_parent, min_format })
}

/// The cuts of a messages delta: the parent's history at the start of
/// `messages` (reference 6) and the parent's response right after it and a
/// separator (reference 7). Each is cut only when it is longer than the
/// splice that replaces it, and only where the bytes are equal.
fn messages_cuts(messages: &[u8], parent: Parent<'_>, cuts: &mut Vec<Cut>) {
    let Continuation::History { end, response_at } = continuation(messages, parent) else { return };
    if end <= SPLICE_BYTES {
        return;
    }
    cuts.push(Cut::plain(0, end, REF_PARENT_MESSAGES, 0, 0));
    let response = parent.response_message.unwrap_or_default();
    if let Some(at) = response_at.filter(|_| response.len() > SPLICE_BYTES) {
        cuts.push(Cut::plain(at, at + response.len(), REF_PARENT_RESPONSE, 0, 0));
    }
}

/// How a call's `messages` text continues its parent's chat documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Continuation {
    /// The parent's `messages` is not a JSON list's text (no closing `]`).
    NotAList,
    /// `messages` leaves the parent's `messages` (its closing `]` aside) at
    /// this byte: the history was re-rendered or edited.
    LeavesAt(usize),
    /// `messages` starts with the parent's `messages` without its closing
    /// `]` (`end` bytes); `response_at`: where the parent's (non-empty)
    /// `response_message` follows, after `, ` or `,`.
    History { end: usize, response_at: Option<usize> },
}

pub(crate) fn continuation(messages: &[u8], parent: Parent<'_>) -> Continuation {
    let Some((b']', history)) = parent.messages.split_last() else { return Continuation::NotAList };
    let shared = messages.iter().zip(history).take_while(|(a, b)| a == b).count();
    if shared < history.len() {
        return Continuation::LeavesAt(shared);
    }
    let rest = messages.get(history.len()..).unwrap_or_default();
    let response = parent.response_message.filter(|r| !r.is_empty());
    let response_at = response.and_then(|response| {
        [&b", "[..], b","]
            .iter()
            .find(|sep| rest.starts_with(sep) && rest.get(sep.len()..).is_some_and(|r| r.starts_with(response)))
            .map(|sep| history.len() + sep.len())
    });
    Continuation::History { end: history.len(), response_at }
}

thread_local! {
    // One zstd context per thread, reused: making one per call costs more
    // than compressing a typical call's documents.
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> = const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { std::cell::RefCell::new(None) };
}

fn compress(data: &[u8]) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with(|c| {
        let mut c = c.try_borrow_mut().map_err(std::io::Error::other)?;
        if c.is_none() {
            *c = Some(zstd::bulk::Compressor::new(ZSTD_LEVEL)?);
        }
        match c.as_mut() {
            Some(c) => c.compress(data),
            None => zstd::bulk::compress(data, ZSTD_LEVEL),
        }
    })
}

fn decompress(data: &[u8], capacity: usize) -> std::io::Result<Vec<u8>> {
    // The frame's own header says how much it holds: a frame that disagrees
    // with the docs header is refused before anything is allocated for it.
    match zstd::zstd_safe::get_frame_content_size(data) {
        Ok(Some(n)) if n == capacity as u64 => {}
        Ok(found) => {
            return Err(std::io::Error::other(format!(
                "the frame holds {found:?} bytes, the docs header says {capacity}"
            )))
        }
        Err(_) => return Err(std::io::Error::other("not a zstd frame header")),
    }
    DECOMPRESSOR.with(|d| {
        let mut d = d.try_borrow_mut().map_err(std::io::Error::other)?;
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        match d.as_mut() {
            Some(d) => d.decompress(data, capacity),
            None => zstd::bulk::decompress(data, capacity),
        }
    })
}

/// `doc` with the cuts taken out, and its splice table.
fn template(doc: &[u8], cuts: &[Cut]) -> (Vec<u8>, Vec<u8>) {
    let cut_bytes: usize = cuts.iter().map(|c| (c.end - c.start).saturating_sub(c.kept.len())).sum();
    let mut text = Vec::with_capacity(doc.len() - cut_bytes);
    let mut splices = Vec::with_capacity(cuts.len() * SPLICE_BYTES);
    // (original end of a cut, bytes removed up to there), to map an original
    // position before a cut into the template.
    let mut removed_at: Vec<(usize, usize)> = Vec::new();
    let mut removed = 0;
    let mut pos = 0;
    for cut in cuts {
        text.extend_from_slice(doc.get(pos..cut.start).unwrap_or_default());
        let offset = text.len();
        let arg = if cut.reference == REF_TOKEN_BYTES {
            let before = match removed_at.binary_search_by(|&(end, _)| end.cmp(&cut.token_at)) {
                Ok(i) => removed_at.get(i).map_or(0, |r| r.1),
                Err(0) => 0,
                Err(i) => removed_at.get(i - 1).map_or(0, |r| r.1),
            };
            (offset - (cut.token_at - before)) as u32
        } else {
            cut.arg
        };
        splices.put_u32(offset as u32);
        splices.put_u8(cut.reference);
        splices.put_u8(cut.style);
        splices.put_u16(0);
        splices.put_u32(arg);
        text.extend_from_slice(&cut.kept);
        removed += (cut.end - cut.start) - cut.kept.len();
        removed_at.push((cut.end, removed));
        pos = cut.end;
    }
    text.extend_from_slice(doc.get(pos..).unwrap_or_default());
    (text, splices)
}

/// The values of `extra` that are copies of the columns or of `messages`.
/// One pass over the text: a value is scanned again only where it is a leaf
/// compared with a column.
fn extra_cuts(extra: &[u8], call: &Call, cuts: &mut Vec<Cut>, scratch: &mut String, content: bool) {
    let t = extra;
    let mut st = Finder { call, cuts, scratch, content };
    walk_object(t, skip_ws(t, 0), &mut |key, at| match key {
        b"raw_request" => walk_object(t, at, &mut |key, at| match key {
            b"messages" => {
                let messages = st.call.messages.as_deref()?;
                // `messages` is one valid JSON document (checked before a
                // call is encoded): when it is a list, object or string, the
                // bytes at `at` that equal it are the whole value there, so
                // the value is not scanned for its end first.
                let delimited = matches!(messages.first(), Some(b'[' | b'{' | b'"'));
                if delimited && t.get(at..at + messages.len()) == Some(messages) {
                    st.cuts.push(Cut::plain(at, at + messages.len(), REF_MESSAGES, 0, 0));
                    return Some(at + messages.len());
                }
                value_end(t, at)
            }
            // A token-in completions request: the prompt as ids.
            b"prompt" if t.get(at) == Some(&b'[') && !st.call.prompt_token_ids.is_empty() => st.ids(t, at, REF_PROMPT),
            _ => None,
        }),
        b"raw_response" => walk_object(t, at, &mut |key, at| match key {
            b"prompt_token_ids" => st.ids(t, at, REF_PROMPT),
            b"choices" => walk_array(t, at, &mut |i, at| {
                if i > 0 {
                    return None;
                }
                walk_object(t, at, &mut |key, at| match key {
                    b"token_ids" => st.ids(t, at, REF_COMPLETION),
                    b"prompt_token_ids" => st.ids(t, at, REF_PROMPT),
                    b"logprobs" => st.logprobs(t, at),
                    _ => None,
                })
            }),
            _ => None,
        }),
        _ => None,
    });
    cuts.sort_by_key(|c| c.start);
}

impl Cut {
    fn plain(start: usize, end: usize, reference: u8, style: u8, arg: u32) -> Self {
        Cut { start, end, reference, style, arg, token_at: 0, kept: Vec::new() }
    }
}

/// What the walk of `extra` compares values with, and the cuts it found.
struct Finder<'c> {
    call: &'c Call,
    cuts: &'c mut Vec<Cut>,
    scratch: &'c mut String,
    /// Whether reference 8 may be used.
    content: bool,
}

impl Finder<'_> {
    /// A list of ids at `at`: cut when it renders as `column` does. A list
    /// that does is read once (its end is where the comparison stops).
    fn ids(&mut self, t: &[u8], at: usize, reference: u8) -> Option<usize> {
        let ids = if reference == REF_PROMPT { &self.call.prompt_token_ids } else { &self.call.completion_token_ids };
        if let Some((len, style)) = list_match(t.get(at..)?, ids.iter().copied()) {
            self.cuts.push(Cut::plain(at, at + len, reference, style, 0));
            return Some(at + len);
        }
        value_end(t, at)
    }

    /// `choices[0].logprobs`: chat's `content[]` objects, or completions'
    /// `token_logprobs` list.
    fn logprobs(&mut self, t: &[u8], at: usize) -> Option<usize> {
        walk_object(t, at, &mut |key, at| match key {
            b"content" if self.content && self.whole_content(t, at).is_some() => self.cuts.last().map(|c| c.end),
            b"content" => walk_array(t, at, &mut |i, at| {
                let mut token_at = None;
                walk_object(t, at, &mut |key, at| match key {
                    b"token" if t.get(at) == Some(&b'"') => {
                        token_at = Some(at);
                        string_end(t, at)
                    }
                    b"logprob" => self.logprob(t, at, i),
                    b"bytes" => match token_at {
                        Some(token_at) => self.token_bytes(t, at, token_at),
                        None => value_end(t, at),
                    },
                    _ => None,
                })
            }),
            b"token_logprobs" if self.content && self.whole_logprobs(t, at).is_some() => self.cuts.last().map(|c| c.end),
            b"token_logprobs" => walk_array(t, at, &mut |i, at| self.logprob(t, at, i)),
            _ => None,
        })
    }

    /// A logprob at `at`, entry `i`: cut when it renders as the column's `i`.
    fn logprob(&mut self, t: &[u8], at: usize, i: usize) -> Option<usize> {
        let end = value_end(t, at)?;
        let (Some(orig), Some(&v)) = (t.get(at..end), self.call.logprobs.as_ref().and_then(|lp| lp.get(i))) else {
            return Some(end);
        };
        // Rendered and compared, not parsed first: the text a reader renders
        // is the test (equal bytes also parse to the column's value), and
        // rendering costs about what parsing did.
        self.scratch.clear();
        write_py_float(self.scratch, f64::from(v));
        if self.scratch.as_bytes() == orig {
            self.cuts.push(Cut::plain(at, end, REF_LOGPROB, FLOAT_PYTHON, i as u32));
        }
        Some(end)
    }

    /// A token's `bytes` at `at`: cut when they are the UTF-8 of the token
    /// literal at `token_at`. Returns the end of the value.
    fn token_bytes(&mut self, t: &[u8], at: usize, token_at: usize) -> Option<usize> {
        if let Some(token) = string_value(t, token_at) {
            if let Some((len, style)) = list_match(t.get(at..)?, token.bytes().map(u32::from)) {
                self.cuts.push(Cut {
                    start: at,
                    end: at + len,
                    reference: REF_TOKEN_BYTES,
                    style,
                    arg: 0,
                    token_at,
                    kept: Vec::new(),
                });
                return Some(at + len);
            }
        }
        value_end(t, at)
    }

    /// `token_logprobs` at `at` as a whole (reference 9): cut when it is
    /// exactly the logprob column as a list of floats in one list style.
    fn whole_logprobs(&mut self, t: &[u8], at: usize) -> Option<()> {
        let lps = self.call.logprobs.as_deref().filter(|lp| !lp.is_empty())?;
        let rest = t.get(at..)?.strip_prefix(b"[")?;
        let mut i = 0;
        let mut style = None;
        for (k, &lp) in lps.iter().enumerate() {
            if k > 0 {
                let sep = if rest.get(i..)?.starts_with(b", ") { LIST_SPACED } else { LIST_COMPACT };
                if *style.get_or_insert(sep) != sep || rest.get(i) != Some(&b',') {
                    return None;
                }
                i += if sep == LIST_SPACED { 2 } else { 1 };
            }
            self.scratch.clear();
            write_py_float(self.scratch, f64::from(lp));
            rest.get(i..)?.starts_with(self.scratch.as_bytes()).then_some(())?;
            i += self.scratch.len();
        }
        (rest.get(i) == Some(&b']')).then_some(())?;
        let end = at + i + 2;
        self.cuts.push(Cut::plain(at, end, REF_LOGPROB_LIST, style.unwrap_or(LIST_COMPACT), 0));
        Some(())
    }

    /// `logprobs.content` at `at` as a whole (reference 8): cut when it is
    /// exactly the logprob column in vLLM's form, one
    /// `{"token", "logprob", "bytes", "top_logprobs": []}` object per logprob,
    /// around the token literals found in it. The cut keeps the literals in
    /// the template, back to back. `None` (nothing cut) on any difference:
    /// the entries are then walked one by one.
    fn whole_content(&mut self, t: &[u8], at: usize) -> Option<()> {
        let lps = self.call.logprobs.as_deref().filter(|lp| !lp.is_empty())?;
        let style = if t.get(at + 1..)?.starts_with(CONTENT_SPACED.open) { LIST_SPACED } else { LIST_COMPACT };
        let p = ContentPieces::of(style);
        let mut kept = Vec::new();
        let mut i = at;
        let expect = |i: &mut usize, piece: &[u8]| -> Option<()> {
            t.get(*i..)?.starts_with(piece).then(|| *i += piece.len())
        };
        expect(&mut i, b"[")?;
        for (k, &lp) in lps.iter().enumerate() {
            if k > 0 {
                expect(&mut i, p.sep)?;
            }
            expect(&mut i, p.open)?;
            let literal_end = string_end(t, i)?;
            let token = string_value(t, i)?;
            kept.extend_from_slice(t.get(i..literal_end)?);
            i = literal_end;
            expect(&mut i, p.logprob)?;
            self.scratch.clear();
            write_py_float(self.scratch, f64::from(lp));
            expect(&mut i, self.scratch.as_bytes())?;
            expect(&mut i, p.bytes)?;
            let (len, found) = list_match(t.get(i..)?, token.bytes().map(u32::from))?;
            // A list of one item or none has no separator to tell its style.
            if token.len() > 1 && found != style {
                return None;
            }
            i += len;
            expect(&mut i, p.close)?;
        }
        expect(&mut i, b"]")?;
        let arg = u32::try_from(kept.len()).ok()?;
        self.cuts.push(Cut { start: at, end: i, reference: REF_CONTENT, style, arg, token_at: 0, kept });
        Some(())
    }
}

/// The fixed text of reference 8's objects in one style (record.md §7.2).
struct ContentPieces {
    /// Before the token literal.
    open: &'static [u8],
    /// Between the literal and the logprob.
    logprob: &'static [u8],
    /// Between the logprob and the bytes list.
    bytes: &'static [u8],
    /// After the bytes list.
    close: &'static [u8],
    /// Between two objects.
    sep: &'static [u8],
}

const CONTENT_COMPACT: ContentPieces = ContentPieces {
    open: br#"{"token":"#,
    logprob: br#","logprob":"#,
    bytes: br#","bytes":"#,
    close: br#","top_logprobs":[]}"#,
    sep: b",",
};

const CONTENT_SPACED: ContentPieces = ContentPieces {
    open: br#"{"token": "#,
    logprob: br#", "logprob": "#,
    bytes: br#", "bytes": "#,
    close: br#", "top_logprobs": []}"#,
    sep: b", ",
};

impl ContentPieces {
    fn of(style: u8) -> &'static ContentPieces {
        if style == LIST_SPACED {
            &CONTENT_SPACED
        } else {
            &CONTENT_COMPACT
        }
    }
}

/// The string literals that fill `text[start..end]` back to back (reference
/// 8's kept run), each with its start; `None` when the run is anything else.
fn content_literals(text: &[u8], start: usize, end: usize) -> Option<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut i = start;
    while i < end {
        let e = string_end(text, i).filter(|&e| e <= end)?;
        string_value(text, i)?;
        out.push((i, e));
        i = e;
    }
    (i == end).then_some(out)
}

/// The list style in which `items` render as exactly `orig`, if any: a
/// scan of `orig` that compares as it parses (what [`write_list`] would
/// write, without writing it).
#[cfg(test)]
fn list_style(orig: &[u8], items: impl Iterator<Item = u32>) -> Option<u8> {
    list_match(orig, items).filter(|&(len, _)| len == orig.len()).map(|(_, style)| style)
}

/// Whether `text` starts with a list that `items` render as in some style:
/// that list's length in bytes and its style.
fn list_match(text: &[u8], mut items: impl Iterator<Item = u32>) -> Option<(usize, u8)> {
    let rest = text.strip_prefix(b"[")?;
    let Some(first) = items.next() else { return (rest.first() == Some(&b']')).then_some((2, LIST_COMPACT)) };
    let mut style = None;
    let mut pos = 0;
    let mut want = Some(first);
    while let Some(v) = want {
        // One decimal, no sign, no leading zero.
        let start = pos;
        let mut n: u64 = 0;
        while let Some(d) = rest.get(pos).filter(|d| d.is_ascii_digit()) {
            n = n * 10 + u64::from(d - b'0');
            pos += 1;
            if pos - start > 10 {
                return None;
            }
        }
        if pos == start || (rest.get(start) == Some(&b'0') && pos - start > 1) || n != u64::from(v) {
            return None;
        }
        want = items.next();
        if want.is_none() {
            break;
        }
        let sep = match rest.get(pos..pos + 2) {
            Some(b", ") => LIST_SPACED,
            _ if rest.get(pos) == Some(&b',') => LIST_COMPACT,
            _ => return None,
        };
        if *style.get_or_insert(sep) != sep {
            return None;
        }
        pos += if sep == LIST_SPACED { 2 } else { 1 };
    }
    (rest.get(pos) == Some(&b']')).then_some((pos + 2, style.unwrap_or(LIST_COMPACT)))
}

fn write_list(out: &mut Vec<u8>, items: impl Iterator<Item = u32>, style: u8) {
    let sep: &[u8] = if style == LIST_SPACED { b", " } else { b"," };
    out.push(b'[');
    for (i, v) in items.enumerate() {
        if i > 0 {
            out.extend_from_slice(sep);
        }
        out.extend_from_slice(decimal(v, &mut [0u8; 10]));
    }
    out.push(b']');
}



// ---------------------------------------------------------------- decoding

/// A docs block, decompressed and its table checked; [`Block::resolve`]
/// renders the documents.
#[derive(Debug)]
pub struct Block {
    payload: Vec<u8>,
    /// Per document: (index into `DOC_FIELDS`, text range, splice range).
    docs: Vec<(usize, std::ops::Range<usize>, std::ops::Range<usize>)>,
}

/// Decompress `block` and check its table. `present[i]`: whether the record's
/// flags say document `i` (messages, response_message, metadata, extra) is
/// present; the table must list exactly those, in that order.
pub fn open(block: &[u8], present: [bool; 4]) -> Result<Block, DecodeError> {
    let mut c = Cursor::new(block);
    let codec = c.u8("docs codec")?;
    let _reserved = c.u8("docs reserved")?;
    let n_docs = c.u16("docs count")? as usize;
    let raw_len = c.u32("docs raw length")? as usize;
    if raw_len > RAW_LEN_MAX {
        return Err(DecodeError::new(4, format!("docs raw length {raw_len} is over its limit {RAW_LEN_MAX}")));
    }
    let rest = block.get(HEADER_BYTES..).unwrap_or_default();
    let payload = match codec {
        CODEC_NONE => rest.to_vec(),
        CODEC_ZSTD => decompress(rest, raw_len)
            .map_err(|e| DecodeError::new(HEADER_BYTES, format!("docs: zstd frame does not decompress ({e})")))?,
        other => return Err(DecodeError::new(0, format!("unknown docs codec {other}"))),
    };
    if payload.len() != raw_len {
        return Err(DecodeError::new(4, format!("docs: {} bytes, the header says {raw_len}", payload.len())));
    }
    let want: Vec<usize> = present.iter().enumerate().filter(|(_, &p)| p).map(|(i, _)| i).collect();
    if n_docs != want.len() {
        return Err(DecodeError::new(2, format!("docs: {n_docs} documents, the record's flags say {}", want.len())));
    }
    let mut t = Cursor::new(&payload);
    let mut entries = Vec::with_capacity(n_docs);
    for &field in &want {
        let name = t.u8("doc name")?;
        let _ = t.u8("doc reserved")?;
        let _ = t.u16("doc reserved")?;
        let text_len = t.u32("doc text length")? as usize;
        let n_splices = t.u32("doc splice count")? as usize;
        if DOC_NAMES.get(field) != Some(&name) {
            return Err(DecodeError::new(t.pos(), format!("docs: document {name} where {} belongs", field_name(field))));
        }
        entries.push((field, text_len, n_splices));
    }
    let mut pos = t.pos();
    let mut docs = Vec::with_capacity(n_docs);
    for (field, text_len, n_splices) in entries {
        let text_end = pos.checked_add(text_len);
        let splice_end = n_splices.checked_mul(SPLICE_BYTES).and_then(|s| text_end?.checked_add(s));
        let (Some(text_end), Some(splice_end)) = (text_end, splice_end) else {
            return Err(DecodeError::new(pos, "docs: lengths overflow"));
        };
        if splice_end > payload.len() {
            return Err(DecodeError::new(pos, format!("docs: {} runs past the payload", field_name(field))));
        }
        docs.push((field, pos..text_end, text_end..splice_end));
        pos = splice_end;
    }
    if pos != payload.len() {
        return Err(DecodeError::new(pos, format!("docs: {} trailing bytes", payload.len() - pos)));
    }
    Ok(Block { payload, docs })
}

impl Block {
    fn splices(&self, range: &std::ops::Range<usize>) -> impl Iterator<Item = Result<Splice, DecodeError>> + '_ {
        let bytes = self.payload.get(range.clone()).unwrap_or_default();
        let base = range.start;
        (0..bytes.len() / SPLICE_BYTES).map(move |i| {
            let mut c = Cursor::at(bytes, i * SPLICE_BYTES);
            let at = |e: DecodeError| DecodeError::new(base + e.offset as usize, e.what);
            Ok(Splice {
                offset: c.u32("splice offset").map_err(at)? as usize,
                reference: c.u8("splice reference").map_err(at)?,
                style: c.u8("splice style").map_err(at)?,
                arg: {
                    let _ = c.u16("splice reserved").map_err(at)?;
                    c.u32("splice argument").map_err(at)?
                },
            })
        })
    }

    /// Whether a splice of a document below `fields` refers to one of `refs`.
    fn refers_to(&self, fields: usize, refs: &[u8]) -> bool {
        self.docs
            .iter()
            .filter(|(f, _, _)| *f < fields)
            .any(|(_, _, s)| self.splices(s).any(|r| r.is_ok_and(|s| refs.contains(&s.reference))))
    }

    /// Bytes of each document's template (the text left after the cuts,
    /// before compression): messages, response_message, metadata, extra.
    pub fn template_bytes(&self) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (field, text, _) in &self.docs {
            if let Some(slot) = out.get_mut(*field) {
                *slot += text.len() as u64;
            }
        }
        out
    }

    /// Whether a splice refers to the prompt column.
    pub fn needs_prompt(&self) -> bool {
        self.refers_to(DOC_FIELDS.len(), &[REF_PROMPT])
    }

    /// Whether a splice of `messages` or `response_message` refers to the
    /// prompt column ([`Block::resolve_chat`] needs it then).
    pub fn chat_needs_prompt(&self) -> bool {
        self.refers_to(2, &[REF_PROMPT])
    }

    /// Whether `extra` holds vLLM's logprobs as one splice: the chat API's
    /// content list (reference 8) or the completions API's `token_logprobs`
    /// (reference 9).
    pub fn has_content_list(&self) -> bool {
        self.refers_to(DOC_FIELDS.len(), &[REF_CONTENT, REF_LOGPROB_LIST])
    }

    /// Whether a splice refers to the parent's documents.
    pub fn needs_parent(&self) -> bool {
        self.refers_to(DOC_FIELDS.len(), &[REF_PARENT_MESSAGES, REF_PARENT_RESPONSE])
    }

    /// Render `messages` and `response_message` only (what a child's
    /// references 6 and 7 need).
    pub fn resolve_chat(&self, cols: &Columns<'_>) -> Result<Docs, DecodeError> {
        self.resolve_fields(cols, 2)
    }

    /// Render the documents. Fails (never panics) on a splice that does not
    /// fit: an offset out of order or past the text, an unknown reference or
    /// style, an argument out of range, a missing column.
    pub fn resolve(&self, cols: &Columns<'_>) -> Result<Docs, DecodeError> {
        self.resolve_fields(cols, DOC_FIELDS.len())
    }

    /// Render the documents whose index (into `DOC_FIELDS`) is below `fields`.
    fn resolve_fields(&self, cols: &Columns<'_>, fields: usize) -> Result<Docs, DecodeError> {
        let mut docs = Docs::default();
        let mut total = 0usize;
        for (field, text_range, splice_range) in self.docs.iter().filter(|(f, _, _)| *f < fields) {
            let text = self.payload.get(text_range.clone()).unwrap_or_default();
            let holes = self.holes(*field, text, splice_range, cols, docs.messages.is_some())?;
            let limit = (JSON_BYTES_PER_CALL_MAX as usize).saturating_sub(total);
            let out = render(text, &holes, cols, docs.messages.as_deref(), limit)
                .map_err(|what| DecodeError::new(splice_range.start, format!("docs: {what}")))?;
            total += out.len();
            *docs.slot(*field) = Some(out);
        }
        Ok(docs)
    }

    /// Render `messages`, `response_message` and `metadata`, and leave
    /// `extra` as its template with its splices checked (a [`Spliced`]) for a
    /// reader that builds its values straight from the columns rather than
    /// from their text. `extra` is rendered too (and `None` returned) when
    /// its rendering could pass the documents' limit: [`Block::resolve`]
    /// then gives the verdict.
    pub fn resolve_but_extra(self, cols: &Columns<'_>) -> Result<(Docs, Option<Spliced>), DecodeError> {
        let mut docs = self.resolve_fields(cols, DOC_EXTRA)?;
        let Some((_, text_range, splice_range)) = self.docs.iter().find(|(f, _, _)| *f == DOC_EXTRA).cloned() else {
            return Ok((docs, None));
        };
        let text = self.payload.get(text_range.clone()).unwrap_or_default();
        let holes = self.holes(DOC_EXTRA, text, &splice_range, cols, docs.messages.is_some())?;
        let used: usize = [&docs.messages, &docs.response_message, &docs.metadata]
            .iter()
            .map(|d| d.as_ref().map_or(0, Vec::len))
            .sum();
        let bound = rendered_bound(text, &holes, cols, docs.messages.as_deref());
        if bound.is_none_or(|b| used.saturating_add(b) > JSON_BYTES_PER_CALL_MAX as usize) {
            docs.extra = self.resolve(cols)?.extra;
            return Ok((docs, None));
        }
        Ok((docs, Some(Spliced { payload: self.payload, text: text_range, holes })))
    }

    /// The splices of document `field` (its `text` and splice table), checked:
    /// offsets in order and within the text, known references and styles,
    /// arguments in range, the columns and documents they need present.
    fn holes(
        &self,
        field: usize,
        text: &[u8],
        splice_range: &std::ops::Range<usize>,
        cols: &Columns<'_>,
        has_messages: bool,
    ) -> Result<Vec<(usize, Hole)>, DecodeError> {
        let err = |what: String| DecodeError::new(splice_range.start, format!("docs: {what}"));
        let mut holes = Vec::with_capacity((splice_range.end - splice_range.start) / SPLICE_BYTES);
        let mut pos = 0;
        for splice in self.splices(splice_range) {
            let s = splice?;
            if matches!(
                s.reference,
                REF_PROMPT | REF_COMPLETION | REF_MESSAGES | REF_PARENT_MESSAGES | REF_PARENT_RESPONSE | REF_LOGPROB_LIST
            ) && s.arg != 0
            {
                return Err(err(format!("splice reference {} with argument {}", s.reference, s.arg)));
            }
            if s.offset < pos || s.offset > text.len() {
                return Err(err(format!("splice offset {} out of order or past the text", s.offset)));
            }
            pos = s.offset;
            let hole = match (s.reference, s.style) {
                (REF_CONTENT, LIST_COMPACT | LIST_SPACED) if field == DOC_EXTRA => {
                    let end = s
                        .offset
                        .checked_add(s.arg as usize)
                        .filter(|&end| end <= text.len())
                        .ok_or_else(|| err(format!("a content splice's {} bytes run past the text", s.arg)))?;
                    let n = content_literals(text, s.offset, end)
                        .ok_or_else(|| err("a content splice's run is not string literals".into()))?
                        .len();
                    let column = cols.logprobs.map_or(0, <[f32]>::len);
                    if n == 0 || n != column {
                        return Err(err(format!("a content splice of {n} tokens, the logprob column holds {column}")));
                    }
                    // The run is consumed: the next splice starts after it.
                    pos = end;
                    Hole::Content { end, spaced: s.style == LIST_SPACED }
                }
                (REF_LOGPROB_LIST, LIST_COMPACT | LIST_SPACED) if field == DOC_EXTRA => {
                    if cols.logprobs.is_none_or(<[f32]>::is_empty) {
                        return Err(err("a logprob list splice without logprobs".into()));
                    }
                    Hole::Logprobs { spaced: s.style == LIST_SPACED }
                }
                (REF_PROMPT, LIST_COMPACT | LIST_SPACED) => {
                    cols.prompt.ok_or_else(|| err("the prompt column is needed".into()))?;
                    Hole::Prompt { spaced: s.style == LIST_SPACED }
                }
                (REF_COMPLETION, LIST_COMPACT | LIST_SPACED) => Hole::Completion { spaced: s.style == LIST_SPACED },
                (REF_LOGPROB, FLOAT_PYTHON) => {
                    if cols.logprobs.and_then(|lp| lp.get(s.arg as usize)).is_none() {
                        return Err(err(format!("logprob {} is not in the column", s.arg)));
                    }
                    Hole::Logprob(s.arg)
                }
                (REF_TOKEN_BYTES, LIST_COMPACT | LIST_SPACED) => {
                    let token_at = s
                        .offset
                        .checked_sub(s.arg as usize)
                        .filter(|&at| string_value(text, at).is_some())
                        .ok_or_else(|| err("the token of a bytes splice is not a string".into()))?;
                    Hole::TokenBytes { token_at, spaced: s.style == LIST_SPACED }
                }
                (REF_MESSAGES, 0) if field == DOC_EXTRA && has_messages => Hole::Messages,
                (REF_MESSAGES, 0) => return Err(err("a messages splice without messages".into())),
                (REF_PARENT_MESSAGES | REF_PARENT_RESPONSE, 0) if field == 0 => {
                    let parent = cols.parent.ok_or_else(|| err("the parent's documents are needed".into()))?;
                    if s.reference == REF_PARENT_MESSAGES {
                        if parent.messages.is_empty() {
                            return Err(err("the parent's messages are empty".into()));
                        }
                        Hole::ParentMessages
                    } else {
                        parent.response_message.ok_or_else(|| err("the parent has no response_message".into()))?;
                        Hole::ParentResponse
                    }
                }
                (r, st) => return Err(err(format!("unknown splice reference {r} style {st}"))),
            };
            holes.push((s.offset, hole));
        }
        Ok(holes)
    }
}

/// What a checked splice puts back at its offset (record.md §7.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hole {
    /// The prompt column as a JSON list (`spaced`: `", "` between items).
    Prompt { spaced: bool },
    /// The completion column as a JSON list.
    Completion { spaced: bool },
    /// Logprob `i` of the column as Python writes the float.
    Logprob(u32),
    /// The UTF-8 bytes (a JSON list) of the token string literal that starts
    /// at `token_at` in the template.
    TokenBytes { token_at: usize, spaced: bool },
    /// The call's `messages` document (in `extra` only).
    Messages,
    /// The prefix-delta parent's `messages` without its closing `]` (in
    /// `messages` only).
    ParentMessages,
    /// The parent's `response_message` (in `messages` only).
    ParentResponse,
    /// vLLM's `logprobs.content` list (in `extra` only): one object per
    /// token literal of the template from the hole's offset to `end` (which
    /// the hole replaces), with the logprob column's value of that index.
    Content { end: usize, spaced: bool },
    /// The logprob column as a JSON list of floats (the completions API's
    /// `token_logprobs`; in `extra` only).
    Logprobs { spaced: bool },
}

/// The `extra` document of a docs block as its template and checked holes
/// (see `Block::resolve_but_extra`). A reader may build each hole's value
/// from the columns itself; [`Spliced::render`] gives the text.
#[derive(Debug)]
pub struct Spliced {
    payload: Vec<u8>,
    text: std::ops::Range<usize>,
    /// (offset in [`Spliced::text`], what goes there), in offset order.
    pub holes: Vec<(usize, Hole)>,
}

impl Spliced {
    /// The template: the document's text with the holes' values cut out.
    pub fn text(&self) -> &[u8] {
        self.payload.get(self.text.clone()).unwrap_or_default()
    }

    /// The document's text, from the call's columns (those the block was
    /// checked against) and its rendered `messages`.
    pub fn render(
        &self,
        prompt: &[u32],
        completion: &[u32],
        logprobs: Option<&[f32]>,
        messages: Option<&[u8]>,
    ) -> Result<Vec<u8>, DecodeError> {
        let cols = Columns { prompt: Some(prompt), completion, logprobs, parent: None };
        render(self.text(), &self.holes, &cols, messages, JSON_BYTES_PER_CALL_MAX as usize)
            .map_err(|what| DecodeError::new(0, format!("docs: {what}")))
    }
}

/// `text` with each hole's value written at its offset; fails when the
/// result would pass `limit` bytes or a hole's column or document is absent.
fn render(
    text: &[u8],
    holes: &[(usize, Hole)],
    cols: &Columns<'_>,
    messages: Option<&[u8]>,
    limit: usize,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len());
    let mut scratch = String::new();
    let mut pos = 0;
    let style = |spaced: bool| if spaced { LIST_SPACED } else { LIST_COMPACT };
    for &(offset, hole) in holes {
        out.extend_from_slice(text.get(pos..offset).ok_or("a splice offset past the text")?);
        pos = offset;
        match hole {
            Hole::Prompt { spaced } => {
                let prompt = cols.prompt.ok_or("the prompt column is needed")?;
                write_list(&mut out, prompt.iter().copied(), style(spaced));
            }
            Hole::Completion { spaced } => write_list(&mut out, cols.completion.iter().copied(), style(spaced)),
            Hole::Logprob(i) => {
                let v = cols.logprobs.and_then(|lp| lp.get(i as usize)).ok_or("a logprob not in the column")?;
                scratch.clear();
                write_py_float(&mut scratch, f64::from(*v));
                out.extend_from_slice(scratch.as_bytes());
            }
            Hole::TokenBytes { token_at, spaced } => {
                let token = string_value(text, token_at).ok_or("the token of a bytes splice is not a string")?;
                write_list(&mut out, token.bytes().map(u32::from), style(spaced));
            }
            Hole::Messages => out.extend_from_slice(messages.ok_or("a messages splice without messages")?),
            Hole::ParentMessages => {
                let parent = cols.parent.ok_or("the parent's documents are needed")?;
                let history = parent.messages.split_last().map(|(_, h)| h).ok_or("the parent's messages are empty")?;
                out.extend_from_slice(history);
            }
            Hole::ParentResponse => {
                let parent = cols.parent.ok_or("the parent's documents are needed")?;
                out.extend_from_slice(parent.response_message.ok_or("the parent has no response_message")?);
            }
            Hole::Logprobs { spaced } => {
                let logprobs = cols.logprobs.ok_or("a logprob list splice without logprobs")?;
                out.push(b'[');
                for (k, v) in logprobs.iter().enumerate() {
                    if k > 0 {
                        out.extend_from_slice(if spaced { b", " } else { b"," });
                    }
                    scratch.clear();
                    write_py_float(&mut scratch, f64::from(*v));
                    out.extend_from_slice(scratch.as_bytes());
                }
                out.push(b']');
            }
            Hole::Content { end, spaced } => {
                write_content(&mut out, text, offset, end, style(spaced), cols.logprobs, &mut scratch, limit)?;
                pos = end;
            }
        }
        if out.len() > limit {
            return Err(format!("documents over their limit {JSON_BYTES_PER_CALL_MAX}"));
        }
    }
    out.extend_from_slice(text.get(pos..).unwrap_or_default());
    Ok(out)
}

/// Reference 8: the list of `{"token", "logprob", "bytes", "top_logprobs"}`
/// objects of the literals in `text[start..end]` and the logprob column.
#[allow(clippy::too_many_arguments)]
fn write_content(
    out: &mut Vec<u8>,
    text: &[u8],
    start: usize,
    end: usize,
    style: u8,
    logprobs: Option<&[f32]>,
    scratch: &mut String,
    limit: usize,
) -> Result<(), String> {
    let p = ContentPieces::of(style);
    let literals = content_literals(text, start, end).ok_or("a content splice's run is not string literals")?;
    let logprobs = logprobs.filter(|lp| lp.len() == literals.len()).ok_or("a content splice without its logprobs")?;
    out.push(b'[');
    for (k, (&(at, literal_end), &lp)) in literals.iter().zip(logprobs).enumerate() {
        if k > 0 {
            out.extend_from_slice(p.sep);
        }
        out.extend_from_slice(p.open);
        out.extend_from_slice(text.get(at..literal_end).unwrap_or_default());
        out.extend_from_slice(p.logprob);
        scratch.clear();
        write_py_float(scratch, f64::from(lp));
        out.extend_from_slice(scratch.as_bytes());
        out.extend_from_slice(p.bytes);
        let token = string_value(text, at).ok_or("a content splice's token is not a string")?;
        write_list(out, token.bytes().map(u32::from), style);
        out.extend_from_slice(p.close);
        if out.len() > limit {
            return Err(format!("documents over their limit {JSON_BYTES_PER_CALL_MAX}"));
        }
    }
    out.push(b']');
    Ok(())
}

/// At least the length of `text` rendered with `holes` (an upper bound,
/// without rendering it); `None` when a hole's column or document is absent.
fn rendered_bound(text: &[u8], holes: &[(usize, Hole)], cols: &Columns<'_>, messages: Option<&[u8]>) -> Option<usize> {
    // A u32 in decimal is at most 10 digits, a separator 2 bytes; Python's
    // repr of a finite double is at most 24 bytes ("-2.2250738585072014e-308").
    let list = |n: usize| n.saturating_mul(12).saturating_add(2);
    holes.iter().try_fold(text.len(), |acc, &(offset, hole)| {
        let len = match hole {
            Hole::Prompt { .. } => list(cols.prompt?.len()),
            Hole::Completion { .. } => list(cols.completion.len()),
            Hole::Logprob(_) => 32,
            Hole::TokenBytes { token_at, .. } => list(string_end(text, token_at)?.saturating_sub(token_at)),
            Hole::Messages => messages?.len(),
            Hole::ParentMessages => cols.parent?.messages.len(),
            Hole::ParentResponse => cols.parent?.response_message?.len(),
            // Per token: its literal, at most as many bytes (each at most 12
            // written), a float, and the fixed text of one object.
            Hole::Logprobs { .. } => cols.logprobs?.len().saturating_mul(32).saturating_add(2),
            Hole::Content { end, .. } => {
                let n = cols.logprobs?.len();
                let run = end.saturating_sub(offset);
                run.saturating_mul(13).saturating_add(n.saturating_mul(32 + 64)).saturating_add(2)
            }
        };
        Some(acc.saturating_add(len))
    })
}

#[derive(Debug, Clone, Copy)]
struct Splice {
    offset: usize,
    reference: u8,
    style: u8,
    arg: u32,
}

// ---------------------------------------------------------------- a JSON span scanner

/// The string literal at `i`, unescaped (borrowed when it has no escape).
fn string_value(b: &[u8], i: usize) -> Option<std::borrow::Cow<'_, str>> {
    let end = string_end(b, i)?;
    let lit = b.get(i..end)?;
    let inner = lit.get(1..lit.len() - 1)?;
    if !inner.contains(&b'\\') {
        return std::str::from_utf8(inner).ok().map(std::borrow::Cow::Borrowed);
    }
    serde_json::from_slice::<String>(lit).ok().map(std::borrow::Cow::Owned)
}


/// Walk the object starting at `i` (a `{`): `visit(key, value_start)`
/// returns the value's end when it walked the value itself, `None` to have it
/// skipped here. Keys are raw (escapes not resolved: a key with an escape
/// matches nothing). Returns the end of the object, `None` when the text is
/// not an object there.
fn walk_object(b: &[u8], i: usize, visit: &mut dyn FnMut(&[u8], usize) -> Option<usize>) -> Option<usize> {
    if b.get(i) != Some(&b'{') {
        return None;
    }
    let mut j = skip_ws(b, i + 1);
    if b.get(j) == Some(&b'}') {
        return Some(j + 1);
    }
    loop {
        let key_end = string_end(b, j)?;
        let key = b.get(j + 1..key_end - 1)?;
        j = skip_ws(b, key_end);
        if b.get(j) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, j + 1);
        let end = match visit(key, start) {
            Some(end) if end > start => end,
            _ => value_end(b, start)?,
        };
        j = skip_ws(b, end);
        match b.get(j)? {
            b',' => j = skip_ws(b, j + 1),
            b'}' => return Some(j + 1),
            _ => return None,
        }
    }
}

/// Walk the array starting at `i` (a `[`): `visit(index, item_start)` as for
/// [`walk_object`].
fn walk_array(b: &[u8], i: usize, visit: &mut dyn FnMut(usize, usize) -> Option<usize>) -> Option<usize> {
    if b.get(i) != Some(&b'[') {
        return None;
    }
    let mut j = skip_ws(b, i + 1);
    if b.get(j) == Some(&b']') {
        return Some(j + 1);
    }
    let mut n = 0;
    loop {
        let end = match visit(n, j) {
            Some(end) if end > j => end,
            _ => value_end(b, j)?,
        };
        n += 1;
        j = skip_ws(b, end);
        match b.get(j)? {
            b',' => j = skip_ws(b, j + 1),
            b']' => return Some(j + 1),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call_with(extra: &str, messages: Option<&str>) -> Call {
        Call {
            trace_id: "t".into(),
            session_id: "s".into(),
            prompt_token_ids: vec![1, 2, 3],
            completion_token_ids: vec![10, 11],
            logprobs: Some(vec![-0.5, -2.1e-5]),
            messages: messages.map(|m| m.as_bytes().to_vec()),
            extra: Some(extra.as_bytes().to_vec()),
            ..Default::default()
        }
    }

    fn round_trip(call: &Call) -> Option<Docs> {
        let block = encode(call, None)?.block;
        let present = [
            call.messages.is_some(),
            call.response_message.is_some(),
            call.metadata.is_some(),
            call.extra.is_some(),
        ];
        let b = open(&block, present).expect("open");
        let cols = Columns {
            prompt: Some(&call.prompt_token_ids),
            completion: &call.completion_token_ids,
            logprobs: call.logprobs.as_deref(),
            parent: None,
        };
        let docs = b.resolve(&cols).expect("resolve");
        assert_eq!(docs.messages, call.messages);
        assert_eq!(docs.extra, call.extra);
        // The template with its holes renders the same text.
        let (rest, spliced) = open(&block, present).and_then(|b| b.resolve_but_extra(&cols)).expect("spliced");
        assert_eq!(rest.messages, call.messages);
        assert_eq!(rest.extra, None);
        let spliced = spliced.expect("extra left as a template");
        let text = spliced
            .render(&call.prompt_token_ids, &call.completion_token_ids, call.logprobs.as_deref(), rest.messages.as_deref())
            .expect("render");
        assert_eq!(Some(text), call.extra);
        Some(docs)
    }

    fn padded(inner: &str) -> String {
        // Long enough for the block to pay off.
        format!(r#"{{"pad":"{}",{inner}}}"#, "x".repeat(600))
    }

    #[test]
    fn references_round_trip_and_cut() {
        let msgs = r#"[{"role":"user","content":"hi"}]"#;
        let extra = padded(&format!(
            r#""raw_request":{{"messages":{msgs},"n":1}},"raw_response":{{"choices":[{{"logprobs":{{"content":[{{"token":"ab","logprob":-0.5,"bytes":[97,98]}},{{"token":"\u00e9","logprob":-2.099999983329326e-05,"bytes":[195, 169]}}]}},"token_ids":[10,11]}}],"prompt_token_ids":[1, 2, 3]}}"#
        ));
        let call = call_with(&extra, Some(msgs));
        let mut cuts = Vec::new();
        extra_cuts(call.extra.as_deref().unwrap_or_default(), &call, &mut cuts, &mut String::new(), true);
        let refs: Vec<u8> = cuts.iter().map(|c| c.reference).collect();
        assert_eq!(refs, [REF_MESSAGES, REF_LOGPROB, REF_TOKEN_BYTES, REF_LOGPROB, REF_TOKEN_BYTES, REF_COMPLETION, REF_PROMPT]);
        assert!(round_trip(&call).is_some());
        // The holes a reader builds values for: each token's bytes name where
        // that token's literal is in the template.
        let block = encode(&call, None).expect("a block").block;
        let cols = Columns { prompt: Some(&call.prompt_token_ids), completion: &call.completion_token_ids, logprobs: call.logprobs.as_deref(), parent: None };
        let (_, spliced) = open(&block, [true, false, false, true]).and_then(|b| b.resolve_but_extra(&cols)).expect("open");
        let spliced = spliced.expect("a template");
        let holes: Vec<Hole> = spliced.holes.iter().map(|h| h.1).collect();
        let tokens: Vec<String> = holes
            .iter()
            .filter_map(|h| match *h {
                Hole::TokenBytes { token_at, .. } => string_value(spliced.text(), token_at).map(|t| t.into_owned()),
                _ => None,
            })
            .collect();
        assert_eq!(tokens, ["ab", "\u{e9}"]);
        assert_eq!(holes.first(), Some(&Hole::Messages));
        assert_eq!(holes.get(1), Some(&Hole::Logprob(0)));
        assert_eq!(holes.last(), Some(&Hole::Prompt { spaced: true }));
    }

    #[test]
    fn list_style_is_what_write_list_writes() {
        let cases: &[&[u32]] = &[&[], &[0], &[7], &[1, 2, 3], &[0, 10, 4294967295], &[120, 3]];
        for &items in cases {
            for style in [LIST_COMPACT, LIST_SPACED] {
                let mut text = Vec::new();
                write_list(&mut text, items.iter().copied(), style);
                let want = if items.len() < 2 { LIST_COMPACT } else { style };
                assert_eq!(list_style(&text, items.iter().copied()), Some(want), "{}", String::from_utf8_lossy(&text));
            }
        }
        for (text, items) in [
            ("[1,2]", &[1u32, 3][..]),
            ("[1, 2,3]", &[1, 2, 3]),
            ("[01]", &[1]),
            ("[1 ]", &[1]),
            ("[ 1]", &[1]),
            ("[1,2]", &[1]),
            ("[1]", &[1, 2]),
            ("[4294967296]", &[0]),
            ("[]", &[1]),
            ("[-1]", &[1]),
        ] {
            assert_eq!(list_style(text.as_bytes(), items.iter().copied()), None, "{text}");
        }
    }

    #[test]
    fn mismatches_stay_verbatim() {
        // Ids that differ from the columns, a logprob written with another
        // precision, bytes that are not the token's: all kept as written.
        let extra = padded(
            r#""raw_response":{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-0.50,"bytes":[1]}]},"token_ids":[10,12]}],"prompt_token_ids":[1,2]}"#,
        );
        let call = call_with(&extra, None);
        let mut cuts = Vec::new();
        extra_cuts(call.extra.as_deref().unwrap_or_default(), &call, &mut cuts, &mut String::new(), true);
        assert!(cuts.is_empty(), "{cuts:?}");
        assert!(round_trip(&call).is_some());
    }

    /// vLLM's `content` list in `style` for `tokens` (JSON literals) and
    /// `logprobs`, as `json.dumps` (spaced) or a compact writer renders it.
    fn content_list(tokens: &[&str], logprobs: &[f32], style: u8) -> String {
        let p = ContentPieces::of(style);
        let mut out = b"[".to_vec();
        for (k, (t, lp)) in tokens.iter().zip(logprobs).enumerate() {
            if k > 0 {
                out.extend_from_slice(p.sep);
            }
            out.extend_from_slice(p.open);
            out.extend_from_slice(t.as_bytes());
            out.extend_from_slice(p.logprob);
            out.extend_from_slice(crate::trace_json::py_float(f64::from(*lp)).as_bytes());
            out.extend_from_slice(p.bytes);
            let token = string_value(t.as_bytes(), 0).expect("a literal");
            write_list(&mut out, token.bytes().map(u32::from), style);
            out.extend_from_slice(p.close);
        }
        out.push(b']');
        String::from_utf8(out).expect("utf-8")
    }

    fn refs_of(call: &Call, content: bool) -> Vec<u8> {
        let mut cuts = Vec::new();
        extra_cuts(call.extra.as_deref().unwrap_or_default(), call, &mut cuts, &mut String::new(), content);
        cuts.iter().map(|c| c.reference).collect()
    }

    /// `logprobs.<key>` holding `list`, which is not the column `lps`'s
    /// whole list: no `reference` is cut, and the text comes back.
    fn near_miss(key: &str, list: &str, lps: &[f32], reference: u8) {
        let extra = padded(&format!(r#""raw_response":{{"choices":[{{"logprobs":{{"{key}":{list}}}}}]}}"#));
        let mut call = call_with(&extra, None);
        call.logprobs = Some(lps.to_vec());
        assert!(!refs_of(&call, true).contains(&reference), "{list}");
        assert_eq!(round_trip(&call).map(|d| d.extra).unwrap_or(call.extra.clone()), call.extra);
    }

    #[test]
    fn the_content_list_is_one_splice() {
        let tokens = [r#""ab""#, r#""\u00e9""#, r#""\"q""#, r#""""#];
        let logprobs = [-0.5f32, -2.1e-5, -9999.0, -0.0];
        for style in [LIST_COMPACT, LIST_SPACED] {
            let content = content_list(&tokens, &logprobs, style);
            let extra = padded(&format!(r#""raw_response":{{"choices":[{{"logprobs":{{"content":{content}}},"token_ids":[10,11]}}]}}"#));
            let mut call = call_with(&extra, None);
            call.completion_token_ids = vec![1, 2, 3, 4];
            call.logprobs = Some(logprobs.to_vec());
            assert_eq!(refs_of(&call, true), [REF_CONTENT], "{content}");
            let docs = round_trip(&call).expect("a block");
            assert_eq!(docs.extra, call.extra);
            let e = encode(&call, None).expect("a block");
            assert_eq!(e.min_format, super::super::FORMAT_CONTENT_REF);
            // The template keeps the literals and none of the objects' text.
            let b = open(&e.block, [false, false, false, true]).expect("open");
            assert_eq!(b.template_bytes()[DOC_EXTRA] as usize, extra.len() - content.len() + tokens.concat().len());
            // An older segment format gets the entries one by one.
            let old = encode_for(&call, None, Allow::format(5)).expect("a block");
            assert_eq!(old.min_format, 2);
            assert_eq!(refs_of(&call, false).iter().filter(|&&r| r == REF_LOGPROB).count(), 4);
            let b = open(&old.block, [false, false, false, true]).expect("open");
            let cols = Columns { prompt: None, completion: &call.completion_token_ids, logprobs: call.logprobs.as_deref(), parent: None };
            assert_eq!(b.resolve(&cols).expect("resolve").extra, call.extra);
        }
        // Anything but the exact list of the whole column: entries one by one.
        let compact = content_list(&tokens, &logprobs, LIST_COMPACT);
        let spaced = content_list(&tokens, &logprobs, LIST_SPACED);
        let off = content_list(&tokens, &[-0.5, -2.1e-5, -9999.5, -0.0], LIST_COMPACT);
        for (content, lps) in [
            (compact.replacen(r#""top_logprobs":[]"#, r#""top_logprobs":[{"logprob":-1.0}]"#, 1), &logprobs[..]),
            (compact.replacen("[97,98]", "[97, 98]", 1), &logprobs[..]),
            (spaced.replacen("[97, 98]", "[97,98]", 1), &logprobs[..]),
            (off, &logprobs[..]),
            (compact.clone(), &logprobs[..3]),
            (compact.replacen(r#","bytes":[97,98]"#, "", 1), &logprobs[..]),
            (compact.replace(r#""token":"#, r#""token" :"#), &logprobs[..]),
        ] {
            near_miss("content", &content, lps, REF_CONTENT);
        }
    }

    #[test]
    fn found_cuts_stand_in_for_the_search() {
        let msgs = r#"[{"role":"user","content":"hi"}]"#;
        let tokens = [r#""ab""#, r#""\u00e9""#];
        let logprobs = [-0.5f32, -0.0];
        let content = content_list(&tokens, &logprobs, LIST_COMPACT);
        let extra = padded(&format!(
            r#""raw_request":{{"messages":{msgs}}},"raw_response":{{"choices":[{{"logprobs":{{"content":{content}}},"token_ids":[10,11]}}],"prompt_token_ids":[1,2,3]}}"#
        ));
        let mut call = call_with(&extra, Some(msgs));
        call.logprobs = Some(logprobs.to_vec());
        let at = |needle: &str| extra.find(needle).expect("in the text");
        let mut found = ExtraCuts::default();
        found.ids(at("[1,2,3]"), at("[1,2,3]") + 7, true);
        found.messages(at(msgs), at(msgs) + msgs.len());
        found.ids(at("[10,11]"), at("[10,11]") + 7, false);
        assert!(found.content(at(&content), at(&content) + content.len(), tokens.concat().into_bytes()));
        assert!(found_cuts_agree(&call, &found));
        let searched = encode(&call, None).expect("a block");
        assert_eq!(encode_found(&call, None, Some(found.clone())), Some(searched.clone()));
        // Cuts that fail the cheap checks are not taken: the text is searched.
        for bad in [
            |f: &mut ExtraCuts| f.ids(1, 8, true),
            |f: &mut ExtraCuts| f.messages(0, 5),
            |f: &mut ExtraCuts| f.logprob_list(0, 2),
        ] {
            let mut f = found.clone();
            bad(&mut f);
            assert!(!found_cuts_agree(&call, &f));
            assert_eq!(encode_found(&call, None, Some(f)), Some(searched.clone()));
        }
        // Found cuts that the search does not find disagree.
        let mut missing = ExtraCuts::default();
        missing.messages(at(msgs), at(msgs) + msgs.len());
        assert!(!found_cuts_agree(&call, &missing));
        // No logprobs column: no whole-list reference is plausible.
        let mut no_column = call.clone();
        no_column.logprobs = None;
        assert!(!plausible(&no_column, &found.into_sorted()));
    }

    #[test]
    fn token_logprobs_is_one_splice() {
        let logprobs = [-0.5f32, -2.1e-5, -12.969_864, -0.0];
        let floats: Vec<String> = logprobs.iter().map(|v| crate::trace_json::py_float(f64::from(*v))).collect();
        for (sep, style) in [(",", LIST_COMPACT), (", ", LIST_SPACED)] {
            let list = format!("[{}]", floats.join(sep));
            let extra = padded(&format!(r#""raw_response":{{"choices":[{{"logprobs":{{"text_offset":[],"token_logprobs":{list},"tokens":["a","b","c","d"]}}}}]}}"#));
            let mut call = call_with(&extra, None);
            call.logprobs = Some(logprobs.to_vec());
            let mut cuts = Vec::new();
            extra_cuts(call.extra.as_deref().unwrap_or_default(), &call, &mut cuts, &mut String::new(), true);
            assert_eq!(cuts.iter().map(|c| (c.reference, c.style)).collect::<Vec<_>>(), [(REF_LOGPROB_LIST, style)]);
            let e = encode(&call, None).expect("a block");
            assert_eq!(e.min_format, super::super::FORMAT_CONTENT_REF);
            assert!(round_trip(&call).is_some());
            assert_eq!(refs_of(&call, false), [REF_LOGPROB; 4], "format 5: one by one");
            // Without its column the splice is refused, not rendered empty.
            let b = open(&e.block, [false, false, false, true]).expect("open");
            assert!(b.resolve(&Columns { prompt: None, completion: &[], logprobs: None, parent: None }).is_err());
            assert!(b.resolve(&Columns { prompt: None, completion: &[], logprobs: Some(&[]), parent: None }).is_err());
        }
        // Not the whole column, or not its rendering: one by one.
        for (list, lps) in [
            (format!("[{}]", floats[..3].join(",")), &logprobs[..]),
            (format!("[{}]", floats.join(",")), &logprobs[..3]),
            (format!("[{},{}, {}, {}]", floats[0], floats[1], floats[2], floats[3]), &logprobs[..]),
            (format!("[{}]", floats.join(",")).replace("-0.5", "-0.50"), &logprobs[..]),
            (format!("[ {}]", floats.join(",")), &logprobs[..]),
        ] {
            near_miss("token_logprobs", &list, lps, REF_LOGPROB_LIST);
        }
    }

    #[test]
    fn a_token_in_prompt_is_a_reference() {
        // A completions request that sends the prompt as ids (rLLM's
        // token-in calls): `raw_request.prompt` is the prompt column again.
        let extra = padded(r#""raw_request":{"model":"m","prompt":[1, 2, 3],"n":1},"raw_response":{"choices":[{"text":"x"}]}"#);
        let call = call_with(&extra, None);
        assert_eq!(refs_of(&call, true), [REF_PROMPT]);
        assert!(round_trip(&call).is_some());
        // Text, nested lists, other ids: verbatim.
        for prompt in [r#""hi""#, "[[1,2,3]]", "[1,2,4]", "[]"] {
            let extra = padded(&format!(r#""raw_request":{{"prompt":{prompt}}}"#));
            let call = call_with(&extra, None);
            assert!(refs_of(&call, true).is_empty(), "{prompt}");
            assert_eq!(round_trip(&call).map(|d| d.extra).unwrap_or(call.extra.clone()), call.extra);
        }
    }

    #[test]
    fn content_splices_are_checked() {
        // A template "x" + `"a""b"` + "y" with reference 8 at offset 1.
        let hole = |offset: u32, arg: u32, lps: &[f32], next: Option<u32>| {
            let text = br#"x"a""b"y"#;
            let mut payload = Vec::new();
            let n = 1 + u32::from(next.is_some());
            payload.extend_from_slice(&[4, 0, 0, 0]);
            payload.put_u32(text.len() as u32);
            payload.put_u32(n);
            payload.extend_from_slice(text);
            for (offset, reference, arg) in [(offset, REF_CONTENT, arg)].into_iter().chain(next.map(|o| (o, REF_LOGPROB, 0))) {
                payload.put_u32(offset);
                payload.put_u8(reference);
                payload.put_u8(if reference == REF_CONTENT { LIST_COMPACT } else { FLOAT_PYTHON });
                payload.put_u16(0);
                payload.put_u32(arg);
            }
            let mut block = vec![CODEC_NONE, 0, 1, 0];
            block.put_u32(payload.len() as u32);
            block.extend_from_slice(&payload);
            let b = open(&block, [false, false, false, true]).expect("open");
            let cols = Columns { prompt: None, completion: &[], logprobs: Some(lps), parent: None };
            b.resolve(&cols).map(|d| String::from_utf8(d.extra.unwrap_or_default()).unwrap_or_default())
        };
        let want = r#"x[{"token":"a","logprob":-1.0,"bytes":[97],"top_logprobs":[]},{"token":"b","logprob":-2.0,"bytes":[98],"top_logprobs":[]}]y"#;
        assert_eq!(hole(1, 6, &[-1.0, -2.0], None).as_deref(), Ok(want));
        assert!(hole(1, 6, &[-1.0, -2.0], Some(7)).is_ok(), "a splice right after the run");
        for (offset, arg, lps, next) in [
            (1, 5, &[-1.0f32, -2.0][..], None), // the run ends inside a literal
            (1, 7, &[-1.0, -2.0], None),        // the run takes the "y"
            (1, 60, &[-1.0, -2.0], None),       // past the text
            (1, 6, &[-1.0], None),              // fewer logprobs than tokens
            (1, 6, &[-1.0, -2.0, -3.0], None),  // more
            (1, 0, &[], None),                  // no token
            (0, 7, &[-1.0, -2.0], None),        // "x" is no literal
            (1, 6, &[-1.0, -2.0], Some(4)),     // a splice inside the run
        ] {
            assert!(hole(offset, arg, lps, next).is_err(), "{offset} {arg} {lps:?} {next:?}");
        }
    }

    #[test]
    fn corrupt_blocks_are_errors() {
        let extra = padded(r#""raw_response":{"prompt_token_ids":[1,2,3]}"#);
        let call = call_with(&extra, None);
        let block = encode(&call, None).expect("block").block;
        let present = [false, false, false, true];
        for cut in 0..block.len() {
            let _ = open(&block[..cut], present).and_then(|b| b.resolve(&Columns { prompt: None, completion: &[], logprobs: None, parent: None }));
        }
        let b = open(&block, present).expect("open");
        assert!(b.needs_prompt());
        assert!(b.resolve(&Columns { prompt: None, completion: &[], logprobs: None, parent: None }).is_err());
        assert!(open(&block, [true, false, false, true]).is_err());
    }
}
