"""RMSNorm as one Triton kernel per row, optionally fused with the residual add that precedes it. The arithmetic is
`fulcrum.layers.layernorm`'s: Llama's RMSNorm normalises in fp32, rounds to x's dtype, then scales by the weight;
Gemma's (`gemma=True`, the weight holding 1 + w) scales in fp32 and rounds once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.kernels.triton.rounding import _cast

_MAX_BLOCK = 8192  # wider rows are read in chunks, twice


@triton.jit
def _load_sum(x_row, res_row, o, m, x_ty: tl.constexpr, RESIDUAL: tl.constexpr):
    """x's values at `o` in fp32; with a residual, x + residual rounded to x's dtype, as PyTorch's add rounds it."""
    xv = tl.load(x_row + o, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:
        xv = _cast(xv + tl.load(res_row + o, mask=m, other=0.0).to(tl.float32), x_ty).to(tl.float32)
    return xv


@triton.jit
def _normalize(x, w, r, out_ty: tl.constexpr, x_ty: tl.constexpr, GEMMA: tl.constexpr):
    if GEMMA:
        y = x * r * w
    else:
        # rounded to x's dtype before the weight, as the reference does; the product is rounded once more on store
        y = _cast(x * r, x_ty).to(tl.float32) * w
    return _cast(y, out_ty)


@triton.jit
def _rms_norm_kernel(
    x, w, res, out, N, eps, x_st, res_st, out_st,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr, RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * x_st
    res_row = res + row * res_st
    out_row = out + row * out_st
    # with a residual the norm reads the sum, in the residual's dtype (x's, in the models)
    x_ty = res.dtype.element_ty if RESIDUAL else x.dtype.element_ty
    out_ty = out.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if CHUNKS == 1:
        m = offs < N
        xv = _load_sum(x_row, res_row, offs, m, x_ty, RESIDUAL)  # the norm reads the rounded sum
        if RESIDUAL:
            tl.store(res_row + offs, xv, mask=m)  # exact in the residual's dtype
        # sqrt_rn and div_rn: NVIDIA's rsqrt is approximate, the references' (on CPU) correctly rounded
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(xv * xv, 0), N * 1.0) + eps))
        wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_row + offs, _normalize(xv, wv, r, out_ty, x_ty, GEMMA), mask=m)
    else:
        # the first pass only sums: storing the residual there and reading it back in the second would need a
        # barrier, so both passes recompute x + residual from the inputs, and the second stores it
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            o = c * BLOCK + offs
            m = o < N
            xv = _load_sum(x_row, res_row, o, m, x_ty, RESIDUAL)
            acc += xv * xv
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(acc, 0), N * 1.0) + eps))
        for c in range(CHUNKS):
            o = c * BLOCK + offs
            m = o < N
            xv = _load_sum(x_row, res_row, o, m, x_ty, RESIDUAL)
            if RESIDUAL:
                tl.store(res_row + o, xv, mask=m)
            wv = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
            tl.store(out_row + o, _normalize(xv, wv, r, out_ty, x_ty, GEMMA), mask=m)


def rms_norm(x, weight, eps, residual=None, out=None, gemma: bool = False):
    """RMSNorm of x [T, hidden] (rows may be strided) with weight [hidden] (x's dtype or fp32), into `out` (a new
    tensor of x's dtype when None). With `residual` [T, hidden]: residual += x in place (rounded to x's dtype), and
    (norm of the sum, residual) is returned. `gemma`: the weight holds 1 + w and scales in fp32 (GemmaRMSNorm)."""
    T, N = x.shape
    if weight.shape != (N,) or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} needs a contiguous last dim and weight [{N}], got {tuple(weight.shape)}")
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype if residual is None else residual.dtype, device=x.device)
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{T}, {N}] with a contiguous last dim, got {tuple(residual.shape)}")
    if T > 0:
        block = min(triton.next_power_of_2(N), _MAX_BLOCK)
        res = residual if residual is not None else x  # never read without a residual
        _rms_norm_kernel[(T,)](
            x, weight, res, out, N, eps, x.stride(0), res.stride(0), out.stride(0),
            BLOCK=block, CHUNKS=triton.cdiv(N, block), RESIDUAL=residual is not None, GEMMA=gemma,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    return out if residual is None else (out, residual)
