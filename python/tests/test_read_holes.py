"""Session reads build `extra`'s copies of the columns (vLLM's
`raw_response.prompt_token_ids`, `choices[0].token_ids`, every
`logprobs.content[i]` `logprob` and `bytes`) straight from the columns and
parse only the rest of the stored template. The dicts must be exactly what
`json.loads` makes of the stored text: same types, same float bits, same key
order, whatever the text's whitespace, escapes and numbers; what that path
cannot map exactly (an integer beyond 64 bits, a lone surrogate) is read
through the text."""

import json
import os
import random
import subprocess

import numpy as np
import pytest

import trajlog

from test_import_sqlite import trajlog_binary
from test_trace_dict import assert_same, plain

# Tokens whose JSON text needs escapes, or several UTF-8 bytes.
TOKENS = [" the", "\n", "\t", "é", "日本", "🎉", '"q"', "back\\slash", "\u2028", "\x00", "\x1f", "/", "", " x" * 40]


def logprob_entries(rng, completion, logprobs, tokens):
    entries = []
    for i, lp in enumerate(logprobs):
        tok = tokens[i % len(tokens)]
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
        if rng.random() < 0.3:
            alt = rng.choice(TOKENS)
            entry["top_logprobs"] = [{"token": alt, "logprob": float(np.float32(lp - 1)), "bytes": list(alt.encode())}]
        if rng.random() < 0.1:
            entry["logprob"] = rng.choice([lp + 1e-9, 0.0, -0.0, -1e-300, 5e-324])  # stays verbatim
        if rng.random() < 0.1:
            entry["bytes"] = None if rng.random() < 0.5 else [1, 2, 3]  # not the token's bytes
        if rng.random() < 0.05:
            del entry["token"]
        entries.append(entry)
    return entries


def gateway_trace(rng, session, turn, history):
    n = rng.randint(0, 60)
    completion = [rng.randint(0, 2**32 - 1) for _ in range(n)]
    logprobs = [float(np.float32(rng.uniform(-30, 0))) for _ in range(n)]
    prompt = [rng.randint(0, 200_000) for _ in range(rng.randint(0, 80))]
    history.append({"role": "user", "content": rng.choice(TOKENS) * rng.randint(1, 5)})
    raw_prompt = prompt if rng.random() < 0.9 else prompt[:-1] + [7]
    trace = {
        "trace_id": f"{session}-{turn}",
        "session_id": session,
        "model": "m",
        "messages": list(history),
        "prompt_token_ids": prompt,
        "response_message": {"role": "assistant", "content": "ok"},
        "completion_token_ids": completion,
        "logprobs": logprobs,
        "timestamp": 1700000000.0 + turn,
        "raw_request": {"messages": list(history) if rng.random() < 0.8 else history[:1], "temperature": 1.0},
        "raw_response": {
            "id": "cmpl-1",
            "choices": [{
                "index": 0,
                "logprobs": {"content": logprob_entries(rng, completion, logprobs, rng.sample(TOKENS, 5))},
                "token_ids": completion if rng.random() < 0.9 else completion[::-1],
                "finish_reason": "stop",
            }],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "ratio": 0.1, "neg": -3},
            "prompt_token_ids": raw_prompt,
            "nums": [0, -0, 1.5e300, -2.5e-300, 1e16, 123456789012345678, -(2**63), True, False, None],
        },
    }
    history.append(trace["response_message"])
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_session_dicts_equal_the_stored_dicts_bit_for_bit(tmp_path, seed):
    rng = random.Random(seed)
    traces = []
    for s in range(4):
        history = []
        traces += [gateway_trace(rng, f"s{s}", turn, history) for turn in range(6)]
    # A big int or a float that needs the text path, in one call each.
    traces[3]["raw_response"]["big"] = 2**70
    traces[7]["raw_response"]["choices"][0]["logprobs"]["content"].append({"token": "z", "logprob": -(2**64)})
    with trajlog.Store(tmp_path / "s") as store:
        for t in traces:
            store.append_trace(t)
        store.flush()
        for s in range(4):
            want = [plain(t) for t in traces if t["session_id"] == f"s{s}"]
            got = store.session_dicts(f"s{s}")
            assert_same(got, want)
            # The same dicts as the per-call path (rendered text, parsed).
            assert [json.dumps(d) for d in got] == [json.dumps(store.get(t["trace_id"]).to_dict()) for t in want]
            # Each copy of a column is a list of its own.
            for d in got:
                rr = d["raw_response"]
                assert rr["prompt_token_ids"] is not d["prompt_token_ids"]
                assert rr["choices"][0]["token_ids"] is not d["completion_token_ids"]


def ingested_line(rng, i):
    """A gateway trace as text with whitespace around every value (a
    serializer other than Python's), as `trajlog ingest` keeps it."""
    n = 30
    completion = list(range(1000 + i, 1000 + i + n))
    logprobs = [-0.5 - k / 8 for k in range(n)]
    tokens = [" a", "\n", "é", '"q"', "🎉", "xyz"]
    sep = rng.choice([" ,\t ", ",", ",  ", " , "])
    entries = sep.join(
        '{ "token" : %s , "logprob" :%s%r ,"bytes" :  %s%s, "top_logprobs": [ ] }'
        % (json.dumps(tokens[k % 6], ensure_ascii=rng.random() < 0.5), rng.choice(["", " ", "\t"]), logprobs[k],
           json.dumps(list(tokens[k % 6].encode())), rng.choice(["", " ", "  "]))
        for k in range(n)
    )
    ids = json.dumps(completion).replace(", ", rng.choice([",", ", "]))
    return (
        '{"trace_id":"t%d","session_id":"s","timestamp":%d.5,"prompt_token_ids":[5,6,7],"completion_token_ids":%s,"logprobs":%s,'
        '"messages":[{"role":"user","content":"hi"}],"raw_request":{ "messages" :  [{"role":"user","content":"hi"}] ,"n" : 1},'
        '"raw_response": { "prompt_token_ids" :  [5, 6, 7]  , "choices" : [ { "token_ids" :%s%s , "logprobs" : { "content" : [ %s ] } } ], '
        '"e": [1E2, 1e-2, -0.0, 0, -0, 2.5E+3], "s": "\\u00e9\\ud83c\\udf89\\n\\/", "pad": "%s" } }'
        % (i, 1700000000 + i, json.dumps(completion), json.dumps(logprobs), rng.choice(["", " ", "\t"]), ids, entries, "p" * 300)
    )


def ingest(binary, tmp_path, lines, store):
    """`trajlog ingest` of `lines` (JSON text) into `store`; it must succeed."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(src, "rb") as f:
        out = subprocess.run([binary, "ingest", "--store", str(store)], stdin=f, capture_output=True,
                             text=True, env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 0, out.stderr
    return out


def test_ingested_text_with_any_whitespace_reads_back_as_json_loads_reads_it(tmp_path):
    binary = trajlog_binary()
    if binary is None:
        pytest.skip("the trajlog binary is not built (cargo build)")
    rng = random.Random(5)
    lines = [ingested_line(rng, i) for i in range(12)]
    # Text only json.loads maps exactly: a lone surrogate, an integer beyond 64 bits.
    lines.append(lines[0].replace('"t0"', '"t12"').replace('1700000000.5', '1700000012.5').replace('"pad"', '"lone": "\\ud800", "pad"'))
    lines.append(lines[1].replace('"t1"', '"t13"').replace('1700000001.5', '1700000013.5').replace('"pad"', '"big": 123456789012345678901234567890, "pad"'))
    out = ingest(binary, tmp_path, lines, tmp_path / "st")
    assert f"ingested {len(lines)}, refused 0" in out.stderr
    with trajlog.Store(tmp_path / "st", read_only=True) as store:
        got = store.session_dicts("s")
        want = [json.loads(line) for line in lines]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
            assert json.dumps(g) == json.dumps(w)


def clean_trace(session, turn, tokens):
    """A gateway trace whose `logprobs.content` is exactly its logprob column
    in vLLM's form: stored as one reference (format-spec/record.md §7.2,
    reference 8) and rebuilt from the column and the token literals."""
    n = 5 + 7 * turn
    completion = [90_000 + 31 * turn + k for k in range(n)]
    logprobs = [float(np.float32(-k / 7 - turn)) for k in range(n)]
    entries = [
        {"token": tokens[k % len(tokens)], "logprob": lp, "bytes": list(tokens[k % len(tokens)].encode()), "top_logprobs": []}
        for k, lp in enumerate(logprobs)
    ]
    messages = [{"role": "user", "content": f"turn {turn}"}]
    return {
        "trace_id": f"{session}-{turn}",
        "session_id": session,
        "messages": messages,
        "prompt_token_ids": [1, 2, turn],
        "completion_token_ids": completion,
        "logprobs": logprobs,
        "timestamp": 1700000000.0 + turn,
        "raw_request": {"messages": messages, "logprobs": True},
        "raw_response": {
            "choices": [{"index": 0, "logprobs": {"content": entries}, "token_ids": completion}],
            "prompt_token_ids": [1, 2, turn],
        },
    }


def content_lists(binary, store):
    out = subprocess.run([binary, "verify", "--store", str(store)], capture_output=True, text=True,
                         env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    found = [line for line in out.stdout.splitlines() if line.startswith("call records:")]
    assert found, out.stdout
    return int(found[0].split(" with vLLM's logprobs list as one reference")[0].rsplit(" ", 1)[1])


def test_content_lists_stored_as_one_reference_read_back_exactly(tmp_path):
    """Dicts appended from Python (compact text) and lines ingested as
    Python's json.dumps writes them (spaced, ASCII escapes or not): their
    content lists are one reference each, and read back as json.loads reads
    the stored text, escapes, float bits and all."""
    binary = trajlog_binary()
    if binary is None:
        pytest.skip("the trajlog binary is not built (cargo build)")
    traces = [clean_trace("py", turn, TOKENS) for turn in range(4)]
    # A completions-API answer: its `token_logprobs` is the column (reference 9).
    cmpl = clean_trace("py", 4, TOKENS)
    cmpl["raw_response"]["choices"][0]["logprobs"] = {
        "text_offset": [], "token_logprobs": list(cmpl["logprobs"]), "tokens": TOKENS,
        "top_logprobs": []}
    traces.append(cmpl)
    with trajlog.Store(tmp_path / "a") as store:
        for t in traces:
            store.append_trace(t)
        store.flush()
        got = store.session_dicts("py")
        assert_same(got, [plain(t) for t in traces])
        assert [json.dumps(d) for d in got] == [json.dumps(store.get(t["trace_id"]).to_dict()) for t in traces]
    assert content_lists(binary, tmp_path / "a") == 5
    lines = [json.dumps(clean_trace("txt", turn, TOKENS[:8]), ensure_ascii=turn % 2 == 0) for turn in range(4)]
    ingest(binary, tmp_path, lines, tmp_path / "b")
    assert content_lists(binary, tmp_path / "b") == 4
    with trajlog.Store(tmp_path / "b", read_only=True) as store:
        got = store.session_dicts("txt")
        for g, line in zip(got, lines):
            assert_same(g, json.loads(line))
            assert json.dumps(g) == json.dumps(json.loads(line))
