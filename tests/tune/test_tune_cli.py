"""`fulcrum tune` end to end: real servers of the bundled model on loopback ports under a small budget, the
`--serve-cmd` path through a stand-in server script, and bad flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fulcrum.utils.serve_process import start

STANDIN = Path(__file__).with_name("standin_server.py")
SMALL = ["--input-len", "32", "--output-len", "16", "--concurrency", "4", "--point-seconds", "3", "--quiet"]


def tune(*args: str, timeout: float = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "fulcrum.cli", "tune", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def no_servers_left(out: Path) -> bool:
    """No process still runs with a command line naming the tune's folder or a fulcrum serve of it."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(out) not in ps


def test_a_tune_walks_every_stage_and_its_config_starts_a_server(tmp_path):
    out = tmp_path / "tune"
    # a quality bound no quantization meets: every format is rejected before a server of it starts
    done = tune("--budget", "100s", "--max-quality-loss", "kl=1e-9", "--try-quantization", "int8",
                "--slo", "ttft_p90=2s,tpot_p90=500ms", "--out", str(out), *SMALL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    stages = [t["stage"] for t in doc["trials"]]
    for stage in ("baseline", "memory & batching", "quantization", "parallelism", "scale out", "disaggregate"):
        assert stage in stages, stages
    baseline = doc["trials"][0]
    assert baseline["verdict"] == "baseline" and baseline["measurement"]["goodput_rps"] > 0
    quant = [t for t in doc["trials"] if t["stage"] == "quantization"]
    assert quant and all(t["verdict"].startswith("rejected unmeasured: quality kl") for t in quant)
    assert all(t["measurement"] is None for t in quant)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "--quantization" not in logs and "--kv-cache-dtype" not in logs  # no server of them was started
    assert doc["result"]["goodput_rps"] >= doc["result"]["baseline_goodput_rps"] > 0
    for name in ("report.md", "serve-config.yaml", "goodput.png"):
        assert (out / name).exists(), name
    md = (out / "report.md").read_text()
    assert "## Stage 2: baseline" in md and "## Stage 7: disaggregate" in md and "fulcrum serve" in md
    assert "fulcrum serve" in done.stdout and no_servers_left(out)
    # the winning configuration starts as written
    with start(None, "--config", str(out / "serve-config.yaml"), "--served-model-name", "tuned",
               log_path=tmp_path / "serve.log", timeout=120) as server:  # fmt: skip
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tuned"


def test_serve_cmd_drives_another_engines_server_through_the_template(tmp_path):
    out, log = tmp_path / "tune", tmp_path / "standin.log"
    template = f"{sys.executable} {STANDIN} --port {{port}} {{max_num_seqs:--max-num-seqs }}"
    done = tune("--serve-cmd", template, "--budget", "60s", "--slo", "ttft_p90=120ms", "--concurrency", "8",
                "--input-len", "8", "--output-len", "16", "--point-seconds", "3", "--quiet", "--out", str(out),
                env={"STANDIN_LOG": str(log)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert starts[0] == ["--port", starts[0][1]]  # the baseline: the stand-in's own default batch
    seqs = next(t for t in doc["trials"] if t["change"].startswith("max-num-seqs"))
    # queueing behind 2 slots breaks the TTFT bound; 8 slots hold the load
    assert seqs["kept"], seqs["verdict"]
    assert any("--max-num-seqs" in s for s in starts[1:])
    skipped = [t for t in doc["trials"] if "does not expose" in t["verdict"]]
    assert any("quantization" in t["verdict"] for t in skipped)
    assert any("max_num_batched_tokens" in t["verdict"] for t in skipped)
    pd = [t for t in doc["trials"] if t["stage"] == "disaggregate"]
    assert pd[-1]["predicted"] and "another engine" in pd[-1]["verdict"]
    assert "--max-num-seqs" in doc["result"]["command"] and str(STANDIN) in doc["result"]["command"]
    assert no_servers_left(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slo", "ttft_p42=1s"], "bad SLO"),
        (["--budget", "soon"], "expected a duration"),
        (["--max-quality-loss", "bleu=1"], "bad quality bound"),
        (["--serve-cmd", "serve {max_num_seqs}"], "needs a {port} placeholder"),
        (["--try-quantization", "int3"], "int3 not among"),
        (["--rate", "2", "--concurrency", "4"], "not allowed with"),
        (["/no/such/model"], "not a model folder"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    done = tune(*args, "--budget", "10s", timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
