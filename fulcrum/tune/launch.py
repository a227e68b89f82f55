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

# stopped at exit too (`fulcrum tune` turns SIGTERM into the same path): only a SIGKILL leaves servers behind
_running: list[ServerProcess] = []


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
        device: str = "cpu",
        units: int = 1,
        timeout: float = 600,
    ):
        self.model, self.logs, self.serve_cmd, self.base_args = model, logs, serve_cmd, tuple(base_args)
        self.device, self.units, self.timeout, self.count = device, units, timeout, 0
        logs.mkdir(parents=True, exist_ok=True)

    def _log(self, name: str) -> Path:
        self.count += 1
        return self.logs / f"{self.count:03d}-{name}.log"

    def pd_engines(self, config: Config) -> list[tuple[str, Config, dict]]:
        """The prefill engine (KV producer) and the decode engine (KV consumer) of a P/D candidate, each on half the
        machine: half the GPUs (CUDA_VISIBLE_DEVICES) or half the cores (threads bound to them)."""
        half, out = max(1, self.units // 2), []
        for i, role in enumerate(("producer", "consumer")):
            share = [min(c, self.units - 1) for c in range(i * half, (i + 1) * half)]
            if self.device == "cuda":
                out.append((role, config.with_(kv_role=role), {"CUDA_VISIBLE_DEVICES": ",".join(map(str, share))}))
            else:
                bind = f"{share[0]}-{share[-1]}" if half > 1 else str(share[0])
                out.append((role, config.with_(kv_role=role, cpu_threads=half, cpu_bind=bind), {}))
        return out

    def commands(self, config: Config) -> list[str]:
        """The command lines that serve `config` by hand (for the report): one server, or P/D's two engines and
        the router in front of them."""
        if self.serve_cmd:
            return [render(self.serve_cmd, config, 8000, self.model)]
        if not config.pd:
            return [shlex.join(["fulcrum", "serve", self.model, *self.base_args, *config.serve_args()])]
        out = []
        for (role, one, env), port in zip(self.pd_engines(config), (8100, 8200)):
            prefix = "".join(f"{k}={v} " for k, v in env.items())
            args = ["fulcrum", "serve", self.model, "--port", str(port), *self.base_args, *one.serve_args()]
            out.append(f"{prefix}{shlex.join(args)} &  # the {'prefill' if role == 'producer' else 'decode'} engine")
        out.append(shlex.join(["fulcrum", "router", "--port", "8000", "--model", self.model, "--prefill",
                               "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]))  # fmt: skip
        return out

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
        """P/D's two engines behind `fulcrum router`'s pd mode; the base URL is the router's."""
        servers: list[ServerProcess] = []
        secret = {"FULCRUM_KV_TRANSFER_SECRET": secrets.token_hex(16)}  # the decode engine trusts this producer
        try:
            for role, one, env in self.pd_engines(config):
                args = (*self.base_args, *one.serve_args())
                log = self._log(role)
                servers.append(_track(start(self.model, *args, log_path=log, timeout=self.timeout,
                                            env={**env, **secret})))  # fmt: skip
            port = free_port()
            cmd = [sys.executable, "-m", "fulcrum.cli", "router", "--port", str(port), "--model", self.model,
                   "--prefill", servers[0].url, "--decode", servers[1].url, "--log-level", "warning"]  # fmt: skip
            servers.append(_track(start_command(cmd, port, log_path=self._log("router"), timeout=60)))
            yield servers[-1].url
        finally:
            for s in reversed(servers):
                _untrack(s)
