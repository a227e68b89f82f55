// y = x @ W^T + b for few rows of x, the shape that dominates decoding: a decode step streams every weight once, and
// PyTorch's CPU paths for few rows read them well below the memory's rate. Each weight row is walked once against up
// to 4 input rows held in registers (more go 4 at a time over cache-resident blocks of weight rows, split_rows.h),
// the bias fused, the input's dtype written. AVX-512 BF16 builds the native rows (`vdpbf16ps` for bf16, FMA for
// fp32); AVX2 and plain AVX-512 the rows written on vec.h, bf16 widened in registers.
#include <atomic>

#include "exports.h"
#include "split_rows.h"

#if defined(__AVX512BF16__)
// One weight row at a time against M input rows held in registers (M accumulator chains): walking several weight rows
// at once measured slower (more streams than the prefetchers follow).
template <int M, typename Out>
static void rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  const int64_t I32 = I / 32 * 32, I64 = I / 64 * 64;
  for (int64_t o = begin; o < end; ++o) {
    const uint16_t* wr = w + o * I;
    // two accumulator chains per input row hide the FMA latency, so one core keeps up with its memory stream
    __m512 acc[M], acc2[M];
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < I64; i += 64) {
      prefetch_stream(wr + i);
      prefetch_stream(wr + i + 32);
      __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wr + i));
      __m512bh wv2 = (__m512bh)_mm512_loadu_si512((const void*)(wr + i + 32));
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512((const void*)(x + m * I + i)));
        acc2[m] = _mm512_dpbf16_ps(acc2[m], wv2, (__m512bh)_mm512_loadu_si512((const void*)(x + m * I + i + 32)));
      }
    }
    for (; i < I32; i += 32) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wr + i));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512((const void*)(x + m * I + i)));
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
      for (int64_t i = I32; i < I; ++i) s += bf16_to_f32(wr[i]) * bf16_to_f32(x[m * I + i]);
      if (bias) s += bf16_to_f32(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

// At 4 input rows one chain per row: 4 chains already hide the FMA latency, and a second set of input loads cost more
// than it saved (fp32, 2-core AMD EPYC)
template <int M, typename Out>
static void rows_f32_one_chain(const float* x, const float* w, const float* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  const int64_t I16 = I / 16 * 16;
  for (int64_t o = begin; o < end; ++o) {
    const float* wr = w + o * I;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < I16; i += 16) {
      prefetch_stream(wr + i);
      __m512 wv = _mm512_loadu_ps(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * I + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]);
      for (int64_t i = I16; i < I; ++i) s += wr[i] * x[m * I + i];
      if (bias) s += bias[o];
      store(y + m * O + o, s);
    }
  }
}

template <int M, typename Out>
static void rows_f32(const float* x, const float* w, const float* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  if constexpr (M >= 4) {
    rows_f32_one_chain<M>(x, w, bias, y, I, O, begin, end);
    return;
  }
  const int64_t I16 = I / 16 * 16, I32 = I / 32 * 32;
  for (int64_t o = begin; o < end; ++o) {
    const float* wr = w + o * I;
    // two accumulator chains per input row hide the FMA latency (as in rows_bf16), which one chain did not at 1-3 rows
    __m512 acc[M], acc2[M];
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < I32; i += 32) {
      prefetch_stream(wr + i);
      prefetch_stream(wr + i + 16);
      const __m512 wv = _mm512_loadu_ps(wr + i), wv2 = _mm512_loadu_ps(wr + i + 16);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * I + i), acc[m]);
        acc2[m] = _mm512_fmadd_ps(wv2, _mm512_loadu_ps(x + m * I + i + 16), acc2[m]);
      }
    }
    for (; i < I16; i += 16) {
      const __m512 wv = _mm512_loadu_ps(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * I + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
      for (int64_t i = I16; i < I; ++i) s += wr[i] * x[m * I + i];
      if (bias) s += bias[o];
      store(y + m * O + o, s);
    }
  }
}
#else  // AVX2 and AVX-512 without BF16: the same row loops written once on vec.h
#include "vec.h"

// T is float or c10::BFloat16: vload widens either to fp32, so one loop serves both dtypes
template <int M, typename T, typename Out>
static void rows(const T* x, const T* w, const T* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  const int64_t IV = I / (2 * VW) * (2 * VW);
  for (int64_t o = begin; o < end; ++o) {
    const T* wr = w + o * I;
    vf acc[M], acc2[M];  // two chains per input row hide the FMA latency
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = vzero();
    for (int64_t i = 0; i < IV; i += 2 * VW) {
      prefetch_span<2 * VW * sizeof(T)>(wr + i, i * sizeof(T));
      const vf wv = vload(wr + i), wv2 = vload(wr + i + VW);
      for (int m = 0; m < M; ++m) {
        acc[m] = vfmadd(wv, vload(x + m * I + i), acc[m]);
        acc2[m] = vfmadd(wv2, vload(x + m * I + i + VW), acc2[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(vadd(acc[m], acc2[m]));
      for (int64_t i = IV; i < I; ++i) s += float(wr[i]) * float(x[m * I + i]);
      if (bias) s += float(bias[o]);
      store(y + m * O + o, s);
    }
  }
}

// the entry points run() below calls, as the AVX-512 BF16 build names them (bf16 arrives as raw 16-bit words)
template <int M, typename Out>
static void rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  using B = c10::BFloat16;
  rows<M>(reinterpret_cast<const B*>(x), reinterpret_cast<const B*>(w), reinterpret_cast<const B*>(bias), y, I, O, begin, end);
}

template <int M, typename Out>
static void rows_f32(const float* x, const float* w, const float* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  rows<M>(x, w, bias, y, I, O, begin, end);
}
#endif

// the rows kernels f1..f4 (1 to 4 input rows at a time) over split_rows' blocks
template <typename T, typename Out, typename Fn1, typename Fn2, typename Fn3, typename Fn4>
static void run(const T* x, const T* w, const T* bias, Out* y, int64_t M, int64_t I, int64_t O,
                Fn1 f1, Fn2 f2, Fn3 f3, Fn4 f4) {
  split_rows(M, O, I * int64_t(sizeof(T)), [&](int64_t m0, int64_t n, int64_t o, int64_t oe) {
    const T* xm = x + m0 * I;
    Out* ym = y + m0 * O;
    switch (n) {
      case 1: f1(xm, w, bias, ym, I, O, o, oe); break;
      case 2: f2(xm, w, bias, ym, I, O, o, oe); break;
      case 3: f3(xm, w, bias, ym, I, O, o, oe); break;
      default: f4(xm, w, bias, ym, I, O, o, oe); break;
    }
  });
}

// how many threads a parallel_for in this library really runs on (1 if OpenMP was not compiled in)
extern "C" int64_t fulcrum_parallel_threads() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 1 << 16, 1, [&](int64_t, int64_t) {
    int64_t t = at::get_thread_num() + 1, cur = seen.load();
    while (t > cur && !seen.compare_exchange_weak(cur, t)) {}
  });
  return seen.load();
}

// x [M, I], w [O, I], bias [O] or null, all contiguous and of one dtype; y [M, O] in that dtype, accumulated in fp32
extern "C" void fulcrum_gemv_bf16(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t I,
                                  int64_t O) {
  using B = c10::BFloat16;
  run((const uint16_t*)x, (const uint16_t*)w, (const uint16_t*)bias, (B*)y, M, I, O, rows_bf16<1, B>,
      rows_bf16<2, B>, rows_bf16<3, B>, rows_bf16<4, B>);
}

extern "C" void fulcrum_gemv_f32(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t I,
                                 int64_t O) {
  run((const float*)x, (const float*)w, (const float*)bias, (float*)y, M, I, O, rows_f32<1, float>,
      rows_f32<2, float>, rows_f32<3, float>, rows_f32<4, float>);
}
