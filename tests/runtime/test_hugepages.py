"""Weights and the KV cache on huge pages keep their values, their ties and their alignment."""

import pytest
import torch
from torch import nn

from fulcrum.runtime.hugepages import HUGE_PAGE, huge_page_empty, move_parameters_to_huge_pages


def test_huge_page_tensor_is_zeroed_aligned_and_outlives_its_mapping_handle():
    t = huge_page_empty((3, 1000, 7), torch.bfloat16)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.abs().sum() == 0
    t.fill_(2)
    assert t.float().sum() == 2 * 3 * 1000 * 7


def test_moved_parameters_keep_values_and_ties():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8)
    model = nn.ModuleDict({"emb": emb, "proj": nn.Linear(8, 3), "head": nn.Linear(8, 50, bias=False)})
    model["head"].weight = emb.weight  # tied, as tie_word_embeddings does
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = move_parameters_to_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.data_ptr() % 64 == 0
    assert model["head"].weight is model["emb"].weight
    model["emb"].weight.data[0, 0] = 123.0
    assert model["head"].weight[0, 0] == 123.0
    x = torch.randn(2, 8)
    assert torch.allclose(model["proj"](x), x @ before["proj.weight"].T + before["proj.bias"])


def test_buffers_move_too():
    """A quantized layer's packed weights are buffers: they go to the same region as the parameters."""
    model = nn.Linear(64, 32)
    model.register_buffer("qweight", torch.randint(-127, 127, (32, 64), dtype=torch.int8))
    model.register_buffer("scales", torch.rand(32))
    before = {n: b.clone() for n, b in model.named_buffers()}
    moved = move_parameters_to_huge_pages(model)
    assert moved >= 32 * 64 + 32 * 4 + (32 * 64 + 32) * 4
    ptrs = [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]
    assert max(ptrs) - min(ptrs) < HUGE_PAGE  # one region, side by side
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]) and b.data_ptr() % 64 == 0


def test_a_linears_packed_copy_moves_too_and_still_computes_the_same():
    """The copies in fulcrum's blocked layout (a linear's `packed_weight`, a plain attribute) are what decode steps of
    several rows stream: they go to the region beside the parameters, and the blocked kernel reads the same values."""
    from fulcrum.kernels import cpu_prepack

    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    if not cpu_prepack.fits_layout(model.weight):
        pytest.skip("fulcrum's blocked kernel is not built at this ISA level")
    model.packed_weight = cpu_prepack.block(model.weight)
    x = torch.randn(4, 64)
    want = cpu_prepack.linear(x, model.packed_weight)
    packed_before = model.packed_weight.clone()
    moved = move_parameters_to_huge_pages(model)
    assert moved >= 2 * 64 * 64 * 4
    ptrs = [model.weight.data_ptr(), model.packed_weight.data_ptr()]
    assert max(ptrs) - min(ptrs) < HUGE_PAGE  # one region, side by side
    assert torch.equal(model.packed_weight, packed_before) and model.packed_weight.is_contiguous()
    assert torch.equal(cpu_prepack.linear(x, model.packed_weight), want)
