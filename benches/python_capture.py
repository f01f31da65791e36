#!/usr/bin/env python3
"""The capture path as rLLM users run it, from Python: trajlog through its
binding vs an aiosqlite store written the way rLLM's gateway writes it
(one `json.dumps` blob per trace, a session junction table, WAL,
synchronous=NORMAL, a commit per trace), on the same calls.

    .venv/bin/python benches/python_capture.py                 # the default workload
    .venv/bin/python benches/python_capture.py --sessions 8 --json
    .venv/bin/python benches/python_capture.py --shape lean    # the earlier, lean traces

The traces are shaped as rLLM's model gateway stores them (`--shape gateway`,
the default: the whole chat history with tool calls and tool results, the raw
request and vLLM's raw response with every token id and logprob again; or
`gateway-streaming`, raw_response null), or lean (`--shape lean`: one-line
messages, no raw bodies), the same token stream in every shape.

Measured, per backend:
  * per-call append latency p50/p99, calls/s, token MB/s, and the process's
    CPU time per call (every thread: trajlog's writer, aiosqlite's worker):
      - trajlog `append` with Python lists, with numpy arrays (returns once the
        writer has the call; one `flush()` at the end makes it durable, and
        its time is included in the throughput);
      - trajlog `TrajlogTraceStore.store_trace` (gateway protocol, durable on
        return) and the aiosqlite store's `store_trace` (committed on return);
  * one 10k-token call (10,000-token prompt, 500-token completion): append
    latency p50/p99 with lists and with numpy;
  * session read: every session read back (trajlog: zero-copy numpy views;
    also `to_dict()` plain lists as the gateway returns them; aiosqlite:
    `json.loads` of each row), as token MB/s and ms per session.

Token payload counts 4 bytes per prompt id, completion id and logprob. Needs
numpy and aiosqlite (`pip install aiosqlite`).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import sys
import random
import tempfile
import time
import uuid

# numpy's OpenBLAS threads spin after start-up and took ~2% of this 2-core
# machine's samples; nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import trajlog
from trajlog.rllm import TrajlogTraceStore


# ---------------------------------------------------------------------------
# The baseline: an aiosqlite store with rLLM gateway's schema and writes.
# ---------------------------------------------------------------------------


class RllmStyleSqliteStore:
    """Persistent aiosqlite connection; WAL, synchronous=NORMAL; traces as one
    json.dumps TEXT blob; trace_sessions junction; a commit per store_trace."""

    def __init__(self, path):
        self.path = path
        self.conn = None

    async def open(self):
        import aiosqlite

        self.conn = await aiosqlite.connect(self.path, timeout=20.0)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=20000", "temp_store=MEMORY", "mmap_size=0"):
            await self.conn.execute(f"PRAGMA {pragma}")
        await self.conn.execute("PRAGMA foreign_keys = ON")
        await self.conn.execute("CREATE TABLE IF NOT EXISTS traces (trace_id TEXT PRIMARY KEY, data TEXT NOT NULL, created_at REAL NOT NULL)")
        await self.conn.execute(
            "CREATE TABLE IF NOT EXISTS trace_sessions (trace_id TEXT NOT NULL, session_id TEXT NOT NULL, "
            "run_id TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, PRIMARY KEY (trace_id, session_id), "
            "FOREIGN KEY (trace_id) REFERENCES traces(trace_id) ON DELETE CASCADE)"
        )
        await self.conn.execute("CREATE INDEX IF NOT EXISTS idx_ts_session_time ON trace_sessions(session_id, created_at ASC)")
        await self.conn.execute("CREATE INDEX IF NOT EXISTS idx_traces_time ON traces(created_at)")
        await self.conn.commit()

    async def store_trace(self, trace_id, session_id, data):
        now = time.time()
        await self.conn.execute(
            "INSERT OR REPLACE INTO traces (trace_id, data, created_at) VALUES (?, ?, "
            "COALESCE((SELECT created_at FROM traces WHERE trace_id = ?), ?))",
            (trace_id, json.dumps(data), trace_id, now),
        )
        await self.conn.execute(
            "INSERT OR IGNORE INTO trace_sessions (trace_id, session_id, run_id, created_at) VALUES (?, ?, '', "
            "COALESCE((SELECT created_at FROM traces WHERE trace_id = ?), ?))",
            (trace_id, session_id, trace_id, now),
        )
        await self.conn.commit()

    async def get_session_traces(self, session_id):
        sql = (
            "SELECT t.data FROM traces t INNER JOIN trace_sessions ts ON t.trace_id = ts.trace_id "
            "WHERE ts.session_id = ? ORDER BY ts.created_at ASC"
        )
        async with self.conn.execute(sql, (session_id,)) as cur:
            rows = await cur.fetchall()
        return [json.loads(r[0]) for r in rows]

    async def close(self):
        await self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        await self.conn.close()


# ---------------------------------------------------------------------------
# The workload: multi-turn agent sessions whose prompts grow turn by turn.
# ---------------------------------------------------------------------------

SHAPES = ("gateway", "gateway-streaming", "lean")

# The synthetic vocabulary and tools of trajlog-sim (crates/sim/src/gateway.rs):
# a token's text is a word piece, most with a leading space; some are newlines.
PIECES = [
    "the", "of", "to", "and", "a", "in", "is", "it", "that", "for", "file", "test", "def", "return", "self", "import",
    "from", "error", "value", "line", "we", "need", "check", "function", "print", "if", "else", "None", "True", "path",
    "(", ")", ":", ",", ".", "=", "_", "\"", "'", "[", "]", "{", "}", "->", "==", "#", "config", "data", "run",
    "output", "result", "fix", "bug", "call", "args", "list", "str", "int", "case", "module", "class", "let", "name",
    "step",
]
TOOLS = [
    ("bash", "command", "Run a bash command in the task's sandbox and return its exit code, stdout and stderr. "
     "Long outputs are cut to their last 200 lines.", "The command line to run, e.g. `pytest -x tests/test_io.py`."),
    ("read_file", "path", "Read a file of the repository and return its content with line numbers.",
     "Path of the file, relative to the repository root."),
    ("search", "pattern", "Search the repository for a regular expression and return each matching line with its "
     "file and line number.", "A Python regular expression."),
    ("submit", "answer", "Submit the final answer and end the episode.", "A summary of the change made."),
]
MODEL = "Qwen/Qwen3-4B"


def token_text(i):
    if i % 29 == 0:
        return "\n"
    return (" " if (i // 64) % 4 else "") + PIECES[i % len(PIECES)]


def decode(ids):
    return "".join(token_text(i) for i in ids.tolist())


def tools_param():
    return [
        {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": {param: {"type": "string", "description": pdesc}}, "required": [param]}}}
        for name, param, desc, pdesc in TOOLS
    ]


class Conversation:
    """One session's chat history and the documents rLLM's model gateway
    stores per call (rllm_model_gateway/data_process.py, build_trace_record;
    docs/serve-contract.md section 3): `messages` is the whole history sent,
    growing every turn like the prompt; non-streaming calls carry vLLM's whole
    response in `raw_response`, streaming ones have it null."""

    def __init__(self, first_prompt, streaming, rnd, max_tokens):
        split = len(first_prompt) * 3 // 4
        self.history = [
            {"role": "system", "content": decode(first_prompt[:split])},
            {"role": "user", "content": decode(first_prompt[split:])},
        ]
        self.streaming, self.rnd, self.tools = streaming, rnd, tools_param()
        self.max_tokens = max(2048, 1 << (max_tokens - 1).bit_length())
        self.pending_tool_call = None

    def documents(self, prompt, completion, logprobs, timestamp, last):
        """The gateway's fields of one call besides the token columns, in its key order."""
        rnd = self.rnd
        n = len(completion)
        tool = None if last else TOOLS[rnd.randrange(len(TOOLS) - 1)]
        arg_len = min(n // 4, 48) if tool else 0
        text = decode(completion[: n - arg_len])
        arg_text = decode(completion[n - arg_len:])
        finish = "tool_calls" if tool else "stop"
        call_id = f"chatcmpl-tool-{rnd.getrandbits(128):032x}" if tool else None
        arguments = json.dumps({tool[1]: arg_text}) if tool else None
        merged = [{"id": call_id, "type": "function", "function": {"name": tool[0], "arguments": arguments}}] if tool else []
        content = None if (tool and not text) else text
        if self.streaming:
            # Assembled from the deltas: tool-call fragments unmerged.
            rm = {"role": "assistant"}
            if text:
                rm["content"] = text
            if tool:
                frags = [{"id": call_id, "type": "function", "index": 0, "function": {"name": tool[0]}}]
                pieces = [json.dumps({tool[1]: ""})[:-2]] + [json.dumps(token_text(i))[1:-1] for i in completion[n - arg_len:].tolist()]
                pieces[-1] += '"}'
                frags += [{"index": 0, "function": {"arguments": a}} for a in pieces]
                rm["tool_calls"] = frags
            history_message = {"role": "assistant", "content": content}
            if tool:
                history_message["tool_calls"] = merged
        else:
            rm = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                  "function_call": None, "tool_calls": merged, "reasoning_content": None}
            history_message = rm
        messages = list(self.history)
        latency_ms = 50 + rnd.random() * 850
        request = {"messages": messages, "model": MODEL}
        if self.streaming:
            request["stream"] = True
        request.update({"temperature": 1.0, "tools": self.tools, "logprobs": True, "return_token_ids": True,
                        "top_p": 1.0, "max_tokens": self.max_tokens})
        p, c = len(prompt), n
        if self.streaming:
            raw_response, token_counts = None, {}
        else:
            completion_list = completion.tolist()
            entries = []
            for i, lp in zip(completion_list, logprobs.astype(np.float64).tolist()):
                t = token_text(i)
                entries.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []})
            raw_response = {
                "id": f"chatcmpl-{rnd.getrandbits(128):032x}", "object": "chat.completion",
                "created": int(timestamp - latency_ms / 1000), "model": MODEL,
                "choices": [{"index": 0, "message": rm, "logprobs": {"content": entries}, "finish_reason": finish,
                             "stop_reason": None, "token_ids": completion_list}],
                "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_ids": prompt.tolist(), "kv_transfer_params": None,
            }
            token_counts = {"prompt": p, "completion": c}
        self.history.append(history_message)
        self.pending_tool_call = call_id
        return {
            "trace_id": str(uuid.UUID(int=rnd.getrandbits(128), version=4)),
            "messages": messages, "response_message": rm, "routing_matrices": None, "finish_reason": finish,
            "latency_ms": latency_ms, "token_counts": token_counts, "metadata": {},
            "raw_request": request, "raw_response": raw_response,
        }

    def tool_result(self, ids):
        content = decode(ids)
        if self.pending_tool_call:
            self.history.append({"role": "tool", "tool_call_id": self.pending_tool_call, "content": content})
        else:
            self.history.append({"role": "user", "content": content})
        self.pending_tool_call = None


def workload(sessions, steps, prompt_tokens, completion_tokens, seed, shape="gateway"):
    """Calls with their token columns as numpy arrays and, for the gateway
    shapes, the documents the gateway stores beside them (the token stream is
    the same in every shape)."""
    rng = np.random.default_rng(seed)
    calls = []
    for s in range(sessions):
        prompt = rng.integers(0, 150_000, prompt_tokens, dtype=np.uint32)
        conv = None
        if shape != "lean":
            rnd = random.Random(seed * 1_000_003 + s)
            conv = Conversation(prompt, shape == "gateway-streaming", rnd, completion_tokens * 3 // 2 + 1)
        for k in range(steps):
            n = int(rng.integers(completion_tokens // 2, completion_tokens * 3 // 2 + 1))
            completion = rng.integers(0, 150_000, n, dtype=np.uint32)
            logprobs = (-rng.exponential(0.5, n)).astype(np.float32)
            call = {
                "trace_id": f"s{s}-k{k}",
                "session_id": f"task-{s // 4}:{s % 4}:0",
                "timestamp": 1_700_000_000.0 + s * 100 + k,
                "model": MODEL,
                "weight_version": 3,
                "prompt": prompt,
                "completion": completion,
                "logprobs": logprobs,
            }
            if conv is None:
                call.update({
                    "messages": [{"role": "user", "content": f"observation {k} of task {s}: " + "x" * 200}],
                    "response_message": {"role": "assistant", "content": "thinking… " + "y" * 300},
                    "finish_reason": "stop",
                    "latency_ms": 812.5,
                })
            else:
                call.update(conv.documents(prompt, completion, logprobs, call["timestamp"], last=k == steps - 1))
            calls.append(call)
            user = rng.integers(0, 150_000, int(rng.integers(50, 300)), dtype=np.uint32)
            if conv is not None:
                conv.tool_result(user)
            prompt = np.concatenate([prompt, completion, user])
    return calls


# The gateway's TraceRecord keys, in its order.
GATEWAY_KEYS = (
    "trace_id", "session_id", "model", "messages", "prompt_token_ids", "response_message", "completion_token_ids",
    "logprobs", "routing_matrices", "finish_reason", "weight_version", "latency_ms", "token_counts", "timestamp",
    "metadata", "raw_request", "raw_response",
)
# The documents of a gateway-shaped call that have no column in trajlog.
GATEWAY_EXTRA = ("routing_matrices", "token_counts", "raw_request", "raw_response")


def as_gateway_dict(c):
    """The trace dict the gateway hands to its store: plain lists (for the
    gateway shapes, its 17 keys in its order)."""
    lists = {
        "prompt_token_ids": c["prompt"].tolist(),
        "completion_token_ids": c["completion"].tolist(),
        "logprobs": c["logprobs"].astype(np.float64).tolist(),
    }
    if "raw_request" in c:
        lists["logprobs"] = lists["logprobs"] or None  # the gateway stores an empty list as null
        return {k: lists[k] if k in lists else c[k] for k in GATEWAY_KEYS}
    d = {k: v for k, v in c.items() if k not in ("prompt", "completion", "logprobs")}
    d.update(lists)
    return d


def payload_bytes(c):
    return 4 * (len(c["prompt"]) + len(c["completion"]) + len(c["logprobs"]))


def percentiles(ns):
    a = np.asarray(ns, dtype=np.float64) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def dir_bytes(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def result(name, lat_ns, calls, nbytes, seconds, cpu_seconds, disk=None):
    """One backend's row. `cpu_seconds`: this process's CPU time (every
    thread: trajlog's writer, aiosqlite's worker) over the timed part, a
    figure that a busy or stolen-from machine distorts less than calls/s."""
    p50, p99 = percentiles(lat_ns)
    return {
        "backend": name,
        "calls": calls,
        "calls_per_s": calls / seconds,
        "cpu_us_per_call": cpu_seconds / calls * 1e6,
        "token_mb_per_s": nbytes / seconds / 1e6,
        "append_p50_us": p50,
        "append_p99_us": p99,
        "bytes_on_disk": disk,
    }


# ---------------------------------------------------------------------------


def bench_trajlog_append(calls, dicts, root, use_numpy):
    path = os.path.join(root, "trajlog-numpy" if use_numpy else "trajlog-list")
    store = trajlog.Store(path, durability="group")
    lat = []
    t0, c0 = time.perf_counter(), time.process_time()
    for c, d in zip(calls, dicts):
        if use_numpy:
            t = time.perf_counter_ns()
            store.append(
                trace_id=c["trace_id"], session_id=c["session_id"], prompt_token_ids=c["prompt"],
                completion_token_ids=c["completion"], logprobs=c["logprobs"], timestamp=c["timestamp"],
                model=c["model"], weight_version=c["weight_version"], messages=c["messages"],
                response_message=c["response_message"], metadata=c.get("metadata"), finish_reason=c["finish_reason"],
                latency_ms=c["latency_ms"], **{k: c[k] for k in GATEWAY_EXTRA if k in c and k != "routing_matrices"},
            )
        else:
            t = time.perf_counter_ns()
            store.append_trace(d)
        lat.append(time.perf_counter_ns() - t)
    store.flush()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    store.close()
    name = "trajlog append (numpy)" if use_numpy else "trajlog append_trace (lists)"
    return result(name, lat, len(calls), sum(map(payload_bytes, calls)), seconds, cpu, dir_bytes(path)), path


async def time_store_trace(store, dicts):
    """Per-call latencies (ns) and total seconds of the gateway protocol's
    `store_trace`, awaited one call at a time as the gateway does; and the
    process's CPU seconds."""
    lat = []
    t0, c0 = time.perf_counter(), time.process_time()
    for d in dicts:
        t = time.perf_counter_ns()
        await store.store_trace(d["trace_id"], d["session_id"], d)
        lat.append(time.perf_counter_ns() - t)
    return lat, time.perf_counter() - t0, time.process_time() - c0


async def time_store_trace_concurrent(store, dicts):
    """`store_trace` from every session at once: one coroutine per session
    awaiting its calls in order (an agent waits for each answer), all
    sessions concurrently, as a gateway serving them does. Per-call
    latencies (ns), total seconds and the process's CPU seconds."""
    by_session = {}
    for d in dicts:
        by_session.setdefault(d["session_id"], []).append(d)
    lat = []

    async def session(ds):
        for d in ds:
            t = time.perf_counter_ns()
            await store.store_trace(d["trace_id"], d["session_id"], d)
            lat.append(time.perf_counter_ns() - t)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(session(ds) for ds in by_session.values()))
    return lat, time.perf_counter() - t0, time.process_time() - c0


async def bench_concurrent(calls, dicts, root):
    """Both stores' `store_trace` with every session concurrent."""
    rows = []
    path = os.path.join(root, "trajlog-gateway-concurrent")
    store = TrajlogTraceStore(path)
    lat, seconds, cpu = await time_store_trace_concurrent(store, dicts)
    await store.close()
    n = len({d["session_id"] for d in dicts})
    rows.append(result(f"trajlog store_trace, {n} sessions concurrently (durable each)", lat, len(calls),
                       sum(map(payload_bytes, calls)), seconds, cpu, dir_bytes(path)))
    path = os.path.join(root, "rllm-sqlite-concurrent.db")
    sql = RllmStyleSqliteStore(path)
    await sql.open()
    lat, seconds, cpu = await time_store_trace_concurrent(sql, dicts)
    await sql.close()
    rows.append(result(f"aiosqlite, {n} sessions concurrently (commit each)", lat, len(calls),
                       sum(map(payload_bytes, calls)), seconds, cpu, sum(os.path.getsize(p) for p in glob.glob(path + "*"))))
    return rows


async def bench_gateway_protocol(calls, dicts, root):
    path = os.path.join(root, "trajlog-gateway")
    store = TrajlogTraceStore(path)
    lat, seconds, cpu = await time_store_trace(store, dicts)
    await store.close()
    return result("trajlog TrajlogTraceStore.store_trace (durable each)", lat, len(calls), sum(map(payload_bytes, calls)), seconds, cpu, dir_bytes(path))


async def bench_sqlite(calls, dicts, root):
    path = os.path.join(root, "rllm-sqlite.db")
    store = RllmStyleSqliteStore(path)
    await store.open()
    lat, seconds, cpu = await time_store_trace(store, dicts)
    return result("aiosqlite, rLLM gateway style (commit each)", lat, len(calls), sum(map(payload_bytes, calls)), seconds, cpu), store, path


def bench_big_call(root, repeats):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 150_000, 10_000, dtype=np.uint32)
    completion = rng.integers(0, 150_000, 500, dtype=np.uint32)
    logprobs = (-rng.exponential(0.5, 500)).astype(np.float32)
    lists = (prompt.tolist(), completion.tolist(), logprobs.astype(np.float64).tolist())
    out = {}
    for kind in ("list", "numpy"):
        store = trajlog.Store(os.path.join(root, f"big-{kind}"))
        lat = []
        for i in range(repeats):
            p, c, l = lists if kind == "list" else (prompt, completion, logprobs)
            t = time.perf_counter_ns()
            store.append(trace_id=f"big-{i}", session_id=f"big-{i}", prompt_token_ids=p, completion_token_ids=c, logprobs=l)
            lat.append(time.perf_counter_ns() - t)
        store.flush()
        store.close()
        out[kind] = percentiles(lat)
    return out


def bench_reads(calls, trajlog_path):
    sessions = sorted({c["session_id"] for c in calls})
    total = sum(map(payload_bytes, calls))
    out = {}
    store = trajlog.Store(trajlog_path, read_only=True)
    t0 = time.perf_counter()
    touched = 0
    for s in sessions:
        for call in store.session(s):
            # The arrays a trainer uses: views (the prompt materialized when stored as a delta).
            touched += len(call.prompt_token_ids) + len(call.completion_token_ids) + len(call.logprobs)
    seconds = time.perf_counter() - t0
    assert touched * 4 == total, "read back every token"
    out["trajlog session() numpy"] = (total / seconds / 1e6, seconds / len(sessions) * 1e3)
    t0 = time.perf_counter()
    for s in sessions:
        # Kept, as a caller of get_session_traces keeps them (so that the
        # garbage collector sees them as it would there).
        dicts = [call.to_dict() for call in store.session(s)]
        assert len(dicts) > 0
    seconds = time.perf_counter() - t0
    out["trajlog session() to_dict lists"] = (total / seconds / 1e6, seconds / len(sessions) * 1e3)
    # What TrajlogTraceStore.get_session_traces returns: the same dicts, each
    # prompt rebuilt from the call before it.
    t0 = time.perf_counter()
    n = 0
    for s in sessions:
        n += len(store.session_dicts(s))
    seconds = time.perf_counter() - t0
    assert n == len(calls)
    out["trajlog session_dicts (get_session_traces)"] = (total / seconds / 1e6, seconds / len(sessions) * 1e3)
    store.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="first prompt of a session; later prompts grow")
    ap.add_argument("--completion-tokens", type=int, default=400, help="mean completion length")
    ap.add_argument("--big-call-repeats", type=int, default=200)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--shape", choices=SHAPES, default="gateway",
                    help="what each trace carries besides its tokens: the rLLM gateway's record of a non-streaming "
                         "call (chat history with tool calls, raw request, vLLM's raw response; the default), of a "
                         "streaming call (raw_response null), or lean (one-line messages, no raw bodies)")
    ap.add_argument("--dir", help="where to write the stores (default: a new temporary directory, removed after)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)

    root = args.dir or tempfile.mkdtemp(prefix="trajlog-pybench-")
    os.makedirs(root, exist_ok=True)
    calls = workload(args.sessions, args.steps, args.prompt_tokens, args.completion_tokens, args.seed, args.shape)
    dicts = [as_gateway_dict(c) for c in calls]
    total = sum(map(payload_bytes, calls))
    json_bytes = sum(len(json.dumps(d)) for d in dicts)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(f"workload: {len(calls)} calls in {args.sessions} sessions × {args.steps} steps, {args.shape} shape, "
        f"{total / 1e6:.1f} MB of token payload, {json_bytes / 1e6:.1f} MB as json.dumps text")

    rows = []
    log("trajlog append_trace (lists)…")
    r, list_path = bench_trajlog_append(calls, dicts, root, use_numpy=False)
    rows.append(r)
    log("trajlog append (numpy)…")
    r, _ = bench_trajlog_append(calls, dicts, root, use_numpy=True)
    rows.append(r)
    log("trajlog gateway store_trace…")
    rows.append(asyncio.run(bench_gateway_protocol(calls, dicts, root)))

    async def sqlite_part():
        log("aiosqlite rLLM-style store_trace…")
        r, store, path = await bench_sqlite(calls, dicts, root)
        log("reads…")
        sessions = sorted({c["session_id"] for c in calls})
        t0 = time.perf_counter()
        n = 0
        for s in sessions:
            n += len(await store.get_session_traces(s))
        seconds = time.perf_counter() - t0
        assert n == len(calls)
        await store.close()
        r["bytes_on_disk"] = sum(os.path.getsize(p) for p in glob.glob(path + "*"))
        return r, (total / seconds / 1e6, seconds / len(sessions) * 1e3)

    sqlite_row, sqlite_read = asyncio.run(sqlite_part())
    rows.append(sqlite_row)
    log("store_trace from every session concurrently…")
    rows.extend(asyncio.run(bench_concurrent(calls, dicts, root)))
    reads = bench_reads(calls, list_path)
    reads["aiosqlite get_session_traces (json.loads)"] = sqlite_read
    log("10k-token call…")
    big = bench_big_call(root, args.big_call_repeats)

    report = {
        "workload": {"calls": len(calls), "sessions": args.sessions, "steps": args.steps, "shape": args.shape,
                     "token_bytes": total, "json_bytes": json_bytes},
        "append": rows,
        "big_call_append_us": {k: {"p50": v[0], "p99": v[1]} for k, v in big.items()},
        "session_read": {k: {"token_mb_per_s": v[0], "ms_per_session": v[1]} for k, v in reads.items()},
    }
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    base = sqlite_row
    print(f"\nappend path, {len(calls)} calls ({args.shape} shape), {total / 1e6:.1f} MB token payload, "
          f"{json_bytes / 1e6:.1f} MB as json.dumps text")
    print(f"{'backend':<62} {'calls/s':>9} {'token MB/s':>10} {'p50 µs':>9} {'p99 µs':>9} {'CPU µs/call':>11} {'on disk':>10} {'vs sqlite':>9}")
    concurrent_base = rows[-1]  # aiosqlite with every session concurrent
    for r in rows:
        disk = f"{r['bytes_on_disk'] / 1e6:.1f} MB" if r["bytes_on_disk"] is not None else "-"
        b = concurrent_base if "concurrently" in r["backend"] else base  # like against like
        print(f"{r['backend']:<62} {r['calls_per_s']:>9.0f} {r['token_mb_per_s']:>10.1f} {r['append_p50_us']:>9.1f} {r['append_p99_us']:>9.1f} {r['cpu_us_per_call']:>11.0f} {disk:>10} {r['calls_per_s'] / b['calls_per_s']:>8.1f}×")
    print("\none 10k-token call (10,000 prompt + 500 completion tokens), trajlog append")
    for k, (p50, p99) in big.items():
        print(f"  {k:<6} p50 {p50:8.1f} µs   p99 {p99:8.1f} µs")
    print("\nsession read (every session, oldest first)")
    sq = reads["aiosqlite get_session_traces (json.loads)"][0]
    for k, (mbs, ms) in reads.items():
        print(f"  {k:<45} {mbs:9.1f} token MB/s  {ms:8.2f} ms/session  {mbs / sq:6.1f}× sqlite")
    return report


if __name__ == "__main__":
    main()
