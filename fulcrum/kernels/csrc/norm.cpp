// RMSNorm, one vectorised read of a row for its sum of squares and one for the output, rows split over the threads,
// where PyTorch runs 7 ops (each a pass, each paying its fixed cost on a decode step's tiny rows). The reference
// arithmetic, as HF transformers has it: fp32, cast to the input dtype, then times the weight (the sum of squares
// taken in another order: within 1e-6 in fp32, and in bf16 an occasional output one rounding step away).
#include <cmath>

#include "exports.h"
#include "vec.h"

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
      for (; i + VW <= n; i += VW) {
        const vf a = vload(xr + i);
        s0 = vfmadd(a, a, s0);
      }
      float ss = vsum(vadd(s0, s1));
      for (; i < n; ++i) {
        const float v = float(xr[i]);
        ss += v * v;
      }
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
