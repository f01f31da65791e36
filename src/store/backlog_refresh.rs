//! The writer's refresh of the backlog index file (store/backlog_file.rs,
//! format-spec/backlog-index.md §1).
//!
//! Without it the file is written only by a writable open, from the survey
//! that open runs anyway: a long-lived writer kept every call it wrote in
//! its maps (~0.28 KB a call), and the first open after it closed paid the
//! survey of the whole backlog (10M lean tiny calls: 19.9 s, 2.17 GB peak).
//!
//! Now, once the calls of sealed segments the file does not list pass
//! [`Options::backlog_index_min_calls`] and those segments are more than an
//! eighth of the ones it lists (the rule of a writable open,
//! [`backlog_file::outgrown`]), the writer starts a helper thread that
//!
//! 1. writes the file over the sealed segments up to the last one: from
//!    the file there and the footers of the segments it does not list
//!    ([`backlog_file::write_incremental`]), or, when that cannot be done
//!    (no file; a new record naming a session of its layer otherwise than
//!    as that session's own call, seal or reward), from a load of every
//!    segment surveyed as an open surveys them
//!    ([`recovery::load_surveyed`]);
//! 2. loads them again through the file just written: an index whose cold
//!    layer is mapped, with the segments' other footer entries in its maps;
//! 3. hands that index to the writer, which takes it instead of its own
//!    once it has replayed what it wrote since ([`Writer::adopt_rebuilt`],
//!    as after a publication), and gives its maps' memory back.
//!
//! A writable open that wrote the file itself starts step 2 at once. The
//! helper reads only sealed segments, which nothing rewrites, and the file
//! is replaced atomically, so the writer goes on appending meanwhile. The
//! writer takes the index only while nothing it is built on changed: no
//! shards (a store with shards gets its index rebuilt by each publication
//! instead), no compaction under way, the same sealed segments; otherwise
//! it keeps its own (the file stays written for the next opens). A close
//! waits for a helper under way to write its file (not to load it again). A refresh from the
//! file before reads the footers of the segments sealed since only, but
//! rebuilds and rewrites the whole layer; one from a survey reads every
//! footer. The eighth rule makes either O(1) amortized per call, as for
//! the shard index file.
//!
//! Within the eighth, each roll has the helper write the *delta* over the
//! file instead (`backlog-delta.tbi`, [`backlog_file::write_delta`],
//! format-spec/backlog-index.md §4): the sealed segments after the file's,
//! from their footers alone, then steps 2 and 3 through both files. So an
//! open maps the file's layer and the delta's and reads the active
//! segment's entries beside them, and the writer's maps hold what it wrote
//! since its last roll. A refresh that ends after more segments sealed
//! starts the one due then.

use super::recovery::{load_dir, load_surveyed, Rebuilt};
use super::*;

/// What a helper writes: the file over every sealed segment, or the delta
/// over the segments after the file's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Whole,
    Delta,
}

/// What a helper thread produced.
pub(super) struct Outcome {
    kind: Kind,
    /// The sealed segments it loaded (never none), in log order.
    ids: Vec<u64>,
    /// The index loaded through the file, when the file was written (or
    /// was there) and used.
    index: Option<Index>,
    /// Whether the file was written from the one before, not from a
    /// survey of every footer.
    incremental: bool,
}

struct Job {
    handle: JoinHandle<()>,
    outcome: Arc<Mutex<Option<Outcome>>>,
    /// Set when the store closes: the helper does not load the segments
    /// again once it wrote the file (nothing would take the index).
    closing: Arc<AtomicBool>,
}

/// Wakes the writer when the helper ends, whether it returned or panicked
/// (then it left no outcome); the writer is gone if the store closed.
struct Wake(Sender<Cmd>);

impl Drop for Wake {
    fn drop(&mut self) {
        let _ = self.0.send(Cmd::BacklogRefreshed);
    }
}

/// The writer's state of the refresh.
#[derive(Default)]
pub(super) struct BacklogRefresh {
    /// Sealed segments the file the writer's index maps lists (0: none).
    listed: usize,
    /// The last segment the delta over that file lists (0: none).
    delta_through: u64,
    /// No delta is written until the next whole file (one could not be).
    delta_off: bool,
    /// The sealed segments after the file's: id and calls.
    unlisted: Vec<(u64, u64)>,
    /// Calls of unlisted segments below which no refresh starts (raised
    /// after one that could not be used, so it is not tried at every roll).
    next_at: u64,
    job: Option<Job>,
    /// Set around the roll that begins a compaction: no refresh starts.
    pub(super) paused: bool,
    /// Refreshes started, those whose index the writer took, and those
    /// that wrote the file from the one before (tests).
    pub(super) started: u64,
    pub(super) adopted: u64,
    pub(super) incremental: u64,
    /// Deltas written and taken (tests).
    pub(super) deltas: u64,
}

impl BacklogRefresh {
    /// The state after an open whose index maps a file listing `listed`
    /// segments (0: none) and a delta over it listing those up to
    /// `delta_through`, with `unlisted` sealed segments after the file's.
    pub(super) fn at_open(listed: usize, delta_through: Option<u64>, unlisted: impl IntoIterator<Item = u64>) -> Self {
        // Their calls are not counted (the open replayed them from their
        // footers): only the calls written from now on start a refresh.
        let unlisted = unlisted.into_iter().map(|id| (id, 0)).collect();
        BacklogRefresh { listed, delta_through: delta_through.unwrap_or(0), unlisted, ..Default::default() }
    }

    fn unlisted_calls(&self) -> u64 {
        self.unlisted.iter().map(|(_, n)| n).sum()
    }
}

/// The sealed segments of `manifest` up to `through`, as a manifest of
/// their own (what the helper loads).
fn sealed_through(manifest: &Manifest, through: u64) -> Manifest {
    let mut m = manifest.clone();
    m.segments.retain(|s| s.id <= through && s.state == SegmentState::Sealed);
    m
}

/// The helper thread's body: steps 1 (if `write`) and 2 of the module's
/// documentation over `manifest`, all of whose segments are sealed.
/// Returns the index loaded through the file (`None`: none to take), and
/// whether the file was written from the one before
/// ([`backlog_file::write_incremental`]).
fn refresh(
    dir: &Path,
    manifest: Manifest,
    kind: Kind,
    write: bool,
    options: &Options,
    closing: &AtomicBool,
) -> (Option<Index>, bool) {
    if kind == Kind::Delta {
        let through = manifest.segments.last().map(|s| s.id);
        if !matches!(backlog_file::write_delta(dir, &manifest, options), Ok(Some(n)) if n > 0)
            || closing.load(Ordering::Acquire)
        {
            return (None, false);
        }
        let loaded = load_dir(dir, manifest, RecoveryMode::TolerateTornTail, false, &|_| false, true).ok();
        let used = |l: &recovery::Loaded| l.backlog_used && l.backlog_listed.1 == through && l.damage.is_empty();
        return (loaded.filter(used).map(|l| l.index), false);
    }
    let incremental = write && matches!(backlog_file::write_incremental(dir, &manifest, options), Ok(Some(n)) if n > 0);
    if write && !incremental {
        let Some(loaded) = load_surveyed(dir, manifest.clone()).ok().flatten() else { return (None, false) };
        if !super::backlog_file_written(dir, &loaded, options) {
            return (None, false);
        }
        drop(loaded);
    }
    crate::storage::mmap::trim_heap();
    if closing.load(Ordering::Acquire) {
        return (None, incremental);
    }
    let loaded = load_dir(dir, manifest, RecoveryMode::TolerateTornTail, false, &|_| false, true).ok();
    let index = loaded.filter(|l| l.backlog_used && l.damage.is_empty()).map(|l| l.index);
    (index, incremental)
}

impl Writer {
    /// After a roll sealed segment `id`, which holds `calls` calls: note
    /// it, and start a refresh if one is due.
    pub(super) fn note_sealed(&mut self, id: u64, calls: u64) {
        self.backlog.unlisted.push((id, calls));
        self.start_due_refresh();
    }

    /// Start the refresh that is due, if any and none is under way: the
    /// whole file once the sealed segments it does not list pass an eighth
    /// of those it lists (and the minimum of calls), else the delta over
    /// it once a sealed segment is in neither.
    fn start_due_refresh(&mut self) {
        let min = self.options.backlog_index_min_calls;
        let b = &self.backlog;
        let idle = min > 0 && !b.paused && b.job.is_none();
        let whole = idle && b.unlisted_calls() >= min.max(b.next_at) && b.unlisted.len().saturating_mul(8) > b.listed;
        // Within the eighth, the delta follows every roll.
        let delta = idle && b.listed > 0 && !b.delta_off && b.unlisted.iter().any(|(id, _)| *id > b.delta_through);
        if whole {
            self.start_backlog_refresh(true);
        } else if delta {
            self.start_refresh(Kind::Delta, true);
        }
    }

    /// Start a helper over the sealed segments (see the module's
    /// documentation; `write`: step 1 too), unless the writer could not
    /// take what it builds.
    pub(super) fn start_backlog_refresh(&mut self, write: bool) {
        self.start_refresh(Kind::Whole, write);
    }

    /// [`Writer::start_backlog_refresh`] of a `kind` file.
    fn start_refresh(&mut self, kind: Kind, write: bool) {
        let clean = self.options.recovery != RecoveryMode::SkipCorrupted && self.damage.is_empty();
        let Some(through) = self.sealed_segments.get_max().map(|(id, _)| *id) else { return };
        if !clean || self.poisoned() || !self.takes_backlog_index() || self.backlog.job.is_some() {
            return;
        }
        let manifest = sealed_through(&self.manifest, through);
        let ids: Vec<u64> = manifest.segments.iter().map(|s| s.id).collect();
        if ids.is_empty() {
            return;
        }
        let Some(tx) = self.inner.tx.clone() else { return };
        let outcome = Arc::new(Mutex::new(None));
        let closing = Arc::new(AtomicBool::new(false));
        let (slot, stop) = (outcome.clone(), closing.clone());
        let (dir, options) = (self.dir.clone(), self.options.clone());
        let spawned = std::thread::Builder::new().name("trajlog-backlog".into()).spawn(move || {
            let _wake = Wake(tx);
            let (index, incremental) = refresh(&dir, manifest, kind, write, &options, &stop);
            *lock(&slot) = Some(Outcome { kind, ids, index, incremental });
        });
        // A helper that cannot start leaves things as they are.
        if let Ok(handle) = spawned {
            self.backlog.job = Some(Job { handle, outcome, closing });
            self.backlog.started += 1;
        }
    }

    /// Whether the writer's index could be one loaded from the files: no
    /// shards, no compaction under way.
    fn takes_backlog_index(&self) -> bool {
        self.journal.is_none() && self.shards.files().next().is_none()
    }

    /// Wait for the helper under way, if any, and take its index if `adopt`
    /// and the writer still can (module documentation). Whether it took it.
    pub(super) fn finish_backlog_refresh(&mut self, adopt: bool) -> bool {
        let Some(job) = self.backlog.job.take() else { return false };
        if !adopt {
            job.closing.store(true, Ordering::Release);
        }
        // It has set its outcome (or panicked: then there is none).
        let _ = job.handle.join();
        let outcome = lock(&job.outcome).take();
        let (kind, taken) = match outcome {
            Some(Outcome { kind, ids, index, incremental }) => {
                self.backlog.incremental += u64::from(incremental);
                // A retirement while the helper ran removed the file it
                // then wrote anew, listing a retired segment: stale.
                let gone: Vec<u64> = ids.iter().copied().filter(|id| !self.sealed_segments.contains_key(id)).collect();
                backlog_file::remove_if_listing(&self.dir, &gone, &self.options.faults);
                let through = ids.last().copied().unwrap_or(0);
                let same_segments = self.sealed_segments.range(..=through).map(|(id, _)| *id).eq(ids.iter().copied());
                let taken = match index {
                    Some(index) if adopt && same_segments => self.adopt_backlog_index(index, kind, through, ids.len()),
                    _ => false,
                };
                if kind == Kind::Delta {
                    // Not again before the next whole file.
                    self.backlog.delta_off |= !taken;
                }
                (kind, taken)
            }
            None => (Kind::Whole, false),
        };
        if !taken && kind == Kind::Whole {
            // Not again before the backlog doubles (a damaged segment, a
            // survey too small to write, a compaction meanwhile).
            self.backlog.next_at = self.backlog.unlisted_calls().saturating_mul(2);
        }
        if adopt {
            // What rolled while it ran may be due now.
            self.start_due_refresh();
        }
        taken
    }

    /// Test hook: finish every refresh under way and those they make due.
    #[cfg(any(test, feature = "internals"))]
    pub(super) fn settle_backlog_refresh(&mut self) {
        while self.backlog.job.is_some() {
            self.finish_backlog_refresh(true);
        }
    }

    /// Take `index` (sealed segments up to `through`, `listed` of them,
    /// loaded through the file) in place of the writer's own, if it still
    /// can; whether it did.
    fn adopt_backlog_index(&mut self, index: Index, kind: Kind, through: u64, listed: usize) -> bool {
        if self.poisoned() || !self.takes_backlog_index() {
            return false;
        }
        // Everything written is in the active segment before the replay.
        self.commit(true);
        if !self.adopt_rebuilt(Rebuilt::of_index(index, &self.shards), through, &[]) {
            return false;
        }
        // The replay's lookups read blocks of the mapped file: a failed
        // one poisons the writer before anything is published from it.
        self.check_index();
        if self.poisoned() {
            return false;
        }
        match kind {
            Kind::Whole => {
                self.backlog.listed = listed;
                self.backlog.unlisted.retain(|(id, _)| *id > through);
                self.backlog.delta_through = 0;
                self.backlog.delta_off = false;
                self.backlog.next_at = 0;
            }
            Kind::Delta => {
                self.backlog.delta_through = through;
                self.backlog.deltas += 1;
            }
        }
        self.backlog.adopted += 1;
        self.commit(true);
        // The admission's sealed sessions stop holding the index taken out.
        {
            let mut s = lock(&self.inner.send);
            let durable_seq = self.inner.durable_seq.load(Ordering::Acquire);
            let view = lock(&self.inner.view).clone();
            s.sealed.rebase(view.index.clone(), durable_seq);
        }
        crate::storage::mmap::trim_heap();
        true
    }
}
