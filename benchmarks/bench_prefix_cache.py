"""Prefix caching: 32 requests that share a 1,024-token prefix, with caching on and off.

    python benchmarks/bench_prefix_cache.py [--model qwen05|bundled|PATH]

Reports prefill work (prompt tokens actually computed) and mean time to first token, and checks
that both runs produce identical outputs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, model_folder, print_table, save_json  # noqa: E402


def run(folder, prompts, caching: bool, dtype, device, kv):
    from fulcrum import LLM, SamplingParams

    llm = LLM(
        model=str(folder),
        dtype=dtype,
        device=device,
        enable_prefix_caching=caching,
        max_model_len=len(prompts[0]) + 64,
        max_num_batched_tokens=2048,
        kv_cache_memory=kv,
    )
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # the first request warms the cache; the 31 others arrive together after it
    t0 = time.perf_counter()
    first = llm.generate(prompts[:1], sp, use_tqdm=False)
    rest = llm.generate(prompts[1:], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    outs = first + rest
    ttft = [o.metrics.ttft for o in outs]
    computed = sum(len(o.prompt_token_ids) - o.metrics.num_cached_tokens for o in outs)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "prefill_tokens": computed,
        "mean_ttft": sum(ttft) / len(ttft),
        "wall": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    args = p.parse_args()
    folder = model_folder(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, vocab, (args.prefix_len,), generator=g).tolist()
    prompts = [prefix + torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(args.num_requests)]

    kv = int(args.kv_cache_gb * 2**30)
    off = run(folder, prompts, False, args.dtype, args.device, kv)
    on = run(folder, prompts, True, args.dtype, args.device, kv)
    same = on["tokens"] == off["tokens"]
    matching = sum(a == b for a, b in zip(on["tokens"], off["tokens"]))
    rows = [
        ("caching off", off["prefill_tokens"], f"{off['mean_ttft'] * 1000:.0f}", f"{off['wall']:.1f}"),
        ("caching on", on["prefill_tokens"], f"{on['mean_ttft'] * 1000:.0f}", f"{on['wall']:.1f}"),
    ]
    print_table(
        f"{args.num_requests} requests sharing a {args.prefix_len}-token prefix ({folder.name})",
        rows,
        ("run", "prefill tokens computed", "mean TTFT ms", "wall s"),
    )
    work = off["prefill_tokens"] / on["prefill_tokens"]
    ttft = off["mean_ttft"] / on["mean_ttft"]
    print(
        f"prefill work {work:.1f}x less, mean TTFT {ttft:.1f}x lower, identical outputs: {same} "
        f"({matching}/{len(prompts)} requests token-identical)"
    )
    if not same and args.dtype != "float32":
        print(
            "  (in 16-bit, a batch computed in other shapes rounds differently, and a random-weight model's "
            "near-tied logits then flip greedy picks; run with --dtype float32 or a trained model to check identity)"
        )
    save_json(args.out, {"prefill_work_ratio": work, "ttft_ratio": ttft, "identical": same, "matching": matching})


if __name__ == "__main__":
    main()
