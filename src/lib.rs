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

pub mod audit;
pub mod bench;
pub mod compact;
pub mod delta;
pub mod error;
pub mod format;
#[doc(hidden)]
pub mod fuzzing;
pub mod index;
pub mod limits;
pub mod progress;
pub mod record;
pub mod repair;
pub mod rllm;
pub mod segment;
pub mod sim;
pub mod snapshot;
pub mod storage;
pub mod store;
pub mod trace_json;
pub mod verify;

pub use compact::{CompactOptions, CompactReport, Selection, ShardCompression};
pub use error::{Error, ErrorKind, Result};
pub use format::record::{Loc, Relation};
pub use record::{Annotation, Call, Target};
pub use snapshot::{CallView, SegmentInfo, SessionInfo, Snapshot};
pub use store::{Durability, Options, Receipt, RecoveryEvent, RecoveryEventKind, RecoveryMode, RecoveryReport, Store};
