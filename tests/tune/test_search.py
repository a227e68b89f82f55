"""The walk's decisions, apart from servers: a measurer that returns known figures stands in for the runs."""

from __future__ import annotations

import pytest

from fulcrum.tune.facts import Facts
from fulcrum.tune.measure import Measurement, Point
from fulcrum.tune.quality import QualityResult
from fulcrum.tune.search import Walk, budget_candidates
from fulcrum.tune.space import Config


def measured(goodput: float, concurrency: int = 4, seconds: float = 1.0) -> Measurement:
    summary = {"request_throughput": goodput, "failed": 0, "output_throughput": goodput * 10,
               "ttft_ms": {"p90": 100.0}, "tpot_ms": {"p90": 10.0}}  # fmt: skip
    return Measurement(points=[Point(concurrency, summary, [])], seconds=seconds)


class FakeMeasurer:
    """Goodput by the candidate's description; a list gives one figure per run (first run, confirmation, ...)."""

    def __init__(self, figures: dict, default: float = 10.0):
        self.figures, self.default, self.calls = figures, default, []

    def __call__(self, config: Config, start_at: int = 1, deadline=None) -> Measurement:
        self.calls.append(config)
        key = config.describe()
        value = self.figures.get(key, self.default)
        if isinstance(value, list):
            value = value.pop(0) if len(value) > 1 else value[0]
        return measured(value)


class FakeGate:
    def __init__(self, kl: dict):
        self.kl, self.calls = kl, []

    def __call__(self, quantization, kv_cache_dtype="auto", timeout=None) -> QualityResult:
        self.calls.append((quantization, kv_cache_dtype))
        key = quantization if kv_cache_dtype == "auto" else f"kv-{kv_cache_dtype}"
        return QualityResult({"kl_mean": self.kl.get(key, 0.0), "top1_agreement": 0.99})


def walk(figures: dict, facts: Facts | None = None, kl: dict | None = None, budget: float = 1e9, **kw):
    m, gate = FakeMeasurer(figures), FakeGate(kl or {})
    facts = facts or Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8)
    w = Walk(m, gate, facts, {"kl": 0.01}, budget, **kw)
    w.run()
    return w, m, gate


def timed_walk(figures: dict, seconds: float, units: int, budget: float = 100) -> tuple[Walk, FakeMeasurer]:
    """A walk on a clock that only the runs move: each takes `seconds` of a `budget`-second budget."""
    clock = [0.0]
    m = FakeMeasurer(figures)

    def timed(config, start_at=1, deadline=None):
        clock[0] += seconds
        r = m(config)
        r.seconds = seconds
        return r

    facts = Facts(units=units, num_heads=8, num_kv_heads=4, num_layers=8)
    w = Walk(timed, FakeGate({}), facts, {"kl": 0.01}, budget, clock=lambda: clock[0])
    w.run()
    return w, m


def trial(w: Walk, change_prefix: str):
    found = [t for t in w.trials if t.change.startswith(change_prefix)]
    assert found, [t.change for t in w.trials]
    return found[0]


def test_a_candidate_that_lowers_goodput_is_not_kept():
    w, _, _ = walk({"max-num-batched-tokens=128": 8.0})
    t = trial(w, "max-num-batched-tokens 128")
    assert not t.kept and t.verdict.startswith("rejected: goodput 8")
    assert w.best.config.get("max_num_batched_tokens") is None  # the server's own default, no flag


def test_the_step_budgets_tried_sit_around_the_servers_own_for_the_device():
    # on CPU fulcrum serve steps 256 tokens: 8192 would be a second-long step, so the walk tries 128 and 1024
    w, _, _ = walk({})
    tried = [t.change for t in w.trials if t.change.startswith("max-num-batched-tokens")]
    assert tried == ["max-num-batched-tokens 128", "max-num-batched-tokens 1024"]
    gpu = Facts(device="cuda", units=1, num_heads=8, num_kv_heads=4, num_layers=8)
    w, _, _ = walk({}, facts=gpu)
    assert [t.change for t in w.trials if t.change.startswith("max-num-batched-tokens")] == [
        "max-num-batched-tokens 512", "max-num-batched-tokens 8192"]  # fmt: skip
    # never below max_num_seqs (a decode token per running sequence), and never the default itself
    assert budget_candidates("cpu", 256) == [1024]
    assert budget_candidates("cpu", 512) == [2048]
    assert budget_candidates("cuda", 1024) == [1024, 8192]


def test_another_engines_walk_also_tries_fulcrums_default_budget():
    # a --serve-cmd baseline runs at that engine's own step budget, which tune does not know: fulcrum's default for
    # the device is a candidate of its own there, between the smaller and the larger
    other = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8, fulcrum_server=False)
    w, _, _ = walk({"max-num-batched-tokens=256": 12.0}, facts=other)
    tried = [t.change for t in w.trials if t.change.startswith("max-num-batched-tokens")]
    assert tried == ["max-num-batched-tokens 128", "max-num-batched-tokens 256", "max-num-batched-tokens 1024"]
    assert w.best.config.get("max_num_batched_tokens") == 256  # a flag now, where fulcrum's own walk sets none
    assert budget_candidates("cpu", 256, fulcrum_server=False) == [256, 1024]
    assert budget_candidates("cuda", 4, fulcrum_server=False) == [512, 2048, 8192]


def test_a_candidate_within_the_minimum_gain_is_not_kept():
    w, _, _ = walk({"max-num-batched-tokens=128": 10.3}, min_gain=0.05)
    assert not trial(w, "max-num-batched-tokens 128").kept


def test_a_better_candidate_is_kept_and_later_stages_build_on_it():
    w, m, _ = walk({"max-num-batched-tokens=128": 13.0})
    t = trial(w, "max-num-batched-tokens 128")
    assert t.kept and "x1.30" in t.verdict
    # confirmed by a second run of the same configuration, and run again beside the default at the end
    assert sum(c.describe() == "max-num-batched-tokens=128" for c in m.calls) == 3
    final = [t for t in w.trials if t.stage == "final check"]
    assert [t.config.describe() for t in final] == ["defaults", "max-num-batched-tokens=128"]
    assert trial(w, "weights int8").config.get("max_num_batched_tokens") == 128
    assert w.best.config.get("max_num_batched_tokens") == 128


def test_a_win_the_confirming_run_does_not_repeat_is_not_kept():
    w, _, _ = walk({"max-num-batched-tokens=128": [13.0, 9.0]})
    t = trial(w, "max-num-batched-tokens 128")
    assert not t.kept and "the lower of two runs" in t.verdict
    assert t.measurement.goodput == 9.0


def test_a_win_the_best_matches_when_run_again_is_not_kept():
    # the baseline measured 10 once, but 11.9 when run again beside the candidate: 12 is within the noise
    w, m, _ = walk({"max-num-batched-tokens=128": 12.0, "defaults": [10.0, 11.9]})
    t = trial(w, "max-num-batched-tokens 128")
    assert not t.kept and "vs 11.9, the higher of the best's" in t.verdict
    assert t.notes["best_rerun"]["goodput_rps"] == 11.9
    order = [c.describe() for c in m.calls if c.describe() in ("defaults", "max-num-batched-tokens=128")]
    assert order[:4] == ["defaults", "max-num-batched-tokens=128", "max-num-batched-tokens=128", "defaults"]


def test_a_quantization_over_the_quality_bound_is_rejected_before_any_speed_run():
    w, m, gate = walk({}, kl={"int4": 0.05, "int8": 0.001})
    int4 = trial(w, "weights int4")
    assert int4.verdict.startswith("rejected unmeasured: quality kl 0.05 > 0.01")
    assert int4.measurement is None and int4.quality["kl_mean"] == 0.05
    assert not any(c.get("quantization") == "int4" for c in m.calls)  # never started
    assert any(c.get("quantization") == "int8" for c in m.calls)  # within the bound: measured
    assert ("int4", "auto") in gate.calls


def test_what_cannot_fit_is_pruned_unstarted():
    facts = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8,
                  fits=lambda c: "too big" if c.get("tensor_parallel_size") > 1 else None)  # fmt: skip
    w, m, _ = walk({}, facts=facts)
    t = trial(w, "tensor-parallel-size 2")
    assert "does not fit (too big)" in t.verdict and t.measurement is None
    assert not any(c.get("tensor_parallel_size") > 1 for c in m.calls)


def test_heads_that_do_not_split_are_skipped():
    w, _, _ = walk({}, facts=Facts(units=4, num_heads=6, num_kv_heads=2, num_layers=8))
    assert "6 query and 2 KV heads do not split 4 ways" in trial(w, "tensor-parallel-size 4").verdict


def test_knobs_the_server_command_does_not_expose_are_skipped():
    facts = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8, exposes=lambda k: k == "max_num_seqs")
    w, m, gate = walk({}, facts=facts)
    assert "does not expose max_num_batched_tokens" in trial(w, "max-num-batched-tokens 128").verdict
    assert "does not expose quantization" in trial(w, "weights int8").verdict
    assert not gate.calls  # nothing to gate: the server cannot take the format
    assert all(set(c.changes) <= {"max_num_seqs"} for c in m.calls)


def test_the_budget_skips_candidates_but_every_stage_is_walked():
    w, m = timed_walk({}, seconds=30, units=2)
    stages = {t.stage for t in w.trials}
    assert stages == {"baseline", "memory & batching", "quantization", "parallelism", "scale out", "disaggregate"}
    assert len(m.calls) <= 3
    assert any(t.verdict.startswith("skipped: budget") for t in w.trials)
    pd = [t for t in w.trials if t.stage == "disaggregate"]
    assert pd[-1].predicted and "budget" in pd[-1].verdict


def test_scale_out_sizes_the_fleet_from_the_measured_goodput():
    facts = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8, target_rate=25.0, price_per_hour=2.0,
                  shares_prefixes=True, router_policy="prefix")  # fmt: skip
    w, _, _ = walk({}, facts=facts)
    t = trial(w, "replicas behind the router")
    assert t.notes["replicas"] == 3 and t.notes["fleet_cost_per_hour"] == 6.0
    assert "--policy prefix" in t.verdict and t.predicted


@pytest.mark.parametrize("pd_possible", [None, "one core"])
def test_disaggregation_is_measured_when_two_engines_fit_else_predicted(pd_possible):
    facts = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8, pd_possible=pd_possible)
    w, m, _ = walk({}, facts=facts)
    pd = [t for t in w.trials if t.stage == "disaggregate"]
    assert len(pd) == 1
    if pd_possible is None:
        assert pd[0].measurement is not None and any(c.pd for c in m.calls)
    else:
        assert pd[0].predicted and "one core" in pd[0].verdict and not any(c.pd for c in m.calls)


def test_an_unreachable_slo_is_an_answer_naming_the_limit_and_the_hardware_that_would_meet_it():
    from types import SimpleNamespace

    from fulcrum.defaults import DEFAULT_MODEL
    from fulcrum.plan.model_spec import load_model_spec
    from fulcrum.tune.cli import _result
    from fulcrum.tune.facts import WorkloadFacts
    from fulcrum.tune.target import parse_slo

    def broken(config, start_at=1, deadline=None):
        summary = {"request_throughput": 3.0, "failed": 0, "ttft_ms": {"p90": 900.0}, "tpot_ms": {"p90": 10.0}}
        return Measurement(points=[Point(1, summary, ["ttft_p90 900ms > 5ms"])], seconds=1.0)

    w = Walk(broken, FakeGate({}), Facts(units=1, num_heads=8, num_kv_heads=4, num_layers=8), {"kl": 0.01}, 1e9)
    w.run()
    launcher = SimpleNamespace(commands=lambda c: ["fulcrum serve MODEL"], logs="logs")
    args = SimpleNamespace(slo=parse_slo("ttft_p90=5ms"))
    workload = WorkloadFacts(32, 32, 16, 16, 1, False)
    result = _result(args, w, launcher, load_model_spec(DEFAULT_MODEL), workload, 60.0)
    text = "\n".join(result["lines"])
    assert result["goodput_rps"] == 0
    assert "unreachable here: no configuration met the SLO" in text and "ttft_p90 900ms > 5ms" in text
    assert "limited by prefill compute" in text
    assert "plan's roofline says one of these would meet it: H100-SXM" in text
    assert not any(t.kept for t in w.trials if t.stage != "baseline")


def test_the_baseline_is_measured_whatever_plans_arithmetic_says():
    facts = Facts(units=2, num_heads=8, num_kv_heads=4, num_layers=8, fits=lambda c: "too big")
    w, m, _ = walk({}, facts=facts)
    assert w.baseline.verdict == "baseline" and m.calls[0].describe() == "defaults"
    assert all("does not fit (too big)" in t.verdict for t in w.trials if t.stage == "memory & batching")


def test_a_win_with_no_budget_left_to_confirm_it_is_not_kept():
    w, _ = timed_walk({"max-num-batched-tokens=128": 20.0}, seconds=40, units=1)
    t = trial(w, "max-num-batched-tokens 128")
    assert not t.kept and t.verdict == "rejected: won once, but no budget was left to confirm the win"
    assert w.best is w.baseline
