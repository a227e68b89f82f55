"""The prefix-caching benchmark end to end on the bundled model (slow: `make test-slow`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_prefix_caching_cuts_prefill_work_with_identical_outputs(tmp_path):
    out = tmp_path / "prefix.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_prefix_cache.py"),
        "--model",
        "bundled",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-requests",
        "16",
        "--prefix-len",
        "512",
        "--kv-cache-gb",
        "0.25",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    figures = json.loads(out.read_text())
    assert figures["identical"]
    assert figures["prefill_work_ratio"] >= 5
    assert figures["ttft_ratio"] >= 2
