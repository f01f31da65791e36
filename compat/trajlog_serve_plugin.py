"""A pytest plugin that runs rLLM's model-gateway test suite against `trajlog serve`.

rLLM's tests build their gateway with two names imported when a test module
loads: `rllm_model_gateway.create_app(config)` (an ASGI app, driven in-process
through `httpx.ASGITransport`) and `tests.helpers.gateway_server.GatewayServer`
(which serves such an app over real HTTP). Loaded with `-p`, before the test
modules are imported, this plugin replaces both:

- `create_app(config)` returns a small ASGI app that starts `trajlog serve`
  (configured from the same `GatewayConfig`) on first use and forwards every
  request to it over loopback, streaming responses chunk by chunk;
- `GatewayServer(app)` starts that `trajlog serve` process itself and gives
  its URL, so the real-HTTP tests talk to the Rust server with no Python hop.

The tests themselves are rLLM's, unchanged (see compat/README.md).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import yaml
import rllm_model_gateway
import rllm_model_gateway.server
import tests.helpers.gateway_server as gateway_server_module

_ORIGINAL_GATEWAY_SERVER = gateway_server_module.GatewayServer
_REPO = Path(__file__).resolve().parent.parent
_LISTENING = "trajlog serve: listening on "
_START_TIMEOUT_S = 60.0


def _binary() -> str:
    path = os.environ.get("TRAJLOG_BIN") or str(_REPO / "target" / "release" / "trajlog")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"trajlog binary not found at {path}; build it (cargo build --release) or set TRAJLOG_BIN")
    return path


def _serve_yaml(config) -> str:
    """rLLM's `GatewayConfig`, every key as rLLM holds it, as `trajlog serve`'s YAML config.

    `trajlog serve --config gateway.yaml` reads rLLM's keys itself (docs/serve.md):
    `sync_traces` picks the durability, `health_check_interval` the health checks.
    The store is always a fresh trajlog directory given with `--store DIR`, which
    overrides rLLM's `store_worker`/`db_path` (trajlog logs that it ignores them).
    """
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


_RUNNING: list["_ServeProcess"] = []


class _ServeProcess:
    """One `trajlog serve` process with its own temporary store."""

    def __init__(self, config, host: str, port: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="trajlog-serve-")
        config_path = Path(self.tmp) / "gateway.yaml"
        config_path.write_text(_serve_yaml(config))
        store = Path(self.tmp) / "store"
        self.log_path = Path(self.tmp) / "serve.log"
        self.log = open(self.log_path, "wb")
        cmd = [_binary(), "serve", "--store", str(store), "--host", host, "--port", str(port)]
        cmd += ["--config", str(config_path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log)
        _RUNNING.append(self)
        self.url = self._wait_listening()
        # Keep draining stdout so the server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_listening(self) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").strip()
                if line.startswith(_LISTENING):
                    found.append(line[len(_LISTENING) :])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(_START_TIMEOUT_S)
        if not found:
            self.stop()
            raise RuntimeError(f"trajlog serve did not start; its log:\n{self.log_path.read_text(errors='replace')}")
        return found[0].rstrip("/")

    def _drain(self) -> None:
        if self.proc.stdout is not None:
            for _ in self.proc.stdout:
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self in _RUNNING:
            _RUNNING.remove(self)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


atexit.register(_stop_all)

# Response headers that belong to one hop, not to the forwarded response.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class _ProxyView:
    """What rLLM's tests read from `app.state.proxy`."""

    def __init__(self, app: "TrajlogApp") -> None:
        self._app = app

    @property
    def weight_version(self):
        url = self._app.start() + "/admin/weight_version"
        return httpx.get(url, timeout=30).json().get("weight_version")


class TrajlogApp:
    """An ASGI app standing for `trajlog serve` configured by `config`."""

    def __init__(self, config) -> None:
        self.config = config
        self._server: _ServeProcess | None = None
        self._lock = threading.Lock()
        self.state = SimpleNamespace(proxy=_ProxyView(self))

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        with self._lock:
            if self._server is None:
                self._server = _ServeProcess(self.config, host, port)
            return self._server.url

    def stop(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        base = self.start()
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope.get("raw_path") or scope["path"].encode()
        path = path.split(b"?", 1)[0]
        url = base + path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            response = await client.send(request, stream=True)
            try:
                out_headers = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in response.headers.multi_items()
                    if k.lower() not in _HOP_HEADERS
                ]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await response.aclose()


def create_app(config) -> TrajlogApp:
    return TrajlogApp(config)


class GatewayServer:
    """`tests.helpers.gateway_server.GatewayServer`, serving with `trajlog serve`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._fallback = None if isinstance(app, TrajlogApp) else _ORIGINAL_GATEWAY_SERVER(app, host, port)
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._fallback is not None:
            return self._fallback.url
        if self._url is None:
            raise RuntimeError("GatewayServer.url before start()")
        return self._url

    def start(self) -> None:
        if self._fallback is not None:
            self._fallback.start()
            return
        self._url = self.app.start(self.host, self.port)

    def stop(self) -> None:
        if self._fallback is not None:
            self._fallback.stop()
            return
        self.app.stop()


rllm_model_gateway.create_app = create_app
rllm_model_gateway.server.create_app = create_app
gateway_server_module.GatewayServer = GatewayServer

# Tests of rLLM's own Python classes (URL splitting and config models), not of
# the server: they would pass whatever serves the HTTP API, so they are left out.
_RLLM_INTERNALS = ("TestUrlSplitting", "TestWorkerConfigAutoSplit", "TestBuildUrl", "TestWorkerInfoAutoSplit")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (drop if any(f"::{name}::" in item.nodeid for name in _RLLM_INTERNALS) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_unconfigure(config):
    _stop_all()

