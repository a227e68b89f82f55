"""Greedy decoding's argmax over a step's logits, as one CPU kernel.

A greedy step's sampler did `logits.float().argmax(-1)`: on the 0.5B shape's [64, 151936] bf16 logits that was a
13-22 ms widening copy into fresh memory and a 14-20 ms argmax (torch's argmax reduction is not vectorised on the
CPU), about 15% of a 64-row decode step (profiled on a 2-core AMX Xeon). Here each row is read in its own dtype,
twice from cache: a vector max, then the first position holding it. The result is torch's: the first index of the
largest value, a NaN counted as larger than any number (the first NaN wins), -0.0 equal to 0.0. Built by
`fulcrum.kernels.cpu_ext` for AVX2 and AVX-512; callers fall back to torch's argmax where it is missing.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext

_BODY = r"""
#ifdef __AVX512F__
static inline uint32_t nan_bits(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline uint32_t eq_bits(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
#else
static inline uint32_t nan_bits(vf a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline uint32_t eq_bits(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
#endif

template <typename T>
static int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = float(x[i]);
    if (v != v) return i;
  }
  return -1;
}

template <typename T>
static int64_t row_argmax(const T* x, int64_t n) {
  // pass 1: the largest number (max_ps keeps its second operand when the first is NaN, so NaNs drop out here and
  // are counted on the side)
  vf m0 = vset1(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  uint32_t nan = 0;
  int64_t i = 0;
  for (; i + 4 * VW <= n; i += 4 * VW) {
    const vf a = vload(x + i), b = vload(x + i + VW), c = vload(x + i + 2 * VW), d = vload(x + i + 3 * VW);
    nan |= nan_bits(a) | nan_bits(b) | nan_bits(c) | nan_bits(d);
    m0 = vmax(a, m0), m1 = vmax(b, m1), m2 = vmax(c, m2), m3 = vmax(d, m3);
  }
  for (; i + VW <= n; i += VW) {
    const vf a = vload(x + i);
    nan |= nan_bits(a);
    m0 = vmax(a, m0);
  }
  float m = vmax_all(vmax(vmax(m0, m1), vmax(m2, m3)));
  for (; i < n; ++i) {
    const float v = float(x[i]);
    if (v != v) nan = 1;
    else m = std::max(m, v);
  }
  if (nan) return first_nan(x, n);
  // pass 2: the first position of it
  const vf target = vset1(m);
  for (i = 0; i + VW <= n; i += VW) {
    const uint32_t hit = eq_bits(vload(x + i), target);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (float(x[i]) == m) return i;
  return 0;  // every value -inf: the first
}

// x [rows, n] with rows `stride` elements apart, out [rows] int64
extern "C" void fulcrum_argmax(int64_t bf16, const void* x, int64_t* out, int64_t rows, int64_t n, int64_t stride) {
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      out[r] = bf16 ? row_argmax((const c10::BFloat16*)x + r * stride, n) : row_argmax((const float*)x + r * stride, n);
  });
}
"""

_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def _module():
    lib = cpu_ext.load_vector("fulcrum_cpu_argmax", _BODY)
    if lib is None:
        return None
    P, I64 = cpu_ext.PTR, cpu_ext.I64
    return cpu_ext.bind(lib.fulcrum_argmax, None, I64, P, P, I64, I64, I64)


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor) -> bool:
    """CPU bf16/fp32 logits [rows, vocab], unit stride along the vocabulary."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and available()
    )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for rows `usable` accepts: int64 [rows]."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _module()(x.dtype == torch.bfloat16, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out
