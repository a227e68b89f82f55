"""`fulcrum bench serve` end to end against a real `fulcrum serve` on loopback: every workload, both
endpoints, the JSON/CSV/plot outputs, `bench compare`, and Ctrl-C keeping a partial result."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fulcrum.cli import main
from fulcrum.config import DEFAULT_MODEL
from tests.server.test_http_errors import metric
from tests.servers import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()


def bench(server, tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    common = ["bench", "serve", "--base-url", server.url, "--quiet", "--out", str(out), "--ignore-eos"]
    assert main([*common, *args]) == 0
    return json.loads(out.read_text())


WORKLOADS = {
    "random": ["--input-len", "uniform:8:40", "--output-len", "6"],
    "shared-prefix": ["--num-groups", "2", "--prefix-len", "64", "--input-len", "8", "--output-len", "4"],
    "long-prefill": ["--long-fraction", "0.5", "--long-input-len", "300", "--input-len", "12", "--output-len", "6"],
    "multi-turn": ["--turns", "3", "--input-len", "10", "--output-len", "5"],
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_each_workload_against_fulcrum_serve(server, tmp_path, workload, endpoint):
    doc = bench(
        server, tmp_path, "--workload", workload, "--endpoint", endpoint, "--num-prompts", "4",
        "--concurrency", "2", "--tokenizer", str(DEFAULT_MODEL), *WORKLOADS[workload],
    )  # fmt: skip
    (run,) = doc["runs"]
    s = run["summary"]
    assert doc["workload"]["name"] == workload and isinstance(doc["workload"]["output_len"], str)
    per_session = 3 if workload == "multi-turn" else 1
    assert s["completed"] == 4 * per_session and s["failed"] == 0
    assert s["token_source"] == {"usage": 4 * per_session}  # counted from the server's usage
    assert doc["model"] == "shakespeare" and run["peak_concurrency"] == 2
    assert s["ttft_ms"]["p50"] > 0 and s["output_throughput"] > 0
    assert len(run["requests"]) == 4 * per_session
    r = run["requests"][0]
    assert len(r["chunk_times"]) >= 1 and r["e2e"] >= r["ttft"] > 0
    if workload == "long-prefill":
        assert set(run["by_tag"]) <= {"short", "long"} and run["by_tag"]
    if workload == "multi-turn":
        assert set(run["by_tag"]) == {"turn 1", "turn 2", "turn 3"}
        turns = {q["tag"]: q["prompt_tokens"] for q in run["requests"] if q["session"] == 0}
        assert turns["turn 1"] < turns["turn 2"] < turns["turn 3"]  # the history grows
    if workload == "random":
        assert all(o == 6 for o in (q["output_tokens"] for q in run["requests"]))


def test_jsonl_workload_without_tokenizer(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "ROMEO:", "max_tokens": 5}\n{"prompt": "JULIET:", "max_tokens": 3}\n')
    doc = bench(server, tmp_path, "--workload", "jsonl", "--dataset", str(data), "--num-prompts", "4")
    s = doc["runs"][0]["summary"]
    assert s["completed"] == 4 and s["output_tokens"] == 5 + 3 + 5 + 3
    assert doc["prompt_lengths"] == "exact (the server's /tokenize)"
    assert {q["prompt_tokens"] - q["input_len"] for q in doc["runs"][0]["requests"]} == {0}  # counted by the server


@pytest.mark.parametrize("input_len", ["128", "uniform:20:90"])
def test_without_tokenizer_the_server_tokenizes_and_prompts_are_exact(server, tmp_path, input_len):
    """`fulcrum serve` by its served name (no folder, not in the Hugging Face cache): bench asks its /tokenize, and
    every prompt is as long as asked, by the server's own count."""
    doc = bench(server, tmp_path, "--num-prompts", "6", "--concurrency", "3", "--input-len", input_len,
                "--output-len", "2")  # fmt: skip
    assert doc["model"] == "shakespeare" and doc["prompt_lengths"] == "exact (the server's /tokenize)"
    reqs = doc["runs"][0]["requests"]
    assert len(reqs) == 6 and all(q["ok"] for q in reqs)
    assert [q["prompt_tokens"] for q in reqs] == [q["input_len"] for q in reqs]
    if input_len == "128":
        assert {q["prompt_tokens"] for q in reqs} == {128}
    else:
        assert all(20 <= q["prompt_tokens"] <= 90 for q in reqs) and len({q["prompt_tokens"] for q in reqs}) > 1


def test_without_stream_usage_the_tokenizer_counts(server, tmp_path):
    args = ["--num-prompts", "3", "--input-len", "8", "--output-len", "6", "--no-stream-usage"]
    doc = bench(server, tmp_path, *args, "--tokenizer", str(DEFAULT_MODEL))
    s = doc["runs"][0]["summary"]
    assert s["token_source"] == {"tokenizer": 3}
    assert 3 * 4 <= s["output_tokens"] <= 3 * 8  # re-tokenized text: close to the 6 tokens generated


def test_sweep_outputs_csv_plots_and_compare(server, tmp_path, capsys):
    plots, table = tmp_path / "plots", tmp_path / "sweep.csv"
    doc = bench(
        server, tmp_path, "--concurrency", "1,4", "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
        "--slo", "ttft=10s,tpot=1s", "--price-per-hour", "2.5", "--csv", str(table), "--plot", str(plots),
    )  # fmt: skip
    assert [r["label"] for r in doc["runs"]] == ["concurrency 1", "concurrency 4"]
    assert [r["peak_concurrency"] for r in doc["runs"]] == [1, 4]
    for r in doc["runs"]:
        s = r["summary"]
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLOs: every request meets them
        assert s["cost_per_1m_output_tokens"] == pytest.approx(2.5 / (s["output_throughput"] * 3600) * 1e6)
    rows = list(csv.DictReader(table.open()))
    assert [r["label"] for r in rows] == ["concurrency 1", "concurrency 4"] and "ttft_p99_ms" in rows[0]
    assert {p.name for p in plots.iterdir()} == {
        "latency_vs_throughput.png",
        "ttft_distribution.png",
        "itl_distribution.png",
    }
    capsys.readouterr()
    other = tmp_path / "other.json"
    (tmp_path / "result.json").rename(other)
    doc2 = bench(
        server, tmp_path, "--concurrency", "1,4", "--num-prompts", "8", "--input-len", "16", "--output-len", "8"
    )
    assert doc2["runs"]
    assert main(["bench", "compare", str(other), str(tmp_path / "result.json")]) == 0
    out = capsys.readouterr().out
    assert "concurrency 4" in out and "result / other" in out and "x" in out


def test_unreachable_server_and_bad_arguments_fail_cleanly(tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--quiet", "--num-prompts", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["bench", "serve", "--workload", "jsonl", "--quiet"]) == 2
    assert "needs --dataset" in capsys.readouterr().err
    assert main(["bench", "serve", "--slo", "ttft=soon", "--quiet"]) == 2
    assert main(["bench", "compare", str(tmp_path / "missing.json")]) == 2


def finished(server) -> float:
    """Requests the server has finished at their max_tokens (what the Ctrl-C test's client asks for)."""
    try:
        return metric(server, 'fulcrum:request_success_total{finished_reason="length"')
    except KeyError:  # none yet
        return 0.0


def test_ctrl_c_writes_the_partial_result(server, tmp_path):
    out = tmp_path / "partial.json"
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", server.url, "--quiet"]
    cmd += ["--concurrency", "2", "--num-prompts", "200", "--input-len", "8", "--output-len", "200"]
    cmd += ["--ignore-eos", "--out", str(out)]
    before = finished(server)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    # Ctrl-C once the server has finished two of its requests (a fixed sleep raced the client's slow start)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and finished(server) < before + 2:
        time.sleep(0.2)
    assert proc.poll() is None, "the client ended before Ctrl-C"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["stopped_by"] == "Ctrl-C"
    run = doc["runs"][0]
    assert run["interrupted"] and 0 < len(run["requests"]) < 200
    assert run["summary"]["failures"].get("interrupted", 0) <= 2  # the requests in flight
    assert b"partial result" in stdout


def test_open_loop_sweep_and_duration(server, tmp_path):
    doc = bench(
        server, tmp_path, "--request-rate", "20,inf", "--burstiness", "0.5", "--max-concurrency", "3",
        "--num-prompts", "6", "--input-len", "8", "--output-len", "4", "--warmup", "2",
    )  # fmt: skip
    assert [r["label"] for r in doc["runs"]] == ["rate 20/s (burstiness 0.5)", "rate inf/s (burstiness 0.5)"]
    assert all(r["summary"]["completed"] == 6 and r["peak_concurrency"] <= 3 for r in doc["runs"])
    assert doc["runs"][1]["load"]["request_rate"] == "inf"
    doc = bench(server, tmp_path, "--concurrency", "2", "--duration", "2", "--input-len", "8", "--output-len", "4")
    (run,) = doc["runs"]
    assert run["summary"]["completed"] >= 4 and max(q["start"] for q in run["requests"]) < 2


def test_ctrl_c_while_the_server_does_not_answer(tmp_path):
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, "--quiet"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # its first connection comes after its Ctrl-C handler is set; a fixed sleep was too short for a slow start
        silent.settimeout(60)
        conn, _ = silent.accept()
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        conn.close()
        assert proc.returncode == 130 and time.time() - t0 < 5


def test_the_servers_own_histograms_beside_the_clients(server, tmp_path, capsys):
    """Each point records the server's TTFT and E2E means over its measured requests (the warm-up left out): the
    server's clocks run from the HTTP arrival to the frontend's receipt, inside the client's send-to-receive span."""
    doc = bench(server, tmp_path, "--concurrency", "1,2", "--num-prompts", "6", "--warmup", "2", "--input-len", "16",
                "--output-len", "6")  # fmt: skip
    for run in doc["runs"]:
        srv, s = run["server"], run["summary"]
        assert srv["requests"] == 6 == s["completed"]
        assert 0 < srv["ttft_mean_ms"] <= s["ttft_ms"]["mean"]
        assert srv["ttft_mean_ms"] < srv["e2e_mean_ms"] <= s["e2e_ms"]["mean"]
    main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2"])
    assert "the server's own histograms (2 req)" in capsys.readouterr().out
