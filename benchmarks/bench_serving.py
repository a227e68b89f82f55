"""Serving against offline: the same requests through `fulcrum serve` (64 concurrent streaming
clients) and through `LLM.generate`, in one script.

    python benchmarks/bench_serving.py [--model qwen05|bundled|PATH] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    add_model_args,
    fulcrum_server,
    model_folder,
    print_table,
    save_json,
    workload,
)


def offline(folder, reqs, args) -> float:
    from fulcrum import LLM, SamplingParams

    llm = LLM(
        model=str(folder),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.concurrency,
        kv_cache_memory=int(args.kv_cache_gb * 2**30),
    )
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([p for p, _ in reqs[:2]], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


async def one(client, url, prompt, max_tokens) -> int:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    n = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
    return n


async def served(url, reqs, concurrency) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await one(client, url, reqs[0][0], 4)  # warm-up
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p, o):
            async with sem:
                return await one(client, url, p, o)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(bounded(p, o) for p, o in reqs))
        dt = time.perf_counter() - t0
    assert sum(counts) == sum(o for _, o in reqs), "the server returned fewer tokens than asked"
    return sum(counts) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    folder = model_folder(args)
    from transformers import AutoConfig

    reqs = workload(args.num_prompts, AutoConfig.from_pretrained(folder).vocab_size)
    off = offline(folder, reqs, args)
    print(f"offline: {off:.1f} tok/s", flush=True)

    flags = ["--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.concurrency)]
    with fulcrum_server(folder, *flags, "--kv-cache-memory", str(args.kv_cache_gb)) as url:
        srv = asyncio.run(served(url, reqs, args.concurrency))
    rows = [
        ("offline LLM.generate", f"{off:.1f}"),
        (f"fulcrum serve, {args.concurrency} streaming clients", f"{srv:.1f}"),
    ]
    print_table(f"serving vs offline ({folder.name}, {args.device}, {args.dtype})", rows, ("run", "output tok/s"))
    print(f"serving / offline = {srv / off:.2f}")
    save_json(args.out, {"offline_tok_s": off, "served_tok_s": srv, "ratio": srv / off})


if __name__ == "__main__":
    main()
