"""A CPU kernel for decode attention read straight from the paged KV cache.

PyTorch's path for a decode step gathers every sequence's blocks into a padded [D, KVH, L, hd]
copy (`k_cache[block_tables]`) and runs SDPA with a mask over it: the copy and the masked padding
cost far more than the few FLOPs and bytes of KV the step needs, and profiles of throughput runs
showed it as a large share of the step (figures in the commit that added this kernel).

This kernel gives one (sequence, KV head) pair to a task: it reads each cached key once through the
block table, scores it against all query heads of the group in fp32, takes a softmax per head
(vectorised exp), and sums the values the same way. No gather, no padding, no mask. Built by
`fulcrum.kernels.cpu_ext`; callers fall back to PyTorch where it is not available.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext

MAX_GROUP = 16  # query heads per KV head the kernel keeps in its scratch
_DTYPES = (torch.bfloat16, torch.float32)
_CACHE_KINDS = cpu_ext.KV_CACHE_KINDS

_BODY = r"""
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <cmath>
#include <vector>

constexpr int64_t MAX_G = 16;  // query heads per KV head (MAX_GROUP)

// A quantized cache (fulcrum.quant.kv): one byte per value, one fp16 scale per token and head. fp8 loads as 2^-8
// times its value (vload_f8), so its scales carry the 2^8.
static inline vf vload(const int8_t* p) { return vload_i8(p); }
static inline vf vload(const c10::Float8_e4m3fn* p) { return vload_f8((const uint8_t*)p); }
template <typename C> constexpr float load_factor() { return std::is_same_v<C, c10::Float8_e4m3fn> ? 256.f : 1.f; }

// A head of HD values in vectors of VW: HD need not be a multiple of VW (a draft's head_dim 24 on AVX-512). The
// last vector then holds the HD % VW values left and zeros, loaded through a zeroed buffer so that no read passes
// the head's end (the next head's values, or the cache's end); zero queries make the padded lanes score nothing.
template <int HD> constexpr int num_vectors() { return (HD + VW - 1) / VW; }
template <int HD, typename P>
static inline vf vload_head(const P* p, int c) {
  if constexpr (HD % VW != 0) {
    if (c == num_vectors<HD>() - 1) {
      alignas(64) unsigned char buf[VW * sizeof(P)] = {};
      std::memcpy(buf, p + VW * c, (HD % VW) * sizeof(P));
      return vload((const P*)buf);
    }
  }
  return vload(p + VW * c);
}


// Calls fn(i, row, slot) for the cached tokens start..ctx-1 in order (i counts from 0; slot: the token's cache
// slot), walking the block table once instead of dividing every position by the block size. While a block is
// read, the next block's `head_bytes` of each token are prefetched: blocks lie anywhere in the cache, where the
// hardware prefetchers do not follow.
template <typename C, typename Fn>
static inline void for_each_token(const C* cache, const int64_t* table, int64_t start, int64_t ctx, int64_t bs,
                                  int64_t kv_stride, Fn fn, int64_t head_bytes = 64) {
  int64_t i = 0;
  for (int64_t blk = start / bs, off = start % bs; blk * bs < ctx; ++blk, off = 0) {
    const C* base = cache + table[blk] * bs * kv_stride;
    const int64_t stop = std::min(bs, ctx - blk * bs);
    if ((blk + 1) * bs < ctx) {
      const char* next = (const char*)(cache + table[blk + 1] * bs * kv_stride);
      const int64_t rows = std::min(bs, ctx - (blk + 1) * bs);
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t b = 0; b < head_bytes; b += 64)
          _mm_prefetch(next + j * kv_stride * int64_t(sizeof(C)) + b, _MM_HINT_T0);
    }
    for (int64_t j = off; j < stop; ++j) fn(i++, base + j * kv_stride, table[blk] * bs + j);
  }
}

// VW vectors in, one out: lane j holds the sum of vector j's lanes, so that a head scores VW keys per vector. A
// transpose that adds as it goes: in-lane unpacks and shuffles first (cheap), the 128-bit lanes crossed only at the
// end, about 2 shuffles and 1 add per vector where a horizontal sum of each takes 4 shuffles and 4 adds.
#if defined(__AVX512F__)
static inline vf vsum_each(vf* v) {
  vf x[8], y[4], z[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    x[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: the lane's sums of a, b, c, d
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44), _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
  for (int j = 0; j < 2; ++j)  // 128-bit lanes 0+1 and 2+3 of two vectors
    z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0x88), _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
#else
static inline vf vsum_each(vf* v) {  // AVX2's in-lane hadd twice, then the two 128-bit halves
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
#endif

// q and out of T; the cache of C: T itself (ksc, vsc null), int8 or fp8 with the head's scales (stride `sstride`
// between slots), which multiply each key's scores and each value's weight. `scores` holds g rows of n rounded up
// to whole vectors.
template <typename T, typename C, int HD>
static void attend(const T* q, const C* kc, const C* vc, const c10::Half* ksc, const c10::Half* vsc,
                   int64_t sstride, const int64_t* table, int64_t start, int64_t ctx, int64_t bs, int64_t kv_stride,
                   int64_t g, float scale, float softcap, float* scores, T* out, int64_t q_stride) {
  constexpr float factor = load_factor<C>();
  constexpr bool quantized = !std::is_same_v<C, T>;
  constexpr int NV = num_vectors<HD>();
  const int64_t n = ctx - start, np = (n + VW - 1) / VW * VW;
  // queries of the group in fp32, scaled: [g][C] vectors (from L1 when they outnumber the registers)
  vf qv[16][NV];
  for (int64_t h = 0; h < g; ++h)
    for (int c = 0; c < NV; ++c) qv[h][c] = vmul(vload_head<HD>(q + h * q_stride, c), vset1(scale));
  // scores [g, np], VW keys at a time: each key read and widened once, its g partial products summed lane-wise
  // with the VW-1 others of its chunk into one vector of VW scores; a last, partial chunk repeats its last key
  // and its lanes past the end are set to -inf, which the softmax turns into zero weights
  const C* keys[VW];
  alignas(64) float kscale[VW];
  int64_t filled = 0, chunk = 0;
  auto score_chunk = [&]() {
    for (int64_t j = filled; j < VW; ++j) {
      keys[j] = keys[filled - 1];
      if constexpr (quantized) kscale[j] = kscale[filled - 1];
    }
    vf kv[VW][NV];
    for (int j = 0; j < VW; ++j)
      for (int c = 0; c < NV; ++c) kv[j][c] = vload_head<HD>(keys[j], c);
    for (int64_t h = 0; h < g; ++h) {
      vf part[VW];
      for (int j = 0; j < VW; ++j) {
        vf a = vmul(qv[h][0], kv[j][0]);
        for (int c = 1; c < NV; ++c) a = vfmadd(qv[h][c], kv[j][c], a);
        part[j] = a;
      }
      vf sc = vsum_each(part);
      if constexpr (quantized) sc = vmul(sc, vload(kscale));
      vstore(scores + h * np + chunk * VW, sc);
      for (int64_t j = filled; j < VW; ++j) scores[h * np + chunk * VW + j] = -INFINITY;
    }
    ++chunk, filled = 0;
  };
  for_each_token(kc, table, start, ctx, bs, kv_stride, [&](int64_t, const C* k, int64_t slot) {
    keys[filled] = k;
    if constexpr (quantized) kscale[filled] = float(ksc[slot * sstride]) * factor;
    if (++filled == VW) score_chunk();
  }, HD * int64_t(sizeof(C)));
  if (filled) score_chunk();
  // Gemma 2's soft cap on the scaled scores, cap * tanh(score / cap), before the softmax (not on the padding)
  if (softcap > 0)
    for (int64_t h = 0; h < g; ++h)
      for (int64_t t = 0; t < n; ++t) scores[h * np + t] = softcap * std::tanh(scores[h * np + t] / softcap);
  // softmax per head in place, unnormalised: the sum's inverse scales the output instead of every weight
  float inv[16];
  for (int64_t h = 0; h < g; ++h) {
    float* s = scores + h * np;
    vf m = vset1(-INFINITY);
    for (int64_t t = 0; t < np; t += VW) m = vmax(m, vload(s + t));
    const vf mx = vset1(vmax_all(m));
    vf sum = vzero();
    for (int64_t t = 0; t < np; t += VW) {
      const vf e = vexp(vsub(vload(s + t), mx));
      vstore(s + t, e);
      sum = vadd(sum, e);
    }
    inv[h] = 1.0f / vsum(sum);
  }
  // out [g, HD]: one value read, g weighted sums; groups of up to 4 heads keep their sums in registers
  for (int64_t h0 = 0; h0 < g; h0 += 4) {
    const int64_t hn = std::min<int64_t>(4, g - h0);
    vf acc[4][NV];
    for (int64_t h = 0; h < hn; ++h) for (int c = 0; c < NV; ++c) acc[h][c] = vzero();
    for_each_token(vc, table, start, ctx, bs, kv_stride, [&](int64_t i, const C* v, int64_t slot) {
      vf vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = vload_head<HD>(v, c);
      float vs = 1.f;
      if constexpr (quantized) vs = float(vsc[slot * sstride]) * factor;
      for (int64_t h = 0; h < hn; ++h) {
        const vf p = vset1(quantized ? scores[(h0 + h) * np + i] * vs : scores[(h0 + h) * np + i]);
        for (int c = 0; c < NV; ++c) acc[h][c] = vfmadd(p, vv[c], acc[h][c]);
      }
    }, HD * int64_t(sizeof(C)));
    for (int64_t h = 0; h < hn; ++h) {
      alignas(64) float tmp[NV * VW];
      for (int c = 0; c < NV; ++c) vstore(tmp + VW * c, vmul(acc[h][c], vset1(inv[h0 + h])));
      for (int d = 0; d < HD; ++d) store(out + (h0 + h) * q_stride + d, tmp[d]);
    }
  }
}

template <typename T, typename C, int HD>
static void run(const T* qp, const C* kp, const C* vp, const c10::Half* ks, const c10::Half* vs, const int64_t* tp,
                const int64_t* lp, T* op, int64_t D, int64_t H, int64_t KVH, int64_t bs, int64_t width, float scale,
                int64_t window, float softcap) {
  const int64_t g = H / KVH, kv_stride = KVH * HD;
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < D; ++i) max_ctx = std::max(max_ctx, lp[i]);
  at::parallel_for(0, D * KVH, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(g * (max_ctx + VW));  // each head's row rounded up to whole vectors
    for (int64_t task = b; task < e; ++task) {
      const int64_t i = task / KVH, kvh = task % KVH, ctx = lp[i];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      attend<T, C, HD>(qp + (i * H + kvh * g) * HD, kp + kvh * HD, vp + kvh * HD, ks ? ks + kvh : nullptr,
                       vs ? vs + kvh : nullptr, KVH, tp + i * width, start, ctx, bs, kv_stride, g, scale, softcap,
                       scores.data(), op + (i * H + kvh * g) * HD, HD);
    }
  });
}

template <typename T, int HD>
static void run_cache(int64_t kind, const void* q, const void* kc, const void* vc, const void* ks, const void* vs,
                      const int64_t* tables, const int64_t* lens, void* out, int64_t D, int64_t H, int64_t KVH,
                      int64_t bs, int64_t width, float scale, int64_t window, float softcap) {
  using S = c10::Half;
  const S *ksc = (const S*)ks, *vsc = (const S*)vs;
#if QUANTIZED_KV  // the quantized caches' build: int8 and fp8 only
  if (kind == 1)
    run<T, int8_t, HD>((const T*)q, (const int8_t*)kc, (const int8_t*)vc, ksc, vsc, tables, lens, (T*)out, D, H,
                       KVH, bs, width, scale, window, softcap);
  else if (kind == 2)
    run<T, c10::Float8_e4m3fn, HD>((const T*)q, (const c10::Float8_e4m3fn*)kc, (const c10::Float8_e4m3fn*)vc, ksc,
                                   vsc, tables, lens, (T*)out, D, H, KVH, bs, width, scale, window, softcap);
#else
  if (kind == 0)
    run<T, T, HD>((const T*)q, (const T*)kc, (const T*)vc, nullptr, nullptr, tables, lens, (T*)out, D, H, KVH, bs,
                  width, scale, window, softcap);
#endif
}

// -- prefill: causal attention of n queries (the last n of m positions) over m keys, flash-style ----------------
// Keys go in tiles of KT: NK vectors' worth (64 keys on AVX-512, 16 on AVX2, what the registers hold for RB rows).
// Each KV head's keys are widened to fp32 and transposed once per call into [tile][hd][KT], its values widened into
// [position][hdp]; then a task (one KV head, a block of queries with all g query heads of the group) walks the tiles
// up to its last query, RB rows at a time: a tile's scores are RB x NK accumulators (each transposed key vector read
// once for the RB rows), the online softmax folds the tile into each row's running max and sum once per KT keys, and
// the weighted values go into the accumulators RB rows by CB vectors at a time. No score matrix, no mask tensor: the
// causal limit is a count of keys per row. (Tiles of one vector, re-widened by every task, ran at 51-72 GFLOP/s.)
constexpr int NK = VW == 16 ? 4 : 2;
constexpr int KT = NK * VW;
constexpr int RB = 4;
constexpr int CB = VW == 16 ? 4 : 2;
constexpr int64_t TASK_ROWS = 128;                // rows (queries x group) a task aims at, to amortise each tile read
constexpr int64_t WIDE_BYTES = int64_t(64) << 20;  // widened K/V of at most this many bytes at once (KV heads in turns)

// the weighted values of one tile into R rows' accumulators, value vectors c..c+B-1
template <int R, int B>
static inline void prefill_values(float* acc, const float* Vb, const float (*p)[KT], const float* corr, int64_t valid,
                                  int64_t hdp, int64_t c) {
  vf a[R][B];
  for (int j = 0; j < R; ++j)
    for (int b = 0; b < B; ++b) a[j][b] = vmul(vload(acc + j * hdp + (c + b) * VW), vset1(corr[j]));
  for (int64_t i = 0; i < valid; ++i) {
    vf vv[B];
    for (int b = 0; b < B; ++b) vv[b] = vload(Vb + i * hdp + (c + b) * VW);
    for (int j = 0; j < R; ++j) {
      const vf pj = vset1(p[j][i]);
      for (int b = 0; b < B; ++b) a[j][b] = vfmadd(pj, vv[b], a[j][b]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int b = 0; b < B; ++b) vstore(acc + j * hdp + (c + b) * VW, a[j][b]);
}

// R rows (queries) against one key tile: scores, the causal limit (a row sees `seen` keys: those past it in the tile
// become -inf), the online-softmax update, and the weighted values. Q rows hold hd values; the accumulators and value
// rows hdp (hd rounded up to whole vectors, the padding zero).
template <int R>
static inline void prefill_rows(const float* Q, float* acc, float* mx, float* sum, const float* Kt, const float* Vb,
                                const int64_t* seen, int64_t k0, int64_t kn, int64_t hd, int64_t hdp,
                                int64_t window) {
  vf sc[R][NK];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < NK; ++c) sc[j][c] = vzero();
  for (int64_t d = 0; d < hd; ++d) {
    vf kt[NK];
    for (int c = 0; c < NK; ++c) kt[c] = vload(Kt + d * KT + c * VW);
    for (int j = 0; j < R; ++j) {
      const vf qd = vset1(Q[j * hd + d]);
      for (int c = 0; c < NK; ++c) sc[j][c] = vfmadd(qd, kt[c], sc[j][c]);
    }
  }
  alignas(64) float p[R][KT];
  float corr[R];
  int64_t valid = 0;  // keys of the tile any of the R rows sees
  for (int j = 0; j < R; ++j) {
    for (int c = 0; c < NK; ++c) vstore(p[j] + c * VW, sc[j][c]);
    const int64_t vj = std::max<int64_t>(0, std::min<int64_t>(kn, seen[j] - k0));
    for (int64_t i = vj; i < KT; ++i) p[j][i] = -INFINITY;
    if (window > 0)  // a sliding window: the keys before the row's first are out too
      for (int64_t i = 0, lo = seen[j] - window - k0; i < std::min<int64_t>(lo, KT); ++i) p[j][i] = -INFINITY;
    valid = std::max(valid, vj);
    vf mv = vload(p[j]);
    for (int c = 1; c < NK; ++c) mv = vmax(mv, vload(p[j] + c * VW));
    const float m_new = std::max(mx[j], vmax_all(mv));
    if (m_new == -INFINITY) {  // nothing seen yet (a window starting past this tile): nothing to add
      corr[j] = 1.f;
      for (int c = 0; c < NK; ++c) vstore(p[j] + c * VW, vzero());
      continue;
    }
    corr[j] = std::exp(mx[j] - m_new);  // 0 on a row's first tile (mx = -inf); 1 when nothing here is seen
    const vf mn = vset1(m_new);
    vf s = vzero();
    for (int c = 0; c < NK; ++c) {
      const vf e = vexp(vsub(vload(p[j] + c * VW), mn));
      vstore(p[j] + c * VW, e);
      s = vadd(s, e);
    }
    sum[j] = sum[j] * corr[j] + vsum(s);
    mx[j] = m_new;
  }
  const int64_t nv = hdp / VW;
  int64_t c = 0;
  for (; c + CB <= nv; c += CB) prefill_values<R, CB>(acc, Vb, p, corr, valid, hdp, c);
  for (; c < nv; ++c) prefill_values<R, 1>(acc, Vb, p, corr, valid, hdp, c);
}

// KV head kvh's keys from tile t0 on, widened and transposed: Kt [tile][hd][KT], and its values widened: Vw
// [position][hdp]; positions past m (the last tile's tail) are zeros, masked out by the rows' counts
template <typename T>
static void widen_tile(const T* k, const T* v, int64_t m, int64_t kvh, int64_t hd, int64_t hdp, int64_t ks,
                       int64_t vs, int64_t t, float* Kt, float* Vw) {
  float* kt = Kt + t * hd * KT;
  for (int64_t i = 0; i < KT; ++i) {
    const int64_t pos = t * KT + i;
    float* vr = Vw + pos * hdp;
    if (pos < m) {
      const T* kr = k + pos * ks + kvh * hd;
      const T* vsrc = v + pos * vs + kvh * hd;
      for (int64_t d = 0; d < hd; ++d) kt[d * KT + i] = float(kr[d]);
      for (int64_t d = 0; d < hd; ++d) vr[d] = float(vsrc[d]);
    } else {
      for (int64_t d = 0; d < hd; ++d) kt[d * KT + i] = vr[d] = 0.f;
    }
    for (int64_t d = hd; d < hdp; ++d) vr[d] = 0.f;
  }
}

template <typename T>
static void prefill_task(const T* q, T* out, const float* Kt, const float* Vw, int64_t n, int64_t m, int64_t H,
                         int64_t KVH, int64_t hd, int64_t qs, int64_t os, float scale, int64_t kvh, int64_t q0,
                         int64_t qb, int64_t window, float* scratch, int64_t* seen) {
  const int64_t g = H / KVH, q1 = std::min(n, q0 + qb), rows = (q1 - q0) * g, past = m - n;
  const int64_t hdp = (hd + VW - 1) / VW * VW;  // hd in whole vectors (a multiple of 8 on AVX-512: half of one)
  float* Q = scratch;                  // [rows][hd], scaled
  float* acc = Q + qb * MAX_G * hd;    // [rows][hdp]
  float* mx = acc + qb * MAX_G * hdp;  // [rows]
  float* sum = mx + qb * MAX_G;        // [rows]
  for (int64_t t = q0; t < q1; ++t)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (t - q0) * g + j;
      const T* src = q + t * qs + (kvh * g + j) * hd;
      for (int64_t d = 0; d < hd; ++d) Q[r * hd + d] = float(src[d]) * scale;
      for (int64_t d = 0; d < hdp; ++d) acc[r * hdp + d] = 0.f;
      mx[r] = -INFINITY;
      sum[r] = 0.f;
      seen[r] = past + t + 1;
    }
  const int64_t last = past + q1;  // keys the block's last query sees
  // the first key the block's first query sees (a sliding window's), aligned down to a tile
  const int64_t first = window > 0 ? std::max<int64_t>(0, past + q0 + 1 - window) / KT * KT : 0;
  for (int64_t k0 = first; k0 < last; k0 += KT) {
    const int64_t kn = std::min<int64_t>(KT, last - k0);
    const float* kt = Kt + k0 / KT * hd * KT;
    const float* vb = Vw + k0 * hdp;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
      prefill_rows<RB>(Q + r * hd, acc + r * hdp, mx + r, sum + r, kt, vb, seen + r, k0, kn, hd, hdp, window);
    for (; r + 2 <= rows; r += 2)
      prefill_rows<2>(Q + r * hd, acc + r * hdp, mx + r, sum + r, kt, vb, seen + r, k0, kn, hd, hdp, window);
    for (; r < rows; ++r)
      prefill_rows<1>(Q + r * hd, acc + r * hdp, mx + r, sum + r, kt, vb, seen + r, k0, kn, hd, hdp, window);
  }
  for (int64_t t = q0; t < q1; ++t)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (t - q0) * g + j;
      const float inv = 1.0f / sum[r];
      T* dst = out + t * os + (kvh * g + j) * hd;
      for (int64_t d = 0; d < hd; ++d) store(dst + d, acc[r * hdp + d] * inv);
    }
}

template <typename T>
static void prefill_all(const T* q, const T* k, const T* v, T* out, int64_t n, int64_t m, int64_t H, int64_t KVH,
                        int64_t hd, int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale, int64_t window) {
  const int64_t g = H / KVH, hdp = (hd + VW - 1) / VW * VW, tiles = (m + KT - 1) / KT;
  const int64_t qb = std::max<int64_t>(16, std::min<int64_t>(64, TASK_ROWS / g)), blocks = (n + qb - 1) / qb;
  // tiles no query sees (before the first query's window) are not widened
  const int64_t t0 = window > 0 ? std::max<int64_t>(0, m - n + 1 - window) / KT : 0;
  const int64_t head_floats = tiles * KT * (hd + hdp);
  const int64_t heads = std::max<int64_t>(1, std::min<int64_t>(KVH, WIDE_BYTES / 4 / head_floats));  // per turn
  std::vector<float> wide(heads * head_floats);
  const int64_t floats = qb * MAX_G * (hd + hdp) + 2 * qb * MAX_G;
  for (int64_t h0 = 0; h0 < KVH; h0 += heads) {
    const int64_t nh = std::min(heads, KVH - h0);
    at::parallel_for(0, nh * (tiles - t0), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* base = wide.data() + i / (tiles - t0) * head_floats;
        widen_tile(k, v, m, h0 + i / (tiles - t0), hd, hdp, ks, vs, t0 + i % (tiles - t0), base,
                   base + tiles * KT * hd);
      }
    });
    at::parallel_for(0, blocks * nh, 1, [&](int64_t b, int64_t e) {
      std::vector<float> scratch(floats + 16);
      std::vector<int64_t> seen(qb * MAX_G);
      for (int64_t t = b; t < e; ++t) {
        // short (early) and long (late) query blocks alternate, so contiguous task ranges carry similar work
        const int64_t i = t / nh, blk = i % 2 ? blocks - 1 - i / 2 : i / 2, h = t % nh;
        const float* base = wide.data() + h * head_floats;
        prefill_task(q, out, base, base + tiles * KT * hd, n, m, H, KVH, hd, qs, os, scale, h0 + h, blk * qb, qb,
                     window, scratch.data(), seen.data());
      }
    });
  }
}

// q [n, H, hd], k and v [m, KVH, hd], out [n, H, hd], each with its own row stride (elements between tokens; the
// heads of a token packed); the queries are the last n of the m positions. Returns 0, or -1 for a head_dim that is
// not a multiple of 8 or a group over MAX_G.
extern "C" int64_t fulcrum_prefill_attention(int64_t bf16, const void* q, const void* k, const void* v, void* out,
                                             int64_t n, int64_t m, int64_t H, int64_t KVH, int64_t hd, int64_t qs,
                                             int64_t ks, int64_t vs, int64_t os, float scale, int64_t window) {
  if (hd % 8 || H / KVH > MAX_G) return -1;
  if (bf16)
    prefill_all((const c10::BFloat16*)q, (const c10::BFloat16*)k, (const c10::BFloat16*)v, (c10::BFloat16*)out, n, m,
                H, KVH, hd, qs, ks, vs, os, scale, window);
  else
    prefill_all((const float*)q, (const float*)k, (const float*)v, (float*)out, n, m, H, KVH, hd, qs, ks, vs, os,
                scale, window);
  return 0;
}

// q and out [D, H, hd]; k/v cache [blocks, bs, KVH, hd]; tables [D, width] int64; ctx_lens [D] int64, all contiguous.
// kind 0: the cache in q's dtype; 1: int8, 2: fp8 e4m3, with fp16 scales k_scales/v_scales [blocks, bs, KVH].
// window <= 0: no sliding window. Returns 0, or -1 for an unsupported head_dim.
extern "C" int64_t fulcrum_decode_attention(int64_t bf16, int64_t kind, const void* q, const void* k_cache,
                                            const void* v_cache, const void* k_scales, const void* v_scales,
                                            const int64_t* tables, const int64_t* ctx_lens, void* out, int64_t D,
                                            int64_t H, int64_t KVH, int64_t hd, int64_t bs, int64_t width, float scale,
                                            int64_t window, float softcap) {
#define CASE(HD)                                                                                                   \
  case HD:                                                                                                         \
    if (bf16) run_cache<c10::BFloat16, HD>(kind, q, k_cache, v_cache, k_scales, v_scales, tables, ctx_lens, out, D, \
                                           H, KVH, bs, width, scale, window, softcap);                             \
    else run_cache<float, HD>(kind, q, k_cache, v_cache, k_scales, v_scales, tables, ctx_lens, out, D, H, KVH, bs, \
                              width, scale, window, softcap);                                                      \
    return 0;
  switch (hd) {
    CASE(8) CASE(16) CASE(24) CASE(32) CASE(40) CASE(48) CASE(56) CASE(64) CASE(80) CASE(96) CASE(128) CASE(160)
    CASE(256)
  }
#undef CASE
  return -1;
}
"""

# the decode kernel's builds: the common sizes, and every multiple of 8 below 64 (small draft models: the bundled
# one's is 24); on AVX-512 one that is not a multiple of 16 ends in a half-filled vector
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 160, 256)


def level() -> str:
    """The ISA this kernel is built for here: AVX-512 where the CPU (and FULCRUM_CPU_ISA) allows, else AVX2."""
    return cpu_ext.best("avx512", "avx2")


@functools.cache
def _module(quantized_kv: bool = False):
    """The kernels' library; `quantized_kv`: the build whose decode reads int8/fp8 caches (built only for a server
    with one: the 48 instantiations of every cache type took the single build 11 s on 2 cores against ~4)."""
    lvl = level()
    name = f"fulcrum_cpu_attention_{'q' if quantized_kv else ''}{lvl}"
    lib = cpu_ext.load(name, f"#define QUANTIZED_KV {int(quantized_kv)}\n" + cpu_ext.vector_prelude(lvl) + _BODY, lvl)
    if lib is None:
        return None
    P, I64 = cpu_ext.PTR, cpu_ext.I64
    decode = cpu_ext.bind(
        lib.fulcrum_decode_attention, I64, I64, I64, P, P, P, P, P, P, P, P, *[I64] * 6, cpu_ext.F32, I64, cpu_ext.F32
    )
    prefill = cpu_ext.bind(lib.fulcrum_prefill_attention, I64, I64, P, P, P, P, *[I64] * 9, cpu_ext.F32, I64)
    return {"decode": decode, "prefill": prefill}


def available(quantized_kv: bool = False) -> bool:
    return _module(quantized_kv) is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    """CPU, bf16/fp32 queries, a cache in their dtype or int8/fp8 (with its scales), a supported head size and
    group, contiguous tensors."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype in (q.dtype, *_CACHE_KINDS)
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] // num_kv_heads <= MAX_GROUP
        and k_cache.is_contiguous()
        and available(k_cache.dtype in _CACHE_KINDS)
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [D, H, hd] (one token per sequence) over each sequence's first context_lens cached tokens. An int8/fp8
    cache comes with its fp16 scales [blocks, block_size, kv_heads] (fulcrum.quant.kv). `softcap`: Gemma 2's
    cap * tanh(score / cap) on the scaled scores."""
    q = q.contiguous()
    tables, lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    d, h, hd = q.shape
    kind = _CACHE_KINDS.get(k_cache.dtype, 0)
    if kind and not all(s is not None and s.dtype == torch.float16 and s.is_contiguous() for s in (k_scales, v_scales)):
        raise ValueError("an int8/fp8 KV cache needs contiguous fp16 scales")
    rc = _module(bool(kind))["decode"](
        q.dtype == torch.bfloat16, kind, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if kind else None, v_scales.data_ptr() if kind else None, tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), d, h, k_cache.shape[2], hd, k_cache.shape[1], tables.shape[1], scale,
        sliding_window or 0, softcap or 0.0,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"decode attention: unsupported head_dim {hd}")
    return out


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CPU, bf16/fp32 alike, a head size that is a multiple of 8, a group of at most MAX_GROUP."""
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and q.shape[1] % k.shape[1] == 0
        and q.shape[1] // k.shape[1] <= MAX_GROUP
        and all(cpu_ext.rows_packed(t) for t in (q, k, v))
        and available()
    )


def prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Causal attention of q [n, H, hd] (the last n positions) over k, v [m, KVH, hd]: [n, H, hd]; with a sliding
    window each query sees its last `sliding_window` positions, itself included."""
    n, h, hd = q.shape
    out = torch.empty(n, h, hd, dtype=q.dtype)
    rc = _module()["prefill"](
        q.dtype == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, k.shape[0], h,
        k.shape[1], hd, q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale, sliding_window or 0,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"prefill attention: unsupported head_dim {hd} or group {h // k.shape[1]}")
    return out
