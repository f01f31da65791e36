//! Python binding of trajlog: the store, calls whose token arrays are numpy
//! views into the mapped segment files, and the error kinds as exceptions.
//! The Python package (`trajlog/`) converts inputs and adds the rLLM adapters.

use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyTuple};
use std::sync::Arc;

mod arrow_export;
mod holes;
mod nowait;
mod trace_dict;

use trajlog::rllm::SdkTrace;
use trajlog::{Call as RCall, CompactOptions, Durability, ErrorKind, Options, Selection, Target};

/// Raise the Python exception that mirrors a Rust error's kind, with the same
/// message (classes defined in `trajlog/errors.py`).
pub(crate) fn to_py(e: trajlog::Error) -> PyErr {
    let name = match e.kind() {
        ErrorKind::Io => "IOFailure",
        ErrorKind::StorageFull => "StorageFullError",
        ErrorKind::Corrupt { .. } => "CorruptError",
        ErrorKind::Incompatible => "IncompatibleError",
        ErrorKind::InvalidInput { .. } => "InvalidInputError",
        ErrorKind::LimitExceeded { .. } => "LimitExceededError",
        ErrorKind::Locked => "LockedError",
        ErrorKind::Closed => "ClosedError",
        ErrorKind::Poisoned => "PoisonedError",
        ErrorKind::NotFound => "NotFoundError",
        _ => "TrajlogError",
    };
    py_error(name, e.message().to_owned())
}

/// The exception `trajlog.errors.<name>(message)`.
fn py_error(name: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let class = py.import("trajlog.errors").and_then(|m| m.getattr(name));
        match class {
            Ok(class) => match class.call1((message,)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(err) => err,
            },
            Err(err) => err,
        }
    })
}

/// `trajlog.InvalidInputError(message)`; nothing has been written.
fn invalid_input(message: String) -> PyErr {
    py_error("InvalidInputError", message)
}

// ---- Input conversion: token ids and logprobs given as Python sequences ----
//
// Each element is checked (a bool is never a number here; numpy scalars are
// accepted like the Python numbers they stand for) and a refusal names the
// field and the index. Nothing is written before every element passed.

/// A Python number, as the element checks see it.
enum Number {
    Bool,
    Int(i64),
    /// An integer outside `i64`.
    BigInt,
    Float(f64),
    Other,
}

fn classify(item: &Bound<'_, PyAny>) -> PyResult<Number> {
    if item.is_exact_instance_of::<PyBool>() {
        return Ok(Number::Bool);
    }
    if item.is_instance_of::<PyInt>() {
        return Ok(item.extract::<i64>().map_or(Number::BigInt, Number::Int));
    }
    if let Ok(f) = item.cast::<PyFloat>() {
        return Ok(Number::Float(f.value()));
    }
    // numpy scalars (numpy.float32, numpy.int64, numpy.bool_, ...).
    let ty = item.get_type();
    if ty.module().is_ok_and(|m| m.to_cow().is_ok_and(|m| m == "numpy")) {
        if let Ok(kind) = item.getattr(intern!(item.py(), "dtype")).and_then(|d| d.getattr(intern!(item.py(), "kind")))
        {
            match kind.extract::<String>()?.as_str() {
                "b" => return Ok(Number::Bool),
                "i" | "u" => return Ok(item.extract::<i64>().map_or(Number::BigInt, Number::Int)),
                "f" => return Ok(item.extract::<f64>().map_or(Number::Other, Number::Float)),
                _ => {}
            }
        }
    }
    Ok(Number::Other)
}

fn repr(item: &Bound<'_, PyAny>) -> String {
    item.repr().map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string_lossy().into_owned())
}

/// The elements of a list, a tuple or any other iterable.
fn for_each_item<'py>(
    values: &Bound<'py, PyAny>,
    mut f: impl FnMut(usize, &Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if values.is_exact_instance_of::<PyList>() {
        let py = values.py();
        // SAFETY (the blocks below): `values` is a live `list`, which
        // PyList_Size and PyList_GetItem take; PyList_GetItem returns a
        // borrowed reference to the item at an index below the length just
        // read. An exact `int` or `float` is handed on borrowed (`f` reads
        // its value without running Python code); anything else is held,
        // and the length read again after `f`.
        let mut len = unsafe { pyo3::ffi::PyList_Size(values.as_ptr()) };
        let mut i: pyo3::ffi::Py_ssize_t = 0;
        while i < len {
            let item = unsafe { pyo3::ffi::PyList_GetItem(values.as_ptr(), i) };
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            let ty = unsafe { pyo3::ffi::Py_TYPE(item) };
            let number = ty == std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type)
                || ty == std::ptr::addr_of_mut!(pyo3::ffi::PyFloat_Type);
            if number {
                f(i as usize, &*unsafe { pyo3::Borrowed::from_ptr(py, item) })?;
            } else {
                f(i as usize, &unsafe { Bound::from_borrowed_ptr(py, item) })?;
                len = unsafe { pyo3::ffi::PyList_Size(values.as_ptr()) };
            }
            i += 1;
        }
    } else if let Ok(list) = values.cast::<PyList>() {
        for (i, item) in list.iter().enumerate() {
            f(i, &item)?;
        }
    } else if let Ok(tuple) = values.cast::<PyTuple>() {
        for (i, item) in tuple.iter().enumerate() {
            f(i, &item)?;
        }
    } else {
        for (i, item) in values.try_iter()?.enumerate() {
            f(i, &item?)?;
        }
    }
    Ok(())
}

/// Token ids from a Python sequence of ints, as a uint32 array; refuses a
/// bool, a float, or an int outside `0..=u32::MAX`, naming `field[index]`.
#[pyfunction]
fn u32_array<'py>(py: Python<'py>, field: &str, values: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u32>>> {
    Ok(PyArray1::from_vec(py, u32_vec(field, values)?))
}

/// Token ids from a Python sequence of ints (see [`u32_array`]).
fn u32_vec(field: &str, values: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(values.len().unwrap_or(0));
    for_each_item(values, |i, item| {
        // The common case first: a plain int that fits.
        if item.is_exact_instance_of::<PyInt>() {
            // SAFETY: `item` is a live `int` object (checked just above), which
            // is what PyLong_AsUnsignedLong takes; it returns (unsigned long)-1
            // with an exception set on overflow, handled below.
            let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLong(item.as_ptr()) };
            if v != std::ffi::c_ulong::MAX {
                if let Ok(id) = u32::try_from(v) {
                    out.push(id);
                    return Ok(());
                }
            } else if let Some(err) = PyErr::take(item.py()) {
                drop(err); // negative or too large: refused below, naming the element
            } else if let Ok(id) = u32::try_from(v) {
                out.push(id);
                return Ok(());
            }
        }
        match classify(item)? {
            Number::Int(v) if (0..=i64::from(u32::MAX)).contains(&v) => {
                out.push(v as u32);
                Ok(())
            }
            Number::Bool => Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is a bool, not a token id (an integer in 0..=4294967295)",
                repr(item)
            ))),
            _ => Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is not a token id (an integer in 0..=4294967295)",
                repr(item)
            ))),
        }
    })?;
    Ok(out)
}

/// One logprob as a float32 and whether it is exactly the value given.
/// Refuses what is not a number (bools included) and finite values beyond
/// the float32 range (they would become infinite).
fn logprob(field: &str, i: usize, item: &Bound<'_, PyAny>) -> PyResult<(f32, bool)> {
    let (narrow, exact) = match classify(item)? {
        Number::Float(v) => {
            let narrow = v as f32;
            if v.is_finite() && !narrow.is_finite() {
                return Err(invalid_input(format!(
                    "invalid {field}[{i}]: {} is outside the float32 range (magnitude at most 3.4028235e38); a logprob is stored as a float32",
                    repr(item)
                )));
            }
            (narrow, f64::from(narrow).to_bits() == v.to_bits())
        }
        Number::Int(v) => {
            let narrow = v as f32;
            (narrow, f64::from(narrow) as i128 == i128::from(v))
        }
        Number::BigInt => {
            return Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is not a logprob (an integer beyond 64 bits)",
                repr(item)
            )))
        }
        Number::Bool => {
            return Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is a bool, not a logprob (a float)",
                repr(item)
            )))
        }
        Number::Other => {
            return Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is not a number; logprobs are floats",
                repr(item)
            )))
        }
    };
    Ok((narrow, exact))
}

/// Logprobs from a Python sequence of numbers as a float32 array, and
/// whether every value was exactly a float32. With `exact`, a value that is
/// not is refused naming `field[index]`; otherwise it becomes the nearest
/// float32 (the caller keeps the value given elsewhere).
#[pyfunction]
fn f32_array<'py>(
    py: Python<'py>,
    field: &str,
    values: &Bound<'py, PyAny>,
    exact: bool,
) -> PyResult<(Bound<'py, PyArray1<f32>>, bool)> {
    let mut out = Vec::with_capacity(values.len().unwrap_or(0));
    let mut all_exact = true;
    for_each_item(values, |i, item| {
        let (v, is_exact) = logprob(field, i, item)?;
        if exact && !is_exact {
            return Err(invalid_input(format!(
                "invalid {field}[{i}]: {} is not exactly representable as float32; pass float32 values (e.g. a numpy float32 array)",
                repr(item)
            )));
        }
        all_exact &= is_exact;
        out.push(v);
        Ok(())
    })?;
    Ok((PyArray1::from_vec(py, out), all_exact))
}

/// For the tests: walk `trace` as `append_trace` does and say whether the
/// cuts of `extra` the walk found are exactly those the docs encoder's
/// search finds (True), or that the walk left the search to the encoder
/// (None). A False is a defect: a found cut the encoder would take unchecked.
#[pyfunction]
fn _found_cuts_agree(py: Python<'_>, trace: &Bound<'_, PyDict>) -> PyResult<Option<bool>> {
    let (call, found) = trace_dict::call_of_trace(py, trace, 0.0)?;
    Ok(found.map(|f| trajlog::found_cuts_agree(&call, &f)))
}

/// How deeply containers nest in a JSON text (`1` for `[]`, `0` for a scalar);
/// brackets inside strings do not count.
#[pyfunction]
fn json_depth(text: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in text.as_bytes() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// The elements of a one-dimensional numpy array as a `Vec`. The binding's
/// Python side passes contiguous, aligned arrays; anything else is refused
/// rather than read through a misaligned pointer.
fn array_vec<T: numpy::Element + Copy>(field: &str, arr: &PyReadonlyArray1<'_, T>) -> PyResult<Vec<T>> {
    let array: &Bound<'_, PyArray1<T>> = arr;
    if PyUntypedArrayMethods::len(array) == 0 {
        return Ok(Vec::new());
    }
    let aligned = (PyArrayMethods::data(array) as usize).is_multiple_of(std::mem::align_of::<T>());
    match (aligned, arr.as_slice()) {
        (true, Ok(slice)) => Ok(slice.to_vec()),
        _ => Err(invalid_input(format!("invalid {field}: the array must be contiguous and aligned"))),
    }
}

/// Whether `extra` holds a `logprobs` value of its own (not null): the
/// values as the caller gave them, kept because they are not all float32.
fn has_verbatim_logprobs(extra: &[u8]) -> bool {
    serde_json::from_slice::<std::collections::BTreeMap<String, &serde_json::value::RawValue>>(extra)
        .is_ok_and(|m| m.get("logprobs").is_some_and(|v| v.get() != "null"))
}

/// Keeps a snapshot — and through it the segment mappings and decoded shard
/// row groups — alive for as long as any array viewing them lives.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Snapshot {
    pub(crate) snap: trajlog::Snapshot,
}

/// One captured call, read from a snapshot.
#[pyclass(frozen, module = "trajlog._trajlog")]
struct Call {
    snap: Py<Snapshot>,
    trace_id: String,
}

/// Append `call` with the GIL released; with `durable`, wait until it is
/// durable. `serialized`: its JSON documents are the trace dict walker's
/// output (JSON by construction), not parsed again.
/// `found`: the cuts of its `extra` the trace walk found (`trajlog::ExtraCuts`).
fn append_call(
    py: Python<'_>,
    store: &trajlog::Store,
    call: RCall,
    durable: bool,
    serialized: bool,
    found: Option<trajlog::ExtraCuts>,
) -> PyResult<()> {
    py.detach(|| {
        let call =
            if serialized { trajlog::ValidCall::from_serialized_json(call)? } else { trajlog::ValidCall::new(call)? };
        let call = call.with_found_cuts(found);
        let receipt = store.append_valid(call)?;
        if durable {
            receipt.wait()?;
        }
        Ok(())
    })
    .map_err(to_py)
}

fn view<'a>(snap: &'a Snapshot, trace_id: &str) -> PyResult<trajlog::CallView<'a>> {
    snap.snap.get(trace_id).map_err(to_py)?.ok_or_else(|| to_py_missing(trace_id))
}

fn to_py_missing(trace_id: &str) -> PyErr {
    pyo3::exceptions::PyKeyError::new_err(format!("trace {trace_id:?} is not in this snapshot"))
}

/// A read-only numpy array viewing `slice`, which lives inside `owner`.
fn borrowed<'py, T: numpy::Element + Copy>(
    py: Python<'py>,
    slice: &[T],
    owner: &Py<Snapshot>,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let arr = ArrayView1::from(slice);
    // SAFETY: `slice` points into memory owned by the `Snapshot` object (a
    // segment mapping or a decoded row group held by it), which never moves or
    // changes while the snapshot lives; the array holds `owner` as its base, so
    // the snapshot outlives the array. The array is made read-only below: the
    // mapping is read-only and must never be written through.
    let out = unsafe { PyArray1::borrow_from_array(&arr, owner.clone_ref(py).into_bound(py).into_any()) };
    let kwargs = PyDict::new(py);
    kwargs.set_item("write", false)?;
    out.call_method("setflags", (), Some(&kwargs))?;
    Ok(out)
}

#[pymethods]
impl Call {
    #[getter]
    fn trace_id(&self) -> &str {
        &self.trace_id
    }
    #[getter]
    fn session_id(&self) -> PyResult<String> {
        Ok(view(self.snap.get(), &self.trace_id)?.session_id().to_owned())
    }
    #[getter]
    fn timestamp(&self) -> PyResult<f64> {
        Ok(view(self.snap.get(), &self.trace_id)?.timestamp())
    }
    #[getter]
    fn model(&self) -> PyResult<Option<String>> {
        Ok(view(self.snap.get(), &self.trace_id)?.record.model.map(str::to_owned))
    }
    #[getter]
    fn weight_version(&self) -> PyResult<Option<i64>> {
        Ok(view(self.snap.get(), &self.trace_id)?.record.weight_version)
    }
    #[getter]
    fn session_uids(&self) -> PyResult<Vec<String>> {
        Ok(view(self.snap.get(), &self.trace_id)?.record.session_uids.iter().map(|s| (*s).to_owned()).collect())
    }
    /// How the prompt relates to its parent: root, extends, tito_break, diverges_earlier.
    #[getter]
    fn relation(&self) -> PyResult<&'static str> {
        Ok(view(self.snap.get(), &self.trace_id)?.relation().name())
    }
    #[getter]
    fn divergence_position(&self) -> PyResult<Option<usize>> {
        Ok(view(self.snap.get(), &self.trace_id)?.divergence_position())
    }
    #[getter]
    fn is_compacted(&self) -> PyResult<bool> {
        Ok(view(self.snap.get(), &self.trace_id)?.is_compacted())
    }
    /// uint32 view into the mapped segment (or the snapshot's shard row group).
    #[getter]
    fn completion_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = view(self.snap.get(), &self.trace_id)?;
        borrowed(py, v.completion_token_ids(), &self.snap)
    }
    /// float32 view, or None when the call had no logprobs.
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyArray1<f32>>>> {
        let v = view(self.snap.get(), &self.trace_id)?;
        v.logprobs().map(|l| borrowed(py, l, &self.snap)).transpose()
    }
    /// uint32 array: a view when the prompt is stored whole (first call of a
    /// session, or a compacted call); otherwise materialized from the
    /// prefix-delta chain (a new array). `prompt_is_view` tells which.
    #[getter]
    fn prompt_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = view(self.snap.get(), &self.trace_id)?;
        if v.prompt_prefix_len() == 0 {
            return borrowed(py, v.prompt_suffix(), &self.snap);
        }
        let prompt = v.prompt().map_err(to_py)?;
        Ok(PyArray1::from_vec(py, prompt))
    }
    #[getter]
    fn prompt_is_view(&self) -> PyResult<bool> {
        Ok(view(self.snap.get(), &self.trace_id)?.prompt_prefix_len() == 0)
    }
    /// The stored part of the prompt (a view) and the length taken from the parent.
    #[getter]
    fn prompt_suffix<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = view(self.snap.get(), &self.trace_id)?;
        borrowed(py, v.prompt_suffix(), &self.snap)
    }
    #[getter]
    fn prompt_prefix_len(&self) -> PyResult<usize> {
        Ok(view(self.snap.get(), &self.trace_id)?.prompt_prefix_len())
    }
    /// The gateway-shaped trace dict, with plain lists (ids as ints, logprobs
    /// as the exact float32 values, or as given when they were not all
    /// float32), built here from the stored JSON documents.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (call, spliced) = view(self.snap.get(), &self.trace_id)?.to_call_spliced().map_err(to_py)?;
        gc_paused(py, || call_dict_with(py, call, spliced, &mut trace_dict::KeyMemo::new()))
    }

    /// The gateway-shaped trace as JSON text (logprobs kept verbatim beside
    /// the column are written as given, as in `to_dict`).
    fn to_json(&self) -> PyResult<String> {
        let v = view(self.snap.get(), &self.trace_id)?;
        let mut call = v.to_call().map_err(to_py)?;
        if call.extra.as_deref().is_some_and(has_verbatim_logprobs) {
            call.logprobs = None;
        }
        Ok(trajlog::trace_json::export_call(&call))
    }
    fn __repr__(&self) -> PyResult<String> {
        let v = view(self.snap.get(), &self.trace_id)?;
        Ok(format!(
            "Call(trace_id={:?}, session_id={:?}, prompt={} tokens, completion={} tokens, relation={})",
            self.trace_id,
            v.session_id(),
            v.prompt_len(),
            v.completion_token_ids().len(),
            v.relation().name()
        ))
    }
}

/// Run `f` with Python's cyclic garbage collector paused (restored as it
/// was). A trace dict is thousands of containers with no cycles; while many
/// are built and kept, the collector would walk them again and again.
fn gc_paused<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    /// Turns the collector back on however `f` ends (a panic included).
    struct Resume<'py>(Option<Bound<'py, PyModule>>);
    impl Drop for Resume<'_> {
        fn drop(&mut self) {
            if let Some(gc) = &self.0 {
                let _ = gc.call_method0("enable");
            }
        }
    }
    let gc = py.import("gc")?;
    let _resume = if gc.call_method0("isenabled")?.is_truthy()? {
        gc.call_method0("disable")?;
        Resume(Some(gc))
    } else {
        Resume(None)
    };
    f()
}

/// A stored call as the gateway-shaped trace dict `Call.to_dict()` returns:
/// ids as ints, logprobs as the exact float32 values (or, when the trace
/// kept them verbatim beside the column, as given); dict keys shared through
/// `keys` (a session's calls).
///
/// The dict is built key by key in the order `trace_json::export_call`
/// writes them (its plan, or the trace's own order kept in `extra`): the
/// columns straight from the call, each document parsed once, and `extra`
/// parsed once into the values of its keys — no export text in between.
///
/// `spliced`: `extra` as its docs-block template (`call.extra` is then
/// `None`), whose copies of the columns are made from the columns' lists.
fn call_dict_with<'py>(
    py: Python<'py>,
    mut call: RCall,
    spliced: Option<trajlog::Spliced>,
    keys: &mut trace_dict::KeyMemo<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    use trajlog::trace_json::{export_plan, reorder, KEY_ORDER};
    let logprobs = call.logprobs.take();
    let prompt = std::mem::take(&mut call.prompt_token_ids);
    let completion = std::mem::take(&mut call.completion_token_ids);
    let prompt_list = PyList::new(py, &prompt)?;
    let completion_list = PyList::new(py, &completion)?;
    let logprobs_list = logprobs.as_ref().map(|lp| PyList::new(py, lp.iter().map(|&x| f64::from(x)))).transpose()?;
    let pool = trace_dict::NumberPool {
        columns: vec![(&prompt, prompt_list.clone()), (&completion, completion_list.clone())],
        logprobs: logprobs.as_deref().zip(logprobs_list.clone()),
    };
    let doc = |keys: &mut trace_dict::KeyMemo<'py>, doc: &Option<Vec<u8>>| -> PyResult<Bound<'py, PyAny>> {
        match doc {
            Some(text) => trace_dict::json_to_py_with(py, &utf8(text), keys, &pool),
            None => Ok(py.None().into_bound(py)),
        }
    };
    // `messages`, once built (its copy in `extra` is a copy of it).
    let mut messages: Option<Bound<'py, PyAny>> = None;
    // `extra` is a JSON object (the boundary check refuses anything else; an
    // export would read it as no extra fields, and so does this).
    let extra = match (call.extra.as_deref(), &spliced) {
        (Some(text), _) => Some(trace_dict::json_to_py_with(py, &utf8(text), keys, &pool)?),
        (None, Some(spliced)) => {
            if spliced.holes.iter().any(|(_, h)| *h == trajlog::Hole::Messages) {
                messages = Some(doc(keys, &call.messages)?);
            }
            let src = holes::Sources {
                prompt: &prompt_list,
                completion: &completion_list,
                logprobs: logprobs_list.as_ref(),
                messages: messages.as_ref(),
            };
            match holes::build(py, spliced, &src, keys, &pool)? {
                Some(v) => Some(v),
                None => {
                    let text = spliced
                        .render(&prompt, &completion, logprobs.as_deref(), call.messages.as_deref())
                        .map_err(|e| py_error("CorruptError", format!("extra of trace {:?}: {e}", call.trace_id)))?;
                    Some(trace_dict::json_to_py_with(py, &utf8(&text), keys, &pool)?)
                }
            }
        }
        (None, None) => None,
    }
    .and_then(|v| v.cast_into::<PyDict>().ok());
    // The keys of `extra` (sorted, as the export reads them), each with
    // whether its value is null.
    let mut extra_keys: Vec<(String, bool)> = Vec::new();
    let mut order: Option<Vec<String>> = None;
    if let Some(extra) = &extra {
        for (k, v) in extra.iter() {
            let k: String = k.extract()?;
            if k == KEY_ORDER {
                order = v.extract().ok();
            }
            extra_keys.push((k, v.is_none()));
        }
        extra_keys.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    }
    // Verbatim logprobs in `extra` (not all float32) win over the column.
    let verbatim = extra_keys.iter().any(|(k, null)| k == "logprobs" && !null);
    if !verbatim {
        call.logprobs = logprobs.as_ref().map(|_| Vec::new());
    }
    let listed: Vec<(&str, bool)> = extra_keys.iter().map(|(k, null)| (k.as_str(), *null)).collect();
    let mut plan = export_plan(&call, &listed);
    if let Some(order) = &order {
        reorder(&mut plan, order);
    }
    let d = PyDict::new(py);
    for (name, from_extra) in plan {
        let value: Bound<'py, PyAny> = if from_extra {
            match extra.as_ref().map(|e| e.get_item(name)).transpose()?.flatten() {
                Some(v) => v,
                None => continue,
            }
        } else {
            match name {
                "trace_id" => call.trace_id.as_str().into_pyobject(py)?.into_any(),
                "session_id" => call.session_id.as_str().into_pyobject(py)?.into_any(),
                "session_uids" => PyList::new(py, &call.session_uids)?.into_any(),
                "timestamp" => finite_or_none(py, call.timestamp),
                "model" => call.model.as_deref().unwrap_or_default().into_pyobject(py)?.into_any(),
                "weight_version" => call.weight_version.unwrap_or_default().into_pyobject(py)?.into_any(),
                "prompt_token_ids" => prompt_list.clone().into_any(),
                "completion_token_ids" => completion_list.clone().into_any(),
                "logprobs" => match &logprobs_list {
                    Some(list) => list.clone().into_any(),
                    None => PyList::empty(py).into_any(),
                },
                "finish_reason" => call.finish_reason.as_deref().unwrap_or_default().into_pyobject(py)?.into_any(),
                "latency_ms" => finite_or_none(py, call.latency_ms.unwrap_or_default()),
                "messages" => match messages.take() {
                    Some(m) => m,
                    None => doc(keys, &call.messages)?,
                },
                "response_message" => doc(keys, &call.response_message)?,
                "metadata" => doc(keys, &call.metadata)?,
                "routing_matrices" => {
                    let r = call.routing_matrices.as_deref().unwrap_or_default();
                    match std::str::from_utf8(r)
                        .ok()
                        .filter(|s| serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok())
                    {
                        Some(json) => trace_dict::json_to_py_with(py, json, keys, &pool)?,
                        None => PyList::new(py, r.iter().map(|&b| u32::from(b)))?.into_any(),
                    }
                }
                _ => py.None().into_bound(py),
            }
        };
        d.set_item(keys.key(py, name), value)?;
    }
    Ok(d.into_any())
}

/// A stored document as text: in place when it is UTF-8 (always, as the
/// writers make them), else with the invalid bytes replaced, as the export
/// reads it.
fn utf8(text: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(text) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => String::from_utf8_lossy(text),
    }
}

/// A float of a column (`timestamp`, `latency_ms`) as the export writes it:
/// `None` when not finite.
fn finite_or_none(py: Python<'_>, v: f64) -> Bound<'_, PyAny> {
    if v.is_finite() {
        pyo3::types::PyFloat::new(py, v).into_any()
    } else {
        py.None().into_bound(py)
    }
}

/// An SDK record as the Python side passes it to `append_sdk_batch`.
type SdkRecord = (String, String, String, String, String, Vec<String>, f64, f64);

type SdkTuple = (String, String, String, String, f64, f64, Vec<String>);

fn sdk_tuple(t: SdkTrace) -> SdkTuple {
    (t.data, t.namespace, t.context_type, t.metadata, t.created_at, t.updated_at, t.session_uids)
}

/// The native store; `trajlog.Store` wraps it.
///
/// Frozen (no `&mut self` method): what `close` takes away sits behind a
/// lock held only to copy or take the handles, so a `close` in one thread
/// while another reads (or a read while a `close` waits for the writer)
/// never meets PyO3's borrow check ("Already borrowed"): the read either
/// holds the store already, and the close then flushes it and leaves the
/// last user to close it, or finds it closed.
#[pyclass(frozen, module = "trajlog._trajlog")]
struct NativeStore {
    held: std::sync::Mutex<Held>,
}

/// What a [`NativeStore`] holds until `close` takes it.
struct Held {
    store: Option<Arc<trajlog::Store>>,
    /// The thread that appends what `append_trace_nowait` walked; started on
    /// first use, finished by `close` (and by `flush`'s barrier, in part).
    encoder: Option<Arc<nowait::Encoder>>,
    /// The store `close` took while other threads were inside calls on it:
    /// the last of them closes it (and frees the directory's lock).
    closing: std::sync::Weak<trajlog::Store>,
}

impl NativeStore {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self) -> PyResult<Arc<trajlog::Store>> {
        self.held().store.clone().ok_or_else(|| to_py(trajlog::Error::closed()))
    }

    fn encoder(&self) -> PyResult<Arc<nowait::Encoder>> {
        let mut held = self.held();
        if let Some(encoder) = &held.encoder {
            return Ok(encoder.clone());
        }
        let store = held.store.clone().ok_or_else(|| to_py(trajlog::Error::closed()))?;
        let started = Arc::new(nowait::Encoder::start(store).map_err(PyErr::from)?);
        held.encoder = Some(started.clone());
        Ok(started)
    }
}

fn snapshot_obj(py: Python<'_>, store: &trajlog::Store) -> PyResult<Py<Snapshot>> {
    Py::new(py, Snapshot { snap: store.snapshot() })
}

fn calls_of(py: Python<'_>, snap: &Py<Snapshot>, ids: Vec<String>) -> PyResult<Vec<Call>> {
    Ok(ids.into_iter().map(|trace_id| Call { snap: snap.clone_ref(py), trace_id }).collect())
}

#[pymethods]
impl NativeStore {
    #[new]
    #[pyo3(signature = (path, durability = "group", read_only = false, segment_bytes = None, group_commit_ms = None, queue_depth = None, recovery = "tolerate-torn-tail", queue_bytes = None, zero_ahead_bytes = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        durability: &str,
        read_only: bool,
        segment_bytes: Option<u64>,
        group_commit_ms: Option<u64>,
        queue_depth: Option<usize>,
        recovery: &str,
        queue_bytes: Option<u64>,
        zero_ahead_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let recovery = recovery.parse::<trajlog::RecoveryMode>().map_err(to_py)?;
        let mut options =
            Options::default().durability(durability.parse::<Durability>().map_err(to_py)?).recovery(recovery);
        if let Some(v) = segment_bytes {
            options = options.segment_bytes(v);
        }
        if let Some(v) = group_commit_ms {
            options = options.group_commit_ms(v);
        }
        if let Some(v) = queue_depth {
            options = options.queue_depth(v);
        }
        if let Some(v) = queue_bytes {
            options = options.queue_bytes(v);
        }
        if let Some(v) = zero_ahead_bytes {
            options = options.zero_ahead_bytes(v);
        }
        let store = py
            .detach(|| {
                if read_only {
                    trajlog::Store::open_read_only_with(&path, recovery)
                } else {
                    trajlog::Store::open(&path, options)
                }
            })
            .map_err(to_py)?;
        Ok(Self {
            held: std::sync::Mutex::new(Held {
                store: Some(Arc::new(store)),
                encoder: None,
                closing: std::sync::Weak::new(),
            }),
        })
    }

    /// What the open's recovery did: one line per torn tail cut, damaged
    /// region skipped or footer rebuilt (empty for an intact store).
    fn recovery_report(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.recovery_report().events.iter().map(ToString::to_string).collect())
    }

    /// Append one call; the arrays are validated and copied. With `durable`,
    /// returns once the record is durable at the store's level.
    /// The documents (`messages`, `response_message`, `metadata`, and the
    /// extra fields as a dict) are Python objects serialized here, or, with
    /// `docs_are_text`, JSON texts the caller made.
    #[pyo3(signature = (trace_id, session_id, prompt_token_ids, completion_token_ids, logprobs, session_uids, timestamp, model, weight_version, finish_reason, latency_ms, messages, response_message, metadata, extra, routing_matrices, durable, docs_are_text))]
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        py: Python<'_>,
        trace_id: String,
        session_id: String,
        prompt_token_ids: PyReadonlyArray1<'_, u32>,
        completion_token_ids: PyReadonlyArray1<'_, u32>,
        logprobs: Option<PyReadonlyArray1<'_, f32>>,
        session_uids: Vec<String>,
        timestamp: f64,
        model: Option<String>,
        weight_version: Option<i64>,
        finish_reason: Option<String>,
        latency_ms: Option<f64>,
        messages: Option<Bound<'_, PyAny>>,
        response_message: Option<Bound<'_, PyAny>>,
        metadata: Option<Bound<'_, PyAny>>,
        extra: Option<Bound<'_, PyAny>>,
        routing_matrices: Option<Vec<u8>>,
        durable: bool,
        docs_are_text: bool,
    ) -> PyResult<()> {
        let text = docs_are_text;
        let messages = trace_dict::document_arg("messages", messages.as_ref(), text)?;
        let response_message = trace_dict::document_arg("response_message", response_message.as_ref(), text)?;
        let metadata = trace_dict::document_arg("metadata", metadata.as_ref(), text)?;
        let extra = trace_dict::extra_arg(extra.as_ref(), text)?;
        let call = RCall {
            trace_id,
            session_id,
            session_uids,
            timestamp,
            model,
            weight_version,
            prompt_token_ids: array_vec("prompt_token_ids", &prompt_token_ids)?,
            completion_token_ids: array_vec("completion_token_ids", &completion_token_ids)?,
            logprobs: logprobs.map(|l| array_vec("logprobs", &l)).transpose()?,
            routing_matrices,
            finish_reason,
            latency_ms,
            messages,
            response_message,
            metadata,
            extra,
        };
        append_call(py, &*self.get()?, call, durable, !docs_are_text, None)
    }

    /// Append a gateway-shaped trace dict, walked here (see `trace_dict`):
    /// nothing of it is written when a field is refused. With `durable`,
    /// returns once the record is durable at the store's level.
    fn append_trace(&self, py: Python<'_>, trace: &Bound<'_, PyDict>, durable: bool) -> PyResult<()> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let (call, found) = trace_dict::call_of_trace(py, trace, now)?;
        append_call(py, &*self.get()?, call, durable, true, found)
    }

    /// Append a trace dict without waiting (for an event loop): the dict is
    /// walked here as by `append_trace` (a refused field raises, nothing
    /// written), and the call is handed to the store's encoder thread, which
    /// checks and appends it in walk order and asks for a commit. Returns a
    /// `Pending` to poll when `waker` (this store's) wakes the loop; a call
    /// the encoder refuses raises from `poll`. Never blocks.
    fn append_trace_nowait(
        &self,
        py: Python<'_>,
        trace: &Bound<'_, PyDict>,
        waker: &nowait::Waker,
    ) -> PyResult<nowait::Pending> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let (call, found) = trace_dict::call_of_trace(py, trace, now)?;
        Ok(self.encoder()?.send(call, found, waker.signal.clone()))
    }

    /// A `Waker` for an event loop: its `fileno()` becomes readable after
    /// each commit that makes appends durable, and when the store fails or
    /// closes. Each call registers a new one (kept until the store is dropped).
    fn durable_waker(&self) -> PyResult<nowait::Waker> {
        nowait::Waker::new(&*self.get()?).map_err(PyErr::from)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        let encoder = self.held().encoder.clone();
        if let Some(encoder) = encoder {
            // What `append_trace_nowait` took before is appended first.
            py.detach(|| encoder.barrier());
        }
        py.detach(|| store.flush()).map_err(to_py)
    }

    fn refresh(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.refresh()).map_err(to_py)
    }

    fn seal(&self, py: Python<'_>, session_id: &str) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.seal_session(session_id)).map_err(to_py)
    }

    fn set_reward(&self, py: Python<'_>, kind: &str, id: String, value: f64) -> PyResult<()> {
        let store = self.get()?;
        let target = if kind == "session" { Target::Session(id) } else { Target::Trace(id) };
        py.detach(|| store.set_reward(target, value)).map_err(to_py)
    }

    fn delete_session(&self, py: Python<'_>, session_id: &str) -> PyResult<u64> {
        let store = self.get()?;
        py.detach(|| store.delete_session(session_id)).map_err(to_py)
    }

    fn get_call(&self, py: Python<'_>, trace_id: &str) -> PyResult<Option<Call>> {
        let store = self.get()?;
        let snap = snapshot_obj(py, &store)?;
        let found = snap.get().snap.get(trace_id).map_err(to_py)?.is_some();
        Ok(found.then(|| Call { snap, trace_id: trace_id.to_owned() }))
    }

    #[pyo3(signature = (session_id, since = None, limit = None))]
    fn session(
        &self,
        py: Python<'_>,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
    ) -> PyResult<Vec<Call>> {
        let store = self.get()?;
        let snap = snapshot_obj(py, &store)?;
        let ids: Vec<String> = snap
            .get()
            .snap
            .session(session_id, since, limit)
            .map_err(to_py)?
            .iter()
            .map(|c| c.trace_id().to_owned())
            .collect();
        calls_of(py, &snap, ids)
    }

    /// The session's calls as gateway-shaped trace dicts (what `to_dict`
    /// gives for each), oldest first. Each prompt is rebuilt from the call
    /// before it (O(session tokens)); the GIL is released while the store is
    /// read.
    #[pyo3(signature = (session_id, since = None, limit = None))]
    fn session_dicts<'py>(
        &self,
        py: Python<'py>,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let store = self.get()?;
        let snap = store.snapshot();
        let calls = py.detach(|| snap.session_calls_spliced(session_id, since, limit)).map_err(to_py)?;
        let mut keys = trace_dict::KeyMemo::new();
        // The list too is made while the collector is paused: its allocation
        // would otherwise start a collection over every object just built.
        gc_paused(py, || {
            let dicts = calls
                .into_iter()
                .map(|(c, spliced)| call_dict_with(py, c, spliced, &mut keys))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, dicts)
        })
    }

    /// One Arrow C Data Interface record batch per call of the session
    /// (oldest first), as (schema capsule, array capsule) pairs; one empty
    /// batch when the session has no calls. Token buffers point into the
    /// mapped segments (see `arrow_export`).
    #[pyo3(signature = (session_id, since = None, limit = None))]
    fn session_arrow_capsules<'py>(
        &self,
        py: Python<'py>,
        session_id: &str,
        since: Option<f64>,
        limit: Option<usize>,
    ) -> PyResult<Vec<(Bound<'py, pyo3::types::PyCapsule>, Bound<'py, pyo3::types::PyCapsule>)>> {
        let store = self.get()?;
        let snap = snapshot_obj(py, &store)?;
        arrow_export::session_batches(py, &snap, session_id, since, limit)
    }

    /// Append one record of the older rLLM SDK store (see `trajlog::rllm`).
    #[pyo3(signature = (trace_id, data, namespace, context_type, metadata, session_uids, created_at, updated_at, durable))]
    #[allow(clippy::too_many_arguments)]
    fn append_sdk(
        &self,
        py: Python<'_>,
        trace_id: String,
        data: String,
        namespace: String,
        context_type: String,
        metadata: String,
        session_uids: Vec<String>,
        created_at: f64,
        updated_at: f64,
        durable: bool,
    ) -> PyResult<()> {
        let t = SdkTrace { trace_id, data, namespace, context_type, metadata, created_at, updated_at, session_uids };
        let store = self.get()?;
        py.detach(|| {
            let call = trajlog::rllm::sdk_to_call(&t)?;
            let receipt = store.append(call)?;
            if durable {
                receipt.wait()?;
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Append records of the older rLLM SDK store, all or none: every record
    /// is converted and validated before the first is handed to the writer.
    /// Each is (trace_id, data, namespace, context_type, metadata,
    /// session_uids, created_at, updated_at). With `durable`, returns once all
    /// are durable.
    fn append_sdk_batch(&self, py: Python<'_>, records: Vec<SdkRecord>, durable: bool) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| {
            let calls = records
                .into_iter()
                .map(|(trace_id, data, namespace, context_type, metadata, session_uids, created_at, updated_at)| {
                    let t = SdkTrace {
                        trace_id,
                        data,
                        namespace,
                        context_type,
                        metadata,
                        created_at,
                        updated_at,
                        session_uids,
                    };
                    trajlog::rllm::sdk_to_call(&t)
                })
                .collect::<trajlog::Result<Vec<_>>>()?;
            let mut last = None;
            for call in calls {
                last = Some(store.append(call)?);
            }
            match last {
                // One wait covers every earlier append.
                Some(receipt) if durable => receipt.wait(),
                _ => Ok(()),
            }
        })
        .map_err(to_py)
    }

    /// SDK records by trace id (None where absent or not an SDK record), as
    /// (data, namespace, context_type, metadata, created_at, updated_at, session_uids).
    fn get_sdk(&self, py: Python<'_>, trace_ids: Vec<String>) -> PyResult<Vec<Option<SdkTuple>>> {
        let store = self.get()?;
        py.detach(|| {
            let mut snap = store.snapshot();
            snap.decode_whole_row_groups();
            let mut out = Vec::with_capacity(trace_ids.len());
            for id in &trace_ids {
                // Many compacted ids: what was decoded for earlier ones is
                // dropped as it piles up.
                snap.bound_decoded(trajlog::limits::SCAN_DECODED_BYTES_MAX);
                out.push(match snap.get(id)? {
                    Some(v) => trajlog::rllm::call_to_sdk(&v.to_call()?)?.map(sdk_tuple),
                    None => None,
                });
            }
            Ok::<_, trajlog::Error>(out)
        })
        .map_err(to_py)
    }

    /// Every SDK record of the store (for queries without a session filter).
    fn scan_sdk(&self, py: Python<'_>) -> PyResult<Vec<(String, SdkTuple)>> {
        let store = self.get()?;
        py.detach(|| {
            let snap = store.snapshot();
            let mut out = Vec::new();
            snap.for_each_call(|v| {
                if let Some(t) = trajlog::rllm::call_to_sdk(&v.to_call()?)? {
                    out.push((t.trace_id.clone(), sdk_tuple(t)));
                }
                Ok(())
            })?;
            Ok(out)
        })
        .map_err(to_py)
    }

    /// Migrate an rLLM SQLite trace database into this store (see
    /// `trajlog import-rllm-sqlite`); returns the report as a dict.
    #[pyo3(signature = (db, schema = None, verify = true))]
    fn import_rllm_sqlite<'py>(
        &self,
        py: Python<'py>,
        db: std::path::PathBuf,
        schema: Option<&str>,
        verify: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let store = self.get()?;
        let schema = schema.map(str::parse::<trajlog::rllm::sqlite::Schema>).transpose().map_err(to_py)?;
        let r =
            py.detach(|| trajlog::rllm::sqlite::import(&db, &store, schema, verify, &mut |_, _| {})).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("schema", r.schema.name())?;
        d.set_item("traces", r.traces)?;
        d.set_item("session_links", r.session_links)?;
        d.set_item("token_bytes", r.token_bytes)?;
        d.set_item("verified", r.verified)?;
        Ok(d)
    }

    /// Sessions with a live call: dicts with session_id, trace_count,
    /// first_trace_at, last_trace_at, sealed, reward; by first call time.
    fn sessions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let store = self.get()?;
        let list = PyList::empty(py);
        let snap = store.snapshot();
        let sessions = snap.sessions();
        // A read-only store's lookups that met a damaged block of the shard
        // index file may have left sessions out: an error, not a short list.
        snap.check_index().map_err(to_py)?;
        for s in sessions {
            let d = PyDict::new(py);
            d.set_item("session_id", s.session_id)?;
            d.set_item("trace_count", s.calls)?;
            d.set_item("first_trace_at", s.first_timestamp)?;
            d.set_item("last_trace_at", s.last_timestamp)?;
            d.set_item("sealed", s.sealed)?;
            d.set_item("reward", s.reward)?;
            list.append(d)?;
        }
        Ok(list)
    }

    #[pyo3(signature = (
        older_than = None,
        collect_dead = Some(trajlog::DEFAULT_COLLECT_DEAD_FRACTION),
        merge_fanout = Some(trajlog::DEFAULT_MERGE_FANOUT),
        max_calls = None,
        copy_forward = Some(trajlog::DEFAULT_COPY_FORWARD),
        batch_calls = Some(trajlog::DEFAULT_BATCH_CALLS),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn compact<'py>(
        &self,
        py: Python<'py>,
        older_than: Option<f64>,
        collect_dead: Option<f64>,
        merge_fanout: Option<u32>,
        max_calls: Option<u64>,
        copy_forward: Option<f64>,
        batch_calls: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let store = self.get()?;
        let options = CompactOptions::default()
            .selection(older_than.map_or(Selection::SealedOnly, Selection::OlderThan))
            .collect_dead_fraction(collect_dead)
            .merge_fanout(merge_fanout)
            .max_calls(max_calls)
            .copy_forward(copy_forward)
            .batch_calls(batch_calls);
        let r = py.detach(|| store.compact(&options)).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("sessions", r.sessions)?;
        d.set_item("calls", r.calls)?;
        d.set_item("trajectories", r.trajectories)?;
        d.set_item("token_bytes", r.token_bytes)?;
        d.set_item("shards", r.shards.iter().map(|p| p.display().to_string()).collect::<Vec<_>>())?;
        d.set_item("retired_segments", r.retired_segments)?;
        // Sessions left in the log because a call of theirs is damaged: (session id, error).
        d.set_item("sessions_damaged", r.sessions_damaged)?;
        // Collection: earlier compactions whose shards were rewritten.
        d.set_item("collected_generations", r.collected_generations)?;
        // Merging: small earlier compactions whose shards were written again together.
        d.set_item("merged_generations", r.merged_generations)?;
        d.set_item("moved_calls", r.moved_calls)?;
        d.set_item("dropped_rows", r.dropped_rows)?;
        d.set_item("collected_bytes", r.collected_bytes)?;
        d.set_item("collect_skipped", r.collect_skipped)?;
        // Generations left for a later collection: a dead row of theirs keeps another record of its trace id dead.
        d.set_item("collect_deferred", r.collect_deferred)?;
        // Shard files the deletions side table could not read: (path under shards/, error).
        d.set_item("deletions_skipped", r.deletions_skipped)?;
        // Selected sessions `max_calls` left for a later compaction.
        d.set_item("sessions_left", r.sessions_left)?;
        // The copy-forward collector: unfinished sessions copied out of segments they alone kept.
        d.set_item("copied_sessions", r.copied_sessions)?;
        d.set_item("copied_calls", r.copied_calls)?;
        d.set_item("copied_bytes", r.copied_bytes)?;
        // Publications made: more than one past `batch_calls` calls.
        d.set_item("publications", r.publications)?;
        Ok(d)
    }

    /// The TI/TO audit as JSON text.
    fn audit_json(&self, py: Python<'_>) -> PyResult<String> {
        let store = self.get()?;
        let report = py.detach(|| trajlog::audit::audit(&store.snapshot())).map_err(to_py)?;
        serde_json::to_string(&report).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
    }

    /// Where the store's bytes are and what keeps them (`trajlog space`), as JSON text.
    fn space_json(&self, py: Python<'_>) -> PyResult<String> {
        let store = self.get()?;
        let snap = store.snapshot();
        let report = py.detach(|| trajlog::space::space(&snap)).map_err(to_py)?;
        Ok(report.to_json(&snap.index_layers()).to_string())
    }

    /// Why the store refuses writes after a failed write or fsync poisoned
    /// it (the error's text), or None while it takes writes. Closed: None.
    fn poisoned(&self) -> Option<String> {
        self.held().store.as_ref().and_then(|s| s.poisoned()).map(|e| e.to_string())
    }

    /// Segment files of the current snapshot (paths), for diagnostics.
    fn segment_paths(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.snapshot().segments().iter().map(|s| s.path.display().to_string()).collect())
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let (store, encoder) = {
            let mut held = self.held();
            (held.store.take(), held.encoder.take())
        };
        if let Some(encoder) = encoder {
            // What `append_trace_nowait` took is appended before the close
            // (a call handed to it after this is refused as closed).
            py.detach(|| encoder.finish());
        }
        if let Some(store) = store {
            match Arc::try_unwrap(store) {
                Ok(store) => py.detach(|| store.close()).map_err(to_py)?,
                // Another thread is inside a call: flush now, close when the last user drops it.
                Err(shared) => {
                    self.held().closing = Arc::downgrade(&shared);
                    py.detach(|| shared.flush()).map_err(to_py)?
                }
            }
        }
        Ok(())
    }

    /// Wait until the store is closed (by `close`, in this thread or
    /// another) and the threads that were inside calls on it have returned,
    /// so that the directory's lock is free (`timeout` in seconds, None: no
    /// limit). Whether it is; false on a timeout.
    #[pyo3(signature = (timeout = None))]
    fn wait_closed(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let deadline = timeout.map(|t| std::time::Instant::now() + std::time::Duration::from_secs_f64(t.max(0.0)));
        py.detach(|| loop {
            let held = self.held();
            if held.store.is_none() && held.closing.strong_count() == 0 {
                return true;
            }
            drop(held);
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        })
    }
}

#[pymodule]
fn _trajlog(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeStore>()?;
    m.add_class::<Call>()?;
    m.add_class::<nowait::Pending>()?;
    m.add_class::<nowait::Waker>()?;
    m.add_class::<Snapshot>()?;
    m.add_function(wrap_pyfunction!(u32_array, m)?)?;
    m.add_function(wrap_pyfunction!(f32_array, m)?)?;
    m.add_function(wrap_pyfunction!(json_depth, m)?)?;
    m.add_function(wrap_pyfunction!(_found_cuts_agree, m)?)?;
    Ok(())
}
