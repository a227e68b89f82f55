// Every entry point of fulcrum's C++ kernels, declared once. Each kernel's .cpp includes this header, so the compiler
// checks its definitions against these lines (a C function declared twice differently does not compile); the Python
// loaders' ctypes bindings are checked against them at load (cpu_ext.exports), and the decode stack takes its
// function-pointer types from them (decltype). cpu_ext reads this file with a strict parser: one declaration a
// statement, `ret name(type name, ...);`, of the types int64_t, float, double and pointers (passed from Python as ints).
#pragma once

#include <cstdint>

extern "C" {
// act.cpp
void fulcrum_silu_and_mul(int64_t bf16, const void* x, void* y, int64_t rows, int64_t n, int64_t xs);

// argmax.cpp
void fulcrum_argmax(int64_t bf16, const void* x, int64_t* out, int64_t rows, int64_t n, int64_t stride);

// norm.cpp
void fulcrum_rms_norm(int64_t bf16, const void* x, const void* w, void* y, int64_t rows, int64_t n, float eps);

// rope.cpp
void fulcrum_rope_cache(int64_t bf16, void* q, void* k, const void* v, const void* cos, const void* sin,
                        const void* slots, void* kc, void* vc, void* ksc, void* vsc, int64_t kind, int64_t ntok,
                        int64_t H, int64_t KVH, int64_t D, int64_t qs, int64_t ks, int64_t vs);

// decode_attention.cpp
int64_t fulcrum_decode_attention(int64_t bf16, int64_t kind, const void* q, const void* k_cache, const void* v_cache,
                                 const void* k_scales, const void* v_scales, const int64_t* tables,
                                 const int64_t* ctx_lens, void* out, int64_t D, int64_t H, int64_t KVH, int64_t hd,
                                 int64_t bs, int64_t width, float scale, int64_t window, float softcap,
                                 const float* sinks);

// prefill_attention.cpp
int64_t fulcrum_prefill_attention(int64_t bf16, const void* q, const void* k, const void* v, void* out, int64_t n,
                                  int64_t m, int64_t H, int64_t KVH, int64_t hd, int64_t qs, int64_t ks, int64_t vs,
                                  int64_t os, float scale, int64_t window, const float* sinks);
int64_t fulcrum_prefill_attention_varlen(int64_t bf16, const void* q, const void* k, const void* v, void* out,
                                         const int64_t* q0, const int64_t* n, const int64_t* k0, const int64_t* m,
                                         int64_t S, int64_t H, int64_t KVH, int64_t hd, int64_t qs, int64_t ks,
                                         int64_t vs, int64_t os, float scale, int64_t window, const float* sinks);

// packed_linear.cpp
int64_t fulcrum_packed_linear(int64_t bf16, const void* x, const void* packed, const void* bias, void* y, int64_t M,
                              int64_t I, int64_t O);

// blocked_linear.cpp
int64_t fulcrum_blocked_linear(int64_t bf16, const void* x, const void* w, const void* bias, void* y, int64_t M,
                               int64_t I, int64_t O);

// gemv.cpp
void fulcrum_gemv_bf16(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t I, int64_t O);
void fulcrum_gemv_f32(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t I, int64_t O);
int64_t fulcrum_parallel_threads();

// qgemv.cpp
void fulcrum_qgemv_int8(int64_t bf16, int64_t fp8, const void* x, const void* w, const void* scale, const void* bias,
                        void* y, int64_t M, int64_t I, int64_t O);
void fulcrum_qgemv_int4(int64_t bf16, const void* x, const void* w, const void* scale, const void* offset,
                        const void* bias, void* y, int64_t M, int64_t I, int64_t O, int64_t G);
void fulcrum_dequant_int8(int64_t bf16, int64_t fp8, const void* w, const void* scale, void* out, int64_t O,
                          int64_t I);
void fulcrum_dequant_int4(int64_t bf16, const void* w, const void* scale, const void* offset, void* out, int64_t O,
                          int64_t I, int64_t G);

void fulcrum_qgemv_int8g(int64_t bf16, const void* x, const void* w, const void* scale, const void* offset,
                         const void* bias, void* y, int64_t M, int64_t I, int64_t O, int64_t G);
void fulcrum_dequant_int8g(int64_t bf16, const void* w, const void* scale, const void* offset, void* out, int64_t O,
                           int64_t I, int64_t G);
void fulcrum_qgemv_fp8g(int64_t bf16, const void* x, const void* w, const void* scale, const void* bias, void* y,
                        int64_t M, int64_t I, int64_t O, int64_t G);
void fulcrum_dequant_fp8g(int64_t bf16, const void* w, const void* scale, void* out, int64_t O, int64_t I, int64_t G);
void fulcrum_qgemv_int5(int64_t bf16, const void* x, const void* w, const void* high, const void* scale,
                        const void* offset, const void* bias, void* y, int64_t M, int64_t I, int64_t O);
void fulcrum_dequant_int5(int64_t bf16, const void* w, const void* high, const void* scale, const void* offset,
                          void* out, int64_t O, int64_t I);

// mxfp4.cpp
void fulcrum_qgemv_mxfp4(int64_t bf16, const void* x, const void* blocks, const void* scales, const void* bias,
                         void* y, int64_t M, int64_t I, int64_t O);
void fulcrum_dequant_mxfp4(int64_t bf16, const void* blocks, const void* scales, void* out, int64_t O, int64_t I);

// qgemv_vnni.cpp
void fulcrum_qgemv_int8_vnni(const void* x, const void* w, const void* scale, const void* bias, void* y, int64_t M,
                             int64_t I, int64_t O);
void fulcrum_qgemv_int4_vnni(const void* x, const void* w, const void* scale, const void* offset, const void* bias,
                             void* y, int64_t M, int64_t I, int64_t O, int64_t G);
void fulcrum_qgemv_int8g_vnni(const void* x, const void* w, const void* scale, const void* offset, const void* bias,
                              void* y, int64_t M, int64_t I, int64_t O, int64_t G);
void fulcrum_qgemv_int5_vnni(const void* x, const void* w, const void* high, const void* scale, const void* offset,
                             const void* bias, void* y, int64_t M, int64_t I, int64_t O);

// decode_stack.cpp
int64_t fulcrum_decode_stack(int64_t bf16, const int64_t* fns, const int64_t* layers, const float* scales, int64_t L,
                             const int64_t* dims, float eps, float softcap, void* x, const void* cos, const void* sin,
                             const int64_t* slots, const int64_t* tables, const int64_t* ctx_lens, int64_t width,
                             int64_t M, void* scratch, const int64_t* lora_slots);
int64_t fulcrum_decode_stack_timers(int64_t on, double* out);

// cpu_threads.cpp (fulcrum.runtime.cpu_threads)
int64_t fulcrum_bind_threads(const int64_t* cpus, int64_t n);
void fulcrum_thread_cpus(int64_t* out, int64_t n);
}
