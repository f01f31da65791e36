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
import threading
from typing import Any, Optional

from . import Store


class TrajlogTraceStore:
    """rLLM gateway `TraceStore` backed by a trajlog store directory."""

    def __init__(self, path: str, *, durability: str = "group", **options: Any):
        self.path = str(path)
        self._durability = durability
        self._options = options
        self._store: Optional[Store] = None
        self._lock = threading.Lock()

    def _get(self) -> Store:
        # Concurrent first use from many coroutines or threads opens once.
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    self._store = Store(self.path, durability=self._durability, **self._options)
                store = self._store
        return store

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

    async def flush(self) -> None:
        """Barrier: everything stored before is durable; raises on failure."""
        await self._run(lambda: self._get().flush())

    async def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            await self._run(store.close)
