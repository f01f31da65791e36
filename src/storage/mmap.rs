//! Read-only memory mappings of segment files — the only module with `unsafe`.
//!
//! # The mmap contract
//! A mapping is a view of the file's bytes; if another process truncated the
//! file under it, touching the lost pages would raise SIGBUS. trajlog upholds:
//! 1. Segment files are only ever *grown* while mapped, except that the single
//!    writer truncates, at open, bytes past the last valid record (no reader has
//!    been handed anything there: readers serve only CRC-checked frames), and at
//!    seal, preallocated zero bytes past the footer (likewise never served).
//! 2. A segment file is deleted only once no `Mapping` of it is alive in this
//!    process (mappings are reference counted via `Arc`); on Linux, unlinking a
//!    mapped file keeps its pages alive anyway.
//! 3. Bytes are only read through `&[u8]` obtained here, and every read of a
//!    record goes through frame validation (CRC) first.
//!
//! 4. The shard index file (`shards/index.tsi`, format-spec/shard-index.md)
//!    is never written in place: a new one is written under another name
//!    and renamed over it, so a mapping of the old one keeps its inode.
//!
//! Callers outside trajlog that truncate segment files void this contract.

use crate::error::{Error, Result};
use std::fs::File;
use std::path::Path;

/// A read-only mapping of the first `len` bytes of a file.
#[derive(Debug)]
pub struct Mapping {
    map: Option<memmap2::Mmap>,
}

impl Mapping {
    /// Map the first `len` bytes of `file` read-only. `len` must not exceed the
    /// file's length at the time of the call.
    pub(crate) fn map(file: &File, len: u64, path: &Path) -> Result<Self> {
        if len == 0 {
            return Ok(Self { map: None });
        }
        let len = usize::try_from(len).map_err(|_| Error::invalid("segment length", "does not fit in memory"))?;
        // SAFETY: see the module-level contract: trajlog never shrinks a mapped
        // segment below bytes it serves, and never mutates mapped bytes in place
        // (writes only append past the committed end). The mapping is read-only.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(file) }
            .map_err(|e| Error::io(format!("mmap {}", path.display()), e))?;
        Ok(Self { map: Some(map) })
    }

    /// Give this process's resident pages of the mapping back (`MADV_DONTNEED`):
    /// the resident set shrinks at once, and the next access faults the same
    /// bytes in again from the page cache or the file. For long reads of
    /// whole segments (compaction), so that what they touched does not stay
    /// counted against the process. Advice only: an error changes nothing.
    pub(crate) fn release_pages(&self) {
        if let Some(map) = &self.map {
            // SAFETY: a `Mapping` is a shared (`MAP_SHARED`), read-only mapping
            // of a file trajlog never modifies in place (the contract above).
            // For such a mapping `MADV_DONTNEED` discards no data: it only
            // unmaps the pages, and any later access — through slices
            // borrowed before this call too — reads the same bytes back from
            // the file. (memmap2 marks the advice unsafe for private or
            // written mappings, whose changes it would discard.)
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// [`Mapping::release_pages`] for the pages of `range` (bytes of the
    /// mapping) only.
    pub(crate) fn release_range(&self, range: std::ops::Range<usize>) {
        if let Some(map) = &self.map {
            let start = range.start - range.start % page_size();
            let end = range.end.min(map.len());
            if start < end {
                // SAFETY: as in `release_pages`.
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
            }
        }
    }

    /// The crc32 of `range` of the mapping (`None` past its end), reading
    /// it through the mapping in 64 MiB steps and giving each step's pages
    /// back after it: no copy, and the check leaves nothing resident.
    pub(crate) fn crc32_transient(&self, range: std::ops::Range<usize>) -> Option<u32> {
        const STEP: usize = 64 << 20;
        let bytes = self.bytes().get(range.clone())?;
        let mut h = crc32fast::Hasher::new();
        for (i, chunk) in bytes.chunks(STEP).enumerate() {
            h.update(chunk);
            let at = range.start + i * STEP;
            self.release_range(at..at + chunk.len());
        }
        Some(h.finalize())
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The mapped address range, for tests and diagnostics (zero-copy proofs).
    pub fn address_range(&self) -> std::ops::Range<usize> {
        let b = self.bytes();
        let start = b.as_ptr() as usize;
        start..start + b.len()
    }
}

/// The system's page size (4096 where it cannot be asked).
fn page_size() -> usize {
    // SAFETY: `sysconf` reads a constant of the system; no memory is touched.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|n| *n > 0).unwrap_or(4096)
}

/// Give the heap's free pages back to the system (glibc's `malloc_trim`).
/// An open frees the per-row structures it decoded from the shards (about
/// 120 bytes a compacted call, in small blocks among the blocks it keeps);
/// glibc returns only the top of its heap by itself, so without this the
/// process keeps those pages resident: 265 MB instead of 160 MB after a
/// read-only open of a million compacted calls. No effect elsewhere.
pub(crate) fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory of the allocator's own
    // arenas; it touches no allocation that is in use and takes its locks.
    unsafe {
        libc::malloc_trim(0);
    }
}
