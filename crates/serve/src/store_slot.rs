//! The gateway's store, and its reopening after a failed write poisoned it.
//!
//! A failed write or fsync (a full disk, an I/O error, a file over the size
//! limit) poisons a trajlog store: every later write is refused until the
//! store is closed and opened again, which cuts the torn tail back to the
//! last acknowledged record (README "Durability"). A gateway that runs for
//! days must not need a restart for that, so the first request that meets
//! the poisoned store starts a reopen in the background
//! (`server::start_reopen`): the slot is emptied (requests get a 503 that
//! says why, as they would from the poisoned store), the old store is closed
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

    /// Whether a store is in the slot (the `/health` answer).
    pub(crate) fn available(&self) -> Result<(), String> {
        self.get().map(|_| ())
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
