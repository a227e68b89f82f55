"""The weight formats round-trip within half a quantization step, and int4's packing is the one documented."""

import pytest
import torch

from fulcrum.quant import formats


def test_int8_error_is_within_half_a_step_per_channel():
    w = torch.randn(48, 200) * torch.linspace(0.01, 3, 48)[:, None]  # channels of very different ranges
    q, scale = formats.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (48,)
    err = (formats.dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_is_within_half_a_step_per_group_and_zero_is_exact(group):
    w = torch.randn(16, 256)
    w[:, :group] = w[:, :group].abs()  # a group with no negative value: its range is stretched to hold 0
    w[3, 5] = 0.0
    packed, scale, offset = formats.quantize_int4(w, group)
    assert packed.shape == (16, 128) and packed.dtype == torch.uint8 and scale.shape == (16, 256 // group)
    deq = formats.dequantize_int4(packed, scale, offset)
    step = scale.repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    assert deq[3, 5] == 0.0


def test_int4_packing_puts_value_j_and_j_plus_16_in_one_byte():
    q = torch.arange(64).remainder(16).reshape(1, 64)
    packed = formats.pack_int4(q)
    assert packed[0, 0].item() == 0 | (0 << 4) and packed[0, 1].item() == 1 | (1 << 4)
    q = torch.randint(0, 16, (3, 96))
    assert torch.equal(formats.unpack_int4(formats.pack_int4(q)), q.to(torch.uint8))
    assert formats.pack_int4(q)[1, 2].item() == int(q[1, 2]) | int(q[1, 18]) << 4


def test_fp8_keeps_e4m3s_relative_precision_per_channel():
    w = torch.randn(32, 256) * torch.linspace(0.01, 3, 32)[:, None]
    q, scale = formats.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (32,)
    deq = formats.dequantize_fp8(q, scale)
    normal = w.abs() >= scale[:, None] * 2**-6  # e4m3's normal range: 3 mantissa bits, a relative step of 1/16
    assert ((deq - w).abs() <= w.abs() / 16 + 1e-12)[normal].all()
    assert ((deq - w).abs() <= scale[:, None] * 2**-10)[~normal].all()  # subnormals: half of 2^-9 of the scale
    assert (deq.abs().amax(1) - w.abs().amax(1)).abs().max() < 1e-5  # the channel's largest value is exact


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a GPU with fp8 tensor cores",
)
def test_fp8_scaled_mm_on_cuda_matches_the_dequantized_matmul():
    from fulcrum.quant.online import fp8_scaled_mm, scaled_mm_usable

    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(256, 512, generator=g), torch.randn(7, 512, generator=g), torch.randn(256, generator=g)
    q, scale = formats.quantize_fp8(w)
    q, scale, x, b = q.cuda(), scale.cuda(), x.cuda().bfloat16(), b.cuda().bfloat16()
    assert scaled_mm_usable(x, q)
    got = fp8_scaled_mm(x, q, scale, b).float()
    want = x.float() @ formats.dequantize_fp8(q, scale).T + b.float()
    # the input's own fp8 rounding (3 mantissa bits) on top of the weight's
    assert ((got - want).abs().max() / want.abs().max()) < 0.05
