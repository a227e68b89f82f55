"""bench_step_breakdown --workload splits a whole offline run by step kind and kernel, and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_whole_run_is_split_into_prefill_steps_decode_steps_and_the_time_between(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import BUNDLED, workload

    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmarks/bench_step_breakdown.py", "--model", "bundled", "--dtype", "float32",
           "--workload", "6", "--repeats", "1", "--work-dir", str(tmp_path), "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "prefill steps" in res.stdout and "decode steps" in res.stdout, res.stdout
    (run,) = json.loads(out.read_text())["runs"]
    vocab = json.loads((BUNDLED / "config.json").read_text())["vocab_size"]
    outs = [o for _, o in workload(6, vocab)]
    prefill, decode = run["prefill"], run["decode"]
    # every token after each request's first comes from a decode row, or from a row beside a prompt chunk
    assert decode["rows"] + prefill["rows"] >= sum(outs) - len(outs)
    assert decode["steps"] >= max(outs) - 1 - prefill["steps"]
    assert prefill["parts"]["linears"] > 0 and sum(decode["parts"].values()) > 0
    assert 0 < prefill["s"] + decode["s"] < run["total_s"] and run["between_steps_s"] > 0
    # the fused stack's decode steps are split by its own clocks, within the stack's time
    if decode["parts"].get("decode stack"):
        assert 0 < sum(decode["stack"].values()) <= decode["parts"]["decode stack"]
        assert decode["stack"]["attn"] > 0 and decode["stack"]["gate_up"] > 0


def test_a_step_is_timed_against_the_floor_measured_beside_it(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmarks/bench_step_breakdown.py", "--model", "bundled", "--dtype", "float32",
           "--rows", "4", "--steps", "8", "--prompt-len", "32", "--repeats", "2", "--work-dir", str(tmp_path),
           "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(out.read_text())
    # each timed run has its own floor, and the ratio reported is the median of the runs' own ratios
    assert len(r["step_ms_runs"]) == len(r["floor_ms_runs"]) == 2
    assert sorted(r["step_over_floor_runs"]) == sorted(s / f for s, f in zip(r["step_ms_runs"], r["floor_ms_runs"]))
    assert r["step_over_floor"] in r["step_over_floor_runs"]
    assert r["floor"]["ms"] == max(r["floor"]["bytes_ms"], r["floor"]["flops_ms"]) > 0
    if r["parts_ms"].get("decode stack"):  # the stack's own split, and its linears against their floor
        assert r["stack_ms"]["qkv"] > 0 and r["stack_ms"]["attn"] > 0
        assert r["linears_ms"] > 0 and r["linears_over_floor"] == r["linears_ms"] / r["linears_floor_ms"]
    assert "step / floor" in res.stdout and "against their floor" in res.stdout
