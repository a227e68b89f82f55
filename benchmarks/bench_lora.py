"""Multi-LoRA throughput: a batch of --batch requests spread over 1, 4 and 8 adapters of rank --rank (every attention
and MLP projection targeted), against the base model alone on a plain engine, in the same script; and batch-1 decode
with an adapter against the base.

The model: Qwen2.5-0.5B's shape with random weights (--model qwen05), adapters in PEFT's layout with random A and B.
Each configuration runs --repeats times, alternating; reported: output tokens/s min/median/max and the ratio of the
medians to the base model's.

    python benchmarks/bench_lora.py [--dtype bfloat16] [--batch 16] [--prompt-len 128] [--output-len 64] \\
        [--rank 16] [--repeats 3] [--out benchmarks/results/lora/bench-lora-bf16.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, cpu_summary, model_folder, print_table, save_json  # noqa: E402
from fulcrum.engine.llm import LLM  # noqa: E402
from fulcrum.engine.lora import LoRARequest  # noqa: E402
from fulcrum.sampling_params import SamplingParams  # noqa: E402

PROJ = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A PEFT adapter folder with random A and B for every projection of every layer."""
    if (folder / "adapter_model.safetensors").exists():
        return folder
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd), "v_proj": (hidden, kv * hd),
              "o_proj": (heads * hd, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for block, names in PROJ.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [n for v in PROJ.values() for n in v],
        "bias": "none", "task_type": "CAUSAL_LM"}))  # fmt: skip
    return folder


def run(llm: LLM, prompts, params, loras) -> float:
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in out) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--spreads", default="1,4,8", help="adapters the batch is spread over")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(cpu_summary())
    folder = model_folder(args)
    cfg = json.loads((folder / "config.json").read_text())
    spreads = [int(x) for x in args.spreads.split(",")]
    adapters = [write_adapter(Path(args.work_dir) / f"lora-r{args.rank}-{i}", cfg, args.rank, i)
                for i in range(max(spreads))]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist()}
               for _ in range(args.batch)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kw = dict(dtype=args.dtype, kv_cache_memory=int(args.kv_cache_gb * 2**30), enable_prefix_caching=False)
    base = LLM(str(folder), **kw)
    lora = LLM(str(folder), enable_lora=True, max_loras=max(spreads), max_lora_rank=args.rank, **kw)
    reqs = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    for r in reqs:
        lora.add_lora(r)
    configs = {"base (plain engine)": (base, None, prompts), "base (LoRA engine, no adapter)": (lora, None, prompts)}
    for n in spreads:
        configs[f"{n} adapter(s)"] = (lora, [reqs[i % n] for i in range(args.batch)], prompts)
    configs["batch-1 base"] = (base, None, prompts[:1])
    configs["batch-1 adapter"] = (lora, [reqs[0]], prompts[:1])
    for llm_, loras, ps in configs.values():  # warm-up: kernels built, adapters in their slots
        llm_.generate(ps[:2], SamplingParams(max_tokens=4), lora_request=loras[:2] if loras else None, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.repeats):
        for name, (llm_, loras, ps) in configs.items():
            rates[name].append(run(llm_, ps, params, loras))
            print(f"  run {r + 1} {name}: {rates[name][-1]:.1f} tok/s")
    rows, results = [], {}
    for name, rs in rates.items():
        ref = "batch-1 base" if name.startswith("batch-1") else "base (plain engine)"
        ratio = statistics.median(rs) / statistics.median(rates[ref])
        results[name] = {"tok_per_s": sorted(rs), "ratio_vs_" + ref: ratio}
        rows.append((name, f"{min(rs):.1f}/{statistics.median(rs):.1f}/{max(rs):.1f}", f"{ratio:.2f}x vs {ref}"))
    print_table(f"LoRA rank {args.rank}, {args.dtype}, batch {args.batch}, {args.prompt_len} in / {args.output_len} out",
                rows, ("configuration", "output tok/s min/med/max", "ratio"))  # fmt: skip
    save_json(args.out, {"cpu": cpu_summary(), "args": vars(args), "results": results})
    base.close()
    lora.close()


if __name__ == "__main__":
    main()
