"""gpt-oss's attention sinks in the CPU decode kernel: one more logit per head in its softmax denominator, with no
value. The kernel equals the formula over the gathered tokens (windowed or not), and a large sink changes the output
(so the comparison has something to see); test_cpu_attention checks the layer with and without the kernel."""

import pytest
import torch

from fulcrum.kernels import cpu_attention
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
