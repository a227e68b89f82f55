"""Build and load fulcrum's C++ CPU kernels (AVX-512) once per environment.

Each kernel module is compiled with torch's C++ extension loader into its own cache folder
(~/.cache/fulcrum/kernels, or $FULCRUM_CACHE), keyed by its source, the flags, torch and the
interpreter, so two virtual environments never rebuild over each other. Kernels are used only on x86
CPUs with AVX-512 BF16; anywhere else, with FULCRUM_CPU_KERNELS=0, or when the build fails (no
compiler), `load` returns None and callers stay on PyTorch ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time

import torch

log = logging.getLogger(__name__)

# -fopenmp matters: at::parallel_for is a header template that runs its `omp parallel` region only
# when the extension itself is compiled with OpenMP; without it every kernel silently ran on one
# thread. The extension's libgomp.so.1 resolves to the one torch has already loaded (same soname).
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
# Headers and helpers every kernel source starts with: loads and stores that widen bf16 to fp32 and round
# fp32 back to the tensor's dtype (round to nearest even, as `.to()` does).
PRELUDE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstring>

static inline float bf16_to_f32(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void store(float* y, float v) { *y = v; }
static inline void store(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }
"""
STALE_LOCK_S = 180  # a build takes well under a minute; an older lock was left by a killed process


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags and "avx512f" in flags


def enabled() -> bool:
    return os.environ.get("FULCRUM_CPU_KERNELS", "1") != "0" and cpu_has_avx512_bf16()


def _build_dir(source: str) -> str:
    key = hashlib.sha256("|".join([source, " ".join(FLAGS), torch.__version__, sys.prefix]).encode()).hexdigest()
    root = os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum"))
    path = os.path.join(root, "kernels", key[:16])
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    # torch waits forever on the lock file of a build whose process was killed: clear a stale one
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
        with contextlib.suppress(OSError):
            os.remove(lock)
    return path


def load(name: str, source: str, functions: list[str]):
    """The compiled module, or None where the kernels do not apply or cannot be built."""
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=name,
            cpp_sources=source,
            functions=functions,
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=_build_dir(source),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: stay correct, just slower
        log.warning("CPU kernel %s unavailable, using PyTorch ops: %s", name, e)
        return None
