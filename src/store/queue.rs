//! Back-pressure: the budget of records and bytes in flight between the
//! appenders and the writer thread.
//!
//! An appender takes a [`Permit`] for its record *before* it takes the append
//! lock (under which it gets its sequence number and sends the command on an
//! unbounded channel), so no lock is held while it waits for room, and nothing
//! that needs that lock — or none at all, like a durability wait's
//! `SyncSoon` — queues behind it. The writer thread drops the permit once it
//! has handled the record, which gives the room back.
//!
//! Invariants: at most `records_max` records and `bytes_max` bytes are in
//! flight, except that one record larger than `bytes_max` is let in alone,
//! once nothing else is in flight (so it never waits for ever). Permits are
//! granted in arrival order (tickets): a large record waiting for the queue to
//! empty is not starved by a stream of small ones. Stopping the queue (the
//! store is poisoned or closed) wakes every waiter with the error.

use super::*;

pub(super) struct Queue {
    state: Mutex<QueueState>,
    /// Signalled when room is given back, a ticket is served, or the queue stops.
    room: Condvar,
    records_max: u64,
    bytes_max: u64,
    /// Signalled when an appender starts waiting (tests observe back-pressure
    /// with it instead of sleeping).
    #[cfg(test)]
    waiting_changed: Condvar,
}

struct QueueState {
    records: u64,
    bytes: u64,
    /// The ticket the next appender gets.
    next_ticket: u64,
    /// The ticket whose turn it is; `next_ticket - serving` appenders wait.
    serving: u64,
    /// Appenders asleep on `room`.
    waiting: usize,
    /// Set once: every waiting and later `acquire` returns it.
    stopped: Option<Error>,
}

impl QueueState {
    fn fits(&self, records_max: u64, bytes_max: u64, bytes: u64) -> bool {
        self.records == 0 || (self.records < records_max && self.bytes.saturating_add(bytes) <= bytes_max)
    }
}

/// Room for one record in the queue, given back when dropped (by the writer
/// thread once it has handled the record, or by the appender if the record
/// never reached the channel).
pub(super) struct Permit {
    queue: Arc<Queue>,
    bytes: u64,
}

impl Queue {
    pub(super) fn new(records_max: u64, bytes_max: u64) -> Self {
        Self {
            state: Mutex::new(QueueState {
                records: 0,
                bytes: 0,
                next_ticket: 0,
                serving: 0,
                waiting: 0,
                stopped: None,
            }),
            room: Condvar::new(),
            records_max,
            bytes_max,
            #[cfg(test)]
            waiting_changed: Condvar::new(),
        }
    }

    /// Room for a record of `bytes`, waiting (in arrival order) while the
    /// queue is full; the stop error once the queue is stopped.
    pub(super) fn acquire(self: &Arc<Self>, bytes: u64) -> Result<Permit> {
        let mut s = lock(&self.state);
        if let Some(e) = &s.stopped {
            return Err(e.clone());
        }
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        let mut waited = false;
        loop {
            if let Some(e) = &s.stopped {
                // Stopped for good: tickets no longer matter.
                let e = e.clone();
                s.waiting -= usize::from(waited);
                return Err(e);
            }
            if s.serving == ticket && s.fits(self.records_max, self.bytes_max, bytes) {
                break;
            }
            if !waited {
                waited = true;
                s.waiting += 1;
                #[cfg(test)]
                self.waiting_changed.notify_all();
            }
            s = self.room.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if waited {
            s.waiting -= 1;
        }
        s.serving += 1;
        s.records += 1;
        s.bytes += bytes;
        // The next ticket may fit too.
        let others_wait = s.next_ticket != s.serving;
        drop(s);
        if others_wait {
            self.room.notify_all();
        }
        Ok(Permit { queue: self.clone(), bytes })
    }

    /// [`Queue::acquire`] without waiting: `None` when the record would
    /// wait (the queue is full, or others wait before it).
    pub(super) fn try_acquire(self: &Arc<Self>, bytes: u64) -> Result<Option<Permit>> {
        let mut s = lock(&self.state);
        if let Some(e) = &s.stopped {
            return Err(e.clone());
        }
        if s.next_ticket != s.serving || !s.fits(self.records_max, self.bytes_max, bytes) {
            return Ok(None);
        }
        s.next_ticket += 1;
        s.serving += 1;
        s.records += 1;
        s.bytes += bytes;
        Ok(Some(Permit { queue: self.clone(), bytes }))
    }

    fn release(&self, bytes: u64) {
        let mut s = lock(&self.state);
        s.records = s.records.saturating_sub(1);
        s.bytes = s.bytes.saturating_sub(bytes);
        let someone_waits = s.next_ticket != s.serving;
        drop(s);
        if someone_waits {
            self.room.notify_all();
        }
    }

    /// Refuse every waiting and later `acquire` with `error` (the first stop wins).
    pub(super) fn stop(&self, error: Error) {
        let mut s = lock(&self.state);
        if s.stopped.is_none() {
            s.stopped = Some(error);
        }
        drop(s);
        self.room.notify_all();
    }

    /// Records and bytes in flight.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> (u64, u64) {
        let s = lock(&self.state);
        (s.records, s.bytes)
    }

    /// Wait until `n` appenders are asleep waiting for room (a test's way to
    /// know that back-pressure holds them, without sleeping).
    #[cfg(test)]
    pub(super) fn wait_for_waiters(&self, n: usize) {
        let s = lock(&self.state);
        let (s, timeout) = self
            .waiting_changed
            .wait_timeout_while(s, std::time::Duration::from_secs(300), |s| s.waiting < n)
            .unwrap_or_else(|e| e.into_inner());
        assert!(
            !timeout.timed_out() && s.waiting >= n,
            "no appender waited for room (a hang guard, not a timing verdict)"
        );
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.queue.release(self.bytes);
    }
}

/// What a queued call holds in memory, for the byte budget.
pub(super) fn call_bytes(call: &Call) -> u64 {
    let blob = |b: &Option<Vec<u8>>| b.as_ref().map_or(0, Vec::len);
    let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let tokens =
        call.prompt_token_ids.len() + call.completion_token_ids.len() + call.logprobs.as_ref().map_or(0, Vec::len);
    let bytes = std::mem::size_of::<Call>()
        + 4 * tokens
        + blob(&call.routing_matrices)
        + blob(&call.messages)
        + blob(&call.response_message)
        + blob(&call.metadata)
        + blob(&call.extra)
        + call.trace_id.len()
        + call.session_id.len()
        + call.session_uids.iter().map(String::len).sum::<usize>()
        + text(&call.model)
        + text(&call.finish_reason);
    bytes as u64
}

/// What a queued annotation holds in memory, for the byte budget.
pub(super) fn annotation_bytes(ann: &Annotation) -> u64 {
    let id = match ann {
        Annotation::Reward { target: Target::Trace(id) | Target::Session(id), .. }
        | Annotation::Seal { session_id: id }
        | Annotation::DeleteSession { session_id: id }
        | Annotation::MoveSession { session_id: id } => id.len(),
    };
    (std::mem::size_of::<Annotation>() + id) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A hang guard, not a timing verdict: every wait below is for an event
    /// the test itself causes.
    const NEVER: Duration = Duration::from_secs(120);

    fn queue(records_max: u64, bytes_max: u64) -> Arc<Queue> {
        Arc::new(Queue::new(records_max, bytes_max))
    }

    /// Acquire on another thread; the permit (or error) comes back on the receiver.
    fn acquire_on_thread(q: &Arc<Queue>, bytes: u64) -> mpsc::Receiver<Result<Permit>> {
        let (tx, rx) = mpsc::channel();
        let q = q.clone();
        std::thread::spawn(move || {
            let _ = tx.send(q.acquire(bytes));
        });
        rx
    }

    #[test]
    fn a_full_queue_holds_the_next_record_until_room_is_given_back() {
        let q = queue(2, 1000);
        let a = q.acquire(100).expect("room");
        let _b = q.acquire(100).expect("room");
        let c = acquire_on_thread(&q, 100);
        q.wait_for_waiters(1);
        assert!(c.try_recv().is_err(), "two records in flight: the third waits");
        drop(a);
        let _c = c.recv_timeout(NEVER).expect("released").expect("room");
        assert_eq!(q.in_flight(), (2, 200));
    }

    #[test]
    fn bytes_bound_the_queue_and_a_record_over_the_budget_goes_alone() {
        let q = queue(100, 1000);
        let a = q.acquire(600).expect("room");
        let b = acquire_on_thread(&q, 600);
        q.wait_for_waiters(1);
        assert!(b.try_recv().is_err(), "1200 bytes would pass the budget of 1000");
        drop(a);
        let b = b.recv_timeout(NEVER).expect("released").expect("room");
        drop(b);
        // Larger than the whole budget: taken when nothing else is in flight…
        let big = q.acquire(5000).expect("taken alone");
        assert_eq!(q.in_flight(), (1, 5000));
        // …and nothing joins it.
        let small = acquire_on_thread(&q, 1);
        q.wait_for_waiters(1);
        assert!(small.try_recv().is_err());
        drop(big);
        let _small = small.recv_timeout(NEVER).expect("released").expect("room");
    }

    #[test]
    fn room_is_granted_in_arrival_order_so_a_large_record_is_not_starved() {
        let q = queue(100, 1000);
        let a = q.acquire(10).expect("room");
        let big = acquire_on_thread(&q, 5000);
        q.wait_for_waiters(1);
        // Would fit beside `a`, but arrives after the large record.
        let small = acquire_on_thread(&q, 10);
        q.wait_for_waiters(2);
        drop(a);
        let big = big.recv_timeout(NEVER).expect("released").expect("room");
        assert_eq!(q.in_flight(), (1, 5000));
        assert!(small.try_recv().is_err(), "the small record waits behind the large one");
        drop(big);
        let _small = small.recv_timeout(NEVER).expect("released").expect("room");
        assert_eq!(q.in_flight(), (1, 10));
    }

    #[test]
    fn stopping_wakes_every_waiter_with_the_error() {
        let q = queue(1, 1000);
        let _a = q.acquire(1).expect("room");
        let waiters = [acquire_on_thread(&q, 1), acquire_on_thread(&q, 1)];
        q.wait_for_waiters(2);
        let full = Error::io("write segment", std::io::Error::from_raw_os_error(28));
        q.stop(Error::poisoned(&full));
        for w in waiters {
            let err = w.recv_timeout(NEVER).expect("woken").err().expect("refused");
            assert_eq!(err.kind(), &ErrorKind::StorageFull, "{err}");
            assert_eq!(err.io_error().and_then(std::io::Error::raw_os_error), Some(28));
        }
        assert!(q.acquire(1).is_err(), "later appenders are refused at once");
        q.stop(Error::closed());
        let err = q.acquire(1).err().expect("refused");
        assert_eq!(err.kind(), &ErrorKind::StorageFull, "the first stop wins");
    }
}
