// The vector contract at AVX2 (vec_avx512.h is the same contract at AVX-512): a kernel written against these names
// builds for either level unchanged; vec.h picks the level by the compiler's flags.
//   vf, VW                   a vector of VW fp32 lanes (8 here)
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

typedef __m256 vf;
constexpr int VW = 8;
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline float vmax_all(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vexp2i(vf p, vf n) {  // n goes straight into the exponent bits
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf vload_f8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}
static inline vf vround_bf16(vf a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000))));
}
static inline void vstore_bf16(c10::BFloat16* p, vf a) {
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(a)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // 8 words in the low half
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
