//! Receipts and durability waits: the durable sequence number, poisoning,
//! and the condition variable waiters sleep on.

use super::*;

pub(super) struct Durable {
    pub(super) seq: u64,
    pub(super) poisoned: Option<Error>,
    pub(super) closed: bool,
}

pub(super) struct Inner {
    pub(super) dir: PathBuf,
    pub(super) options: Options,
    /// The writer thread's channel (unbounded: a send never blocks); `None`
    /// for a read-only store. Appends and annotations are sent under `send`.
    pub(super) tx: Option<Sender<Cmd>>,
    /// Back-pressure: records and bytes in flight to the writer thread.
    pub(super) queue: Arc<Queue>,
    /// The append lock: sequence numbers and the admission state.
    pub(super) send: Mutex<SendState>,
    pub(super) durable: Mutex<Durable>,
    pub(super) durable_cv: Condvar,
    pub(super) durable_seq: AtomicU64,
    pub(super) poisoned: AtomicBool,
    pub(super) view: Mutex<Arc<View>>,
    /// One compaction at a time (two would compact the same sessions twice).
    pub(super) compacting: Mutex<()>,
    /// What the last publication's annotation cache build read, so that
    /// the next reads only what was sealed since (store/annotation_cache.rs
    /// `write_after`). Publications only (one at a time).
    pub(super) annotation_built: Mutex<Option<super::annotation_cache::Built>>,
    /// Called each time the durability state changes ([`Store::on_durable`]).
    pub(super) listeners: Mutex<Vec<Listener>>,
    /// Retirement verdicts reused unread (store/retire.rs), for tests.
    #[cfg(test)]
    pub(super) verdicts_reused: AtomicU64,
    /// Retirement verdicts judged by the compacting thread and taken by the
    /// writer (store/retire.rs `prejudge`), for tests.
    #[cfg(test)]
    pub(super) verdicts_adopted: AtomicU64,
}

/// A durability listener ([`Store::on_durable`]).
pub(super) type Listener = Arc<dyn Fn() + Send + Sync>;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    pub(super) fn wait_durable(&self, seq: u64) -> Result<()> {
        if self.durable_seq.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        let mut d = lock(&self.durable);
        loop {
            if d.seq >= seq {
                return Ok(());
            }
            if let Some(p) = &d.poisoned {
                return Err(Error::poisoned(p));
            }
            if d.closed {
                return Err(Error::closed());
            }
            d = self.durable_cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The error for a caller whose command the writer thread will never
    /// answer (its channel or reply is gone): the thread has ended, poisoned
    /// (a failure or a panic) or closed. Waits until the thread says which.
    pub(super) fn dead_error(&self) -> Error {
        let mut d = lock(&self.durable);
        loop {
            if let Some(p) = &d.poisoned {
                return Error::poisoned(p);
            }
            if d.closed {
                return Error::closed();
            }
            d = self.durable_cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Refuse every later write with `cause` (the first cause wins) and wake
    /// everyone waiting: for durability, and for room in the queue.
    pub(super) fn poison(&self, cause: &Error) {
        let error = {
            let mut d = lock(&self.durable);
            let first = d.poisoned.get_or_insert_with(|| cause.clone());
            let error = Error::poisoned(first);
            self.poisoned.store(true, Ordering::Release);
            self.durable_cv.notify_all();
            error
        };
        self.queue.stop(error);
        self.notify_listeners();
    }

    /// A block of the shard index file, of the annotation cache or of the
    /// backlog index file failed its check under one of the writer's
    /// lookups (a writable open checks them a block at a time): the lookup
    /// may have missed, so no further write is accepted. The file, a cache
    /// (of the shards, of the annotation segments, of the sealed segments'
    /// footers), is removed, so that the next open does without
    /// it and writes it anew rather than meet the block again. Returns the
    /// error the write gets.
    pub(super) fn index_damaged(&self, cause: &Error) -> Error {
        let shards_dir = self.dir.join(SHARDS_DIR);
        let caches = [crate::shard::index_file::INDEX_FILE_NAME, annotation_cache::CACHE_FILE_NAME];
        if let ErrorKind::Corrupt { path, .. } = cause.kind() {
            let name = path.file_name().and_then(|n| n.to_str());
            if let Some(name) = caches.into_iter().find(|c| Some(*c) == name) {
                if recovery::remove_if_present(&shards_dir.join(name)).is_ok() {
                    let _ = crate::storage::sync_dir(&shards_dir, &self.options.faults);
                }
            }
            // The file or its delta: both go (a delta extends the file).
            let backlog = [super::backlog_file::BACKLOG_FILE_NAME, super::backlog_file::DELTA_FILE_NAME];
            if backlog.iter().any(|b| Some(*b) == name) {
                let removed = backlog.iter().map(|b| recovery::remove_if_present(&self.dir.join(b)).is_ok());
                if removed.fold(false, |any, r| any | r) {
                    let _ = crate::storage::sync_dir(&self.dir, &self.options.faults);
                }
            }
        }
        self.poison(cause);
        Error::poisoned(cause)
    }

    /// Send the writer thread a command that needs no sequence number. The
    /// channel is unbounded, so this never blocks on a busy writer.
    pub(super) fn send(&self, cmd: Cmd) -> Result<()> {
        let tx = self.tx.as_ref().ok_or_else(Error::closed)?;
        tx.send(cmd).map_err(|_| self.dead_error())
    }

    pub(super) fn poisoned_error(&self) -> Option<Error> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        let d = lock(&self.durable);
        d.poisoned.as_ref().map(Error::poisoned)
    }

    pub(super) fn set_view(&self, view: Arc<View>) {
        *lock(&self.view) = view;
    }

    pub(super) fn advance(&self, seq: u64) {
        {
            let mut d = lock(&self.durable);
            d.seq = d.seq.max(seq);
            self.durable_seq.store(d.seq, Ordering::Release);
            self.durable_cv.notify_all();
        }
        self.notify_listeners();
    }

    /// Run the durability listeners, holding none of the store's locks but
    /// the list's own (a listener must not add a listener).
    pub(super) fn notify_listeners(&self) {
        let listeners = lock(&self.listeners);
        for listener in listeners.iter() {
            listener();
        }
    }

    /// Durable up to which sequence number, and the error every later wait
    /// gets (the store poisoned or closed), if any.
    pub(super) fn durability(&self) -> (u64, Option<Error>) {
        let d = lock(&self.durable);
        let stopped = match (&d.poisoned, d.closed) {
            (Some(p), _) => Some(Error::poisoned(p)),
            (None, true) => Some(Error::closed()),
            (None, false) => None,
        };
        (d.seq, stopped)
    }
}

/// What [`Store::try_append_valid`] did with a call.
#[derive(Debug)]
pub enum TryAppend {
    /// Appended: the receipt, as [`Store::append_valid`] returns it.
    Appended(Receipt),
    /// Not appended, the queue being full: the call, untouched.
    Full(Box<ValidCall>),
}

/// Proof that an append was accepted; [`Receipt::wait`] blocks until it is
/// durable at the store's level.
#[derive(Clone)]
pub struct Receipt {
    pub(super) seq: u64,
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipt").field("seq", &self.seq).finish_non_exhaustive()
    }
}

impl Receipt {
    /// Wait until the record is durable; an error if the store was poisoned or
    /// closed before that.
    pub fn wait(&self) -> Result<()> {
        if self.inner.durable_seq.load(Ordering::Acquire) >= self.seq {
            return Ok(());
        }
        self.request_sync();
        self.inner.wait_durable(self.seq)
    }

    /// [`Receipt::wait`] without blocking: `Ok(true)` once the record is
    /// durable, `Ok(false)` while it is not yet, and the error `wait` would
    /// return once it never will be (the store poisoned or closed before).
    /// For an event loop: ask for the commit with [`Receipt::sync_soon`],
    /// then poll this from a [`Store::on_durable`] listener's wake-up.
    pub fn poll(&self) -> Result<bool> {
        if self.inner.durable_seq.load(Ordering::Acquire) >= self.seq {
            return Ok(true);
        }
        match self.inner.durability() {
            (seq, _) if seq >= self.seq => Ok(true),
            (_, Some(e)) => Err(e),
            (_, None) => Ok(false),
        }
    }

    /// Ask for the record's group commit now rather than at the
    /// `group_commit_ms` timer, as [`Receipt::wait`] does, without waiting.
    /// Never blocks; does nothing once the record is durable, or with a
    /// durability other than [`Durability::Group`].
    pub fn sync_soon(&self) {
        if self.inner.durable_seq.load(Ordering::Acquire) < self.seq {
            self.request_sync();
        }
    }

    /// Someone waits (group commit): ask the writer to commit after its
    /// current batch rather than at the timer; waiters queued together share
    /// the fsync. Takes no lock and never blocks — not behind appenders held
    /// by back-pressure either (the channel is unbounded, the record is
    /// already in it, ahead of this request).
    pub(super) fn request_sync(&self) {
        if self.inner.options.durability == Durability::Group {
            if let Some(tx) = &self.inner.tx {
                // A writer that is gone answers through `wait_durable`.
                let _ = tx.send(Cmd::SyncSoon);
            }
        }
    }

    /// The record's sequence number in this store session (1-based, in append order).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}
