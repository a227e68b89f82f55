"""RMSNorm as one CPU kernel, for a decode step's rows and a prefill's alike.

In a batch-1 CPU decode step the GEMVs stream the weights and everything else is overhead: PyTorch's
RMSNorm is 7 ops (cast, square, mean, rsqrt, multiply, cast, weight), each paying PyTorch's per-op
cost on a tiny row, and a 0.5B-shape step has 49 of them; on a prefill's 2048 rows the same ops took 2.7-8.6 ms
against this kernel's 0.6 (each op a pass over the rows, 2-core Xeon). This kernel is one vectorised read of a
row for its sum of squares and one for the output, rows split over the threads. It keeps the reference
arithmetic: float32, cast to the input dtype, then times the weight, as HF transformers does
(the float32 sum of squares is taken in another order: within 1e-6 in float32, and in bf16 an
occasional output one rounding step away).
Built by `fulcrum.kernels.cpu_ext`; callers fall back to PyTorch ops where it is not available.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext

_BODY = r"""

template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      vf s0 = vzero(), s1 = vzero();
      int64_t i = 0;
      for (; i + 2 * VW <= n; i += 2 * VW) {
        const vf a = vload(xr + i), c = vload(xr + i + VW);
        s0 = vfmadd(a, a, s0), s1 = vfmadd(c, c, s1);
      }
      for (; i + VW <= n; i += VW) { const vf a = vload(xr + i); s0 = vfmadd(a, a, s0); }
      float ss = vsum(vadd(s0, s1));
      for (; i < n; ++i) { const float v = float(xr[i]); ss += v * v; }
      const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
      const vf vinv = vset1(inv);
      // (x * rstd) rounded to T, then times the weight, rounded: the reference's two roundings
      for (i = 0; i + VW <= n; i += VW)
        vstore_as(yr + i, vround(vmul(vload(w + i), vround(vmul(vload(xr + i), vinv), yr)), yr));
      for (; i < n; ++i) yr[i] = T(float(w[i]) * float(T(float(xr[i]) * inv)));
    }
  });
}

// x and y [rows, n], w [n], all contiguous and of one dtype
extern "C" void fulcrum_rms_norm(int64_t bf16, const void* x, const void* w, void* y, int64_t rows, int64_t n,
                                 float eps) {
  using B = c10::BFloat16;
  if (bf16) rms_rows((const B*)x, (const B*)w, (B*)y, rows, n, eps);
  else rms_rows((const float*)x, (const float*)w, (float*)y, rows, n, eps);
}
"""


_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def _module():
    lib = cpu_ext.load_vector("fulcrum_cpu_norm_v", _BODY)
    if lib is None:
        return None
    P, I64 = cpu_ext.PTR, cpu_ext.I64
    return cpu_ext.bind(lib.fulcrum_rms_norm, None, I64, P, P, P, I64, I64, cpu_ext.F32)


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU, bf16/fp32 alike in input and weight, contiguous."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.shape == x.shape[-1:]
        and x.is_contiguous()
        and x.numel() > 0
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    weight = weight.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _module()(x.dtype == torch.bfloat16, x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y
