"""Rounding the kernels' narrowing stores share: fp32 to bf16 / fp8 to nearest even, and torch.round's halves. Triton's
interpreter truncates fp32 -> bf16 and misrounds fp8 (no ties to even, no carry into the exponent), so values are
rounded here first and the cast meets only exact ones, natively too (a few integer ops in kernels bound by memory)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    # torch.round's rounding; floor(y + 0.5) would be wrong just below 0.5, where y + 0.5 itself rounds up to 1
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _cast(x, ty: tl.constexpr):
    """fp32 x to `ty`, rounded to nearest even. The interpreter truncates fp32 -> bf16 and misrounds fp8 (no ties
    to even, no carry into the exponent): rounding here first leaves the cast only exact values, on the GPU too,
    where it costs a few integer ops in kernels bound by memory."""
    if ty == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif ty == tl.float8e4nv:  # |x| <= 448 here: no overflow to handle
        e = tl.maximum(((tl.abs(x).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # below 2^-6: subnormal
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        inv = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
        r = _round_half_even(tl.abs(x) * inv) * step
        x = tl.where(x < 0, -r, r)  # a negative value rounding to zero keeps its sign, as torch's cast does
    return x.to(ty)
