// Prefill attention: causal attention of n queries (the last n of m positions) over m keys, flash-style.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <vector>

#include "exports.h"
#include "vec.h"

constexpr int64_t MAX_G = 16;  // query heads per KV head (cpu_attention.MAX_GROUP)

// Keys go in tiles of KT: NK vectors' worth (64 keys on AVX-512 and AVX2).
// Each KV head's keys are widened to fp32 and transposed once per call into [tile][hd][KT], its values widened into
// [position][hdp]; then a task (one KV head, a block of queries with all g query heads of the group) walks the tiles
// up to its last query, RB rows at a time: a tile's scores are RB x NS accumulators at a time (each transposed key
// vector read once for the RB rows), the online softmax folds the tile into each row's running max and sum once per
// KT keys, and the weighted values go into the accumulators RB rows by CB vectors at a time. No score matrix, no mask
// tensor: the causal limit is a count of keys per row. (Tiles of one vector, re-widened by every task, ran at 51-72
// GFLOP/s.)
constexpr int NK = VW == 16 ? 4 : 8;
constexpr int KT = NK * VW;
constexpr int RB = 4;
// A tile's scores go NS vectors at a time (RB x NS accumulators, what the registers hold: all four on AVX-512, two on
// AVX2's 16 registers), then one softmax update a row for the whole tile: 64 keys a tile on either. On AVX2 tiles of
// 2 vectors spent about half of prefill_rows in the softmax (its horizontal max and sum, an exp a row); tiles of 8
// took 21-26% less time in a slow hour of the VM and 10-13% in a faster one (issue 49: the bundled model's shape,
// fp32, the offline workload's prompts in 2048-token steps, benchmarks/bench_prefill_attention.py); on AVX-512 tiles
// of 8 vectors were level with 4.
constexpr int NS = VW == 16 ? 4 : 2;
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
  alignas(64) float p[R][KT];
  for (int c0 = 0; c0 < NK; c0 += NS) {
    vf sc[R][NS];
    for (int j = 0; j < R; ++j)
      for (int c = 0; c < NS; ++c) sc[j][c] = vzero();
    for (int64_t d = 0; d < hd; ++d) {
      vf kt[NS];
      for (int c = 0; c < NS; ++c) kt[c] = vload(Kt + d * KT + (c0 + c) * VW);
      for (int j = 0; j < R; ++j) {
        const vf qd = vset1(Q[j * hd + d]);
        for (int c = 0; c < NS; ++c) sc[j][c] = vfmadd(qd, kt[c], sc[j][c]);
      }
    }
    for (int j = 0; j < R; ++j)
      for (int c = 0; c < NS; ++c) vstore(p[j] + (c0 + c) * VW, sc[j][c]);
  }
  float corr[R];
  int64_t valid = 0;  // keys of the tile any of the R rows sees
  for (int j = 0; j < R; ++j) {
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
  // what is left in pairs: a head of two vectors (head_dim 32 in fp32 on AVX-512, the bundled model) reads each
  // weight once for both, where one vector at a time read the weights twice with half the sums per read
  for (; c + 2 <= nv; c += 2) prefill_values<R, 2>(acc, Vb, p, corr, valid, hdp, c);
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
                         int64_t qb, int64_t window, const float* sinks, float* scratch, int64_t* seen) {
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
    // rows go by query, so the rows that see none of this tile (a query before it: the block's diagonal) come
    // first; they would add nothing (weights exp(-inf), a correction of 1), so they skip it
    int64_t r = 0;
    while (r < rows && seen[r] <= k0) ++r;
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
      // a head's sink (gpt-oss): one more term of its softmax's sum, with no value
      const float inv = 1.0f / (sinks ? sum[r] + std::exp(sinks[kvh * g + j] - mx[r]) : sum[r]);
      T* dst = out + t * os + (kvh * g + j) * hd;
      for (int64_t d = 0; d < hd; ++d) store(dst + d, acc[r * hdp + d] * inv);
    }
}

template <typename T>
static void prefill_all(const T* q, const T* k, const T* v, T* out, int64_t n, int64_t m, int64_t H, int64_t KVH,
                        int64_t hd, int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale, int64_t window,
                        const float* sinks) {
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
                     window, sinks, scratch.data(), seen.data());
      }
    });
  }
}

// Several sequences' prefills in one call (a step's fresh prompts): sequence s has its n[s] queries at rows
// q0[s].. of q and out, and its m[s] keys and values at rows k0[s].. of k and v (its queries the last n[s] of them).
// One call per sequence spent most of a short prompt's time in the two parallel regions' fork and join (a 128-token
// prompt is 8 tasks a region on the bundled model); here the sequences are widened in one region and their tasks
// run in another, the costliest first, each thread taking the next from a shared counter. Sequences go in turns of
// at most WIDE_BYTES widened; one longer than that alone takes prefill_all (which turns its KV heads).
template <typename T>
static void prefill_varlen(const T* q, const T* k, const T* v, T* out, const int64_t* q0, const int64_t* n,
                           const int64_t* k0, const int64_t* m, int64_t S, int64_t H, int64_t KVH, int64_t hd,
                           int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale, int64_t window,
                           const float* sinks) {
  const int64_t g = H / KVH, hdp = (hd + VW - 1) / VW * VW;
  const int64_t qb = std::max<int64_t>(16, std::min<int64_t>(64, TASK_ROWS / g));
  const int64_t floats = qb * MAX_G * (hd + hdp) + 2 * qb * MAX_G;
  auto tiles = [&](int64_t s) { return (m[s] + KT - 1) / KT; };
  auto head_floats = [&](int64_t s) { return tiles(s) * KT * (hd + hdp); };
  // the first tile any query of s sees (a sliding window's), as prefill_all
  auto first_tile = [&](int64_t s) { return window > 0 ? std::max<int64_t>(0, m[s] - n[s] + 1 - window) / KT : 0; };
  std::vector<float> wide;
  std::vector<int64_t> base;                                 // each sequence's widened K/V in `wide`
  std::vector<std::array<int64_t, 3>> widen, tasks;          // (sequence, KV head, tile or query block)
  std::vector<int64_t> cost;
  auto run = [&](int64_t s0, int64_t s1) {
    base.assign(S, 0);
    int64_t total = 0;
    widen.clear();
    tasks.clear();
    for (int64_t s = s0; s < s1; ++s) {
      base[s] = total;
      total += KVH * head_floats(s);
      for (int64_t h = 0; h < KVH; ++h) {
        for (int64_t t = first_tile(s); t < tiles(s); ++t) widen.push_back({s, h, t});
        for (int64_t b = 0; b < (n[s] + qb - 1) / qb; ++b) tasks.push_back({s, h, b});
      }
    }
    // the costliest tasks first (keys seen by a block's last query, times its rows), so the shared counter ends
    // on short ones
    std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) {
      auto c = [&](const std::array<int64_t, 3>& x) {
        const int64_t s = x[0], q1 = std::min(n[s], (x[2] + 1) * qb), keys = m[s] - n[s] + q1;
        return (window > 0 ? std::min(keys, window + qb) : keys) * (q1 - x[2] * qb);
      };
      return c(a) > c(b);
    });
    wide.resize(total);
    at::parallel_for(0, (int64_t)widen.size(), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const auto [s, h, t] = widen[i];
        float* kt = wide.data() + base[s] + h * head_floats(s);
        widen_tile(k + k0[s] * ks, v + k0[s] * vs, m[s], h, hd, hdp, ks, vs, t, kt, kt + tiles(s) * KT * hd);
      }
    });
    std::atomic<int64_t> next{0};
    const int64_t N = (int64_t)tasks.size();
    at::parallel_for(0, std::min<int64_t>(N, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      std::vector<float> scratch(floats + 16);
      std::vector<int64_t> seen(qb * MAX_G);
      for (int64_t i = next++; i < N; i = next++) {
        const auto [s, h, blk] = tasks[i];
        const float* kt = wide.data() + base[s] + h * head_floats(s);
        prefill_task(q + q0[s] * qs, out + q0[s] * os, kt, kt + tiles(s) * KT * hd, n[s], m[s], H, KVH, hd, qs, os,
                     scale, h, blk * qb, qb, window, sinks, scratch.data(), seen.data());
      }
    });
  };
  int64_t s0 = 0, bytes = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t b = KVH * head_floats(s) * 4;
    if (b > WIDE_BYTES) {  // alone, in turns of KV heads
      if (s > s0) run(s0, s);
      prefill_all(q + q0[s] * qs, k + k0[s] * ks, v + k0[s] * vs, out + q0[s] * os, n[s], m[s], H, KVH, hd, qs, ks,
                  vs, os, scale, window, sinks);
      s0 = s + 1, bytes = 0;
    } else if (bytes + b > WIDE_BYTES) {
      run(s0, s);
      s0 = s, bytes = b;
    } else {
      bytes += b;
    }
  }
  if (S > s0) run(s0, S);
}

// q [n, H, hd], k and v [m, KVH, hd], out [n, H, hd], each with its own row stride (elements between tokens; the
// heads of a token packed); the queries are the last n of the m positions. sinks: [H] fp32, one more logit per head
// in its softmax (gpt-oss), or null. Returns 0, or -1 for a head_dim that is not a multiple of 8 or a group over
// MAX_G.
extern "C" int64_t fulcrum_prefill_attention(int64_t bf16, const void* q, const void* k, const void* v, void* out,
                                             int64_t n, int64_t m, int64_t H, int64_t KVH, int64_t hd, int64_t qs,
                                             int64_t ks, int64_t vs, int64_t os, float scale, int64_t window,
                                             const float* sinks) {
  if (hd % 8 || H / KVH > MAX_G) return -1;
  if (bf16)
    prefill_all((const c10::BFloat16*)q, (const c10::BFloat16*)k, (const c10::BFloat16*)v, (c10::BFloat16*)out, n, m,
                H, KVH, hd, qs, ks, vs, os, scale, window, sinks);
  else
    prefill_all((const float*)q, (const float*)k, (const float*)v, (float*)out, n, m, H, KVH, hd, qs, ks, vs, os,
                scale, window, sinks);
  return 0;
}


// prefill_varlen over S sequences: q0, n, k0, m are [S] int64 (rows of q/out, and of k/v; see above); the rest as
// fulcrum_prefill_attention. Returns 0, or -1 as it does.
extern "C" int64_t fulcrum_prefill_attention_varlen(int64_t bf16, const void* q, const void* k, const void* v,
                                                    void* out, const int64_t* q0, const int64_t* n, const int64_t* k0,
                                                    const int64_t* m, int64_t S, int64_t H, int64_t KVH, int64_t hd,
                                                    int64_t qs, int64_t ks, int64_t vs, int64_t os, float scale,
                                                    int64_t window, const float* sinks) {
  if (hd % 8 || H / KVH > MAX_G) return -1;
  if (bf16)
    prefill_varlen((const c10::BFloat16*)q, (const c10::BFloat16*)k, (const c10::BFloat16*)v, (c10::BFloat16*)out, q0,
                   n, k0, m, S, H, KVH, hd, qs, ks, vs, os, scale, window, sinks);
  else
    prefill_varlen((const float*)q, (const float*)k, (const float*)v, (float*)out, q0, n, k0, m, S, H, KVH, hd, qs,
                   ks, vs, os, scale, window, sinks);
  return 0;
}
