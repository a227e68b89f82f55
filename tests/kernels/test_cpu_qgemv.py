"""The quantized GEMV computes x @ dequant(W)^T + b, the dequantized weight being the formats' reference."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels import cpu_qgemv, cpu_qgemv_vnni
from fulcrum.quant import formats

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="needs an x86 CPU with AVX2 and a compiler")


def close(got, ref, tol):
    return ((got.float() - ref).abs() / (ref.abs() + 1)).max() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 64])  # 7: a group of 4 rows and a remainder of 3
@pytest.mark.parametrize("shape", [(96, 64), (130, 77), (5, 4864)])  # 77: a tail past the vector loop
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_int8_and_fp8_match_the_dequantized_weight(dtype, tol, rows, shape, fmt):
    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(shape, generator=g), torch.randn(rows, shape[1], generator=g), torch.randn(shape[0])
    w[0, :5] = torch.tensor([1e-9, -1e-7, 3e-6, 0.0, -0.0])  # fp8 subnormals and zeros
    q, scale = getattr(formats, f"quantize_{fmt}")(w)
    x, b = x.to(dtype), b.to(dtype)
    ref = F.linear(x.float(), getattr(formats, f"dequantize_{fmt}")(q, scale), b.float())
    got = cpu_qgemv.int8(x, q, scale, b)
    assert got.dtype == dtype and got.shape == (rows, shape[0]) and close(got, ref, tol)
    assert close(cpu_qgemv.int8(x, q, scale), ref - b.float(), tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("group, shape", [(32, (96, 64)), (64, (130, 192)), (128, (7, 4864))])
def test_int4_matches_the_dequantized_weight(dtype, tol, rows, group, shape):
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(shape, generator=g), torch.randn(rows, shape[1], generator=g), torch.randn(shape[0])
    packed, scale, offset = formats.quantize_int4(w, group)
    x, b = x.to(dtype), b.to(dtype)
    ref = F.linear(x.float(), formats.dequantize_int4(packed, scale, offset), b.float())
    got = cpu_qgemv.int4(x, packed, scale, offset, group, b)
    assert got.dtype == dtype and close(got, ref, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int4_without_offsets_has_the_zero_point_8(dtype, tol, rows):
    """GGUF's Q4_0: W = (q - 8) * scale, its offsets unstored."""
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (40, 448), generator=g, dtype=torch.uint8)
    scale, x = torch.rand(40, 28, generator=g) * 0.01, torch.randn(rows, 896, generator=g).to(dtype)
    deq = formats.dequantize_int4(packed, scale, None)
    assert torch.equal(deq, formats.dequantize_int4(packed, scale, -8 * scale))
    assert close(cpu_qgemv.int4(x, packed, scale, None, 32), F.linear(x.float(), deq), tol)
    assert close(cpu_qgemv.dequantize_int4(packed, scale, None, 32, torch.float32), deq, 1e-6)
    if cpu_qgemv_vnni.usable(x):
        assert close(cpu_qgemv_vnni.int4(x, packed, scale, None, 32), F.linear(q8_blocks(x), deq), tol)


def test_int5_packs_and_unpacks_every_value():
    q = torch.randint(0, 32, (5, 192), generator=torch.Generator().manual_seed(5))
    packed, high = formats.pack_int5(q)
    assert packed.shape == (5, 96) and high.shape == (5, 24)
    assert torch.equal(formats.unpack_int5(packed, high), q)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
@pytest.mark.parametrize("offset", [False, True])
def test_int5_matches_the_dequantized_weight(dtype, tol, rows, offset):
    """GGUF's Q5_0 (zero point 16, no offsets) and Q5_1/Q5_K (an offset per 32) as int4 nibbles and a bit plane."""
    g = torch.Generator().manual_seed(6)
    packed, high = formats.pack_int5(torch.randint(0, 32, (40, 896), generator=g))
    scale = torch.rand(40, 28, generator=g) * 0.01
    off = torch.randn(40, 28, generator=g) * 0.1 if offset else None
    x = torch.randn(rows, 896, generator=g).to(dtype)
    deq = formats.dequantize_int5(packed, high, scale, off)
    assert close(cpu_qgemv.int5(x, packed, high, scale, off), F.linear(x.float(), deq), tol)
    assert close(cpu_qgemv.dequantize_int5(packed, high, scale, off, torch.float32), deq, 1e-6)
    if cpu_qgemv_vnni.usable(x):
        assert close(cpu_qgemv_vnni.int5(x, packed, high, scale, off), F.linear(q8_blocks(x), deq), tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("shape", [(96, 64), (7, 896)])
def test_grouped_int8_matches_the_dequantized_weight(dtype, tol, rows, group, offset, shape):
    """GGUF's Q8_0/Q5_*/Q6_K/Q3_K/Q2_K layout: int8 in groups of 16 or 32, a scale and maybe an offset each."""
    g = torch.Generator().manual_seed(3)
    w, x, b = torch.randn(shape, generator=g), torch.randn(rows, shape[1], generator=g), torch.randn(shape[0])
    q, scale, off = formats.quantize_int8g(w, group, offset)
    x, b = x.to(dtype), b.to(dtype)
    deq = formats.dequantize_int8g(q, scale, off)
    ref = F.linear(x.float(), deq, b.float())
    got = cpu_qgemv.int8g(x, q, scale, off, group, b)
    assert got.dtype == dtype and close(got, ref, tol)
    assert close(cpu_qgemv.dequantize_int8g(q, scale, off, group, torch.float32), deq, 1e-6)  # one rounding (FMA)
    if cpu_qgemv_vnni.usable(x, b):
        ref = F.linear(q8_blocks(x), deq, b.float())
        assert close(cpu_qgemv_vnni.int8g(x, q, scale, off, group, b), ref, tol)


def test_the_whole_weight_dequantizes_as_the_reference_does():
    w = torch.randn(70, 256)
    q, scale = formats.quantize_int8(w)
    assert torch.equal(cpu_qgemv.dequantize_int8(q, scale), formats.dequantize_int8(q, scale))
    bf = cpu_qgemv.dequantize_int8(q, scale, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, formats.dequantize_int8(q, scale).bfloat16())
    w[0, :3] = torch.tensor([1e-7, -3e-6, 0.0])  # subnormals
    q, scale = formats.quantize_fp8(w)
    q[1, 7] = torch.tensor(-0.0, dtype=torch.float8_e4m3fn)
    ref = formats.dequantize_fp8(q, scale)
    assert torch.allclose(cpu_qgemv.dequantize_int8(q, scale), ref, rtol=1e-6, atol=0)
    assert torch.equal(cpu_qgemv.dequantize_int8(q, scale, torch.bfloat16), ref.bfloat16())
    for group in (32, 128):
        packed, s, m = formats.quantize_int4(w, group)
        ref = formats.dequantize_int4(packed, s, m)
        assert torch.allclose(cpu_qgemv.dequantize_int4(packed, s, m, group), ref, atol=1e-6)
        bf = cpu_qgemv.dequantize_int4(packed, s, m, group, torch.bfloat16).float()
        assert torch.allclose(bf, ref, rtol=1e-2, atol=1e-6)


def test_few_rows_only():
    rows = cpu_qgemv.max_rows(torch.float32)
    assert cpu_qgemv.usable(torch.randn(rows, 8))
    assert not cpu_qgemv.usable(torch.randn(rows + 1, 8))
    assert not cpu_qgemv.usable(torch.randn(1, 8, dtype=torch.float16))
    assert not cpu_qgemv.usable(torch.randn(1, 8), torch.randn(8, dtype=torch.bfloat16))


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the VNNI kernel sees it: int8 in blocks of 32, a scale per block (amax / 127), times its reciprocal and
    rounded to nearest (a value x / s rounds the other way at a tie, and that one step shows in the sums)."""
    b = x.float().reshape(x.shape[0], -1, 32)
    s = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s > 0, 1 / torch.where(s > 0, s, 1), 0)
    return (torch.round(b * inv).clamp(-127, 127) * s).reshape(x.shape)


@pytest.mark.skipif(not cpu_qgemv_vnni.available(), reason="needs AVX-512 VNNI (and BF16) and a compiler")
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 17, 32])
@pytest.mark.parametrize("group, shape", [(32, (96, 64)), (64, (130, 192)), (128, (40, 896))])
def test_vnni_int8_and_int4_match_the_dequantized_weight_on_the_quantized_input(rows, group, shape):
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(shape, generator=g), torch.randn(rows, shape[1], generator=g), torch.randn(shape[0])
    x, b = x.bfloat16(), b.bfloat16()
    xq = q8_blocks(x)
    q, scale = formats.quantize_int8(w)
    tol = 2e-2  # the bf16 output's rounding, as for the widening GEMV's bf16 results
    assert close(cpu_qgemv_vnni.int8(x, q, scale, b), F.linear(xq, formats.dequantize_int8(q, scale), b.float()), tol)
    packed, s, m = formats.quantize_int4(w, group)
    ref = F.linear(xq, formats.dequantize_int4(packed, s, m), b.float())
    assert close(cpu_qgemv_vnni.int4(x, packed, s, m, group, b), ref, tol)
    assert cpu_qgemv_vnni.usable(x) and not cpu_qgemv_vnni.usable(x.float()) and not cpu_qgemv_vnni.usable(x[:, :32])
    assert not cpu_qgemv_vnni.usable(x.repeat(cpu_qgemv_vnni.MAX_ROWS + 1, 1))  # more rows: the dense matmul


FP8G_CHECK = """
import torch
from fulcrum.kernels import cpu_qgemv
g = torch.Generator().manual_seed(1)
for group, (o, i) in [(16, (96, 64)), (128, (130, 512)), (48, (7, 4848))]:
    q = torch.randn(o, i, generator=g).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[0, :4] = torch.tensor([0, 0x80, 0x01, 0x87], dtype=torch.uint8)  # zeros and subnormals
    scale = torch.rand(o, i // group, generator=g) + 0.25
    w = (q.float().view(o, -1, group) * scale[..., None]).view(o, i)
    assert torch.equal(cpu_qgemv.dequantize_fp8g(q, scale, group), w)
    assert torch.equal(cpu_qgemv.dequantize_fp8g(q, scale, group, torch.bfloat16), w.bfloat16())
    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)]:
        for rows in (1, 3, 4, 7, 16):
            x, b = torch.randn(rows, i, generator=g).to(dtype), torch.randn(o, generator=g).to(dtype)
            ref = x.float() @ w.T + b.float()
            got = cpu_qgemv.fp8g(x, q, scale, group, b)
            assert got.dtype == dtype and ((got.float() - ref).abs() / (ref.abs() + 1)).max() < tol, (group, rows)
print(cpu_qgemv.level())
"""


@pytest.mark.parametrize("level", [None, "avx2"])
def test_fp8_with_a_scale_per_block_of_inputs_matches_the_widened_weight(level):
    """Block-wise fp8 checkpoints' layout (a scale per row and block of inputs) at this CPU's level and forced to
    AVX2: the kernel reads fp8 zeros and subnormals as the format defines them, and its widening is exact."""
    env = {**os.environ, "FULCRUM_CPU_ISA": level} if level else dict(os.environ)  # None: this process' level
    res = subprocess.run([sys.executable, "-c", FP8G_CHECK], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (level or cpu_qgemv.level())
