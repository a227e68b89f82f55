"""A second, blocked copy of each linear's weight for more rows than fulcrum's GEMV wins at (prefill, batched
decode), made once at load: fulcrum's own layout (csrc/blocked_linear.cpp: tiles of output columns side by side per
input, read in the outer-product order) for fp32 and bf16 at every level, where it beat oneDNN's prepacked matmul
(1.4x at 8 bf16 rows, up to 2.5x at 16 fp32 rows; level with it at prefill; below AVX-512 BF16 bf16 is kept in bf16
and widened as it loads, where oneDNN needs a widened fp32 copy); at AMX bf16 takes oneDNN's blocked layout, whose
tiles it uses, and so does a weight whose rows do not fill the tiles (F.linear would reorder a bf16 weight on every
call and take fp32 to MKL's sgemm). The copy is made only while RESERVE_BYTES stay free and at a level fulcrum's
kernels run at. FULCRUM_CPU_PREPACK=0 turns both off, FULCRUM_CPU_BLOCKED=0 fulcrum's layout alone.
At AMX a bf16 weight also gets fulcrum's layout for steps of few rows (`pack_small`; FULCRUM_CPU_SMALL=0 turns it off).
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
_LINEAR = (I64, I64, PTR, PTR, PTR, PTR, I64, I64, I64)
BINDINGS = {
    "packed_linear.cpp": {"fulcrum_packed_linear": _LINEAR},
    "blocked_linear.cpp": {"fulcrum_blocked_linear": _LINEAR},
}
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


def _onednn_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN's copy of a `dtype` weight is in: its own, but fp32 for bf16 where torch has no native bf16
    matmul."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_gemv.native_bf16_matmul() else dtype


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `dtype` is packed in: its own in fulcrum's layout, else oneDNN's dtype for it."""
    return dtype if blocked_dtype(dtype) else _onednn_dtype(dtype)


# From this many rows fulcrum's blocked matmul beat the GEMV, at every level it runs at: 1.4-1.7x at 2-4 rows of the
# 0.5B shape's cold weights (bf16 and fp32, AVX-512 BF16 and forced AVX2, 2-core AMD EPYC); 1 row was level or slower
BLOCKED_MIN_ROWS = 2


# From this many rows (prefill) an fp32 weight's linear takes torch's sgemm (MKL's) on the plain weight instead of the
# blocked copy, by level, on Intel CPUs. The blocked kernel reads each tile whole against 8 rows at a time: at AVX-512
# a tile past L1 (the bundled model's down projection, 768 inputs) ran at half MKL's rate, the others 15-30% below it;
# at AVX2 the two were level (bundled model's widths, 2-core AMX Xeon, issue 49: 2048 rows 17.5 against 23.3 ms a
# layer at AVX-512, 29.0 against 29.4 at forced AVX2; 512 rows 4.0-4.2 against 4.5-5.4; 256 and fewer level or the
# blocked ahead). MKL runs its AVX-512 kernels on Intel's CPUs only: on a 2-core AMD EPYC (Zen 5, AVX-512 BF16) its
# sgemm ran 200-212 GFLOP/s at 512-2048 rows of the same shapes against the blocked kernel's 449-480 (a layer 15.7
# against 7.0 ms at 2048 rows), so elsewhere the blocked copy takes every row count.
BLAS_ROWS = {"amx": 512, "avx512_bf16": 512, "avx512": 512}
BLAS_VENDORS = ("GenuineIntel",)


@functools.cache
def blas_rows() -> int | None:
    """BLAS_ROWS at this level and vendor (read once: every linear asks), or None where the blocked copy takes every
    row count."""
    return BLAS_ROWS.get(cpu_isa.isa()) if cpu_isa.vendor() in BLAS_VENDORS else None


def takes_blas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., in] times the plain fp32 `weight` goes to torch's sgemm rather than a blocked copy."""
    if not weight.dtype == x.dtype == torch.float32:
        return False
    rows = blas_rows()
    return rows is not None and x.numel() >= rows * x.shape[-1]


@functools.cache
def min_rows(dtype: torch.dtype) -> int:
    """Rows from which a `dtype` weight's linear takes its packed copy (where `supported`)."""
    if blocked_dtype(dtype):
        return BLOCKED_MIN_ROWS
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


@functools.cache
def _blocked():
    """`fulcrum_blocked_linear`, or None where it is turned off or cannot be built."""
    if os.environ.get("FULCRUM_CPU_BLOCKED", "1") == "0" or not supported():
        return None
    lib = cpu_ext.load("blocked_linear.cpp", cpu_gemv.level(), BINDINGS["blocked_linear.cpp"])
    return None if lib is None else lib.fulcrum_blocked_linear


def tile() -> int:
    """Output columns per tile of fulcrum's fp32 layout: two vectors of the level (TW in blocked_linear.cpp)."""
    return 16 if cpu_gemv.level() == "avx2" else 32


def _pairs() -> bool:
    """Whether bf16 takes the layout of input pairs for AVX-512 BF16's dot products here (else fp32's, widened)."""
    return cpu_gemv.level() == "avx512_bf16"


def fits_layout(weight: torch.Tensor) -> bool:
    """Whether fulcrum's blocked kernel holds `weight` [out, in] here: fp32 or bf16 whose rows fill whole tiles;
    with AVX-512 BF16 dot products bf16 rows in tiles of 32 and inputs in pairs."""
    out, inp = weight.shape
    if weight.dtype == torch.bfloat16 and _pairs():
        fits = out % 32 == 0 and inp % 2 == 0
    else:
        fits = weight.dtype in (torch.float32, torch.bfloat16) and out % tile() == 0
    return fits and _blocked() is not None


def blocks(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] takes fulcrum's blocked layout as its packed copy (else oneDNN's): where it fits
    the layout, bar bf16 at AMX, whose tiles oneDNN uses (there `pack_small` makes fulcrum's copy beside it)."""
    return fits_layout(weight) and not (weight.dtype == torch.bfloat16 and cpu_isa.isa() == "amx")


def blocked_dtype(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` take fulcrum's layout here (those whose rows fill its tiles)."""
    return blocks(torch.empty(64, 2, dtype=dtype))


def block(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in fulcrum's layout: [out / TW, in, TW], bf16 at AVX-512 BF16 [out / 32, in / 2, 32, 2]."""
    out, inp = weight.shape
    w = weight.detach().contiguous()
    if w.dtype == torch.bfloat16 and _pairs():
        return w.view(out // 32, 32, inp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.view(out // tile(), tile(), inp).permute(0, 2, 1).contiguous()


def is_blocked(packed: torch.Tensor) -> bool:
    """A weight from `block` (a plain tensor), not oneDNN's (an opaque mkldnn one)."""
    return packed.layout == torch.strided


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in fulcrum's blocked layout where it `blocks`, else oneDNN's, or None where neither
    applies or a copy would not fit."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or not supported():
        return None
    blocked = blocks(weight)
    dtype = weight.dtype if blocked else _onednn_dtype(weight.dtype)
    if _mem_available() - weight.numel() * dtype.itemsize < RESERVE_BYTES:
        return _stop("a second copy would leave under %d GiB free", RESERVE_BYTES >> 30)
    if blocked:
        return block(weight)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), PACKED_FOR_ROWS)
    except RuntimeError as e:  # oneDNN capped below what it needs (ONEDNN_MAX_CPU_ISA set by hand): the plain path
        return _stop("%s", e)


# At the amx level a bf16 weight also gets fulcrum's layout (`pack_small`) for steps of BLOCKED_MIN_ROWS to SMALL_ROWS
# rows, where the blocked kernel's AVX-512 BF16 dot products beat oneDNN's AMX tiles on cold weights; oneDNN's copy
# keeps the steps past them and prefill. 0.5B shape, 2-core AMX Xeon (benchmarks/bench_linear_rows.py): blocked
# 0.67-0.74x oneDNN's time at 5 rows, 0.73-0.92x at 8, 1.09-1.43x at 12.
SMALL_ROWS = 8


def pack_small(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in fulcrum's layout as a second packed copy for few rows: bf16 at the amx level (where
    `pack` makes oneDNN's) whose shape fits the layout, while the copy leaves RESERVE_BYTES free; else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not supported() or cpu_isa.isa() != "amx":
        return None
    if os.environ.get("FULCRUM_CPU_SMALL", "1") == "0" or not fits_layout(weight):
        return None
    if _mem_available() - weight.numel() * weight.element_size() < RESERVE_BYTES:
        return _stop("a third copy would leave under %d GiB free", RESERVE_BYTES >> 30)
    return block(weight)


def small_rows(x: torch.Tensor) -> bool:
    """Whether x [..., in] holds the rows a `pack_small` copy takes."""
    return BLOCKED_MIN_ROWS * x.shape[-1] <= x.numel() <= SMALL_ROWS * x.shape[-1]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T + bias through the packed weight, in x's dtype (computed in the packed weight's)."""
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(packed.dtype).contiguous()
    bias = None if bias is None else bias.to(packed.dtype).contiguous()
    if is_blocked(packed):
        y = torch.empty(x2.shape[0], packed.shape[0] * packed.shape[2], dtype=packed.dtype)
        _blocked()(packed.dtype == torch.bfloat16, x2.data_ptr(), packed.data_ptr(),
                   None if bias is None else bias.data_ptr(), y.data_ptr(), *x2.shape, y.shape[1])  # fmt: skip
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.to(dtype).reshape(*lead, y.shape[-1])


@functools.cache
def _onednn_linear():
    if not supported():
        return None
    lib = cpu_ext.load("packed_linear.cpp", cpu_gemv.level(), BINDINGS["packed_linear.cpp"])
    return None if lib is None else lib.fulcrum_packed_linear


def c_linear(packed: torch.Tensor | None = None):
    """The C entry point the decode stack calls for weights packed like `packed`: `fulcrum_blocked_linear` for
    fulcrum's layout, `fulcrum_packed_linear` (csrc/packed_linear.cpp) for oneDNN's; None where it cannot be built.
    Without `packed`: builds both (kernels.warm_up)."""
    if packed is None:
        return _blocked(), _onednn_linear()
    return _blocked() if is_blocked(packed) else _onednn_linear()


def handle(packed: torch.Tensor) -> int:
    """The packed weight as its C entry point takes it: fulcrum's layout its data's address, oneDNN's its
    TensorImpl's (packed_linear.cpp; the caller keeps the tensor alive)."""
    return packed.data_ptr() if is_blocked(packed) else packed._cdata
