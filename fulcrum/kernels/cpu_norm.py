"""RMSNorm as one CPU kernel (csrc/norm.cpp), for a decode step's rows and a prefill's alike: two vectorised reads
of a row where PyTorch runs 7 ops, with the reference's arithmetic (benchmarks/results/cpu-norm-avx2.log). Callers
fall back to PyTorch ops where it is not available."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import F32, I64, PTR

_DTYPES = (torch.bfloat16, torch.float32)


BINDINGS = {"norm.cpp": {"fulcrum_rms_norm": (None, I64, PTR, PTR, PTR, I64, I64, F32)}}


@functools.cache
def _module():
    lib = cpu_ext.load("norm.cpp", cpu_ext.vector_level(), BINDINGS["norm.cpp"])
    return None if lib is None else lib.fulcrum_rms_norm


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU, bf16/fp32 alike in input and weight, contiguous."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.shape == x.shape[-1:]
        and x.is_contiguous()
        and x.numel() > 0
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    weight = weight.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _module()(x.dtype == torch.bfloat16, x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y
