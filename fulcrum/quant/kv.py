"""The quantized KV cache's formats, as pure tensor functions: what the CPU kernels write and read, and the
reference the PyTorch paths (any device) use. fp8 (e4m3) and int8 store one byte per value and one fp16 scale per
token and KV head, taken from that head's largest magnitude when the token is written (dynamic, so no calibration and
no clipping): value ~ q * scale, and a head costs about half its bf16 bytes (`bytes_per_head`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: torch.dtype  # the cache's element type
    qmax: float  # the largest magnitude a value may take after scaling


SCALE_DTYPE = torch.float16
FORMATS = {
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, 448.0),
    "fp8_e4m3": KVFormat("fp8", torch.float8_e4m3fn, 448.0),
    "int8": KVFormat("int8", torch.int8, 127.0),
}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The format of a `--kv-cache-dtype`; None for "auto" (the model's own dtype, unscaled)."""
    return None if kv_cache_dtype == "auto" else FORMATS[kv_cache_dtype]


def bytes_per_head(fmt: KVFormat | None, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes of one token's head (its k or its v): the values, and the scale of a quantized format."""
    if fmt is None:
        return head_dim * dtype.itemsize
    return head_dim * fmt.dtype.itemsize + SCALE_DTYPE.itemsize


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] in fmt.dtype, scale [...] fp16). The stored (rounded) fp16 scale is
    the one values are divided by, so dequantizing undoes exactly what was rounded."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / fmt.qmax).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    y = torch.where(s > 0, xf / s.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(xf))
    y = y.clamp(-fmt.qmax, fmt.qmax)
    q = y.round().to(torch.int8) if fmt.dtype == torch.int8 else y.to(fmt.dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values the cache holds, in `dtype`: q * scale."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
