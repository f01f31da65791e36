//! Fault injection at every point where the store touches the disk.
//!
//! Every segment write and fsync, every manifest replacement and every
//! directory fsync asks the store's [`FaultPlan`] (`Options::faults`, none by
//! default) first. A plan can let the operation proceed, fail it with an
//! errno (EIO, ENOSPC, …) without touching the disk, or write only a prefix
//! of the bytes and then fail (a short or torn write).
//!
//! [`CrashAt`] models a power cut: it lets everything through until its n-th
//! sync point, fails that one and everything after, and remembers how much of
//! each file had been fsynced — [`CrashAt::drop_unsynced`] then cuts every
//! segment back to that length (optionally leaving torn garbage past it), which
//! is what a machine that lost power keeps. The fault tests (`tests/faults.rs`)
//! drive the store through it at every sync point of a workload.
//!
//! The plans are built only by the test suite (feature `internals`); without
//! it the hooks stay in place and always let the operation proceed.
#![cfg_attr(not(feature = "internals"), allow(dead_code))]

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One disk operation of the store.
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    /// Positional write of `len` bytes at `offset` of a segment file.
    Write { path: &'a Path, offset: u64, len: usize },
    /// fsync / fdatasync of a segment file.
    Sync { path: &'a Path },
    /// Atomic replacement of a small file (the manifest): write a temporary
    /// file, fsync it, rename it over `path`.
    Replace { path: &'a Path },
    /// fsync of a directory (new files and renames in it become durable).
    SyncDir { path: &'a Path },
}

/// What happens to an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Proceed,
    /// Fail with this errno (`libc` numbering: 5 = EIO, 28 = ENOSPC), touching nothing.
    Fail(i32),
    /// Write only the first `written` bytes, then fail with `errno` (writes only;
    /// for other operations the same as `Fail`).
    Short {
        written: usize,
        errno: i32,
    },
}

/// EIO.
pub const EIO: i32 = 5;
/// ENOSPC.
pub const ENOSPC: i32 = 28;

/// Decides the fate of each disk operation.
pub trait FaultPlan: Send + Sync + std::fmt::Debug {
    fn check(&self, op: &Op<'_>) -> Fault;
}

/// The store's plan, if any.
pub type Faults = Option<Arc<dyn FaultPlan>>;

fn error(errno: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(errno)
}

/// Ask the plan about a non-write operation.
pub(crate) fn check(faults: &Faults, op: Op<'_>) -> std::io::Result<()> {
    match faults.as_ref().map_or(Fault::Proceed, |f| f.check(&op)) {
        Fault::Proceed => Ok(()),
        Fault::Fail(errno) | Fault::Short { errno, .. } => Err(error(errno)),
    }
}

/// `file.write_all_at(buf, offset)` through the plan.
pub(crate) fn write_at(faults: &Faults, file: &File, path: &Path, buf: &[u8], offset: u64) -> std::io::Result<()> {
    let op = Op::Write { path, offset, len: buf.len() };
    match faults.as_ref().map_or(Fault::Proceed, |f| f.check(&op)) {
        Fault::Proceed => file.write_all_at(buf, offset),
        Fault::Fail(errno) => Err(error(errno)),
        Fault::Short { written, errno } => {
            file.write_all_at(buf.get(..written.min(buf.len())).unwrap_or_default(), offset)?;
            Err(error(errno))
        }
    }
}

/// `fdatasync` (or `fsync` with `all`) through the plan.
pub(crate) fn sync(faults: &Faults, file: &File, path: &Path, all: bool) -> std::io::Result<()> {
    check(faults, Op::Sync { path })?;
    if all {
        file.sync_all()
    } else {
        file.sync_data()
    }
}

/// Which operations a [`FailAt`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Sync,
    Replace,
    SyncDir,
}

impl OpKind {
    fn of(op: &Op<'_>) -> OpKind {
        match op {
            Op::Write { .. } => OpKind::Write,
            Op::Sync { .. } => OpKind::Sync,
            Op::Replace { .. } => OpKind::Replace,
            Op::SyncDir { .. } => OpKind::SyncDir,
        }
    }
}

/// Fail the `nth` (0-based) operation of `kind` with `fault`, and — when
/// `sticky` — every operation of any kind after it (a disk that stays broken).
#[derive(Debug)]
pub struct FailAt {
    pub kind: OpKind,
    pub nth: u64,
    pub fault: Fault,
    pub sticky: bool,
    seen: AtomicU64,
    tripped: std::sync::atomic::AtomicBool,
}

impl FailAt {
    pub fn new(kind: OpKind, nth: u64, fault: Fault, sticky: bool) -> Arc<Self> {
        Arc::new(Self { kind, nth, fault, sticky, seen: AtomicU64::new(0), tripped: Default::default() })
    }

    /// Whether the fault has fired.
    pub fn tripped(&self) -> bool {
        self.tripped.load(Ordering::Acquire)
    }
}

impl FaultPlan for FailAt {
    fn check(&self, op: &Op<'_>) -> Fault {
        if self.sticky && self.tripped() {
            return match self.fault {
                Fault::Short { errno, .. } => Fault::Fail(errno),
                f => f,
            };
        }
        if OpKind::of(op) == self.kind && self.seen.fetch_add(1, Ordering::AcqRel) == self.nth {
            self.tripped.store(true, Ordering::Release);
            return self.fault;
        }
        Fault::Proceed
    }
}

/// A power cut at the `nth` (0-based) sync point: segment fsyncs, manifest
/// replacements and directory fsyncs count. That one and everything after
/// fail with EIO; [`CrashAt::drop_unsynced`] then leaves the files as a
/// machine that lost power would.
#[derive(Debug)]
pub struct CrashAt {
    nth: u64,
    state: Mutex<CrashState>,
}

#[derive(Debug, Default)]
struct CrashState {
    sync_points: u64,
    crashed: bool,
    /// Per segment file: end of the bytes written so far, and of those fsynced.
    written: HashMap<PathBuf, u64>,
    synced: HashMap<PathBuf, u64>,
}

impl CrashAt {
    pub fn new(nth: u64) -> Arc<Self> {
        Arc::new(Self { nth, state: Mutex::new(CrashState::default()) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CrashState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count the segment files already in `dir` as durable at their
    /// current length (written by an earlier process, which closed the
    /// store): a cut keeps them, and drops only what is written to them
    /// after this call and not fsynced. Without it, a file the plan never
    /// saw fsynced counts as empty.
    pub fn assume_durable(&self, dir: &std::path::Path) -> std::io::Result<()> {
        let mut st = self.state();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.file_name().to_string_lossy().ends_with(".tlog") {
                let len = e.metadata()?.len();
                st.written.insert(e.path(), len);
                st.synced.insert(e.path(), len);
            }
        }
        Ok(())
    }

    /// Whether the crash happened (the workload reached the `nth` sync point).
    pub fn crashed(&self) -> bool {
        self.state().crashed
    }

    /// Sync points seen so far (to size a sweep: run once with no crash).
    /// Another run has the same count only if the writer batches the same
    /// way: under `Durability::Sync` every batch is an fsync, and a batch is
    /// whatever the channel held when the writer woke. A sweep must fix the
    /// batching (`tests/faults.rs` holds the writer through the plan while a
    /// batch is queued), not hope for it.
    pub fn sync_points(&self) -> u64 {
        self.state().sync_points
    }

    /// Cut every segment file written through the plan back to its fsynced
    /// length; with `torn`, leave up to that many bytes of garbage past it
    /// (a write that reached the disk in part). Files never fsynced keep
    /// nothing past what was synced when they were created (their header).
    pub fn drop_unsynced(&self, torn: usize, seed: u64) -> std::io::Result<()> {
        let st = self.state();
        let mut rng = seed | 1;
        for (path, &written) in &st.written {
            let synced = st.synced.get(path).copied().unwrap_or(0);
            if written <= synced || !path.exists() {
                continue;
            }
            let file = std::fs::OpenOptions::new().write(true).open(path)?;
            file.set_len(synced)?;
            if torn > 0 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let n = (rng as usize % (torn + 1)).min((written - synced) as usize);
                let garbage: Vec<u8> = (0..n).map(|i| (rng >> (i % 56)) as u8 ^ 0x5a).collect();
                file.write_all_at(&garbage, synced)?;
            }
            file.sync_all()?;
        }
        Ok(())
    }
}

impl FaultPlan for CrashAt {
    fn check(&self, op: &Op<'_>) -> Fault {
        let mut st = self.state();
        if st.crashed {
            return Fault::Fail(EIO);
        }
        match *op {
            Op::Write { path, offset, len } => {
                let end = st.written.entry(path.to_owned()).or_insert(0);
                *end = (*end).max(offset + len as u64);
                Fault::Proceed
            }
            Op::Sync { path } | Op::Replace { path } | Op::SyncDir { path } => {
                if st.sync_points == self.nth {
                    st.crashed = true;
                    return Fault::Fail(EIO);
                }
                st.sync_points += 1;
                if let Op::Sync { .. } = op {
                    let written = st.written.get(path).copied().unwrap_or(0);
                    st.synced.insert(path.to_owned(), written);
                }
                Fault::Proceed
            }
        }
    }
}
