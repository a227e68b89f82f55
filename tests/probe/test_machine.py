"""The machine probe times fulcrum's own decoder layers (fulcrum.models) at a model's shape, and stays quiet."""

import dataclasses
import os

import pytest
import torch

from fulcrum.config import DEFAULT_MODEL
from fulcrum.models.llama import LlamaDecoderLayer
from fulcrum.plan.model_spec import load_model_spec
from fulcrum.plan.roofline import OnlineQuant
from fulcrum.probe import machine
from fulcrum.probe.machine import (
    decoder_layers,
    layer_linears,
    measure_bandwidth,
    measure_framework_cost,
    quantized_linear,
)

SMALL = dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128)


@pytest.mark.parametrize(
    ("preset", "qkv_bias", "o_bias", "qk_norm"),
    [("llama-3.1-8b", False, False, False), ("qwen2.5-7b", True, False, False), ("qwen3-8b", False, False, True)],
)
def test_the_probe_builds_the_models_own_layer_with_its_switches(preset, qkv_bias, o_bias, qk_norm):
    spec = dataclasses.replace(load_model_spec(preset), **SMALL)  # the family's switches at a small shape
    layers, rope, meta = decoder_layers(spec, torch.float32, layers=2, context=40)
    assert len(layers) == 2 and all(isinstance(layer, LlamaDecoderLayer) for layer in layers)
    attn = layers[0].self_attn
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None, attn.qk_norm) == (qkv_bias, o_bias, qk_norm)
    assert [tuple(lin.weight.shape) for lin in layer_linears(layers[0])] == [(128, 64), (64, 64), (256, 64), (64, 128)]
    with torch.inference_mode():
        h = torch.randn(1, 64)
        for layer in layers:  # one token decoding over 40 cached ones, as a step runs the layers
            h = layer(rope, h, meta)
    assert h.shape == (1, 64) and torch.isfinite(h).all()


def test_framework_cost_is_measured_and_kineto_is_silenced_unless_the_user_chose(monkeypatch):
    spec = load_model_spec(DEFAULT_MODEL)
    monkeypatch.setenv("KINETO_LOG_LEVEL", "")  # so that teardown restores the environment the test found
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    per_layer, per_op = measure_framework_cost(spec, "fp32", context=32, repeats=1)
    assert per_layer >= 0 and per_op >= 0
    assert os.environ["KINETO_LOG_LEVEL"] == "6"  # set before the profiler's first use: no "USDT:" lines
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")
    measure_framework_cost(spec, "fp32", context=32, repeats=1)
    assert os.environ["KINETO_LOG_LEVEL"] == "2"


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("int8", "int8"), ("int4", "fp8")])
def test_the_probe_quantizes_layers_and_cache_as_the_engine_does(quantization, kv_cache_dtype):
    spec = dataclasses.replace(load_model_spec("llama-3.1-8b"), **SMALL)
    layers, rope, meta = decoder_layers(
        spec,
        torch.float32,
        layers=2,
        context=40,
        quant=OnlineQuant(quantization, 32),
        kv_cache_dtype=kv_cache_dtype,
    )
    for lin in layer_linears(layers[0]):  # the loaded weight is gone, the engine's packed one in its place
        assert not hasattr(lin, "weight") and lin.qweight.dtype == (
            torch.uint8 if quantization == "int4" else torch.int8
        )
    attn = layers[0].self_attn.attn
    assert attn.kv_format.name == kv_cache_dtype and attn.k_scales is not None
    with torch.inference_mode():
        h = torch.randn(1, 64)
        for layer in layers:
            h = layer(rope, h, meta)
    assert h.shape == (1, 64) and torch.isfinite(h).all()


def test_quantized_weight_streaming_counts_the_packed_bytes(monkeypatch):
    monkeypatch.setattr(machine, "_median_time", lambda fn, repeats: (fn(), 1.0)[1])  # one second: rate = bytes
    matrices = [(256, 256), (512, 256)]
    for quantization, group_size in [("int4", 128), ("int8", 128), ("fp8", 128), (None, 128)]:
        fmt = OnlineQuant(quantization, group_size) if quantization else None
        rate = measure_bandwidth("fp32", matrices, quant=fmt)
        # what plan predicts for the format: int4 half a byte a weight + 2 fp32 per group, int8/fp8 1 byte + 1 fp32 a row
        assert rate == sum(fmt.matrix_bytes(o, i) if fmt else o * i * 4 for o, i in matrices)
    _, fn = quantized_linear(torch.randn(64, 256), OnlineQuant("int4", 128))
    assert fn(torch.randn(3, 256)).shape == (3, 64)  # the engine's quantized layer, output in the input's dtype
