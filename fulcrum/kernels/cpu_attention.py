"""Attention on the CPU read straight from the paged KV cache (csrc/decode_attention.cpp), and causal prefill
attention over a chunk's own k and v (csrc/prefill_attention.cpp): no gathered copy of the cache, no padding, no mask.
Callers fall back to PyTorch where they are not available."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import F32, I64, PTR

MAX_GROUP = 16  # query heads per KV head the kernels keep in their scratch (MAX_G in the sources)
_DTYPES = (torch.bfloat16, torch.float32)
_CACHE_KINDS = cpu_ext.KV_CACHE_KINDS
# the decode kernel's builds: the common sizes, and every multiple of 8 below 64 (small draft models: the bundled
# one's is 24); on AVX-512 one that is not a multiple of 16 ends in a half-filled vector
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 160, 256)


def level() -> str:
    """The ISA these kernels are built for here: AVX-512 where the CPU (and FULCRUM_CPU_ISA) allows, else AVX2."""
    return cpu_ext.vector_level()


BINDINGS = {
    "decode_attention.cpp": {"fulcrum_decode_attention": (I64, I64, I64, *[PTR] * 8, *[I64] * 6, F32, I64, F32, PTR)},
    "prefill_attention.cpp": {
        "fulcrum_prefill_attention": (I64, I64, *[PTR] * 4, *[I64] * 9, F32, I64, PTR),
        "fulcrum_prefill_attention_varlen": (I64, I64, *[PTR] * 8, *[I64] * 8, F32, I64, PTR),
    },
}


@functools.cache
def _decode(quantized_kv: bool = False):
    """The decode kernel; `quantized_kv`: the build that reads int8/fp8 caches (built only for a server with one, so
    that the others do not compile its instantiations)."""
    lib = cpu_ext.load("decode_attention.cpp", level(), BINDINGS["decode_attention.cpp"],
                       defines={"QUANTIZED_KV": int(quantized_kv)})  # fmt: skip
    return None if lib is None else lib.fulcrum_decode_attention


@functools.cache
def _prefill_lib():
    return cpu_ext.load("prefill_attention.cpp", level(), BINDINGS["prefill_attention.cpp"])


def _prefill():
    lib = _prefill_lib()
    return None if lib is None else lib.fulcrum_prefill_attention


def available(quantized_kv: bool = False) -> bool:
    """Decode attention over this kind of cache, and prefill attention, are built here."""
    return _decode(quantized_kv) is not None and _prefill() is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    """CPU, bf16/fp32 queries, a cache in their dtype or int8/fp8 (with its scales), a supported head size and
    group, contiguous tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype in (q.dtype, *_CACHE_KINDS)
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] // num_kv_heads <= MAX_GROUP
        and k_cache.is_contiguous()
        and available(k_cache.dtype in _CACHE_KINDS)
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [D, H, hd] (one token per sequence) over each sequence's first context_lens cached tokens. An int8/fp8
    cache comes with its fp16 scales [blocks, block_size, kv_heads] (fulcrum.quant.kv). `softcap`: Gemma 2's
    cap * tanh(score / cap) on the scaled scores. `sinks` [H]: gpt-oss's logit per head, one more term of each
    head's softmax denominator."""
    q = q.contiguous()
    tables, lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    d, h, hd = q.shape
    kind = _CACHE_KINDS.get(k_cache.dtype, 0)
    if kind and not all(s is not None and s.dtype == torch.float16 and s.is_contiguous() for s in (k_scales, v_scales)):
        raise ValueError("an int8/fp8 KV cache needs contiguous fp16 scales")
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    rc = _decode(bool(kind))(
        q.dtype == torch.bfloat16, kind, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if kind else None, v_scales.data_ptr() if kind else None, tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), d, h, k_cache.shape[2], hd, k_cache.shape[1], tables.shape[1], scale,
        sliding_window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"decode attention: unsupported head_dim {hd}")
    return out


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CPU, bf16/fp32 alike, a head size that is a multiple of 8, a group of at most MAX_GROUP."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and q.shape[1] % k.shape[1] == 0
        and q.shape[1] // k.shape[1] <= MAX_GROUP
        and all(cpu_ext.rows_packed(t) for t in (q, k, v))
        and _prefill() is not None
    )


def prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of q [n, H, hd] (the last n positions) over k, v [m, KVH, hd]: [n, H, hd]; with a sliding
    window each query sees its last `sliding_window` positions, itself included. `sinks` [H]: gpt-oss's logit per
    head, one more term of each head's softmax denominator."""
    n, h, hd = q.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    out = torch.empty(n, h, hd, dtype=q.dtype)
    rc = _prefill()(
        q.dtype == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, k.shape[0], h,
        k.shape[1], hd, q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale, sliding_window or 0,
        None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"prefill attention: unsupported head_dim {hd} or group {h // k.shape[1]}")
    return out


def prefill_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, spans: list[tuple[int, int, int, int]],
    scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`prefill` for several sequences in one call, into `out` (q's shape and strides): each span (q_start, n,
    k_start, m) is a sequence whose n queries are rows q_start.. of q and out, attending causally over rows
    k_start..k_start+m of k and v (its queries the last n of those m positions). A step's fresh prompts in one call
    instead of one each: their tasks share two parallel regions (prefill_usable must hold for q, k, v)."""
    _, h, hd = q.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    cols = torch.tensor(spans, dtype=torch.int64).t().contiguous()  # q_start, n, k_start, m: [4, S]
    rc = _prefill_lib().fulcrum_prefill_attention_varlen(
        q.dtype == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cols[0].data_ptr(),
        cols[1].data_ptr(), cols[2].data_ptr(), cols[3].data_ptr(), len(spans), h, k.shape[1], hd, q.stride(0),
        k.stride(0), v.stride(0), out.stride(0), scale, sliding_window or 0, None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"prefill attention: unsupported head_dim {hd} or group {h // k.shape[1]}")
