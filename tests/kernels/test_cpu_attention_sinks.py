"""gpt-oss's attention sinks in the CPU decode kernel: one more logit per head in its softmax denominator, with no
value. The kernel equals the formula over the gathered tokens (windowed or not), and a large sink changes the output
(so the comparison has something to see); test_cpu_attention checks the layer with and without the kernel."""

import pytest
import torch

from fulcrum.kernels import cpu_attention
from fulcrum.layers.attention import Attention
from tests.kernels.test_cpu_attention import paged, reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs an x86 CPU with AVX2 and a compiler")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 21])
def test_sinks_join_each_heads_softmax(dtype, tol, window):
    q, kc, vc, tables, lens = paged([1, 50, 300], 8, 2, 64, 16, dtype, seed=2)
    sinks = torch.linspace(-2.0, 4.0, 8).to(dtype)
    got = cpu_attention.decode(q, kc, vc, tables, lens, 64**-0.5, window, sinks=sinks)
    want = reference(q, kc, vc, tables, lens, 64**-0.5, window, sinks=sinks)
    assert (got.double() - want).abs().max() < tol
    plain = cpu_attention.decode(q, kc, vc, tables, lens, 64**-0.5, window)
    assert (plain.double() - want).abs().max() > 0.1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n, m, window", [(40, 40, None), (40, 40, 8), (17, 150, 32)])
def test_the_prefill_kernel_takes_sinks_as_the_eager_path_does(monkeypatch, dtype, tol, n, m, window):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(n, 8, 64, generator=g).to(dtype)
    k, v = (torch.randn(m, 2, 64, generator=g).to(dtype) for _ in range(2))
    layer = Attention(8, 2, 64, 0.125, sliding_window=window)
    layer.sinks = torch.linspace(-2.0, 4.0, 8)
    assert cpu_attention.prefill_usable(q, k, v)
    got = layer._attend(q, k, v)
    plain = cpu_attention.prefill(q, k, v, 0.125, window)
    monkeypatch.setattr(cpu_attention, "prefill_usable", lambda *a: False)
    want = layer._attend(q, k, v)  # the eager path: scores, the sink column, softmax, in float32
    assert (got.float() - want.float()).abs().max() < tol
    assert (plain.float() - want.float()).abs().max() > 0.05
