"""bench_decode_attention runs a small step, times the kernel beside a plain read, and checks a second build."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fulcrum.kernels import cpu_attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_attention.available(), reason="needs fulcrum's CPU attention kernels")
def test_the_bench_times_the_kernel_and_a_second_build_beside_a_plain_read(tmp_path):
    out = tmp_path / "r.json"
    against = ROOT / "fulcrum/kernels/csrc/decode_attention.cpp"
    cmd = [sys.executable, "benchmarks/bench_decode_attention.py", "--seqs", "6", "--ctx", "70", "--prompt", "40",
           "--layers", "2", "--rounds", "2", "--against", str(against), "--out", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("fulcrum", "against", "plain read"):
        assert any(line.startswith(name) and "GB/s" in line for line in res.stdout.splitlines()), res.stdout
    data = json.loads(out.read_text())
    assert data["bytes"] == 6 * 70 * 4 * 32 * 4 * 2 * 2
    assert len(data["ms_runs"]["fulcrum"]) == 2 and all(ms > 0 for ms in data["ms_runs"]["fulcrum"])
