// Rotary embedding and the KV-cache write in one pass: q and k rotated in place, the rotated k and v copied (or
// quantized) into their cache slots, where PyTorch spends ten small ops per layer. The arithmetic is the reference's:
// in bf16 each product and the sum are rounded as the PyTorch ops round them, so outputs are identical. Plain loops,
// vectorised by the compiler for the level.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>

#include "exports.h"
#include "prelude.h"

// a * c + b * s as two rounded products and a rounded sum, never one fused multiply-add: fp32 results then equal
// PyTorch's bit for bit too
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

template <typename T> static inline T mul_add(T a, T c, T b, T s) {
  // (a * c) + (b * s), each step rounded to T, as the PyTorch ops on T tensors do
  return T(float(T(float(a) * float(c))) + float(T(float(b) * float(s))));
}

// x [T, heads, D] with a row stride of `xs` elements per token; cos/sin [T, D] (sin signed for rotate-half)
template <typename T>
static inline void rotate_row(T* x, const T* c, const T* s, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const T a = x[i], b = x[i + h];
    x[i] = mul_add(a, c[i], b, s[i]);
    x[i + h] = mul_add(b, c[i + h], a, s[i + h]);
  }
}

// A quantized cache (kind 1: int8, 2: fp8 e4m3): each head's D values with one fp16 scale, its largest magnitude
// over the format's; values divided by the rounded scale, then rounded (int8: half to even) and clamped, as
// fulcrum.quant.kv.quantize does in PyTorch ops.
template <typename T>
static void quantize_head(const T* x, int64_t D, int kind, void* out, c10::Half* scale) {
  const float qmax = kind == 1 ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(float(x[i])));
  const c10::Half hs(amax / qmax);
  *scale = hs;
  const float s = float(hs);
  for (int64_t i = 0; i < D; ++i) {
    const float y = s > 0.f ? std::min(qmax, std::max(-qmax, float(x[i]) / s)) : 0.f;
    if (kind == 1) ((int8_t*)out)[i] = int8_t(std::nearbyint(y));
    else ((c10::Float8_e4m3fn*)out)[i] = c10::Float8_e4m3fn(y);
  }
}

template <typename T>
static void rope_cache(T* q, T* k, const T* v, const T* cos, const T* sin, const int64_t* slots, void* kc, void* vc,
                       c10::Half* ksc, c10::Half* vsc, int kind, int64_t ntok, int64_t H, int64_t KVH, int64_t D,
                       int64_t qs, int64_t ks, int64_t vs) {
  at::parallel_for(0, ntok, std::max<int64_t>(1, 256 / (H + KVH)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t hh = 0; hh < H; ++hh) rotate_row(q + t * qs + hh * D, c, s, D);
      for (int64_t hh = 0; hh < KVH; ++hh) rotate_row(k + t * ks + hh * D, c, s, D);
      if (!kc) continue;
      const int64_t slot = slots[t];
      if (kind == 0) {
        std::memcpy((T*)kc + slot * KVH * D, k + t * ks, KVH * D * sizeof(T));
        std::memcpy((T*)vc + slot * KVH * D, v + t * vs, KVH * D * sizeof(T));
        continue;
      }
      for (int64_t hh = 0; hh < KVH; ++hh) {  // one byte per value
        const int64_t at = slot * KVH + hh;
        quantize_head(k + t * ks + hh * D, D, kind, (int8_t*)kc + at * D, ksc + at);
        quantize_head(v + t * vs + hh * D, D, kind, (int8_t*)vc + at * D, vsc + at);
      }
    }
  });
}

// kind: 0 a cache of T, 1 int8 and 2 fp8 with fp16 scales ksc/vsc [slots, KVH]
extern "C" void fulcrum_rope_cache(int64_t bf16, void* q, void* k, const void* v, const void* cos, const void* sin,
                                   const void* slots, void* kc, void* vc, void* ksc, void* vsc, int64_t kind,
                                   int64_t ntok, int64_t H, int64_t KVH, int64_t D, int64_t qs, int64_t ks,
                                   int64_t vs) {
  using B = at::BFloat16;
  using S = c10::Half;
  const int64_t* sl = (const int64_t*)slots;
  if (bf16) rope_cache((B*)q, (B*)k, (const B*)v, (const B*)cos, (const B*)sin, sl, kc, vc, (S*)ksc, (S*)vsc, int(kind), ntok, H, KVH, D, qs, ks, vs);
  else rope_cache((float*)q, (float*)k, (const float*)v, (const float*)cos, (const float*)sin, sl, kc, vc, (S*)ksc, (S*)vsc, int(kind), ntok, H, KVH, D, qs, ks, vs);
}
