"""The trace walk finds the copies of the columns in `raw_request` and
`raw_response` while it writes them (`trajlog.ExtraCuts`), so the docs
encoder does not search ~100 kB of text for them again. The encoder takes
those cuts unchecked, so they must be exactly the cuts its search finds, or
none at all (the walk then leaves the search to the encoder): never other
ones. `_found_cuts_agree` compares the two for one trace; every trace here
also reads back equal to the dict stored."""

import collections
import copy
import enum
import random

import numpy as np
import pytest

import trajlog
from trajlog import _trajlog

from test_import_sqlite import trajlog_binary
from test_read_holes import TOKENS, content_lists, gateway_trace
from test_trace_dict import assert_same, plain


def clean_trace(rng, i, n=None, completions_api=False, token_in=False):
    """A gateway trace whose raw bodies repeat the columns exactly, as vLLM
    and rLLM's gateway write them."""
    n = rng.randint(1, 50) if n is None else n
    completion = [rng.randint(0, 2**32 - 1) for _ in range(n)]
    logprobs = [float(np.float32(rng.uniform(-30, 0))) for _ in range(n)]
    if n:
        logprobs[0] = -0.0
    prompt = [rng.randint(0, 200_000) for _ in range(rng.randint(1, 90))]
    messages = [{"role": "user", "content": rng.choice(TOKENS) * 3}]
    tokens = [rng.choice(TOKENS) for _ in range(n)]
    if completions_api:
        logprobs_doc = {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None}
    else:
        logprobs_doc = {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(tokens, logprobs)
        ]}
    raw_request = {"model": "m", "messages": copy.deepcopy(messages), "logprobs": True}
    if token_in:
        raw_request = {"model": "m", "prompt": list(prompt), "logprobs": 1}
    return {
        "trace_id": f"c{i}",
        "session_id": f"cs{i % 3}",
        "model": "m",
        "messages": messages,
        "prompt_token_ids": prompt,
        "response_message": {"role": "assistant", "content": "".join(tokens)},
        "completion_token_ids": completion,
        "logprobs": logprobs,
        "timestamp": 1_700_000_000.0 + i,
        "raw_request": raw_request,
        "raw_response": {
            "id": "cmpl-1",
            "choices": [{"index": 0, "logprobs": logprobs_doc, "token_ids": list(completion), "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n},
            "prompt_token_ids": list(prompt),
        },
    }


def as_read(v):
    """What a value reads back as: `plain`, with int and float subclasses
    (an IntEnum, numpy's float64) as the int and float they write."""
    v = plain(v)
    if isinstance(v, dict):
        return {k: as_read(x) for k, x in v.items()}
    if isinstance(v, list):
        return [as_read(x) for x in v]
    if isinstance(v, int) and type(v) not in (int, bool):
        return int(v)
    if isinstance(v, float) and type(v) is not float:
        return float(v)
    return v


class Tok(enum.IntEnum):
    A = 7


class F(float):
    pass


def edits():
    """Ways a trace steps off the walk's exact path, by name: after each the
    walk must leave the search to the encoder (None) or find what the search
    finds."""
    def at(t, *path):
        v = t
        for k in path:
            v = v[k]
        return v

    edits = {
        "prompt copy as a tuple": lambda t: t["raw_response"].update(prompt_token_ids=tuple(t["prompt_token_ids"])),
        "an IntEnum id": lambda t: at(t, "raw_response", "prompt_token_ids").__setitem__(0, Tok.A),
        "a bool id": lambda t: at(t, "raw_response", "prompt_token_ids").__setitem__(0, True),
        "a float id": lambda t: at(t, "raw_response", "prompt_token_ids").__setitem__(0, 1.0),
        "a negative id": lambda t: at(t, "raw_response", "prompt_token_ids").__setitem__(0, -1),
        "a 70-bit id": lambda t: at(t, "raw_response", "prompt_token_ids").__setitem__(0, 2**70),
        "one id more": lambda t: at(t, "raw_response", "prompt_token_ids").append(5),
        "one id less": lambda t: at(t, "raw_response", "prompt_token_ids").pop(),
        "empty prompt copy": lambda t: t["raw_response"].update(prompt_token_ids=[]),
        "completion copy reversed": lambda t: at(t, "raw_response", "choices", 0, "token_ids").reverse(),
        "a top_logprobs entry": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0)["top_logprobs"].append(
            {"token": "x", "logprob": -1.0, "bytes": [120]}),
        "a logprob off by one ulp": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0).update(
            logprob=float(np.nextafter(at(t, "logprobs", 0), -1.0))),
        "a numpy float64 logprob": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0).update(
            logprob=np.float64(at(t, "logprobs", 0))),
        "a completions logprob off by one ulp": lambda t: at(t, "raw_response", "choices", 0, "logprobs").update(
            token_logprobs=[float(np.nextafter(x, -1.0)) for x in t["logprobs"]]),
        "a float subclass logprob": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0).update(
            logprob=F(at(t, "logprobs", 0))),
        "bytes not the token's": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0).update(bytes=[1]),
        "keys in another order": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content").__setitem__(
            0, dict(reversed(list(at(t, "raw_response", "choices", 0, "logprobs", "content", 0).items())))),
        "an extra key in an entry": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content", 0).update(x=1),
        "an entry as an OrderedDict": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content").__setitem__(
            0, collections.OrderedDict(at(t, "raw_response", "choices", 0, "logprobs", "content", 0))),
        "one entry less": lambda t: at(t, "raw_response", "choices", 0, "logprobs", "content").pop(),
        "content empty": lambda t: at(t, "raw_response", "choices", 0, "logprobs").update(content=[]),
        "content null": lambda t: at(t, "raw_response", "choices", 0, "logprobs").update(content=None),
        "logprobs null": lambda t: at(t, "raw_response", "choices", 0).update(logprobs=None),
        "logprobs as an OrderedDict": lambda t: at(t, "raw_response", "choices", 0).update(
            logprobs=collections.OrderedDict(at(t, "raw_response", "choices", 0, "logprobs"))),
        "choice 0 null": lambda t: at(t, "raw_response", "choices").__setitem__(0, None),
        "choices as a tuple": lambda t: t["raw_response"].update(choices=tuple(t["raw_response"]["choices"])),
        "a second choice": lambda t: at(t, "raw_response", "choices").append(copy.deepcopy(at(t, "raw_response", "choices", 0))),
        "raw_response an OrderedDict": lambda t: t.update(raw_response=collections.OrderedDict(t["raw_response"])),
        "raw_response a string": lambda t: t.update(raw_response="text"),
        "raw_response null": lambda t: t.update(raw_response=None),
        "no raw_response": lambda t: t.pop("raw_response"),
        "request messages edited": lambda t: at(t, "raw_request", "messages").append({"role": "system", "content": "x"}),
        "request messages a tuple": lambda t: t["raw_request"].update(messages=tuple(t["raw_request"]["messages"])),
        "no logprobs column": lambda t: t.pop("logprobs"),
        "raw bodies before the columns": lambda t: [t.__setitem__(k, t.pop(k)) for k in
                                                    ("prompt_token_ids", "completion_token_ids", "logprobs", "messages")],
        "logprobs kept verbatim": lambda t: t["logprobs"].__setitem__(0, 1e-300),
    }
    return edits


def variants(rng):
    """A trace per edit, each off the exact path one way."""
    for name, edit in edits().items():
        t = clean_trace(rng, rng.randint(0, 10**6))
        edit(t)
        yield name, t


def test_traces_with_several_edits_find_the_search_s_cuts_or_leave_the_search(tmp_path):
    """Two to four edits at once, on chat, completions-API and token-in
    traces: the walk's cuts are the search's or none, and every trace reads
    back as it was stored."""
    rng = random.Random(6)
    names = sorted(edits())
    cases = []
    outcomes = collections.Counter()
    for i in range(150):
        t = clean_trace(rng, 1000 + i, completions_api=i % 5 == 1, token_in=i % 5 == 2)
        chosen = rng.sample(names, rng.randint(2, 4))
        for name in chosen:
            try:
                edits()[name](t)
            except (KeyError, IndexError, TypeError, AttributeError):
                pass  # an edit of a part an earlier edit took away
        agree = _trajlog._found_cuts_agree(t)
        assert agree is not False, chosen
        outcomes[agree] += 1
        cases.append((chosen, t))
    # Both ways are exercised (56 and 94 with this seed).
    assert outcomes[True] >= 20 and outcomes[None] >= 20, outcomes
    with trajlog.Store(tmp_path / "s") as store:
        for i, (chosen, t) in enumerate(cases):
            store.append_trace(dict(t, trace_id=f"e{i}", session_id=f"es{i}"))
        store.flush()
        for i, (chosen, t) in enumerate(cases):
            want = as_read(dict(t, trace_id=f"e{i}", session_id=f"es{i}"))
            assert_same(store.session_dicts(f"es{i}"), [want], where=str(chosen))


def test_exact_raw_bodies_are_cut_as_the_search_cuts_them():
    rng = random.Random(1)
    traces = [clean_trace(rng, i) for i in range(40)]
    traces += [clean_trace(rng, 100 + i, completions_api=True) for i in range(10)]
    traces += [clean_trace(rng, 200 + i, token_in=True) for i in range(10)]
    traces += [clean_trace(rng, 300, n=0)]
    for t in traces:
        assert _trajlog._found_cuts_agree(t) is True, t["trace_id"]


def test_every_other_trace_finds_the_search_s_cuts_or_leaves_the_search(tmp_path):
    rng = random.Random(2)
    cases = list(variants(rng))
    # The random gateway traces of the hole tests: near misses everywhere.
    for seed in range(4):
        r = random.Random(seed)
        for s in range(3):
            history = []
            cases += [(f"random {seed}/{s}/{k}", gateway_trace(r, f"r{seed}-{s}", k, history)) for k in range(6)]
    outcomes = collections.Counter()
    for name, t in cases:
        agree = _trajlog._found_cuts_agree(t)
        assert agree is not False, name
        outcomes[agree] += 1
    # Both ways are exercised.
    assert outcomes[True] >= 10 and outcomes[None] >= 20, outcomes
    # And everything reads back as it was stored.
    with trajlog.Store(tmp_path / "s") as store:
        for i, (name, t) in enumerate(cases):
            t = dict(t, trace_id=f"v{i}", session_id=f"vs{i}")
            store.append_trace(t)
        store.flush()
        for i, (name, t) in enumerate(cases):
            got = store.session_dicts(f"vs{i}")
            assert_same(got, [as_read(dict(t, trace_id=f"v{i}", session_id=f"vs{i}"))], where=name)


def test_the_walk_s_cuts_are_the_whole_list_references_verify_counts(tmp_path):
    """Stored through the walk's cuts, every clean trace's logprobs list is
    one reference (`verify` counts them), and reads back exactly."""
    binary = trajlog_binary()
    if binary is None:
        pytest.skip("the trajlog binary is not built (cargo build)")
    rng = random.Random(3)
    traces = [clean_trace(rng, i) for i in range(6)] + [clean_trace(rng, 50 + i, completions_api=True) for i in range(2)]
    with trajlog.Store(tmp_path / "s") as store:
        for t in traces:
            store.append_trace(t)
        store.flush()
        for s in range(3):
            assert_same(store.session_dicts(f"cs{s}"), [plain(t) for t in traces if t["session_id"] == f"cs{s}"])
    assert content_lists(binary, tmp_path / "s") == len(traces)


@pytest.mark.parametrize("token", ["\ud800", "a\udfff"])
def test_a_token_with_a_lone_surrogate_is_refused_as_before(tmp_path, token):
    rng = random.Random(4)
    t = clean_trace(rng, 1, n=2)
    t["raw_response"]["choices"][0]["logprobs"]["content"][1]["token"] = token
    with trajlog.Store(tmp_path / "s") as store:
        with pytest.raises(ValueError, match=r"raw_response\.choices\[0\]\.logprobs\.content\[1\]\.token"):
            store.append_trace(t)
        store.flush()
        assert store.session_dicts(t["session_id"]) == []


def test_ints_are_written_exactly(tmp_path):
    """The walk writes ints' digits in place: every width and sign, the
    int64 ends, in a copy of a column and anywhere else."""
    edges = [0, 1, 9, 10, 99, 100, 2**31, 2**32 - 1, 2**32, -1, -9, -10, 2**63 - 1, -(2**63), 123456789012345678]
    rng = random.Random(5)
    edges += [rng.randint(-(2**63), 2**63 - 1) for _ in range(200)]
    t = clean_trace(rng, 1, n=3)
    t["raw_response"]["edges"] = edges
    t["prompt_token_ids"] = t["raw_response"]["prompt_token_ids"] = [0, 9, 10, 2**32 - 1]
    assert _trajlog._found_cuts_agree(t) is True
    with trajlog.Store(tmp_path / "s") as store:
        store.append_trace(t)
        store.flush()
        assert_same(store.session_dicts(t["session_id"]), [plain(t)])
