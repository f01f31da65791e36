//! Segment files: the active segment's writer ([`writer`]), validated reads of
//! frames in a mapped segment ([`SegmentRef`]), and recovery/loading
//! ([`recovery`]). Implements format-spec/segment.md.

pub mod recovery;
pub mod writer;

use crate::error::{Error, Result};
use crate::format::frame::{read_frame, FrameRead};
use crate::storage::mmap::Mapping;
use std::path::PathBuf;
use std::sync::Arc;

/// A segment as a snapshot sees it: a mapping and how many bytes of it hold
/// committed frames. Cloning is cheap (two `Arc`s).
#[derive(Debug, Clone)]
pub struct SegmentRef {
    pub id: u64,
    pub path: Arc<PathBuf>,
    map: Arc<Mapping>,
    /// End of the last committed frame visible to this snapshot.
    pub visible_len: u64,
    pub sealed: bool,
}

impl SegmentRef {
    pub(crate) fn new(id: u64, path: Arc<PathBuf>, map: Arc<Mapping>, visible_len: u64, sealed: bool) -> Self {
        debug_assert!(visible_len as usize <= map.bytes().len());
        Self { id, path, map, visible_len, sealed }
    }

    /// The committed bytes (header and frames; never the footer).
    pub fn bytes(&self) -> &[u8] {
        let all = self.map.bytes();
        all.get(..self.visible_len as usize).unwrap_or(all)
    }

    /// Every mapped byte (for a sealed segment: footer and trailer included).
    pub(crate) fn mapped_bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    /// Give the mapping's resident pages back (see `Mapping::release_pages`).
    pub(crate) fn release_pages(&self) {
        self.map.release_pages();
    }

    /// A weak handle on the mapping: it fails to upgrade once no snapshot uses it.
    pub(crate) fn weak_map(&self) -> std::sync::Weak<Mapping> {
        Arc::downgrade(&self.map)
    }

    /// The whole mapped region (for zero-copy proofs and diagnostics).
    pub fn mapped_range(&self) -> std::ops::Range<usize> {
        self.map.address_range()
    }

    /// The CRC-checked body of the frame at `offset`.
    pub fn body_at(&self, offset: u64) -> Result<&[u8]> {
        match read_frame(self.bytes(), offset) {
            Ok(FrameRead::Frame { body, .. }) => Ok(body),
            Ok(FrameRead::End) => Err(Error::corrupt(self.path.as_path(), offset, "no frame where the index points")),
            Err(e) => Err(Error::corrupt(self.path.as_path(), offset, e.what)),
        }
    }
}
