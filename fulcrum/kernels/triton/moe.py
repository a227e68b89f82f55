"""The MoE experts as two grouped GEMMs, as vLLM's fused_moe: the (token, choice) slots sorted by expert on the
device, each expert's run padded to whole M blocks, and one Triton kernel computing every block's rows against its own
expert's weights (rows gathered by slot, routing weights applied in the epilogue). No host sync: the buffers are sized
by a static bound and blocks past the padded total exit at once, so CUDA graphs can capture it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fulcrum.kernels.triton import interpreted
from fulcrum.kernels.triton.rounding import _cast


@triton.jit
def _grouped_gemm_kernel(
    a, w, c, topk_w, sorted_ids, expert_of_block, num_padded,
    N, K, num_slots, a_div, num_m_blocks,
    a_st, w_se, w_sn, w_sk, c_st,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, LOWP_DOT: tl.constexpr,
):  # fmt: skip
    # consecutive programs walk GROUP_M M blocks (mostly one expert's) under one N block, so its weight tile is reused
    # from L2 instead of being read once per M block
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    # the grid covers the static bound; blocks past the data's padded total have nothing to do
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    e = tl.load(expert_of_block + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids + offs_m).to(tl.int64)
    valid = slots < num_slots  # padding holds num_slots
    rows = tl.where(valid, slots // a_div, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    dot_ty = a.dtype.element_ty if LOWP_DOT else tl.float32

    a_ptrs = a + rows[:, None] * a_st + offs_k[None, :]
    w_ptrs = w + e * w_se + offs_n[None, :] * w_sn + offs_k[:, None] * w_sk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        at = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if LOWP_DOT:
            acc += tl.dot(at.to(dot_ty), wt.to(dot_ty))
        else:
            # the interpreter's bf16 arithmetic (and dot) is wrong, and fp32 stays exact without TF32
            acc += tl.dot(at.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_sk

    out_ty = c.dtype.element_ty
    if MUL_WEIGHT:
        # rounded to the output dtype before the float32 weight, as the PyTorch path's `h * weight`
        rw = tl.load(topk_w + slots, mask=valid, other=0.0).to(tl.float32)
        acc = _cast(acc, out_ty).to(tl.float32) * rw[:, None]
    c_ptrs = c + slots[:, None] * c_st + offs_n[None, :]
    tl.store(c_ptrs, _cast(acc, out_ty), mask=valid[:, None] & n_mask[None, :])


def pick_block_m(num_tokens: int, num_experts: int) -> int:
    """vLLM's default: small M blocks when the tokens are few per expert (decode), where padding would dominate."""
    return 16 if num_tokens <= num_experts else 64


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_slot_ids int32 [num_m_blocks * block_m], expert_of_block int32 [num_m_blocks],
    num_padded int32 [1]), num_m_blocks = cdiv(T * k + E * (block_m - 1), block_m). The slots (t * k + choice) are
    sorted by expert (stably), each expert's run padded to a multiple of block_m with T * k; expert_of_block is -1
    past num_padded, the rows in use. Torch ops only, with no host sync."""
    device = topk_ids.device
    flat = topk_ids.flatten().long()
    n = flat.numel()
    num_m_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    # not bincount: on CUDA it reads the max id back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_e = flat.index_select(0, order)
    # a slot's row: its expert's padded start plus its rank among that expert's slots
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts).index_select(0, sorted_e)
    dest = (padded_end - padded).index_select(0, sorted_e) + rank
    sorted_ids = torch.full((num_m_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_m_blocks, device=device) * block_m
    expert_of_block = torch.searchsorted(padded_end, block_start, right=True)  # empty experts' runs are skipped
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1).to(torch.int32)
    return sorted_ids, expert_of_block, padded_end[-1:].to(torch.int32)


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, sorted_slot_ids: torch.Tensor, expert_of_block: torch.Tensor,
    num_padded: torch.Tensor, top_k: int, *, block_m: int, a_per_slot: bool = False,
    topk_weights: torch.Tensor | None = None, out: torch.Tensor | None = None, block_n: int = 64, block_k: int = 64,
) -> torch.Tensor:  # fmt: skip
    """out[s] = a[row(s)] @ w[expert(s)].T for every slot s, [num_slots, N] in a's dtype: w is [E, N, K], a is
    [T, K] (row(s) = s // top_k, the slot's token) or with `a_per_slot` [T * k, K] (row(s) = s). With topk_weights
    (float32, [T, k]) each row is rounded, then scaled by its slot's weight and rounded again. The other arguments are
    align_block_size's, made with the same block_m."""
    num_slots = a.shape[0] * (1 if a_per_slot else top_k)
    E, N, K = w.shape
    if a.shape[1] != K or a.stride(1) != 1:
        raise ValueError(f"a {tuple(a.shape)} needs a contiguous last dim of {K}, to meet w {tuple(w.shape)}")
    if w.stride(2) != 1:
        w = w.contiguous()
    if out is None:
        out = torch.empty((num_slots, N), dtype=a.dtype, device=a.device)
    num_m_blocks = expert_of_block.shape[0]
    if num_slots == 0:
        return out
    rw = topk_weights.reshape(-1) if topk_weights is not None else out  # never read without weights
    low_precision = a.dtype in (torch.bfloat16, torch.float16) and not interpreted()
    grid = (num_m_blocks * triton.cdiv(N, block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, rw, sorted_slot_ids, expert_of_block, num_padded,
        N, K, num_slots, 1 if a_per_slot else top_k, num_m_blocks,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        MUL_WEIGHT=topk_weights is not None, LOWP_DOT=low_precision,
    )  # fmt: skip
    return out


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, -1)
    return F.silu(gate) * up


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act=None,
) -> torch.Tensor:  # fmt: skip
    """x [T, H], w13 [E, 2I, H] ([gate, up] stacked), w2 [E, H, I], routing weights float32 / ids [T, k] -> the sum
    over each token's k experts of weight * down(act(gate_up(x))), [T, H] in x's dtype: summed in float32 and rounded
    once, as FusedExperts.forward. `act` maps [.., 2I] to [.., I] (silu(gate) * up when None)."""
    tokens, k = topk_ids.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = pick_block_m(tokens, w13.shape[0])
    aligned = align_block_size(topk_ids, w13.shape[0], block_m)
    h = grouped_gemm(x, w13, *aligned, k, block_m=block_m)
    h = (act or _silu_and_mul)(h)
    h = h if h.stride(1) == 1 else h.contiguous()
    ys = grouped_gemm(h, w2, *aligned, k, block_m=block_m, a_per_slot=True, topk_weights=topk_weights.float())
    return ys.view(tokens, k, x.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)
