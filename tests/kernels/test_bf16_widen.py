"""bf16 matmuls on CPUs without native bf16 (AVX2, AVX-512 without BF16): the weight is widened to fp32 for the call,
a block of rows at a time, and the results are F.linear's in fp32, rounded to bf16. Above those levels torch's own
bf16 matmul stays."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels import cpu_gemv, cpu_qgemv
from fulcrum.layers.linear import ColumnParallelLinear
from fulcrum.quant.online import Int8Method
from fulcrum.utils import cpu_isa


def close_to_fp32(got, x, w, b=None):
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [16, 300])
@pytest.mark.parametrize("block_bytes", [cpu_gemv.WIDEN_BYTES, 4 * 96 * 7])  # one block; blocks of 7 rows and a tail
def test_widened_linear_matches_fp32(monkeypatch, rows, block_bytes):
    monkeypatch.setattr(cpu_gemv, "WIDEN_BYTES", block_bytes)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 96, generator=g).bfloat16()
    b = torch.randn(100, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    close_to_fp32(cpu_gemv.widened_linear(x, w, b), x, w, b)
    close_to_fp32(cpu_gemv.widened_linear(x.reshape(2, rows // 2, 96), w), x.reshape(2, rows // 2, 96), w)


def test_linear_widens_only_many_bf16_rows_where_torch_emulates_bf16(monkeypatch):
    calls = []
    widen = cpu_gemv.widened_linear
    monkeypatch.setattr(cpu_gemv, "widened_linear", lambda *a: calls.append(a[0].shape) or widen(*a))
    monkeypatch.setattr(cpu_gemv, "native_bf16_matmul", lambda: False)
    w = torch.randn(64, 48).bfloat16()
    x = torch.randn(cpu_gemv.WIDEN_MIN_ROWS + 50, 48).bfloat16()
    close_to_fp32(cpu_gemv.linear(x, w), x, w)
    assert calls == [x.shape]
    cpu_gemv.linear(x[:2].reshape(1, 2, 48), w)  # few rows (past the GEMV: 3-D): torch's own matmul
    cpu_gemv.linear(x.float(), w.float())  # fp32
    assert len(calls) == 1
    monkeypatch.setattr(cpu_gemv, "native_bf16_matmul", lambda: True)
    cpu_gemv.linear(x, w)
    assert len(calls) == 1


@pytest.mark.skipif(not cpu_qgemv.available(), reason="needs the quantized kernels (x86, a compiler)")
def test_a_quantized_layer_dequantizes_to_fp32_where_torch_emulates_bf16(monkeypatch):
    layer = ColumnParallelLinear(96, 80, dtype=torch.bfloat16, quant_method=Int8Method())
    layer.weight.data.copy_(torch.randn(80, 96))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(200, 96).bfloat16()
    asked = []
    fast = layer.quant_method.dequantize_fast
    monkeypatch.setattr(layer.quant_method, "dequantize_fast", lambda lay, dt: asked.append(dt) or fast(lay, dt))
    monkeypatch.setattr(cpu_gemv, "native_bf16_matmul", lambda: False)
    close_to_fp32(layer(x), x, layer.quant_method.dequantize(layer))
    monkeypatch.setattr(cpu_gemv, "native_bf16_matmul", lambda: True)
    layer(x)
    assert asked == [torch.float32, torch.bfloat16]


def test_the_forced_levels_below_avx512_bf16_take_the_widened_path():
    code = "from fulcrum.kernels import cpu_gemv; print(cpu_gemv.native_bf16_matmul())"
    native = cpu_isa.ISA_LEVELS.index(cpu_isa.detected_isa()) >= cpu_isa.ISA_LEVELS.index("avx512_bf16")
    for level, want in [("avx2", False), ("avx512", False), (None, native)]:
        env = {k: v for k, v in os.environ.items() if k != "FULCRUM_CPU_ISA"}
        if level:
            env["FULCRUM_CPU_ISA"] = level
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == str(want), level
