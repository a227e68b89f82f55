"""SwiGLU's gate, silu(gate) * up, as one CPU kernel (csrc/act.cpp): each row read once and written once, where
PyTorch's three ops make two extra passes. Callers fall back to PyTorch ops where it is missing."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

_DTYPES = (torch.bfloat16, torch.float32)
# Below this many inputs PyTorch's ops win: their fixed cost is under the kernel call's on one decode row
# (benchmarks/results/cpu-kernel-figures-from-comments.log)
MIN_ELEMENTS = 16384


# each source's entry points as ctypes calls them (result, then arguments), checked against csrc/exports.h at load
BINDINGS = {"act.cpp": {"fulcrum_silu_and_mul": (None, I64, PTR, PTR, I64, I64, I64)}}


@functools.cache
def _module():
    lib = cpu_ext.load("act.cpp", cpu_ext.vector_level(), BINDINGS["act.cpp"])
    return None if lib is None else lib.fulcrum_silu_and_mul


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor) -> bool:
    """CPU bf16/fp32 rows [.., 2n] with unit stride along the last dimension."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() >= 1
        and x.shape[-1] % 2 == 0
        and x.numel() >= MIN_ELEMENTS
        and x.stride(-1) == 1
        and (x.dim() == 1 or x.reshape(-1, x.shape[-1]).stride(0) >= x.shape[-1])
        and available()
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:]."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x.shape[-1] // 2
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    _module()(x.dtype == torch.bfloat16, x2.data_ptr(), y.data_ptr(), x2.shape[0], n, x2.stride(0))
    return y.view(*x.shape[:-1], n)
