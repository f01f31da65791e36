//! A call's `extra` built into Python objects straight from its docs-block
//! template (format-spec/record.md §7): the values the block keeps as
//! references to the columns (`raw_response.prompt_token_ids`,
//! `choices[0].token_ids`, each `logprobs.content[i].logprob` and `bytes`)
//! are made from the columns' Python lists, not rendered as JSON text and
//! parsed back; the template's own text is parsed here.
//!
//! Exactness: [`build`] returns a value only when the template parsed as JSON
//! with every hole at a value's position, so the rendered text is valid JSON
//! that `json.loads` reads as this very value. Anything else (an integer
//! beyond 64 bits, a lone surrogate, a control character in a string,
//! `NaN`, nesting beyond the limit, a hole where no value starts, text that
//! is not JSON) returns `None`, and the caller renders the text and parses it
//! as before.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PyString};
use std::borrow::Cow;

use crate::trace_dict::{KeyMemo, NumberPool, JSON_DEPTH_MAX};
use trajlog::{Hole, Spliced};

/// Containers nested deeper than the walker writes them are left to the
/// text path.
const DEPTH_MAX: usize = JSON_DEPTH_MAX;

/// What the holes are made of: the call's column lists (shared with the
/// dict's own `prompt_token_ids`, `completion_token_ids` and `logprobs`) and
/// its rendered `messages`.
pub(crate) struct Sources<'a, 'py> {
    pub(crate) prompt: &'a Bound<'py, PyList>,
    pub(crate) completion: &'a Bound<'py, PyList>,
    pub(crate) logprobs: Option<&'a Bound<'py, PyList>>,
    /// The dict's `messages` (its copy in `extra` is a copy of it).
    pub(crate) messages: Option<&'a Bound<'py, PyAny>>,
}

/// Why a build stopped: the text path must decide, or Python raised.
enum Stop {
    Bail,
    Py(PyErr),
}

impl From<PyErr> for Stop {
    fn from(e: PyErr) -> Self {
        Stop::Py(e)
    }
}

type Built<'py> = Result<Bound<'py, PyAny>, Stop>;

/// The Python object of `spliced`'s document, or `None` when the text path
/// must build it (see the module doc).
pub(crate) fn build<'py>(
    py: Python<'py>,
    spliced: &Spliced,
    src: &Sources<'_, 'py>,
    keys: &mut KeyMemo<'py>,
    pool: &NumberPool<'_, 'py>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Ok(text) = std::str::from_utf8(spliced.text()) else { return Ok(None) };
    let mut p =
        Parser { py, t: text.as_bytes(), s: text, pos: 0, holes: &spliced.holes, next: 0, keys, pool, src, depth: 0 };
    match p.document() {
        Ok(v) => Ok(Some(v)),
        Err(Stop::Bail) => Ok(None),
        Err(Stop::Py(e)) => Err(e),
    }
}

struct Parser<'a, 'k, 'py> {
    py: Python<'py>,
    t: &'a [u8],
    /// `t` as text (checked UTF-8 once).
    s: &'a str,
    pos: usize,
    holes: &'a [(usize, Hole)],
    /// The first hole not yet filled.
    next: usize,
    keys: &'k mut KeyMemo<'py>,
    pool: &'a NumberPool<'a, 'py>,
    src: &'a Sources<'a, 'py>,
    depth: usize,
}

impl<'a, 'py> Parser<'a, '_, 'py> {
    /// The whole text as one value, every hole filled.
    fn document(&mut self) -> Built<'py> {
        let v = self.value(usize::MAX)?;
        self.ws();
        if self.pos != self.t.len() || self.next != self.holes.len() {
            return Err(Stop::Bail);
        }
        Ok(v)
    }

    fn ws(&mut self) {
        while matches!(self.t.get(self.pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// The value starting here (after any whitespace): a hole's value when
    /// the next hole is here. `index`: the value's position in its list, or
    /// its object's (for the number pool).
    fn value(&mut self, index: usize) -> Built<'py> {
        let start = self.pos;
        self.ws();
        if let Some(&(at, hole)) = self.holes.get(self.next) {
            // A cut value started after the whitespace before it; the
            // whitespace after it is left in the template too.
            if (start..=self.pos).contains(&at) {
                self.next += 1;
                self.pos = at;
                return self.hole(hole);
            }
            if at < start {
                return Err(Stop::Bail);
            }
        }
        match self.t.get(self.pos) {
            Some(b'{') => self.nested(|p| p.object(index)),
            Some(b'[') => self.nested(Parser::array),
            Some(b'"') => {
                let s = self.string()?;
                Ok(PyString::new(self.py, &s).into_any())
            }
            Some(b't') => self.literal("true", PyBool::new(self.py, true).to_owned().into_any()),
            Some(b'f') => self.literal("false", PyBool::new(self.py, false).to_owned().into_any()),
            Some(b'n') => self.literal("null", self.py.None().into_bound(self.py)),
            Some(b'-' | b'0'..=b'9') => self.number(index),
            _ => Err(Stop::Bail),
        }
    }

    fn nested(&mut self, f: impl FnOnce(&mut Self) -> Built<'py>) -> Built<'py> {
        if self.depth >= DEPTH_MAX {
            return Err(Stop::Bail);
        }
        self.depth += 1;
        let v = f(self);
        self.depth -= 1;
        v
    }

    fn literal(&mut self, word: &str, v: Bound<'py, PyAny>) -> Built<'py> {
        if !self.t.get(self.pos..).is_some_and(|r| r.starts_with(word.as_bytes())) {
            return Err(Stop::Bail);
        }
        self.pos += word.len();
        Ok(v)
    }

    fn object(&mut self, index: usize) -> Built<'py> {
        let dict = PyDict::new(self.py);
        self.pos += 1;
        self.ws();
        if self.t.get(self.pos) == Some(&b'}') {
            self.pos += 1;
            return Ok(dict.into_any());
        }
        loop {
            self.ws();
            if self.t.get(self.pos) != Some(&b'"') {
                return Err(Stop::Bail);
            }
            let key = match self.string()? {
                Cow::Borrowed(k) => self.keys.key(self.py, k),
                Cow::Owned(k) => PyString::new(self.py, &k),
            };
            self.ws();
            if self.t.get(self.pos) != Some(&b':') {
                return Err(Stop::Bail);
            }
            self.pos += 1;
            // Members take the object's position (a logprobs entry's `logprob`).
            let v = self.value(index)?;
            dict.set_item(key, v)?;
            self.ws();
            match self.t.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(dict.into_any());
                }
                _ => return Err(Stop::Bail),
            }
        }
    }

    fn array(&mut self) -> Built<'py> {
        self.pos += 1;
        let mut items: Vec<Bound<'py, PyAny>> = Vec::new();
        let start = self.pos;
        self.ws();
        // An empty list, unless a hole is its only item.
        let hole_here = self.holes.get(self.next).is_some_and(|&(at, _)| (start..=self.pos).contains(&at));
        if self.t.get(self.pos) == Some(&b']') && !hole_here {
            self.pos += 1;
            return Ok(PyList::empty(self.py).into_any());
        }
        self.pos = start;
        loop {
            let v = self.value(items.len())?;
            items.push(v);
            self.ws();
            match self.t.get(self.pos) {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(PyList::new(self.py, items)?.into_any());
                }
                _ => return Err(Stop::Bail),
            }
        }
    }

    /// The string literal here (at its `"`), unescaped; the position moves
    /// past it.
    fn string(&mut self) -> Result<Cow<'a, str>, Stop> {
        let text: &'a str = self.s;
        let (s, end) = string_at(self.t, text, self.pos).ok_or(Stop::Bail)?;
        self.pos = end;
        Ok(s)
    }

    /// A number as `json.loads` reads it: an int without a fraction or an
    /// exponent, else a float (`float()` of the text, correctly rounded, as
    /// Rust's parse is).
    fn number(&mut self, index: usize) -> Built<'py> {
        let t = self.t;
        let start = self.pos;
        let mut i = start;
        if t.get(i) == Some(&b'-') {
            i += 1;
        }
        let int_start = i;
        match t.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while t.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
            }
            _ => return Err(Stop::Bail),
        }
        let int_digits = i - int_start;
        // One or more digits from `i`: where they end.
        let digits = |mut i: usize| {
            let d = i;
            while t.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            if i == d {
                Err(Stop::Bail)
            } else {
                Ok(i)
            }
        };
        let mut float = false;
        if t.get(i) == Some(&b'.') {
            i = digits(i + 1)?;
            float = true;
        }
        if matches!(t.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(t.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            i = digits(i)?;
            float = true;
        }
        let text = self.s.get(start..i).ok_or(Stop::Bail)?;
        self.pos = i;
        if float {
            let v: f64 = text.parse().map_err(|_| Stop::Bail)?;
            if let Some(shared) = self.pool.float(index, v) {
                return Ok(shared);
            }
            return Ok(PyFloat::new(self.py, v).into_any());
        }
        // Beyond 20 digits an integer passes 64 bits: the text path.
        if int_digits > 20 {
            return Err(Stop::Bail);
        }
        let v: i128 = text.parse().map_err(|_| Stop::Bail)?;
        if let Ok(u) = u64::try_from(v) {
            if let Some(shared) = self.pool.get(index, u) {
                return Ok(shared);
            }
            let Ok(v) = u.into_pyobject(self.py);
            return Ok(v.into_any());
        }
        let v = i64::try_from(v).map_err(|_| Stop::Bail)?;
        let Ok(v) = v.into_pyobject(self.py);
        Ok(v.into_any())
    }

    /// The value of a hole, from the columns' lists.
    fn hole(&mut self, hole: Hole) -> Built<'py> {
        let src = self.src;
        match hole {
            Hole::Prompt { .. } => Ok(src.prompt.get_slice(0, src.prompt.len()).into_any()),
            Hole::Completion { .. } => Ok(src.completion.get_slice(0, src.completion.len()).into_any()),
            Hole::Logprob(i) => Ok(src.logprobs.ok_or(Stop::Bail)?.get_item(i as usize).map_err(|_| Stop::Bail)?),
            Hole::TokenBytes { token_at, .. } => {
                let (token, _) = string_at(self.t, self.s, token_at).ok_or(Stop::Bail)?;
                Ok(PyList::new(self.py, token.bytes())?.into_any())
            }
            Hole::Messages => Ok(deep_copy(src.messages.ok_or(Stop::Bail)?, 0)?),
            Hole::Content { end, .. } => self.content(end),
            Hole::Logprobs { .. } => {
                let logprobs = src.logprobs.ok_or(Stop::Bail)?;
                Ok(logprobs.get_slice(0, logprobs.len()).into_any())
            }
            Hole::ParentMessages | Hole::ParentResponse => Err(Stop::Bail),
        }
    }
}

impl<'py> Parser<'_, '_, 'py> {
    /// vLLM's `logprobs.content` list from the token literals here (up to
    /// `end`, where the parse goes on) and the logprob column's floats.
    fn content(&mut self, end: usize) -> Built<'py> {
        let logprobs = self.src.logprobs.ok_or(Stop::Bail)?;
        let mut items: Vec<Bound<'py, PyAny>> = Vec::with_capacity(logprobs.len());
        let [k_token, k_logprob, k_bytes, k_top] =
            ["token", "logprob", "bytes", "top_logprobs"].map(|k| self.keys.key(self.py, k));
        let mut i = self.pos;
        while i < end {
            let (token, next) = string_at(self.t, self.s, i).ok_or(Stop::Bail)?;
            let entry = PyDict::new(self.py);
            entry.set_item(&k_token, PyString::new(self.py, &token))?;
            let logprob = logprobs.get_item(items.len()).map_err(|_| Stop::Bail)?;
            entry.set_item(&k_logprob, logprob)?;
            entry.set_item(&k_bytes, PyList::new(self.py, token.bytes())?)?;
            entry.set_item(&k_top, PyList::empty(self.py))?;
            items.push(entry.into_any());
            i = next;
        }
        if i != end || items.len() != logprobs.len() {
            return Err(Stop::Bail);
        }
        self.pos = end;
        Ok(PyList::new(self.py, items)?.into_any())
    }
}

/// A copy of `v` with lists and dicts of its own: what parsing its text
/// again makes (strings and numbers are immutable, so the copy shares them).
fn deep_copy<'py>(v: &Bound<'py, PyAny>, depth: usize) -> Result<Bound<'py, PyAny>, Stop> {
    if depth > DEPTH_MAX {
        return Err(Stop::Bail);
    }
    if let Ok(list) = v.cast_exact::<PyList>() {
        let items = list.iter().map(|x| deep_copy(&x, depth + 1)).collect::<Result<Vec<_>, _>>()?;
        return Ok(PyList::new(v.py(), items)?.into_any());
    }
    if let Ok(dict) = v.cast_exact::<PyDict>() {
        let out = PyDict::new(v.py());
        for (k, x) in dict.iter() {
            out.set_item(k, deep_copy(&x, depth + 1)?)?;
        }
        return Ok(out.into_any());
    }
    Ok(v.clone())
}

/// The string literal at `at` of `t` (`s` is the same text), unescaped as
/// `json.loads` does, and the position after it; `None` for what `json.loads`
/// would refuse or make a lone surrogate of, and for a control character.
fn string_at<'s>(t: &[u8], s: &'s str, at: usize) -> Option<(Cow<'s, str>, usize)> {
    if t.get(at) != Some(&b'"') {
        return None;
    }
    let body = at + 1;
    let mut i = plain_run_end(t, body);
    match *t.get(i)? {
        b'"' => return Some((Cow::Borrowed(s.get(body..i)?), i + 1)),
        b'\\' => {}
        _ => return None,
    }
    let mut out = String::from(s.get(body..i)?);
    loop {
        match *t.get(i)? {
            b'"' => return Some((Cow::Owned(out), i + 1)),
            b'\\' => {
                let e = *t.get(i + 1)?;
                i += 2;
                match e {
                    b'"' => out.push('"'),
                    b'\\' => out.push('\\'),
                    b'/' => out.push('/'),
                    b'b' => out.push('\u{8}'),
                    b'f' => out.push('\u{c}'),
                    b'n' => out.push('\n'),
                    b'r' => out.push('\r'),
                    b't' => out.push('\t'),
                    b'u' => {
                        let hi = hex4(t, i)?;
                        i += 4;
                        let c = match hi {
                            0xD800..=0xDBFF => {
                                // Only a pair makes a character; a lone half
                                // is left to `json.loads`.
                                if t.get(i..i + 2)? != b"\\u" {
                                    return None;
                                }
                                let lo = hex4(t, i + 2)?;
                                if !(0xDC00..=0xDFFF).contains(&lo) {
                                    return None;
                                }
                                i += 6;
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            }
                            0xDC00..=0xDFFF => return None,
                            c => c,
                        };
                        out.push(char::from_u32(c)?);
                    }
                    _ => return None,
                }
            }
            c if c < 0x20 => return None,
            _ => {
                // Copy up to the next quote or backslash at once.
                let end = plain_run_end(t, i);
                out.push_str(s.get(i..end)?);
                i = end;
            }
        }
    }
}

/// The first position from `i` of a `"`, a `\\` or a control character
/// (or the end): where a string's plain run stops. Eight bytes at a time.
fn plain_run_end(t: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // Whether a byte of `v` is below `n` (n <= 128): exact as a yes/no.
    let below = |v: u64, n: u8| v.wrapping_sub(ONES * u64::from(n)) & !v & HIGHS != 0;
    while let Some(chunk) = t.get(i..i + 8) {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else { break };
        let x = u64::from_le_bytes(bytes);
        if below(x, 0x20) || below(x ^ (ONES * u64::from(b'"')), 1) || below(x ^ (ONES * u64::from(b'\\')), 1) {
            break;
        }
        i += 8;
    }
    while let Some(&c) = t.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        i += 1;
    }
    i
}

fn hex4(t: &[u8], i: usize) -> Option<u32> {
    let h = t.get(i..i + 4)?;
    let s = std::str::from_utf8(h).ok()?;
    if !h.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}
