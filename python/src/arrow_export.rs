//! `Store.session_arrow`: a session's calls as Arrow record batches exported
//! through the Arrow C Data Interface (PyCapsule protocol), so pyarrow imports
//! them without a copy.
//!
//! Each call is one record batch of one row. The `completion_token_ids`,
//! `logprobs` and whole-prompt `prompt_token_ids` value buffers are the call's
//! own bytes in the mapped segment file (or the snapshot's decoded shard row
//! group); a list column's values must be contiguous, and a session's calls
//! are not contiguous on disk, hence one batch per call. A prompt stored as a
//! prefix-delta is materialized into a new buffer. Every buffer that views the
//! mapping holds the snapshot, which holds the mapping, so the table outlives
//! the store and any later compaction.

use crate::{to_py, Snapshot};
use arrow_array::builder::{Float64Builder, Int64Builder, StringBuilder, UInt32Builder};
use arrow_array::types::{ArrowPrimitiveType, Float32Type, UInt32Type};
use arrow_array::{ArrayRef, Float32Array, ListArray, PrimitiveArray, RecordBatch, StructArray, UInt32Array};
use arrow_buffer::{Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use std::panic::RefUnwindSafe;
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock};

/// The owner of every zero-copy buffer: the Python snapshot object, which
/// keeps the segment mappings and decoded row groups alive.
struct KeepSnapshot(#[allow(dead_code)] Py<Snapshot>);

// The snapshot is only read through these buffers, never mutated; a panic
// cannot leave it in a state a later reader could observe.
impl RefUnwindSafe for KeepSnapshot {}

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    let list = |name: &str, item: DataType, nullable: bool| {
        Field::new(name, DataType::List(Arc::new(Field::new_list_field(item, false))), nullable)
    };
    Arc::new(Schema::new(vec![
        Field::new("trace_id", DataType::Utf8, false),
        Field::new("session_id", DataType::Utf8, false),
        Field::new("timestamp", DataType::Float64, false),
        Field::new("model", DataType::Utf8, true),
        Field::new("weight_version", DataType::Int64, true),
        Field::new("finish_reason", DataType::Utf8, true),
        Field::new("relation", DataType::Utf8, false),
        Field::new("prompt_prefix_len", DataType::UInt32, false),
        list("prompt_token_ids", DataType::UInt32, false),
        list("completion_token_ids", DataType::UInt32, false),
        list("logprobs", DataType::Float32, true),
    ]))
});

/// A typed buffer viewing `slice` (memory owned by `owner`), or a copy if the
/// slice is not aligned for its type (the formats align every column, so this
/// is a guard, not a path taken).
fn view_values<T: ArrowPrimitiveType>(slice: &[T::Native], owner: &Arc<KeepSnapshot>) -> PrimitiveArray<T> {
    if !(slice.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T::Native>()) {
        return PrimitiveArray::<T>::from_iter_values(slice.iter().copied());
    }
    let ptr = NonNull::new(slice.as_ptr() as *mut u8).unwrap_or(NonNull::dangling());
    let bytes = std::mem::size_of_val(slice);
    // SAFETY: `slice` lies in memory held by the snapshot (a read-only segment
    // mapping or a decoded row group the snapshot caches and never drops or
    // moves while it lives); `owner` keeps the snapshot alive as long as the
    // buffer, and arrow never writes through an immutable `Buffer`.
    let buffer = unsafe { Buffer::from_custom_allocation(ptr, bytes, owner.clone()) };
    PrimitiveArray::<T>::new(ScalarBuffer::new(buffer, 0, slice.len()), None)
}

/// A one-row list array holding all of `values` (null when `null`).
fn one_list(values: ArrayRef, null: bool) -> ArrayRef {
    let len = values.len();
    let field = Arc::new(Field::new_list_field(values.data_type().clone(), false));
    let nulls = null.then(|| NullBuffer::new_null(1));
    Arc::new(ListArray::new(field, OffsetBuffer::from_lengths([len]), values, nulls))
}

fn call_batch(v: &trajlog::CallView<'_>, owner: &Arc<KeepSnapshot>) -> PyResult<RecordBatch> {
    let strings = |s: Option<&str>| -> ArrayRef {
        let mut b = StringBuilder::new();
        b.append_option(s);
        Arc::new(b.finish())
    };
    let trace_id = strings(Some(v.trace_id()));
    let session_id = strings(Some(v.session_id()));
    let model = strings(v.record.model);
    let finish_reason = strings(v.record.finish_reason);
    let relation = strings(Some(v.relation().name()));
    let mut ts = Float64Builder::new();
    ts.append_value(v.timestamp());
    let mut wv = Int64Builder::new();
    wv.append_option(v.record.weight_version);
    let mut prefix = UInt32Builder::new();
    let prefix_len = u32::try_from(v.prompt_prefix_len()).unwrap_or(u32::MAX);
    prefix.append_value(prefix_len);

    let prompt: ArrayRef = if v.prompt_prefix_len() == 0 {
        Arc::new(view_values::<UInt32Type>(v.prompt_suffix(), owner))
    } else {
        Arc::new(UInt32Array::from(v.prompt().map_err(to_py)?))
    };
    let logprobs: ArrayRef = match v.logprobs() {
        Some(l) => Arc::new(view_values::<Float32Type>(l, owner)),
        None => Arc::new(Float32Array::from(Vec::<f32>::new())),
    };
    let columns: Vec<ArrayRef> = vec![
        trace_id,
        session_id,
        Arc::new(ts.finish()),
        model,
        Arc::new(wv.finish()),
        finish_reason,
        relation,
        Arc::new(prefix.finish()),
        one_list(prompt, false),
        one_list(Arc::new(view_values::<UInt32Type>(v.completion_token_ids(), owner)), false),
        one_list(logprobs, v.logprobs().is_none()),
    ];
    RecordBatch::try_new(SCHEMA.clone(), columns).map_err(arrow_err)
}

fn arrow_err(e: arrow_schema::ArrowError) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!("arrow export failed: {e}"))
}

type CapsulePair<'py> = (Bound<'py, PyCapsule>, Bound<'py, PyCapsule>);

fn export<'py>(py: Python<'py>, batch: RecordBatch) -> PyResult<CapsulePair<'py>> {
    let data = arrow_data::ArrayData::from(StructArray::from(batch));
    let (array, schema) = arrow_array::ffi::to_ffi(&data).map_err(arrow_err)?;
    // pyarrow moves the structs out of the capsules (clearing their release
    // callbacks); a capsule never imported releases them when it is dropped.
    let schema = PyCapsule::new_with_value(py, schema, c"arrow_schema")?;
    let array = PyCapsule::new_with_value(py, array, c"arrow_array")?;
    Ok((schema, array))
}

pub(crate) fn session_batches<'py>(
    py: Python<'py>,
    snap: &Py<Snapshot>,
    session_id: &str,
    since: Option<f64>,
    limit: Option<usize>,
) -> PyResult<Vec<CapsulePair<'py>>> {
    let owner = Arc::new(KeepSnapshot(snap.clone_ref(py)));
    let calls = snap.get().snap.session(session_id, since, limit).map_err(to_py)?;
    if calls.is_empty() {
        return Ok(vec![export(py, RecordBatch::new_empty(SCHEMA.clone()))?]);
    }
    calls.iter().map(|v| export(py, call_batch(v, &owner)?)).collect()
}
