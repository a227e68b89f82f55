"""Killing a replica mid-run: streams it was serving end with an error event, requests not yet answered are
retried on the other, none hangs; the replica leaves the pool and rejoins when it is restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.router.conftest import replica_env, run_router, start_replica
from tests.servers import MODEL

pytestmark = pytest.mark.slow


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_kill_a_replica_mid_run(tmp_path):
    a, b = start_replica(tmp_path), start_replica(tmp_path)
    restarted = None
    try:
        with run_router([a.url, b.url], policy="round-robin", first_token_timeout=30) as r:
            client = r.client()
            outcomes, started = {}, threading.Event()

            def stream(i):
                try:
                    s = client.completions.create(model="shakespeare", prompt=f"KING {i}:", max_tokens=400,
                                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                    n = 0
                    for _chunk in s:
                        n += 1
                        if n == 2:
                            started.set()
                    outcomes[i] = ("done", n)
                except openai.APIError as e:
                    outcomes[i] = ("error", str(e))

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: r.router.pool.replicas[a.url].in_flight >= 2 and started.is_set(), 60, "streams")
            time.sleep(0.5)
            engine = a.engine_pid()
            os.kill(a.proc.pid, signal.SIGKILL)
            os.kill(engine, signal.SIGKILL)
            # requests sent right after the kill: some are routed to the dead replica before a health check
            # notices, fail to connect and are retried on the other
            texts = [
                client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=3).choices[0].text
                for _ in range(4)
            ]
            assert all(isinstance(t, str) for t in texts)
            for t in threads:
                t.join(120)
                assert not t.is_alive(), "a stream hung"
            errors = [o for o in outcomes.values() if o[0] == "error"]
            assert len(outcomes) == 4 and len(errors) == 2, outcomes
            assert all("failed mid-stream" in e[1] for e in errors)
            wait_for(lambda: not r.router.pool.replicas[a.url].healthy, 5, "the dead replica to leave the pool")
            assert [x.url for x in r.router.pool.available()] == [b.url]

            # restarted on the same port, it rejoins and takes traffic again
            cmd = [sys.executable, "-m", "fulcrum.cli", "serve", str(MODEL), "--port", str(a.port),
                   "--kv-cache-memory", "0.05", "--served-model-name", "shakespeare"]  # fmt: skip
            with replica_env(), open(tmp_path / "restarted.log", "w") as log:
                restarted = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: r.router.pool.replicas[a.url].healthy, 120, "the restarted replica to rejoin")
            before = r.requests_by_replica()[a.url]
            for _ in range(2):
                client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=2)
            assert r.requests_by_replica()[a.url] == before + 1
    finally:
        a.stop()
        b.stop()
        if restarted is not None:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(30)
