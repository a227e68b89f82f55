"""The kv-events policy over two real `fulcrum serve` replicas that publish their KV-cache events: the router's
index holds what a replica cached, a request sharing the prefix goes there, evictions in a small cache leave
the index, a router started later learns the past from the replay socket; and the index's bookkeeping of
restarts and missed batches."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fulcrum.router.kv_index import KVIndex
from fulcrum.utils.hashing import hash_prefix_blocks
from fulcrum.utils.kv_event_schema import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from fulcrum.utils.serve_process import free_port
from tests.router.conftest import run_router, start_replica
from tests.router.test_router import complete

BLOCK = 16
SYSTEM = "You are the Chorus. O for a Muse of fire, that would ascend the brightest heaven of invention! "


@pytest.fixture(scope="module")
def event_replicas(tmp_path_factory):
    """Two replicas with a 16-block cache each (max_model_len 256), events and replay on free ports."""
    tmp = tmp_path_factory.mktemp("kv-events")

    def one(_):
        endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
        s = start_replica(tmp, "--kv-cache-memory", str(16 * BLOCK * 8192 / 2**30), "--max-model-len", "256",
                          "--kv-events-config", json.dumps(cfg))  # fmt: skip
        return s, endpoint, replay

    with ThreadPoolExecutor(2) as ex:
        servers = list(ex.map(one, range(2)))
    yield servers
    for s, *_ in servers:
        s.stop()


def events_router(servers, **kw):
    return run_router(
        [s.url for s, *_ in servers],
        policy="kv-events",
        balance_margin=2,
        kv_events_endpoints={s.url: e for s, e, _ in servers},
        kv_events_replay_endpoints={s.url: r for s, _, r in servers},
        **kw,
    )


def prompt_blocks(r, prompt: str) -> list[int]:
    return hash_prefix_blocks(r.router.tokenizer.token_ids("completions", {"prompt": prompt}), BLOCK)


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_index_follows_the_cache_routes_to_the_holder_and_sees_evictions(event_replicas):
    with events_router(event_replicas) as r:
        index, client = r.router.kv_index, r.client()
        urls = [s.url for s, *_ in event_replicas]
        wait_for(lambda: all(r.router.subscriptions.tasks.get(u) for u in urls), "subscriptions did not start")
        prompt = SYSTEM + "Who comes?"
        blocks = prompt_blocks(r, prompt)
        assert len(blocks) >= 2
        complete(client, prompt=prompt, max_tokens=1)
        (holder,) = r.requests_by_replica()
        other = next(u for u in urls if u != holder)
        # max_tokens 1: the sampled token is never computed, so the replica cached exactly the prompt's full blocks
        wait_for(lambda: index.of(holder).hashes == set(blocks), f"index {index.of(holder).hashes} != {blocks}")
        assert not index.of(other).hashes & set(blocks)
        for i, stream in enumerate((False, True, False)):
            complete(client, prompt=SYSTEM + f"Question {i}?", stream=stream)
        assert r.requests_by_replica() == {holder: 4}
        assert r.decisions()["kv-events"] == 3
        text = httpx.get(f"{r.url}/metrics").text
        assert 'fulcrum_router:decisions_total{reason="kv-events"} 3.0' in text
        line = next(
            x for x in text.splitlines() if x.startswith(f'fulcrum_router:kv_index_blocks{{replica="{holder}"}}')
        )
        assert float(line.split()[-1]) == len(index.of(holder).hashes) >= len(blocks)
        holder_replica = r.router.pool.replicas[holder]
        holder_replica.in_flight += 3  # the holder saturated: its load exceeds the other's by more than the margin
        try:
            complete(client, prompt=SYSTEM + "Guarded?", stream=True)
        finally:
            holder_replica.in_flight -= 3
        assert r.decisions()["load-guard"] == 1 and r.requests_by_replica()[other] == 1
        # distinct prompts sent straight to the holder fill its 16 blocks: the shared prefix is evicted there
        for i in range(8):
            httpx.post(f"{holder}/v1/completions", timeout=60,
                       json={"model": "shakespeare", "prompt": f"{i} KING HENRY: Once more unto the breach, dear friends, {i} once more; "
                             f"or close the wall up with our English dead. {i}", "max_tokens": 2})  # fmt: skip
        wait_for(lambda: not set(blocks) & index.of(holder).hashes, "the evicted blocks stayed in the index")
        complete(client, prompt=SYSTEM + "And now?")  # only the other replica (the guarded request) holds it now
        assert r.requests_by_replica() == {holder: 4, other: 2} and r.decisions()["kv-events"] == 4


def test_a_router_started_later_learns_the_cache_from_the_replay(event_replicas):
    s0 = event_replicas[0][0]
    prompt = SYSTEM * 2 + "Replay me."
    resp = httpx.post(
        f"{s0.url}/v1/completions", json={"model": "shakespeare", "prompt": prompt, "max_tokens": 1}, timeout=60
    )
    assert resp.status_code == 200
    with events_router(event_replicas) as r:
        blocks = prompt_blocks(r, prompt)
        wait_for(lambda: set(blocks) <= r.router.kv_index.of(s0.url).hashes, "the replay did not fill the index")
        complete(r.client(), prompt=prompt + " Again.", stream=True)
        assert r.requests_by_replica() == {s0.url: 1}


def test_cli_refuses_kv_events_without_endpoints():
    from fulcrum.cli import build_parser
    from fulcrum.router.cli import router_config

    parse = build_parser().parse_args
    with pytest.raises(SystemExit, match="needs --model"):
        router_config(parse(["router", "--replica", "http://127.0.0.1:1", "--policy", "kv-events"]))
    m = ["--model", "tok"]
    with pytest.raises(SystemExit, match="needs --kv-events-endpoint"):
        router_config(parse(["router", "--replica", "http://127.0.0.1:1", "--policy", "kv-events", *m]))
    with pytest.raises(SystemExit, match="one --kv-events-endpoint per --replica"):
        router_config(parse(["router", "--replica", "http://a:1", "--replica", "http://b:1", "--policy", "kv-events",
                             "--kv-events-endpoint", "tcp://a:5557", *m]))  # fmt: skip
    cfg = router_config(parse(["router", "--replica", "http://a:1/", "--policy", "kv-events", *m,
                               "--kv-events-endpoint", "tcp://a:5557", "--kv-events-topic", "kv"]))  # fmt: skip
    assert cfg.kv_events_endpoints == {"http://a:1": "tcp://a:5557"} and cfg.kv_events_topic == "kv"


def _tokens(*blocks: int) -> list[int]:
    return [k for k in blocks for _ in range(BLOCK)]


def _ours(*blocks: int) -> list[int]:
    return hash_prefix_blocks(_tokens(*blocks), BLOCK)


def _stored(*blocks: int) -> BlockStored:
    """A prompt's first blocks (block k: BLOCK tokens k), hashed by the replica as the router hashes them."""
    return BlockStored(_ours(*blocks), None, _tokens(*blocks), BLOCK, None, "CPU", None)


def test_index_drops_a_replica_on_clear_gap_and_restart():
    index = KVIndex()
    index.apply("a", 0, EventBatch(0, [AllBlocksCleared()]))
    index.apply("a", 1, EventBatch(0, [_stored(1, 2, 3)]))
    index.apply("b", 5, EventBatch(0, [_stored(1)]))  # joined mid-stream: taken as it comes
    assert index.cached_prefix("a", _ours(1, 2, 3, 4)) == 3 and index.cached_prefix("b", _ours(1, 2)) == 1
    index.apply("a", 2, EventBatch(0, [BlockRemoved([_ours(1, 2)[1]], "CPU")]))
    assert index.cached_prefix("a", _ours(1, 2, 3)) == 1 and index.of("a").block_size == BLOCK
    index.apply("a", 2, EventBatch(0, [_stored(9)]))  # a batch seen twice (replay and live) applies once
    assert not set(_ours(9)) & index.of("a").hashes
    index.apply("a", 5, EventBatch(0, [_stored(7)]))  # 3 and 4 were missed: what came before is unknown
    assert index.of("a").hashes == set(_ours(7))
    index.restarted("a")  # the publisher started over
    assert index.of("a").hashes == set() and index.of("a").last_seq is None
    index.apply("a", 0, EventBatch(0, [_stored(4)]))
    index.apply("a", 1, EventBatch(0, [AllBlocksCleared()]))
    assert index.of("a").hashes == set() and index.of("b").hashes == set(_ours(1))


@pytest.mark.slow
def test_a_restarted_replica_starts_empty_in_the_index(tmp_path):
    """SIGKILL a replica, restart it on the same port and endpoint: its old blocks leave the index (failed health
    check, then its publisher's new sequence), and what it caches after the restart comes back in."""
    import os
    import signal
    import subprocess
    import sys

    from tests.router.conftest import replica_env
    from tests.servers import MODEL

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
    a = start_replica(tmp_path, "--kv-events-config", cfg)
    restarted = None
    try:
        with run_router([a.url], policy="kv-events", kv_events_endpoints={a.url: endpoint}) as r:
            index, client = r.router.kv_index, r.client()
            first = SYSTEM + "Before the fall."
            time.sleep(0.5)  # the subscription reaches the publisher
            complete(client, prompt=first, max_tokens=1)
            wait_for(lambda: set(prompt_blocks(r, first)) <= index.of(a.url).hashes, "the first prompt's blocks")
            engine = a.engine_pid()
            os.kill(a.proc.pid, signal.SIGKILL)
            os.kill(engine, signal.SIGKILL)
            wait_for(lambda: not r.router.pool.replicas[a.url].healthy, "the dead replica to leave the pool")
            assert not index.of(a.url).hashes
            cmd = [sys.executable, "-m", "fulcrum.cli", "serve", str(MODEL), "--port", str(a.port), "--kv-cache-memory",
                   "0.05", "--served-model-name", "shakespeare", "--kv-events-config", cfg]  # fmt: skip
            with replica_env(), open(tmp_path / "restarted.log", "w") as log:
                restarted = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: r.router.pool.replicas[a.url].healthy, "the restarted replica to rejoin", timeout=120)
            second = "FALSTAFF: " + SYSTEM + "After the fall."
            complete(client, prompt=second, max_tokens=1)
            wait_for(lambda: set(prompt_blocks(r, second)) <= index.of(a.url).hashes, "the new blocks")
            assert not set(prompt_blocks(r, first)) & index.of(a.url).hashes  # the old cache did not come back
            assert index.of(a.url).drops >= 1
    finally:
        a.stop()
        if restarted is not None:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(30)
