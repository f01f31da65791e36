//! Trace dicts in and out without a JSON text round trip in Python.
//!
//! In: [`call_of_trace`] walks a gateway-shaped trace dict: token lists go
//! straight into the columns, the documents (`messages`, `response_message`,
//! `metadata`, `routing_matrices`, every key without a column) are serialized
//! to JSON text once, here, as `json.dumps(..., allow_nan=False)` would read
//! back: floats as the shortest text that parses back to the same value
//! (always with a `.` or an exponent, so `1.0` stays a float), ints of any
//! size, `True`/`False` before ints, tuples as lists, dict key order kept.
//! NaN and infinities, non-string keys, objects JSON has no value for and
//! documents nested deeper than `JSON_DEPTH_MAX` are refused with an error
//! that names the path inside the trace
//! (`raw_response.choices[0].logprobs.content[17].logprob`); nothing is
//! written then.
//!
//! Out: [`json_to_py_with`] parses a stored JSON text straight into Python objects
//! (dicts keep the key order of the text; floats parsed exactly), falling back
//! to Python's `json.loads` for a text it cannot map exactly (an integer
//! beyond 64 bits, or nesting beyond serde_json's limit).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::{ffi, Borrowed};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt::Write as _;

use crate::{classify, invalid_input, py_error, repr, u32_vec, Number};
use trajlog::trace_json::{self, KEY_ORDER};
use trajlog::Call as RCall;

/// How deeply the containers of one document may nest (`trajlog.JSON_DEPTH_MAX`).
pub(crate) const JSON_DEPTH_MAX: usize = 128;

/// Where a value sits inside the trace; rendered only for an error message.
#[derive(Clone, Copy)]
enum Path<'a> {
    Key(&'a str),
    Child(&'a Path<'a>, &'a str),
    /// A child under a key object whose text was not needed to write it.
    ChildObj(&'a Path<'a>, &'a Bound<'a, PyString>),
    Index(&'a Path<'a>, usize),
}

impl Path<'_> {
    fn render(&self) -> String {
        match self {
            Path::Key(k) => (*k).to_owned(),
            Path::Child(parent, k) => format!("{}.{k}", parent.render()),
            Path::ChildObj(parent, k) => format!("{}.{}", parent.render(), k.to_string_lossy()),
            Path::Index(parent, i) => format!("{}[{i}]", parent.render()),
        }
    }
}

fn refuse(path: &Path<'_>, why: String) -> PyErr {
    invalid_input(format!("invalid {}: {why}", path.render()))
}

/// What a byte of a string becomes in a JSON string literal: 0 for itself,
/// `b'u'` for a `\u00XX` escape, or the letter of a short escape.
static ESCAPE: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = b'u';
        b += 1;
    }
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t[b'\n' as usize] = b'n';
    t[b'\r' as usize] = b'r';
    t[b'\t' as usize] = b't';
    t[0x08] = b'b';
    t[0x0c] = b'f';
    t
};

/// Write `s` as a JSON string literal (raw UTF-8, the escapes JSON requires).
fn write_str(out: &mut String, s: &str) {
    out.reserve(s.len() + 2);
    out.push('"');
    let mut rest = s;
    while let Some(at) = rest.bytes().position(|b| ESCAPE[usize::from(b)] != 0) {
        // `at` is an ASCII byte, so both cuts are on character boundaries.
        let (plain, tail) = rest.split_at(at);
        out.push_str(plain);
        let b = tail.as_bytes().first().copied().unwrap_or_default();
        match ESCAPE[usize::from(b)] {
            b'u' => {
                let _ = write!(out, "\\u{b:04x}");
            }
            letter => {
                out.push('\\');
                out.push(char::from(letter));
            }
        }
        rest = tail.get(1..).unwrap_or_default();
    }
    out.push_str(rest);
    out.push('"');
}

/// A finite float as Python's `repr` writes it (`json.dumps`' text, so the
/// docs block finds a logprob copied from the column): the shortest text
/// that parses back to it, always with a `.` or an exponent.
fn write_float(out: &mut String, v: f64) {
    trace_json::write_py_float(out, v);
}

fn text_of<'a>(path: &Path<'_>, s: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    s.to_cow().map_err(|_| {
        refuse(path, "not valid UTF-8 text (a lone surrogate); pass text without unpaired surrogates".to_owned())
    })
}

/// Dict keys already written as JSON string literals, by the address of the
/// key object (documents repeat the same key objects — `"role"`, `"logprob"`
/// — many times). Only used while the trace, which keeps every key alive,
/// is walked with the GIL held; emptied whenever the walk runs Python code
/// (which could free a key and reuse its address).
type Keys = std::collections::HashMap<usize, String, std::hash::BuildHasherDefault<AddrHasher>>;

/// Hashes an object's address: a multiply and a shift, not SipHash (the
/// addresses come from CPython's allocator, not from a caller).
#[derive(Default)]
struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        // Objects are 16-byte aligned: the low bits carry nothing.
        self.0 = ((n as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Serialize one Python value as JSON text into `out`. `depth` counts the
/// containers around `obj` within its document.
fn write_value(out: &mut String, obj: &Bound<'_, PyAny>, path: &Path<'_>, depth: usize) -> PyResult<()> {
    write_value_with(out, obj, path, depth, &mut Keys::default())
}

/// Whether `obj` is a `str`, `int`, `float`, `bool` or `None` of the exact
/// built-in type: a leaf whose text is written without running Python code,
/// so a borrowed reference to it stays valid while it is written.
fn is_plain_leaf(obj: *mut ffi::PyObject) -> bool {
    // SAFETY: `obj` is a live object (a borrowed reference from a live
    // container); Py_TYPE reads its type and the type objects are static.
    unsafe {
        let ty = ffi::Py_TYPE(obj);
        ty == std::ptr::addr_of_mut!(ffi::PyUnicode_Type)
            || ty == std::ptr::addr_of_mut!(ffi::PyLong_Type)
            || ty == std::ptr::addr_of_mut!(ffi::PyFloat_Type)
            || ty == std::ptr::addr_of_mut!(ffi::PyBool_Type)
            || obj == ffi::Py_None()
    }
}

/// Serialize the list `list` (exact type) item by item. An item that is a
/// plain leaf is written through a borrowed reference; any other is held
/// while it is written (writing it may run Python code), and the length is
/// read again after it.
fn write_list(
    out: &mut String,
    list: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
) -> PyResult<()> {
    let py = list.py();
    open(path, depth)?;
    out.push('[');
    // SAFETY (the blocks below): `list` is a live `list`, which
    // PyList_Size and PyList_GetItem take; PyList_GetItem returns a borrowed
    // reference to the item at an index below the length just read, whose
    // type Py_TYPE reads, and PyLong_AsLongAndOverflow takes an exact int.
    let mut len = unsafe { ffi::PyList_Size(list.as_ptr()) };
    // Room for a list of token ids (most of a trace's long lists) at once,
    // up to 16 MiB.
    out.reserve(usize::try_from(len).unwrap_or_default().saturating_mul(7).min(16 << 20));
    let mut i: ffi::Py_ssize_t = 0;
    while i < len {
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i) };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        if i > 0 {
            out.push(',');
        }
        // An exact int that fits 64 bits, written here (the ids of a list
        // of token ids): no dispatch, no path.
        if unsafe { ffi::Py_TYPE(item) } == std::ptr::addr_of_mut!(ffi::PyLong_Type) && write_int(out, py, item) {
            i += 1;
            continue;
        }
        let at = Path::Index(path, i as usize);
        if is_plain_leaf(item) {
            write_value_with(out, &*unsafe { Borrowed::from_ptr(py, item) }, &at, depth + 1, keys)?;
        } else {
            let item = unsafe { Bound::from_borrowed_ptr(py, item) };
            write_value_with(out, &item, &at, depth + 1, keys)?;
            len = unsafe { ffi::PyList_Size(list.as_ptr()) };
        }
        i += 1;
    }
    out.push(']');
    Ok(())
}

/// Serialize the dict `dict` (exact type) member by member, in its order,
/// with `PyDict_Next`'s borrowed keys and values (a value that is not a
/// plain leaf is held while it is written); `hook` may write a member's
/// value itself.
fn write_dict(
    out: &mut String,
    dict: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
    mut hook: Option<&mut dyn MemberHook>,
) -> PyResult<()> {
    let py = dict.py();
    open(path, depth)?;
    out.push('{');
    // SAFETY: `dict` is a live `dict`; PyDict_Next hands out borrowed
    // references to its key and value at `pos`, valid until the dict
    // changes, which only Python code run while a held value is written
    // could do (the size check below then refuses the document).
    let size = unsafe { ffi::PyDict_Size(dict.as_ptr()) };
    let mut pos: ffi::Py_ssize_t = 0;
    let (mut k, mut v) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut i = 0;
    while unsafe { ffi::PyDict_Next(dict.as_ptr(), &mut pos, &mut k, &mut v) } != 0 {
        if is_plain_leaf(v) {
            let key = unsafe { Borrowed::from_ptr(py, k) };
            let value = unsafe { Borrowed::from_ptr(py, v) };
            write_member(out, i, &key, &value, path, depth, keys, reborrow(&mut hook))?;
        } else {
            // Both held: the key names the path of a refusal inside the value.
            let key = unsafe { Bound::from_borrowed_ptr(py, k) };
            let value = unsafe { Bound::from_borrowed_ptr(py, v) };
            write_member(out, i, &key, &value, path, depth, keys, reborrow(&mut hook))?;
            if unsafe { ffi::PyDict_Size(dict.as_ptr()) } != size {
                return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "{}: the dict changed size while it was written",
                    path.render()
                )));
            }
        }
        i += 1;
    }
    out.push('}');
    Ok(())
}

fn write_value_with(
    out: &mut String,
    obj: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
) -> PyResult<()> {
    // The exact built-in types first, told by their type object alone.
    let ptr = obj.as_ptr();
    // SAFETY: `obj` is live; Py_TYPE reads its type, the type objects are
    // static, and each call below takes an object of the type just checked.
    let ty = unsafe { ffi::Py_TYPE(ptr) };
    if ty == std::ptr::addr_of_mut!(ffi::PyUnicode_Type) {
        // SAFETY: checked just above.
        let s = unsafe { obj.cast_unchecked::<PyString>() };
        write_str(out, &text_of(path, s)?);
        return Ok(());
    }
    if ty == std::ptr::addr_of_mut!(ffi::PyLong_Type) {
        if write_int(out, obj.py(), ptr) {
            return Ok(());
        }
    } else if ty == std::ptr::addr_of_mut!(ffi::PyFloat_Type) {
        // SAFETY: an exact `float`, whose value PyFloat_AsDouble reads without failing.
        return write_finite(out, obj, path, unsafe { ffi::PyFloat_AsDouble(ptr) });
    } else if ty == std::ptr::addr_of_mut!(ffi::PyList_Type) {
        return write_list(out, obj, path, depth, keys);
    } else if ty == std::ptr::addr_of_mut!(ffi::PyDict_Type) {
        return write_dict(out, obj, path, depth, keys, None);
    }
    write_other(out, obj, path, depth, keys)
}

/// Write the exact `int` `item` if it fits 64 bits; false (nothing
/// written) for a bigger one, which the general path writes.
fn write_int(out: &mut String, py: Python<'_>, item: *mut ffi::PyObject) -> bool {
    let mut overflow = 0;
    // SAFETY: the caller checked that `item` is a live exact `int`; -1 with
    // an overflow flag, or -1 with an exception set (not expected for an
    // int), is handled below.
    let v = unsafe { ffi::PyLong_AsLongAndOverflow(item, &mut overflow) };
    if overflow == 0 && (v != -1 || PyErr::take(py).is_none()) {
        push_int(out, v);
        return true;
    }
    false
}

/// Append `v` in decimal, its digits written in place (no formatting
/// buffer copied with a `memcpy` call per number: a trace has ~4,000 ids).
fn push_int(out: &mut String, v: i64) {
    if v < 0 {
        out.push('-');
    }
    let mut n = v.unsigned_abs();
    let len = n.checked_ilog10().map_or(1, |d| d as usize + 1);
    // SAFETY: only ASCII digits are written, so `out` stays UTF-8.
    let bytes = unsafe { out.as_mut_vec() };
    bytes.reserve(len);
    let start = bytes.len();
    let room = bytes.spare_capacity_mut();
    for slot in room.iter_mut().take(len).rev() {
        slot.write(b'0' + (n % 10) as u8);
        n /= 10;
    }
    // SAFETY: the `len` bytes after `start` were just written (`reserve`
    // made room for them).
    unsafe { bytes.set_len(start + len) };
}

/// Write the float value `v` of `obj`, or refuse it when not finite.
fn write_finite(out: &mut String, obj: &Bound<'_, PyAny>, path: &Path<'_>, v: f64) -> PyResult<()> {
    if !v.is_finite() {
        return Err(refuse(path, format!("{} is not a finite number; JSON has no NaN or Infinity", repr(obj))));
    }
    write_float(out, v);
    Ok(())
}

/// Write the items of a list or tuple (a subclass's own storage, as
/// `json.dumps` reads it) as a JSON array.
fn write_items<'py>(
    out: &mut String,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
) -> PyResult<()> {
    open(path, depth)?;
    out.push('[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_value_with(out, &item, &Path::Index(path, i), depth + 1, keys)?;
    }
    out.push(']');
    Ok(())
}

/// Serialize what is not one of the exact types `write_value_with` writes
/// itself: `None`, bools, ints beyond 64 bits, subclasses, tuples.
fn write_other(
    out: &mut String,
    obj: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
) -> PyResult<()> {
    if obj.is_none() {
        out.push_str("null");
    } else if let Ok(s) = obj.cast::<PyString>() {
        write_str(out, &text_of(path, s)?);
    } else if obj.is_exact_instance_of::<PyBool>() {
        out.push_str(if obj.is_truthy()? { "true" } else { "false" });
    } else if obj.is_instance_of::<PyInt>() {
        match obj.extract::<i64>() {
            Ok(v) if obj.is_exact_instance_of::<PyInt>() => {
                push_int(out, v);
            }
            // Beyond 64 bits, or an int subclass (an IntEnum): its decimal
            // digits, as `json.dumps` writes them (`int.__repr__`).
            _ => {
                keys.clear(); // Python code runs
                let digits = obj.py().get_type::<PyInt>().call_method1(intern!(obj.py(), "__repr__"), (obj,))?;
                out.push_str(&digits.extract::<String>()?);
            }
        }
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        write_finite(out, obj, path, f.value())?;
    } else if let Ok(list) = obj.cast::<PyList>() {
        write_items(out, list.iter(), path, depth, keys)?;
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        write_items(out, tuple.iter(), path, depth, keys)?;
    } else if let Ok(dict) = obj.cast::<PyDict>() {
        open(path, depth)?;
        out.push('{');
        // A dict subclass (an `OrderedDict` after `move_to_end`) may order
        // its keys apart from the underlying dict: its `items()`, as
        // `json.dumps` takes them.
        // Its `items()` may be Python code handing out objects made for the
        // occasion and freed after: their keys are cached apart, for this
        // dict's walk only, and what was cached before is dropped.
        keys.clear();
        let mut own = Keys::default();
        for (i, item) in dict.call_method0(intern!(obj.py(), "items"))?.try_iter()?.enumerate() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
            write_member(out, i, &k, &v, path, depth, &mut own, None)?;
            own.clear();
        }
        out.push('}');
    } else {
        let ty = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        return Err(refuse(path, format!("a {ty} ({}) is not JSON-serializable", repr(obj))));
    }
    Ok(())
}

/// Write the `i`-th member `k: v` of an object at `path`; `hook` may write
/// the value itself.
#[allow(clippy::too_many_arguments)]
fn write_member(
    out: &mut String,
    i: usize,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
    hook: Option<&mut dyn MemberHook>,
) -> PyResult<()> {
    let Ok(key) = k.cast::<PyString>() else {
        return Err(refuse(path, format!("the key {} is not a string; JSON object keys are strings", repr(k))));
    };
    if i > 0 {
        out.push(',');
    }
    let addr = key.as_ptr() as usize;
    if hook.is_none() {
        if let Some(literal) = keys.get(&addr) {
            out.push_str(literal);
            out.push(':');
            return write_value_with(out, v, &Path::ChildObj(path, key), depth + 1, keys);
        }
    }
    let key = text_of(path, key)?;
    let mut literal = String::with_capacity(key.len() + 2);
    write_str(&mut literal, &key);
    out.push_str(&literal);
    keys.insert(addr, literal);
    out.push(':');
    let at = Path::Child(path, &key);
    if let Some(hook) = hook {
        if hook.member(&key, out, v, (&at, depth + 1, keys))? {
            return Ok(());
        }
    }
    write_value_with(out, v, &at, depth + 1, keys)
}

/// Refuse a container that would nest deeper than `JSON_DEPTH_MAX`.
fn open(path: &Path<'_>, depth: usize) -> PyResult<()> {
    if depth >= JSON_DEPTH_MAX {
        return Err(py_error(
            "LimitExceededError",
            format!(
                "invalid {}: nested deeper than JSON_DEPTH_MAX ({JSON_DEPTH_MAX} nested lists/dicts); flatten the document",
                path.render()
            ),
        ));
    }
    Ok(())
}

/// `hook` again, for one member.
fn reborrow<'a>(hook: &'a mut Option<&mut dyn MemberHook>) -> Option<&'a mut dyn MemberHook> {
    match hook {
        Some(h) => Some(&mut **h),
        None => None,
    }
}

/// Writes a member's value instead of [`write_value_with`]: true when it did.
trait MemberHook {
    fn member(&mut self, key: &str, out: &mut String, v: &Bound<'_, PyAny>, at: Place<'_, '_>) -> PyResult<bool>;
}

/// The cuts of `raw_request` and `raw_response` that the docs encoder
/// would search the written text for (`trajlog::ExtraCuts`: the columns'
/// copies, `messages` again), found while writing them: each value at one
/// of those places is compared with the column as it is written, on the
/// Python objects (exact built-in types only, read through borrowed
/// references, so no Python code runs meanwhile), into the very text the
/// general writer makes of it, and cut when equal (`messages`: its text
/// compared with the `messages` document's). Anything the search would cut that this does not compare
/// exactly (a tuple, an `int` subclass, logprobs entries that do not
/// match as a whole) makes the walk `incomplete`: the encoder then
/// searches, as before.
pub(crate) struct Found<'c> {
    call: &'c RCall,
    cuts: trajlog::ExtraCuts,
    incomplete: bool,
}

/// Where a value is written: its path, its depth, the key literals cache.
type Place<'p, 'k> = (&'p Path<'p>, usize, &'k mut Keys);

/// Where in a raw body a hooked object sits.
#[derive(Clone, Copy)]
enum Level {
    Request,
    Response,
    /// `raw_response.choices[0]`.
    Choice,
    /// `raw_response.choices[0].logprobs`.
    Logprobs,
}

struct At<'f, 'c> {
    found: &'f mut Found<'c>,
    level: Level,
}

impl Found<'_> {
    /// A value the search could cut that this walk does not compare: the
    /// encoder must search.
    fn unknown(&mut self, v: &Bound<'_, PyAny>) -> bool {
        if !is_plain_leaf(v.as_ptr()) {
            self.incomplete = true;
        }
        false
    }

    /// A list of ids at a prompt (`prompt`) or completion reference's place.
    fn ids(&mut self, out: &mut String, v: &Bound<'_, PyAny>, prompt: bool, at: Place<'_, '_>) -> PyResult<bool> {
        let Ok(list) = v.cast_exact::<PyList>() else { return Ok(self.unknown(v)) };
        open(at.0, at.1)?;
        let column = if prompt { &self.call.prompt_token_ids } else { &self.call.completion_token_ids };
        let start = out.len();
        match write_ids(out, list, column) {
            Some(equal) => {
                if equal {
                    self.cuts.ids(start, out.len(), prompt);
                }
                Ok(true)
            }
            None => {
                self.incomplete = true;
                Ok(false)
            }
        }
    }

    /// A whole logprobs list: vLLM's `choices[0].logprobs.content`
    /// (`content`, reference 8) or the completions API's `token_logprobs`
    /// (reference 9), cut whole when it is the logprob column's; any other
    /// the search cuts entry by entry.
    fn logprobs_list(
        &mut self,
        out: &mut String,
        v: &Bound<'_, PyAny>,
        at: Place<'_, '_>,
        content: bool,
    ) -> PyResult<bool> {
        let Ok(list) = v.cast_exact::<PyList>() else { return Ok(self.unknown(v)) };
        if list.is_empty() {
            return Ok(false);
        }
        let lps = self.call.logprobs.as_deref().unwrap_or_default();
        let start = out.len();
        // A content entry's `bytes` is two levels down: deeper than the
        // limit allows, the general writer refuses the list.
        if at.1 + 2 < JSON_DEPTH_MAX {
            let cut = if content {
                write_content(out, list, lps).is_some_and(|l| self.cuts.content(start, out.len(), l.into_bytes()))
            } else {
                write_logprobs(out, list, lps) && {
                    self.cuts.logprob_list(start, out.len());
                    true
                }
            };
            if cut {
                return Ok(true);
            }
            out.truncate(start);
        }
        self.incomplete = true;
        Ok(false)
    }

    /// `raw_request.messages`: cut when its text is the `messages` document's.
    fn messages(&mut self, out: &mut String, v: &Bound<'_, PyAny>, at: Place<'_, '_>) -> PyResult<bool> {
        let start = out.len();
        write_value_with(out, v, at.0, at.1, at.2)?;
        let messages = self.call.messages.as_deref().unwrap_or_default();
        let delimited = matches!(messages.first(), Some(b'[' | b'{' | b'"'));
        if delimited && out.as_bytes().get(start..) == Some(messages) {
            self.cuts.messages(start, out.len());
        }
        Ok(true)
    }

    /// `raw_response.choices`: its first choice walked for its cuts.
    fn choices(&mut self, out: &mut String, v: &Bound<'_, PyAny>, at: Place<'_, '_>) -> PyResult<bool> {
        let Ok(list) = v.cast_exact::<PyList>() else { return Ok(self.unknown(v)) };
        let (path, depth, keys) = at;
        open(path, depth)?;
        out.push('[');
        let mut i = 0;
        while let Ok(item) = list.get_item(i) {
            if i > 0 {
                out.push(',');
            }
            let item_path = Path::Index(path, i);
            if i == 0 && item.is_exact_instance_of::<PyDict>() {
                let mut hook = At { found: &mut *self, level: Level::Choice };
                write_dict(out, &item, &item_path, depth + 1, keys, Some(&mut hook))?;
            } else {
                if i == 0 {
                    self.unknown(&item);
                }
                write_value_with(out, &item, &item_path, depth + 1, keys)?;
            }
            i += 1;
        }
        out.push(']');
        Ok(true)
    }
}

// The writers below write what `write_value_with` writes for the same
// list, comparing it with a column as they go, in one pass: they read only
// exact built-in types (through borrowed references, running no Python
// code) and give up, writing nothing, on anything else, which the general
// writer then writes (and refuses, where it must).

/// The item `i` of the exact list `list`, borrowed; null past its end.
fn list_item(list: &Bound<'_, PyList>, i: usize) -> *mut ffi::PyObject {
    let Ok(i) = ffi::Py_ssize_t::try_from(i) else { return std::ptr::null_mut() };
    // SAFETY: `list` is a live list; PyList_GetItem returns a borrowed
    // reference (null, with an IndexError set, past the end: cleared by the
    // callers' `PyErr::take` or left for none, as they give up then).
    let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i) };
    if item.is_null() {
        let _ = PyErr::take(list.py());
    }
    item
}

fn is_type(obj: *mut ffi::PyObject, ty: *mut ffi::PyTypeObject) -> bool {
    // SAFETY: `obj` is a live object (callers check for null); Py_TYPE reads its type.
    !obj.is_null() && unsafe { ffi::Py_TYPE(obj) } == ty
}

/// The value of the exact `int` `obj` when it fits 64 bits.
fn int_of(py: Python<'_>, obj: *mut ffi::PyObject) -> Option<i64> {
    if !is_type(obj, std::ptr::addr_of_mut!(ffi::PyLong_Type)) {
        return None;
    }
    let mut overflow = 0;
    // SAFETY: an exact live `int`; -1 with an exception set is handled below.
    let v = unsafe { ffi::PyLong_AsLongAndOverflow(obj, &mut overflow) };
    (overflow == 0 && (v != -1 || PyErr::take(py).is_none())).then_some(v)
}

/// The value of the exact `float` `obj` when finite.
fn float_of(obj: *mut ffi::PyObject) -> Option<f64> {
    if !is_type(obj, std::ptr::addr_of_mut!(ffi::PyFloat_Type)) {
        return None;
    }
    // SAFETY: an exact live `float`, which PyFloat_AsDouble reads without failing.
    let v = unsafe { ffi::PyFloat_AsDouble(obj) };
    v.is_finite().then_some(v)
}

/// The UTF-8 text of the exact `str` `obj`, borrowed from it; None for
/// another type or text with a lone surrogate.
fn str_of<'a>(py: Python<'_>, obj: *mut ffi::PyObject) -> Option<&'a str> {
    if !is_type(obj, std::ptr::addr_of_mut!(ffi::PyUnicode_Type)) {
        return None;
    }
    let mut len: ffi::Py_ssize_t = 0;
    // SAFETY: an exact live `str`; the UTF-8 buffer it returns lives as long
    // as the string, which its container holds while the caller writes it
    // (no Python code runs meanwhile). Null with an exception for a lone
    // surrogate.
    let p = unsafe { ffi::PyUnicode_AsUTF8AndSize(obj, &mut len) };
    if p.is_null() {
        let _ = PyErr::take(py);
        return None;
    }
    // SAFETY: CPython's UTF-8 buffer of `len` bytes, valid UTF-8 (it
    // refused the one text that is not: a lone surrogate).
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), usize::try_from(len).ok()?) };
    // SAFETY: see above.
    Some(unsafe { std::str::from_utf8_unchecked(bytes) })
}

/// Write the exact list `list` of exact ints; `Some(equal to column)`, or
/// None with nothing written when an item is anything else.
fn write_ids(out: &mut String, list: &Bound<'_, PyList>, column: &[u32]) -> Option<bool> {
    let start = out.len();
    let n = list.len();
    let mut equal = n == column.len();
    out.reserve(n.saturating_mul(7).min(16 << 20));
    out.push('[');
    for i in 0..n {
        let Some(v) = int_of(list.py(), list_item(list, i)) else {
            out.truncate(start);
            return None;
        };
        if i > 0 {
            out.push(',');
        }
        push_int(out, v);
        equal &= column.get(i).is_some_and(|&c| i64::from(c) == v);
    }
    out.push(']');
    Some(equal)
}

/// Write the exact list `list` when it is exactly the logprob column `lps`
/// as floats; false (nothing written) otherwise.
fn write_logprobs(out: &mut String, list: &Bound<'_, PyList>, lps: &[f32]) -> bool {
    let start = out.len();
    if list.len() != lps.len() {
        return false;
    }
    out.push('[');
    for (i, &lp) in lps.iter().enumerate() {
        match float_of(list_item(list, i)) {
            Some(v) if v.to_bits() == f64::from(lp).to_bits() => {
                if i > 0 {
                    out.push(',');
                }
                write_float(out, v);
            }
            _ => {
                out.truncate(start);
                return false;
            }
        }
    }
    out.push(']');
    true
}

/// Write the exact list `list` when it is exactly vLLM's
/// `logprobs.content` of the column `lps` — one `{"token", "logprob",
/// "bytes", "top_logprobs": []}` dict per logprob, each logprob the
/// column's value, each `bytes` its token's UTF-8 — and return its token
/// literals back to back; None (nothing written) otherwise.
fn write_content(out: &mut String, list: &Bound<'_, PyList>, lps: &[f32]) -> Option<String> {
    let start = out.len();
    let written = write_content_entries(out, list, lps);
    if written.is_none() {
        out.truncate(start);
    }
    written
}

fn write_content_entries(out: &mut String, list: &Bound<'_, PyList>, lps: &[f32]) -> Option<String> {
    const NAMES: [&str; 4] = ["token", "logprob", "bytes", "top_logprobs"];
    if list.len() != lps.len() || lps.is_empty() {
        return None;
    }
    let py = list.py();
    let mut literals = String::new();
    out.push('[');
    for (i, &lp) in lps.iter().enumerate() {
        let entry = list_item(list, i);
        // SAFETY (the block): `entry` is a live exact dict (checked first);
        // PyDict_Size reads its size and PyDict_Next hands out borrowed
        // references to its members, valid while nothing changes it (no
        // Python code runs here).
        let mut members = [std::ptr::null_mut(); 4];
        unsafe {
            if !is_type(entry, std::ptr::addr_of_mut!(ffi::PyDict_Type)) || ffi::PyDict_Size(entry) != 4 {
                return None;
            }
            let mut pos: ffi::Py_ssize_t = 0;
            for (name, slot) in NAMES.iter().zip(members.iter_mut()) {
                let (mut k, mut v) = (std::ptr::null_mut(), std::ptr::null_mut());
                if ffi::PyDict_Next(entry, &mut pos, &mut k, &mut v) == 0 || str_of(py, k) != Some(*name) {
                    return None;
                }
                *slot = v;
            }
        }
        let [token, logprob, bytes, top] = members;
        let token = str_of(py, token)?;
        let logprob = float_of(logprob).filter(|v| v.to_bits() == f64::from(lp).to_bits())?;
        if !is_type(bytes, std::ptr::addr_of_mut!(ffi::PyList_Type))
            || !is_type(top, std::ptr::addr_of_mut!(ffi::PyList_Type))
        {
            return None;
        }
        // SAFETY: both are live exact lists (checked just above), borrowed
        // from the entry, which the list holds.
        let (bytes, top) = unsafe { (Borrowed::from_ptr(py, bytes), Borrowed::from_ptr(py, top)) };
        // SAFETY: checked to be exact lists.
        let (bytes, top) = unsafe { (bytes.cast_unchecked::<PyList>(), top.cast_unchecked::<PyList>()) };
        if !top.is_empty() || bytes.len() != token.len() {
            return None;
        }
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"token\":");
        let at = out.len();
        write_str(out, token);
        literals.push_str(out.get(at..)?);
        out.push_str(",\"logprob\":");
        write_float(out, logprob);
        out.push_str(",\"bytes\":[");
        for (j, &want) in token.as_bytes().iter().enumerate() {
            if int_of(py, list_item(&bytes, j)) != Some(i64::from(want)) {
                return None;
            }
            if j > 0 {
                out.push(',');
            }
            push_int(out, i64::from(want));
        }
        out.push_str("],\"top_logprobs\":[]}");
    }
    out.push(']');
    Some(literals)
}

impl MemberHook for At<'_, '_> {
    fn member(&mut self, key: &str, out: &mut String, v: &Bound<'_, PyAny>, at: Place<'_, '_>) -> PyResult<bool> {
        let f = &mut *self.found;
        match (self.level, key) {
            (Level::Request, "messages") => f.messages(out, v, at),
            (Level::Request, "prompt") if !f.call.prompt_token_ids.is_empty() => f.ids(out, v, true, at),
            (Level::Response | Level::Choice, "prompt_token_ids") => f.ids(out, v, true, at),
            (Level::Response, "choices") => f.choices(out, v, at),
            (Level::Choice, "token_ids") => f.ids(out, v, false, at),
            (Level::Choice, "logprobs") => {
                if !v.is_exact_instance_of::<PyDict>() {
                    return Ok(f.unknown(v));
                }
                let mut hook = At { found: f, level: Level::Logprobs };
                write_dict(out, v, at.0, at.1, at.2, Some(&mut hook))?;
                Ok(true)
            }
            (Level::Logprobs, "content") => f.logprobs_list(out, v, at, true),
            (Level::Logprobs, "token_logprobs") => f.logprobs_list(out, v, at, false),
            _ => Ok(false),
        }
    }
}

/// `raw_request` or `raw_response` (`key`) as JSON text, with the cuts
/// found in it (offsets into that text) unless the walk is incomplete.
fn raw_body(call: &RCall, key: &str, v: &Bound<'_, PyAny>) -> PyResult<(String, Option<trajlog::ExtraCuts>)> {
    let mut out = String::new();
    let mut found = Found { call, cuts: trajlog::ExtraCuts::default(), incomplete: false };
    let path = Path::Key(key);
    let mut keys = Keys::default();
    if v.is_exact_instance_of::<PyDict>() {
        let level = if key == "raw_request" { Level::Request } else { Level::Response };
        let mut hook = At { found: &mut found, level };
        write_dict(&mut out, v, &path, 0, &mut keys, Some(&mut hook))?;
    } else {
        found.unknown(v);
        write_value_with(&mut out, v, &path, 0, &mut keys)?;
    }
    Ok((out, (!found.incomplete).then_some(found.cuts)))
}

/// One document as JSON text.
fn document(key: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let mut out = String::new();
    write_value(&mut out, obj, &Path::Key(key), 0)?;
    Ok(out.into_bytes())
}

/// A document argument of `Store.append` as JSON text: `obj` serialized here
/// (the writer `append_trace` uses), or, with `is_text`, the text the caller
/// already made of it. `None` and Python's `None` are no document.
pub(crate) fn document_arg(key: &str, obj: Option<&Bound<'_, PyAny>>, is_text: bool) -> PyResult<Option<Vec<u8>>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) if is_text => Ok(Some(o.extract::<String>()?.into_bytes())),
        Some(o) => document(key, o).map(Some),
    }
}

/// `Store.append`'s extra keyword arguments as one JSON object (`None` when
/// there are none): each value serialized as a document of its own, named by
/// its key in a refusal and nested up to `JSON_DEPTH_MAX` (the object around
/// the fields does not count). With `is_text`, the caller's text.
pub(crate) fn extra_arg(extra: Option<&Bound<'_, PyAny>>, is_text: bool) -> PyResult<Option<Vec<u8>>> {
    let Some(extra) = extra.filter(|e| !e.is_none()) else { return Ok(None) };
    if is_text {
        return Ok(Some(extra.extract::<String>()?.into_bytes()));
    }
    let dict = extra.cast::<PyDict>().map_err(|_| invalid_input("invalid extra fields: not a dict".to_owned()))?;
    if dict.is_empty() {
        return Ok(None);
    }
    let mut out = String::from("{");
    let mut keys = Keys::default();
    for (i, (k, v)) in dict.iter().enumerate() {
        let Ok(key) = k.cast::<PyString>() else {
            return Err(invalid_input(format!("invalid extra fields: the key {} is not a string", repr(&k))));
        };
        let key = text_of(&Path::Key("extra fields"), key)?;
        if i > 0 {
            out.push(',');
        }
        write_str(&mut out, &key);
        out.push(':');
        write_value_with(&mut out, &v, &Path::Key(&key), 0, &mut keys)?;
    }
    out.push('}');
    Ok(Some(out.into_bytes()))
}

fn helper<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import(intern!(py, "trajlog"))?.getattr(name)
}

/// A str field (`trace_id`, `model`, ...); the Python helper words a refusal.
fn text(py: Python<'_>, field: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = v.cast::<PyString>() {
        if let Ok(s) = s.to_cow() {
            return Ok(s.into_owned());
        }
    }
    helper(py, "_text")?.call1((field, v))?.extract()
}

fn finite(py: Python<'_>, field: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(f) = v.cast_exact::<PyFloat>() {
        let x = f.value();
        if x.is_finite() && x >= 0.0 {
            return Ok(x);
        }
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("non_negative", true)?;
    helper(py, "_finite")?.call((field, v), Some(&kwargs))?.extract()
}

fn token_ids(py: Python<'_>, field: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        return u32_vec(field, v);
    }
    let arr = helper(py, "_token_ids")?.call1((field, v))?;
    crate::array_vec(field, &arr.extract::<numpy::PyReadonlyArray1<'_, u32>>()?)
}

/// Logprobs of a trace: the float32 column, and the values as given (JSON
/// text) when they are not all floats that are exactly float32 values.
fn logprobs(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<(Vec<f32>, Option<String>)> {
    if !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
        // numpy arrays, array.array, buffers: the Python helper.
        let (column, verbatim) = helper(py, "_trace_logprobs")?
            .call1((v,))?
            .extract::<(numpy::PyReadonlyArray1<'_, f32>, Option<Bound<'_, PyAny>>)>()?;
        let column = crate::array_vec("logprobs", &column)?;
        let verbatim = verbatim.map(|l| document("logprobs", &l).map(|b| String::from_utf8(b).unwrap_or_default()));
        return Ok((column, verbatim.transpose()?));
    }
    let mut column = Vec::with_capacity(v.len().unwrap_or(0));
    let mut all_exact = true;
    crate::for_each_item(v, |i, item| {
        let (narrow, exact) = crate::logprob("logprobs", i, item)?;
        // An int (even one a float32 holds) reads back as an int only from the verbatim values.
        all_exact &= exact && (item.is_exact_instance_of::<PyFloat>() || !matches!(classify(item)?, Number::Int(_)));
        column.push(narrow);
        Ok(())
    })?;
    if all_exact {
        return Ok((column, None));
    }
    // Not all exactly float32 (rare): the values as given, read again.
    let mut verbatim = String::from("[");
    let mut not_finite = None;
    crate::for_each_item(v, |i, item| {
        if i > 0 {
            verbatim.push(',');
        }
        match classify(item)? {
            Number::Float(x) if x.is_finite() => write_float(&mut verbatim, x),
            Number::Float(_) => {
                not_finite.get_or_insert_with(|| (i, repr(item)));
            }
            // An int reads back as an int only from the verbatim values.
            Number::Int(x) => {
                let _ = write!(verbatim, "{x}");
            }
            _ => return Err(invalid_input(format!("invalid logprobs[{i}]: {} changed while it was read", repr(item)))),
        }
        Ok(())
    })?;
    verbatim.push(']');
    if let Some((i, r)) = not_finite {
        return Err(invalid_input(format!(
            "invalid logprobs[{i}]: {r} cannot be kept verbatim beside values that are not float32 \
             (JSON has no NaN or Infinity); pass float32 values"
        )));
    }
    Ok((column, Some(verbatim)))
}

/// The call of a gateway-shaped trace dict, and the cuts of its `extra`
/// found while writing it ([`Found`]; none when the walk could not find
/// them all); a refusal names the field (and the path inside it). `now`
/// fills a missing timestamp.
pub(crate) fn call_of_trace(
    py: Python<'_>,
    trace: &Bound<'_, PyDict>,
    now: f64,
) -> PyResult<(RCall, Option<trajlog::ExtraCuts>)> {
    let mut call = RCall { timestamp: now, ..Default::default() };
    // `raw_request` and `raw_response`, written once the columns and
    // `messages` they may repeat are known.
    let mut raw: Vec<(usize, Bound<'_, PyAny>)> = Vec::new();
    let (mut has_trace_id, mut has_session_id, mut verbatim_logprobs) = (false, false, false);
    // The trace's keys in order, and those kept in `extra` (with whether null).
    let mut order: Vec<String> = Vec::with_capacity(trace.len());
    // The keys without a column (and known ones holding None), with their JSON.
    let mut extra: Vec<(String, String)> = Vec::new();
    fn extra_field(extra: &mut Vec<(String, String)>, key: &str, json: impl Into<String>) {
        extra.push((key.to_owned(), json.into()));
    }
    for (k, v) in trace.iter() {
        let Ok(key) = k.cast::<PyString>() else {
            return Err(invalid_input(format!(
                "invalid trace: the key {} is not a string; trace keys are strings",
                repr(&k)
            )));
        };
        let key = text_of(&Path::Key("trace"), key)?;
        let key: &str = &key;
        if key == KEY_ORDER {
            return Err(invalid_input(
                "invalid trace: a key named \"\\u0000key_order\" is reserved by trajlog".to_owned(),
            ));
        }
        order.push(key.to_owned());
        if v.is_none() && key != "trace_id" && key != "session_id" {
            // A known field holding None is kept verbatim: it reads back as None.
            extra_field(&mut extra, key, "null");
            continue;
        }
        match key {
            "trace_id" => {
                if !v.is_none() {
                    call.trace_id = text(py, key, &v)?;
                    has_trace_id = true;
                }
            }
            "session_id" => {
                if !v.is_none() {
                    call.session_id = text(py, key, &v)?;
                    has_session_id = true;
                }
            }
            "prompt_token_ids" => call.prompt_token_ids = token_ids(py, key, &v)?,
            "completion_token_ids" => call.completion_token_ids = token_ids(py, key, &v)?,
            "logprobs" => {
                let (column, verbatim) = logprobs(py, &v)?;
                call.logprobs = Some(column);
                if let Some(text) = verbatim {
                    // The caller's values, for `to_dict`; the column holds the nearest float32.
                    extra_field(&mut extra, key, text);
                    verbatim_logprobs = true;
                }
            }
            "session_uids" => {
                let uids: Vec<String> = if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
                    let mut uids = Vec::new();
                    crate::for_each_item(&v, |i, u| {
                        uids.push(text(py, &format!("session_uids[{i}]"), u)?);
                        Ok(())
                    })?;
                    uids
                } else {
                    helper(py, "_session_uids")?.call1((&v,))?.extract()?
                };
                if uids.is_empty() {
                    // No column value tells an empty list from none: kept verbatim.
                    extra_field(&mut extra, key, "[]");
                }
                call.session_uids = uids;
            }
            "timestamp" => call.timestamp = finite(py, key, &v)?,
            "latency_ms" => call.latency_ms = Some(finite(py, key, &v)?),
            "model" => call.model = Some(text(py, key, &v)?),
            "finish_reason" => call.finish_reason = Some(text(py, key, &v)?),
            "weight_version" => {
                let w = if v.is_exact_instance_of::<PyBool>() { None } else { v.extract::<i64>().ok() };
                call.weight_version = Some(w.filter(|_| v.is_instance_of::<PyInt>()).ok_or_else(|| {
                    invalid_input(format!("invalid weight_version: {} is not an integer in the int64 range", repr(&v)))
                })?);
            }
            "messages" => call.messages = Some(document(key, &v)?),
            "response_message" => call.response_message = Some(document(key, &v)?),
            "metadata" => call.metadata = Some(document(key, &v)?),
            "routing_matrices" => call.routing_matrices = Some(document(key, &v)?),
            "raw_request" | "raw_response" => {
                raw.push((extra.len(), v));
                extra_field(&mut extra, key, String::new());
            }
            _ => {
                let mut json = String::new();
                write_value(&mut json, &v, &Path::Key(key), 0)?;
                extra_field(&mut extra, key, json);
            }
        }
    }
    let mut found_in: Vec<(&'static str, trajlog::ExtraCuts)> = Vec::new();
    let mut incomplete = false;
    for (at, v) in raw {
        let Some((key, json)) = extra.get_mut(at) else { continue };
        let key: &'static str = if key == "raw_request" { "raw_request" } else { "raw_response" };
        let (text, cuts) = raw_body(&call, key, &v)?;
        *json = text;
        match cuts {
            Some(cuts) => found_in.push((key, cuts)),
            None => incomplete = true,
        }
    }
    for (key, present) in [("trace_id", has_trace_id), ("session_id", has_session_id)] {
        if !present {
            return Err(invalid_input(format!("invalid {key}: missing; every trace needs a {key} string")));
        }
    }
    // `extra` sorted by key, as `trajlog ingest` writes it; the key order
    // kept when the default export order (which reads verbatim logprobs
    // from `extra`, not from the column) would not give it back.
    extra.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let keys: Vec<(&str, bool)> = extra.iter().map(|(k, json)| (k.as_str(), json == "null")).collect();
    let order: Vec<&str> = order.iter().map(String::as_str).collect();
    let column = if verbatim_logprobs { call.logprobs.take() } else { None };
    let kept = trace_json::key_order(&call, &keys, &order);
    if verbatim_logprobs {
        call.logprobs = column;
    }
    if let Some(kept) = kept {
        let at = extra.partition_point(|(k, _)| k.as_str() < KEY_ORDER);
        extra.insert(at, (KEY_ORDER.to_owned(), kept));
    }
    let mut found = trajlog::ExtraCuts::default();
    if !extra.is_empty() {
        let mut out = String::with_capacity(2 + extra.iter().map(|(k, v)| k.len() + v.len() + 4).sum::<usize>());
        out.push('{');
        for (i, (k, v)) in extra.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_str(&mut out, k);
            out.push(':');
            if let Some(at) = found_in.iter().position(|(key, _)| key == k) {
                found.extend_at(found_in.swap_remove(at).1, out.len());
            }
            out.push_str(v);
        }
        out.push('}');
        call.extra = Some(out.into_bytes());
    }
    Ok((call, (!incomplete).then_some(found)))
}

// ---- Out: JSON text straight into Python objects ----

/// Dict keys already made into Python strings, by their text: a trace's
/// documents repeat a few keys thousands of times (`"token"`, `"logprob"`,
/// `"bytes"` in every logprobs entry), and a shared key object is neither
/// allocated, decoded nor hashed again (`json.loads` memoizes its keys
/// too). A direct-mapped cache of `KEY_MEMO_SLOTS` slots: a key whose slot
/// holds another is made afresh and takes the slot, so a lookup is O(1)
/// whatever the keys (no chains for colliding keys to grow), and keys longer
/// than `KEY_MEMO_KEY_BYTES` are never kept.
pub(crate) struct KeyMemo<'py> {
    slots: Vec<Option<(Box<str>, Bound<'py, PyString>)>>,
}

const KEY_MEMO_SLOTS: usize = 1024;
const KEY_MEMO_KEY_BYTES: usize = 64;

impl<'py> KeyMemo<'py> {
    pub(crate) fn new() -> Self {
        KeyMemo { slots: Vec::new() }
    }

    pub(crate) fn key(&mut self, py: Python<'py>, k: &str) -> Bound<'py, PyString> {
        if k.len() > KEY_MEMO_KEY_BYTES {
            return PyString::new(py, k);
        }
        if self.slots.is_empty() {
            self.slots.resize_with(KEY_MEMO_SLOTS, || None);
        }
        // FNV-1a over the key's bytes, folded to a slot.
        let hash = k.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        let at = (hash ^ (hash >> 32)) as usize % KEY_MEMO_SLOTS;
        let Some(slot) = self.slots.get_mut(at) else { return PyString::new(py, k) };
        match slot {
            Some((text, s)) if **text == *k => s.clone(),
            _ => {
                let s = PyString::new(py, k);
                *slot = Some((k.into(), s.clone()));
                s
            }
        }
    }
}

/// Number objects a document may share with a call's columns. An id at
/// position `i` of any list of a document (`raw_response.prompt_token_ids`
/// repeats the prompt) that equals a token column's id at `i` is that
/// column list's int object, and a float of the entry at position `i` of a
/// list (`raw_response...logprobs.content[i].logprob`) with the bits of the
/// logprob column's `i`-th value is that list's float object, not new ones:
/// numbers are immutable, so one object of the value is as good as
/// another, and thousands are neither allocated nor freed per call.
pub(crate) struct NumberPool<'a, 'py> {
    /// The token columns with their lists.
    pub(crate) columns: Vec<(&'a [u32], Bound<'py, PyList>)>,
    /// The logprob column (widened) with its list.
    pub(crate) logprobs: Option<(&'a [f32], Bound<'py, PyList>)>,
}

impl<'py> NumberPool<'_, 'py> {
    /// The pooled int object of value `v` at list position `i`, if any.
    pub(crate) fn get(&self, i: usize, v: u64) -> Option<Bound<'py, PyAny>> {
        // CPython keeps its own objects of -5..=256.
        if v <= 256 {
            return None;
        }
        self.columns.iter().find(|(ids, _)| ids.get(i).is_some_and(|&x| u64::from(x) == v))?.1.get_item(i).ok()
    }

    /// The pooled float object with the bits of `v` at list position `i`, if any.
    pub(crate) fn float(&self, i: usize, v: f64) -> Option<Bound<'py, PyAny>> {
        let (values, list) = self.logprobs.as_ref()?;
        let lp = values.get(i)?;
        (f64::from(*lp).to_bits() == v.to_bits()).then(|| list.get_item(i).ok()).flatten()
    }
}

/// Builds the Python object of one JSON value. `maybe_big` is set when a
/// number could have been an integer beyond 64 bits (serde_json reads those
/// as floats): the caller then parses the text with `json.loads` instead.
/// `index`: the value's position in the list around it, or, for a member
/// of an object, the object's (`usize::MAX` outside any list).
#[derive(Clone, Copy)]
struct PySeed<'a, 'py> {
    py: Python<'py>,
    maybe_big: &'a Cell<bool>,
    keys: &'a std::cell::RefCell<&'a mut KeyMemo<'py>>,
    pool: &'a NumberPool<'a, 'py>,
    index: usize,
}

/// A dict key: its memoized string.
struct KeySeed<'a, 'py>(PySeed<'a, 'py>);

fn de_err<E: serde::de::Error>(e: PyErr) -> E {
    E::custom(e.to_string())
}

impl<'de, 'py> DeserializeSeed<'de> for PySeed<'_, 'py> {
    type Value = Bound<'py, PyAny>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, 'py> DeserializeSeed<'de> for KeySeed<'_, 'py> {
    type Value = Bound<'py, PyString>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de, 'py> Visitor<'de> for KeySeed<'_, 'py> {
    type Value = Bound<'py, PyString>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object key")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.keys.borrow_mut().key(self.0.py, v))
    }
}

impl<'de, 'py> Visitor<'de> for PySeed<'_, 'py> {
    type Value = Bound<'py, PyAny>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.py.None().into_bound(self.py))
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        let Ok(v) = v.into_pyobject(self.py);
        Ok(v.into_any())
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        if let Some(shared) = self.pool.get(self.index, v) {
            return Ok(shared);
        }
        let Ok(v) = v.into_pyobject(self.py);
        Ok(v.into_any())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // An integer literal beyond 64 bits arrives here as a float.
        if v.fract() == 0.0 && v.abs() >= 9.2e18 {
            self.maybe_big.set(true);
        }
        if let Some(shared) = self.pool.float(self.index, v) {
            return Ok(shared);
        }
        Ok(PyFloat::new(self.py, v).into_any())
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PyString::new(self.py, v).into_any())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(PySeed { index: items.len(), ..self })? {
            items.push(item);
        }
        PyList::new(self.py, items).map(Bound::into_any).map_err(de_err)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let dict = PyDict::new(self.py);
        // Members take the object's position (a logprobs entry's `logprob`).
        while let Some(key) = map.next_key_seed(KeySeed(self))? {
            let value = map.next_value_seed(self)?;
            dict.set_item(key, value).map_err(de_err)?;
        }
        Ok(dict.into_any())
    }
}

/// The Python object of a JSON text (see the module doc), with dict keys
/// shared through `keys` (across the calls of one read) and ints through
/// `pool`.
pub(crate) fn json_to_py_with<'py>(
    py: Python<'py>,
    text: &str,
    keys: &mut KeyMemo<'py>,
    pool: &NumberPool<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let maybe_big = Cell::new(false);
    let keys = std::cell::RefCell::new(keys);
    let mut de = serde_json::Deserializer::from_str(text);
    let seed = PySeed { py, maybe_big: &maybe_big, keys: &keys, pool, index: usize::MAX };
    let parsed = seed.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    match parsed {
        Ok(v) if !maybe_big.get() => Ok(v),
        _ => py.import(intern!(py, "json"))?.call_method1(intern!(py, "loads"), (text,)),
    }
}
