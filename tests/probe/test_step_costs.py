"""`fulcrum sim calibrate` on the bundled model: the engine's real steps measured and fitted, the file it writes, and
`fulcrum plan --validate` / `--hardware local` predicting from a given cost file."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from fulcrum.cli import main
from fulcrum.plan.step_costs import StepCosts, decode_seconds, prefill_seconds
from fulcrum.probe.step_costs import calibrate, default_costs_path, engine_threads
from fulcrum.sim.calibrate import add_calibrate_args, run_calibrate
from fulcrum.utils import cpu_isa


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A quick calibration of the bundled model (no server: about 10 s), saved as a user's would be."""
    costs = calibrate(quick=True, served=False, say=None)
    return costs, costs.save(tmp_path_factory.mktemp("costs") / "bundled.json")


def test_a_quick_calibration_writes_a_model_that_predicts_more_work_as_slower(calibrated):
    _, path = calibrated
    costs = StepCosts.load(path)
    assert costs.source == "measured" and costs.engine["model"].endswith("tiny-shakespeare-target")
    assert costs.engine["num_blocks"] > 0 and costs.engine["threads"] >= 1 and costs.engine["block_size"] == 16
    assert costs.machine["cores"] == os.cpu_count() and costs.machine["isa"] == cpu_isa.isa()
    # the sweep measured prefill chunks up to the engine's 2048; the replica it describes is `fulcrum serve`'s, whose
    # CPU step budget is 256 (what `fulcrum sim` and `plan --hardware local` model unless told otherwise)
    assert costs.engine["max_num_batched_tokens"] == 2048 and costs.engine["device"] == "cpu"
    assert costs.engine["served_max_num_batched_tokens"] == costs.step_budget == 256
    held = costs.fit["held_out"]
    assert held["steps"] == costs.fit["shapes_held_out"] > 0 and held["mean_abs_rel_error"] >= 0
    assert costs.fit["shapes_fitted"] > 3 * costs.fit["shapes_held_out"] // 2  # about four fifths fitted
    assert costs.frontend_s == 0 and "not measured" in costs.fit["frontend"]["how"]
    assert costs.kv_transfer_s_per_block > 0 and costs.fit["kv_transfer"]["block_bytes"] == 8 * 2 * 4 * 32 * 16 * 4
    # more rows, a longer prompt: a slower step (far apart, so that timing noise cannot reorder them)
    assert decode_seconds(costs, 16, 256) > decode_seconds(costs, 1, 256) > 0
    assert prefill_seconds(costs, 1024, 2048) > prefill_seconds(costs, 16, 2048) > 0


def test_the_default_path_names_the_engine_settings_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    path = default_costs_path(None, "auto", "fp8_e4m3", 3, "int4", 64)
    assert path == tmp_path / "step-costs" / f"tiny-shakespeare-target-fp32-kvfp8-int4g64-3t-{cpu_isa.isa()}.json"
    assert default_costs_path(None, "bfloat16", "auto", 1).name.startswith("tiny-shakespeare-target-bf16-kvbf16-1t-")


def _calibrate_cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    add_calibrate_args(p)
    return run_calibrate(p.parse_args(list(argv)))


def test_settings_the_engine_refuses_are_one_line_and_exit_2(capsys, tmp_path):
    assert _calibrate_cli("--max-model-len", "99999", "--out", str(tmp_path / "x.json")) == 2
    err = capsys.readouterr().err
    assert err.startswith("fulcrum sim calibrate: ") and "max_model_len" in err and err.count("\n") == 1
    assert _calibrate_cli(str(tmp_path / "no-such-model"), "--quick", "--no-served") == 2
    assert "not a model folder" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def known_costs(tmp_path) -> tuple[StepCosts, str]:
    coef = {"samples": 0.0, "decode_kv": 1e-6, "prefill_rows": 0.0, "prefill_attn": 0.0}
    costs = StepCosts((1, 2, 2048), [3e-3, 4e-3, 0.5], coef, engine={"threads": 1, "max_num_batched_tokens": 2048})
    return costs, str(costs.save(tmp_path / "known.json"))


def test_validate_predicts_from_the_given_cost_file(capsys, tmp_path):
    costs, path = known_costs(tmp_path)
    assert main(["plan", "--validate", "--step-costs", path, "--input-len", "64", "--output-len", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hardware"]["step_costs"] == path
    rows = {r["quantity"]: r for r in result["comparisons"]}
    context = 32 + 12 // 2  # the decode prompt and half the output: the mean KV length decoded over
    assert rows["decode batch 1: TPOT (ms)"]["predicted"] == pytest.approx(decode_seconds(costs, 1, context) * 1e3)
    assert rows["decode batch 2: TPOT (ms)"]["predicted"] == pytest.approx(decode_seconds(costs, 2, context) * 1e3)
    assert rows["prefill 64 tokens (tokens/s)"]["predicted"] == pytest.approx(64 / prefill_seconds(costs, 64, 64))
    assert rows["resident weights (MB)"]["error"] == 0  # the other columns stay plan's arithmetic


def test_plan_on_local_hardware_predicts_from_the_given_cost_file(tmp_path):
    costs, path = known_costs(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    args = ["plan", "--hardware", "local", "--step-costs", path, "--json", "--concurrency", "4", "--input-len", "100"]
    res = subprocess.run([sys.executable, "-m", "fulcrum.cli", *args], capture_output=True, text=True, timeout=300,
                         env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    context = 100 + 256 // 2
    assert [p["tpot_s"] for p in d["decode"]] == pytest.approx([decode_seconds(costs, b, context) for b in (1, 2, 4)])
    assert d["prefill"]["seconds"] == pytest.approx(prefill_seconds(costs, 100, 2048))
    assert any(path in a for a in d["assumptions"])


@pytest.mark.slow
def test_a_served_calibration_measures_the_frontend_and_prints_its_error(capsys, tmp_path):
    out = tmp_path / "served.json"
    assert _calibrate_cli("--quick", "--out", str(out)) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "held-out error: mean" in text and f"saved to {out}" in text and "a step of 16 tokens" in text
    costs = StepCosts.load(out)
    assert costs.frontend_s >= 0 and costs.fit["frontend"]["requests"] == 20
    assert costs.fit["frontend"]["ttft_median_s"] > costs.frontend_s


@pytest.mark.slow
def test_validate_calibrates_this_machine_first_when_it_has_no_cost_file(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("fulcrum.probe.step_costs.cache_root", lambda: tmp_path)
    args = ["plan", "--validate", "--input-len", "64", "--output-len", "12", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    path = default_costs_path(None, "auto", "auto", engine_threads(own_process=False))
    assert "calibrating" in captured.err and path.is_file() and path.parent.parent == tmp_path
    assert json.loads(captured.out)["hardware"]["step_costs"] == str(path)
    assert main(args) == 0  # the second time, the file is there
    assert "calibrating" not in capsys.readouterr().err
