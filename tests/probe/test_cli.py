"""`fulcrum plan --validate` and `--hardware local` as a user runs them: the probe measures this machine and the
engine, and the CLI hands plan the numbers."""

import json
import os
import subprocess
import sys

import pytest

from fulcrum.cli import main
from fulcrum.plan.step_costs import StepCosts


@pytest.fixture
def step_costs(tmp_path) -> str:
    """A step-cost file (`fulcrum sim calibrate`'s), so that a test does not calibrate this machine first."""
    coef = {"samples": 2e-5, "decode_kv": 1e-7, "prefill_rows": 1e-4, "prefill_attn": 1e-9}
    return str(StepCosts((1, 2, 2048), [1e-3, 1.2e-3, 0.3], coef, engine={"threads": 2}).save(tmp_path / "c.json"))


def test_validate_on_the_bundled_model_predicts_and_measures(capsys, step_costs):
    # the CLI hands plan the engine's measurement (plan itself never imports the engine)
    args = ["--step-costs", step_costs, "--input-len", "64", "--output-len", "12", "--json"]
    assert main(["plan", "--validate", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["quantity"]: r for r in result["comparisons"]}
    tpot = rows["decode batch 1: TPOT (ms)"]
    # timings vary with what else runs on the machine: the error itself is for the committed logs, not a test
    assert tpot["predicted"] > 0 and tpot["measured"] > 0
    assert tpot["error"] == (tpot["predicted"] - tpot["measured"]) / tpot["measured"]
    assert set(result["measured"]["decode"]) == {"1", "2"}
    assert result["measured"]["weight_bytes"] == 6820096 * 4  # the engine loaded what the config describes


def test_validate_int4_with_an_int8_cache_probes_and_runs_quantized(capsys, step_costs):
    # the engine's own flags, as `fulcrum serve` takes them: the engine runs the quantized kernels, the weight bytes
    # it holds are what plan predicts, and a cost file calibrated for another engine is said to be one
    args = ["--quantization", "int4", "--quantization-group-size", "64", "--kv-cache-dtype", "int8"]
    args += ["--step-costs", step_costs]
    assert main(["plan", "--validate", *args, "--input-len", "32", "--output-len", "6", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    err = " ".join(captured.err.split())  # the console wraps at 120 columns
    assert "the step costs were calibrated with quantization none; the engine ran int4" in err
    assert result["quantization"] == {"method": "int4", "group_size": 64} and result["kv_cache_dtype"] == "int8"
    got = result["measured"]
    assert got["quantization"] == "int4 (group 64)" and got["kv_cache_dtype"].startswith("int8")
    rows = {r["quantity"]: r for r in result["comparisons"]}
    assert rows["resident weights (MB)"]["error"] == 0  # 4.28 MB, a sixth of the fp32 checkpoint
    assert rows["decode batch 2: TPOT (ms)"]["predicted"] > 0 and rows["decode batch 2: TPOT (ms)"]["measured"] > 0


def test_plan_on_local_hardware_measures_this_machine(step_costs):
    # a process of its own, as a user runs it: the profiler's backend (kineto) reads its log level once per process
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    args = ["plan", "--hardware", "local", "--json", "--concurrency", "4", "--step-costs", step_costs]
    res = subprocess.run(
        [sys.executable, "-m", "fulcrum.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "USDT" not in res.stdout + res.stderr  # kineto's "USDT: ... profiler_start" lines stay out
    d = json.loads(res.stdout)
    hw = d["hardware"]
    assert hw["name"] == "local" and hw["bandwidth"] > 1e9 and hw["op_latency_s"] > 0
    assert d["memory"]["fits"] is True and d["decode"][0]["overhead_s"] > 0
