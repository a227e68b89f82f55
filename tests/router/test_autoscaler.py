"""The autoscaler: its decisions on a driven clock, and (slow) a step of load over real local replicas: one
added under the step, one drained and removed after, no request dropped."""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest

from fulcrum.router.autoscaler import Autoscaler, Decider, ScalerConfig, parse_slo
from fulcrum.router.backends import LocalBackend
from fulcrum.router.pool import Pool
from fulcrum.router.scrape import Histogram
from tests.router.conftest import run_router
from tests.servers import MODEL


def test_parse_slo():
    slo = parse_slo("ttft=500ms,itl=0.1", 0.95)
    assert (slo.ttft, slo.itl, slo.percentile) == (0.5, 0.1, 0.95)
    with pytest.raises(ValueError):
        parse_slo("tpot=1")


def drive(decider, start, seconds, concurrency, current, step=1.0):
    t, n = start, current
    while t < start + seconds:
        decider.observe(t, concurrency)
        n, _ = decider.desired(t, current)
        t += step
    return t, n


def test_stable_window_sizes_the_pool_and_n_minus_1_guards_the_way_down():
    d = Decider(ScalerConfig(min_replicas=1, max_replicas=5, target_concurrency=4, stable_window=10, panic_window=2))
    t, n = drive(d, 0, 20, concurrency=7, current=2)
    assert n == 2  # ceil(7 / 4)
    t, n = drive(d, t, 20, concurrency=4.5, current=2)
    assert n == 2  # 4.5 on one replica exceeds its target: N-1 would not hold it
    t, n = drive(d, t, 20, concurrency=3, current=2)
    assert n == 1
    _, n = drive(d, t, 20, concurrency=0, current=1)
    assert n == 1  # never below --min


def test_panic_window_reacts_to_a_burst_and_holds_while_it_lasts():
    d = Decider(ScalerConfig(max_replicas=10, target_concurrency=2, stable_window=30, panic_window=3))
    t, _ = drive(d, 0, 30, concurrency=1, current=1)
    for dt in range(3):
        d.observe(t + dt, 12)
    n, reason = d.desired(t + 2, 1)
    assert n == 6 and reason.startswith("panic")
    # the burst is over but the panic lasts a stable window: no scale-down yet
    t2, n = drive(d, t + 3, 10, concurrency=0, current=6)
    assert n == 6
    _, n = drive(d, t2, 40, concurrency=0, current=6)
    assert n == 5  # then down one at a time


def test_full_kv_caches_add_a_replica_and_hold_the_way_down():
    d = Decider(ScalerConfig(max_replicas=3, target_concurrency=8, stable_window=10, panic_window=2))
    for t in range(3):
        d.observe(t, 2, kv_usage=0.95)  # few requests, but long ones: the caches are full
    n, reason = d.desired(2, 1)
    assert n == 2 and "KV cache usage 0.95" in reason
    for t in range(3, 30):
        d.observe(t, 1, kv_usage=0.5)
    n, reason = d.desired(29, 2)
    assert n == 2 and reason == "N-1 would not hold the load"  # 0.5 over 2 is 1.0 on one: over the limit
    for t in range(30, 40):
        d.observe(t, 1, kv_usage=0.3)
    assert d.desired(39, 2)[0] == 1


def test_an_slo_breach_adds_a_replica():
    cfg = ScalerConfig(max_replicas=3, target_concurrency=8, stable_window=10, slo=parse_slo("ttft=0.2"))
    d = Decider(cfg)
    slow = Histogram({0.1: 1.0, 0.5: 2.0, 1.0: 10.0, float("inf"): 10.0}, 10.0)
    d.observe(0, 2, ttft=slow)
    n, reason = d.desired(0, 1)
    assert n == 2 and "ttft" in reason


SERVE_ARGS = ["--kv-cache-memory", "0.05", "--served-model-name", "shakespeare"]


def replica_pythonpath(monkeypatch):
    """FULCRUM_REPLICA_PYTHONPATH (see conftest.py) goes first on the replicas' path."""
    paths = [p for p in (os.environ.get("FULCRUM_REPLICA_PYTHONPATH"), os.environ.get("PYTHONPATH")) if p]
    if paths:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


@pytest.mark.slow
def test_local_backend_scales_up_under_a_step_and_down_after(tmp_path, monkeypatch):
    replica_pythonpath(monkeypatch)
    events = ({}, {})  # the local backend gives each replica its KV-events endpoints: the kv-events policy routes
    seen = step_load(
        LocalBackend(str(MODEL), SERVE_ARGS, log_dir=tmp_path, drain_timeout=30, kv_events=events),
        policy="kv-events", kv_events_endpoints=events[0], kv_events_replay_endpoints=events[1],
    )  # fmt: skip
    assert len(events[0]) == 2 and all(seen[url] for url in events[0]), seen  # both replicas' blocks were indexed


def step_load(backend, policy="least-load", **router_cfg) -> dict[str, int]:
    """The step of load; returns the blocks the router's KV index saw per replica, most at any time."""
    cfg = ScalerConfig(min_replicas=1, max_replicas=2, target_concurrency=1, stable_window=6, panic_window=2, tick=0.5)
    made = {}

    def autoscaler(pool):
        made["a"] = Autoscaler(pool, backend, cfg)
        return made["a"]

    pool = Pool([])
    seen: dict[str, int] = {}
    with run_router([], pool=pool, autoscaler=autoscaler, policy=policy, **router_cfg) as r:
        scaler = made["a"]
        deadline = time.time() + 120
        while not pool.available():
            assert time.time() < deadline, "the first replica never came up"
            time.sleep(0.2)
        client = r.client()
        results, stop_heavy, stop_all = [], threading.Event(), threading.Event()

        def user(stop):
            while not stop.is_set():
                try:
                    s = client.completions.create(model="shakespeare", prompt="KING:", max_tokens=24, stream=True)
                    results.append("".join(c.choices[0].text for c in s if c.choices) is not None)
                except openai.APIError as e:
                    results.append(e)

        heavy = [threading.Thread(target=user, args=(stop_heavy,)) for _ in range(3)]
        light = threading.Thread(target=user, args=(stop_all,))
        for t in [*heavy, light]:
            t.start()
        try:
            deadline = time.time() + 180
            while len(pool.available()) < 2:
                assert time.time() < deadline, f"no scale-up: {scaler.events}"
                time.sleep(0.5)
            for _ in range(6):  # the new replica takes some of the step
                if r.router.kv_index is not None:
                    for url, held in list(r.router.kv_index.replicas.items()):
                        seen[url] = max(seen.get(url, 0), len(held.hashes))
                time.sleep(0.5)
            stop_heavy.set()
            deadline = time.time() + 120
            while not any(e.kind == "down" for e in scaler.events):
                assert time.time() < deadline, f"no scale-down: {scaler.events} {list(scaler.decider.samples)[-10:]}"
                time.sleep(0.5)
            time.sleep(1)
        finally:
            stop_heavy.set()
            stop_all.set()
            for t in [*heavy, light]:
                t.join(60)
        assert [e.kind for e in scaler.events] == ["up", "up", "down"]  # --min, the step, after it
        assert len(pool.available()) == 1
        failures = [x for x in results if x is not True]
        assert results and not failures, failures
    return seen
