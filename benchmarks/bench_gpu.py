"""The GPU path's figures, in one process on one CUDA device, baselines measured in the same run:

    python benchmarks/bench_gpu.py [--model qwen05] [--out results.json] [--skip-hf] [--skip-nano]

1. batch-1 decode tok/s and its share of the bandwidth roofline (every weight read once per token, at the copy
   bandwidth measured here), for four engines: --async-scheduling over CUDA graphs and the Triton kernels, graphs
   and kernels (the default), the Triton kernels run eagerly (--enforce-eager), and the first days' PyTorch path
   (FULCRUM_ATTENTION_BACKEND=torch, eager); what the loop, graphs and kernels each bought is the ratio between
   neighbours;
2. the 64-request workload of bench_throughput.py (prompts 64-512, outputs 32-256 tokens): fulcrum with async
   scheduling, graphs, and neither, against transformers' static batch of 64;
3. nano-vllm's shape: 256 requests, prompts and outputs uniform in 100-1024 tokens, greedy, eos ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_throughput import batch1_decode, hf_static, run_fulcrum  # noqa: E402
from benchmarks.common import add_model_args, model_folder, workload  # noqa: E402

ENGINES = {  # name -> (engine keyword arguments, attention backend)
    "async+graphs+triton": ({"async_scheduling": True}, ""),
    "graphs+triton": ({}, ""),
    "triton eager": ({"enforce_eager": True}, ""),
    "torch eager": ({"enforce_eager": True}, "torch"),
}


def copy_bandwidth_gbs(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read plus written per second: the ceiling a decode step's weight reads get."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del x, y
    return 2 * gib * 2**30 / best / 1e9


def with_backend(backend: str):
    if backend:
        os.environ["FULCRUM_ATTENTION_BACKEND"] = backend
    else:
        os.environ.pop("FULCRUM_ATTENTION_BACKEND", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-nano", action="store_true")
    p.add_argument("--engines", default=",".join(ENGINES), help="batch-1 engines to measure")
    args = p.parse_args()
    if args.device != "cuda":
        sys.exit("bench_gpu.py measures a CUDA device")
    folder = model_folder(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": folder.name}
    bw = copy_bandwidth_gbs()
    res["copy_bandwidth_gbs"] = bw
    print(f"{res['device']}, torch {torch.__version__}; copy bandwidth {bw:.0f} GB/s (read + written)", flush=True)
    kv = int(args.kv_cache_gb * 2**30)

    # 1. batch-1 decode
    res["batch1"] = {}
    for name in args.engines.split(","):
        kw, backend = ENGINES[name]
        with_backend(backend)
        rounds = batch1_decode(folder, args.dtype, "cuda", vocab, kv, rounds=3, n_tokens=128, **kw)
        tps = statistics.median(r["tok_s"] for r in rounds)
        weight_bytes = rounds[0]["weight_bytes"]
        roofline = bw * 1e9 / weight_bytes
        res["batch1"][name] = {"tok_s": tps, "rounds": [r["tok_s"] for r in rounds], "roofline_tok_s": roofline}
        each = ", ".join(f"{r['tok_s']:.0f}" for r in rounds)
        print(f"batch-1 decode, {name}: {tps:.1f} tok/s (rounds {each}); "
              f"roofline {roofline:.0f} tok/s ({weight_bytes / 1e6:.0f} MB of weights): {tps / roofline:.1%}",
              flush=True)  # fmt: skip
    with_backend("")

    # 2. the 64-request workload
    reqs = workload(64, vocab)
    out_tokens = sum(o for _, o in reqs)
    res["workload64"] = {"requests": 64, "output_tokens": out_tokens}
    for name in ("async+graphs+triton", "graphs+triton", "triton eager"):
        kw, _ = ENGINES[name]
        dt, n = run_fulcrum(folder, reqs, args.dtype, "cuda", max_num_seqs=64, kv_cache_memory=kv, **kw)
        res["workload64"][name] = n / dt
        print(f"64 requests, fulcrum {name}: {n / dt:.1f} tok/s ({dt:.2f} s)", flush=True)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).to("cuda").eval()
        hf_static(model, reqs[:4], 4, "cuda")  # warm-up
        dt, n = hf_static(model, reqs, 64, "cuda")
        res["workload64"]["hf_static_64"] = n / dt
        best = max(res["workload64"][name] for name in ENGINES if name in res["workload64"])
        print(f"64 requests, HF static batch 64: {n / dt:.1f} tok/s ({dt:.2f} s); fulcrum / HF = {best / (n / dt):.2f}x",
              flush=True)  # fmt: skip
        del model
        torch.cuda.empty_cache()

    # 3. nano-vllm's shape
    if not args.skip_nano:
        reqs = workload(256, vocab, prompt=(100, 1024), output=(100, 1024))
        res["nano_vllm_shape"] = {"requests": 256}
        for name in ("async+graphs+triton", "graphs+triton"):
            kw = dict(max_num_seqs=256, max_model_len=4096, kv_cache_memory=16 << 30, **ENGINES[name][0])
            dt, n = run_fulcrum(folder, reqs, args.dtype, "cuda", **kw)
            res["nano_vllm_shape"][name] = {"output_tokens": n, "seconds": dt, "tok_s": n / dt}
            print(f"nano-vllm shape (256 requests, 100-1024 in and out), {name}: {n / dt:.1f} tok/s "
                  f"({n} tokens in {dt:.1f} s)", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
