"""The Triton RMSNorm (and its fused residual add) against fulcrum's RMSNorm and GemmaRMSNorm modules.
Interpreted on CPU, native on CUDA."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.triton import rms_norm as rn
from fulcrum.layers.layernorm import GemmaRMSNorm, RMSNorm

EPS = 1e-6


def _module(hidden, dtype, gemma, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 1.0 + 0.2 * torch.randn(hidden, generator=g)
    if gemma:
        m = GemmaRMSNorm(hidden, EPS)
        m.weight.data.copy_(w)  # holds 1 + w, in fp32
    else:
        m = RMSNorm(hidden, EPS, dtype=dtype)
        m.weight.data.copy_(w.to(dtype))
    return m.to(device)


def _close(actual, expected):
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:  # the sum of squares is taken in another order: one ulp
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)


def _check(T, hidden, dtype, residual, gemma, device="cpu", strided=True):
    m = _module(hidden, dtype, gemma, device)
    g = torch.Generator().manual_seed(1)
    base = (2 * torch.randn(T, 2 * hidden, generator=g)).to(dtype).to(device)
    x = base[:, hidden:] if strided else base[:, hidden:].contiguous()  # rows strided as a slice of a wider output
    res = torch.randn(T, hidden, generator=g).to(dtype).to(device) if residual else None
    if res is None:
        want = m(x)
        got = rn.rms_norm(x, m.weight, EPS, gemma=gemma)
    else:
        want_res = x + res
        want = m(want_res)
        got, got_res = rn.rms_norm(x, m.weight, EPS, residual=res, gemma=gemma)
        assert got_res is res
        assert torch.equal(res, want_res)  # one rounding of the sum, as PyTorch's
    _close(got, want)
    assert torch.equal(x, base[:, hidden:])  # x itself is left alone


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [24, 64, 896])
def test_rms_norm(hidden, dtype, residual, gemma):
    _check(T=3, hidden=hidden, dtype=dtype, residual=residual, gemma=gemma)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_in_chunks(monkeypatch, residual, gemma):
    """Rows wider than the block are read in chunks (hidden > 8192 in a model; a block of 64 here)."""
    monkeypatch.setattr(rn, "_MAX_BLOCK", 64)
    _check(T=2, hidden=200, dtype=torch.bfloat16, residual=residual, gemma=gemma)
    _check(T=2, hidden=200, dtype=torch.float32, residual=residual, gemma=gemma, strided=False)


def test_out_and_fp32_weight():
    """`out` is written and returned; an fp32 weight with a bf16 x (Llama order) rounds the product to bf16."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = 1.0 + 0.1 * torch.randn(64)
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    assert rn.rms_norm(x, w, EPS, out=out) is out
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    _close(out, (w * normed).to(torch.bfloat16))


def test_empty():
    x = torch.empty(0, 64)
    assert rn.rms_norm(x, torch.ones(64), EPS).shape == (0, 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("hidden", [896, 4096, 8192, 12288])
def test_rms_norm_cuda(hidden, gemma):
    for dtype in (torch.bfloat16, torch.float32):
        for residual in (False, True):
            _check(T=33, hidden=hidden, dtype=dtype, residual=residual, gemma=gemma, device="cuda")
