"""oneDNN's prepacked matmul for linears with more rows than fulcrum's GEMV wins at (prefill, batched decode).

F.linear reorders the plain [out, in] weight into oneDNN's blocked layout on every bf16 call, and takes BLAS's
sgemm for fp32 (MKL, which runs AMD CPUs at about half of oneDNN's rate). Reordering once at load
(`torch.ops.mkldnn._reorder_linear_weight`, packed for 128 rows; packed for 1 row it ran 2-4x slower at 16-64 rows)
and calling `_linear_pointwise` measured faster than F.linear at every row count and level tried: on AMX 1.1-2.5x
at 8-256 rows (2-core Xeon); on a 2-core AMD EPYC with AVX-512 BF16 the 0.5B shape's linears (24 layers and the
LM head, read from memory) ran 1.2-1.8x at 8-64 rows in bf16 and 2.1x in fp32, 1.6-2.5x at forced avx2/avx512.
bf16 weights on a CPU without native bf16 arithmetic are packed widened to fp32 once, at load: oneDNN's emulated
bf16 matmul ran no faster than widening per call, and the widened copy ran 1.1-2x it at 16-32 rows.

Few rows stay on fulcrum's GEMV, which reads the plain weight at the memory's rate: the packed weight is a second
copy, so it is made only while it leaves RESERVE_BYTES of the machine's memory free (the KV cache is allocated
after the weights), and only at a level fulcrum's kernels run at (avx2 and up); FULCRUM_CPU_PREPACK=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from fulcrum.kernels import cpu_gemv
from fulcrum.utils import cpu_isa

log = logging.getLogger(__name__)

PACKED_FOR_ROWS = 128
# From this many rows the packed matmul beat the GEMV kernel, by level and weight dtype. amx: 2-core Xeon (at 4
# rows the GEMV won 2 of 3 shapes). The rest: the 0.5B shape's 24 layers and LM head from memory, 2-core AMD EPYC,
# 2 threads, the lower levels forced (FULCRUM_CPU_ISA, oneDNN and MKL capped with it); bf16 below avx512_bf16
# against the fp32 copy, where the GEMV widens in registers and wins longer.
MIN_ROWS = {
    "amx": {torch.bfloat16: 5, torch.float32: 5},
    "avx512_bf16": {torch.bfloat16: 3, torch.float32: 3},
    "avx512": {torch.bfloat16: 12, torch.float32: 3},
    "avx2": {torch.bfloat16: 16, torch.float32: 8},
}
RESERVE_BYTES = 6 << 30
# A decode step's fused stack (kernels/cpu_decode_stack.py: the GEMV, and BLAS's sgemm past it) beat the modules
# through the packed weights up to these rows, by level, and lost past them. amx: bf16 130 against 139-190 ms a step
# at 8 rows, 214 against 142 at 16 (and behind at 10 and 12); fp32 ahead at 8, even at 16, 374-400 against 298-344
# at 24 and 471-522 against 378-420 at 32 (2-core AMX Xeon). The rest, 2-core AMD EPYC, lower levels forced: bf16
# 33 against 36 ms at 4 rows, 45 against 36 at 6 (avx512_bf16), 88 against 95 at 8 and 156 against 119 at 16
# (avx512), 92 against 102 at 8 and 169 against 166 at 16 (avx2); fp32 52 against 69 at 2, 70 against 74 at 3 and
# 67 against 66 at 4 (avx512_bf16, the GEMV with two chains per row), 52 against 57 at 2 and 76 against 61 at 4
# (avx512), 124 against 131 at 8 and 189 against 168 at 16 (avx2). All 0.5B shape, 300-token contexts, 2 threads,
# alternating runs in one process.
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
