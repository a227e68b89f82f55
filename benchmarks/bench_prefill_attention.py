"""Prefill attention on the CPU (csrc/prefill_attention.cpp) over a batch's fresh prompts, as the engine calls it: a
step's prompts in one varlen call a layer. Defaults: the bundled model's shape (8 heads, 4 KV heads of 32, fp32) and
the prompt lengths of bench_vs_vllm.py's 64-request workload (benchmarks.common.workload: 64-512 tokens), grouped into
steps of at most --budget tokens (whole prompts; the engine would chunk the one that crosses the budget). Reports the
time of one layer's calls over every step and the rate in GFLOP/s (causal: 4 x head_dim flops a head for each key a
query sees, its score and its weighted value).

    .venv/bin/python benchmarks/bench_prefill_attention.py [--prompts 64 --dtype float32] [--out F.json]
    .venv/bin/python benchmarks/bench_prefill_attention.py --against OLD.cpp   # another build of the kernel, in turn

`--against`: a second source of the kernel (an older prefill_attention.cpp), built at the same level and timed in
turn with today's; the largest difference between their outputs is reported. Per round, the best of 3 passes of
each; the median and every round are reported. Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_attention_kernel_args,
    cpu_summary,
    in_turn,
    kernel_build,
    save_json,
    workload,
)
from fulcrum.kernels import cpu_attention  # noqa: E402


def steps_of(lens: list[int], budget: int) -> list[list[int]]:
    """Prompt lengths in steps of at most `budget` tokens, whole prompts in order (one longer than the budget alone)."""
    steps, cur = [], []
    for n in lens:
        if cur and sum(cur) + n > budget:
            steps.append(cur)
            cur = []
        cur.append(n)
    return steps + [cur] if cur else steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--budget", type=int, default=2048, help="tokens a step (max_num_batched_tokens)")
    add_attention_kernel_args(p, "prefill_attention.cpp")
    args = p.parse_args()

    if cpu_attention._prefill() is None:
        sys.exit("the prefill attention kernel is not built at this ISA level")
    dt, h, kvh, hd = getattr(torch, args.dtype), args.heads, args.kv_heads, args.head_dim
    lens = [len(ids) for ids, _ in workload(args.prompts, 2048, prompt=(args.min_len, args.max_len))]
    steps = steps_of(lens, args.budget)
    g = torch.Generator().manual_seed(0)
    data = []  # per step: q, k, v (one fused qkv's views, as the model has them) and the spans' columns
    for step in steps:
        rows = sum(step)
        qkv = torch.randn(rows, (h + 2 * kvh) * hd, generator=g).to(dt)
        q, k, v = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
        starts = torch.tensor([0, *step[:-1]]).cumsum(0).tolist()
        cols = torch.tensor([(s, n, s, n) for s, n in zip(starts, step)], dtype=torch.int64).t().contiguous()
        data.append((q.view(rows, h, hd), k.view(rows, kvh, hd), v.view(rows, kvh, hd), cols))
    flops = sum(n * (n + 1) / 2 for n in lens) * h * hd * 4

    libs = {"fulcrum": cpu_attention._prefill_lib()}
    if args.against:
        libs["against"] = kernel_build(str(Path(args.against).resolve()), "prefill_attention.cpp")
    outs = {name: [torch.empty_like(q) for q, *_ in data] for name in libs}

    def layer(name: str) -> None:
        fn = libs[name].fulcrum_prefill_attention_varlen
        for (q, k, v, cols), o in zip(data, outs[name]):
            fn(dt == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), cols[0].data_ptr(),
               cols[1].data_ptr(), cols[2].data_ptr(), cols[3].data_ptr(), cols.shape[1], h, kvh, hd, q.stride(0),
               k.stride(0), v.stride(0), o.stride(0), hd**-0.5, 0, None)  # fmt: skip

    runs = in_turn({name: (lambda n=name: layer(n)) for name in libs}, args.rounds, passes=3)

    print(cpu_summary())
    print(f"{len(lens)} prompts ({sum(lens)} tokens, {min(lens)}-{max(lens)}) in {len(steps)} steps of up to "
          f"{args.budget} tokens; {h} heads / {kvh} KV of {hd}, {args.dtype}: "
          f"{flops / 1e9:.2f} GFLOP a layer")  # fmt: skip
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "flops": flops, "ms_runs": runs}
    if args.against:
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs["fulcrum"], outs["against"]))
        result["max_abs_diff"] = diff
        print(f"largest difference between the two builds' outputs: {diff:.3g}")
    for name, ms in runs.items():
        med = sorted(ms)[len(ms) // 2]
        result[f"{name}_median_ms"] = med
        rounds = " ".join(f"{x:.2f}" for x in ms)
        print(f"{name:8s} median {med:8.2f} ms  {flops / med / 1e6:6.1f} GFLOP/s   rounds {rounds}")
    save_json(args.out, result)


if __name__ == "__main__":
    main()
