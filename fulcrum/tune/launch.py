"""Starting what a candidate is: `fulcrum serve` with the candidate's flags, a P/D pair behind `fulcrum router`, or
another engine's server from a `--serve-cmd` template. Everything started is stopped on exit, Ctrl-C included."""

from __future__ import annotations

import atexit
import contextlib
import secrets
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from fulcrum.tune.space import Config, render
from fulcrum.utils.serve_process import ServerProcess, free_port, start, start_command

_running: list[ServerProcess] = []  # stopped at exit too: a tune killed by SIGTERM leaves no server behind


@atexit.register
def stop_all() -> None:
    while _running:
        _running.pop().stop(timeout=10)


def _track(server: ServerProcess) -> ServerProcess:
    _running.append(server)
    return server


def _untrack(server: ServerProcess) -> None:
    server.stop(timeout=15)
    if server in _running:
        _running.remove(server)


class Launcher:
    """Starts candidates of one model; `logs` is where each server's output goes."""

    def __init__(
        self,
        model: str,
        logs: Path,
        *,
        serve_cmd: str | None = None,
        base_args: tuple[str, ...] = (),
        cores: int = 1,
        timeout: float = 600,
    ):
        self.model, self.logs, self.serve_cmd, self.base_args = model, logs, serve_cmd, tuple(base_args)
        self.cores, self.timeout, self.count = cores, timeout, 0
        logs.mkdir(parents=True, exist_ok=True)

    def _log(self, name: str) -> Path:
        self.count += 1
        return self.logs / f"{self.count:03d}-{name}.log"

    def command(self, config: Config) -> str:
        """The command line that serves `config` (for the report; P/D shows its decode engine's)."""
        if self.serve_cmd:
            return render(self.serve_cmd, config, 8000, self.model)
        args = ["fulcrum", "serve", self.model, *self.base_args, *config.serve_args()]
        return shlex.join(args)

    @contextlib.contextmanager
    def serving(self, config: Config) -> Iterator[str]:
        """The base URL of `config`, running until the block ends."""
        if config.pd:
            with self._pd(config) as url:
                yield url
            return
        if self.serve_cmd:
            port = free_port()
            cmd = render(self.serve_cmd, config, port, self.model)
            server = _track(start_command(cmd, port, log_path=self._log("serve-cmd"), timeout=self.timeout))
        else:
            args = (*self.base_args, *config.serve_args())
            server = _track(start(self.model, *args, log_path=self._log("serve"), timeout=self.timeout))
        try:
            yield server.url
        finally:
            _untrack(server)

    @contextlib.contextmanager
    def _pd(self, config: Config) -> Iterator[str]:
        """A prefill engine and a decode engine, each on half the cores, behind `fulcrum router`'s pd mode."""
        half = max(1, self.cores // 2)
        cores = [f"0-{half - 1}" if half > 1 else "0", f"{half}-{2 * half - 1}" if half > 1 else str(half)]
        servers: list[ServerProcess] = []
        env = {"FULCRUM_KV_TRANSFER_SECRET": secrets.token_hex(16)}  # the decode engine trusts this producer
        try:
            for role, bind in zip(("producer", "consumer"), cores):
                one = config.with_(kv_role=role, cpu_threads=half, cpu_bind=bind if self.cores > 1 else "auto")
                args = (*self.base_args, *one.serve_args())
                log = self._log(role)
                servers.append(_track(start(self.model, *args, log_path=log, timeout=self.timeout, env=env)))
            port = free_port()
            cmd = [sys.executable, "-m", "fulcrum.cli", "router", "--port", str(port), "--model", self.model,
                   "--prefill", servers[0].url, "--decode", servers[1].url, "--log-level", "warning"]  # fmt: skip
            servers.append(_track(start_command(cmd, port, log_path=self._log("router"), timeout=60)))
            yield servers[-1].url
        finally:
            for s in reversed(servers):
                _untrack(s)
