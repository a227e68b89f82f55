"""Issue 49's figures in one script: batched CPU throughput and served TTFT, fulcrum against vLLM's CPU build.

    .venv/bin/python benchmarks/bench_cpu_batched.py [--levels native,avx2] [--repeats 2] [--out F.json]
    .venv/bin/python benchmarks/bench_cpu_batched.py --only served --concurrency 4,16

Offline (benchmarks/bench_vs_vllm.py, one engine process at a time, the same token ids, --skip-hf):
  - the bundled model in fp32, 64 requests; the 0.5B shape (random weights) in bf16, 8 requests, and in fp32, 4
  at each ISA level asked for: `native` (what the CPU has) and `avx2` (FULCRUM_CPU_ISA=avx2 for fulcrum; vLLM's
  torch, oneDNN and MKL capped alike by environment; vLLM's own C++ kernels stay at their build's level).
  vLLM is given both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0); fulcrum its defaults.
  Each level's compile caches are kept between its repeats, so the first run of each engine is cold, the rest warm.
Served (`fulcrum bench serve` with the tokenizer: 128-token prompts, 64 out, eos ignored, streamed): `fulcrum
serve` on the bundled model, then vLLM's OpenAI server (eager, both cores), closed loop at each concurrency with
prompts of its own (the same for both engines; none found in the prefix cache), `--repeats` runs each in turn. Ratios are fulcrum / vLLM of the median of the runs; every run is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import BUNDLED, cpu_summary  # noqa: E402
from benchmarks.vllm_cpu import DEFAULT_VENV, ensure_venv  # noqa: E402
from benchmarks.vllm_cpu import start_server as start_vllm  # noqa: E402
from fulcrum.utils.cpu_isa import TORCH_ISA_ENV  # noqa: E402
from fulcrum.utils.serve_process import start as start_fulcrum  # noqa: E402

HERE = Path(__file__).resolve().parent
OFFLINE = (("bundled", "float32", 64), ("qwen05", "bfloat16", 8), ("qwen05", "float32", 4))
VLLM_THREADS = ["VLLM_CPU_OMP_THREADS_BIND=0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU=0"]


def offline(args, level: str, model: str, dtype: str, n: int, work: Path) -> dict:
    out = work / f"offline-{level}-{model}-{dtype}-{n}.json"
    cmd = [sys.executable, str(HERE / "bench_vs_vllm.py"), "--model", model, "--dtype", dtype, "--num-prompts", str(n)]
    cmd += ["--skip-hf", "--repeats", str(args.repeats), "--no-warm-start", "--out", str(out)]
    cmd += ["--cache-dir", str(work / f"cache-{level}-{model}-{dtype}"), "--decode-rounds", "3"]
    env = dict(os.environ)
    env.pop("FULCRUM_CPU_ISA", None)
    vllm_env = list(VLLM_THREADS)
    if level != "native":
        env["FULCRUM_CPU_ISA"] = level
        vllm_env += [f"{k}={v}" for k, v in TORCH_ISA_ENV[level].items()]
    for kv in vllm_env:
        cmd += ["--vllm-env", kv]
    print(f"== offline {model} {dtype} x{n} at {level}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    runs = json.loads(out.read_text())
    return {"level": level, "model": model, "dtype": dtype, "requests": n, "result": runs}


def throughputs(result: dict, engine: str) -> list[float]:
    """Every run's output tok/s of one engine in bench_vs_vllm's JSON."""
    return [r["throughput"]["tok_s"] for r in result.get("runs", []) if r.get("engine") == engine
            and r.get("throughput")]  # fmt: skip


def bench_serve(url: str, conc: int, args, out: Path) -> dict:
    cmd = [
        str(Path(sys.executable).parent / "fulcrum"),
        "bench",
        "serve",
        "--base-url",
        url,
        "--concurrency",
        str(conc),
    ]
    # prompts of their own per concurrency (the seed), the same for both engines: with one seed for all, each
    # concurrency after the first on a server found its prompts in the prefix cache
    cmd += [
        "--input-len",
        "128",
        "--output-len",
        "64",
        "--ignore-eos",
        "--tokenizer",
        str(BUNDLED),
        "--seed",
        str(conc),
    ]
    cmd += ["--num-prompts", str(args.served_prompts), "--warmup", str(conc), "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True)
    run = json.loads(out.read_text())["runs"][0]
    s = run["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "tpot_p50_ms": s["tpot_ms"]["p50"]}  # fmt: skip


def served(args, work: Path) -> list[dict]:
    rows = []
    for rep in range(args.repeats):
        for engine in ("fulcrum", "vllm"):
            log = work / f"{engine}-serve-{rep}.log"
            if engine == "fulcrum":
                server = start_fulcrum(BUNDLED, "--log-level", "warning", "--dtype", "float32", log_path=log)
            else:
                server = start_vllm(BUNDLED, "--dtype", "float32", "--max-model-len", "1024", log_path=log)
            with server:  # a ServerProcess: stopped on leaving
                for conc in args.concurrency:
                    out = work / f"served-{engine}-c{conc}-{rep}.json"
                    r = bench_serve(server.url, conc, args, out)
                    print(f"   {engine} concurrency {conc} run {rep}: {r}", flush=True)
                    rows.append({"engine": engine, "concurrency": conc, "repeat": rep, **r})
    return rows


def report(res: dict) -> None:
    print(f"\nmachine: {res['cpu']}")
    for o in res["offline"]:
        f, v = throughputs(o["result"], "fulcrum"), throughputs(o["result"], "vllm")
        ratio = statistics.median(f) / statistics.median(v) if f and v else float("nan")
        print(f"offline {o['model']:8s} {o['dtype']:9s} x{o['requests']:<3d} {o['level']:7s} fulcrum "
              f"{', '.join(f'{x:.1f}' for x in f)} vLLM {', '.join(f'{x:.1f}' for x in v)} tok/s: {ratio:.2f}x")  # fmt: skip
    for conc in sorted({r["concurrency"] for r in res["served"]}):
        got = {
            e: [r for r in res["served"] if r["engine"] == e and r["concurrency"] == conc] for e in ("fulcrum", "vllm")
        }
        med = {e: {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "ttft_p50_ms")}
               for e, rs in got.items() if rs}  # fmt: skip
        if len(med) == 2:
            f, v = med["fulcrum"], med["vllm"]
            print(f"served concurrency {conc}: fulcrum {f['output_tok_s']:.1f} tok/s TTFT p50 {f['ttft_p50_ms']:.1f} ms"
                  f"; vLLM {v['output_tok_s']:.1f} tok/s TTFT p50 {v['ttft_p50_ms']:.1f} ms; throughput "
                  f"{f['output_tok_s'] / v['output_tok_s']:.2f}x")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="native,avx2")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", choices=("offline", "served"), default=None)
    p.add_argument("--workloads", default=None, help="offline subset, e.g. bundled:float32:64")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--served-prompts", type=int, default=96)
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench-49"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: expected numbers such as 4,16")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ensure_venv(DEFAULT_VENV)
    workloads = OFFLINE
    if args.workloads:
        try:
            workloads = [(m, d, int(n)) for m, d, n in (w.split(":") for w in args.workloads.split(","))]
        except ValueError:
            p.error(f"--workloads {args.workloads!r}: expected MODEL:DTYPE:REQUESTS[,...], e.g. bundled:float32:64")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_summary(), "offline": [], "served": []}
    t = time.perf_counter()
    if args.only != "served":
        for level in args.levels.split(","):
            for model, dtype, n in workloads:
                res["offline"].append(offline(args, level, model, dtype, n, work))
    if args.only != "offline":
        res["served"] = served(args, work)
    res["wall_s"] = time.perf_counter() - t
    report(res)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
