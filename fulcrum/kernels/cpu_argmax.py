"""Greedy decoding's argmax over a step's logits as one CPU kernel (csrc/argmax.cpp): torch's `logits.float().argmax`
paid a widening copy and an argmax that is not vectorised on the CPU, about 15% of a 64-row decode step. The result
is torch's (first index of the largest, NaN largest). Callers fall back to torch's argmax where it is missing."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

_DTYPES = (torch.bfloat16, torch.float32)


BINDINGS = {"argmax.cpp": {"fulcrum_argmax": (None, I64, PTR, PTR, I64, I64, I64)}}


@functools.cache
def _module():
    lib = cpu_ext.load("argmax.cpp", cpu_ext.vector_level(), BINDINGS["argmax.cpp"])
    return None if lib is None else lib.fulcrum_argmax


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor) -> bool:
    """CPU bf16/fp32 logits [rows, vocab], unit stride along the vocabulary."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and available()
    )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for rows `usable` accepts: int64 [rows]."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _module()(x.dtype == torch.bfloat16, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out
