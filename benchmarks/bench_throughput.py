"""Offline throughput: fulcrum against Hugging Face transformers, in one process.

    python benchmarks/bench_throughput.py [--model qwen05|bundled|PATH] [--num-prompts 64]

Workload (issue "Engine core"): 64 requests, prompts uniform in 64-512 tokens, outputs uniform in
32-256 tokens, eos ignored, greedy. Systems:
  1. fulcrum `LLM.generate` (continuous batching, paged KV)
  2. transformers `generate` with static batches of 16 and 64 (left-padded; a batch runs until its
     longest request is done, and only the requested tokens are counted)
  3. transformers `generate_batch` (its continuous batching), if it runs
Then batch-1 decode against this machine's memory-bandwidth roofline. Ratios are to the best HF run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    add_model_args,
    cpu_summary,
    matmul_floor,
    memory_bandwidth_gbs,
    model_folder,
    print_table,
    save_json,
    step_matmul_floor,
    workload,
)


def record_steps(runner) -> list[tuple[int, int]]:
    """From now on, each step `runner` executes as (rows through the layers, rows sampled: through the LM head)."""
    steps, execute = [], runner.execute

    def recorded(out):
        sampled = sum(s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens for s in out.scheduled)
        steps.append((sum(s.num_new_tokens for s in out.scheduled), sampled))
        return execute(out)

    runner.execute = recorded
    return steps


def run_fulcrum(folder, reqs, dtype, device, floor: dict | None = None, **kw) -> tuple[float, int]:
    """Seconds and output tokens of the workload; `floor`, when given, gets the matmul floors measured just after
    (the FLOP floor, and under "per_step" the one at each step's own row count)."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype=dtype, device=device, **kw)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([p for p, _ in reqs[:2]], params[:2], use_tqdm=False)  # warm-up
    steps = record_steps(llm.core.runner) if floor is not None else []
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == sum(o for _, o in reqs)
    if floor is not None:
        floor.update(matmul_floor(llm.core.runner.model, reqs, dtype))
        floor["per_step"] = step_matmul_floor(llm.core.runner.model, steps, dtype)
    del llm
    return dt, n


def hf_static(model, reqs, batch_size: int, device) -> tuple[float, int]:
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch_size):
        group = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, (p, _) in enumerate(group):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(o for _, o in group)
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(o for _, o in group)
    return time.perf_counter() - t0, useful


def hf_generate_batch(model, reqs) -> tuple[float, int, int]:
    from transformers import GenerationConfig

    longest = max(o for _, o in reqs)
    cfg = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=[p for p, _ in reqs], generation_config=cfg)
    dt = time.perf_counter() - t0
    # one max_new_tokens for all: it runs every request to the longest length. Count the requested
    # tokens (as for the static batches), and report the raw count beside it.
    produced = sum(len(o.generated_tokens) for o in out.values())
    return dt, sum(o for _, o in reqs), produced


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (`parameters()` lists a tied
    embedding once, as the LM head reads it whole), but an untied input embedding only by one row; quantized
    layers' packed weights and scales (their buffers) once; a tied embedding then reads rows of the LM head's."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = [m for m in model.modules() if hasattr(m, "quant_method") and not hasattr(m, "weight")]
    total += sum(b.numel() * b.element_size() for m in quantized for b in m.buffers(recurse=False))
    emb = getattr(model.model.embed_tokens, "weight", None)  # gone when a tied table is the quantized head's
    if emb is not None and (not getattr(model, "tie_word_embeddings", False) or model.lm_head in quantized):
        total -= emb.numel() * emb.element_size()
    return total


BATCH1_TOKENS = 48  # per batch-1 round: the first comes from the prefill, the rest are timed decode steps


def batch1_decode(
    folder, dtype, device, vocab, kv, rounds: int = 5, n_tokens: int = BATCH1_TOKENS, **engine_kw
) -> list[dict]:
    """Batch-1 decode tok/s, each round beside a bandwidth probe taken just before it.

    This VM's read bandwidth moves between ~30 and ~60 GB/s from one minute to the next, so a probe
    taken minutes away from the decode says little; each round pairs the two."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype=dtype, device=device, max_num_seqs=1, kv_cache_memory=kv, **engine_kw)
    weight_bytes = decode_weight_bytes(llm.core.runner.model)
    g = torch.Generator().manual_seed(1)
    llm.generate([[11] * 32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rounds_out = []
    for _ in range(rounds):
        bw = memory_bandwidth_gbs(repeats=3) if device == "cpu" else None
        prompt = torch.randint(10, vocab, (32,), generator=g).tolist()  # a fresh prompt: no prefix-cache hit
        sp = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
        m = llm.generate([prompt], sp, use_tqdm=False)[0].metrics
        tps = (n_tokens - 1) / (m.finish_time - m.first_token_time)
        row = {"tok_s": tps, "bandwidth_gbs": bw, "weight_bytes": weight_bytes}
        if bw:
            row["roofline_tok_s"] = bw * 1e9 / weight_bytes
            row["roofline_fraction"] = tps / row["roofline_tok_s"]
        rounds_out.append(row)
    del llm
    return rounds_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-generate-batch", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    folder = model_folder(args)
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    reqs = workload(args.num_prompts, vocab)
    total_out = sum(o for _, o in reqs)
    print(cpu_summary())
    print(f"model {folder.name} dtype {args.dtype} device {args.device} threads {torch.get_num_threads()}")
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, {total_out} output tokens")

    rows, results = [], {}
    kv = int(args.kv_cache_gb * 2**30)
    floor = {} if args.device == "cpu" else None
    dt, n = run_fulcrum(folder, reqs, args.dtype, args.device, floor, max_num_seqs=args.num_prompts, kv_cache_memory=kv)
    results["fulcrum"] = n / dt
    rows.append(("fulcrum LLM.generate", f"{dt:.1f}", n, f"{n / dt:.1f}"))
    print(f"fulcrum: {n / dt:.1f} tok/s", flush=True)
    if floor:
        results["matmul_floor"] = {**floor, "ratio": dt / floor["floor_s"]}
        print(
            f"matmul floor: {floor['matmul_flops'] / 1e12:.2f} TFLOP of weight matmuls at "
            f"{floor['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s (the engine's linear, measured now) = {floor['floor_s']:.1f} s; "
            f"fulcrum took {dt:.1f} s = {dt / floor['floor_s']:.2f}x the floor",
            flush=True,
        )
        per_step = floor["per_step"]
        results["matmul_floor"]["per_step"]["ratio"] = dt / per_step["floor_s"]
        rates = ", ".join(f"{m}: {r / 1e9:.0f}" for m, r in per_step["gemm_rates_by_rows"].items())
        print(
            f"per-step matmul floor: the same matmuls, each of the {per_step['steps']} steps at the rate of its own "
            f"row count (GFLOP/s by rows {rates}) = {per_step['floor_s']:.1f} s; "
            f"fulcrum took {dt / per_step['floor_s']:.2f}x that",
            flush=True,
        )

    if not args.skip_hf:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
            dt, n = hf_static(model, reqs, bs, args.device)
            results[f"hf_static_{bs}"] = n / dt
            rows.append((f"HF generate static batch {bs}", f"{dt:.1f}", n, f"{n / dt:.1f}"))
            print(f"HF static {bs}: {n / dt:.1f} tok/s", flush=True)
        if not args.skip_generate_batch:
            try:
                dt, n, produced = hf_generate_batch(model, reqs)
                results["hf_generate_batch"] = n / dt
                results["hf_generate_batch_raw"] = produced / dt
                rows.append(("HF generate_batch (continuous)", f"{dt:.1f}", n, f"{n / dt:.1f}"))
                rows.append(("  same, counting all it generated", f"{dt:.1f}", produced, f"{produced / dt:.1f}"))
            except Exception as e:  # it is experimental; report and go on
                rows.append(("HF generate_batch (continuous)", "failed", type(e).__name__, str(e)[:60]))
        del model

    rounds = batch1_decode(folder, args.dtype, args.device, vocab, kv)
    results["batch1_decode_rounds"] = rounds
    results["batch1_decode_tok_s"] = statistics.median(r["tok_s"] for r in rounds)
    # tokens the user asked for, per second; generate_batch's raw count includes tokens past each request's end
    hf_best = max((v for k, v in results.items() if k.startswith("hf_") and not k.endswith("_raw")), default=None)
    print_table(
        "throughput (output tokens/s)",
        rows,
        ("system", "seconds", "output tokens", "tok/s"),
    )
    if hf_best:
        results["ratio_vs_best_hf"] = results["fulcrum"] / hf_best
        print(f"fulcrum / best HF = {results['ratio_vs_best_hf']:.2f}x")
    weights = rounds[0]["weight_bytes"]
    if args.device == "cpu":
        print_table(
            f"batch-1 decode against the bandwidth roofline (weights {weights / 1e9:.2f} GB per token; "
            f"each round: bandwidth probe, then {BATCH1_TOKENS - 1} decode steps)",
            [
                (i + 1, f"{r['bandwidth_gbs']:.1f}", f"{r['roofline_tok_s']:.1f}", f"{r['tok_s']:.1f}",
                 f"{100 * r['roofline_fraction']:.0f}%", f"{r['tok_s'] * weights / 1e9:.1f}")
                for i, r in enumerate(rounds)
            ],
            ("round", "bandwidth GB/s", "roofline tok/s", "fulcrum tok/s", "of roofline", "weights read GB/s"),
        )  # fmt: skip
        results["roofline_fraction"] = statistics.median(r["roofline_fraction"] for r in rounds)
        print(f"batch-1 decode: median {results['batch1_decode_tok_s']:.1f} tok/s, "
              f"median {100 * results['roofline_fraction']:.0f}% of the roofline measured beside it")  # fmt: skip
    else:
        print(f"batch-1 decode: median {results['batch1_decode_tok_s']:.1f} tok/s")
    save_json(args.out, results)


if __name__ == "__main__":
    main()
