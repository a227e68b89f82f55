// y [M, O] = x [M, I] @ W^T + bias over a weight blocked once at load (cpu_prepack.block): tiles of TW = 2 VW output
// columns, each tile's columns side by side for every input index, so that one vector load holds VW columns of one
// input (fp32, and bf16 below AVX-512 BF16: [O/TW][I][TW]) or of one input pair (bf16 at AVX-512 BF16:
// [O/32][I/2][32][2], the pairs `vdpbf16ps` multiplies). Below AVX-512 BF16 a bf16 tile is widened in registers (a
// 16-bit shift a vector) and runs fp32's FMAs, its inputs widened once a call: half the bytes of a widened fp32 copy.
// Each tile is one contiguous stream, read against up to MG input rows at a time whose values are broadcast: the
// outer-product order, where the GEMV (gemv.cpp) walks each weight row against the inputs (dot products, a horizontal
// sum per output). Against oneDNN's prepacked matmul on a 2-core AMD EPYC (AVX-512 BF16), cold weights: bf16 8 rows
// of the 0.5B shape 35-36 GB/s where oneDNN read 19-26, fp32 4 rows 29-38 against 25-33, fp32 16-64 rows of the
// bundled model's widths 1.1-2.5x its speed; at 512-1822 rows (prefill) bf16 level with it, fp32 within 5%.
#include <memory>
#include <type_traits>
#include <vector>

#include "exports.h"
#include "prelude.h"
#include "vec.h"

constexpr int TW = 2 * VW;  // a tile's columns: two vectors (cpu_prepack.tile() gives the same by level)
// input rows per pass over a tile: two accumulators each, with the two weight vectors and a broadcast in registers
constexpr int MG = VW == 16 ? 8 : 6;
// A tile's stream asks for the line TILE_AHEAD bytes on, twice a GEMV's distance: at 8 rows a step of a tile takes 16
// FMAs (or dot products) per two vectors of weight, so 4 KiB ahead was less time ahead than a read from memory takes.
// Measured (issue 49; 2-core AMD EPYC Zen 5, the 0.5B shape's layers from memory, GB/s of weight, in turn with
// 4 KiB): bf16 8 rows qkv 55.4 -> 61.0, o 50.1 -> 54.0, gate_up 61.9 -> 70.6, down 52.7 -> 55.6; fp32 4 rows
// 61.3 -> 63.5, 59.3 -> 60.5, 64.5 -> 67.3, 75.9 -> 81.1; 16 KiB no better. The GEMV measured level at 8 KiB.
constexpr int TILE_AHEAD = 8192;

static inline void vstore(c10::BFloat16* p, vf a) { vstore_bf16(p, a); }

// rows m0.. (n of them) against one tile of fp32 weights, or of bf16 ones widened as they load: y[:, t * TW + ...]
// (y in the weight's dtype, bf16 rounded to nearest even as PyTorch's bf16 matmul rounds its fp32 sums)
template <int N, typename W, typename Y>
static void tile_f32(const float* x, const W* wt, const Y* bias, Y* y, int64_t I, int64_t O) {
  vf a0[N], a1[N];
  for (int m = 0; m < N; ++m) a0[m] = a1[m] = vzero();
  for (int64_t k = 0; k < I; ++k) {
    const W* w = wt + k * TW;
    prefetch_span<TW * sizeof(W), TILE_AHEAD>(w, k * TW * sizeof(W));
    const vf w0 = vload(w), w1 = vload(w + VW);
    for (int m = 0; m < N; ++m) {
      const vf b = vset1(x[m * I + k]);
      a0[m] = vfmadd(w0, b, a0[m]);
      a1[m] = vfmadd(w1, b, a1[m]);
    }
  }
  const vf b0 = bias ? vload(bias) : vzero(), b1 = bias ? vload(bias + VW) : vzero();
  for (int m = 0; m < N; ++m) {
    vstore(y + m * O, vadd(a0[m], b0));
    vstore(y + m * O + VW, vadd(a1[m], b1));
  }
}

#if defined(__AVX512BF16__)
// the same for a bf16 tile: an input pair broadcast as one 32-bit value, `vdpbf16ps` adding both products to fp32
template <int N>
static void tile_bf16(const uint16_t* x, const uint16_t* wt, const uint16_t* bias, c10::BFloat16* y, int64_t I,
                      int64_t O) {
  __m512 a0[N], a1[N];
  for (int m = 0; m < N; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < I / 2; ++k) {
    const uint16_t* w = wt + k * 64;
    prefetch_span<128, TILE_AHEAD>(w, k * 128);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int m = 0; m < N; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * I + 2 * k, 4);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, b);
      a1[m] = _mm512_dpbf16_ps(a1[m], w1, b);
    }
  }
  const __m512 b0 = bias ? vload((const c10::BFloat16*)bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? vload((const c10::BFloat16*)bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < N; ++m) {  // rounded to nearest even, as PyTorch's bf16 matmul rounds its fp32 sums
    _mm256_storeu_si256((__m256i*)(y + m * O), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[m], b0)));
    _mm256_storeu_si256((__m256i*)(y + m * O + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1[m], b1)));
  }
}
#endif

// tile(n, m0, t, first): rows m0..m0+n-1 against tile t (first: the block's first group), for the tiles over torch's
// threads: each thread's tiles against every row group (a tile read from memory once, from cache for the next
// groups), MB rows at a time, so that many rows (prefill) read their inputs from L2 and write their outputs a block
// of rows at a time (one tile's column strip down all rows ran 5-12% slower at 1841 rows of the bundled model). A
// block's rows split into groups of near-equal size (8 rows at AVX2 two groups of 4, not 6 and 2: a group of 2 keeps
// 4 FMA chains, too few to hide the FMA's latency).
constexpr int64_t MB = 8 * MG;
template <typename F>
static void over_tiles(int64_t M, int64_t O, F tile) {
  at::parallel_for(0, O / TW, 1, [&](int64_t b, int64_t e) {
    for (int64_t mb = 0; mb < M; mb += MB) {
      const int64_t rows = std::min(M - mb, MB), groups = (rows + MG - 1) / MG;
      for (int64_t t = b; t < e; ++t)
        for (int64_t g = 0, m0 = mb; g < groups; ++g) {
          const int64_t n = (mb + rows - m0 + groups - g - 1) / (groups - g);
          tile(n, m0, t, g == 0);
          m0 += n;
        }
    }
  });
}

// a row count known at compile time, 1..MG, for fn<N>()
template <typename F>
static void with_rows(int64_t n, F fn) {
  switch (n) {
    case 1: return fn(std::integral_constant<int, 1>());
    case 2: return fn(std::integral_constant<int, 2>());
    case 3: return fn(std::integral_constant<int, 3>());
    case 4: return fn(std::integral_constant<int, 4>());
    case 5: return fn(std::integral_constant<int, 5>());
    case 6: return fn(std::integral_constant<int, 6>());
#if defined(__AVX512F__)
    case 7: return fn(std::integral_constant<int, 7>());
    case 8: return fn(std::integral_constant<int, 8>());
#endif
  }
}

// From this many rows a bf16 tile is widened into the thread's buffer (a panel) once a block of rows. Fewer (a
// decode step's cold weights) widen in registers: the 0.5B shape's qkv, gate_up and down at 8-16 rows took 1.14-1.47x
// the time through a panel, at 32 rows 0.94-1.03x (bf16, 2-core AMD EPYC Zen 3, AVX2, in turn in one process).
constexpr int64_t PANEL_MIN_ROWS = 32;

// fp32 tiles, or bf16 ones widened, against x's rows (bf16 inputs widened to fp32 once, here). A bf16 tile is
// widened in registers for a decode step's few rows; for many (prefill) once a block of rows, into a buffer of the
// thread's that every group reads: widening it again for each group took the fp32 FMAs' issue slots (the 0.5B shape
// at 256-1024 rows, 2-core AMD EPYC Zen 3: 73-81 GFLOP/s against oneDNN's widened fp32 copy's 100-138; through the
// panel 108-130, level with it).
template <typename W>
static void blocked_wide(const W* x, const W* w, const W* bias, W* y, int64_t M, int64_t I, int64_t O) {
  std::unique_ptr<float[]> widened;  // uninitialised: every value is written before it is read
  const float* xf = (const float*)x;
  constexpr bool bf16 = !std::is_same_v<W, float>;
  if constexpr (bf16) {
    widened.reset(new float[M * I]);
    at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b * I; i < e * I; ++i) widened[i] = float(x[i]);
    });
    xf = widened.get();
  }
  over_tiles(M, O, [&](int64_t n, int64_t m0, int64_t t, bool first) {
    const W* wt = w + t * I * TW;
    auto rows_against = [&](auto* tile) {  // the tile as stored, or its widened panel
      with_rows(n, [&](auto N) {
        tile_f32<N>(xf + m0 * I, tile, bias ? bias + t * TW : nullptr, y + m0 * O + t * TW, I, O);
      });
    };
    if constexpr (bf16) {
      if (M >= PANEL_MIN_ROWS) {
        thread_local std::vector<float> panel;
        if (first) {
          panel.resize(I * TW);
          for (int64_t i = 0; i < I * TW; i += VW) vstore(panel.data() + i, vload(wt + i));
        }
        return rows_against((const float*)panel.data());
      }
    }
    rows_against(wt);
  });
}

// x [M, I], bias [O] or null, y [M, O]: contiguous, of one dtype (bf16 when `bf16`, else fp32); w blocked as above,
// O a multiple of TW (bf16 at AVX-512 BF16: of 32, I even). Returns 0.
extern "C" int64_t fulcrum_blocked_linear(int64_t bf16, const void* x, const void* w, const void* bias, void* y,
                                          int64_t M, int64_t I, int64_t O) {
  if (bf16) {
#if defined(__AVX512BF16__)
    const uint16_t *xb = (const uint16_t*)x, *wb = (const uint16_t*)w, *bb = (const uint16_t*)bias;
    c10::BFloat16* yb = (c10::BFloat16*)y;
    over_tiles(M, O, [&](int64_t n, int64_t m0, int64_t t, bool) {
      with_rows(n, [&](auto N) {
        tile_bf16<N>(xb + m0 * I, wb + t * I * TW, bb ? bb + t * TW : nullptr, yb + m0 * O + t * TW, I, O);
      });
    });
#else
    blocked_wide((const c10::BFloat16*)x, (const c10::BFloat16*)w, (const c10::BFloat16*)bias, (c10::BFloat16*)y, M,
                 I, O);
#endif
    return 0;
  }
  blocked_wide((const float*)x, (const float*)w, (const float*)bias, (float*)y, M, I, O);
  return 0;
}
