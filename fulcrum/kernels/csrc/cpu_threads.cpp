// Thread placement for fulcrum.runtime.cpu_threads: sched_setaffinity from inside an OpenMP region, once on every
// thread of the pool torch's ops and fulcrum's kernels share. Needs no vector ISA (built at level "none").
#include <omp.h>
#include <sched.h>

#include <cstdint>

#include "exports.h"

// Pins OpenMP thread i of a team of n to cpus[i]; the pool keeps its threads, so later parallel regions of the
// same size (torch's ops, fulcrum's kernels) run on the same pinned threads. Returns how many pins failed.
extern "C" int64_t fulcrum_bind_threads(const int64_t* cpus, int64_t n) {
  int64_t failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[omp_get_thread_num()], &set);
    failed += sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  return failed;
}

// The core each thread of a team of n runs on now, written to out[0..n)
extern "C" void fulcrum_thread_cpus(int64_t* out, int64_t n) {
#pragma omp parallel num_threads(n)
  out[omp_get_thread_num()] = sched_getcpu();
}
