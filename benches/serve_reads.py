"""CPU and wall time of `trajlog serve`'s trace reads, two builds side by side.

    python benches/serve_reads.py BASELINE_TRAJLOG TRAJLOG [STORE] [--rounds N]

STORE (default: a fresh one, `trajlog generate --sessions 64 --steps 8
--shape gateway`) is copied for each run; each run starts `TRAJLOG serve` on
the copy, reads every session's traces (`GET /sessions/{sid}/traces`) five
times over one connection, and reports the serve process's CPU
(`/proc/PID/stat`, user + system) and the wall time per session read. The
two builds alternate, `--rounds` times (default 3), and the answers of both
must be the same bytes (md5 of every session's answer), or the script fails.
Linux only. Standard library only."""

import argparse
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(binary, store, scratch):
    copy = os.path.join(scratch, "copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(store, copy)
    p = subprocess.Popen(
        [binary, "serve", "--store", copy, "--port", "0", "--worker", "http://127.0.0.1:9/v1", "--log-level", "error"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        host, port = p.stdout.readline().strip().rsplit("http://", 1)[1].split(":")
        c = http.client.HTTPConnection(host, int(port))
        c.request("GET", "/sessions")
        sids = sorted(s["session_id"] for s in json.loads(c.getresponse().read()))
        digest, reads, size = hashlib.md5(), 0, 0
        c0, t0 = cpu_seconds(p.pid), time.perf_counter()
        for round_ in range(5):
            for sid in sids:
                c.request("GET", f"/sessions/{sid}/traces")
                body = c.getresponse().read()
                if round_ == 0:
                    digest.update(body)
                reads, size = reads + 1, size + len(body)
        t1, c1 = time.perf_counter(), cpu_seconds(p.pid)
    finally:
        p.terminate()
        p.wait()
    return (c1 - c0) / reads * 1e3, (t1 - t0) / reads * 1e3, size / reads, digest.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline")
    ap.add_argument("trajlog")
    ap.add_argument("store", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        store = a.store
        if store is None:
            store = os.path.join(scratch, "store")
            subprocess.run(
                [a.trajlog, "generate", "--store", store, "--sessions", "64", "--steps", "8", "--shape", "gateway"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        digests = set()
        for _ in range(a.rounds):
            for name, binary in (("baseline", a.baseline), ("this build", a.trajlog)):
                cpu_ms, wall_ms, size, digest = run(binary, store, scratch)
                digests.add(digest)
                print(f"{name:10}  serve CPU {cpu_ms:6.2f} ms per session read  wall {wall_ms:6.2f} ms  {size / 1e6:.2f} MB", flush=True)
        if len(digests) != 1:
            sys.exit(f"the two builds answered differently: {sorted(digests)}")
        print("answers: the same bytes from both builds")


if __name__ == "__main__":
    main()
