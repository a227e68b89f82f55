// SwiGLU's gate, silu(gate) * up, in one pass: each row read once and written once, where PyTorch's three ops write
// and read the intermediate activations twice more. The arithmetic is PyTorch's: silu in fp32 (x * sigmoid(x), with
// vexp: within a few fp32 ulps of torch's), rounded to the dtype, then the product rounded, so bf16 results equal
// PyTorch's except where an ulp of difference crosses a rounding boundary.
#include <cmath>

#include "exports.h"
#include "vec.h"

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
static inline vf vsilu(vf x) { return vmul(x, vrcp(vadd(vset1(1.0f), vexp(vmin(vsub(vzero(), x), vset1(87.0f)))))); }
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
