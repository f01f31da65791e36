"""Shared fixtures: a store filled through `trajlog ingest` and compacted
through `trajlog compact`, plus the traces that went in."""

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def trajlog_bin() -> str:
    env = os.environ.get("TRAJLOG_BIN")
    if env:
        return env
    for profile in ("release", "debug"):
        candidate = ROOT / "target" / profile / "trajlog"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("trajlog")
    if found:
        return found
    pytest.fail("no trajlog binary: build it (cargo build --release) or set TRAJLOG_BIN")


def make_traces(seed: int = 7, sessions: int = 12, steps: int = 5):
    """Multi-turn rollouts in the rLLM gateway shape; every 4th session has a
    retokenization break. Logprobs are f32 values written as Python floats."""
    rng = random.Random(seed)
    traces = []
    for s in range(sessions):
        task, rollout = divmod(s, 4)
        sid = f"task-{task}:{rollout}"
        prompt = [rng.randrange(151000) for _ in range(rng.randrange(20, 60))]
        break_at = rng.randrange(1, steps) if s % 4 == 3 else None
        for step in range(steps):
            completion = [rng.randrange(151000) for _ in range(rng.randrange(3, 30))]
            logprobs = [float(np.float32(-rng.random() * 8)) for _ in completion]
            traces.append(
                {
                    "trace_id": f"{sid}/{step}",
                    "session_id": sid,
                    "timestamp": 1_700_000_000.0 + s + step * 0.01,
                    "model": "Qwen/Qwen3-8B",
                    "weight_version": step // 2,
                    "prompt_token_ids": list(prompt),
                    "completion_token_ids": completion,
                    "logprobs": logprobs,
                    "messages": [{"role": "user", "content": f"turn {step}"}],
                    "metadata": {"group_id": f"task-{task}"},
                    "finish_reason": "stop",
                    # As the rLLM gateway stores them; every 3rd call streamed (no raw response).
                    "raw_request": {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": f"turn {step}"}], "logprobs": True},
                    "raw_response": None
                    if step % 3 == 2
                    else {"id": f"chatcmpl-{s}-{step}", "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}},
                }
            )
            nxt = list(prompt)
            if break_at == step + 1 and len(completion) >= 4:
                p = len(completion) // 2
                nxt += completion[:p] + [(completion[p] + completion[p + 1]) % 151000 + 1] + completion[p + 2 :]
            else:
                nxt += completion
            nxt += [rng.randrange(151000) for _ in range(rng.randrange(1, 10))]
            prompt = nxt
    return traces


@pytest.fixture(scope="session")
def compacted_store(tmp_path_factory):
    traces = make_traces()
    store = tmp_path_factory.mktemp("store") / "s"
    exe = trajlog_bin()
    lines = "".join(json.dumps(t) + "\n" for t in traces)
    out = subprocess.run([exe, "ingest", "--store", str(store)], input=lines, capture_output=True, text=True, check=True)
    assert len(out.stdout.splitlines()) == len(traces), out.stderr
    subprocess.run([exe, "compact", "--store", str(store), "--older-than", "0"], capture_output=True, text=True, check=True)
    return store, {t["trace_id"]: t for t in traces}
