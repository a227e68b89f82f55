"""Grouped experts against a per-token expert loop, in one run, through the engine: a random-weight model of
Mixtral's shape scaled to about 200M parameters (hidden 768, 4 layers, 8 experts of 2688, top-2, GQA 12:4), prefill
tokens/s and decode tokens/s at batch 1 and 16. And per MoE family a tiny model's load time and batch-1 decode.

The baseline swaps FusedExperts.forward for a loop that runs each token's k experts one (token, choice) at a time
with the same kernels: it reads an expert's weights once per token that chose it, where the grouped path reads
each chosen expert once per step. Rounds alternate between the two so that this VM's drifting bandwidth falls on
both alike; the table gives each one's median and the ratio.

    .venv/bin/python benchmarks/bench_moe.py                       # bf16, a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_moe.py --dtype float32 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BUNDLED, cpu_summary, print_table, save_json  # noqa: E402
from fulcrum import LLM, SamplingParams  # noqa: E402
from fulcrum.config import ModelConfig  # noqa: E402
from fulcrum.kernels import cpu_gemv  # noqa: E402
from fulcrum.layers.moe import FusedExperts  # noqa: E402
from fulcrum.models.loader import load_model  # noqa: E402
from tests.tiny_models import MOE_FAMILIES, save_tiny_model  # noqa: E402

# Mixtral-8x7B's proportions (intermediate 3.5x hidden, 8 experts, top-2, 4 query heads per KV head) at ~200M
MIXTRAL_200M = dict(
    vocab_size=2048,  # the bundled tokenizer's
    hidden_size=768,
    intermediate_size=2688,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def mixtral_200m(folder: Path, dtype: torch.dtype) -> Path:
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, MixtralConfig

    from fulcrum.utils.tokenizer import copy_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**MIXTRAL_200M), dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    copy_tokenizer(BUNDLED, folder)
    return folder


def per_token_experts(self: FusedExperts, x, topk_weights, topk_ids):
    """The baseline: every (token, choice) its own gate/up and down GEMV, as a loop over tokens computes MoE."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
    for t, (experts, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for e, w in zip(experts, weights):
            out[t] += w * cpu_gemv.linear(self.act(cpu_gemv.linear(x[t : t + 1], w13[e])), w2[e])[0]
    return out.to(x.dtype)


GROUPED = FusedExperts.forward
VARIANTS = {"grouped": GROUPED, "per-token loop": per_token_experts}


def prefill_tok_s(llm: LLM, g: torch.Generator, vocab: int, batch: int, length: int) -> float:
    prompts = [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(batch)]  # fresh: no cache hit
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return batch * length / (time.perf_counter() - t)


def decode_tok_s(llm: LLM, g: torch.Generator, vocab: int, batch: int, n: int) -> float:
    prompts = [torch.randint(10, vocab, (16,), generator=g).tolist() for _ in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    start = max(o.metrics.first_token_time for o in outs)  # every prompt's prefill done
    return batch * (n - 1) / (max(o.metrics.finish_time for o in outs) - start)


def engine(folder: Path, args, **kw) -> LLM:
    return LLM(model=str(folder), dtype=args.dtype, seed=0, cpu_threads=args.cpu_threads, **kw)


def grouped_vs_loop(folder: Path, args) -> list[dict]:
    llm = engine(folder, args, max_num_seqs=64, kv_cache_memory=512 << 20)
    vocab = MIXTRAL_200M["vocab_size"]
    cases = [("prefill", args.prefill_batch, args.prefill_len)] + [
        ("decode", b, args.decode_tokens) for b in args.batches
    ]
    runs = {(kind, b, v): [] for kind, b, _ in cases for v in VARIANTS}
    llm.generate([[11] * 16], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    for _ in range(args.rounds):
        for kind, batch, n in cases:
            for name, forward in VARIANTS.items():
                FusedExperts.forward = forward
                try:
                    g = torch.Generator().manual_seed(len(runs[(kind, batch, name)]))  # same prompts per variant
                    measure = prefill_tok_s if kind == "prefill" else decode_tok_s
                    runs[(kind, batch, name)].append(measure(llm, g, vocab, batch, n))
                finally:
                    FusedExperts.forward = GROUPED
    rows = []
    for kind, batch, n in cases:
        grouped = statistics.median(runs[(kind, batch, "grouped")])
        loop = statistics.median(runs[(kind, batch, "per-token loop")])
        what = f"{batch} x {n} prompt tokens" if kind == "prefill" else f"batch {batch}, {n} tokens each"
        rows.append(dict(case=kind, shape=what, grouped_tok_s=grouped, loop_tok_s=loop, ratio=grouped / loop))
    del llm
    return rows


def tiny_families(work: Path, args) -> list[dict]:
    rows = []
    for family in MOE_FAMILIES:
        folder = save_tiny_model(family, work / family)
        loads = []
        for _ in range(3):
            t = time.perf_counter()
            load_model(ModelConfig.from_path(folder, dtype=args.dtype))
            loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm = engine(folder, args, max_num_seqs=1, kv_cache_memory=64 << 20)
        engine_s = time.perf_counter() - t
        g = torch.Generator().manual_seed(0)
        decode_tok_s(llm, g, 2048, 1, 8)  # warm up
        tps = statistics.median(decode_tok_s(llm, g, 2048, 1, 128) for _ in range(args.rounds))
        params = sum(p.numel() for p in llm.core.runner.model.parameters())
        rows.append(dict(family=family, params=params, load_s=statistics.median(loads), engine_s=engine_s, tok_s=tps))
        del llm
    return rows


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=64)
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--decode-tokens", type=int, default=33)
    p.add_argument("--cpu-threads", type=int, default=None, help="the engine's (default: every allowed core)")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    work = Path(args.work_dir)
    print(cpu_summary())
    print(f"dtype {args.dtype}, engine threads {args.cpu_threads or 'all'}, {args.rounds} rounds (medians)")
    print(f"load average before: {load_average()} (other processes on these cores slow every figure)")

    out: dict = {"cpu": cpu_summary(), "dtype": args.dtype}
    if not args.skip_tiny:
        out["tiny"] = tiny_families(work / "moe-tiny", args)
        print_table(
            "tiny MoE models: load (load_model, median of 3), engine start (LLM()), batch-1 decode of 128 tokens",
            [
                (
                    r["family"],
                    f"{r['params'] / 1e6:.2f}M",
                    f"{r['load_s'] * 1e3:.0f} ms",
                    f"{r['engine_s']:.2f} s",
                    f"{r['tok_s']:.0f}",
                )
                for r in out["tiny"]
            ],  # fmt: skip
            ("family", "params", "load", "engine start", "decode tok/s"),
        )
    folder = mixtral_200m(work / "mixtral-200m", getattr(torch, args.dtype))
    t = time.perf_counter()
    model = load_model(ModelConfig.from_path(folder, dtype=args.dtype))
    out["big_load_s"] = time.perf_counter() - t
    total = sum(p.numel() for p in model.parameters())
    del model
    print(f"\nMixtral-shaped model: {total / 1e6:.0f}M parameters, loaded in {out['big_load_s']:.2f} s ({folder})")
    out["grouped_vs_loop"] = rows = grouped_vs_loop(folder, args)
    print_table(
        "grouped experts against a per-token expert loop (engine tokens/s)",
        [
            (r["case"], r["shape"], f"{r['grouped_tok_s']:.1f}", f"{r['loop_tok_s']:.1f}", f"{r['ratio']:.2f}x")
            for r in rows
        ],
        ("case", "shape", "grouped", "per-token loop", "ratio"),
    )
    print(f"load average after: {load_average()}")
    save_json(args.out, out)


if __name__ == "__main__":
    main()
