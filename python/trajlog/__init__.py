"""trajlog: an exact, append-only trace store for RL training of LLM agents.

    import trajlog
    with trajlog.Store("traces") as store:
        store.append(trace_id="t1", session_id="task:0",
                     prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                     logprobs=np.array([-0.1, -0.2], dtype=np.float32))
        store.flush()
        call = store.get("t1")
        call.completion_token_ids   # numpy uint32 view into the mapped segment

Token ids and logprobs come back bit for bit. `Call.completion_token_ids` and
`Call.logprobs` are always zero-copy views (read-only numpy arrays whose base
keeps the mapping alive, even after the store is closed); `Call.prompt_token_ids`
is a view when the prompt is stored whole (a session's first call, or a
compacted call) and otherwise materialized from the prefix-delta chain
(`Call.prompt_is_view` tells which; `Call.prompt_suffix` is always a view).

Bad input is refused before anything is written, with a trajlog exception
(`InvalidInputError` is a `ValueError`, `LimitExceededError` one of those)
whose message names the field and index: token ids must be ints in
0..=4294967295 (never bools); `Store.append` logprobs must be float32 values
(a float32 array, or floats exactly representable as float32); session uids
a list of str; timestamps finite and >= 0; JSON documents at most
`JSON_DEPTH_MAX` containers deep.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Iterable, Optional

import numpy as np

from . import _trajlog as _native
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
    StorageFullError,
    TrajlogError,
)

__all__ = [
    "Store",
    "Call",
    "errors",
    "TrajlogError",
    "IOFailure",
    "StorageFullError",
    "CorruptError",
    "IncompatibleError",
    "InvalidInputError",
    "LimitExceededError",
    "LockedError",
    "ClosedError",
    "PoisonedError",
    "NotFoundError",
    "JSON_DEPTH_MAX",
]

# How deeply the containers (lists, dicts) of one JSON document given to
# trajlog may nest: `messages`, `response_message`, `metadata`, each extra
# field of a call, an SDK record's `data` and `metadata`. Deeper documents are
# refused with LimitExceededError before anything is written (Python's own
# JSON codec gives up near 1000 levels, and a document must read back too).
JSON_DEPTH_MAX = 128

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U32_MAX = 0xFFFFFFFF
_EMPTY_U32 = np.empty(0, dtype=np.uint32)


def _text(field: str, value: Any) -> str:
    """A str that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(value, str):
        raise InvalidInputError(f"invalid {field}: {value!r} is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"invalid {field}: not valid UTF-8 text (a lone surrogate {value[e.start]!r} at position {e.start}); "
            "pass text without unpaired surrogates"
        ) from None
    return value


def _optional_text(field: str, value: Any) -> Optional[str]:
    return None if value is None else _text(field, value)


def _session_uids(values: Any) -> list:
    if values is None:
        return []
    if not isinstance(values, (list, tuple)):
        raise InvalidInputError(f"invalid session_uids: {values!r} is not a list of strings; pass e.g. [\"outer\", \"inner\"]")
    return [_text(f"session_uids[{i}]", v) for i, v in enumerate(values)]


def _as_array(field: str, values: Any) -> Any:
    """A numpy array of a numpy array, array.array or other buffer; a list
    of any other iterable (its elements are checked one by one)."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, (str, dict, set, frozenset)):
        raise InvalidInputError(f"invalid {field}: a {type(values).__name__} is not a sequence of numbers")
    try:
        return np.asarray(memoryview(values))
    except TypeError:
        pass
    try:
        return list(values)
    except TypeError:
        raise InvalidInputError(f"invalid {field}: {values!r} is not a sequence of numbers") from None


def _one_dimensional(field: str, arr: np.ndarray) -> None:
    if arr.ndim != 1:
        raise InvalidInputError(f"invalid {field}: must be one-dimensional, got shape {arr.shape}")


def _token_ids(field: str, values: Any) -> np.ndarray:
    """Token ids (a list, tuple, numpy array, array.array or buffer) as a
    contiguous, aligned uint32 array. Each must be an int in 0..=u32::MAX;
    a bool, a float or anything else is refused naming `field[index]`."""
    if values is None:
        return _EMPTY_U32
    if isinstance(values, (list, tuple)):
        return _native.u32_array(field, values)
    arr = _as_array(field, values)
    if isinstance(arr, list):
        return _native.u32_array(field, arr)
    _one_dimensional(field, arr)
    if arr.size == 0:
        return _EMPTY_U32
    if arr.dtype.kind not in "iu":
        # Bools, floats, objects: the element check names the first bad one.
        return _native.u32_array(field, arr.tolist())
    if arr.dtype != np.uint32:
        bad = (arr < 0) | (arr > _U32_MAX)
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidInputError(f"invalid {field}[{i}]: {arr[i]} is not a token id (an integer in 0..=4294967295)")
    return np.require(arr, dtype=np.uint32, requirements=["C", "A"])


def _f32_of_array(field: str, arr: np.ndarray, exact: bool):
    """(float32 array, every value exactly a float32) for a numpy array; see
    `_logprobs`."""
    _one_dimensional(field, arr)
    if arr.dtype.kind == "f" and arr.dtype.itemsize <= 4:
        # float16 and float32 (any byte order) widen exactly.
        return np.require(arr, dtype=np.float32, requirements=["C", "A"]), True
    if arr.dtype.kind != "f" or arr.dtype.itemsize != 8:
        # Ints, bools, objects, long doubles: element by element.
        return _native.f32_array(field, arr.tolist(), exact)
    wide = np.require(arr, dtype=np.float64, requirements=["C", "A"])
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32)
    inexact = narrow.astype(np.float64).view(np.uint64) != wide.view(np.uint64)
    if not inexact.any():
        return narrow, True
    if exact or (np.isfinite(wide) & ~np.isfinite(narrow)).any():
        # The element check raises, naming the first value refused.
        return _native.f32_array(field, wide.tolist(), exact)
    return narrow, False


def _logprobs(values: Any) -> Optional[np.ndarray]:
    """Logprobs as a contiguous float32 array. Each value must be exactly
    representable as a float32 (float32 arrays always are; float64 arrays
    and Python floats are checked, bit for bit): anything else — an inexact
    value, one outside the float32 range, a bool, a non-number — is refused
    naming `logprobs[index]`, so what reads back is what was given."""
    if values is None:
        return None
    if isinstance(values, (list, tuple)):
        return _native.f32_array("logprobs", values, True)[0]
    arr = _as_array("logprobs", values)
    if isinstance(arr, list):
        return _native.f32_array("logprobs", arr, True)[0]
    return _f32_of_array("logprobs", arr, True)[0]


def _trace_logprobs(values: Any):
    """Logprobs of a trace dict: (float32 array for the column, the values
    to keep verbatim or None). Values that are not all float32 go to the
    column as the nearest float32 and are also kept as given, so the dict
    reads back equal; values beyond the float32 range, bools and
    non-numbers are refused naming `logprobs[index]`."""
    if isinstance(values, (list, tuple)):
        column, exact = _native.f32_array("logprobs", values, False)
        given = values
    else:
        arr = _as_array("logprobs", values)
        if isinstance(arr, list):
            column, exact = _native.f32_array("logprobs", arr, False)
        else:
            column, exact = _f32_of_array("logprobs", arr, False)
        given = arr if isinstance(arr, list) else arr.tolist()
    if exact:
        return column, None
    verbatim = [v if isinstance(v, (int, float)) else float(v) for v in given]
    for i, v in enumerate(verbatim):
        if not math.isfinite(v):
            raise InvalidInputError(
                f"invalid logprobs[{i}]: {v!r} cannot be kept verbatim beside values that are not float32 "
                "(JSON has no NaN or Infinity); pass float32 values"
            )
    return column, verbatim


def _depth_error(field: str, depth: Optional[int]) -> LimitExceededError:
    how = "nested too deeply" if depth is None else f"nested {depth} containers deep"
    return LimitExceededError(
        f"invalid {field}: {how}, over JSON_DEPTH_MAX ({JSON_DEPTH_MAX} nested lists/dicts); flatten the document"
    )


def _json_text(field: str, value: Any, *, allow_nan: bool = False) -> Optional[str]:
    """The JSON text of a document, refused (naming `field`) when it is not
    JSON-serializable or nests deeper than JSON_DEPTH_MAX."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=allow_nan, separators=(",", ":"))
    except RecursionError:
        raise _depth_error(field, None) from None
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"invalid {field}: not JSON-serializable ({e})") from None
    depth = _native.json_depth(text)
    if depth > JSON_DEPTH_MAX:
        raise _depth_error(field, depth)
    return text


def _extra_text(extra: dict) -> Optional[str]:
    """The JSON object of a call's extra fields; a refusal names the key."""
    if not extra:
        return None
    try:
        text = json.dumps(extra, allow_nan=False, separators=(",", ":"))
        depth = _native.json_depth(text) - 1  # the object around the fields
    except (RecursionError, TypeError, ValueError):
        text, depth = None, None
    if text is None or depth > JSON_DEPTH_MAX:
        for key, value in extra.items():
            _json_text(str(key), value)
        raise InvalidInputError("invalid extra fields: not JSON-serializable")
    return text


def _since(value: Any) -> Optional[float]:
    return None if value is None else _number("since", value)


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"invalid {field}: {value!r} is not a number")
    try:
        return float(value)
    except OverflowError:
        raise InvalidInputError(f"invalid {field}: {value!r} is too large for a float") from None


def _finite(field: str, value: Any, *, non_negative: bool = False) -> Optional[float]:
    if value is None:
        return None
    v = _number(field, value)
    if not math.isfinite(v) or (non_negative and v < 0):
        kind = "a finite, non-negative number" if non_negative else "a finite number"
        raise InvalidInputError(f"invalid {field}: {value!r} is not {kind}")
    return v


def _count(field: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > _I64_MAX:
        raise InvalidInputError(f"invalid {field}: {value!r} is not a non-negative integer")
    return value


def _routing(value: Any) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, (bool, int, str)):
        raise InvalidInputError(f"invalid routing_matrices: a {type(value).__name__} is not bytes; pass bytes or a buffer")
    try:
        return bytes(value)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"invalid routing_matrices: {e}; pass bytes or a buffer") from None


class Store:
    """An open trajlog store directory. Safe to share between threads; the GIL
    is released while the store waits on I/O.

    `durability` is "buffered", "group" (the default) or "sync"; see the
    README. `read_only=True` opens without the writer lock (another process may
    be writing); `refresh()` then shows what it flushed since. `recovery` is
    what the open does about damage in the log: "tolerate-torn-tail" (the
    default: an interrupted write at the end is cut, damage refuses the open),
    "absolute" (anything `trajlog verify` would report refuses it) or
    "skip-corrupted" (damaged records are left out, every valid one kept);
    `recovery_report()` lists what it cut or skipped. `zero_ahead_bytes`
    (default 1 MiB) is how far past the last record the writer keeps the
    active segment's blocks written with zeros after each fsync, so that a
    durable append's fdatasync writes data alone; 0 turns it off (for
    copy-on-write file systems such as btrfs or ZFS).
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
        recovery: str = "tolerate-torn-tail",
        queue_bytes: Optional[int] = None,
        zero_ahead_bytes: Optional[int] = None,
    ):
        self.path = str(path)
        if not isinstance(recovery, str):
            raise InvalidInputError(
                f"invalid recovery: {recovery!r} is not one of \"tolerate-torn-tail\", \"absolute\", \"skip-corrupted\""
            )
        if not isinstance(durability, str):
            raise InvalidInputError(f"invalid durability: {durability!r} is not one of \"buffered\", \"group\", \"sync\"")
        self._native = NativeStore(
            self.path,
            durability=durability,
            read_only=bool(read_only),
            segment_bytes=_count("segment_bytes", segment_bytes),
            group_commit_ms=_count("group_commit_ms", group_commit_ms),
            queue_depth=_count("queue_depth", queue_depth),
            recovery=recovery,
            queue_bytes=_count("queue_bytes", queue_bytes),
            zero_ahead_bytes=_count("zero_ahead_bytes", zero_ahead_bytes),
        )

    def recovery_report(self) -> list:
        """What opening did about damage: one line per torn tail cut, damaged
        region skipped or footer rebuilt; empty for an intact store."""
        return self._native.recovery_report()

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
        # Every field is converted and checked here, before the call is handed
        # to the store: a refusal writes nothing.
        if weight_version is not None and (
            isinstance(weight_version, bool) or not isinstance(weight_version, int)
            or not _I64_MIN <= weight_version <= _I64_MAX
        ):
            raise InvalidInputError(f"invalid weight_version: {weight_version!r} is not an integer in the int64 range")
        args = (
            _text("trace_id", trace_id),
            _text("session_id", session_id),
            _token_ids("prompt_token_ids", prompt_token_ids),
            _token_ids("completion_token_ids", completion_token_ids),
            _logprobs(logprobs),
            _session_uids(session_uids),
            time.time() if timestamp is None else _finite("timestamp", timestamp, non_negative=True),
            _optional_text("model", model),
            weight_version,
            _optional_text("finish_reason", finish_reason),
            _finite("latency_ms", latency_ms, non_negative=True),
        )
        tail = (_routing(routing_matrices), bool(durable))
        try:
            try:
                # The documents are serialized by the native writer (the one
                # `append_trace` uses): no JSON text is made in Python.
                self._native.append(*args, messages, response_message, metadata, extra, *tail, False)
            except ValueError:  # InvalidInputError is one, and so is int.__repr__'s digit limit
                # Refused before anything was written. `json.dumps` takes a
                # little more (keys that are numbers, booleans or None become
                # strings) and words other refusals its own way: the documents
                # go again as its texts, which succeeds or raises its error.
                texts = (
                    _json_text("messages", messages),
                    _json_text("response_message", response_message),
                    _json_text("metadata", metadata),
                    _extra_text(extra),
                )
                self._native.append(*args, *texts, *tail, True)
        except (TypeError, OverflowError, UnicodeError) as e:  # a guard: the checks above should catch these
            raise InvalidInputError(f"invalid call: {e}") from e

    def append_trace(self, trace: dict, *, durable: bool = False) -> None:
        """Append a whole gateway-shaped trace dict (`trace_id`, `session_id`,
        `prompt_token_ids`, `completion_token_ids`, `logprobs`, `messages`, …).
        The dict is walked by the native code, the mapping `trajlog ingest`
        and the gateway use too: token lists go straight into the columns and
        every document (`messages`, `response_message`, `metadata`,
        `routing_matrices`, each key without a column) is serialized to JSON
        once. `Call.to_dict()` gives the same dict back. Logprobs always go
        to the float32 column (and their length must match the completion's);
        values that are not all floats exactly representable as float32 (an
        inexact float, an int) are stored there as the nearest float32 and
        also kept as given, so the dict still reads back equal.

        Refused, naming the path inside the trace (e.g.
        `raw_response.choices[0].logprobs.content[17].logprob`), with nothing
        written: NaN or infinite floats in a document, non-string dict keys,
        values JSON has no type for (sets, bytes, objects), documents nested
        deeper than `JSON_DEPTH_MAX`, bad token ids or logprobs."""
        self._walk_trace(lambda t: self._native.append_trace(t, bool(durable)), trace)

    def _append_trace_nowait(self, trace: dict, waker):
        """`append_trace` for an event loop: walks the dict here and hands
        the call to the store's encoder thread; never waits. Returns a
        native `Pending`: poll it after `waker` (from
        `_native.durable_waker()`) wakes the loop; it raises what refused
        the call, if anything did."""
        return self._walk_trace(lambda t: self._native.append_trace_nowait(t, waker), trace)

    @staticmethod
    def _walk_trace(append, trace):
        if not isinstance(trace, dict):
            try:
                trace = dict(trace)
            except (TypeError, ValueError):
                raise InvalidInputError(f"invalid trace: a {type(trace).__name__} is not a dict") from None
        try:
            return append(trace)
        except (TypeError, OverflowError, UnicodeError) as e:  # a guard: the walker names what it refuses
            raise InvalidInputError(f"invalid trace: {e}") from e

    def poisoned(self) -> Optional[str]:
        """Why the store refuses every write, after a failed write or fsync
        (a full disk, an I/O error) poisoned it; None while it takes writes.
        A poisoned store recovers by being closed and opened again (which
        cuts the failed write off; free space first after a full disk)."""
        return self._native.poisoned()

    def flush(self) -> None:
        """Barrier: returns once everything appended before is durable at the
        store's level; raises the error that prevented it."""
        self._native.flush()

    def refresh(self) -> None:
        """Read-only stores: see what the writer flushed since the open or the
        last refresh. After appends only, it replays just the new records
        (O(what was appended)); after a compaction it loads the store again.
        A no-op on a writable store."""
        self._native.refresh()

    def seal(self, session_id: str) -> None:
        """Mark a session complete (all its calls are in)."""
        self._native.seal(_text("session_id", session_id))

    def set_reward(self, value: float, *, trace_id: Optional[str] = None, session_id: Optional[str] = None) -> None:
        """Set the reward of a trace's live call or of a session (last one wins); durable on return.

        A ``trace_id`` with no live call (never appended, or deleted with its
        session) raises ``NotFoundError`` and writes nothing; a session reward
        needs no call.
        """
        if (trace_id is None) == (session_id is None):
            raise InvalidInputError("invalid reward target: give exactly one of trace_id, session_id")
        reward = _number("reward", value)
        if session_id is not None:
            self._native.set_reward("session", _text("session_id", session_id), reward)
        else:
            self._native.set_reward("trace", _text("trace_id", trace_id), reward)

    def delete_session(self, session_id: str) -> int:
        return self._native.delete_session(_text("session_id", session_id))

    def get(self, trace_id: str) -> Optional[Call]:
        return self._native.get_call(_text("trace_id", trace_id))

    def session(self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """A session's calls, oldest first (timestamp > since; at most limit)."""
        return self._native.session(_text("session_id", session_id), _since(since), _count("limit", limit))

    def session_dicts(self, session_id: str, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """A session's calls as gateway-shaped trace dicts (each what
        `Call.to_dict()` gives), oldest first; each prompt is rebuilt from the
        call before it, so a whole session reads in O(its tokens)."""
        return self._native.session_dicts(_text("session_id", session_id), _since(since), _count("limit", limit))

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

        pairs = self._native.session_arrow_capsules(_text("session_id", session_id), _since(since), _count("limit", limit))
        batches = [pa.record_batch(_CArray(pair)) for pair in pairs]
        return pa.Table.from_batches(batches)

    def sessions(self, since: Optional[float] = None, limit: Optional[int] = None) -> list:
        """Sessions with counts and time range, by first call time; `since`
        keeps those with a call after it."""
        since, limit = _since(since), _count("limit", limit)
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
        if schema is not None and not isinstance(schema, str):
            raise InvalidInputError(f"invalid schema: {schema!r} is not \"gateway\" or \"sdk\"")
        return self._native.import_rllm_sqlite(str(db), schema, bool(verify))

    def compact(
        self,
        *,
        older_than: Optional[float] = None,
        collect_dead: Optional[float] = 0.2,
        merge_fanout: Optional[int] = 8,
        max_calls: Optional[int] = None,
        copy_forward: Optional[float] = 0.25,
        batch_calls: Optional[int] = 2**20,
    ) -> dict:
        """Compact sealed sessions (or those idle for `older_than` seconds)
        into Parquet shards under `<path>/shards/`.

        `max_calls` limits one compaction to about that many calls: whole
        sessions, oldest first (one larger than the limit goes alone); the
        result's `sessions_left` says how many selected sessions are left
        for the next call.

        A compaction publishes its shards in steps of at most about
        `batch_calls` calls (new ones and those collection and merging write
        again, together; default 2**20), one after another until every
        session selected when it began is compacted: what a publication
        builds grows with its calls (about 0.3 KB each), so a large backlog
        is not built at once, at the cost of time (each step rewrites the
        shard index file). A backlog under it is one publication. `None`:
        one publication whatever the backlog, in which collection and
        merging write at most 2**20 calls again. The result's
        `publications` says how many were made.

        Earlier compactions whose rows are at least `collect_dead` dead
        (deleted or replaced calls; any with no live row left) are rewritten
        with their live rows only, freeing their space; `None` never
        rewrites. Once `merge_fanout` earlier compactions are in one size
        tier they are written again together (`None`: never), so the number
        of shard files stays logarithmic in the rows. Shard files can be
        replaced by either: list them again (a directory glob) after a
        compaction. Each compaction also rewrites `<path>/shards/_deleted.parquet`,
        the rows of the files whose calls were deleted or replaced since their
        compaction (`trajlog.data.TrajectoryDataset` leaves them out).

        A segment kept on disk only by unfinished sessions (stragglers)
        whose live calls there take at most `copy_forward` of its bytes has
        those sessions copied forward (their calls appended again, exactly),
        so that it is freed; `None` never copies. The result's
        `copied_sessions`, `copied_calls` and `copied_bytes` say what was."""
        if collect_dead is not None:
            collect_dead = _finite("collect_dead", collect_dead, non_negative=True)
            if collect_dead > 1:
                raise InvalidInputError(f"invalid collect_dead: {collect_dead!r} is not a fraction between 0 and 1")
        if merge_fanout is not None:
            if isinstance(merge_fanout, bool) or not isinstance(merge_fanout, int):
                raise InvalidInputError(f"invalid merge_fanout: {merge_fanout!r} is not an integer")
            if not 2 <= merge_fanout <= 2**32 - 1:
                raise InvalidInputError(f"invalid merge_fanout: {merge_fanout!r} is not between 2 and 4294967295")
        if copy_forward is not None:
            copy_forward = _finite("copy_forward", copy_forward, non_negative=True)
            if copy_forward > 0.5:
                raise InvalidInputError(f"invalid copy_forward: {copy_forward!r} is not a fraction between 0 and 0.5")
        for name, value in (("max_calls", max_calls), ("batch_calls", batch_calls)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidInputError(f"invalid {name}: {value!r} is not an integer")
                if not 1 <= value <= 2**64 - 1:
                    raise InvalidInputError(f"invalid {name}: {value!r} is not between 1 and 18446744073709551615")
        return self._native.compact(
            _finite("older_than", older_than, non_negative=True),
            collect_dead,
            merge_fanout,
            max_calls,
            copy_forward,
            batch_calls,
        )

    def audit(self) -> dict:
        """The TI/TO audit (see `trajlog audit`)."""
        return json.loads(self._native.audit_json())

    def space(self) -> dict:
        """Where the store's bytes are and what keeps them (see `trajlog
        space`): `segments` (per segment: `live_bytes`/`live_calls` still
        served from it, `compacted_bytes`, `dead_bytes`, `annotation_bytes`,
        and `kept_by`, the sessions whose live calls keep it, with `sealed`),
        `shards` (per `steps` file: `rows`, `live_rows`, `file_bytes`), and
        the totals `segment_bytes`, `shard_bytes`, `live_bytes` and
        `disk_over_live` (segments and `steps` shards over the live data);
        `other`: the directory's other files (`trajectories_bytes`,
        `index_file_bytes`: the shard index file, its annotation cache and
        the backlog index file with its delta,
        `other_bytes`), and `total_bytes` /
        `total_over_live` for everything in the directory; `index`:
        `live_calls`, and how many of them the index holds in its frozen
        layer (`frozen_calls`, `frozen_bytes`: compacted sessions untouched
        since the store was opened) and `index_file_bytes`, the size of the
        shard index file the open mapped (0: none, the shards were decoded;
        format-spec/shard-index.md), and `cached_annotation_segments`, the
        segments whose seals and rewards the open took from the annotation
        cache (shard-index.md §7), and `backlog_segments`, the sealed
        segments whose footers and cold layer the open took from the
        backlog index file and its delta (format-spec/backlog-index.md),
        `cold_calls` and `cold_layers`: the calls in the cold layers and
        how many layers hold them."""
        return json.loads(self._native.space_json())

    def close(self) -> None:
        """Flush and close. When other threads are inside calls on the store
        (a read), it is closed when the last of them returns, and the
        directory stays locked until then: see `wait_closed`."""
        self._native.close()

    def wait_closed(self, timeout: Optional[float] = None) -> bool:
        """Wait until the store is closed (by `close`, in this thread or
        another) and the calls other threads were making on it have
        returned, so that the directory can be opened again (`timeout` in
        seconds; None waits as long as it takes). Whether it is; False on a
        timeout."""
        return self._native.wait_closed(None if timeout is None else float(timeout))


class _CArray:
    """An exported (schema, array) capsule pair, offered to pyarrow through the
    Arrow PyCapsule protocol."""

    __slots__ = ("_pair",)

    def __init__(self, pair):
        self._pair = pair

    def __arrow_c_array__(self, requested_schema=None):
        return self._pair

