// The quantized GEMV with integer dot products, for bf16 inputs on CPUs with AVX-512 VNNI: widening every packed
// weight to fp32 (qgemv.cpp) costs more instructions per byte than the memory delivers. The input rows are quantized
// once per call to int8 in blocks of 32 values, a scale per block (llama.cpp's Q8_0), and `vpdpbusd` multiplies 64
// weight bytes by 64 input bytes into int32 sums in one instruction: int4 nibbles are already unsigned; int8 weights
// become unsigned by adding 128 (one XOR), whose share is taken back through each block's sum. Only bf16 inputs take
// this path: a bf16 value carries 8 significant bits, an int8 block value about 7 relative to its block's largest,
// so the result stays within bf16's own rounding of the dequantized-weight product.
#include <cmath>
#include <vector>

#include "exports.h"
#include "split_rows.h"

using B = c10::BFloat16;

// The input rows as int8 blocks of 32: q [M, I], scale per block s [M, I/32], each block's integer sum, and (for int4's
// zero points) the sum of the quantized x over each weight group of G. Per 64 values also the layouts the kernels read:
// xlo/xhi (32 bytes each: values 0-15 and 32-47, values 16-31 and 48-63, matching int4's nibble order) and the
// block scales spread over the lanes their sums land in.
struct QX {
  int64_t M, I, G;
  std::vector<int8_t> q, lo, hi;
  std::vector<float> s, s16, s8, fsum, corr;
};

static QX quantize_x(const B* x, int64_t M, int64_t I, int64_t G) {
  QX r{M, I, G};
  const int64_t nb = I / 32, nc = I / 64;
  r.q.resize(M * I); r.lo.resize(M * I / 2); r.hi.resize(M * I / 2);
  r.s.resize(M * nb); r.s16.resize(M * nc * 16); r.s8.resize(M * nc * 8);
  r.fsum.assign(M * (I / G), 0.f); r.corr.assign(M, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const B* xb = x + m * I + b * 32;
      float amax = 0.f, f[32];
      for (int j = 0; j < 32; ++j) { f[j] = float(xb[j]); amax = std::max(amax, std::fabs(f[j])); }
      const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
      int32_t qs[2] = {0, 0};  // per half block: groups of 16 weights (Q6_K ...) need each half's sum
      for (int j = 0; j < 32; ++j) {
        const int v = int(std::nearbyint(f[j] * inv));
        r.q[m * I + b * 32 + j] = int8_t(std::min(127, std::max(-127, v)));
        qs[j / 16] += r.q[m * I + b * 32 + j];
      }
      r.s[m * nb + b] = s;
      r.corr[m] += 128.f * s * float(qs[0] + qs[1]);  // the +128 of unsigned int8 weights, times this block's sum
      // zero points (int4's, grouped int8's) multiply the sum of the quantized x, not of x: the offset then cancels
      // out of the error
      for (int h = 0; h < 2; ++h) r.fsum[m * (I / G) + (b * 32 + h * 16) / G] += s * float(qs[h]);
    }
    for (int64_t c = 0; c < nc; ++c) {
      const int8_t* q = r.q.data() + m * I + c * 64;
      int8_t* lo = r.lo.data() + m * (I / 2) + c * 32;
      int8_t* hi = r.hi.data() + m * (I / 2) + c * 32;
      for (int j = 0; j < 16; ++j) { lo[j] = q[j]; hi[j] = q[16 + j]; lo[16 + j] = q[32 + j]; hi[16 + j] = q[48 + j]; }
      const float s0 = r.s[m * nb + 2 * c], s1 = r.s[m * nb + 2 * c + 1];
      for (int j = 0; j < 8; ++j) { r.s16[(m * nc + c) * 16 + j] = s0; r.s16[(m * nc + c) * 16 + 8 + j] = s1; }
      for (int j = 0; j < 4; ++j) { r.s8[(m * nc + c) * 8 + j] = s0; r.s8[(m * nc + c) * 8 + 4 + j] = s1; }
    }
  }
  return r;
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

template <int M>
static void rows_i8(const QX& qx, int64_t m0, const int8_t* w, const float* scale, const B* bias, B* y, int64_t O,
                    int64_t begin, int64_t end) {
  const int64_t I = qx.I, nc = I / 64;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* wr = w + o * I;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      prefetch_stream(wr + c * 64);
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512((const void*)(wr + c * 64)), flip);  // w + 128
      for (int m = 0; m < M; ++m) {
        const int64_t mm = m0 + m;
        const __m512i xv = _mm512_loadu_si512((const void*)(qx.q.data() + mm * I + c * 64));
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);  // lanes 0-7: block 2c, 8-15: 2c+1
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(qx.s16.data() + (mm * nc + c) * 16), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = (_mm512_reduce_add_ps(acc[m]) - qx.corr[m0 + m]) * scale[o];
      if (bias) s += float(bias[o]);
      y[(m0 + m) * O + o] = B(s);
    }
  }
}

// int4 and int5 (FIVE: each value's fifth bit added as 16 by a masked byte add, the bits stored as the lanes'
// masks), groups of G (int5: 32): 128 values per step in 512-bit registers (64 weight bytes: chunks c and c + 1 of
// qx's 64-value layout, whose lo/hi bytes and block scales lie side by side), a last odd chunk in 256 bits. The
// zero points where no offsets are stored: 8 (Q4_0), 16 (Q5_0).
template <int M, bool FIVE>
static void rows_i45(const QX& qx, int64_t m0, const uint8_t* w, const uint8_t* high, const float* scale,
                     const float* offset, const B* bias, B* y, int64_t O, int64_t begin, int64_t end) {
  const int64_t I = qx.I, G = qx.G, nc = I / 64, ng = I / G;
  const int gshift = __builtin_ctzll(G);  // G is 32, 64 or 128: a shift, never a division in the loop
  const __m512i mask = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* wr = w + o * (I / 2);
    const uint32_t* hb = FIVE ? (const uint32_t*)(high + o * (I / 8)) : nullptr;
    const float* sr = scale + o * ng;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= nc; c += 2) {
      prefetch_span<64>(wr + c * 32, c * 32);
      const __m512i b = _mm512_loadu_si512((const void*)(wr + c * 32));
      __m512i lo = _mm512_and_si512(b, mask), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
      if constexpr (FIVE) {
        lo = _mm512_mask_add_epi8(lo, __mmask64(hb[2 * c] | uint64_t(hb[2 * c + 2]) << 32), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, __mmask64(hb[2 * c + 1] | uint64_t(hb[2 * c + 3]) << 32), hi, sixteen);
      }
      // lanes 4k..4k+3 hold 32-value block 2c + k
      const int64_t b0 = 2 * c;
      const __m128 s4 = G == 32 ? _mm_loadu_ps(sr + b0)
                                : _mm_set_ps(sr[((b0 + 3) * 32) >> gshift], sr[((b0 + 2) * 32) >> gshift],
                                             sr[((b0 + 1) * 32) >> gshift], sr[(b0 * 32) >> gshift]);
      const __m512 ws = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
      for (int m = 0; m < M; ++m) {
        const int64_t mm = m0 + m;
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                        _mm512_loadu_si512((const void*)(qx.lo.data() + mm * (I / 2) + c * 32)));
        d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void*)(qx.hi.data() + mm * (I / 2) + c * 32)));
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(qx.s8.data() + (mm * nc + c) * 8), ws);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[m]);
      }
    }
    float tail[M];
    for (int m = 0; m < M; ++m) tail[m] = 0.f;
    if (c < nc) {  // one chunk of 64 values left
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      const __m256i b = _mm256_loadu_si256((const __m256i*)(wr + c * 32));
      __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
      if constexpr (FIVE) {
        lo = _mm256_mask_add_epi8(lo, __mmask32(hb[2 * c]), lo, _mm256_set1_epi8(16));
        hi = _mm256_mask_add_epi8(hi, __mmask32(hb[2 * c + 1]), hi, _mm256_set1_epi8(16));
      }
      const __m256 ws = _mm256_set_m128(_mm_set1_ps(sr[(c * 64 + 32) >> gshift]), _mm_set1_ps(sr[(c * 64) >> gshift]));
      for (int m = 0; m < M; ++m) {
        const int64_t mm = m0 + m;
        __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i*)(qx.lo.data() + mm * (I / 2) + c * 32)));
        d = _mm256_dpbusd_epi32(d, hi, _mm256_loadu_si256((const __m256i*)(qx.hi.data() + mm * (I / 2) + c * 32)));
        const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(qx.s8.data() + (mm * nc + c) * 8), ws);
        tail[m] = hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(d), sv));
      }
    }
    // the offsets (or the zero point of Q4_0, 8, or Q5_0, 16, times the scale) against each group's sum of x
    const __m512 zero = _mm512_set1_ps(FIVE ? -16.f : -8.f);
    const float* mr = offset ? offset + o * ng : nullptr;
    for (int m = 0; m < M; ++m) {
      const float* fs = qx.fsum.data() + (m0 + m) * ng;
      __m512 corr = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; g += 16) {
        const __mmask16 k = ng - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ng - g)) - 1);
        const __m512 coef = mr ? _mm512_maskz_loadu_ps(k, mr + g) : _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + g), zero);
        corr = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(k, fs + g), corr);
      }
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], corr)) + tail[m];
      if (bias) s += float(bias[o]);
      y[(m0 + m) * O + o] = B(s);
    }
  }
}

// int8 in groups of G (16 or 32) with a scale and optionally an offset each (qgemv.cpp's grouped format): the
// lanes of one 64-byte dot product hold groups 64c/G.. in order (4 lanes = 16 weights), so the weights' scales are
// spread over them beside the input blocks'. The +128 of the unsigned weights and the offsets both multiply a
// group's sum of the quantized x: one pass over the groups at the end, (offset - 128 scale) . fsum.
template <int M, int G>
static void rows_i8g(const QX& qx, int64_t m0, const int8_t* w, const float* scale, const float* offset,
                     const B* bias, B* y, int64_t O, int64_t begin, int64_t end) {
  const int64_t I = qx.I, nc = I / 64, ng = I / G;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  // lane l of a chunk's sums belongs to weight group l / (G / 4) of the chunk's 64 / G groups
  const __m512i spread = G == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __mmask16 per_chunk = G == 16 ? 0xF : 0x3;
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* wr = w + o * I;
    const float* sr = scale + o * ng;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      prefetch_stream(wr + c * 64);
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512((const void*)(wr + c * 64)), flip);  // w + 128
      const __m512 ws = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(per_chunk, sr + c * (64 / G)));
      for (int m = 0; m < M; ++m) {
        const int64_t mm = m0 + m;
        const __m512i xv = _mm512_loadu_si512((const void*)(qx.q.data() + mm * I + c * 64));
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(qx.s16.data() + (mm * nc + c) * 16), ws);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[m]);
      }
    }
    const float* mr = offset ? offset + o * ng : nullptr;
    for (int m = 0; m < M; ++m) {
      const float* fs = qx.fsum.data() + (m0 + m) * ng;
      __m512 corr = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; g += 16) {
        const __mmask16 k = ng - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ng - g)) - 1);
        __m512 coef = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + g), _mm512_set1_ps(-128.f));
        if (mr) coef = _mm512_add_ps(coef, _mm512_maskz_loadu_ps(k, mr + g));
        corr = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(k, fs + g), corr);
      }
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], corr));
      if (bias) s += float(bias[o]);
      y[(m0 + m) * O + o] = B(s);
    }
  }
}


// x [M, I] bf16 (I a multiple of 64), w int8 [O, I], scale [O]; y [M, O] bf16
extern "C" void fulcrum_qgemv_int8_vnni(const void* x, const void* w, const void* scale, const void* bias, void* y,
                                        int64_t M, int64_t I, int64_t O) {
  const QX qx = quantize_x((const B*)x, M, I, I);
  split_rows(M, O, I, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const int8_t* wq = (const int8_t*)w;
    const float* s = (const float*)scale;
    switch (n) {
      case 1: rows_i8<1>(qx, m0, wq, s, (const B*)bias, (B*)y, O, o, oe); break;
      case 2: rows_i8<2>(qx, m0, wq, s, (const B*)bias, (B*)y, O, o, oe); break;
      case 3: rows_i8<3>(qx, m0, wq, s, (const B*)bias, (B*)y, O, o, oe); break;
      default: rows_i8<4>(qx, m0, wq, s, (const B*)bias, (B*)y, O, o, oe); break;
    }
  });
}

// the int4 format of cpu_qgemv (w [O, I/2], scale/offset [O, I/G]); I a multiple of 64
extern "C" void fulcrum_qgemv_int4_vnni(const void* x, const void* w, const void* scale, const void* offset,
                                        const void* bias, void* y, int64_t M, int64_t I, int64_t O, int64_t G) {
  const QX qx = quantize_x((const B*)x, M, I, G);
  split_rows(M, O, I / 2, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const uint8_t* wq = (const uint8_t*)w;
    const float *s = (const float*)scale, *mo = (const float*)offset;
    switch (n) {
      case 1: rows_i45<1, false>(qx, m0, wq, nullptr, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      case 2: rows_i45<2, false>(qx, m0, wq, nullptr, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      case 3: rows_i45<3, false>(qx, m0, wq, nullptr, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      default: rows_i45<4, false>(qx, m0, wq, nullptr, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
    }
  });
}

// the grouped int8 format (w [O, I] int8, scale and offset or null [O, I/G], G 16 or 32); I a multiple of 64
extern "C" void fulcrum_qgemv_int8g_vnni(const void* x, const void* w, const void* scale, const void* offset,
                                         const void* bias, void* y, int64_t M, int64_t I, int64_t O, int64_t G) {
  const QX qx = quantize_x((const B*)x, M, I, G);
  split_rows(M, O, I, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const int8_t* wq = (const int8_t*)w;
    const float *s = (const float*)scale, *mo = (const float*)offset;
    const B* b = (const B*)bias;
    B* yb = (B*)y;
    if (G == 16) {
      switch (n) {
        case 1: rows_i8g<1, 16>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        case 2: rows_i8g<2, 16>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        case 3: rows_i8g<3, 16>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        default: rows_i8g<4, 16>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
      }
    } else {
      switch (n) {
        case 1: rows_i8g<1, 32>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        case 2: rows_i8g<2, 32>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        case 3: rows_i8g<3, 32>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
        default: rows_i8g<4, 32>(qx, m0, wq, s, mo, b, yb, O, o, oe); break;
      }
    }
  });
}

// the int5 format of qgemv.cpp (groups of 32; offset null: the zero point 16); I a multiple of 64
extern "C" void fulcrum_qgemv_int5_vnni(const void* x, const void* w, const void* high, const void* scale,
                                        const void* offset, const void* bias, void* y, int64_t M, int64_t I,
                                        int64_t O) {
  const QX qx = quantize_x((const B*)x, M, I, 32);
  split_rows(M, O, I / 2 + I / 8, [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const uint8_t *wq = (const uint8_t*)w, *h = (const uint8_t*)high;
    const float *s = (const float*)scale, *mo = (const float*)offset;
    switch (n) {
      case 1: rows_i45<1, true>(qx, m0, wq, h, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      case 2: rows_i45<2, true>(qx, m0, wq, h, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      case 3: rows_i45<3, true>(qx, m0, wq, h, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
      default: rows_i45<4, true>(qx, m0, wq, h, s, mo, (const B*)bias, (B*)y, O, o, oe); break;
    }
  });
}
