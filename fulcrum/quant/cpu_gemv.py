"""A CPU kernel for the shape that dominates batch-1 decoding: y = x @ W^T with few rows in x.

PyTorch's CPU GEMV paths read bf16 and fp32 weights at a fraction of memory bandwidth (measured
here: about 15 GB/s of a 55 GB/s read bandwidth), while a decode step is nothing but streaming every
weight once. This kernel walks each weight row once with AVX-512 (`vdpbf16ps` for bf16, FMA for
fp32), keeps the few input rows in registers, and splits output rows over PyTorch's own thread pool.

It is compiled once per environment with torch's C++ extension loader (cached in ~/.cache/fulcrum;
the model runner builds it at startup, before a server reports ready) and used only on
x86 CPUs with AVX-512 BF16; anywhere else, or if the build fails, callers fall back to F.linear.
Set FULCRUM_CPU_KERNELS=0 to turn it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 2  # beyond this, PyTorch's GEMM kernels are as fast or faster (measured)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

static inline float bf16_to_f32(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }

// R weight rows at a time (R*M accumulator chains). Measured on a 2-core EPYC: R = 1 streams
// fastest (22 GB/s bf16 at M = 1); R = 4 was slower (10 GB/s), so the dispatch uses R = 1.
template <int M, int R>
static void gemv_bf16_rows(const uint16_t* x, const uint16_t* w, float* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  const int64_t I32 = I / 32 * 32;
  int64_t o = begin;
  for (; o + R <= end; o += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < I32; i += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512((const void*)(x + m * I + i));
      for (int r = 0; r < R; ++r) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + (o + r) * I + i));
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      const uint16_t* wr = w + (o + r) * I;
      for (int64_t i = I32; i < I; ++i) s += bf16_to_f32(wr[i]) * bf16_to_f32(x[m * I + i]);
      y[m * O + o + r] = s;
    }
  }
  if (o < end) gemv_bf16_rows<M, 1>(x, w, y, I, O, o, end);
}

template <int M, int R>
static void gemv_f32_rows(const float* x, const float* w, float* y, int64_t I, int64_t O, int64_t begin, int64_t end) {
  const int64_t I16 = I / 16 * 16;
  int64_t o = begin;
  for (; o + R <= end; o += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < I16; i += 16) {
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * I + i);
      for (int r = 0; r < R; ++r) {
        __m512 wv = _mm512_loadu_ps(w + (o + r) * I + i);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      const float* wr = w + (o + r) * I;
      for (int64_t i = I16; i < I; ++i) s += wr[i] * x[m * I + i];
      y[m * O + o + r] = s;
    }
  }
  if (o < end) gemv_f32_rows<M, 1>(x, w, y, I, O, o, end);
}

#define ROWS_SWITCH(FN, ...)                                       \
  switch (M) {                                                     \
    case 1: FN<1, 1>(__VA_ARGS__); break;                          \
    case 2: FN<2, 1>(__VA_ARGS__); break;                          \
    case 3: FN<3, 1>(__VA_ARGS__); break;                          \
    default: FN<4, 1>(__VA_ARGS__); break;                         \
  }

// x [M, I] (M <= 4), w [O, I], both contiguous and of one dtype (bf16 or fp32); returns fp32 [M, O]
torch::Tensor gemv(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), I = x.size(1), O = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4, "gemv takes 1 to 4 rows");
  auto y = torch::empty({M, O}, x.options().dtype(torch::kFloat));
  float* yp = y.data_ptr<float>();
  // about 64 KB of weights per task, so threads split the rows evenly without much scheduling
  const int64_t grain = std::max<int64_t>(1, 65536 / (I * w.element_size()));
  if (x.scalar_type() == torch::kBFloat16) {
    auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    at::parallel_for(0, O, grain, [&](int64_t b, int64_t e) { ROWS_SWITCH(gemv_bf16_rows, xp, wp, yp, I, O, b, e) });
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "gemv takes bf16 or fp32");
    auto xp = x.data_ptr<float>();
    auto wp = w.data_ptr<float>();
    at::parallel_for(0, O, grain, [&](int64_t b, int64_t e) { ROWS_SWITCH(gemv_f32_rows, xp, wp, yp, I, O, b, e) });
  }
  return y;
}
"""


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags and "avx512f" in flags


STALE_LOCK_S = 180  # a build takes well under a minute; an older lock was left by a killed process


def _build_dir() -> str:
    """One cache folder per source, flags, torch and interpreter: two virtual environments never
    rebuild over each other (torch's default folder is shared by name)."""
    import hashlib
    import sys

    key = hashlib.sha256("|".join([_SOURCE, " ".join(_FLAGS), torch.__version__, sys.prefix]).encode()).hexdigest()
    root = os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum"))
    path = os.path.join(root, "kernels", key[:16])
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    # torch waits forever on the lock file of a build whose process was killed: clear a stale one
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
        with contextlib.suppress(OSError):
            os.remove(lock)
    return path


_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma"]


@functools.cache
def _module():
    if os.environ.get("FULCRUM_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="fulcrum_cpu_gemv",
            cpp_sources=_SOURCE,
            functions=["gemv"],
            extra_cflags=_FLAGS,
            build_directory=_build_dir(),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: stay correct, just slower
        log.warning("CPU GEMV kernel unavailable, using F.linear: %s", e)
        return None


def available() -> bool:
    return _module() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel applies: CPU, bf16/fp32, few rows, contiguous weight."""
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight.is_contiguous()
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = _module().gemv(x.contiguous(), weight)
    if bias is not None:
        y += bias
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the GEMV kernel where it applies (any leading dims flattened)."""
    if x.dim() == 2 and usable(x, weight):
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
