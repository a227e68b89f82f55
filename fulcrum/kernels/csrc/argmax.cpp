// Greedy decoding's argmax over a step's logits: each row read in its own dtype (no widening copy), twice from cache:
// a vector max, then the first position holding it. The result is torch's: the first index of the largest value, a
// NaN counted as larger than any number (the first NaN wins), -0.0 equal to 0.0.
#include <cmath>

#include "exports.h"
#include "vec.h"

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
