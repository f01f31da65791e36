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

    /// [`Mapping::crc32_transient`] of each of `ranges`, on two threads when
    /// they hold more than 64 MiB in all (an open of a large store checks a
    /// 1–2 GB shard index file while the other core is mostly idle): the
    /// ranges are cut into 16 MiB pieces, the first half of the bytes
    /// hashed here and the second on a helper thread, and each range's
    /// pieces combined in order (`crc32fast::Hasher::combine`).
    pub(crate) fn crc32s_transient(&self, ranges: &[std::ops::Range<usize>]) -> Vec<Option<u32>> {
        const PIECE: usize = 16 << 20;
        let len = self.bytes().len();
        let total: usize = ranges.iter().filter(|r| r.start <= r.end && r.end <= len).map(|r| r.end - r.start).sum();
        if total <= 64 << 20 {
            return ranges.iter().map(|r| self.crc32_transient(r.clone())).collect();
        }
        // (range, piece) in order; each piece's bytes.
        let mut pieces: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        for (i, r) in ranges.iter().enumerate().filter(|(_, r)| r.start <= r.end && r.end <= len) {
            let mut at = r.start;
            loop {
                let end = (at + PIECE).min(r.end);
                pieces.push((i, at..end));
                if end == r.end {
                    break;
                }
                at = end;
            }
        }
        let mut sum = 0;
        let split = pieces.iter().take_while(|(_, p)| {
            sum += p.len();
            sum <= total / 2
        });
        let split = split.count();
        let hash = |ps: &[(usize, std::ops::Range<usize>)]| -> Vec<crc32fast::Hasher> {
            ps.iter()
                .map(|(_, p)| {
                    let mut h = crc32fast::Hasher::new();
                    h.update(self.bytes().get(p.clone()).unwrap_or_default());
                    self.release_range(p.clone());
                    h
                })
                .collect()
        };
        let (first, second) = pieces.split_at(split.min(pieces.len()));
        let hashers: Vec<crc32fast::Hasher> = std::thread::scope(|scope| {
            let other = scope.spawn(|| hash(second));
            let mut mine = hash(first);
            // A helper that could not run (it panicked): hash its half here.
            mine.extend(other.join().unwrap_or_else(|_| hash(second)));
            mine
        });
        let mut out: Vec<Option<crc32fast::Hasher>> = ranges.iter().map(|_| None).collect();
        for ((i, _), h) in pieces.iter().zip(hashers) {
            if let Some(slot) = out.get_mut(*i) {
                match slot {
                    Some(acc) => acc.combine(&h),
                    None => *slot = Some(h),
                }
            }
        }
        ranges
            .iter()
            .zip(out)
            .map(|(r, h)| match h {
                Some(h) => Some(h.finalize()),
                // An empty range in the mapping has the crc32 of nothing.
                None if r.start <= r.end && r.end <= len => Some(crc32fast::hash(&[])),
                None => None,
            })
            .collect()
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

/// This process's resident pages of mapped files, in bytes (the `shared`
/// field of `/proc/self/statm`: file pages and shared memory); `None` where
/// that is not known.
fn resident_file_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let shared: u64 = statm.split_whitespace().nth(2)?.parse().ok()?;
        Some(shared.saturating_mul(page_size() as u64))
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// A bound on the mapped-file pages a long walk of random lookups keeps
/// resident: binary searches of the index files' tables (a retirement's or
/// a liveness count's lookups of 1M calls in segments on a 10M-call store)
/// touch pages all over them, each counted against the process until it is
/// given back. [`PageBudget::tick`] after each lookup reads what is
/// resident every [`PageBudget::EVERY`] ticks (one small read of
/// `/proc/self/statm`) and runs `release` once it passes the budget; the
/// pages lookups touch again (the top of each binary search) fault back in
/// from the page cache. Where the resident pages are not known it releases
/// every `EVERY × 64` ticks.
pub(crate) struct PageBudget {
    ticks: u64,
    next_check: u64,
    max_bytes: u64,
}

impl PageBudget {
    /// Lookups between two readings of the resident pages. A lookup
    /// touches up to ~20 pages, so a walk may pass the budget by up to
    /// ~20 × 4 KiB × `EVERY` before a reading sees it: 20 MB here (1024
    /// lookups before, up to ~80 MB: a batched compaction of 1.5M calls on
    /// 10M peaked at 1.04–1.06 GB then, 0.94 GB now, in the same time).
    pub(crate) const EVERY: u64 = 256;

    /// What a compaction's walks keep of the index files resident beside
    /// the heap. (Smaller costs time: the pages given back stay in the page
    /// cache, but each one a later lookup needs again is a minor fault and
    /// a fault-around; 128 MiB made that batched compaction ~30% slower.)
    const COMPACTION_BYTES: u64 = 256 << 20;

    fn new(max_bytes: u64) -> PageBudget {
        PageBudget { ticks: 0, next_check: Self::EVERY, max_bytes }
    }

    /// The budget of a compaction's walks (256 MiB of mapped-file pages).
    pub(crate) fn compaction() -> PageBudget {
        Self::new(Self::COMPACTION_BYTES)
    }

    /// One lookup done; `release` gives the walk's mappings' pages back.
    pub(crate) fn tick(&mut self, release: impl FnOnce()) {
        self.ticks_n(1, release);
    }

    /// `n` lookups done (see [`PageBudget::tick`]).
    pub(crate) fn ticks_n(&mut self, n: u64, release: impl FnOnce()) {
        self.ticks = self.ticks.saturating_add(n);
        if self.ticks < self.next_check {
            return;
        }
        self.next_check = self.ticks.saturating_add(Self::EVERY);
        let over = match resident_file_bytes() {
            Some(bytes) => bytes > self.max_bytes,
            None => (self.ticks / Self::EVERY).is_multiple_of(64),
        };
        if over {
            release();
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget of no bytes releases at each reading (every `EVERY`
    /// lookups: this test binary's own mapped pages are resident); an
    /// unbounded one never does.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_page_budget_releases_only_past_its_bytes_and_only_at_a_reading() {
        let mut released = 0;
        let mut tight = PageBudget::new(0);
        for _ in 0..PageBudget::EVERY - 1 {
            tight.tick(|| released += 1);
        }
        assert_eq!(released, 0, "no reading before EVERY lookups");
        tight.tick(|| released += 1);
        assert_eq!(released, 1);
        tight.ticks_n(PageBudget::EVERY * 3, || released += 1);
        assert_eq!(released, 2, "one reading for a batch of lookups");
        let mut loose = PageBudget::new(u64::MAX);
        for _ in 0..PageBudget::EVERY * 65 {
            loose.tick(|| released += 1);
        }
        assert_eq!(released, 2);
    }

    /// The two-thread crc32 of a large mapping equals the one-thread one,
    /// section by section, for empty, unaligned and out-of-range sections.
    #[test]
    fn crc32s_on_two_threads_equal_the_sequential_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let len = (80 << 20) + 12_345;
        let bytes: Vec<u8> = (0..len).map(|i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        std::fs::write(&path, &bytes).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        let map = Mapping::map(&file, len as u64, &path).expect("map");
        let ranges =
            [0..0, 0..(40 << 20) + 7, (40 << 20) + 7..(40 << 20) + 7, (40 << 20) + 7..len - 3, len - 3..len, 5..len + 1];
        let got = map.crc32s_transient(&ranges);
        let want: Vec<Option<u32>> =
            ranges.iter().map(|r| bytes.get(r.clone()).map(crc32fast::hash)).collect();
        assert_eq!(got, want);
        assert_eq!(got[5], None);
        // Small: the sequential path.
        assert_eq!(map.crc32s_transient(&[3..1000, 0..0]), vec![Some(crc32fast::hash(&bytes[3..1000])), Some(0)]);
    }
}

