//! File I/O: memory mappings, the store lock, finding a sparse file's
//! written part and starting a file's writeback (the crate's only `unsafe`), atomic file replacement and
//! directory fsync. Everything above this layer works on
//! byte slices and `std::fs::File`.

pub mod fault;
pub mod mmap;
pub(crate) mod table;
pub(crate) mod lock;

use fault::{Faults, Op};

use crate::error::{Error, Result};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The manifest's file name inside a store directory.
pub(crate) const MANIFEST_NAME: &str = "MANIFEST";
/// Shards live under `DIR/shards/{steps,trajectories}/`.
pub(crate) const SHARDS_DIR: &str = "shards";
/// The shard tables, one directory each under [`SHARDS_DIR`].
pub(crate) const SHARD_TABLES: [&str; 2] = ["steps", "trajectories"];
/// The writer lock's file name.
pub(crate) const LOCK_NAME: &str = "LOCK";

/// File name of segment `id` inside a store directory.
pub fn segment_file_name(id: u64) -> String {
    format!("seg-{id:010}.tlog")
}

/// Path of segment `id` inside `dir`.
pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(segment_file_name(id))
}

/// Parse a segment id back from a file name made by [`segment_file_name`].
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    name.strip_prefix("seg-")?.strip_suffix(".tlog")?.parse().ok()
}

/// fsync a directory so that renames and new files in it are durable.
pub fn sync_dir(dir: &Path, faults: &Faults) -> Result<()> {
    fault::check(faults, Op::SyncDir { path: dir })
        .and_then(|()| File::open(dir))
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(format!("fsync directory {}", dir.display()), e))
}

/// Replace `dir/name` with `bytes` atomically: write `name.tmp`, fsync it,
/// rename it over `name`, fsync the directory. A crash leaves the old or the new
/// file, never a mix.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8], faults: &Faults) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let dst = dir.join(name);
    fault::check(faults, Op::Replace { path: &dst }).map_err(|e| Error::io(format!("replace {}", dst.display()), e))?;
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
    f.write_all(bytes).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
    f.sync_all().map_err(|e| Error::io(format!("fsync {}", tmp.display()), e))?;
    drop(f);
    fs::rename(&tmp, &dst).map_err(|e| Error::io(format!("rename {} to {}", tmp.display(), dst.display()), e))?;
    sync_dir(dir, faults)
}

/// A file written front to back whose written bytes are handed to the
/// kernel's writeback every [`WRITEBACK_BYTES`] as it goes
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, Linux; elsewhere a plain file),
/// so that the fsync at its end finds little left to write. A large file
/// (the shard index file: 1.3 GB at 10M calls) otherwise goes out in one
/// burst of synchronous writes at that fsync, in the device queue ahead of
/// the segment fsyncs that acknowledge appends. Starting writeback changes
/// nothing of what is durable: the caller still fsyncs.
pub(crate) struct WritebackFile {
    file: File,
    /// Bytes written from the start of the file.
    written: u64,
    /// Where the range not yet handed to writeback starts.
    handed: u64,
    /// Whether to start writeback at all (not for a scratch file, which
    /// is never fsynced and may be deleted before it needs to be written).
    on: bool,
}

/// How much [`WritebackFile`] writes between two writeback starts.
pub(crate) const WRITEBACK_BYTES: u64 = 8 << 20;

impl WritebackFile {
    /// `file`, written from its start; `on`: start its writeback as it goes.
    pub(crate) fn new(file: File, on: bool) -> WritebackFile {
        WritebackFile { file, written: 0, handed: 0, on }
    }

    /// The file (to seek back and fsync).
    pub(crate) fn into_inner(self) -> File {
        self.file
    }

    #[cfg(target_os = "linux")]
    fn start_writeback(&self, from: u64, len: u64) {
        use std::os::fd::AsRawFd;
        let (Ok(from), Ok(len)) = (libc::off64_t::try_from(from), libc::off64_t::try_from(len)) else { return };
        // SAFETY: sync_file_range on a descriptor this value owns; it only
        // starts writeback of pages already written. Best effort: an error
        // here is one the caller's fsync reports.
        unsafe {
            libc::sync_file_range(self.file.as_raw_fd(), from, len, libc::SYNC_FILE_RANGE_WRITE);
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn start_writeback(&self, _from: u64, _len: u64) {}
}

impl Write for WritebackFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.on && self.written - self.handed >= WRITEBACK_BYTES {
            self.start_writeback(self.handed, self.written - self.handed);
            self.handed = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Where the last data region of `file` (of length `len`) ends: every byte
/// past it is a hole and reads as zero. `len` where the file system cannot say
/// (no `SEEK_HOLE`), or on any error.
pub(crate) fn written_len(file: &File, len: u64) -> u64 {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut end = 0u64;
    let mut pos = 0u64;
    while pos < len {
        let Ok(at) = libc::off_t::try_from(pos) else { return len };
        // SAFETY: lseek on a descriptor this function borrows; it only moves
        // the file offset, which no caller relies on (reads use pread).
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            // ENXIO: no data at or after `pos`; anything else: cannot say.
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => end,
                _ => len,
            };
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let Ok(hole) = u64::try_from(hole) else { return len };
        if hole <= pos {
            return len;
        }
        end = hole.min(len);
        pos = hole;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::{written_len, WritebackFile, WRITEBACK_BYTES};
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::FileExt;

    /// A file written through [`WritebackFile`] (writeback started at
    /// every [`WRITEBACK_BYTES`], or never) holds exactly the bytes written,
    /// whatever the sizes of the writes, and takes a header rewritten at its
    /// start afterwards, as the shard index file's writer does.
    #[test]
    fn a_file_written_with_writeback_holds_exactly_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut want: Vec<u8> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        while want.len() < 2 * WRITEBACK_BYTES as usize + 12_345 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            want.push(x as u8);
        }
        for on in [true, false] {
            let path = dir.path().join(format!("f-{on}"));
            let mut w = std::io::BufWriter::with_capacity(1 << 16, WritebackFile::new(std::fs::File::create(&path).unwrap(), on));
            let mut at = 0;
            let mut step = 1;
            while at < want.len() {
                let end = (at + step).min(want.len());
                w.write_all(&want[at..end]).unwrap();
                at = end;
                step = step * 3 % 1_000_003 + 1;
            }
            let mut file = w.into_inner().map_err(|e| e.into_error()).unwrap().into_inner();
            file.seek(SeekFrom::Start(0)).unwrap();
            file.write_all(b"HEAD").unwrap();
            file.sync_all().unwrap();
            let mut got = Vec::new();
            std::fs::File::open(&path).unwrap().read_to_end(&mut got).unwrap();
            assert_eq!(got.len(), want.len());
            assert_eq!(&got[..4], b"HEAD");
            assert!(got[4..] == want[4..], "writeback {on}: the bytes differ");
        }
    }

    /// Every byte past `written_len` reads as zero, and a preallocated
    /// segment's unwritten tail is not counted (where the file system has
    /// holes: then at most the block holding the last written byte is).
    #[test]
    fn written_len_leaves_out_only_zero_bytes() {
        let dir = tempfile::tempdir().unwrap();
        for (writes, len) in [
            (vec![(0u64, 100usize)], 64u64 << 20),
            (vec![(0, 100), (5 << 20, 3)], 64 << 20),
            (vec![(0, 10), ((64 << 20) - 5, 5)], 64 << 20),
            (vec![], 1 << 20),
        ] {
            let path = dir.path().join("f");
            let file = std::fs::File::create(&path).unwrap();
            file.set_len(len).unwrap();
            let mut last = 0;
            for (at, n) in &writes {
                file.write_all_at(&vec![7u8; *n], *at).unwrap();
                last = last.max(at + *n as u64);
            }
            let end = written_len(&file, len);
            assert!(end >= last && end <= len, "{writes:?}: {end}");
            let mut rest = Vec::new();
            let mut f = std::fs::File::open(&path).unwrap();
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(end)).unwrap();
            f.read_to_end(&mut rest).unwrap();
            assert!(rest.iter().all(|&b| b == 0), "{writes:?}: non-zero bytes past {end}");
            if writes.len() == 1 && end < len {
                assert!(end <= 1 << 20, "the unwritten tail was counted: {end}");
            }
        }
    }
}
