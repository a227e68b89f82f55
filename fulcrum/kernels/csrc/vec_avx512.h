// The vector contract at AVX-512 (vec_avx2.h is the same contract at AVX2): a kernel written against these names
// builds for either level unchanged; vec.h picks the level by the compiler's flags.
//   vf, VW                   a vector of VW fp32 lanes (16 here)
//   vload(p)                 VW values from float* or c10::BFloat16* (bf16 widened exactly: a 16-bit shift)
//   vstore(p, a)             VW fp32 values to float*
//   vset1, vzero             broadcast, zero
//   vadd vsub vmul vdiv vmax vmin            lane-wise
//   vfmadd(a, b, c)          a * b + c, one rounding;  vfnmadd(a, b, c): c - a * b
//   vsum(a), vmax_all(a)     the sum, the largest, of a's lanes
//   vround(x)                to the nearest integer (ties to even)
//   vexp2i(p, n)             p * 2^n for integral n (n >= -126)
//   vload_i8(p)              VW int8 values, widened
//   vload_f8(p)              VW fp8 e4m3 bytes as 2^-8 times their value (fp16's bias 15 against e4m3's 7; exact,
//                            subnormals included): callers fold 2^8 into their scale
//   vround_bf16(a)           a rounded to bf16 (nearest even, as `.to()` rounds finite values), kept as fp32
//   vstore_bf16(p, a)        VW values stored as bf16, rounded so
#pragma once

#include "prelude.h"

typedef __m512 vf;
constexpr int VW = 16;
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vmax_all(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
static inline vf vexp2i(vf p, vf n) { return _mm512_scalef_ps(p, n); }
static inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// fp8 e4m3 as fp16: sign, then exponent and mantissa 7 bits up; F16C widens fp16 exactly
static inline vf vload_f8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}
static inline vf vround_bf16(vf a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000))));
}
static inline void vstore_bf16(c10::BFloat16* p, vf a) {
  const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(a)), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(h));
}
