//! File I/O: memory mappings, the store lock and finding a sparse file's
//! written part (the crate's only `unsafe`), atomic file replacement and
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
    use super::written_len;
    use std::io::Read;
    use std::os::unix::fs::FileExt;

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
