"""SwiGLU's gate, silu(gate) * up, as one CPU kernel.

PyTorch spends three passes on it (the chunk views, silu into a new tensor, the product into another): on a
prefill's [tokens, 2 x intermediate] input that is two extra writes and reads of the intermediate activations, and
on a decode step two ops' fixed cost per layer. Here each row is read once and written once. The arithmetic is
PyTorch's: silu in fp32 (x * sigmoid(x), with this library's vector exp: within a few fp32 ulps of torch's), rounded
to the dtype, then the product rounded, so bf16 results equal PyTorch's except where an ulp of difference crosses
a rounding boundary. Built by `fulcrum.kernels.cpu_ext`; callers fall back to PyTorch ops where it is missing.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext

_BODY = r"""
// silu(x) = x / (1 + e^-x), one exponential: -x capped at 87, where e^87 (6e37) still fits a float and the
// quotient is as good as 0 (the exact value is below 1e-36 there); vexp's reduction holds for |x| <= 87
#ifdef __AVX512F__
static inline vf vrcp_approx(vf a) { return _mm512_rcp14_ps(a); }  // relative error 2^-14
#else
static inline vf vrcp_approx(vf a) { return _mm256_rcp_ps(a); }  // 1.5 * 2^-12
#endif
// 1 / a: the estimate and one Newton step (error about its square: 2^-23 or better), for a division's 10-20 cycles
static inline vf vrcp(vf a) {
  const vf r = vrcp_approx(a);
  return vmul(r, vfnmadd(a, r, vset1(2.0f)));
}
static inline vf vsilu(vf x) {
  return vmul(x, vrcp(vadd(vset1(1.0f), vexp(vmin(vsub(vzero(), x), vset1(87.0f))))));
}
static inline float silu1(float x) { return x / (1.0f + std::exp(std::min(-x, 87.0f))); }


template <typename T>
static void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t n, int64_t xs) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = x + r * xs;
      const T* u = g + n;
      T* o = y + r * n;
      int64_t i = 0;
      for (; i + VW <= n; i += VW)  // silu rounded to T, then the product rounded: PyTorch's two roundings
        vstore_as(o + i, vround(vmul(vround(vsilu(vload(g + i)), o), vload(u + i)), o));
      for (; i < n; ++i) store(o + i, float(T(silu1(float(g[i])))) * float(u[i]));
    }
  });
}

// x [rows, 2n] (gate then up; rows `xs` elements apart), y [rows, n] contiguous, one dtype
extern "C" void fulcrum_silu_and_mul(int64_t bf16, const void* x, void* y, int64_t rows, int64_t n, int64_t xs) {
  if (bf16) silu_mul_rows((const c10::BFloat16*)x, (c10::BFloat16*)y, rows, n, xs);
  else silu_mul_rows((const float*)x, (float*)y, rows, n, xs);
}
"""

_DTYPES = (torch.bfloat16, torch.float32)
# Below this many inputs PyTorch's ops win (their fixed cost is under the call's here: one decode row of a 0.5B-shape
# model, 2 x 4864 bf16 values, 8.7 us in PyTorch against 11.4 us)
MIN_ELEMENTS = 16384


@functools.cache
def _module():
    lib = cpu_ext.load_vector("fulcrum_cpu_act", _BODY)
    if lib is None:
        return None
    P, I64 = cpu_ext.PTR, cpu_ext.I64
    return cpu_ext.bind(lib.fulcrum_silu_and_mul, None, I64, P, P, I64, I64, I64)


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor) -> bool:
    """CPU bf16/fp32 rows [.., 2n] with unit stride along the last dimension."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() >= 1
        and x.shape[-1] % 2 == 0
        and x.numel() >= MIN_ELEMENTS
        and x.stride(-1) == 1
        and (x.dim() == 1 or x.reshape(-1, x.shape[-1]).stride(0) >= x.shape[-1])
        and available()
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:]."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x.shape[-1] // 2
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    _module()(x.dtype == torch.bfloat16, x2.data_ptr(), y.data_ptr(), x2.shape[0], n, x2.stride(0))
    return y.view(*x.shape[:-1], n)
