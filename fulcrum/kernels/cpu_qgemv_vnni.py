"""The quantized GEMV with integer dot products (csrc/qgemv_vnni.cpp), for bf16 inputs on CPUs with AVX-512 VNNI:
the input rows quantized to int8 blocks once per call and `vpdpbusd` against the packed weights, where widening each
weight to fp32 (cpu_qgemv) runs compute-bound. fp32 inputs keep the exact widening GEMV."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR
from fulcrum.utils.cpu_isa import cpu_flags

BINDINGS = {
    "qgemv_vnni.cpp": {
        "fulcrum_qgemv_int8_vnni": (None, *[PTR] * 5, I64, I64, I64),
        "fulcrum_qgemv_int4_vnni": (None, *[PTR] * 6, I64, I64, I64, I64),
        "fulcrum_qgemv_int8g_vnni": (None, *[PTR] * 6, I64, I64, I64, I64),
        "fulcrum_qgemv_int5_vnni": (None, *[PTR] * 7, I64, I64, I64),
    }
}


@functools.cache
def _module():
    if "avx512_vnni" not in cpu_flags():
        return None
    lib = cpu_ext.load("qgemv_vnni.cpp", "avx512_bf16", BINDINGS["qgemv_vnni.cpp"], extra_flags=("-mavx512vnni",))
    if lib is None:
        return None
    return {
        "int8": lib.fulcrum_qgemv_int8_vnni,
        "int4": lib.fulcrum_qgemv_int4_vnni,
        "int8g": lib.fulcrum_qgemv_int8g_vnni,
        "int5": lib.fulcrum_qgemv_int5_vnni,
    }


def available() -> bool:
    return _module() is not None


# Up to these rows the integer dot products beat dequantizing the weight for oneDNN's bf16 matmul (a 9728 x 896
# int8/int4 weight, behind at 64 rows; benchmarks/results/cpu-kernel-figures-from-comments.log): more rows go to the
# dense matmul.
MAX_ROWS = 32
# The grouped formats' own limits, measured against dequantizing for oneDNN's bf16 matmul on 9728 x 896 and
# 896 x 4864 weights (2-core AMD EPYC, AVX-512 BF16; benchmarks/results/gguf/vnni-rows.log): int4 and int5 ahead
# through 16 rows and behind at 32 on both shapes; int8 in groups even at 8 rows on the 4864-wide one, behind at 16.
FORMAT_ROWS = {"int8": MAX_ROWS, "int4": 16, "int5": 16, "int8g": 8}


def usable(x: torch.Tensor, bias: torch.Tensor | None = None, fmt: str = "int8") -> bool:
    """CPU bf16 rows (up to FORMAT_ROWS[fmt] of them) whose length is a multiple of 64, on a CPU with AVX-512
    VNNI."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and 1 <= x.shape[0] <= FORMAT_ROWS[fmt]
        and x.shape[-1] % 64 == 0
        and (bias is None or bias.dtype == x.dtype)
        and available()
    )


def int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int8"](x.data_ptr(), w.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
                      y.data_ptr(), x.shape[0], x.shape[1], w.shape[0])  # fmt: skip
    return y


def int4(x, w, scale, offset, group_size: int, bias=None) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int4"](x.data_ptr(), w.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0],
                      group_size)  # fmt: skip
    return y


def int8g(x, w, scale, offset, group_size: int, bias=None) -> torch.Tensor:
    """The grouped int8 format of cpu_qgemv.int8g (G 16 or 32)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int8g"](x.data_ptr(), w.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0],
                       group_size)  # fmt: skip
    return y


def int5(x, w, high, scale, offset, bias=None) -> torch.Tensor:
    """The int5 format of cpu_qgemv.int5."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int5"](x.data_ptr(), w.data_ptr(), high.data_ptr(), scale.data_ptr(),
                      None if offset is None else offset.data_ptr(), None if bias is None else bias.data_ptr(),
                      y.data_ptr(), x.shape[0], x.shape[1], w.shape[0])  # fmt: skip
    return y
