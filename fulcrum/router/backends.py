"""Where the autoscaler's replicas run. `local`: `fulcrum serve` processes on free loopback ports of this
machine. (`ray`: fulcrum/router/ray_backend.py.) A backend starts one replica and returns its URL once /health
answers, and stops one by URL with SIGTERM, so that the replica drains its in-flight requests."""

from __future__ import annotations

import json
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
    """With `kv_events` (the router's endpoint maps, for the kv-events policy) each replica publishes its KV-cache
    events on free loopback ports, written into those maps before the replica joins the pool."""

    def __init__(self, model: str | None, serve_args: list[str], log_dir: str | Path | None = None,
                 start_timeout: float = 300, drain_timeout: float = 60,
                 kv_events: tuple[dict, dict] | None = None):  # fmt: skip
        self.model, self.serve_args = model, serve_args
        self.log_dir = Path(log_dir) if log_dir else None
        self.start_timeout, self.drain_timeout = start_timeout, drain_timeout
        self.procs: dict[str, ServerProcess] = {}
        self.kv_events = kv_events  # (replica URL -> events endpoint, replica URL -> replay endpoint)

    def start(self) -> str:
        log_path = self.log_dir / f"replica-{len(self.procs)}-{time.time_ns()}.log" if self.log_dir else None
        args = list(self.serve_args)
        if self.kv_events is not None:
            endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
            args += ["--kv-events-config", json.dumps(cfg)]
        proc, url = launch(self.model, args, "127.0.0.1", log_path, self.start_timeout)
        self.procs[url] = proc
        if self.kv_events is not None:
            self.kv_events[0][url], self.kv_events[1][url] = endpoint, replay
        return url

    def stop(self, url: str) -> int:
        proc = self.procs.pop(url)
        return terminate(proc, self.drain_timeout + 10)
