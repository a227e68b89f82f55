// What every kernel starts with: the light ATen headers (at::parallel_for, c10::BFloat16; never <torch/extension.h>,
// whose compile alone took longer than all the kernels'), scalar bf16 stores, and prefetch for weight streams.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>


static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// fp32 back to the tensor's dtype, rounded to nearest even as `.to()` rounds
static inline void store(float* y, float v) { *y = v; }
static inline void store(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }

// A weight stream read once (a GEMV's rows) asks for the line STREAM_AHEAD bytes on: Intel's hardware prefetchers
// alone left a bf16 GEMV well short of a plain read of the same bytes (benchmarks/results/
// cpu-throughput-qwen05-bf16-intel-before-prefetch.log, cpu-kernel-figures-from-comments.log).
constexpr int STREAM_AHEAD = 4096;
template <int AHEAD = STREAM_AHEAD>
static inline void prefetch_stream(const void* p) { _mm_prefetch((const char*)p + AHEAD, _MM_HINT_T0); }
// the same for a loop step that reads BYTES of the stream at p, `at` bytes into it: one request a cache line, so a
// step of less than a line asks on every 64th byte only
template <int64_t BYTES, int AHEAD = STREAM_AHEAD>
static inline void prefetch_span(const void* p, int64_t at) {
  if (BYTES >= 64) {
    for (int64_t b = 0; b < BYTES; b += 64) prefetch_stream<AHEAD>((const char*)p + b);
  } else if (at % 64 == 0) {
    prefetch_stream<AHEAD>(p);
  }
}
