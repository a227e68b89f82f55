"""`fulcrum plan --validate` and `--hardware local` as a user runs them: the probe measures this machine and the
engine, and the CLI hands plan the numbers."""

import json
import os
import subprocess
import sys

from fulcrum.cli import main


def test_validate_on_the_bundled_model_predicts_and_measures(capsys):
    # the CLI hands plan the engine's measurement (plan itself never imports the engine)
    assert main(["plan", "--validate", "--input-len", "64", "--output-len", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["quantity"]: r for r in result["comparisons"]}
    tpot = rows["decode batch 1: TPOT (ms)"]
    # timings vary with what else runs on the machine: the error itself is for the committed logs, not a test
    assert tpot["predicted"] > 0 and tpot["measured"] > 0
    assert tpot["error"] == (tpot["predicted"] - tpot["measured"]) / tpot["measured"]
    assert set(result["measured"]["decode"]) == {"1", "2"}
    assert result["measured"]["weight_bytes"] == 6820096 * 4  # the engine loaded what the config describes


def test_plan_on_local_hardware_measures_this_machine():
    # a process of its own, as a user runs it: the profiler's backend (kineto) reads its log level once per process
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    res = subprocess.run(
        [sys.executable, "-m", "fulcrum.cli", "plan", "--hardware", "local", "--json", "--concurrency", "4"],
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
