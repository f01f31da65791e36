"""trajlog as rLLM's gateway TraceStore: the behaviours rLLM's own store tests
check, concurrency on a fresh store, and reading from another process."""

import asyncio
import json
import subprocess
import sys

import numpy as np

from trajlog.rllm import TrajlogTraceStore


def trace(i, session="s1", ts=None, **more):
    d = {
        "trace_id": f"t{i}",
        "session_id": session,
        "timestamp": float(i) if ts is None else ts,
        "model": "Qwen/Qwen3-8B",
        "prompt_token_ids": list(range(i, i + 5)),
        "completion_token_ids": [100 + i, 200 + i],
        "logprobs": [float(np.float32(-0.1 * (i + 1))), -1.5],
        "messages": [{"role": "user", "content": f"q{i}"}],
        "response_message": {"role": "assistant", "content": f"a{i}"},
        "finish_reason": "stop",
        "latency_ms": 12.0,
        "token_counts": {"prompt": 5, "completion": 2},
        "metadata": {"step": i},
        "weight_version": None,
    }
    d.update(more)
    return d


def run(coro):
    return asyncio.run(coro)


def test_store_get_upsert_and_missing(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        t = trace(1)
        await store.store_trace("t1", "s1", t)
        assert await store.get_trace("t1") == t
        assert await store.get_trace("missing") is None
        t2 = trace(1, model="other", extra_field={"k": [1, 2]})
        await store.store_trace("t1", "s1", t2)
        assert await store.get_trace("t1") == t2
        assert len(await store.get_session_traces("s1")) == 1
        await store.close()

    run(go())


def test_session_order_limit_since_delete_and_list(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        for i in [3, 1, 2, 0]:
            await store.store_trace(f"t{i}", "s1", trace(i))
        await store.store_trace("t9", "s2", trace(9, session="s2"))
        got = await store.get_session_traces("s1")
        assert [t["trace_id"] for t in got] == ["t0", "t1", "t2", "t3"]
        assert [t["trace_id"] for t in await store.get_session_traces("s1", limit=2)] == ["t0", "t1"]
        assert [t["trace_id"] for t in await store.get_session_traces("s1", since=1.0)] == ["t2", "t3"]
        sessions = await store.list_sessions()
        assert sessions == [
            {"session_id": "s1", "trace_count": 4, "first_trace_at": 0.0, "last_trace_at": 3.0},
            {"session_id": "s2", "trace_count": 1, "first_trace_at": 9.0, "last_trace_at": 9.0},
        ]
        assert [s["session_id"] for s in await store.list_sessions(since=5.0)] == ["s2"]
        assert len(await store.list_sessions(limit=1)) == 1
        assert await store.delete_session("s1") == 4
        assert await store.get_session_traces("s1") == []
        assert await store.get_trace("t2") is None
        assert await store.delete_session("s1") == 0
        await store.flush()
        await store.close()

    run(go())


def test_dicts_round_trip_unchanged_even_with_non_float32_logprobs(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        t = trace(4, logprobs=[-0.1, -0.2])  # not representable as float32
        await store.store_trace("t4", "s1", t)
        assert await store.get_trace("t4") == t
        await store.close()

    run(go())


def test_64_coroutines_storing_at_once_on_a_fresh_store(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        await asyncio.gather(*(store.store_trace(f"t{i}", f"s{i % 8}", trace(i, session=f"s{i % 8}")) for i in range(64)))
        await store.flush()
        counts = {s["session_id"]: s["trace_count"] for s in await store.list_sessions()}
        assert counts == {f"s{k}": 8 for k in range(8)}
        for i in range(64):
            assert (await store.get_trace(f"t{i}"))["prompt_token_ids"] == list(range(i, i + 5))
        await store.close()

    run(go())


def test_another_process_reads_what_was_flushed(tmp_path):
    path = str(tmp_path / "s")

    async def write():
        store = TrajlogTraceStore(path)
        for i in range(5):
            await store.store_trace(f"t{i}", "s1", trace(i))
        await store.flush()
        return store

    store = run(write())
    code = (
        "import json, trajlog;"
        f"s = trajlog.Store({path!r}, read_only=True);"
        "print(json.dumps([c.to_dict() for c in s.session('s1')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [trace(i) for i in range(5)]
    run(store.close())
