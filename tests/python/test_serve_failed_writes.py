"""`trajlog serve` when its store's writes fail, driven by real EFBIGs: the
running gateway's RLIMIT_FSIZE is lowered (`resource.prlimit`, SIGXFSZ
ignored) below its segment size, so a write past it fails and poisons the
store, and reopening it for writing fails too (preallocating the active
segment passes the limit), as after a full disk. Meanwhile the gateway
serves reads from a read-only open; once the limit is raised again it
reopens the store by itself and captures again. Verdicts are about what the
gateway answers; the waits are hang guards."""

import http.client
import json
import os
import resource
import subprocess
import time

import pytest

from conftest import trajlog_bin

pytestmark = pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux)")


def request(addr, method, path, body=None):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    c.request(method, path, body=None if body is None else json.dumps(body), headers={"content-type": "application/json"})
    r = c.getresponse()
    return r.status, r.read().decode()


def listening(proc):
    line = proc.stdout.readline()
    assert "listening on http://" in line, line
    return line.strip().rsplit("http://", 1)[1]


def wait_for(what, check, seconds=120):
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.05)


def chat(text):
    return {"model": "mock-model", "messages": [{"role": "user", "content": text}], "max_tokens": 3}


def test_reads_go_on_while_the_store_cannot_be_reopened_for_writing(tmp_path):
    binary = trajlog_bin()
    store = tmp_path / "store"
    config = tmp_path / "gateway.yaml"
    config.write_text("store_segment_bytes: 262144\nstore_zero_ahead_bytes: 0\n")
    mock = subprocess.Popen([binary, "mock-vllm", "--port", "0"], stdout=subprocess.PIPE, text=True)
    gw = None
    try:
        worker = f"http://{listening(mock)}/v1"
        # `exec` keeps the pid (so prlimit reaches the gateway) and the ignored SIGXFSZ.
        gw = subprocess.Popen(
            ["bash", "-c", f"trap '' XFSZ; exec '{binary}' serve --store '{store}' --config '{config}' "
                           f"--port 0 --worker {worker} --durability sync --log-level error"],
            stdout=subprocess.PIPE, text=True,
        )
        addr = listening(gw)
        status, body = request(addr, "POST", "/sessions/small/v1/chat/completions", chat("one"))
        assert status == 200, body

        limit = 128 << 10
        resource.prlimit(gw.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))  # the soft limit: no privilege needed
        medium = {"model": "mock-model", "prompt": [(i * 2654435761) % 50000 for i in range(40_000)], "max_tokens": 2}
        status, body = request(addr, "POST", "/sessions/medium/v1/completions", medium)
        assert status == 503 and "trace was not stored" in body, (status, body)

        # Reads: from a read-only open while the writable one keeps failing.
        traces = wait_for("reads from the read-only open", lambda: (lambda r: r[0] == 200 and json.loads(r[1]))(
            request(addr, "GET", "/sessions/small/traces")))
        assert [t["messages"][0]["content"] for t in traces] == ["one"]
        sent = lambda: next(l for l in request(addr, "GET", "/metrics")[1].splitlines()  # noqa: E731
                            if l.startswith('trajlog_serve_bytes_total{direction="request"}'))
        before = sent()
        status, body = request(addr, "POST", "/sessions/small/v1/chat/completions", chat("two"))
        assert status == 503 and "being reopened" in body and "not forwarded" in body, (status, body)
        assert sent() == before, "a call whose trace cannot be stored is not sent upstream"
        assert 'trajlog_serve_calls_total{outcome="store_unavailable"} 1' in request(addr, "GET", "/metrics")[1]
        status, body = request(addr, "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "unavailable", body
        assert "trajlog_serve_store_available 0" in request(addr, "GET", "/metrics")[1]

        resource.prlimit(gw.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_for("the writable reopen", lambda: request(addr, "GET", "/health")[0] == 200)
        status, body = request(addr, "POST", "/sessions/small/v1/chat/completions", chat("three"))
        assert status == 200, body
        contents = [t["messages"][0]["content"] for t in json.loads(request(addr, "GET", "/sessions/small/traces")[1])]
        assert contents == ["one", "three"], contents
        metrics = request(addr, "GET", "/metrics")[1]
        assert "trajlog_serve_store_reopens_total 1" in metrics and "trajlog_serve_store_available 1" in metrics
        assert request(addr, "GET", "/sessions/medium/traces") == (200, "[]")
        gw.terminate()
        assert gw.wait(60) == 0
        gw = None
    finally:
        for p in (gw, mock):
            if p is not None:
                p.kill()
                p.wait()
