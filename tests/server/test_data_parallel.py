"""Data parallel (issue 17): `fulcrum serve --data-parallel-size 2` runs two engine cores behind one frontend, each
with its own KV cache and one CPU core; a batch of requests is split between them (per-engine gauges in /metrics),
the answers are those of one core, and a core that dies makes the server unhealthy."""

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.servers import start_server


def completion(url, i):
    body = {"prompt": f"ROMEO {i}:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def engine_pids(server) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    return pids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    one, two = start_server(tmp), start_server(tmp, "--data-parallel-size", "2")
    yield one, two
    one.stop()
    two.stop()


def test_two_cores_split_a_batch_and_answer_as_one(pair):
    one, two = pair
    assert len(engine_pids(two)) == 2 and len(engine_pids(one)) == 1
    with ThreadPoolExecutor(8) as pool:
        split = list(pool.map(lambda i: completion(two.url, i), range(8)))
    alone = [completion(one.url, i) for i in range(8)]
    assert [r["choices"][0]["text"] for r in split] == [r["choices"][0]["text"] for r in alone]
    metrics = httpx.get(f"{two.url}/metrics").text
    served = {
        m[0]: float(m[1]) for m in re.findall(r'fulcrum:engine_requests_total\{engine="(\d)"[^}]*\} (\S+)', metrics)
    }
    assert set(served) == {"0", "1"} and all(v >= 2 for v in served.values()), served

    # the cache of both cores together
    def capacity(url):
        text = httpx.get(f"{url}/metrics").text
        return float(re.search(r"fulcrum:kv_cache_capacity_tokens\{[^}]*\} (\S+)", text)[1])

    assert capacity(two.url) == 2 * capacity(one.url)


def test_a_dead_core_makes_the_server_unhealthy(tmp_path):
    s = start_server(tmp_path, "--data-parallel-size", "2")
    try:
        pids = engine_pids(s)
        os.kill(pids[1], signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 1  # the server notices, fails and exits
        time.sleep(1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]  # no orphan
    finally:
        s.stop()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except FileNotFoundError:
        return "zombie"
