//! # trajlog
//!
//! An exact, append-only trace store for reinforcement-learning training of
//! LLM agents. Each captured LLM call keeps the token ids and logprobs the
//! inference server produced, bit for bit, in typed columns of length- and
//! CRC-framed records inside segment files; readers get `&[u32]` / `&[f32]`
//! slices that point into the mapped files.
//!
//! ```no_run
//! use trajlog::{Call, Options, Store};
//! let store = Store::open("/tmp/traces", Options::default())?;
//! store.append(Call {
//!     trace_id: "t1".into(),
//!     session_id: "task-7:0".into(),
//!     timestamp: 1.0,
//!     prompt_token_ids: vec![1, 2, 3],
//!     completion_token_ids: vec![4, 5],
//!     logprobs: Some(vec![-0.1, -0.2]),
//!     ..Default::default()
//! })?;
//! store.flush()?;
//! let snap = store.snapshot();
//! for call in snap.session("task-7:0", None, None)? {
//!     let ids: &[u32] = call.completion_token_ids(); // zero-copy
//!     assert_eq!(ids, &[4, 5]);
//! }
//! # Ok::<(), trajlog::Error>(())
//! ```
//!
//! See `ARCHITECTURE.md` for the map of modules and `format-spec/` for the bytes.
//!
//! ## The public API
//!
//! The types re-exported here ([`Store`], [`Options`], [`Snapshot`],
//! [`CallView`], [`Call`], …) and the modules [`audit`], [`limits`],
//! [`repair`], [`rllm`], [`trace_json`] and [`verify`] are the API. Everything
//! else is crate-private.
//!
//! ## Features
//!
//! - `sqlite`: the rLLM SQLite migration, `rllm::sqlite` (a bundled SQLite).
//! - `internals`: unstable and hidden from the docs; the codecs, the fault
//!   injection and the fuzz targets' bodies, for this repository's test suite
//!   and `fuzz/`. No semver promise.

// The lint wall (STYLE.md): no unwrap, no unchecked indexing, no unsafe block
// without its safety argument, on every library path; tests may.
#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::undocumented_unsafe_blocks)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::indexing_slicing))]

/// A module that is crate-private, and public (hidden, unstable) with the
/// `internals` feature for the test suite and the fuzz targets.
macro_rules! internal_mod {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        mod $name;
    )*};
}

internal_mod!(format, segment, shard, storage);

#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod fuzzing;

pub mod audit;
mod compact;
mod delta;
mod error;
mod index;
mod inventory;
/// Where a JSON value ends, found without parsing (shared with the gateway crate; not a stable API).
#[doc(hidden)]
pub mod json_scan;
pub mod limits;
mod record;
pub mod repair;
pub mod rllm;
mod snapshot;
pub mod space;
mod store;
pub mod trace_json;
pub mod verify;

pub use compact::{
    merge_tier, CompactOptions, CompactReport, Selection, ShardCompression, COPY_FORWARD_MAX, DEFAULT_BATCH_CALLS,
    DEFAULT_COLLECT_DEAD_FRACTION, DEFAULT_COPY_FORWARD, DEFAULT_MERGE_FANOUT, MERGE_MAX_ROWS,
};
pub use error::{Error, ErrorKind, Result};
pub use format::docs::{found_cuts_agree, ExtraCuts, Hole, Spliced};
pub use format::record::{Loc, Relation};
pub use record::{Annotation, Call, Target, ValidCall};
pub use snapshot::{CallView, Docs, IndexLayers, SegmentInfo, SessionInfo, Snapshot};
pub use store::{
    Durability, Options, Receipt, RecoveryEvent, RecoveryEventKind, RecoveryMode, RecoveryReport, Store, TryAppend,
};
