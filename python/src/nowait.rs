//! Appends from an asyncio event loop that never block it and need no
//! thread per call.
//!
//! `NativeStore.append_trace_nowait` walks the trace dict on the caller's
//! thread (the loop's), hands the call to the store's [`Encoder`] thread
//! (which checks it, encodes its documents and appends it) and returns a
//! [`Pending`] at once. The writer thread, after each group commit, writes a
//! byte to one end of a socket pair ([`Waker`]); the loop watches the other
//! end (`loop.add_reader`), and its callback polls the `Pending`s in order.
//! So a durable store costs the loop one walk and one wake-up per group
//! commit, however many calls it covers, and no other thread ever takes the
//! GIL. The Python side bounds how many stores are in flight (it awaits the
//! oldest first); the encoder waits for room in the writer's queue.

use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use crate::to_py;

/// What became of a trace handed to the [`Encoder`].
enum Outcome {
    /// Still in the encoder's queue.
    Queued,
    Appended(trajlog::Receipt),
    Refused(trajlog::Error),
}

/// A trace handed to the [`Encoder`]; `poll` says when it is durable.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Pending(Arc<Mutex<Outcome>>);

#[pymethods]
impl Pending {
    /// True once the record is durable, False while it is not yet; raises
    /// the error that refused it (a check of the record, a full disk, a
    /// closed store) once it never will be.
    fn poll(&self) -> PyResult<bool> {
        match &*lock(&self.0) {
            Outcome::Queued => Ok(false),
            Outcome::Appended(receipt) => receipt.poll().map_err(to_py),
            Outcome::Refused(e) => Err(to_py(e.clone())),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum Job {
    Append {
        call: Box<trajlog::Call>,
        /// The cuts of its `extra` the walk found (`trajlog::ExtraCuts`).
        found: Option<trajlog::ExtraCuts>,
        outcome: Arc<Mutex<Outcome>>,
        wake: Arc<Signal>,
    },
    /// Answered once every job sent before it is appended.
    Barrier(std::sync::mpsc::Sender<()>),
}

/// A thread that checks and appends the calls an event loop walked, in the
/// order they were walked, so the loop's thread is free for the next walk
/// while this one's documents are encoded: with many sessions at once, the
/// walk (which needs the GIL) and the encoding (which does not) run on two
/// cores. It waits for room in the writer's queue (back-pressure stays in
/// the store), asks for the commit, and wakes the loop itself only for a
/// refused record (the writer wakes it for the rest).
///
/// Shared by the native store and the calls using it at the moment: its
/// halves sit behind locks, so that a `close` in one thread finishes it
/// while another hands it a call (which is then refused as closed).
pub(crate) struct Encoder {
    tx: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Encoder {
    pub(crate) fn start(store: Arc<trajlog::Store>) -> std::io::Result<Encoder> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new().name("trajlog-encode".into()).spawn(move || {
            for job in rx {
                match job {
                    Job::Append { call, found, outcome, wake } => {
                        let appended = trajlog::ValidCall::from_serialized_json(*call)
                            .and_then(|c| store.append_valid(c.with_found_cuts(found)));
                        match appended {
                            Ok(receipt) => {
                                receipt.sync_soon();
                                *lock(&outcome) = Outcome::Appended(receipt);
                            }
                            Err(e) => {
                                *lock(&outcome) = Outcome::Refused(e);
                                wake.wake();
                            }
                        }
                    }
                    Job::Barrier(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })?;
        Ok(Encoder { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)) })
    }

    /// Queue `call`; its outcome is polled through the `Pending`.
    pub(crate) fn send(&self, call: trajlog::Call, found: Option<trajlog::ExtraCuts>, wake: Arc<Signal>) -> Pending {
        let outcome = Arc::new(Mutex::new(Outcome::Queued));
        let job = Job::Append { call: Box::new(call), found, outcome: outcome.clone(), wake: wake.clone() };
        let sent = lock(&self.tx).as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            // Finished (the store is closing), or the thread is gone.
            *lock(&outcome) = Outcome::Refused(trajlog::Error::closed());
            wake.wake();
        }
        Pending(outcome)
    }

    /// Return once every call queued before is appended (not durable).
    pub(crate) fn barrier(&self) {
        let (done, wait) = std::sync::mpsc::channel();
        let sent = lock(&self.tx).as_ref().is_some_and(|tx| tx.send(Job::Barrier(done)).is_ok());
        if sent {
            let _ = wait.recv();
        }
    }

    /// Append what is queued, then end the thread; calls sent afterwards
    /// are refused as closed.
    pub(crate) fn finish(&self) {
        drop(lock(&self.tx).take());
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// The writing half of a [`Waker`]: at most one byte in the socket until
/// the loop drains it, so the socket never fills.
pub(crate) struct Signal {
    write: UnixStream,
    pending: AtomicBool,
    /// The read end (the loop's), owned here so that it stays open as long
    /// as anyone may write: a write never meets a closed peer (no EPIPE, no
    /// SIGPIPE in a process that does not ignore it).
    read: UnixStream,
}

impl Signal {
    pub(crate) fn wake(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            // Never full: one byte at a time until the loop drains it.
            let _ = (&self.write).write(&[1]);
        }
    }
}

/// The socket pair that wakes an event loop when the store's durability
/// changes: the loop watches `fileno()` (`loop.add_reader`) and calls
/// `drain()` first in its callback, then polls its `Pending`s. An object of
/// its own (not a part of the native store), so that the loop's callback
/// never waits for a call on the store, such as a `close` in another thread.
#[pyclass(frozen, module = "trajlog._trajlog")]
pub(crate) struct Waker {
    pub(crate) signal: Arc<Signal>,
}

impl Waker {
    /// A waker whose signal is `store`'s durability listener.
    pub(crate) fn new(store: &trajlog::Store) -> std::io::Result<Waker> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        let signal = Arc::new(Signal { write, pending: AtomicBool::new(false), read });
        let listener = signal.clone();
        store.on_durable(move || listener.wake());
        Ok(Waker { signal })
    }
}

#[pymethods]
impl Waker {
    /// The file descriptor to watch for reading.
    fn fileno(&self) -> i32 {
        self.signal.read.as_raw_fd()
    }

    /// Take the wake-up: read what the socket holds, then clear the flag,
    /// then (the caller) poll. In this order no wake-up is lost: a commit
    /// before the clear is seen by the poll that follows it, and a commit
    /// after the clear writes a new byte. (Clearing before reading would
    /// let a byte written in between be read with the flag left set, and
    /// every later commit would then write nothing.)
    fn drain(&self) {
        let mut buf = [0u8; 64];
        loop {
            match (&self.signal.read).read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == IoKind::Interrupted => continue,
                Err(_) => break, // WouldBlock: drained
            }
        }
        // AcqRel: what the writer published before its wake-up is seen by the poll.
        self.signal.pending.swap(false, Ordering::AcqRel);
    }
}
