"""The trajectories read benchmark (benches/trajectories_read.py) runs end to
end on two small stores, one compacted with the default `trajectories` row
groups and one whose row groups close at 64 rows whatever their bytes, and
reports their row groups as the files have them (the times are not judged:
they depend on the machine's load)."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq

import trajlog

ROOT = Path(__file__).resolve().parents[2]


def tiny_store(path, sessions):
    with trajlog.Store(path) as store:
        for s in range(sessions):
            sid = f"task-{s}:0"
            store.append(trace_id=f"{sid}/0", session_id=sid, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.5, -0.25])
            store.seal(sid)


def test_trajectories_read_benchmark(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("trajectories_read", ROOT / "benches" / "trajectories_read.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    default, rows_only = tmp_path / "default", tmp_path / "rows"
    tiny_store(default, 200)
    tiny_store(rows_only, 200)
    with trajlog.Store(default) as store:
        store.compact()
    candidates = (os.environ.get("TRAJLOG_BIN"), ROOT / "target/debug/trajlog", ROOT / "target/release/trajlog", shutil.which("trajlog"))
    cli = next((str(c) for c in candidates if c and Path(c).exists()), None)
    assert cli, "no trajlog binary (set TRAJLOG_BIN)"
    subprocess.run([cli, "compact", "--store", str(rows_only), "--trajectories-min-group-bytes", "0"], check=True, capture_output=True)
    report = bench.main([str(default), str(rows_only), "--repeat", "1"])
    out = capsys.readouterr().out
    for store in (default, rows_only):
        r = report[str(store)]
        files = sorted((store / "shards" / "trajectories").glob("*.parquet"))
        assert r["files"] == len(files) == 1
        meta = pq.ParquetFile(files[0]).metadata
        assert r["row_groups"] == meta.num_row_groups and r["footer_bytes"] == meta.serialized_size
        assert r["samples"] == 200 and r["pass_s"] > 0
        assert f"{store} median:" in out
    # 200 tiny trajectories are far below the default minimum: one row group.
    assert report[str(default)]["row_groups"] == 1
    assert report[str(rows_only)]["row_groups"] == 4  # 64, 64, 64, 8
