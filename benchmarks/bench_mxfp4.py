"""Batch-1 decode of a gpt-oss-shaped MoE with its experts in MXFP4 (kept so: the GEMV kernel reads the 4-bit values
and their exponents) against the same experts in bf16, through the engine, in one run. gpt-oss-20b's real sizes
(hidden 2880, 32 experts of 2880, top-4, 64 query heads and 8 KV heads of 64, biases, sinks, sliding window 128 on
every other layer) with random weights; the layer count cut to fit this machine's memory (2 by default, of 24) and
the vocabulary the bundled tokenizer's (2048, of 201088: the LM head's share of a step shrinks with it).

Both checkpoints hold the same expert weights: random MXFP4 blocks and exponents, and their exact bf16 values.
Rounds alternate between the two so that a drifting machine falls on both alike; the table gives medians.

    .venv/bin/python benchmarks/bench_mxfp4.py --out benchmarks/results/mxfp4/cpu-gpt-oss-20b-shape.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BUNDLED, cpu_summary, print_table, save_json  # noqa: E402
from fulcrum import LLM, SamplingParams  # noqa: E402
from fulcrum.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from fulcrum.quant import mxfp4  # noqa: E402
from fulcrum.utils.tokenizer import copy_tokenizer  # noqa: E402

GPT_OSS_20B = dict(
    vocab_size=2048, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
    num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    max_position_embeddings=4096, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=4096, rope_theta=150000.0),
    architectures=["GptOssForCausalLM"],
)  # fmt: skip
QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}  # fmt: skip


def save_pair(work: Path, layers: int) -> tuple[Path, Path]:
    """The MXFP4 checkpoint and its bf16 twin (experts as transformers saves them, [E, in, out])."""
    from transformers import GptOssConfig

    folders = work / f"gpt-oss-20b-shape-{layers}l-mxfp4", work / f"gpt-oss-20b-shape-{layers}l-bf16"
    if all((f / "model.safetensors").exists() for f in folders):
        return folders
    types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    cfg = GptOssConfig(**GPT_OSS_20B, num_hidden_layers=layers, layer_types=types)
    cfg.quantization_config = QUANT
    # the names and shapes of the MXFP4 model's parameters (torch.empty: no page of them is touched)
    shapes = {n: (p.shape, p.dtype) for n, p in GptOssForCausalLM(cfg, torch.bfloat16).named_parameters()}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name in [n for n in shapes if ".qkv_proj." in n]:  # the checkpoint's q, k and v, which the model stacks
        shape, dtype = shapes.pop(name)
        for part, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[name.replace("qkv_proj", part)] = ((rows, *shape[1:]), dtype)
    g = torch.Generator().manual_seed(0)
    quantized, dense = {}, {}
    for name, (shape, dtype) in shapes.items():
        if name.endswith("_scales"):  # exponents around 2^-6: weights of about 0.03
            t = torch.randint(118, 124, shape, generator=g, dtype=torch.uint8)
        elif name.endswith("_blocks"):
            t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        quantized[name] = t
    for name, t in quantized.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            scales = quantized[f"{base}_scales"]
            w = torch.stack([mxfp4.dequantize(t[e], scales[e], torch.bfloat16) for e in range(t.shape[0])])
            dense[base] = w.transpose(1, 2).contiguous()
        else:
            dense[name] = t
    for folder, tensors, quant in ((folders[0], quantized, True), (folders[1], dense, False)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config = cfg.to_dict() | {"dtype": "bfloat16"}
        if not quant:
            config.pop("quantization_config")
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        copy_tokenizer(BUNDLED, folder)
    return folders


def decode_tok_s(llm: LLM, g: torch.Generator, n: int) -> float:
    prompt = torch.randint(10, 2048, (16,), generator=g).tolist()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return (n - 1) / (out.metrics.finish_time - out.metrics.first_token_time)


def expert_bytes(llm: LLM) -> int:
    model = llm.core.runner.model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=33)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args()
    print(cpu_summary())
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine slows both)")
    folders = save_pair(Path(args.work_dir), args.layers)
    engines = {}
    for name, folder in zip(("mxfp4", "bf16"), folders):
        t = time.perf_counter()
        engines[name] = LLM(model=str(folder), dtype="bfloat16", seed=0, cpu_threads=args.cpu_threads,
                            max_num_seqs=1, kv_cache_memory=64 << 20)  # fmt: skip
        print(
            f"{name}: engine up in {time.perf_counter() - t:.1f} s, experts {expert_bytes(engines[name]) / 1e9:.2f} GB"
        )
        decode_tok_s(engines[name], torch.Generator().manual_seed(99), 8)  # warm up
    runs = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            runs[name].append(decode_tok_s(llm, torch.Generator().manual_seed(r), args.decode_tokens))
    med = {name: statistics.median(v) for name, v in runs.items()}
    rows = [(name, f"{expert_bytes(engines[name]) / 1e9:.2f} GB", f"{med[name]:.2f}", f"{med[name] / med['bf16']:.2f}x")
            for name in engines]  # fmt: skip
    print_table(f"batch-1 decode, gpt-oss-20b shape, {args.layers} layers (engine tokens/s, median of "
                f"{args.rounds})", rows, ("experts", "expert bytes", "tok/s", "vs bf16"))  # fmt: skip
    out = {
        "cpu": cpu_summary(), "layers": args.layers, "shape": GPT_OSS_20B, "decode_tokens": args.decode_tokens,
        "rounds": runs, "median_tok_s": med, "ratio_mxfp4_vs_bf16": med["mxfp4"] / med["bf16"],
        "expert_bytes": {name: expert_bytes(llm) for name, llm in engines.items()},
        "load_average_after": os.getloadavg(), "note": "machine shared with other engineers' test runs",
    }  # fmt: skip
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    save_json(args.out, out)


if __name__ == "__main__":
    main()
