"""The simulator runs the engine's own scheduler: on a fixed workload, one simulated replica makes the decisions a
live engine core makes, step for step (the same requests, the same token counts, the same preemptions)."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.config import DEFAULT_MODEL, EngineConfig
from fulcrum.engine.core import EngineCore
from fulcrum.plan.step_costs import StepCosts
from fulcrum.sampling_params import SamplingParams
from fulcrum.sim.fleet import Fleet, FleetConfig, Load
from fulcrum.sim.replica import EngineShape
from fulcrum.sim.workload import SimSession

BLOCK_BYTES = 8 * 2 * 4 * 32 * 16 * 4  # the bundled model's KV block: layers x K,V x heads x head_dim x 16 x fp32


def costs() -> StepCosts:
    return StepCosts(
        (1, 2048), [1e-3, 2e-2], dict.fromkeys(("samples", "decode_kv", "prefill_rows", "prefill_attn"), 0.0)
    )


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 60, size=40).tolist()
    out = []
    for i in range(n):
        own = rng.integers(1, 60, size=int(rng.integers(5, 120))).tolist()
        out.append(((shared if i % 2 else []) + own, int(rng.integers(4, 40))))
    return out


def live_decisions(requests, **engine) -> tuple[list, int]:
    """Every step's (request, tokens) and preemptions, from a live engine core running `requests` offline."""
    core = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), **engine))
    log = []
    schedule = core.scheduler.schedule

    def recorded():
        out = schedule()
        if out.scheduled:
            log.append(([(s.request.request_id, s.num_new_tokens) for s in out.scheduled], list(out.preempted)))
        return out

    core.scheduler.schedule = recorded
    try:
        for i, (prompt, max_tokens) in enumerate(requests):
            core.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        while core.has_unfinished_requests():
            core.step()
        return log, core.kv.num_blocks
    finally:
        core.shutdown()


def sim_decisions(requests, num_blocks: int, **shape) -> list:
    sessions = [SimSession(i, [], [prompt], [max_tokens]) for i, (prompt, max_tokens) in enumerate(requests)]
    fleet = Fleet(FleetConfig(replicas=1, record_steps=True), EngineShape(num_blocks=num_blocks, **shape), costs(),
                  frontend_s=0.0)  # fmt: skip
    res = fleet.run(iter(sessions), Load(concurrency=len(sessions), num_prompts=len(sessions)))
    assert len(res.tracks) == len(requests)
    (log,) = res.steps_log.values()
    return log


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(dict(max_num_seqs=8, max_num_batched_tokens=64), id="chunked-prefill"),
        pytest.param(
            dict(max_num_seqs=16, max_num_batched_tokens=128, kv_cache_memory=24 * BLOCK_BYTES, max_model_len=256),
            id="kv-pressure-preempts",
        ),  # fmt: skip
    ],
)
def test_one_replica_schedules_as_the_live_engine(engine):
    requests = workload(24)
    live, num_blocks = live_decisions(requests, **engine)
    shape = {"max_model_len": 1024, **{k: v for k, v in engine.items() if k != "kv_cache_memory"}}
    sim = sim_decisions(requests, num_blocks, **shape)
    assert len(sim) == len(live)
    for step, (a, b) in enumerate(zip(live, sim)):
        assert a == b, f"step {step}: live {a} != sim {b}"
    if "kv_cache_memory" in engine:
        assert any(pre for _, pre in live), "the workload should preempt under this KV budget"
