//! What opening a store found in its log and did about it: the
//! [`RecoveryReport`] that [`Store::recovery_report`] returns
//! (format-spec/segment.md §6). Every cut and every skip is in it; an empty
//! report means the open found nothing to cut, skip or rebuild.

use super::RecoveryMode;
pub use crate::segment::recovery::RecoveryEventKind;
use std::fmt;
use std::path::PathBuf;

/// One thing recovery found in one segment, and what it did.
#[derive(Debug, Clone, PartialEq)]
pub struct RecoveryEvent {
    pub kind: RecoveryEventKind,
    /// The segment's id (its file is `path`).
    pub segment: u64,
    pub path: PathBuf,
    /// Byte offset in the segment file (for a rebuilt footer: where the
    /// frames end and the footer starts, or would).
    pub offset: u64,
    /// Bytes concerned: for a torn tail, those cut off up to the last
    /// non-zero byte (the preallocated zeros after it are not counted); for a
    /// skip, from `offset` up to the next valid frame (in a sealed segment
    /// with a usable footer: the damaged frame's size); for a rebuilt footer,
    /// the footer and trailer.
    pub len: u64,
    /// Why, in words (the validation failure).
    pub what: String,
}

/// What an open (or, read-only, the last [`crate::Store::refresh`]) found and did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecoveryReport {
    /// The mode the store was opened with.
    pub mode: RecoveryMode,
    /// A read-only open: it cuts nothing and does not report a torn tail
    /// (beside a live writer that may be a write in progress); "skipped"
    /// there means left out of its view.
    pub read_only: bool,
    /// In log order (segment, offset).
    pub events: Vec<RecoveryEvent>,
}

impl RecoveryReport {
    /// Nothing cut, skipped or rebuilt.
    pub fn is_clean(&self) -> bool {
        self.events.is_empty()
    }

    /// How many events of `kind`.
    pub fn count(&self, kind: RecoveryEventKind) -> usize {
        self.events.iter().filter(|e| e.kind == kind).count()
    }

    /// Bytes concerned by events of `kind` (see [`RecoveryEvent::len`]).
    pub fn bytes(&self, kind: RecoveryEventKind) -> u64 {
        self.events.iter().filter(|e| e.kind == kind).map(|e| e.len).sum()
    }
}

impl fmt::Display for RecoveryEvent {
    /// One line: what was done, where, and why.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (seg, path, at, len, what) = (self.segment, self.path.display(), self.offset, self.len, &self.what);
        match self.kind {
            RecoveryEventKind::TornTailCut => {
                write!(f, "cut a torn tail of {len} bytes at offset {at} of segment {seg} ({path}): {what}")
            }
            RecoveryEventKind::CorruptedRecordSkipped => write!(
                f,
                "skipped {len} damaged bytes at offset {at} of segment {seg} ({path}), left in place: {what}"
            ),
            RecoveryEventKind::SkippedEarlier => write!(
                f,
                "{len} damaged bytes at offset {at} of segment {seg} ({path}) were skipped by an earlier open and are still in the file"
            ),
            RecoveryEventKind::FooterRebuilt => {
                write!(f, "rebuilt the index of segment {seg} ({path}) from its frames: {what}")
            }
        }
    }
}

impl fmt::Display for RecoveryReport {
    /// A one-line summary (the events are listed by their own `Display`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RecoveryEventKind::*;
        write!(
            f,
            "recovery mode {}: {} torn tails cut ({} bytes), {} damaged regions skipped ({} bytes), {} skipped earlier ({} bytes), {} footers rebuilt",
            self.mode,
            self.count(TornTailCut),
            self.bytes(TornTailCut),
            self.count(CorruptedRecordSkipped),
            self.bytes(CorruptedRecordSkipped),
            self.count(SkippedEarlier),
            self.bytes(SkippedEarlier),
            self.count(FooterRebuilt),
        )
    }
}
