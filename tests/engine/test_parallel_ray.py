"""Tensor parallel through the Ray backend (issue 17): a Ray cluster started here on 127.0.0.1 (as `ray start --head`
would on a first machine; others would join it with `ray start --address`), the worker placed on it as an actor,
the same greedy tokens as one process; the cluster stopped after."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fulcrum.engine.llm import LLM
from fulcrum.errors import EngineDeadError
from fulcrum.sampling_params import SamplingParams
from fulcrum.utils.serve_process import free_port

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak."]


@pytest.fixture
def ray_cluster(monkeypatch):
    """A head node of our own, in a session of its own so that stopping it stops only it (not `ray stop`, which would
    stop every Ray cluster on the machine). Token authentication off, as on a trusted loopback."""
    cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    log = open(os.path.join(temp, "head.log"), "w+")  # noqa: SIM115 (open while the head runs, closed after)
    head = subprocess.Popen(
        [cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
         "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in Path(log.name).read_text():
            assert head.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.5)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_tensor_parallel_on_a_ray_cluster_gives_the_tokens_of_one_process(ray_cluster):
    engine = dict(kv_cache_memory=32 << 20, cpu_threads=1)
    ref = [o.outputs[0].token_ids for o in LLM(**engine).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="ray", **engine)
    try:
        port = os.environ["RAY_ADDRESS"].rsplit(":", 1)[1]
        assert ray.get_runtime_context().gcs_address.endswith(f":{port}")  # the cluster started above
        (actor,) = llm.core.workers._ray.actors  # rank 1, a Ray actor on that cluster's one node
        assert ray.get(actor.ping.remote()) == ray.util.get_node_ip_address()
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == ref
        # the actor dies: the engine says so on the next request instead of waiting for the rank forever
        ray.kill(actor)
        time.sleep(2)
        with pytest.raises(EngineDeadError, match="worker 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
