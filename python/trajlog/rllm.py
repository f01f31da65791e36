"""trajlog as the trace store of rLLM's gateway: `TrajlogTraceStore` implements
its async `TraceStore` protocol.

    from rllm.gateway import create_app            # rLLM
    from trajlog.rllm import TrajlogTraceStore
    app = create_app(config, store=TrajlogTraceStore("/data/traces"))

Any trace dict round-trips unchanged: token fields that are lists of ints (and
logprobs exactly representable as float32, which is what inference engines
produce) go to the typed columns and come back as plain lists; every other
field is kept as verbatim JSON. A trace is durable when `store_trace` returns
(group commit); nothing is dropped when the writer is behind — callers wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any, Optional

from . import InvalidInputError, Store


class _LazyStore:
    """A trajlog store opened on first use. Concurrent first use from many
    coroutines or threads opens it once; `flush` and `close` are async."""

    def __init__(self, path: str, durability: str, options: dict):
        self._path = str(path)
        self._durability = durability
        self._options = options
        self._store: Optional[Store] = None
        self._lock = threading.Lock()

    def _get(self) -> Store:
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    self._store = Store(self._path, durability=self._durability, **self._options)
                store = self._store
        return store

    def _close_sync(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    async def flush(self) -> None:
        """Barrier: everything stored before is durable; raises on failure."""
        await asyncio.to_thread(lambda: self._get().flush())

    async def close(self) -> None:
        await asyncio.to_thread(self._close_sync)


class TrajlogTraceStore(_LazyStore):
    """rLLM gateway `TraceStore` backed by a trajlog store directory."""

    def __init__(self, path: str, *, durability: str = "group", **options: Any):
        super().__init__(path, durability, options)
        self.path = str(path)

    async def _run(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    def _store_sync(self, trace_id: str, session_id: str, data: dict) -> None:
        trace = dict(data)
        trace["trace_id"] = trace_id
        trace["session_id"] = session_id
        self._get().append_trace(trace, durable=True)

    async def store_trace(self, trace_id: str, session_id: str, data: dict) -> None:
        """Insert or replace (upsert) a trace; durable on return."""
        await self._run(self._store_sync, trace_id, session_id, data)

    def _get_sync(self, trace_id: str) -> Optional[dict]:
        call = self._get().get(trace_id)
        return None if call is None else call.to_dict()

    async def get_trace(self, trace_id: str) -> Optional[dict]:
        return await self._run(self._get_sync, trace_id)

    def _session_sync(self, session_id: str, since: Optional[float], limit: Optional[int]) -> list:
        return [c.to_dict() for c in self._get().session(session_id, since=since, limit=limit)]

    async def get_session_traces(
        self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None
    ) -> list:
        """A session's traces, oldest first (timestamp > since, at most limit)."""
        return await self._run(self._session_sync, session_id, since, limit)

    async def delete_session(self, session_id: str) -> int:
        return await self._run(lambda: self._get().delete_session(session_id))

    def _list_sync(self, since: Optional[float], limit: Optional[int]) -> list:
        keys = ("session_id", "trace_count", "first_trace_at", "last_trace_at")
        return [{k: s[k] for k in keys} for s in self._get().sessions(since=since, limit=limit)]

    async def list_sessions(self, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        return await self._run(self._list_sync, since, limit)


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

    def _store_sync(self, trace_id, data, namespace, context_type, metadata, session_uids, durable, now=None):
        if not isinstance(trace_id, str) or not trace_id:
            raise InvalidInputError(f"invalid trace_id: {trace_id!r} is not a non-empty string")
        store = self._get()
        now = time.time() if now is None else now
        # created_at survives an upsert; it is the call's timestamp (a cheap
        # index lookup, no decoding of the stored record).
        existing = store.get(trace_id)
        created_at = existing.timestamp if existing is not None else now
        uids = _active_session_uids() if session_uids is None else list(session_uids)
        try:
            data_json = json.dumps(data)
            metadata_json = json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"invalid data: not JSON-serializable ({e})") from None
        store._native.append_sdk(
            trace_id, data_json, namespace, context_type, metadata_json, uids, created_at, now, durable
        )
        return created_at

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
        await asyncio.to_thread(
            self._store_sync, trace_id, data, namespace, context_type, metadata, session_uids, True
        )

    async def store_batch(self, traces: list, preserve_order: bool = True) -> list:
        """Store `{"id", "data", "namespace"?, "type"?, "metadata"?}` records
        under the active sessions with one durability wait; returns their
        `TraceContext`s in order."""
        session_uids = _active_session_uids()

        def run():
            now = time.time()
            out = []
            for t in traces:
                namespace = t.get("namespace", "default")
                context_type = t.get("type", "llm_trace")
                metadata = t.get("metadata", {})
                created = self._store_sync(t["id"], t["data"], namespace, context_type, metadata, session_uids, False, now)
                out.append(TraceContext(t["id"], t["data"], namespace, context_type, metadata, created, now))
            self._get().flush()
            return out

        return await asyncio.to_thread(run)

    async def get(self, trace_id: str) -> Optional[TraceContext]:
        rows = await asyncio.to_thread(self._rows, [trace_id])
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
        return await asyncio.to_thread(self._by_uid_sync, session_uid, since, limit)

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
        return await asyncio.to_thread(self._query_sync, session_uids, context_types, namespaces, since, limit)

    async def get_session_uids_for_trace(self, trace_id: str) -> list:
        rows = await asyncio.to_thread(self._rows, [trace_id])
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
        self.store._store_sync(trace_id, data, self.namespace, "llm_trace", final_metadata, session_uids, False)

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
        if failure:
            self.last_error = failure[0]
            logger.error("trajlog tracer: flush failed: %s", failure[0])
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
