"""`fulcrum serve` runs its CPU engine core below the frontend's priority (--cpu-nice, 10 by default), so that reading
requests and streaming tokens are not held up behind the compute threads that fill the cores."""

from __future__ import annotations

import os

import httpx

from tests.servers import niceness


def test_the_engine_core_computes_below_the_frontend_and_cpu_nice_sets_how_far(server, fresh_server):
    started_at = os.getpriority(os.PRIO_PROCESS, 0)  # a suite run under `nice` starts the servers there
    assert niceness(server.engine_pid()) == {max(10, started_at)}
    assert niceness(server.proc.pid) == {started_at}  # the frontend keeps its own
    s = fresh_server("--cpu-nice", str(min(started_at + 3, 19)))
    assert niceness(s.engine_pid()) == {min(started_at + 3, 19)}
    body = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
