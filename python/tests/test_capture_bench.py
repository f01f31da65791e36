"""The Python capture benchmark (benches/python_capture.py) runs end to end
on a tiny workload and reports every figure it promises."""

import importlib.util
from pathlib import Path


def test_capture_benchmark_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benches" / "python_capture.py"
    spec = importlib.util.spec_from_file_location("python_capture", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--sessions", "2", "--steps", "3", "--prompt-tokens", "200", "--big-call-repeats", "5", "--json"]
    report = bench.main(args + ["--dir", str(tmp_path / "gateway")])
    assert report["workload"]["calls"] == 6
    assert report["workload"]["shape"] == "gateway"
    names = [r["backend"] for r in report["append"]]
    assert sum(n.startswith("aiosqlite") for n in names) == 2 and sum(n.startswith("trajlog") for n in names) == 4
    assert sum("concurrently" in n for n in names) == 2
    for r in report["append"]:
        assert r["calls"] == 6 and r["calls_per_s"] > 0 and r["append_p99_us"] >= r["append_p50_us"] > 0
        assert r["cpu_us_per_call"] > 0
        assert r["bytes_on_disk"] > 0
    assert set(report["big_call_append_us"]) == {"list", "numpy"}
    assert len(report["session_read"]) == 4
    # The lean traces carry the same tokens and much less besides.
    lean = bench.main(args + ["--shape", "lean", "--dir", str(tmp_path / "lean")])
    assert lean["workload"]["shape"] == "lean"
    assert lean["workload"]["token_bytes"] == report["workload"]["token_bytes"]
    assert lean["workload"]["json_bytes"] < report["workload"]["json_bytes"]
