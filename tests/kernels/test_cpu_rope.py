"""The fused rotary + KV-cache write gives exactly what apply_rotary and two index copies give, in fp32 and bf16."""

import pytest
import torch

from fulcrum.kernels import cpu_rope
from fulcrum.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(not cpu_rope.available(), reason="needs an x86 CPU with AVX2 and a compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 32), (4, 4, 64), (14, 2, 128)])
def test_matches_apply_rotary_and_index_copy(dtype, tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(tokens)
    # q, k, v as the model has them: views of one fused qkv output, each token's row strided
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos, sin = RotaryEmbedding(head_dim, 512, {"rope_type": "default", "rope_theta": 10000.0})(positions, dtype)
    slots = torch.randperm(64 * 16, generator=g)[:tokens]
    want_q, want_k = apply_rotary(q, k, cos, sin)
    want_kc = torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype)
    want_vc = torch.zeros_like(want_kc)
    want_kc.view(-1, kv_heads, head_dim).index_copy_(0, slots, want_k)
    want_vc.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    assert cpu_rope.usable(q, k, v, cos, sin, kc)
    cpu_rope.rope_and_cache(q, k, v, cos, sin, slots, kc, vc)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_without_a_cache_it_only_rotates():
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    cos, sin = RotaryEmbedding(32, 64, {"rope_type": "default", "rope_theta": 10000.0})(torch.arange(3), q.dtype)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    cpu_rope.rope_and_cache(q, k, v, cos, sin, None, None, None)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert not cpu_rope.usable(q.transpose(1, 2), k, v, cos, sin, None)  # heads not packed per token
