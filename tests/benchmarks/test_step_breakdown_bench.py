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
