// Decode attention read straight from the paged KV cache: one (sequence, KV head) pair a task (attend), or for a
// step of many sequences over small cache rows one sequence a task, all its heads at once (attend_rows); each cached
// key read once through the block table and scored against all query heads of its group in fp32, a softmax per
// head, the values summed the same way. PyTorch's path gathers every sequence's blocks into a padded copy and runs a masked
// SDPA over it; here there is no gather, no padding and no mask. Built twice: QUANTIZED_KV=0 reads a cache in the
// activations' dtype, QUANTIZED_KV=1 int8 and fp8 caches (fulcrum.quant.kv) only, so a server without one does not
// compile their instantiations.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "exports.h"
#include "vec.h"

#ifndef QUANTIZED_KV
#error "cpu_attention builds this file with -DQUANTIZED_KV=0 or 1"
#endif

constexpr int64_t MAX_G = 16;  // query heads per KV head (cpu_attention.MAX_GROUP)
// A step of at least ROWS_PER_THREAD sequences a thread over a cache of at least MIN_ROW_HEADS KV heads whose rows (a
// token's KV heads side by side) are at most MAX_ROW_BYTES takes a task per sequence, all its heads in one pass
// (attend_rows); else a task per (sequence, KV head) (attend). Measured (issue 49): 4 KV heads of 32 (the bundled
// model, fp32, 64 sequences) 7.9 -> 5.7 ms a step's attention, 4 of 128 bf16 6.5 -> 5.9; 8 of 64 bf16 level; with 2
// KV heads of 64 and 7 queries each (Qwen2.5-0.5B), compute-bound, attend was faster in bf16.
constexpr int64_t ROWS_PER_THREAD = 2, MIN_ROW_HEADS = 4, MAX_ROW_BYTES = 1024;
// attend's first KV head reads its sequence's whole rows in order where its keys are at most this many bytes (see
// for_each_token). Measured: Qwen2.5-0.5B's shape, 320 tokens, fp32 1.76 -> 1.36 ms a step's attention, bf16 level;
// 8 KV heads of 128 bf16, 512 tokens, 11.2 -> 9.9; at 2048 tokens (4 MiB of keys) 13.3 -> 15.9. attend_rows' keys'
// pass reads the values' rows beside the keys' where the values are at most this many bytes.
constexpr int64_t TOUCH_BYTES = 256 << 10;

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

// out[0..HD) = a head's value sums (NV vectors of fp32 at `sums`) times s, its softmax sum's inverse, rounded to T
template <int HD, typename T>
static inline void store_head(T* out, const float* sums, float s) {
  alignas(64) float tmp[num_vectors<HD>() * VW];
  for (int c = 0; c < num_vectors<HD>(); ++c) vstore(tmp + VW * c, vmul(vload(sums + VW * c), vset1(s)));
  for (int d = 0; d < HD; ++d) store(out + d, tmp[d]);
}

// Calls fn(i, row, slot) for the cached tokens start..ctx-1 in order (i counts from 0; slot: the token's cache
// slot), walking the block table once instead of dividing every position by the block size. While a block is
// read, the next block's `head_bytes` of each token are prefetched: blocks lie anywhere in the cache, where the
// hardware prefetchers do not follow. `row_bytes` (a sequence's first KV head): the tokens' whole rows too, into L2,
// where the other heads' tasks of the sequence (next on this thread) find them instead of going back to DRAM.
// `touch` instead (bytes: a whole row): each token's first `touch` bytes read in order (a 4-byte load a cache line)
// just before fn sees it. Reading a block's rows in order is a stream the hardware prefetchers follow and run ahead
// of; a head's slice of every row (fn's reads) is a strided pattern they did not, and software prefetches of the next
// block in place of the in-order reads measured slower (issue 49). `also` (with `touch`): a second cache of the same
// layout (the values beside the keys), whose same row is read after each row. With `touch`, a block that does not
// follow the one before it in the cache (a jump the hardware prefetchers make only after the new stream's first
// misses) is prefetched while the block AHEAD_BLOCKS before it is read, a row of it (and of `also`) with each row
// read. A prompt's blocks taken together from a fresh cache lie side by side; decode tokens' blocks, and any
// request's once others have ended (the LRU free queue), lie anywhere. Measured (issue 49, 2-core AMD EPYC Zen 5,
// bench_decode_attention in turn): every block scattered (--prompt 32) 9.74 -> 6.80 ms, 9.62 -> 8.36 at one block
// ahead; prompt blocks side by side (the default) level within the VM's noise (5.89 -> 5.97, 5.96 -> 6.09). The
// first block prefetches the jumps before that too: 256 sequences of 64 tokens, every block scattered, 4.64 -> 4.52
// natively, 4.78 -> 4.34 at forced AVX2.
constexpr int64_t AHEAD_BLOCKS = 2;
template <typename C, typename Fn>
static inline void for_each_token(const C* cache, const int64_t* table, int64_t start, int64_t ctx, int64_t bs,
                                  int64_t kv_stride, Fn fn, int64_t head_bytes = 64, int64_t row_bytes = 0,
                                  int64_t touch = 0, const C* also = nullptr) {
  int64_t i = 0;
  __m128i touched = _mm_setzero_si128();
  for (int64_t blk = start / bs, off = start % bs; blk * bs < ctx; ++blk, off = 0) {
    const C* base = cache + table[blk] * bs * kv_stride;
    const int64_t stop = std::min(bs, ctx - blk * bs);
    if (!touch && (blk + 1) * bs < ctx && (head_bytes || row_bytes)) {
      const char* next = (const char*)(cache + table[blk + 1] * bs * kv_stride);
      const int64_t rows = std::min(bs, ctx - (blk + 1) * bs);
      for (int64_t j = 0; j < rows; ++j) {
        for (int64_t b = 0; b < head_bytes; b += 64)
          _mm_prefetch(next + j * kv_stride * int64_t(sizeof(C)) + b, _MM_HINT_T0);
        if (row_bytes)
          for (int64_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch(next + j * kv_stride * int64_t(sizeof(C)) + b, _MM_HINT_T1);
      }
    }
    // the blocks to prefetch while this one is read, where they jump: AHEAD_BLOCKS on, and from the first block the
    // ones before that too (no block before reads them)
    int64_t ahead_rows[AHEAD_BLOCKS] = {}, ahead_at[AHEAD_BLOCKS] = {}, any = 0;
    for (int64_t a = blk == start / bs ? 1 : AHEAD_BLOCKS; a <= AHEAD_BLOCKS; ++a) {
      const int64_t ab = blk + a;
      if (touch && ab * bs < ctx && table[ab] != table[ab - 1] + 1) {
        ahead_rows[a - 1] = std::min(bs, ctx - ab * bs), ahead_at[a - 1] = table[ab] * bs * kv_stride;
        any = 1;
      }
    }
    auto rows = [&](auto prefetch) {
      for (int64_t j = off; j < stop; ++j) {
        const C* row = base + j * kv_stride;
        if (prefetch)
          for (int64_t a = 0; a < AHEAD_BLOCKS; ++a)
            if (j < ahead_rows[a])
              for (const C* c : {cache, also})
                if (c)
                  for (int64_t b = 0; b < touch; b += 64)
                    _mm_prefetch((const char*)(c + ahead_at[a] + j * kv_stride) + b, _MM_HINT_T0);
        for (int64_t b = 0; b < touch; b += 64) touched = _mm_or_si128(touched, _mm_loadu_si32((const char*)row + b));
        if (also) {
          const char* other = (const char*)(also + (row - cache));
          for (int64_t b = 0; b < touch; b += 64) touched = _mm_or_si128(touched, _mm_loadu_si32(other + b));
        }
        fn(i++, row, table[blk] * bs + j);
      }
    };
    if (any) rows(std::true_type());
    else rows(std::false_type());
  }
  asm volatile("" : : "x"(touched));  // the in-order reads' result counts as used: the compiler keeps the reads
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

// Rows of n scores (np apart, padded with -inf to whole vectors) into unnormalised softmax weights in place, each
// row's sum's inverse in inv: it scales the output instead of every weight. Gemma 2's soft cap, cap * tanh(s / cap),
// first (not on the padding). A head's sink (gpt-oss) is one more logit in its softmax, with no value: it joins the
// max and the sum only.
static void softmax(float* scores, int64_t rows, int64_t n, int64_t np, float softcap, const float* sinks,
                    float* inv) {
  if (softcap > 0)
    for (int64_t h = 0; h < rows; ++h)
      for (int64_t t = 0; t < n; ++t) scores[h * np + t] = softcap * std::tanh(scores[h * np + t] / softcap);
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * np;
    vf m = vset1(-INFINITY);
    for (int64_t t = 0; t < np; t += VW) m = vmax(m, vload(s + t));
    const float top = sinks ? std::max(vmax_all(m), sinks[h]) : vmax_all(m);
    const vf mx = vset1(top);
    vf sum = vzero();
    for (int64_t t = 0; t < np; t += VW) {
      const vf e = vexp(vsub(vload(s + t), mx));
      vstore(s + t, e);
      sum = vadd(sum, e);
    }
    inv[h] = 1.0f / (vsum(sum) + (sinks ? std::exp(sinks[h] - top) : 0.f));
  }
}

// q and out of T; the cache of C: T itself (ksc, vsc null), int8 or fp8 with the head's scales (stride `sstride`
// between slots), which multiply each key's scores and each value's weight. `scores` holds g rows of n rounded up
// to whole vectors. `prefetch_rows` and `touch` (bytes of a token's row, or 0): for_each_token's whole-row reads,
// taken by the keys' pass and the values' first group of heads.
template <typename T, typename C, int HD>
static void attend(const T* q, const C* kc, const C* vc, const c10::Half* ksc, const c10::Half* vsc,
                   int64_t sstride, const int64_t* table, int64_t start, int64_t ctx, int64_t bs, int64_t kv_stride,
                   int64_t g, float scale, float softcap, const float* sinks, float* scores, T* out,
                   int64_t q_stride, int64_t prefetch_rows, int64_t touch) {
  constexpr float factor = load_factor<C>();
  constexpr bool quantized = !std::is_same_v<C, T>;
  constexpr int NV = num_vectors<HD>();
  const int64_t n = ctx - start, np = (n + VW - 1) / VW * VW;
  // queries of the group in fp32, scaled: [g][C] vectors (from L1 when they outnumber the registers)
  vf qv[MAX_G][NV];
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
  }, HD * int64_t(sizeof(C)), prefetch_rows, touch);
  if (filled) score_chunk();
  float inv[MAX_G];
  softmax(scores, g, n, np, softcap, sinks, inv);
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
    }, HD * int64_t(sizeof(C)), h0 == 0 ? prefetch_rows : 0, h0 == 0 ? touch : 0);
    for (int64_t h = 0; h < hn; ++h) store_head<HD>(out + (h0 + h) * q_stride, (const float*)acc[h], inv[h0 + h]);
  }
}

// attend_rows' steps on a chunk of m <= VW rows (a row: a token's KV heads side by side; rows[j] for j < m), each
// KV head's slice scored against its g queries of `qs` (scaled fp32, [H][NV * VW]) into scores[h * np + j], lanes
// past m set to -inf; or its values summed into `acc` ([H][NV * VW]) with the weights scores[h * np + j]. Kept out of
// line: inlined into attend_rows they measured slower (the compiler spilled more).
template <typename T, typename C, int HD>
__attribute__((noinline)) static void score_rows(const float* qs, const C* const* rows, const c10::Half* ksc,
                                                 const int64_t* slots, int64_t m, int64_t KVH, int64_t g,
                                                 float* scores, int64_t np) {
  constexpr float factor = load_factor<C>();
  constexpr bool quantized = !std::is_same_v<C, T>;
  constexpr int NV = num_vectors<HD>();
  // an fp32 cache: a head's keys loaded for each of its queries, straight from L1 into the FMAs. The VW * NV
  // vectors of a chunk's keys are more than the registers (32 at HD 32 on AVX-512 or AVX2), and keeping them
  // spilled to the stack cost more than loading them again; a chunk of fp32 keys at VW 8 and HD 32 took 16% less
  // on AVX2 (issue 49). A cache that needs widening (bf16, int8, fp8) still widens each key once for all g queries.
  if constexpr (std::is_same_v<C, float>) {
    for (int64_t h = 0; h < KVH * g; ++h) {
      const int64_t kvh = h / g;
      vf qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = vload(qs + (h * NV + c) * VW);
      vf part[VW];
      for (int j = 0; j < VW; ++j) {  // a partial chunk repeats its last row
        const C* k = rows[std::min<int64_t>(j, m - 1)] + kvh * HD;
        vf a = vmul(qv[0], vload_head<HD>(k, 0));
        for (int c = 1; c < NV; ++c) a = vfmadd(qv[c], vload_head<HD>(k, c), a);
        part[j] = a;
      }
      vstore(scores + h * np, vsum_each(part));
      for (int64_t j = m; j < VW; ++j) scores[h * np + j] = -INFINITY;
    }
    return;
  }
  for (int64_t kvh = 0; kvh < KVH; ++kvh) {
    vf kv[VW][NV];
    alignas(64) float kscale[VW];
    for (int j = 0; j < VW; ++j) {  // a partial chunk repeats its last row
      const int64_t r = std::min<int64_t>(j, m - 1);
      for (int c = 0; c < NV; ++c) kv[j][c] = vload_head<HD>(rows[r] + kvh * HD, c);
      if constexpr (quantized) kscale[j] = float(ksc[slots[r] * KVH + kvh]) * factor;
    }
    for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
      const float* qh = qs + h * NV * VW;
      vf part[VW];
      for (int j = 0; j < VW; ++j) {
        vf a = vmul(vload(qh), kv[j][0]);
        for (int c = 1; c < NV; ++c) a = vfmadd(vload(qh + c * VW), kv[j][c], a);
        part[j] = a;
      }
      vf sc = vsum_each(part);
      if constexpr (quantized) sc = vmul(sc, vload(kscale));
      vstore(scores + h * np, sc);
      for (int64_t j = m; j < VW; ++j) scores[h * np + j] = -INFINITY;
    }
  }
}

// HN heads' value sums of one KV head over a chunk, in registers: HN * NV accumulators, each value vector loaded
// into the FMAs. HN is a constant, so the sums stay in registers; with a head count known only at run time the
// compiler kept them on the stack, and each FMA waited on the last one's store (AVX2, issue 49).
template <typename T, typename C, int HD, int HN>
static inline void sum_heads(const float* scores, int64_t np, const C* const* rows, const c10::Half* vsc,
                             const int64_t* slots, int64_t m, int64_t KVH, int64_t kvh, int64_t h0, float* acc) {
  constexpr float factor = load_factor<C>();
  constexpr bool quantized = !std::is_same_v<C, T>;
  constexpr int NV = num_vectors<HD>();
  vf a[HN][NV];
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < NV; ++c) a[h][c] = vload(acc + ((h0 + h) * NV + c) * VW);
  for (int64_t j = 0; j < m; ++j) {
    const C* v = rows[j] + kvh * HD;
    const float vs = quantized ? float(vsc[slots[j] * KVH + kvh]) * factor : 1.f;
    for (int h = 0; h < HN; ++h) {
      const float w = scores[(h0 + h) * np + j];
      const vf p = vset1(quantized ? w * vs : w);
      for (int c = 0; c < NV; ++c) a[h][c] = vfmadd(p, vload_head<HD>(v, c), a[h][c]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int c = 0; c < NV; ++c) vstore(acc + ((h0 + h) * NV + c) * VW, a[h][c]);
}

template <typename T, typename C, int HD>
__attribute__((noinline)) static void sum_rows(const float* scores, int64_t np, const C* const* rows,
                                               const c10::Half* vsc, const int64_t* slots, int64_t m, int64_t KVH,
                                               int64_t g, float* acc) {
  constexpr int NV = num_vectors<HD>();
  constexpr int HB = NV >= 8 ? 1 : std::min(4, 8 / NV);  // heads a group: about 8 accumulators
  for (int64_t kvh = 0; kvh < KVH; ++kvh)
    for (int64_t h0 = kvh * g; h0 < (kvh + 1) * g; h0 += HB) {
      const int64_t hn = std::min<int64_t>(HB, (kvh + 1) * g - h0);
      if (hn == HB) sum_heads<T, C, HD, HB>(scores, np, rows, vsc, slots, m, KVH, kvh, h0, acc);
      else if constexpr (HB > 1) {
        if (hn == 1) sum_heads<T, C, HD, 1>(scores, np, rows, vsc, slots, m, KVH, kvh, h0, acc);
        else if (hn == 2) sum_heads<T, C, HD, 2>(scores, np, rows, vsc, slots, m, KVH, kvh, h0, acc);
        else sum_heads<T, C, HD, 3>(scores, np, rows, vsc, slots, m, KVH, kvh, h0, acc);
      }
    }
}

// The floats of attend_rows' scratch for H heads and up to max_ctx tokens
template <int HD>
static int64_t rows_scratch_floats(int64_t H, int64_t max_ctx) {
  return 2 * H * num_vectors<HD>() * VW + (H + VW - 1) / VW * VW + H * (max_ctx + VW);
}

// The sequence a thread takes after this one (index: the step's count where none is left; table null then):
// attend_rows takes it as its values' pass starts, and prefetches its first rows into L2, one row of keys and
// values for every NEXT_EVERY values it sums, while that pass reads L2 only and the memory bus would otherwise
// idle. Taken then, not earlier, so that a thread holds a sequence the other threads could run only for that pass.
// Measured (issue 49; the bundled model's shape as below, in turn, medians of 12): a row every 4 values 16.3 ->
// 16.1 ms natively and 18.5 -> 17.5 at AVX2; every 2 values or every value slower than none.
// On AMD's CPUs the prefetches cost more than they hid (a 2-core AMD EPYC, Zen 5, bench_decode_attention against
// the build with them, in turn: 5.49 -> 5.26, 5.57 -> 5.40 and 6.48 -> 6.13 ms natively, 6.45 -> 6.33 and 6.83 ->
// 6.38 at forced AVX2): there the next sequence is taken as before, and not prefetched (PREFETCH_NEXT, a template
// argument: a run-time flag tested in the values' loop made the loop 15% slower than either).
struct NextSeq {
  int64_t index = 0;
  const int64_t* table = nullptr;
  int64_t pos = 0, ctx = 0;
};
constexpr int64_t NEXT_EVERY = 4;
static bool prefetch_next() {
  static const bool on = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return on;
}

// One sequence's every head in one pass over its cached tokens' rows, VW tokens at a time. Each row's cache lines
// are first read in order (a 4-byte load a line), so that the hardware prefetchers see one sequential stream a
// block and run ahead of it; the scores and sums then find the rows in L1. Reading a block head by head (a head's
// slice of every row, then the next head's: attend's order) is a strided pattern they do not follow, and software
// prefetches of the next block measured slower here. The sums are attend's, in its order (each head's keys and
// values in token order), so that a sequence gets the same output bit for bit on either path. `scratch` holds the
// queries and the value sums [H][NV * VW], the sums' inverses [H] and the scores [H][n rounded up to whole vectors]
// (rows_scratch_floats); q and out [H, HD] contiguous.
// `take_next()`: the thread's next sequence (NextSeq), whose index attend_rows returns.
template <typename T, typename C, int HD, bool PREFETCH_NEXT, typename TakeNext>
static int64_t attend_rows(const T* q, const C* kc, const C* vc, const c10::Half* ksc, const c10::Half* vsc,
                           const int64_t* table, int64_t start, int64_t ctx, int64_t bs, int64_t KVH, int64_t g,
                           float scale, float softcap, const float* sinks, float* scratch, T* out,
                           TakeNext take_next) {
  constexpr int NV = num_vectors<HD>();
  const int64_t H = KVH * g, kv_stride = KVH * HD, n = ctx - start, np = (n + VW - 1) / VW * VW;
  const int64_t row_bytes = kv_stride * int64_t(sizeof(C));
  float *qs = scratch, *acc = qs + H * NV * VW, *inv = acc + H * NV * VW, *scores = inv + (H + VW - 1) / VW * VW;
  for (int64_t h = 0; h < H; ++h)
    for (int c = 0; c < NV; ++c) {
      vstore(qs + (h * NV + c) * VW, vmul(vload_head<HD>(q + h * HD, c), vset1(scale)));
      vstore(acc + (h * NV + c) * VW, vzero());
    }
  // calls fn(i0, rows, slots, m) for chunks of VW tokens (m < VW only in the last), each row's lines read first
  // (`touch` bytes of it), and the same row of `also` after it where given
  auto for_each_chunk = [&](const C* cache, auto fn, int64_t touch, const C* also) {
    const C* rows[VW];
    int64_t slots[VW], m = 0, i0 = 0;
    for_each_token(cache, table, start, ctx, bs, kv_stride, [&](int64_t i, const C* r, int64_t slot) {
      if (m == 0) i0 = i;
      rows[m] = r, slots[m] = slot;
      if (++m == VW) fn(i0, rows, slots, m), m = 0;
    }, 0, 0, touch, also);
    if (m) fn(i0, rows, slots, m);
  };
  // Where a sequence's values fit TOUCH_BYTES, the keys' pass reads each value row beside its key row: two streams
  // in flight instead of one, and the values' pass then finds them in L2. Measured (issue 49; the bundled model's
  // shape, fp32, 64 sequences at 482 tokens, 8 layers, with the scoring and sums above): 19.3 -> 17.1 ms natively,
  // 21.7 -> 18.6 at AVX2, against 17.5 and 20.3 with the reads alone.
  const bool both = n * row_bytes <= TOUCH_BYTES;
  for_each_chunk(kc, [&](int64_t i0, const C* const* rows, const int64_t* slots, int64_t m) {
    score_rows<T, C, HD>(qs, rows, ksc, slots, m, KVH, g, scores + i0, np);
  }, row_bytes, both ? vc : nullptr);
  softmax(scores, H, n, np, softcap, sinks, inv);
  NextSeq next = take_next();
  for_each_chunk(vc, [&](int64_t i0, const C* const* rows, const int64_t* slots, int64_t m) {
    if (PREFETCH_NEXT && both && next.table)
      for (int64_t r = 0; r < m / NEXT_EVERY && next.pos < next.ctx; ++r, ++next.pos) {
        const int64_t at = (next.table[next.pos / bs] * bs + next.pos % bs) * kv_stride;
        for (const C* cache : {kc, vc})
          for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char*)(cache + at) + b, _MM_HINT_T1);
      }
    sum_rows<T, C, HD>(scores + i0, np, rows, vsc, slots, m, KVH, g, acc);
  }, both ? 0 : row_bytes, nullptr);
  for (int64_t h = 0; h < H; ++h) store_head<HD>(out + h * HD, acc + h * NV * VW, inv[h]);
  return next.index;
}

template <typename T, typename C, int HD>
static void run(const T* qp, const C* kp, const C* vp, const c10::Half* ks, const c10::Half* vs, const int64_t* tp,
                const int64_t* lp, T* op, int64_t D, int64_t H, int64_t KVH, int64_t bs, int64_t width, float scale,
                int64_t window, float softcap, const float* sinks) {
  const int64_t g = H / KVH, kv_stride = KVH * HD;
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < D; ++i) max_ctx = std::max(max_ctx, lp[i]);
  const int64_t threads = at::get_num_threads();
  if (KVH >= MIN_ROW_HEADS && D >= ROWS_PER_THREAD * threads && kv_stride * int64_t(sizeof(C)) <= MAX_ROW_BYTES) {
    // a task a sequence, every head in one pass over its rows (attend_rows), taken in turn from a shared counter;
    // a thread takes its next one during the one before (see NextSeq)
    std::atomic<int64_t> next{0};
    auto first = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, lp[i] - window) : 0; };
    auto take_next = [&]() {
      const int64_t j = next.fetch_add(1);
      return j < D ? NextSeq{j, tp + j * width, first(j), lp[j]} : NextSeq{D};
    };
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(rows_scratch_floats<HD>(H, max_ctx));
      using Take = decltype(take_next);
      const auto seq = prefetch_next() ? attend_rows<T, C, HD, true, Take> : attend_rows<T, C, HD, false, Take>;
      for (int64_t i = next.fetch_add(1); i < D;)
        i = seq(qp + i * H * HD, kp, vp, ks, vs, tp + i * width, first(i), lp[i], bs, KVH, g, scale, softcap, sinks,
                scratch.data(), op + i * H * HD, take_next);
    });
    return;
  }
  at::parallel_for(0, D * KVH, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(g * (max_ctx + VW));  // each head's row rounded up to whole vectors
    for (int64_t task = b; task < e; ++task) {
      const int64_t i = task / KVH, kvh = task % KVH, ctx = lp[i];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      // the first KV head's task reads whole rows, for the others' tasks (next on this thread) to find in L2; in
      // order where a sequence's keys fit TOUCH_BYTES (longer ones measured slower so: the later heads' rows had left)
      const int64_t row_bytes = kvh == 0 && KVH > 1 ? kv_stride * int64_t(sizeof(C)) : 0;
      const bool in_order = row_bytes && (ctx - start) * row_bytes <= TOUCH_BYTES;
      attend<T, C, HD>(qp + (i * H + kvh * g) * HD, kp + kvh * HD, vp + kvh * HD, ks ? ks + kvh : nullptr,
                       vs ? vs + kvh : nullptr, KVH, tp + i * width, start, ctx, bs, kv_stride, g, scale, softcap,
                       sinks ? sinks + kvh * g : nullptr, scores.data(), op + (i * H + kvh * g) * HD, HD,
                       in_order ? 0 : row_bytes, in_order ? row_bytes : 0);
    }
  });
}

template <typename T, int HD>
static void run_cache(int64_t kind, const void* q, const void* kc, const void* vc, const void* ks, const void* vs,
                      const int64_t* tables, const int64_t* lens, void* out, int64_t D, int64_t H, int64_t KVH,
                      int64_t bs, int64_t width, float scale, int64_t window, float softcap, const float* sinks) {
  using S = c10::Half;
  const S *ksc = (const S*)ks, *vsc = (const S*)vs;
#if QUANTIZED_KV  // the quantized caches' build: int8 and fp8 only
  if (kind == 1)
    run<T, int8_t, HD>((const T*)q, (const int8_t*)kc, (const int8_t*)vc, ksc, vsc, tables, lens, (T*)out, D, H,
                       KVH, bs, width, scale, window, softcap, sinks);
  else if (kind == 2)
    run<T, c10::Float8_e4m3fn, HD>((const T*)q, (const c10::Float8_e4m3fn*)kc, (const c10::Float8_e4m3fn*)vc, ksc,
                                   vsc, tables, lens, (T*)out, D, H, KVH, bs, width, scale, window, softcap,
                                   sinks);
#else
  if (kind == 0)
    run<T, T, HD>((const T*)q, (const T*)kc, (const T*)vc, nullptr, nullptr, tables, lens, (T*)out, D, H, KVH, bs,
                  width, scale, window, softcap, sinks);
#endif
}

// q and out [D, H, hd]; k/v cache [blocks, bs, KVH, hd]; tables [D, width] int64; ctx_lens [D] int64, all contiguous.
// kind 0: the cache in q's dtype; 1: int8, 2: fp8 e4m3, with fp16 scales k_scales/v_scales [blocks, bs, KVH].
// window <= 0: no sliding window. sinks: [H] fp32, one more logit per head in its softmax (gpt-oss), or null.
// Returns 0, or -1 for an unsupported head_dim.
extern "C" int64_t fulcrum_decode_attention(int64_t bf16, int64_t kind, const void* q, const void* k_cache,
                                            const void* v_cache, const void* k_scales, const void* v_scales,
                                            const int64_t* tables, const int64_t* ctx_lens, void* out, int64_t D,
                                            int64_t H, int64_t KVH, int64_t hd, int64_t bs, int64_t width, float scale,
                                            int64_t window, float softcap, const float* sinks) {
#define CASE(HD)                                                                                                   \
  case HD:                                                                                                         \
    if (bf16) run_cache<c10::BFloat16, HD>(kind, q, k_cache, v_cache, k_scales, v_scales, tables, ctx_lens, out, D, \
                                           H, KVH, bs, width, scale, window, softcap, sinks);                      \
    else run_cache<float, HD>(kind, q, k_cache, v_cache, k_scales, v_scales, tables, ctx_lens, out, D, H, KVH, bs, \
                              width, scale, window, softcap, sinks);                                               \
    return 0;
  switch (hd) {
    CASE(8) CASE(16) CASE(24) CASE(32) CASE(40) CASE(48) CASE(56) CASE(64) CASE(80) CASE(96) CASE(128) CASE(160)
    CASE(256)
  }
#undef CASE
  return -1;
}
