"""The CPU decode-attention kernel reads the paged cache through block tables and gives attention's
result: checked against a float64 softmax(q k^T) v over each sequence's gathered tokens."""

import pytest
import torch

from fulcrum.kernels import cpu_attention
from fulcrum.layers.attention import Attention, AttentionMetadata
from fulcrum.quant import kv as kv_quant

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs an x86 CPU with AVX2 and a compiler")


def paged(ctxs, heads, kv_heads, head_dim, block, dtype, seed=0):
    """A cache with each sequence's blocks scattered in shuffled order, and its tables."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-c // block) for c in ctxs) + 3
    kc = torch.randn(n_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(n_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables, i = [], 0
    for c in ctxs:
        k = -(-c // block)
        tables.append(order[i : i + k])
        i += k
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(ctxs), heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(ctxs)


def reference(q, kc, vc, tables, ctxs, scale, window, softcap=None, sinks=None):
    """Attention over each sequence's gathered tokens in float64; `sinks` [H]: one more logit per head in its
    softmax, with no value (gpt-oss)."""
    heads, kv_heads, block = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j, c in enumerate(ctxs.tolist()):
        blocks = tables[j, : -(-c // block)]
        ks = kc[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, 1)
        vs = vc[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, 1)
        start = max(0, c - window) if window else 0
        scores = torch.einsum("hd,thd->ht", q[j].double(), ks[start:]) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            probs = torch.cat([scores, sinks.double()[:, None]], -1).softmax(-1)[:, :-1]
        out[j] = torch.einsum("ht,thd->hd", probs, vs[start:])
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "ctxs, heads, kv_heads, head_dim, block, window",
    [
        ([1, 17, 300], 14, 2, 64, 16, None),  # Qwen2.5-0.5B's grouping, partial last blocks, one-token context
        ([40, 5], 8, 8, 128, 16, None),  # no GQA
        ([200, 3], 16, 8, 128, 16, None),  # keys past 256 KiB: the next block prefetched, not read in order
        ([100, 1, 33, 64], 32, 8, 80, 32, None),
        ([70, 9], 4, 1, 256, 16, None),  # MQA, the widest head
        ([1, 50, 300], 14, 2, 64, 16, 32),  # sliding window
        ([1, 50, 300], 14, 2, 64, 16, 21),  # a window starting mid-vector
        ([30, 7], 8, 2, 32, 8, None),  # blocks of 8: one key at a time on AVX-512, whole vectors on AVX2
        ([61, 3], 8, 2, 32, 24, 10),  # blocks of 24: one key at a time on both
        # head dims that are a multiple of 8, not of 16: AVX-512 ends each head with a half-filled vector
        ([1, 17, 300], 4, 2, 24, 16, None),  # the bundled draft model's shape
        ([50, 9], 8, 1, 40, 16, 21),
        ([33, 2], 2, 2, 8, 8, None),
        ([20, 64], 6, 3, 56, 16, None),
    ],
)
def test_matches_attention_over_gathered_tokens(dtype, tol, ctxs, heads, kv_heads, head_dim, block, window):
    q, kc, vc, tables, lens = paged(ctxs, heads, kv_heads, head_dim, block, dtype)
    assert cpu_attention.usable(q, kc, kv_heads)
    got = cpu_attention.decode(q, kc, vc, tables, lens, head_dim**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - reference(q, kc, vc, tables, lens, head_dim**-0.5, window)).abs().max() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 21])
def test_soft_capped_scores(dtype, tol, window):
    """Gemma 2's cap * tanh(score / cap): a cap below the scores' range changes the answer, and the kernel follows."""
    q, kc, vc, tables, lens = paged([1, 50, 300], 8, 2, 64, 16, dtype, seed=1)
    q = q * 8  # scores well past the cap
    got = cpu_attention.decode(q, kc, vc, tables, lens, 64**-0.5, window, softcap=2.0)
    want = reference(q, kc, vc, tables, lens, 64**-0.5, window, softcap=2.0)
    assert (got.double() - want).abs().max() < tol
    assert (reference(q, kc, vc, tables, lens, 64**-0.5, window) - want).abs().max() > 0.1


@pytest.mark.skipif(not cpu_attention.available(True), reason="needs the quantized caches' build")
@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_dim_of_24_reads_the_quantized_cache(name, dtype):
    """int8 and fp8 caches through the half-filled last vector: no byte past a head's end is read."""
    q, kc, vc, tables, lens = paged([1, 17, 300], 4, 2, 24, 16, torch.float32)
    fmt = kv_quant.FORMATS[name]
    (kq, ks), (vq, vs) = kv_quant.quantize(kc * 4, fmt), kv_quant.quantize(vc, fmt)
    q = q.to(dtype)
    assert cpu_attention.usable(q, kq, 2)
    got = cpu_attention.decode(q, kq, vq, tables, lens, 24**-0.5, None, ks, vs)
    kd, vd = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
    want = reference(q, kd, vd, tables, lens, 24**-0.5, None)
    assert (got.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block, window, softcap, sinks, cache",
    [
        (8, 4, 32, 16, None, None, False, None),  # the bundled model's shape
        (12, 4, 32, 16, None, None, False, None),  # groups of 3 heads: a partial group of value sums
        (16, 4, 24, 16, 21, None, False, None),  # half-filled last vectors on AVX-512, a window mid-vector
        (8, 4, 32, 8, None, 2.0, True, None),  # blocks of 8, soft cap, sinks
        (4, 4, 16, 24, 10, None, False, None),  # blocks of 24, no GQA
        (8, 8, 64, 16, None, None, False, None),  # 1 KiB bf16 rows (2 KiB fp32 ones take a task per head)
        (8, 4, 32, 16, None, None, False, "int8"),
        (8, 4, 32, 16, 21, None, True, "fp8"),
    ],
)
def test_a_batch_gives_each_sequence_what_it_gets_alone(
    dtype, tol, heads, kv_heads, head_dim, block, window, softcap, sinks, cache
):
    """A step of many sequences reads each one's cache rows once for all its heads (a task per sequence), a lone
    sequence head by head (a task per KV head): the same output, bit for bit, and attention's within tolerance."""
    if cache and not cpu_attention.available(True):
        pytest.skip("needs the quantized caches' build")
    n = 2 * torch.get_num_threads() + 3
    ctxs = [1, 300, 17, 64, 129, 5, 200, 48, 33, 90][:n] + [77] * max(0, n - 10)
    q, kc, vc, tables, lens = paged(ctxs, heads, kv_heads, head_dim, block, torch.float32, seed=2)
    q = (q * 3).to(dtype)
    extra = {"softcap": softcap, "sinks": torch.linspace(-1.0, 3.0, heads) if sinks else None}
    if cache:
        fmt = kv_quant.FORMATS[cache]
        (kq, ks), (vq, vs) = kv_quant.quantize(kc, fmt), kv_quant.quantize(vc, fmt)
        args = (kq, vq)
        extra.update(k_scales=ks, v_scales=vs)
        kc, vc = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
        args = (kc, vc)
    got = cpu_attention.decode(q, *args, tables, lens, head_dim**-0.5, window, **extra)
    for j in range(n):
        alone = cpu_attention.decode(q[j : j + 1], *args, tables[j : j + 1], lens[j : j + 1], head_dim**-0.5, window,
                                     **extra)  # fmt: skip
        assert torch.equal(got[j : j + 1], alone), f"sequence {j} (context {ctxs[j]})"
    want = reference(q, kc, vc, tables, lens, head_dim**-0.5, window, softcap, extra["sinks"])
    assert (got.double() - want).abs().max() < tol


@pytest.mark.parametrize("sinks", [False, True])  # gpt-oss's logit per head, windowed as its sliding layers are
def test_attention_layer_gives_the_same_with_and_without_the_kernel(monkeypatch, sinks):
    q, kc, vc, tables, lens = paged([5, 123, 64], 14, 2, 64, 16, torch.float32)
    layer = Attention(14, 2, 64, 0.125, sliding_window=40 if sinks else None)
    layer.sinks = torch.linspace(-1.0, 3.0, 14) if sinks else None
    layer.k_cache, layer.v_cache = kc, vc
    meta = AttentionMetadata(
        query_lens=[1, 1, 1], decode_block_tables=tables, decode_context_lens=lens, decode_max_context=123
    )
    with_kernel = layer._decode(q, meta)
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    without = layer._decode(q, AttentionMetadata(**{**meta.__dict__, "shared": {}}))
    assert torch.allclose(with_kernel, without, atol=1e-5)


def test_unsupported_shapes_fall_back():
    q, kc, _, _, _ = paged([4], 2, 1, 20, 16, torch.float32)  # head_dim 20 (not a multiple of 8) has no kernel
    assert not cpu_attention.usable(q, kc, 1)
    q, kc, _, _, _ = paged([4], 4, 1, 64, 16, torch.float16)
    assert not cpu_attention.usable(q, kc, 1)


def causal_reference(q, k, v, scale, window=None):
    """float64 causal attention, queries at the last positions, K/V repeated per query head."""
    n, m, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), kk) * scale
    allowed = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    if window:
        allowed &= ~torch.ones(n, m, dtype=torch.bool).tril(m - n - window)
    scores.masked_fill_(~allowed, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "n, m, heads, kv_heads, head_dim, window",
    [
        (300, 300, 8, 2, 32, None),  # a fresh prompt: query blocks of 16 and a remainder, key blocks with a tail
        (37, 100, 14, 2, 64, None),  # a chunk after 63 cached tokens
        (1, 1, 4, 4, 32, None),  # one token
        (129, 129, 8, 8, 128, None),  # no GQA, wide heads
        (50, 70, 16, 1, 64, None),  # MQA with the largest group
        (17, 17, 3, 3, 48, None),  # head_dim 48, 24: AVX-512 ends each head with a half-filled vector
        (70, 70, 4, 2, 24, None),  # the bundled draft model's shape
        (9, 40, 4, 2, 24, 16),
        (200, 200, 8, 2, 32, 37),  # sliding window, not a multiple of the key block
        (40, 300, 4, 2, 64, 100),  # a chunk after cached context, windowed
    ],
)
def test_prefill_kernel_matches_causal_attention(dtype, tol, n, m, heads, kv_heads, head_dim, window):
    g = torch.Generator().manual_seed(n)
    # q, k, v as the model has them: strided views of one fused qkv output (k, v of the fresh tokens only when n == m)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q[m - n :].view(n, heads, head_dim), k.view(m, kv_heads, head_dim), v.view(m, kv_heads, head_dim)
    assert cpu_attention.prefill_usable(q, k, v)
    got = cpu_attention.prefill(q, k, v, head_dim**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - causal_reference(q, k, v, head_dim**-0.5, window)).abs().max() < tol


def test_attention_layer_prefills_through_the_kernel_and_agrees_without_it(monkeypatch):
    g = torch.Generator().manual_seed(3)
    layer = Attention(14, 2, 64, 0.125)
    q, k, v = (torch.randn(n, h, 64, generator=g) for n, h in [(90, 14), (200, 2), (200, 2)])
    assert cpu_attention.prefill_usable(q, k, v)
    fast = layer._attend(q, k, v)
    monkeypatch.setattr(cpu_attention, "prefill_usable", lambda *a: False)
    assert torch.allclose(fast, layer._attend(q, k, v), atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window, sinks", [(None, False), (37, False), (None, True)])
def test_prefill_of_several_sequences_in_one_call_matches_one_call_each(dtype, tol, window, sinks):
    # a step's prompts: fresh ones (their k/v rows are their query rows) and a chunk after cached context (its k/v
    # elsewhere), as strided views of one fused qkv output
    heads, kv_heads, hd = 8, 2, 32
    g = torch.Generator().manual_seed(7)
    spans, rows = [], 0
    for n, m in [(128, 128), (1, 1), (37, 100), (300, 300), (64, 64), (5, 5)]:
        spans.append((rows + m - n, n, rows, m))  # queries: the last n of the sequence's m rows
        rows += m
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.view(rows, heads, hd), k.view(rows, kv_heads, hd), v.view(rows, kv_heads, hd)
    head_sinks = torch.randn(heads, generator=g) if sinks else None
    assert cpu_attention.prefill_usable(q, k, v)
    out = torch.full_like(q, float("nan"))
    cpu_attention.prefill_varlen(q, k, v, out, spans, hd**-0.5, window, head_sinks)
    for qs, n, ks, m in spans:
        one = cpu_attention.prefill(q[qs : qs + n], k[ks : ks + m], v[ks : ks + m], hd**-0.5, window, head_sinks)
        assert torch.equal(out[qs : qs + n], one)  # the same tasks, the same sums
        if not sinks:
            ref = causal_reference(q[qs : qs + n], k[ks : ks + m], v[ks : ks + m], hd**-0.5, window)
            assert (out[qs : qs + n].double() - ref).abs().max() < tol
    between = torch.ones(rows, dtype=torch.bool)
    for qs, n, _, _ in spans:
        between[qs : qs + n] = False
    assert out[between].isnan().all()  # rows that are no sequence's queries are left alone


def test_prefill_of_several_sequences_takes_turns_past_the_widened_budget():
    # five 128-token prompts widen to 16 MiB each (64 KV heads of 256): they run in two turns of the 64 MiB budget,
    # and one of 520 tokens (65 MiB) alone, its KV heads in turns
    hd, h = 256, 64
    g = torch.Generator().manual_seed(1)
    lens = [128] * 5 + [520, 16]
    rows = sum(lens)
    q, k, v = (torch.randn(rows, h, hd, generator=g) for _ in range(3))
    spans, start = [], 0
    for n in lens:
        spans.append((start, n, start, n))
        start += n
    out = torch.empty_like(q)
    cpu_attention.prefill_varlen(q, k, v, out, spans, hd**-0.5)
    for qs, n, _, _ in spans:
        one = cpu_attention.prefill(q[qs : qs + n], k[qs : qs + n], v[qs : qs + n], hd**-0.5)
        assert torch.equal(out[qs : qs + n], one)
