"""Real `fulcrum serve` replicas of the bundled model, and the router run in a thread of the test process so that
a test can read its pool and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from fulcrum.router.app import Router, RouterConfig, build_app
from fulcrum.router.pool import Pool
from fulcrum.utils.serve_process import free_port
from tests.servers import MODEL, start_server


@contextlib.contextmanager
def replica_env():
    """FULCRUM_REPLICA_PYTHONPATH runs the replicas from another checkout (while this tree's engine is mid-edit):
    the router under test only needs replicas that speak HTTP."""
    path = os.environ.get("FULCRUM_REPLICA_PYTHONPATH")
    old = os.environ.get("PYTHONPATH")
    if path:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if path:
            os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)


def start_replica(tmp_path, *args):
    with replica_env():
        return start_server(tmp_path, *args)


@pytest.fixture(scope="session")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    with ThreadPoolExecutor(2) as ex:
        servers = list(ex.map(lambda _: start_replica(tmp), range(2)))
    yield servers
    for s in servers:
        s.stop()


class RunningRouter:
    def __init__(self, router: Router, port: int, app=None):
        self.router, self.port, self.app = router, port, app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60, **kw)

    def requests_by_replica(self) -> dict[str, float]:
        out = {}
        for s in self.router.metrics.requests.collect()[0].samples:
            if s.name.endswith("_total"):
                out[s.labels["replica"]] = s.value
        return out

    def decisions(self) -> dict[str, float]:
        return {
            s.labels["reason"]: s.value
            for s in self.router.metrics.decisions.collect()[0].samples
            if s.name.endswith("_total")
        }


@contextlib.contextmanager
def run_router(urls, pool_kw=None, autoscaler=None, pool=None, **cfg):
    """`autoscaler`: a callable pool -> Autoscaler, run beside the router."""
    cfg.setdefault("model", MODEL)
    pool = pool or Pool(list(urls), **(pool_kw or {}))
    router = Router(pool, RouterConfig(**cfg))
    with serve_router(router, build_app(router, autoscaler(pool) if autoscaler else None)) as running:
        yield running


@contextlib.contextmanager
def router_process(tmp_path, *flags):
    """`fulcrum router FLAGS` as a process of its own on a free loopback port, up (its /health 200) before it is
    yielded as its base URL; stopped after."""
    port = free_port()
    cmd = [sys.executable, "-m", "fulcrum.cli", "router", "--port", str(port), *flags]
    with open(tmp_path / "router.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            assert time.time() < deadline, "the router did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def serve_router(router, app):
    """`app` (router/app.py's build_app over `router`) on a free loopback port, in a thread of this process."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the router did not start"
        time.sleep(0.05)
    try:
        yield RunningRouter(router, port, app)
    finally:
        server.should_exit = True
        thread.join(30)
