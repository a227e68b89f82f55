"""Measured engine speed for `fulcrum plan --validate`: prefill tokens/s and time per output token,
from the engine's own request timestamps (random prompts, prefix caching off, greedy, eos ignored), with the
weight quantization and KV-cache dtype given, and the weight bytes the engine holds."""

from __future__ import annotations

import statistics
import time

import torch

from fulcrum.engine.llm import LLM
from fulcrum.quant import describe
from fulcrum.sampling_params import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids from 10 up: clear of the special tokens of small vocabularies
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def measure_speed(
    model: str,
    dtype: str = "auto",
    device: str = "cpu",
    input_len: int = 512,
    output_len: int = 64,
    batch_sizes: tuple[int, ...] = (1,),
    decode_prompt_len: int = 32,
    repeats: int = 3,
    kv_cache_memory: int | None = None,
    quantization: str | None = None,
    quantization_group_size: int = 128,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Prefill: the median over `repeats` of one `input_len`-token prompt's first scheduled step to first token.
    Decode: per batch size, the median over requests of (finish - first token) / (tokens - 1), with the whole
    batch prefilled in one step and then decoded together. `quantization`, `quantization_group_size` and
    `kv_cache_dtype` are the engine's own settings (`fulcrum serve --quantization ...`)."""
    max_len = max(input_len, decode_prompt_len + output_len) + 1
    llm = LLM(
        model=model,
        dtype=dtype,
        device=device,
        max_model_len=max_len,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(input_len, decode_prompt_len * max(batch_sizes)),
        enable_prefix_caching=False,
        kv_cache_memory=kv_cache_memory or (512 << 20),  # ample for a few sequences of the models validated on CPU
        quantization=quantization,
        quantization_group_size=quantization_group_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    vocab = llm.core.model_config.hf_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts(1, input_len, vocab, seed=99), one, use_tqdm=False)  # warm-up: kernels, allocator

    prefill = []
    for r in range(repeats):
        out = llm.generate(_prompts(1, input_len, vocab, seed=r), one, use_tqdm=False)[0]
        prefill.append(out.metrics.first_token_time - out.metrics.first_scheduled_time)
    prefill_s = statistics.median(prefill)

    decode = {}
    many = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for b in batch_sizes:
        llm.generate(_prompts(b, decode_prompt_len, vocab, seed=100 + b), SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(b, decode_prompt_len, vocab, seed=200 + b), many, use_tqdm=False)
        wall = time.perf_counter() - t0
        tpot = statistics.median(
            (o.metrics.finish_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs
        )
        decode[b] = {"tpot_s": tpot, "tokens_per_s": b / tpot, "wall_s": wall}
    cfg, runner = llm.core.model_config, llm.core.runner
    model, runner_kv, engine_weights = runner.model, runner.kv_cache_dtype_name, runner.weight_bytes
    quantized = sum(1 for m in model.modules() if getattr(m, "quant_method", None) and hasattr(m, "qweight"))
    weights = resident_weight_bytes(model)
    del llm, runner, model
    return {
        "model": str(cfg.path),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "quantization": describe(cfg.quantization, cfg.quantization_group_size),
        "quantized_layers": quantized,  # linear layers (and the LM head) holding quantized weights
        "kv_cache_dtype": runner_kv,
        "device": device,
        "threads": torch.get_num_threads(),
        "weight_bytes": weights,
        "engine_weight_bytes": engine_weights,
        "input_len": input_len,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": input_len / prefill_s,
        "output_len": output_len,
        "decode": decode,
    }


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a checkpoint's weights became: parameters and persistent buffers (quantized weights,
    scales, offsets), a tied tensor once. The engine's own figure (ModelRunner.weight_bytes, its startup log) also
    counts the RoPE cos/sin tables, which are computed, not loaded."""
    seen = {}
    for t in model.state_dict(keep_vars=True).values():
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return sum(seen.values())
