"""Real `fulcrum serve` processes on free loopback ports, started and stopped by tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from fulcrum.config import DEFAULT_MODEL

MODEL = os.environ.get("FULCRUM_TEST_MODEL", str(DEFAULT_MODEL))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def engine_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = [int(p) for p in out]
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise RuntimeError(f"no engine process among children {pids}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp_path, *args: str) -> Server:
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "fulcrum.cli",
        "serve",
        MODEL,
        "--port",
        str(port),
        "--kv-cache-memory",
        "0.05",
        "--served-model-name",
        "shakespeare",
        *args,
    ]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_path)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")
