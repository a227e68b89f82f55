"""`fulcrum tune` on this machine: the default's goodput under one stated SLO and workload against tune's, the time
tune took, and whether a rerun recommends the same (the baseline is measured inside each run, beside the candidates).

    python benchmarks/bench_tune.py --model bundled --budget 10m --runs 2
    python benchmarks/bench_tune.py --model qwen05 --budget 15m --runs 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import BUNDLED, cpu_summary, qwen05_model, save_json

# one stated SLO and workload per model: the bundled model is a 2M-parameter toy whose server overhead dominates;
# the 0.5B shape decodes at tens of ms per token on a few cores
PRESETS = {
    "bundled": {"slo": "ttft_p90=200ms,tpot_p90=10ms", "workload": ["--input-len", "256", "--output-len", "64"]},
    "qwen05": {"slo": "ttft_p90=1s,tpot_p90=100ms", "workload": ["--input-len", "128", "--output-len", "64"]},
}


def in_vocab(folder: Path) -> Path:
    """A copy of the random-weight 0.5B-shape model whose embedding rows past the bundled tokenizer's 2,048 tokens
    are zero. Tied to the LM head, those tokens' logits are then 0 while the others' spread around it, so greedy
    decoding stays on tokens the tokenizer can write: otherwise it picks among 151,936 ids, and nearly every reply
    decodes to no text (a failed request to any client). Shape, weights read and cost per token are unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fulcrum.utils.tokenizer import load_tokenizer

    out = folder.with_name(folder.name + "-in-vocab")
    if (out / "model.safetensors").exists():
        return out
    shutil.copytree(folder, out, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][len(load_tokenizer(folder)) :] = 0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def run_tune(model: Path, slo: str, workload: list[str], budget: str, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "fulcrum.cli", "tune", str(model), "--slo", slo, "--budget", budget,
           "--out", str(out), *workload, *extra]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, text=True, capture_output=True)
    took = time.monotonic() - t0
    (out / "stderr.log").write_text(done.stderr) if out.exists() else None
    if done.returncode != 0:
        raise SystemExit(f"tune failed ({done.returncode}):\n{done.stderr[-3000:]}")
    doc = json.loads((out / "report.json").read_text())
    r = doc["result"]
    return {
        "baseline_goodput_rps": r["baseline_goodput_rps"],
        "goodput_rps": r["goodput_rps"],
        "gain": r["goodput_rps"] / r["baseline_goodput_rps"] if r["baseline_goodput_rps"] else None,
        "config": r["config"],
        "pd": r["pd"],
        "command": r["command"],
        "seconds": took,
        "kept": [t["change"] for t in doc["trials"] if t["kept"] and t["stage"] != "baseline"],
        "measured": sum(t["measurement"] is not None for t in doc["trials"]),
        "lines": r["lines"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="bundled", help="bundled, qwen05 (random weights, Qwen2.5-0.5B shape) or a folder"
    )
    p.add_argument("--budget", default="10m")
    p.add_argument("--runs", type=int, default=2, help="tune runs, to see whether a rerun recommends the same")
    p.add_argument("--slo", default=None, help="default: the model's preset")
    p.add_argument("--work-dir", default="/tmp/fulcrum-bench")
    p.add_argument("--extra", default="", help="more tune flags, e.g. '--concurrency 16'")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args()
    preset = PRESETS.get(args.model, PRESETS["qwen05"])
    if args.model == "bundled":
        model = BUNDLED
    elif args.model == "qwen05":
        model = in_vocab(qwen05_model(Path(args.work_dir) / "qwen2.5-0.5b-shape"))
    else:
        model = Path(args.model)
    slo = args.slo or preset["slo"]
    print(cpu_summary())
    print(f"model {model}, SLO {slo}, workload {' '.join(preset['workload'])}, budget {args.budget}", flush=True)
    runs = []
    for i in range(args.runs):
        out = Path(args.work_dir) / f"tune-{args.model}-{int(time.time())}-{i}"
        r = run_tune(model, slo, preset["workload"], args.budget, out, args.extra.split())
        runs.append(r)
        print(f"run {i + 1}: default {r['baseline_goodput_rps']:.3g} req/s, tuned {r['goodput_rps']:.3g} req/s "
              f"(x{r['gain'] or 0:.2f}) in {r['seconds'] / 60:.1f} min, {r['measured']} runs measured; kept: "
              f"{', '.join(r['kept']) or 'none'}", flush=True)  # fmt: skip
        for line in r["lines"]:
            print(f"    {line}")
    if len(runs) > 1:
        same = all(r["config"] == runs[0]["config"] and r["pd"] == runs[0]["pd"] for r in runs)
        gains = [r["gain"] or 0 for r in runs]
        print(f"recommendation {'the same' if same else 'differs'} across {len(runs)} runs; gain over the default "
              f"{min(gains):.2f}-{max(gains):.2f}x; tuned goodput "
              f"{min(r['goodput_rps'] for r in runs):.3g}-{max(r['goodput_rps'] for r in runs):.3g} req/s")  # fmt: skip
    save_json(Path(args.out) if args.out else None, {"model": str(model), "slo": slo, "runs": runs})


if __name__ == "__main__":
    main()
