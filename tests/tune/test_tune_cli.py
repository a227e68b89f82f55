"""`fulcrum tune` end to end: real servers of the bundled model on loopback ports under a small budget, the
`--serve-cmd` path through a stand-in server script, and bad flags."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
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


def running(marker: str) -> list[str]:
    """Command lines of the processes naming `marker` (each tune's servers get it as their served model name)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if marker in line and "pytest" not in line and " tune " not in line]


def marked(tmp_path: Path) -> tuple[str, list[str]]:
    marker = f"tuned-{tmp_path.name}"
    return marker, ["--serve-args", f"--served-model-name {marker}"]


def test_a_tune_walks_every_stage_and_its_config_starts_a_server(tmp_path):
    out = tmp_path / "tune"
    marker, serve_args = marked(tmp_path)
    # a quality bound no quantization meets: every format is rejected before a server of it starts
    done = tune("--budget", "120s", "--max-quality-loss", "kl=1e-9", "--try-quantization", "int8",
                "--slo", "ttft_p90=2s,tpot_p90=500ms", "--out", str(out), *serve_args, *SMALL)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    stages = [t["stage"] for t in doc["trials"]]
    for stage in ("baseline", "memory & batching", "quantization", "parallelism", "scale out", "disaggregate"):
        assert stage in stages, stages
    assert doc["elapsed_s"] <= 120 + 30  # the budget, and the last candidate's stop
    baseline = doc["trials"][0]
    assert baseline["verdict"] == "baseline" and baseline["measurement"]["goodput_rps"] > 0
    quant = [t for t in doc["trials"] if t["stage"] == "quantization"]
    rejected = [t for t in quant if t["verdict"].startswith("rejected unmeasured: quality kl")]
    # the rest ran out of the budget: before they started, or in their quality eval. In a slow hour of the VM that
    # can be every one of them (a clean-clone run failed so): the rejection itself is test_search's to show, here
    # that no candidate over the bound is measured or served
    out_of_budget = ("skipped: budget", "skipped: quality not known (fulcrum eval took over")
    verdicts = [t["verdict"] for t in quant]
    assert quant and all(t in rejected or t["verdict"].startswith(out_of_budget) for t in quant), verdicts
    assert all(t["measurement"] is None for t in quant)
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    assert "--quantization" not in logs and "--kv-cache-dtype" not in logs  # no server of them was started
    assert doc["result"]["goodput_rps"] >= doc["result"]["baseline_goodput_rps"] > 0
    for name in ("report.md", "serve-config.yaml", "goodput.png"):
        assert (out / name).exists(), name
    md = (out / "report.md").read_text()
    assert "## Stage 2: baseline" in md and "## Stage 7: disaggregate" in md and "fulcrum serve" in md
    assert "fulcrum serve" in done.stdout and not running(marker)
    # the winning configuration starts as written
    with start(None, "--config", str(out / "serve-config.yaml"), "--served-model-name", "tuned",
               log_path=tmp_path / "serve.log", timeout=120) as server:  # fmt: skip
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tuned"


def test_serve_cmd_drives_another_engines_server_through_the_template(tmp_path):
    out, log = tmp_path / "tune", tmp_path / "standin.log"
    # 10 ms a token: a request queued behind a busy slot waits 160 ms, well past the 120 ms bound, and one that is
    # not waits about 10 ms, well inside it, so the load the baseline holds does not move with the machine's speed
    template = f"{sys.executable} {STANDIN} --port {{port}} --token-ms 10 {{max_num_seqs:--max-num-seqs }}"
    done = tune("--serve-cmd", template, "--budget", "60s", "--slo", "ttft_p90=120ms", "--concurrency", "8",
                "--input-len", "8", "--output-len", "16", "--point-seconds", "3", "--quiet", "--out", str(out),
                "--price-per-hour", "2", env={"STANDIN_LOG": str(log)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert starts[0] == ["--port", starts[0][1], "--token-ms", "10"]  # the baseline: the stand-in's default batch
    seqs = next(t for t in doc["trials"] if t["change"].startswith("max-num-seqs"))
    # queueing behind 2 slots breaks the TTFT bound at a load of 4; twice the slots hold twice the load
    assert seqs["kept"], seqs["verdict"]
    assert any("--max-num-seqs" in s for s in starts[1:])
    skipped = [t for t in doc["trials"] if "does not expose" in t["verdict"]]
    assert any("quantization" in t["verdict"] for t in skipped)
    assert any("max_num_batched_tokens" in t["verdict"] for t in skipped)
    pd = [t for t in doc["trials"] if t["stage"] == "disaggregate"]
    assert pd[-1]["predicted"] and "another engine" in pd[-1]["verdict"]
    assert "--max-num-seqs" in doc["result"]["command"] and str(STANDIN) in doc["result"]["command"]
    assert not running(str(STANDIN))


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
        (["--hardware", "H100-SXM"], "this machine has no GPU"),
        (["--hardware", "TPU-v9"], "TPU-v9"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    done = tune(*args, "--budget", "10s", timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_server_and_keeps_what_was_measured(tmp_path, sig):
    out = tmp_path / "tune"
    marker, serve_args = marked(tmp_path)
    cmd = [sys.executable, "-m", "fulcrum.cli", "tune", "--budget", "5m", "--out", str(out), *serve_args, *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not running(marker) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert running(marker), "no server started"
        time.sleep(3)  # starting or loaded: either way it must go
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    deadline = time.time() + 10
    while running(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert not running(marker)
    doc = json.loads((out / "report.json").read_text())
    assert doc["interrupted"] is True


def test_a_pd_candidate_is_a_prefill_and_a_decode_engine_behind_the_router(tmp_path):
    from fulcrum.defaults import DEFAULT_MODEL
    from fulcrum.tune.launch import Launcher
    from fulcrum.tune.space import Config

    launcher = Launcher(str(DEFAULT_MODEL), tmp_path / "logs", units=2)
    with launcher.serving(Config({"max_num_seqs": 8}, pd=True)) as url:
        body = {"model": "tiny-shakespeare-target", "prompt": "To be, or not to be " * 12, "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    disaggregated = [line for line in metrics.splitlines() if line.startswith("fulcrum_router:pd_requests_total")]
    assert any('path="disaggregated"' in line and line.endswith(" 1.0") for line in disaggregated), disaggregated
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["001-producer.log", "002-consumer.log", "003-router.log"]


def test_defaults_that_do_not_serve_end_the_tune_with_the_reason(tmp_path):
    failing = f"{sys.executable} -c \"import sys; print('RuntimeError: no GPU here'); sys.exit(3)\" {{port}}"
    done = tune("--serve-cmd", failing, "--budget", "30s", "--quiet", "--out", str(tmp_path / "tune"), timeout=60)
    assert done.returncode == 1
    assert "the default configuration did not serve, so nothing was tuned" in done.stdout
    assert "RuntimeError: no GPU here" in done.stdout
    doc = json.loads((tmp_path / "tune" / "report.json").read_text())
    assert [t["stage"] for t in doc["trials"]] == ["baseline"]


def test_a_trace_and_a_fleet_rate(tmp_path):
    out, trace = tmp_path / "tune", tmp_path / "trace.jsonl"
    rows = [
        {"prompt": f"request {i}: " + "word " * 20, "max_tokens": 8} for i in range(100)
    ]  # no repeats among what tune samples
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = f"{sys.executable} {STANDIN} --port {{port}} --max-num-seqs 16 {{max_num_seqs:--max-num-seqs }}"
    done = tune("--serve-cmd", template, "--dataset", str(trace), "--rate", "5000", "--budget", "20s",
                "--slo", "ttft_p90=500ms", "--price-per-hour", "2", "--point-seconds", "2", "--quiet",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    assert "workload: jsonl" in doc["target"]["lines"][1] and "prefixes not shared" in doc["target"]["lines"][1]
    fleet = next(t for t in doc["trials"] if t["stage"] == "scale out")
    g = doc["result"]["goodput_rps"]  # the best's, per replica
    assert 0 < g < 5000 and fleet["notes"]["replicas"] == math.ceil(5000 / g)
    assert fleet["notes"]["fleet_cost_per_hour"] == 2 * fleet["notes"]["replicas"]
    assert "--policy least-load" in fleet["verdict"]


def test_a_pd_winner_is_written_as_its_two_engines_and_the_router(tmp_path):
    from fulcrum.tune.launch import Launcher
    from fulcrum.tune.space import Config

    launcher = Launcher("/m", tmp_path / "logs", units=4)
    prefill, decode, router = launcher.commands(Config({"max_num_seqs": 8}, pd=True))
    assert "--kv-role producer" in prefill and "--cpu-bind 0-1" in prefill and "--port 8100" in prefill
    assert "--kv-role consumer" in decode and "--cpu-bind 2-3" in decode and "--max-num-seqs 8" in decode
    assert router.startswith("fulcrum router") and "--prefill http://127.0.0.1:8100" in router
    gpus = Launcher("/m", tmp_path / "logs", device="cuda", units=2).commands(Config({}, pd=True))
    assert gpus[0].startswith("CUDA_VISIBLE_DEVICES=0 ") and gpus[1].startswith("CUDA_VISIBLE_DEVICES=1 ")
