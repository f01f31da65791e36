//! The single-writer lock (`DIR/LOCK`, format-spec/manifest.md §1), kept out
//! of forked children.
//!
//! A `flock` belongs to the open file description, which a `fork` shares with
//! the child: a child forked while a store is open for writing (a torch
//! DataLoader worker, a `multiprocessing` process, a subprocess before its
//! `exec`) would keep holding the store's lock after the parent closed it, and
//! every later open for writing would be refused as "locked by another
//! writer" until that child exits. So every held lock is registered here, and
//! a `pthread_atfork` child handler points the child's copies of their
//! descriptors at `/dev/null` (with `dup2`, async-signal-safe): the child no
//! longer references the lock's file description, and its copy of the store
//! closes `/dev/null` harmlessly. The handler runs when the child first
//! runs: until the scheduler gets to it, the child still shares the lock's
//! description. So a lock is also released explicitly (`flock(LOCK_UN)`, on
//! the description) when it is dropped, before its descriptor is closed: a
//! close and reopen right after a fork never waits for the child to run.
//! (A child started by `posix_spawn`, as `std::process::Command` does, runs
//! no fork handlers; close-on-exec drops the descriptor at its `exec` a
//! moment later.)

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

/// Descriptors of the locks held by this process (-1: a free slot). A fixed
/// table of atomics: the fork handler may not take a lock or allocate.
const SLOTS: usize = 256;
static HELD: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
static INSTALL: Once = Once::new();

/// Runs in the child of a `fork`, before `fork` returns there: only
/// async-signal-safe calls.
extern "C" fn in_child() {
    // SAFETY: open, dup2, fcntl and close are async-signal-safe; the path is
    // a NUL-terminated static string.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 {
            return;
        }
        for slot in &HELD {
            let fd = slot.load(Ordering::Acquire);
            if fd >= 0 && libc::dup2(null, fd) == fd {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
        libc::close(null);
    }
}

/// A held store lock: its file, registered so that forked children drop it.
#[derive(Debug)]
pub(crate) struct HeldLock {
    /// Closed (by its own drop) after `Drop for HeldLock` unregistered it.
    _file: File,
    slot: Option<&'static AtomicI32>,
}

impl HeldLock {
    /// Register `file`, whose `flock` the caller holds. With every slot taken
    /// (more than 256 stores open for writing in one process) the lock works
    /// as before, without the fork protection.
    pub(crate) fn new(file: File) -> HeldLock {
        INSTALL.call_once(|| {
            // SAFETY: registers a handler that only makes async-signal-safe calls.
            unsafe {
                libc::pthread_atfork(None, None, Some(in_child));
            }
        });
        let fd: RawFd = file.as_raw_fd();
        let slot = HELD.iter().find(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire).is_ok());
        HeldLock { _file: file, slot }
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        // Unregister before the descriptor is closed (when `file` drops after
        // this), so a fork meanwhile never redirects a reused descriptor number.
        if let Some(slot) = self.slot {
            slot.store(-1, Ordering::Release);
        }
        // The lock belongs to the open file description, which a forked
        // child whose fork handler has not run yet still shares: closing
        // this descriptor would leave it locked until the child runs.
        // Unlocking the description releases it now. (An error leaves the
        // close to release it, as before.)
        let _ = self._file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::HeldLock;
    use std::fs::{File, OpenOptions};
    use std::os::fd::AsRawFd;

    fn lock(path: &std::path::Path) -> Option<HeldLock> {
        let file: File = OpenOptions::new().create(true).truncate(false).write(true).open(path).expect("open LOCK");
        file.try_lock().ok().map(|()| HeldLock::new(file))
    }

    /// A second descriptor of the lock's file description stands for a
    /// forked child that has not run yet: a reopen after the close must not
    /// wait for it.
    #[test]
    fn a_dropped_lock_is_released_though_its_description_is_shared() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("LOCK");
        let held = lock(&path).expect("first lock");
        // SAFETY: dup of a descriptor `held` owns and keeps open here.
        let child_copy = unsafe { libc::dup(held._file.as_raw_fd()) };
        assert!(child_copy >= 0);
        assert!(lock(&path).is_none(), "held");
        drop(held);
        let again = lock(&path);
        // SAFETY: closes the descriptor dup'ed above, used by nothing else.
        unsafe { libc::close(child_copy) };
        assert!(again.is_some(), "the reopen waited for the shared description");
    }
}
