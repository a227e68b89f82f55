"""The field's worked example, and what the calculator tells a user who asks for too much."""

import json

import pytest

from fulcrum.plan.advice import what_to_do
from fulcrum.plan.catalog import get_hardware, load_catalog
from fulcrum.plan.memory import plan_memory
from fulcrum.plan.model_spec import from_config

# A dense 70B model: 80 layers, 8 KV heads of 128, 16-bit (Llama 3 70B's shape)
DENSE_70B = {
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def plan(weight_dtype="bf16", kv_dtype="bf16", hardware="H100-SXM", concurrency=1, **kw):
    return plan_memory(
        from_config(DENSE_70B, "dense-70b"), get_hardware(hardware), weight_dtype, kv_dtype, 32768, concurrency, **kw
    )


def test_worked_example_weights_kv_and_one_long_sequence():
    assert plan("bf16").weight_bytes == pytest.approx(140e9, rel=0.01)
    assert plan("fp8").weight_bytes == pytest.approx(70e9, rel=0.01)
    assert plan("int8").weight_bytes == pytest.approx(70e9, rel=0.01)
    assert plan("int4").weight_bytes == pytest.approx(35e9, rel=0.01)
    m = plan("bf16")
    assert m.kv_per_token == 327_680 == 320 * 1024
    assert m.kv_per_sequence == 327_680 * 32768 == 10 * 2**30  # 10.7 GB
    assert round(m.kv_per_sequence / 1e9, 1) == 10.7


def test_worked_example_does_not_fit_one_80gb_gpu_and_names_the_levers():
    spec, hw = from_config(DENSE_70B, "dense-70b"), get_hardware("H100-SXM")
    m = plan("bf16")
    assert hw.memory_bytes == 80e9 and not m.weights_fit and not m.fits and m.max_concurrency == 0
    advice = what_to_do(spec, hw, m, load_catalog())
    assert "do not fit on one H100-SXM" in advice[0]
    text = "\n".join(advice)
    assert "8-bit 70.6 GB" in text and "4-bit 35.3 GB" in text and "int4 fits on one H100-SXM" in text
    assert "TP=4" in text  # 141 GB over 2 cards leaves no room for a 10.7 GB sequence; 4 do
    assert "a larger card: B200, B300, MI300X, MI325X" in text
    assert m.min_gpus == 4 and m.suggested_tp == 4


def test_split_over_gpus_shards_weights_and_kv():
    m = plan("bf16", concurrency=8, tp=4)
    assert m.weights_per_gpu == pytest.approx(plan("bf16").weight_bytes / 4)
    assert m.kv_per_gpu == pytest.approx(8 * 10 * 2**30 / 4)  # 8 KV heads split over 4 ranks
    assert m.fits and m.max_concurrency >= 8


def test_kv_limits_concurrency_and_fp8_kv_doubles_it():
    m = plan("fp8", hardware="H200", concurrency=64)
    assert m.weights_fit and 1 <= m.max_concurrency < 64
    spec, hw = from_config(DENSE_70B, "dense-70b"), get_hardware("H200")
    text = "\n".join(what_to_do(spec, hw, m, load_catalog()))
    assert "KV cache limits concurrency" in text and "quantize the KV cache to fp8" in text
    # one byte a value and fulcrum's fp16 scale per token and head: 130 bytes a 128-wide head against 256
    fp8_kv = plan("fp8", kv_dtype="fp8", hardware="H200").max_concurrency
    assert int(1.9 * m.max_concurrency) <= fp8_kv <= 2 * m.max_concurrency + 1


def test_catalog_has_every_required_card_with_sources():
    catalog = load_catalog()
    for name in (
        "H100-SXM",
        "H100-PCIe",
        "H200",
        "B200",
        "B300",
        "A100-80GB",
        "L40S",
        "L4",
        "RTX-4090",
        "MI300X",
        "MI325X",
    ):
        hw = catalog[name]
        assert hw.memory_bytes > 0 and hw.bandwidth > 0 and hw.flops["bf16"] > 0 and hw.source
    assert "fp4" in catalog["B200"].formats and "fp8" not in catalog["A100-80GB"].formats
    raw = json.loads((__import__("fulcrum.plan.catalog").plan.catalog.CATALOG).read_text())
    assert all("source" in e for e in raw["gpus"].values())


def test_unknown_hardware_lists_the_names():
    with pytest.raises(ValueError, match="H100-SXM.*MI325X.*local"):
        get_hardware("TPU-v9")
