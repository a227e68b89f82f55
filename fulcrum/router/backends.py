"""Where the autoscaler's replicas run. `local`: `fulcrum serve` processes on free loopback ports of this
machine. (`ray`: fulcrum/router/ray_backend.py.) A backend starts one replica and returns its URL once /health
answers, and stops one by URL with SIGTERM, so that the replica drains its in-flight requests."""

from __future__ import annotations

import time
from pathlib import Path

from fulcrum.utils.serve_process import ServerProcess, free_port, start

__all__ = ["LocalBackend", "free_port", "launch", "terminate"]


def launch(model: str | None, serve_args: list[str], host: str, log_path: Path | None, timeout: float):
    """A `fulcrum serve` child on a free port, returned once healthy: (server, url)."""
    server = start(model, *serve_args, log_path=log_path, timeout=timeout, host=host)
    return server, server.url


def terminate(server: ServerProcess, timeout: float) -> int:
    """SIGTERM (the replica drains), SIGKILL after `timeout`; its exit code."""
    return server.stop(timeout)


class LocalBackend:
    def __init__(self, model: str | None, serve_args: list[str], log_dir: str | Path | None = None,
                 start_timeout: float = 300, drain_timeout: float = 60):  # fmt: skip
        self.model, self.serve_args = model, serve_args
        self.log_dir = Path(log_dir) if log_dir else None
        self.start_timeout, self.drain_timeout = start_timeout, drain_timeout
        self.procs: dict[str, ServerProcess] = {}

    def start(self) -> str:
        log_path = self.log_dir / f"replica-{len(self.procs)}-{time.time_ns()}.log" if self.log_dir else None
        proc, url = launch(self.model, self.serve_args, "127.0.0.1", log_path, self.start_timeout)
        self.procs[url] = proc
        return url

    def stop(self, url: str) -> int:
        proc = self.procs.pop(url)
        return terminate(proc, self.drain_timeout + 10)
