"""Scale out and P/D simulated with `fulcrum sim`: the commands tune builds from the best configuration, the search
for the fewest replicas (a fake sim that writes known summaries), and one real `fulcrum sim` on the bundled model."""

from __future__ import annotations

import json
import time

from fulcrum.bench.workloads import LengthDist, WorkloadSpec
from fulcrum.defaults import DEFAULT_MODEL
from fulcrum.plan.step_costs import StepCosts
from fulcrum.tune.facts import Facts
from fulcrum.tune.fleet import FleetSim, parse_result, pd_splits
from fulcrum.tune.search import Walk
from fulcrum.tune.space import Config
from fulcrum.tune.target import parse_slo
from tests.tune.test_search import FakeGate, FakeMeasurer

WORKLOAD = WorkloadSpec(input_len=LengthDist.parse(64), output_len=LengthDist.parse(16))


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


class FakeSim:
    """Stands in for the `fulcrum sim` process: a fleet meets tpot_p90=4ms from `enough` machines on, and the first
    run finds no calibration when `calibrated` is False."""

    def __init__(self, enough: int, calibrated: bool = True):
        self.enough, self.calibrated, self.commands = enough, calibrated, []

    def __call__(self, cmd: list[str], timeout: float) -> tuple[int, str]:
        self.commands.append(cmd)
        if "calibrate" in cmd:
            self.calibrated = True
            return 0, "saved to costs.json"
        if not self.calibrated:
            return 2, "fulcrum sim: no step-cost calibration of M on this machine (x.json): run `fulcrum sim calibrate`"
        pd = "--prefill-replicas" in cmd
        n = (
            int(flag(cmd, "--prefill-replicas")) + int(flag(cmd, "--decode-replicas"))
            if pd
            else int(flag(cmd, "--replicas"))
        )
        tpot = 3.0 if n >= self.enough else 9.0
        summary = {"failed": 0, "ttft_ms": {"p90": 50.0}, "tpot_ms": {"p90": tpot}, "request_throughput": 10.0}
        with open(flag(cmd, "--out"), "w") as f:
            json.dump({"runs": [{"summary": summary, "sim": {}}]}, f)
        return 0, ""


def fleet(tmp_path, runner, **kw) -> FleetSim:
    return FleetSim("/models/m", WORKLOAD, parse_slo("tpot_p90=4ms"), tmp_path / "sim", runner=runner, **kw)


def test_the_sim_command_carries_the_best_configurations_engine_and_the_walks_workload(tmp_path):
    config = Config({"max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_cache_dtype": "int8",
                     "no_prefix_caching": True, "cpu_threads": 2})  # fmt: skip
    f = fleet(tmp_path, FakeSim(1), dtype="bfloat16")
    cmd = f.sim_command(config, 25.0, "prefix", "out.json", replicas=3)
    assert cmd[1:4] == ["-m", "fulcrum.cli", "sim"] and flag(cmd, "--model") == "/models/m"
    assert flag(cmd, "--max-num-seqs") == "8" and flag(cmd, "--max-num-batched-tokens") == "512"
    assert flag(cmd, "--kv-cache-dtype") == "int8" and flag(cmd, "--dtype") == "bfloat16"
    assert "--no-enable-prefix-caching" in cmd and flag(cmd, "--replicas") == "3"
    assert flag(cmd, "--policy") == "prefix" and flag(cmd, "--request-rate") == "25"
    assert flag(cmd, "--input-len") == "64" and flag(cmd, "--output-len") == "16" and flag(cmd, "--out") == "out.json"
    pd = f.sim_command(config, 25.0, "prefix", "out.json", prefill=1, decode=2)
    assert flag(pd, "--prefill-replicas") == "1" and flag(pd, "--decode-replicas") == "2" and "--replicas" not in pd
    cal = f.calibrate_command(config.with_(quantization="int8"), quick=True, out="c.json")
    assert cal[3:6] == ["sim", "calibrate", "/models/m"] and flag(cal, "--quantization") == "int8"
    assert "--quick" in cal and flag(cal, "--out") == "c.json" and flag(cal, "--max-num-seqs") == "8"
    assert f.why_not(config.with_(tensor_parallel_size=2)) and f.why_not(Config(pd=True)) and not f.why_not(config)
    assert pd_splits(6) == [(2, 4), (3, 3), (1, 5)] and pd_splits(2) == [(1, 1)]


def test_result_parsing_checks_every_percentile_bound(tmp_path):
    path = tmp_path / "r.json"
    summary = {"failed": 1, "ttft_ms": {"p90": 700.0, "p99": 900.0}, "tpot_ms": {"p90": 20.0}}
    path.write_text(json.dumps({"runs": [{"summary": summary}]}))
    got, misses = parse_result(path, parse_slo("ttft_p99=800ms,tpot_p90=50ms"))
    assert got == summary and misses == ["ttft_p99 900ms > 800ms", "1 requests failed"]


def test_the_fewest_replicas_are_found_from_either_side_of_the_arithmetic(tmp_path):
    deadline = time.monotonic() + 60
    for start in (2, 7, 20):
        answer, tried, why = fleet(tmp_path, FakeSim(enough=7)).fewest_replicas(Config(), 50, "least-load", start,
                                                                                 deadline)  # fmt: skip
        assert why is None and answer.replicas == 7 and not tried[6].met and tried[7].met
    answer, _, why = fleet(tmp_path, FakeSim(enough=1)).fewest_replicas(Config(), 50, "least-load", 3, deadline)
    assert answer.replicas == 1
    answer, _, why = fleet(tmp_path, FakeSim(enough=100)).fewest_replicas(Config(), 50, "least-load", 3, deadline)
    assert answer is None and "up to 64 replicas" in why


def test_a_missing_calibration_is_made_once_then_the_sim_reruns(tmp_path):
    sim = FakeSim(enough=3, calibrated=False)
    f = fleet(tmp_path, sim)
    answer, _, why = f.fewest_replicas(Config({"kv_cache_dtype": "int8"}), 50, "least-load", 3, time.monotonic() + 60)
    assert answer.replicas == 3
    calibrations = [c for c in sim.commands if "calibrate" in c]
    assert len(calibrations) == 1 and "--quick" in calibrations[0]  # a minute left: the quick sweep
    assert flag(calibrations[0], "--kv-cache-dtype") == "int8" and f.calibrations[0]["quick"]


def test_the_walk_says_simulated_beside_the_arithmetic_and_sets_pd_against_the_fleet(tmp_path):
    facts = Facts(units=1, target_rate=100.0, pd_possible="one core", price_per_hour=1.0)
    w = Walk(FakeMeasurer({}, default=25.0), FakeGate({}), facts, {"kl": 0.01}, 1e9, fleet=fleet(tmp_path, FakeSim(6)))
    w.run()
    scale = next(t for t in w.trials if t.stage == "scale out")
    assert (
        scale.verdict.startswith("simulated: 6 replica(s)")
        and "arithmetic from the measured goodput: 4" in scale.verdict
    )
    assert scale.predicted and scale.notes["replicas"] == 6 and scale.notes["fleet_cost_per_hour"] == 6.0
    assert not scale.notes["sim"]["tried"][5]["met"] and scale.notes["sim_file"].endswith("sim-replicas-6.json")
    pd = next(t for t in w.trials if t.stage == "disaggregate")
    assert pd.verdict.startswith("simulated, not measured (one core): P/D 2+4 meets the SLO on 6 machines")
    assert "prompts are" in pd.verdict and pd.predicted  # the ratio stays as context


def test_without_a_simulator_the_arithmetic_verdict_says_why(tmp_path):
    facts = Facts(units=1, target_rate=100.0, pd_possible="one core")
    w = Walk(FakeMeasurer({}, default=25.0), FakeGate({}), facts, {"kl": 0.01}, 1e9, fleet_why="another engine")
    w.run()
    scale = next(t for t in w.trials if t.stage == "scale out")
    assert scale.verdict.startswith("computed: 4 replica(s)") and "not simulated: another engine" in scale.verdict
    pd = next(t for t in w.trials if t.stage == "disaggregate")
    assert pd.verdict.startswith("predicted, not measured (one core)")


def test_a_real_sim_of_the_bundled_model_finds_the_fewest_replicas(tmp_path):
    # step costs that make a step of 64 tokens 4 ms: at 300 req/s of 64+16 tokens, 2 replicas' TPOT p90 is over
    # 4 ms and 3 replicas' under it
    coef = {"samples": 2e-5, "decode_kv": 2e-8, "prefill_rows": 1e-4, "prefill_attn": 1e-9}
    engine = {"num_blocks": 2000, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512,
              "max_model_len": 1024}  # fmt: skip
    costs = StepCosts((1, 64, 512, 2048), [2e-3, 4e-3, 3e-2, 1.2e-1], coef, frontend_s=0.002, engine=engine)
    path = str(costs.save(tmp_path / "costs.json"))
    sim = FleetSim(str(DEFAULT_MODEL), WORKLOAD, parse_slo("tpot_p90=4ms"), tmp_path / "sim", costs=path)
    facts = Facts(units=1, target_rate=300.0)  # P/D measurable here: no P/D is simulated
    w = Walk(FakeMeasurer({}, default=150.0), FakeGate({}), facts, {"kl": 0.01}, 1e9, fleet=sim)
    w.baseline_stage()  # 150 req/s a replica: the arithmetic says 2
    w.scale_out_stage()
    scale = w.trials[-1]
    tried = scale.notes["sim"]["tried"]
    assert scale.notes["replicas"] == 3 and scale.verdict.startswith("simulated: 3 replica(s)"), scale.verdict
    assert tried[3]["met"] and not tried[2]["met"] and tried[2]["error"] is None  # 2 ran and broke the bound
    assert json.loads((tmp_path / "sim" / "sim-replicas-3.json").read_text())["runs"][0]["summary"]["completed"] > 0


def test_a_budget_left_at_the_default_is_the_servers_default_on_tunes_device(tmp_path):
    from fulcrum.defaults import DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS

    config = Config()
    for device, want in (("cpu", DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS), ("cuda", DEFAULT_MAX_NUM_BATCHED_TOKENS)):
        f = fleet(tmp_path, FakeSim(1), device=device)
        assert flag(f.sim_command(config, 5.0, "prefix", "o.json"), "--max-num-batched-tokens") == str(want)
        assert flag(f.calibrate_command(config, quick=True), "--max-num-batched-tokens") == str(want)
    many = fleet(tmp_path, FakeSim(1), device="cpu").sim_command(Config({"max_num_seqs": 600}), 5.0, "prefix", "o")
    assert flag(many, "--max-num-batched-tokens") == "600"
