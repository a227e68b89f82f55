// A decode step's whole decoder stack in one call: the same kernels the layers call (their entry points, reached
// through function pointers the Python side takes from their libraries once), layer after layer, over scratch
// buffers allocated once, with the residual adds rounded to the dtype as PyTorch rounds them. Needs no vector ISA of
// its own: it is built where the kernels it calls are.
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "exports.h"

// the kernels' types, from their one declaration in exports.h
typedef decltype(&fulcrum_gemv_f32) gemv_fn;  // fulcrum_gemv_bf16's too
typedef decltype(&fulcrum_rms_norm) norm_fn;
typedef decltype(&fulcrum_rope_cache) rope_fn;
typedef decltype(&fulcrum_decode_attention) attn_fn;
typedef decltype(&fulcrum_silu_and_mul) act_fn;
// BLAS's sgemm (Fortran calling convention), the one torch's fp32 F.linear calls: for more rows than the GEMV takes
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// The three int64 arrays the Python side fills (cpu_decode_stack.py reads these enums from this file and fills each
// array by these names): the kernels' addresses, the model's dimensions, and one row of LAYER_FIELDS per layer.
enum Fn { GEMV, NORM, ROPE, ATTN, ACT, SGEMM, NUM_FNS };
enum Dim { HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, CACHE_KIND, GEMV_ROWS, NUM_DIMS };
enum LayerField { IN_NORM, QKV_W, QKV_B, O_W, O_B, POST_NORM, GU_W, GU_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, K_SCALES,
                  V_SCALES, WINDOW, LAYER_FIELDS };

// x += t, rounded to T as PyTorch's add rounds (fp32 arithmetic, one rounding)
template <typename T>
static void add_into(T* x, const T* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = T(float(x[i]) + float(t[i]));
}

// y [M, O] = x [M, I] @ w [O, I]^T + bias: the GEMV kernel up to `gemv_rows` rows, BLAS's sgemm past them (fp32)
template <typename T>
static void linear(const int64_t* fns, int64_t gemv_rows, const T* x, const void* w, const void* bias, T* y,
                   int64_t M, int64_t I, int64_t O) {
  if (M <= gemv_rows || sizeof(T) != 4) return ((gemv_fn)fns[GEMV])(x, w, bias, y, M, I, O);
  const int m = int(O), n = int(M), k = int(I);
  const float one = 1.f, zero = 0.f;
  // row-major y^T = w x^T is column-major y: w read as the transpose of a column-major [I, O]
  ((sgemm_fn)fns[SGEMM])("T", "N", &m, &n, &k, &one, (const float*)w, &k, (const float*)x, &k, &zero, (float*)y, &m);
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t o = 0; o < O; ++o) y[r * O + o] = T(float(y[r * O + o]) + float(((const T*)bias)[o]));
}

template <typename T>
static int64_t run(const int64_t* fns, const int64_t* layers, const float* scales, int64_t L, const int64_t* dims,
                   float eps, float softcap, T* x, const void* cos, const void* sin, const int64_t* slots,
                   const int64_t* tables, const int64_t* ctx_lens, int64_t width, int64_t M, T* scratch) {
  const norm_fn norm = (norm_fn)fns[NORM];
  const rope_fn rope = (rope_fn)fns[ROPE];
  const attn_fn attn = (attn_fn)fns[ATTN];
  const act_fn act = (act_fn)fns[ACT];
  const int64_t hidden = dims[HIDDEN], H = dims[HEADS], KVH = dims[KV_HEADS], hd = dims[HEAD_DIM],
                inter = dims[INTER], bs = dims[BLOCK_SIZE], kind = dims[CACHE_KIND], gemv_rows = dims[GEMV_ROWS];
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

// fns [NUM_FNS], dims [NUM_DIMS], layers [L, LAYER_FIELDS], scales [L]. x [M, hidden] is the residual stream, updated
// in place; scratch holds M * (2 hidden + qkv + 2 q + 3 intermediate) values of x's dtype.
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
