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
//! again with a growing pause while opening fails (the disk still full).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use trajlog::Store;

/// The store a request uses now, or why there is none.
pub(crate) struct StoreSlot {
    current: RwLock<Option<Arc<Store>>>,
    /// Why the slot is empty (the failure, then the last failed open).
    why: Mutex<String>,
    /// Set from the first request that met the poisoned store until the
    /// reopen ends: one reopen at a time.
    reopening: AtomicBool,
    /// Reopens that succeeded (the metrics).
    pub reopens: AtomicU64,
}

impl StoreSlot {
    pub(crate) fn new(store: Store) -> StoreSlot {
        StoreSlot {
            current: RwLock::new(Some(Arc::new(store))),
            why: Mutex::new(String::new()),
            reopening: AtomicBool::new(false),
            reopens: AtomicU64::new(0),
        }
    }

    /// The store, or the error to answer with while it is being reopened.
    pub(crate) fn get(&self) -> Result<Arc<Store>, String> {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Some(store) => Ok(store.clone()),
            None => Err(format!(
                "the store is being reopened after a failed write ({}); try again shortly",
                lock(&self.why)
            )),
        }
    }

    /// Whether the slot holds a store that takes writes (the `/health`
    /// answer).
    pub(crate) fn available(&self) -> Result<(), String> {
        match self.get()?.poisoned() {
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
        self.current.write().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Take `failed` out of the slot, saying why, if it is still the store
    /// there (a request that held an older store, already replaced, must not
    /// take the new one away); else end the reopen claimed for it.
    pub(crate) fn take_failed(&self, failed: &Arc<Store>, why: String) -> Option<Arc<Store>> {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, failed)) {
            self.reopening.store(false, Ordering::Release);
            return None;
        }
        *lock(&self.why) = why;
        current.take()
    }

    /// Say why the slot is still empty (a failed open).
    pub(crate) fn still_empty(&self, why: String) {
        *lock(&self.why) = why;
    }

    /// Fill the slot and end the reopen.
    pub(crate) fn put(&self, store: Arc<Store>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(store);
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
        slot.put(taken);
        assert!(slot.available().is_ok());
        assert!(slot.claim_reopen(), "put ends the reopen");
    }
}
