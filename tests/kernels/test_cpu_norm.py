"""The CPU RMSNorm kernel gives the reference RMSNorm's values, on a decode step's rows and a prefill's."""

import pytest
import torch

from fulcrum.kernels import cpu_norm
from fulcrum.layers.layernorm import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_norm.available(), reason="needs an x86 CPU with AVX2 and a compiler")


def reference(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "shape", [(1, 896), (7, 896), (3, 14, 64), (2, 33), (2048, 896), (5, 77)]
)  # decode, q/k norm, prefill
def test_matches_reference(dtype, tol, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.1 + 1).to(dtype)
    norm = RMSNorm(shape[-1], eps=1e-6, dtype=dtype)
    norm.weight.data.copy_(w)
    assert cpu_norm.usable(x, w)
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert ((got.float() - reference(x, w, 1e-6).float()).abs() / (1 + x.float().abs())).max() < tol


def test_inputs_it_does_not_take_use_pytorch():
    w = torch.ones(896)
    assert cpu_norm.usable(torch.randn(2048, 896), w)  # a prefill's rows too
    assert not cpu_norm.usable(torch.randn(896, 4).t(), w)  # not contiguous
    assert not cpu_norm.usable(torch.randn(1, 896), w.bfloat16())  # weight of another dtype
