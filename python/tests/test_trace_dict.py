"""Trace dicts are walked and rebuilt by the native code: the dict read back
equals the dict stored (key order, int vs float, big ints, -0.0, unicode),
and a malformed document is refused naming the path inside the trace, with
nothing written."""

import json
import random
import struct

import numpy as np
import pytest

import trajlog
from trajlog.rllm import TrajlogTraceStore

FLOATS = [1.0, 0.0, -0.0, 1e-7, 5e-324, 1.7976931348623157e308, 1e16, 1e22, 0.1, -2.5, 123456789.125, 3.0e-5]
INTS = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64, 2**70, -(2**100), 10**30]
STRINGS = ["", "a", "hé", "日本語", "emoji 🎉", "quote \" back \\ slash", "ctl \x00\x01\x1f\n\t\r", "\u2028\u2029", "</script>"]


def rand_value(rng, depth=0):
    kinds = ["float", "int", "str", "bool", "none"]
    if depth < 4:
        kinds += ["list", "dict", "tuple"]
    k = rng.choice(kinds)
    if k == "float":
        return rng.choice(FLOATS + [rng.uniform(-1e6, 1e6), rng.random() * 10 ** rng.randint(-300, 300)])
    if k == "int":
        return rng.choice(INTS + [rng.randint(-10**6, 10**6)])
    if k == "str":
        return rng.choice(STRINGS) + "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 5)))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k in ("list", "tuple"):
        items = [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        return tuple(items) if k == "tuple" else items
    keys = rng.sample(["a", "b", "z", "role", "content", "é", "", "1", "choices", "usage", "logprob", "x y"],
                      rng.randint(0, 5))
    return {key: rand_value(rng, depth + 1) for key in keys}


def f32_exact(rng, n):
    return [float(np.float32(rng.uniform(-20, 0))) for _ in range(n)]


def rand_trace(rng, i):
    n = rng.randint(0, 6)
    completion = [rng.randint(0, 2**32 - 1) for _ in range(n)]
    lp_kind = rng.choice(["exact", "inexact", "ints", "none", "absent", "numpy"])
    fields = {
        "trace_id": f"t{i}",
        "session_id": f"s{i % 3}",
        "model": rng.choice(["m", None, "Qwen/Qwen3-8B"]),
        "messages": [{"role": "user", "content": rng.choice(STRINGS)}, rand_value(rng)],
        "prompt_token_ids": [rng.randint(0, 2**32 - 1) for _ in range(rng.randint(0, 8))],
        "response_message": rand_value(rng),
        "completion_token_ids": completion,
        "routing_matrices": rng.choice([None, ["AAEC", "AwQF"]]),
        "finish_reason": rng.choice(["stop", "length", None]),
        "weight_version": rng.choice([None, 0, 7, -3, 2**62]),
        "latency_ms": rng.choice([None, 0.0, 12.25, 1e-7]),
        "token_counts": {"prompt": rng.randint(0, 99), "completion": n},
        "timestamp": rng.choice([1.0, 1700000000.123456, 0.0, None]),
        "metadata": rng.choice([{}, None, rand_value(rng)]),
        "raw_request": rand_value(rng),
        "raw_response": rng.choice([None, {"choices": [{"token_ids": completion, "logprobs": {"content": [
            {"logprob": rng.choice(FLOATS)} for _ in range(n)]}}], "usage": rand_value(rng)}]),
        "session_uids": rng.choice([None, [], ["outer", "inner"]]),
        "unknown é": rand_value(rng),
        "x": rand_value(rng),
    }
    if lp_kind == "exact":
        fields["logprobs"] = f32_exact(rng, n)
    elif lp_kind == "inexact":
        fields["logprobs"] = [rng.uniform(-20, 0) for _ in range(n)]
    elif lp_kind == "ints":
        fields["logprobs"] = [rng.randint(-5, 0) for _ in range(n)]
    elif lp_kind == "none":
        fields["logprobs"] = None
    elif lp_kind == "numpy":
        fields["logprobs"] = np.array(f32_exact(rng, n), dtype=np.float32)
    keys = list(fields)
    # Optional keys left out at random (a missing token list or timestamp
    # reads back as [] or the ingest time); the order shuffled for some traces.
    keys = [k for k in keys if k in ("trace_id", "session_id", "timestamp", "prompt_token_ids", "completion_token_ids") or rng.random() < 0.8]
    if rng.random() < 0.5:
        rng.shuffle(keys)
    if fields["timestamp"] is None and rng.random() < 0.5:
        fields["timestamp"] = 5.5
    return {k: fields[k] for k in keys}


def plain(v):
    """What the dict reads back as: tuples as lists, numpy arrays as lists."""
    if isinstance(v, np.ndarray):
        return v.astype(np.float64).tolist() if v.dtype.kind == "f" else v.tolist()
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


def assert_same(read, want, where="trace"):
    assert type(read) is type(want), (where, read, want)
    if isinstance(want, dict):
        assert list(read) == list(want), (where, list(read), list(want))
        for k in want:
            assert_same(read[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(read) == len(want), where
        for i, (a, b) in enumerate(zip(read, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert struct.pack("<d", read) == struct.pack("<d", want), (where, read, want)
    else:
        assert read == want, (where, read, want)


@pytest.mark.parametrize("seed", range(4))
def test_random_traces_read_back_equal_key_order_included(tmp_path, seed):
    rng = random.Random(seed)
    traces = [rand_trace(rng, i) for i in range(60)]
    with trajlog.Store(tmp_path / "s") as store:
        for t in traces:
            store.append_trace(t)
        store.flush()
        for t in traces:
            want = plain(t)
            call = store.get(t["trace_id"])
            read = call.to_dict()
            assert_same(read, want)
            assert json.dumps(read) == json.dumps(want)
            lp = t.get("logprobs")
            if lp is not None:
                nearest = np.array([float(x) for x in lp], dtype=np.float64).astype(np.float32)
                assert call.logprobs.view(np.uint32).tolist() == nearest.view(np.uint32).tolist()
            assert call.completion_token_ids.tolist() == plain(t.get("completion_token_ids") or [])
        # The session read path builds the same dicts.
        for s in {t["session_id"] for t in traces}:
            mine = [plain(t) for t in traces if t["session_id"] == s]
            got = {c.trace_id: c.to_dict() for c in store.session(s)}
            for want in mine:
                assert json.dumps(got[want["trace_id"]]) == json.dumps(want)
            # session_dicts (prompts rebuilt call after call) gives the same
            # dicts, in the session's order, for a window too.
            listed = [c.to_dict() for c in store.session(s)]
            assert [json.dumps(d) for d in store.session_dicts(s)] == [json.dumps(d) for d in listed]
            if len(listed) > 2:
                since = listed[0]["timestamp"]
                window = [json.dumps(d) for d in store.session_dicts(s, since=since, limit=2)]
                assert window == [json.dumps(c.to_dict()) for c in store.session(s, since=since, limit=2)]
    # And after reopening (read from the files).
    with trajlog.Store(tmp_path / "s", read_only=True) as store:
        for t in traces:
            assert json.dumps(store.get(t["trace_id"]).to_dict()) == json.dumps(plain(t))


def test_gateway_protocol_reads_back_equal(tmp_path):
    import asyncio

    rng = random.Random(99)
    traces = [rand_trace(rng, i) for i in range(20)]

    async def run():
        store = TrajlogTraceStore(str(tmp_path / "g"))
        await asyncio.gather(*(store.store_trace(t["trace_id"], t["session_id"], t) for t in traces))
        for t in traces:
            got = await store.get_trace(t["trace_id"])
            assert json.dumps(got) == json.dumps(plain(t))
        await store.close()

    asyncio.run(run())


def deep_nan():
    content = [{"logprob": -0.5, "token": "a"} for _ in range(17)] + [{"logprob": float("nan"), "token": "b"}]
    return {"id": "x", "choices": [{"logprobs": {"content": content}}]}


@pytest.mark.parametrize(
    "extra, error, match",
    [
        ({"raw_response": deep_nan()}, trajlog.InvalidInputError,
         r"raw_response\.choices\[0\]\.logprobs\.content\[17\]\.logprob: nan is not a finite number"),
        ({"metadata": {"a": [{"b": float("inf")}]}}, trajlog.InvalidInputError, r"metadata\.a\[0\]\.b: inf"),
        ({"raw_request": {"a": {1: "x"}}}, trajlog.InvalidInputError, r"raw_request\.a: the key 1 is not a string"),
        ({"messages": [{"content": {1, 2}}]}, trajlog.InvalidInputError, r"messages\[0\]\.content: a set"),
        ({"response_message": {"x": object()}}, trajlog.InvalidInputError, r"response_message\.x: a object"),
        ({"raw_response": {"b": b"bytes"}}, trajlog.InvalidInputError, r"raw_response\.b: a bytes"),
        ({"completion_token_ids": [1, 2, 3, -4], "logprobs": [-0.5] * 4}, trajlog.InvalidInputError,
         r"completion_token_ids\[3\]"),
        ({"prompt_token_ids": [1, True]}, trajlog.InvalidInputError, r"prompt_token_ids\[1\]: True is a bool"),
        ({"token_counts": {"p": np.float32(1)}}, trajlog.InvalidInputError, r"token_counts\.p: a float32"),
        ({"raw_request": {"s": "lone \ud800"}}, trajlog.InvalidInputError, r"raw_request\.s: not valid UTF-8"),
        ({1: "x"}, trajlog.InvalidInputError, r"trace: the key 1 is not a string"),
        ({"\x00key_order": ["trace_id"]}, trajlog.InvalidInputError, "reserved"),
    ],
)
def test_malformed_documents_are_refused_naming_the_path_and_nothing_is_written(tmp_path, extra, error, match):
    with trajlog.Store(tmp_path / "s") as store:
        trace = {"trace_id": "t", "session_id": "s", "prompt_token_ids": [1], "completion_token_ids": [2],
                 "timestamp": 1.0, **extra}
        with pytest.raises(error, match=match):
            store.append_trace(trace, durable=True)
        store.flush()
        assert store.get("t") is None
        assert store.sessions() == []


def test_over_deep_documents_are_refused_naming_the_path(tmp_path):
    deep = []
    for _ in range(trajlog.JSON_DEPTH_MAX):
        deep = [deep]
    with trajlog.Store(tmp_path / "s") as store:
        ok = {"trace_id": "ok", "session_id": "s", "timestamp": 1.0, "raw_request": deep[0],
              "prompt_token_ids": [], "completion_token_ids": []}
        store.append_trace(ok, durable=True)
        assert json.dumps(store.get("ok").to_dict()) == json.dumps(ok)
        bad = {"trace_id": "t", "session_id": "s", "raw_request": {"a": deep[0]}}
        with pytest.raises(trajlog.LimitExceededError, match=r"raw_request\.a(\[0\])*: nested deeper than JSON_DEPTH_MAX"):
            store.append_trace(bad, durable=True)
        cyclic = {"k": []}
        cyclic["k"].append(cyclic)
        with pytest.raises(trajlog.LimitExceededError, match=r"metadata\.k\[0\]\.k"):
            store.append_trace({"trace_id": "c", "session_id": "s", "metadata": cyclic}, durable=True)
        assert store.get("t") is None and store.get("c") is None


def test_a_raw_response_that_disagrees_with_the_columns_is_stored_verbatim(tmp_path):
    trace = {"trace_id": "t", "session_id": "s", "prompt_token_ids": [1, 2], "completion_token_ids": [3],
             "logprobs": [-0.5], "timestamp": 2.0,
             "raw_response": {"prompt_token_ids": [9, 9, 9], "choices": [{"token_ids": [7, 7],
                              "logprobs": {"content": [{"logprob": -0.1}]}}]}}
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(trace, durable=True)
        call = store.get("t")
        assert call.prompt_token_ids.tolist() == [1, 2] and call.completion_token_ids.tolist() == [3]
        assert json.dumps(call.to_dict()) == json.dumps(trace)


def test_routing_matrices_go_to_their_column_and_read_back(tmp_path):
    trace = {"trace_id": "t", "session_id": "s", "routing_matrices": ["AAEC", "AwQF"], "timestamp": 2.0,
             "prompt_token_ids": [5], "completion_token_ids": []}
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(trace, durable=True)
        assert json.dumps(store.get("t").to_dict()) == json.dumps(trace)
        assert json.loads(store.get("t").to_json())["routing_matrices"] == ["AAEC", "AwQF"]


def test_documents_are_written_as_json_dumps_writes_them(tmp_path):
    """The walker writes a document as `json.dumps(doc, separators=(",", ":"),
    ensure_ascii=False)` does, floats in Python's repr (`1e-05`, `1e+16`): the
    text a DuckDB user reads from the shards, and the text in which the docs
    block finds a logprob copied from the column."""
    metadata = {
        "floats": [1e-05, -2.099999983329326e-05, 1e16, 1e-4, 9999999999999998.0, 123.0, 0.1, 5e-324, -0.0,
                   1.7976931348623157e308, 1.5e-07, 412.7384520000001],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64, -(2**100)],
        "text": "quote \" back \\ ctl \x01\x1f \n\t é 日本 🎉 \u2028",
        "nested": [{"a": [1, {"b": None}]}, (True, False), [], {}],
    }
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace({"trace_id": "t", "session_id": "s", "timestamp": 1.0, "metadata": metadata}, durable=True)
        text = store.get("t").to_json()
        assert json.dumps(metadata, separators=(",", ":"), ensure_ascii=False) in text
        assert_same(store.get("t").to_dict()["metadata"], plain(metadata))


def test_a_document_changed_while_it_is_walked_reads_back_as_json_dumps_saw_it(tmp_path):
    """Python code run during the walk (a dict subclass's `items()`) may change
    the containers around it: a list is read to its new end, as `json.dumps`
    reads it, and a dict that changes size is refused (RuntimeError) with
    nothing written, where `json.dumps` would write the members it saw first
    (it copies a dict's items before it writes them)."""

    class Shrinks(dict):
        def items(self):
            outer.clear()
            return super().items()

    class Grows(dict):
        def items(self):
            outer_dict["new"] = 1
            return super().items()

    outer = [1, 2.5, "x", Shrinks(a=1), 3, [4]]
    outer_dict = {"a": Grows(b=1), "c": 2}
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace({"trace_id": "t", "session_id": "s", "timestamp": 1.0, "metadata": outer}, durable=True)
        assert store.get("t").to_dict()["metadata"] == [1, 2.5, "x", {"a": 1}]
        with pytest.raises(RuntimeError, match="changed size"):
            store.append_trace({"trace_id": "u", "session_id": "s", "timestamp": 1.0, "metadata": outer_dict}, durable=True)
        store.flush()
        assert store.get("u") is None
        assert [c.trace_id for c in store.session("s")] == ["t"]


def test_read_dicts_share_the_columns_int_objects_in_lists_of_their_own(tmp_path):
    """A read builds each token id and logprob once: `raw_response.prompt_token_ids`
    (and any other list of a document with the column's id at the same
    position) holds the column list's int objects, a logprobs entry the
    column's float object, while every list stays a list of its own
    (changing one changes no other)."""
    prompt = [1000 + 7 * i for i in range(300)]
    completion = [90000 + i for i in range(40)]
    logprobs = f32_exact(random.Random(1), 40)
    content = [{"token": "x", "logprob": lp, "bytes": [120]} for lp in logprobs]
    content[3]["logprob"] = -0.25  # not the column's value: a float of its own
    trace = {"trace_id": "t", "session_id": "s", "timestamp": 1.0, "prompt_token_ids": prompt,
             "completion_token_ids": completion, "logprobs": logprobs,
             "raw_response": {"prompt_token_ids": prompt, "choices": [{"token_ids": completion,
                              "logprobs": {"content": content}}], "other": [1000, 5, 90000, 1014]}}
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(trace, durable=True)
        for d in (store.get("t").to_dict(), store.session_dicts("s")[0]):
            assert json.dumps(d) == json.dumps(trace)
            raw = d["raw_response"]
            assert raw["prompt_token_ids"] is not d["prompt_token_ids"]
            assert all(a is b for a, b in zip(raw["prompt_token_ids"], d["prompt_token_ids"]))
            assert all(a is b for a, b in zip(raw["choices"][0]["token_ids"], d["completion_token_ids"]))
            read = raw["choices"][0]["logprobs"]["content"]
            assert [e["logprob"] is lp for e, lp in zip(read, d["logprobs"])] == [i != 3 for i in range(40)]
            assert read[3]["logprob"] == -0.25
            # Same value at the same position: shared; elsewhere: equal values.
            assert raw["other"][0] is d["prompt_token_ids"][0]
            assert raw["other"] == [1000, 5, 90000, 1014]
            raw["prompt_token_ids"][0] = -1
            assert d["prompt_token_ids"][0] == 1000


def test_a_dict_subclass_handing_out_fresh_keys_reads_back_with_its_keys(tmp_path):
    """A dict subclass whose `items()` makes a new key object for each member
    (freed once written, its address free for the next one) is written with
    each member's own key: the walker's key cache never outlives a key."""

    class Fresh(dict):
        def items(self):
            for k, v in super().items():
                yield k.encode().decode(), v

    metadata = [Fresh({f"key-{i}": {"inner": i, f"k{i}": [i]} for i in range(200)}),
                Fresh({f"other-{i}": i for i in range(200)}), {"plain": 1}]
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace({"trace_id": "t", "session_id": "s", "timestamp": 1.0, "metadata": metadata}, durable=True)
        assert store.get("t").to_dict()["metadata"] == json.loads(json.dumps(metadata))
