"""y = x @ dequant(W)^T + b over MXFP4 weights (gpt-oss's experts; fulcrum.quant.mxfp4 holds the format and chooses
between these): the GEMV kernel (csrc/mxfp4.cpp) for few rows reads the 4-bit values and their exponents in
registers; the whole weight dequantized for many rows (prefill)."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

BLOCK = 32  # values per shared exponent (fulcrum.quant.BLOCK)
_DTYPES = (torch.float32, torch.bfloat16)

BINDINGS = {
    "mxfp4.cpp": {
        "fulcrum_qgemv_mxfp4": (None, I64, *[PTR] * 5, I64, I64, I64),
        "fulcrum_dequant_mxfp4": (None, I64, PTR, PTR, PTR, I64, I64),
    }
}


@functools.cache
def _module():
    return cpu_ext.load("mxfp4.cpp", cpu_ext.vector_level(), BINDINGS["mxfp4.cpp"])


def available() -> bool:
    return _module() is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def usable(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """The kernel takes these: CPU, fp32/bf16 input rows [M, I], contiguous blocks, a bias of the input's dtype."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in _DTYPES
        and blocks.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and available()
    )


def gemv(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, I] @ W^T + bias with W [O, I] as MXFP4 blocks [O, I / 32, 16] and scales [O, I / 32], by the kernel."""
    x = x.contiguous()
    out_features, in_features = blocks.shape[0], blocks.shape[1] * BLOCK
    if x.shape[-1] != in_features:
        raise ValueError(f"input of {x.shape[-1]} features for an MXFP4 weight of {in_features}")
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    _module().fulcrum_qgemv_mxfp4(x.dtype == torch.bfloat16, x.data_ptr(), blocks.data_ptr(), scales.data_ptr(),
                                     _ptr(bias), y.data_ptr(), x.shape[0], in_features, out_features)  # fmt: skip
    return y


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [O, I] in `dtype` (fp32 or bf16) from blocks [O, I / 32, 16] and scales [O, I / 32], by the kernel."""
    out = torch.empty(blocks.shape[0], blocks.shape[1] * BLOCK, dtype=dtype)
    _module().fulcrum_dequant_mxfp4(dtype == torch.bfloat16, blocks.contiguous().data_ptr(),
                                    scales.contiguous().data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])  # fmt: skip
    return out
