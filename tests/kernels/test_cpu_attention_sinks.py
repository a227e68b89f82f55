"""gpt-oss's attention sinks in the CPU decode kernel: one more logit per head in its softmax denominator, with no
value. The kernel equals the formula over the gathered tokens (windowed or not), a large sink changes the output
(so the comparison has something to see), and the attention layer agrees with and without the kernel."""

import pytest
import torch

from fulcrum.kernels import cpu_attention
from fulcrum.layers.attention import Attention, AttentionMetadata
from tests.kernels.test_cpu_attention import paged

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs an x86 CPU with AVX2 and a compiler")


def reference(q, kc, vc, tables, ctxs, scale, window, sinks):
    heads, kv_heads, block = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j, c in enumerate(ctxs.tolist()):
        blocks = tables[j, : -(-c // block)]
        ks = kc[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, 1)
        vs = vc[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, 1)
        start = max(0, c - window) if window else 0
        scores = torch.einsum("hd,thd->ht", q[j].double(), ks[start:]) * scale
        probs = torch.cat([scores, sinks.double()[:, None]], -1).softmax(-1)[:, :-1]
        out[j] = torch.einsum("ht,thd->hd", probs, vs[start:])
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 21])
def test_sinks_join_each_heads_softmax(dtype, tol, window):
    q, kc, vc, tables, lens = paged([1, 50, 300], 8, 2, 64, 16, dtype, seed=2)
    sinks = torch.linspace(-2.0, 4.0, 8).to(dtype)
    got = cpu_attention.decode(q, kc, vc, tables, lens, 64**-0.5, window, sinks=sinks)
    want = reference(q, kc, vc, tables, lens, 64**-0.5, window, sinks)
    assert (got.double() - want).abs().max() < tol
    plain = cpu_attention.decode(q, kc, vc, tables, lens, 64**-0.5, window)
    assert (plain.double() - want).abs().max() > 0.1


def test_the_layer_agrees_with_and_without_the_kernel(monkeypatch):
    q, kc, vc, tables, lens = paged([5, 123, 64], 8, 2, 64, 16, torch.float32, seed=3)
    layer = Attention(8, 2, 64, 0.125, sliding_window=40)
    layer.k_cache, layer.v_cache = kc, vc
    layer.sinks = torch.linspace(-1.0, 3.0, 8)
    meta = AttentionMetadata(
        query_lens=[1, 1, 1], decode_block_tables=tables, decode_context_lens=lens, decode_max_context=123
    )
    with_kernel = layer._decode(q, meta)
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    without = layer._decode(q, AttentionMetadata(**{**meta.__dict__, "shared": {}}))
    assert torch.allclose(with_kernel, without, atol=1e-5)
