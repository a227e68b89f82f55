"""`fulcrum sim` against live replicas on this machine, both sides in one run, and one fleet question at scale.

For each model (the bundled one, and the Qwen2.5-0.5B shape in bf16 with random weights):
1. calibrate the step costs (`fulcrum sim calibrate`, reused from the cache unless --recalibrate);
2. the simulator's own saturation throughput of one replica sets the load levels (--levels, fractions of it);
3. live: `fulcrum bench serve` (open loop, Poisson arrivals, exact prompt lengths through the tokenizer,
   ignore_eos) against one `fulcrum serve` replica, then against two behind `fulcrum router --policy least-load`
   (each engine pinned to its own core), at each level; sim: `fulcrum sim` with the same workload, rates and seeds
   (so the same arrival times) and the same fleet;
4. the error of sim against live: p50 and p90 of TTFT and TPOT, and output throughput.

Then the fleet question (the bundled model's calibration): how many replicas hold 100 requests/s of a shared-prefix
workload at TTFT p90 <= 500 ms, prefix against least-load routing, and how long the simulator takes for 100,000
requests over 100 replicas.

    python benchmarks/bench_sim.py [--models bundled,qwen05] [--levels 0.3,0.6,0.9] [--prompts 150]
                                   [--only live,fleet] [--recalibrate]

Writes benchmarks/results/sim/*.json and prints the tables (the log goes to results/cpu-sim.log by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_tune import in_vocab  # noqa: E402
from benchmarks.common import BUNDLED, cpu_summary, qwen05_model  # noqa: E402
from fulcrum.utils.serve_process import free_port, start, start_command  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sim"
CLI = [sys.executable, "-m", "fulcrum.cli"]
WORKLOAD = {
    "bundled": ["--input-len", "128", "--output-len", "64"],
    "qwen05": ["--input-len", "128", "--output-len", "32"],
}
METRICS = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"), ("output_throughput", None)]


def costs_path(model: Path) -> Path:
    from fulcrum.probe.step_costs import default_costs_path

    return default_costs_path(str(model), "auto", "auto", None)


def calibrate(model: Path, recalibrate: bool, quick: bool) -> tuple[Path, float | None]:
    path = costs_path(model)
    if path.is_file() and not recalibrate:
        return path, None
    t0 = time.perf_counter()
    subprocess.run([*CLI, "sim", "calibrate", str(model), *(["--quick"] if quick else [])], check=True)
    return path, time.perf_counter() - t0


def sim(model: Path, costs: Path, out: Path, *args: str) -> dict:
    cmd = [*CLI, "sim", "--model", str(model), "--costs", str(costs), "--out", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def bench(url: str, model: Path, out: Path, *args: str) -> dict:
    cmd = [*CLI, "bench", "serve", "--base-url", url, "--quiet", "--ignore-eos", "--tokenizer", str(model),
           "--out", str(out), *args]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


@contextlib.contextmanager
def fleet(model: Path, replicas: int, logs: Path):
    """One `fulcrum serve` (its engine on core 1, the frontend left core 0), or two, each engine pinned to its own
    core, behind `fulcrum router --policy least-load`. Yields the URL to load."""
    with contextlib.ExitStack() as stack:
        if replicas == 1:
            s = stack.enter_context(start(model, "--log-level", "warning", log_path=logs / "replica.log"))
            yield s.url
            return
        urls = []
        for core in range(replicas):
            s = stack.enter_context(start(model, "--log-level", "warning", "--cpu-threads", "1", "--cpu-bind",
                                          str(core % os.cpu_count()), log_path=logs / f"replica-{core}.log"))  # fmt: skip
            urls.append(s.url)
        port = free_port()
        cmd = [*CLI, "router", "--port", str(port), "--policy", "least-load", "--log-level", "warning"]
        for u in urls:
            cmd += ["--replica", u]
        router = stack.enter_context(start_command(cmd, port, log_path=logs / "router.log", timeout=120))
        yield router.url


def value(summary: dict, key: str, stat: str | None):
    v = summary[key]
    return v[stat] if stat else v


def error_row(label: str, live: dict, simulated: dict) -> dict:
    row = {"point": label}
    for key, stat in METRICS:
        a, b = value(live, key, stat), value(simulated, key, stat)
        name = f"{key.removesuffix('_ms')}_{stat}" if stat else "throughput"
        row[name] = {"live": a, "sim": b, "error": (b - a) / a if a else None}
    return row


def live_vs_sim(name: str, model: Path, args) -> list[dict]:
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    costs, took = calibrate(model, args.recalibrate, quick=name in args.quick_calibration.split(","))
    cal = json.loads(costs.read_text())
    print(f"\n== {name}: step costs {costs}" + (f" (calibrated in {took:.0f} s)" if took else " (cached)"))
    print(f"   fit: {json.dumps(cal.get('fit', {}))[:300]}")
    print(f"   frontend {cal.get('frontend_s', 0) * 1e3:.1f} ms, engine {json.dumps(cal.get('engine', {}))[:200]}")
    workload = WORKLOAD.get(name, WORKLOAD["bundled"])
    sat = sim(model, costs, out / "saturation.json", "--request-rate", "1000", "--num-prompts", "200", *workload)
    capacity = sat["runs"][0]["summary"]["request_throughput"]
    print(f"   the simulator's one-replica saturation: {capacity:.2f} req/s")
    rows = []
    prompts = args.prompts if name == "bundled" else max(args.prompts // 4, 30)
    for replicas in (1, 2):
        with fleet(model, replicas, out) as url:
            bench(url, model, out / "warmup.json", "--request-rate", "inf", "--num-prompts", "8", *workload)
            for i, level in enumerate(float(x) for x in args.levels.split(",")):
                rate = round(level * capacity * replicas, 3)
                load = ["--request-rate", str(rate), "--num-prompts", str(prompts), "--seed", str(100 + i), *workload]
                t0 = time.perf_counter()
                live = bench(url, model, out / f"live-{replicas}r-{level}.json", *load)
                live_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                fleet_args = ["--replicas", str(replicas), "--policy", "least-load"]
                simulated = sim(model, costs, out / f"sim-{replicas}r-{level}.json", *load, *fleet_args)
                sim_s = time.perf_counter() - t0
                label = f"{name} {replicas} replica(s), {level:g} of saturation ({rate:g} req/s)"
                row = error_row(label, live["runs"][0]["summary"], simulated["runs"][0]["summary"])
                row.update(live_wall_s=live_s, sim_wall_s=sim_s, replicas=replicas, level=level, rate=rate)
                rows.append(row)
                print_row(row)
    (out / "errors.json").write_text(json.dumps(rows, indent=1))
    return rows


def print_row(row: dict) -> None:
    parts = []
    for k, v in row.items():
        if isinstance(v, dict) and "error" in v:
            unit = "" if k == "throughput" else " ms"
            parts.append(f"{k} {v['live']:.1f}/{v['sim']:.1f}{unit} ({v['error']:+.0%})")
    print(f"  {row['point']}: live/sim " + ", ".join(parts) + f"  [live {row['live_wall_s']:.0f} s, "
          f"sim {row['sim_wall_s']:.1f} s]")  # fmt: skip


def fleet_question(args) -> None:
    """Replicas for 100 req/s of a shared-prefix workload at TTFT p90 <= 500 ms, prefix vs least-load."""
    out = RESULTS / "fleet"
    out.mkdir(parents=True, exist_ok=True)
    costs, _ = calibrate(BUNDLED, False, quick=False)
    # 512 system prompts of 768 tokens: 24,576 KV blocks, more than one replica's cache holds (16,384), so where a
    # request goes decides whether its prefix is still cached there
    workload = ["--workload", "shared-prefix", "--num-groups", "512", "--prefix-len", "768", "--input-len", "64",
                "--output-len", "64", "--request-rate", "100", "--slo", "ttft=500ms", "--no-requests"]  # fmt: skip
    print("\n== fleet question: replicas for 100 req/s of shared-prefix (512 groups x 768 tokens + 64, 64 out), "
          "TTFT p90 <= 500 ms; the bundled model's calibration")  # fmt: skip
    answers = {}
    for policy in ("least-load", "prefix"):
        for n in range(1, 41):
            t0 = time.perf_counter()
            doc = sim(BUNDLED, costs, out / f"{policy}-{n}.json", *workload, "--num-prompts", "12000",
                      "--replicas", str(n), "--policy", policy)  # fmt: skip
            wall = time.perf_counter() - t0
            run = doc["runs"][0]
            p90 = run["summary"]["ttft_ms"]["p90"]
            hit = run["sim"]["prefix_cache_hit_rate"]
            print(f"  {policy:10s} {n:2d} replicas: TTFT p90 {p90:9.1f} ms, prefix hits {hit:.0%}, "
                  f"goodput {run['summary']['goodput']:.1f} req/s  [{wall:.1f} s]")  # fmt: skip
            if p90 <= 500:
                answers[policy] = n
                break
    print(f"  answer: least-load needs {answers.get('least-load')}, prefix {answers.get('prefix')} replicas")
    t0 = time.perf_counter()
    doc = sim(BUNDLED, costs, out / "scale-100k.json", "--workload", "random", "--input-len", "128", "--output-len",
              "64", "--request-rate", "2000", "--num-prompts", "100000", "--replicas", "100", "--policy",
              "least-load", "--no-requests")  # fmt: skip
    wall = time.perf_counter() - t0
    run = doc["runs"][0]
    print(f"  scale: 100,000 requests (128 in, 64 out) at 2,000 req/s over 100 replicas (least-load): simulated "
          f"{run['duration_s']:.0f} s, {run['sim']['events']:,} events, in {run['sim']['wall_s']:.1f} s "
          f"({wall:.1f} s with start-up and the report)")  # fmt: skip
    (out / "answer.json").write_text(json.dumps({"answers": answers, "scale_wall_s": wall,
                                                 "scale_sim_s": run["sim"]["wall_s"]}, indent=1))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bundled,qwen05")
    p.add_argument("--levels", default="0.3,0.6,0.9", help="load levels as fractions of the simulated saturation")
    p.add_argument("--prompts", type=int, default=150, help="requests per live point (qwen05: a quarter)")
    p.add_argument("--only", default="live,fleet")
    p.add_argument("--recalibrate", action="store_true")
    p.add_argument("--quick-calibration", default="qwen05", help="models calibrated with --quick")
    p.add_argument("--work-dir", default="/tmp/fulcrum-bench-sim")
    args = p.parse_args()
    print(cpu_summary())
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S')}, load {os.getloadavg()}")
    all_rows = []
    if "live" in args.only:
        for name in args.models.split(","):
            # the 0.5B shape with its embeddings past the bundled tokenizer's 2,048 tokens zeroed, so that replies
            # decode to text (benchmarks/bench_tune.py: in_vocab)
            model = BUNDLED if name == "bundled" else in_vocab(qwen05_model(Path(args.work_dir) / "qwen2.5-0.5b-shape"))
            all_rows += live_vs_sim(name, model, args)
        worst = {}
        for row in all_rows:
            for k, v in row.items():
                if isinstance(v, dict) and v.get("error") is not None:
                    worst[k] = max(worst.get(k, 0.0), abs(v["error"]))
        print("\nlargest |error| over every point: " + ", ".join(f"{k} {v:.0%}" for k, v in worst.items()))
    if "fleet" in args.only:
        fleet_question(args)


if __name__ == "__main__":
    main()
