"""Round trips (lists, numpy, array.array, buffers) bit-exact; bad inputs raise
clear errors and write nothing; errors mirror the Rust kinds."""

import array
import struct

import numpy as np
import pytest

import trajlog


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32).tolist()


SPECIAL = np.array(
    [-0.0, 0.0, np.inf, -np.inf, 1e-45, -3.4028235e38] + [struct.unpack("<f", struct.pack("<I", b))[0] for b in (0x7FC00001, 0xFFA0BEEF)],
    dtype=np.float32,
)
# NaN payloads must survive too: build them from bits directly.
SPECIAL = np.concatenate([SPECIAL[:6], np.array([0x7FC00001, 0xFFA0BEEF], dtype=np.uint32).view(np.float32)])


@pytest.mark.parametrize(
    "kind",
    ["list", "numpy", "array", "memoryview", "numpy-int64"],
)
def test_round_trip_of_every_input_kind_is_bit_exact(tmp_path, kind):
    prompt = [0, 1, 2**32 - 1, 151000]
    completion = list(range(len(SPECIAL)))
    if kind == "list":
        p, c, lp = prompt, completion, SPECIAL.tolist()
    elif kind == "numpy":
        p, c, lp = np.array(prompt, dtype=np.uint32), np.array(completion, dtype=np.uint32), SPECIAL
    elif kind == "array":
        p, c, lp = array.array("I", prompt), array.array("I", completion), array.array("f", SPECIAL.tobytes())
    elif kind == "memoryview":
        p = memoryview(np.array(prompt, dtype=np.uint32))
        c = memoryview(np.array(completion, dtype=np.uint32))
        lp = memoryview(SPECIAL)
    else:
        p, c, lp = np.array(prompt, dtype=np.int64), np.array(completion, dtype=np.int64), SPECIAL
    with trajlog.Store(tmp_path / "s") as store:
        store.append(trace_id="t", session_id="s", prompt_token_ids=p, completion_token_ids=c, logprobs=lp, durable=True)
        call = store.get("t")
        assert call.prompt_token_ids.tolist() == prompt
        assert call.completion_token_ids.tolist() == completion
        want = bits(SPECIAL) if kind != "list" else bits(np.array(SPECIAL.tolist(), dtype=np.float32))
        assert bits(call.logprobs) == want
    with trajlog.Store(tmp_path / "s", read_only=True) as ro:
        assert bits(ro.get("t").logprobs) == want


def test_all_fields_and_extra_keys_round_trip(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        store.append(
            trace_id="t1",
            session_id="task:0",
            session_uids=["outer"],
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[4, 5],
            logprobs=[-0.5, -0.25],
            timestamp=12.5,
            model="m",
            weight_version=3,
            messages=[{"role": "user", "content": "héllo"}],
            response_message={"role": "assistant", "content": "ok"},
            metadata={"group_id": "g"},
            finish_reason="stop",
            latency_ms=3.5,
            token_counts={"prompt": 3},
            raw_request={"x": [1, None]},
        )
        store.flush()
        d = store.get("t1").to_dict()
    assert d == {
        "trace_id": "t1",
        "session_id": "task:0",
        "session_uids": ["outer"],
        "timestamp": 12.5,
        "model": "m",
        "weight_version": 3,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "latency_ms": 3.5,
        "messages": [{"role": "user", "content": "héllo"}],
        "response_message": {"role": "assistant", "content": "ok"},
        "metadata": {"group_id": "g"},
        "token_counts": {"prompt": 3},
        "raw_request": {"x": [1, None]},
    }


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [2**32]}, "prompt_token_ids[0]"),
        ({"prompt_token_ids": np.array([5, -3], dtype=np.int64)}, "prompt_token_ids[1]"),
        ({"prompt_token_ids": [1.5]}, "prompt_token_ids[0]"),
        ({"prompt_token_ids": ["a"]}, "prompt_token_ids[0]"),
        ({"logprobs": [-1.0, -2.0]}, "logprobs"),
        ({"logprobs": ["x"]}, "logprobs[0]"),
        ({"timestamp": float("nan")}, "timestamp"),
        ({"latency_ms": float("inf")}, "latency_ms"),
        ({"trace_id": ""}, "trace_id"),
        ({"session_id": "x" * 513}, "session_id"),
        ({"weight_version": 1.5}, "weight_version"),
        ({"messages": {"bad": float("nan")}}, "messages"),
    ],
)
def test_bad_input_raises_a_clear_error_and_writes_nothing(tmp_path, kwargs, field):
    base = dict(trace_id="t", session_id="s", prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-1.0])
    base.update(kwargs)
    with trajlog.Store(tmp_path / "s") as store:
        with pytest.raises(trajlog.InvalidInputError) as e:
            store.append(**base)
        assert field in str(e.value)
        assert isinstance(e.value, ValueError)
        store.flush()
        assert store.get("t") is None
        assert store.sessions() == []


def test_limits_locks_and_closed_stores_raise_their_kinds(tmp_path):
    path = tmp_path / "s"
    store = trajlog.Store(path)
    with pytest.raises(trajlog.LimitExceededError, match="COMPLETION_TOKENS_MAX"):
        store.append(trace_id="t", session_id="s", prompt_token_ids=[], completion_token_ids=np.zeros(2**20 + 1, dtype=np.uint32))
    with pytest.raises(trajlog.LockedError, match="locked"):
        trajlog.Store(path)
    ro = trajlog.Store(path, read_only=True)
    with pytest.raises(trajlog.ClosedError, match="read-only"):
        ro.append(trace_id="t", session_id="s", prompt_token_ids=[], completion_token_ids=[])
    store.close()
    with pytest.raises(trajlog.ClosedError):
        store.flush()
    with pytest.raises(trajlog.NotFoundError):
        trajlog.Store(tmp_path / "nope", read_only=True)



def test_close_while_other_threads_read_closes_and_they_see_closed_error(tmp_path):
    # Before the native store took its handles behind a lock, `close` met
    # PyO3's borrow check whenever another thread was inside a call
    # ("RuntimeError: Already borrowed") and left the store open.
    import threading

    path = tmp_path / "s"
    for _ in range(10):
        store = trajlog.Store(path)
        store.append(trace_id="t", session_id="s", prompt_token_ids=[1, 2], completion_token_ids=[3], durable=True)
        started = threading.Barrier(3)
        stop = threading.Event()
        seen = []

        def reader():
            started.wait()
            while not stop.is_set():
                try:
                    store.flush()
                    assert store.get("t").completion_token_ids.tolist() == [3]
                except trajlog.ClosedError:
                    seen.append("closed")
                except Exception as e:  # noqa: BLE001 - anything else is the bug
                    seen.append(repr(e))

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait()
        store.close()
        stop.set()
        for t in threads:
            t.join()
        assert set(seen) <= {"closed"}, seen
        with pytest.raises(trajlog.ClosedError):
            store.get("t")
        # Closed for real once the readers let go: the directory is not locked.
        with trajlog.Store(path) as again:
            assert again.get("t").completion_token_ids.tolist() == [3]

def test_wait_closed_waits_for_calls_in_other_threads_then_the_directory_opens(tmp_path):
    # `close` while another thread is inside a call closes the store when
    # that call returns: until then the directory stays locked, and an open
    # right after `close` met LockedError in about a quarter of such rounds
    # (measured with a session of 300 calls). `wait_closed` waits for it.
    import threading

    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        for i in range(300):
            store.append(trace_id=f"t{i}", session_id="s", prompt_token_ids=list(range(3000 + i)), completion_token_ids=[3])
        store.flush()
    store = trajlog.Store(path)
    assert not store.wait_closed(timeout=0.01), "an open store is not closed"
    for _ in range(20):
        reading = [threading.Event(), threading.Event()]
        stop = threading.Event()
        seen = []

        def reader(store=store, reading=None):
            while not stop.is_set():
                try:
                    assert len(store.session_dicts("s")) == 300
                except trajlog.ClosedError:
                    pass
                except Exception as e:  # noqa: BLE001 - anything else is the bug
                    seen.append(repr(e))
                reading.set()

        threads = [threading.Thread(target=reader, kwargs={"reading": r}) for r in reading]
        for t in threads:
            t.start()
        for r in reading:
            assert r.wait(120), "hang guard: each reader made a call"
        store.close()  # the readers are most likely inside a call now
        assert store.wait_closed(timeout=120), "hang guard: the readers' calls return"
        again = trajlog.Store(path)  # never LockedError: the old store let go
        stop.set()
        for t in threads:
            t.join()
        assert seen == []
        assert again.get("t7").completion_token_ids.tolist() == [3]
        store = again
    store.close()
    assert store.wait_closed(timeout=0)


def test_sessions_rewards_seal_delete_and_compaction(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        for i in range(4):
            store.append(trace_id=f"a{i}", session_id="a", prompt_token_ids=list(range(i * 3)), completion_token_ids=[1, 2, 3], timestamp=float(i))
        store.append(trace_id="b0", session_id="b", prompt_token_ids=[9], completion_token_ids=[8], timestamp=0.5)
        store.set_reward(1.0, session_id="a")
        store.seal("a")
        with pytest.raises(trajlog.InvalidInputError, match="sealed"):
            store.append(trace_id="a9", session_id="a", prompt_token_ids=[], completion_token_ids=[])
        assert [c.trace_id for c in store.session("a", since=0.5, limit=2)] == ["a1", "a2"]
        listed = {s["session_id"]: s for s in store.sessions()}
        assert listed["a"]["trace_count"] == 4 and listed["a"]["reward"] == 1.0 and listed["a"]["sealed"]
        report = store.compact()
        assert report["sessions"] == 1 and report["calls"] == 4
        call = store.get("a3")
        assert call.is_compacted and call.prompt_is_view
        assert call.prompt_token_ids.tolist() == list(range(9))
        assert store.audit()["sessions_checked"] == 2
        assert store.delete_session("b") == 1
        assert store.get("b0") is None
        # A trace reward needs the trace's live call; nothing is written otherwise.
        store.set_reward(0.5, trace_id="a1")
        with pytest.raises(trajlog.NotFoundError, match="b0"):
            store.set_reward(0.5, trace_id="b0")
        with pytest.raises(trajlog.NotFoundError, match="never"):
            store.set_reward(0.5, trace_id="never")


def _three_sealed_sessions(store):
    """Sessions y (3 calls, oldest), z (1) and x (2), sealed."""
    for s, (first, n) in {"x": (3.0, 2), "y": (1.0, 3), "z": (2.0, 1)}.items():
        for i in range(n):
            store.append(trace_id=f"{s}{i}", session_id=s, prompt_token_ids=[i], completion_token_ids=[1], timestamp=first + i / 10)
        store.seal(s)


def _refuses_counts(store, name):
    """`compact` refuses a count that is not a positive integer, naming it."""
    for bad in (0, -1, 1.5, True):
        with pytest.raises(trajlog.InvalidInputError, match=name):
            store.compact(**{name: bad})


def test_compact_in_batches_of_max_calls(tmp_path):
    """`max_calls`: whole sessions, oldest first, until none is left."""
    with trajlog.Store(tmp_path / "s") as store:
        _three_sealed_sessions(store)
        _refuses_counts(store, "max_calls")
        first = store.compact(max_calls=4)
        assert (first["sessions"], first["calls"], first["sessions_left"]) == (2, 4, 1)
        assert store.get("y0").is_compacted and store.get("z0").is_compacted and not store.get("x0").is_compacted
        second = store.compact(max_calls=4)
        assert (second["sessions"], second["calls"], second["sessions_left"]) == (1, 2, 0)
        assert store.compact()["sessions_left"] == 0


def test_compact_publishes_in_steps_of_batch_calls(tmp_path):
    """`batch_calls`: one compaction, published in steps of whole sessions,
    oldest first, until every selected session is compacted."""
    with trajlog.Store(tmp_path / "s") as store:
        _three_sealed_sessions(store)
        _refuses_counts(store, "batch_calls")
        r = store.compact(batch_calls=2)
        # y (3 calls, larger than the batch) alone, then z (1; x's 2 more
        # would pass 2), then x.
        assert (r["sessions"], r["calls"], r["sessions_left"], r["publications"]) == (3, 6, 0, 3)
        assert all(store.get(f"{s}0").is_compacted for s in "xyz")
        assert store.compact(batch_calls=None)["publications"] == 1


def test_a_straggler_is_copied_forward_out_of_the_segments_it_kept(tmp_path):
    """An unfinished session spread over many segments: `compact()` copies
    its calls forward (exactly, with its rewards) and frees the segments it
    alone kept; `copy_forward=None` leaves them."""

    def fill(store):
        for s in range(16):
            sid = f"done-{s}:0"
            for i in range(6):
                prompt = [s] * 300 + list(range(i * 50))
                store.append(trace_id=f"{sid}/{i}", session_id=sid, prompt_token_ids=prompt, completion_token_ids=list(range(400)), logprobs=[-0.5] * 400)
            store.seal(sid)
            # The straggler's next call, its prompt extending the last one.
            store.append(trace_id=f"late/{s}", session_id="late:0", prompt_token_ids=list(range(s * 3)), completion_token_ids=[s, 1, 2], logprobs=[-0.0, float("-inf"), -0.125], timestamp=float(s))
        store.set_reward(0.75, trace_id="late/3")  # (carried with its copy: tests/copy_forward.rs checks it)
        store.set_reward(-1.0, session_id="late:0")

    def segments(path):
        return sorted(path.glob("seg-*.tlog"))

    kept = {}
    for mode, copy_forward in (("off", None), ("on", 0.25)):
        path = tmp_path / mode
        with trajlog.Store(path, segment_bytes=64 * 1024) as store:
            fill(store)
            spread = len(segments(path))
            r = store.compact(copy_forward=copy_forward)
            assert r["sessions"] == 16
            kept[mode] = (spread, len(segments(path)), r["copied_sessions"], r["copied_calls"])
            late = store.session("late:0")
            assert [c.trace_id for c in late] == [f"late/{s}" for s in range(16)]
            for s, c in enumerate(late):
                assert c.prompt_token_ids.tolist() == list(range(s * 3))
                assert c.completion_token_ids.tolist() == [s, 1, 2]
                assert np.asarray(c.logprobs, dtype=np.float32).view(np.uint32).tolist() == np.array([-0.0, float("-inf"), -0.125], dtype=np.float32).view(np.uint32).tolist()
            assert {d["session_id"]: d["reward"] for d in store.sessions()}["late:0"] == -1.0
    assert kept["off"][0] >= 5 and kept["off"][1] >= 5 and kept["off"][2:] == (0, 0), kept
    assert kept["on"][1] <= 3 and kept["on"][2:] == (1, 16), kept
    with trajlog.Store(tmp_path / "on", read_only=True) as store:
        assert [c.trace_id for c in store.session("late:0")] == [f"late/{s}" for s in range(16)]
    with trajlog.Store(tmp_path / "on") as store:
        for bad in (0.75, -0.1, float("nan")):
            with pytest.raises(trajlog.InvalidInputError, match="copy_forward"):
                store.compact(copy_forward=bad)


def test_a_read_only_store_refreshes_beside_a_writer(tmp_path):
    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        store.append(trace_id="a0", session_id="a", prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5])
        store.flush()
        ro = trajlog.Store(path, read_only=True)
        assert [c.trace_id for c in ro.session("a")] == ["a0"]
        # Appends only: the refresh replays the new records.
        store.append(trace_id="a1", session_id="a", prompt_token_ids=[1, 2, 3, 4], completion_token_ids=[5], logprobs=[-0.25], timestamp=1.0)
        store.set_reward(2.0, session_id="a")
        store.seal("a")
        store.flush()
        assert ro.get("a1") is None
        ro.refresh()
        call = ro.get("a1")
        assert call.prompt_token_ids.tolist() == [1, 2, 3, 4] and bits(call.logprobs) == bits(np.array([-0.25], dtype=np.float32))
        listed = {s["session_id"]: s for s in ro.sessions()}
        assert listed["a"]["reward"] == 2.0 and listed["a"]["sealed"] and listed["a"]["trace_count"] == 2
        # A compaction: the refresh loads the store again and reads the shards.
        store.compact()
        ro.refresh()
        assert ro.get("a1").is_compacted
        assert ro.get("a1").prompt_token_ids.tolist() == [1, 2, 3, 4]
        ro.close()


def test_space_names_the_open_session_that_keeps_a_segment(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        store.append(trace_id="s0", session_id="straggler", prompt_token_ids=[1], completion_token_ids=[2], timestamp=0.0)
        for i in range(3):
            store.append(trace_id=f"a{i}", session_id="a", prompt_token_ids=list(range(i + 1)), completion_token_ids=[7], timestamp=float(i))
        store.seal("a")
        # (Copied forward, the straggler would leave the segment: kept here.)
        store.compact(copy_forward=None)
        space = store.space()
        kept = [s for s in space["segments"] if s["live_calls"] > 0]
        assert [s["live_calls"] for s in kept] == [1]
        assert kept[0]["kept_by"] == [{"session_id": "straggler", "calls": 1, "bytes": kept[0]["live_bytes"], "sealed": False}]
        assert kept[0]["compacted_calls"] == 3
        assert [(s["rows"], s["live_rows"]) for s in space["shards"]] == [(3, 3)]
        other = space["other"]
        # The shard index file and its annotation cache, if there is one.
        caches = (tmp_path / "s" / "shards").glob("index.ts[ia]")
        assert other["index_file_bytes"] == sum(p.stat().st_size for p in caches)
        assert space["total_bytes"] == space["segment_bytes"] + space["shard_bytes"] + other["trajectories_bytes"] + other["index_file_bytes"] + other["other_bytes"]
        assert space["total_over_live"] > space["disk_over_live"]
        assert 0 < space["live_bytes"] < space["segment_bytes"] + space["shard_bytes"]
        # Compacted in this process: the publication wrote the shard index
        # file and handed the writer an index rebuilt over it, so session
        # "a" is in the frozen layer already, as after a reopen.
        assert (space["index"]["live_calls"], space["index"]["frozen_calls"]) == (4, 3)
    with trajlog.Store(tmp_path / "s") as store:
        # Opened again: session "a", all compacted, is in the frozen layer.
        index = store.space()["index"]
        assert (index["live_calls"], index["frozen_calls"]) == (4, 3) and index["frozen_bytes"] > 0
        # ... read from the shard index file the compaction wrote.
        assert index["index_file_bytes"] == (tmp_path / "s" / "shards" / "index.tsi").stat().st_size


@pytest.mark.parametrize("child_ran", [True, False])
def test_a_forked_child_does_not_keep_the_store_locked(tmp_path, child_ran):
    """A process forked while the store is open for writing (a torch
    DataLoader worker, a multiprocessing worker) does not hold its LOCK once
    the parent closed it: the parent reopens at once. The close releases the
    lock on the description the child shares, and the child's fork handler
    drops its copy when the child first runs (src/storage/lock.rs): the
    reopen succeeds whether the child ran by then (`child_ran`: the parent
    waits for it to say so) or not."""
    import os

    path = tmp_path / "s"
    store = trajlog.Store(path)
    store.append(trace_id="t", session_id="s", prompt_token_ids=[1, 2], completion_token_ids=[3], timestamp=1.0)
    store.flush()
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child says it runs, waits for the parent, then leaves
        os.write(ready_w, b"r")
        os.read(r, 1)
        os._exit(0)
    try:
        if child_ran:
            assert os.read(ready_r, 1) == b"r"
        store.close()
        with trajlog.Store(path) as again:
            assert again.get("t") is not None
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        for fd in (r, w, ready_r, ready_w):
            os.close(fd)
