"""The SwiGLU gate kernel gives PyTorch's silu(gate) * up: within fp32 rounding, and in bf16 equal to PyTorch's
but for an occasional value one rounding step away."""

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels import cpu_act
from fulcrum.layers.activation import SiluAndMul

pytestmark = pytest.mark.skipif(not cpu_act.available(), reason="needs an x86 CPU with AVX2 and a compiler")


def reference(x):
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


@pytest.mark.parametrize("shape", [(1, 2 * 4864), (37, 2 * 256), (5, 2 * 13), (2, 3, 2 * 40), (300, 2 * 77)])
def test_float32_matches_pytorch(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 6
    x.view(-1)[:3] = torch.tensor([-100.0, 100.0, 0.0])  # far tails and zero
    got = cpu_act.silu_and_mul(x)
    assert got.shape == reference(x).shape
    assert torch.allclose(got, reference(x), rtol=2e-6, atol=1e-6)


def test_bfloat16_matches_pytorch_but_for_rare_rounding_steps():
    x = (torch.randn(64, 2 * 896, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    got, want = cpu_act.silu_and_mul(x), reference(x)
    differ = got != want
    assert differ.float().mean() < 0.002
    assert torch.allclose(got[differ].float(), want[differ].float(), rtol=1e-2)


def test_layer_takes_the_kernel_for_a_strided_view_and_agrees_without_it(monkeypatch):
    wide = torch.randn(300, 2 * 64 + 10)
    x = wide[:, : 2 * 64]  # rows strided as a slice of a wider output
    assert cpu_act.usable(x)
    fast = SiluAndMul()(x)
    monkeypatch.setattr(cpu_act, "usable", lambda *a: False)
    assert torch.allclose(fast, SiluAndMul()(x), rtol=2e-6, atol=1e-6)
    monkeypatch.undo()
    assert not cpu_act.usable(torch.randn(1, 2 * 4864))  # a decode row: PyTorch's ops are faster
