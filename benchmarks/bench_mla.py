"""Multi-head latent attention (DeepSeek-V2/V3) on this machine, in one run: load time and batch-1 decode of tiny
DeepSeek models through the engine; decode with the up-projections absorbed against expanding K/V from the cached
latents every step, through the engine (a model with DeepSeek-V2-Lite's attention) and per attention call (V2-Lite's
16 heads and V3's 128 at several contexts and batch sizes).

    .venv/bin/python benchmarks/bench_mla.py [--dtype bfloat16] [--contexts 256,1024,4096] [--batches 1,8] [--threads 1]

Every model is random weights saved with save_pretrained; both decodes give the same result (tests/layers/test_mla.py).
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
from benchmarks.common import cpu_summary, print_table, save_json  # noqa: E402

# DeepSeek-V2-Lite's attention (16 heads, latent 512 + RoPE key 64, heads of 128 + 64 / 128, no query latent) and
# hidden size, 4 dense layers, the bundled tokenizer's vocabulary
V2_LITE_ATTENTION = dict(
    vocab_size=2048, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, first_k_dense_replace=4, max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip
SHAPES = {"v2-lite (16 heads)": 16, "v3 (128 heads)": 128}  # per-call shapes: heads; latent 512 + 64, heads 128/64/128


def save_v2_lite(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from benchmarks.common import BUNDLED
    from fulcrum.utils.tokenizer import copy_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV2Config(**V2_LITE_ATTENTION), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    copy_tokenizer(BUNDLED, folder)
    return folder


def engine_decode(
    folder: Path, dtype: str, prompt_len: int, n_tokens: int, rounds: int, absorb=(True,), threads=None
) -> dict:
    """Load time, then batch-1 decode tok/s (median of `rounds`, each a fresh prompt) for each `absorb` setting,
    the same engine switched between them."""
    from fulcrum import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=dtype, max_num_seqs=1, kv_cache_memory=256 << 20, seed=0, cpu_threads=threads)
    out = {"load_s": time.perf_counter() - t0}
    layers = llm.core.runner.attn_layers
    sp = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    llm.generate([[11] * 16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [torch.randint(10, 2048, (prompt_len,), generator=g).tolist() for _ in range(rounds)]
    tokens = []
    for a in absorb:
        for layer in layers:
            layer.absorb = a
        speeds, toks = [], []
        for prompt in prompts:  # the same prompts for each setting (a prefix-cache hit skips prefill, not decode)
            o = llm.generate([prompt], sp, use_tqdm=False)[0]
            speeds.append((n_tokens - 1) / (o.metrics.finish_time - o.metrics.first_token_time))
            toks.append(o.outputs[0].token_ids)
        out["absorbed" if a else "expanded"] = statistics.median(speeds)
        tokens.append(toks)
    # the greedy tokens of each setting, compared: in bf16 the two orders of rounding may part after many tokens
    out["same_tokens"] = all(t == tokens[0] for t in tokens)
    return out


def attention_call(heads: int, batch: int, context: int, dtype: torch.dtype, absorb: bool, repeats: int) -> float:
    """Milliseconds per decode call of one MLAAttention layer: `batch` sequences with `context` cached rows each."""
    from fulcrum.layers.attention import AttentionMetadata, attach_kv_cache
    from fulcrum.layers.linear import ColumnParallelLinear
    from fulcrum.layers.mla import MLAAttention

    r, rope, nope, v, bs = 512, 64, 128, 128, 16
    attn = MLAAttention(heads, r, nope, rope, v, (nope + rope) ** -0.5)
    kv_b = ColumnParallelLinear(r, heads * (nope + v), dtype=dtype)
    kv_b.weight.data.normal_(0, 0.02)
    attn.load_up_projection(kv_b, dtype)
    attn.absorb = absorb
    per_seq = -(-context // bs)
    cache = attach_kv_cache([attn], batch * per_seq, bs, dtype, None, "cpu")[0]
    cache.normal_()
    tables = torch.arange(batch * per_seq).view(batch, per_seq)
    slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
    meta = AttentionMetadata.for_decodes(slots, tables, torch.full((batch,), context))
    q, rows = torch.randn(batch, heads, nope + rope, dtype=dtype), torch.randn(batch, r + rope, dtype=dtype)
    with torch.inference_mode():
        attn(q, rows, meta)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            attn(q, rows, meta)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1024, help="the V2-Lite-attention model's prompt")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the per-call figures; the engine's take it as cpu_threads
    dtype = getattr(torch, args.dtype)
    print(cpu_summary())
    print(f"dtype {args.dtype}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} (start)")
    results: dict = {"cpu": cpu_summary(), "dtype": args.dtype}
    from tests.tiny_models import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-mla-"))
    # a first engine builds or loads the CPU kernels, which the load times below then leave out
    engine_decode(save_tiny_model("deepseek-v3", work / "warm-up"), args.dtype, 8, 4, 1, threads=args.threads)
    rows = []
    for family in ["deepseek-v2", "deepseek-v3", "deepseek-v3-moe"]:
        r = engine_decode(save_tiny_model(family, work / family), args.dtype, 32, 128, 3, threads=args.threads)
        results[family] = r
        rows.append((family, f"{r['load_s']:.2f}", f"{r['absorbed']:.0f}"))
    title = "tiny models (tests' builders: hidden 64, latent 32 + 8, 2-3 layers): load, batch-1 decode after 32 tokens"
    print_table(title, rows, ("model", "load s", "tok/s"))

    folder = save_v2_lite(work / "v2-lite")
    r = engine_decode(folder, args.dtype, args.prompt_len, 64, 3, absorb=(True, False), threads=args.threads)
    results["v2-lite-attention"] = r
    print_table(
        f"V2-Lite attention, 4 dense layers: batch-1 decode after a {args.prompt_len}-token prompt",
        [
            (
                f"{r['load_s']:.2f}",
                f"{r['absorbed']:.1f}",
                f"{r['expanded']:.1f}",
                f"{r['absorbed'] / r['expanded']:.2f}x",
                r["same_tokens"],
            )
        ],
        ("load s", "absorbed tok/s", "expanded tok/s", "ratio", "same tokens"),
    )

    rows, calls = [], []
    for name, heads in SHAPES.items():
        for b in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                if heads * b * ctx > 128 * 4096:  # expanded K/V of more would pass a few GB
                    continue
                absorbed = attention_call(heads, b, ctx, dtype, True, args.repeats)
                expanded = attention_call(heads, b, ctx, dtype, False, args.repeats)
                calls.append(dict(shape=name, batch=b, context=ctx, absorbed_ms=absorbed, expanded_ms=expanded))
                rows.append((name, b, ctx, f"{absorbed:.2f}", f"{expanded:.2f}", f"{expanded / absorbed:.1f}x"))
    results["attention_calls"] = calls
    print_table(
        "one decode call of one layer (ms)", rows, ("shape", "batch", "context", "absorbed", "expanded", "speed-up")
    )
    print(f"load average {os.getloadavg()[0]:.1f} (end): other processes share these cores")
    save_json(args.out, results)


if __name__ == "__main__":
    main()
