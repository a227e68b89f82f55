"""A batched decode step's attention on the CPU, read from a paged KV cache as the engine lays it out
(csrc/decode_attention.cpp), against a plain read of the same bytes (a sum over a buffer of the cache's size) in the
same process: how near the kernel runs to the memory bandwidth. Defaults: the bundled model's shape (8 heads, 4 KV
heads of 32, fp32) at 64 sequences of 482 tokens, 8 layers, each layer's cache its own, so that every call reads from
memory as a step does. Each sequence's prompt blocks lie side by side and its decode blocks interleave with the other
sequences', as a step of 64 requests admitted together leaves them.

    .venv/bin/python benchmarks/bench_decode_attention.py [--seqs 64 --ctx 482 --dtype float32] [--out F.json]
    .venv/bin/python benchmarks/bench_decode_attention.py --against OLD.cpp   # another build of the kernel, in turn

`--against`: a second source of the kernel (an older decode_attention.cpp), built at the same level and timed in
turn with today's; the two must give the same output bit for bit. Per round, the best of 8 calls of each; the median
and every round are reported. The VM's speed moves between rounds: compare within a round. Nothing else may run
beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import add_attention_kernel_args, cpu_summary, in_turn, kernel_build, save_json  # noqa: E402
from fulcrum.kernels import cpu_attention  # noqa: E402


def paged_tables(seqs: int, ctx: int, prompt: int, block: int) -> torch.Tensor:
    """Block tables: each sequence's prompt blocks contiguous, then the decode blocks dealt out in turn."""
    width = (ctx + block - 1) // block
    pb = min(width, (prompt + block - 1) // block)
    table = torch.zeros(seqs, width, dtype=torch.int64)
    nxt = 0
    for i in range(seqs):
        table[i, :pb] = torch.arange(nxt, nxt + pb)
        nxt += pb
    for b in range(pb, width):
        for i in range(seqs):
            table[i, b] = nxt
            nxt += 1
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--ctx", type=int, default=482, help="tokens of context per sequence")
    p.add_argument("--prompt", type=int, default=450, help="tokens of each sequence's contiguous prompt blocks")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block", type=int, default=16)
    add_attention_kernel_args(p, "decode_attention.cpp")
    args = p.parse_args()

    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    table = paged_tables(args.seqs, args.ctx, args.prompt, args.block)
    blocks = int(table.max()) + 1
    shape = (blocks, args.block, args.kv_heads, args.head_dim)
    caches = [tuple(torch.randn(shape, generator=g).to(dt) for _ in range(2)) for _ in range(args.layers)]
    qs = [torch.randn(args.seqs, args.heads, args.head_dim, generator=g).to(dt) for _ in range(args.layers)]
    lens = torch.full((args.seqs,), args.ctx, dtype=torch.int64)
    nbytes = args.seqs * args.ctx * args.kv_heads * args.head_dim * dt.itemsize * 2 * args.layers
    plain = torch.ones(nbytes // 4, dtype=torch.float32)

    if not cpu_attention.available():
        sys.exit("the decode attention kernel is not built at this ISA level")
    kernels = {"fulcrum": cpu_attention._decode()}
    if args.against:
        source = str(Path(args.against).resolve())
        kernels["against"] = kernel_build(source, "decode_attention.cpp", {"QUANTIZED_KV": 0}).fulcrum_decode_attention
    outs = {name: [torch.empty_like(q) for q in qs] for name in kernels}

    def step(name: str) -> None:
        fn = kernels[name]
        for (k, v), q, o in zip(caches, qs, outs[name]):
            fn(dt == torch.bfloat16, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(),
               lens.data_ptr(), o.data_ptr(), args.seqs, args.heads, args.kv_heads, args.head_dim, args.block,
               table.shape[1], args.head_dim**-0.5, 0, 0.0, None)  # fmt: skip

    calls = {name: (lambda n=name: step(n)) for name in kernels} | {"plain read": plain.sum}
    runs = in_turn(calls, args.rounds, passes=8)
    if args.against and not all(torch.equal(a, b) for a, b in zip(outs["fulcrum"], outs["against"])):
        sys.exit("the two builds differ in their output")

    print(cpu_summary())
    print(f"{args.seqs} sequences x {args.ctx} tokens, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV "
          f"of {args.head_dim}, {args.dtype}, blocks of {args.block}: {nbytes / 1e6:.0f} MB of cache a step")  # fmt: skip
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "bytes": nbytes, "ms_runs": runs}
    for name, ms in runs.items():
        med = sorted(ms)[len(ms) // 2]
        result[f"{name}_median_ms"] = med
        print(
            f"{name:12s} median {med:7.2f} ms  {nbytes / med / 1e6:5.1f} GB/s   rounds {' '.join(f'{x:.2f}' for x in ms)}"
        )
    save_json(args.out, result)


if __name__ == "__main__":
    main()
