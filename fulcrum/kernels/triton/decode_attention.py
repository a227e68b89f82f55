"""Paged decode attention in Triton: one query token per row against its KV cache, read through the block table
token by token (no gather). One program serves a group of a KV head's query heads (GQA, MLA) over one split of the
context; with several splits a second kernel merges the partial softmaxes. Handles int8/fp8 caches with per-token
scales, sliding windows and Gemma 2's softcap, and never syncs with the host (CUDA-graph safe)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fulcrum.kernels.triton import interpreted

_MIN_TOKENS_PER_SPLIT = 256  # below this a split's setup and the merge cost more than the parallelism gains
_MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    sm_scale,
    softcap,
    window,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ksn,
    stride_kss,
    stride_ksh,
    stride_vsn,
    stride_vss,
    stride_vsh,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_od,
    num_heads,
    block_size,
    G: tl.constexpr,
    G_BLOCK: tl.constexpr,
    HEAD_GROUPS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK1: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
    HAS_DK2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    LOWP_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // HEAD_GROUPS
    hg = tl.program_id(1) % HEAD_GROUPS
    split = tl.program_id(2)

    g = hg * G_BLOCK + tl.arange(0, G_BLOCK)
    g_mask = g < G
    heads = kvh * G + g
    d1 = tl.arange(0, BLOCK_DK1)
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV
    dot_ty = q_ptr.dtype.element_ty if LOWP_DOT else tl.float32

    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(ctx - window, 0)
    # splits share the row's own (possibly windowed) length, in whole tiles; trailing ones may get nothing
    per_split = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = start + split * per_split
    split_end = tl.minimum(split_start + per_split, ctx)

    # the interpreter computes bf16 arithmetic wrongly, so every load is widened to fp32 before any use
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q1 = tl.load(q_row + d1[None, :] * stride_qd, mask=g_mask[:, None] & (d1[None, :] < DK), other=0.0)
    q1 = q1.to(tl.float32).to(dot_ty)
    if HAS_DK2:
        d2 = BLOCK_DK1 + tl.arange(0, BLOCK_DK2)
        q2 = tl.load(q_row + d2[None, :] * stride_qd, mask=g_mask[:, None] & (d2[None, :] < DK), other=0.0)
        q2 = q2.to(tl.float32).to(dot_ty)

    # scores are kept in log2 units so the softmax can use exp2; the softcap needs them in natural units first
    if USE_SOFTCAP:
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([G_BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_BLOCK], dtype=tl.float32)
    acc = tl.zeros([G_BLOCK, BLOCK_DV], dtype=tl.float32)

    for n0 in range(split_start, split_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < split_end
        page = tl.load(bt_ptr + b * stride_btb + (n // block_size) * stride_btn, mask=n_mask, other=0).to(tl.int64)
        slot = n % block_size

        k_tok = k_ptr + page * stride_kn + slot * stride_ks + kvh * stride_kh
        k1 = tl.load(k_tok[None, :] + d1[:, None] * stride_kd, mask=n_mask[None, :] & (d1[:, None] < DK), other=0.0)
        k1 = k1.to(tl.float32).to(dot_ty)
        if LOWP_DOT:
            qk = tl.dot(q1, k1)
        else:
            qk = tl.dot(q1, k1, input_precision="ieee")
        if HAS_DK2:
            k2 = tl.load(k_tok[None, :] + d2[:, None] * stride_kd, mask=n_mask[None, :] & (d2[:, None] < DK), other=0.0)
            k2 = k2.to(tl.float32).to(dot_ty)
            if LOWP_DOT:
                qk += tl.dot(q2, k2)
            else:
                qk += tl.dot(q2, k2, input_precision="ieee")

        if K_SCALED:
            # one scale per token: applying it to the scores equals dequantizing K first
            ks = tl.load(ks_ptr + page * stride_ksn + slot * stride_kss + kvh * stride_ksh, mask=n_mask, other=0.0)
            qk = qk * (ks.to(tl.float32) * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        if USE_SOFTCAP:
            # tanh through exp (tl has no portable tanh): saturates cleanly to +-1 when exp over/underflows
            t = 1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0)
            qk = softcap * t * 1.4426950408889634
        qk = tl.where(n_mask[None, :], qk, float("-inf"))

        # every tile holds at least one valid token, so m_new is finite and no exp sees inf - inf
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_tok = v_ptr + page * stride_vn + slot * stride_vs + kvh * stride_vh
        v = tl.load(v_tok[:, None] + dv[None, :] * stride_vd, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        v = v.to(tl.float32).to(dot_ty)
        if V_SCALED:
            vs = tl.load(vs_ptr + page * stride_vsn + slot * stride_vss + kvh * stride_vsh, mask=n_mask, other=0.0)
            p = p * vs.to(tl.float32)[None, :]
        if LOWP_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        # an empty row (context 0, CUDA-graph padding) has l = 0 and must come out as zeros, not 0/0
        denom = tl.where(l_i > 0, l_i, 1.0)
        o = acc / denom[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    else:
        row = (b * num_heads + heads) * NUM_SPLITS + split
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)
        tl.store(acc_ptr + row[:, None] * DV + dv[None, :], acc, mask=g_mask[:, None] & dv_mask[None, :])


@triton.jit
def _merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    num_heads,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (b * num_heads + h) * NUM_SPLITS
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < NUM_SPLITS
    m = tl.load(m_ptr + row + s, mask=s_mask, other=float("-inf"))
    m_max = tl.max(m, 0)
    # empty splits carry m = -inf; if every split is empty (context 0) a finite pivot keeps the weights at 0
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(w * tl.load(l_ptr + row + s, mask=s_mask, other=0.0), 0)

    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for i in range(NUM_SPLITS):
        w_i = tl.exp2(tl.load(m_ptr + row + i) - m_max)
        acc += w_i * tl.load(acc_ptr + (row + i) * DV + dv, mask=dv_mask, other=0.0)
    o = acc / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv * stride_od, o.to(out_ptr.dtype.element_ty), mask=dv_mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: splits only add work there


def _split_dk(dk: int) -> tuple[int, int]:
    """Dk as one power-of-two tile, or two (576 = 512 + 64, 80 = 64 + 16) when that wastes less of the dot."""
    full = triton.next_power_of_2(dk)
    if full == dk:
        return full, 0
    lo = full // 2
    rest = max(16, triton.next_power_of_2(dk - lo))
    return (lo, rest) if lo + rest < full else (full, 0)


def default_num_splits(batch: int, kv_programs: int, max_context: int, device: torch.device) -> int:
    """From static shapes only (CUDA-graph safe): enough programs to cover the SMs about twice, no split shorter
    than _MIN_TOKENS_PER_SPLIT tokens of the longest possible context."""
    base = batch * kv_programs
    want = triton.cdiv(2 * _sm_count(device), base)
    cap = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, _MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, Dk] against k_cache [blocks, block_size, KVH, Dk] / v_cache [..., Dv] (any strides) through
    block_tables [B, max_blocks]; row b sees its first context_lens[b] tokens. Returns [B, H, Dv] in q's dtype."""
    batch, num_heads, dk = q.shape
    _, block_size, kv_heads, dk_cache = k_cache.shape
    dv = v_cache.shape[-1]
    assert dk_cache == dk and num_heads % kv_heads == 0, (q.shape, k_cache.shape)
    assert (k_scales is None) == (k_cache.dtype not in (torch.int8, torch.float8_e4m3fn)), "scales iff quantized"
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty(batch, num_heads, dv, dtype=q.dtype, device=q.device)

    block_dk1, block_dk2 = _split_dk(dk)
    block_dv = triton.next_power_of_2(dv)
    g_pad = max(16, triton.next_power_of_2(group))
    # the accumulator is G_BLOCK x BLOCK_DV fp32 in registers: a wide V (MLA's 512) takes fewer heads per program
    g_block = min(g_pad, max(16, 8192 // block_dv))
    head_groups = triton.cdiv(group, g_block)
    block_n = 16 if block_dk1 + block_dk2 > 256 else 32
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads * head_groups, block_tables.shape[1] * block_size, q.device)

    if num_splits > 1:
        m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        lse = torch.empty_like(m)
        acc = torch.empty(batch, num_heads, num_splits, dv, dtype=torch.float32, device=q.device)
    else:
        m = lse = acc = out  # unused: the kernel writes the output directly
    ks = k_scales if k_scales is not None else k_cache
    vs = v_scales if v_scales is not None else v_cache
    ks_strides = k_scales.stride() if k_scales is not None else (0, 0, 0)
    vs_strides = v_scales.stride() if v_scales is not None else (0, 0, 0)
    low_precision = q.dtype in (torch.bfloat16, torch.float16) and not interpreted()

    _decode_kernel[(batch, kv_heads * head_groups, num_splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        context_lens,
        out,
        m,
        lse,
        acc,
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *ks_strides,
        *vs_strides,
        *block_tables.stride(),
        *out.stride(),
        num_heads,
        block_size,
        G=group,
        G_BLOCK=g_block,
        HEAD_GROUPS=head_groups,
        DK=dk,
        DV=dv,
        BLOCK_DK1=block_dk1,
        BLOCK_DK2=max(block_dk2, 16),
        HAS_DK2=block_dk2 > 0,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        K_SCALED=k_scales is not None,
        V_SCALED=v_scales is not None,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(softcap),
        LOWP_DOT=low_precision,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _merge_kernel[(batch, num_heads)](
            m,
            lse,
            acc,
            out,
            *out.stride(),
            num_heads,
            DV=dv,
            BLOCK_DV=block_dv,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
