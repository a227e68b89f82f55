"""`fulcrum serve --tensor-parallel-size 2` (issue 17): the engine core and one worker process answer as one
process does; killing the worker mid-request fails what was in flight with a 5xx, the server exits non-zero and
leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import httpx

from fulcrum.engine.llm import LLM
from fulcrum.sampling_params import SamplingParams
from tests.servers import niceness, start_server


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except FileNotFoundError:
        return False


def test_tensor_parallel_server_answers_as_one_process_and_fails_cleanly_when_a_worker_dies(tmp_path):
    expected = (
        LLM(kv_cache_memory=32 << 20, cpu_threads=1)
        .generate(["ROMEO:"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    s = start_server(tmp_path, "--tensor-parallel-size", "2")
    try:
        body = {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert httpx.get(f"{s.url}/health").status_code == 200

        core = s.engine_pid()
        workers = children(core)
        assert len(workers) == 1  # rank 1; rank 0 is the engine core itself
        started_at = os.getpriority(os.PRIO_PROCESS, 0)  # both ranks compute below the frontend (--cpu-nice)
        assert niceness(core) == niceness(workers[0]) == {max(10, started_at)}
        # a long request in flight, then the worker is killed under it
        answer = {}

        def long_request():
            big = {"prompt": "ROMEO:", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
            try:
                answer["status"] = httpx.post(f"{s.url}/v1/completions", json=big, timeout=120).status_code
            except httpx.HTTPError as e:
                answer["status"] = repr(e)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.5)
        os.kill(workers[0], signal.SIGKILL)
        t.join(60)
        assert answer["status"] in (500, 503), answer  # in flight: an error answer, not a hang or a lost request
        with contextlib.suppress(httpx.TransportError):  # unhealthy from then on: a 503, or no answer once it is gone
            assert httpx.get(f"{s.url}/health", timeout=5).status_code == 503
        assert s.proc.wait(timeout=30) == 1  # the server notices, fails and exits non-zero
        time.sleep(1)
        assert not [p for p in [core, *workers] if alive(p)]  # no orphans
    finally:
        s.stop()
