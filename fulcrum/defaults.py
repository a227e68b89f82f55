"""Names and defaults the command line offers, kept free of torch and transformers.

`fulcrum bench`, `fulcrum plan` and `fulcrum router` are clients or arithmetic: building their parser must not import
the engine's dependencies (3-6 s on a small VM). fulcrum.config re-exports these for the engine.
"""

from __future__ import annotations

from pathlib import Path

VERSION = "0.1.0"  # the package's (pyproject.toml reads it), the container images' tag

# Weight-only quantization methods (fulcrum/quant) and int4's group sizes: online (a full-precision checkpoint
# quantized at load time), or read from a checkpoint's quantization_config (its quant_method, as named there)
ONLINE_QUANTIZATIONS = ("int8", "int4", "fp8")
# "fp8-block" is a checkpoint's quant_method "fp8" (block-wise scales): the name tells it from online fp8
FP8_BLOCK = "fp8-block"
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors", "gguf", FP8_BLOCK, "mxfp4")
QUANTIZATIONS = ONLINE_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
INT4_GROUP_SIZES = (32, 64, 128)
# What the KV cache stores: "auto" is the model's dtype; fp8 (e4m3) and int8 hold one byte per value with an fp16
# scale per token and KV head (fulcrum/quant/kv.py). "fp8_e4m3" is vLLM's other name for fp8.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")

# The scheduler's and the CPU KV cache's defaults (EngineConfig, the model runner; `fulcrum tune` starts from them)
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# `fulcrum serve`'s step budget on CPU when --max-num-batched-tokens is not given (vLLM too sets its budget by device
# and by server or offline use). A CPU step's time grows with its tokens (its prefill GEMMs run at their full rate
# from about 128 rows), so a smaller budget gives the first prompts of a burst their first token sooner and lets
# closed-loop clients drift apart instead of arriving in lockstep. Bundled model, 2-core AMX Xeon, 128 in / 64 out,
# three rounds (benchmarks/results/cpu_batched/serve-step-budget-amx-xeon.json): TTFT p50 at concurrency 16 86.7 ms
# (runs 84-99) against 221.7 (189-237) at 2048, output 1645 (1482-1838) against 1722 (1431-2041) tok/s; at
# concurrency 4 53.7 (51-60) against 71.2 (70-92) ms, 1077 against 1035 tok/s.
DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS = 256
DEFAULT_CPU_KV_BYTES = 2 << 30  # the KV cache on CPU when --kv-cache-memory is not given

# The model that ships in the repository; every command uses it when no model is given.
DEFAULT_MODEL = Path(__file__).resolve().parent / "bundled" / "tiny-shakespeare-target"  # package data: in the wheel

# What one client may make the server hold (fulcrum/server/limits.py, fulcrum/engine/structured/grammar.py). The
# grammar bounds are read from the environment where grammars are checked (the frontend) and compiled (the engine
# core's process, which inherits it): `fulcrum serve` sets them from its flags.
DEFAULT_MAX_BODY_MB = 32.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES_ENV, DEFAULT_MAX_GRAMMAR_BYTES = "FULCRUM_MAX_GRAMMAR_BYTES", 128 << 10
COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT_S = "FULCRUM_GRAMMAR_COMPILE_TIMEOUT", 30.0
COMPILE_MEMORY_ENV, DEFAULT_COMPILE_MEMORY_MB = "FULCRUM_GRAMMAR_COMPILE_MEMORY_MB", 2048


def serve_max_num_batched_tokens(device: str, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> int:
    """`fulcrum serve`'s step budget on `device` (cpu or cuda) when none is given: DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS
    on CPU, never fewer than max_num_seqs (every running sequence's decode token fits a step); the engine's default
    elsewhere."""
    if device != "cpu":
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
