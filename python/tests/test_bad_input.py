"""Issue 15, Python side: every accepted value reads back bit-equal, every
refused one raises a trajlog exception naming the field (and index) and
leaves nothing written, on every path (typed `Store.append`, trace dicts,
the rLLM gateway and SDK adapters); and a read sees every trace stored
before it, in every mode."""

import asyncio
import collections
import json
import struct

import numpy as np
import pytest

import trajlog
from trajlog.rllm import TrajlogSdkTraceStore, TrajlogTraceStore, TrajlogTracer


def f32_bits(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def f64_bits(values):
    return np.asarray(values, dtype=np.float64).view(np.uint64).tolist()


def nested(depth):
    """A JSON document whose containers nest `depth` deep."""
    doc = 1
    for _ in range(depth):
        doc = [doc]
    return doc


def base(**more):
    d = dict(trace_id="t", session_id="s", prompt_token_ids=[1, 2], completion_token_ids=[3, 4])
    d.update(more)
    return d


def assert_nothing_written(path, trace_ids=("t",)):
    """Nothing is visible now (after a barrier) nor after a reopen."""
    with trajlog.Store(path) as store:
        store.flush()
        for tid in trace_ids:
            assert store.get(tid) is None, tid
        assert store.sessions() == []


def refuse(path, exc, match, **kwargs):
    with trajlog.Store(path) as store:
        with pytest.raises(exc, match=match) as info:
            store.append(**kwargs)
        store.flush()
        assert store.get("t") is None and store.sessions() == []
    assert_nothing_written(path)
    return info.value


# ---------------------------------------------------------------------------
# The exception hierarchy
# ---------------------------------------------------------------------------


def test_exception_kinds_subclass_the_builtin_they_are():
    assert issubclass(trajlog.InvalidInputError, ValueError)
    assert issubclass(trajlog.LimitExceededError, trajlog.InvalidInputError)
    assert issubclass(trajlog.IOFailure, OSError)
    assert issubclass(trajlog.NotFoundError, LookupError)
    for name in ("IOFailure", "CorruptError", "IncompatibleError", "InvalidInputError", "LimitExceededError",
                 "LockedError", "ClosedError", "PoisonedError", "NotFoundError"):
        assert issubclass(getattr(trajlog, name), trajlog.TrajlogError), name


# ---------------------------------------------------------------------------
# Logprobs on the typed API: exactly float32, or refused
# ---------------------------------------------------------------------------


SPECIAL_F32 = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4028235e38, -0.5], dtype=np.float32)


@pytest.mark.parametrize("kind", ["float64-array", "python-floats", "float16-array", "int-list"])
def test_exact_float32_values_given_wider_are_accepted_bit_equal(tmp_path, kind):
    if kind == "float64-array":
        lp = SPECIAL_F32.astype(np.float64)
        want = SPECIAL_F32
    elif kind == "python-floats":
        lp = SPECIAL_F32.astype(np.float64).tolist()
        want = SPECIAL_F32
    elif kind == "float16-array":
        lp = np.array([-0.5, -1.25, 0.0, -0.0, np.inf, -np.inf, -65504.0, -6e-8], dtype=np.float16)
        want = lp.astype(np.float32)
    else:
        lp = [0, -1, -7, -16777216, 0, 0, -3, -2]
        want = np.array(lp, dtype=np.float32)
    n = len(want)
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(completion_token_ids=list(range(n)), logprobs=lp), durable=True)
        assert f32_bits(store.get("t").logprobs) == f32_bits(want)
    with trajlog.Store(tmp_path / "s", read_only=True) as ro:
        assert f32_bits(ro.get("t").logprobs) == f32_bits(want)


@pytest.mark.parametrize(
    "lp, index, value",
    [
        (np.array([-0.5, -0.25, -1.0, 0.1]), 3, "0.1"),  # a float64 array: was cast to float32 silently
        ([-0.5, -0.25, -1.0, 0.1], 3, "0.1"),  # Python floats
        ([-0.5, -1e39], 1, "-1e+39"),  # outside float32: was stored as -inf
        (np.array([-1e39, -0.5]), 0, "-1e+39"),
        ([-0.5, 1e-50], 1, "1e-50"),  # underflows to 0
        ([-0.5, 16777217], 1, "16777217"),  # an int float32 cannot hold exactly
    ],
)
def test_inexact_or_out_of_range_logprobs_are_refused_naming_the_index(tmp_path, lp, index, value):
    n = len(lp)
    err = refuse(tmp_path / "s", trajlog.InvalidInputError, rf"logprobs\[{index}\]",
                 **base(completion_token_ids=list(range(n)), logprobs=lp))
    assert value in str(err)
    assert "float32" in str(err)


def test_a_payload_nan_that_float32_cannot_hold_is_refused_and_plain_nan_is_kept(tmp_path):
    payload_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    refuse(tmp_path / "s", trajlog.InvalidInputError, r"logprobs\[1\]",
           **base(logprobs=[-0.5, payload_nan]))
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(logprobs=[float("nan"), float("-inf")]), durable=True)
        assert f32_bits(store.get("t").logprobs) == f32_bits(np.array([np.nan, -np.inf], dtype=np.float32))


@pytest.mark.parametrize("lp", [[True, -0.5], np.array([True, False]), ["-0.5", -0.5], [None, -0.5]])
def test_non_numbers_and_bools_are_not_logprobs(tmp_path, lp):
    refuse(tmp_path / "s", trajlog.InvalidInputError, r"logprobs\[0\]", **base(logprobs=lp))


@pytest.mark.parametrize("lp", [np.array([-0.5, -0.25, -1.0]), [-0.5], np.array([-0.5], dtype=np.float32)])
def test_a_logprob_length_mismatch_is_refused_for_any_input_kind(tmp_path, lp):
    refuse(tmp_path / "s", trajlog.InvalidInputError, "logprobs", **base(logprobs=lp))


# ---------------------------------------------------------------------------
# Token ids, session uids, timestamps, other fields
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, ids, index",
    [
        ("prompt_token_ids", [True], 0),
        ("prompt_token_ids", [1, 2, False], 2),
        ("completion_token_ids", (5, True), 1),
        ("prompt_token_ids", np.array([True, False]), 0),
        ("prompt_token_ids", [1, np.bool_(True)], 1),
        ("prompt_token_ids", [1, 2.0], 1),
        ("prompt_token_ids", [1, -1], 1),
        ("prompt_token_ids", [2**32], 0),
        ("prompt_token_ids", [2**70], 0),
        ("completion_token_ids", np.array([1.0, 2.0]), 0),
        ("prompt_token_ids", [1, "2"], 1),
    ],
)
def test_bad_token_ids_are_refused_naming_field_and_index(tmp_path, field, ids, index):
    kwargs = base(**{field: ids})
    if field == "completion_token_ids":
        kwargs["logprobs"] = None
    refuse(tmp_path / "s", trajlog.InvalidInputError, rf"{field}\[{index}\]", **kwargs)


def test_numpy_integer_scalars_and_every_u32_are_token_ids(tmp_path):
    ids = [np.uint32(0), np.int64(7), 2**32 - 1, np.uint64(2**32 - 1)]
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(prompt_token_ids=ids, completion_token_ids=(9, 10)), durable=True)
        call = store.get("t")
        assert call.prompt_token_ids.tolist() == [0, 7, 2**32 - 1, 2**32 - 1]
        assert call.completion_token_ids.tolist() == [9, 10]
        # Empty lists (an empty buffer may sit at any address) are fine too.
        store.append(**base(trace_id="e", prompt_token_ids=[], completion_token_ids=[], logprobs=[]), durable=True)
        assert store.get("e").prompt_token_ids.tolist() == []


def test_session_uids_must_be_a_list_of_strings(tmp_path):
    err = refuse(tmp_path / "s", trajlog.InvalidInputError, "session_uids", **base(session_uids="abc"))
    assert "list" in str(err)
    refuse(tmp_path / "s", trajlog.InvalidInputError, r"session_uids\[1\]", **base(session_uids=["a", 1]))
    refuse(tmp_path / "s", trajlog.InvalidInputError, r"session_uids\[0\]", **base(session_uids=["\ud800"]))
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(session_uids=("outer", "inner")), durable=True)
        assert store.get("t").session_uids == ["outer", "inner"]


@pytest.mark.parametrize("ts", [-1.0, -1e-300, float("inf"), float("nan"), 10**400, "1", True])
def test_timestamps_must_be_finite_and_not_negative(tmp_path, ts):
    refuse(tmp_path / "s", trajlog.InvalidInputError, "timestamp", **base(timestamp=ts))


def test_timestamp_zero_and_exact_values_are_kept(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        for i, ts in enumerate([0.0, 5e-324, 1795356919.1171234]):
            store.append(**base(trace_id=f"t{i}", timestamp=ts), durable=True)
            assert f64_bits([store.get(f"t{i}").timestamp]) == f64_bits([ts])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(weight_version=2**70), "weight_version"),
        (dict(weight_version=1.5), "weight_version"),
        (dict(model=5), "model"),
        (dict(model="m\ud800"), "model"),
        (dict(finish_reason=b"stop"), "finish_reason"),
        (dict(trace_id="t\udc80"), "trace_id"),
        (dict(session_id="s\ud83d"), "session_id"),
        (dict(latency_ms=10**400), "latency_ms"),
        (dict(latency_ms=-1.0), "latency_ms"),
        (dict(routing_matrices=5), "routing_matrices"),
        (dict(routing_matrices="abc"), "routing_matrices"),
        (dict(routing_matrices=[1, 300]), "routing_matrices"),
        (dict(messages={1, 2}), "messages"),
        (dict(metadata={"x": float("nan")}), "metadata"),
    ],
)
def test_bad_fields_raise_trajlog_errors_naming_the_field(tmp_path, kwargs, field):
    """Never a bare OverflowError / TypeError / UnicodeEncodeError."""
    err = refuse(tmp_path / "s", trajlog.InvalidInputError, field, **base(**kwargs))
    assert isinstance(err, ValueError)


def test_reads_and_annotations_with_bad_arguments_raise_trajlog_errors(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(), durable=True)
        for call, field in [
            (lambda: store.session("s", limit=-1), "limit"),
            (lambda: store.session("s", since="yesterday"), "since"),
            (lambda: store.session(5), "session_id"),
            (lambda: store.get("t\ud800"), "trace_id"),
            (lambda: store.set_reward("high", session_id="s"), "reward"),
            (lambda: store.set_reward(1.0, session_id=["s"]), "session_id"),
            (lambda: store.seal(None), "session_id"),
            (lambda: store.delete_session(b"s"), "session_id"),
            (lambda: store.compact(older_than=-5), "older_than"),
            (lambda: store.compact(collect_dead=1.5), "collect_dead"),
            (lambda: store.compact(collect_dead=float("nan")), "collect_dead"),
            (lambda: store.compact(merge_fanout=1), "merge_fanout"),
            (lambda: store.compact(merge_fanout=2.5), "merge_fanout"),
            (lambda: store.compact(merge_fanout=True), "merge_fanout"),
        ]:
            with pytest.raises(trajlog.InvalidInputError, match=field):
                call()
        assert len(store.session("s")) == 1
    with pytest.raises(trajlog.InvalidInputError, match="segment_bytes"):
        trajlog.Store(tmp_path / "s", segment_bytes=-1)
    with pytest.raises(trajlog.InvalidInputError, match="durability"):
        trajlog.Store(tmp_path / "s", durability="fast")


# ---------------------------------------------------------------------------
# Deeply nested documents
# ---------------------------------------------------------------------------


def test_nesting_up_to_the_limit_round_trips_and_deeper_is_refused_before_writing(tmp_path):
    limit = trajlog.JSON_DEPTH_MAX
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(trace_id="ok", messages=nested(limit), deep_extra=nested(limit)), durable=True)
        d = store.get("ok").to_dict()
        assert d["messages"] == nested(limit) and d["deep_extra"] == nested(limit)
    for kwargs, field in [
        (dict(messages=nested(limit + 1)), "messages"),
        (dict(response_message={"a": nested(limit)}), "response_message"),
        (dict(metadata=nested(5000)), "metadata"),  # was a bare RecursionError
        (dict(deep_extra=nested(limit + 1)), "deep_extra"),
        (dict(deep_extra=nested(100000)), "deep_extra"),
    ]:
        err = refuse(tmp_path / "d", trajlog.LimitExceededError, field, **base(**kwargs))
        assert "JSON_DEPTH_MAX" in str(err)


def test_a_deep_trace_dict_is_refused_on_every_dict_path(tmp_path):
    deep = nested(5000)
    with trajlog.Store(tmp_path / "s") as store:
        with pytest.raises(trajlog.LimitExceededError, match="raw_request"):
            store.append_trace({"trace_id": "t", "session_id": "s", "raw_request": deep})

    async def gateway():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        with pytest.raises(trajlog.LimitExceededError, match="messages"):
            await store.store_trace("t", "s", {"messages": deep})
        assert await store.get_session_traces("s") == []
        await store.close()

    asyncio.run(gateway())
    assert_nothing_written(tmp_path / "s")


def test_an_sdk_batch_with_one_bad_record_writes_none_of_it(tmp_path):
    """A deep (or otherwise invalid) record in `store_batch` used to fail
    after the records before it were written."""
    good = {"input": {"prompt_token_ids": [1, 2]}, "output": {"output_token_ids": [3], "rollout_logprobs": [-0.5]}}

    async def go(bad):
        store = TrajlogSdkTraceStore(str(tmp_path / "s"))
        records = [{"id": "a", "data": good}, {"id": "b", "data": bad}, {"id": "c", "data": good}]
        with pytest.raises(trajlog.InvalidInputError):
            await store.store_batch(records)
        assert await store.query() == []
        assert await store.get("a") is None
        await store.close()

    for bad in [{"x": nested(5000)}, {"x": nested(trajlog.JSON_DEPTH_MAX + 1)},
                {"output": {"output_token_ids": [3], "rollout_logprobs": [-0.5, -0.25]}},
                {"output": {"output_token_ids": [3], "rollout_logprobs": [1e39]}}]:
        asyncio.run(go(bad))
        assert_nothing_written(tmp_path / "s", ("a", "b", "c"))


def test_the_tracer_refuses_a_deep_trace_with_a_trajlog_error(tmp_path):
    tracer = TrajlogTracer(str(tmp_path / "s"))
    with pytest.raises(trajlog.LimitExceededError):
        tracer.log_llm_call("n", {"messages": nested(5000)}, {}, "m", 1.0, {}, session_uids=["u"])
    with pytest.raises(trajlog.InvalidInputError, match="data"):
        tracer.log_llm_call("n", {"x": {1, 2}}, {}, "m", 1.0, {}, session_uids=["u"])
    assert tracer.flush(10)
    tracer.close_sync()
    assert_nothing_written(tmp_path / "s", ())


# ---------------------------------------------------------------------------
# Trace dicts: the dict round-trips, the column is always filled
# ---------------------------------------------------------------------------


def gateway_trace(logprobs, completion=(7, 8)):
    return {
        "trace_id": "t",
        "session_id": "g:0",
        "timestamp": 5.0,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": list(completion),
        "logprobs": logprobs,
        "messages": [{"role": "user", "content": "hi"}],
        "token_counts": {"prompt": 3},
    }


def test_inexact_trace_logprobs_fill_the_column_with_the_nearest_float32(tmp_path):
    """The dict reads back equal (values kept verbatim), while Call.logprobs,
    Arrow and the Parquet shards carry the nearest float32 values, never 0.0."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.dataset as ds

    lp = [-0.1, -0.2]  # not float32 values
    want = np.array(lp, dtype=np.float32)
    trace = gateway_trace(lp)
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(trace, durable=True)
        call = store.get("t")
        assert call.to_dict() == trace
        assert f64_bits(call.to_dict()["logprobs"]) == f64_bits(lp)
        assert f32_bits(call.logprobs) == f32_bits(want)
        table = store.session_arrow("g:0")
        assert f32_bits(table.column("logprobs").to_pylist()[0]) == f32_bits(want)
        store.seal("g:0")
        store.compact()
        assert store.get("t").is_compacted
        assert store.get("t").to_dict() == trace
        assert f32_bits(store.get("t").logprobs) == f32_bits(want)
    trajs = ds.dataset(str(tmp_path / "s" / "shards" / "trajectories")).to_table().to_pylist()
    assert len(trajs) == 1
    row = trajs[0]
    assert row["token_ids"] == [1, 2, 3, 7, 8]
    assert f32_bits(row["logprobs"][3:]) == f32_bits(want)
    steps = ds.dataset(str(tmp_path / "s" / "shards" / "steps")).to_table().to_pylist()
    assert f32_bits(steps[0]["logprobs"]) == f32_bits(want)
    assert isinstance(pa.__version__, str)


def test_exact_trace_logprobs_are_stored_once_and_read_back_bit_equal(tmp_path):
    lp = [float(np.float32(-0.1)), -0.5, float("-inf")]
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(gateway_trace(lp, completion=(7, 8, 9)), durable=True)
        call = store.get("t")
        assert f64_bits(call.to_dict()["logprobs"]) == f64_bits(lp)
        # A float64 numpy array in a dict is accepted the same way.
        store.append_trace(dict(gateway_trace(np.array([-0.1, -0.5])), trace_id="u"), durable=True)
        u = store.get("u")
        assert f32_bits(u.logprobs) == f32_bits(np.array([-0.1, -0.5], dtype=np.float32))
        assert f64_bits(u.to_dict()["logprobs"]) == f64_bits([-0.1, -0.5])


@pytest.mark.parametrize(
    "lp, match",
    [
        ([-0.1, -0.2, -0.3], "logprobs"),  # inexact and too long: was kept verbatim, unchecked
        ([-0.5], "logprobs"),
        ([-0.5, -1e39], r"logprobs\[1\]"),
        ([-0.5, None], r"logprobs\[1\]"),
        ([True, -0.5], r"logprobs\[0\]"),
        (["x", -0.5], r"logprobs\[0\]"),
        ([float("nan"), -0.1], r"logprobs\[0\]"),  # NaN cannot be kept verbatim in JSON
    ],
)
def test_bad_trace_logprobs_are_refused_on_the_dict_paths(tmp_path, lp, match):
    with trajlog.Store(tmp_path / "s") as store:
        with pytest.raises(trajlog.InvalidInputError, match=match):
            store.append_trace(gateway_trace(lp))

    async def gateway():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        with pytest.raises(trajlog.InvalidInputError, match=match):
            await store.store_trace("t", "g:0", gateway_trace(lp))
        assert await store.get_trace("t") is None
        await store.close()

    asyncio.run(gateway())
    assert_nothing_written(tmp_path / "s")


def test_trace_dicts_with_bad_shapes_raise_trajlog_errors(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        for trace, match in [
            ([("trace_id", "t")], "trace"),
            ({"trace_id": "t", "session_id": "s", "session_uids": "abc"}, "session_uids"),
            ({"trace_id": "t", "session_id": "s", "prompt_token_ids": [1, True]}, r"prompt_token_ids\[1\]"),
            ({"trace_id": "t", "session_id": "s", "timestamp": -3.0}, "timestamp"),
            ({"trace_id": "t", "session_id": 7}, "session_id"),
        ]:
            with pytest.raises(trajlog.InvalidInputError, match=match):
                store.append_trace(trace)
    assert_nothing_written(tmp_path / "s")


def test_sdk_logprobs_fill_the_column_and_data_round_trips(tmp_path):
    lp = [-0.1, -0.2]
    data = {"input": {"prompt_token_ids": [1, 2]}, "output": {"output_token_ids": [3, 4], "rollout_logprobs": lp}}

    async def go():
        store = TrajlogSdkTraceStore(str(tmp_path / "s"))
        await store.store("tr", data, session_uids=["u"])
        got = await store.get("tr")
        assert got.data == data
        assert f64_bits(got.data["output"]["rollout_logprobs"]) == f64_bits(lp)
        await store.close()

    asyncio.run(go())
    with trajlog.Store(tmp_path / "s") as store:
        assert f32_bits(store.get("tr").logprobs) == f32_bits(np.array(lp, dtype=np.float32))


# ---------------------------------------------------------------------------
# Item 9: a read sees every trace stored before it, in every mode
# ---------------------------------------------------------------------------


class FireAndForgetProxy:
    """What rLLM's gateway does with `sync_traces=False`
    (rllm_model_gateway/proxy.py `_persist`): one task per trace, nobody
    waits for it; `stop()` drains them."""

    def __init__(self, store):
        self.store = store
        self.pending = set()

    def persist(self, trace_id, session_id, data):
        task = asyncio.create_task(self._safe_store(trace_id, session_id, data))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _safe_store(self, trace_id, session_id, data):
        await self.store.store_trace(trace_id, session_id, data)


def small_trace(session, i):
    return {
        "trace_id": f"{session}/{i}",
        "session_id": session,
        "timestamp": float(i),
        "prompt_token_ids": list(range(i + 3)),
        "completion_token_ids": [100 + i],
        "logprobs": [-0.5],
    }


def test_fire_and_forget_stores_are_seen_by_the_next_read(tmp_path):
    """rLLM's `sync_traces=False`: the last trace of a session was missing
    from a read issued right after it was handed over (3 of 32 sessions)."""

    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        proxy = FireAndForgetProxy(store)
        for s in range(32):
            session = f"task-{s}"
            for i in range(4):
                proxy.persist(f"{session}/{i}", session, small_trace(session, i))
            # The read comes at once, with no flush and without yielding first.
            got = await store.get_session_traces(session)
            assert [t["trace_id"] for t in got] == [f"{session}/{i}" for i in range(4)], session
            assert got[-1] == small_trace(session, 3)
        proxy.persist("late/0", "late", small_trace("late", 0))
        assert await store.get_trace("late/0") == small_trace("late", 0)
        proxy.persist("late/1", "late", small_trace("late", 1))
        sessions = {s["session_id"]: s["trace_count"] for s in await store.list_sessions()}
        assert sessions["late"] == 2 and len(sessions) == 33
        proxy.persist("late/2", "late", small_trace("late", 2))
        assert await store.delete_session("late") == 3  # the delete covers a store called before it
        assert await store.get_session_traces("late") == []
        await asyncio.gather(*proxy.pending)
        await store.close()

    asyncio.run(go())
    with trajlog.Store(tmp_path / "s") as store:
        assert len(store.sessions()) == 32
        assert store.get("late/2") is None


def test_a_failed_fire_and_forget_store_does_not_block_reads(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        task = asyncio.create_task(store.store_trace("bad", "s", {"prompt_token_ids": [True]}))
        good = asyncio.create_task(store.store_trace("good", "s", small_trace("s", 0)))
        assert [t["trace_id"] for t in await store.get_session_traces("s")] == ["good"]
        with pytest.raises(trajlog.InvalidInputError, match=r"prompt_token_ids\[0\]"):
            await task
        await good
        await store.close()

    asyncio.run(go())


def test_sdk_reads_see_what_the_tracer_logged_without_a_flush(tmp_path):
    tracer = TrajlogTracer(str(tmp_path / "s"))
    for i in range(3):
        tracer.log_llm_call("n", {"messages": [{"role": "user", "content": str(i)}]}, {"id": f"o{i}"}, "m", 1.0, {},
                            trace_id=f"tr{i}", session_uids=["outer", "inner"])

    async def read():
        got = await tracer.store.get_by_session_uid("inner")
        assert sorted(c.id for c in got) == ["tr0", "tr1", "tr2"]
        assert (await tracer.store.get("tr2")).data["input"] == {"messages": [{"role": "user", "content": "2"}]}

    asyncio.run(read())
    tracer.close_sync()


# ---------------------------------------------------------------------------
# Store.append's documents: serialized natively, json.dumps's rules kept
# ---------------------------------------------------------------------------


def test_append_documents_read_back_equal_and_json_dumps_rules_still_hold(tmp_path):
    docs = dict(
        messages=[{"role": "user", "content": "héllo ✓ \u2028 \"q\" \\ \n\x01", "n": 1e-7, "big": 2**70,
                   "t": (1, 2.5), "f": [0.1, -0.0, 1e300, 5e-324]}],
        response_message={"a": True, "b": None, "s": ""},
        metadata={"x": 1.5, "nested": nested(trajlog.JSON_DEPTH_MAX - 1)},
        raw_request={"k": [1.0, -2], "deep": nested(trajlog.JSON_DEPTH_MAX - 1)},
        deep_extra=nested(trajlog.JSON_DEPTH_MAX),
        empty_extra={},
    )
    with trajlog.Store(tmp_path / "s") as store:
        store.append(**base(trace_id="n", **docs), durable=True)
        # Keys json.dumps turns into strings are still accepted (through its
        # text), as they were before the native writer.
        store.append(**base(trace_id="k", metadata={1: "a", None: "b", False: "c", 2.5: "d"}), durable=True)
        # A dict subclass is written in its own order, as json.dumps does.
        ordered = collections.OrderedDict([("a", 1), ("b", 2)])
        ordered.move_to_end("a")
        store.append(**base(trace_id="o", metadata=ordered), durable=True)
    with trajlog.Store(tmp_path / "s") as store:
        d = store.get("n").to_dict()
        for k, v in docs.items():
            assert d[k] == json.loads(json.dumps(v)), k
        assert f64_bits(d["messages"][0]["f"]) == f64_bits([0.1, -0.0, 1e300, 5e-324])
        assert store.get("k").to_dict()["metadata"] == {"1": "a", "null": "b", "false": "c", "2.5": "d"}
        assert list(store.get("o").to_dict()["metadata"]) == ["b", "a"]
    for kwargs, field in [
        (dict(messages=[{"x": float("nan")}]), "messages"),
        (dict(response_message={"x": float("inf")}), "response_message"),
        (dict(metadata={"x": {1, 2}}), "metadata"),
        (dict(weird_extra={1, 2}), "weird_extra"),
        (dict(messages=[{"x": object()}]), "messages"),
        (dict(messages=[10**5000]), "messages"),  # int.__repr__'s digit limit
    ]:
        refuse(tmp_path / "r", trajlog.InvalidInputError, field, **base(**kwargs))
