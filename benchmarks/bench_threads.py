"""The engine core's CPU threads under a co-located client: `fulcrum serve` with several `--cpu-threads` /
`--cpu-bind` settings, each driven by `fulcrum bench serve` on the same cores, alternating, several rounds.

    python benchmarks/bench_threads.py [--model bundled|qwen05|PATH] [--rounds 2] [--concurrency 1,4]

Variants: `auto` (the default: one thread per core, each pinned), `none` (the OS places them, torch's default),
one pinned thread, and `OMP_NUM_THREADS=1` unpinned (what issue 13 measured as the workaround). The client runs
on the same machine, as a load generator or a co-located application would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, cpu_summary, model_folder, print_table, save_json  # noqa: E402

VARIANTS = {
    "auto (default)": ([], {}),
    "none": (["--cpu-bind", "none"], {}),
    "1 thread pinned": (["--cpu-threads", "1"], {}),
    "OMP_NUM_THREADS=1": (["--cpu-bind", "none"], {"OMP_NUM_THREADS": "1"}),
}


def run_variant(folder, args, flags, env, concurrency: int, out: Path) -> float:
    from fulcrum.utils.serve_process import start

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server process inherits them; restored before the client starts
    try:
        server = start(folder, "--log-level", "warning", "--dtype", args.dtype,
                       "--kv-cache-memory", str(args.kv_cache_gb), *flags)  # fmt: skip
        srv = server.__enter__()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", srv.url, "--quiet",
               "--ignore-eos", "--concurrency", str(concurrency), "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--out", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        res = json.loads(out.read_text())
    finally:
        server.__exit__(None, None, None)
    run = res["runs"][0] if "runs" in res else res
    return run["summary"]["output_throughput"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, dtype="float32")
    p.set_defaults(model="bundled", kv_cache_gb=0.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    folder = model_folder(args)
    print(cpu_summary(), flush=True)
    results: dict[str, dict[int, list[float]]] = {name: {} for name in VARIANTS}
    tmp = Path(tempfile.mkdtemp(prefix="fulcrum-threads-"))
    for rnd in range(args.rounds):
        for c in [int(x) for x in args.concurrency.split(",")]:
            for name, (flags, env) in VARIANTS.items():
                tps = run_variant(folder, args, flags, env, c, tmp / f"{rnd}-{c}.json")
                results[name].setdefault(c, []).append(tps)
                print(f"round {rnd + 1} concurrency {c} {name}: {tps:.1f} output tok/s", flush=True)
    cs = [int(x) for x in args.concurrency.split(",")]
    rows = [
        (name, *(f"{statistics.median(v[c]):.1f} ({min(v[c]):.0f}-{max(v[c]):.0f})" for c in cs))
        for name, v in results.items()
    ]
    print_table(
        "output tok/s, median (min-max) over rounds", rows, ("engine threads", *(f"concurrency {c}" for c in cs))
    )
    save_json(args.out, {"cpu": cpu_summary(), "results": results})


if __name__ == "__main__":
    main()
