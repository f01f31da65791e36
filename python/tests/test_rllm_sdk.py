"""The older rLLM SDK interface (store/store_batch/get/query/get_by_session_uid/
get_session_uids_for_trace) and its tracer, on trajlog."""

import asyncio

import numpy as np
import pytest

import trajlog
from trajlog.rllm import TrajlogSdkTraceStore, TrajlogTracer


def sdk_trace(i, prompt, completion, logprobs):
    """A trace as rLLM SDK's `Trace.model_dump()` writes it."""
    return {
        "trace_id": f"tr_{i}",
        "session_name": "task:0:0",
        "name": "proxy/m",
        "input": {"messages": [{"role": "user", "content": f"turn {i} ✓"}], "prompt_token_ids": prompt},
        "output": {
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
            "output_token_ids": completion,
            "rollout_logprobs": logprobs,
        },
        "model": "m",
        "latency_ms": 12.5,
        "tokens": {"prompt": len(prompt), "completion": len(completion), "total": len(prompt) + len(completion)},
        "metadata": {"session_name": "task:0:0"},
        "timestamp": 1700000000.0 + i,
        "parent_trace_id": None,
    }


def f32_list(n, seed):
    rng = np.random.default_rng(seed)
    return [float(x) for x in (-rng.random(n, dtype=np.float32) * 5)]


def run(coro):
    return asyncio.run(coro)


def test_store_get_round_trips_data_exactly_and_fills_columns(tmp_path):
    store = TrajlogSdkTraceStore(str(tmp_path / "s"))
    prompt, completion = list(range(100, 400)), [7, 8, 9]
    lp = f32_list(3, 1)
    data = sdk_trace(0, prompt, completion, lp)

    async def go():
        await store.store("tr_0", data, namespace="ns", metadata={"job": "j"}, session_uids=["outer", "inner"])
        got = await store.get("tr_0")
        missing = await store.get("nope")
        uids = await store.get_session_uids_for_trace("tr_0")
        return got, missing, uids

    got, missing, uids = run(go())
    assert missing is None
    assert got.id == "tr_0" and got.data == data
    assert got.namespace == "ns" and got.type == "llm_trace" and got.metadata == {"job": "j"}
    assert uids == ["outer", "inner"]
    call = store._get().get("tr_0")
    assert call.prompt_token_ids.tolist() == prompt, "prompt ids are in the typed column"
    assert call.completion_token_ids.tolist() == completion
    assert call.logprobs.astype(np.float64).tolist() == lp
    assert call.session_id == "inner"
    run(store.close())


def test_upsert_keeps_created_at_and_nested_sessions_query_newest_first(tmp_path):
    store = TrajlogSdkTraceStore(str(tmp_path / "s"))

    async def go():
        for i in range(5):
            uids = ["outer", "inner-a"] if i < 3 else ["outer", "inner-b"]
            await store.store(f"tr_{i}", sdk_trace(i, [1, 2], [3], [-0.5]), session_uids=uids)
            await asyncio.sleep(0.002)
        first = await store.get("tr_0")
        await asyncio.sleep(0.002)
        await store.store("tr_0", {"replaced": True}, session_uids=["outer", "inner-a"])
        again = await store.get("tr_0")
        outer = await store.get_by_session_uid("outer")
        inner_a = await store.get_by_session_uid("inner-a")
        limited = await store.get_by_session_uid("outer", limit=2)
        since = await store.get_by_session_uid("outer", since=outer[1].created_at)
        q = await store.query(session_uids=["inner-a", "inner-b"])
        q_all = await store.query()
        q_ns = await store.query(namespaces=["other"])
        return first, again, outer, inner_a, limited, since, q, q_all, q_ns

    first, again, outer, inner_a, limited, since, q, q_all, q_ns = run(go())
    assert again.data == {"replaced": True}
    assert again.created_at == first.created_at, "created_at survives an upsert"
    assert again.updated_at > first.updated_at
    assert [t.id for t in outer] == ["tr_4", "tr_3", "tr_2", "tr_1", "tr_0"], "newest first by created_at"
    assert [t.id for t in inner_a] == ["tr_2", "tr_1", "tr_0"]
    assert [t.id for t in limited] == ["tr_4", "tr_3"]
    assert [t.id for t in since] == ["tr_4", "tr_3"], "since keeps created_at >= since"
    assert [t.id for t in q] == ["tr_4", "tr_3", "tr_2", "tr_1", "tr_0"], "distinct across uids"
    assert [t.id for t in q_all] == [t.id for t in q]
    assert q_ns == []
    run(store.close())


def test_store_batch_and_query_filters(tmp_path):
    store = TrajlogSdkTraceStore(str(tmp_path / "s"))
    batch = [
        {"id": "a", "data": {"x": 1}, "namespace": "n1"},
        {"id": "b", "data": {"x": 2}, "namespace": "n2", "type": "signal", "metadata": {"m": 1}},
    ]

    async def go():
        stored = await store.store_batch(batch)
        by_type = await store.query(context_types=["signal"])
        by_ns = await store.query(namespaces=["n1"])
        return stored, by_type, by_ns

    stored, by_type, by_ns = run(go())
    assert [(t.id, t.namespace, t.type) for t in stored] == [("a", "n1", "llm_trace"), ("b", "n2", "signal")]
    assert [t.id for t in by_type] == ["b"] and by_type[0].metadata == {"m": 1}
    assert [t.id for t in by_ns] == ["a"]
    run(store.close())


def test_bad_data_raises_and_writes_nothing(tmp_path):
    store = TrajlogSdkTraceStore(str(tmp_path / "s"))
    with pytest.raises(trajlog.InvalidInputError, match="data"):
        run(store.store("t", {"x": float("nan")}, session_uids=["s"]))
    with pytest.raises(trajlog.InvalidInputError, match="data"):
        run(store.store("t", {"x": object()}, session_uids=["s"]))
    assert run(store.get("t")) is None
    run(store.close())


def openai_response(i, prompt, completion, logprobs):
    return {
        "id": f"chatcmpl-{i}",
        "object": "chat.completion",
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "done"},
                "finish_reason": "stop",
                "provider_specific_fields": {"token_ids": completion},
                "logprobs": {"content": [{"token": f"t{j}", "logprob": v} for j, v in enumerate(logprobs)]},
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
    }


def test_tracer_logs_without_dropping_and_flush_reports(tmp_path):
    # A queue of depth 1 keeps the writer behind: callers wait, nothing is dropped.
    tracer = TrajlogTracer(str(tmp_path / "s"), namespace="train", queue_depth=1)
    expected = {}
    for i in range(300):
        prompt = list(range(i, i + 50))
        completion = [i, i + 1]
        lp = f32_list(2, i)
        out = openai_response(i, prompt, completion, lp)
        tracer.log_llm_call("chat.completions.create", {"messages": []}, out, "m", 3.0, {"prompt": 50}, session_uids=["run", f"task-{i % 3}"])
        expected[f"chatcmpl-{i}"] = (prompt, completion, lp, out)
    assert tracer.flush(timeout=30) is True
    store = tracer.store

    async def check():
        run_traces = await store.get_by_session_uid("run")
        return run_traces, await store.get("chatcmpl-7")

    run_traces, seven = run(check())
    assert len(run_traces) == 300, "every logged trace is there"
    assert seven.data["output"] == expected["chatcmpl-7"][3]
    assert seven.namespace == "train"
    for tid, (prompt, completion, lp, _) in expected.items():
        call = store._get().get(tid)
        assert call.prompt_token_ids.tolist() == prompt
        assert call.completion_token_ids.tolist() == completion
        assert call.logprobs.astype(np.float64).tolist() == lp, "logprobs copied from logprobs.content"
    run(tracer.close())


def test_tracer_flush_returns_false_when_a_write_failed(tmp_path):
    tracer = TrajlogTracer(str(tmp_path / "s"))
    tracer.log_llm_call("x", {}, {"id": "a"}, "m", 1.0, {}, session_uids=["s"])
    assert tracer.flush() is True
    tracer.store._get().close()  # every later operation fails with ClosedError
    assert tracer.flush(timeout=5) is False
    assert isinstance(tracer.last_error, trajlog.ClosedError)
    with pytest.raises(trajlog.ClosedError):
        tracer.log_llm_call("x", {}, {"id": "b"}, "m", 1.0, {}, session_uids=["s"])


_TRACER_FAILED_WRITE_SCRIPT = r"""
import json, resource, signal, sys, time
import trajlog
from trajlog.rllm import TrajlogTracer

# A real write failure: files of at most 1 MiB; SIGXFSZ ignored, so the
# write that passes the limit returns EFBIG and poisons the store.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
out = {}
tracer = TrajlogTracer(sys.argv[1], segment_bytes=65536, zero_ahead_bytes=0)

def log(name, output):
    try:
        tracer.log_llm_call(name, {}, output, "m", 1.0, {}, session_uids=["s"])
        return "logged"
    except trajlog.TrajlogError as e:
        return type(e).__name__

def big(name):
    return {"id": name, "prompt_token_ids": [(i * 2654435761) % 50000 for i in range(400_000)]}

out["a"] = log("a", {"id": "a"})
out["flush_a"] = tracer.flush()
# The failure found by a flush: reported, and the store is reopened.
out["big1"] = log("big1", big("big1"))
out["flush_big1"] = (tracer.flush(), type(tracer.last_error).__name__)
out["b"] = log("b", {"id": "b"})
out["flush_b"] = tracer.flush()
# The failure found by the next trace (the writer failed before it): that
# trace is logged on the reopened store, the next flush reports the loss.
out["big2"] = log("big2", big("big2"))
deadline = time.monotonic() + 120
while tracer.store._store.poisoned() is None:
    assert time.monotonic() < deadline, "hang guard: the writer meets the limit"
    time.sleep(0.01)
out["c"] = log("c", {"id": "c"})
out["flush_c"] = (tracer.flush(), type(tracer.last_error).__name__)
out["d"] = log("d", {"id": "d"})
out["flush_d"] = tracer.flush()
tracer.close_sync()
print(json.dumps(out))
"""


def test_the_tracer_reopens_the_store_after_a_failed_write_and_reports_the_lost_traces(tmp_path):
    # A process that logs through the tracer for days must not need a
    # restart after a full disk: before, every later `log_llm_call` raised
    # PoisonedError and every `flush` returned False for good.
    import json
    import subprocess
    import sys

    path = str(tmp_path / "s")
    ran = subprocess.run([sys.executable, "-c", _TRACER_FAILED_WRITE_SCRIPT, path], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out == {
        "a": "logged", "flush_a": True,
        "big1": "logged", "flush_big1": [False, "PoisonedError"],
        "b": "logged", "flush_b": True,
        "big2": "logged",
        "c": "logged", "flush_c": [False, "PoisonedError"],
        "d": "logged", "flush_d": True,
    }, out
    with trajlog.Store(path, read_only=True) as store:
        assert sorted(c.trace_id for s in store.sessions() for c in store.session(s["session_id"])) == ["a", "b", "c", "d"]
