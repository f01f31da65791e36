"""`TrajlogTraceStore.store_trace` without a thread per call: once the store
is open, the trace is appended on the loop's thread and the coroutine waits
for a wake-up of the loop by the writer (the store's durability waker).

Each test checks which path a store took through what it leaves behind
(the worker threads' futures, the waker), and every verdict is about data
read back, never about timing."""

import asyncio
import threading

import pytest

import trajlog
from trajlog.rllm import TrajlogTraceStore

from test_rllm import trace


def run(coro):
    return asyncio.run(coro)


class CountingStore(TrajlogTraceStore):
    """Counts the stores handed to worker threads."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threaded = 0

    def _submit(self, fn, *args):
        self.threaded += 1
        return super()._submit(fn, *args)


def read_only(path, trace_id):
    """The trace as another reader of the directory sees it (durable data only)."""
    store = trajlog.Store(path, read_only=True)
    try:
        call = store.get(trace_id)
        return None if call is None else call.to_dict()
    finally:
        store.close()


def test_after_the_opening_store_each_store_is_durable_on_return_without_a_thread(tmp_path):
    path = str(tmp_path / "s")

    async def go():
        store = CountingStore(path)
        await store.store_trace("t0", "s1", trace(0))
        assert store.threaded == 1, "the first store opens the store in a thread"
        for i in range(1, 12):
            await store.store_trace(f"t{i}", "s1", trace(i))
            # Durable on return: a reader opening the directory now sees it.
            assert read_only(path, f"t{i}") == trace(i)
        assert store.threaded == 1, "later stores took no thread"
        assert store._waker is not None and store._waker[0] is asyncio.get_running_loop()
        assert not store._pending, "every store settled"
        await store.close()
        assert store._waker is None, "close stops watching the waker"

    run(go())


def test_concurrent_stores_from_one_loop_read_back_exact(tmp_path):
    async def go():
        store = CountingStore(str(tmp_path / "s"))
        await store.store_trace("first", "s0", trace(0, session="s0"))
        traces = {f"t{i}": trace(i, session=f"s{i % 8}", extra={"i": i, "f": 0.1 * i}) for i in range(256)}
        await asyncio.gather(*(store.store_trace(k, t["session_id"], t) for k, t in traces.items()))
        assert not store._pending
        for k, t in traces.items():
            assert await store.get_trace(k) == t
        assert store.threaded == 1, "only the opening store took a thread"
        await store.close()

    run(go())


def test_a_read_sees_stores_called_before_it_and_not_awaited(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        await store.store_trace("t0", "s1", trace(0))
        tasks = [asyncio.create_task(store.store_trace(f"t{i}", "s1", trace(i))) for i in range(1, 40)]
        got = await store.get_session_traces("s1")
        assert [t["trace_id"] for t in got] == [f"t{i}" for i in range(40)]
        await asyncio.gather(*tasks)
        await store.close()

    run(go())


def test_close_settles_stores_in_flight_and_a_cancelled_caller_still_stores(tmp_path):
    path = str(tmp_path / "s")

    async def go():
        store = TrajlogTraceStore(path)
        await store.store_trace("t0", "s1", trace(0))
        tasks = [asyncio.create_task(store.store_trace(f"t{i}", "s1", trace(i))) for i in range(1, 20)]
        await asyncio.sleep(0)  # each task appended and now waits
        tasks[0].cancel()
        await store.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert results[1:] == [None] * 18
        assert not store._pending

    run(go())
    assert sorted(c.trace_id for c in _reader_calls(path)) == sorted(f"t{i}" for i in range(20))


def test_a_refused_trace_raises_from_store_trace_and_writes_nothing(tmp_path):
    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        await store.store_trace("t0", "s1", trace(0))
        bad = trace(1, metadata={"x": float("nan")})
        with pytest.raises(trajlog.InvalidInputError, match="metadata"):
            await store.store_trace("t1", "s1", bad)
        with pytest.raises(trajlog.InvalidInputError, match="session_id"):
            await store.store_trace("t2", 7, trace(2))
        assert await store.get_trace("t1") is None
        assert not store._pending
        await store.store_trace("t3", "s1", trace(3))
        assert [t["trace_id"] for t in await store.get_session_traces("s1")] == ["t0", "t3"]
        await store.close()

    run(go())


def test_a_second_loop_uses_threads_and_takes_over_once_the_first_is_closed(tmp_path):
    store = CountingStore(str(tmp_path / "s"))

    async def some(lo, hi):
        for i in range(lo, hi):
            await store.store_trace(f"t{i}", "s1", trace(i))
        return asyncio.get_running_loop()

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(some(0, 5))
        assert store.threaded == 1
        # Another loop in another thread while the first is open: threads.
        seen = []
        t = threading.Thread(target=lambda: seen.append(asyncio.run(some(5, 10))))
        t.start()
        t.join()
        assert store.threaded == 1 + 5
        assert store._waker[0] is first
    finally:
        first.close()
    # The first loop is closed: the next loop watches the waker itself.
    loop = run(some(10, 15))
    assert store.threaded == 1 + 5
    assert store._waker[0] is loop

    async def check():
        assert [t["trace_id"] for t in await store.get_session_traces("s1")] == [f"t{i}" for i in range(15)]
        await store.close()

    run(check())


def test_a_call_the_encoder_refuses_raises_from_its_store_trace_alone(tmp_path):
    """The trace id check runs on the encoder thread (against the store's
    index): its refusal wakes the loop and reaches that caller alone; the
    stores around it are kept."""

    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        await store.store_trace("t0", "s1", trace(0))
        results = await asyncio.gather(
            store.store_trace("t1", "s1", trace(1)),
            store.store_trace("t0", "s2", trace(0, session="s2")),  # t0 lives in s1
            store.store_trace("t2", "s1", trace(2)),
            return_exceptions=True,
        )
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], trajlog.InvalidInputError) and "trace_id" in str(results[1]), results[1]
        assert not store._pending
        assert [t["trace_id"] for t in await store.get_session_traces("s1")] == ["t0", "t1", "t2"]
        assert await store.get_session_traces("s2") == []
        # One store alone: the same refusal, through the same wake-up.
        assert not store._pending
        with pytest.raises(trajlog.InvalidInputError, match="trace_id"):
            await store.store_trace("t0", "s3", trace(0, session="s3"))
        assert await store.get_session_traces("s3") == []
        await store.close()

    run(go())


def test_stores_in_flight_are_bounded_and_stay_in_order(tmp_path, monkeypatch):
    import trajlog.rllm as rllm

    monkeypatch.setattr(rllm, "_NOWAIT_IN_FLIGHT", 4)

    async def go():
        store = TrajlogTraceStore(str(tmp_path / "s"))
        await store.store_trace("t0", "s1", trace(0))
        seen = []
        native_append = store._store._append_trace_nowait

        def counting(trace, waker):
            seen.append(len(store._pending))
            return native_append(trace, waker)

        store._store._append_trace_nowait = counting
        # The same trace id stored 64 times in a row, unawaited: the last wins.
        await asyncio.gather(*(store.store_trace("t1", "s1", trace(1, metadata={"v": v})) for v in range(64)))
        assert len(seen) == 64 and max(seen) <= 3, seen
        assert (await store.get_trace("t1"))["metadata"] == {"v": 63}
        await store.close()

    run(go())


def test_flush_from_another_thread_covers_stores_still_with_the_encoder(tmp_path):
    """`Store.flush` is a barrier for what the loop handed the encoder too."""
    path = str(tmp_path / "s")

    async def go():
        store = TrajlogTraceStore(path)
        await store.store_trace("t0", "s1", trace(0))
        tasks = [asyncio.create_task(store.store_trace(f"t{i}", "s1", trace(i))) for i in range(1, 30)]
        await asyncio.sleep(0)  # each task walked its trace and handed it on
        await asyncio.to_thread(store._store.flush)
        assert sorted(c.trace_id for c in _reader_calls(path)) == sorted(f"t{i}" for i in range(30))
        await asyncio.gather(*tasks)
        await store.close()

    run(go())


def _reader_calls(path):
    reader = trajlog.Store(path, read_only=True)
    try:
        return reader.session("s1")
    finally:
        reader.close()


def test_every_commit_wakes_the_loop(tmp_path):
    """Thousands of group commits, each waking the loop while it may be
    draining the previous wake-up: no store is left waiting. (A drain that
    cleared its flag before reading lost a wake-up this way and hung.) The
    timeout is a hang guard only."""

    async def go():
        for r in range(20):
            store = TrajlogTraceStore(str(tmp_path / f"s{r}"))

            async def session(k):
                for i in range(20):
                    await store.store_trace(f"t{k}-{i}", f"s{k}", trace(i, session=f"s{k}"))

            await asyncio.wait_for(asyncio.gather(*(session(k) for k in range(16))), 300)
            assert not store._pending
            assert len(await store.get_session_traces("s15")) == 20
            await store.close()

    run(go())


def test_stores_past_the_in_flight_bound_are_handed_on_in_call_order(tmp_path, monkeypatch):
    # A store that waited for room used to be overtaken by one called after
    # it, whenever that one came while the oldest store had just settled and
    # before the waiting one resumed: an older upsert of the same trace id
    # then won. Here that moment is made certain, not left to chance: the
    # loop stops watching the waker while two stores are in flight, a third
    # waits for room, and the two are settled by hand right before a fourth
    # store is called.
    import trajlog.rllm as rllm

    monkeypatch.setattr(rllm, "_NOWAIT_IN_FLIGHT", 2)
    path = str(tmp_path / "s")

    async def go():
        store = TrajlogTraceStore(path)
        await store.store_trace("t", "s1", trace(0))  # opens the store (thread)
        loop = asyncio.get_running_loop()
        first = [asyncio.create_task(store.store_trace("t", "s1", trace(i))) for i in (1, 2)]
        await asyncio.sleep(0)
        assert len(store._pending) == 2
        waker = store._waker[2]
        loop.remove_reader(waker.fileno())
        third = asyncio.create_task(store.store_trace("t", "s1", trace(3)))
        await asyncio.sleep(0)
        assert len(store._pending) == 2, "the third store waits for room"
        while not all(receipt.poll() for receipt, _ in store._pending):
            await asyncio.sleep(0.001)
        loop.add_reader(waker.fileno(), store._on_durable)
        store._settle(waker)  # both settle; the third is handed on now
        await store.store_trace("t", "s1", trace(4))
        await asyncio.gather(*first, third)
        assert await store.get_trace("t") == dict(trace(4), trace_id="t")
        await store.close()

    run(go())
    assert read_only(path, "t") == dict(trace(4), trace_id="t")


def test_close_waits_for_stores_still_waiting_for_room(tmp_path, monkeypatch):
    import trajlog.rllm as rllm

    monkeypatch.setattr(rllm, "_NOWAIT_IN_FLIGHT", 2)
    path = str(tmp_path / "s")

    async def go():
        store = CountingStore(path)
        await store.store_trace("t0", "s1", trace(0))
        tasks = [asyncio.create_task(store.store_trace(f"t{i}", "s1", trace(i))) for i in range(1, 40)]
        await asyncio.sleep(0)
        await store.close()
        assert await asyncio.gather(*tasks) == [None] * 39
        assert store.threaded == 1, "no store fell back to a thread (nor reopened the store)"

    run(go())
    assert sorted(c.trace_id for c in _reader_calls(path)) == sorted(f"t{i}" for i in range(40))


def _run_with_file_size_limit(go_source, path):
    """Run `go_source` (an `async def go()` filling the dict `out`) in a
    subprocess whose files may be at most 1 MiB — a real write failure:
    SIGXFSZ ignored, the write that passes the limit returns EFBIG — with
    `path` as `sys.argv[1]`; returns `out`."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import asyncio, json, resource, signal, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import trajlog\n"
        "from trajlog.rllm import TrajlogTraceStore\n"
        "from test_rllm import trace\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "out = {}\n" + go_source + "\nasyncio.run(go())\nprint(json.dumps(out))\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    ran = subprocess.run([sys.executable, "-c", script, path, here], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout.strip().splitlines()[-1])


_FAILED_WRITE_SCRIPT = r"""
async def go():
    store = TrajlogTraceStore(sys.argv[1], segment_bytes=65536, zero_ahead_bytes=0)
    await store.store_trace("t0", "s1", trace(0))  # opens the store (thread)
    await store.store_trace("t1", "s1", trace(1))  # the loop's path
    big = trace(2, session="big")
    big["prompt_token_ids"] = [(i * 2654435761) % 50000 for i in range(400_000)]
    try:
        await store.store_trace("big", "big", big)
        out["big"] = "stored"
    except trajlog.TrajlogError as e:
        out["big"] = type(e).__name__
    for i in (3, 4, 5):
        await store.store_trace(f"t{i}", "s1", trace(i))
    out["s1"] = [t["trace_id"] for t in await store.get_session_traces("s1")]
    out["big_read"] = await store.get_trace("big")
    out["nowait"] = store._waker is not None and store._waker[1] is store._store._native
    await store.close()
"""


def test_a_failed_write_closes_the_poisoned_store_and_the_next_store_opens_it_again(tmp_path):
    # rLLM's gateway keeps one TraceStore for days: a full disk or an I/O
    # error must not need a restart. The store that failed raises; the
    # native store, poisoned, is closed, and the next store opens the
    # directory again (the failed write cut off), then takes the loop's
    # path again.
    path = str(tmp_path / "s")
    out = _run_with_file_size_limit(_FAILED_WRITE_SCRIPT, path)
    assert out["big"] != "stored", out
    assert out["s1"] == ["t0", "t1", "t3", "t4", "t5"], out
    assert out["big_read"] is None, out
    assert out["nowait"], "the reopened store is watched by the loop again"
    assert sorted(c.trace_id for c in _reader_calls(path)) == ["t0", "t1", "t3", "t4", "t5"]


_UNAWAITED_FAILED_WRITE_SCRIPT = r"""
async def go():
    store = TrajlogTraceStore(sys.argv[1], segment_bytes=65536, zero_ahead_bytes=0)
    await store.store_trace("t0", "s1", trace(0))
    await store.flush()
    # rLLM's gateway with sync_traces=False: the store is not awaited (its
    # own task logs a failure); the trainer's flush is the barrier.
    big = trace(1, session="big")
    big["prompt_token_ids"] = [(i * 2654435761) % 50000 for i in range(400_000)]
    task = asyncio.create_task(store.store_trace("big", "big", big))
    out["big"] = type((await asyncio.gather(task, return_exceptions=True))[0]).__name__
    await store.store_trace("t2", "s1", trace(2))  # on the reopened store
    try:
        await store.flush()
        out["flush"] = "flushed"
    except trajlog.TrajlogError as e:
        out["flush"] = [type(e).__name__, "may have been lost" in str(e)]
    await store.flush()
    out["flush_again"] = "flushed"
    out["s1"] = [t["trace_id"] for t in await store.get_session_traces("s1")]
    out["big_read"] = await store.get_trace("big")
    await store.close()
"""


def test_the_first_flush_after_a_failed_write_says_that_unawaited_stores_were_lost(tmp_path):
    # The store reopens by itself after a failed write; a store nobody
    # awaited (rLLM's sync_traces=False) failed with it. The flush after
    # must not pass for a barrier over it: before, it returned normally.
    out = _run_with_file_size_limit(_UNAWAITED_FAILED_WRITE_SCRIPT, str(tmp_path / "s"))
    assert out["big"] != "NoneType", out
    assert out["flush"] == ["PoisonedError", True], out
    assert out["flush_again"] == "flushed", out
    assert out["s1"] == ["t0", "t2"], out
    assert out["big_read"] is None, out
