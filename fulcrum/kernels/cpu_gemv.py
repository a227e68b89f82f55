"""A CPU kernel for the shape that dominates decoding: y = x @ W^T + b with few rows in x.

A decode step is nothing but streaming every weight once, and PyTorch's CPU paths for few rows read
bf16 and fp32 weights well below the rate of a plain sum over the same bytes. This kernel
walks each weight row once (AVX-512 BF16: `vdpbf16ps` for bf16, FMA for fp32; AVX2 and plain AVX-512: bf16
widened in registers, FMA), keeps up to 4 input
rows in registers (more rows go 4 at a time over cache-resident blocks of weight rows), fuses the
bias, writes the input's dtype, and splits output rows over PyTorch's OpenMP thread pool.

It is built by `fulcrum.kernels.cpu_ext` (the model runner's `fulcrum.kernels.warm_up` builds it at
startup, before a server reports ready); where it is not available callers fall back to F.linear.
"""

from __future__ import annotations

import functools

import torch

from fulcrum.kernels import cpu_ext
from fulcrum.utils import cpu_isa

# Up to these row counts the kernel beat F.linear over the 0.5B shape's matrices (2-core EPYC VMs, 2 threads;
# figures in benchmarks/results/cpu-gemv-*.log and the commits). AVX-512 BF16: bf16 through 16 rows, fp32 through
# 32, where it runs at the FMA peak and oneDNN/MKL's fp32 GEMM does not. AVX2: fp32 through 16 (behind at 32),
# bf16 through 32 (torch has no fast bf16 path without native bf16). AVX-512 without BF16 is unmeasured: AVX2's.
MAX_ROWS = {
    "avx512_bf16": {torch.bfloat16: 16, torch.float32: 32},
    "avx512": {torch.bfloat16: 32, torch.float32: 16},
    "avx2": {torch.bfloat16: 32, torch.float32: 16},
}

_NATIVE_ROWS = r"""
#include <atomic>

// One weight row at a time against M input rows held in registers (M accumulator chains).
// Walking several weight rows at once measured slower than one row at a time (more streams than the
// prefetchers follow), so rows are walked one by one.
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
    // two accumulator chains per input row hide the FMA latency (as in rows_bf16): 1-3 rows read 28-43 GB/s
    // against 23-26 with one chain at 2-3 rows (2-core AMD EPYC, alternating runs)
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

"""

# The same row loops written against cpu_ext's vector primitives, for AVX2 and AVX-512 without BF16: bf16 is
# widened to fp32 in registers (a 16-bit shift) and multiplied with FMA.
_GENERIC_ROWS = r"""
#include <atomic>

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

// the entry points _COMMON calls, as the AVX-512 BF16 build names them (bf16 arrives as raw 16-bit words)
template <int M, typename Out>
static void rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  using B = c10::BFloat16;
  rows<M>(reinterpret_cast<const B*>(x), reinterpret_cast<const B*>(w), reinterpret_cast<const B*>(bias), y, I, O, begin, end);
}

template <int M, typename Out>
static void rows_f32(const float* x, const float* w, const float* bias, Out* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  rows<M>(x, w, bias, y, I, O, begin, end);
}

"""

_COMMON = (
    cpu_ext.SPLIT_ROWS
    + r"""
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
"""
)


@functools.cache
def level() -> str:
    """The ISA this kernel is built for here: AVX-512 BF16 (native bf16 dot products), else AVX-512 or AVX2."""
    return cpu_ext.best("avx512_bf16", "avx512", "avx2")


def _source(lvl: str) -> str:
    if lvl == "avx512_bf16":
        return cpu_ext.PRELUDE + _NATIVE_ROWS + _COMMON
    return cpu_ext.vector_prelude(lvl) + _GENERIC_ROWS + _COMMON


@functools.cache
def _module():
    lvl = level()
    lib = cpu_ext.load_at("fulcrum_cpu_gemv", _source(lvl), lvl)
    if lib is None:
        return None
    P, I64 = cpu_ext.PTR, cpu_ext.I64
    return {
        torch.bfloat16: cpu_ext.bind(lib.fulcrum_gemv_bf16, None, P, P, P, P, I64, I64, I64),
        torch.float32: cpu_ext.bind(lib.fulcrum_gemv_f32, None, P, P, P, P, I64, I64, I64),
        "threads": cpu_ext.bind(lib.fulcrum_parallel_threads, I64),
    }


def available() -> bool:
    return _module() is not None


def parallel_threads() -> int:
    """Threads the kernel's row split runs on; PyTorch's thread count when the build is right."""
    return _module()["threads"]()


def usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel applies: CPU, bf16/fp32, few rows, contiguous weight."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and 1 <= x.shape[0] <= MAX_ROWS[level()].get(x.dtype, 0)
        and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],)))
        and weight.is_contiguous()
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ weight[O, I]^T + bias, for inputs `usable` accepts."""
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    m, i = x.shape
    y = torch.empty(m, weight.shape[0], dtype=x.dtype)
    _module()[x.dtype](x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                       m, i, weight.shape[0])  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the GEMV kernel where it applies, and bf16 widened where torch has no native bf16 matmul."""
    if x.dim() == 2 and usable(x, weight, bias):
        return gemv(x, weight, bias)
    if widens(x, weight):
        return widened_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


# The fp32 copy widened_linear makes at most at once: a block of weight rows that fits the caches' neighbourhood
# rather than a second whole matrix (an LM head's would be over 500 MB at the 0.5B shape)
WIDEN_BYTES = 64 * 2**20
# Below this many rows widening the weight costs more than torch's emulated bf16 saves (the two crossed at 8-16)
WIDEN_MIN_ROWS = 16


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether torch's bf16 matmul runs natively here (oneDNN at AVX-512 BF16 or AMX). Below that, oneDNN emulates
    bf16 at 11-19 GFLOP/s on AVX2 and 28-39 on AVX-512 (2-core Xeon, 0.5B shape, 32-512 rows), where the weight
    widened to fp32 for the call and MKL's fp32 GEMM run at 35-95 and 40-160."""
    return cpu_isa.torch_at_least("avx512_bf16")


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes these inputs through widened_linear: bf16, many rows, a CPU without native bf16."""
    return (
        x.dtype == weight.dtype == torch.bfloat16  # first: fp32 layers pay one comparison
        and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]
        and x.device.type == "cpu"
        and not native_bf16_matmul()
    )


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias for bf16 x and weight through fp32: the weight widened one block of rows at a time
    (nothing of it kept), the result rounded back to x's dtype."""
    xf = x.float()
    bf = None if bias is None else bias.float()
    block = max(1, WIDEN_BYTES // (4 * weight.shape[1]))
    if block >= weight.shape[0]:
        return torch.nn.functional.linear(xf, weight.float(), bf).to(x.dtype)
    y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    for a in range(0, weight.shape[0], block):
        b = None if bf is None else bf[a : a + block]
        y[..., a : a + block] = torch.nn.functional.linear(xf, weight[a : a + block].float(), b)
    return y
