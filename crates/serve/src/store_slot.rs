//! The gateway's store, and its reopening after a failed write poisoned it.
//!
//! A failed write or fsync (a full disk, an I/O error, a file over the size
//! limit) poisons a trajlog store: every later write is refused until the
//! store is closed and opened again, which cuts the torn tail back to the
//! last acknowledged record (README "Durability"). A gateway that runs for
//! days must not need a restart for that, so the first request that meets
//! the poisoned store (or `GET /health`) empties the slot before it answers
//! (later requests get a 503 that says why, as they would from the poisoned
//! store) and starts a reopen in the background (`server::start_reopen`):
//! the old store is closed
//! once the requests holding it let go, and a new one is opened, again and
//! again with a growing pause while opening fails (the disk still full);
//! meanwhile a read-only open of the directory serves the reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use trajlog::Store;

/// The store a request uses now, or why there is none.
pub(crate) struct StoreSlot {
    current: RwLock<Current>,
    /// Why there is no writable store (the failure, then the last failed open).
    why: Mutex<String>,
    /// Set from the first request that met the poisoned store until the
    /// reopen ends: one reopen at a time.
    reopening: AtomicBool,
    /// Reopens that succeeded (the metrics).
    pub reopens: AtomicU64,
    /// A failed write that may have lost traces the gateway had already
    /// answered (`--durability async`: answered before they were durable),
    /// not yet reported by a flush.
    lost: Mutex<Option<String>>,
}

/// What the slot holds.
#[derive(Default)]
struct Current {
    store: Option<Arc<Store>>,
    /// `store` is a read-only open of the directory that serves reads while
    /// the writable open keeps failing (a full disk): writes are refused.
    read_only: bool,
}

impl StoreSlot {
    pub(crate) fn new(store: Store) -> StoreSlot {
        StoreSlot {
            current: RwLock::new(Current { store: Some(Arc::new(store)), read_only: false }),
            why: Mutex::new(String::new()),
            reopening: AtomicBool::new(false),
            reopens: AtomicU64::new(0),
            lost: Mutex::new(None),
        }
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    fn current_mut(&self) -> std::sync::RwLockWriteGuard<'_, Current> {
        self.current.write().unwrap_or_else(|e| e.into_inner())
    }

    fn unavailable(&self) -> String {
        format!("the store is being reopened after a failed write ({}); try again shortly", lock(&self.why))
    }

    /// A store to read from (also the read-only one that stands in while
    /// the writable open fails), or the error to answer with.
    pub(crate) fn get(&self) -> Result<Arc<Store>, String> {
        self.current().store.clone().ok_or_else(|| self.unavailable())
    }

    /// The store to write to, or the error to answer with while it is being
    /// reopened.
    pub(crate) fn get_writable(&self) -> Result<Arc<Store>, String> {
        let current = self.current();
        match &current.store {
            Some(store) if !current.read_only => Ok(store.clone()),
            _ => Err(self.unavailable()),
        }
    }

    /// Whether the slot holds a store that takes writes (the `/health`
    /// answer).
    pub(crate) fn available(&self) -> Result<(), String> {
        match self.get_writable()?.poisoned() {
            None => Ok(()),
            Some(e) => Err(format!("the store refuses writes after a failed write ({e})")),
        }
    }

    /// Claim the reopen: true for the first caller until [`StoreSlot::put`].
    pub(crate) fn claim_reopen(&self) -> bool {
        !self.reopening.swap(true, Ordering::AcqRel)
    }

    /// Empty the slot, saying why; the store taken, if there was one.
    pub(crate) fn take(&self, why: String) -> Option<Arc<Store>> {
        *lock(&self.why) = why;
        std::mem::take(&mut *self.current_mut()).store
    }

    /// Take `failed` out of the slot, saying why, if it is still the store
    /// there (a request that held an older store, already replaced, must not
    /// take the new one away); else end the reopen claimed for it.
    pub(crate) fn take_failed(&self, failed: &Arc<Store>, why: String) -> Option<Arc<Store>> {
        let mut current = self.current_mut();
        if current.read_only || !current.store.as_ref().is_some_and(|c| Arc::ptr_eq(c, failed)) {
            self.reopening.store(false, Ordering::Release);
            return None;
        }
        *lock(&self.why) = why;
        current.store.take()
    }

    /// Say why there is still no writable store (a failed open).
    pub(crate) fn still_empty(&self, why: String) {
        *lock(&self.why) = why;
    }

    /// Whether the slot holds no store at all (not even a read-only one).
    pub(crate) fn is_empty(&self) -> bool {
        self.current().store.is_none()
    }

    /// Serve reads from `store`, a read-only open, while the reopen goes on.
    pub(crate) fn put_read_only(&self, store: Arc<Store>) {
        *self.current_mut() = Current { store: Some(store), read_only: true };
    }

    /// Remember that a failed write may have lost answered traces, for the
    /// next flush to report.
    pub(crate) fn note_loss(&self, why: String) {
        *lock(&self.lost) = Some(why);
    }

    /// The failed write the last flush did not report, if any (taken: a
    /// flush reports it once).
    pub(crate) fn take_loss(&self) -> Option<String> {
        lock(&self.lost).take()
    }

    /// Fill the slot with a writable store and end the reopen.
    pub(crate) fn put(&self, store: Arc<Store>) {
        *self.current_mut() = Current { store: Some(store), read_only: false };
        self.reopening.store(false, Ordering::Release);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &tempfile::TempDir) -> Store {
        Store::open(dir.path(), trajlog::Options::default()).expect("open")
    }

    #[test]
    fn only_the_failed_store_is_taken_away() {
        let (a, b) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
        let slot = StoreSlot::new(store(&a));
        let current = slot.get().expect("a store");
        // A request that held an older store (here: another one) fails late.
        let stale = Arc::new(store(&b));
        assert!(slot.claim_reopen());
        assert!(slot.take_failed(&stale, "late".into()).is_none(), "the current store stays");
        assert!(slot.get().is_ok());
        assert!(slot.claim_reopen(), "the claim was given back");
        let taken = slot.take_failed(&current, "disk full".into()).expect("taken");
        assert!(Arc::ptr_eq(&taken, &current));
        let err = slot.get().map(|_| ()).expect_err("empty while it is reopened");
        assert!(err.contains("disk full"), "{err}");
        assert!(!slot.claim_reopen(), "one reopen at a time");
        // The writable open fails: a read-only open serves reads meanwhile.
        let read_only = Arc::new(Store::open_read_only(a.path()).expect("read-only open"));
        slot.put_read_only(read_only.clone());
        assert!(Arc::ptr_eq(&slot.get().expect("reads"), &read_only));
        let err = slot.get_writable().map(|_| ()).expect_err("no writes");
        assert!(err.contains("disk full"), "{err}");
        assert!(slot.available().is_err());
        slot.put(taken);
        assert!(slot.available().is_ok());
        assert!(slot.get_writable().is_ok());
        assert!(slot.claim_reopen(), "put ends the reopen");
    }
}
