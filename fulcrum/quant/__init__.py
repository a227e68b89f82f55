"""Quantized weight formats behind the linear layers' `quant_method` seam."""

from __future__ import annotations

from collections.abc import Callable

from fulcrum.config import CHECKPOINT_QUANTIZATIONS, INT4_GROUP_SIZES, ONLINE_QUANTIZATIONS, QUANTIZATIONS
from fulcrum.quant.base import LinearMethod


def method_factory(
    quantization: str | None,
    group_size: int = 128,
    checkpoint: dict | None = None,
    packed_modules_mapping: dict | None = None,
    tie_word_embeddings: bool = False,
) -> Callable[[str], LinearMethod | None]:
    """What each linear layer (and the LM head) of a model is built with: `quant(prefix)` gives a fresh method
    for the layer named `prefix` ("model.layers.0.self_attn.qkv_proj", "lm_head"), or None for full precision.
    `quantization` is one of QUANTIZATIONS: online ones quantize every layer (`group_size` is int4's); a
    checkpoint's (gptq, awq, compressed-tensors) follow its quantization_config (`checkpoint`), which may leave
    modules unquantized, matched by their checkpoint names (a stacked layer's through `packed_modules_mapping`)."""
    if quantization is None:
        return lambda prefix: None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization == "gguf":  # a GGUF file's blocks, each tensor in its own type
        from fulcrum.quant.gguf import gguf_factory

        return gguf_factory()
    if quantization == "mxfp4":  # gpt-oss: only the experts are MXFP4, and its model reads them (models/gpt_oss.py)
        return lambda prefix: None
    if quantization in CHECKPOINT_QUANTIZATIONS:
        from fulcrum.quant.checkpoint import checkpoint_factory

        return checkpoint_factory(quantization, checkpoint or {}, packed_modules_mapping or {}, tie_word_embeddings)
    if quantization == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    from fulcrum.quant.online import Fp8Method, Int4Method, Int8Method

    if quantization == "int8":
        return lambda prefix: Int8Method()
    if quantization == "fp8":
        return lambda prefix: Fp8Method()
    return lambda prefix: Int4Method(group_size)


def expert_format(quant: Callable, prefix: str) -> tuple[int, int] | None:
    """How a MoE layer's routed experts at `prefix` ("model.layers.3.mlp.experts") are stored: a block-wise fp8
    checkpoint's weight_block_size, or None for full precision (every other format quantizes linear layers only)."""
    experts = getattr(quant, "experts", None)
    return experts(prefix) if experts is not None else None


def describe(quantization: str | None, group_size: int = 128, checkpoint: dict | None = None) -> str:
    """One line for the startup log: "int4 (group 128)", "gptq int4 (group 128, desc_act)" (a checkpoint's
    format needs its quantization_config, `checkpoint`, for the details)."""
    if quantization is None:
        return "none"
    if quantization in ONLINE_QUANTIZATIONS:
        return f"int4 (group {group_size})" if quantization == "int4" else quantization
    if not checkpoint:
        return f"{quantization} (from the checkpoint)"
    if quantization == "mxfp4":
        return "mxfp4 (experts: 4-bit e2m1 values, one exponent per 32)"
    if quantization == "gguf":
        from fulcrum.quant.gguf import describe as describe_gguf

        return describe_gguf(checkpoint)
    from fulcrum.quant.checkpoint import checkpoint_format

    return checkpoint_format(quantization, checkpoint).describe()
