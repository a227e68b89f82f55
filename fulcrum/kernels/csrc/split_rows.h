// The row split of the GEMVs (dense and quantized): output rows over torch's OpenMP pool, about 64 KB of weights
// per task so threads split evenly. Up to 4 input rows share one pass over the weights; more go 4 at a time over a
// block of weight rows small enough to stay in L2, so the weights still come from memory once.
#pragma once

#include <vector>

#include "prelude.h"

// The input rows as fp32, widened once per call rather than once per weight row
template <typename T> static std::vector<float> widen(const T* x, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = float(x[i]);
  return out;
}

// f(m0, n, begin, end) computes input rows m0..m0+n-1 (n <= 4) against weight rows [begin, end); `row_bytes`: bytes
// of one packed weight row
template <typename F>
static void split_rows(int64_t M, int64_t O, int64_t row_bytes, F f) {
  const int64_t block = std::max<int64_t>(1, 131072 / row_bytes);
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);
  at::parallel_for(0, O, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; o += block) {
      const int64_t oe = std::min(e, o + block);
      for (int64_t m0 = 0; m0 < M; m0 += 4) f(m0, std::min<int64_t>(4, M - m0), o, oe);
    }
  });
}
