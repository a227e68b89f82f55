"""Rotary embedding and the KV-cache write as one Triton kernel: q and k rotated in place (rotate-half, signed sin),
the rotated k and v stored at their flat cache slots, quantized per (token, KV head) with fp16 scales for int8 and
fp8 caches exactly as `fulcrum.quant.kv.quantize` does. The GPU counterpart of `fulcrum.kernels.cpu_rope`; it never
syncs with the host, so CUDA graphs can capture it (their padding rows carry slot -1 and are skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.kernels.triton.rounding import _cast, _round_half_even

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@triton.jit
def _store_head(x1, x2, n1, n2, offs, half, dst, scale_dst, QUANT: tl.constexpr, INT8: tl.constexpr, QMAX):
    """One head's values (two halves of fp32 values, already rounded to the source dtype) into the cache; n1 and n2,
    the halves' lengths, are 0 for a skipped row (limits, not a combined mask: the interpreter mishandles `m & ok`)."""
    m1 = offs < n1
    m2 = offs < n2
    if QUANT:
        amax = tl.maximum(tl.max(tl.where(m1, tl.abs(x1), 0.0), 0), tl.max(tl.where(m2, tl.abs(x2), 0.0), 0))
        # the stored fp16 scale is the divisor, so dequantizing undoes exactly what was rounded
        scale = _cast(tl.math.div_rn(amax, QMAX), tl.float16)
        s = scale.to(tl.float32)
        safe = tl.where(s > 0.0, s, 1.0)
        # div_rn: the plain `/` is an approximate division on NVIDIA, and a value one ulp off may round differently
        y1 = tl.where(s > 0.0, tl.minimum(tl.maximum(tl.math.div_rn(x1, safe), -QMAX), QMAX), 0.0)
        y2 = tl.where(s > 0.0, tl.minimum(tl.maximum(tl.math.div_rn(x2, safe), -QMAX), QMAX), 0.0)
        if INT8:
            y1 = _round_half_even(y1)
            y2 = _round_half_even(y2)
        tl.store(dst + offs, _cast(y1, dst.dtype.element_ty), mask=m1)
        tl.store(dst + half + offs, _cast(y2, dst.dtype.element_ty), mask=m2)
        tl.store(scale_dst, scale, mask=n1 > 0)
    else:
        tl.store(dst + offs, _cast(x1, dst.dtype.element_ty), mask=m1)
        tl.store(dst + half + offs, _cast(x2, dst.dtype.element_ty), mask=m2)


@triton.jit
def _rope_cache_kernel(
    q, k, v, cos, sin, slots, kc, vc, ksc, vsc,
    H, KVH, D, DV,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, cs_st, kc_ss, kc_sh, vc_ss, vc_sh,
    QMAX,
    HALF: tl.constexpr, HALF_V: tl.constexpr, ROTATE: tl.constexpr, WRITE: tl.constexpr,
    QUANT: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    # one program per (token, head): heads 0..H-1 are q's, H..H+KVH-1 are k's (each also writing that head's v)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = D // 2
    offs = tl.arange(0, HALF)
    m = offs < half
    if ROTATE:
        c1 = tl.load(cos + t * cs_st + offs, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t * cs_st + half + offs, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t * cs_st + offs, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t * cs_st + half + offs, mask=m, other=0.0).to(tl.float32)
    if h < H:
        if ROTATE:
            row = q + t * q_st + h * q_sh
            x1 = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(row + half + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(row + offs, _cast(x1 * c1 + x2 * s1, row.dtype.element_ty), mask=m)
            tl.store(row + half + offs, _cast(x2 * c2 + x1 * s2, row.dtype.element_ty), mask=m)
    else:
        kh = h - H
        row = k + t * k_st + kh * k_sh
        x1 = tl.load(row + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + offs, mask=m, other=0.0).to(tl.float32)
        if ROTATE:
            r1 = _cast(x1 * c1 + x2 * s1, row.dtype.element_ty)
            r2 = _cast(x2 * c2 + x1 * s2, row.dtype.element_ty)
            tl.store(row + offs, r1, mask=m)
            tl.store(row + half + offs, r2, mask=m)
            # the cache gets k as rounded to its dtype, as the reference writes the rotated tensor
            x1 = r1.to(tl.float32)
            x2 = r2.to(tl.float32)
        if WRITE:
            slot = tl.load(slots + t)
            ok = slot >= 0  # not a padding row of a captured graph
            n = tl.where(ok, half, 0)
            _store_head(
                x1, x2, n, n, offs, half, kc + slot * kc_ss + kh * kc_sh, ksc + slot * KVH + kh, QUANT, INT8, QMAX
            )
            # v's width may be odd: its second "half" takes the one extra value
            half_v = DV // 2
            offs_v = tl.arange(0, HALF_V)
            nv1 = tl.where(ok, half_v, 0)
            nv2 = tl.where(ok, DV - half_v, 0)
            vrow = v + t * v_st + kh * v_sh
            v1 = tl.load(vrow + offs_v, mask=offs_v < half_v, other=0.0).to(tl.float32)
            v2 = tl.load(vrow + half_v + offs_v, mask=offs_v < DV - half_v, other=0.0).to(tl.float32)
            vdst = vc + slot * vc_ss + kh * vc_sh
            _store_head(v1, v2, nv1, nv2, offs_v, half_v, vdst, vsc + slot * KVH + kh, QUANT, INT8, QMAX)


def _table(x: torch.Tensor, T: int, D: int) -> torch.Tensor:
    x = x.reshape(T, D)
    return x if x.stride(1) == 1 else x.contiguous()


def _check_cache(cache: torch.Tensor, kvh: int, d: int, name: str) -> None:
    ok = (
        cache.dim() == 4
        and tuple(cache.shape[2:]) == (kvh, d)
        and cache.stride(3) == 1
        and cache.stride(0) == cache.shape[1] * cache.stride(1)  # flat slots: block * block_size + offset
    )
    if not ok:
        raise ValueError(f"{name} must be [num_blocks, block_size, {kvh}, {d}] with flat slots, got {cache.shape}")


def rope_and_cache(q, k, v, cos, sin, slot_mapping, k_cache, v_cache, k_scales=None, v_scales=None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place by cos and signed sin ([T, 1, D] or [T, D]; None: no rotation);
    when slot_mapping [T] and the caches [num_blocks, block_size, KVH, D] are given, write the rotated k and
    v [T, KVH, Dv] at the flat slots (slots < 0 skipped). An int8 or fp8 cache is quantized per (token, KV head),
    its fp16 scales written to k_scales/v_scales [num_blocks, block_size, KVH]. q, k and v may be strided views
    (of a fused qkv output) with a contiguous last dimension."""
    T, H, D = q.shape
    KVH = k.shape[1]
    DV = v.shape[2] if v is not None else D
    if D % 2 or k.shape[2] != D:
        raise ValueError(f"rotate-half needs an even head_dim shared by q and k, got q {q.shape}, k {k.shape}")
    if q.stride(2) != 1 or k.stride(2) != 1 or (v is not None and v.stride(2) != 1):
        raise ValueError("q, k and v need a contiguous last dimension")
    if T == 0:
        return
    rotate = cos is not None
    if rotate:
        cos, sin = _table(cos, T, D), _table(sin, T, D)
        if cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = q  # never read
    write = slot_mapping is not None and k_cache is not None
    quant = write and k_cache.dtype in _QMAX
    if write:
        _check_cache(k_cache, KVH, D, "k_cache")
        _check_cache(v_cache, KVH, DV, "v_cache")
        if v_cache.dtype != k_cache.dtype:
            raise ValueError("k_cache and v_cache must share a dtype")
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        slots = slots.contiguous()
    else:
        slots, k_cache, v_cache, v = q, q, q, k  # never read
    if quant:
        for s in (k_scales, v_scales):
            if s is None or s.dtype != torch.float16 or not s.is_contiguous():
                raise ValueError("a quantized KV cache needs contiguous fp16 k_scales and v_scales")
    else:
        k_scales = v_scales = q  # never read
    if not rotate and not write:
        return
    nq = H if rotate else 0  # without a rotation q's programs would have nothing to do
    _rope_cache_kernel[(T, nq + KVH)](
        q, k, v, cos, sin, slots, k_cache, v_cache, k_scales, v_scales,
        nq, KVH, D, DV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        _QMAX.get(k_cache.dtype, 1.0),
        HALF=triton.next_power_of_2(max(D // 2, 1)), HALF_V=triton.next_power_of_2(max(DV - DV // 2, 1)),
        ROTATE=rotate, WRITE=write, QUANT=quant, INT8=quant and k_cache.dtype == torch.int8,
        num_warps=1 if D <= 128 else 2,
    )  # fmt: skip
