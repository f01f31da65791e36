"""trajlog: an exact, append-only trace store for RL training of LLM agents.

    import trajlog
    with trajlog.Store("traces") as store:
        store.append(trace_id="t1", session_id="task:0",
                     prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                     logprobs=[-0.1, -0.2])
        store.flush()
        call = store.get("t1")
        call.completion_token_ids   # numpy uint32 view into the mapped segment

Token ids and logprobs come back bit for bit. `Call.completion_token_ids` and
`Call.logprobs` are always zero-copy views (read-only numpy arrays whose base
keeps the mapping alive, even after the store is closed); `Call.prompt_token_ids`
is a view when the prompt is stored whole (a session's first call, or a
compacted call) and otherwise materialized from the prefix-delta chain
(`Call.prompt_is_view` tells which; `Call.prompt_suffix` is always a view).
"""

from __future__ import annotations

import array
import json
import math
import time
from typing import Any, Iterable, Optional

import numpy as np

from . import errors
from ._trajlog import Call, NativeStore
from .errors import (
    ClosedError,
    CorruptError,
    IncompatibleError,
    InvalidInputError,
    IOFailure,
    LimitExceededError,
    LockedError,
    NotFoundError,
    PoisonedError,
    TrajlogError,
)

__all__ = [
    "Store",
    "Call",
    "errors",
    "TrajlogError",
    "IOFailure",
    "CorruptError",
    "IncompatibleError",
    "InvalidInputError",
    "LimitExceededError",
    "LockedError",
    "ClosedError",
    "PoisonedError",
    "NotFoundError",
]

_U32_MAX = 0xFFFFFFFF
# The array.array type code of a 4-byte unsigned int, where there is one.
_U32_CODE = next((c for c in "IL" if array.array(c).itemsize == 4), None)

# Trace keys stored in columns or typed fields; every other key is kept verbatim.
_COLUMNS = (
    "trace_id", "session_id", "prompt_token_ids", "completion_token_ids", "logprobs", "session_uids",
    "timestamp", "model", "weight_version", "messages", "response_message", "metadata",
    "finish_reason", "latency_ms",
)


def _as_array(values: Any) -> np.ndarray:
    """A numpy array of any sequence, numpy array, array.array or buffer."""
    if isinstance(values, (list, tuple, np.ndarray)):
        return np.asarray(values)
    try:
        return np.asarray(memoryview(values))
    except TypeError:
        return np.asarray(list(values))


def _token_ids(field: str, values: Any) -> np.ndarray:
    """Any sequence, numpy array, array.array or buffer of integer ids →
    contiguous uint32, refusing (never wrapping) what does not fit."""
    if values is None:
        return np.empty(0, dtype=np.uint32)
    if isinstance(values, np.ndarray) and values.dtype == np.uint32 and values.ndim == 1:
        return np.ascontiguousarray(values)
    if _U32_CODE and isinstance(values, list):
        # Fast path for lists of ints (3x faster than numpy's conversion);
        # anything it refuses takes the checked path below, which names the bad element.
        try:
            return np.frombuffer(array.array(_U32_CODE, values), dtype=np.uint32)
        except (OverflowError, TypeError):
            pass
    arr = _as_array(values)
    if arr.ndim != 1:
        raise InvalidInputError(f"invalid {field}: must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidInputError(f"invalid {field}[{i}]: {v!r} is not a token id (an integer in 0..=4294967295)")
        arr = np.asarray(arr.tolist(), dtype=np.int64) if max(arr.tolist()) < 2**63 else np.asarray(arr.tolist(), dtype=object)
    if arr.dtype == object:
        bad = next(i for i, v in enumerate(arr.tolist()) if not 0 <= v <= _U32_MAX)
        raise InvalidInputError(f"invalid {field}[{bad}]: {arr[bad]} is not a token id (an integer in 0..=4294967295)")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _U32_MAX:
        bad = int(np.argmax((arr < 0) | (arr > _U32_MAX)))
        raise InvalidInputError(f"invalid {field}[{bad}]: {arr[bad]} is not a token id (an integer in 0..=4294967295)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _logprobs(values: Any) -> Optional[np.ndarray]:
    """float32 stays bit-exact; other floats are rounded to float32 (the
    precision inference engines produce)."""
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == np.float32 and values.ndim == 1:
        return np.ascontiguousarray(values)
    arr = _as_array(values)
    if arr.ndim != 1:
        raise InvalidInputError(f"invalid logprobs: must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype == object or arr.dtype.kind not in "fiu"):
        for i, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidInputError(f"invalid logprobs[{i}]: {v!r} is not a number")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _exact_f32(values: Any) -> Optional[np.ndarray]:
    """`values` as float32 when every one is a number exactly representable
    as float32 (so widening gives the same Python floats back); else None."""
    if isinstance(values, np.ndarray):
        return values if values.dtype == np.float32 and values.ndim == 1 else None
    try:
        if any(isinstance(v, bool) for v in values):
            return None
        wide = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if wide.ndim != 1:
        return None
    narrow = wide.astype(np.float32)
    return narrow if np.array_equal(narrow.astype(np.float64), wide) else None


def _json_text(field: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"invalid {field}: not JSON-serializable ({e})") from None


def _finite(field: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInputError(f"invalid {field}: {value!r} is not a finite number")
    return float(value)


class Store:
    """An open trajlog store directory. Safe to share between threads; the GIL
    is released while the store waits on I/O.

    `durability` is "buffered", "group" (the default) or "sync"; see the
    README. `read_only=True` opens without the writer lock (another process may
    be writing); `refresh()` then shows what it flushed since.
    """

    def __init__(
        self,
        path,
        *,
        durability: str = "group",
        read_only: bool = False,
        segment_bytes: Optional[int] = None,
        group_commit_ms: Optional[int] = None,
        queue_depth: Optional[int] = None,
    ):
        self.path = str(path)
        self._native = NativeStore(
            self.path,
            durability=durability,
            read_only=read_only,
            segment_bytes=segment_bytes,
            group_commit_ms=group_commit_ms,
            queue_depth=queue_depth,
        )

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def append(
        self,
        *,
        trace_id: str,
        session_id: str,
        prompt_token_ids: Any,
        completion_token_ids: Any,
        logprobs: Any = None,
        session_uids: Optional[Iterable[str]] = None,
        timestamp: Optional[float] = None,
        model: Optional[str] = None,
        weight_version: Optional[int] = None,
        messages: Any = None,
        response_message: Any = None,
        metadata: Any = None,
        finish_reason: Optional[str] = None,
        latency_ms: Optional[float] = None,
        routing_matrices: Optional[bytes] = None,
        durable: bool = False,
        **extra: Any,
    ) -> None:
        """Append one call. Lists, numpy arrays, array.array and buffers are
        accepted for the token ids and logprobs. Returns once the writer has the
        call; `durable=True` waits until it is durable (or call `flush()`).
        Unknown keyword arguments are kept verbatim as JSON and come back in
        `Call.to_dict()`."""
        self._append(
            trace_id, session_id, prompt_token_ids, completion_token_ids, logprobs, session_uids, timestamp, model,
            weight_version, messages, response_message, metadata, finish_reason, latency_ms, routing_matrices,
            durable, extra,
        )

    def _append(
        self, trace_id, session_id, prompt_token_ids, completion_token_ids, logprobs, session_uids, timestamp, model,
        weight_version, messages, response_message, metadata, finish_reason, latency_ms, routing_matrices,
        durable, extra,
    ) -> None:
        if not isinstance(trace_id, str) or not isinstance(session_id, str):
            raise InvalidInputError("invalid trace_id/session_id: must be strings")
        if weight_version is not None and (isinstance(weight_version, bool) or not isinstance(weight_version, int)):
            raise InvalidInputError(f"invalid weight_version: {weight_version!r} is not an integer")
        self._native.append(
            trace_id,
            session_id,
            _token_ids("prompt_token_ids", prompt_token_ids),
            _token_ids("completion_token_ids", completion_token_ids),
            _logprobs(logprobs),
            list(session_uids or []),
            time.time() if timestamp is None else _finite("timestamp", timestamp),
            model,
            weight_version,
            finish_reason,
            _finite("latency_ms", latency_ms),
            _json_text("messages", messages),
            _json_text("response_message", response_message),
            _json_text("metadata", metadata),
            _json_text("extra", extra) if extra else None,
            None if routing_matrices is None else bytes(routing_matrices),
            durable,
        )

    def append_trace(self, trace: dict, *, durable: bool = False) -> None:
        """Append a whole gateway-shaped trace dict (`trace_id`, `session_id`,
        `prompt_token_ids`, `completion_token_ids`, `logprobs`, `messages`, …).
        Every key without a column is kept verbatim; `Call.to_dict()` gives the
        same dict back."""
        d = dict(trace)
        known = {}
        for key in _COLUMNS:
            # A known field holding None stays in `d`: kept verbatim, it comes back as None.
            if key in d and d[key] is not None:
                known[key] = d.pop(key)
        if "logprobs" in known:
            exact = _exact_f32(known["logprobs"])
            if exact is not None:
                known["logprobs"] = exact
            else:
                # Not representable as float32: keep the original values verbatim.
                d["logprobs"] = known.pop("logprobs")
        for key in ("trace_id", "session_id"):
            if key not in known:
                raise InvalidInputError(f"invalid {key}: missing; every trace needs a {key} string")
        k = known.get
        self._append(
            k("trace_id"), k("session_id"), k("prompt_token_ids"), k("completion_token_ids"), k("logprobs"),
            k("session_uids"), k("timestamp"), k("model"), k("weight_version"), k("messages"),
            k("response_message"), k("metadata"), k("finish_reason"), k("latency_ms"), None, durable, d,
        )

    def flush(self) -> None:
        """Barrier: returns once everything appended before is durable at the
        store's level; raises the error that prevented it."""
        self._native.flush()

    def refresh(self) -> None:
        self._native.refresh()

    def seal(self, session_id: str) -> None:
        """Mark a session complete (all its calls are in)."""
        self._native.seal(session_id)

    def set_reward(self, value: float, *, trace_id: Optional[str] = None, session_id: Optional[str] = None) -> None:
        if (trace_id is None) == (session_id is None):
            raise InvalidInputError("invalid reward target: give exactly one of trace_id, session_id")
        if session_id is not None:
            self._native.set_reward("session", session_id, float(value))
        else:
            self._native.set_reward("trace", trace_id, float(value))

    def delete_session(self, session_id: str) -> int:
        return self._native.delete_session(session_id)

    def get(self, trace_id: str) -> Optional[Call]:
        return self._native.get_call(trace_id)

    def session(self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """A session's calls, oldest first (timestamp > since; at most limit)."""
        return self._native.session(session_id, since, limit)

    def session_arrow(self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None):
        """A session's calls as a `pyarrow.Table`, oldest first, imported
        through the Arrow C Data Interface without a copy.

        Columns: trace_id, session_id, timestamp, model, weight_version,
        finish_reason, relation, prompt_prefix_len, prompt_token_ids
        (list<uint32>), completion_token_ids (list<uint32>), logprobs
        (list<float32>, null when the call had none).

        The table has one chunk per call: the value buffers of
        `completion_token_ids`, `logprobs`, and `prompt_token_ids` when the
        prompt is stored whole, point into the mapped segment (a list column's
        values are contiguous, a session's calls are not). A prefix-delta
        prompt is materialized. The buffers keep the mapping alive, so the
        table stays valid after the store is closed. `table.combine_chunks()`
        makes contiguous copies.
        """
        import pyarrow as pa

        batches = [
            pa.record_batch(_CArray(pair)) for pair in self._native.session_arrow_capsules(session_id, since, limit)
        ]
        return pa.Table.from_batches(batches)

    def sessions(self, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """Sessions with counts and time range, by first call time; `since`
        keeps those with a call after it."""
        out = self._native.sessions()
        if since is not None:
            out = [s for s in out if s["last_trace_at"] > since]
        return out if limit is None else out[:limit]

    def import_rllm_sqlite(self, db, *, schema: Optional[str] = None, verify: bool = True) -> dict:
        """Migrate an rLLM SQLite trace database (the gateway's or the older
        SDK's schema; told apart automatically unless `schema` is "gateway" or
        "sdk") into this store, exactly; with `verify`, every imported trace is
        read back and compared with its row. Same as `trajlog
        import-rllm-sqlite DB --store DIR`."""
        return self._native.import_rllm_sqlite(str(db), schema, verify)

    def compact(self, *, older_than: Optional[float] = None) -> dict:
        """Compact sealed sessions (or those idle for `older_than` seconds)
        into Parquet shards under `<path>/shards/`."""
        return self._native.compact(older_than)

    def audit(self) -> dict:
        """The TI/TO audit (see `trajlog audit`)."""
        return json.loads(self._native.audit_json())

    def close(self) -> None:
        self._native.close()


class _CArray:
    """An exported (schema, array) capsule pair, offered to pyarrow through the
    Arrow PyCapsule protocol."""

    __slots__ = ("_pair",)

    def __init__(self, pair):
        self._pair = pair

    def __arrow_c_array__(self, requested_schema=None):
        return self._pair


def _call_to_dict(self: Call) -> dict:
    """The gateway-shaped trace dict with plain lists: token ids as ints,
    logprobs as the exact float32 values."""
    d = json.loads(self.to_json_without_tokens())
    d["prompt_token_ids"] = self.prompt_token_ids.tolist()
    d["completion_token_ids"] = self.completion_token_ids.tolist()
    lp = self.logprobs
    if lp is not None:
        d["logprobs"] = lp.astype(np.float64).tolist()
    return d

