"""Weight-only quantization against 16-bit, in one process: batch-1 decode (bytes read per token fall 2x for int8,
about 3.5x for int4) and the 64-request workload's throughput, each configuration in turn, `--repeats` times.

    .venv/bin/python benchmarks/bench_quant.py --model qwen05 --dtype bfloat16 [--repeats 2] [--num-prompts 64]

Batch-1 rounds each sit beside a bandwidth probe (bench_throughput.batch1_decode); the table gives each
configuration's median tok/s, its ratio to the unquantized run of the same repeat, the weight bytes a step reads
and the fraction of the bandwidth roofline. Quality is `fulcrum eval`'s job (see the README).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_throughput import batch1_decode, run_fulcrum  # noqa: E402
from benchmarks.common import add_model_args, cpu_summary, model_folder, print_table, save_json, workload  # noqa: E402

CONFIGS = {
    "none": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    folder = model_folder(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    reqs = workload(args.num_prompts, vocab)
    kv = int(args.kv_cache_gb * 2**30)
    names = args.configs.split(",")
    print(cpu_summary())
    print(f"model {folder.name} dtype {args.dtype} threads {torch.get_num_threads()}; configs {names}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            kw = CONFIGS[name]
            rounds = batch1_decode(folder, args.dtype, args.device, vocab, kv, **kw)
            row = {
                "batch1_tok_s": statistics.median(r["tok_s"] for r in rounds),
                "weight_bytes": rounds[0]["weight_bytes"],
                "roofline_fraction": statistics.median(r.get("roofline_fraction", 0) for r in rounds),
                "rounds": rounds,
            }
            if not args.skip_throughput:
                dt, n = run_fulcrum(folder, reqs, args.dtype, args.device, max_num_seqs=args.num_prompts,
                                    kv_cache_memory=kv, **kw)  # fmt: skip
                row["throughput_tok_s"] = n / dt
            runs[name].append(row)
            print(f"repeat {rep + 1} {name}: batch-1 {row['batch1_tok_s']:.1f} tok/s "
                  f"({row['weight_bytes'] / 1e6:.0f} MB a step, {100 * row['roofline_fraction']:.0f}% of roofline)"
                  + (f", throughput {row['throughput_tok_s']:.1f} tok/s" if "throughput_tok_s" in row else ""),
                  flush=True)  # fmt: skip

    def ratios(key):
        base = runs.get("none")
        return {n: [r[key] / b[key] for r, b in zip(rs, base)] for n, rs in runs.items()} if base else {}

    b1, tp = ratios("batch1_tok_s"), ratios("throughput_tok_s") if not args.skip_throughput else {}
    rows = []
    for n, rs in runs.items():
        med = statistics.median
        rows.append((
            n, f"{rs[0]['weight_bytes'] / 1e6:.0f}", f"{med(r['batch1_tok_s'] for r in rs):.1f}",
            f"{med(b1[n]):.2f}x" if b1 else "-", f"{100 * med(r['roofline_fraction'] for r in rs):.0f}%",
            f"{med(r['throughput_tok_s'] for r in rs):.1f}" if tp else "-", f"{med(tp[n]):.2f}x" if tp else "-",
        ))  # fmt: skip
    print_table(
        f"weight-only quantization, median of {args.repeats} (ratios: to 'none' of the same repeat)",
        rows,
        ("config", "MB read / step", "batch-1 tok/s", "vs none", "of roofline", "throughput tok/s", "vs none"),
    )
    save_json(args.out, {"runs": runs, "batch1_ratio": b1, "throughput_ratio": tp})


if __name__ == "__main__":
    main()
