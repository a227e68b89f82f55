"""y = x @ W^T + b for few rows of x as one CPU kernel (csrc/gemv.cpp), the shape that dominates decoding: each
weight row read once, at the memory's rate, where PyTorch's few-row paths fall well short of it. Built by the model
runner's `fulcrum.kernels.warm_up` before a server reports ready; callers fall back to F.linear where it is missing."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR
from fulcrum.utils import cpu_isa

# Up to these rows the kernel beat F.linear over the 0.5B shape's matrices, by level and dtype (AVX-512 without
# BF16 unmeasured: AVX2's); benchmarks/results/cpu-gemv-avx2.log, cpu-kernel-figures-from-comments.log
MAX_ROWS = {
    "avx512_bf16": {torch.bfloat16: 16, torch.float32: 32},
    "avx512": {torch.bfloat16: 32, torch.float32: 16},
    "avx2": {torch.bfloat16: 32, torch.float32: 16},
}


@functools.cache
def level() -> str:
    """The ISA this kernel is built for here: AVX-512 BF16 (native bf16 dot products), else AVX-512 or AVX2."""
    return cpu_ext.best("avx512_bf16", "avx512", "avx2")


_GEMV = (None, PTR, PTR, PTR, PTR, I64, I64, I64)
BINDINGS = {"gemv.cpp": {"fulcrum_gemv_bf16": _GEMV, "fulcrum_gemv_f32": _GEMV, "fulcrum_parallel_threads": (I64,)}}


@functools.cache
def _module():
    lib = cpu_ext.load("gemv.cpp", level(), BINDINGS["gemv.cpp"])
    if lib is None:
        return None
    return {
        torch.bfloat16: lib.fulcrum_gemv_bf16,
        torch.float32: lib.fulcrum_gemv_f32,
        "threads": lib.fulcrum_parallel_threads,
    }


def available() -> bool:
    return _module() is not None


def parallel_threads() -> int:
    """Threads the kernel's row split runs on; PyTorch's thread count when the build is right."""
    return _module()["threads"]()


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel applies: CPU, bf16/fp32, few rows, contiguous weight."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and 1 <= x.shape[0] <= MAX_ROWS[level()].get(x.dtype, 0)
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],)))
        and weight.is_contiguous()
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ weight[O, I]^T + bias, for inputs `usable` accepts."""
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    m, i = x.shape
    y = torch.empty(m, weight.shape[0], dtype=x.dtype)
    _module()[x.dtype](x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                       m, i, weight.shape[0])  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the GEMV kernel where it applies, and bf16 widened where torch has no native bf16 matmul."""
    if x.dim() == 2 and usable(x, weight, bias):
        return gemv(x, weight, bias)
    if widens(x, weight):
        return widened_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


# The fp32 copy widened_linear makes at most at once: a block of weight rows, not a second whole matrix (an LM head's
# would be over 500 MB at the 0.5B shape)
WIDEN_BYTES = 64 * 2**20
# Below this many rows widening the weight costs more than torch's emulated bf16 saves (the two crossed at 8-16)
WIDEN_MIN_ROWS = 16


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether torch's bf16 matmul runs natively here (oneDNN at AVX-512 BF16 or AMX). Below that oneDNN emulates
    bf16, slower than widening the weight to fp32 for MKL's GEMM (benchmarks/results/
    cpu-throughput-qwen05-bf16-forced-avx2-widened.log, cpu-kernel-figures-from-comments.log)."""
    return cpu_isa.torch_at_least("avx512_bf16")


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes these inputs through widened_linear: bf16, many rows, a CPU without native bf16."""
    return (
        x.dtype == weight.dtype == torch.bfloat16  # first: fp32 layers pay one comparison
        and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]
        and x.device.type == "cpu"
        and not native_bf16_matmul()
    )


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias for bf16 x and weight through fp32: the weight widened one block of rows at a time
    (nothing of it kept), the result rounded back to x's dtype."""
    xf = x.float()
    bf = None if bias is None else bias.float()
    block = max(1, WIDEN_BYTES // (4 * weight.shape[1]))
    if block >= weight.shape[0]:
        return torch.nn.functional.linear(xf, weight.float(), bf).to(x.dtype)
    y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    for a in range(0, weight.shape[0], block):
        b = None if bf is None else bf[a : a + block]
        y[..., a : a + block] = torch.nn.functional.linear(xf, weight[a : a + block].float(), b)
    return y
