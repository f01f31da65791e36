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
//! Out: [`json_to_py`] parses a stored JSON text straight into Python objects
//! (dicts keep the key order of the text; floats parsed exactly), falling back
//! to Python's `json.loads` for a text it cannot map exactly (an integer
//! beyond 64 bits, or nesting beyond serde_json's limit).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt::Write as _;

use crate::{classify, invalid_input, py_error, repr, u32_vec, Number};
use trajlog::trace_json::{self, KEY_ORDER};
use trajlog::Call as RCall;

/// How deeply the containers of one document may nest (`trajlog.JSON_DEPTH_MAX`).
const JSON_DEPTH_MAX: usize = 128;

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

/// Write `s` as a JSON string literal (raw UTF-8, the escapes JSON requires).
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if esc.is_empty() {
            let _ = write!(out, "\\u{b:04x}");
        } else {
            out.push_str(esc);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// A finite float as the shortest text that parses back to it; always with
/// a `.` or an exponent, so it reads back as a float.
fn write_float(out: &mut String, v: f64) {
    let _ = write!(out, "{v:?}");
}

fn text_of<'a>(path: &Path<'_>, s: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    s.to_cow().map_err(|_| {
        refuse(path, "not valid UTF-8 text (a lone surrogate); pass text without unpaired surrogates".to_owned())
    })
}

/// Dict keys already written as JSON string literals, by the address of the
/// key object (documents repeat the same key objects — `"role"`, `"logprob"`
/// — many times). Only used while the trace, which keeps every key alive,
/// is walked with the GIL held.
type Keys = std::collections::HashMap<usize, String>;

/// Serialize one Python value as JSON text into `out`. `depth` counts the
/// containers around `obj` within its document.
fn write_value(out: &mut String, obj: &Bound<'_, PyAny>, path: &Path<'_>, depth: usize) -> PyResult<()> {
    write_value_with(out, obj, path, depth, &mut Keys::new())
}

fn write_value_with(
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
                out.push_str(itoa::Buffer::new().format(v));
            }
            // Beyond 64 bits, or an int subclass (an IntEnum): its decimal
            // digits, as `json.dumps` writes them (`int.__repr__`).
            _ => {
                let digits = obj.py().get_type::<PyInt>().call_method1(intern!(obj.py(), "__repr__"), (obj,))?;
                out.push_str(&digits.extract::<String>()?);
            }
        }
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        let v = f.value();
        if !v.is_finite() {
            return Err(refuse(path, format!("{} is not a finite number; JSON has no NaN or Infinity", repr(obj))));
        }
        write_float(out, v);
    } else if let Ok(list) = obj.cast::<PyList>() {
        open(path, depth)?;
        out.push('[');
        for (i, item) in list.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_value_with(out, &item, &Path::Index(path, i), depth + 1, keys)?;
        }
        out.push(']');
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        open(path, depth)?;
        out.push('[');
        for (i, item) in tuple.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_value_with(out, &item, &Path::Index(path, i), depth + 1, keys)?;
        }
        out.push(']');
    } else if let Ok(dict) = obj.cast::<PyDict>() {
        open(path, depth)?;
        out.push('{');
        if obj.is_exact_instance_of::<PyDict>() {
            for (i, (k, v)) in dict.iter().enumerate() {
                write_member(out, i, &k, &v, path, depth, keys)?;
            }
        } else {
            // A dict subclass (an `OrderedDict` after `move_to_end`) may order
            // its keys apart from the underlying dict: its `items()`, as
            // `json.dumps` takes them.
            for (i, item) in obj.call_method0(intern!(obj.py(), "items"))?.try_iter()?.enumerate() {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
                write_member(out, i, &k, &v, path, depth, keys)?;
            }
        }
        out.push('}');
    } else {
        let ty = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        return Err(refuse(path, format!("a {ty} ({}) is not JSON-serializable", repr(obj))));
    }
    Ok(())
}

/// Write the `i`-th member `k: v` of an object at `path`.
fn write_member(
    out: &mut String,
    i: usize,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    path: &Path<'_>,
    depth: usize,
    keys: &mut Keys,
) -> PyResult<()> {
    let Ok(key) = k.cast::<PyString>() else {
        return Err(refuse(path, format!("the key {} is not a string; JSON object keys are strings", repr(k))));
    };
    if i > 0 {
        out.push(',');
    }
    let addr = key.as_ptr() as usize;
    if let Some(literal) = keys.get(&addr) {
        out.push_str(literal);
        out.push(':');
        return write_value_with(out, v, &Path::ChildObj(path, key), depth + 1, keys);
    }
    let key = text_of(path, key)?;
    let mut literal = String::with_capacity(key.len() + 2);
    write_str(&mut literal, &key);
    out.push_str(&literal);
    keys.insert(addr, literal);
    out.push(':');
    write_value_with(out, v, &Path::Child(path, &key), depth + 1, keys)
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
    let mut keys = Keys::new();
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
    let mut verbatim = String::from("[");
    let mut not_finite = None;
    crate::for_each_item(v, |i, item| {
        let (narrow, exact) = crate::logprob("logprobs", i, item)?;
        if i > 0 {
            verbatim.push(',');
        }
        match classify(item)? {
            Number::Float(x) => {
                if x.is_finite() {
                    write_float(&mut verbatim, x);
                } else if not_finite.is_none() {
                    not_finite = Some((i, repr(item)));
                }
                all_exact &= exact;
            }
            Number::Int(x) => {
                // An int reads back as an int only from the verbatim values.
                let _ = write!(verbatim, "{x}");
                all_exact = false;
            }
            _ => unreachable!("logprob() refuses everything else"),
        }
        column.push(narrow);
        Ok(())
    })?;
    verbatim.push(']');
    if all_exact {
        return Ok((column, None));
    }
    if let Some((i, r)) = not_finite {
        return Err(invalid_input(format!(
            "invalid logprobs[{i}]: {r} cannot be kept verbatim beside values that are not float32 \
             (JSON has no NaN or Infinity); pass float32 values"
        )));
    }
    Ok((column, Some(verbatim)))
}

/// The call of a gateway-shaped trace dict; a refusal names the field (and
/// the path inside it). `now` fills a missing timestamp.
pub(crate) fn call_of_trace(py: Python<'_>, trace: &Bound<'_, PyDict>, now: f64) -> PyResult<RCall> {
    let mut call = RCall { timestamp: now, ..Default::default() };
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
            _ => {
                let mut json = String::new();
                write_value(&mut json, &v, &Path::Key(key), 0)?;
                extra_field(&mut extra, key, json);
            }
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
    if !extra.is_empty() {
        let mut out = String::with_capacity(2 + extra.iter().map(|(k, v)| k.len() + v.len() + 4).sum::<usize>());
        out.push('{');
        for (i, (k, v)) in extra.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_str(&mut out, k);
            out.push(':');
            out.push_str(v);
        }
        out.push('}');
        call.extra = Some(out.into_bytes());
    }
    Ok(call)
}

// ---- Out: JSON text straight into Python objects ----

/// Builds the Python object of one JSON value. `maybe_big` is set when a
/// number could have been an integer beyond 64 bits (serde_json reads those
/// as floats): the caller then parses the text with `json.loads` instead.
#[derive(Clone, Copy)]
struct PySeed<'a, 'py> {
    py: Python<'py>,
    maybe_big: &'a Cell<bool>,
}

fn de_err<E: serde::de::Error>(e: PyErr) -> E {
    E::custom(e.to_string())
}

impl<'de, 'py> DeserializeSeed<'de> for PySeed<'_, 'py> {
    type Value = Bound<'py, PyAny>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
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
        let Ok(v) = v.into_pyobject(self.py);
        Ok(v.into_any())
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // An integer literal beyond 64 bits arrives here as a float.
        if v.fract() == 0.0 && v.abs() >= 9.2e18 {
            self.maybe_big.set(true);
        }
        Ok(PyFloat::new(self.py, v).into_any())
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PyString::new(self.py, v).into_any())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let list = PyList::empty(self.py);
        while let Some(item) = seq.next_element_seed(self)? {
            list.append(item).map_err(de_err)?;
        }
        Ok(list.into_any())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let dict = PyDict::new(self.py);
        while let Some(key) = map.next_key_seed(self)? {
            let value = map.next_value_seed(self)?;
            dict.set_item(key, value).map_err(de_err)?;
        }
        Ok(dict.into_any())
    }
}

/// The Python object of a JSON text (see the module doc).
pub(crate) fn json_to_py<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    let maybe_big = Cell::new(false);
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = PySeed { py, maybe_big: &maybe_big }.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    match parsed {
        Ok(v) if !maybe_big.get() => Ok(v),
        _ => py.import(intern!(py, "json"))?.call_method1(intern!(py, "loads"), (text,)),
    }
}
