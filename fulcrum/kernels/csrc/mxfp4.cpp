// y = x @ dequant(W)^T + b for few rows of x over MXFP4 weights (gpt-oss's experts), reading the packed bytes: W
// [O, I] as blocks [O, I / 32, 16] uint8 (two e2m1 values a byte, the even column in the low nibble) and scales
// [O, I / 32] uint8 (E8M0: the block's scale 2^(e - 127)). The values are decoded in registers and multiplied with
// FMA against x (fp32 or bf16, widened once), each block's sum scaled once:
// - AVX-512: the 16 bytes widened to 32-bit lanes, each nibble a lane index into the 16 e2m1 values
//   (vpermps), the low nibbles giving the block's even columns and the high ones its odd columns: x is reordered
//   once per call to match (each block's even columns, then its odd ones).
// - AVX2: one byte shuffle per nibble turns the bytes into 32 int8 values (twice the e2m1 values, all integers:
//   0, 1, 2, 3, 4, 6, 8, 12 and negatives) in column order, widened 8 at a time; the scale halved to match.
// Also the whole weight dequantized, for many rows (prefill).
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

#ifdef __AVX512F__
constexpr bool DEINTERLEAVED = true;  // x's blocks reordered: even columns, then odd ones
constexpr int DOUBLED = 0;
// a block's values as two vectors: its even columns (the low nibbles), then its odd ones
static inline void block_values(const uint8_t* p, vf* w) {
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                      -4.f, -6.f);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  w[0] = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#else
constexpr bool DEINTERLEAVED = false;
constexpr int DOUBLED = 1;  // the values come out doubled: the scale is halved
// a block's values (doubled) as four vectors of 8 consecutive columns
static inline void block_values(const uint8_t* p, vf* w) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i b = _mm_loadu_si128((const __m128i*)p), nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, nib));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // columns 0..15, 16..31
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
}
#endif

// 2^(e - 127) (2^(e - 128) for doubled values) from a table: std::ldexp per block was the kernel's largest cost
struct ScaleTable {
  float v[256];
  explicit ScaleTable(int bias) {
    for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.f, e - bias);
  }
};
static const ScaleTable SCALES(127), DOUBLED_SCALES(128);  // the GEMV's (per ISA) and the dequantization's
static inline float block_scale(uint8_t e) { return (DOUBLED ? DOUBLED_SCALES : SCALES).v[e]; }

template <typename T> static inline float scalar(T v) { return float(v); }

// M input rows against weight rows [begin, end)
template <int M, typename T>
static void rows_mxfp4(const float* x, const uint8_t* w, const uint8_t* e, const T* bias, T* y, int64_t I, int64_t O,
                       int64_t begin, int64_t end) {
  const int64_t ng = I / 32;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* wr = w + o * (I / 2);
    const uint8_t* er = e + o * ng;
    // two accumulators per row, even and odd blocks: one chain of scaled block sums held the loop to the FMA's
    // latency per block
    vf even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = vzero();
    auto block = [&](int64_t g, vf* acc) {
      prefetch_span<16>(wr + g * 16, g * 16);
      vf wv[32 / VW];
      block_values(wr + g * 16, wv);
      vf bacc[M];
      for (int m = 0; m < M; ++m) bacc[m] = vzero();
      for (int c = 0; c < 32 / VW; ++c)
        for (int m = 0; m < M; ++m) bacc[m] = vfmadd(wv[c], vload(x + m * I + g * 32 + c * VW), bacc[m]);
      const vf s = vset1(block_scale(er[g]));
      for (int m = 0; m < M; ++m) acc[m] = vfmadd(bacc[m], s, acc[m]);
    };
    int64_t g = 0;
    for (; g + 1 < ng; g += 2) {
      block(g, even);
      block(g + 1, odd);
    }
    if (g < ng) block(g, even);
    for (int m = 0; m < M; ++m) {
      float s = vsum(vadd(even[m], odd[m]));
      if (bias) s += scalar(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

template <typename T>
static void qgemv_mxfp4(const T* x_in, const uint8_t* w, const uint8_t* e, const T* bias, T* y, int64_t M,
                        int64_t I, int64_t O) {
  std::vector<float> xf = widen(x_in, M * I);
  if (DEINTERLEAVED) {  // each block of 32: its even columns, then its odd ones
    float tmp[32];
    for (int64_t b = 0; b < M * I; b += 32) {
      for (int j = 0; j < 16; ++j) tmp[j] = xf[b + 2 * j], tmp[16 + j] = xf[b + 2 * j + 1];
      std::memcpy(xf.data() + b, tmp, sizeof(tmp));
    }
  }
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
        const vf s = vset1(DOUBLED_SCALES.v[e[o * ng + g]]);
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
