"""MLAAttention against float64 multi-head attention over keys and values expanded from the latents: decode with
the absorbed weights and with K/V expanded per step, fresh prompts, chunks after cached context and decodes in one
step, the cache rows it writes, its up-projection read from a (quantized) kv_b_proj, and its cache's size."""

import pytest
import torch

from fulcrum.errors import InvalidRequestError
from fulcrum.layers.attention import AttentionMetadata, attach_kv_cache
from fulcrum.layers.linear import ColumnParallelLinear
from fulcrum.layers.mla import MLAAttention
from fulcrum.quant import kv as kv_quant
from fulcrum.quant.online import Int8Method

H, R, NOPE, ROPE, V = 4, 32, 16, 8, 16  # heads, kv_lora_rank, qk_nope, qk_rope, v
ROW = R + ROPE
SCALE = 0.3


def make_attention(dtype=torch.float32, seed=0) -> MLAAttention:
    g = torch.Generator().manual_seed(seed)
    kv_b = ColumnParallelLinear(R, H * (NOPE + V), dtype=dtype)
    kv_b.weight.data.copy_(torch.randn(H * (NOPE + V), R, generator=g) * 0.3)
    attn = MLAAttention(H, R, NOPE, ROPE, V, SCALE)
    attn.load_up_projection(kv_b, dtype)
    return attn


def reference(attn: MLAAttention, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Float64 causal attention of q [n, H, qk] (the last n positions) over rows [m, row] expanded per head."""
    n, m = q.shape[0], rows.shape[0]
    rows, q = rows.double(), q.double()
    latent, k_pe = rows[:, :R], rows[:, R:]
    k_nope = torch.einsum("mr,hdr->mhd", latent, attn.w_uk.double())
    v = torch.einsum("mr,hdr->mhd", latent, attn.w_uv.double())
    k = torch.cat((k_nope, k_pe[:, None].expand(m, H, ROPE)), -1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * SCALE
    allowed = torch.arange(m)[None] <= torch.arange(m - n, m)[:, None]
    return torch.einsum("hnm,mhd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cache(attn, num_blocks, block_size, dtype=torch.float32):
    return attach_kv_cache([attn], num_blocks, block_size, dtype, None, "cpu")[0]


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_decode_equals_expanded_attention(absorb, dtype, tol):
    """Sequences of 1, 7, 16 and 53 cached tokens in scattered blocks of 4, decoded in one call."""
    attn = make_attention(dtype)
    attn.absorb = absorb
    bs, lens = 4, [1, 7, 16, 53]
    cache = _cache(attn, 64, bs, dtype)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    tables = torch.stack([perm[i * 16 : (i + 1) * 16] for i in range(len(lens))])
    ctx = [rand(n, ROW, seed=10 + i, dtype=dtype) for i, n in enumerate(lens)]
    for row, rows in zip(tables, ctx):
        pos = torch.arange(rows.shape[0])
        cache[0].view(-1, ROW)[row[pos // bs] * bs + pos % bs] = rows
    # each sequence's last row is the decoding token's own: written by forward
    slots = torch.tensor([int(t[(n - 1) // bs]) * bs + (n - 1) % bs for t, n in zip(tables, lens)])
    q = rand(len(lens), H, NOPE + ROPE, seed=2, dtype=dtype)
    new_rows = torch.stack([rows[-1] for rows in ctx])
    meta = AttentionMetadata.for_decodes(slots, tables, torch.tensor(lens))
    out = attn(q, new_rows, meta)
    assert out.shape == (len(lens), H, V) and out.dtype == dtype
    for i, rows in enumerate(ctx):
        torch.testing.assert_close(out[i].double(), reference(attn, q[i : i + 1], rows)[0], atol=tol, rtol=tol)


def test_absorbed_and_expanded_decode_agree():
    """The two decodes benchmarks/bench_mla.py times against each other: one result, 100 cached tokens."""
    attn = make_attention()
    cache = _cache(attn, 8, 16)
    cache[0].view(-1, ROW)[:100] = rand(100, ROW, seed=3)
    q, row = rand(1, H, NOPE + ROPE, seed=4), cache[0].view(-1, ROW)[99].clone()[None]

    def decode():
        return attn(
            q, row, AttentionMetadata.for_decodes(torch.tensor([99]), torch.arange(8)[None], torch.tensor([100]))
        )

    absorbed = decode()
    attn.absorb = False
    torch.testing.assert_close(absorbed, decode(), atol=1e-5, rtol=0)


def test_a_mixed_step_writes_its_rows_and_attends_like_the_reference():
    """One step: a fresh prompt of 9, a chunk of 5 after 11 cached tokens, and two decodes, in flattened order
    decode, prompt, decode, chunk; blocks of 4."""
    attn = make_attention()
    bs = 4
    cache = _cache(attn, 32, bs)
    # (cached rows before the step, new tokens) and each sequence's blocks
    seqs = [(6, 1), (0, 9), (20, 1), (11, 5)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    full = [rand(c + n, ROW, seed=20 + i) for i, (c, n) in enumerate(seqs)]
    for (c, _), table, rows in zip(seqs, tables, full):
        for p in range(c):
            cache[0, table[p // bs], p % bs] = rows[p]
    q_all, kv_all, slots, prefills, prefill_tables, dec_idx, t = [], [], [], [], [], [], 0
    for i, ((c, n), table, rows) in enumerate(zip(seqs, tables, full)):
        q_all.append(rand(n, H, NOPE + ROPE, seed=40 + i))
        kv_all.append(rows[c:])
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
        if n == 1:
            dec_idx.append(t)
        else:
            prefills.append((t, n, c + n, len(prefill_tables)))
            prefill_tables.append(table)
        t += n
    dec_tables = torch.tensor([tables[0], tables[2]])
    meta = AttentionMetadata(
        query_lens=[n for _, n in seqs],
        slot_mapping=torch.tensor(slots),
        prefills=prefills,
        block_tables=torch.tensor(prefill_tables),
        decode_token_idx=torch.tensor(dec_idx),
        decode_block_tables=dec_tables,
        decode_context_lens=torch.tensor([7, 21]),
        decode_max_context=21,
    )
    out = attn(torch.cat(q_all), torch.cat(kv_all), meta)
    assert torch.equal(cache[0].view(-1, ROW)[torch.tensor(slots)], torch.cat(kv_all))
    t = 0
    for q, rows in zip(q_all, full):
        torch.testing.assert_close(out[t : t + q.shape[0]].double(), reference(attn, q, rows), atol=2e-5, rtol=2e-5)
        t += q.shape[0]


def test_without_a_cache_each_prompt_attends_over_its_own_rows():
    attn = make_attention()
    lens = [3, 1, 12]
    q, kv = rand(sum(lens), H, NOPE + ROPE, seed=5), rand(sum(lens), ROW, seed=6)
    out = attn(q, kv, AttentionMetadata.for_prompts(lens))
    for s, n in zip([0, 3, 4], lens):
        torch.testing.assert_close(
            out[s : s + n].double(), reference(attn, q[s : s + n], kv[s : s + n]), atol=2e-5, rtol=0
        )


def test_the_up_projection_is_what_a_quantized_kv_b_proj_computes():
    """Read by running kv_b_proj on the identity, W_UK and W_UV are an int8 layer's dequantized weights: the latent
    expanded with them equals the layer's own output."""
    kv_b = ColumnParallelLinear(R, H * (NOPE + V), dtype=torch.float32, quant_method=Int8Method())
    weight = rand(H * (NOPE + V), R, seed=7)
    kv_b.weight.data.copy_(weight)
    kv_b.quant_method.process_weights_after_loading(kv_b)
    attn = MLAAttention(H, R, NOPE, ROPE, V, SCALE)
    attn.load_up_projection(kv_b, torch.float32)
    latent = rand(5, R, seed=8)
    expanded = kv_b(latent).view(5, H, NOPE + V)
    torch.testing.assert_close(torch.einsum("mr,hdr->mhd", latent, attn.w_uk), expanded[..., :NOPE], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.einsum("mr,hdr->mhd", latent, attn.w_uv), expanded[..., NOPE:], atol=1e-5, rtol=0)
    # the rounded weights, not the checkpoint's
    assert not torch.allclose(attn.w_uk, weight.view(H, NOPE + V, R)[:, :NOPE], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_is_one_row_per_token_per_layer(dtype):
    layers = [MLAAttention(H, R, NOPE, ROPE, V, SCALE) for _ in range(3)]
    assert layers[0].kv_bytes_per_token(dtype, None) == ROW * dtype.itemsize
    cache, scales = attach_kv_cache(layers, 10, 16, dtype, None, "cpu")
    assert cache.shape == (3, 10, 16, ROW) and cache.dtype == dtype and scales is None
    assert layers[2].k_cache.data_ptr() == cache[2].data_ptr()
    assert layers[2].v_cache.shape == (10, 16, R)  # the latents, a view of the rows


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_quantized_cache_is_refused(name):
    attn = MLAAttention(H, R, NOPE, ROPE, V, SCALE)
    fmt = kv_quant.kv_format(name)
    with pytest.raises(InvalidRequestError, match=f"--kv-cache-dtype {name}"):
        attn.kv_bytes_per_token(torch.bfloat16, fmt)
    with pytest.raises(InvalidRequestError, match="latent"):
        attach_kv_cache([attn], 4, 16, torch.bfloat16, fmt, "cpu")
