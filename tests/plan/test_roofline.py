"""Roofline estimates behave as the physics says: batch-1 decode is weight reads over bandwidth, large batches
turn compute-bound, prefill is compute-bound, MoE batches read more experts, cost follows throughput."""

import pytest

from fulcrum.plan.catalog import get_hardware
from fulcrum.plan.model_spec import load_model_spec
from fulcrum.plan.roofline import Efficiency, batch_sizes, decode_step, prefill, weight_bytes_read
from fulcrum.utils.cost import cost_per_million_tokens

EXACT = Efficiency(bandwidth=1.0, compute=1.0)


def test_batch1_decode_is_weight_bytes_over_bandwidth():
    spec, hw = load_model_spec("llama-3.1-8b"), get_hardware("H100-SXM")
    d = decode_step(spec, hw, "bf16", "bf16", 1, 1, eff=EXACT)
    # 8.03B parameters less the 0.53B embedding table (looked up, not streamed), 2 bytes each, at 3.35 TB/s
    assert d.tpot_s == pytest.approx((8.03e9 - 128256 * 4096) * 2 / 3.35e12, rel=0.01)
    assert d.bound == "memory"
    # the efficiency factor divides the bandwidth
    assert decode_step(spec, hw, "bf16", "bf16", 1, 1).tpot_s == pytest.approx(d.tpot_s / 0.8, rel=0.01)


def test_large_batches_turn_compute_bound_and_throughput_grows():
    spec, hw = load_model_spec("llama-3.1-8b"), get_hardware("H100-SXM")
    points = [decode_step(spec, hw, "bf16", "fp8", b, 128, eff=EXACT) for b in batch_sizes(1024)]
    assert points[0].bound == "memory" and points[-1].bound == "compute"
    # throughput grows with the batch until compute caps it, then stays flat
    assert all(a.tokens_per_s <= b.tokens_per_s * 1.0001 for a, b in zip(points, points[1:]))
    assert points[-1].tokens_per_s > 100 * points[0].tokens_per_s
    assert all(a.tpot_s <= b.tpot_s for a, b in zip(points, points[1:]))


def test_fp8_weights_halve_batch1_decode_time():
    spec, hw = load_model_spec("llama-3.1-70b"), get_hardware("H100-SXM")
    bf16 = decode_step(spec, hw, "bf16", "bf16", 1, 1, tp=4).tpot_s
    fp8 = decode_step(spec, hw, "fp8", "bf16", 1, 1, tp=4).tpot_s
    assert fp8 < 0.6 * bf16


def test_prefill_is_compute_bound_at_2_flops_per_parameter_per_token():
    spec, hw = load_model_spec("llama-3.1-8b"), get_hardware("H100-SXM")
    p = prefill(spec, hw, "bf16", 4096, eff=EXACT)
    assert p.bound == "compute"
    assert p.flops > 2 * (8.03e9 - 2 * 128256 * 4096) * 4096  # plus causal attention
    assert p.seconds == pytest.approx(p.flops / 989.4e12, rel=0.01)


def test_moe_batch_reads_more_experts_up_to_all():
    spec = load_model_spec("mixtral-8x7b")
    one, many = weight_bytes_read(spec, "bf16", 1), weight_bytes_read(spec, "bf16", 256)
    assert one == pytest.approx((12.88e9 - 32000 * 4096) * 2, rel=0.01)  # 2 of 8 experts
    assert many == pytest.approx((46.7e9 - 32000 * 4096) * 2, rel=0.01)  # every expert


def test_cost_per_million_tokens_uses_every_gpu_hour():
    spec, hw = load_model_spec("llama-3.1-70b"), get_hardware("H100-SXM")
    d = decode_step(spec, hw, "bf16", "bf16", 32, 1152, tp=4, price_per_hour=2.0)
    assert d.cost_per_million == pytest.approx(cost_per_million_tokens(2.0, d.tokens_per_s, replicas=4))


def test_attention_measured_slower_than_matmuls_lengthens_prefill_by_its_own_rate():
    import dataclasses

    from fulcrum.plan.roofline import attention_flops

    spec, hw = load_model_spec("llama-3.1-8b"), get_hardware("H100-SXM")
    base = prefill(spec, hw, "bf16", 4096, eff=EXACT)
    slow = dataclasses.replace(hw, attention_flops=100e12)  # attention at ~1/10 of the matmul peak
    p = prefill(spec, slow, "bf16", 4096, eff=EXACT)
    attn = attention_flops(spec, 4096, 4096, causal=True)
    assert p.seconds == pytest.approx(base.seconds - attn / 989.4e12 + attn / 100e12, rel=1e-6)
