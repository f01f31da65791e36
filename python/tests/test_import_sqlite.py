"""`trajlog import-rllm-sqlite`: databases written exactly the way rLLM's two
SQLite stores write them are migrated, and every field reads back equal."""

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import trajlog
from trajlog.rllm import TrajlogSdkTraceStore, TrajlogTraceStore

# The gateway's SqliteTraceStore schema and writes (rllm gateway store).
GATEWAY_DDL = [
    "CREATE TABLE IF NOT EXISTS traces (trace_id TEXT PRIMARY KEY, data TEXT NOT NULL, created_at REAL NOT NULL)",
    """CREATE TABLE IF NOT EXISTS trace_sessions (trace_id TEXT NOT NULL, session_id TEXT NOT NULL,
       run_id TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, PRIMARY KEY (trace_id, session_id),
       FOREIGN KEY (trace_id) REFERENCES traces(trace_id) ON DELETE CASCADE)""",
    "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, started_at REAL NOT NULL, ended_at REAL, metadata TEXT NOT NULL DEFAULT '{}')",
    "CREATE INDEX IF NOT EXISTS idx_ts_session_time ON trace_sessions(session_id, created_at ASC)",
]

# The older SDK's SqliteTraceStore schema and writes (rllm/sdk/store/sqlite_store.py).
SDK_DDL = [
    """CREATE TABLE IF NOT EXISTS traces (id TEXT PRIMARY KEY, context_type TEXT NOT NULL, namespace TEXT NOT NULL,
       data TEXT NOT NULL, metadata TEXT DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS trace_sessions (trace_id TEXT NOT NULL, session_uid TEXT NOT NULL,
       created_at REAL NOT NULL, PRIMARY KEY (trace_id, session_uid),
       FOREIGN KEY (trace_id) REFERENCES traces(id) ON DELETE CASCADE)""",
    "CREATE INDEX IF NOT EXISTS idx_trace_sessions_uid_time ON trace_sessions(session_uid, created_at DESC)",
]


def f32s(n, seed):
    rng = np.random.default_rng(seed)
    return [float(x) for x in (-rng.random(n, dtype=np.float32) * 8)]


def gateway_db(path):
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for ddl in GATEWAY_DDL:
        conn.execute(ddl)
    traces = {}
    for s in range(4):
        prompt = list(range(1000 + s, 1200 + s))
        for k in range(3):
            tid = f"gw-{s}-{k}"
            completion = [s, k, 99]
            data = {
                "trace_id": tid,
                "session_id": f"task-{s}:0",
                "timestamp": 1700000000.0 + s * 10 + k + 0.125,
                "model": "qwen",
                "weight_version": 7,
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "logprobs": f32s(3, s * 3 + k),
                "messages": [{"role": "user", "content": f"q{s}{k} – ünïcode"}],
                "response_message": {"role": "assistant", "content": "a", "tool_calls": None},
                "finish_reason": "stop",
                "latency_ms": 35 + k,  # an int, as some callers write it
                "metadata": {"attempt": k, "nested": {"x": [1, 2.5, None]}},
                "token_counts": {"prompt": len(prompt)},
                "routing_matrices": None,
            }
            if s == 1 and k == 1:
                data["logprobs"] = [-0.1, -0.2, -0.3]  # f64 values that are not float32: kept verbatim
            prompt = prompt + completion + [5]
            traces[tid] = data
            now = 1700000100.0 + len(traces)
            conn.execute(
                "INSERT OR REPLACE INTO traces (trace_id, data, created_at) VALUES (?, ?, COALESCE((SELECT created_at FROM traces WHERE trace_id = ?), ?))",
                (tid, json.dumps(data), tid, now),
            )
            conn.execute(
                "INSERT OR IGNORE INTO trace_sessions (trace_id, session_id, run_id, created_at) VALUES (?, ?, ?, COALESCE((SELECT created_at FROM traces WHERE trace_id = ?), ?))",
                (tid, data["session_id"], "run-1", tid, now),
            )
            conn.commit()
    # One trace also linked to a second session.
    conn.execute("INSERT INTO trace_sessions VALUES ('gw-0-0', 'eval-set', 'run-1', 1700000101.0)")
    conn.commit()
    conn.close()
    return traces


def sdk_db(path):
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    for ddl in SDK_DDL:
        conn.execute(ddl)
    rows = {}
    for i in range(6):
        tid = f"tr_{i:04d}"
        prompt, completion, lp = list(range(i, i + 120)), [i, i + 1, i + 2, i + 3], f32s(4, 100 + i)
        if i % 2 == 0:  # the SDK `Trace` model
            data = {
                "trace_id": tid, "session_name": "task:1:0", "name": "proxy/qwen",
                "input": {"messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": prompt},
                "output": {"message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop",
                           "output_token_ids": completion, "rollout_logprobs": lp},
                "model": "qwen", "latency_ms": 10.5, "tokens": {"prompt": 120, "completion": 4, "total": 124},
                "metadata": {}, "timestamp": 1700000500.0 + i, "parent_trace_id": None, "cost": None,
            }
        else:  # the SDK tracer: a raw OpenAI response
            data = {
                "name": "chat.completions.create", "input": {"messages": [{"role": "user", "content": "x"}]},
                "output": {"id": tid, "prompt_token_ids": prompt, "choices": [{"index": 0, "message": {"content": "z"},
                           "provider_specific_fields": {"token_ids": completion},
                           "logprobs": {"content": [{"token": "a", "logprob": v} for v in lp]}}]},
                "model": "qwen", "latency_ms": 9.0, "tokens": {"prompt": 120}, "timestamp": 1700000500.0 + i,
            }
        namespace = "default" if i < 4 else "eval"
        metadata = {"job": "j1"} if i != 3 else None
        uids = ["ctx_outer", f"ctx_inner_{i % 2}"] if i != 5 else []
        now = 1700000600.0 + i
        conn.execute(
            "INSERT OR REPLACE INTO traces (id, context_type, namespace, data, metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?, COALESCE((SELECT created_at FROM traces WHERE id = ?), ?), ?)",
            (tid, "llm_trace", namespace, json.dumps(data), json.dumps(metadata), tid, now, now + 0.5),
        )
        conn.execute("DELETE FROM trace_sessions WHERE trace_id = ?", (tid,))
        conn.executemany("INSERT INTO trace_sessions (trace_id, session_uid, created_at) VALUES (?, ?, ?)", [(tid, u, now) for u in uids])
        conn.commit()
        rows[tid] = dict(data=data, namespace=namespace, metadata=metadata, created_at=now, updated_at=now + 0.5, uids=uids, prompt=prompt, completion=completion, lp=lp)
    conn.close()
    return rows


def test_gateway_database_imports_field_by_field(tmp_path):
    db = tmp_path / "gateway_traces.db"
    traces = gateway_db(db)
    with trajlog.Store(tmp_path / "store") as store:
        report = store.import_rllm_sqlite(db)
        assert report == {"schema": "gateway", "traces": 12, "session_links": 13, "verified": 12, "token_bytes": report["token_bytes"]}
        for tid, data in traces.items():
            call = store.get(tid)
            assert call.prompt_token_ids.tolist() == data["prompt_token_ids"]
            assert call.completion_token_ids.tolist() == data["completion_token_ids"]
            if tid == "gw-1-1":
                # The one logprob rule: the column holds the nearest float32
                # values, the trace dict gives the verbatim values back.
                assert call.logprobs.tolist() == np.asarray(data["logprobs"], dtype=np.float32).tolist()
                assert call.to_dict()["logprobs"] == data["logprobs"]
            else:
                assert call.logprobs.astype(np.float64).tolist() == data["logprobs"]
            assert call.model == "qwen" and call.weight_version == 7 and call.session_id == data["session_id"]
    gw = TrajlogTraceStore(str(tmp_path / "store"))

    async def read():
        out = {tid: await gw.get_trace(tid) for tid in traces}
        sessions = {s: await gw.get_session_traces(f"task-{s}:0") for s in range(4)}
        listed = await gw.list_sessions()
        return out, sessions, listed

    got, sessions, listed = asyncio.run(read())
    for tid, data in traces.items():
        want = dict(data)
        if tid == "gw-0-0":
            want["session_uids"] = ["eval-set"]
        assert got[tid] == want, tid
        for key in data:  # field by field, with the types Python sees
            assert type(got[tid][key]) is type(data[key]) or key == "latency_ms", (tid, key)
    for s in range(4):
        assert [t["trace_id"] for t in sessions[s]] == [f"gw-{s}-{k}" for k in range(3)]
    counts = {d["session_id"]: d["trace_count"] for d in listed}
    assert counts["eval-set"] == 1 and counts["task-2:0"] == 3
    asyncio.run(gw.close())


def test_sdk_database_imports_field_by_field_and_queries_match_sqlite(tmp_path):
    db = tmp_path / "traces.db"
    rows = sdk_db(db)
    with trajlog.Store(tmp_path / "store") as store:
        report = store.import_rllm_sqlite(db, schema="sdk")
        assert report["traces"] == 6 and report["verified"] == 6 and report["session_links"] == 10
        for tid, r in rows.items():
            call = store.get(tid)
            assert call.prompt_token_ids.tolist() == r["prompt"]
            assert call.completion_token_ids.tolist() == r["completion"]
            assert call.logprobs.astype(np.float64).tolist() == r["lp"]
        assert store._native.get_sdk(["tr_0003"])[0][3] == "null", "the stored metadata text is kept as written"
    sdk = TrajlogSdkTraceStore(str(tmp_path / "store"))

    async def read():
        got = {tid: await sdk.get(tid) for tid in rows}
        uids = {tid: await sdk.get_session_uids_for_trace(tid) for tid in rows}
        outer = await sdk.get_by_session_uid("ctx_outer")
        inner = await sdk.get_by_session_uid("ctx_inner_1", limit=1)
        evals = await sdk.query(namespaces=["eval"])
        return got, uids, outer, inner, evals

    got, uids, outer, inner, evals = asyncio.run(read())
    for tid, r in rows.items():
        t = got[tid]
        assert t.data == r["data"], tid
        assert t.namespace == r["namespace"] and t.type == "llm_trace"
        assert t.metadata == (r["metadata"] or {}), "None reads as {}, as rLLM's TraceContext does"
        assert t.created_at == r["created_at"] and t.updated_at == r["updated_at"]
        assert uids[tid] == r["uids"]
    # The same queries answered by SQLite itself, as the SDK runs them.
    conn = sqlite3.connect(db)
    q = "SELECT t.id FROM traces t INNER JOIN trace_sessions ts ON t.id = ts.trace_id WHERE ts.session_uid = ? ORDER BY ts.created_at DESC"
    assert [t.id for t in outer] == [r[0] for r in conn.execute(q, ("ctx_outer",))]
    assert [t.id for t in inner] == [r[0] for r in conn.execute(q + " LIMIT 1", ("ctx_inner_1",))]
    assert [t.id for t in evals] == [r[0] for r in conn.execute("SELECT id FROM traces WHERE namespace = 'eval' ORDER BY created_at DESC")]
    conn.close()
    asyncio.run(sdk.close())


def test_import_is_idempotent_and_refuses_non_rllm_databases(tmp_path):
    db = tmp_path / "g.db"
    gateway_db(db)
    with trajlog.Store(tmp_path / "store") as store:
        store.import_rllm_sqlite(db)
        again = store.import_rllm_sqlite(db)
        assert again["verified"] == 12
        assert sum(s["trace_count"] for s in store.sessions()) == 13
        other = tmp_path / "other.db"
        conn = sqlite3.connect(other)
        conn.execute("CREATE TABLE t (x)")
        conn.close()
        with pytest.raises(trajlog.InvalidInputError, match="no `traces` table"):
            store.import_rllm_sqlite(other)
        with pytest.raises(trajlog.InvalidInputError, match="is not a file"):
            store.import_rllm_sqlite(tmp_path / "absent.db")
        with pytest.raises(trajlog.InvalidInputError, match="schema"):
            store.import_rllm_sqlite(db, schema="postgres")


def trajlog_binary():
    root = Path(__file__).resolve().parents[2]
    for candidate in (os.environ.get("TRAJLOG_BIN"), root / "target/debug/trajlog", root / "target/release/trajlog", shutil.which("trajlog")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def test_cli_import(tmp_path):
    binary = trajlog_binary()
    if binary is None:
        pytest.skip("the trajlog binary is not built (cargo build)")
    db = tmp_path / "sdk.db"
    sdk_db(db)
    out = subprocess.run([binary, "import-rllm-sqlite", str(db), "--store", str(tmp_path / "store")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "imported 6 traces (10 session links" in out.stdout and "(sdk schema)" in out.stdout
    assert "verified: 6/6" in out.stdout
    with trajlog.Store(tmp_path / "store", read_only=True) as store:
        assert store.get("tr_0003").completion_token_ids.tolist() == [3, 4, 5, 6]


def test_one_logprob_rule_for_every_way_in(tmp_path):
    """The same traces through `append_trace` (a dict), an rLLM SQLite
    import and `trajlog ingest` (JSON lines): the same float32 column (the
    nearest float32 of each value) and the same dict back (the values as
    they came: float32 values widened, others verbatim, ints as ints)."""
    binary = trajlog_binary()
    if binary is None:
        pytest.skip("the trajlog binary is not built (cargo build)")
    cases = {
        "exact": np.array([-0.3, -2.1e-05, 0.0, -1.5], dtype=np.float32).astype(np.float64).tolist(),
        "inexact": [-0.1, -0.2, -0.123456789012345, -1e-50],
        "ints": [-1, -2.5, 0, -3],
    }
    traces = []
    for name, lps in cases.items():
        traces.append({"trace_id": name, "session_id": "s", "timestamp": 1.0, "prompt_token_ids": [1, 2],
                       "completion_token_ids": list(range(len(lps))), "logprobs": lps})
    # 1. the dict walker
    with trajlog.Store(tmp_path / "a") as store:
        for t in traces:
            store.append_trace(dict(t), durable=True)
    # 2. the rLLM import
    db = tmp_path / "gw.db"
    conn = sqlite3.connect(db)
    for ddl in GATEWAY_DDL:
        conn.execute(ddl)
    for t in traces:
        conn.execute("INSERT INTO traces (trace_id, data, created_at) VALUES (?, ?, ?)", (t["trace_id"], json.dumps(t), 1.0))
        conn.execute("INSERT INTO trace_sessions (trace_id, session_id, created_at) VALUES (?, ?, ?)", (t["trace_id"], "s", 1.0))
    conn.commit()
    conn.close()
    with trajlog.Store(tmp_path / "b") as store:
        store.import_rllm_sqlite(db)
    # 3. trajlog ingest
    lines = "".join(json.dumps(t) + "\n" for t in traces)
    out = subprocess.run([binary, "ingest", "--store", str(tmp_path / "c")], input=lines, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for d in ("a", "b", "c"):
        with trajlog.Store(tmp_path / d, read_only=True) as store:
            for t in traces:
                call = store.get(t["trace_id"])
                want = np.asarray(t["logprobs"], dtype=np.float64).astype(np.float32)
                assert call.logprobs.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (d, t["trace_id"])
                got = call.to_dict()["logprobs"]
                assert got == t["logprobs"] and [type(x) for x in got] == [type(x) for x in t["logprobs"]], (d, t["trace_id"], got)
