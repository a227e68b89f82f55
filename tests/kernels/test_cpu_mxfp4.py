"""The MXFP4 GEMV kernel equals dequantize-then-matmul, in fp32 and bf16, at this CPU's ISA level and at forced
AVX2 (a process of its own); the kernel's dequantization equals fulcrum.quant.mxfp4's, which decodes what
`quantize` encodes."""

import os
import subprocess
import sys

import pytest
import torch

from fulcrum.kernels import cpu_ext, cpu_mxfp4
from fulcrum.quant import mxfp4

needs_kernel = pytest.mark.skipif(not cpu_mxfp4.available(), reason="no AVX2 CPU kernels here")


def _weight(rows=72, cols=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 4, (rows, 1), generator=g).float())
    return mxfp4.quantize(w)


def test_every_e2m1_value_and_exponent_roundtrips():
    values = torch.tensor(mxfp4.FP4_VALUES).repeat(4).view(2, 32)  # each code twice per row: one full block
    for exp in (-20, 0, 7):
        blocks, scales = mxfp4.quantize(values * 2.0**exp)
        assert torch.equal(mxfp4.dequantize(blocks, scales), values * 2.0**exp)
        assert scales.tolist() == [[127 + exp]] * 2  # the largest magnitude, 6, needs no further exponent


@needs_kernel
def test_the_kernel_dequantizes_as_the_reference():
    blocks, scales = _weight()
    ref = mxfp4.dequantize(blocks, scales)
    assert torch.equal(cpu_mxfp4.dequantize(blocks, scales, torch.float32), ref)
    assert torch.equal(cpu_mxfp4.dequantize(blocks, scales, torch.bfloat16), ref.bfloat16())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_the_gemv_matches_dequantize_then_matmul(rows, dtype, bias):
    blocks, scales = _weight()
    w = mxfp4.dequantize(blocks, scales)
    x = torch.randn(rows, w.shape[1]).to(dtype)
    b = torch.randn(w.shape[0]).to(dtype) if bias else None
    ref = x.float() @ w.T + (b.float() if bias else 0)
    got = cpu_mxfp4.gemv(x, blocks, scales, b)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    else:  # the fp32 sum rounded once to bf16
        torch.testing.assert_close(got.float(), ref.bfloat16().float(), atol=0, rtol=2**-7)


def test_linear_takes_many_rows_through_the_dequantized_weight():
    blocks, scales = _weight()
    x = torch.randn(40, 160)
    torch.testing.assert_close(mxfp4.linear(x, blocks, scales), x @ mxfp4.dequantize(blocks, scales).T)


@needs_kernel
@pytest.mark.skipif(cpu_ext.isa() == "avx2", reason="this CPU is AVX2 already: the tests above ran there")
def test_the_kernel_at_forced_avx2():
    env = {**os.environ, "FULCRUM_CPU_ISA": "avx2"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not forced"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout
