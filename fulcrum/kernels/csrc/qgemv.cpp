// y = x @ dequant(W)^T + b for few rows of x over quantized weights, reading the packed bytes: a decode step streams
// every weight once, so bytes read per token set its speed. The packed weights are widened in registers (never a
// dequantized copy in memory) and multiplied with FMA against x (fp32 or bf16, widened likewise), the scales applied
// per output channel (int8, fp8) or per group (int4). Formats (fulcrum.quant makes them at load time):
// - int8: w [O, I] int8, scale [O] fp32: W[o, i] = w[o, i] * scale[o].
// - fp8: the same with w in float8_e4m3fn, widened through fp16 (F16C), since x86 CPUs have no fp8 arithmetic.
// - int8 in groups (GGUF's Q8_0, Q5_*, Q6_K, Q3_K, Q2_K): w [O, I] int8, scale and offset (or none) [O, I / G] fp32,
//   G 16 or 32: W[o, i] = w[o, i] * scale[o, i / G] + offset[o, i / G].
// - int5 (GGUF's Q5_0, Q5_1, Q5_K): int4's nibbles (w [O, I / 2]) and their fifth bits, high [O, I / 8], 8 bytes per
//   64 values: two uint32 words, word 0's bit k the fifth bit of the value in the low nibble of byte k of the 64
//   values' 32 bytes (values 0-15, 32-47), word 1's of the high nibble's (values 16-31, 48-63); scale and offset
//   per 32 values (offset null: the zero point 16, -16 * scale, as Q5_0's). I a multiple of 64.
// - int4: w [O, I / 2] uint8, scale and offset [O, I / G] fp32, G a multiple of 32:
//   W[o, i] = q * scale[o, i / G] + offset[o, i / G], q the 4-bit value in 0..15; offset null: -8 * scale (GGUF's
//   Q4_0, whose zero point is 8: its offsets are not stored). In each 32 values of a row
//   (16 bytes), byte j holds value j in its low nibble and value j + 16 in its high one, so one load of VW bytes
//   yields two vectors of consecutive values on every vector width.
#include <cmath>
#include <vector>

#include "exports.h"
#include "split_rows.h"
#include "vec.h"

// VW bytes: their low nibbles (values j..j+VW of a 32-value chunk) and their high nibbles (values j+16..)
#ifdef __AVX512F__
static inline void vload_u4(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
static inline void vload_u4(const uint8_t* p, vf& lo, vf& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#endif
template <typename T> static inline float scalar(T v) { return float(v); }

// v + 16 in the lanes whose bit of `bits` is set (lane k: bit k; int5's fifth bits)
#ifdef __AVX512F__
static inline vf vadd16_bits(vf v, uint32_t bits) {
  return _mm512_mask_add_ps(v, __mmask16(bits & 0xFFFF), v, _mm512_set1_ps(16.f));
}
#else
static inline vf vadd16_bits(vf v, uint32_t bits) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), lanes), lanes);
  return _mm256_add_ps(v, _mm256_and_ps(_mm256_castsi256_ps(set), _mm256_set1_ps(16.f)));
}
#endif
// the fifth bits of 32-value group g's low-nibble values (lo) and high-nibble values (hi), bit k: value k of 16
static inline void int5_bits(const uint32_t* hb, int64_t g, uint32_t& lo, uint32_t& hi) {
  const int shift = int(g & 1) * 16;
  lo = (hb[2 * (g / 2)] >> shift) & 0xFFFF;
  hi = (hb[2 * (g / 2) + 1] >> shift) & 0xFFFF;
}

// One byte per weight, per-channel scale: int8, or fp8 e4m3 (FP8 true: read as 2^-8 times its value)
static inline float fp8_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
  return b & 0x80 ? -v : v;
}
template <bool FP8> static inline vf vload_w(const int8_t* p) {
  if constexpr (FP8) return vload_f8((const uint8_t*)p);
  else return vload_i8(p);
}
template <bool FP8> static inline float weight(int8_t v) {
  if constexpr (FP8) return fp8_to_f32(uint8_t(v)) / 256.f;
  else return float(v);
}

// M input rows against weight rows [begin, end)
template <int M, bool FP8, typename T>
static void rows_i8(const float* x, const int8_t* w, const float* scale, const T* bias, T* y, int64_t I, int64_t O,
                    int64_t begin, int64_t end) {
  const int64_t IV = I / (2 * VW) * (2 * VW);
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* wr = w + o * I;
    vf acc[M], acc2[M];  // two chains per input row hide the FMA latency
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = vzero();
    for (int64_t i = 0; i < IV; i += 2 * VW) {
      prefetch_span<2 * VW>(wr + i, i);
      const vf wv = vload_w<FP8>(wr + i), wv2 = vload_w<FP8>(wr + i + VW);
      for (int m = 0; m < M; ++m) {
        acc[m] = vfmadd(wv, vload(x + m * I + i), acc[m]);
        acc2[m] = vfmadd(wv2, vload(x + m * I + i + VW), acc2[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(vadd(acc[m], acc2[m]));
      for (int64_t i = IV; i < I; ++i) s += weight<FP8>(wr[i]) * x[m * I + i];
      s *= FP8 ? scale[o] * 256.f : scale[o];
      if (bias) s += scalar(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

// int4 and int5 (FIVE: each value's fifth bit added as 16), group-wise scale and offset: sum over a group of
// (q * s + m) * x = s * sum(q * x) + m * sum(x), the second term from xsum [M, I / G], computed once per call; no
// offsets: the zero point (8: Q4_0, 16: Q5_0) times the scale
template <int M, bool FIVE, typename T>
static void rows_i45(const float* x, const uint8_t* w, const uint8_t* high, const float* scale, const float* offset,
                     const float* xsum, const T* bias, T* y, int64_t I, int64_t O, int64_t G, int64_t begin,
                     int64_t end) {
  const int64_t ng = I / G;
  const float zero = FIVE ? -16.f : -8.f;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* wr = w + o * (I / 2);
    const uint32_t* hb = FIVE ? (const uint32_t*)(high + o * (I / 8)) : nullptr;
    const float* sr = scale + o * ng;
    const float* mr = offset ? offset + o * ng : nullptr;
    vf acc[M];
    float macc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero(), macc[m] = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      vf lo_acc[M], hi_acc[M];
      for (int m = 0; m < M; ++m) lo_acc[m] = hi_acc[m] = vzero();
      for (int64_t c = g * G; c < (g + 1) * G; c += 32) {
        uint32_t bl = 0, bh = 0;
        if constexpr (FIVE) int5_bits(hb, c / 32, bl, bh);
        prefetch_span<16>(wr + c / 2, c / 2);
        for (int j = 0; j < 16; j += VW) {
          vf lo, hi;
          vload_u4(wr + c / 2 + j, lo, hi);
          if constexpr (FIVE) {
            lo = vadd16_bits(lo, bl >> j);
            hi = vadd16_bits(hi, bh >> j);
          }
          for (int m = 0; m < M; ++m) {
            lo_acc[m] = vfmadd(lo, vload(x + m * I + c + j), lo_acc[m]);
            hi_acc[m] = vfmadd(hi, vload(x + m * I + c + 16 + j), hi_acc[m]);
          }
        }
      }
      const vf s = vset1(sr[g]);
      for (int m = 0; m < M; ++m) {
        acc[m] = vfmadd(vadd(lo_acc[m], hi_acc[m]), s, acc[m]);
        macc[m] += (mr ? mr[g] : zero * sr[g]) * xsum[m * ng + g];
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[m]) + macc[m];
      if (bias) s += scalar(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

// int8 in groups of G (16 or 32) with a scale each and optionally an offset: per group, s * sum(q * x) + m * sum(x);
// FP8: fp8 e4m3 with a scale per group of G (a multiple of the vector width; block-wise fp8 checkpoints: G = 128)
template <int M, bool FP8, typename T>
static void rows_i8g(const float* x, const int8_t* w, const float* scale, const float* offset, const float* xsum,
                     const T* bias, T* y, int64_t I, int64_t O, int64_t G, int64_t begin, int64_t end) {
  const int64_t ng = I / G;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* wr = w + o * I;
    const float* sr = scale + o * ng;
    vf acc[M];
    float macc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero(), macc[m] = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      vf gacc[M];
      for (int m = 0; m < M; ++m) gacc[m] = vzero();
      for (int64_t c = g * G; c < (g + 1) * G; c += VW) {
        prefetch_span<VW>(wr + c, c);
        const vf wv = vload_w<FP8>(wr + c);
        for (int m = 0; m < M; ++m) gacc[m] = vfmadd(wv, vload(x + m * I + c), gacc[m]);
      }
      const vf s = vset1(FP8 ? sr[g] * 256.f : sr[g]);
      for (int m = 0; m < M; ++m) acc[m] = vfmadd(gacc[m], s, acc[m]);
      if (offset)
        for (int m = 0; m < M; ++m) macc[m] += offset[o * ng + g] * xsum[m * ng + g];
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[m]) + macc[m];
      if (bias) s += scalar(bias[o]);
      store(y + m * O + o, s);
    }
  }
}


template <bool FP8, typename T>
static void qgemv_i8(const T* x_in, const int8_t* w, const float* scale, const T* bias, T* y, int64_t M, int64_t I,
                     int64_t O) {
  const std::vector<float> xf = widen(x_in, M * I);
  const float* x = xf.data();
  split_rows(M, O, I, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const float* xm = x + m0 * I;
    T* ym = y + m0 * O;
    switch (n) {
      case 1: rows_i8<1, FP8>(xm, w, scale, bias, ym, I, O, o, oe); break;
      case 2: rows_i8<2, FP8>(xm, w, scale, bias, ym, I, O, o, oe); break;
      case 3: rows_i8<3, FP8>(xm, w, scale, bias, ym, I, O, o, oe); break;
      default: rows_i8<4, FP8>(xm, w, scale, bias, ym, I, O, o, oe); break;
    }
  });
}

template <bool FIVE, typename T>
static void qgemv_i45(const T* x_in, const uint8_t* w, const uint8_t* high, const float* scale, const float* offset,
                      const T* bias, T* y, int64_t M, int64_t I, int64_t O, int64_t G) {
  const int64_t ng = I / G;
  const std::vector<float> xf = widen(x_in, M * I);
  const float* x = xf.data();
  std::vector<float> xsum(M * ng, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) xsum[m * ng + i / G] += x[m * I + i];
  split_rows(M, O, I / 2 + (FIVE ? I / 8 : 0), [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const float* xm = x + m0 * I;
    const float* xs = xsum.data() + m0 * ng;
    T* ym = y + m0 * O;
    switch (n) {
      case 1: rows_i45<1, FIVE>(xm, w, high, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      case 2: rows_i45<2, FIVE>(xm, w, high, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      case 3: rows_i45<3, FIVE>(xm, w, high, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      default: rows_i45<4, FIVE>(xm, w, high, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
    }
  });
}

template <bool FP8, typename T>
static void qgemv_i8g(const T* x_in, const int8_t* w, const float* scale, const float* offset, const T* bias, T* y,
                      int64_t M, int64_t I, int64_t O, int64_t G) {
  const int64_t ng = I / G;
  const std::vector<float> xf = widen(x_in, M * I);
  const float* x = xf.data();
  std::vector<float> xsum(offset ? M * ng : 0, 0.f);
  if (offset)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < I; ++i) xsum[m * ng + i / G] += x[m * I + i];
  split_rows(M, O, I, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const float* xm = x + m0 * I;
    const float* xs = xsum.data() + (offset ? m0 * ng : 0);
    T* ym = y + m0 * O;
    switch (n) {
      case 1: rows_i8g<1, FP8>(xm, w, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      case 2: rows_i8g<2, FP8>(xm, w, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      case 3: rows_i8g<3, FP8>(xm, w, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
      default: rows_i8g<4, FP8>(xm, w, scale, offset, xs, bias, ym, I, O, G, o, oe); break;
    }
  });
}


// x [M, I] and y [M, O] in one dtype (bf16 when `bf16`, else fp32), bias [O] in it too or null; w int8, or fp8
// e4m3 bytes when `fp8`
extern "C" void fulcrum_qgemv_int8(int64_t bf16, int64_t fp8, const void* x, const void* w, const void* scale,
                                   const void* bias, void* y, int64_t M, int64_t I, int64_t O) {
  using B = c10::BFloat16;
  const int8_t* q = (const int8_t*)w;
  const float* s = (const float*)scale;
  if (bf16 && fp8) qgemv_i8<true>((const B*)x, q, s, (const B*)bias, (B*)y, M, I, O);
  else if (bf16) qgemv_i8<false>((const B*)x, q, s, (const B*)bias, (B*)y, M, I, O);
  else if (fp8) qgemv_i8<true>((const float*)x, q, s, (const float*)bias, (float*)y, M, I, O);
  else qgemv_i8<false>((const float*)x, q, s, (const float*)bias, (float*)y, M, I, O);
}

// the int5 format above (offset may be null: the zero point 16); I a multiple of 64
extern "C" void fulcrum_qgemv_int5(int64_t bf16, const void* x, const void* w, const void* high, const void* scale,
                                   const void* offset, const void* bias, void* y, int64_t M, int64_t I, int64_t O) {
  using B = c10::BFloat16;
  const uint8_t *q = (const uint8_t*)w, *h = (const uint8_t*)high;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) qgemv_i45<true>((const B*)x, q, h, s, m, (const B*)bias, (B*)y, M, I, O, 32);
  else qgemv_i45<true>((const float*)x, q, h, s, m, (const float*)bias, (float*)y, M, I, O, 32);
}

// the grouped int8 format above (offset may be null)
extern "C" void fulcrum_qgemv_int8g(int64_t bf16, const void* x, const void* w, const void* scale,
                                    const void* offset, const void* bias, void* y, int64_t M, int64_t I, int64_t O,
                                    int64_t G) {
  using B = c10::BFloat16;
  const int8_t* q = (const int8_t*)w;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) qgemv_i8g<false>((const B*)x, q, s, m, (const B*)bias, (B*)y, M, I, O, G);
  else qgemv_i8g<false>((const float*)x, q, s, m, (const float*)bias, (float*)y, M, I, O, G);
}

extern "C" void fulcrum_qgemv_int4(int64_t bf16, const void* x, const void* w, const void* scale,
                                   const void* offset, const void* bias, void* y, int64_t M, int64_t I, int64_t O,
                                   int64_t G) {
  using B = c10::BFloat16;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) qgemv_i45<false>((const B*)x, (const uint8_t*)w, nullptr, s, m, (const B*)bias, (B*)y, M, I, O, G);
  else qgemv_i45<false>((const float*)x, (const uint8_t*)w, nullptr, s, m, (const float*)bias, (float*)y, M, I, O, G);
}

// The whole weight [O, I] in the input's dtype, for many input rows (prefill), where a dense matmul beats the GEMV
template <bool FP8, typename T>
static void dequant_i8(const int8_t* q, const float* s, T* y, int64_t O, int64_t I) {
  at::parallel_for(0, O, std::max<int64_t>(1, 65536 / I), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const float so = FP8 ? s[o] * 256.f : s[o];
      const vf sv = vset1(so);
      int64_t i = 0;
      for (; i + VW <= I; i += VW) vstore_as(y + o * I + i, vmul(vload_w<FP8>(q + o * I + i), sv));
      for (; i < I; ++i) y[o * I + i] = T(weight<FP8>(q[o * I + i]) * so);
    }
  });
}

template <bool FIVE, typename T>
static void dequant_i45(const uint8_t* q, const uint8_t* high, const float* s, const float* m, T* y, int64_t O,
                        int64_t I, int64_t G) {
  const int64_t ng = I / G;
  const float zero = FIVE ? -16.f : -8.f;
  at::parallel_for(0, O, std::max<int64_t>(1, 131072 / I), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const uint32_t* hb = FIVE ? (const uint32_t*)(high + o * (I / 8)) : nullptr;
      for (int64_t c = 0; c < I; c += 32) {
        const float so = s[o * ng + c / G];
        const vf sv = vset1(so), mv = vset1(m ? m[o * ng + c / G] : zero * so);
        uint32_t bl = 0, bh = 0;
        if constexpr (FIVE) int5_bits(hb, c / 32, bl, bh);
        for (int j = 0; j < 16; j += VW) {
          vf lo, hi;
          vload_u4(q + o * (I / 2) + c / 2 + j, lo, hi);
          if constexpr (FIVE) {
            lo = vadd16_bits(lo, bl >> j);
            hi = vadd16_bits(hi, bh >> j);
          }
          vstore_as(y + o * I + c + j, vfmadd(lo, sv, mv));
          vstore_as(y + o * I + c + 16 + j, vfmadd(hi, sv, mv));
        }
      }
    }
  });
}

extern "C" void fulcrum_dequant_int8(int64_t bf16, int64_t fp8, const void* w, const void* scale, void* out,
                                     int64_t O, int64_t I) {
  const int8_t* q = (const int8_t*)w;
  const float* s = (const float*)scale;
  if (bf16 && fp8) dequant_i8<true>(q, s, (c10::BFloat16*)out, O, I);
  else if (bf16) dequant_i8<false>(q, s, (c10::BFloat16*)out, O, I);
  else if (fp8) dequant_i8<true>(q, s, (float*)out, O, I);
  else dequant_i8<false>(q, s, (float*)out, O, I);
}

extern "C" void fulcrum_dequant_int4(int64_t bf16, const void* w, const void* scale, const void* offset, void* out,
                                     int64_t O, int64_t I, int64_t G) {
  const uint8_t* q = (const uint8_t*)w;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) dequant_i45<false>(q, nullptr, s, m, (c10::BFloat16*)out, O, I, G);
  else dequant_i45<false>(q, nullptr, s, m, (float*)out, O, I, G);
}

template <bool FP8, typename T>
static void dequant_i8g(const int8_t* q, const float* s, const float* m, T* y, int64_t O, int64_t I, int64_t G) {
  const int64_t ng = I / G;
  at::parallel_for(0, O, std::max<int64_t>(1, 65536 / I), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o)
      for (int64_t g = 0; g < ng; ++g) {
        const vf sv = vset1(FP8 ? s[o * ng + g] * 256.f : s[o * ng + g]), mv = vset1(m ? m[o * ng + g] : 0.f);
        for (int64_t c = g * G; c < (g + 1) * G; c += VW)
          vstore_as(y + o * I + c, vfmadd(vload_w<FP8>(q + o * I + c), sv, mv));
      }
  });
}

extern "C" void fulcrum_dequant_int8g(int64_t bf16, const void* w, const void* scale, const void* offset, void* out,
                                      int64_t O, int64_t I, int64_t G) {
  const int8_t* q = (const int8_t*)w;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) dequant_i8g<false>(q, s, m, (c10::BFloat16*)out, O, I, G);
  else dequant_i8g<false>(q, s, m, (float*)out, O, I, G);
}

// fp8 e4m3 w [O, I] with a scale per row and group of G inputs, scale [O, I / G] (block-wise fp8 checkpoints, their
// tile scales widened to rows); G a multiple of 16
extern "C" void fulcrum_qgemv_fp8g(int64_t bf16, const void* x, const void* w, const void* scale, const void* bias,
                                   void* y, int64_t M, int64_t I, int64_t O, int64_t G) {
  using B = c10::BFloat16;
  const int8_t* q = (const int8_t*)w;
  const float* s = (const float*)scale;
  if (bf16) qgemv_i8g<true>((const B*)x, q, s, nullptr, (const B*)bias, (B*)y, M, I, O, G);
  else qgemv_i8g<true>((const float*)x, q, s, nullptr, (const float*)bias, (float*)y, M, I, O, G);
}

extern "C" void fulcrum_dequant_fp8g(int64_t bf16, const void* w, const void* scale, void* out, int64_t O, int64_t I,
                                     int64_t G) {
  const int8_t* q = (const int8_t*)w;
  const float* s = (const float*)scale;
  if (bf16) dequant_i8g<true>(q, s, nullptr, (c10::BFloat16*)out, O, I, G);
  else dequant_i8g<true>(q, s, nullptr, (float*)out, O, I, G);
}


extern "C" void fulcrum_dequant_int5(int64_t bf16, const void* w, const void* high, const void* scale,
                                     const void* offset, void* out, int64_t O, int64_t I) {
  const uint8_t *q = (const uint8_t*)w, *h = (const uint8_t*)high;
  const float *s = (const float*)scale, *m = (const float*)offset;
  if (bf16) dequant_i45<true>(q, h, s, m, (c10::BFloat16*)out, O, I, 32);
  else dequant_i45<true>(q, h, s, m, (float*)out, O, I, 32);
}
