"""Quantized weight formats behind the linear layers' `quant_method` seam."""

from __future__ import annotations

from collections.abc import Callable

from fulcrum.config import INT4_GROUP_SIZES, QUANTIZATIONS
from fulcrum.quant.base import LinearMethod


def method_factory(quantization: str | None, group_size: int = 128) -> Callable[[], LinearMethod | None]:
    """What each linear layer (and the LM head) of a model is built with: a fresh method per layer, or None for
    full precision. `quantization` is one of QUANTIZATIONS; `group_size` is int4's."""
    if quantization is None:
        return lambda: None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    from fulcrum.quant.online import Fp8Method, Int4Method, Int8Method

    if quantization == "int8":
        return Int8Method
    if quantization == "fp8":
        return Fp8Method
    return lambda: Int4Method(group_size)


def describe(quantization: str | None, group_size: int = 128) -> str:
    if quantization is None:
        return "none"
    return f"int4 (group {group_size})" if quantization == "int4" else quantization
