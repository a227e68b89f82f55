// A decode step's whole decoder stack in one call: the same kernels the layers call (their entry points, reached
// through function pointers the Python side takes from their libraries once), layer after layer, over scratch
// buffers allocated once, with the residual adds rounded to the dtype as PyTorch rounds them. Needs no vector ISA of
// its own: it is built where the kernels it calls are.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "exports.h"

// the kernels' types, from their one declaration in exports.h
typedef decltype(&fulcrum_gemv_f32) gemv_fn;  // fulcrum_gemv_bf16's too
typedef decltype(&fulcrum_rms_norm) norm_fn;
typedef decltype(&fulcrum_rope_cache) rope_fn;
typedef decltype(&fulcrum_decode_attention) attn_fn;
typedef decltype(&fulcrum_silu_and_mul) act_fn;
typedef decltype(&fulcrum_qgemv_int4) qgemv_g_fn;        // fulcrum_qgemv_int8g's too: grouped (scale, offset, G)
typedef decltype(&fulcrum_qgemv_int4_vnni) qgemv_gv_fn;  // fulcrum_qgemv_int8g_vnni's too
typedef decltype(&fulcrum_qgemv_int8) qgemv_c_fn;        // per-channel int8 / fp8
typedef decltype(&fulcrum_qgemv_int8_vnni) qgemv_cv_fn;
typedef decltype(&fulcrum_qgemv_int5) qgemv_5_fn;
typedef decltype(&fulcrum_qgemv_int5_vnni) qgemv_5v_fn;
typedef decltype(&fulcrum_packed_linear) packed_fn;
// BLAS's sgemm (Fortran calling convention), the one torch's fp32 F.linear calls: for more rows than the GEMV takes
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// The three int64 arrays the Python side fills (cpu_decode_stack.py reads these enums from this file and fills each
// array by these names): the kernels' addresses, the model's dimensions, and one row of LAYER_FIELDS per layer.
enum Fn { GEMV, NORM, ROPE, ATTN, ACT, SGEMM, Q4, Q8G, Q8, Q4V, Q8GV, Q8V, Q5, Q5V, PACKED, SMALL, NUM_FNS };
// PACKED_ROWS: from this many rows a dense linear with a packed weight (the layer's *_P fields) takes PACKED,
// fulcrum's blocked matmul (blocked_linear.cpp) or oneDNN's prepacked one (packed_linear.cpp), as the weights are
// packed (both take the same arguments); 0: never. SMALL_MIN_ROWS .. SMALL_ROWS: a linear with a second copy in
// fulcrum's layout (the layer's *_S fields, cpu_prepack.pack_small) takes SMALL, the blocked matmul, first; 0: none
enum Dim { HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, CACHE_KIND, GEMV_ROWS, QUANT, VNNI_ROWS, LORA_RANK,
           PACKED_ROWS, SMALL_MIN_ROWS, SMALL_ROWS, NUM_DIMS };
// With dims[QUANT] set, each layer's weight fields (QKV_W, O_W, GU_W, DOWN_W) point to a descriptor of the linear's
// parts (a GGUF layer stacks tensors of several formats): {n, then per part PART_FIELDS values}, each part's rows
// following the previous part's in the output.
enum PartField { KIND, ROWS, W, SCALE, OFFSET, GROUP, HIGH, PART_FIELDS };
enum Kind { DENSE, INT4, INT8G, INT8, FP8, INT5, NUM_KINDS };
// With dims[LORA_RANK] R set, each linear's LoRA slots (layers/lora.py): A [slots, shards * R, in] and B transposed
// [slots, out, R], and the step's slot per row (-1: none) as an argument.
// QKV_P .. DOWN_P: the linears' packed weights as PACKED takes them (cpu_prepack.handle; 0: none); QKV_S .. DOWN_S:
// their copies in fulcrum's layout for few rows (SMALL_MIN_ROWS .. SMALL_ROWS), or 0
enum LayerField { IN_NORM, QKV_W, QKV_B, O_W, O_B, POST_NORM, GU_W, GU_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, K_SCALES,
                  V_SCALES, WINDOW, QKV_LA, QKV_LB, O_LA, O_LB, GU_LA, GU_LB, DOWN_LA, DOWN_LB, QKV_P, O_P, GU_P,
                  DOWN_P, QKV_S, O_S, GU_S, DOWN_S, LAYER_FIELDS };

// Where the step's time goes inside the stack, when fulcrum_decode_stack_timers turns its clocks on
// (benchmarks/bench_step_breakdown.py): seconds by kind of call, summed over layers and steps. Off, a lap is one test
// of a flag. The stack runs on one thread at a time (the engine's); the kernels it calls spread over torch's threads.
enum Phase { T_NORM, T_QKV, T_ROPE, T_ATTN, T_O, T_GATE_UP, T_ACT, T_DOWN, T_OTHER, NUM_PHASES };
static bool timing = false;
static double phase_seconds[NUM_PHASES];
struct Clock {
  std::chrono::steady_clock::time_point t = timing ? std::chrono::steady_clock::now() : decltype(t)();
  void lap(Phase p) {
    if (!timing) return;
    const auto now = std::chrono::steady_clock::now();
    phase_seconds[p] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

// x += t, rounded to T as PyTorch's add rounds (fp32 arithmetic, one rounding)
template <typename T>
static void add_into(T* x, const T* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = T(float(x[i]) + float(t[i]));
}

// y [M, O] = x [M, I] @ w [O, I]^T + bias: the small copy from `small_min` to `small_max` rows where the layer has
// one, the packed weight from `packed_rows` rows where it has one, else the GEMV kernel up to `gemv_rows` rows and
// BLAS's sgemm past them (fp32). False where the packed call failed.
template <typename T>
static bool linear(const int64_t* fns, int64_t gemv_rows, const T* x, const void* w, const void* bias, T* y,
                   int64_t M, int64_t I, int64_t O, const void* packed = nullptr, int64_t packed_rows = 0,
                   const void* small = nullptr, int64_t small_min = 0, int64_t small_max = 0) {
  if (small && M >= small_min && M <= small_max)
    return ((packed_fn)fns[SMALL])(sizeof(T) == 2, x, small, bias, y, M, I, O) == 0;
  if (packed && packed_rows && M >= packed_rows)
    return ((packed_fn)fns[PACKED])(sizeof(T) == 2, x, packed, bias, y, M, I, O) == 0;
  if (M <= gemv_rows || sizeof(T) != 4) return ((gemv_fn)fns[GEMV])(x, w, bias, y, M, I, O), true;
  const int m = int(O), n = int(M), k = int(I);
  const float one = 1.f, zero = 0.f;
  // row-major y^T = w x^T is column-major y: w read as the transpose of a column-major [I, O]
  ((sgemm_fn)fns[SGEMM])("T", "N", &m, &n, &k, &one, (const float*)w, &k, (const float*)x, &k, &zero, (float*)y, &m);
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t o = 0; o < O; ++o) y[r * O + o] = T(float(y[r * O + o]) + float(((const T*)bias)[o]));
  return true;
}

// One part of a quantized layer: the integer-dot (VNNI) kernel for bf16 rows where it takes them, else the widening
// GEMV (its row limit is the Python side's: the stack runs no more rows than every part takes)
template <typename T>
static void part(const int64_t* fns, const int64_t* dims, const int64_t* d, const T* x, const void* bias, T* y,
                 int64_t M, int64_t I) {
  const int64_t bf16 = sizeof(T) == 2, rows = d[ROWS], G = d[GROUP];
  const void *w = (const void*)d[W], *s = (const void*)d[SCALE], *off = (const void*)d[OFFSET];
  const bool vnni = bf16 && M <= dims[VNNI_ROWS] && I % 64 == 0;
  switch (d[KIND]) {
    case DENSE: linear(fns, dims[GEMV_ROWS], x, w, bias, y, M, I, rows); return;
    case INT4:
      if (vnni && fns[Q4V]) return ((qgemv_gv_fn)fns[Q4V])(x, w, s, off, bias, y, M, I, rows, G);
      return ((qgemv_g_fn)fns[Q4])(bf16, x, w, s, off, bias, y, M, I, rows, G);
    case INT8G:
      if (vnni && fns[Q8GV]) return ((qgemv_gv_fn)fns[Q8GV])(x, w, s, off, bias, y, M, I, rows, G);
      return ((qgemv_g_fn)fns[Q8G])(bf16, x, w, s, off, bias, y, M, I, rows, G);
    case INT5: {
      const void* high = (const void*)d[HIGH];
      if (vnni && fns[Q5V]) return ((qgemv_5v_fn)fns[Q5V])(x, w, high, s, off, bias, y, M, I, rows);
      return ((qgemv_5_fn)fns[Q5])(bf16, x, w, high, s, off, bias, y, M, I, rows);
    }
    default:
      if (d[KIND] == INT8 && vnni && fns[Q8V]) return ((qgemv_cv_fn)fns[Q8V])(x, w, s, bias, y, M, I, rows);
      return ((qgemv_c_fn)fns[Q8])(bf16, d[KIND] == FP8, x, w, s, bias, y, M, I, rows);
  }
}

// y [M, O] = x [M, I] @ W^T + bias over a descriptor's parts: one part writes y itself; several write `tmp` in turn,
// copied into their columns of y, the bias added after
template <typename T>
static void qlinear(const int64_t* fns, const int64_t* dims, const T* x, const int64_t* desc, const void* bias, T* y,
                    int64_t M, int64_t I, int64_t O, T* tmp) {
  const int64_t n = desc[0];
  if (n == 1) return part(fns, dims, desc + 1, x, bias, y, M, I);
  int64_t col = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t* d = desc + 1 + p * PART_FIELDS;
    part(fns, dims, d, x, (const void*)nullptr, tmp, M, I);
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * O + col, tmp + m * d[ROWS], d[ROWS] * sizeof(T));
    col += d[ROWS];
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < O; ++o) y[m * O + o] = T(float(y[m * O + o]) + float(((const T*)bias)[o]));
}

// y [M, O] += each row's LoRA delta: xa = A_slot x (the GEMV over A's shards * R rows), then per output shard
// y += B_shard xa_shard (the GEMV over that shard's rows of B transposed); rows without an adapter are left alone
template <typename T>
static void lora_add(const int64_t* fns, const T* x, T* y, int64_t M, int64_t I, int64_t O, const int64_t* sizes,
                     int64_t S, int64_t R, const void* A, const void* Bt, const int64_t* row_slot, T* xa, T* t) {
  if (!row_slot || !A || !R) return;
  const gemv_fn gemv = (gemv_fn)fns[GEMV];
  for (int64_t m = 0; m < M; ++m) {
    const int64_t s = row_slot[m];
    if (s < 0) continue;
    gemv(x + m * I, (const T*)A + s * S * R * I, nullptr, xa, 1, I, S * R);
    int64_t off = 0;
    for (int64_t i = 0; i < S; ++i) {
      gemv(xa + i * R, (const T*)Bt + (s * O + off) * R, nullptr, t, 1, R, sizes[i]);
      add_into(y + m * O + off, t, sizes[i]);
      off += sizes[i];
    }
  }
}

template <typename T>
static int64_t run(const int64_t* fns, const int64_t* layers, const float* scales, int64_t L, const int64_t* dims,
                   float eps, float softcap, T* x, const void* cos, const void* sin, const int64_t* slots,
                   const int64_t* tables, const int64_t* ctx_lens, int64_t width, int64_t M, T* scratch,
                   const int64_t* lora_slots) {
  const norm_fn norm = (norm_fn)fns[NORM];
  const rope_fn rope = (rope_fn)fns[ROPE];
  const attn_fn attn = (attn_fn)fns[ATTN];
  const act_fn act = (act_fn)fns[ACT];
  const int64_t hidden = dims[HIDDEN], H = dims[HEADS], KVH = dims[KV_HEADS], hd = dims[HEAD_DIM],
                inter = dims[INTER], bs = dims[BLOCK_SIZE], kind = dims[CACHE_KIND], gemv_rows = dims[GEMV_ROWS];
  const int64_t qkv_rows = (H + 2 * KVH) * hd;
  T* tmp = scratch + M * (2 * hidden + qkv_rows + 2 * H * hd + 3 * inter);  // M * (qkv | 2 inter | hidden) more
  // LoRA's buffers after those: one row's xa (3 R) and one shard's delta (up to 2 inter, qkv or hidden)
  T* lora_xa = tmp + (dims[QUANT] ? M * std::max(qkv_rows, std::max(2 * inter, hidden)) : 0);
  T* lora_t = lora_xa + 3 * dims[LORA_RANK];
  const int64_t R = dims[LORA_RANK];
  bool failed = false;  // a packed call that threw: the step fails as a whole (-2), after its layers ran
  auto gemv = [&](const T* in, const void* w, const void* b, T* out, int64_t M, int64_t I, int64_t O,
                  const void* packed, const void* small) {
    if (dims[QUANT]) return qlinear(fns, dims, in, (const int64_t*)w, b, out, M, I, O, tmp);
    failed |= !linear(fns, gemv_rows, in, w, b, out, M, I, O, packed, dims[PACKED_ROWS], small, dims[SMALL_MIN_ROWS],
                      dims[SMALL_ROWS]);
  };
  const int64_t bf16 = sizeof(T) == 2;
  const int64_t qs = H * hd, kvs = KVH * hd, qkv_n = qs + 2 * kvs;
  const int64_t qkv_sizes[3] = {qs, kvs, kvs}, gu_sizes[2] = {inter, inter}, o_sizes[1] = {hidden};
  // scratch: h [M, hidden], qkv [M, qkv_n], q [M, qs], o [M, qs], t [M, hidden], gu [M, 2 inter], a [M, inter]
  T* h = scratch;
  T* qkv = h + M * hidden;
  T* q = qkv + M * qkv_n;
  T* o = q + M * qs;
  T* t = o + M * qs;
  T* gu = t + M * hidden;
  T* a = gu + M * 2 * inter;
  Clock clock;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* p = layers + l * LAYER_FIELDS;
    auto ptr = [&](int f) { return (void*)p[f]; };
    norm(bf16, x, ptr(IN_NORM), h, M, hidden, eps);
    clock.lap(T_NORM);
    gemv(h, ptr(QKV_W), ptr(QKV_B), qkv, M, hidden, qkv_n, ptr(QKV_P), ptr(QKV_S));
    lora_add(fns, h, qkv, M, hidden, qkv_n, qkv_sizes, 3, R, ptr(QKV_LA), ptr(QKV_LB), lora_slots, lora_xa, lora_t);
    clock.lap(T_QKV);
    rope(bf16, qkv, qkv + qs, qkv + qs + kvs, cos, sin, slots, ptr(K_CACHE), ptr(V_CACHE), ptr(K_SCALES),
         ptr(V_SCALES), kind, M, H, KVH, hd, qkv_n, qkv_n, qkv_n);
    clock.lap(T_ROPE);
    const T* qc = qkv;  // one row's q is already contiguous; more rows are copied out of the fused qkv rows
    if (M > 1) {
      for (int64_t m = 0; m < M; ++m) std::memcpy(q + m * qs, qkv + m * qkv_n, qs * sizeof(T));
      qc = q;
    }
    clock.lap(T_OTHER);
    if (attn(bf16, kind, qc, ptr(K_CACHE), ptr(V_CACHE), ptr(K_SCALES), ptr(V_SCALES), tables, ctx_lens, o, M, H,
             KVH, hd, bs, width, scales[l], p[WINDOW], softcap, nullptr) != 0)
      return -1;
    clock.lap(T_ATTN);
    gemv(o, ptr(O_W), ptr(O_B), t, M, qs, hidden, ptr(O_P), ptr(O_S));
    lora_add(fns, o, t, M, qs, hidden, o_sizes, 1, R, ptr(O_LA), ptr(O_LB), lora_slots, lora_xa, lora_t);
    clock.lap(T_O);
    add_into(x, t, M * hidden);
    clock.lap(T_OTHER);
    norm(bf16, x, ptr(POST_NORM), h, M, hidden, eps);
    clock.lap(T_NORM);
    gemv(h, ptr(GU_W), ptr(GU_B), gu, M, hidden, 2 * inter, ptr(GU_P), ptr(GU_S));
    lora_add(fns, h, gu, M, hidden, 2 * inter, gu_sizes, 2, R, ptr(GU_LA), ptr(GU_LB), lora_slots, lora_xa, lora_t);
    clock.lap(T_GATE_UP);
    act(bf16, gu, a, M, inter, 2 * inter);
    clock.lap(T_ACT);
    gemv(a, ptr(DOWN_W), ptr(DOWN_B), t, M, inter, hidden, ptr(DOWN_P), ptr(DOWN_S));
    lora_add(fns, a, t, M, inter, hidden, o_sizes, 1, R, ptr(DOWN_LA), ptr(DOWN_LB), lora_slots, lora_xa, lora_t);
    clock.lap(T_DOWN);
    add_into(x, t, M * hidden);
    clock.lap(T_OTHER);
    if (failed) return -2;
  }
  return 0;
}

// fns [NUM_FNS], dims [NUM_DIMS], layers [L, LAYER_FIELDS], scales [L]. x [M, hidden] is the residual stream, updated
// in place; scratch holds M * (2 hidden + qkv + 2 q + 3 intermediate) values of x's dtype, with dims[QUANT]
// M * max(qkv, 2 intermediate, hidden) more, and with dims[LORA_RANK] R 3 R + max(qkv, 2 intermediate, hidden) more.
// lora_slots [M]: each row's LoRA slot (-1: none), or null. Returns 0; -1 for an unsupported head_dim, -2 where a
// packed linear failed.
extern "C" int64_t fulcrum_decode_stack(int64_t bf16, const int64_t* fns, const int64_t* layers, const float* scales,
                                        int64_t L, const int64_t* dims, float eps, float softcap, void* x,
                                        const void* cos, const void* sin, const int64_t* slots, const int64_t* tables,
                                        const int64_t* ctx_lens, int64_t width, int64_t M, void* scratch,
                                        const int64_t* lora_slots) {
  if (bf16)
    return run(fns, layers, scales, L, dims, eps, softcap, (c10::BFloat16*)x, cos, sin, slots, tables, ctx_lens,
               width, M, (c10::BFloat16*)scratch, lora_slots);
  return run(fns, layers, scales, L, dims, eps, softcap, (float*)x, cos, sin, slots, tables, ctx_lens, width, M,
             (float*)scratch, lora_slots);
}

// Turns the stack's clocks on (on != 0) or off, and moves their sums since the last call into out [NUM_PHASES] (by
// the Phase enum), or drops them (out null); returns NUM_PHASES.
extern "C" int64_t fulcrum_decode_stack_timers(int64_t on, double* out) {
  for (int i = 0; i < NUM_PHASES; ++i) {
    if (out) out[i] = phase_seconds[i];
    phase_seconds[i] = 0;
  }
  timing = on != 0;
  return NUM_PHASES;
}
