//! JSON text as rLLM's gateway (Python) writes it: floats as Python's
//! `repr(float)` (the shortest decimal that parses back to the same `f64`,
//! in exponent form below 1e-4 and from 1e16 on, with a two-digit exponent),
//! strings escaped as `json.dumps` escapes ASCII text. The simulator only
//! writes printable ASCII and `\n`, where `json.dumps` and serde_json agree.

pub use trajlog::trace_json::{py_float, write_py_float};
