"""Where the autoscaler's replicas run. `local`: `fulcrum serve` processes on free loopback ports of this
machine. (`ray`: fulcrum/router/ray_backend.py.) A backend starts one replica and returns its URL once /health
answers, and stops one by URL with SIGTERM, so that the replica drains its in-flight requests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with _opener.open(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except Exception:  # refused, reset, timed out, a non-2xx
        return False


def launch(model: str | None, serve_args: list[str], host: str, log_path: Path | None, timeout: float):
    """A `fulcrum serve` child on a free port, returned once healthy: (process, url)."""
    port = free_port(host)
    cmd = [sys.executable, "-m", "fulcrum.cli", "serve", *([model] if model else []), "--host", host,
           "--port", str(port), *serve_args]  # fmt: skip
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child keeps its copy)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if log_path:
        out.close()
    url = f"http://{host}:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log = Path(log_path).read_text()[-4000:] if log_path else ""
            raise RuntimeError(f"fulcrum serve exited early ({' '.join(cmd)}):\n{log}")
        if healthy(url):
            return proc, url
        time.sleep(0.3)
    terminate(proc, 5)
    raise RuntimeError(f"fulcrum serve did not become healthy in {timeout:.0f} s ({' '.join(cmd)})")


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class LocalBackend:
    def __init__(self, model: str | None, serve_args: list[str], log_dir: str | Path | None = None,
                 start_timeout: float = 300, drain_timeout: float = 60):  # fmt: skip
        self.model, self.serve_args = model, serve_args
        self.log_dir = Path(log_dir) if log_dir else None
        self.start_timeout, self.drain_timeout = start_timeout, drain_timeout
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> str:
        log_path = self.log_dir / f"replica-{len(self.procs)}-{time.time_ns()}.log" if self.log_dir else None
        proc, url = launch(self.model, self.serve_args, "127.0.0.1", log_path, self.start_timeout)
        self.procs[url] = proc
        return url

    def stop(self, url: str) -> int:
        proc = self.procs.pop(url)
        return terminate(proc, self.drain_timeout + 10)
