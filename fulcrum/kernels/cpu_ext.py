"""Build and load fulcrum's C++ CPU kernels once per environment, for the ISA level this CPU has.

Each kernel is a small C++ library with plain `extern "C"` entry points taking raw pointers, compiled by the
system's C++ compiler straight into a cache folder (~/.cache/fulcrum/kernels, or $FULCRUM_CACHE) keyed by its
source, the flags, torch and the interpreter, and loaded with ctypes. The sources include only the light ATen
headers they use (at::parallel_for, c10::BFloat16), never <torch/extension.h>: that header alone took ~40 s to
compile on a 2-core machine, three times over, before a server could report ready; a kernel now builds in a few
seconds. Each kernel picks the highest level it has a build for (all three: AVX2 at least; the GEMV uses AVX-512
BF16's dot products); below AVX2, with FULCRUM_CPU_KERNELS=0, or when the build fails (no compiler), `load`
returns None and callers stay on PyTorch ops. The level itself (FULCRUM_CPU_ISA=none|avx2|avx512|avx512_bf16|amx
forces a lower one than the CPU's, torch's libraries included) is `fulcrum.utils.cpu_isa`'s.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile

import torch

# the kernels pick their level through these (re-exported: one home for the level, utils/cpu_isa.py)
from fulcrum.utils.cpu_isa import ISA_LEVELS, at_least, best, detected_isa, isa  # noqa: F401

log = logging.getLogger(__name__)

# -fopenmp matters: at::parallel_for is a header template that runs its `omp parallel` region only
# when the library itself is compiled with OpenMP; without it every kernel silently ran on one
# thread. The library's libgomp.so.1 resolves to the one torch has already loaded (same soname), so torch's
# ops and these kernels share one thread pool.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
# Software prefetch for a weight stream (needs <immintrin.h> and <cstdint> before it); in PRELUDE, and in any source
# that writes its own headers
PREFETCH = r"""
// A weight stream read once (a GEMV's rows) asks for the line STREAM_AHEAD bytes on: on Intel server cores the
// hardware prefetchers alone kept a bf16 GEMV at ~60% of a plain read of the same bytes, and 3-4 KB ahead brought it
// to ~95% (measured; figures in the commit that added it).
constexpr int STREAM_AHEAD = 4096;
static inline void prefetch_stream(const void* p) { _mm_prefetch((const char*)p + STREAM_AHEAD, _MM_HINT_T0); }
// the same for a loop step that reads BYTES of the stream at p, `at` bytes into it: one request a cache line, so a
// step of less than a line asks on every 64th byte only
template <int64_t BYTES>
static inline void prefetch_span(const void* p, int64_t at) {
  if (BYTES >= 64) {
    for (int64_t b = 0; b < BYTES; b += 64) prefetch_stream((const char*)p + b);
  } else if (at % 64 == 0) {
    prefetch_stream(p);
  }
}
"""
# Headers and helpers every kernel source starts with: loads and stores that widen bf16 to fp32 and round
# fp32 back to the tensor's dtype (round to nearest even, as `.to()` does).
PRELUDE = (
    r"""
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
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
    + PREFETCH
)

ISA_FLAGS = {
    "none": ["-O2", "-fopenmp"],  # code that needs no vector ISA (thread placement)
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
    "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"],
    "avx512_bf16": FLAGS,
    "amx": FLAGS,  # the AVX-512 BF16 builds: AMX itself is oneDNN's, through torch's bf16 matmuls
}
# The row split of the GEMVs (dense and quantized): output rows over torch's OpenMP pool, about 64 KB of weights
# per task so threads split evenly; up to 4 input rows share one pass over the weights, and more go 4 at a time
# over a block of weight rows small enough to stay in L2, so the weights still come from memory once.
# f(m0, n, begin, end) computes input rows m0..m0+n-1 (n <= 4) against weight rows [begin, end).
SPLIT_ROWS = r"""
// Up to 4 input rows share one pass over the weights; more go 4 at a time over a block of weight rows small
// enough to stay in L2, so the weights still come from memory once. `row_bytes`: bytes of one packed weight row.
template <typename F>
static void split_rows(int64_t M, int64_t O, int64_t row_bytes, F f) {
  const int64_t block = std::max<int64_t>(1, 131072 / row_bytes);
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);
  at::parallel_for(0, O, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; o += block) {
      const int64_t oe = std::min(e, o + block);
      for (int64_t m0 = 0; m0 < M; m0 += 4) f(m0, std::min<int64_t>(4, M - m0), o, oe);
    }
  });
}
"""
# Vector primitives a kernel can be written against once and built for any level: vf holds VW floats.
VECTOR_PRELUDE = {
    "avx512": r"""
typedef __m512 vf;
constexpr int VW = 16;
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) { return load16(p); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } // c - a * b
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vmax_all(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
static inline vf vexp2i(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
static inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// VW fp8 e4m3 bytes as fp16 (sign, then exponent and mantissa 7 bits up; F16C widens fp16 exactly, subnormals
// included): the value times 2^-8, since fp16's exponent bias is 15 against e4m3's 7. Callers fold 2^8 into the scale.
static inline vf vload_f8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}
// VW floats rounded to bf16, to nearest even as .to() rounds (finite values), kept as fp32; and stored as bf16
static inline vf vround_bf16(vf a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000))));
}
static inline void vstore_bf16(c10::BFloat16* p, vf a) {
  const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(a)), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(h));
}
""",
    "avx2": r"""
typedef __m256 vf;
constexpr int VW = 8;
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline float vmax_all(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vexp2i(vf p, vf n) {  // p * 2^n for integral n >= -126: n goes straight into the exponent bits
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf vload_f8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}
static inline vf vround_bf16(vf a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000))));
}
static inline void vstore_bf16(c10::BFloat16* p, vf a) {
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(a)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // 8 words in the low half
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
""",
}


# Functions written once on the primitives above
VECTOR_MATH = r"""
// e^x for -87 <= x <= 87 (less is taken as -87): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2; degree-6 polynomial, rel. error ~2e-7
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
"""


# A value rounded to T, kept as fp32, and stored as T (bf16: the rounding to nearest even above), by the pointer's type
TYPED_STORES = r"""
static inline vf vround(vf a, c10::BFloat16*) { return vround_bf16(a); }
static inline void vstore_as(c10::BFloat16* p, vf a) { vstore_bf16(p, a); }
static inline vf vround(vf a, float*) { return a; }
static inline void vstore_as(float* p, vf a) { vstore(p, a); }
"""


def vector_prelude(level: str) -> str:
    """PRELUDE plus the vector primitives of `level` (avx2 or avx512): for kernels written once for both."""
    return PRELUDE + VECTOR_PRELUDE[level] + VECTOR_MATH + TYPED_STORES


def vector_level() -> str:
    """The level a kernel written on the vector primitives is built for here: avx512 or avx2 (or below: none)."""
    return best("avx512", "avx2")


def load_vector(name: str, body: str) -> ctypes.CDLL | None:
    """`load` for a kernel written on the vector primitives: `body` after their prelude and <cmath>, built as
    `name_<level>` at `vector_level()`."""
    level = vector_level()
    return load(f"{name}_{level}", vector_prelude(level) + "#include <cmath>\n" + body, level)


def _build_dir(source: str, flags: list[str]) -> str:
    key = hashlib.sha256("|".join([source, " ".join(flags), torch.__version__, sys.prefix]).encode()).hexdigest()
    root = os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum"))
    path = os.path.join(root, "kernels", key[:16])
    os.makedirs(path, exist_ok=True)
    return path


def compile_command(source_path: str, out_path: str, flags: list[str], link: bool = True) -> list[str]:
    """The compiler call for one kernel library: torch's headers, and its libraries for at::parallel_for."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++").split()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *flags]
    cmd += [f"-I{p}" for p in include_paths()]
    if not link:
        return [*cmd, "-c", source_path, "-o", out_path]
    libs = library_paths()
    return [*cmd, "-shared", source_path, "-o", out_path, *(f"-L{p}" for p in libs),
            *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]  # fmt: skip


def build(name: str, source: str, flags: list[str]) -> str:
    """The path of `name`'s library built from `source`, compiling it unless the cache holds it. Concurrent
    builders (two servers starting at once) each write a private file and rename it into place."""
    folder = _build_dir(source, flags)
    lib = os.path.join(folder, f"{name}.so")
    if os.path.exists(lib):
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = os.path.join(tmp, f"{name}.cpp"), os.path.join(tmp, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        res = subprocess.run(compile_command(src, out, flags), capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {name} failed:\n{res.stderr[-4000:]}")
        os.replace(out, lib)
    return lib


def load(name: str, source: str, level: str = "avx512_bf16", extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library compiled for ISA `level` (its `extern "C"` functions reached through ctypes), or None where
    the CPU (or FULCRUM_CPU_ISA) is below it or it cannot be built. `extra_flags`: compiler flags for an extension
    the caller has checked the CPU for (e.g. -mavx512vnni)."""
    if not at_least(level):
        return None
    try:
        return ctypes.CDLL(build(name, source, [*ISA_FLAGS[level], *extra_flags]))
    except Exception as e:  # no compiler, no headers: stay correct, just slower
        log.warning("CPU kernel %s unavailable, using PyTorch ops: %s", name, e)
        return None


def load_at(base: str, source: str, level: str) -> ctypes.CDLL | None:
    """`load` for a kernel built at one of several levels: its library is `base` at avx512_bf16 (the first level these
    kernels were written for) and `base_<level>` below it."""
    return load(base if level == "avx512_bf16" else f"{base}_{level}", source, level)


def bind(fn, restype, *argtypes):
    """Give a ctypes function its signature (pointers are passed as ints, None for NULL) and return it."""
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


PTR, I64, F32, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double

# A quantized KV cache's element type -> the `kind` the rope and attention kernels take (0: a cache in the
# activations' own dtype); fulcrum.quant.kv holds the format
KV_CACHE_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}


def rows_packed(x: torch.Tensor) -> bool:
    """[T, heads, D] with a token's heads side by side (tokens may be strided: views of the fused qkv output)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
