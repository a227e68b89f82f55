"""oneDNN's prepacked matmul for linears with many rows (prefill, wide decode batches) on AMX machines.

On a CPU with AMX, F.linear reaches the tile units through oneDNN but reorders the plain [out, in] weight into
oneDNN's blocked layout on every call. Reordering once at load (`torch.ops.mkldnn._reorder_linear_weight`, packed
for 128 rows; packed for 1 row it ran 2-4x slower at 16-64 rows) and calling `_linear_pointwise` measured 1.1-2.5x
F.linear's rate at 8-256 rows over the 0.5B shape's matrices, bf16 and fp32 (2-core Xeon with AMX, 2 threads; the
commit has the figures). Few rows stay on fulcrum's GEMV, which reads the plain weight at the memory's rate: the
packed weight is a second copy, so it is made only while it leaves RESERVE_BYTES of the machine's memory free
(the KV cache is allocated after the weights) and only at the `amx` level; FULCRUM_CPU_PREPACK=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from fulcrum.utils import cpu_isa

log = logging.getLogger(__name__)

PACKED_FOR_ROWS = 128
# From this many rows the packed matmul beat the GEMV kernel (bf16 and fp32; at 4 rows the GEMV won 2 of 3 shapes)
MIN_ROWS = 5
RESERVE_BYTES = 6 << 30
# A decode step's fused stack (kernels/cpu_decode_stack.py: the GEMV, and BLAS's sgemm past it) beat the modules
# through the packed weights up to these rows, and lost past them: bf16 130 against 139-190 ms a step at 8 rows,
# 214 against 142 at 16 (and behind at 10 and 12); fp32 ahead at 8, even at 16, 374-400 against 298-344 at 24 and
# 471-522 against 378-420 at 32 (0.5B shape, 300-token contexts, 2-core AMX Xeon, 2 threads, alternating runs)
STACK_ROWS = {torch.bfloat16: 8, torch.float32: 16}


@functools.cache
def supported() -> bool:
    """AMX here (under FULCRUM_CPU_ISA), oneDNN in this torch, and not turned off."""
    return (
        os.environ.get("FULCRUM_CPU_PREPACK", "1") != "0"
        and cpu_isa.at_least("amx")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_warned = False


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout, or None where it does not apply or would not fit."""
    global _warned
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or not supported():
        return None
    if _mem_available() - weight.nbytes < RESERVE_BYTES:
        if not _warned:
            log.info("oneDNN weight prepacking stops: a second copy would leave under %d GiB free", RESERVE_BYTES >> 30)
            _warned = True
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKED_FOR_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T + bias through the packed weight."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], "")
    return y.reshape(*lead, y.shape[-1])
