"""Serving levers seen through `fulcrum bench serve`, each against its baseline in the same run:

- sweep:   a concurrency sweep 1 -> 64 (throughput rises, TTFT and TPOT grow: the trade of batching);
- prefix:  the shared-prefix workload with prefix caching on, against the same server with it off (TTFT);
- chunked: the long-prefill workload with chunked prefill on, against whole-prompt prefill (the ITL of
           the short requests while long prompts come in);
- budget:  the step budget (--max-num-batched-tokens): one fresh server per budget, closed loop at each
           --budget-concurrency (128 in, 64 out, eos ignored), --repeats rounds of the budgets in turn; each
           budget's median TTFT p50 and output tok/s over the rounds, every run kept (budget.json).

    python benchmarks/bench_serve_levers.py [--model bundled|qwen05|PATH] [--only sweep,prefix,chunked,budget]

Each scenario starts its own `fulcrum serve`, drives it with the `fulcrum bench serve` CLI (HTTP only),
and keeps the JSON results, plots and a summary under --results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, fulcrum_server, model_folder  # noqa: E402


def bench(url: str, out: Path, *args: str, plot: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, "--quiet", "--ignore-eos"]
    cmd += ["--out", str(out), *args]
    if plot:
        cmd += ["--plot", str(plot)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def server_flags(args) -> list[str]:
    return ["--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", str(args.kv_cache_gb)]


def on_off(args, folder, res: Path, load: list[str], variants: dict[str, list[str]]) -> list[dict]:
    """The same load against one fresh server per variant of flags; the run of each, in order."""
    runs = []
    for name, flags in variants.items():
        with fulcrum_server(folder, *server_flags(args), *flags) as url:
            runs.append(bench(url, res / f"{name}.json", *load)["runs"][0])
    return runs


def compare_plots(res: Path, name: str, variants: list[str], tag: str | None = None) -> None:
    """TTFT and ITL distributions of the variants overlaid (only requests tagged `tag`, when given)."""
    from fulcrum.bench.report import write_plots

    runs = []
    for v in variants:
        run = json.loads((res / f"{v}.json").read_text())["runs"][0]
        reqs = [q for q in run["requests"] if tag is None or q["tag"] == tag]
        runs.append({**run, "label": v + (f" ({tag} requests)" if tag else ""), "requests": reqs})
    write_plots(res / name, runs, sweep=False)


def sweep(args, folder, res: Path) -> list[str]:
    with fulcrum_server(folder, *server_flags(args), "--max-num-seqs", "64") as url:
        doc = bench(
            url, res / "sweep.json", "--tokenizer", str(folder), "--concurrency", args.concurrency,
            "--num-prompts", str(args.sweep_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--warmup", "4", plot=res / "sweep",
        )  # fmt: skip
    lines = ["concurrency sweep (random workload):"]
    for r in doc["runs"]:
        s = r["summary"]
        lines.append(
            f"  {r['label']:>15}: {s['output_throughput']:8.1f} out tok/s  TTFT p50 {s['ttft_ms']['p50']:8.1f} ms"
            f"  p99 {s['ttft_ms']['p99']:8.1f} ms  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms"
        )
    first, last = doc["runs"][0]["summary"], doc["runs"][-1]["summary"]
    lines.append(
        f"  throughput x{last['output_throughput'] / first['output_throughput']:.1f}, "
        f"TTFT p50 x{last['ttft_ms']['p50'] / first['ttft_ms']['p50']:.1f} from the first point to the last"
    )
    return lines


def prefix(args, folder, res: Path) -> list[str]:
    load = ["--workload", "shared-prefix", "--num-groups", "4", "--prefix-len", str(args.prefix_len)]
    load += ["--input-len", "32", "--output-len", "16", "--num-prompts", "64", "--concurrency", "4"]
    load += ["--tokenizer", str(folder)]
    variants = {"prefix-cache-on": [], "prefix-cache-off": ["--no-prefix-caching"]}
    on, off = (run["summary"] for run in on_off(args, folder, res, load, variants))
    compare_plots(res, "prefix", list(variants))
    return [
        f"shared-prefix ({args.prefix_len}-token system prompts, 4 groups, 64 requests, concurrency 4):",
        f"  TTFT mean: {on['ttft_ms']['mean']:.1f} ms with prefix caching, {off['ttft_ms']['mean']:.1f} ms without"
        f" -> {off['ttft_ms']['mean'] / on['ttft_ms']['mean']:.1f}x lower",
        f"  TTFT p99:  {on['ttft_ms']['p99']:.1f} ms vs {off['ttft_ms']['p99']:.1f} ms; "
        f"output tok/s {on['output_throughput']:.1f} vs {off['output_throughput']:.1f}",
    ]


def chunked(args, folder, res: Path) -> list[str]:
    load = ["--workload", "long-prefill", "--long-fraction", "0.2", "--long-input-len", str(args.long_len)]
    load += ["--input-len", "32", "--output-len", "32", "--num-prompts", "80", "--concurrency", "8"]
    load += ["--tokenizer", str(folder), "--seed", "1"]
    budget = ["--max-num-batched-tokens", str(args.chunk)]
    variants = {"chunked-on": budget, "chunked-off": [*budget, "--no-chunked-prefill"]}
    on, off = (run["by_tag"]["short"] for run in on_off(args, folder, res, load, variants))
    compare_plots(res, "chunked", list(variants), tag="short")
    return [
        f"long-prefill (20% {args.long_len}-token prompts among 32-token chats, concurrency 8, chunk {args.chunk}):",
        f"  short requests' ITL p99: {on['itl_ms']['p99']:.1f} ms with chunked prefill, "
        f"{off['itl_ms']['p99']:.1f} ms without -> {off['itl_ms']['p99'] / on['itl_ms']['p99']:.1f}x lower",
        f"  short requests' ITL p95 {on['itl_ms']['p95']:.1f} vs {off['itl_ms']['p95']:.1f} ms, TPOT p99"
        f" {on['tpot_ms']['p99']:.1f} vs {off['tpot_ms']['p99']:.1f} ms, TTFT p50 {on['ttft_ms']['p50']:.1f} vs"
        f" {off['ttft_ms']['p50']:.1f} ms",
    ]


def budget(args, folder, res: Path) -> list[str]:
    budgets, concs = args.budgets.split(","), args.budget_concurrency.split(",")
    runs = []
    for rnd in range(args.repeats):
        for b in budgets:
            with fulcrum_server(folder, *server_flags(args), "--max-num-batched-tokens", b) as url:
                for c in concs:  # prompts of their own per concurrency (the seed): none found in the prefix cache
                    load = ["--tokenizer", str(folder), "--concurrency", c, "--num-prompts", str(args.budget_prompts)]
                    load += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
                    load += ["--seed", c, "--warmup", c]
                    s = bench(url, res / f"budget-{b}-c{c}-{rnd}.json", *load)["runs"][0]["summary"]
                    runs.append({"budget": int(b), "concurrency": int(c), "round": rnd,
                                 "output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                                 "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p50_ms": s["tpot_ms"]["p50"]})  # fmt: skip
    (res / "budget.json").write_text(json.dumps(runs, indent=1))
    lines = [f"step budget ({args.input_len} in, {args.output_len} out, {args.repeats} rounds):"]
    for c in map(int, concs):
        for b in map(int, budgets):
            rs = [r for r in runs if r["budget"] == b and r["concurrency"] == c]
            ttft, tok = ([r[k] for r in rs] for k in ("ttft_p50_ms", "output_tok_s"))
            lines.append(
                f"  concurrency {c:3d} budget {b:5d}: TTFT p50 {statistics.median(ttft):7.1f} ms (runs "
                f"{', '.join(f'{x:.1f}' for x in ttft)}), output {statistics.median(tok):7.1f} tok/s (runs "
                f"{', '.join(f'{x:.0f}' for x in tok)})"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, dtype="float32")
    p.set_defaults(model="bundled")
    p.add_argument("--only", default="sweep,prefix,chunked")
    p.add_argument("--results", default=str(Path(__file__).parent / "results" / "serve"))
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--sweep-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--long-len", type=int, default=900)
    p.add_argument("--chunk", type=int, default=128, help="max-num-batched-tokens of both chunked-prefill servers")
    p.add_argument("--budgets", default="256,512,1024,2048", help="budget: the --max-num-batched-tokens values")
    p.add_argument("--budget-concurrency", default="4,16")
    p.add_argument("--budget-prompts", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="budget: rounds of the budgets in turn")
    args = p.parse_args()
    folder = model_folder(args)
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    lines = [f"model {folder.name}, {args.device}, {args.dtype}"]
    for name in args.only.split(","):
        lines += {"sweep": sweep, "prefix": prefix, "chunked": chunked, "budget": budget}[name](args, folder, res)
    print("\n".join(lines))
    (res / f"summary-{'-'.join(args.only.split(','))}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
