"""Rotary embedding and the KV-cache write as one CPU kernel (csrc/rope.cpp): q and k rotated in place, the rotated
k and v written to their cache slots, with the reference's roundings (outputs identical to PyTorch's ten small ops).
Callers fall back to PyTorch ops where it is not available."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

_DTYPES = (torch.bfloat16, torch.float32)
_CACHE_KINDS = cpu_ext.KV_CACHE_KINDS
BINDINGS = {"rope.cpp": {"fulcrum_rope_cache": (None, I64, *[PTR] * 10, *[I64] * 8)}}


@functools.cache
def _module():
    # plain loops, vectorised by the compiler for the level
    lib = cpu_ext.load("rope.cpp", cpu_ext.best("avx512_bf16", "avx512", "avx2"), BINDINGS["rope.cpp"])
    return None if lib is None else lib.fulcrum_rope_cache


def available() -> bool:
    return _module() is not None


def usable(q, k, v, cos, sin, k_cache) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == v.dtype == cos.dtype == sin.dtype == q.dtype
        and (k_cache is None or k_cache.dtype in (q.dtype, *_CACHE_KINDS) and k_cache.is_contiguous())
        and cpu_ext.rows_packed(q) and cpu_ext.rows_packed(k) and cpu_ext.rows_packed(v)
        and q.shape[2] % 2 == 0
        and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == q.shape[0] * q.shape[2]
        and available()
    )  # fmt: skip


def rope_and_cache(q, k, v, cos, sin, slot_mapping, k_cache, v_cache, k_scales=None, v_scales=None) -> None:
    """Rotate q and k in place; when a cache is given, write the rotated k and v to their slots in it (an int8 or
    fp8 cache quantized, with their fp16 scales [blocks, block_size, kv_heads] written to k_scales/v_scales)."""

    def ptr(t):
        return None if t is None else t.data_ptr()

    kind = 0 if k_cache is None else _CACHE_KINDS.get(k_cache.dtype, 0)
    if kind and (k_scales is None or k_scales.dtype != torch.float16 or not k_scales.is_contiguous()):
        raise ValueError("a quantized KV cache needs contiguous fp16 scales")
    slots = None if slot_mapping is None else slot_mapping.to(torch.int64).contiguous()
    _module()(
        q.dtype == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        ptr(slots), ptr(k_cache), ptr(v_cache), ptr(k_scales), ptr(v_scales), kind, q.shape[0], q.shape[1],
        k.shape[1], q.shape[2], q.stride(0), k.stride(0), v.stride(0),
    )  # fmt: skip
