"""Varlen prefill / chunked-prefill attention over the paged KV cache, for a scheduler's mixed steps (prompt chunks on
top of cached context next to decode rows) in one launch: flash-attention style, online softmax in fp32, keys read
through the block table token by token, a query block's key loop cut at its causal end (and sliding-window start).
Each program takes one sequence, one KV head and a block of queries with all the query heads sharing that KV head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.kernels.triton import interpreted


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    start,
    end,
    hi,
    pos,
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_row,
    kvh,
    offs_dk,
    offs_dv,
    dk_ok,
    dv_ok,
    qk_scale,
    softcap,
    sliding_window,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_LOWP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over keys start..end (tile aligned). MASKED tiles apply the causal/window mask; the others are
    visible to every row of the block, so they skip it (most of a long prompt's tiles)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < hi
        # per-token paging keeps BLOCK_N independent of the cache's block size (which may be 1)
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = (offs_n % BLOCK_SIZE).to(tl.int64)

        k_off = page * stride_kb + slot * stride_kt + kvh * stride_kh
        k = tl.load(
            k_ptr + k_off[None, :] + offs_dk[:, None] * stride_kd, mask=dk_ok[:, None] & n_ok[None, :], other=0.0
        )
        if DOT_LOWP:
            # int8 and e4m3 values are exact in bf16/fp16, so the dot stays exact up to q's own rounding
            k = k.to(q_ptr.dtype.element_ty)
        else:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee")
        if QUANT:
            # scaling the score columns equals dequantizing k (one scale per token and KV head), for BLOCK_N mults
            ks = tl.load(ks_ptr + page * stride_ksb + slot * stride_kst + kvh * stride_ksh, mask=n_ok, other=0.0)
            s = s * ks.to(tl.float32)[None, :]
        s = s * qk_scale
        if USE_SOFTCAP:
            # tanh through exp (no tanh in core tl); the clamp keeps exp finite, tanh(±15) is ±1 in fp32
            t = tl.minimum(tl.maximum(s / softcap, -15.0), 15.0)
            e = tl.exp(2.0 * t)
            s = softcap * (e - 1.0) / (e + 1.0) * 1.4426950408889634

        if MASKED:
            visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row may see nothing in this tile (window start, padded rows): subtract 0 there so no inf - inf NaNs
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new

        v_off = page * stride_vb + slot * stride_vt + kvh * stride_vh
        v = tl.load(
            v_ptr + v_off[:, None] + offs_dv[None, :] * stride_vd, mask=n_ok[:, None] & dv_ok[None, :], other=0.0
        )
        if QUANT:
            vs = tl.load(vs_ptr + page * stride_vsb + slot * stride_vst + kvh * stride_vsh, mask=n_ok, other=0.0)
            p = p * vs.to(tl.float32)[None, :]
        if DOT_LOWP:
            acc += tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty), input_precision="ieee")
        else:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc, l_i, m_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    ks_ptr,
    vs_ptr,
    query_start_ptr,
    query_lens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale,
    softcap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    stride_bt,
    HEAD_DK: tl.constexpr,
    HEAD_DV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_LOWP: tl.constexpr,
):
    # the last query blocks see the most keys: launching them first shortens the tail of the grid
    qb = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)

    q_len = tl.load(query_lens_ptr + seq)
    if qb * BLOCK_Q >= q_len:
        return
    q_start = tl.load(query_start_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    first_pos = ctx - q_len  # absolute position of the sequence's first new token

    # row m of the tile is query token qb*BLOCK_Q + m // GROUP of head kvh*GROUP + m % GROUP: the heads of a group
    # share every K/V tile, and decode rows (one token) still fill GROUP rows of the dot
    offs_m = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = first_pos + tok

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ok = offs_dk < HEAD_DK
    dv_ok = offs_dv < HEAD_DV

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_dk[None, :] * stride_qd, mask=row_ok[:, None] & dk_ok[None, :], other=0.0
    )
    if DOT_LOWP:
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)

    # keys this block needs: up to the causal end of its last valid row, from the window start of its first row
    hi = first_pos + tl.minimum((qb + 1) * BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + qb * BLOCK_Q - sliding_window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    if USE_SOFTCAP:
        qk_scale = scale
    else:
        qk_scale = scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys every row of the block sees: up to the first row's position, from the last row's window start
    mid = ((first_pos + qb * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
    full_lo = lo
    if USE_WINDOW:
        full_lo = tl.maximum(hi - sliding_window, 0)
        full_lo = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, mid)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, lo, full_lo, hi, pos, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_dk, offs_dv,
            dk_ok, dv_ok, qk_scale, softcap, sliding_window, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb,
            stride_vt, stride_vh, stride_vd, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            BLOCK_SIZE, BLOCK_N, QUANT, USE_WINDOW, USE_SOFTCAP, DOT_LOWP, True,
        )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, full_lo, mid, hi, pos, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_dk, offs_dv,
        dk_ok, dv_ok, qk_scale, softcap, sliding_window, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb,
        stride_vt, stride_vh, stride_vd, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
        BLOCK_SIZE, BLOCK_N, QUANT, USE_WINDOW, USE_SOFTCAP, DOT_LOWP, False,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, mid, hi, hi, pos, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_dk, offs_dv, dk_ok,
        dv_ok, qk_scale, softcap, sliding_window, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt,
        stride_vh, stride_vd, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, BLOCK_SIZE,
        BLOCK_N, QUANT, USE_WINDOW, USE_SOFTCAP, DOT_LOWP, True,
    )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_dv[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _launch_config(max_query_len: int, group: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Rows of a tile are (query token, head of the group) pairs: few
    queries per sequence (decode-heavy steps) get the smallest tile tl.dot takes, prompts a wide one so each K/V
    tile is reused by many rows."""
    block_m = 16 if max_query_len * group <= 16 else 64
    if block_d > 128:
        return block_m, 32, 8, 2
    return block_m, 64, 4, 2


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, H, Dk] (sequence s: rows query_start[s] .. + query_lens[s], the last
    query_lens[s] of its context_lens[s] cached positions) over the paged cache [num_blocks, block_size, KVH, D].
    int8/fp8 caches need k_scales/v_scales [num_blocks, block_size, KVH] (value = q * scale). Writes only the
    sequences' rows of out [T, H, Dv]; no host sync (max_query_len sizes the grid)."""
    T, H, Dk = q.shape
    _, block_size, KVH, Dk_cache = k_cache.shape
    Dv = v_cache.shape[-1]
    if Dk_cache != Dk or v_cache.shape[:3] != k_cache.shape[:3] or H % KVH:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    quant = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    if quant and (k_scales is None or v_scales is None):
        raise ValueError(f"a {k_cache.dtype} cache needs k_scales and v_scales")
    if out is None:
        out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
    S = query_lens.shape[0]
    if S == 0 or T == 0 or max_query_len <= 0:
        return out

    group = H // KVH
    block_dk, block_dv = _block_d(Dk), _block_d(Dv)
    block_m, block_n, num_warps, num_stages = _launch_config(max_query_len, group, max(block_dk, block_dv))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group

    ks = k_scales if quant else k_cache  # unread when not quantized: any tensor fills the slot
    vs = v_scales if quant else v_cache
    ks_strides = ks.stride()[:3] if quant else (0, 0, 0)
    vs_strides = vs.stride()[:3] if quant else (0, 0, 0)
    # interpreted, 16-bit dtypes' arithmetic is unreliable: the dots run in fp32 there
    dot_lowp = q.dtype in (torch.bfloat16, torch.float16) and not interpreted()

    grid = (triton.cdiv(max_query_len, block_q), S, KVH)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        ks,
        vs,
        query_start,
        query_lens,
        context_lens,
        block_tables,
        float(scale),
        float(softcap) if softcap else 1.0,
        int(sliding_window) if sliding_window else 0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *ks_strides,
        *vs_strides,
        block_tables.stride(0),
        HEAD_DK=Dk,
        HEAD_DV=Dv,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        QUANT=quant,
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(softcap),
        DOT_LOWP=dot_lowp,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
