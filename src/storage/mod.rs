//! File I/O: memory mappings (the crate's only `unsafe`), atomic file
//! replacement and directory fsync. Everything above this layer works on
//! byte slices and `std::fs::File`.

pub mod fault;
pub mod mmap;
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
