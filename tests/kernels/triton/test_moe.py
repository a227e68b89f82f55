"""The Triton MoE: the alignment's invariants, the grouped GEMM against a per-slot PyTorch product, and
FusedExperts' Triton path against its own PyTorch path. Interpreted on CPU, native on CUDA."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.triton import moe as tm
from fulcrum.layers.moe import FusedExperts


def _ids(tokens, k, num_experts, g, used=None):
    """Each token's k distinct experts among the first `used` (so that the others get no token)."""
    used = used or num_experts
    return torch.rand(tokens, used, generator=g).argsort(-1)[:, :k]


def _close(actual, expected):
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # the products summed in another order: a bf16 ulp or two
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "tokens, k, num_experts, block_m", [(1, 1, 4, 16), (5, 2, 8, 16), (33, 2, 8, 4), (0, 2, 4, 16)]
)
def test_alignment_sorts_every_slot_once_into_single_expert_blocks(tokens, k, num_experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = _ids(tokens, k, num_experts, g, used=num_experts - 1)
    sorted_ids, expert_of_block, num_padded = tm.align_block_size(ids, num_experts, block_m)
    n = tokens * k
    blocks = -(-(n + num_experts * (block_m - 1)) // block_m)  # the static bound, rounded up to whole blocks
    assert sorted_ids.shape == (blocks * block_m,) and expert_of_block.shape == (blocks,)
    assert num_padded.shape == (1,) and num_padded.dtype == torch.int32
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    total = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == total
    used, rest = sorted_ids[:total], sorted_ids[total:]
    assert (rest == n).all()  # nothing but padding past the total
    valid = used[used < n]
    assert sorted(valid.tolist()) == list(range(n))  # every slot exactly once
    assert (used <= n).all()
    assert (expert_of_block[total // block_m :] == -1).all()
    flat = ids.flatten()
    for b in range(total // block_m):
        block = used[b * block_m : (b + 1) * block_m]
        slots = block[block < n].long()
        assert len(slots), "a block in use holds at least one slot"
        assert (flat[slots] == expert_of_block[b]).all()  # one expert per block
        assert (block[: len(slots)] < n).all()  # padding only at a run's end
        assert slots.tolist() == sorted(slots.tolist())  # stable: slots keep their order within an expert
    assert expert_of_block[: total // block_m].tolist() == sorted(expert_of_block[: total // block_m].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_per_slot, weighted", [(False, False), (True, True)])
@pytest.mark.parametrize("tokens, k, num_experts, N, K", [(5, 2, 4, 40, 24), (33, 2, 8, 96, 72)])
def test_grouped_gemm_equals_a_per_slot_product(tokens, k, num_experts, N, K, a_per_slot, weighted, dtype):
    g = torch.Generator().manual_seed(N + K)
    ids = _ids(tokens, k, num_experts, g, used=num_experts - 1)
    a = torch.randn(tokens * k if a_per_slot else tokens, K, generator=g).to(dtype)
    w = (0.2 * torch.randn(num_experts, N, K, generator=g)).to(dtype)
    rw = torch.rand(tokens, k, generator=g) if weighted else None
    block_m = 16
    aligned = tm.align_block_size(ids, num_experts, block_m)
    got = tm.grouped_gemm(a, w, *aligned, k, block_m=block_m, a_per_slot=a_per_slot, topk_weights=rw)
    flat = ids.flatten()
    want = torch.empty(tokens * k, N, dtype=dtype)
    for s in range(tokens * k):
        row = a[s if a_per_slot else s // k].float()
        y = (w[flat[s]].float() @ row).to(dtype)
        want[s] = y * rw.flatten()[s] if weighted else y
    _close(got, want)


def _experts(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(num_experts, hidden, inter, dtype)
    for e in range(num_experts):
        for part, stack, shape in ((0, ex.gate_up_proj, (inter, hidden)), (1, ex.gate_up_proj, (inter, hidden)),
                                   (0, ex.down_proj, (hidden, inter))):  # fmt: skip
            # scaled by 1 / sqrt(fan-in) so that outputs stay near 1 at any size, where bf16's tolerance means something
            w = torch.randn(shape, generator=g) * shape[1] ** -0.5
            stack.weight.weight_loader(stack.weight, w.to(dtype), (e, part))
    return ex


def _compare(monkeypatch, tokens, k, num_experts, hidden, inter, dtype, device="cpu"):
    ex = _experts(num_experts, hidden, inter, dtype).to(device)
    g = torch.Generator().manual_seed(tokens * 10 + k)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    ids = _ids(tokens, k, num_experts, g, used=max(k, num_experts - 2)).to(device)  # two experts idle
    rw = torch.rand(tokens, k, generator=g).to(device)
    monkeypatch.setenv("FULCRUM_ATTENTION_BACKEND", "torch")
    want = ex(x, rw, ids)
    monkeypatch.setenv("FULCRUM_ATTENTION_BACKEND", "triton")
    calls = []
    fused = tm.fused_experts
    monkeypatch.setattr(tm, "fused_experts", lambda *args: calls.append(1) or fused(*args))
    got = ex(x, rw, ids)
    assert calls, "the Triton path was not taken"
    _close(got, want)
    return ex, x, rw, ids, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, k, num_experts, hidden, inter",
    [(1, 1, 4, 24, 40), (5, 2, 8, 64, 96), (33, 2, 8, 24, 40), (33, 1, 4, 64, 96)],
)
def test_fused_experts_triton_path_equals_the_torch_path(monkeypatch, tokens, k, num_experts, hidden, inter, dtype):
    _compare(monkeypatch, tokens, k, num_experts, hidden, inter, dtype)


def test_fused_experts_triton_path_takes_no_tokens(monkeypatch):
    monkeypatch.setenv("FULCRUM_ATTENTION_BACKEND", "triton")
    ex = _experts(4, 24, 40, torch.float32)
    out = ex(torch.zeros(0, 24), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 24)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_cuda_large_and_graph_capturable(monkeypatch):
    ex, x, rw, ids, got = _compare(monkeypatch, 256, 2, 8, 1024, 2048, torch.bfloat16, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the Triton path raises
    try:
        ex(x, rw, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # captured once, replayed on other routing: nothing may depend on the first step's data
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ex(x, rw, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex(x, rw, ids)
    g = torch.Generator().manual_seed(7)
    ids.copy_(_ids(256, 2, 8, g, used=3).cuda())  # most slots on three experts
    rw.copy_(torch.rand(256, 2, generator=g).cuda())
    graph.replay()
    monkeypatch.setenv("FULCRUM_ATTENTION_BACKEND", "torch")
    _close(out, ex(x, rw, ids))
