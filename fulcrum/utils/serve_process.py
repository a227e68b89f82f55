"""`fulcrum serve` in a child process on a free port: for tests, benchmarks, scripts and the router's replica
backends (local processes, Ray actors). `start` returns once /health answers 200, and raises with the server's log
if it exits or never becomes healthy. Standard library only, and no import of the server: any layer may use it."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# The standard library, not httpx (a dev extra): this module must import on a plain install. No proxy either:
# an http_proxy in the environment must not route a loopback health check through it.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str) -> bool:
    try:
        with _opener.open(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, a non-2xx (HTTPError is an OSError)
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str | None  # None: the server writes to this process's stdout
    host: str = "127.0.0.1"
    group: bool = False  # the process leads its own process group (a shell command): signal the whole group

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        if self.log_path is None:
            return "(the server's output went to stdout)"
        return Path(self.log_path).read_text()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (the server drains), then SIGKILL after `timeout` seconds; the exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        elif self.group:  # the shell is gone: what it started may not be
            self._signal(signal.SIGKILL)
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            if self.group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(
    model: str | Path | None,
    *flags: str,
    log_path: str | Path | None = None,
    timeout: float = 300,
    module: str = "fulcrum.cli",
    host: str = "127.0.0.1",
    env: dict | None = None,
) -> ServerProcess:
    """`model` None: the bundled one. `module` is run with -m and must take fulcrum's CLI arguments (tests wrap the
    CLI to inject faults); `env` is added to this process's environment."""
    port = free_port(host)
    where = ["--port", str(port)] + (["--host", host] if host != "127.0.0.1" else [])
    cmd = [sys.executable, "-m", module, "serve", *([str(model)] if model is not None else []), *where, *flags]
    return start_command(cmd, port, log_path=log_path, timeout=timeout, host=host, env=env)


def start_command(
    cmd: list[str] | str,
    port: int,
    *,
    log_path: str | Path | None = None,
    timeout: float = 300,
    host: str = "127.0.0.1",
    env: dict | None = None,
) -> ServerProcess:
    """Any server command that will listen on `port` and answer /health (a string runs in a shell, in its own
    process group so that stopping it stops what it started); returns once /health answers 200."""
    shell = isinstance(cmd, str)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    kw = dict(env=env, shell=shell, start_new_session=shell)
    if log_path is None:
        proc = subprocess.Popen(cmd, **kw)
    else:
        with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **kw)
    server = ServerProcess(proc, port, None if log_path is None else str(log_path), host, group=shell)
    shown = cmd if shell else " ".join(cmd)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early ({shown}):\n{server.log()}")
            if _healthy(server.url):
                return server
            time.sleep(0.3)
    except BaseException:  # exited, or Ctrl-C while it started: nothing is left running
        server.stop()
        raise
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout:.0f} s ({shown}):\n{server.log()}")
