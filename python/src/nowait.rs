//! Appends from an asyncio event loop that never block it and need no
//! thread per call.
//!
//! `NativeStore.append_trace_nowait` walks the trace dict on the caller's
//! thread (the loop's), hands the record to the writer thread and returns a
//! [`Receipt`] at once. The writer thread, after each group commit, writes a
//! byte to one end of a socket pair ([`Waker`]); the loop watches the other
//! end (`loop.add_reader`), and its callback polls the receipts in order.
//! So a durable store costs the loop one wake-up per group commit, however
//! many calls it covers, and no other thread ever takes the GIL. When the
//! writer's queue is full the record comes back as a [`Deferred`], which a
//! thread that may block appends (back-pressure, not an unbounded queue).

use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use crate::to_py;

/// A record appended without waiting; `poll` says when it is durable.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Receipt(pub(crate) trajlog::Receipt);

#[pymethods]
impl Receipt {
    /// True once the record is durable, False while it is not yet; raises the
    /// store's error once it never will be (a failed write, a closed store).
    fn poll(&self) -> PyResult<bool> {
        self.0.poll().map_err(to_py)
    }

    /// The record's sequence number in this store session.
    #[getter]
    fn seq(&self) -> u64 {
        self.0.seq()
    }
}

/// A checked record the writer's queue had no room for; append it with
/// `NativeStore.append_deferred` from a thread that may wait.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Deferred(pub(crate) Mutex<Option<trajlog::ValidCall>>);

impl Deferred {
    pub(crate) fn take(&self) -> Option<trajlog::ValidCall> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The socket pair that wakes an event loop when the store's durability
/// changes: the loop watches `fileno()` (`loop.add_reader`) and calls
/// `drain()` first in its callback, then polls its receipts. The writer
/// thread writes at most one byte until the loop drains it (`pending`), so
/// the socket never fills. An object of its own (not a part of the native
/// store), so that the loop's callback never waits for a call on the store,
/// such as a `close` in another thread.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Waker {
    read: Arc<UnixStream>,
    pending: Arc<AtomicBool>,
}

impl Waker {
    /// A waker registered as `store`'s durability listener.
    pub(crate) fn new(store: &trajlog::Store) -> std::io::Result<Waker> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        let read = Arc::new(read);
        let pending = Arc::new(AtomicBool::new(false));
        let flag = pending.clone();
        // The listener keeps the read end open too, for as long as the
        // store lives: a write never meets a closed peer (no EPIPE, no
        // SIGPIPE in a process that does not ignore it).
        let keep = read.clone();
        store.on_durable(move || {
            if !flag.swap(true, Ordering::AcqRel) {
                // Never full: one byte at a time until the loop drains it.
                let _ = (&write).write(&[1]);
            }
            let _ = &keep;
        });
        Ok(Waker { read, pending })
    }
}

#[pymethods]
impl Waker {
    /// The file descriptor to watch for reading.
    fn fileno(&self) -> i32 {
        self.read.as_raw_fd()
    }

    /// Take the wake-up: clear the flag first, so that a commit from now on
    /// writes a new byte, then read what is there. Poll the receipts after
    /// this; none is missed.
    fn drain(&self) {
        self.pending.store(false, Ordering::Release);
        let mut buf = [0u8; 64];
        loop {
            match (&*self.read).read(&mut buf) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if e.kind() == IoKind::Interrupted => continue,
                Err(_) => return, // WouldBlock: drained
            }
        }
    }
}
