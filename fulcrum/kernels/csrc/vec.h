// The vector primitives at the level the compiler's flags name (-mavx512f: vec_avx512.h, else -mavx2: vec_avx2.h;
// the contract is at the top of each), and what is written once on them: vexp and the typed rounding stores.
#pragma once

#if defined(__AVX512F__)
#include "vec_avx512.h"
#elif defined(__AVX2__)
#include "vec_avx2.h"
#else
#error "the vector kernels need AVX2 or AVX-512 (cpu_ext.ISA_FLAGS)"
#endif

// e^x for -87 <= x <= 87 (less is taken as -87): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2; degree-6
// polynomial, relative error ~2e-7
static inline vf vexp(vf x) {
  x = vmax(x, vset1(-87.0f));
  vf n = vround(vmul(x, vset1(1.44269504f)));
  vf r = vfnmadd(n, vset1(0.693145752f), x);
  r = vfnmadd(n, vset1(1.42860677e-6f), r);
  vf p = vset1(1.0f / 720);
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vexp2i(p, n);
}

// A value rounded to T, kept as fp32, and stored as T, by the pointer's type (bf16: vround_bf16's rounding)
static inline vf vround(vf a, c10::BFloat16*) { return vround_bf16(a); }
static inline void vstore_as(c10::BFloat16* p, vf a) { vstore_bf16(p, a); }
static inline vf vround(vf a, float*) { return a; }
static inline void vstore_as(float* p, vf a) { vstore(p, a); }
