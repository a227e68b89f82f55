"""Real `fulcrum serve` processes on free loopback ports, started and stopped by tests."""

from __future__ import annotations

import os
import subprocess

from fulcrum.config import DEFAULT_MODEL
from fulcrum.utils.serve_process import ServerProcess, free_port, start

MODEL = os.environ.get("FULCRUM_TEST_MODEL", str(DEFAULT_MODEL))


def niceness(pid: int) -> set[int]:
    """The niceness of each of a process's threads."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


class Server(ServerProcess):
    def engine_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = [int(p) for p in out]
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise RuntimeError(f"no engine process among children {pids}")


def start_server(tmp_path, *args: str, module: str = "fulcrum.cli") -> Server:
    """The bundled model with a small KV cache, served as "shakespeare", its log kept under tmp_path."""
    flags = ["--kv-cache-memory", "0.05", "--served-model-name", "shakespeare", *args]
    s = start(MODEL, *flags, log_path=tmp_path / f"server-{free_port()}.log", timeout=120, module=module)
    return Server(s.proc, s.port, s.log_path)
