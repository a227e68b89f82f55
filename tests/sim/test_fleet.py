"""The fleet: routing policies, the autoscaler and P/D on the simulated clock, with a known step-cost model."""

from __future__ import annotations

import json

import pytest

from fulcrum.bench.workloads import LengthDist, WorkloadSpec
from fulcrum.plan.step_costs import StepCosts
from fulcrum.router.autoscaler import SLO, ScalerConfig
from fulcrum.sim.fleet import Fleet, FleetConfig, Load
from fulcrum.sim.replica import EngineShape
from fulcrum.sim.workload import token_sessions

VOCAB = 32000


def costs(frontend_s: float = 0.0) -> StepCosts:
    """About a small model on a CPU: 2 ms a decode step, 30 ms for 512 prompt tokens."""
    coef = {"samples": 2e-5, "decode_kv": 2e-8, "prefill_rows": 1e-4, "prefill_attn": 1e-9}
    return StepCosts((1, 64, 512, 2048), [2e-3, 4e-3, 3e-2, 1.2e-1], coef, frontend_s=frontend_s,
                     kv_transfer_s_per_block=2e-4)  # fmt: skip


def shared_prefix(seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(name="shared-prefix", input_len=LengthDist.parse(64), output_len=LengthDist.parse(16),
                        num_groups=9, prefix_len=512, seed=seed)  # fmt: skip


def run(cfg: FleetConfig, spec: WorkloadSpec, load: Load, num_blocks: int = 4000, **kw):
    fleet = Fleet(cfg, EngineShape(num_blocks=num_blocks, max_num_seqs=32, max_num_batched_tokens=512), costs(**kw))
    return fleet.run(token_sessions(spec, VOCAB), load)


def hit_rate(res) -> float:
    hits = sum(r["prefix_cache_hits"] for r in res.replicas.values())
    return hits / sum(r["prefix_cache_queries"] for r in res.replicas.values())


def test_prefix_routing_raises_the_prefix_hit_rate_on_a_shared_prefix_workload():
    """4 replicas whose KV caches hold about 3 of the 8 system prompts each: round-robin sends every group
    everywhere and evicts; the prefix policy keeps each group where its blocks are."""
    load = Load(rate=40.0, num_prompts=600)
    rr = run(FleetConfig(replicas=4, policy="round-robin"), shared_prefix(), load, num_blocks=110)
    px = run(FleetConfig(replicas=4, policy="prefix"), shared_prefix(), load, num_blocks=110)
    assert hit_rate(px) > hit_rate(rr) + 0.25, (hit_rate(rr), hit_rate(px))
    assert px.routes.get("prefix", 0) > 500
    ttft = lambda res: sorted(t.token_times[0] - t.start for t in res.tracks)[len(res.tracks) // 2]  # noqa: E731
    assert ttft(px) < ttft(rr)  # the prefill a hit saves is time to first token


def test_kv_events_routing_reads_the_simulated_caches():
    load = Load(rate=40.0, num_prompts=400)
    rr = run(FleetConfig(replicas=4, policy="round-robin"), shared_prefix(), load, num_blocks=110)
    ev = run(FleetConfig(replicas=4, policy="kv-events"), shared_prefix(), load, num_blocks=110)
    assert hit_rate(ev) > hit_rate(rr) + 0.2
    assert ev.routes.get("kv-events", 0) > 300


def test_least_load_spreads_requests_and_every_request_completes():
    res = run(FleetConfig(replicas=3, policy="least-load"), shared_prefix(), Load(concurrency=12, num_prompts=300))
    assert len(res.tracks) == 300 and all(t.error is None and len(t.token_times) == 16 for t in res.tracks)
    steps = [r["steps"] for r in res.replicas.values()]
    assert min(steps) > 0.5 * max(steps)
    assert res.peak_concurrency == 12


def test_more_replicas_hold_a_load_that_one_cannot():
    spec = WorkloadSpec(name="random", input_len=LengthDist.parse(256), output_len=LengthDist.parse(64))
    one = run(FleetConfig(replicas=1), spec, Load(rate=100.0, num_prompts=600))
    four = run(FleetConfig(replicas=4), spec, Load(rate=100.0, num_prompts=600))
    p90 = lambda res: sorted(t.token_times[0] - t.start for t in res.tracks)[int(0.9 * len(res.tracks))]  # noqa: E731
    assert p90(four) < p90(one) / 3
    assert four.duration < one.duration


def step_trace(path, phases) -> str:
    """A jsonl trace with arrival times: (seconds, requests/s) phases, evenly spaced."""
    lines, t = [], 0.0
    for seconds, rate in phases:
        n = int(seconds * rate)
        for i in range(n):  # distinct words: no prompt shares a prefix with another
            prompt = " ".join(f"w{len(lines)}x{k}" for k in range(400))
            lines.append({"prompt": prompt, "max_tokens": 64, "timestamp": t + i / rate})
        t += seconds
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return str(path)


def test_the_autoscaler_adds_replicas_under_a_step_of_load_and_removes_them_after(tmp_path):
    trace = step_trace(tmp_path / "step.jsonl", [(20, 2.0), (40, 40.0), (200, 0.5)])
    scaler = ScalerConfig(min_replicas=1, max_replicas=6, target_concurrency=4, stable_window=20, panic_window=4,
                          slo=SLO(ttft=0.5))  # fmt: skip
    cfg = FleetConfig(autoscale=scaler, replica_startup_s=5.0)
    res = run(cfg, WorkloadSpec(name="jsonl", dataset=trace), Load(rate=float("inf")))
    ups = [e for e in res.scale_events if e["kind"] == "up"]
    downs = [e for e in res.scale_events if e["kind"] == "down"]
    assert ups and downs, res.scale_events
    assert max(e["replicas"] for e in res.scale_events) >= 3
    assert 20 <= ups[0]["at_s"] < 40  # after the step (at 20 s), and within the panic window's reach of it
    assert downs[-1]["at_s"] > 60 and downs[-1]["replicas"] < max(e["replicas"] for e in ups)
    assert len(res.replicas) == 1 + len(ups)
    # a fixed single replica under the same load: the autoscaled fleet's TTFT tail is far lower
    fixed = run(FleetConfig(replicas=1), WorkloadSpec(name="jsonl", dataset=trace), Load(rate=float("inf")))
    p90 = lambda r: sorted(t.token_times[0] - t.start for t in r.tracks)[int(0.9 * len(r.tracks))]  # noqa: E731
    assert p90(res) < p90(fixed) / 2
    assert res.replica_seconds < 6 * res.duration


def test_pd_split_moves_prefills_to_the_prefill_pool_and_pulls_their_blocks():
    spec = WorkloadSpec(name="random", input_len=LengthDist.parse(512), output_len=LengthDist.parse(32))
    res = run(FleetConfig(prefill_replicas=1, decode_replicas=2), spec, Load(rate=4.0, num_prompts=80))
    assert len(res.tracks) == 80 and all(t.error is None and len(t.token_times) == 32 for t in res.tracks)
    roles = {name: r["role"] for name, r in res.replicas.items()}
    assert sorted(roles.values()) == ["consumer", "consumer", "producer"]
    producer = next(r for r in res.replicas.values() if r["role"] == "producer")
    consumers = [r for r in res.replicas.values() if r["role"] == "consumer"]
    # the decode engines found the pulled blocks as a prefix hit: they computed only the tail of each prompt
    assert sum(r["prefix_cache_hits"] for r in consumers) >= 80 * 496
    assert producer["prefix_cache_queries"] >= 80 * 512
    short = WorkloadSpec(name="random", input_len=LengthDist.parse(8), output_len=LengthDist.parse(8))
    res = run(FleetConfig(prefill_replicas=1, decode_replicas=1), short, Load(rate=4.0, num_prompts=10))
    assert res.routes.get("pd:short-prompt") == 10


@pytest.mark.parametrize(
    "cfg, message",
    [
        (FleetConfig(replicas=0), "--replicas"),
        (FleetConfig(prefill_replicas=1), "--decode-replicas"),
        (FleetConfig(prefill_replicas=1, decode_replicas=1, autoscale=ScalerConfig()), "P/D"),
    ],
)
def test_bad_fleets_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        Fleet(cfg, EngineShape(num_blocks=100), costs())


def test_a_replica_scaled_down_loses_no_request_on_its_way_in(tmp_path):
    """With a long way in (frontend_s), requests are in flight to a replica before it holds them: a drain waits
    for them, as the live autoscaler waits for the router's in-flight count."""
    trace = step_trace(tmp_path / "step.jsonl", [(20, 2.0), (40, 40.0), (200, 3.0)])
    scaler = ScalerConfig(min_replicas=1, max_replicas=6, target_concurrency=4, stable_window=20, panic_window=4,
                          slo=SLO(ttft=0.5))  # fmt: skip
    res = run(FleetConfig(autoscale=scaler, replica_startup_s=5.0), WorkloadSpec(name="jsonl", dataset=trace),
              Load(rate=float("inf")), frontend_s=0.4)  # fmt: skip
    assert [e for e in res.scale_events if e["kind"] == "down"]
    assert all(t.error is None for t in res.tracks), sum(t.error is not None for t in res.tracks)
