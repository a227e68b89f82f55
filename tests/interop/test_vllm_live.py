"""fulcrum's clients against a live vLLM (its CPU build, from `.venv-vllm`: `make vllm-venv`; skipped without it):
`fulcrum bench serve` gets exact prompts from vLLM's /tokenize and vLLM's usage; `fulcrum router --policy kv-events`
over two vLLM replicas reads their KV-cache events (vLLM's own hashes) and sends shared prefixes to the holder;
the least-load policy reads vLLM's metric names. The bundled model, served eagerly (no compile). Slow: a vLLM start
takes about a minute here. The figures (bench's TTFT beside vLLM's own histogram, the router's decisions by reason)
are printed, and written to $FULCRUM_INTEROP_OUT when set (benchmarks/results/interop/)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks import vllm_cpu
from fulcrum.cli import main
from fulcrum.router.scrape import sample_totals
from fulcrum.utils.serve_process import free_port
from tests.router.conftest import run_router
from tests.servers import MODEL

pytestmark = pytest.mark.slow
FIGURES: dict = {}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """Two vLLM replicas of the bundled model, each publishing its KV-cache events: [(server, (pub, replay))]."""
    if not vllm_cpu.installed():
        pytest.skip(f"vLLM's CPU build is not installed in {vllm_cpu.DEFAULT_VENV} (make vllm-venv creates it)")
    tmp = tmp_path_factory.mktemp("vllm")
    ports = [(free_port(), free_port()) for _ in range(2)]

    def one(i):
        return vllm_cpu.start_server(MODEL, "--dtype", "float32", "--max-model-len", "1024",
                                     log_path=tmp / f"vllm-{i}.log", kv_events=ports[i])  # fmt: skip

    with ThreadPoolExecutor(2) as ex:
        servers = list(ex.map(one, range(2)))
    yield list(zip(servers, ports))
    for s in servers:
        s.stop()
    out = os.environ.get("FULCRUM_INTEROP_OUT")
    if out and FIGURES:
        with open(out, "w") as f:
            json.dump(FIGURES, f, indent=1)


def ttft_histogram(url: str) -> tuple[float, float]:
    totals = sample_totals(httpx.get(f"{url}/metrics").text)
    return totals.get("vllm:time_to_first_token_seconds_sum", 0.0), totals.get(
        "vllm:time_to_first_token_seconds_count", 0.0
    )


def test_bench_gets_exact_prompts_and_usage_from_vllm(vllm, tmp_path):
    server = vllm[0][0]
    before = ttft_histogram(server.url)
    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--base-url", server.url, "--quiet", "--out", str(out), "--ignore-eos", "--num-prompts",
            "12", "--concurrency", "2", "--input-len", "128", "--output-len", "16"]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "shakespeare" and doc["prompt_lengths"].startswith("exact")
    reqs = doc["runs"][0]["requests"]
    assert len(reqs) == 12 and all(q["ok"] for q in reqs)
    assert {q["prompt_tokens"] for q in reqs} == {128}  # vLLM's own usage: the prompts are as long as asked
    assert {q["output_tokens"] for q in reqs} == {16}
    after = ttft_histogram(server.url)
    served = (after[0] - before[0]) / (after[1] - before[1])
    measured = sum(q["ttft"] for q in reqs) / len(reqs)
    FIGURES["bench_vs_vllm_histogram"] = {"bench_ttft_mean_s": measured, "vllm_histogram_ttft_mean_s": served,
                                          "requests": len(reqs), "prompt_lengths": doc["prompt_lengths"]}  # fmt: skip
    print(f"\nTTFT mean: bench {measured * 1e3:.1f} ms, vLLM's histogram {served * 1e3:.1f} ms")
    assert after[1] - before[1] == 12
    assert measured >= served * 0.9  # the client's clock starts first: it cannot see a first token much sooner


def test_router_kv_events_over_two_vllm_replicas(vllm):
    (a, a_ports), (b, b_ports) = vllm
    endpoints = {s.url: f"tcp://127.0.0.1:{p[0]}" for s, p in vllm}
    replays = {s.url: f"tcp://127.0.0.1:{p[1]}" for s, p in vllm}
    system = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 6
    with run_router([a.url, b.url], policy="kv-events", kv_events_endpoints=endpoints,
                    kv_events_replay_endpoints=replays) as r:  # fmt: skip
        client = r.client()
        client.completions.create(model="shakespeare", prompt=system + "First?", max_tokens=2)
        holder = next(url for url, n in r.requests_by_replica().items() if n == 1)
        deadline = time.time() + 30
        tokens = r.router.tokenizer.token_ids("completions", {"prompt": system})
        from fulcrum.utils.hashing import hash_prefix_blocks

        hashes = hash_prefix_blocks(tokens, 32)  # vLLM-CPU's blocks
        while r.router.kv_index.cached_prefix(holder, hashes) < len(hashes) - 1:
            assert time.time() < deadline, "vLLM's events never filled the index"
            time.sleep(0.2)
        for i in range(4):
            client.completions.create(model="shakespeare", prompt=system + f"Question {i}?", max_tokens=2)
        decisions = r.decisions()
        by_replica = r.requests_by_replica()
        FIGURES["router_kv_events"] = {"decisions": decisions, "requests_by_replica": by_replica,
                                       "indexed_blocks": r.router.kv_index.cached_prefix(holder, hashes)}  # fmt: skip
        print(f"\nrouter decisions {decisions}, requests by replica {by_replica}")
        assert by_replica[holder] == 5 and decisions.get("kv-events", 0) >= 4


def test_least_load_reads_vllm_metric_names(vllm):
    (a, _), (b, _) = vllm
    with run_router([a.url, b.url], policy="least-load", pool_kw={"interval": 0.1}) as r:
        busy = threading.Thread(
            target=lambda: httpx.post(f"{a.url}/v1/completions", timeout=300, json={
                "model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 600, "ignore_eos": True}),
        )  # fmt: skip
        busy.start()
        replica_a = r.router.pool.replicas[a.url]
        deadline = time.time() + 30
        while replica_a.metrics.running < 1:  # vllm:num_requests_running, scraped
            assert time.time() < deadline, "the router never saw vLLM's running request"
            time.sleep(0.05)
        r.client().completions.create(model="shakespeare", prompt="JULIET:", max_tokens=2)
        assert r.requests_by_replica() == {b.url: 1}
        busy.join(300)
