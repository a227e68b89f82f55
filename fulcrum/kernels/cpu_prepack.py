"""oneDNN's prepacked matmul for linears with more rows than fulcrum's GEMV wins at (prefill, batched decode): the
weight reordered into oneDNN's blocked layout once at load, where F.linear reorders it on every bf16 call (and fp32
takes MKL's sgemm). The packed copy is a second weight, made only while RESERVE_BYTES stay free and at a level
fulcrum's kernels run at; bf16 is packed widened to fp32 without native bf16. FULCRUM_CPU_PREPACK=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from fulcrum.kernels import cpu_ext, cpu_gemv
from fulcrum.kernels.cpu_ext import I64, PTR
from fulcrum.utils import cpu_isa

log = logging.getLogger(__name__)

PACKED_FOR_ROWS = 128  # packed for 1 row it ran 2-4x slower at 16-64 rows
# From this many rows the packed matmul beat the GEMV kernel, by level and weight dtype
# (benchmarks/results/cpu-prepack-amd-crossovers.log, cpu-kernel-figures-from-comments.log)
MIN_ROWS = {
    "amx": {torch.bfloat16: 5, torch.float32: 5},
    "avx512_bf16": {torch.bfloat16: 3, torch.float32: 3},
    "avx512": {torch.bfloat16: 12, torch.float32: 3},
    "avx2": {torch.bfloat16: 16, torch.float32: 8},
}
RESERVE_BYTES = 6 << 30
BINDINGS = {"packed_linear.cpp": {"fulcrum_packed_linear": (I64, I64, PTR, PTR, PTR, PTR, I64, I64, I64)}}
# A decode step's fused stack (cpu_decode_stack.py: the GEMV, and BLAS's sgemm past it) beat the modules through the
# packed weights up to these rows, by level, and lost past them (the same two logs). Where the stack calls the packed
# matmul itself (`c_linear`) it takes every decode step instead.
STACK_ROWS = {
    "amx": {torch.bfloat16: 8, torch.float32: 16},
    "avx512_bf16": {torch.bfloat16: 4, torch.float32: 3},
    "avx512": {torch.bfloat16: 11, torch.float32: 2},
    "avx2": {torch.bfloat16: 15, torch.float32: 8},
}


@functools.cache
def supported() -> bool:
    """fulcrum's kernels at avx2 or above here (under FULCRUM_CPU_ISA), oneDNN in this torch, and not turned off."""
    return (
        os.environ.get("FULCRUM_CPU_PREPACK", "1") != "0"
        and cpu_isa.at_least("avx2")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `dtype` is packed in: its own, but bf16 where torch has no native bf16 matmul."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_gemv.native_bf16_matmul() else dtype


@functools.cache
def min_rows(dtype: torch.dtype) -> int:
    """Rows from which a `dtype` weight's linear takes its packed copy (where `supported`)."""
    return MIN_ROWS[cpu_isa.isa()][dtype]


def stack_rows(dtype: torch.dtype) -> int:
    """Rows up to which a decode step of `dtype` layers with packed weights stays in the fused stack."""
    return STACK_ROWS[cpu_isa.isa()].get(dtype, 0)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_stopped = False


def _stop(reason: str, *args) -> None:
    """Log once per process why packing stopped; the layer keeps the plain path."""
    global _stopped
    if not _stopped:
        log.info("oneDNN weight prepacking stops: " + reason, *args)
        _stopped = True


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout, or None where it does not apply or would not fit."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or not supported():
        return None
    dtype = packed_dtype(weight.dtype)
    if _mem_available() - weight.numel() * dtype.itemsize < RESERVE_BYTES:
        return _stop("a second copy would leave under %d GiB free", RESERVE_BYTES >> 30)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), PACKED_FOR_ROWS)
    except RuntimeError as e:  # oneDNN capped below what it needs (ONEDNN_MAX_CPU_ISA set by hand): the plain path
        return _stop("%s", e)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T + bias through the packed weight, in x's dtype (computed in the packed weight's)."""
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(packed.dtype).contiguous()
    bias = None if bias is None else bias.to(packed.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "").to(dtype)
    return y.reshape(*lead, y.shape[-1])


@functools.cache
def c_linear():
    """`fulcrum_packed_linear` (csrc/packed_linear.cpp): this matmul as a C entry point the decode stack calls,
    or None where packing does not apply or it cannot be built."""
    if not supported():
        return None
    lib = cpu_ext.load("packed_linear.cpp", cpu_gemv.level(), BINDINGS["packed_linear.cpp"])
    return None if lib is None else lib.fulcrum_packed_linear


def handle(packed: torch.Tensor) -> int:
    """The packed weight's TensorImpl address, as packed_linear.cpp takes it (the caller keeps the tensor alive)."""
    return packed._cdata
