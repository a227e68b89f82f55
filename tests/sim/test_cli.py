"""`fulcrum sim` from the command line: a bench-shaped report, predicted hardware, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from fulcrum.bench.compare import compare_tables
from fulcrum.cli import main
from fulcrum.plan.step_costs import StepCosts


@pytest.fixture
def costs_file(tmp_path):
    coef = {"samples": 2e-5, "decode_kv": 2e-8, "prefill_rows": 1e-4, "prefill_attn": 1e-9}
    engine = {"num_blocks": 2000, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512,
              "max_model_len": 1024}  # fmt: skip
    costs = StepCosts((1, 64, 512, 2048), [2e-3, 4e-3, 3e-2, 1.2e-1], coef, frontend_s=0.002, engine=engine)
    return str(costs.save(tmp_path / "costs.json"))


def test_sim_writes_a_bench_serve_report_that_bench_compare_reads(costs_file, tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["sim", "--costs", costs_file, "--request-rate", "4,16", "--num-prompts", "120", "--input-len", "128",
               "--output-len", "16", "--replicas", "2", "--policy", "least-load", "--slo", "ttft=200ms",
               "--price-per-hour", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed and "replica-seconds" in printed
    doc = json.loads(out.read_text())
    assert doc["simulated"] is True and [r["label"] for r in doc["runs"]] == ["rate 4/s", "rate 16/s"]
    s = doc["runs"][1]["summary"]
    assert s["completed"] == 120 and s["failed"] == 0 and s["output_tokens"] == 120 * 16
    assert s["ttft_ms"]["p50"] > 2.0  # at least the frontend's 2 ms
    assert s["goodput"] > 0 and s["cost_per_1m_output_tokens"] > 0
    assert len(doc["runs"][1]["requests"]) == 120
    assert compare_tables([str(out), str(out)])  # bench compare sets it beside any other run


def test_a_replica_takes_the_step_budget_its_server_took(tmp_path, capsys):
    """A calibration on CPU measures chunks up to 2048 tokens, but `fulcrum serve` there steps 256 at a time: sim
    models the server's budget unless --max-num-batched-tokens says otherwise (older files: the sweep's)."""
    coef = {"samples": 2e-5, "decode_kv": 2e-8, "prefill_rows": 1e-4, "prefill_attn": 1e-9}
    engine = {"num_blocks": 2000, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
              "max_model_len": 1024, "device": "cpu", "served_max_num_batched_tokens": 256}  # fmt: skip
    served = StepCosts((1, 64, 512, 2048), [2e-3, 4e-3, 3e-2, 1.2e-1], coef, engine=engine)
    older = StepCosts(served.knots, served.knot_seconds, coef, engine={k: v for k, v in engine.items() if k[0] != "s"})
    load = ["--request-rate", "2", "--num-prompts", "10", "--input-len", "600", "--output-len", "4"]
    for costs, flags, budget in ((served, [], 256), (served, ["--max-num-batched-tokens", "1024"], 1024),
                                 (older, [], 2048)):  # fmt: skip
        path = costs.save(tmp_path / "costs.json")
        assert main(["sim", "--costs", str(path), *load, *flags]) == 0
        assert f"{budget} tokens a step" in capsys.readouterr().out


def test_a_catalog_gpu_is_predicted_from_the_roofline(capsys):
    rc = main(["sim", "--model", "llama-3.1-8b", "--hardware", "H100-SXM", "--request-rate", "10",
               "--num-prompts", "100", "--input-len", "512", "--output-len", "64"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "predicted (roofline, H100-SXM)" in printed and "completed 100, failed 0" in printed


def test_no_calibration_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    assert main(["sim", "--request-rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fulcrum sim calibrate" in err


def write(path, lines) -> str:
    path.write_text("\n".join(lines))
    return str(path)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--request-rate", "-3"], "values must be > 0"),
        (["--request-rate", "abc"], "comma-separated"),
        (["--policy", "fastest", "--request-rate", "1"], "invalid choice: 'fastest'"),
        (["--replicas", "0", "--request-rate", "1"], "--replicas"),
        (["--prefill-replicas", "1", "--request-rate", "1"], "--decode-replicas"),
        (["--autoscale", "4,2", "--request-rate", "1"], "MIN <= MAX"),
        (["--autoscale", "1,4,latency=5", "--request-rate", "1"], "--autoscale"),
        (["--workload", "jsonl", "--request-rate", "1"], "needs --dataset"),
        ([], "give --request-rate"),
        (["--slo", "speed=1", "--request-rate", "1"], "unknown SLO"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(costs_file, flags, message, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own refusals
        raise SystemExit(main(["sim", "--costs", costs_file, *flags]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"max_tokens": 5}'], ":1: each line needs"),
        (
            ['{"prompt": "a b c", "max_tokens": 4, "timestamp": 0}', '{"prompt": "d e", "max_tokens": 4}'],
            ":2: either every line has a timestamp",
        ),
        (['{"prompt": "a b", "timestamp": -1}'], "timestamp must be"),
        (["[1, 2]"], "JSON object"),
        (["{not json"], ":1:"),
    ],
)
def test_a_bad_trace_names_its_line(costs_file, tmp_path, lines, message, capsys):
    trace = write(tmp_path / "t.jsonl", lines)
    assert main(["sim", "--costs", costs_file, "--workload", "jsonl", "--dataset", trace, "--request-rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_timed_trace_is_replayed_on_its_own_clock(costs_file, tmp_path, capsys):
    lines = [json.dumps({"prompt": f"w{i} x y z", "max_tokens": 4, "timestamp": 10 + 2 * i}) for i in range(5)]
    trace = write(tmp_path / "t.jsonl", lines)
    out = tmp_path / "o.json"
    rc = main(["sim", "--costs", costs_file, "--workload", "jsonl", "--dataset", trace, "--out", str(out)])
    assert rc == 0
    reqs = json.loads(out.read_text())["runs"][0]["requests"]
    assert [round(r["start"], 6) for r in reqs] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert all(r["output_tokens"] == 4 for r in reqs)


def test_a_malformed_costs_file_is_one_line(tmp_path, capsys):
    bad = write(tmp_path / "c.json", ['{"format": "something else"}'])
    assert main(["sim", "--costs", bad, "--request-rate", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a fulcrum step-cost file" in err


def test_a_traces_priorities_reach_the_scheduler(costs_file, tmp_path):
    """A burst too large for one step: the requests marked priority 0 are served before the ones marked 1,
    whatever their order in the trace."""
    lines = [json.dumps({"prompt": " ".join(f"w{i}x{k}" for k in range(300)), "max_tokens": 8, "timestamp": 0,
                         "priority": 1 if i < 10 else 0}) for i in range(20)]  # fmt: skip
    trace = write(tmp_path / "t.jsonl", lines)
    out = tmp_path / "o.json"
    flags = ["--workload", "jsonl", "--dataset", trace, "--out", str(out), "--max-num-seqs", "4"]
    assert main(["sim", "--costs", costs_file, *flags]) == 0
    reqs = json.loads(out.read_text())["runs"][0]["requests"]
    first = {r["session"]: r["ttft"] for r in reqs}
    urgent = [first[i] for i in range(20) if i >= 10]
    late = [first[i] for i in range(20) if i < 10]
    assert max(urgent) < min(late)
