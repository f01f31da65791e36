#!/usr/bin/env python3
"""What a dataloader pays to open and read compacted stores' `trajectories`
shards: the files' row groups and footer bytes, the time pyarrow takes to read
every file's metadata, the time `TrajectoryDataset` takes to its first sample
and to a whole pass (default shuffle, every column), medians of `--repeat`
runs taken in turns, so that stores compacted by two builds compare in one run.

    .venv/bin/python benches/trajectories_read.py STORE [STORE ...] [--repeat 3]

Used for the `trajectories` row-group minimum (README, "Compaction"): 1M tiny
calls made by `trajlog generate --sessions 125000 --steps 8 --prompt-tokens 16
--completion-tokens 8 --tool-tokens 8 --shape lean`, a copy compacted by each
build.
"""
import argparse
import glob
import statistics
import time

import pyarrow.parquet as pq

from trajlog.data import TrajectoryDataset


def main(argv=None):
    """Print a line per store and run, then the medians; returns, per store,
    its row groups, footer bytes, samples and median times (seconds)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    shape = {}
    runs = {s: [] for s in args.stores}
    for _ in range(args.repeat):
        for store in args.stores:
            path = f"{store}/shards/trajectories"
            files = sorted(glob.glob(f"{path}/*.parquet"))
            t = time.perf_counter()
            metas = [pq.ParquetFile(f).metadata for f in files]
            meta_s = time.perf_counter() - t
            t = time.perf_counter()
            it = iter(TrajectoryDataset(path, seed=1))
            samples = 1 if next(it, None) is not None else 0
            first_s = time.perf_counter() - t
            samples += sum(1 for _ in it)
            pass_s = time.perf_counter() - t
            groups = sum(m.num_row_groups for m in metas)
            footer = sum(m.serialized_size for m in metas)
            runs[store].append((meta_s, first_s, pass_s))
            shape[store] = {"files": len(files), "row_groups": groups, "footer_bytes": footer, "samples": samples}
            print(
                f"{store}: {len(files)} files, {groups} row groups, {footer} footer bytes; metadata {meta_s * 1e3:.0f} ms, "
                f"first sample {first_s * 1e3:.0f} ms, pass {pass_s:.2f} s over {samples} samples",
                flush=True,
            )
    report = {}
    for store, r in runs.items():
        med = [statistics.median(x[i] for x in r) for i in range(3)]
        print(f"{store} median: metadata {med[0] * 1e3:.0f} ms, first sample {med[1] * 1e3:.0f} ms, pass {med[2]:.2f} s")
        report[store] = dict(shape[store], metadata_s=med[0], first_sample_s=med[1], pass_s=med[2])
    return report


if __name__ == "__main__":
    main()
