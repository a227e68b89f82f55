"""The Triton varlen prefill kernel against plain PyTorch attention over the same paged cache: fresh prompts, chunks on
cached context, mixed prefill/decode batches, GQA, odd head dims, quantized caches, sliding window, softcap. Without
CUDA it runs under Triton's interpreter, so the cases are small."""

from __future__ import annotations

import math

import pytest
import torch

from fulcrum.kernels.triton import prefill_attention
from fulcrum.kernels.triton.prefill_attention import paged_prefill
from fulcrum.quant import kv as kv_quant

SENTINEL = 7.0  # rows of out no sequence owns must keep it


def build_case(
    seqs,
    heads=4,
    kv_heads=1,
    dk=64,
    dv=None,
    block_size=16,
    dtype=torch.float32,
    kv=None,
    order=None,
    table_dtype=torch.int32,
    device="cpu",
    seed=0,
):
    """seqs: (query_len, context_len) per sequence; order: where each sequence's rows go in q (arbitrary layout)."""
    dv = dv or dk
    g = torch.Generator().manual_seed(seed)
    n_pages = [math.ceil(ctx / block_size) for _, ctx in seqs]
    num_blocks = sum(n_pages) + 3  # spare pages nobody's table points at
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(n_pages) + 2
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    used = 0
    for s, n in enumerate(n_pages):
        tables[s, :n] = perm[used : used + n]
        used += n

    k_f = torch.randn(num_blocks, block_size, kv_heads, dk, generator=g)
    v_f = torch.randn(num_blocks, block_size, kv_heads, dv, generator=g)
    if kv is None:
        k_cache, v_cache = k_f.to(dtype), v_f.to(dtype)
        k_deq, v_deq, k_scales, v_scales = k_cache.float(), v_cache.float(), None, None
    else:
        fmt = kv_quant.FORMATS[kv]
        k_cache, k_scales = kv_quant.quantize(k_f * 3, fmt)
        v_cache, v_scales = kv_quant.quantize(v_f * 3, fmt)
        k_deq = kv_quant.dequantize(k_cache, k_scales, torch.float32)
        v_deq = kv_quant.dequantize(v_cache, v_scales, torch.float32)

    # q rows: sequences laid out in `order`, with a spare row before each one that no sequence owns
    order = order if order is not None else list(range(len(seqs)))
    starts = [0] * len(seqs)
    row = 0
    for s in order:
        row += 1
        starts[s] = row
        row += seqs[s][0]
    T = row + 1
    q = torch.randn(T, heads, dk, generator=g).to(dtype)
    case = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor([ql for ql, _ in seqs], dtype=torch.int32),
        context_lens=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32),
        block_tables=tables.to(table_dtype),
        k_scales=k_scales,
        v_scales=v_scales,
    )
    case = {k: (v.to(device) if v is not None else None) for k, v in case.items()}
    return case, k_deq, v_deq


def reference(case, k_deq, v_deq, scale, sliding_window=None, softcap=None):
    q = case["q"]
    T, H, _ = q.shape
    block_size, kvh = k_deq.shape[1], k_deq.shape[2]
    out = torch.full((T, H, v_deq.shape[-1]), SENTINEL)
    for s in range(case["query_lens"].shape[0]):
        qs, ql, ctx = (int(case[k][s]) for k in ("query_start", "query_lens", "context_lens"))
        pages = case["block_tables"][s, : math.ceil(ctx / block_size)].cpu().long()
        k = k_deq[pages].reshape(-1, kvh, k_deq.shape[-1])[:ctx].repeat_interleave(H // kvh, 1)  # [ctx, H, Dk]
        v = v_deq[pages].reshape(-1, kvh, v_deq.shape[-1])[:ctx].repeat_interleave(H // kvh, 1)
        qf = q[qs : qs + ql].cpu().float()
        scores = torch.einsum("qhd,khd->hqk", qf, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx - ql, ctx)[:, None]
        n = torch.arange(ctx)[None, :]
        visible = n <= pos
        if sliding_window:
            visible &= n > pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qs : qs + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check(seqs, sliding_window=None, softcap=None, device="cpu", **kw):
    case, k_deq, v_deq = build_case(seqs, device=device, **kw)
    dtype = case["q"].dtype
    scale = case["q"].shape[-1] ** -0.5
    out = torch.full((case["q"].shape[0], case["q"].shape[1], v_deq.shape[-1]), SENTINEL, dtype=dtype, device=device)
    got = paged_prefill(
        **case,
        scale=scale,
        max_query_len=max(ql for ql, _ in seqs),
        sliding_window=sliding_window,
        softcap=softcap,
        out=out,
    )
    assert got is out
    want = reference(case, k_deq, v_deq, scale, sliding_window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), atol=tol, rtol=tol)


MIXED = [(1, 33), (25, 40), (1, 16), (12, 12), (1, 1)]  # decode rows between prompts and a chunk on context


@pytest.mark.parametrize(
    "seqs, kw",
    [
        pytest.param([(37, 37)], dict(heads=4, kv_heads=1), id="fresh-prompt-gqa4"),
        pytest.param([(20, 70)], dict(heads=2, kv_heads=2, dtype=torch.bfloat16), id="chunk-on-context-bf16"),
        pytest.param(MIXED, dict(heads=8, kv_heads=1, dk=128, order=[3, 0, 4, 1, 2]), id="mixed-gqa8-d128"),
        pytest.param(MIXED, dict(heads=4, kv_heads=4, dtype=torch.bfloat16, order=[2, 4, 1, 0, 3]), id="mixed-bf16"),
        pytest.param([(9, 23), (1, 5), (4, 4)], dict(block_size=1, dk=24), id="block-size-1-d24"),
        pytest.param([(16, 32), (1, 17), (15, 48), (17, 17)], dict(heads=2, kv_heads=1), id="block-boundaries"),
        pytest.param([(80, 90)], dict(heads=1, kv_heads=1, dk=32), id="several-query-blocks"),
        pytest.param([(20, 30), (1, 9)], dict(heads=8, kv_heads=1, dk=24, dv=64), id="gqa8-blocks-dk24-dv64"),
        pytest.param([(6, 20), (1, 3)], dict(heads=2, kv_heads=1, dk=256, dv=80), id="d256-dv80"),
        pytest.param(MIXED, dict(table_dtype=torch.int64, block_size=32, order=[4, 3, 2, 1, 0]), id="int64-tables"),
    ],
)
def test_matches_reference(seqs, kw):
    check(seqs, **kw)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache(kv, dtype):
    check([(1, 40), (18, 50), (7, 7)], heads=4, kv_heads=1, kv=kv, dtype=dtype, order=[1, 2, 0])


@pytest.mark.parametrize("window", [1, 8, 70])
def test_sliding_window(window):
    # 8 and 1 start the key loop past 0 (and mid tile); 70 covers all of the short sequences
    check([(30, 100), (1, 50), (12, 12)], sliding_window=window, heads=2, kv_heads=1, order=[2, 0, 1])


def test_softcap():
    check(MIXED, softcap=5.0, heads=4, kv_heads=1, dk=64, order=[1, 3, 0, 2, 4])


def test_softcap_with_window_and_int8_bf16():
    check([(20, 60), (1, 30)], softcap=3.0, sliding_window=16, kv="int8", dtype=torch.bfloat16, heads=4, kv_heads=4)


def test_allocates_out_and_leaves_no_rows_unset_for_its_sequences():
    case, k_deq, v_deq = build_case([(5, 9), (1, 4)], heads=2, kv_heads=1)
    got = paged_prefill(**case, scale=0.125, max_query_len=5)
    want = reference(case, k_deq, v_deq, 0.125)
    owned = want[:, 0, 0] != SENTINEL
    assert got.shape == want.shape and got.dtype == case["q"].dtype
    torch.testing.assert_close(got[owned], want[owned], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)], ids=["m16-n16", "m32-n16"])
@pytest.mark.parametrize(
    "window, kw",
    [
        (None, dict()),
        (10, dict(block_size=1)),
        (23, dict(kv="int8")),
        (40, dict(dtype=torch.bfloat16, block_size=32)),
    ],
)
def test_small_tiles(monkeypatch, tiles, window, kw):
    # tiles far smaller than the sequences: many query blocks, and key loops with unmasked tiles between the masked
    # window start and the masked causal end
    monkeypatch.setattr(prefill_attention, "_launch_config", lambda *_: (*tiles, 4, 2))
    check([(40, 90), (1, 33), (25, 25), (3, 70)], sliding_window=window, heads=4, kv_heads=2, order=[2, 3, 0, 1], **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "kw",
    [
        dict(dtype=torch.bfloat16),
        dict(dtype=torch.float16, kv="fp8"),
        dict(dtype=torch.bfloat16, kv="int8", block_size=32),
        dict(dtype=torch.float32),
        dict(dtype=torch.bfloat16, dk=256, block_size=1),
        dict(dtype=torch.bfloat16, dk=80, dv=96),
    ],
)
def test_cuda_large(kw):
    seqs = [(700, 700), (1, 900), (300, 1200), (1, 5), (129, 129), (1, 2000), (64, 65)]
    kw = dict(heads=32, kv_heads=8, dk=128) | kw
    check(seqs, device="cuda", order=[5, 2, 0, 6, 1, 3, 4], **kw)
    check(seqs, device="cuda", sliding_window=256, softcap=30.0, order=[6, 5, 4, 3, 2, 1, 0], **kw)
