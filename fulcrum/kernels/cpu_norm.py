"""RMSNorm as one CPU kernel, for decode-sized inputs.

In a batch-1 CPU decode step the GEMVs stream the weights and everything else is overhead: PyTorch's
RMSNorm is 7 ops (cast, square, mean, rsqrt, multiply, cast, weight), each paying PyTorch's per-op
cost on a tiny row, and a 0.5B-shape step has 49 of them. This kernel is one pass. It keeps the reference
arithmetic: float32, cast to the input dtype, then times the weight, as HF transformers does
(the float32 sum of squares is taken in another order: within 1e-6 in float32, and in bf16 an
occasional output one rounding step away).
Built by `fulcrum.kernels.cpu_ext`; callers fall back to PyTorch ops where it is not available.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext

_SOURCE = (
    cpu_ext.PRELUDE
    + r"""
#include <cmath>

template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) { float v = float(xr[i]); ss += v * v; }
      const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
      // (x * rstd) rounded to T, then times the weight in T: the reference's two roundings
      for (int64_t i = 0; i < n; ++i) yr[i] = T(float(w[i]) * float(T(float(xr[i]) * inv)));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  auto y = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  if (x.scalar_type() == torch::kBFloat16)
    rms_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, n, float(eps));
  else
    rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, n, float(eps));
  return y;
}

"""
)

_DTYPES = (torch.bfloat16, torch.float32)
MAX_ELEMENTS = 16 * 4096


@functools.cache
def _module():
    # plain C++ loops: built with each level's flags, the compiler vectorises them for that level
    lvl = cpu_ext.best("avx512_bf16", "avx512", "avx2")
    name = "fulcrum_cpu_norm" if lvl == "avx512_bf16" else f"fulcrum_cpu_norm_{lvl}"
    return cpu_ext.load(name, _SOURCE, ["rms_norm"], lvl)


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU, bf16/fp32 alike in input and weight, contiguous, and few rows: the scalar loop beats PyTorch's
    7 ops only on decode-sized inputs (their fixed per-op cost dominates); on many rows PyTorch's vectorised ops win."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and x.numel() <= MAX_ELEMENTS
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _module().rms_norm(x, weight.contiguous(), eps)
