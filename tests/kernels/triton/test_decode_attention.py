"""The Triton paged decode attention against a plain PyTorch reference that gathers each row's tokens through its
block table: GQA and MLA shapes, odd head sizes, block sizes, quantized caches, sliding windows, softcap, split-KV
and empty rows. Without CUDA the kernels run under Triton's interpreter, so the cases are kept small."""

import pytest
import torch

from fulcrum.kernels.triton import decode_attention
from fulcrum.quant import kv as kv_quant


def reference(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, softcap=None,
              k_scales=None, v_scales=None):  # fmt: skip
    batch, num_heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros(batch, num_heads, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(batch):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        n = torch.arange(ctx, device=q.device)
        pages, slots = block_tables[b, n // block_size].long(), n % block_size
        k, v = k_cache[pages, slots], v_cache[pages, slots]  # [ctx, KVH, D]
        k = kv_quant.dequantize(k, k_scales[pages, slots], torch.float32) if k_scales is not None else k.float()
        v = kv_quant.dequantize(v, v_scales[pages, slots], torch.float32) if v_scales is not None else v.float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, H, D]
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sliding_window:
            s = s.masked_fill(n[None, :] < ctx - sliding_window, float("-inf"))
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def make_case(lens, *, kv_heads=2, group=1, dk=24, dv=None, block_size=16, dtype=torch.float32, kv=None,
              bt_dtype=torch.int32, mla=False, extra_blocks=2, device="cpu", seed=0):  # fmt: skip
    """Caches with their pages shuffled (a row's blocks are not contiguous) and block tables padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or dk
    batch, num_heads = len(lens), kv_heads * group
    max_blocks = max(1, -(-max(lens) // block_size)) + extra_blocks
    num_blocks = batch * max_blocks + 3
    q = torch.randn(batch, num_heads, dk, generator=gen).to(dtype)
    k = torch.randn(num_blocks, block_size, kv_heads, dk, generator=gen) * (1 + torch.rand(num_blocks, 1, 1, 1))
    if mla:
        v = None
    else:
        v = torch.randn(num_blocks, block_size, kv_heads, dv, generator=gen)
    k_scales = v_scales = None
    if kv is not None:
        fmt = kv_quant.FORMATS[kv]
        k, k_scales = kv_quant.quantize(k, fmt)
        if not mla:
            v, v_scales = kv_quant.quantize(v, fmt)
    else:
        k = k.to(dtype)
        v = v.to(dtype) if v is not None else None
    if mla:
        v, v_scales = k[..., :dv], k_scales  # the latent values are the first dv of the same cache row
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(batch, max_blocks, dtype=bt_dtype)
    for b, ctx in enumerate(lens):
        used = -(-ctx // block_size)
        block_tables[b, :used] = perm[b * max_blocks : b * max_blocks + used].to(bt_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    tensors = dict(q=q, k_cache=k, v_cache=v, block_tables=block_tables, context_lens=context_lens,
                   k_scales=k_scales, v_scales=v_scales)  # fmt: skip
    return {name: (t.to(device) if t is not None else None) for name, t in tensors.items()}


def check(case, *, tol, scale=None, **kwargs):
    scale = scale or case["q"].shape[-1] ** -0.5
    got = decode_attention.paged_decode(**case, scale=scale, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k in ("sliding_window", "softcap")}
    want = reference(**case, scale=scale, **ref_kwargs)
    assert got.shape == want.shape and got.dtype == case["q"].dtype
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    return got


FP32, BF16 = 1e-5, 2e-2


@pytest.mark.parametrize(
    "lens, block_size",
    [
        ([1], 16),  # a single-token context
        ([16, 32, 48], 16),  # exactly at block boundaries
        ([5, 37, 70], 16),  # partial blocks
        ([1, 9, 23], 1),  # one token per block
        ([33, 64], 32),
    ],
)
def test_contexts_and_block_sizes(lens, block_size):
    check(make_case(lens, block_size=block_size), tol=FP32, num_splits=1)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dk", [24, 64, 128])
def test_gqa_and_head_sizes(group, dk):
    check(make_case([7, 41], kv_heads=2 if group < 8 else 1, group=group, dk=dk), tol=FP32, num_splits=1)


@pytest.mark.parametrize("dk, dv", [(80, 80), (40, 24)])
def test_head_sizes_that_are_not_powers_of_two(dk, dv):
    check(make_case([19, 50], group=2, dk=dk, dv=dv), tol=FP32, num_splits=2)


@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
def test_mla_shape(kv):
    # one latent KV head shared by 16 query heads, values a strided view of the key rows
    case = make_case([13, 45], kv_heads=1, group=16, dk=40, dv=32, mla=True, kv=kv)
    assert not case["v_cache"].is_contiguous()
    check(case, tol=FP32, num_splits=1)
    check(case, tol=FP32, num_splits=3)


@pytest.mark.parametrize("group", [1, 4])
def test_bf16(group):
    check(make_case([3, 29, 66], group=group, dk=64, dtype=torch.bfloat16), tol=BF16)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache(kv, dtype):
    case = make_case([11, 47], group=4, dk=64, kv=kv, dtype=dtype)
    assert case["k_cache"].dtype == kv_quant.FORMATS[kv].dtype
    check(case, tol=FP32 if dtype == torch.float32 else BF16, num_splits=2)


@pytest.mark.parametrize("window", [1, 8, 20, 100])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window(window, num_splits):
    check(make_case([5, 21, 60], group=2), tol=FP32, sliding_window=window, num_splits=num_splits)


def test_softcap():
    # large scores so the cap actually bends them
    check(make_case([9, 40], group=2), tol=FP32, scale=3.0, softcap=5.0, num_splits=2)


@pytest.mark.parametrize("bt_dtype", [torch.int32, torch.int64])
def test_splits_equal_unsplit(bt_dtype):
    case = make_case([1, 30, 69], group=4, dk=32, bt_dtype=bt_dtype)
    one = check(case, tol=FP32, num_splits=1)
    three = check(case, tol=FP32, num_splits=3)
    torch.testing.assert_close(three, one, atol=FP32, rtol=FP32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_row_gives_zeros(num_splits):
    case = make_case([0, 17, 0], group=2)
    # padding rows of a CUDA graph: a block table of garbage must not be read at all
    case["block_tables"][0] = 10**6
    case["block_tables"][2] = -(10**6)
    got = check(case, tol=FP32, num_splits=num_splits)
    assert (got[0] == 0).all() and (got[2] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_out_is_written_in_place(num_splits):
    case = make_case([12, 34], group=2, dk=24, dv=32)
    out = torch.full((2, 4, 32), float("nan"))
    got = check(case, tol=FP32, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()


def test_default_splits_use_static_shapes_only():
    cpu = torch.device("cpu")
    assert decode_attention.default_num_splits(4, 2, 64, cpu) == 1
    assert decode_attention.default_num_splits(1, 1, 1 << 20, cpu) >= 1
    case = make_case([20, 3], group=2)
    check(case, tol=FP32)  # the heuristic's own choice


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "group, dk, dv, kv, mla, window, softcap",
    [
        (4, 128, 128, None, False, None, None),
        (8, 128, 128, "fp8", False, None, None),
        (1, 64, 64, "int8", False, 100, None),
        (2, 256, 256, None, False, None, 30.0),
        (4, 80, 80, None, False, None, None),
        (128, 576, 512, None, True, None, None),
        (16, 576, 512, "fp8", True, None, None),
    ],
)
def test_cuda_against_reference(group, dk, dv, kv, mla, window, softcap):
    lens = [1, 0, 17, 256, 1000, 3000, 513, 4096]
    case = make_case(lens, kv_heads=1 if mla else 8 // min(group, 8), group=group, dk=dk, dv=dv, kv=kv, mla=mla,
                     dtype=torch.bfloat16, block_size=16, device="cuda")  # fmt: skip
    for num_splits in (None, 1, 7):
        check(case, tol=BF16, sliding_window=window, softcap=softcap, num_splits=num_splits)
