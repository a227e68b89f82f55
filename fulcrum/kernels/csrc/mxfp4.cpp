// y = x @ dequant(W)^T + b for few rows of x over MXFP4 weights (gpt-oss's experts), reading the packed bytes: W
// [O, I] as blocks [O, I / 32, 16] uint8 (two e2m1 values a byte, the even column in the low nibble) and scales
// [O, I / 32] uint8 (E8M0: the block's scale 2^(e - 127)). A block's 16 bytes become 32 int8 values (twice the
// e2m1 values, all integers: 0, 1, 2, 3, 4, 6, 8, 12 and negatives) through one byte shuffle per nibble, are widened
// in registers and multiplied with FMA against x (fp32 or bf16, widened once); the block's sum is scaled by
// 2^(e - 128). Also the whole weight dequantized, for many rows (prefill).
#include <cmath>
#include <vector>

#include "exports.h"
#include "split_rows.h"
#include "vec.h"

// 16 packed bytes -> 32 int8 values (twice the e2m1 values) in column order
static inline void decode_block(const uint8_t* p, int8_t* out) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i b = _mm_loadu_si128((const __m128i*)p), nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, nib));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  _mm_storeu_si128((__m128i*)out, _mm_unpacklo_epi8(lo, hi));  // columns 0..15: byte j's low, then its high
  _mm_storeu_si128((__m128i*)(out + 16), _mm_unpackhi_epi8(lo, hi));
}

// the block scale with the doubling of decode_block undone, 2^(e - 128), from a table: std::ldexp per block was
// the kernel's largest cost
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.f, e - 128);
  }
};
static const ScaleTable SCALES;
static inline float block_scale(uint8_t e) { return SCALES.v[e]; }

template <typename T> static inline float scalar(T v) { return float(v); }

template <typename T> static std::vector<float> widen(const T* x, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = float(x[i]);
  return out;
}

// M input rows against weight rows [begin, end)
template <int M, typename T>
static void rows_mxfp4(const float* x, const uint8_t* w, const uint8_t* e, const T* bias, T* y, int64_t I, int64_t O,
                       int64_t begin, int64_t end) {
  const int64_t ng = I / 32;
  alignas(64) int8_t v[32];
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* wr = w + o * (I / 2);
    const uint8_t* er = e + o * ng;
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    for (int64_t g = 0; g < ng; ++g) {
      prefetch_span<16>(wr + g * 16, g * 16);
      decode_block(wr + g * 16, v);
      vf bacc[M];
      for (int m = 0; m < M; ++m) bacc[m] = vzero();
      for (int c = 0; c < 32; c += VW) {
        const vf wv = vload_i8(v + c);
        for (int m = 0; m < M; ++m) bacc[m] = vfmadd(wv, vload(x + m * I + g * 32 + c), bacc[m]);
      }
      const vf s = vset1(block_scale(er[g]));
      for (int m = 0; m < M; ++m) acc[m] = vfmadd(bacc[m], s, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[m]);
      if (bias) s += scalar(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

template <typename T>
static void qgemv_mxfp4(const T* x_in, const uint8_t* w, const uint8_t* e, const T* bias, T* y, int64_t M,
                        int64_t I, int64_t O) {
  const std::vector<float> xf = widen(x_in, M * I);
  const float* x = xf.data();
  split_rows(M, O, I / 2 + I / 32, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const float* xm = x + m0 * I;
    T* ym = y + m0 * O;
    switch (n) {
      case 1: rows_mxfp4<1>(xm, w, e, bias, ym, I, O, o, oe); break;
      case 2: rows_mxfp4<2>(xm, w, e, bias, ym, I, O, o, oe); break;
      case 3: rows_mxfp4<3>(xm, w, e, bias, ym, I, O, o, oe); break;
      default: rows_mxfp4<4>(xm, w, e, bias, ym, I, O, o, oe); break;
    }
  });
}

// x [M, I] and y [M, O] in one dtype (bf16 when `bf16`, else fp32), bias [O] in it too or null; I a multiple of 32
extern "C" void fulcrum_qgemv_mxfp4(int64_t bf16, const void* x, const void* blocks, const void* scales,
                                    const void* bias, void* y, int64_t M, int64_t I, int64_t O) {
  using B = c10::BFloat16;
  const uint8_t *w = (const uint8_t*)blocks, *e = (const uint8_t*)scales;
  if (bf16) qgemv_mxfp4((const B*)x, w, e, (const B*)bias, (B*)y, M, I, O);
  else qgemv_mxfp4((const float*)x, w, e, (const float*)bias, (float*)y, M, I, O);
}

template <typename T>
static void dequant_mxfp4(const uint8_t* w, const uint8_t* e, T* y, int64_t O, int64_t I) {
  const int64_t ng = I / 32;
  at::parallel_for(0, O, std::max<int64_t>(1, 131072 / I), [&](int64_t b, int64_t end) {
    alignas(64) int8_t v[32];
    for (int64_t o = b; o < end; ++o) {
      for (int64_t g = 0; g < ng; ++g) {
        decode_block(w + o * (I / 2) + g * 16, v);
        const vf s = vset1(block_scale(e[o * ng + g]));
        for (int c = 0; c < 32; c += VW) vstore_as(y + o * I + g * 32 + c, vmul(vload_i8(v + c), s));
      }
    }
  });
}

// the whole weight [O, I] in the input's dtype (exact: every MXFP4 value is a bf16 value within E8M0's range)
extern "C" void fulcrum_dequant_mxfp4(int64_t bf16, const void* blocks, const void* scales, void* out, int64_t O,
                                      int64_t I) {
  const uint8_t *w = (const uint8_t*)blocks, *e = (const uint8_t*)scales;
  if (bf16) dequant_mxfp4(w, e, (c10::BFloat16*)out, O, I);
  else dequant_mxfp4(w, e, (float*)out, O, I);
}
