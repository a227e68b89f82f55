"""The CPU GEMV kernel gives F.linear's results (it only changes the summation order)."""

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="needs an x86 CPU with AVX2 and a compiler")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])  # other summation order
@pytest.mark.parametrize("rows", [1, 2, 5, 16])  # 5 and 16: a group of 4 rows and a remainder
@pytest.mark.parametrize("shape", [(96, 64), (130, 77), (5, 4864)])  # tails: 77 and 130 are not multiples of 32
def test_matches_f_linear(dtype, tol, rows, shape):
    g = torch.Generator().manual_seed(0)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    assert cpu_gemv.usable(x, w)
    ref = F.linear(x.float(), w.float(), b.float())
    got = cpu_gemv.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    assert ((got.float() - ref).abs() / (ref.abs() + 1)).max() < tol


def test_runs_on_every_thread():
    """The kernel's parallel_for needs OpenMP compiled in; without it the split silently ran on one thread."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread")
    assert cpu_gemv.parallel_threads() == torch.get_num_threads()


def test_falls_back_for_big_batches_and_odd_inputs():
    w = torch.randn(8, 16)
    assert not cpu_gemv.usable(torch.randn(64, 16), w)
    assert not cpu_gemv.usable(torch.randn(1, 16), w, torch.randn(8, dtype=torch.bfloat16))
    assert not cpu_gemv.usable(torch.randn(1, 16, dtype=torch.float16), w.half())
    assert not cpu_gemv.usable(torch.randn(1, 16), w.t().contiguous().t())
    x = torch.randn(64, 16)
    assert torch.equal(cpu_gemv.linear(x, w), F.linear(x, w))
