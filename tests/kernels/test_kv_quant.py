"""The quantized KV cache (--kv-cache-dtype fp8|int8): the format's round trip, the fused rope kernel writing
exactly what the PyTorch reference writes, and decode attention over it matching attention over the dequantized
values, through the kernel and through the PyTorch fallback alike."""

import pytest
import torch

from fulcrum.kernels import cpu_attention, cpu_rope
from fulcrum.layers.attention import Attention, AttentionMetadata
from fulcrum.layers.rotary import RotaryEmbedding, apply_rotary
from fulcrum.quant import kv as kv_quant
from tests.kernels.test_cpu_attention import paged, reference

FORMATS = ["int8", "fp8"]
needs_kernels = pytest.mark.skipif(
    not (cpu_attention.available(True) and cpu_rope.available()), reason="needs an x86 CPU with AVX2 and a compiler"
)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_within_the_format_step(name):
    fmt = kv_quant.FORMATS[name]
    x = torch.randn(50, 4, 64) * torch.rand(50, 4, 1) * 10
    x[3, 1] = 0  # an all-zero head: scale 0, values 0
    q, scale = kv_quant.quantize(x, fmt)
    assert q.dtype == fmt.dtype and scale.dtype == torch.float16 and scale.shape == (50, 4)
    back = kv_quant.dequantize(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of amax / 127; fp8 e4m3: 3 mantissa bits, half a unit in the last place (1/16 relative),
    # plus what rounding the scale to fp16 moves the largest value (2^-11 relative)
    bound = amax / 254 + amax * 2**-10 if name == "int8" else x.abs() / 16 + amax * 2**-9 + 1e-6
    assert ((back - x).abs() <= bound + 1e-7).all()
    assert scale[3, 1] == 0 and (back[3, 1] == 0).all()


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_writes_what_the_reference_quantizes(name, dtype):
    fmt = kv_quant.FORMATS[name]
    tokens, heads, kv_heads, hd = 37, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=g) * 3).to(dtype)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = (t.view(tokens, -1, hd) for t in (q, k, v))
    cos, sin = RotaryEmbedding(hd, 512, {"rope_type": "default", "rope_theta": 10000.0})(
        torch.randint(0, 500, (tokens,), generator=g), dtype
    )
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    want_q, want_k = apply_rotary(q, k, cos, sin)
    kq, ks = kv_quant.quantize(want_k, fmt)
    vq, vs = kv_quant.quantize(v, fmt)

    kc = torch.zeros(8, 16, kv_heads, hd, dtype=fmt.dtype)
    vc = torch.zeros_like(kc)
    ksc = torch.zeros(8, 16, kv_heads, dtype=torch.float16)
    vsc = torch.zeros_like(ksc)
    assert cpu_rope.usable(q, k, v, cos, sin, kc)
    cpu_rope.rope_and_cache(q, k, v, cos, sin, slots, kc, vc, ksc, vsc)
    assert torch.equal(q, want_q)
    flat = kc.view(torch.uint8).view(-1, kv_heads, hd)[slots]
    assert torch.equal(flat, kq.view(torch.uint8)), "k values differ from the reference's"
    assert torch.equal(vc.view(torch.uint8).view(-1, kv_heads, hd)[slots], vq.view(torch.uint8))
    assert torch.equal(ksc.view(-1, kv_heads)[slots], ks) and torch.equal(vsc.view(-1, kv_heads)[slots], vs)


def quantized_paged(ctxs, heads, kv_heads, hd, block, name, seed=0):
    q, kc, vc, tables, lens = paged(ctxs, heads, kv_heads, hd, block, torch.float32, seed)
    fmt = kv_quant.FORMATS[name]
    (kq, ks), (vq, vs) = kv_quant.quantize(kc * 4, fmt), kv_quant.quantize(vc, fmt)
    return q, (kq, vq, ks, vs), tables, lens


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctxs, heads, kv_heads, hd, window", [([1, 17, 300], 14, 2, 64, None), ([40, 90], 8, 8, 128, 32)]
)
def test_decode_kernel_reads_the_quantized_cache(name, dtype, ctxs, heads, kv_heads, hd, window):
    q, (kq, vq, ks, vs), tables, lens = quantized_paged(ctxs, heads, kv_heads, hd, 16, name)
    q = q.to(dtype)
    assert cpu_attention.usable(q, kq, kv_heads)
    got = cpu_attention.decode(q, kq, vq, tables, lens, hd**-0.5, window, ks, vs)
    kd, vd = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
    want = reference(q, kd, vd, tables, lens, hd**-0.5, window)
    assert (got.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("name", FORMATS)
def test_attention_layer_decodes_and_prefills_from_the_quantized_cache(name, monkeypatch):
    """The layer's decode (kernel and PyTorch fallback) and a prefill chunk over cached context both attend over
    the dequantized cache."""
    fmt = kv_quant.FORMATS[name]
    q, (kq, vq, ks, vs), tables, lens = quantized_paged([5, 123, 64], 14, 2, 64, 16, name)
    layer = Attention(14, 2, 64, 0.125)
    layer.set_cache(kq, vq, fmt, ks, vs)
    meta = AttentionMetadata(
        query_lens=[1, 1, 1], decode_block_tables=tables, decode_context_lens=lens, decode_max_context=123
    )
    kd, vd = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
    want = reference(q, kd, vd, tables, lens, 0.125, None)
    outs = [layer._decode(q, meta)]
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    outs.append(layer._decode(q, AttentionMetadata(**{**meta.__dict__, "shared": {}})))
    for out in outs:
        assert (out.double() - want).abs().max() < 1e-5
    # the last query of sequence 1 as a prefill chunk of one token over its 123 cached tokens
    ks_, vs_ = layer._gather(tables[1], 123, torch.float32)
    assert torch.allclose(ks_.double(), kd[tables[1]].flatten(0, 1)[:123], atol=1e-6)
    assert torch.allclose(vs_.double(), vd[tables[1]].flatten(0, 1)[:123], atol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
def test_fallback_write_matches_the_reference(name, monkeypatch):
    """Without the fused kernel the layer quantizes in PyTorch ops: same bytes, same scales."""
    fmt = kv_quant.FORMATS[name]
    monkeypatch.setattr(cpu_rope, "usable", lambda *a: False)
    layer = Attention(4, 2, 32, 32**-0.5)
    kc, vc = torch.zeros(4, 16, 2, 32, dtype=fmt.dtype), torch.zeros(4, 16, 2, 32, dtype=fmt.dtype)
    ksc, vsc = torch.zeros(4, 16, 2, dtype=torch.float16), torch.zeros(4, 16, 2, dtype=torch.float16)
    layer.set_cache(kc, vc, fmt, ksc, vsc)
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    slots = torch.tensor([5, 17, 40])
    meta = AttentionMetadata(query_lens=[3], slot_mapping=slots, prefills=[(0, 3, 3, 0)])
    layer(torch.randn(3, 4, 32), k, v, meta)
    kq, ks = kv_quant.quantize(k, fmt)
    assert torch.equal(kc.view(torch.uint8).view(-1, 2, 32)[slots], kq.view(torch.uint8))
    assert torch.equal(ksc.view(-1, 2)[slots], ks)
