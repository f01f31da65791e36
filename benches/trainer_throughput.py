#!/usr/bin/env python3
"""The trainer side: reading `trajectories` shards into torch tensors, and
how much of a batch is padding.

    .venv/bin/python benches/trainer_throughput.py            # the default workload (~1 min on 2 cores)
    .venv/bin/python benches/trainer_throughput.py --sessions 4000 --json
    .venv/bin/python benches/trainer_throughput.py --smoke    # tiny, for tests

Builds a store of multi-turn sessions through `trajlog.Store.append` (1 to
`--turns-max` calls per session; the first prompt 200–2,000 tokens, each later
prompt the previous context plus a 20–200-token tool result; completions
log-normal around `--completion-tokens`; float32 logprobs; GRPO groups of
`--group-size` rollouts), compacts it, then measures, over the same Parquet:

  * `trajlog.data.TrajectoryDataset` in a torch DataLoader with each of
    `--workers` (0, 2, 4): batch_size=None (a dict of tensors per sample), and
    padded batches of `--batch-size` (`collate(mode="pad")`; from a worker,
    a sample or batch crosses as one slot of the dataset's shared arena, and
    torch's DataLoader still pays a message round trip per item, so batch in
    the workers); and
    "decode only", batches of `--batch-size` whose collate_fn returns only
    their counts: the samples are decoded but nothing crosses to the trainer,
    the most workers can give on this machine;
  * Hugging Face `datasets`: `load_dataset("parquet")` (its Arrow cache build
    timed apart), `set_format("torch")`, iterating rows;
  * plain `pyarrow`: `iter_batches`, a `torch.from_numpy` per list cell.

Each reader is timed over full passes after its setup (the median of
`--repeat`, 3 by default; the worker start-up of a DataLoader is inside the
pass: a trainer pays it every epoch); samples/s and tokens/s (tokens = all of
`token_ids`), and the CPU seconds of this (the trainer's) process in the pass:
with workers, what the data costs the process that drives the GPU. Then the padding waste (padding
tokens / all tokens) of fixed-size batches padded to their longest sample,
against token-balanced micro-batches (`token_budget`, each counted as padded to
the whole budget, the static-shape worst case; a micro-batch over the budget —
a lone sample or GRPO group longer than it — counts at its own size and is
reported), over `--world` ranks, beside the bound no packing beats: ceil(a
step's tokens / (world x budget)) micro-batches per rank.
Fixed seeds; the store is built in a temporary directory (or `--dir`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import tempfile
import time

import numpy as np

# The installed package (scripts/test.sh installs it into .venv with pip).
import trajlog  # noqa: E402
from trajlog.data import TrajectoryDataset  # noqa: E402


def build_store(path: str, args) -> dict:
    rng = np.random.default_rng(args.seed)
    calls = trajectories = 0
    with trajlog.Store(path, durability="buffered") as store:
        for s in range(args.sessions):
            sid = f"task-{s // args.group_size}:{s % args.group_size}"
            prompt = rng.integers(0, 150_000, size=int(rng.integers(200, 2000))).astype(np.uint32)
            for turn in range(int(rng.integers(1, args.turns_max + 1))):
                n = int(np.clip(rng.lognormal(np.log(args.completion_tokens), 0.5), 8, 4 * args.completion_tokens))
                completion = rng.integers(0, 150_000, size=n).astype(np.uint32)
                logprobs = (-rng.exponential(0.5, size=n)).astype(np.float32)
                store.append(trace_id=f"{sid}/{turn}", session_id=sid, prompt_token_ids=prompt,
                             completion_token_ids=completion, logprobs=logprobs, timestamp=float(turn))
                calls += 1
                tool = rng.integers(0, 150_000, size=int(rng.integers(20, 200))).astype(np.uint32)
                prompt = np.concatenate([prompt, completion, tool])
            store.set_reward(float(rng.random()), session_id=sid)
            store.seal(sid)
            trajectories += 1
        store.flush()
        store.compact()
    return {"sessions": args.sessions, "calls": calls}


REPEAT = 3  # passes per reader; the median is reported (set by --repeat)


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn, repeat=1):
    """(fn's result, median seconds over `repeat` calls, this process's CPU
    seconds in that call: with DataLoader workers, what is left to the
    trainer's own process)."""
    runs = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), _self_cpu()
        out = fn()
        runs.append((time.perf_counter() - t0, _self_cpu() - c0))
    secs, cpu = sorted(runs)[len(runs) // 2]
    return out, secs, cpu


def _count(batch):
    """A collate_fn that hands over nothing but the batch's size and tokens."""
    return len(batch), sum(int(s["token_ids"].shape[0]) for s in batch)


def read_trajlog(shards: str, workers: int, batch_size=None, decode_only=False):
    """One pass; batch_size None: a dict of tensors per sample; else padded
    batches (`collate(mode="pad")`, tokens counted without the padding), or
    with `decode_only` batches reduced to their counts in the worker (what
    workers can reach when handing a batch over costs nothing)."""
    import functools

    import torch

    from trajlog.data import collate

    def run():
        n = tokens = 0
        ds = TrajectoryDataset(shards, seed=0, columns=["token_ids", "loss_mask", "logprobs"])
        pad = _count if decode_only else functools.partial(collate, mode="pad")
        loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                             collate_fn=None if batch_size is None else pad)
        for item in loader:
            if decode_only:
                n += item[0]
                tokens += item[1]
            elif batch_size is None:
                n += 1
                tokens += item["token_ids"].shape[0]
            else:
                n += item["token_ids"].shape[0]
                # numpy, not torch: a torch reduction this size fans out to its
                # intra-op threads, and on a busy 2-core machine waiting for them
                # cost ~1 ms a batch, more than the batch itself
                tokens += int(item["attention_mask"].numpy().sum())
        return n, tokens

    return timed(run, REPEAT)


def read_hf(shards: str, cache: str):
    from datasets import load_dataset

    files = sorted(glob.glob(os.path.join(shards, "*.parquet")))
    data, load_s, _ = timed(lambda: load_dataset("parquet", data_files=files, split="train", cache_dir=cache))
    data = data.select_columns(["token_ids", "loss_mask", "logprobs"]).with_format("torch")

    def run():
        n = tokens = 0
        for row in data:
            n += 1
            tokens += row["token_ids"].shape[0]
        return n, tokens

    return timed(run, REPEAT), load_s


def read_pyarrow(shards: str):
    import warnings

    import pyarrow.parquet as pq
    import torch

    # Arrow's buffers are read-only; torch warns once that it cannot mark
    # tensors so. Nothing here writes to them.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def run():
        n = tokens = 0
        for f in sorted(glob.glob(os.path.join(shards, "*.parquet"))):
            for batch in pq.ParquetFile(f).iter_batches(columns=["token_ids", "loss_mask", "logprobs"]):
                cols = [batch.column(i) for i in range(3)]
                offsets = [c.offsets.to_numpy() for c in cols]
                values = [c.values.to_numpy(zero_copy_only=True) for c in cols]
                for r in range(batch.num_rows):
                    t = torch.from_numpy(values[0][offsets[0][r] : offsets[0][r + 1]].astype(np.int64))
                    for k in (1, 2):
                        torch.from_numpy(values[k][offsets[k][r] : offsets[k][r + 1]])
                    n += 1
                    tokens += t.shape[0]
        return n, tokens

    return timed(run, REPEAT)


def padding_waste(shards: str, args) -> list:
    """Padding tokens / all tokens: fixed-size batches vs token-balanced micro-batches."""
    rows = []
    lengths = []
    for r in range(args.world):
        ds = TrajectoryDataset(shards, rank=r, world_size=args.world, seed=0, columns=["call_starts", "completion_lens"])
        lengths.append([int(s["call_starts"][-1] + s["completion_lens"][-1]) for s in ds])
    real = padded = 0
    for ls in lengths:
        for i in range(0, len(ls), args.batch_size):
            batch = ls[i : i + args.batch_size]
            real += sum(batch)
            padded += len(batch) * max(batch)
    rows.append({"batching": f"fixed {args.batch_size} samples, padded to the longest", "micro_batches": sum(-(-len(ls) // args.batch_size) for ls in lengths), "over_budget": 0, "waste_bound": None,
                 "waste": (padded - real) / padded})
    for keep in (False, True):
        real = padded = count = over = 0
        per_rank, step_tokens = [], {}
        for r in range(args.world):
            ds = TrajectoryDataset(shards, rank=r, world_size=args.world, seed=0, token_budget=args.token_budget,
                                   samples_per_step=args.samples_per_step, keep_groups=keep,
                                   columns=["call_starts", "completion_lens"])
            per_rank.append(ds.micro_batches_per_step())
            step_of = np.repeat(np.arange(len(per_rank[-1])), per_rank[-1])
            for i, mb in enumerate(ds):
                t = sum(int(s["call_starts"][-1] + s["completion_lens"][-1]) for s in mb)
                real += t
                padded += max(t, args.token_budget)  # an over-budget micro-batch: its own size
                count += 1
                over += t > args.token_budget
                step_tokens[step_of[i]] = step_tokens.get(step_of[i], 0) + t
        assert all(p == per_rank[0] for p in per_rank), "equal micro-batch counts per step"
        # No packing does better than ceil(step tokens / (world x budget))
        # micro-batches per rank per step (over-budget samples aside).
        bound = sum(args.world * -(-t // (args.world * args.token_budget)) * args.token_budget for t in step_tokens.values())
        rows.append({"batching": f"token budget {args.token_budget}, FFD" + (", groups kept" if keep else ""),
                     "micro_batches": count, "over_budget": over, "waste": (padded - real) / padded,
                     "waste_bound": (bound - real) / bound})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=3000, help="sessions (one trajectory each)")
    p.add_argument("--turns-max", type=int, default=4, help="calls per session: 1 to this")
    p.add_argument("--completion-tokens", type=int, default=400, help="median completion length")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per GRPO group")
    p.add_argument("--workers", default="0,2,4", help="DataLoader num_workers to measure, comma-separated")
    p.add_argument("--batch-size", type=int, default=8, help="fixed-size batches for the padding comparison")
    p.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--samples-per-step", type=int, default=512, help="samples per optimizer step over all ranks (64 prompts x 8 rollouts)")
    p.add_argument("--world", type=int, default=4, help="ranks for the padding comparison")
    p.add_argument("--repeat", type=int, default=3, help="passes per reader (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="build the store here (default: a temporary directory, removed)")
    p.add_argument("--skip-hf", action="store_true", help="leave Hugging Face datasets out")
    p.add_argument("--smoke", action="store_true", help="tiny and fast (for the test suite)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns_max, args.completion_tokens, args.workers = 24, 3, 40, "0,2"
        args.token_budget, args.samples_per_step, args.world, args.group_size = 1024, 8, 2, 4
        args.repeat = 1
    workers = [int(w) for w in args.workers.split(",") if w != ""]
    global REPEAT
    REPEAT = max(args.repeat, 1)

    tmp = None
    root = args.dir
    if root is None:
        tmp = tempfile.mkdtemp(prefix="trainer-bench-")
        root = os.path.join(tmp, "store")
    try:
        workload, build_s, _ = timed(lambda: build_store(root, args))
        shards = os.path.join(root, "shards", "trajectories")
        parquet_bytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(shards, "*.parquet")))
        workload.update(build_and_compact_s=round(build_s, 2), parquet_mb=round(parquet_bytes / 1e6, 2))
        results = []

        def add(reader, setup_s, run):
            (n, tokens), secs, cpu = run
            results.append({"reader": reader, "samples": n, "tokens": tokens, "setup_s": setup_s, "pass_s": secs,
                            "main_cpu_s": cpu, "samples_per_s": n / secs, "tokens_per_s": tokens / secs})

        import warnings

        with warnings.catch_warnings():  # torch warns when workers outnumber cores: that is measured here
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            for w in workers:
                add(f"trajlog, {w} workers, per sample", 0.0, read_trajlog(shards, w))
            for w in workers:
                add(f"trajlog, {w} workers, padded batches of {args.batch_size}", 0.0, read_trajlog(shards, w, args.batch_size))
            for w in workers:
                add(f"trajlog, {w} workers, decode only", 0.0, read_trajlog(shards, w, args.batch_size, decode_only=True))
        if not args.skip_hf:
            run, load_s = read_hf(shards, os.path.join(tmp or root, "hf-cache"))
            add("HF datasets (set_format torch)", load_s, run)
        add("pyarrow iter_batches + from_numpy", 0.0, read_pyarrow(shards))
        workload.update(trajectories=results[0]["samples"], tokens=results[0]["tokens"])
        report = {"workload": workload, "readers": results, "padding": padding_waste(shards, args)}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        w = report["workload"]
        print(f"workload: {w['sessions']} sessions, {w['calls']} calls, {w['trajectories']} trajectories, "
              f"{w['tokens'] / 1e6:.2f} M tokens, {w['parquet_mb']} MB of trajectories Parquet "
              f"(store built and compacted in {w['build_and_compact_s']} s)")
        print()
        print(f"| {'reader':<40} | {'setup s':>8} | {'pass s':>7} | {'main CPU s':>10} | {'samples/s':>10} | {'M tokens/s':>10} |")
        print(f"|{'-' * 42}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
        for r in report["readers"]:
            print(f"| {r['reader']:<40} | {r['setup_s']:>8.2f} | {r['pass_s']:>7.2f} | {r['main_cpu_s']:>10.2f} | {r['samples_per_s']:>10.0f} | {r['tokens_per_s'] / 1e6:>10.2f} |")
        print()
        print(f"padding waste over {args.world} ranks (padding tokens / all tokens):")
        print(f"| {'batching':<44} | {'micro-batches':>13} | {'over budget':>11} | {'waste':>6} | {'bound':>6} |")
        print(f"|{'-' * 46}|{'-' * 15}|{'-' * 13}|{'-' * 8}|{'-' * 8}|")
        for r in report["padding"]:
            bound = "" if r["waste_bound"] is None else f"{100 * r['waste_bound']:.1f}%"
            print(f"| {r['batching']:<44} | {r['micro_batches']:>13} | {r['over_budget']:>11} | {100 * r['waste']:>5.1f}% | {bound:>6} |")
    return report


if __name__ == "__main__":
    main()
