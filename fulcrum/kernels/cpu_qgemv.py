"""y = x @ dequant(W)^T + b for few rows of x over fulcrum's int8, fp8 and int4 weights (csrc/qgemv.cpp, formats
there): the packed bytes are widened in registers, never dequantized into memory; also the whole weight dequantized
for many rows (prefill). Formats made by `fulcrum.quant` at load; callers fall back to PyTorch ops where it is missing."""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.kernels.cpu_ext import I64, PTR

# Up to these rows the kernel beat dequantizing the weight and a dense matmul (a 9728 x 896 int4/int8 weight,
# 2-core AVX-512 BF16 VM): fp32 through 64 rows; bf16 through 8 where the CPU has native bf16 matmuls (oneDNN's
# bf16 GEMM then wins), else through 64 (without them torch's bf16 matmul is slower than widening in registers).
MAX_ROWS = {torch.float32: 64, torch.bfloat16: 8}
MAX_ROWS_NO_NATIVE_BF16 = {torch.float32: 64, torch.bfloat16: 64}

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def level() -> str:
    return cpu_ext.vector_level()


BINDINGS = {
    "qgemv.cpp": {
        "fulcrum_qgemv_int8": (None, I64, I64, *[PTR] * 5, I64, I64, I64),
        "fulcrum_qgemv_int4": (None, I64, *[PTR] * 6, I64, I64, I64, I64),
        "fulcrum_qgemv_int8g": (None, I64, *[PTR] * 6, I64, I64, I64, I64),
        "fulcrum_dequant_int8g": (None, I64, PTR, PTR, PTR, PTR, I64, I64, I64),
        "fulcrum_qgemv_fp8g": (None, I64, *[PTR] * 5, I64, I64, I64, I64),
        "fulcrum_dequant_fp8g": (None, I64, PTR, PTR, PTR, I64, I64, I64),
        "fulcrum_qgemv_int5": (None, I64, *[PTR] * 7, I64, I64, I64),
        "fulcrum_dequant_int5": (None, I64, *[PTR] * 5, I64, I64),
        "fulcrum_dequant_int8": (None, I64, I64, PTR, PTR, PTR, I64, I64),
        "fulcrum_dequant_int4": (None, I64, PTR, PTR, PTR, PTR, I64, I64, I64),
    }
}


@functools.cache
def _module():
    lib = cpu_ext.load("qgemv.cpp", level(), BINDINGS["qgemv.cpp"])
    if lib is None:
        return None
    return {"int8": lib.fulcrum_qgemv_int8, "int4": lib.fulcrum_qgemv_int4, "int8g": lib.fulcrum_qgemv_int8g,
            "dequant_int8": lib.fulcrum_dequant_int8, "dequant_int4": lib.fulcrum_dequant_int4,
            "dequant_int8g": lib.fulcrum_dequant_int8g, "int5": lib.fulcrum_qgemv_int5,
            "dequant_int5": lib.fulcrum_dequant_int5, "fp8g": lib.fulcrum_qgemv_fp8g,
            "dequant_fp8g": lib.fulcrum_dequant_fp8g}  # fmt: skip


def available() -> bool:
    return _module() is not None


@functools.cache
def max_rows(dtype: torch.dtype) -> int:
    return (MAX_ROWS if cpu_ext.at_least("avx512_bf16") else MAX_ROWS_NO_NATIVE_BF16).get(dtype, 0)


def usable(x: torch.Tensor, bias: torch.Tensor | None = None, most_rows: int | None = None) -> bool:
    """CPU, fp32/bf16 input of few rows (`most_rows`, by default max_rows of its dtype), a bias (if any) of the
    input's dtype."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in _DTYPES
        and 1 <= x.shape[0] <= (max_rows(x.dtype) if most_rows is None else most_rows)
        and (bias is None or bias.dtype == x.dtype)
        and available()
    )


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ (w [O, I] * scale [O, 1])^T + bias, in x's dtype; w int8, or float8_e4m3fn."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int8"](x.dtype == torch.bfloat16, w.dtype == torch.float8_e4m3fn, x.data_ptr(), w.data_ptr(),
                      scale.data_ptr(), _ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0])  # fmt: skip
    return y


def int4(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, I] @ W^T + bias with W in the int4 format above (w [O, I/2] uint8, scale/offset [O, I/G] fp32)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int4"](x.dtype == torch.bfloat16, x.data_ptr(), w.data_ptr(), scale.data_ptr(), _ptr(offset),
                      _ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0], group_size)  # fmt: skip
    return y


def int8g(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, I] @ W^T + bias with W int8 in groups (w [O, I] int8, scale and offset or None [O, I/G] fp32, G 16
    or 32): W = w * scale + offset per group."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int8g"](x.dtype == torch.bfloat16, x.data_ptr(), w.data_ptr(), scale.data_ptr(), _ptr(offset),
                       _ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0], group_size)  # fmt: skip
    return y


def int5(
    x: torch.Tensor,
    w: torch.Tensor,
    high: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, I] @ W^T + bias with W in the int5 format (formats.pack_int5: w [O, I/2], high [O, I/8] uint8; scale and
    offset or None [O, I/32] fp32; I a multiple of 64)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["int5"](x.dtype == torch.bfloat16, x.data_ptr(), w.data_ptr(), high.data_ptr(), scale.data_ptr(),
                      _ptr(offset), _ptr(bias), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0])  # fmt: skip
    return y


# One buffer per dtype, grown to the largest weight and reused by every layer's dequantized copy: a fresh tensor of
# tens of MB per call costs its page faults each time (10 ms for a 9728 x 896 weight here, against 2-3 ms reused).
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    n = shape[0] * shape[1]
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[dtype] = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


def dequantize_int8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The int8 (or float8_e4m3fn) weight as [O, I] in `dtype` (fp32 or bf16), in a buffer the next call reuses:
    use it at once."""
    out = _scratch(tuple(w.shape), dtype)
    _module()["dequant_int8"](dtype == torch.bfloat16, w.dtype == torch.float8_e4m3fn, w.data_ptr(), scale.data_ptr(),
                              out.data_ptr(), w.shape[0], w.shape[1])  # fmt: skip
    return out


def dequantize_int4(
    w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The int4 weight as [O, I] in `dtype`, in a reused buffer like dequantize_int8's."""
    out = _scratch((w.shape[0], w.shape[1] * 2), dtype)
    _module()["dequant_int4"](dtype == torch.bfloat16, w.data_ptr(), scale.data_ptr(), _ptr(offset),
                              out.data_ptr(), w.shape[0], w.shape[1] * 2, group_size)  # fmt: skip
    return out


def dequantize_int8g(
    w: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The grouped int8 weight as [O, I] in `dtype`, in a reused buffer like dequantize_int8's."""
    out = _scratch(tuple(w.shape), dtype)
    _module()["dequant_int8g"](dtype == torch.bfloat16, w.data_ptr(), scale.data_ptr(), _ptr(offset), out.data_ptr(),
                               w.shape[0], w.shape[1], group_size)  # fmt: skip
    return out


FP8G_MULTIPLE = 16  # an fp8 group spans whole vectors at every level (AVX-512: 16 floats)


def fp8g(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_size: int, bias: torch.Tensor | None = None):
    """x [M, I] @ W^T + bias, W fp8 e4m3 [O, I] with a scale per row and group of `group_size` inputs (scale [O,
    I / G] fp32; G a multiple of FP8G_MULTIPLE): block-wise fp8 checkpoints' weights, read as stored."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    _module()["fp8g"](x.dtype == torch.bfloat16, x.data_ptr(), w.data_ptr(), scale.data_ptr(), _ptr(bias),
                      y.data_ptr(), x.shape[0], x.shape[1], w.shape[0], group_size)  # fmt: skip
    return y


def dequantize_fp8g(w: torch.Tensor, scale: torch.Tensor, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """fp8g's weight as [O, I] in `dtype`, in a reused buffer like dequantize_int8's."""
    out = _scratch(tuple(w.shape), dtype)
    _module()["dequant_fp8g"](dtype == torch.bfloat16, w.data_ptr(), scale.data_ptr(), out.data_ptr(), w.shape[0],
                              w.shape[1], group_size)  # fmt: skip
    return out


def dequantize_int5(
    w: torch.Tensor, high: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, dtype=torch.float32
) -> torch.Tensor:
    """The int5 weight as [O, I] in `dtype`, in a reused buffer like dequantize_int8's."""
    out = _scratch((w.shape[0], w.shape[1] * 2), dtype)
    _module()["dequant_int5"](dtype == torch.bfloat16, w.data_ptr(), high.data_ptr(), scale.data_ptr(), _ptr(offset),
                              out.data_ptr(), w.shape[0], w.shape[1] * 2)  # fmt: skip
    return out
