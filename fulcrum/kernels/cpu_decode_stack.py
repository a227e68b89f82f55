"""A decode step's whole decoder stack in one call into C++.

On a small model a batch-1 CPU decode step is mostly Python: the bundled model's kernels (GEMVs, norm, rope and
cache write, attention, SwiGLU) take about 0.6 ms of a 3.4 ms step, and the rest is module calls, argument checks,
views and tensor allocations, per layer, 8 times. vLLM's CPU backend removes that with torch.compile (minutes of
startup), llama.cpp with a prebuilt graph. This is the graph, without a compiler in the loop: a driver that calls
the same kernels the layers call (their `extern "C"` entry points, reached through function pointers taken from
their libraries once), layer after layer, over scratch buffers allocated once. The numbers are the layers' own:
the same kernels in the same order, the residual adds rounded to the dtype as PyTorch rounds them.

A `DecodeStack` holds one model's plan: per layer the weight, bias and cache pointers, the kernels for its dtype
and cache kind. The model (`models/llama.py`) decides whether its layers fit (dense weights, one tensor-parallel
rank, Llama's layer shape) and falls back to its modules where they do not, or where a step has more rows than
the GEMV takes. FULCRUM_FUSED_DECODE=0 turns it off (A/B runs, tests of the module path).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from fulcrum.kernels import cpu_act, cpu_attention, cpu_ext, cpu_gemv, cpu_norm, cpu_prepack, cpu_rope

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <c10/util/BFloat16.h>

typedef void (*gemv_fn)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t);
typedef void (*norm_fn)(int64_t, const void*, const void*, void*, int64_t, int64_t, float);
typedef void (*rope_fn)(int64_t, void*, void*, const void*, const void*, const void*, const void*, void*, void*,
                        void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int64_t (*attn_fn)(int64_t, int64_t, const void*, const void*, const void*, const void*, const void*,
                           const int64_t*, const int64_t*, void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, float, int64_t, float);
typedef void (*act_fn)(int64_t, const void*, void*, int64_t, int64_t, int64_t);
// BLAS's sgemm (Fortran calling convention), the one torch's fp32 F.linear calls: for more rows than the GEMV takes
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// one layer's pointers, in this order (the Python side fills an int64 array of LAYER_FIELDS per layer)
enum { IN_NORM, QKV_W, QKV_B, O_W, O_B, POST_NORM, GU_W, GU_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, K_SCALES, V_SCALES,
       WINDOW, LAYER_FIELDS };

// x += t, rounded to T as PyTorch's add rounds (fp32 arithmetic, one rounding)
template <typename T>
static void add_into(T* x, const T* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = T(float(x[i]) + float(t[i]));
}

// y [M, O] = x [M, I] @ w [O, I]^T + bias: the GEMV kernel up to `gemv_rows` rows, BLAS's sgemm past them (fp32)
template <typename T>
static void linear(const int64_t* fns, int64_t gemv_rows, const T* x, const void* w, const void* bias, T* y,
                   int64_t M, int64_t I, int64_t O) {
  if (M <= gemv_rows || sizeof(T) != 4) return ((gemv_fn)fns[0])(x, w, bias, y, M, I, O);
  const int m = int(O), n = int(M), k = int(I);
  const float one = 1.f, zero = 0.f;
  // row-major y^T = w x^T is column-major y: w read as the transpose of a column-major [I, O]
  ((sgemm_fn)fns[5])("T", "N", &m, &n, &k, &one, (const float*)w, &k, (const float*)x, &k, &zero, (float*)y, &m);
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t o = 0; o < O; ++o) y[r * O + o] = T(float(y[r * O + o]) + float(((const T*)bias)[o]));
}

template <typename T>
static int64_t run(const int64_t* fns, const int64_t* layers, const float* scales, int64_t L, const int64_t* dims,
                   float eps, float softcap, T* x, const void* cos, const void* sin, const int64_t* slots,
                   const int64_t* tables, const int64_t* ctx_lens, int64_t width, int64_t M, T* scratch) {
  const norm_fn norm = (norm_fn)fns[1];
  const rope_fn rope = (rope_fn)fns[2];
  const attn_fn attn = (attn_fn)fns[3];
  const act_fn act = (act_fn)fns[4];
  const int64_t hidden = dims[0], H = dims[1], KVH = dims[2], hd = dims[3], inter = dims[4], bs = dims[5],
                kind = dims[6], gemv_rows = dims[7];
  auto gemv = [&](const T* in, const void* w, const void* b, T* out, int64_t M, int64_t I, int64_t O) {
    linear(fns, gemv_rows, in, w, b, out, M, I, O);
  };
  const int64_t bf16 = sizeof(T) == 2;
  const int64_t qs = H * hd, kvs = KVH * hd, qkv_n = qs + 2 * kvs;
  // scratch: h [M, hidden], qkv [M, qkv_n], q [M, qs], o [M, qs], t [M, hidden], gu [M, 2 inter], a [M, inter]
  T* h = scratch;
  T* qkv = h + M * hidden;
  T* q = qkv + M * qkv_n;
  T* o = q + M * qs;
  T* t = o + M * qs;
  T* gu = t + M * hidden;
  T* a = gu + M * 2 * inter;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* p = layers + l * LAYER_FIELDS;
    auto ptr = [&](int f) { return (void*)p[f]; };
    norm(bf16, x, ptr(IN_NORM), h, M, hidden, eps);
    gemv(h, ptr(QKV_W), ptr(QKV_B), qkv, M, hidden, qkv_n);
    rope(bf16, qkv, qkv + qs, qkv + qs + kvs, cos, sin, slots, ptr(K_CACHE), ptr(V_CACHE), ptr(K_SCALES),
         ptr(V_SCALES), kind, M, H, KVH, hd, qkv_n, qkv_n, qkv_n);
    const T* qc = qkv;  // one row's q is already contiguous; more rows are copied out of the fused qkv rows
    if (M > 1) {
      for (int64_t m = 0; m < M; ++m) std::memcpy(q + m * qs, qkv + m * qkv_n, qs * sizeof(T));
      qc = q;
    }
    if (attn(bf16, kind, qc, ptr(K_CACHE), ptr(V_CACHE), ptr(K_SCALES), ptr(V_SCALES), tables, ctx_lens, o, M, H,
             KVH, hd, bs, width, scales[l], p[WINDOW], softcap) != 0)
      return -1;
    gemv(o, ptr(O_W), ptr(O_B), t, M, qs, hidden);
    add_into(x, t, M * hidden);
    norm(bf16, x, ptr(POST_NORM), h, M, hidden, eps);
    gemv(h, ptr(GU_W), ptr(GU_B), gu, M, hidden, 2 * inter);
    act(bf16, gu, a, M, inter, 2 * inter);
    gemv(a, ptr(DOWN_W), ptr(DOWN_B), t, M, inter, hidden);
    add_into(x, t, M * hidden);
  }
  return 0;
}

// dims: hidden, heads, kv heads, head_dim, intermediate, block size, cache kind, the GEMV's most rows. x [M, hidden] is the residual
// stream, updated in place; scratch holds M * (2 hidden + qkv + 2 q + 3 intermediate) values of x's dtype.
extern "C" int64_t fulcrum_decode_stack(int64_t bf16, const int64_t* fns, const int64_t* layers, const float* scales,
                                        int64_t L, const int64_t* dims, float eps, float softcap, void* x,
                                        const void* cos, const void* sin, const int64_t* slots, const int64_t* tables,
                                        const int64_t* ctx_lens, int64_t width, int64_t M, void* scratch) {
  if (bf16)
    return run(fns, layers, scales, L, dims, eps, softcap, (c10::BFloat16*)x, cos, sin, slots, tables, ctx_lens,
               width, M, (c10::BFloat16*)scratch);
  return run(fns, layers, scales, L, dims, eps, softcap, (float*)x, cos, sin, slots, tables, ctx_lens, width, M,
             (float*)scratch);
}
"""

LAYER_FIELDS = 15  # the C++ enum's count
MAX_ROWS = 4096  # decode rows of one fused step at most, where sgemm takes the GEMV's place


def enabled() -> bool:
    return os.environ.get("FULCRUM_FUSED_DECODE", "1") != "0"


@functools.cache
def _module():
    # the driver itself needs no vector ISA (its loops are the residual adds); it runs where the kernels it calls run
    lib = cpu_ext.load_at("fulcrum_cpu_decode_stack", _SOURCE, cpu_ext.best("avx512_bf16", "avx512", "avx2"))
    if lib is None:
        return None
    P, I64, F32 = cpu_ext.PTR, cpu_ext.I64, cpu_ext.F32
    return cpu_ext.bind(lib.fulcrum_decode_stack, I64, I64, P, P, P, I64, P, F32, F32, *[P] * 6, I64, I64, P)


def available() -> bool:
    return _module() is not None


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def blas_sgemm() -> int:
    """The address of the sgemm_ torch's CPU library exports (MKL's, the one its fp32 F.linear calls), or 0."""
    try:
        return _address(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).sgemm_)
    except (OSError, AttributeError):
        return 0


@dataclass
class LayerTensors:
    """One Llama-shaped decoder layer's tensors, as the driver walks them."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    scale: float
    sliding_window: int | None


class DecodeStack:
    """The plan of one model's local decoder layers for decode-only steps of up to `max_rows` sequences."""

    def __init__(self, layers: list[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 softcap: float | None, packed: bool = False):  # fmt: skip
        """`packed`: every linear also holds oneDNN's packed weight, which takes steps past its stack_rows."""
        first = layers[0]
        self.dtype = first.qkv_weight.dtype
        self.hidden = first.qkv_weight.shape[1]
        self.inter = first.down_weight.shape[1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.softcap = eps, softcap or 0.0
        self.kind = cpu_ext.KV_CACHE_KINDS.get(first.k_cache.dtype, 0)
        self.gemv_rows = cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(self.dtype, 0)
        # past the GEMV's rows fp32 takes BLAS's sgemm; bf16 keeps the modules there (their oneDNN matmul)
        self.max_rows = MAX_ROWS if self.dtype == torch.float32 and blas_sgemm() else self.gemv_rows
        if packed:
            self.max_rows = min(self.max_rows, cpu_prepack.stack_rows(self.dtype))
        self._layers = layers  # keeps every pointer below alive
        self.cache_ptr = first.k_cache.data_ptr()

        def ptr(t):
            return 0 if t is None else t.data_ptr()

        rows = [
            [ptr(x.input_norm), ptr(x.qkv_weight), ptr(x.qkv_bias), ptr(x.o_weight), ptr(x.o_bias), ptr(x.post_norm),
             ptr(x.gate_up_weight), ptr(x.gate_up_bias), ptr(x.down_weight), ptr(x.down_bias), ptr(x.k_cache),
             ptr(x.v_cache), ptr(x.k_scales), ptr(x.v_scales), x.sliding_window or 0]
            for x in layers
        ]  # fmt: skip
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.scales = torch.tensor([x.scale for x in layers], dtype=torch.float32)
        self.dims = torch.tensor(
            [
                self.hidden,
                num_heads,
                num_kv_heads,
                head_dim,
                self.inter,
                first.k_cache.shape[1],
                self.kind,
                self.gemv_rows,
            ],
            dtype=torch.int64,
        )
        self.fns = torch.tensor(
            [_address(cpu_gemv._module()[self.dtype]), _address(cpu_norm._module()), _address(cpu_rope._module()),
             _address(cpu_attention._module(bool(self.kind))["decode"]), _address(cpu_act._module()), blas_sgemm()],
            dtype=torch.int64,
        )  # fmt: skip
        qkv = (num_heads + 2 * num_kv_heads) * head_dim
        self.per_row = 2 * self.hidden + qkv + 2 * num_heads * head_dim + 3 * self.inter
        self.scratch = torch.empty(max(self.gemv_rows, 1) * self.per_row, dtype=self.dtype)  # grown for more rows

    @staticmethod
    def supported(layers: list[LayerTensors], head_dim: int, group: int) -> bool:
        """Whether every kernel the driver calls exists here and takes these layers' tensors."""
        if not (layers and available()):
            return False
        first = layers[0]
        dtype = first.qkv_weight.dtype
        kind = cpu_ext.KV_CACHE_KINDS.get(first.k_cache.dtype, 0)
        tensors = [t for x in layers for t in (x.input_norm, x.qkv_weight, x.qkv_bias, x.o_weight, x.o_bias,
                                              x.post_norm, x.gate_up_weight, x.gate_up_bias, x.down_weight,
                                              x.down_bias) if t is not None]  # fmt: skip
        return (
            dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
            and all(x.k_cache.dtype == first.k_cache.dtype and x.k_cache.is_contiguous() for x in layers)
            and (kind == 0 and first.k_cache.dtype == dtype or kind != 0 and first.k_scales is not None)
            and head_dim in cpu_attention.HEAD_DIMS
            and head_dim % 2 == 0
            and group <= cpu_attention.MAX_GROUP
            and cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(dtype, 0) > 0
            and all(k.available() for k in (cpu_gemv, cpu_norm, cpu_rope, cpu_act))
            and cpu_attention.available(bool(kind))
        )

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The residual stream after every layer, for x [M, hidden] (M <= max_rows, one decode token per row):
        a new tensor; the cache gets each row's k and v at its slot."""
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place: the caller's tensor stays as it was
        if self.scratch.numel() < x.shape[0] * self.per_row:
            self.scratch = torch.empty(x.shape[0] * self.per_row, dtype=self.dtype)
        slots = slot_mapping.to(torch.int64).contiguous()
        tables, lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = _module()(
            self.dtype == torch.bfloat16, self.fns.data_ptr(), self.table.data_ptr(), self.scales.data_ptr(),
            self.table.shape[0], self.dims.data_ptr(), self.eps, self.softcap, x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1], x.shape[0],
            self.scratch.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"decode stack: unsupported head_dim {self.head_dim}")
        return x
