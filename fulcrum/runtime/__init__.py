"""CPU process setup for the engine: compute threads and where they run (cpu_threads), malloc's thresholds
(cpu_malloc), huge-page memory for weights and KV cache (hugepages). Runtime, not kernels: it sits above kernels/,
whose build compiles its one native helper."""
