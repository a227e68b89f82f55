"""bench_prefill_attention runs small prompts through the prefill kernel and a second build, and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fulcrum.kernels import cpu_attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cpu_attention._prefill() is None, reason="needs fulcrum's CPU prefill attention kernel")
def test_the_bench_times_the_kernel_and_a_second_build_over_steps_of_prompts(tmp_path):
    out = tmp_path / "r.json"
    against = ROOT / "fulcrum/kernels/csrc/prefill_attention.cpp"
    cmd = [sys.executable, "benchmarks/bench_prefill_attention.py", "--prompts", "5", "--min-len", "20",
           "--max-len", "90", "--budget", "128", "--rounds", "2", "--against", str(against),
           "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("fulcrum", "against"):
        assert any(line.startswith(name) and "GFLOP/s" in line for line in res.stdout.splitlines()), res.stdout
    data = json.loads(out.read_text())
    assert data["max_abs_diff"] == 0.0  # the same source, the same output
    assert data["flops"] > 0 and len(data["ms_runs"]["fulcrum"]) == 2


def test_steps_take_whole_prompts_up_to_the_budget():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_prefill_attention import steps_of

    assert steps_of([100, 50, 60, 300, 10], 200) == [[100, 50], [60], [300], [10]]
