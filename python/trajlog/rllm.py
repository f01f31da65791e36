"""trajlog as the trace store of rLLM's gateway: `TrajlogTraceStore` implements
its async `TraceStore` protocol.

    from rllm.gateway import create_app            # rLLM
    from trajlog.rllm import TrajlogTraceStore
    app = create_app(config, store=TrajlogTraceStore("/data/traces"))

Any trace dict round-trips unchanged: token fields go to the typed columns
and come back as plain lists; logprobs always go to the float32 column (as
the nearest float32 when a value is not one, the values given being kept
too); every other field is kept as verbatim JSON. A trace is durable when
`store_trace` returns (group commit); nothing is dropped when the writer is
behind — callers wait. A read sees every `store_trace` called before it,
also one nobody awaits (the gateway's `sync_traces=False`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Optional

from . import InvalidInputError, PoisonedError, Store, _json_text, _session_uids, _text


# Stores in flight from one event loop (walked, not yet durable) before the
# next one waits for the oldest: about 16 group commits of 32 sessions. It
# bounds their count; the writer's own queue (`queue_bytes`) bounds the bytes
# the encoder thread hands on, not the walked calls queued before it.
_NOWAIT_IN_FLIGHT = 512
# How long an open waits for a store closed after a failure to let go of
# the directory (a read in another thread still inside it).
_CLOSE_WAIT_SECONDS = 30.0


class _LazyStore:
    """A trajlog store opened on first use. Concurrent first use from many
    coroutines or threads opens it once; `flush` and `close` are async.

    Reads see every store called before them, in every mode: a store handed
    to a worker thread is in flight from the moment `store_trace` (or
    `store`) is called — also when the caller does not await it, as rLLM's
    gateway does with `sync_traces=False` — and a read first waits for the
    stores in flight when it was called; appends not yet durable (the
    tracer's) are flushed before a read. Nothing here depends on timing.
    """

    def __init__(self, path: str, durability: str, options: dict):
        self._path = str(path)
        self._durability = durability
        self._options = options
        self._store: Optional[Store] = None
        # The store `_after_failure` closed last, until the next open has
        # waited for it to let go of the directory.
        self._closed: Optional[Store] = None
        # Why `_after_failure` closed a poisoned store, until a flush has
        # reported it: stores made before the failure may be lost.
        self._lost: Optional[str] = None
        self._lock = threading.Lock()
        # Stores handed to `_executor` and not finished (concurrent futures).
        self._in_flight: set = set()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # Non-durable appends made (the tracer's), and how many of them a
        # flush has covered: a read flushes when the first is ahead.
        self._appended = 0
        self._visible = 0
        # Stores made from an event loop without a thread (`_store_nowait`):
        # the loop that watches the store's durability, the native store and
        # its durability waker, and the (receipt, future) pairs not yet
        # settled, in append order.
        self._waker: Optional[tuple] = None
        self._nowait_off = False
        # Held while a store is handed to the native store, and while
        # `_close_sync` takes the store away.
        self._handing = threading.Lock()
        self._pending: collections.deque = collections.deque()
        # (trace, future) pairs of stores waiting for room, in call order.
        self._turns: collections.deque = collections.deque()

    def _get(self) -> Store:
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    closed, self._closed = self._closed, None
                    if closed is not None:
                        # A store `_after_failure` closed while another
                        # thread was reading: the directory stays locked
                        # until that read returns (a hang guard, not a
                        # timing assumption: the open below says LockedError
                        # if it never does).
                        closed.wait_closed(_CLOSE_WAIT_SECONDS)
                    self._store = Store(self._path, durability=self._durability, **self._options)
                store = self._store
        return store

    # -- stores --

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """Run a store in a worker thread; it is in flight (reads wait for
        it) from now until it finishes, whether or not anyone awaits it."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="trajlog-store"
                )
            future = self._executor.submit(fn, *args)
            self._in_flight.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future) -> None:
        with self._lock:
            self._in_flight.discard(future)
        if not future.cancelled() and future.exception() is not None:
            self._after_failure()

    def _after_failure(self, *, reported: bool = False) -> None:
        """After a store or flush failed: when a failed write or fsync (a full
        disk, an I/O error) poisoned the store, close it, so that the next
        use opens the directory again (which cuts the failed write off) — a
        gateway that runs for days needs no restart. Stores that failed are
        reported to their callers; those acknowledged before are kept, and
        the next flush says that others may be lost, unless the caller
        reports the failure itself (`reported`)."""
        try:
            self._close_poisoned()
        finally:
            if reported:
                self._lost = None

    def _close_poisoned(self) -> None:
        store = self._store
        try:
            why = None if store is None else store.poisoned()
        except Exception:  # closed meanwhile
            return
        if why is None:
            return
        with self._handing, self._lock:
            if self._store is not store:
                return  # already taken away
            self._store = None
            self._closed = store
            self._lost = why
        try:
            store.close()
        except Exception:  # the poisoning itself, reported to the failed stores
            pass

    async def _run_store(self, fn, *args):
        """Submit a store and wait for it. Cancelling the caller does not
        cancel the store: it was called, so it completes."""
        inner = asyncio.wrap_future(self._submit(fn, *args))
        inner.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved if nobody awaits
        return await asyncio.shield(inner)

    # -- stores from the event loop, without a thread --

    def _nowait_loop(self, loop) -> bool:
        """Whether a store from `loop` can take the thread-free path: the
        store is open (an open can take long, so the first store opens it in
        a thread), and `loop` is the one watching the store's durability:
        the first loop to ask, or the next one once that loop is closed.
        Stores from other loops use threads."""
        store = self._store
        if store is None or self._nowait_off:
            return False
        waker = self._waker
        if waker is not None and waker[0] is loop and waker[1] is store._native:
            return True
        with self._lock:
            waker = self._waker
            if waker is not None:
                if waker[0] is loop and waker[1] is store._native:
                    return True
                if waker[0] is loop:
                    # The store was opened again (after a failed write) and
                    # this loop watches the new one from now on. What is
                    # pending stays: the old store's receipts answer (durable,
                    # or failed as closed) when the loop settles next.
                    loop.remove_reader(waker[2].fileno())
                    self._waker = None
                elif not (waker[0].is_closed() or waker[1] is not store._native):
                    return False
                else:
                    # Its loop is closed (or the store was reopened): what it
                    # left pending can no longer be settled there.
                    self._waker = None
                    self._pending.clear()
                    self._turns.clear()
            try:
                waker = store._native.durable_waker()
                loop.add_reader(waker.fileno(), self._on_durable)
            except (NotImplementedError, AttributeError, OSError):
                # No `add_reader` (Windows' proactor loop): threads it is.
                self._nowait_off = True
                return False
            self._waker = (loop, store._native, waker)
        return True

    async def _store_nowait(self, trace: dict) -> None:
        """Walk `trace` on the loop's thread, hand it to the store's encoder
        thread, and wait, holding no thread, until the group commit that
        covers it wakes the loop. At most `_NOWAIT_IN_FLIGHT` stores are in
        flight: past that, a store waits in a queue of its own, which is
        handed on in call order as room appears (back-pressure that keeps
        the loop running and the stores in the order they were called: a
        later upsert of the same trace id always wins)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        future.add_done_callback(_retrieved)  # retrieved if nobody awaits
        self._turns.append((trace, future))
        self._admit(loop)
        # Cancelling the caller does not cancel the store: it was called, so it completes.
        await asyncio.shield(future)

    def _admit(self, loop) -> None:
        """Hand the waiting stores on, oldest first, while fewer than
        `_NOWAIT_IN_FLIGHT` are in flight. Runs on `loop`, the waker's."""
        turns, pending = self._turns, self._pending
        while turns and len(pending) < _NOWAIT_IN_FLIGHT:
            trace, future = turns.popleft()
            try:
                with self._handing:
                    # `close` takes the store away under this lock: a store it
                    # did not see is never handed to a closing native store.
                    store = self._store if self._nowait_loop(loop) else None
                    receipt = None if store is None else store._append_trace_nowait(trace, self._waker[2])
            except Exception as e:  # the walk refused it: nothing written
                if not future.done():
                    future.set_exception(e)
                continue
            if receipt is None:
                # Closed (or handed to another loop) while this store waited.
                inner = asyncio.wrap_future(self._submit(lambda t=trace: self._get().append_trace(t, durable=True)), loop=loop)
                inner.add_done_callback(lambda f, future=future: _copy_outcome(f, future))
                continue
            pending.append((receipt, future))

    def _on_durable(self) -> None:
        """The loop's callback on the durability file descriptor."""
        waker = self._waker
        if waker is not None:
            self._settle(waker[2])

    def _settle(self, waker) -> None:
        """Take the wake-up, then settle every pending store that is durable
        now, in order, and fail those the store will never make durable (a
        failed write, a closed store). Runs on the waker's loop."""
        waker.drain()
        pending = self._pending
        failed = False
        while pending:
            receipt, future = pending[0]
            try:
                if not receipt.poll():
                    break
                error = None
            except Exception as e:  # the store's error: poisoned or closed
                error = e
                failed = True
            pending.popleft()
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        if failed:
            self._after_failure()
        if self._turns:
            self._admit(asyncio.get_running_loop())

    def _stop_waker(self) -> None:
        """After the store closed: settle what is pending (durable, or failed
        as closed) and stop watching, on the waker's loop."""
        with self._lock:
            waker, self._waker = self._waker, None
        if waker is None:
            return
        loop, _native, waker = waker

        def stop():
            loop.remove_reader(waker.fileno())
            self._settle(waker)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            stop()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(stop)

    def _note_append(self) -> None:
        """Count an append that is not yet durable (and so not yet visible)."""
        with self._lock:
            self._appended += 1

    # -- reads --

    def _make_visible(self) -> None:
        """Flush if an append counted by `_note_append` may not be visible yet."""
        with self._lock:
            target = self._appended
            if target <= self._visible:
                return
        self._get().flush()
        with self._lock:
            self._visible = max(self._visible, target)

    async def _after_stores(self) -> None:
        """Wait (without holding a thread) for the stores in flight now."""
        # A store scheduled just before (`asyncio.create_task(...store_trace(...))`)
        # takes its first step now and is then in flight.
        await asyncio.sleep(0)
        with self._lock:
            pending = [asyncio.wrap_future(f) for f in self._in_flight]
        if self._pending or self._turns:
            waker = self._waker
            if waker is not None and waker[0] is asyncio.get_running_loop():
                pending += [f for _, f in self._pending] + [f for _, f in self._turns]
            else:
                # Stores from another loop, already with the writer: the
                # read's flush covers them.
                self._note_append()
        if pending:
            waits = asyncio.gather(*pending, return_exceptions=True)
            await asyncio.shield(waits)

    def _read_sync(self, fn, *args):
        self._make_visible()
        return fn(*args)

    async def _read(self, fn, *args):
        """`fn(*args)` in a thread, seeing every store called before."""
        await self._after_stores()
        return await asyncio.to_thread(self._read_sync, fn, *args)

    # -- lifecycle --

    def _close_sync(self) -> None:
        with self._lock:
            pending = list(self._in_flight)
            executor, self._executor = self._executor, None
        concurrent.futures.wait(pending)
        if executor is not None:
            executor.shutdown(wait=True)
        with self._handing, self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()
        self._stop_waker()

    async def flush(self) -> None:
        """Barrier: everything stored before is durable; raises on failure.
        A write that failed since the last flush (the store was reopened
        since) is such a failure: stores made before it and not yet durable
        (those not awaited) may be lost, and this flush raises
        `PoisonedError` saying so, once."""
        await self._after_stores()
        try:
            await asyncio.to_thread(lambda: self._get().flush())
        except Exception:
            self._after_failure(reported=True)  # raised below
            raise
        lost, self._lost = self._lost, None
        if lost is not None:
            raise PoisonedError(
                f"a write failed since the last flush ({lost}): stores made before it and not yet durable "
                "may have been lost. The store was reopened and takes stores again; the next flush covers what is "
                "stored from now on"
            )

    async def close(self) -> None:
        """Wait for the stores in flight, then close the store."""
        waker = self._waker
        if self._turns and waker is not None and waker[0] is asyncio.get_running_loop():
            # Stores still waiting for room are handed on (and made durable)
            # as the ones before them settle: close after them.
            waits = asyncio.gather(*[f for _, f in self._turns], return_exceptions=True)
            await asyncio.shield(waits)
        await asyncio.to_thread(self._close_sync)


def _retrieved(future) -> None:
    """Mark a future's exception retrieved (its caller may be gone)."""
    future.cancelled() or future.exception()


def _copy_outcome(source, target) -> None:
    """Settle `target` as `source` settled (a store's worker-thread future)."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(None)


def _check_ids(trace_id: Any, session_id: Any, data: Any) -> None:
    if not isinstance(trace_id, str):
        raise InvalidInputError(f"invalid trace_id: {trace_id!r} is not a string")
    if not isinstance(session_id, str):
        raise InvalidInputError(f"invalid session_id: {session_id!r} is not a string")
    if not isinstance(data, dict):
        raise InvalidInputError(f"invalid data: a {type(data).__name__} is not a dict")


class TrajlogTraceStore(_LazyStore):
    """rLLM gateway `TraceStore` backed by a trajlog store directory.

    `store_trace` returns once the trace is durable. A read
    (`get_trace`, `get_session_traces`, `list_sessions`) and
    `delete_session` see every `store_trace` called before them, awaited or
    not (rLLM's gateway does not await it with `sync_traces=False`).
    """

    def __init__(self, path: str, *, durability: str = "group", **options: Any):
        super().__init__(path, durability, options)
        self.path = str(path)

    def _store_sync(self, trace_id: str, session_id: str, data: dict) -> None:
        _check_ids(trace_id, session_id, data)
        trace = dict(data)
        trace["trace_id"] = trace_id
        trace["session_id"] = session_id
        self._get().append_trace(trace, durable=True)

    async def store_trace(self, trace_id: str, session_id: str, data: dict) -> None:
        """Insert or replace (upsert) a trace; durable on return.

        Once the store is open, the dict is walked on the loop's thread, its
        call checked, encoded and appended by the store's encoder thread (in
        walk order), and the coroutine waits, holding no thread, for the
        group commit that covers it (one wake-up of the loop per commit).
        With `_NOWAIT_IN_FLIGHT` stores in flight, a store first waits for
        the oldest. The first store (which opens the store) and stores from
        a second loop run in a worker thread instead."""
        if self._nowait_loop(asyncio.get_running_loop()):
            _check_ids(trace_id, session_id, data)
            trace = dict(data)
            trace["trace_id"] = trace_id
            trace["session_id"] = session_id
            await self._store_nowait(trace)
        else:
            await self._run_store(self._store_sync, trace_id, session_id, data)

    def _get_sync(self, trace_id: str) -> Optional[dict]:
        call = self._get().get(trace_id)
        return None if call is None else call.to_dict()

    async def get_trace(self, trace_id: str) -> Optional[dict]:
        return await self._read(self._get_sync, trace_id)

    def _session_sync(self, session_id: str, since: Optional[float], limit: Optional[int]) -> list:
        return self._get().session_dicts(session_id, since=since, limit=limit)

    async def get_session_traces(
        self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None
    ) -> list:
        """A session's traces, oldest first (timestamp > since, at most limit)."""
        return await self._read(self._session_sync, session_id, since, limit)

    async def delete_session(self, session_id: str) -> int:
        return await self._read(lambda: self._get().delete_session(session_id))

    def _list_sync(self, since: Optional[float], limit: Optional[int]) -> list:
        keys = ("session_id", "trace_count", "first_trace_at", "last_trace_at")
        return [{k: s[k] for k in keys} for s in self._get().sessions(since=since, limit=limit)]

    async def list_sessions(self, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        return await self._read(self._list_sync, since, limit)


# ---------------------------------------------------------------------------
# The older rLLM SDK: its SqliteTraceStore interface, and its tracer.
# ---------------------------------------------------------------------------
logger = logging.getLogger(__name__)


class TraceContext:
    """A stored SDK record, with the attributes of rLLM SDK's `TraceContext`."""

    __slots__ = ("id", "data", "namespace", "type", "metadata", "created_at", "updated_at")

    def __init__(self, id, data, namespace="default", type="generic", metadata=None, created_at=None, updated_at=None):
        self.id = id
        self.data = data
        self.namespace = namespace
        self.type = type
        self.metadata = metadata if metadata is not None else {}
        self.created_at = created_at if created_at is not None else time.time()
        self.updated_at = updated_at if updated_at is not None else time.time()

    def __repr__(self):
        return f"TraceContext(id={self.id!r}, namespace={self.namespace!r}, type={self.type!r}, created_at={self.created_at})"


def _active_session_uids() -> list:
    """Session uids of the active rLLM SDK sessions, outer → inner ([] without rLLM)."""
    try:
        from rllm.sdk.session import get_active_sessions  # type: ignore
    except Exception:
        return []
    try:
        return [s._uid for s in get_active_sessions()]
    except Exception:
        return []


def _context(trace_id: str, row) -> TraceContext:
    data, namespace, context_type, metadata, created_at, updated_at, _uids = row
    return TraceContext(
        id=trace_id,
        data=json.loads(data),
        namespace=namespace,
        type=context_type,
        metadata=json.loads(metadata),
        created_at=created_at,
        updated_at=updated_at,
    )


class TrajlogSdkTraceStore(_LazyStore):
    """The older rLLM SDK's `SqliteTraceStore` interface on a trajlog store.

    Each record keeps its `data` dict exactly: the token ids and logprobs found
    in it (`input.prompt_token_ids`, `output.output_token_ids`,
    `output.rollout_logprobs`, or an OpenAI response's `prompt_token_ids` and
    `choices[0]` token ids) go to the typed columns and are put back on read;
    everything else is kept as JSON. A record belongs to all its session uids
    (nested sessions); its trajlog `session_id` is the innermost one.
    `created_at` survives an upsert, as in the SDK. `query` and
    `get_by_session_uid` return newest first; `since` keeps `created_at >= since`.
    """

    def __init__(self, db_path: Optional[str] = None, *, durability: str = "group", **options: Any):
        if db_path is None:
            import os

            db_path = os.path.join(os.path.expanduser("~/.rllm"), "traces.trajlog")
        super().__init__(db_path, durability, options)
        self.db_path = str(db_path)

    # -- sync core, shared with the tracer --

    def _record(self, store, trace_id, data, namespace, context_type, metadata, session_uids, now) -> tuple:
        """One record checked and serialized for `append_sdk`/`append_sdk_batch`:
        (trace_id, data, namespace, context_type, metadata, session_uids,
        created_at, updated_at). Raises before anything is written."""
        if not isinstance(trace_id, str) or not trace_id:
            raise InvalidInputError(f"invalid trace_id: {trace_id!r} is not a non-empty string")
        _text("trace_id", trace_id)
        if not isinstance(data, dict):
            raise InvalidInputError(f"invalid data: a {type(data).__name__} is not a dict")
        uids = _active_session_uids() if session_uids is None else _session_uids(session_uids)
        data_json = _json_text("data", data)
        metadata_json = "null" if metadata is None else _json_text("metadata", metadata)
        # created_at survives an upsert; it is the call's timestamp (a cheap
        # index lookup, no decoding of the stored record).
        existing = store.get(trace_id)
        created_at = existing.timestamp if existing is not None else now
        return (
            trace_id, data_json, _text("namespace", namespace), _text("context_type", context_type), metadata_json,
            uids, created_at, now,
        )

    def _store_sync(self, trace_id, data, namespace, context_type, metadata, session_uids, durable, now=None):
        store = self._get()
        record = self._record(
            store, trace_id, data, namespace, context_type, metadata, session_uids, time.time() if now is None else now
        )
        store._native.append_sdk(*record, durable)
        if not durable:
            self._note_append()
        return record[6]

    def _rows(self, trace_ids):
        rows = self._get()._native.get_sdk(list(trace_ids))
        return [(tid, row) for tid, row in zip(trace_ids, rows) if row is not None]

    # -- the SDK store interface --

    async def store(
        self,
        trace_id: str,
        data: dict,
        namespace: str = "default",
        context_type: str = "llm_trace",
        metadata: Optional[dict] = None,
        session_uids: Optional[list] = None,
    ) -> None:
        """Insert or replace a record; durable on return. `session_uids`
        defaults to the active rLLM sessions."""
        if session_uids is None:
            session_uids = _active_session_uids()
        await self._run_store(self._store_sync, trace_id, data, namespace, context_type, metadata, session_uids, True)

    async def store_batch(self, traces: list, preserve_order: bool = True) -> list:
        """Store `{"id", "data", "namespace"?, "type"?, "metadata"?}` records
        under the active sessions with one durability wait; returns their
        `TraceContext`s in order. All or nothing: every record is checked
        before the first is written."""
        session_uids = _active_session_uids()

        def run():
            store = self._get()
            now = time.time()
            records, out = [], []
            for i, t in enumerate(traces):
                if not isinstance(t, dict) or "id" not in t or "data" not in t:
                    raise InvalidInputError(f"invalid traces[{i}]: must be a dict with \"id\" and \"data\"")
                namespace = t.get("namespace", "default")
                context_type = t.get("type", "llm_trace")
                metadata = t.get("metadata", {})
                record = self._record(store, t["id"], t["data"], namespace, context_type, metadata, session_uids, now)
                records.append(record)
                out.append(TraceContext(t["id"], t["data"], namespace, context_type, metadata, record[6], now))
            store._native.append_sdk_batch(records, True)
            return out

        return await self._run_store(run)

    async def get(self, trace_id: str) -> Optional[TraceContext]:
        rows = await self._read(self._rows, [trace_id])
        return _context(*rows[0]) if rows else None

    def _by_uid_sync(self, session_uid, since, limit):
        ids = [c.trace_id for c in self._get().session(session_uid)]
        rows = self._rows(ids)
        rows.reverse()  # newest first
        if since is not None:
            rows = [r for r in rows if r[1][4] >= since]
        return [_context(*r) for r in (rows if limit is None else rows[:limit])]

    async def get_by_session_uid(self, session_uid: str, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """A session uid's records, newest first (`created_at >= since`, at most `limit`)."""
        return await self._read(self._by_uid_sync, session_uid, since, limit)

    def _query_sync(self, session_uids, context_types, namespaces, since, limit):
        if session_uids:
            seen = {}
            for uid in session_uids:
                for c in self._get().session(uid):
                    seen.setdefault(c.trace_id, None)
            rows = self._rows(list(seen))
        else:
            rows = self._get()._native.scan_sdk()
        out = [
            r for r in rows
            if (since is None or r[1][4] >= since)
            and (not context_types or r[1][2] in context_types)
            and (not namespaces or r[1][1] in namespaces)
        ]
        out.sort(key=lambda r: r[1][4], reverse=True)
        if limit:
            out = out[:limit]
        return [_context(*r) for r in out]

    async def query(
        self,
        session_uids: Optional[list] = None,
        context_types: Optional[list] = None,
        namespaces: Optional[list] = None,
        since: Optional[float] = None,
        limit: Optional[int] = None,
    ) -> list:
        """Records matching every given filter, newest first, each once."""
        return await self._read(self._query_sync, session_uids, context_types, namespaces, since, limit)

    async def get_session_uids_for_trace(self, trace_id: str) -> list:
        rows = await self._read(self._rows, [trace_id])
        return list(rows[0][1][6]) if rows else []


class TrajlogTracer:
    """The older rLLM SDK tracer (`log_llm_call`, `flush`, `close`) on trajlog.

    Unlike rLLM's SqliteTracer it never drops a trace: `log_llm_call` hands the
    trace to the store's writer and returns (microseconds); when the writer is
    behind, the caller waits instead of losing data, and an invalid trace raises
    at once. `flush(timeout)` returns True once everything logged before is
    durable, and False only when a write failed (the error is logged and kept
    in `last_error`) or the timeout passed first.
    """

    def __init__(self, db_path: Optional[str] = None, namespace: str = "default", *, durability: str = "group", **options: Any):
        self.store = TrajlogSdkTraceStore(db_path, durability=durability, **options)
        self.namespace = namespace
        self.last_error: Optional[BaseException] = None
        # A write failure `log_llm_call` met (the store reopened since), not
        # yet reported by a `flush`: traces logged before it may be lost.
        self._unreported: Optional[BaseException] = None

    def log_llm_call(
        self,
        name: str,
        input: Any,
        output: Any,
        model: str,
        latency_ms: float,
        tokens: dict,
        session_id: Optional[str] = None,
        metadata: Optional[dict] = None,
        trace_id: Optional[str] = None,
        parent_trace_id: Optional[str] = None,
        cost: Optional[float] = None,
        environment: Optional[str] = None,
        tools: Optional[list] = None,
        contexts: Optional[list] = None,
        tags: Optional[list] = None,
        session_uids: Optional[list] = None,
    ) -> None:
        if trace_id is None and isinstance(output, dict):
            trace_id = output.get("id")
        if trace_id is None:
            trace_id = f"tr_{uuid.uuid4().hex[:16]}"
        context_meta = {}
        try:
            from rllm.sdk.session import get_current_metadata, get_current_session_id  # type: ignore

            if session_id is None:
                session_id = get_current_session_id()
            context_meta = get_current_metadata() or {}
        except Exception:
            pass
        if session_uids is None:
            session_uids = _active_session_uids()
        data = {
            "name": name,
            "input": input,
            "output": output,
            "model": model,
            "latency_ms": latency_ms,
            "tokens": tokens,
            "timestamp": time.time(),
        }
        for key, value in (
            ("parent_trace_id", parent_trace_id), ("cost", cost), ("environment", environment), ("tools", tools),
            ("contexts", contexts), ("tags", tags), ("session_id", session_id),
        ):
            if value is not None:
                data[key] = value
        final_metadata = {**context_meta, **(metadata or {})}
        record = (trace_id, data, self.namespace, "llm_trace", final_metadata, session_uids, False)
        try:
            self.store._store_sync(*record)
        except PoisonedError as e:
            # An earlier write failed (a full disk): the store refuses every
            # write until it is reopened. Reopen it and log this trace; the
            # next `flush` returns False for the traces the failure lost.
            self._unreported = e
            self.store._after_failure(reported=True)  # by the tracer's next flush
            self.store._store_sync(*record)

    def flush(self, timeout: float = 30.0) -> bool:
        done = threading.Event()
        failure: list = []

        def run():
            try:
                self.store._get().flush()
            except BaseException as e:  # reported below, never swallowed silently
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="trajlog-tracer-flush").start()
        if not done.wait(timeout):
            logger.warning("trajlog tracer: flush did not complete within %ss", timeout)
            return False
        # A failure `log_llm_call` met is reported by this flush, whatever it finds.
        unreported, self._unreported = self._unreported, None
        if failure:
            self.last_error = failure[0]
            logger.error("trajlog tracer: flush failed: %s", failure[0])
            # A poisoned store is closed, so the next trace opens it again.
            self.store._after_failure(reported=True)
            return False
        if unreported is not None:
            self.last_error = unreported
            logger.error("trajlog tracer: traces logged before a failed write may have been lost: %s", unreported)
            return False
        return True

    async def close(self, timeout: float = 30.0) -> None:
        """Flush (raising if that fails) and close the store."""
        await asyncio.to_thread(self.close_sync, timeout)

    def close_sync(self, timeout: float = 30.0) -> None:
        if not self.flush(timeout):
            raise self.last_error or TimeoutError(f"trajlog tracer: flush did not complete within {timeout}s")
        self.store._close_sync()

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        await self.close()
        return False

    def __repr__(self):
        return f"TrajlogTracer(namespace={self.namespace!r}, db_path={self.store.db_path!r})"
