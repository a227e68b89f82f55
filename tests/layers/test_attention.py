"""The CPU attention paths agree with PyTorch's reference SDPA."""

import pytest
import torch
import torch.nn.functional as F

from fulcrum.layers.attention import Attention


def reference(q, k, v, scale):
    """Plain causal SDPA with K/V repeated per query head, queries at the last positions."""
    n, m = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(g, 1).transpose(0, 1).float(),
        v.repeat_interleave(g, 1).transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return o.transpose(0, 1)


# a fresh prompt (blocks of 128 and a remainder); a chunk after cached context; shorter than one block
@pytest.mark.parametrize("n, m", [(300, 300), (256, 700), (70, 70)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_blocked_attention_matches_sdpa(n, m, dtype, tol):
    g = torch.Generator().manual_seed(0)
    attn = Attention(num_heads=14, num_kv_heads=2, head_dim=64, scale=0.125)
    q, k, v = (torch.randn(x, h, 64, generator=g).to(dtype) for x, h in [(n, 14), (m, 2), (m, 2)])
    got = attn._attend(q, k, v)
    assert got.dtype == dtype
    got = attn._attend_blocked(q, k, v).float()
    assert (got - reference(q, k, v, 0.125)).abs().max() < tol


def test_bf16_prompts_take_the_matmul_path_and_agree_with_float32():
    g = torch.Generator().manual_seed(1)
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=32, scale=32**-0.5)
    q, k, v = (torch.randn(320, h, 32, generator=g) for h in (4, 2, 2))
    exact = attn._attend(q, k, v)
    fast = attn._attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert (fast.float() - exact).abs().max() < 3e-2


def test_grouped_bf16_decode_matches_float32():
    """Decodes of 16-bit GQA models treat a KV head's query heads as rows of one call; same result."""
    from fulcrum.layers.attention import AttentionMetadata

    g = torch.Generator().manual_seed(2)
    blocks, bs, kvh, h, d = 12, 4, 2, 6, 16
    k_cache, v_cache = (torch.randn(blocks, bs, kvh, d, generator=g) for _ in range(2))
    ctx = torch.tensor([5, 17, 9])
    tables = torch.tensor([[3, 1, 0, 0, 0], [2, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    q = torch.randn(3, h, d, generator=g)
    meta = AttentionMetadata(
        query_lens=[1, 1, 1], decode_block_tables=tables, decode_context_lens=ctx, decode_max_context=17
    )
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        attn = Attention(h, kvh, d, d**-0.5)
        attn.k_cache, attn.v_cache = k_cache.to(dtype), v_cache.to(dtype)
        outs[dtype] = attn._decode(q.to(dtype), meta).float()
    # and the float32 result is plain attention over each sequence's gathered context
    for i in range(3):
        blk = tables[i, : -(-int(ctx[i]) // bs)]
        ks = k_cache[blk].flatten(0, 1)[: ctx[i]]
        vs = v_cache[blk].flatten(0, 1)[: ctx[i]]
        assert torch.allclose(outs[torch.float32][i], reference(q[i : i + 1], ks, vs, d**-0.5)[0], atol=1e-5)
    assert (outs[torch.bfloat16] - outs[torch.float32]).abs().max() < 3e-2
