"""The Triton rotary + KV-cache write against fulcrum's PyTorch path: apply_rotary, then the cache write of
Attention._write (index_copy, quantized by fulcrum.quant.kv.quantize). Interpreted on CPU, native on CUDA."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.triton import rope_cache as rc
from fulcrum.layers.rotary import RotaryEmbedding, apply_rotary
from fulcrum.quant import kv as kv_quant

NUM_BLOCKS, BLOCK_SIZE = 3, 4


def _inputs(T, H, KVH, D, dtype, device="cpu", seed=0):
    """q, k, v as strided views of one fused qkv output; cos and signed sin for random positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype).to(device)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
    rope = RotaryEmbedding(D, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(device)
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    cos, sin = rope(positions, dtype)
    return qkv, q, k, v, cos, sin


def _caches(KVH, D, dtype, device="cpu"):
    quant = dtype in (torch.int8, torch.float8_e4m3fn)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    scales = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, dtype=torch.float16, device=device) for _ in range(2)]
    return k_cache, v_cache, *(scales if quant else (None, None))


def _close(actual, expected, dtype):
    """`expected` computed in fp32 and rounded once, as the kernel computes: equal but for a fused multiply-add on
    the GPU, which may move a result by one ulp of its dtype."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-5)


def _reference_cache(k, v, slots, cache_dtype, KVH, D):
    """The caches PyTorch's path leaves: rows at valid slots only."""
    k_cache, v_cache, ks, vs = _caches(KVH, D, cache_dtype, k.device)
    ok = slots >= 0
    for cache, sc, x in ((k_cache, ks, k), (v_cache, vs, v)):
        if sc is None:
            cache.view(-1, KVH, D)[slots[ok]] = x[ok].to(cache_dtype)
        else:
            fmt = kv_quant.FORMATS["int8" if cache_dtype == torch.int8 else "fp8"]
            qx, sx = kv_quant.quantize(x[ok], fmt)
            cache.view(torch.uint8).view(-1, KVH, D)[slots[ok]] = qx.view(torch.uint8)
            sc.view(-1, KVH)[slots[ok]] = sx
    return k_cache, v_cache, ks, vs


def _check(T, H, KVH, D, dtype, cache_dtype, device="cpu", rotate=True, pad=True):
    qkv, q, k, v, cos, sin = _inputs(T, H, KVH, D, dtype, device)
    if not rotate:
        cos = sin = None
    if rotate:
        # fulcrum's reference in q's dtype rounds each product and the sum; the kernel rounds once: within one ulp of
        # the larger product (the result itself may be far smaller), and equal to the reference run in fp32
        ref_q, ref_k = apply_rotary(q, k, cos, sin)
        if dtype != torch.float32:
            tol = dict(rtol=2**-7, atol=2**-5)
            fq, fk = apply_rotary(q.float(), k.float(), cos.float(), sin.float())
            torch.testing.assert_close(fq.to(dtype).float(), ref_q.float(), **tol)  # the references agree
            torch.testing.assert_close(fk.to(dtype).float(), ref_k.float(), **tol)
            ref_q, ref_k = fq.to(dtype), fk.to(dtype)
    else:
        ref_q, ref_k = q.clone(), k.clone()
    ref_v = v.clone()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(1))[:T].to(device)
    if pad:
        slots[-1] = -1  # a padding row: its k/v go nowhere
    ref = _reference_cache(ref_k, ref_v, slots, cache_dtype, KVH, D)
    k_cache, v_cache, ks, vs = _caches(KVH, D, cache_dtype, device)
    rc.rope_and_cache(q, k, v, cos, sin, slots, k_cache, v_cache, ks, vs)
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    if device == "cpu":  # interpreted, without a fused multiply-add: rounded exactly as the fp32 reference
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, ref_v)
    quant = ks is not None
    for got, want, got_s, want_s in ((k_cache, ref[0], ks, ref[2]), (v_cache, ref[1], vs, ref[3])):
        if not quant:
            _close(got, want, dtype)
            continue
        # a one-ulp difference in the rotated k may move a scale or a value by one step of the format
        torch.testing.assert_close(got_s.float(), want_s.float(), rtol=2e-3 if dtype == torch.float32 else 1e-2, atol=0)
        deq, want_deq = kv_quant.dequantize(got, got_s, torch.float32), kv_quant.dequantize(want, want_s, torch.float32)
        step = want_s.float().unsqueeze(-1) * (1.0 if cache_dtype == torch.int8 else 32.0)  # fp8: 3 mantissa bits
        assert ((deq - want_deq).abs() <= step * (0.01 if device == "cpu" else 1.01) + 1e-6).all()
        if device == "cpu":  # interpreted, the same arithmetic on the same inputs (no fused multiply-add): same bytes
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(got_s, want_s)
    if pad:  # nothing else was touched: the padding slot's row and every unused slot stay zero
        used = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=device)
        used[slots[slots >= 0]] = True
        for c in (k_cache, v_cache):
            assert (c.view(torch.uint8).view(NUM_BLOCKS * BLOCK_SIZE, -1)[~used] == 0).all()
    # q, k and v were views of qkv: the kernel wrote through them
    assert torch.equal(qkv[:, : H * D].view_as(q), q)


@pytest.mark.parametrize("D", [24, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_same_dtype(D, dtype):
    _check(T=5, H=4, KVH=2, D=D, dtype=dtype, cache_dtype=dtype)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 64])
def test_rope_and_cache_quantized(D, dtype, cache_dtype):
    _check(T=5, H=4, KVH=2, D=D, dtype=dtype, cache_dtype=cache_dtype)


def test_mha_no_padding():
    _check(T=3, H=2, KVH=2, D=64, dtype=torch.float32, cache_dtype=torch.float32, pad=False)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_write_only_without_rotation(cache_dtype):
    _check(T=4, H=4, KVH=1, D=64, dtype=torch.bfloat16, cache_dtype=cache_dtype, rotate=False)


@pytest.mark.parametrize("table", ["T1D", "TD", "fp32"])
def test_rotation_only(table):
    """No cache: only q and k rotate; cos/sin as [T, D], and fp32 tables with bf16 q, read the same."""
    _, q, k, v, cos, sin = _inputs(4, 4, 2, 64, torch.bfloat16)
    if table == "fp32":
        rope = RotaryEmbedding(64, 64, {"rope_type": "default", "rope_theta": 10000.0})
        cos, sin = rope(torch.tensor([3, 0, 63, 17]), torch.float32)
    ref_q, ref_k = (x.to(torch.bfloat16) for x in apply_rotary(q.float(), k.float(), cos.float(), sin.float()))
    if table == "TD":
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    rc.rope_and_cache(q, k, v, cos, sin, None, None, None)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)  # interpreted: no fused multiply-add, the same rounding


def test_int8_rounds_half_to_even():
    """Values landing on exact .5 steps round as torch.round does (to even), and just below 0.5 rounds down."""
    D = 8
    k = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 0.49999997, -126.5]]])  # amax 127: scale exactly 1
    v = k.clone()
    q = torch.zeros(1, 1, D)
    k_cache, v_cache, ks, vs = _caches(1, D, torch.int8)
    rc.rope_and_cache(q, k, v, None, None, torch.tensor([0]), k_cache, v_cache, ks, vs)
    want, want_s = kv_quant.quantize(k, kv_quant.FORMATS["int8"])
    assert torch.equal(k_cache.view(-1, 1, D)[:1], want)
    assert torch.equal(ks.view(-1, 1)[:1], want_s)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_v_head_dim_differs(cache_dtype):
    """v's head dim may differ from k's, odd included (its cache [blocks, block_size, KVH, Dv])."""
    T, H, KVH, D, DV = 3, 2, 1, 32, 7
    _, q, k, _, cos, sin = _inputs(T, H, KVH, D, torch.float32)
    v = torch.randn(T, KVH, DV)
    ref_q, ref_k = apply_rotary(q, k, cos, sin)
    slots = torch.tensor([4, -1, 9])
    k_cache, _, ks, vs = _caches(KVH, D, cache_dtype)
    v_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, DV, dtype=cache_dtype)
    rc.rope_and_cache(q, k, v, cos, sin, slots, k_cache, v_cache, ks, vs)
    ok = slots >= 0
    if vs is None:
        assert torch.equal(k_cache.view(-1, KVH, D)[slots[ok]], ref_k[ok])
        assert torch.equal(v_cache.view(-1, KVH, DV)[slots[ok]], v[ok])
    else:
        fmt = kv_quant.FORMATS["int8"]
        for cache, sc, x, d in ((k_cache, ks, ref_k, D), (v_cache, vs, v, DV)):
            want, want_s = kv_quant.quantize(x[ok], fmt)
            assert torch.equal(cache.view(-1, KVH, d)[slots[ok]], want)
            assert torch.equal(sc.view(-1, KVH)[slots[ok]], want_s)
    assert v_cache.view(-1, KVH * DV)[[i for i in range(12) if i not in (4, 9)]].eq(0).all()


def test_fp8_rounding_matches_torch():
    """fp8 values across the format's range, subnormals and exact ties included, round as torch's cast does."""
    D = 128
    g = torch.Generator().manual_seed(3)
    mags = torch.exp2(torch.empty(D - 8).uniform_(-12, 8.8, generator=g)) * torch.randn(D - 8, generator=g).sign()
    ties = torch.tensor([1.0625, 1.1875, -3.375, 0.5 + 2**-5, 2**-9 * 1.5, 2**-9 * 2.5, 127.9, -250.0])
    k = torch.cat([mags.clamp(-448, 448), ties]).view(1, 1, D)
    k[0, 0, 0] = 448.0  # scale 1.0: the values are cast as they are
    k_cache, v_cache, ks, vs = _caches(1, D, torch.float8_e4m3fn)
    rc.rope_and_cache(torch.zeros(1, 1, D), k, k.clone(), None, None, torch.tensor([5]), k_cache, v_cache, ks, vs)
    assert torch.equal(k_cache.view(-1, D)[5].view(torch.uint8), k.view(D).to(torch.float8_e4m3fn).view(torch.uint8))
    assert ks.view(-1)[5].item() == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("D", [64, 128])
def test_rope_and_cache_cuda(D, cache_dtype):
    _check(T=7, H=8, KVH=2, D=D, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda")
    _check(T=7, H=8, KVH=2, D=D, dtype=torch.float32, cache_dtype=torch.float32, device="cuda")
